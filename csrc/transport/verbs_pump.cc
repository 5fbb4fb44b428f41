// RDMA verbs provider, the data path of a connection set up by verbs_provider.cc:
// one frame (frame.h: head, payload, payload tag; authenticated with the TCP connection's
// session keys like every TCP frame) is copied into the registered send slab and posted as RDMA
// WRITE WITH IMM into the peer's receive slab; the receive completion (imm = frame length) is the
// signal; the receiver copies the frame out, reposts a receive and returns one credit with a
// zero-length SEND. One frame in flight per direction; frames of both directions share the QP
// (aborts travel backwards). Waiting blocks on the CQ's completion channel; the TCP connection
// stays open as the peer's liveness signal (a dead process closes it at once).
#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/verbs_impl.h"

namespace dtenjax::transport::verbs {

Status PostRecv(VerbsConn* v) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = kWrRecv;
  if (const int rc = ibv_post_recv(v->qp, &wr, &bad)) {
    return DTENJAX_ERROR(Code::kInternal, std::string("ibv_post_recv failed: ") + std::strerror(rc));
  }
  return Status::Ok();
}

// Acknowledges every completion event waiting on the channel (it is non-blocking).
void ConsumeEvents(VerbsConn* v) {
  ibv_cq* cq = nullptr;
  void* ctx = nullptr;
  unsigned n = 0;
  while (v->dev->lib.get_cq_event(v->channel, &cq, &ctx) == 0) ++n;
  if (n) v->dev->lib.ack_cq_events(v->cq, n);
}

namespace {

Status Drain(VerbsConn* v, const std::string& peer, bool* changed = nullptr);

// How long a closed side channel leaves for the completions the peer's last work is owed.
constexpr double kLastWordsSeconds = 1.0;

// The peer's process is alive while its TCP side channel is open; a dead one closed it. A peer
// that closes its communicator right after its last exchange closes the channel once its last
// RDMA write has completed, i.e. once this device acknowledged the frame, but the receive
// completion may reach this CQ after the acknowledgement (the specification orders neither), and
// this thread may have polled the CQ just before it landed: before calling the peer lost, wait
// (at most kLastWordsSeconds) for what this side waits for, `arrived` (a frame) or a credit.
// A watch (a look for an ABORT the peer is owed nothing for) does not wait, and is told
// (InFrame::closed) rather than counted.
Status SideAlive(VerbsConn* v, const std::string& peer, bool recv, InFrame* watch = nullptr) {
  bool progress = false;
  v->side_in.watch = true;  // only its end is expected; counted below (or by the watcher), once
  Status s = TcpProvider()->recv_some(v->side, &v->side_in, &progress);
  if (!s.ok()) {
    const double until = NowSeconds() + kLastWordsSeconds;
    while (!watch) {
      DTENJAX_RETURN_IF_ERROR(Drain(v, peer));
      if (recv ? v->arrived >= 0 : v->credits > 0) return Status::Ok();
      const double left = until - NowSeconds();
      if (left <= 0) break;
      if (ibv_req_notify_cq(v->cq, 0) != 0) break;
      bool changed = false;
      DTENJAX_RETURN_IF_ERROR(Drain(v, peer, &changed));
      if (changed) continue;
      pollfd pfd{v->channel->fd, POLLIN, 0};
      if (::poll(&pfd, 1, int(std::min(left, 0.02) * 1000) + 1) > 0) ConsumeEvents(v);
    }
    if (watch) {
      watch->closed = true;
    } else {
      CountPeerFailure();
    }
    return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: lost " + peer +
                                                 ": its TCP set-up connection closed (that process "
                                                 "died, aborted the collective or closed its "
                                                 "communicator)" +
                                                 (watch ? std::string()
                                                  : recv ? " before its next frame arrived"
                                                         : " before it returned this side's "
                                                           "credit to send"));
  }
  if (v->side_in.stage != InFrame::kHead || v->side_in.got) {
    Counters().rejected_bad_header.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: " + peer + " sent bytes on the RDMA "
                                              "connection's set-up channel after set-up");
  }
  return Status::Ok();
}

Status WcFailed(const ibv_wc& wc, const std::string& peer) {
  CountPeerFailure();
  const char* what = wc.wr_id == kWrWrite    ? "the RDMA write of a frame to"
                     : wc.wr_id == kWrCredit ? "a credit message to"
                                             : "a receive from";
  return DTENJAX_ERROR(Code::kUnavailable,
                       std::string("dtenjax transport: ") + what + " " + peer + " failed: " +
                           WcStatusName(int(wc.status)) + " (" + WcStatusMeaning(int(wc.status)) +
                           ")");
}

// Polls the completion queue empty, updating the connection's state.
Status Drain(VerbsConn* v, const std::string& peer, bool* changed) {
  if (!v->failed.ok()) return v->failed;
  ibv_wc wc[8];
  while (true) {
    int n = ibv_poll_cq(v->cq, 8, wc);
    if (n < 0) {
      CountPeerFailure();
      return v->failed = DTENJAX_ERROR(Code::kUnavailable,
                                       "dtenjax transport: ibv_poll_cq failed on the completion "
                                       "queue of the RDMA connection to " + peer +
                                           " (the CQ overran or the device failed; it cannot be "
                                           "used any more)");
    }
    if (n == 0) return Status::Ok();
    if (changed) *changed = true;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return v->failed = WcFailed(wc[i], peer);
      if (wc[i].opcode == IBV_WC_RDMA_WRITE) {
        v->write_done = true;
      } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        uint32_t bytes;
        bool last;
        DecodeImm(ntohl(wc[i].imm_data), &bytes, &last);
        if (v->arrived >= 0 || bytes > kSlab || wc[i].byte_len != bytes) {
          Counters().rejected_oversized.fetch_add(1);
          return DTENJAX_ERROR(Code::kDataLoss, "RDMA frame from " + peer +
                                                    " overruns the receive slab (credit violated)");
        }
        v->arrived = int64_t(bytes);
      } else if (wc[i].opcode == IBV_WC_RECV) {  // a credit came back
        ++v->credits;
        DTENJAX_RETURN_IF_ERROR(PostRecv(v));
      }
    }
  }
}


// The frame's counter (its header's seq): unique on its connection's direction, so it tells the
// frame whose write is posted from any other (an address could be reused by the next frame).
uint64_t FrameSeq(const OutFrame& f) {
  FrameHeader h;
  std::memcpy(&h, f.head, sizeof(h));
  return h.seq;
}

}  // namespace

Status VerbsSendSome(Conn* c, OutFrame* f, bool* progress) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  *progress = false;
  DTENJAX_RETURN_IF_ERROR(Drain(v, c->peer));
  if (f->done()) return Status::Ok();
  const uint64_t seq = FrameSeq(*f);
  if (v->write_posted && v->write_seq != seq) {
    // The write in flight is another frame's (one its sender stopped sending, e.g. the ring's
    // segment when the ring gave up): its completion says nothing about this frame, which goes
    // out as a write of its own once that one is done. It was delivered; nobody waits for it.
    if (!v->write_done) return Status::Ok();
    v->write_posted = false;
    Counters().frames_sent.fetch_add(1);
    Counters().bytes_sent.fetch_add(v->write_bytes);
  }
  if (!v->write_posted) {
    if (v->credits <= 0) {
      DTENJAX_RETURN_IF_ERROR(SideAlive(v, c->peer, false));
      if (v->credits <= 0) return Status::Ok();
    }
    if (f->total() > kSlab) {
      return DTENJAX_ERROR(Code::kInvalidArgument, "frame of " + std::to_string(f->total()) +
                                                       " bytes exceeds the RDMA slab");
    }
    uint8_t* b = static_cast<uint8_t*>(v->send_buf);
    std::memcpy(b, f->head, kSealedHeadBytes);
    if (f->payload_bytes) std::memcpy(b + kSealedHeadBytes, f->payload, f->payload_bytes);
    std::memcpy(b + kSealedHeadBytes + f->payload_bytes, f->ptag, kTagBytes);
    ibv_sge sge{reinterpret_cast<uint64_t>(b), uint32_t(f->total()), v->send_mr->lkey};
    ibv_send_wr wr{}, *bad = nullptr;
    wr.wr_id = kWrWrite;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(EncodeImm(uint32_t(f->total()), true));
    wr.wr.rdma.remote_addr = v->remote.addr;
    wr.wr.rdma.rkey = v->remote.rkey;
    if (const int rc = ibv_post_send(v->qp, &wr, &bad)) {
      return DTENJAX_ERROR(Code::kInternal, std::string("ibv_post_send (RDMA WRITE WITH IMM) failed: ") +
                                                std::strerror(rc));
    }
    --v->credits;
    v->write_posted = true;
    v->write_seq = seq;
    v->write_bytes = f->total();
    v->write_done = false;
    *progress = true;
  }
  if (v->write_done) {
    v->write_posted = false;
    f->sent = f->total();
    *progress = true;
    Counters().frames_sent.fetch_add(1);
    Counters().bytes_sent.fetch_add(f->total());
    return Status::Ok();
  }
  // A write in flight is the device's to finish: it completes, or fails after its retries when
  // the peer is gone (the peer may close right after receiving this last frame, before its
  // acknowledgement reached us, so its closed set-up channel says nothing here).
  return Status::Ok();
}

Status VerbsRecvSome(Conn* c, InFrame* f, bool* progress) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  *progress = false;
  DTENJAX_RETURN_IF_ERROR(Drain(v, c->peer));
  if (v->arrived < 0) {
    DTENJAX_RETURN_IF_ERROR(SideAlive(v, c->peer, true, f->watch ? f : nullptr));
    if (v->arrived < 0) return Status::Ok();
  }
  const uint8_t* b = static_cast<const uint8_t*>(v->recv_buf);
  if (f->stage == InFrame::kHead) {
    if (uint64_t(v->arrived) < kSealedHeadBytes + kTagBytes) {
      Counters().rejected_bad_header.fetch_add(1);
      return DTENJAX_ERROR(Code::kDataLoss, "RDMA frame from " + c->peer + " is too short");
    }
    std::memcpy(f->head, b, kSealedHeadBytes);
    f->stage = InFrame::kHeadReady;
    *progress = true;
    return Status::Ok();
  }
  if (f->stage != InFrame::kBody) return Status::Ok();
  if (uint64_t(v->arrived) != kSealedHeadBytes + f->payload_bytes + kTagBytes) {
    Counters().rejected_bad_header.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "RDMA frame from " + c->peer + " has " +
                                              std::to_string(v->arrived) +
                                              " bytes, its header announces " +
                                              std::to_string(f->payload_bytes) + " payload bytes");
  }
  if (f->payload_bytes) std::memcpy(f->dst, b + kSealedHeadBytes, f->payload_bytes);
  std::memcpy(f->ptag, b + kSealedHeadBytes + f->payload_bytes, kTagBytes);
  v->arrived = -1;
  f->stage = InFrame::kDone;
  *progress = true;
  Counters().frames_received.fetch_add(1);
  Counters().bytes_received.fetch_add(kSealedHeadBytes + f->payload_bytes + kTagBytes);
  DTENJAX_RETURN_IF_ERROR(PostRecv(v));
  ibv_send_wr wr{}, *bad = nullptr;  // return the credit: a zero-length SEND
  wr.wr_id = kWrCredit;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (const int rc = ibv_post_send(v->qp, &wr, &bad)) {
    return DTENJAX_ERROR(Code::kInternal, std::string("ibv_post_send (credit) failed: ") +
                                              std::strerror(rc));
  }
  return Status::Ok();
}

// Blocks on the completion channels of the connections until a completion arrives or `until`
// (at most 20 ms at a time, so the callers' liveness checks run). Arm first, then look: a
// completion that lands after the look raises an event.
Status VerbsWait(const WaitItem* items, int n, double until) {
  pollfd pfd[4];
  VerbsConn* conns[4];
  int np = 0;
  for (int i = 0; i < n && np < 4; ++i) {
    if (!items[i].send && !items[i].recv) continue;
    auto* v = static_cast<VerbsConn*>(items[i].conn->impl);
    bool seen = false;
    for (int k = 0; k < np; ++k) seen |= conns[k] == v;
    if (seen) continue;
    if (ibv_req_notify_cq(v->cq, 0) != 0) return Status::Ok();  // the caller's poll reports it
    bool changed = false;
    Status s = Drain(v, items[i].conn->peer, &changed);
    if (!s.ok() || changed) return s;  // progress possible (or an error to report) now
    conns[np] = v;
    pfd[np++] = pollfd{v->channel->fd, POLLIN, 0};
  }
  const double left = until - NowSeconds();
  if (np == 0 || left <= 0) return Status::Ok();
  const int ms = int(std::min(left, 0.02) * 1000) + 1;
  if (::poll(pfd, nfds_t(np), ms) > 0) {
    for (int k = 0; k < np; ++k) {
      if (pfd[k].revents) ConsumeEvents(conns[k]);
    }
  }
  return Status::Ok();
}

void VerbsShutdown(Conn* c) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  if (v && v->qp && v->dev) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    v->dev->lib.modify_qp(v->qp, &a, IBV_QP_STATE);  // flushes this side's outstanding work
    v->state = kErr;
  }
  if (v && v->side) TcpProvider()->shutdown(v->side);  // the peer sees end-of-stream
}


}  // namespace dtenjax::transport::verbs
