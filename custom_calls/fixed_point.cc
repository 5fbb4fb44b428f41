// CPU FFI handlers for the reproducible all-reduce's fixed-point passes (csrc/reduce/fixed_point.h).
//   dtenjax_fp_analyze(x: f32|bf16[...])                    -> int32[3, ...]   (exponent, +inf, -inf)
//   dtenjax_fp_encode(x: f32|bf16[...], e_max: int32[...])  -> int32[2, ...]   (hi, lo)
//   dtenjax_fp_decode(words: int32[2, ...], meta: int32[3, ...]) -> f32|bf16[...]
#include <cstdint>

#include "csrc/reduce/fixed_point.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace fp = dtenjax::fixed_point;

namespace {

ffi::Error Analyze(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::S32>> meta) {
  const int64_t n = x.element_count();
  if (meta->element_count() != 3 * n) {
    return ffi::Error::InvalidArgument("dtenjax_fp_analyze: output must hold 3 x input elements");
  }
  switch (x.element_type()) {
    case ffi::F32: fp::Analyze(x.typed_data<float>(), n, meta->typed_data()); break;
    case ffi::BF16:
      fp::Analyze(reinterpret_cast<const uint16_t*>(x.untyped_data()), n, meta->typed_data());
      break;
    default:
      return ffi::Error::InvalidArgument("dtenjax_fp_analyze supports float32 and bfloat16 only");
  }
  return ffi::Error::Success();
}

ffi::Error Encode(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> e_max,
                  ffi::Result<ffi::Buffer<ffi::S32>> words) {
  const int64_t n = x.element_count();
  if (e_max.element_count() != n || words->element_count() != 2 * n) {
    return ffi::Error::InvalidArgument("dtenjax_fp_encode: shapes of x, e_max and words disagree");
  }
  switch (x.element_type()) {
    case ffi::F32: fp::Encode(x.typed_data<float>(), e_max.typed_data(), n, words->typed_data()); break;
    case ffi::BF16:
      fp::Encode(reinterpret_cast<const uint16_t*>(x.untyped_data()), e_max.typed_data(), n,
                 words->typed_data());
      break;
    default:
      return ffi::Error::InvalidArgument("dtenjax_fp_encode supports float32 and bfloat16 only");
  }
  return ffi::Error::Success();
}

ffi::Error Decode(ffi::Buffer<ffi::S32> words, ffi::Buffer<ffi::S32> meta,
                  ffi::Result<ffi::AnyBuffer> out) {
  const int64_t n = out->element_count();
  if (words.element_count() != 2 * n || meta.element_count() != 3 * n) {
    return ffi::Error::InvalidArgument("dtenjax_fp_decode: shapes of words, meta and out disagree");
  }
  switch (out->element_type()) {
    case ffi::F32: fp::Decode(words.typed_data(), meta.typed_data(), n, out->typed_data<float>()); break;
    case ffi::BF16:
      fp::Decode(words.typed_data(), meta.typed_data(), n,
                 reinterpret_cast<uint16_t*>(out->untyped_data()));
      break;
    default:
      return ffi::Error::InvalidArgument("dtenjax_fp_decode supports float32 and bfloat16 only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FpAnalyze, Analyze,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FpEncode, Encode,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FpDecode, Decode,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

DTENJAX_REGISTER_FFI("dtenjax_fp_analyze", "cpu", FpAnalyze);
DTENJAX_REGISTER_FFI("dtenjax_fp_encode", "cpu", FpEncode);
DTENJAX_REGISTER_FFI("dtenjax_fp_decode", "cpu", FpDecode);
