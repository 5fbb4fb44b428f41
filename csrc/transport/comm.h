// A communicator: one rank of a ring of processes connected by a transport provider, running
// deterministic all-reduce over host memory. Collectives of one communicator run one at a time in
// submission order on its own worker thread (Submit), so an XLA thread never blocks on the network.
//
// Every collective carries a Descriptor (its number on the communicator, op, dtype, element count,
// tag and fingerprint digest) in every frame, and its full fingerprint (fingerprint.h) before its
// first segment; a rank that receives a frame of another collective fails
// with an error naming both, and tells its neighbours with ABORT frames that travel around the
// ring in both directions, so every rank raises (naming the detector's finding and its own
// collective) instead of some ranks returning wrong numbers or waiting for a timeout.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/bufferpool.h"
#include "csrc/transport/fingerprint.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tenancy.h"

namespace dtenjax::transport {

struct CommOptions {
  uint64_t job_id = 0;
  int rank = 0;
  int size = 1;
  std::string secret;
  double timeout_s = 60;
  std::string tenant = "default";
  std::string bind_address = "127.0.0.1";
  const Provider* provider = nullptr;  // default: TCP
  // Largest payload of one frame: a chunk of the ring is sent as segments of this size, and each
  // segment is forwarded as soon as it arrived (pipelining across ring steps).
  uint64_t segment_bytes = uint64_t(1) << 20;
  double handshake_timeout_s = 10;
  int max_pending_handshakes = 16;
};
// Every out-of-range option at once.
Status ValidateCommOptions(const CommOptions& o);

struct WorkQueue;

// Starts a detached thread running fn; a failure to start (std::system_error, bad_alloc) becomes
// a Status instead of an exception that could cross the FFI or binding boundary.
Status StartDetachedThread(std::function<void()> fn, const char* what);

class Comm {
 public:
  static Status Create(const CommOptions& opts, std::shared_ptr<Comm>* out);
  ~Comm();
  const std::string& endpoint() const { return endpoint_; }
  int rank() const { return opts_.rank; }
  int size() const { return opts_.size; }
  const Provider* provider() const { return opts_.provider; }

  // Connects to the next rank and accepts the previous one (both authenticated), then runs the
  // ring set-up check (a one-element all-reduce, collective #0) so every rank of the ring knows
  // the whole ring formed. Runs once; a failure is reported on every rank of the ring with its
  // first cause (quota, authentication, a missing peer, ...), and the tenant's two connections
  // are released at once.
  Status ConnectRing(const std::string& next_endpoint);
  // Ring all-reduce of `count` elements from `src` into `dst` (they may be the same buffer; src is
  // only read, so no copy is made first): reduce-scatter then all-gather over n chunks;
  // chunk c is combined in the fixed order ((x[c] + x[c+1]) + ...) + x[c-1] (ranks mod n), so the
  // result is identical on every rank and in every run. `site` tags the call site (RegisterSite
  // gives its text). `ring_position` >= 0: this process's index along the reduced mesh axis as
  // XLA computed it; it must equal rank() (else an error explains the mesh order dtenjax needs).
  // `tag`: the caller's tag of this collective (e.g. a step number); every rank must pass the same.
  // `site`: the call's id in the table of calls (RegisterSite: its call stack and signature);
  // `thread`: the issuing thread's name ("" for jitted programs). With op, dtype, count and tag
  // they form the collective's fingerprint, which every rank checks against its previous rank's
  // before it combines any payload (fingerprint.h).
  Status AllReduce(const void* src, void* dst, uint64_t count, DType dt, ReduceOp op,
                   uint64_t site, int64_t ring_position = -1, uint32_t tag = 0,
                   const std::string& thread = "");
  // Runs fn on this communicator's worker thread after everything submitted before it; refused
  // (kCancelled) once Close was called.
  Status Submit(std::function<void()> fn);
  // Closes this communicator from any thread: the collective in flight stops within one wait
  // slice (20 ms) and fails with kCancelled ("closed locally"; its neighbours hear it by ABORT
  // frames), every queued one fails the same way without touching the network, a connect in
  // progress gives up, and later calls are refused. Returns once the worker thread has exited
  // (at most `join_s` seconds; at once when called from the worker thread itself). The
  // connections are closed when the last reference goes (~Comm).
  void Close(double join_s = 5.0);
  bool closing() const { return closing_.load(); }
  BufferPool& pool() { return *pool_; }

 private:
  class Ring;   // the state and steps of one RunRing call (ring.cc)
  explicit Comm(const CommOptions& opts);
  // One ring all-reduce over the connected ring (AllReduce's body; Comm::Ring does the work).
  Status RunRing(const uint8_t* src, uint8_t* dst, const Descriptor& d, DType dt, ReduceOp op,
                 OutFrame* out, const Fingerprint* fp = nullptr);
  // Sends an ABORT frame carrying `why` (best effort, bounded time) to the chosen neighbours,
  // finishing a half-sent frame to `next` first so the stream stays parseable.
  void SendAborts(const Status& why, const Descriptor& d, bool to_next, bool to_prev,
                  OutFrame* half_sent);
  // Marks a failed ConnectRing: closes what it opened and gives the tenant's connections back.
  void FailSetup(const Status& why);
  // How long a rank whose connect failed still accepts its previous rank, to tell it why.
  static constexpr double kTellWindowSeconds = 1.0;

  // The error of a call that Close interrupted or refused.
  Status ClosedLocally(const std::string& what) const;

  CommOptions opts_;
  std::atomic<bool> closing_{false};
  Tenant* tenant_;
  Listener* listener_ = nullptr;
  std::string endpoint_;
  Conn* next_ = nullptr;
  Conn* prev_ = nullptr;
  int connections_held_ = 0;
  bool connect_called_ = false;
  std::mutex op_mu_;
  Status broken_;
  // Why the next rank's connection ended after a collective that needed nothing more from it
  // (it closed its communicator); the next collective fails with this, naming it.
  Status next_closed_;
  uint64_t coll_seq_ = 0;
  uint8_t fp_key_[kFingerprintKeyBytes] = {};  // keys the fingerprint digests (job secret)
  uint64_t fp_sent_ = 0;          // digest of the last fingerprint record sent to the next rank
  bool have_fp_sent_ = false;
  Fingerprint fp_cache_;          // the last collective's fingerprint (reused while unchanged)
  uint64_t fp_cache_site_ = 0;
  bool fp_cache_valid_ = false;
  Fingerprint fp_received_;       // the last full fingerprint received from the previous rank
  bool have_fp_received_ = false;
  // Consecutive collectives with one digest and no tag (the undetectable case if the ranks
  // issued them in different orders): first collective number and how many.
  uint64_t run_digest_ = 0, run_first_ = 0, run_len_ = 0;
  std::string run_hint_;  // said by a mismatch of the collective in flight (about that run)
  std::unique_ptr<BufferPool> pool_;
  std::shared_ptr<WorkQueue> queue_;
};

// Process-wide table of communicators, addressed by id from Python and from the FFI handlers.
int64_t RegisterComm(std::shared_ptr<Comm> comm);
std::shared_ptr<Comm> FindComm(int64_t id);
bool DestroyComm(int64_t id);

// How StartDetachedThread starts its threads: spawner(body) starts a detached thread running
// body or throws std::system_error (as std::thread does). A seam: the test extension
// (custom_calls/testing/) swaps in one that fails; returns the previous one (nullptr restores
// the default).
using ThreadSpawner = void (*)(std::function<void()> body);
ThreadSpawner SwapThreadSpawner(ThreadSpawner spawner);

}  // namespace dtenjax::transport
