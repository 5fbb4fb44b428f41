// Device code of the NVLink peer-to-peer all-reduce (one-shot and two-shot). No XLA, no host code.
//
// Bit contract (identical on every rank, and between one-shot and two-shot): element i of the
// result is  round_T( (...((f32(x_0[i]) + f32(x_1[i])) + f32(x_2[i])) + ... ) + f32(x_{W-1}[i]) ),
// i.e. ranks summed in order 0..W-1 with float32 accumulation (no FMA, no pairwise tree, the first
// term is x_0 itself, not 0 + x_0), rounded once to T with round-to-nearest-even. For f32 the
// final rounding is the identity.
//
// Synchronisation: a block-level barrier between the blocks with the same blockIdx.x of every rank.
// Each rank keeps per-block counters in its own region; a barrier writes counter value v into the
// block's landing slot of every peer (st.release.sys after __threadfence_system) and waits until
// each peer has written >= v into its own slots (ld.acquire.sys), with a %globaltimer timeout.
// Every block uses the same element-to-block mapping before and after a barrier, so a block only
// ever reads peer data that the peers' blocks of the same index wrote before signalling it.
// Stage buffers are double-buffered by the call parity: a peer that has reached call k+1 has
// finished all of call k-1 (kernels on one stream are serialised), so the parity buffer of call
// k-1 is free again when call k+1 starts. Hence no end barrier and no flag reset.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "csrc/cuda/p2p_allreduce.h"

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

// --- 16-byte vectors of T <-> float32 --------------------------------------------------------

template <typename T> struct Vec;

template <> struct Vec<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void ToF32(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 FromF32(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
  }
  __device__ __forceinline__ static float ScalarToF32(float x) { return x; }
  __device__ __forceinline__ static float ScalarFromF32(float x) { return x; }
  __device__ __forceinline__ static uint4 NanVec() {
    return make_uint4(0x7fc00000u, 0x7fc00000u, 0x7fc00000u, 0x7fc00000u);
  }
  __device__ __forceinline__ static float NanScalar() { return __uint_as_float(0x7fc00000u); }
};

template <> struct Vec<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static float2 Pair(uint32_t w) {
    __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&w);
    return __bfloat1622float2(h);
  }
  __device__ __forceinline__ static uint32_t Pack(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float ScalarToF32(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 ScalarFromF32(float x) {
    return __float2bfloat16_rn(x);
  }
  __device__ __forceinline__ static uint4 NanVec() {
    return make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
  }
  __device__ __forceinline__ static __nv_bfloat16 NanScalar() {
    return __ushort_as_bfloat16(static_cast<unsigned short>(0x7fc0));
  }
  __device__ __forceinline__ static void ToF32(const uint4& v, float* f) {
    float2 a = Pair(v.x), b = Pair(v.y), c = Pair(v.z), d = Pair(v.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
  }
  __device__ __forceinline__ static uint4 FromF32(const float* f) {
    return make_uint4(Pack(f[0], f[1]), Pack(f[2], f[3]), Pack(f[4], f[5]), Pack(f[6], f[7]));
  }
};

template <> struct Vec<__half> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static float2 Pair(uint32_t w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
  }
  __device__ __forceinline__ static uint32_t Pack(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float ScalarToF32(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half ScalarFromF32(float x) { return __float2half_rn(x); }
  __device__ __forceinline__ static uint4 NanVec() {
    return make_uint4(0x7e007e00u, 0x7e007e00u, 0x7e007e00u, 0x7e007e00u);
  }
  __device__ __forceinline__ static __half NanScalar() {
    return __ushort_as_half(static_cast<unsigned short>(0x7e00));
  }
  __device__ __forceinline__ static void ToF32(const uint4& v, float* f) {
    float2 a = Pair(v.x), b = Pair(v.y), c = Pair(v.z), d = Pair(v.w);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y; f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
  }
  __device__ __forceinline__ static uint4 FromF32(const float* f) {
    return make_uint4(Pack(f[0], f[1]), Pack(f[2], f[3]), Pack(f[4], f[5]), Pack(f[6], f[7]));
  }
};

// Sum of W vectors in rank order with f32 accumulation, rounded once to T.
template <typename T, int W>
__device__ __forceinline__ uint4 ReduceVec(const uint4* v) {
  constexpr int E = Vec<T>::kElems;
  float acc[E];
  Vec<T>::ToF32(v[0], acc);
#pragma unroll
  for (int p = 1; p < W; ++p) {
    float f[E];
    Vec<T>::ToF32(v[p], f);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] = __fadd_rn(acc[e], f[e]);  // never contracted to FMA
  }
  return Vec<T>::FromF32(acc);
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

// out[j] = rank-order sum over src[0..W) at j, for this thread's grid-stride j in [lo, hi); two
// indices per step when W is small so that enough loads are in flight. Also stores to `also`.
template <typename T, int W>
__device__ __forceinline__ void ReduceVecs(uint4* out, uint4* also, const uint4* const* src,
                                           int64_t lo, int64_t hi, int64_t first, int64_t stride,
                                           bool failed) {
  int64_t j = lo + first;
  if constexpr (W <= 4) {
    for (; j + stride < hi; j += 2 * stride) {
      uint4 v[W], u[W];
#pragma unroll
      for (int p = 0; p < W; ++p) { v[p] = __ldcg(src[p] + j); u[p] = __ldcg(src[p] + j + stride); }
      const uint4 r0 = failed ? Vec<T>::NanVec() : ReduceVec<T, W>(v);
      const uint4 r1 = failed ? Vec<T>::NanVec() : ReduceVec<T, W>(u);
      out[j] = r0; out[j + stride] = r1;
      if (also != nullptr) { also[j] = r0; also[j + stride] = r1; }
    }
  }
  for (; j < hi; j += stride) {
    uint4 v[W];
#pragma unroll
    for (int p = 0; p < W; ++p) v[p] = __ldcg(src[p] + j);
    const uint4 r = failed ? Vec<T>::NanVec() : ReduceVec<T, W>(v);
    out[j] = r;
    if (also != nullptr) also[j] = r;
  }
}

// --- the rank's region -----------------------------------------------------------------------

struct Region {
  char* base;
  __device__ __forceinline__ uint32_t* landing() const { return reinterpret_cast<uint32_t*>(base); }
  __device__ __forceinline__ uint32_t* calls() const { return landing() + kMaxBlocks * kMaxRanks; }
  __device__ __forceinline__ uint32_t* barriers() const { return calls() + kMaxBlocks; }
  __device__ __forceinline__ uint4* stage(uint32_t parity, size_t capacity) const {
    return reinterpret_cast<uint4*>(base + kHeaderBytes + parity * capacity);
  }
};

// Barrier of this block with the blocks of the same index on all W ranks. Sets *fail on timeout.
template <int W>
__device__ __forceinline__ void Barrier(const LaunchArgs& a, int rank, uint32_t value, int* fail) {
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
          *fail = 1;
          if (a.error != nullptr) {
            volatile uint32_t* err = a.error;
            err[1] = static_cast<uint32_t>(rank);
            err[2] = static_cast<uint32_t>(p);
            err[3] = value;
            __threadfence_system();
            err[0] = 1;
          }
          break;
        }
      }
    }
  }
  __syncthreads();
}

// --- one-shot: copy in, barrier, every rank reduces everything --------------------------------

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) OneShotKernel(const LaunchArgs a) {
  constexpr int E = Vec<T>::kElems;
  const int local = blockIdx.y;
  const int rank = a.rank0 + local;
  const Region me{a.peers.region[rank]};
  __shared__ uint32_t s_call, s_bar;
  __shared__ int s_fail;
  if (threadIdx.x == 0) {
    s_call = me.calls()[blockIdx.x];
    s_bar = me.barriers()[blockIdx.x];
    s_fail = 0;
  }
  __syncthreads();
  const uint32_t parity = s_call & 1u;
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

  Barrier<W>(a, rank, s_bar + 1, &s_fail);
  const bool failed = s_fail != 0;

  const uint4* src[W];
#pragma unroll
  for (int p = 0; p < W; ++p) src[p] = Region{a.peers.region[p]}.stage(parity, a.capacity);
  ReduceVecs<T, W>(out, nullptr, src, 0, nv, first, stride, failed);
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    const int64_t j = nv * E + threadIdx.x;
    float acc = Vec<T>::ScalarToF32(reinterpret_cast<const T*>(src[0])[j]);
#pragma unroll
    for (int p = 1; p < W; ++p) {
      acc = __fadd_rn(acc, Vec<T>::ScalarToF32(reinterpret_cast<const T*>(src[p])[j]));
    }
    static_cast<T*>(a.io[local].out)[j] = failed ? Vec<T>::NanScalar() : Vec<T>::ScalarFromF32(acc);
  }
  if (threadIdx.x == 0) {
    me.calls()[blockIdx.x] = s_call + 1;
    me.barriers()[blockIdx.x] = s_bar + 1;
  }
}

// --- two-shot: copy in, barrier, reduce own segment in place (reduce-scatter), barrier, gather ---
//
// The nv vectors are cut into W contiguous segments of ceil(nv / W); rank r owns segment r. Within
// every segment, vector j (segment-local) belongs to block (j / kThreads) % gridDim.x in all three
// phases, so each barrier orders exactly the data its block exchanges. The < E tail elements are
// reduced redundantly by block 0 of every rank (same order, same bits).

template <typename T, int W>
__global__ void __launch_bounds__(kThreads) TwoShotKernel(const LaunchArgs a) {
  constexpr int E = Vec<T>::kElems;
  const int local = blockIdx.y;
  const int rank = a.rank0 + local;
  const Region me{a.peers.region[rank]};
  __shared__ uint32_t s_call, s_bar;
  __shared__ int s_fail;
  if (threadIdx.x == 0) {
    s_call = me.calls()[blockIdx.x];
    s_bar = me.barriers()[blockIdx.x];
    s_fail = 0;
  }
  __syncthreads();
  const uint32_t parity = s_call & 1u;
  const int64_t nv = a.count / E;
  const int tail = static_cast<int>(a.count - nv * E);
  const int64_t seg = (nv + W - 1) / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const uint4* in = static_cast<const uint4*>(a.io[local].in);
  uint4* out = static_cast<uint4*>(a.io[local].out);
  uint4* mine = me.stage(parity, a.capacity);
#pragma unroll
  for (int s = 0; s < W; ++s) {
    const int64_t lo = s * seg, hi = min(nv, lo + seg);
    CopyVecs(mine, in, lo, hi, first, stride);
  }
  if (blockIdx.x == 0 && threadIdx.x < tail) {
    reinterpret_cast<T*>(mine)[nv * E + threadIdx.x] =
        static_cast<const T*>(a.io[local].in)[nv * E + threadIdx.x];
  }

  Barrier<W>(a, rank, s_bar + 1, &s_fail);

  const uint4* src[W];
#pragma unroll
  for (int p = 0; p < W; ++p) src[p] = Region{a.peers.region[p]}.stage(parity, a.capacity);
  {
    const bool failed = s_fail != 0;
    const int64_t lo = rank * seg, hi = min(nv, lo + seg);
    // In place: only this rank's blocks read segment `rank` of its own stage in this phase.
    ReduceVecs<T, W>(out, mine, src, lo, hi, first, stride, failed);
    if (blockIdx.x == 0 && threadIdx.x < tail) {
      const int64_t j = nv * E + threadIdx.x;
      float acc = Vec<T>::ScalarToF32(reinterpret_cast<const T*>(src[0])[j]);
#pragma unroll
      for (int p = 1; p < W; ++p) {
        acc = __fadd_rn(acc, Vec<T>::ScalarToF32(reinterpret_cast<const T*>(src[p])[j]));
      }
      static_cast<T*>(a.io[local].out)[j] = failed ? Vec<T>::NanScalar() : Vec<T>::ScalarFromF32(acc);
    }
  }

  Barrier<W>(a, rank, s_bar + 2, &s_fail);
  const bool failed = s_fail != 0;
#pragma unroll
  for (int q = 1; q < W; ++q) {  // peers in the order rank+1, rank+2, ... spreads link load
    const int p = (rank + q) % W;
    const uint4* sp = Region{a.peers.region[p]}.stage(parity, a.capacity);  // p is dynamic
    const int64_t lo = p * seg, hi = min(nv, lo + seg);
    if (failed) {
      for (int64_t j = lo + first; j < hi; j += stride) out[j] = Vec<T>::NanVec();
    } else {
      CopyVecs(out, sp, lo, hi, first, stride);
    }
  }
  if (threadIdx.x == 0) {
    me.calls()[blockIdx.x] = s_call + 1;
    me.barriers()[blockIdx.x] = s_bar + 2;
  }
}

}  // namespace dtenjax::p2p::device
