// Host launchers of the peer-to-peer all-reduce kernels: validate, pick the template instance,
// launch, check the launch. No allocation, no stream query, no synchronisation (CUDA-graph safe).
#include <string>

#include "csrc/p2p/allreduce.h"
#include "csrc/p2p/kernels.h"

namespace dtenjax::p2p {
namespace {

// The kernel a call runs: one-shot messages that fit a low-latency slot use the LL protocol.
Algorithm Effective(const LaunchArgs& a) {
  const size_t bytes = static_cast<size_t>(a.count) * DTypeBytes(a.dtype);
  return a.algorithm == Algorithm::kOneShot && bytes <= kLLMaxBytes ? Algorithm::kOneShotLL
                                                                    : a.algorithm;
}

KernelFn PickKernel(const LaunchArgs& a, Algorithm alg) {
  const int rep = static_cast<int>(a.reproducible);
  switch (a.dtype) {
    case DType::kF32: return PickF32(alg, a.world, rep);
    case DType::kBF16: return PickBF16(alg, a.world, rep);
    case DType::kF16: return PickF16(alg, a.world, rep);
  }
  return nullptr;
}

Status Validate(const LaunchArgs& a) {
  DTENJAX_CHECK_ARG(a.world >= 2 && a.world <= kMaxRanks,
                    "p2p all-reduce: world size " + std::to_string(a.world) +
                        " is outside [2, " + std::to_string(kMaxRanks) +
                        "] (a world of one is a copy)");
  DTENJAX_CHECK_ARG(a.local_ranks >= 1 && a.rank0 >= 0 && a.rank0 + a.local_ranks <= a.world,
                    "p2p all-reduce: ranks [" + std::to_string(a.rank0) + ", " +
                        std::to_string(a.rank0 + a.local_ranks) + ") do not fit world " +
                        std::to_string(a.world));
  DTENJAX_CHECK_ARG(a.blocks >= 1 && a.blocks <= kMaxBlocks,
                    "p2p all-reduce: blocks per rank " + std::to_string(a.blocks) +
                        " is outside [1, " + std::to_string(kMaxBlocks) + "]");
  DTENJAX_CHECK_ARG(a.count >= 0, "p2p all-reduce: negative element count");
  DTENJAX_CHECK_ARG(a.reproducible == Reproducible::kNone || ReproducibleDType(a.dtype),
                    "p2p all-reduce: the reproducible sums support float32 and bfloat16 only");
  DTENJAX_CHECK_ARG(a.reproducible == Reproducible::kNone || a.op == Op::kSum,
                    "p2p all-reduce: a reproducible contract is a sum (op sum; mean divides it)");
  const size_t bytes = static_cast<size_t>(a.count) * DTypeBytes(a.dtype);
  DTENJAX_CHECK_ARG(bytes <= a.capacity,
                    "p2p all-reduce: a chunk of " + std::to_string(bytes) +
                        " bytes exceeds the registered buffer of " + std::to_string(a.capacity) +
                        " bytes");
  DTENJAX_CHECK_ARG(a.capacity % 16 == 0, "p2p all-reduce: capacity must be a multiple of 16");
  for (int r = 0; r < a.world; ++r) {
    DTENJAX_CHECK_ARG(a.peers.region[r] != nullptr &&
                          reinterpret_cast<uintptr_t>(a.peers.region[r]) % 16 == 0,
                      "p2p all-reduce: region of rank " + std::to_string(r) +
                          " is null or not 16-byte aligned");
  }
  for (int k = 0; k < a.local_ranks; ++k) {
    const auto in = reinterpret_cast<uintptr_t>(a.io[k].in);
    const auto out = reinterpret_cast<uintptr_t>(a.io[k].out);
    DTENJAX_CHECK_ARG(a.count == 0 || (in % 16 == 0 && out % 16 == 0 && in != 0 && out != 0),
                      "p2p all-reduce: input/output of rank " + std::to_string(a.rank0 + k) +
                          " are not 16-byte aligned device pointers");
  }
  return Status::Ok();
}

}  // namespace

Status LaunchAllReduce(const LaunchArgs& args, cudaStream_t stream) {
  DTENJAX_RETURN_IF_ERROR(Validate(args));
  KernelFn fn = PickKernel(args, Effective(args));
  if (fn == nullptr) return DTENJAX_ERROR(Code::kInvalidArgument, "p2p all-reduce: no kernel");
  dim3 grid(static_cast<unsigned>(args.blocks), static_cast<unsigned>(args.local_ranks));
  fn<<<grid, kThreads, 0, stream>>>(args);
  DTENJAX_CUDA_CHECK_LAUNCH("p2p all-reduce");
  return Status::Ok();
}

Status MaxResidentBlocks(const LaunchArgs& args, int device, int* blocks) {
  int prev = 0, per_sm = 1 << 30, sms = 0;
  DTENJAX_CUDA_CHECK(cudaGetDevice(&prev));
  DTENJAX_CUDA_CHECK(cudaSetDevice(device));   // the occupancy query is the current device's
  const Status s = [&]() -> Status {
    for (Algorithm alg : {args.algorithm, Algorithm::kOneShotLL}) {
      KernelFn fn = PickKernel(args, alg);
      if (fn == nullptr) return DTENJAX_ERROR(Code::kInvalidArgument, "p2p all-reduce: no kernel");
      int n = 0;
      DTENJAX_CUDA_CHECK_AS(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, 0),
                            Code::kInternal, "p2p occupancy query failed");
      per_sm = n < per_sm ? n : per_sm;
    }
    DTENJAX_CUDA_CHECK_AS(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                          Code::kInternal, "p2p occupancy query failed");
    return Status::Ok();
  }();
  const cudaError_t restored = cudaSetDevice(prev);
  DTENJAX_RETURN_IF_ERROR(s);
  DTENJAX_CUDA_CHECK_AS(restored, Code::kInternal,
                        "cudaSetDevice (restoring the caller's device) failed");
  *blocks = per_sm * sms;
  return Status::Ok();
}

}  // namespace dtenjax::p2p
