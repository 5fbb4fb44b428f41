// RDMA verbs provider: the Provider record and connection set-up.
//
// Connection set-up: an authenticated TCP connection (the TCP provider, with its HMAC handshake
// and session keys) carries each side's QP number, PSN, LID, GID, and the rkey/address of its
// registered receive slab in authenticated CONTROL frames; then the RC QP goes RESET -> INIT ->
// RTR -> RTS, and each side tells the other it is ready (a second CONTROL frame) before anyone
// writes: a write that reached a QP not yet in RTR would be dropped and retried into an error.
// The data path is verbs_pump.cc; the library and the device verbs_loader.cc (verbs_impl.h).
//
// Exercised end to end in the test suite on an emulated device (tests/fakeverbs/: the ibv_*
// contract over unix sockets). NEVER RUN ON RDMA HARDWARE: timings, GPUDirect and the link-layer
// differences of real InfiniBand and RoCE fabrics are not covered (docs/transport.md).
#include "csrc/transport/verbs.h"

#include <fcntl.h>
#include <infiniband/verbs.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/verbs_impl.h"

namespace dtenjax::transport {
namespace verbs {

namespace {

Status Modify(VerbsConn* v, int to, ibv_qp_attr* attr) {
  DTENJAX_RETURN_IF_ERROR(CheckTransition(v->state, to));
  attr->qp_state = static_cast<ibv_qp_state>(to);
  const int rc = v->dev->lib.modify_qp(v->qp, attr, TransitionMask(to));
  if (rc != 0) {
    return DTENJAX_ERROR(Code::kInternal, "ibv_modify_qp to state " + std::to_string(to) +
                                              " failed: " + std::strerror(rc));
  }
  v->state = to;
  return Status::Ok();
}

void Destroy(VerbsConn* v) {
  if (v->dev) {
    const Lib& lib = v->dev->lib;
    if (v->qp) lib.destroy_qp(v->qp);
    if (v->cq) {
      if (v->channel) ConsumeEvents(v);
      lib.destroy_cq(v->cq);
    }
    if (v->channel) lib.destroy_comp_channel(v->channel);
    if (v->send_mr) lib.dereg_mr(v->send_mr);
    if (v->recv_mr) lib.dereg_mr(v->recv_mr);
    ReleaseDevice();
  }
  std::free(v->send_buf);
  std::free(v->recv_buf);
  if (v->side) TcpProvider()->close(v->side);
  delete v;
}

// Creates the QP and MRs, swaps QpInfo over the side channel, brings the QP to RTS, and waits
// until the peer's QP is ready to receive too.
Status Setup(Conn* side, double deadline, Conn** out) {
  auto* v = new VerbsConn;
  v->side = side;
  Status s = AcquireDevice(&v->dev);
  auto fail = [&](Status st) { Destroy(v); return st; };
  if (!s.ok()) {
    v->dev = nullptr;
    return fail(s);
  }
  const Lib& lib = v->dev->lib;
  ibv_pd* pd = v->dev->pd;
  v->channel = lib.create_comp_channel(v->dev->ctx);
  if (!v->channel) return fail(DTENJAX_ERROR(Code::kInternal, "ibv_create_comp_channel failed"));
  const int flags = fcntl(v->channel->fd, F_GETFL);
  if (flags < 0 || fcntl(v->channel->fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return fail(DTENJAX_ERROR(Code::kInternal, "cannot make the completion channel non-blocking"));
  }
  v->cq = lib.create_cq(v->dev->ctx, kCqDepth, nullptr, v->channel, 0);
  if (!v->cq) return fail(DTENJAX_ERROR(Code::kInternal, "ibv_create_cq failed"));
  ibv_qp_init_attr ia{};
  ia.send_cq = v->cq;
  ia.recv_cq = v->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = kSendDepth;
  ia.cap.max_recv_wr = kRecvDepth;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  v->qp = lib.create_qp(pd, &ia);
  if (!v->qp) return fail(DTENJAX_ERROR(Code::kInternal, "ibv_create_qp failed"));
  v->send_buf = std::aligned_alloc(4096, kSlab);
  v->recv_buf = std::aligned_alloc(4096, kSlab);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  v->send_mr = v->send_buf ? lib.reg_mr(pd, v->send_buf, kSlab, IBV_ACCESS_LOCAL_WRITE) : nullptr;
  v->recv_mr = v->recv_buf ? lib.reg_mr(pd, v->recv_buf, kSlab, access) : nullptr;
  if (!v->send_mr || !v->recv_mr) return fail(DTENJAX_ERROR(Code::kResourceExhausted, "ibv_reg_mr failed"));
  QpInfo mine{};
  mine.qpn = v->qp->qp_num;
  uint32_t rnd = 0;
  if (!(s = crypto::RandomBytes(&rnd, sizeof(rnd))).ok()) return fail(s);
  mine.psn = rnd & 0xffffff;
  mine.lid = v->dev->port_attr.lid;
  std::memcpy(mine.gid, v->dev->gid.raw, 16);
  mine.rkey = v->recv_mr->rkey;
  mine.addr = reinterpret_cast<uint64_t>(v->recv_buf);
  s = SendSealed(side, FrameType::kControl, Descriptor{}, &mine, sizeof(mine), deadline);
  if (s.ok()) s = RecvSealed(side, FrameType::kControl, &v->remote, sizeof(v->remote), deadline);
  if (!s.ok()) return fail(s);
  QpParams p;
  p.port = v->dev->port;
  p.gid_index = v->dev->gid_index;
  p.gid_table_len = v->dev->port_attr.gid_tbl_len;
  p.ethernet = v->dev->ethernet;
  p.mtu_bytes = 256 << (int(v->dev->port_attr.active_mtu) - 1);
  p.max_send_wr = kSendDepth;
  p.max_recv_wr = kRecvDepth;
  p.psn = mine.psn;
  p.dest_qpn = v->remote.qpn;
  p.dlid = v->remote.lid;
  s = ValidateQpParams(p);
  if (!s.ok()) return fail(s);
  ibv_qp_attr a{};
  a.pkey_index = 0;
  a.port_num = uint8_t(p.port);
  a.qp_access_flags = access;
  if (!(s = Modify(v, kInit, &a)).ok()) return fail(s);
  for (int i = 0; i < kRecvDepth; ++i) {
    if (!(s = PostRecv(v)).ok()) return fail(s);
  }
  a = ibv_qp_attr{};
  a.path_mtu = static_cast<ibv_mtu>(MtuEnum(p.mtu_bytes));
  a.dest_qp_num = v->remote.qpn;
  a.rq_psn = v->remote.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = uint8_t(p.min_rnr_timer);
  a.ah_attr.port_num = uint8_t(p.port);
  a.ah_attr.dlid = v->remote.lid;
  if (p.ethernet) {  // RoCE: routed by GID (RoCE v2 is UDP/IP)
    a.ah_attr.is_global = 1;
    std::memcpy(a.ah_attr.grh.dgid.raw, v->remote.gid, 16);
    a.ah_attr.grh.sgid_index = uint8_t(p.gid_index);
    a.ah_attr.grh.hop_limit = 64;
  }
  if (!(s = Modify(v, kRtr, &a)).ok()) return fail(s);
  a = ibv_qp_attr{};
  a.timeout = uint8_t(p.timeout);
  a.retry_cnt = uint8_t(p.retry_cnt);
  a.rnr_retry = uint8_t(p.rnr_retry);
  a.sq_psn = mine.psn;
  a.max_rd_atomic = 1;
  if (!(s = Modify(v, kRts, &a)).ok()) return fail(s);
  // Both QPs receive before either writes.
  const uint32_t ready = mine.qpn;
  uint32_t theirs = 0;
  s = SendSealed(side, FrameType::kControl, Descriptor{}, &ready, sizeof(ready), deadline);
  if (s.ok()) s = RecvSealed(side, FrameType::kControl, &theirs, sizeof(theirs), deadline);
  if (s.ok() && theirs != v->remote.qpn) {
    s = DTENJAX_ERROR(Code::kDataLoss, "RDMA set-up with " + side->peer + ": ready message names QP " +
                                           std::to_string(theirs) + ", expected " +
                                           std::to_string(v->remote.qpn));
  }
  if (!s.ok()) return fail(s);
  auto* c = new Conn;
  c->provider = VerbsProvider();
  c->peer_rank = side->peer_rank;
  c->peer = side->peer + " over RDMA";
  c->job_id = side->job_id;
  c->my_rank = side->my_rank;
  // Frames over the QP are authenticated with the side channel's session (its counters continue).
  c->session = std::move(side->session);
  c->impl = v;
  *out = c;
  return Status::Ok();
}

bool VerbsCanConnect(const std::string& ep) {
  int n = 0;
  return ep.rfind("tcp://", 0) == 0 && CountDevices(&n).ok();
}

Status VerbsListen(const std::string& bind_address, Listener** out) {
  Device* d;
  DTENJAX_RETURN_IF_ERROR(AcquireDevice(&d));  // held by the listener until it closes
  Status s = TcpProvider()->listen(bind_address, out);
  if (!s.ok()) {
    ReleaseDevice();
    return s;
  }
  (*out)->provider = VerbsProvider();
  return Status::Ok();
}

Status VerbsConnect(const std::string& ep, const Handshake& hs, double deadline, Conn** out) {
  Conn* side = nullptr;
  DTENJAX_RETURN_IF_ERROR(TcpProvider()->connect(ep, hs, deadline, &side));
  return Setup(side, deadline, out);
}

Status VerbsAccept(Listener* l, const Handshake& hs, double deadline, Conn** out) {
  Conn* side = nullptr;
  const Provider* was = l->provider;
  l->provider = TcpProvider();
  Status s = TcpProvider()->accept(l, hs, deadline, &side);
  l->provider = was;
  DTENJAX_RETURN_IF_ERROR(s);
  return Setup(side, deadline, out);
}

void VerbsClose(Conn* c) {
  if (!c) return;
  if (c->impl) Destroy(static_cast<VerbsConn*>(c->impl));
  delete c;
}

void VerbsCloseListener(Listener* l) {
  if (!l) return;
  l->provider = TcpProvider();
  TcpProvider()->close_listener(l);
  ReleaseDevice();
}

const Provider kVerbs = {"verbs", kSlab - kSealedHeadBytes - kTagBytes, VerbsCanConnect,
                         VerbsListen, VerbsConnect, VerbsAccept, VerbsSendSome, VerbsRecvSome,
                         VerbsWait, VerbsShutdown, VerbsClose, VerbsCloseListener};

}  // namespace

const Provider* VerbsProvider() { return &kVerbs; }

}  // namespace verbs

DTENJAX_REGISTER_PROVIDER(verbs, verbs::VerbsProvider);

}  // namespace dtenjax::transport
