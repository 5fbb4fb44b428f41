// Host implementations of csrc/cpu/bucket_ops.h.
#include "csrc/cpu/bucket_ops.h"

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "csrc/p2p/repro_v3.h"

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace dtenjax::cpu {
namespace {

// The floating-point environment of one call: rounding to nearest even, and `flush` sets
// flush-to-zero and denormals-are-zero (XLA:CPU's kernels run so), otherwise both are cleared
// (IEEE, as contract v3 needs); the caller's state is restored on exit. On a CPU without such a mode (neither x86
// nor aarch64) nothing is changed.
class FloatMode {
 public:
  explicit FloatMode(bool flush) {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    constexpr unsigned kFtzDaz = 0x8040u;   // FTZ (bit 15) | DAZ (bit 6)
    constexpr unsigned kRounding = 0x6000u; // 0: to nearest even
    _mm_setcsr((flush ? (saved_ | kFtzDaz) : (saved_ & ~kFtzDaz)) & ~kRounding);
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    constexpr uint64_t kFz = 1ull << 24, kRounding = 3ull << 22;   // RMode 0: nearest even
    fpcr = (flush ? (fpcr | kFz) : (fpcr & ~kFz)) & ~kRounding;
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr));
#else
    (void)flush;
#endif
  }
  ~FloatMode() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  FloatMode(const FloatMode&) = delete;
  FloatMode& operator=(const FloatMode&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

inline float Widen(const void* data, int64_t i, Float type) {
  if (type == Float::kF32) return static_cast<const float*>(data)[i];
  const uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(data)[i]) << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// float32 -> bfloat16 bits, round to nearest even; a NaN becomes the quiet NaN of its sign
// (what XLA:CPU's conversion gives).
inline uint16_t ToBf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((b >> 16) & 0x8000u) | 0x7fc0u);
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

inline void Store(void* data, int64_t i, float x, Float type) {
  if (type == Float::kF32) {
    static_cast<float*>(data)[i] = x;
  } else {
    static_cast<uint16_t*>(data)[i] = ToBf16(x);
  }
}

#if defined(__SSE2__)
// Four elements at a time (SSE2), for float32 contributions and result, W >= 3: the same
// operations as RepSumWords in the same order -- the code from an integer maximum, two exact
// products, the conversion to int32 in the current rounding mode (nearest even), the int32 sum,
// its conversion and one exact scaling (and the mean's division) -- so the same bits. Lanes that
// leave that path (a NaN or an infinity, a result that may be subnormal, a mean whose sum may
// pass float32's range) are recomputed by RepSum.
inline __m128i Max32(__m128i a, __m128i b) {
  const __m128i gt = _mm_cmpgt_epi32(a, b);
  return _mm_or_si128(_mm_and_si128(gt, a), _mm_andnot_si128(gt, b));
}

inline __m128i Min32(__m128i a, __m128i b) {
  const __m128i gt = _mm_cmpgt_epi32(a, b);
  return _mm_or_si128(_mm_and_si128(gt, b), _mm_andnot_si128(gt, a));
}

inline __m128 Pow2x4(__m128i k) {   // 2^k for k in [-126, 127]
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(k, _mm_set1_epi32(127)), 23));
}

template <int W>
int64_t RepSumF32x4(const float* const* row, bool mean, int64_t c, float* y) {
  constexpr int L = p2p::v3::CeilLog2(W), P = 31 - L;
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), one = _mm_set1_epi32(1);
  const __m128 count = _mm_set1_ps(static_cast<float>(W));
  int64_t e = 0;
  for (; e + 4 <= c; e += 4) {
    __m128 v[W];
    __m128i mag = _mm_setzero_si128();
    for (int p = 0; p < W; ++p) {
      v[p] = _mm_loadu_ps(row[p] + e);
      mag = Max32(mag, _mm_and_si128(_mm_castps_si128(v[p]), abs_mask));
    }
    const __m128i code = Max32(_mm_srli_epi32(mag, 23), one);
    const __m128i sh = _mm_sub_epi32(_mm_set1_epi32(P + 126), code);
    const __m128i sh1 = Min32(sh, _mm_set1_epi32(127));
    const __m128 p1 = Pow2x4(sh1), p2 = Pow2x4(_mm_sub_epi32(sh, sh1));
    __m128i q = _mm_setzero_si128();
    for (int p = 0; p < W; ++p) {
      q = _mm_add_epi32(q, _mm_cvtps_epi32(_mm_mul_ps(_mm_mul_ps(v[p], p1), p2)));
    }
    const __m128i t = _mm_sub_epi32(code, _mm_set1_epi32(126 + P));
    __m128 r = _mm_mul_ps(_mm_cvtepi32_ps(q), Pow2x4(Max32(t, _mm_set1_epi32(-126))));
    if (mean) r = _mm_div_ps(r, count);
    _mm_storeu_ps(y + e, r);
    __m128i other = _mm_or_si128(_mm_cmpgt_epi32(mag, _mm_set1_epi32(0x7f7fffff)),
                                 _mm_cmplt_epi32(t, _mm_set1_epi32(-123)));
    if (mean) other = _mm_or_si128(other, _mm_cmpgt_epi32(code, _mm_set1_epi32(254 - L)));
    const int lanes = _mm_movemask_ps(_mm_castsi128_ps(other));
    if (lanes) {
      for (int l = 0; l < 4; ++l) {
        if (!(lanes & (1 << l))) continue;
        float w[W];
        for (int p = 0; p < W; ++p) w[p] = row[p][e + l];
        y[e + l] = p2p::v3::RepSum<W, false>(w, mean);
      }
    }
  }
  return e;
}

// The word exchange's common cases four elements at a time, float32 (the same operations as the
// scalar loops below, lane by lane: the same bits); each returns where the scalar loop resumes
// and leaves the lanes it cannot take (`redo`, one bit per lane of every group of four) to it.
inline __m128i Codes4(const uint8_t* codes) {
  int32_t four;
  std::memcpy(&four, codes, 4);
  const __m128i z = _mm_setzero_si128();
  return _mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(four), z), z);
}

int64_t ReproCodesF32x4(const float* x, int64_t k, int64_t c, uint8_t* codes) {
  const __m128i abs_mask = _mm_set1_epi32(0x7fffffff), one = _mm_set1_epi32(1);
  int64_t e = 0;
  for (; e + 4 <= c; e += 4) {
    __m128i mag = _mm_setzero_si128();
    for (int64_t p = 0; p < k; ++p) {
      mag = Max32(mag, _mm_and_si128(_mm_castps_si128(_mm_loadu_ps(x + p * c + e)), abs_mask));
    }
    const __m128i code = Max32(_mm_srli_epi32(mag, 23), Min32(mag, one));
    const int32_t four = _mm_cvtsi128_si32(_mm_packus_epi16(_mm_packs_epi32(code, code), code));
    std::memcpy(codes + e, &four, 4);
  }
  return e;
}

// count >= 3 (two contributions round to odd); lanes of code 255 are the scalar loop's.
int64_t ReproEncodeF32x4(const float* x, int64_t k, int64_t c, const uint8_t* codes, int P,
                         int32_t* words, std::vector<int64_t>* redo) {
  int64_t e = 0;
  for (; e + 4 <= c; e += 4) {
    const __m128i code = Codes4(codes + e);
    const __m128i sh = _mm_sub_epi32(_mm_set1_epi32(P + 126), code);
    const __m128i sh1 = Min32(sh, _mm_set1_epi32(127));
    const __m128 p1 = Pow2x4(sh1), p2 = Pow2x4(_mm_sub_epi32(sh, sh1));
    __m128i q = _mm_setzero_si128();
    for (int64_t p = 0; p < k; ++p) {
      q = _mm_add_epi32(q, _mm_cvtps_epi32(_mm_mul_ps(_mm_mul_ps(_mm_loadu_ps(x + p * c + e),
                                                                 p1), p2)));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(words + e), q);
    if (_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(code, _mm_set1_epi32(255))))) {
      redo->push_back(e);
    }
  }
  return e;
}

// Lanes of code 0 or 255, of a possibly subnormal result, or of a mean whose sum may pass
// float32's range are the scalar loop's.
int64_t ReproDecodeF32x4(const int32_t* words, const uint8_t* codes, int64_t c, int count,
                         bool mean, float* y, std::vector<int64_t>* redo) {
  const int L = p2p::v3::CeilLog2(count), P = 31 - L;
  const __m128 n = _mm_set1_ps(static_cast<float>(count));
  int64_t e = 0;
  for (; e + 4 <= c; e += 4) {
    const __m128i code = Codes4(codes + e);
    const __m128i t = _mm_sub_epi32(code, _mm_set1_epi32(126 + P));
    __m128 r = _mm_mul_ps(_mm_cvtepi32_ps(_mm_loadu_si128(
                              reinterpret_cast<const __m128i*>(words + e))),
                          Pow2x4(Max32(t, _mm_set1_epi32(-126))));
    if (mean && count > 1) r = _mm_div_ps(r, n);
    _mm_storeu_ps(y + e, r);
    __m128i other = _mm_or_si128(_mm_cmpgt_epi32(code, _mm_set1_epi32(254 - (mean ? L : 0))),
                                 _mm_cmplt_epi32(t, _mm_set1_epi32(-123)));
    if (_mm_movemask_ps(_mm_castsi128_ps(other))) redo->push_back(e);
  }
  return e;
}
#endif

// y = a + b (kScale false) or y = a * s (kScale true) elementwise over n float32 values, in the
// current floating-point mode (y may be a or b). Four lanes at a time, four vectors per round: the
// extension is built for size (nanobind adds -Os), which leaves a plain loop scalar, one value per
// iteration, where XLA's own kernels are vectorized. Each lane is the one IEEE operation the
// scalar loop would do: the same bits.
template <bool kScale>
void ArithF32(const float* a, const float* b, float s, float* y, int64_t n) {
  int64_t e = 0;
#if defined(__SSE2__)
  const __m128 sv = _mm_set1_ps(s);
  const auto op = [&](int64_t i) {
    const __m128 x = _mm_loadu_ps(a + i);
    return kScale ? _mm_mul_ps(x, sv) : _mm_add_ps(x, _mm_loadu_ps(b + i));
  };
  for (; e + 16 <= n; e += 16) {
    const __m128 s0 = op(e), s1 = op(e + 4), s2 = op(e + 8), s3 = op(e + 12);
    _mm_storeu_ps(y + e, s0);
    _mm_storeu_ps(y + e + 4, s1);
    _mm_storeu_ps(y + e + 8, s2);
    _mm_storeu_ps(y + e + 12, s3);
  }
  for (; e + 4 <= n; e += 4) _mm_storeu_ps(y + e, op(e));
#endif
  for (; e < n; ++e) y[e] = kScale ? a[e] * s : a[e] + b[e];
}

void AddF32(const float* a, const float* b, float* y, int64_t n) {
  ArithF32<false>(a, b, 0.0f, y, n);
}

// y = a * 2^k (k != 0), or a copy of a (k == 0: no multiplication, as the jnp path has none).
void ScaleF32(const float* a, int k, float* y, int64_t n) {
  if (k != 0) return ArithF32<true>(a, nullptr, p2p::v3::Pow2(k), y, n);
  if (n && y != a) std::memcpy(y, a, n * sizeof(float));
}

// The values of chunk `chunk` of `c` values of a flat buffer of `total` values that lie inside
// it (the rest read as zeros).
int64_t Inside(int64_t total, int64_t chunk, int64_t c) {
  const int64_t start = chunk * c;
  return start >= total ? 0 : (total - start < c ? total - start : c);
}

int64_t BitReversed(int64_t p, int64_t n) {   // n a power of two
  int64_t r = 0;
  for (int64_t bit = 1; bit < n; bit <<= 1) r = (r << 1) | ((p & bit) ? 1 : 0);
  return r;
}

template <int W, bool kBf16In, bool kBf16Out>
void RepSumTyped(const std::vector<const void*>& rows_of, bool mean, int64_t c, void* result) {
  constexpr Float in = kBf16In ? Float::kBf16 : Float::kF32;
  constexpr Float out = kBf16Out ? Float::kBf16 : Float::kF32;
  const void* row[W];
  for (int p = 0; p < W; ++p) row[p] = rows_of[p];
  int64_t e = 0;
#if defined(__SSE2__)
  if constexpr (W >= 3 && !kBf16In && !kBf16Out) {
    e = RepSumF32x4<W>(reinterpret_cast<const float* const*>(row), mean, c,
                       static_cast<float*>(result));
  }
#endif
  float v[W];
  for (; e < c; ++e) {
    for (int p = 0; p < W; ++p) v[p] = Widen(row[p], e, in);
    Store(result, e, p2p::v3::RepSum<W, kBf16In>(v, mean), out);
  }
}


template <int W>
void RepSumW(const std::vector<const void*>& rows_of, Float in, bool mean, Float out,
             int64_t c, void* result, int64_t result_row) {
  const size_t width = out == Float::kF32 ? 4 : 2;
  void* dst = static_cast<char*>(result) + result_row * c * static_cast<int64_t>(width);
  if (in == Float::kF32) {
    if (out == Float::kF32) return RepSumTyped<W, false, false>(rows_of, mean, c, dst);
    return RepSumTyped<W, false, true>(rows_of, mean, c, dst);
  }
  if (out == Float::kF32) return RepSumTyped<W, true, false>(rows_of, mean, c, dst);
  return RepSumTyped<W, true, true>(rows_of, mean, c, dst);
}

using RepSumFn = void (*)(const std::vector<const void*>&, Float, bool, Float, int64_t, void*,
                          int64_t);

template <int... Ws>
constexpr RepSumFn RepSumOf(int w, std::integer_sequence<int, Ws...>) {
  RepSumFn fn = nullptr;
  ((fn = (w == Ws + 2) ? &RepSumW<Ws + 2> : fn), ...);
  return fn;
}

constexpr int kMaxContributions = 32;   // fixed_point_v3.MAX_CONTRIBUTIONS: one int32 word

inline uint32_t BitsOf(const void* data, int64_t i, Float type) {   // float32 bits, widened
  return p2p::v3::Bits(Widen(data, i, type));
}

// fixed_point_v3.quantize: the word of finite x (bits b) against the code `code`, with the
// three scales of `code`; round to odd for two contributions, else to nearest even.
inline int32_t Quantize(uint32_t b, float p1, float p2, float p3, bool two) {
  using p2p::v3::FromBits;
  const uint32_t m = b & 0x7fffffu;
  const float sub = static_cast<float>((b >> 31) ? -static_cast<int32_t>(m)
                                                 : static_cast<int32_t>(m)) * p3;
  const float y = (b & 0x7f800000u) == 0 ? sub : (FromBits(b) * p1) * p2;
  if (!two) return p2p::v3::FloatToIntRn(y);
  const float a = y < 0 ? -y : y;
  int32_t t = static_cast<int32_t>(a);
  if (static_cast<float>(t) != a || (a == 0.0f && (b & 0x7fffffffu) != 0)) t |= 1;
  return (b >> 31) ? -t : t;
}

inline float Pow2Clipped(int k) { return p2p::v3::Pow2(k < -126 ? -126 : (k > 127 ? 127 : k)); }

}  // namespace

Status Pack(const void* const* operands, const int64_t* sizes, int count, int64_t rows,
            int64_t total, size_t width, void* out) {
  int64_t used = 0;
  for (int i = 0; i < count; ++i) {
    DTENJAX_CHECK_ARG(sizes[i] >= 0, "pack: operand " + std::to_string(i) + " has a negative size");
    used += sizes[i];
  }
  DTENJAX_CHECK_ARG(rows >= 0 && used <= total,
                    "pack: the operands hold " + std::to_string(used) + " values per row, more "
                    "than the result's " + std::to_string(total));
  char* dst = static_cast<char*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    char* row = dst + r * total * width;
    int64_t at = 0;
    for (int i = 0; i < count; ++i) {
      const char* src = static_cast<const char*>(operands[i]) + r * sizes[i] * width;
      if (sizes[i]) std::memcpy(row + at * width, src, sizes[i] * width);
      at += sizes[i];
    }
    if (total > at) std::memset(row + at * width, 0, (total - at) * width);
  }
  return Status::Ok();
}

Status Unpack(const void* operand, int64_t rows, int64_t total, void* const* results,
              const int64_t* sizes, int count, size_t width) {
  DTENJAX_CHECK_ARG(rows >= 0 && total >= 0, "unpack: negative rows or row length");
  const char* src = static_cast<const char*>(operand);
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = src + r * total * width;
    int64_t at = 0;
    for (int i = 0; i < count; ++i) {
      DTENJAX_CHECK_ARG(sizes[i] >= 0, "unpack: result " + std::to_string(i) + " has a negative size");
      char* dst = static_cast<char*>(results[i]) + r * sizes[i] * width;
      const int64_t have = at >= total ? 0 : (total - at < sizes[i] ? total - at : sizes[i]);
      if (have) std::memcpy(dst, row + at * width, have * width);
      if (sizes[i] > have) std::memset(dst + have * width, 0, (sizes[i] - have) * width);
      at += sizes[i];
    }
  }
  return Status::Ok();
}

Status Fold(const void* const* operands, int count, int64_t values, Float in, Float out,
            void* result) {
  DTENJAX_CHECK_ARG(count >= 1, "fold: no operand");
  FloatMode mode(/*flush=*/true);
  if (in == Float::kF32 && out == Float::kF32) {
    // the common case, one pass per operand (vectorized): ((x0 + x1) + x2) + ... per element
    const float* const* x = reinterpret_cast<const float* const*>(operands);
    float* y = static_cast<float*>(result);
    if (count == 1) {
      std::memcpy(y, x[0], values * sizeof(float));
      return Status::Ok();
    }
    AddF32(x[0], x[1], y, values);
    for (int p = 2; p < count; ++p) AddF32(y, x[p], y, values);
    return Status::Ok();
  }
  for (int64_t e = 0; e < values; ++e) {
    float acc = Widen(operands[0], e, in);
    for (int p = 1; p < count; ++p) acc = acc + Widen(operands[p], e, in);
    Store(result, e, acc, out);
  }
  return Status::Ok();
}

namespace {

// The adds and scalings of ring's and butterfly's steps for float32 (XLA:CPU's flushing, SSE2)
// and int32 (wrapping, as XLA's integer add; no scaling).
void Add(const float* a, const float* b, float* y, int64_t n) { AddF32(a, b, y, n); }
void Add(const int32_t* a, const int32_t* b, int32_t* y, int64_t n) {
  for (int64_t e = 0; e < n; ++e) {
    y[e] = static_cast<int32_t>(static_cast<uint32_t>(a[e]) + static_cast<uint32_t>(b[e]));
  }
}
void Scale(const float* a, int k, float* y, int64_t n) { ScaleF32(a, k, y, n); }
void Scale(const int32_t* a, int, int32_t* y, int64_t n) {
  if (n && y != a) std::memcpy(y, a, n * sizeof(int32_t));
}

template <typename T>
Status ButterflyFirstT(const T* flat, int64_t total, int64_t n, int upper, int64_t c,
                       int scale_log2, T* keep, T* send) {
  DTENJAX_CHECK_ARG(n >= 2 && (n & (n - 1)) == 0, "butterfly: n = " + std::to_string(n) +
                                                      " is not a power of two >= 2");
  DTENJAX_CHECK_ARG(c >= 0 && total >= 0 && total <= n * c && (upper == 0 || upper == 1),
                    "butterfly: " + std::to_string(n) + " chunks of " + std::to_string(c) +
                        " values do not cover " + std::to_string(total) + " values");
  FloatMode mode(/*flush=*/true);
  const int64_t h = n / 2;
  for (int64_t p = 0; p < n; ++p) {   // position p holds chunk bitrev(p)
    T* dst = (p / h == upper ? keep : send) + (p % h) * c;
    const int64_t chunk = BitReversed(p, n), inside = Inside(total, chunk, c);
    Scale(flat + chunk * c, -scale_log2, dst, inside);
    if (c > inside) std::memset(dst + inside, 0, (c - inside) * sizeof(T));
  }
  return Status::Ok();
}

template <typename T>
Status ButterflyStepT(const T* keep, const T* recv, int64_t h, int64_t c, int upper,
                      int next_upper, int scale_log2, T* out_keep, T* out_send) {
  DTENJAX_CHECK_ARG(h >= 1 && (h == 1 || h % 2 == 0) && c >= 0,
                    "butterfly: " + std::to_string(h) + " rows is neither 1 nor even");
  FloatMode mode(/*flush=*/true);
  const T* lower = upper ? recv : keep;   // the lower block's partial sum first
  const T* higher = upper ? keep : recv;
  if (h == 1) {
    Add(lower, higher, out_keep, c);
    Scale(out_keep, scale_log2, out_keep, c);
    return Status::Ok();
  }
  const int64_t half = h / 2 * c, mine = next_upper ? half : 0, theirs = half - mine;
  Add(lower + mine, higher + mine, out_keep, half);
  Add(lower + theirs, higher + theirs, out_send, half);
  return Status::Ok();
}

// Ring's step where the buffer, the partial and the result are of one type T: the partial plus
// the chunk's values inside the buffer, the partial alone (plus zero) past it.
template <typename T>
void RingStepT(const T* x, const T* recv, int64_t inside, int64_t c, T* y) {
  if (recv != nullptr) {
    Add(recv, x, y, inside);
    for (int64_t e = inside; e < c; ++e) y[e] = recv[e] + T(0);
  } else {
    if (inside) std::memcpy(y, x, inside * sizeof(T));
    if (c > inside) std::memset(y + inside, 0, (c - inside) * sizeof(T));
  }
}

}  // namespace

Status RingStep(const void* flat, int64_t total, Float in, const float* recv, int64_t chunk,
                int64_t c, Float out, void* result) {
  DTENJAX_CHECK_ARG(c >= 0 && total >= 0 && chunk >= 0, "ring step: negative sizes");
  FloatMode mode(/*flush=*/true);
  const int64_t start = chunk * c;
  const int64_t inside = Inside(total, chunk, c);
  if (in == Float::kF32 && out == Float::kF32) {   // the common case (vectorized)
    RingStepT(static_cast<const float*>(flat) + start, recv, inside, c,
              static_cast<float*>(result));
    return Status::Ok();
  }
  for (int64_t e = 0; e < c; ++e) {
    // a widened bfloat16 or a float32 read as it is: the flushing applies to the addition only
    // (XLA's convert of a subnormal bfloat16 keeps it, and a lone chunk is a copy)
    const float x = e < inside ? Widen(flat, start + e, in) : 0.0f;
    Store(result, e, recv != nullptr ? recv[e] + x : x, out);
  }
  return Status::Ok();
}

Status RingStep(const int32_t* flat, int64_t total, const int32_t* recv, int64_t chunk,
                int64_t c, int32_t* result) {
  DTENJAX_CHECK_ARG(c >= 0 && total >= 0 && chunk >= 0, "ring step: negative sizes");
  RingStepT(flat + chunk * c, recv, Inside(total, chunk, c), c, result);
  return Status::Ok();
}

Status ButterflyFirst(const float* flat, int64_t total, int64_t n, int upper, int64_t c,
                      int scale_log2, float* keep, float* send) {
  return ButterflyFirstT(flat, total, n, upper, c, scale_log2, keep, send);
}

Status ButterflyFirst(const int32_t* flat, int64_t total, int64_t n, int upper, int64_t c,
                      int32_t* keep, int32_t* send) {
  return ButterflyFirstT(flat, total, n, upper, c, 0, keep, send);
}

Status ButterflyStep(const float* keep, const float* recv, int64_t h, int64_t c, int upper,
                     int next_upper, int scale_log2, float* out_keep, float* out_send) {
  return ButterflyStepT(keep, recv, h, c, upper, next_upper, scale_log2, out_keep, out_send);
}

Status ButterflyStep(const int32_t* keep, const int32_t* recv, int64_t h, int64_t c, int upper,
                     int next_upper, int32_t* out_keep, int32_t* out_send) {
  return ButterflyStepT(keep, recv, h, c, upper, next_upper, 0, out_keep, out_send);
}

Status ReproCodes(const void* x, int64_t k, int64_t c, Float in, uint8_t* codes) {
  DTENJAX_CHECK_ARG(k >= 1 && c >= 0, "reproducible codes: no contribution");
  int64_t e = 0;
#if defined(__SSE2__)
  if (in == Float::kF32) e = ReproCodesF32x4(static_cast<const float*>(x), k, c, codes);
#endif
  for (; e < c; ++e) {
    uint32_t mag = 0;
    for (int64_t p = 0; p < k; ++p) {
      const uint32_t m = BitsOf(x, p * c + e, in) & 0x7fffffffu;
      mag = m > mag ? m : mag;
    }
    codes[e] = static_cast<uint8_t>((mag >> 23) > 1 ? (mag >> 23) : (mag != 0 ? 1 : 0));
  }
  return Status::Ok();
}

// `f(e)` for every element the four-lane loop left: the lanes of its `redo` groups, then the
// elements from `start` on (all of them where no vector loop ran). No index list is built: a
// custom call's scalar path allocated one per element on every call.
template <typename F>
void ForScalarRest(const std::vector<int64_t>& redo, int64_t start, int64_t c, F f) {
  for (int64_t g : redo) for (int64_t l = 0; l < 4; ++l) f(g + l);
  for (int64_t e = start; e < c; ++e) f(e);
}

Status ReproEncode(const void* x, int64_t k, int64_t c, Float in, const uint8_t* codes,
                   int count, int32_t* words) {
  DTENJAX_CHECK_ARG(k >= 1 && count >= k && count <= kMaxContributions,
                    "reproducible encode: " + std::to_string(count) + " contributions; the "
                    "handler takes " + std::to_string(k) + ".." +
                    std::to_string(kMaxContributions));
  FloatMode mode(/*flush=*/false);
  const int P = 31 - p2p::v3::CeilLog2(count);
  int64_t start = 0;
  std::vector<int64_t> redo;   // four-lane groups the vector loop left to the scalar one
#if defined(__SSE2__)
  if (in == Float::kF32 && count >= 3) {
    start = ReproEncodeF32x4(static_cast<const float*>(x), k, c, codes, P, words, &redo);
  }
#endif
  ForScalarRest(redo, start, c, [&](int64_t e) {
    const int code = codes[e];
    const int sh = P + 126 - code, sh1 = sh < 127 ? sh : 127;
    const float p1 = Pow2Clipped(sh1), p2 = Pow2Clipped(sh - sh1), p3 = Pow2Clipped(sh - 149);
    uint32_t w = 0;   // the int32 sum, wrapping as XLA's
    for (int64_t p = 0; p < k; ++p) {
      const uint32_t b = BitsOf(x, p * c + e, in);
      if (code == 255) {   // (NaN or -inf) + 2^16 (NaN or +inf)
        const bool nan = (b & 0x7fffffffu) > 0x7f800000u;
        w += (nan || b == 0xff800000u ? 1u : 0u) + (nan || b == 0x7f800000u ? 1u << 16 : 0u);
      } else {
        w += static_cast<uint32_t>(Quantize(b, p1, p2, p3, count == 2));
      }
    }
    words[e] = static_cast<int32_t>(w);
  });
  return Status::Ok();
}

Status ReproDecode(const int32_t* words, const uint8_t* codes, int64_t c, int count, bool mean,
                   Float out, void* result) {
  DTENJAX_CHECK_ARG(count >= 1 && count <= kMaxContributions,
                    "reproducible decode: " + std::to_string(count) + " contributions");
  using p2p::v3::FromBits;
  using p2p::v3::RoundScaled;
  FloatMode mode(/*flush=*/false);
  const int P = 31 - p2p::v3::CeilLog2(count), m = p2p::v3::CeilLog2(count);
  int64_t start = 0;
  std::vector<int64_t> redo;   // four-lane groups the vector loop left to the scalar one
#if defined(__SSE2__)
  if (out == Float::kF32) {
    start = ReproDecodeF32x4(words, codes, c, count, mean, static_cast<float*>(result), &redo);
  }
#endif
  ForScalarRest(redo, start, c, [&](int64_t e) {
    const int32_t q = words[e];
    const int code = codes[e], t = code - 126 - P;
    uint32_t bits;   // float32 bits (bfloat16's in the high half for a bfloat16 sum)
    if (code == 255) {
      const bool neg = (q & 0xffff) > 0, pos = (q >> 16) > 0;
      bits = neg && pos ? 0x7fc00000u : (pos ? 0x7f800000u : 0xff800000u);
    } else if (code == 0) {
      bits = 0;
    } else if (!mean && out == Float::kBf16) {   // one rounding to bfloat16
      bits = RoundScaled(q, t, 8) << 16;
    } else if (!mean) {
      bits = RoundScaled(q, t, 24);
    } else {   // fixed_point.mean_of: RNE(RNE(S) / n), scaled where RNE(S) may overflow
      const bool big = count > 1 && code + m > 254;
      float r = FromBits(RoundScaled(q, big ? t - m : t, 24));
      if (count > 1) r = p2p::v3::DivRn(r, static_cast<float>(count));
      if (big) r = p2p::v3::MulRn(r, p2p::v3::Pow2(m));
      bits = p2p::v3::Bits(r);
    }
    Store(result, e, FromBits(bits), out);
  });
  return Status::Ok();
}

Status RepSum(const void* const* operands, const int64_t* contributions, int count,
              int64_t rows, int64_t c, Float in, bool mean, Float out, void* result) {
  int64_t w = 0;
  for (int i = 0; i < count; ++i) w += contributions[i];
  DTENJAX_CHECK_ARG(w >= 2 && w <= kMaxContributions,
                    "reproducible sum: " + std::to_string(w) + " contributions; the handler "
                    "takes 2.." + std::to_string(kMaxContributions));
  const RepSumFn fn =
      RepSumOf(static_cast<int>(w), std::make_integer_sequence<int, kMaxContributions - 1>());
  FloatMode mode(/*flush=*/false);
  const size_t width = in == Float::kF32 ? 4 : 2;
  std::vector<const void*> rows_of(static_cast<size_t>(w));
  for (int64_t r = 0; r < rows; ++r) {
    size_t p = 0;
    for (int i = 0; i < count; ++i) {
      const char* base = static_cast<const char*>(operands[i]) +
                         r * contributions[i] * c * static_cast<int64_t>(width);
      for (int64_t j = 0; j < contributions[i]; ++j) rows_of[p++] = base + j * c * width;
    }
    fn(rows_of, in, mean, out, c, result, r);
  }
  return Status::Ok();
}

}  // namespace dtenjax::cpu
