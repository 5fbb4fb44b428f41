// A communicator (comm.h): its options, its worker thread (Submit), its ring set-up
// (ConnectRing: both connections, authenticated, then a check that the whole ring formed), one
// all-reduce call (AllReduce: the checks and the fingerprint, then Comm::RunRing, ring.cc) and the
// ABORT frames that tell the neighbours why it gave up. The arithmetic is arithmetic.cc, the
// table of communicators comm_registry.cc.
#include "csrc/transport/comm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <new>
#include <system_error>
#include <thread>

namespace dtenjax::transport {

namespace {

// Starts a detached thread running body (throws std::system_error as std::thread does).
void SpawnDetached(std::function<void()> body) { std::thread(std::move(body)).detach(); }

std::atomic<ThreadSpawner> g_spawner{&SpawnDetached};

}  // namespace

ThreadSpawner SwapThreadSpawner(ThreadSpawner spawner) {
  return g_spawner.exchange(spawner ? spawner : &SpawnDetached);
}

Status StartDetachedThread(std::function<void()> fn, const char* what) {
  try {
    // Nothing thrown on the new thread may reach std::terminate: the body reports its own failures.
    g_spawner.load()([body = std::move(fn)]() mutable {
      try {
        body();
      } catch (...) {
      }
    });
    return Status::Ok();
  } catch (const std::system_error& e) {
    return DTENJAX_ERROR(Code::kInternal, std::string("could not start a thread for ") + what +
                                              ": " + e.what() +
                                              " (the process is out of threads or memory)");
  } catch (const std::bad_alloc&) {
    return DTENJAX_ERROR(Code::kInternal, std::string("out of memory starting a thread for ") + what);
  }
}

Status ValidateCommOptions(const CommOptions& o) {
  std::string bad;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) bad += (bad.empty() ? "" : "; ") + what;
  };
  need(o.size >= 1 && o.size <= 65536, "size=" + std::to_string(o.size) + " (1..65536)");
  need(o.rank >= 0 && o.rank < o.size,
       "rank=" + std::to_string(o.rank) + " (0.." + std::to_string(o.size - 1) + ")");
  need(std::isfinite(o.timeout_s) && o.timeout_s > 0,
       "timeout_s=" + std::to_string(o.timeout_s) + " (a finite number of seconds > 0)");
  need(std::isfinite(o.handshake_timeout_s) && o.handshake_timeout_s > 0,
       "handshake_timeout_s=" + std::to_string(o.handshake_timeout_s) + " (finite, > 0)");
  need(o.max_pending_handshakes >= 1 && o.max_pending_handshakes <= 4096,
       "max_pending_handshakes=" + std::to_string(o.max_pending_handshakes) + " (1..4096)");
  need(o.segment_bytes >= 256 && o.segment_bytes <= (uint64_t(1) << 30),
       "segment_bytes=" + std::to_string(o.segment_bytes) + " (256..2^30)");
  need(o.secret.size() >= 16, "secret of " + std::to_string(o.secret.size()) +
                                  " bytes (at least 16)");
  need(!o.tenant.empty(), "tenant='' (a non-empty name)");
  if (!bad.empty()) return DTENJAX_ERROR(Code::kInvalidArgument, "invalid communicator options: " + bad);
  return Status::Ok();
}

// A FIFO worker thread. Detached: it owns a shared_ptr to its queue, so a Comm dropped on the
// worker thread itself never joins itself.
struct WorkQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> items;
  bool stop = false;
  bool started = false;
  bool exited = false;          // the worker thread has left its loop (Close waits for this)
  std::thread::id worker;       // the worker thread, once started
};

Comm::Comm(const CommOptions& opts) : opts_(opts), tenant_(GetTenant(opts.tenant)) {
  PoolOptions po;
  po.tenant = opts.tenant;
  po.max_bytes = uint64_t(2) << 30;
  pool_ = std::make_unique<BufferPool>(po);
  queue_ = std::make_shared<WorkQueue>();
}

Status Comm::Create(const CommOptions& opts, std::shared_ptr<Comm>* out) {
  DTENJAX_RETURN_IF_ERROR(ValidateCommOptions(opts));
  std::shared_ptr<Comm> c(new Comm(opts));
  if (!c->opts_.provider) c->opts_.provider = TcpProvider();
  if (opts.size > 1) {
    // Fail closed: no communicator without the library that authenticates its frames.
    DTENJAX_RETURN_IF_ERROR(crypto::Loaded());
    DTENJAX_RETURN_IF_ERROR(DeriveFingerprintKey(opts.secret, opts.job_id, c->fp_key_));
    DTENJAX_RETURN_IF_ERROR(c->opts_.provider->listen(opts.bind_address, &c->listener_));
    c->endpoint_ = c->listener_->endpoint;
  }
  *out = std::move(c);
  return Status::Ok();
}

Status Comm::ClosedLocally(const std::string& what) const {
  return DTENJAX_ERROR(Code::kCancelled,
                       "dtenjax transport: the communicator of rank " + std::to_string(opts_.rank) +
                           " was closed locally (close() in this process) " + what);
}

void Comm::Close(double join_s) {
  closing_.store(true);
  std::shared_ptr<WorkQueue> q = queue_;
  std::unique_lock<std::mutex> l(q->mu);
  q->stop = true;
  q->cv.notify_all();
  if (!q->started || q->exited || q->worker == std::this_thread::get_id()) return;
  // Queued collectives fail at once (closing_), the one in flight within a wait slice.
  q->cv.wait_for(l, std::chrono::duration<double>(join_s), [&] { return q->exited; });
}

Comm::~Comm() {
  closing_.store(true);
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stop = true;
  }
  queue_->cv.notify_all();
  const Provider* p = opts_.provider;
  if (next_) p->close(next_);
  if (prev_) p->close(prev_);
  if (listener_) p->close_listener(listener_);
  for (int i = 0; i < connections_held_; ++i) tenant_->ReleaseConnection();
}

Status Comm::ConnectRing(const std::string& next_endpoint) {
  std::lock_guard<std::mutex> lock(op_mu_);
  if (opts_.size == 1) return Status::Ok();
  if (connect_called_) {
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "communicator of rank " + std::to_string(opts_.rank) +
                             (broken_.ok() ? " is already connected"
                                           : " failed to connect (" + broken_.message() + ")") +
                             "; a communicator connects once: create a new one");
  }
  connect_called_ = true;
  if (!opts_.provider->can_connect(next_endpoint)) {
    broken_ = DTENJAX_ERROR(Code::kInvalidArgument,
                            std::string("provider ") + opts_.provider->name +
                                " cannot reach endpoint '" + next_endpoint + "'");
    return broken_;
  }
  // Both connections at once: rings racing for a quota never each hold half of what they need.
  // A rank its quota refuses still takes part in the two handshakes (closed right after) to tell
  // its neighbours why, so their set-up fails at once with the quota error instead of waiting.
  const Status quota =
      tenant_->AcquireConnections(2, "the two ring connections of rank " + std::to_string(opts_.rank));
  if (quota.ok()) connections_held_ = 2;
  const double deadline = NowSeconds() + opts_.timeout_s;
  const int n = opts_.size, r = opts_.rank;
  // Shared with the acceptor thread, which may outlive a failed start of this function's wait.
  struct Shared {
    std::atomic<double> give_up_at{0};
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    Status status;
    Conn* conn = nullptr;
  };
  auto sh = std::make_shared<Shared>();
  // Close() (closing_) stops both within a poll slice; ConnectRing outlives the acceptor's use.
  Handshake to_next{opts_.job_id, r, (r + 1) % n, opts_.secret, &closing_, nullptr,
                    opts_.handshake_timeout_s, opts_.max_pending_handshakes};
  Handshake from_prev{opts_.job_id, r, (r - 1 + n) % n, opts_.secret, &closing_, &sh->give_up_at,
                      opts_.handshake_timeout_s, opts_.max_pending_handshakes};
  Listener* listener = listener_;
  const Provider* provider = opts_.provider;
  Status started = StartDetachedThread(
      [sh, listener, provider, from_prev, deadline] {
        Conn* c = nullptr;
        Status s;
        try {
          s = provider->accept(listener, from_prev, deadline, &c);
        } catch (const std::exception& e) {
          s = DTENJAX_ERROR(Code::kInternal, std::string("accepting the previous rank: ") + e.what());
        }
        std::lock_guard<std::mutex> l(sh->mu);
        sh->status = s;
        sh->conn = c;
        sh->done = true;
        sh->cv.notify_all();
      },
      "accepting the previous rank's connection");
  if (!started.ok()) {
    FailSetup(started);
    return started;
  }
  Conn* next = nullptr;
  Status s = opts_.provider->connect(next_endpoint, to_next, deadline, &next);
  // Connecting failed: wait a moment longer for the previous rank only to tell it why.
  if (!s.ok()) sh->give_up_at.store(std::min(deadline, NowSeconds() + kTellWindowSeconds));
  Status accept_status;
  {
    std::unique_lock<std::mutex> l(sh->mu);
    sh->cv.wait(l, [&] { return sh->done; });  // accept returns by `deadline` or on give-up
    accept_status = sh->status;
    prev_ = sh->conn;
  }
  next_ = next;
  opts_.provider->close_listener(listener_);
  listener_ = nullptr;
  // The first cause wins: a local close, this rank's quota, then connecting, then accepting.
  Status failure = closing_.load() ? ClosedLocally("while it connected its ring")
                   : !quota.ok()   ? quota
                   : !s.ok()       ? s
                                   : accept_status;
  Descriptor setup;  // coll_seq 0: the ring set-up check
  if (failure.ok()) {
    // Every rank confirms the whole ring: a one-element max all-reduce over both connections.
    // A rank that failed sends ABORTs instead, which this check raises (and forwards), so every
    // rank of a ring fails its set-up with the first cause rather than at its first collective.
    int32_t zero = 0, result = -1;
    setup.count = 1;
    setup.op = uint8_t(ReduceOp::kMax);
    setup.dtype = uint8_t(DType::kS32);
    OutFrame of;
    failure = RunRing(reinterpret_cast<const uint8_t*>(&zero), reinterpret_cast<uint8_t*>(&result),
                      setup, DType::kS32, ReduceOp::kMax, &of);
  } else {
    SendAborts(failure, setup, next_ != nullptr, prev_ != nullptr, nullptr);
  }
  if (!failure.ok()) FailSetup(failure);
  return failure;
}

void Comm::FailSetup(const Status& why) {
  broken_ = why;
  const Provider* p = opts_.provider;
  if (next_) p->close(next_);
  if (prev_) p->close(prev_);
  next_ = prev_ = nullptr;
  if (listener_) p->close_listener(listener_);
  listener_ = nullptr;
  for (; connections_held_ > 0; --connections_held_) tenant_->ReleaseConnection();
}

void Comm::SendAborts(const Status& why, const Descriptor& d, bool to_next, bool to_prev,
                      OutFrame* half_sent) {
  const PeerFailuresQuiet quiet;  // `why` was counted if a peer caused it; this meets its traces
  std::string text;
  text.push_back(char(static_cast<int>(why.code())));
  text += why.message().substr(0, kMaxAbortText - 1);
  // Best effort within 2 % of the timeout (at most 2 s) for each neighbour: one that reads gets
  // the ABORT at once, one that stopped reading (SIGSTOP, or no RDMA credit left) must not push
  // this rank's error past DTENJAX_COLLECTIVE_TIMEOUT by more than that, nor take the other's
  // time (over verbs an ABORT posted after its deadline is abandoned, its write flushed).
  const double budget = std::min(2.0, 0.02 * opts_.timeout_s);
  double deadline = NowSeconds() + budget;
  auto send = [&](Conn* c) {
    Status s = SendSealed(c, FrameType::kAbort, d, text.data(), text.size(), deadline);
    if (s.ok()) Counters().aborts_sent.fetch_add(1);
  };
  if (to_next && next_) {
    bool clean = true;
    if (half_sent && half_sent->active && !half_sent->done()) {
      // Finish the frame in flight so the peer can parse what follows: a sealed frame holds the
      // connection's next counter even with nothing of it sent yet (the peer would take the ABORT
      // behind it for a dropped frame), and over verbs its write may be posted while nothing is
      // counted as sent (its completion is the frame's, not the ABORT's).
      while (!half_sent->done() && NowSeconds() < deadline) {
        bool progress = false;
        if (!opts_.provider->send_some(next_, half_sent, &progress).ok()) break;
        if (!progress && !half_sent->done()) {
          WaitItem w{next_, true, false};
          opts_.provider->wait(&w, 1, deadline);
        }
      }
      clean = half_sent->done();
    }
    if (clean) send(next_);
  }
  if (to_prev && prev_) {
    deadline = NowSeconds() + budget;
    send(prev_);
  }
  if (next_) opts_.provider->shutdown(next_);
  if (prev_) opts_.provider->shutdown(prev_);
}

Status Comm::AllReduce(const void* src, void* dst, uint64_t count, DType dt, ReduceOp op,
                       uint64_t site, int64_t ring_position, uint32_t tag,
                       const std::string& thread) {
  if (closing_.load()) return ClosedLocally("before this all_reduce ran");
  std::lock_guard<std::mutex> lock(op_mu_);
  if (closing_.load()) return ClosedLocally("before this all_reduce ran");
  if (!broken_.ok()) {
    return Status(broken_.code(), "dtenjax transport: communicator of rank " +
                                      std::to_string(opts_.rank) +
                                      " is unusable after an earlier failure: " + broken_.message());
  }
  Counters().collectives.fetch_add(1);
  Counters().ops_in_flight.fetch_add(1);
  struct InFlight { ~InFlight() { Counters().ops_in_flight.fetch_sub(1); } } in_flight;
  Descriptor d;
  d.coll_seq = ++coll_seq_;
  d.count = count;
  d.tag = tag;
  d.op = uint8_t(op);
  d.dtype = uint8_t(dt);
  const int n = opts_.size, r = opts_.rank;
  Status s;
  const Fingerprint* fp = nullptr;
  if (n > 1) {
    // The digest of the last collective is reused when nothing in it changed (a loop).
    if (!fp_cache_valid_ || fp_cache_site_ != site || fp_cache_.tag != tag ||
        fp_cache_.op != d.op || fp_cache_.dtype != d.dtype || fp_cache_.count != count ||
        fp_cache_.thread != thread) {
      fp_cache_valid_ = false;
      s = MakeFingerprint(fp_key_, d, site, thread, &fp_cache_);
      if (s.ok()) fp_cache_valid_ = true, fp_cache_site_ = site;
    }
    fp = &fp_cache_;
    const Fingerprint& fp_ref = fp_cache_;
    // Every frame header carries the whole digest (the user tag is inside it).
    d.site = uint32_t(fp_ref.digest);
    d.tag = uint32_t(fp_ref.digest >> 32);
    // What a mismatch found later should say about the collectives before it.
    run_hint_.clear();
    if (run_len_ >= 2) {
      run_hint_ = ". Collectives #" + std::to_string(run_first_) + " to #" +
                  std::to_string(run_first_ + run_len_ - 1) +
                  " before this one had identical fingerprints and no tag on this rank: if the "
                  "ranks issued them in different orders, they were paired with the wrong "
                  "partners and their results are mixed (nothing on the wire tells them apart). "
                  "Give each a tag (e.g. its key or step number) and recompute them";
    }
    if (tag == 0 && run_len_ > 0 && fp_ref.digest == run_digest_) {
      ++run_len_;
    } else if (tag == 0) {
      run_digest_ = fp_ref.digest, run_first_ = d.coll_seq, run_len_ = 1;
    } else {
      run_len_ = 0;
    }
  }
  if (!next_closed_.ok()) {
    CountPeerFailure();  // its close is a failure now that it is needed
    s = Status(Code::kUnavailable,
               "dtenjax transport: " + next_->peer + " closed its connection after the previous "
               "collective (its communicator was closed or its process exited), so rank " +
                   std::to_string(r) + " cannot run " + Describe(d) + " [" +
                   next_closed_.message() + "]");
  }
  if (DTypeSize(dt) == 0) {
    s = DTENJAX_ERROR(Code::kInvalidArgument, "unsupported dtype code " + std::to_string(int(dt)));
  } else if (!IsReduceOp(int(op))) {
    s = DTENJAX_ERROR(Code::kInvalidArgument, "unsupported reduction code " + std::to_string(int(op)));
  } else if (ring_position >= 0 && ring_position != r) {
    s = DTENJAX_ERROR(Code::kInvalidArgument,
                      "dtenjax transport: this process holds position " +
                          std::to_string(ring_position) +
                          " of the reduced mesh axis but is rank " + std::to_string(r) +
                          " of its ring (its jax.process_index()); the host ring needs the "
                          "processes along that axis in process order. Build the mesh from "
                          "jax.devices() in their order (jax.make_mesh does) or use algorithm='xla'");
  }
  if (n == 1) {
    if (s.ok() && dst != src) std::memcpy(dst, src, count * DTypeSize(dt));
    return s;
  }
  if (next_ == nullptr) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "communicator is not connected (ConnectRing first)");
  }
  OutFrame of;
  if (!s.ok()) {
    SendAborts(s, d, next_closed_.ok(), true, &of);
  } else {
    s = RunRing(static_cast<const uint8_t*>(src), static_cast<uint8_t*>(dst), d, dt, op, &of, fp);
  }
  if (!s.ok()) broken_ = s;
  return s;
}

Status Comm::Submit(std::function<void()> fn) {
  std::shared_ptr<WorkQueue> q = queue_;
  std::lock_guard<std::mutex> lock(q->mu);
  if (q->stop) return ClosedLocally("before this collective was queued");
  if (!q->started) {
    Status s = StartDetachedThread(
        [q] {
          {
            std::lock_guard<std::mutex> l(q->mu);
            q->worker = std::this_thread::get_id();
          }
          // Close() waits for this (the thread is detached, so a Comm dropped on it never joins
          // itself; the flag is its join).
          struct Exit {
            WorkQueue* q;
            ~Exit() {
              std::lock_guard<std::mutex> l(q->mu);
              q->exited = true;
              q->cv.notify_all();
            }
          } exit_flag{q.get()};
          while (true) {
            std::function<void()> item;
            {
              std::unique_lock<std::mutex> l(q->mu);
              q->cv.wait(l, [&] { return q->stop || !q->items.empty(); });
              if (q->items.empty()) return;  // stopped and drained
              item = std::move(q->items.front());
              q->items.pop_front();
              Counters().queue_depth.fetch_sub(1);
            }
            try {
              item();  // items report their own failures; nothing may escape the thread
            } catch (...) {
            }
          }
        },
        "the communicator's worker");
    if (!s.ok()) return s;
    q->started = true;
  }
  q->items.push_back(std::move(fn));
  Counters().queue_depth.fetch_add(1);
  q->cv.notify_one();
  return Status::Ok();
}

}  // namespace dtenjax::transport
