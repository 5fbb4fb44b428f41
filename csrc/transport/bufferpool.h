// Registered buffer pool (seed 3.3). Registration is expensive (pinning pages, creating RDMA MRs),
// so buffers are registered once and reused. Each buffer is reference counted and moves through
// Idle -> Posted -> Completed -> Idle; a buffer is never reused, freed or deregistered while it is
// posted (a NIC or a socket may still be reading it). Pool size limits and the tenant's
// registered-bytes quota bound it; counters make leaks visible from Python.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/common/status.h"
#include "csrc/transport/tenancy.h"

namespace dtenjax::transport {

enum class BufState : int { kIdle = 0, kPosted = 1, kCompleted = 2 };

// How buffers are registered: pinned host memory (mlock) by default; the verbs provider installs
// ibv_reg_mr/ibv_dereg_mr.
struct RegisterHooks {
  Status (*reg)(void* ctx, void* ptr, uint64_t bytes, uint64_t* handle) = nullptr;
  void (*dereg)(void* ctx, uint64_t handle) = nullptr;
  void* ctx = nullptr;
};

struct PoolOptions {
  uint64_t max_bytes = uint64_t(1) << 30;         // total registered bytes of this pool
  uint32_t max_buffers = 1024;
  uint64_t max_buffer_bytes = uint64_t(1) << 30;  // one buffer
  bool pin = true;                                // mlock host buffers (best effort)
  std::string tenant = "default";
  RegisterHooks hooks;
};

struct PoolStats {
  uint64_t registered_bytes, registered_buffers, in_use, posted, acquires, releases;
  uint64_t registrations, deregistrations, reg_failures, reuse_hits, rejected_transitions;
  uint64_t pin_failures, high_water_bytes, allocated_bytes;
};
constexpr int kNumPoolStats = 14;
extern const char* const kPoolStatNames[];

// Every out-of-range limit at once.
Status ValidatePoolOptions(const PoolOptions& o);

// Thread-safe: every method takes the pool's lock and no method blocks while holding it (a
// request that cannot be met fails at once). Pointers returned by Acquire/Data stay valid while
// the caller holds a reference to the buffer, even across Trim() and Close().
class BufferPool {
 public:
  explicit BufferPool(PoolOptions opts);
  ~BufferPool();  // frees what is idle; posted buffers are leaked on purpose, never freed under I/O

  // A buffer of at least `bytes` bytes with refcount 1, state Idle; *data (optional) its address.
  // When a limit (pool bytes, pool buffers, or the tenant's registered-bytes quota) blocks a new
  // registration, or the registration hook refuses it for want of room (kResourceExhausted, as
  // ibv_reg_mr's ENOMEM), idle cached buffers are freed first; only if that is not enough does
  // it fail.
  Status Acquire(uint64_t bytes, int* id, void** data = nullptr);
  Status Retain(int id);
  Status Post(int id);      // Idle -> Posted
  Status Complete(int id);  // Posted -> Completed
  // Drops one reference; at zero a Completed buffer returns to Idle and to the free list. Refused
  // (kFailedPrecondition-like kInvalidArgument) while Posted.
  Status Release(int id);
  // Deregisters and frees every idle, unreferenced buffer.
  void Trim();
  // Trim, and refuse every later Acquire; buffers still referenced are freed when released.
  void Close();
  bool closed();
  void* Data(int id);
  uint64_t Size(int id);
  uint64_t RegHandle(int id);
  int State(int id);
  PoolStats Stats();
  // Replaces how buffers registered from now on are registered and deregistered; returns the
  // previous hooks (a seam: the test extension wraps them to fail like ibv_reg_mr can). Buffers
  // already registered are deregistered with the hooks in place when they are freed, so a
  // replacement must deregister what the hooks it wraps registered.
  RegisterHooks SwapRegisterHooks(RegisterHooks hooks);

 private:
  struct Buf {
    void* ptr = nullptr;
    uint64_t bytes = 0;
    uint64_t handle = 0;
    bool pinned = false;
    int refs = 0;
    BufState state = BufState::kIdle;
    bool live = false;  // registered and owned by the pool
  };
  Status Lookup(int id, Buf** b);
  Status RegisterNew(uint64_t cls, int* id);
  bool EvictOneIdle();
  void FreeBuf(int id);
  Status Transition(int id, BufState from, BufState to, const char* what);

  std::mutex mu_;
  PoolOptions opts_;
  Tenant* tenant_;
  std::vector<Buf> bufs_;
  std::multimap<uint64_t, int> idle_;  // size class -> idle buffer ids
  std::vector<int> free_slots_;
  PoolStats st_{};
  bool closed_ = false;
};

}  // namespace dtenjax::transport
