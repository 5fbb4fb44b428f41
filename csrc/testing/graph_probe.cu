// Fused scale-and-add (out = scale * x + y) over float32: a small, real CUDA kernel that dtenjax uses
// to check that its FFI custom calls are captured inside XLA's command buffers (CUDA graphs) instead
// of splitting them (bench/cuda_graphs.py, dtenjax.graph_report). Host launcher only; no XLA here.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "csrc/common/status.h"

namespace dtenjax::cuda {

namespace {

__global__ void ScaleAddKernel(const float* __restrict__ x, const float* __restrict__ y, float scale,
                               float* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = scale * x[i] + y[i];
  }
}

}  // namespace

Status LaunchScaleAdd(const float* x, const float* y, float scale, float* out, int64_t n,
                      cudaStream_t stream) {
  DTENJAX_CHECK_ARG(n >= 0, "scale_add: negative element count");
  if (n == 0) return Status::Ok();
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 4096 ? wanted : 4096);
  ScaleAddKernel<<<blocks, kThreads, 0, stream>>>(x, y, scale, out, n);
  DTENJAX_CUDA_CHECK_LAUNCH("scale_add kernel");
  return Status::Ok();
}

}  // namespace dtenjax::cuda
