// What the p2p FFI handlers share once their attributes are decoded (attributes.h): the launch
// they fill alike, and a copy on XLA's stream. Used by dtenjax_p2p_all_reduce (allreduce_cuda.cc)
// and by the test extension's simulated-rank harness (custom_calls/testing/p2p_selftest_cuda.cc),
// so both run the kernels with the same arguments.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"
#include "csrc/p2p/allreduce.h"
#include "custom_calls/p2p/attributes.h"

namespace dtenjax::p2p {

// The launch of `kernel` over `world` ranks whose regions are `peers` (stage buffers of `capacity`
// bytes), recording a timeout in `error`; the attributes `mean` and `timeout_ms` as the handlers
// receive them. It runs rank 0 alone: the caller sets the ranks it runs (rank0, local_ranks) and,
// per launch, io, count and blocks.
inline LaunchArgs KernelLaunch(const attributes::Kernel& kernel, int64_t mean, int64_t timeout_ms,
                               const Peers& peers, int world, size_t capacity, uint32_t* error) {
  LaunchArgs a;
  a.peers = peers;
  a.world = world;
  a.rank0 = 0;
  a.local_ranks = 1;
  a.capacity = capacity;
  a.dtype = kernel.dtype;
  a.algorithm = kernel.algorithm;
  a.op = kernel.op;
  a.reproducible = kernel.reproducible;
  a.mean = mean != 0;
  a.timeout_ns = attributes::TimeoutNs(timeout_ms);
  a.error = error;
  return a;
}

// A device-to-device copy on XLA's stream (a reduction over one rank is a copy).
inline Status CopyOnStream(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                           const char* what) {
  DTENJAX_CUDA_CHECK_AS(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                        Code::kInternal, std::string(what) + ": copy failed");
  return Status::Ok();
}

}  // namespace dtenjax::p2p
