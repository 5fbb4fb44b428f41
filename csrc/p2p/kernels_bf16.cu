// Kernel instances for __nv_bfloat16 (see kernels_inst.cuh).
#define DTENJAX_P2P_T __nv_bfloat16
#define DTENJAX_P2P_DTYPE DType::kBF16
#define DTENJAX_P2P_PICK PickBF16
#define DTENJAX_P2P_REP 1
#include "csrc/p2p/kernels_inst.cuh"
