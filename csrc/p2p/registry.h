// Process-wide registry of the peer-to-peer all-reduce's symmetric buffers: one region per device,
// allocated once and never per call; communicators that map every rank's region into this process
// (cudaDeviceEnablePeerAccess for devices of this process, CUDA IPC handles for other processes);
// and the kernels' host-mapped error words, all watched for timeouts. AllocRegionOn and
// AllocErrorWords are what a caller that lays out ranks of its own uses (the test extension's
// simulated-rank harness, through custom_calls/p2p/seams.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "csrc/common/status.h"
#include "csrc/p2p/allreduce.h"

namespace dtenjax::p2p {

// What a rank publishes about its region (exchanged in-process or over jax.distributed's store).
struct Descriptor {
  uint64_t magic;        // kDescriptorMagic
  int64_t pid;
  uint64_t host;         // hash of the host name
  int32_t ordinal;       // device ordinal in the owning process
  int32_t ipc_ok;        // whether `handle` is valid
  uint64_t base;         // region address in the owning process
  uint64_t capacity;     // bytes of one stage buffer
  cudaIpcMemHandle_t handle;
  uint8_t reserved[16];
};
static_assert(sizeof(Descriptor) == kDescriptorBytes, "Descriptor must be kDescriptorBytes");
constexpr uint64_t kDescriptorMagic = 0x64746a7032700001ull;  // "dtjp2p" v1

// A communicator as seen by one device of this process.
struct Comm {
  int world = 0;
  int rank = 0;
  size_t capacity = 0;
  Peers peers{};
  uint32_t* error_host = nullptr;  // host-mapped error words of this device's region
  uint32_t* error_dev = nullptr;
};

// Allocates (first call) the region of `ordinal` with `capacity` bytes per stage buffer and
// returns its descriptor. Later calls return the same region; a different capacity is an error.
Status RegisterRegion(int ordinal, size_t capacity, Descriptor* out);

// Maps the regions of all `world` ranks (descriptors in rank order) for device `ordinal`, which is
// rank `rank`, under communicator id `key`. Idempotent for the same key and descriptors.
Status Connect(int ordinal, uint64_t key, int rank, int world, const Descriptor* all);

// The communicator `key` of device `ordinal`, or kUnavailable saying how to set it up.
Status FindComm(int ordinal, uint64_t key, Comm* out);

// kDeadlineExceeded with what was waited for when a kernel of this region timed out.
Status CheckKernelError(int ordinal, const uint32_t* error_host, const char* what);

// A message per region whose kernel timed out (they trap: the CUDA context of that device is
// unusable afterwards); a watchdog thread also prints each one to stderr as it happens.
std::vector<std::string> KernelTimeouts();

// A zeroed region of RegionBytes(capacity) bytes on device `ordinal` for a caller that keeps it
// for the life of the process (RegisterRegion's regions are allocated this way too).
Status AllocRegionOn(int ordinal, size_t capacity, char** base);

// Host-mapped error words (kErrorWords) for kernels on device `ordinal`, never freed: a timeout a
// kernel records in them is printed by the watchdog, listed by KernelTimeouts and reported by
// CheckKernelError, as for a registered region.
Status AllocErrorWords(int ordinal, uint32_t** host, uint32_t** dev);

}  // namespace dtenjax::p2p
