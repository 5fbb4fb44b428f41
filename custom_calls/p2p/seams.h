// The p2p kernels' and registry's seams, as the production extension hands them to the test
// extension's simulated-rank harness (custom_calls/testing/p2p_selftest_cuda.cc): a table of
// function pointers published as the capsule dtenjax._ffi._p2p_seams. The harness lays out its
// N ranks on one GPU with these and launches the shipped kernels through them; dtenjax._ffi itself
// holds no harness, no simulated ranks and no code path that looks for either.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "csrc/common/status.h"
#include "csrc/p2p/allreduce.h"

namespace dtenjax::p2p {

inline constexpr const char* kSeamsCapsule = "dtenjax._ffi._p2p_seams";
inline constexpr uint32_t kSeamsVersion = 1;

struct Seams {
  uint32_t version;             // kSeamsVersion of the extension that filled the table
  uint32_t launch_args_bytes;   // sizeof(LaunchArgs) there (both extensions must agree)
  // csrc/p2p/allreduce.h: the shipped kernels' launcher, and how many of their blocks fit on a
  // device at once.
  Status (*launch_all_reduce)(const LaunchArgs& args, cudaStream_t stream);
  Status (*max_resident_blocks)(const LaunchArgs& args, int device, int* blocks);
  // csrc/p2p/registry.h: a zeroed region on a device, error words the watchdog and
  // p2p_kernel_timeouts() watch, and the check a handler makes of them before it launches.
  Status (*alloc_region)(int ordinal, size_t capacity, char** base);
  Status (*alloc_error_words)(int ordinal, uint32_t** host, uint32_t** dev);
  Status (*check_kernel_error)(int ordinal, const uint32_t* error_host, const char* what);
};

}  // namespace dtenjax::p2p
