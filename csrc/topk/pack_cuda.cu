// Stream compaction of the elements above a threshold into fixed-size (index, value) buffers.
// Four launches, no host synchronisation, no allocation:
//   1. CountKernel:  block b counts |x| >= t over its contiguous chunk -> workspace[b]
//   2. ScanKernel:   one block turns workspace into exclusive offsets, writes the total count
//   3. WriteKernel:  block b re-reads its chunk and writes flagged elements at
//                    offset[b] + (prefix within the chunk), ascending index order, while < k
//   4. FillKernel:   slots [min(count, k), k) get idx = n, val = 0
// Each pass reads x once with 16-byte loads, so the whole step moves about 2 * 4n bytes.
#include "csrc/topk/pack_cuda.h"

#include <string>

namespace dtenjax::compress {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 4;
constexpr int64_t kTile = kThreads * kItems;
constexpr int kWarps = kThreads / 32;
constexpr int kScanThreads = 1024;

template <bool kVec>
__device__ __forceinline__ void Load4(const float* __restrict__ x, int64_t n, int64_t base,
                                      float (&v)[kItems], bool (&ok)[kItems]) {
  if (kVec && base + kItems <= n) {
    const float4 q = *reinterpret_cast<const float4*>(x + base);
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
#pragma unroll
    for (int j = 0; j < kItems; ++j) ok[j] = true;
  } else {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      ok[j] = base + j < n;
      v[j] = ok[j] ? x[base + j] : 0.0f;
    }
  }
}

template <bool kVec>
__global__ void CountKernel(const float* __restrict__ x, int64_t n, const float* __restrict__ thr,
                            int64_t chunk_tiles, int32_t* __restrict__ counts) {
  __shared__ int32_t s_warp[kWarps];
  const float t = *thr;
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * chunk_tiles;
  int32_t c = 0;
  for (int64_t tile = tile0; tile < tile0 + chunk_tiles; ++tile) {
    const int64_t base = tile * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
    if (base >= n) break;
    float v[kItems];
    bool ok[kItems];
    Load4<kVec>(x, n, base, v, ok);
#pragma unroll
    for (int j = 0; j < kItems; ++j) c += (ok[j] && fabsf(v[j]) >= t) ? 1 : 0;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_down_sync(0xffffffffu, c, o);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) s_warp[warp] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < kWarps; ++w) total += s_warp[w];
    counts[blockIdx.x] = total;
  }
}

__global__ void ScanKernel(int32_t* __restrict__ counts, int64_t num_blocks,
                           int32_t* __restrict__ total_out) {
  __shared__ int32_t s_warp[kScanThreads / 32];
  const int64_t per = (num_blocks + kScanThreads - 1) / kScanThreads;
  const int64_t lo = static_cast<int64_t>(threadIdx.x) * per;
  const int64_t hi = min(lo + per, num_blocks);
  int32_t local = 0;
  for (int64_t i = lo; i < hi; ++i) local += counts[i];
  // Inclusive scan of `local` over the block: warp shuffles, then the warp totals.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t incl = local;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) s_warp[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t w = s_warp[lane];
    int32_t wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += y;
    }
    s_warp[lane] = wi - w;  // exclusive prefix of warp totals
    if (lane == 31) *total_out = wi;
  }
  __syncthreads();
  int32_t run = s_warp[warp] + incl - local;
  for (int64_t i = lo; i < hi; ++i) {
    const int32_t c = counts[i];
    counts[i] = run;
    run += c;
  }
}

template <bool kVec>
__global__ void WriteKernel(const float* __restrict__ x, int64_t n, const float* __restrict__ thr,
                            int64_t chunk_tiles, const int32_t* __restrict__ offsets, int64_t k,
                            int32_t* __restrict__ idx, float* __restrict__ val) {
  __shared__ int32_t s_excl[kWarps];
  __shared__ int32_t s_total;
  const float t = *thr;
  int64_t running = offsets[blockIdx.x];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t tile0 = static_cast<int64_t>(blockIdx.x) * chunk_tiles;
  for (int64_t tile = tile0; tile < tile0 + chunk_tiles; ++tile) {
    if (running >= k || tile * kTile >= n) break;  // uniform over the block
    const int64_t base = tile * kTile + static_cast<int64_t>(threadIdx.x) * kItems;
    float v[kItems];
    bool ok[kItems];
    Load4<kVec>(x, n, base, v, ok);
    bool f[kItems];
    int32_t c = 0;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      f[j] = ok[j] && fabsf(v[j]) >= t;
      c += f[j] ? 1 : 0;
    }
    int32_t incl = c;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int32_t y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    if (lane == 31) s_excl[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      const int32_t w = lane < kWarps ? s_excl[lane] : 0;
      int32_t wi = w;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int32_t y = __shfl_up_sync(0xffffffffu, wi, o);
        if (lane >= o) wi += y;
      }
      if (lane < kWarps) s_excl[lane] = wi - w;
      if (lane == 31) s_total = wi;
    }
    __syncthreads();
    int64_t pos = running + s_excl[warp] + (incl - c);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (f[j]) {
        if (pos < k) {
          idx[pos] = static_cast<int32_t>(base + j);
          val[pos] = v[j];
        }
        ++pos;
      }
    }
    running += s_total;
    __syncthreads();  // s_excl / s_total are rewritten by the next tile
  }
}

__global__ void FillKernel(const int32_t* __restrict__ total, int64_t n, int64_t k,
                           int32_t* __restrict__ idx, float* __restrict__ val) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j < k && j >= static_cast<int64_t>(*total)) {
    idx[j] = static_cast<int32_t>(n);
    val[j] = 0.0f;
  }
}

}  // namespace

Status LaunchPackAboveThreshold(const float* x, int64_t n, const float* threshold, int64_t k,
                                int32_t* workspace, int64_t num_blocks, int32_t* idx, float* val,
                                int32_t* count, cudaStream_t stream) {
  DTENJAX_CHECK_ARG(n >= 0 && n < (int64_t{1} << 31),
                    "topk pack: n=" + std::to_string(n) + " does not fit int32 indices");
  DTENJAX_CHECK_ARG(num_blocks >= 1 && num_blocks <= (int64_t{1} << 20),
                    "topk pack: workspace of " + std::to_string(num_blocks) +
                        " blocks is outside [1, 2^20]");
  DTENJAX_CHECK_ARG(k >= 0 && k <= (int64_t{1} << 31), "topk pack: bad k " + std::to_string(k));
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t chunk_tiles = tiles == 0 ? 1 : (tiles + num_blocks - 1) / num_blocks;
  const bool vec = (reinterpret_cast<uintptr_t>(x) % 16) == 0;
  const dim3 grid(static_cast<unsigned>(num_blocks));
  if (vec) {
    CountKernel<true><<<grid, kThreads, 0, stream>>>(x, n, threshold, chunk_tiles, workspace);
  } else {
    CountKernel<false><<<grid, kThreads, 0, stream>>>(x, n, threshold, chunk_tiles, workspace);
  }
  DTENJAX_CUDA_CHECK_LAUNCH("topk pack: count");
  ScanKernel<<<1, kScanThreads, 0, stream>>>(workspace, num_blocks, count);
  DTENJAX_CUDA_CHECK_LAUNCH("topk pack: scan");
  if (k == 0) return Status::Ok();
  if (vec) {
    WriteKernel<true><<<grid, kThreads, 0, stream>>>(x, n, threshold, chunk_tiles, workspace, k,
                                                     idx, val);
  } else {
    WriteKernel<false><<<grid, kThreads, 0, stream>>>(x, n, threshold, chunk_tiles, workspace, k,
                                                      idx, val);
  }
  DTENJAX_CUDA_CHECK_LAUNCH("topk pack: write");
  const unsigned fill_blocks = static_cast<unsigned>((k + kThreads - 1) / kThreads);
  FillKernel<<<fill_blocks, kThreads, 0, stream>>>(count, n, k, idx, val);
  DTENJAX_CUDA_CHECK_LAUNCH("topk pack: fill");
  return Status::Ok();
}

}  // namespace dtenjax::compress
