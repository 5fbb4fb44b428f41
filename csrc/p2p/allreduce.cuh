// Device code of the NVLink peer-to-peer all-reduce (one-shot and two-shot). No XLA, no host code.
//
// Bit contracts (identical on every rank, and between one-shot and two-shot):
//  * Op::kSum: element i is round_T( (...((f32(x_0[i]) + f32(x_1[i])) + f32(x_2[i])) + ... ) +
//    f32(x_{W-1}[i]) ): ranks summed in order 0..W-1 with float32 accumulation (no FMA, no
//    pairwise tree, the first term is x_0 itself), rounded once to T (RNE). `mean` divides the f32
//    sum by W (RNE) before that rounding.
//  * Op::kMax / kMin: the rank-order fold of `>` / `<` selections; any NaN gives the canonical
//    quiet NaN.
//  * Reproducible::kV3: the reproducible sum of contract v3 (docs/collectives.md), in registers as the
//    peers' floats are read (repro_v3.h): one int32 word per value against the element's
//    common exponent, an int32 sum, one rounding to T (for two ranks one float addition, which
//    gives the same bits). The same bits as the XLA path.
//  * Reproducible::kExact: the exact fixed-point sum of contract v2: codes and quantisation from the
//    float bits with integer operations, an int64 sum, and the XLA path's decode to float32
//    (then one RNE rounding to T), so that it equals the XLA path bit for bit.
//  The kernels are compiled without -ftz: subnormal operands and results are IEEE.
//
// Synchronisation: a block-level barrier between the blocks with the same blockIdx.x of every rank.
// Barrier k of the call with epoch E writes 2E + k into the block's landing slot of every peer
// (st.release.sys after __threadfence_system) and waits until each peer has written >= 2E + k
// into its own slots (ld.acquire.sys), with a %globaltimer timeout that records what it waited
// for in host-mapped memory and traps (the step fails; it never returns made-up data).
// Every block uses the same element-to-block mapping before and after a barrier, so a block only
// ever reads peer data that the peers' blocks of the same index wrote before signalling it.
// Stage buffers alternate with the epoch's parity: a peer that has started call E+1 has finished
// call E, whose first barrier every rank had reached, so every rank had finished call E-1 and its
// reads of the parity buffer that call E+1 now overwrites. Hence no end barrier and no flag reset.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "csrc/p2p/allreduce.h"
#include "csrc/p2p/repro_v3.h"

namespace dtenjax::p2p::device {

__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

constexpr uint32_t kQuietNan = 0x7fc00000u;

// --- 8-byte words of T <-> float32 (a 16-byte vector is two words) -------------------------

template <typename T> struct Vec;

template <> struct Vec<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static float ScalarToF32(float x) { return x; }
  __device__ __forceinline__ static float ScalarFromF32(float x) { return x; }
  __device__ __forceinline__ static void WordToF32(const uint2& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
  }
  __device__ __forceinline__ static uint2 WordFromF32(const float* f) {
    return make_uint2(__float_as_uint(f[0]), __float_as_uint(f[1]));
  }
};

// The 16-bit floats: 8 per vector, two per 32-bit lane. Vec16 is their vector code, once;
// Conv16<T> names T's pair type and CUDA's conversions, the only thing the two types differ in.
template <typename T> struct Conv16;

template <> struct Conv16<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  __device__ __forceinline__ static float2 PairToF32(Pair h) { return __bfloat1622float2(h); }
  __device__ __forceinline__ static Pair PairFromF32(float a, float b) {
    return __floats2bfloat162_rn(a, b);
  }
  __device__ __forceinline__ static float ToF32(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 FromF32(float x) {
    return __float2bfloat16_rn(x);
  }
};

template <> struct Conv16<__half> {
  using Pair = __half2;
  __device__ __forceinline__ static float2 PairToF32(Pair h) { return __half22float2(h); }
  __device__ __forceinline__ static Pair PairFromF32(float a, float b) {
    return __floats2half2_rn(a, b);
  }
  __device__ __forceinline__ static float ToF32(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half FromF32(float x) { return __float2half_rn(x); }
};

template <typename T>
struct Vec16 {
  using C = Conv16<T>;
  static_assert(sizeof(T) == 2 && sizeof(typename C::Pair) == 4, "a 16-bit float and its pair");
  static constexpr int kElems = 8;
  __device__ __forceinline__ static float2 Pair(uint32_t w) {
    return C::PairToF32(*reinterpret_cast<typename C::Pair*>(&w));
  }
  __device__ __forceinline__ static uint32_t Pack(float a, float b) {
    typename C::Pair h = C::PairFromF32(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float ScalarToF32(T x) { return C::ToF32(x); }
  __device__ __forceinline__ static T ScalarFromF32(float x) { return C::FromF32(x); }
  __device__ __forceinline__ static void WordToF32(const uint2& v, float* f) {
    float2 a = Pair(v.x), b = Pair(v.y);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  }
  __device__ __forceinline__ static uint2 WordFromF32(const float* f) {
    return make_uint2(Pack(f[0], f[1]), Pack(f[2], f[3]));
  }
};

template <> struct Vec<__nv_bfloat16> : Vec16<__nv_bfloat16> {};
template <> struct Vec<__half> : Vec16<__half> {};

// --- per-element reductions over the W ranks' values ------------------------------------------

// Rank-order fold of sum (f32, no FMA), max or min (NaN-propagating).
template <int W>
__device__ __forceinline__ float Fold(const float* v, Op op, bool mean) {
  float acc = v[0];
  if (op == Op::kSum) {
#pragma unroll
    for (int p = 1; p < W; ++p) acc = __fadd_rn(acc, v[p]);  // never contracted to an FMA
    return mean ? __fdiv_rn(acc, static_cast<float>(W)) : acc;
  }
  bool nan = isnan(acc);
#pragma unroll
  for (int p = 1; p < W; ++p) {
    nan |= isnan(v[p]);
    acc = (op == Op::kMax) ? (v[p] > acc ? v[p] : acc) : (v[p] < acc ? v[p] : acc);
  }
  return nan ? __uint_as_float(kQuietNan) : acc;
}

// --- contract v2 (the exact fixed-point sum), integer operations only -------------------------
__device__ __forceinline__ uint32_t FixedCode(uint32_t b) {
  const uint32_t a = b & 0x7fffffffu;
  if (a == 0) return 0;
  const uint32_t f = a >> 23;
  return f == 0 ? 1u : f;       // subnormals share code 1; NaN and Inf give 255
}

// round_half_even(x * 2^(40 - e)) for e = C - 126, exactly, from the bits of x.
__device__ __forceinline__ long long FixedQuantize(uint32_t b, int c) {
  const uint32_t a = b & 0x7fffffffu;
  if (a == 0) return 0;
  const int f = static_cast<int>(a >> 23);
  const uint32_t m = (a & 0x7fffffu) | (f != 0 ? 0x800000u : 0u);
  const int d = (f != 0 ? f : 1) - c + 16;
  unsigned long long q;
  if (d >= 0) {
    q = static_cast<unsigned long long>(m) << d;
  } else if (-d > 25) {
    q = 0;
  } else {
    const int k = -d;
    const uint32_t kept = m >> k, rem = m & ((1u << k) - 1u), half = 1u << (k - 1);
    q = kept + ((rem > half || (rem == half && (kept & 1u))) ? 1u : 0u);
  }
  return (b >> 31) ? -static_cast<long long>(q) : static_cast<long long>(q);
}

__device__ __forceinline__ float Pow2(int k) {   // 2^k for k in [-126, 127], from the bits
  return __uint_as_float(static_cast<uint32_t>(k + 127) << 23);
}

// The float32 value of the exact sum Q * 2^(c - 166) (step 5 of contract v2, as the XLA path
// computes it): v = f32(h) * 2^20 + f32(l) with h = Q >> 20, l = Q mod 2^20 (RNE float ops), then
// scaled by 2^t on the exponent bits when the result is normal, or to the subnormal
// rint(|v| * 2^(t + 149)) * 2^-149 below 2^-126, or +-inf past the float32 range.
__device__ __forceinline__ float FixedDecode(long long q, int c) {
  const int h = static_cast<int>(q >> 20);
  const int l = static_cast<int>(q & 0xfffff);
  const float v = __fadd_rn(__fmul_rn(__int2float_rn(h), 1048576.0f), __int2float_rn(l));
  if (v == 0.0f) return 0.0f;
  const int t = c - 166;
  const uint32_t vb = __float_as_uint(v);
  const int f = static_cast<int>((vb >> 23) & 0xff) + t;
  if (f >= 255) return v < 0.0f ? -__uint_as_float(0x7f800000u) : __uint_as_float(0x7f800000u);
  if (f >= 1) return __uint_as_float(vb + (static_cast<uint32_t>(t) << 23));
  const int k = min(max(t + 149, -126), 127);
  const uint32_t tiny = static_cast<uint32_t>(rintf(__fmul_rn(fabsf(v), Pow2(k))));
  return __uint_as_float(tiny | (vb & 0x80000000u));
}

template <int W>
__device__ __forceinline__ float FixedSum(const float* v, bool mean) {
  uint32_t b[W];
  uint32_t c = 0;
#pragma unroll
  for (int p = 0; p < W; ++p) {
    b[p] = __float_as_uint(v[p]);
    c = max(c, FixedCode(b[p]));
  }
  if (c == 255u) {
    bool pos = false, neg = false;
#pragma unroll
    for (int p = 0; p < W; ++p) {
      const bool nan = (b[p] & 0x7fffffffu) > 0x7f800000u;
      pos |= nan || b[p] == 0x7f800000u;
      neg |= nan || b[p] == 0xff800000u;
    }
    return __uint_as_float(pos && neg ? kQuietNan : (pos ? 0x7f800000u : 0xff800000u));
  }
  if (c == 0) return 0.0f;
  long long q = 0;
#pragma unroll
  for (int p = 0; p < W; ++p) q += FixedQuantize(b[p], static_cast<int>(c));
  constexpr int m = v3::CeilLog2(W);
  if (mean && static_cast<int>(c) + m > 254) {   // the sum may overflow, the mean cannot: divide
    const float r = FixedDecode(q, static_cast<int>(c) - m);   // RNE(sum / 2^m), scale back
    return __fmul_rn(__fdiv_rn(r, static_cast<float>(W)), Pow2(m));   // (fixed_point.mean_of)
  }
  const float r = FixedDecode(q, static_cast<int>(c));
  return mean ? __fdiv_rn(r, static_cast<float>(W)) : r;
}


// The reduction a kernel instance computes (its template parameter kMode): int(Reproducible).
constexpr int kPlain = static_cast<int>(Reproducible::kNone);
constexpr int kRepV3 = static_cast<int>(Reproducible::kV3);
constexpr int kRepExact = static_cast<int>(Reproducible::kExact);

template <typename T, int W, int kMode>
__device__ __forceinline__ float ReduceElem(const float* v, Op op, bool mean) {
  if constexpr (kMode == kRepV3) {
    return v3::RepSum<W, std::is_same<T, __nv_bfloat16>::value>(v, mean);
  } else if constexpr (kMode == kRepExact) {
    return FixedSum<W>(v, mean);
  } else {
    return Fold<W>(v, op, mean);
  }
}

// The reduction of W 8-byte words (one per rank), rounded once to T.
template <typename T, int W, int kMode>
__device__ __forceinline__ uint2 ReduceWord(const uint2* v, Op op, bool mean) {
  constexpr int E = 8 / sizeof(T);
  float f[W][E];
#pragma unroll
  for (int p = 0; p < W; ++p) Vec<T>::WordToF32(v[p], f[p]);
  float r[E];
#pragma unroll
  for (int e = 0; e < E; ++e) {
    float col[W];
#pragma unroll
    for (int p = 0; p < W; ++p) col[p] = f[p][e];
    r[e] = ReduceElem<T, W, kMode>(col, op, mean);
  }
  return Vec<T>::WordFromF32(r);
}

// The reduction of W 16-byte vectors: two independent words (every element on its own).
template <typename T, int W, int kMode>
__device__ __forceinline__ uint4 ReduceVec(const uint4* v, Op op, bool mean) {
  uint2 lo[W], hi[W];
#pragma unroll
  for (int p = 0; p < W; ++p) {
    lo[p] = make_uint2(v[p].x, v[p].y);
    hi[p] = make_uint2(v[p].z, v[p].w);
  }
  const uint2 a = ReduceWord<T, W, kMode>(lo, op, mean), b = ReduceWord<T, W, kMode>(hi, op, mean);
  return make_uint4(a.x, a.y, b.x, b.y);
}

// Copies vectors [lo, hi) with this thread's grid-stride indices (lo + first + k * stride), four
// independent 16-byte loads in flight before their stores (the element-to-block mapping is the
// plain grid-stride one, which the barriers rely on).
__device__ __forceinline__ void CopyVecs(uint4* dst, const uint4* src, int64_t lo, int64_t hi,
                                         int64_t first, int64_t stride) {
  int64_t j = lo + first;
  for (; j + 3 * stride < hi; j += 4 * stride) {
    const uint4 t0 = __ldcg(src + j), t1 = __ldcg(src + j + stride);
    const uint4 t2 = __ldcg(src + j + 2 * stride), t3 = __ldcg(src + j + 3 * stride);
    dst[j] = t0; dst[j + stride] = t1; dst[j + 2 * stride] = t2; dst[j + 3 * stride] = t3;
  }
  for (; j < hi; j += stride) dst[j] = __ldcg(src + j);
}

// out[j] = reduction over src[0..W) at j, for this thread's grid-stride j in [lo, hi); two
// indices per step when W is small so that enough loads are in flight. Also stores to `also`.
template <typename T, int W, int kMode>
__device__ __forceinline__ void ReduceVecs(uint4* out, uint4* also, const uint4* const* src,
                                           int64_t lo, int64_t hi, int64_t first, int64_t stride,
                                           Op op, bool mean) {
  int64_t j = lo + first;
  if constexpr (W <= 4) {
    for (; j + stride < hi; j += 2 * stride) {
      uint4 v[W], u[W];
#pragma unroll
      for (int p = 0; p < W; ++p) { v[p] = __ldcg(src[p] + j); u[p] = __ldcg(src[p] + j + stride); }
      const uint4 r0 = ReduceVec<T, W, kMode>(v, op, mean);
      const uint4 r1 = ReduceVec<T, W, kMode>(u, op, mean);
      out[j] = r0; out[j + stride] = r1;
      if (also != nullptr) { also[j] = r0; also[j + stride] = r1; }
    }
  }
  for (; j < hi; j += stride) {
    uint4 v[W];
#pragma unroll
    for (int p = 0; p < W; ++p) v[p] = __ldcg(src[p] + j);
    const uint4 r = ReduceVec<T, W, kMode>(v, op, mean);
    out[j] = r;
    if (also != nullptr) also[j] = r;
  }
}

// The < E elements after the last whole vector: reduced by block 0 (same order, same bits).
template <typename T, int W, int kMode>
__device__ __forceinline__ void ReduceTail(T* out, T* also, const uint4* const* src, int64_t base,
                                          int tail, Op op, bool mean) {
  if (blockIdx.x != 0 || threadIdx.x >= tail) return;
  const int64_t j = base + threadIdx.x;
  float v[W];
#pragma unroll
  for (int p = 0; p < W; ++p) v[p] = Vec<T>::ScalarToF32(reinterpret_cast<const T*>(src[p])[j]);
  const T r = Vec<T>::ScalarFromF32(ReduceElem<T, W, kMode>(v, op, mean));
  out[j] = r;
  if (also != nullptr) also[j] = r;
}

// --- the rank's region -----------------------------------------------------------------------

struct Region {
  char* base;
  __device__ __forceinline__ uint32_t* landing() const { return reinterpret_cast<uint32_t*>(base); }
  __device__ __forceinline__ uint32_t* epoch() const {
    return reinterpret_cast<uint32_t*>(base + kEpochOffset);
  }
  __device__ __forceinline__ uint32_t* done() const { return epoch() + 1; }
  __device__ __forceinline__ uint4* stage(uint32_t parity, size_t capacity) const {
    return reinterpret_cast<uint4*>(base + kHeaderBytes + parity * capacity);
  }
  // The low-latency slot that rank `from` pushes into, in this region.
  __device__ __forceinline__ uint4* ll(uint32_t parity, int from, size_t capacity) const {
    return reinterpret_cast<uint4*>(base + kHeaderBytes + 2 * capacity +
                                    (parity * kMaxRanks + from) * kLLSlotBytes);
  }
};

__device__ __forceinline__ void StoreLine(uint4* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}

__device__ __forceinline__ uint4 LoadLine(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
  return v;
}

// Records a timeout in the host-mapped error words and traps (see Barrier).
__device__ __forceinline__ void Timeout(const LaunchArgs& a, int rank, int peer, uint32_t value) {
  if (a.error != nullptr) {
    volatile uint32_t* err = a.error;
    err[1] = static_cast<uint32_t>(rank);
    err[2] = static_cast<uint32_t>(peer);
    err[3] = value;
    __threadfence_system();
    err[0] = 1;
    __threadfence_system();
  }
  __trap();
}

// Barrier of this block with the blocks of the same index on all W ranks. A timeout records
// {1, rank, peer, value} in the host-mapped error words and traps.
template <int W>
__device__ __forceinline__ void Barrier(const LaunchArgs& a, int rank, uint32_t value) {
  __syncthreads();  // every thread's stores of this block precede the signal
  if (threadIdx.x < W) {
    const int p = threadIdx.x;
    uint32_t* peer_landing = reinterpret_cast<uint32_t*>(a.peers.region[p]);
    __threadfence_system();
    StoreReleaseSys(peer_landing + blockIdx.x * kMaxRanks + rank, value);
    const uint32_t* mine =
        reinterpret_cast<const uint32_t*>(a.peers.region[rank]) + blockIdx.x * kMaxRanks + p;
    uint64_t start = 0;
    uint32_t spins = 0;
    while (static_cast<int32_t>(LoadAcquireSys(mine) - value) < 0) {
      if (a.timeout_ns != 0 && (++spins & 255u) == 0) {
        const uint64_t now = GlobalTimerNs();
        if (start == 0) {
          start = now;
        } else if (now - start > a.timeout_ns) {
          Timeout(a, rank, p, value);
        }
      }
    }
  }
  __syncthreads();
}

// Reads this call's epoch (the same in every block: it only changes when the last block ends).
__device__ __forceinline__ uint32_t BeginCall(const Region& me) {
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) s_epoch = *reinterpret_cast<volatile uint32_t*>(me.epoch());
  __syncthreads();
  return s_epoch;
}

// The last block of this rank to finish advances the epoch for the next call.
__device__ __forceinline__ void EndCall(const Region& me, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t finished = atomicAdd(me.done(), 1u) + 1u;
    if (finished == gridDim.x) {
      *me.done() = 0;
      *reinterpret_cast<volatile uint32_t*>(me.epoch()) = epoch + 1u;
      __threadfence();
    }
  }
}

// --- one-shot: copy in, barrier, every rank reduces everything --------------------------------

template <typename T, int W, int kMode>
__global__ void __launch_bounds__(kThreads) OneShotKernel(const LaunchArgs a) {
  constexpr int E = Vec<T>::kElems;
  const int local = blockIdx.y;
  const int rank = a.rank0 + local;
  const Region me{a.peers.region[rank]};
  const uint32_t epoch = BeginCall(me);
  const uint32_t parity = epoch & 1u;
  const int64_t nv = a.count / E;
  const int tail = static_cast<int>(a.count - nv * E);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const uint4* in = static_cast<const uint4*>(a.io[local].in);
  uint4* out = static_cast<uint4*>(a.io[local].out);
  uint4* mine = me.stage(parity, a.capacity);
  CopyVecs(mine, in, 0, nv, first, stride);
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    reinterpret_cast<T*>(mine)[nv * E + threadIdx.x] =
        static_cast<const T*>(a.io[local].in)[nv * E + threadIdx.x];
  }

  Barrier<W>(a, rank, 2u * epoch + 1u);

  const uint4* src[W];
#pragma unroll
  for (int p = 0; p < W; ++p) src[p] = Region{a.peers.region[p]}.stage(parity, a.capacity);
  src[rank] = in;   // this rank's own values: straight from its input, not its stage copy
  ReduceVecs<T, W, kMode>(out, nullptr, src, 0, nv, first, stride, a.op, a.mean);
  ReduceTail<T, W, kMode>(static_cast<T*>(a.io[local].out), nullptr, src, nv * E, tail, a.op,
                         a.mean);
  EndCall(me, epoch);
}

// --- one-shot, low latency: push lines to every peer, reduce what the peers pushed -------------
//
// Word w (8 bytes; the last one may be partial and is zero-padded) of rank r's input travels as
// line w of slot r in every peer's low-latency area: {bytes 0-3, flag, bytes 4-7, flag} with
// flag = 2E + 1 for the call with epoch E. A reader spins on its local copy of the line until both
// flags show this call, so no barrier and no remote read is needed. Slots alternate with the
// epoch's parity; a peer can only be one call ahead (it needs this rank's lines of the current
// call to finish it), so it never overwrites a slot this rank may still read.

template <typename T>
__device__ __forceinline__ uint2 LoadWord(const T* in, int64_t w, int64_t count) {
  constexpr int E = 8 / sizeof(T);
  if ((w + 1) * E <= count) return reinterpret_cast<const uint2*>(in)[w];
  T v[E];
#pragma unroll
  for (int e = 0; e < E; ++e) v[e] = w * E + e < count ? in[w * E + e] : Vec<T>::ScalarFromF32(0.f);
  return *reinterpret_cast<const uint2*>(v);
}

template <typename T>
__device__ __forceinline__ void StoreWord(T* out, int64_t w, const uint2& r, int64_t count) {
  constexpr int E = 8 / sizeof(T);
  if ((w + 1) * E <= count) {
    reinterpret_cast<uint2*>(out)[w] = r;
    return;
  }
  const T* v = reinterpret_cast<const T*>(&r);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (w * E + e < count) out[w * E + e] = v[e];
  }
}

template <typename T, int W, int kMode>
__global__ void __launch_bounds__(kThreads) OneShotLLKernel(const LaunchArgs a) {
  constexpr int E = 8 / sizeof(T);
  const int local = blockIdx.y;
  const int rank = a.rank0 + local;
  const Region me{a.peers.region[rank]};
  const uint32_t epoch = BeginCall(me);
  const uint32_t parity = epoch & 1u;
  const uint32_t flag = 2u * epoch + 1u;
  const int64_t words = (a.count + E - 1) / E;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const T* in = static_cast<const T*>(a.io[local].in);
  T* out = static_cast<T*>(a.io[local].out);

  for (int64_t w = first; w < words; w += stride) {
    const uint2 d = LoadWord(in, w, a.count);
    const uint4 line = make_uint4(d.x, flag, d.y, flag);
#pragma unroll
    for (int p = 0; p < W; ++p) {
      if (p != rank) StoreLine(Region{a.peers.region[p]}.ll(parity, rank, a.capacity) + w, line);
    }
  }
  for (int64_t w = first; w < words; w += stride) {
    uint2 v[W];
#pragma unroll
    for (int p = 0; p < W; ++p) {
      if (p == rank) {
        v[p] = LoadWord(in, w, a.count);
        continue;
      }
      const uint4* src = me.ll(parity, p, a.capacity) + w;
      uint4 line = LoadLine(src);
      uint64_t start = 0;
      uint32_t spins = 0;
      while (line.y != flag || line.w != flag) {
        if (a.timeout_ns != 0 && (++spins & 1023u) == 0) {
          const uint64_t now = GlobalTimerNs();
          if (start == 0) {
            start = now;
          } else if (now - start > a.timeout_ns) {
            Timeout(a, rank, p, flag);
          }
        }
        line = LoadLine(src);
      }
      v[p] = make_uint2(line.x, line.z);
    }
    StoreWord(out, w, ReduceWord<T, W, kMode>(v, a.op, a.mean), a.count);
  }
  EndCall(me, epoch);
}

// --- two-shot: copy in, barrier, reduce own segment in place (reduce-scatter), barrier, gather ---
//
// The nv vectors are cut into W contiguous segments of ceil(nv / W); rank r owns segment r. Within
// every segment, vector j (segment-local) belongs to the same block in all three phases (the
// grid-stride mapping restarted at each segment's start), so each barrier orders exactly the data
// its block exchanges. The < E tail elements are reduced redundantly by block 0 of every rank.

template <typename T, int W, int kMode>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(const LaunchArgs a) {
  constexpr int E = Vec<T>::kElems;
  const int local = blockIdx.y;
  const int rank = a.rank0 + local;
  const Region me{a.peers.region[rank]};
  const uint32_t epoch = BeginCall(me);
  const uint32_t parity = epoch & 1u;
  const int64_t nv = a.count / E;
  const int tail = static_cast<int>(a.count - nv * E);
  const int64_t seg = (nv + W - 1) / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const uint4* in = static_cast<const uint4*>(a.io[local].in);
  uint4* out = static_cast<uint4*>(a.io[local].out);
  uint4* mine = me.stage(parity, a.capacity);
#pragma unroll
  for (int s = 0; s < W; ++s) {   // peers read segment s of this stage; this rank reads its input
    if (s == rank) continue;
    const int64_t lo = s * seg, hi = min(nv, lo + seg);
    CopyVecs(mine, in, lo, hi, first, stride);
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    reinterpret_cast<T*>(mine)[nv * E + threadIdx.x] =
        static_cast<const T*>(a.io[local].in)[nv * E + threadIdx.x];
  }

  Barrier<W>(a, rank, 2u * epoch + 1u);

  const uint4* src[W];
#pragma unroll
  for (int p = 0; p < W; ++p) src[p] = Region{a.peers.region[p]}.stage(parity, a.capacity);
  src[rank] = in;
  {
    const int64_t lo = rank * seg, hi = min(nv, lo + seg);
    // The reduced segment goes to the output and to segment `rank` of this stage (which no
    // copy-in wrote), where the peers gather it after the second barrier.
    ReduceVecs<T, W, kMode>(out, mine, src, lo, hi, first, stride, a.op, a.mean);
    ReduceTail<T, W, kMode>(static_cast<T*>(a.io[local].out), nullptr, src, nv * E, tail, a.op,
                           a.mean);
  }

  Barrier<W>(a, rank, 2u * epoch + 2u);
#pragma unroll
  for (int q = 1; q < W; ++q) {  // peers in the order rank+1, rank+2, ... spreads link load
    const int p = (rank + q) % W;
    const uint4* sp = Region{a.peers.region[p]}.stage(parity, a.capacity);  // p is dynamic
    const int64_t lo = p * seg, hi = min(nv, lo + seg);
    CopyVecs(out, sp, lo, hi, first, stride);
  }
  EndCall(me, epoch);
}

}  // namespace dtenjax::p2p::device
