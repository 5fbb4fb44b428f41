// Host interface of the NVLink peer-to-peer all-reduce kernels (p2p_allreduce.cuh / .cu).
//
// Every rank owns one symmetric region (allocated once per device, see p2p_registry.cu):
//
//   [ header: kHeaderBytes                                                              ]
//     landing[kMaxBlocks][kMaxRanks]  uint32  flag slots, written by peers (release/acquire .sys)
//     calls[kMaxBlocks]               uint32  this rank's call counter per block (buffer parity)
//     barriers[kMaxBlocks]            uint32  this rank's barrier counter per block (flag values)
//   [ stage[0]: capacity bytes ][ stage[1]: capacity bytes ]   double-buffered by call parity
//
// Counters only ever increase (wrap-safe compares) and are kept in device memory, so a call needs
// no host synchronisation, no flag reset, and replays correctly inside a CUDA graph.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "csrc/common/status.h"

namespace dtenjax::p2p {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;          // flag slots per rank; launches use at most this many blocks
constexpr int kThreads = 512;           // threads per block
constexpr int kRealBlocks = 24;         // blocks per rank in the multi-GPU path (leaves SMs free)
constexpr size_t kHeaderBytes = 4096;   // >= (kMaxBlocks * kMaxRanks + 2 * kMaxBlocks) * 4, aligned
constexpr int kErrorWords = 4;          // {flag, rank, peer, waited-for value}

enum class Algorithm : int { kOneShot = 0, kTwoShot = 1 };
enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

inline size_t DTypeBytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// Every rank's symmetric region, as mapped in this process (index = rank).
struct Peers {
  char* region[kMaxRanks];
};

// What one rank reduces: its input and output (both on the rank's device).
struct RankIo {
  const void* in;
  void* out;
};

struct LaunchArgs {
  Peers peers;
  RankIo io[kMaxRanks];      // io[k] belongs to rank rank0 + k
  int world = 0;             // ranks in the all-reduce
  int rank0 = 0;             // first rank this launch runs (the device's rank; 0 in simulation)
  int local_ranks = 1;       // ranks run by this launch (1 on real GPUs, world when simulating)
  int blocks = kRealBlocks;  // blocks per rank; MUST be the same for every call on one region
  int64_t count = 0;         // elements
  size_t capacity = 0;       // bytes of one stage buffer
  DType dtype = DType::kF32;
  Algorithm algorithm = Algorithm::kOneShot;
  uint64_t timeout_ns = 0;   // per barrier wait; 0 means no limit
  uint32_t* error = nullptr; // kErrorWords words the kernel sets on a timeout (host-mapped)
};

// Validates args and launches the kernel on stream (no allocation, no stream query, no sync).
Status LaunchAllReduce(const LaunchArgs& args, cudaStream_t stream);

// Most blocks of the kernel for args' dtype/algorithm/world that can be resident on device at
// once (used to size simulated launches so that every rank's blocks run concurrently).
Status MaxResidentBlocks(const LaunchArgs& args, int device, int* blocks);

}  // namespace dtenjax::p2p
