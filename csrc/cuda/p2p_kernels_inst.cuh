// Instantiates the one-shot and two-shot kernels of one dtype for worlds 2..8 (included once by
// each p2p_kernels_<dtype>.cu with DTENJAX_P2P_T, DTENJAX_P2P_PICK and DTENJAX_P2P_REP defined).
#include "csrc/cuda/p2p_allreduce.cuh"
#include "csrc/cuda/p2p_kernels.h"

namespace dtenjax::p2p {
namespace {

template <typename T, int W, bool kRep>
KernelFn Pick(Algorithm alg) {
  switch (alg) {
    case Algorithm::kOneShot: return &device::OneShotKernel<T, W, kRep>;
    case Algorithm::kTwoShot: return &device::TwoShotKernel<T, W, kRep>;
    case Algorithm::kOneShotLL: return &device::OneShotLLKernel<T, W, kRep>;
  }
  return nullptr;
}

template <typename T, bool kRep>
KernelFn PickWorld(Algorithm alg, int world) {
  switch (world) {
    case 2: return Pick<T, 2, kRep>(alg);
    case 3: return Pick<T, 3, kRep>(alg);
    case 4: return Pick<T, 4, kRep>(alg);
    case 5: return Pick<T, 5, kRep>(alg);
    case 6: return Pick<T, 6, kRep>(alg);
    case 7: return Pick<T, 7, kRep>(alg);
    case 8: return Pick<T, 8, kRep>(alg);
    default: return nullptr;
  }
}

}  // namespace

KernelFn DTENJAX_P2P_PICK(Algorithm alg, int world, bool reproducible) {
  if (reproducible) {
#if DTENJAX_P2P_REP
    return PickWorld<DTENJAX_P2P_T, true>(alg, world);
#else
    return nullptr;
#endif
  }
  return PickWorld<DTENJAX_P2P_T, false>(alg, world);
}

}  // namespace dtenjax::p2p
