#include "csrc/transport/comm.h"

#include "csrc/transport/peer_text.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace dtenjax::transport {

namespace {

template <typename T>
T Apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kMin: return a < b ? a : b;
  }
  return a;
}

template <typename T>
void ReduceT(T* out, const T* own, const T* in, uint64_t n, ReduceOp op) {
  switch (op) {  // one loop per op so the compiler vectorises the common sum
    case ReduceOp::kSum: for (uint64_t i = 0; i < n; ++i) out[i] = own[i] + in[i]; break;
    case ReduceOp::kProd: for (uint64_t i = 0; i < n; ++i) out[i] = own[i] * in[i]; break;
    default: for (uint64_t i = 0; i < n; ++i) out[i] = Apply(own[i], in[i], op); break;
  }
}

template <typename T>
void ReduceFloat(T* out, const T* own, const T* in, uint64_t n, ReduceOp op) {
  // max/min propagate NaN whatever the argument order, like jnp.maximum/minimum.
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
    for (uint64_t i = 0; i < n; ++i) {
      T a = own[i], b = in[i];
      out[i] = std::isnan(a) ? a : std::isnan(b) ? b : Apply(a, b, op);
    }
    return;
  }
  ReduceT(out, own, in, n, op);
}

float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

// Starts a detached thread running body (throws std::system_error as std::thread does).
void SpawnDetached(std::function<void()> body) { std::thread(std::move(body)).detach(); }

std::atomic<ThreadSpawner> g_spawner{&SpawnDetached};

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

}  // namespace

Status Reduce(void* out, const void* own, const void* in, uint64_t n, DType dt, ReduceOp op) {
  if (!IsReduceOp(int(op))) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported reduction code " + std::to_string(int(op)));
  }
  switch (dt) {
    case DType::kF32:
      ReduceFloat(static_cast<float*>(out), static_cast<const float*>(own),
                  static_cast<const float*>(in), n, op);
      break;
    case DType::kF64:
      ReduceFloat(static_cast<double*>(out), static_cast<const double*>(own),
                  static_cast<const double*>(in), n, op);
      break;
    case DType::kS32:
      ReduceT(static_cast<int32_t*>(out), static_cast<const int32_t*>(own),
              static_cast<const int32_t*>(in), n, op);
      break;
    case DType::kS64:
      ReduceT(static_cast<int64_t*>(out), static_cast<const int64_t*>(own),
              static_cast<const int64_t*>(in), n, op);
      break;
    case DType::kBF16: {
      auto* o = static_cast<uint16_t*>(out);
      auto* a = static_cast<const uint16_t*>(own);
      auto* b = static_cast<const uint16_t*>(in);
      for (uint64_t i = 0; i < n; ++i) {
        float x = Bf16ToF32(a[i]), y = Bf16ToF32(b[i]);
        float r = (op == ReduceOp::kMax || op == ReduceOp::kMin) && (std::isnan(x) || std::isnan(y))
                      ? (std::isnan(x) ? x : y)
                      : Apply(x, y, op);
        o[i] = F32ToBf16(r);
      }
      break;
    }
    default:
      return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported dtype code " + std::to_string(int(dt)));
  }
  return Status::Ok();
}

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
  std::string text;
  text.push_back(char(static_cast<int>(why.code())));
  text += why.message().substr(0, kMaxAbortText - 1);
  // Best effort within 2 % of the timeout (at most 2 s): a neighbour that reads gets the ABORT
  // at once, and one that stopped reading (SIGSTOP) must not push this rank's error past
  // DTENJAX_COLLECTIVE_TIMEOUT by more than that.
  const double deadline = NowSeconds() + std::min(2.0, 0.02 * opts_.timeout_s);
  auto send = [&](Conn* c) {
    Status s = SendSealed(c, FrameType::kAbort, d, text.data(), text.size(), deadline);
    if (s.ok()) Counters().aborts_sent.fetch_add(1);
  };
  if (to_next && next_) {
    bool clean = true;
    if (half_sent && half_sent->active && !half_sent->done() && half_sent->sent > 0) {
      // Finish the frame in flight so the peer can parse what follows.
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
  if (to_prev && prev_) send(prev_);
  if (next_) opts_.provider->shutdown(next_);
  if (prev_) opts_.provider->shutdown(prev_);
}

namespace {

// Why the receiver gives up; which neighbours must hear of it.
struct Failure {
  Status status;
  bool tell_next = true;
  bool tell_prev = true;
};

std::string AbortText(const InFrame& f, Code* code) {
  const char* p = reinterpret_cast<const char*>(f.dst);
  if (f.payload_bytes == 0) {
    *code = Code::kInternal;
    return "(no reason given)";
  }
  const int c = static_cast<unsigned char>(p[0]);
  *code = PeerCode(c);
  return PeerText(p + 1, f.payload_bytes - 1, kMaxAbortText);  // the peer's words: escaped
}

}  // namespace

// --- the ring all-reduce (Comm::RunRing) ---------------------------------------------------------
//
// One call is a Comm::Ring: the ring's geometry (RingPlan), the progress of both directions, and
// one method per part of the loop: the call-site text, the send side, the receive side (a
// frame's head, then its body), the backwards watch of the next rank, and the timeout. Every
// failure goes through Fail, which sends ABORT frames to the neighbours that need to know.

namespace {

// Which chunk and segment moves at each step: n chunks, 2(n-1) steps (reduce-scatter, then
// all-gather), chunk c of `count` elements split in segments of at most seg_elems.
struct RingPlan {
  int n, r;
  uint64_t count;
  size_t esz;
  uint64_t seg_elems;

  int steps() const { return 2 * (n - 1); }
  int mod(int64_t v) const { return int(((v % n) + n) % n); }
  uint64_t off(int c) const { return (count / n) * uint64_t(c) + std::min<uint64_t>(c, count % n); }
  uint64_t len(int c) const { return count / n + (uint64_t(c) < count % n ? 1 : 0); }
  int send_chunk(int t) const { return t < n - 1 ? mod(r - t) : mod(r + 1 - (t - (n - 1))); }
  int recv_chunk(int t) const { return t < n - 1 ? mod(r - t - 1) : mod(r - (t - (n - 1))); }
  uint64_t nseg(int c) const { return std::max<uint64_t>(1, (len(c) + seg_elems - 1) / seg_elems); }
  uint64_t seg_len(int c, uint64_t j) const {
    return std::min(seg_elems, len(c) - std::min(len(c), j * seg_elems));
  }
  // Byte offset of segment j of chunk c.
  uint64_t at(int c, uint64_t j) const { return (off(c) + j * seg_elems) * esz; }
};

}  // namespace

class Comm::Ring {
 public:
  Ring(Comm& comm, const RingPlan& plan, const uint8_t* src, uint8_t* dst, uint8_t* tmp,
       const Descriptor& desc, DType dt, ReduceOp op, OutFrame* of, const Fingerprint* fp)
      : c_(comm), p_(plan), src_(src), dst_(dst), tmp_(tmp), desc_(desc), dt_(dt), op_(op),
        of_(of), T_(plan.steps()), fp_(fp) {}

  Status Run() {
    DTENJAX_RETURN_IF_ERROR(SendFingerprint());
    while (st_ < T_ || rt_ < T_) {
      if (c_.closing_.load()) {
        return Fail(c_.ClosedLocally("while " + Mine() + " was in flight"), true, true);
      }
      bool progress = false;
      if (st_ < T_) DTENJAX_RETURN_IF_ERROR(SendSide(&progress));
      DTENJAX_RETURN_IF_ERROR(ReceiveSide(&progress));
      const double now = NowSeconds();
      if (progress) {
        last_progress_ = now;
        continue;
      }
      if (now - last_progress_ >= c_.opts_.timeout_s) return TimedOut();
      DTENJAX_RETURN_IF_ERROR(WaitAndWatchNext());
    }
    return Status::Ok();
  }

 private:
  // This rank's collective, described in full (for messages only: built when one is written).
  std::string Mine() const {
    return fp_ ? "all_reduce #" + std::to_string(desc_.coll_seq) + " (" +
                     DescribeFingerprint(*fp_) + ")"
               : Describe(desc_);
  }

  // The previous rank's collective of header h: in full when its fingerprint record is known.
  std::string Theirs(const FrameHeader& h) const {
    const Descriptor d = DescriptorOf(h);
    if (h.coll_seq > 0 && c_.have_fp_received_ && c_.fp_received_.digest == DigestOf(d)) {
      return "all_reduce #" + std::to_string(h.coll_seq) + " (" +
             DescribeFingerprint(c_.fp_received_) + ")";
    }
    return Describe(d);
  }

  Status Fail(Status s, bool tell_next, bool tell_prev) {
    if (c_.closing_.load() && s.code() != Code::kCancelled) {
      // Closed here while it failed (e.g. a neighbour of this process closed first): the close
      // is the cause this rank reports.
      s = c_.ClosedLocally("while " + Mine() + " was in flight [" + s.message() + "]");
    }
    c_.SendAborts(s, desc_, tell_next, tell_prev, of_);
    return s;
  }

  // Reads the (short) payload of a frame whose head was authenticated: ABORT and SITE texts.
  Status ReadText(Conn* c, InFrame* f, uint64_t limit) {
    const FrameHeader& h = f->header();
    if (h.payload_bytes > limit) {
      Counters().rejected_oversized.fetch_add(1);
      return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: rejected frame from " + c->peer +
                                                ": " + FrameTypeName(h.type) + " text of " +
                                                std::to_string(h.payload_bytes) + " bytes exceeds " +
                                                std::to_string(limit));
    }
    f->dst = text_buf_;
    f->payload_bytes = h.payload_bytes;
    f->stage = InFrame::kBody;
    f->got = 0;
    const double until = NowSeconds() + std::min(2.0, c_.opts_.timeout_s);
    while (f->stage != InFrame::kDone) {
      bool p = false;
      DTENJAX_RETURN_IF_ERROR(c->provider->recv_some(c, f, &p));
      if (f->stage == InFrame::kDone) break;
      if (c_.closing_.load()) return c_.ClosedLocally("while it read a frame from " + c->peer);
      if (NowSeconds() >= until) {
        return DTENJAX_ERROR(Code::kDeadlineExceeded,
                             std::string("dtenjax transport: timed out reading a ") +
                                 FrameTypeName(f->header().type) + " frame from " + c->peer);
      }
      if (!p) {
        WaitItem w{c, false, true};
        c->provider->wait(&w, 1, until);
      }
    }
    return OpenBody(*c->session, *f, c->peer);
  }

  // An ABORT frame (head already authenticated): read its text and turn it into this rank's error.
  Status ReadAbort(Conn* c, InFrame* f, Status* out) {
    DTENJAX_RETURN_IF_ERROR(ReadText(c, f, kMaxAbortText));
    const FrameHeader& h = f->header();
    Counters().aborts_received.fetch_add(1);
    Code code;
    std::string text = AbortText(*f, &code);
    const std::string prefix = "dtenjax transport: ";
    if (text.compare(0, prefix.size(), prefix) == 0) text = text.substr(prefix.size());
    *out = Status(code, "dtenjax transport: rank " + std::to_string(h.src_rank) + " aborted " +
                            Describe(DescriptorOf(h)) + ": " + text + " [this rank (" +
                            std::to_string(p_.r) + ") was in " + Mine() + "]");
    return Status::Ok();
  }

  // The next rank died or went away while we sent to it: if it told us why first (an ABORT frame
  // waiting on that connection), that is the error to report.
  Status ReverseAbort(const Status& fallback) {
    Conn* next = c_.next_;
    for (int i = 0; i < 64; ++i) {
      bool p = false;
      if (!c_.opts_.provider->recv_some(next, &rev_, &p).ok()) break;
      if (rev_.stage == InFrame::kHeadReady) {
        if (!OpenHead(*next->session, rev_, c_.opts_.job_id, next->peer_rank, next->peer).ok() ||
            rev_.header().type != uint16_t(FrameType::kAbort)) {
          break;
        }
        Status why;
        return ReadAbort(next, &rev_, &why).ok() ? why : fallback;
      }
      if (!p) break;
    }
    return fallback;
  }

  // The next rank gets this collective's fingerprint record before its first segment when it
  // differs from the last one sent on this connection (a loop of identical collectives sends
  // one); every DATA header carries the 64-bit digest, which the receiver checks either way.
  Status SendFingerprint() {
    if (fp_ == nullptr || (c_.have_fp_sent_ && c_.fp_sent_ == fp_->digest)) return Status::Ok();
    const std::string payload = EncodeFingerprint(*fp_, true);
    Status s = SendSealed(c_.next_, FrameType::kFingerprint, desc_, payload.data(),
                          payload.size(), NowSeconds() + c_.opts_.timeout_s, &c_.closing_);
    if (!s.ok()) return Fail(ReverseAbort(s), false, true);
    c_.fp_sent_ = fp_->digest;
    c_.have_fp_sent_ = true;
    return Status::Ok();
  }

  // The previous rank's fingerprint, compared with this rank's before any of its payload is read.
  Status AcceptFingerprint(const FrameHeader& h) {
    Conn* prev = c_.prev_;
    Status s = ReadText(prev, &in_, kMaxFingerprintBytes);
    if (!s.ok()) return Fail(s, true, true);
    Fingerprint theirs;
    bool full = false;
    s = DecodeFingerprint(in_.dst, in_.payload_bytes, prev->peer, &theirs, &full);
    if (!s.ok()) return Fail(s, true, true);
    if (!full) {
      Counters().rejected_bad_header.fetch_add(1);
      return Fail(DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: rejected FINGERPRINT frame "
                                                 "from " + prev->peer + ": a record without its "
                                                 "fields"),
                  true, true);
    }
    c_.fp_received_ = theirs;
    c_.have_fp_received_ = true;
    in_.Reset();
    if (fp_ == nullptr || h.coll_seq != desc_.coll_seq || theirs.digest != fp_->digest) {
      Counters().rejected_mismatch.fetch_add(1);
      const std::string src = std::to_string(h.src_rank);
      const std::string what =
          "all_reduce #" + std::to_string(h.coll_seq) + " (" + DescribeFingerprint(theirs) + ")";
      return Fail(MismatchError(src, "runs " + what,
                                fp_ && h.coll_seq == desc_.coll_seq
                                    ? " (they differ in: " + FingerprintDifference(*fp_, theirs) + ")"
                                    : ""),
                  true, true);
    }
    return Status::Ok();
  }

  // The next segment, once the segment it forwards has arrived; then moves the frame in flight.
  Status SendSide(bool* progress) {
    if (!of_->active) {
      const bool ready = st_ == 0 || rt_ > st_ - 1 || (rt_ == st_ - 1 && rj_ > sj_);
      if (ready) DTENJAX_RETURN_IF_ERROR(SealNextSegment());
    }
    if (!of_->active) return Status::Ok();
    bool p = false;
    Status s = c_.opts_.provider->send_some(c_.next_, of_, &p);
    if (!s.ok()) return Fail(ReverseAbort(s), false, true);
    *progress |= p;
    if (of_->done()) {
      of_->active = false;
      if (++sj_ == p_.nseg(p_.send_chunk(st_))) {
        ++st_;
        sj_ = 0;
      }
    }
    return Status::Ok();
  }

  Status SealNextSegment() {
    const int c = p_.send_chunk(st_);
    const uint64_t bytes = p_.seg_len(c, sj_) * p_.esz;
    uint64_t slept = 0;
    Status s = c_.tenant_->bucket().Take(bytes, NowSeconds() + c_.opts_.timeout_s, &slept);
    if (!s.ok()) {
      return Fail(Status(s.code(), "dtenjax transport: rank " + std::to_string(p_.r) + ": " +
                                       s.message()),
                  true, true);
    }
    if (slept) Counters().throttled_ns.fetch_add(slept);
    Descriptor d = desc_;
    d.step = uint16_t(st_);
    // Step 0 sends this rank's own data; later steps forward what the previous step built.
    const uint8_t* from = st_ == 0 ? src_ : dst_;
    s = Seal(*c_.next_->session, FrameType::kData, c_.opts_.job_id, uint32_t(p_.r), d,
             from + p_.at(c, sj_), bytes, of_);
    return s.ok() ? s : Fail(s, true, true);
  }

  // Every segment that has arrived.
  Status ReceiveSide(bool* progress) {
    Conn* prev = c_.prev_;
    while (rt_ < T_) {
      bool p = false;
      Status s = c_.opts_.provider->recv_some(prev, &in_, &p);
      if (!s.ok()) return Fail(s, true, false);
      *progress |= p;
      if (in_.stage == InFrame::kHeadReady) {
        DTENJAX_RETURN_IF_ERROR(AcceptHead(progress));
        continue;
      }
      if (in_.stage != InFrame::kDone) break;
      DTENJAX_RETURN_IF_ERROR(AcceptBody());
    }
    return Status::Ok();
  }

  // A frame's head from the previous rank: an ABORT ends the call, a SITE text is read at once,
  // a DATA frame must be this collective's next segment (then its body is read into place).
  Status AcceptHead(bool* progress) {
    Conn* prev = c_.prev_;
    Status s = OpenHead(*prev->session, in_, c_.opts_.job_id, prev->peer_rank, prev->peer);
    if (!s.ok()) return Fail(s, true, true);
    const FrameHeader& h = in_.header();
    if (h.type == uint16_t(FrameType::kAbort)) {
      Status why;
      s = ReadAbort(prev, &in_, &why);
      return Fail(s.ok() ? why : s, true, false);
    }
    if (h.type == uint16_t(FrameType::kFingerprint)) {
      *progress = true;
      return AcceptFingerprint(h);
    }
    const Descriptor theirs = DescriptorOf(h);
    if (h.type != uint16_t(FrameType::kData) || !SameCollective(theirs, desc_) ||
        theirs.step != rt_) {
      Counters().rejected_mismatch.fetch_add(1);
      return Fail(Mismatch(h, theirs), true, true);
    }
    const int c = p_.recv_chunk(rt_);
    const uint64_t bytes = p_.seg_len(c, rj_) * p_.esz;
    if (h.payload_bytes != bytes) {
      Counters().rejected_mismatch.fetch_add(1);
      return Fail(DTENJAX_ERROR(Code::kInvalidArgument,
                                "dtenjax transport: rank " + std::to_string(h.src_rank) +
                                    " sent a segment of " + std::to_string(h.payload_bytes) +
                                    " bytes for " + Mine() + ", this rank expects " +
                                    std::to_string(bytes) +
                                    " (DTENJAX_TRANSPORT_SEGMENT_BYTES must be equal on every "
                                    "process)"),
                  true, true);
    }
    // Reduce-scatter steps stage the segment; all-gather steps receive it in place.
    in_.dst = rt_ < p_.n - 1 ? tmp_ : dst_ + p_.at(c, rj_);
    in_.payload_bytes = bytes;
    in_.stage = InFrame::kBody;
    in_.got = 0;
    return Status::Ok();
  }

  Status Mismatch(const FrameHeader& h, const Descriptor& theirs) const {
    std::string what =
        h.type != uint16_t(FrameType::kData)
            ? std::string("sent a ") + FrameTypeName(h.type) + " frame"
            : "sent a frame of " + Theirs(h) +
                  (SameCollective(theirs, desc_)
                       ? " at ring step " + std::to_string(theirs.step) + " (expected " +
                             std::to_string(rt_) + ")"
                       : "");
    return MismatchError(std::to_string(h.src_rank), what, "");
  }

  Status MismatchError(const std::string& src, const std::string& what,
                       const std::string& detail) const {
    const std::string r = std::to_string(p_.r);
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "dtenjax transport: collective mismatch between rank " + src +
                             " and rank " + r + ": rank " + r + " runs " + Mine() + " but rank " +
                             src + " " + what + detail +
                             ". Every process must issue the same collectives (same op, dtype, "
                             "shape, algorithm, call stack, thread and tag) in the same order; "
                             "collectives that look alike (e.g. iterations of one loop) are told "
                             "apart only by a tag" + c_.run_hint_);
  }

  // A segment's body has arrived: authenticate it, reduce it (reduce-scatter steps), move on.
  Status AcceptBody() {
    Status s = OpenBody(*c_.prev_->session, in_, c_.prev_->peer);
    if (!s.ok()) return Fail(s, true, true);
    if (rt_ < p_.n - 1) {
      const int c = p_.recv_chunk(rt_);
      const uint64_t at = p_.at(c, rj_);
      s = Reduce(dst_ + at, src_ + at, tmp_, p_.seg_len(c, rj_), dt_, op_);
      if (!s.ok()) return Fail(s, true, true);
    }
    in_.Reset();
    if (++rj_ == p_.nseg(p_.recv_chunk(rt_))) {
      ++rt_;
      rj_ = 0;
    }
    return Status::Ok();
  }

  Status TimedOut() {
    Counters().timeouts.fetch_add(1);
    std::string waiting =
        rt_ < T_ ? "receiving segment " + std::to_string(rj_) + " of ring step " +
                       std::to_string(rt_) + " from " + c_.prev_->peer
                 : "sending ring step " + std::to_string(st_) + " to " + c_.next_->peer;
    return Fail(DTENJAX_ERROR(Code::kDeadlineExceeded,
                              "dtenjax transport: rank " + std::to_string(p_.r) +
                                  " timed out after " + Seconds(c_.opts_.timeout_s) +
                                  " s without progress " + waiting + " in " + Mine() +
                                  " (DTENJAX_COLLECTIVE_TIMEOUT); the peer is stalled, dead or "
                                  "running a different program"),
                true, true);
  }

  // Waits for either neighbour, then looks at what came backwards from the next rank: only
  // ABORT frames may (or its death; or, once everything for it was sent, its orderly close).
  Status WaitAndWatchNext() {
    Conn* next = c_.next_;
    WaitItem w[2] = {{next, of_->active, !next_done_}, {c_.prev_, false, rt_ < T_}};
    Counters().waits.fetch_add(1);
    Status s = c_.opts_.provider->wait(w, 2, last_progress_ + c_.opts_.timeout_s);
    if (!s.ok()) return Fail(s, true, true);
    if (next_done_) return Status::Ok();
    bool p = false;
    s = c_.opts_.provider->recv_some(next, &rev_, &p);
    if (!s.ok() && st_ == T_ && rev_.stage == InFrame::kHead && rev_.got == 0) {
      // Everything for the next rank was sent and it closed: it finished this collective and
      // closed its communicator (or exited). Nothing here needs it any more; the next
      // collective reports it.
      next_done_ = true;
      c_.next_closed_ = s;
      return Status::Ok();
    }
    if (!s.ok()) return Fail(s, false, true);
    if (rev_.stage != InFrame::kHeadReady) return Status::Ok();
    s = OpenHead(*next->session, rev_, c_.opts_.job_id, next->peer_rank, next->peer);
    if (!s.ok()) return Fail(s, false, true);
    if (rev_.header().type != uint16_t(FrameType::kAbort)) {
      Counters().rejected_bad_header.fetch_add(1);
      return Fail(DTENJAX_ERROR(Code::kDataLoss,
                                std::string("dtenjax transport: ") + next->peer + " sent a " +
                                    FrameTypeName(rev_.header().type) +
                                    " frame backwards (only ABORT frames travel that way)"),
                  false, true);
    }
    Status why;
    s = ReadAbort(next, &rev_, &why);
    return Fail(s.ok() ? why : s, false, true);
  }

  Comm& c_;
  const RingPlan p_;
  const uint8_t* src_;
  uint8_t* dst_;
  uint8_t* tmp_;   // one received segment of a reduce-scatter step
  const Descriptor& desc_;
  const DType dt_;
  const ReduceOp op_;
  OutFrame* of_;
  const int T_;
  int st_ = 0, rt_ = 0;        // send / receive step
  uint64_t sj_ = 0, rj_ = 0;   // segment within the step
  bool next_done_ = false;     // the next rank closed after everything for it was sent
  InFrame in_, rev_;           // from the previous rank / backwards from the next one
  uint8_t text_buf_[kMaxAbortText > kMaxFingerprintBytes ? kMaxAbortText : kMaxFingerprintBytes];
  double last_progress_ = NowSeconds();
  const Fingerprint* fp_;   // nullptr: the ring set-up check
};

Status Comm::RunRing(const uint8_t* src, uint8_t* dst, const Descriptor& desc, DType dt,
                     ReduceOp op, OutFrame* of, const Fingerprint* fp) {
  const size_t esz = DTypeSize(dt);
  uint64_t seg_bytes = opts_.segment_bytes;
  if (opts_.provider->max_payload) seg_bytes = std::min(seg_bytes, opts_.provider->max_payload);
  const RingPlan plan{opts_.size, opts_.rank, desc.count, esz,
                      std::max<uint64_t>(1, seg_bytes / esz)};

  // Staging buffer of one received segment (reduce-scatter), from the pool.
  const uint64_t tmp_bytes = std::max<uint64_t>(1, std::min(plan.seg_elems, plan.len(0)) * esz);
  int buf = -1;
  void* tmp = nullptr;
  DTENJAX_RETURN_IF_ERROR(pool_->Acquire(tmp_bytes, &buf, &tmp));
  struct Release {
    BufferPool* p;
    int b;
    ~Release() { p->Release(b); }
  } release{pool_.get(), buf};
  return Ring(*this, plan, src, dst, static_cast<uint8_t*>(tmp), desc, dt, op, of, fp).Run();
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

namespace {
std::mutex g_comms_mu;
std::map<int64_t, std::shared_ptr<Comm>>& Comms() {
  static auto* comms = new std::map<int64_t, std::shared_ptr<Comm>>();
  return *comms;
}
int64_t g_next_id = 1;
}  // namespace

int64_t RegisterComm(std::shared_ptr<Comm> comm) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  int64_t id = g_next_id++;
  Comms()[id] = std::move(comm);
  return id;
}

std::shared_ptr<Comm> FindComm(int64_t id) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  auto it = Comms().find(id);
  return it == Comms().end() ? nullptr : it->second;
}

bool DestroyComm(int64_t id) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    auto it = Comms().find(id);
    if (it == Comms().end()) return false;
    c = std::move(it->second);
    Comms().erase(it);
  }
  return true;  // freed when the last queued collective holding it finishes
}

}  // namespace dtenjax::transport
