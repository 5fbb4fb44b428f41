// Contract v3 of the reproducible sum (docs/collectives.md, dtenjax/_src/collectives/
// fixed_point_v3.py) for the W values of one element, as the NVLink kernels compute it in
// registers. Host and device code: the kernels include it through allreduce.cuh, and
// tests/test_p2p.py compiles it for the host and compares it with the numpy reference, so the
// arithmetic is checked on machines without a GPU. No XLA, no CUDA runtime.
//
// Per element, for W >= 3: the largest magnitude (an integer maximum of the bits) gives the code
// c; a NaN or an infinity decides the result by the rule of contract v2; otherwise every value
// becomes one int32 word q = round(x * 2^s) (to nearest even), s = P + 126 - c, P = 31 -
// ceil(log2 W): the product of x and two normal powers of two is exact under IEEE arithmetic (no
// flush-to-zero; a product below the subnormal grid is far below 1/2). The int32 sum is rounded
// once to the output: float32 by the int -> float conversion times an exact power of two,
// bfloat16 by round-to-odd at 24 bits followed by the caller's RNE conversion to bfloat16 (one
// rounding in effect), and by RoundScaled on the bits whenever the result could be subnormal.
// For W == 2 the contract's words (rounded to odd) give the correctly rounded sum, which RepSum2
// computes with one float addition.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// Host builds of x86 (not nvcc's) convert with SSE, where nearbyint would be a library call.
#if !defined(__CUDACC__) && (defined(__SSE2__) || defined(__x86_64__))
#include <xmmintrin.h>
#define DTENJAX_HOST_SSE 1
#else
#define DTENJAX_HOST_SSE 0
#endif

#if defined(__CUDACC__)
#define DTENJAX_HD __host__ __device__ __forceinline__
#define DTENJAX_UNROLL _Pragma("unroll")
#else
#define DTENJAX_HD inline
#define DTENJAX_UNROLL
#endif

namespace dtenjax::p2p::v3 {

constexpr uint32_t kQuietNan = 0x7fc00000u;

constexpr int CeilLog2(int n) { return n <= 1 ? 0 : 1 + CeilLog2((n + 1) / 2); }

// --- the few operations whose host and device spellings differ --------------------------------

DTENJAX_HD uint32_t Bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}

DTENJAX_HD float FromBits(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

DTENJAX_HD float MulRn(float a, float b) {   // one IEEE product, never fused
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

DTENJAX_HD float AddRn(float a, float b) {  // one IEEE addition
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

DTENJAX_HD float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

DTENJAX_HD int32_t FloatToIntRn(float y) {  // |y| < 2^31, round to nearest even
#if defined(__CUDA_ARCH__)
  return __float2int_rn(y);
#elif DTENJAX_HOST_SSE
  return _mm_cvtss_si32(_mm_set_ss(y));   // one instruction, in the default rounding mode (the
                                          // host callers keep it: nearest even)
#else
  return static_cast<int32_t>(std::nearbyint(y));   // the default rounding mode
#endif
}

DTENJAX_HD float IntToFloatRn(int32_t q) {
#if defined(__CUDA_ARCH__)
  return __int2float_rn(q);
#else
  return static_cast<float>(q);
#endif
}

DTENJAX_HD int Clz(uint32_t a) {  // a != 0
#if defined(__CUDA_ARCH__)
  return __clz(a);
#else
  return __builtin_clz(a);
#endif
}

// 2^k for k in [-126, 127], from the bits.
DTENJAX_HD float Pow2(int k) { return FromBits(static_cast<uint32_t>(k + 127) << 23); }

// --- the contract ------------------------------------------------------------------------------

// Bits of RNE(q * 2^t) in a format of p significant bits and float32's exponent range (p = 24:
// float32, p = 8: bfloat16 in the low 16 bits): one rounding, subnormals kept, overflow to inf.
DTENJAX_HD uint32_t RoundScaled(int32_t q, int t, int p) {
  if (q == 0) return 0;
  const uint32_t a = q < 0 ? 0u - static_cast<uint32_t>(q) : static_cast<uint32_t>(q);
  const int len = 32 - Clz(a);
  const int u = (len - p + t) > (-125 - p) ? (len - p + t) : (-125 - p);  // the last place
  const int r = u - t;
  uint32_t m;
  if (r > 0) {
    const uint32_t m0 = a >> r, cut = a - (m0 << r), half = 1u << (r - 1);
    m = m0 + ((cut > half || (cut == half && (m0 & 1u))) ? 1u : 0u);
  } else {
    m = a << (-r);
  }
  const uint32_t inf = 255u << (p - 1);
  const int g = u + 125 + p;          // exponent field minus one; m's implicit bit carries it
  uint32_t out = inf;
  if (g < 254) {
    out = (static_cast<uint32_t>(g) << (p - 1)) + m;
    out = out < inf ? out : inf;
  }
  return out | (q < 0 ? (1u << (p + 7)) : 0u);
}

// Round to odd at 24 bits of a nonzero int32 (truncate toward zero, then set the lowest kept
// bit if anything was cut), as an exact float.
DTENJAX_HD float IntToFloatOdd(int32_t q) {
  const uint32_t a = q < 0 ? 0u - static_cast<uint32_t>(q) : static_cast<uint32_t>(q);
  const int drop = 8 - Clz(a) > 0 ? 8 - Clz(a) : 0;          // bits below the top 24
  uint32_t kept = (a >> drop) << drop;
  if (kept != a) kept |= 1u << drop;
  const float f = IntToFloatRn(static_cast<int32_t>(kept >> drop)) * Pow2(drop);   // exact
  return q < 0 ? -f : f;
}

// RepSum for two values. Contract v3 of two contributions is their correctly rounded sum
// (docs/collectives.md derives it from the words: the larger is exact and even, round to odd
// keeps the smaller's cut), with +0.0 for every zero sum and the canonical NaN: one IEEE float32
// addition, for bfloat16 too, whose RNE conversion of it is the correctly rounded bfloat16 sum
// (rounding twice is harmless when the first format has at least 2p + 2 bits, 24 >= 2 * 8 + 2).
// The mean's first step is RNE_f32 of the sum as well; where a + b overflows although its half
// does not, the mean is RNE(a/2 + b/2) (both halvings exact there), as the XLA path's scaled
// decode (fixed_point.mean_of): a finite mean is never inf.
DTENJAX_HD float RepSum2(float a, float b, bool mean) {
  const float s = AddRn(a, b);   // an infinity when a + b overflows float32, as v3's rounding
  const uint32_t sb = Bits(s);
  if ((sb & 0x7fffffffu) > 0x7f800000u) return FromBits(kQuietNan);  // a NaN, or inf - inf
  if (s == 0.0f) return 0.0f;    // only an exact zero sum rounds to zero; -0 + -0 too is +0
  if (mean && (sb & 0x7fffffffu) == 0x7f800000u && (Bits(a) & 0x7fffffffu) < 0x7f800000u &&
      (Bits(b) & 0x7fffffffu) < 0x7f800000u) {
    return AddRn(MulRn(a, 0.5f), MulRn(b, 0.5f));
  }
  return mean ? DivRn(s, 2.0f) : s;
}

// RepSum for three or more values: the words of the contract.
template <int W, bool kBf16>
DTENJAX_HD float RepSumWords(const float* v, bool mean) {
  static_assert(W >= 3, "two values: RepSum2");
  constexpr int P = 31 - CeilLog2(W);
  uint32_t mag = 0;
DTENJAX_UNROLL
  for (int p = 0; p < W; ++p) {
    const uint32_t m = Bits(v[p]) & 0x7fffffffu;
    mag = m > mag ? m : mag;
  }
  if (mag >= 0x7f800000u) {  // a NaN or an infinity: NaN if NaN or both infinities occur
    bool pos = false, neg = false;
DTENJAX_UNROLL
    for (int p = 0; p < W; ++p) {
      const uint32_t b = Bits(v[p]);
      const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
      pos |= nan || b == 0x7f800000u;
      neg |= nan || b == 0xff800000u;
    }
    return FromBits(pos && neg ? kQuietNan : (pos ? 0x7f800000u : 0xff800000u));
  }
  if (mag == 0) return 0.0f;
  const int c = (mag >> 23) > 1 ? static_cast<int>(mag >> 23) : 1;
  const int s = P + 126 - c, s1 = s < 127 ? s : 127;
  const float p1 = Pow2(s1), p2 = Pow2(s - s1);
  int32_t q = 0;
DTENJAX_UNROLL
  for (int p = 0; p < W; ++p) {
    q += FloatToIntRn(MulRn(MulRn(v[p], p1), p2));   // round(x / U); the products are exact
  }
  const int t = c - 126 - P;   // result = q * 2^t, at least 2^t unless 0
  if (q == 0) return 0.0f;
  if (t < -123) {   // a subnormal result (or mean's quotient) is possible: assemble the bits
    const uint32_t bits = RoundScaled(q, t, mean || !kBf16 ? 24 : 8);
    if (mean) return DivRn(FromBits(bits), static_cast<float>(W));
    return kBf16 ? FromBits(bits << 16) : FromBits(bits);
  }
  if (mean && c + CeilLog2(W) > 254) {   // the sum may pass float32's range, the mean cannot:
    constexpr int m = CeilLog2(W);        // divide RNE(sum / 2^m), scale back (fixed_point.mean_of)
    const float r = MulRn(IntToFloatRn(q), Pow2(t - m));
    return MulRn(DivRn(r, static_cast<float>(W)), Pow2(m));
  }
  if (mean || !kBf16) {
    const float r = MulRn(IntToFloatRn(q), Pow2(t));   // the one rounding; an exact scale
    return mean ? DivRn(r, static_cast<float>(W)) : r;
  }
  return MulRn(IntToFloatOdd(q), Pow2(t));   // bfloat16: RNE of this float rounds once
}

// The float32 whose RNE conversion to the output type is the contract-v3 result of the W values
// ``v`` (float32, bfloat16 widened exactly): for a bfloat16 sum the result itself, widened.
template <int W, bool kBf16>
DTENJAX_HD float RepSum(const float* v, bool mean) {
  if constexpr (W == 2) {
    return RepSum2(v[0], v[1], mean);
  } else {
    return RepSumWords<W, kBf16>(v, mean);
  }
}

}  // namespace dtenjax::p2p::v3

#undef DTENJAX_HD
#undef DTENJAX_UNROLL
#undef DTENJAX_HOST_SSE
