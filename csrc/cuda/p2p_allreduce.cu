// Host launchers of the peer-to-peer all-reduce kernels: validate, pick the template instance,
// launch, check the launch. No allocation, no stream query, no synchronisation (CUDA-graph safe).
#include <string>

#include "csrc/cuda/p2p_allreduce.cuh"
#include "csrc/cuda/p2p_allreduce.h"

namespace dtenjax::p2p {
namespace {

using KernelFn = void (*)(const LaunchArgs);

template <typename T, int W>
KernelFn Pick(Algorithm alg) {
  return alg == Algorithm::kOneShot ? &device::OneShotKernel<T, W> : &device::TwoShotKernel<T, W>;
}

template <typename T>
KernelFn PickWorld(Algorithm alg, int world) {
  switch (world) {
    case 1: return Pick<T, 1>(alg);
    case 2: return Pick<T, 2>(alg);
    case 3: return Pick<T, 3>(alg);
    case 4: return Pick<T, 4>(alg);
    case 5: return Pick<T, 5>(alg);
    case 6: return Pick<T, 6>(alg);
    case 7: return Pick<T, 7>(alg);
    case 8: return Pick<T, 8>(alg);
    default: return nullptr;
  }
}

KernelFn PickKernel(const LaunchArgs& a) {
  switch (a.dtype) {
    case DType::kF32: return PickWorld<float>(a.algorithm, a.world);
    case DType::kBF16: return PickWorld<__nv_bfloat16>(a.algorithm, a.world);
    case DType::kF16: return PickWorld<__half>(a.algorithm, a.world);
  }
  return nullptr;
}

Status Validate(const LaunchArgs& a) {
  DTENJAX_CHECK_ARG(a.world >= 1 && a.world <= kMaxRanks,
                    "p2p all-reduce: world size " + std::to_string(a.world) +
                        " is outside [1, " + std::to_string(kMaxRanks) + "]");
  DTENJAX_CHECK_ARG(a.local_ranks >= 1 && a.rank0 >= 0 && a.rank0 + a.local_ranks <= a.world,
                    "p2p all-reduce: ranks [" + std::to_string(a.rank0) + ", " +
                        std::to_string(a.rank0 + a.local_ranks) + ") do not fit world " +
                        std::to_string(a.world));
  DTENJAX_CHECK_ARG(a.blocks >= 1 && a.blocks <= kMaxBlocks,
                    "p2p all-reduce: blocks per rank " + std::to_string(a.blocks) +
                        " is outside [1, " + std::to_string(kMaxBlocks) + "]");
  DTENJAX_CHECK_ARG(a.count >= 0, "p2p all-reduce: negative element count");
  const size_t bytes = static_cast<size_t>(a.count) * DTypeBytes(a.dtype);
  DTENJAX_CHECK_ARG(bytes <= a.capacity,
                    "p2p all-reduce: message of " + std::to_string(bytes) +
                        " bytes exceeds the registered buffer of " + std::to_string(a.capacity) +
                        " bytes (raise DTENJAX_P2P_BUFFER_BYTES or use algorithm='xla')");
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
  KernelFn fn = PickKernel(args);
  if (fn == nullptr) return DTENJAX_ERROR(Code::kInvalidArgument, "p2p all-reduce: no kernel");
  dim3 grid(static_cast<unsigned>(args.blocks), static_cast<unsigned>(args.local_ranks));
  fn<<<grid, kThreads, 0, stream>>>(args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) {
    return DTENJAX_ERROR(Code::kInternal,
                         std::string("p2p all-reduce launch failed: ") + cudaGetErrorString(e));
  }
  return Status::Ok();
}

Status MaxResidentBlocks(const LaunchArgs& args, int device, int* blocks) {
  KernelFn fn = PickKernel(args);
  if (fn == nullptr) return DTENJAX_ERROR(Code::kInvalidArgument, "p2p all-reduce: no kernel");
  int per_sm = 0, sms = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, kThreads, 0);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e != cudaSuccess) {
    return DTENJAX_ERROR(Code::kInternal,
                         std::string("p2p occupancy query failed: ") + cudaGetErrorString(e));
  }
  *blocks = per_sm * sms;
  return Status::Ok();
}

}  // namespace dtenjax::p2p
