// Instantiates the one-shot and two-shot kernels of one dtype for worlds 2..8 and every
// reduction mode (plain; reproducible v3 and exact where DTENJAX_P2P_REP) (included once by
// each kernels_<dtype>.cu with DTENJAX_P2P_T, DTENJAX_P2P_DTYPE, DTENJAX_P2P_PICK and
// DTENJAX_P2P_REP defined; DTENJAX_P2P_REP must say what the vocabulary says of the dtype).
#include "csrc/p2p/allreduce.cuh"
#include "csrc/p2p/kernels.h"

namespace dtenjax::p2p {
static_assert(ReproducibleDType(DTENJAX_P2P_DTYPE) == static_cast<bool>(DTENJAX_P2P_REP),
              "DTENJAX_P2P_REP disagrees with DTENJAX_P2P_DTYPES in csrc/p2p/vocabulary.h");
static_assert(DTypeBytes(DTENJAX_P2P_DTYPE) == sizeof(DTENJAX_P2P_T),
              "DTENJAX_P2P_T is not the size csrc/p2p/vocabulary.h gives its dtype");
namespace {

template <typename T, int W, int kMode>
KernelFn Pick(Algorithm alg) {
  switch (alg) {
    case Algorithm::kOneShot: return &device::OneShotKernel<T, W, kMode>;
    case Algorithm::kTwoShot: return &device::TwoShotKernel<T, W, kMode>;
    case Algorithm::kOneShotLL: return &device::OneShotLLKernel<T, W, kMode>;
  }
  return nullptr;
}

template <typename T, int kMode>
KernelFn PickWorld(Algorithm alg, int world) {
  switch (world) {
    case 2: return Pick<T, 2, kMode>(alg);
    case 3: return Pick<T, 3, kMode>(alg);
    case 4: return Pick<T, 4, kMode>(alg);
    case 5: return Pick<T, 5, kMode>(alg);
    case 6: return Pick<T, 6, kMode>(alg);
    case 7: return Pick<T, 7, kMode>(alg);
    case 8: return Pick<T, 8, kMode>(alg);
    default: return nullptr;
  }
}

}  // namespace

KernelFn DTENJAX_P2P_PICK(Algorithm alg, int world, int rep_mode) {
  switch (rep_mode) {
#if DTENJAX_P2P_REP
    case device::kRepV3: return PickWorld<DTENJAX_P2P_T, device::kRepV3>(alg, world);
    case device::kRepExact: return PickWorld<DTENJAX_P2P_T, device::kRepExact>(alg, world);
#endif
    case device::kPlain: return PickWorld<DTENJAX_P2P_T, device::kPlain>(alg, world);
    default: return nullptr;
  }
}

}  // namespace dtenjax::p2p
