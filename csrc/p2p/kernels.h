// The kernel instances of the p2p all-reduce, one translation unit per dtype (kernels_*.cu)
// so that nvcc compiles them in parallel. Host code picks an instance through these tables.
#pragma once

#include "csrc/p2p/allreduce.h"

namespace dtenjax::p2p {

using KernelFn = void (*)(const LaunchArgs);

// rep_mode: int(Reproducible): kNone plain (Op kSum/kMax/kMin), kV3 the reproducible sum of
// contract v3, kExact the exact contract v2. nullptr when there is no instance (world outside
// [2, 8], or a reproducible mode for a dtype without one: ReproducibleDType).
KernelFn PickF32(Algorithm alg, int world, int rep_mode);
KernelFn PickBF16(Algorithm alg, int world, int rep_mode);
KernelFn PickF16(Algorithm alg, int world, int rep_mode);

}  // namespace dtenjax::p2p
