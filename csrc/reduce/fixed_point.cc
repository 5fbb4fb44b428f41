#include "csrc/reduce/fixed_point.h"

#include <cmath>
#include <cstring>
#include <limits>

// The f32 sequences below must not be contracted into FMAs (the jnp formulation rounds each step).
#pragma STDC FP_CONTRACT OFF

namespace dtenjax::fixed_point {
namespace {

inline float Bf16ToF32(uint16_t bits) {
  uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  if (std::isnan(f)) return static_cast<uint16_t>((w >> 16) | 0x40);
  uint32_t rounding = 0x7FFF + ((w >> 16) & 1);
  return static_cast<uint16_t>((w + rounding) >> 16);
}

inline float Pow2(int k) { return std::ldexp(1.0f, k); }  // exact for k in [-149, 127]

// x * 2^s with a single rounding (see the header); s in [kFracBits - 128, kFracBits - kExpZero].
inline float ScaleUp(float x, int s) {
  if (s <= 127) return x * Pow2(s);
  float y = x * Pow2(127);
  return y * Pow2(s - 127);
}

// v * 2^t where v is an integer-valued float; the first step is exact, the second rounds once.
inline float ScaleDown(float v, int t) {
  int t1 = t < -100 ? -100 : t;
  float y = v * Pow2(t1);
  return y * Pow2(t - t1);
}

inline void AnalyzeOne(float x, int32_t* e, int32_t* pinf, int32_t* ninf) {
  *pinf = 0;
  *ninf = 0;
  if (std::isnan(x)) {
    *pinf = *ninf = 1;
    *e = kExpZero;
  } else if (std::isinf(x)) {
    (x > 0 ? *pinf : *ninf) = 1;
    *e = kExpZero;
  } else if (x == 0.0f) {
    *e = kExpZero;
  } else {
    int ex;
    std::frexp(x, &ex);
    *e = ex;
  }
}

inline void EncodeOne(float x, int32_t e_max, int32_t* hi, int32_t* lo) {
  if (!std::isfinite(x) || e_max == kExpZero) {
    *hi = *lo = 0;
    return;
  }
  float q = std::nearbyint(ScaleUp(x, kFracBits - e_max));  // |q| <= 2^kFracBits
  float h = std::floor(q * Pow2(-kLoBits));
  float l = q - h * Pow2(kLoBits);
  *hi = static_cast<int32_t>(h);
  *lo = static_cast<int32_t>(l);
}

inline float DecodeOne(int32_t hi, int32_t lo, int32_t e_max, int32_t pinf, int32_t ninf) {
  if (pinf && ninf) return std::numeric_limits<float>::quiet_NaN();
  if (pinf) return std::numeric_limits<float>::infinity();
  if (ninf) return -std::numeric_limits<float>::infinity();
  int32_t h = hi + (lo >> kLoBits);  // arithmetic shift: floor division
  int32_t l = lo & ((1 << kLoBits) - 1);
  float v = static_cast<float>(h) * Pow2(kLoBits) + static_cast<float>(l);
  return ScaleDown(v, e_max - kFracBits);
}

template <typename Load>
void AnalyzeImpl(Load load, int64_t n, int32_t* meta) {
  for (int64_t i = 0; i < n; ++i) AnalyzeOne(load(i), &meta[i], &meta[n + i], &meta[2 * n + i]);
}

template <typename Load>
void EncodeImpl(Load load, const int32_t* e_max, int64_t n, int32_t* words) {
  for (int64_t i = 0; i < n; ++i) EncodeOne(load(i), e_max[i], &words[i], &words[n + i]);
}

}  // namespace

void Analyze(const float* x, int64_t n, int32_t* meta) {
  AnalyzeImpl([x](int64_t i) { return x[i]; }, n, meta);
}
void Analyze(const uint16_t* x, int64_t n, int32_t* meta) {
  AnalyzeImpl([x](int64_t i) { return Bf16ToF32(x[i]); }, n, meta);
}
void Encode(const float* x, const int32_t* e_max, int64_t n, int32_t* words) {
  EncodeImpl([x](int64_t i) { return x[i]; }, e_max, n, words);
}
void Encode(const uint16_t* x, const int32_t* e_max, int64_t n, int32_t* words) {
  EncodeImpl([x](int64_t i) { return Bf16ToF32(x[i]); }, e_max, n, words);
}
void Decode(const int32_t* words, const int32_t* meta, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = DecodeOne(words[i], words[n + i], meta[i], meta[n + i], meta[2 * n + i]);
  }
}
void Decode(const int32_t* words, const int32_t* meta, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = F32ToBf16(DecodeOne(words[i], words[n + i], meta[i], meta[n + i], meta[2 * n + i]));
  }
}

}  // namespace dtenjax::fixed_point
