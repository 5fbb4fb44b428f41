// Host interface of the NVLink peer-to-peer all-reduce kernels (allreduce.cuh / .cu).
//
// Every rank owns one symmetric region (allocated once per device, see registry_cuda.cc):
//
//   [ header: kHeaderBytes                                                              ]
//     landing[kMaxBlocks][kMaxRanks]  uint32  flag slots, written by peers (release/acquire .sys)
//     epoch                           uint32  calls this rank has completed on this region
//     done                            uint32  blocks of the running call that have finished
//   [ stage[0]: capacity bytes ][ stage[1]: capacity bytes ]   double-buffered by epoch parity
//   [ ll[2][kMaxRanks][kLLSlotBytes] ]   low-latency slots peers push small messages into
//
// Every rank runs the same sequence of calls on a region, so the epoch is the same on all ranks
// for a given call; barrier k of the call with epoch E writes the value 2E + k into the peers'
// landing slots of its block. The last block of a call to finish advances the epoch, so the next
// call (stream-ordered after this one) sees it. Everything lives in device memory: a call needs no
// host synchronisation and no flag reset, replays correctly inside a CUDA graph, and may use a
// different number of blocks than the previous call.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "csrc/common/status.h"
#include "csrc/p2p/vocabulary.h"

namespace dtenjax::p2p {

// kMaxRanks, kMaxBlocks (landing slots per rank; a launch uses at most this many) and
// kVectorBytes: csrc/p2p/vocabulary.h's DTENJAX_P2P_LIMITS.
constexpr int kThreads = 512;            // threads per block
constexpr size_t kHeaderBytes = 8192;    // >= kMaxBlocks * kMaxRanks * 4 + control words, aligned
constexpr size_t kEpochOffset = kMaxBlocks * kMaxRanks * 4;
constexpr int kErrorWords = 4;           // {flag, rank, peer, waited-for value}
// One-shot messages up to kLLMaxBytes use the low-latency protocol: every rank pushes its data to
// every peer as 16-byte lines {4 data bytes, flag, 4 data bytes, flag} (the flag is the call's
// barrier value; an 8-byte store is never torn), so the data itself is the signal and the call has
// no separate barrier and no remote reads.
constexpr size_t kLLMaxBytes = 256u << 10;
constexpr size_t kLLSlotBytes = 2 * kLLMaxBytes;
constexpr size_t kLLAreaBytes = 2 * kMaxRanks * kLLSlotBytes;

// Bytes of one rank's region for stage buffers of `capacity` bytes.
inline size_t RegionBytes(size_t capacity) { return kHeaderBytes + 2 * capacity + kLLAreaBytes; }

// Algorithm, Op, Reproducible and DType: csrc/p2p/vocabulary.h.

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
  int blocks = 0;            // blocks per rank, 1..kMaxBlocks (same on every rank for a call)
  int64_t count = 0;         // elements; count * itemsize <= capacity
  size_t capacity = 0;       // bytes of one stage buffer
  DType dtype = DType::kF32;
  Algorithm algorithm = Algorithm::kOneShot;
  Op op = Op::kSum;
  Reproducible reproducible = Reproducible::kNone;   // a contract other than kNone needs kSum
  bool mean = false;         // divide the (f32) sum by world before the final rounding
  uint64_t timeout_ns = 0;   // per barrier wait; 0 means no limit. A timeout traps the kernel.
  uint32_t* error = nullptr; // kErrorWords words set before the trap (host-mapped)
};

// Validates args and launches the kernel on stream (no allocation, no stream query, no sync).
Status LaunchAllReduce(const LaunchArgs& args, cudaStream_t stream);

// Most blocks of the kernel for args' dtype/algorithm/world/reproducible that can be resident on
// `device` at once (simulated launches need every rank's blocks resident together). It queries
// `device` whatever the caller's current device is, and leaves that unchanged.
Status MaxResidentBlocks(const LaunchArgs& args, int device, int* blocks);

// Blocks per rank for a message of `bytes`, at most `max_blocks` (DTENJAX_P2P_MAX_BLOCKS).
inline int BlocksFor(size_t bytes, int max_blocks) {
  // Enough blocks to keep many 16-byte loads in flight over NVLink for large messages, few for
  // small ones (each block pays a barrier). A function of the size and the cap only, so every
  // rank of a call computes the same value.
  const size_t per_block = 32u << 10;
  const size_t cap = static_cast<size_t>(max_blocks < 1            ? 1
                                         : max_blocks > kMaxBlocks ? kMaxBlocks
                                                                   : max_blocks);
  size_t b = (bytes + per_block - 1) / per_block;
  b = b < 4 ? 4 : b;
  return static_cast<int>(b > cap ? cap : b);
}

}  // namespace dtenjax::p2p
