// CUDA launcher for top-k compression's packing step: the same contract as
// csrc/topk/pack.h (first min(count, k) elements with |x| >= threshold, ascending index
// order; unused slots idx = n, val = 0), without any host synchronisation, so it can run inside a
// CUDA graph. The threshold is read from device memory.
//
// workspace holds num_blocks int32 (per-block counts, then their exclusive prefix sums); the
// caller chooses num_blocks >= 1 (more blocks: more parallelism; see dtenjax/_src/compression/topk.py).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "csrc/common/status.h"

namespace dtenjax::compress {

Status LaunchPackAboveThreshold(const float* x, int64_t n, const float* threshold, int64_t k,
                                int32_t* workspace, int64_t num_blocks, int32_t* idx, float* val,
                                int32_t* count, cudaStream_t stream);

}  // namespace dtenjax::compress
