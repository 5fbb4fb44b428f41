// Kernel instances for __half (see kernels_inst.cuh).
#define DTENJAX_P2P_T __half
#define DTENJAX_P2P_DTYPE DType::kF16
#define DTENJAX_P2P_PICK PickF16
#define DTENJAX_P2P_REP 0
#include "csrc/p2p/kernels_inst.cuh"
