// The host collectives' arithmetic (arithmetic.h): f32, f64, s32, s64 in their own type, bf16
// through f32 with one round-to-nearest-even per element; max/min propagate NaN like
// jnp.maximum/minimum, whatever the argument order.
#include "csrc/transport/arithmetic.h"

#include <cmath>
#include <cstring>
#include <string>

namespace dtenjax::transport {

namespace {

template <typename T>
T Apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kMin: return a < b ? a : b;
  }
  return a;
}

template <typename T>
void ReduceT(T* out, const T* own, const T* in, uint64_t n, ReduceOp op) {
  switch (op) {  // one loop per op so the compiler vectorises the common sum
    case ReduceOp::kSum: for (uint64_t i = 0; i < n; ++i) out[i] = own[i] + in[i]; break;
    case ReduceOp::kProd: for (uint64_t i = 0; i < n; ++i) out[i] = own[i] * in[i]; break;
    default: for (uint64_t i = 0; i < n; ++i) out[i] = Apply(own[i], in[i], op); break;
  }
}

template <typename T>
void ReduceFloat(T* out, const T* own, const T* in, uint64_t n, ReduceOp op) {
  // max/min propagate NaN whatever the argument order, like jnp.maximum/minimum.
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
    for (uint64_t i = 0; i < n; ++i) {
      T a = own[i], b = in[i];
      out[i] = std::isnan(a) ? a : std::isnan(b) ? b : Apply(a, b, op);
    }
    return;
  }
  ReduceT(out, own, in, n, op);
}

float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

}  // namespace

Status Reduce(void* out, const void* own, const void* in, uint64_t n, DType dt, ReduceOp op) {
  if (!IsReduceOp(int(op))) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported reduction code " + std::to_string(int(op)));
  }
  switch (dt) {
    case DType::kF32:
      ReduceFloat(static_cast<float*>(out), static_cast<const float*>(own),
                  static_cast<const float*>(in), n, op);
      break;
    case DType::kF64:
      ReduceFloat(static_cast<double*>(out), static_cast<const double*>(own),
                  static_cast<const double*>(in), n, op);
      break;
    case DType::kS32:
      ReduceT(static_cast<int32_t*>(out), static_cast<const int32_t*>(own),
              static_cast<const int32_t*>(in), n, op);
      break;
    case DType::kS64:
      ReduceT(static_cast<int64_t*>(out), static_cast<const int64_t*>(own),
              static_cast<const int64_t*>(in), n, op);
      break;
    case DType::kBF16: {
      auto* o = static_cast<uint16_t*>(out);
      auto* a = static_cast<const uint16_t*>(own);
      auto* b = static_cast<const uint16_t*>(in);
      for (uint64_t i = 0; i < n; ++i) {
        float x = Bf16ToF32(a[i]), y = Bf16ToF32(b[i]);
        float r = (op == ReduceOp::kMax || op == ReduceOp::kMin) && (std::isnan(x) || std::isnan(y))
                      ? (std::isnan(x) ? x : y)
                      : Apply(x, y, op);
        o[i] = F32ToBf16(r);
      }
      break;
    }
    default:
      return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported dtype code " + std::to_string(int(dt)));
  }
  return Status::Ok();
}

}  // namespace dtenjax::transport
