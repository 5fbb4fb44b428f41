// Threshold packing for top-k gradient compression (host code; no XLA, no CUDA).
//
// Given x[n] and a threshold t, writes the first min(count, k) elements with |x[i]| >= t, in
// ascending index order, into fixed-size buffers idx[k] / val[k]; unused slots get idx = n (an
// out-of-range index that a scatter with mode="drop" ignores) and val = 0. Returns count, the
// number of elements with |x[i]| >= t (which may exceed k). NaN never passes the threshold.
// The CUDA launcher (csrc/topk/pack_cuda.h) produces identical outputs.
#pragma once

#include <cstdint>

#include "csrc/common/status.h"

namespace dtenjax::compress {

Status PackAboveThreshold(const float* x, int64_t n, float threshold, int64_t k, int32_t* idx,
                          float* val, int32_t* count);

}  // namespace dtenjax::compress
