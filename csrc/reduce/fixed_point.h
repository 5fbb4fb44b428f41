// Exact fixed-point encoding for the reproducible all-reduce (host code, no XLA, no CUDA).
//
// A reproducible sum of floats is computed as an integer sum, which is associative, so its bits do
// not depend on the order, the algorithm or the number of devices. Per element i:
//   1. analyze: meta = [e, pinf, ninf] where e is the frexp exponent of x (|x| < 2^e), or kExpZero
//      for zeros and non-finite values; pinf/ninf flag +inf/-inf (NaN sets both). Reduced with MAX.
//   2. encode:  q = rint(x * 2^(kFracBits - e_max)) split into hi = floor(q / 2^20), lo = q - hi*2^20,
//      both int32. Reduced with SUM (exact for up to kMaxContributions contributions).
//   3. decode:  carry lo into hi, v = f32(hi) * 2^20 + f32(lo), result = v * 2^(e_max - kFracBits),
//      then the IEEE rules: NaN if both flags, +-inf if one.
// Every step is a fixed sequence of f32 operations whose results are exact except the marked
// roundings, so this code and the jnp formulation in dtenjax/_src/collectives/fixed_point.py give identical bits.
#pragma once

#include <cstdint>

namespace dtenjax::fixed_point {

constexpr int kFracBits = 40;            // bits kept below the element's max exponent
constexpr int kLoBits = 20;              // width of the low word
constexpr int kExpZero = -200;           // exponent of zero / non-finite contributions
constexpr int kMaxContributions = 2048;  // 2^(31 - kLoBits): lo and hi sums cannot overflow int32

// bf16 is passed as its raw 16-bit pattern.
void Analyze(const float* x, int64_t n, int32_t* meta /* [3, n] */);
void Analyze(const uint16_t* x_bf16, int64_t n, int32_t* meta);
void Encode(const float* x, const int32_t* e_max, int64_t n, int32_t* words /* [2, n] */);
void Encode(const uint16_t* x_bf16, const int32_t* e_max, int64_t n, int32_t* words);
void Decode(const int32_t* words, const int32_t* meta, int64_t n, float* out);
void Decode(const int32_t* words, const int32_t* meta, int64_t n, uint16_t* out_bf16);

}  // namespace dtenjax::fixed_point
