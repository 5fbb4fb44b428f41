// Kernel instances for float (see kernels_inst.cuh).
#define DTENJAX_P2P_T float
#define DTENJAX_P2P_DTYPE DType::kF32
#define DTENJAX_P2P_PICK PickF32
#define DTENJAX_P2P_REP 1
#include "csrc/p2p/kernels_inst.cuh"
