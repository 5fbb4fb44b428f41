// The kernel instances of the p2p all-reduce, one translation unit per dtype (p2p_kernels_*.cu)
// so that nvcc compiles them in parallel. Host code picks an instance through these tables.
#pragma once

#include "csrc/cuda/p2p_allreduce.h"

namespace dtenjax::p2p {

using KernelFn = void (*)(const LaunchArgs);

// nullptr when there is no instance (world outside [2, 8], or `reproducible` for float16).
KernelFn PickF32(Algorithm alg, int world, bool reproducible);
KernelFn PickBF16(Algorithm alg, int world, bool reproducible);
KernelFn PickF16(Algorithm alg, int world, bool reproducible);

}  // namespace dtenjax::p2p
