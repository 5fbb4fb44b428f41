// Kernel instances for float (see p2p_kernels_inst.cuh).
#define DTENJAX_P2P_T float
#define DTENJAX_P2P_PICK PickF32
#define DTENJAX_P2P_REP 1
#include "csrc/cuda/p2p_kernels_inst.cuh"
