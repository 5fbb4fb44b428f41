// The ring all-reduce of a communicator (Comm::RunRing, comm.h): reduce-scatter then all-gather
// over n chunks in segments, each forwarded as soon as it arrived, with the collective's
// fingerprint checked before any payload is combined and ABORT frames on every failure.
//
// One call is a Comm::Ring: the ring's geometry (RingPlan), the progress of both directions, and
// one method per part of the loop: the call-site text, the send side, the receive side (a
// frame's head, then its body), the backwards watch of the next rank, and the timeout. Every
// failure goes through Fail, which sends ABORT frames to the neighbours that need to know.
#include "csrc/transport/comm.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "csrc/transport/arithmetic.h"
#include "csrc/transport/peer_text.h"

namespace dtenjax::transport {

namespace {

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", s);
  return buf;
}

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
        of_(of), T_(plan.steps()), fp_(fp) {
    rev_.watch = true;
  }

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
    std::string text = AbortReason(f->dst, f->payload_bytes, kMaxAbortText, &code);
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
      if (st_ == T_ && !next_closed_in_flight_.ok()) c_.next_closed_ = next_closed_in_flight_;
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
    std::string waiting;
    if (rt_ < T_) {
      waiting = "receiving segment " + std::to_string(rj_) + " of ring step " +
                std::to_string(rt_) + " from " + c_.prev_->peer;
    } else if (!next_closed_in_flight_.ok()) {
      waiting = "waiting for the send of its last frame to " + c_.next_->peer +
                " to complete, which closed its connection meanwhile";
    } else {
      waiting = "sending ring step " + std::to_string(st_) + " to " + c_.next_->peer;
    }
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
    const bool watching = !next_done_ && next_closed_in_flight_.ok();
    WaitItem w[2] = {{next, of_->active, watching}, {c_.prev_, false, rt_ < T_}};
    Counters().waits.fetch_add(1);
    Status s = c_.opts_.provider->wait(w, 2, last_progress_ + c_.opts_.timeout_s);
    if (!s.ok()) return Fail(s, true, true);
    if (!watching) return Status::Ok();
    bool p = false;
    rev_.closed = false;
    s = c_.opts_.provider->recv_some(next, &rev_, &p);
    if (rev_.closed) {
      // The next rank closed its connection; the watch counted nothing, this decides.
      if (rev_.stage == InFrame::kHead && rev_.got == 0) {
        if (st_ == T_) {
          // Everything for the next rank was sent and it closed: it finished this collective and
          // closed its communicator (or exited). Nothing here needs it any more; the next
          // collective reports it.
          next_done_ = true;
          c_.next_closed_ = s;
          return Status::Ok();
        }
        if (LastFrameInFlight()) {
          // It may have closed having taken our last frame before this side saw that frame's
          // send complete (an RDMA write completes when the peer's acknowledgement comes back,
          // which can be after the peer returned and closed; or the wait above just took that
          // completion): the send side decides, the write completes or fails after the device's
          // retries (counted and reported there, once). The closed rank is not looked at again;
          // once that write completes, the next collective reports the close (as above).
          next_closed_in_flight_ = s;
          return Status::Ok();
        }
      }
      // The close fails this rank: read it again as the peer's end, not a watch's look (the
      // provider counts it; over verbs it first waits for the peer's last words, as a receive
      // does: an ABORT whose receive completion lands after the close is its reason).
      rev_.watch = false;
      s = c_.opts_.provider->recv_some(next, &rev_, &p);
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

  bool LastFrameInFlight() const {
    return of_->active && st_ == T_ - 1 && sj_ + 1 == p_.nseg(p_.send_chunk(st_));
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
  Status next_closed_in_flight_;  // it closed while our last frame's send was undecided
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

}  // namespace dtenjax::transport
