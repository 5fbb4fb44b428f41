// RDMA verbs provider. libibverbs is loaded at run time (dlopen), so the extension imports on
// machines without it; only the data structures and static-inline fast paths (ibv_post_send,
// ibv_post_recv, ibv_poll_cq, which go through context->ops) come from <infiniband/verbs.h>.
//
// Connection set-up: an authenticated TCP connection (the TCP provider, with its HMAC handshake
// and session keys) carries each side's QP number, PSN, LID, GID, and the rkey/address of its
// registered receive slab in authenticated CONTROL frames; then the RC QP goes RESET -> INIT ->
// RTR -> RTS. Data: one frame (frame.h: head, payload, payload tag; authenticated with the TCP
// connection's session keys like every TCP frame) is copied into the registered send slab and
// posted as RDMA WRITE WITH IMM into the peer's receive slab; the receive completion (imm = frame
// length) is the signal; the receiver copies the frame out, reposts a receive and returns one
// credit with a zero-length SEND. One frame in flight per direction; frames of both directions
// share the QP (aborts travel backwards).
//
// NEVER RUN ON RDMA HARDWARE: no machine we have has an RDMA device. The device-free logic
// (transitions, masks, GID choice, validation, imm encoding) is unit-tested; the rest compiles.
#include "csrc/transport/verbs.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tenancy.h"
#include "csrc/transport/crypto.h"

namespace dtenjax::transport {
namespace verbs {

Status CheckTransition(int from, int to) {
  bool ok = to == kReset || to == kErr || (from == kReset && to == kInit) ||
            (from == kInit && (to == kInit || to == kRtr)) || (from == kRtr && to == kRts) ||
            (from == kRts && to == kRts);
  if (!ok) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "RC QP cannot go from state " +
                                                     std::to_string(from) + " to " +
                                                     std::to_string(to) +
                                                     " (RESET -> INIT -> RTR -> RTS)");
  }
  return Status::Ok();
}

int TransitionMask(int to) {
  switch (to) {
    case kInit: return IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    case kRtr:
      return IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
             IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    case kRts:
      return IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
             IBV_QP_MAX_QP_RD_ATOMIC;
    case kReset: case kErr: return IBV_QP_STATE;
  }
  return 0;
}

static bool IsZero(const uint8_t* g) {
  for (int i = 0; i < 16; ++i) if (g[i]) return false;
  return true;
}

static bool IsV4Mapped(const uint8_t* g) {
  for (int i = 0; i < 10; ++i) if (g[i]) return false;
  return g[10] == 0xff && g[11] == 0xff;
}

int SelectGidIndex(const GidEntry* gids, int n, bool ethernet) {
  if (!ethernet) return n > 0 ? 0 : -1;
  for (int pass = 0; pass < 3; ++pass) {
    for (int i = 0; i < n; ++i) {
      if (IsZero(gids[i].raw)) continue;
      if (pass == 0 && gids[i].type == 1 && IsV4Mapped(gids[i].raw)) return i;
      if (pass == 1 && gids[i].type == 1) return i;
      if (pass == 2) return i;
    }
  }
  return -1;
}

int MtuEnum(int bytes) {
  switch (bytes) {
    case 256: return IBV_MTU_256;
    case 512: return IBV_MTU_512;
    case 1024: return IBV_MTU_1024;
    case 2048: return IBV_MTU_2048;
    case 4096: return IBV_MTU_4096;
  }
  return -1;
}

Status ValidateQpParams(const QpParams& p) {
  std::string bad;
  auto need = [&](bool ok, const std::string& what) { if (!ok) bad += (bad.empty() ? "" : "; ") + what; };
  need(p.port >= 1 && p.port <= 255, "port=" + std::to_string(p.port) + " (1..255)");
  need(p.gid_index >= 0 && p.gid_index < p.gid_table_len,
       "gid_index=" + std::to_string(p.gid_index) + " (0.." + std::to_string(p.gid_table_len - 1) + ")");
  need(MtuEnum(p.mtu_bytes) > 0, "mtu_bytes=" + std::to_string(p.mtu_bytes) + " (256,512,1024,2048,4096)");
  need(p.max_send_wr >= 1 && p.max_send_wr <= p.device_max_wr,
       "max_send_wr=" + std::to_string(p.max_send_wr) + " (1.." + std::to_string(p.device_max_wr) + ")");
  need(p.max_recv_wr >= 1 && p.max_recv_wr <= p.device_max_wr,
       "max_recv_wr=" + std::to_string(p.max_recv_wr) + " (1.." + std::to_string(p.device_max_wr) + ")");
  need(p.timeout >= 0 && p.timeout <= 31, "timeout=" + std::to_string(p.timeout) + " (0..31)");
  need(p.retry_cnt >= 0 && p.retry_cnt <= 7, "retry_cnt=" + std::to_string(p.retry_cnt) + " (0..7)");
  need(p.rnr_retry >= 0 && p.rnr_retry <= 7, "rnr_retry=" + std::to_string(p.rnr_retry) + " (0..7)");
  need(p.min_rnr_timer >= 0 && p.min_rnr_timer <= 31,
       "min_rnr_timer=" + std::to_string(p.min_rnr_timer) + " (0..31)");
  need(p.psn < (1u << 24), "psn=" + std::to_string(p.psn) + " (24 bits)");
  need(p.dest_qpn < (1u << 24), "dest_qpn=" + std::to_string(p.dest_qpn) + " (24 bits)");
  need(p.ethernet || p.dlid != 0, "dlid=0 on InfiniBand (the peer's port LID is required)");
  if (!bad.empty()) return DTENJAX_ERROR(Code::kInvalidArgument, "invalid RC QP parameters: " + bad);
  return Status::Ok();
}

uint32_t EncodeImm(uint32_t bytes, bool last) { return (bytes & 0x7fffffffu) | (last ? 0x80000000u : 0); }
void DecodeImm(uint32_t imm, uint32_t* bytes, bool* last) {
  *bytes = imm & 0x7fffffffu;
  *last = (imm & 0x80000000u) != 0;
}

// --- libibverbs, loaded at run time --------------------------------------------------------------
struct Lib {
  void* handle = nullptr;
  ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(ibv_device**);
  const char* (*get_device_name)(ibv_device*);
  ibv_context* (*open_device)(ibv_device*);
  int (*close_device)(ibv_context*);
  ibv_pd* (*alloc_pd)(ibv_context*);
  int (*dealloc_pd)(ibv_pd*);
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int);
  int (*destroy_cq)(ibv_cq*);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  int (*destroy_qp)(ibv_qp*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int);
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*);
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  int (*dereg_mr)(ibv_mr*);
};

static Lib g_lib;
static Status g_load_status = DTENJAX_ERROR(Code::kUnavailable, "libibverbs not loaded yet");
static std::once_flag g_once;

Status LoadLibrary() {
  std::call_once(g_once, [] {
    void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      g_load_status = DTENJAX_ERROR(Code::kUnavailable,
                                    std::string("cannot dlopen libibverbs.so.1 (") + (e ? e : "?") +
                                        "); install rdma-core / libibverbs1 to use RDMA");
      return;
    }
    std::string missing;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    sym(g_lib.get_device_list, "ibv_get_device_list");
    sym(g_lib.free_device_list, "ibv_free_device_list");
    sym(g_lib.get_device_name, "ibv_get_device_name");
    sym(g_lib.open_device, "ibv_open_device");
    sym(g_lib.close_device, "ibv_close_device");
    sym(g_lib.alloc_pd, "ibv_alloc_pd");
    sym(g_lib.dealloc_pd, "ibv_dealloc_pd");
    sym(g_lib.create_cq, "ibv_create_cq");
    sym(g_lib.destroy_cq, "ibv_destroy_cq");
    sym(g_lib.create_qp, "ibv_create_qp");
    sym(g_lib.destroy_qp, "ibv_destroy_qp");
    sym(g_lib.modify_qp, "ibv_modify_qp");
    sym(g_lib.query_port, "ibv_query_port");
    sym(g_lib.query_gid, "ibv_query_gid");
    sym(g_lib.reg_mr, "ibv_reg_mr");
    sym(g_lib.dereg_mr, "ibv_dereg_mr");
    if (!missing.empty()) {
      dlclose(h);
      g_load_status = DTENJAX_ERROR(Code::kUnavailable, "libibverbs lacks symbols: " + missing);
      return;
    }
    g_lib.handle = h;
    g_load_status = Status::Ok();
  });
  return g_load_status;
}

Status CountDevices(int* n) {
  DTENJAX_RETURN_IF_ERROR(LoadLibrary());
  int num = 0;
  ibv_device** list = g_lib.get_device_list(&num);
  if (list) g_lib.free_device_list(list);
  *n = list ? num : 0;
  if (*n == 0) return DTENJAX_ERROR(Code::kUnavailable, "libibverbs found no RDMA device");
  return Status::Ok();
}

}  // namespace verbs

namespace {

using namespace verbs;  // NOLINT

constexpr size_t kSlab = 4 << 20;  // bytes of one frame slab per direction

// One opened device shared by all connections of the process.
struct Device {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  int port = 1;
  ibv_port_attr port_attr{};
  int gid_index = 0;
  ibv_gid gid{};
  bool ethernet = false;
};

std::mutex g_dev_mu;
Device* g_dev = nullptr;
std::string g_want_device;  // set by SetDeviceName (DTENJAX_IB_DEVICE, read in Python)

Status OpenDevice(Device** out) {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  if (g_dev) { *out = g_dev; return Status::Ok(); }
  DTENJAX_RETURN_IF_ERROR(LoadLibrary());
  int num = 0;
  ibv_device** list = g_lib.get_device_list(&num);
  if (!list || num == 0) {
    if (list) g_lib.free_device_list(list);
    return DTENJAX_ERROR(Code::kUnavailable, "no RDMA device; use the TCP provider");
  }
  auto dev = std::make_unique<Device>();
  for (int i = 0; i < num && !dev->ctx; ++i) {
    if (!g_want_device.empty() && g_want_device != g_lib.get_device_name(list[i])) continue;
    ibv_context* ctx = g_lib.open_device(list[i]);
    if (!ctx) continue;
    if (g_lib.query_port(ctx, 1, &dev->port_attr) == 0 && dev->port_attr.state == IBV_PORT_ACTIVE) {
      dev->ctx = ctx;
    } else {
      g_lib.close_device(ctx);
    }
  }
  g_lib.free_device_list(list);
  if (!dev->ctx) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "no RDMA device with an active port 1" +
                             (g_want_device.empty() ? std::string() : " named " + g_want_device));
  }
  dev->ethernet = dev->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  std::vector<GidEntry> gids;
  for (int i = 0; i < dev->port_attr.gid_tbl_len && i < 32; ++i) {
    ibv_gid g;
    if (g_lib.query_gid(dev->ctx, 1, i, &g) != 0) break;
    GidEntry e;
    std::memcpy(e.raw, g.raw, 16);
    // The GID type needs sysfs or ibv_query_gid_ex; treat IPv4-mapped GIDs as RoCE v2 candidates.
    e.type = IsV4Mapped(g.raw) ? 1 : 0;
    gids.push_back(e);
  }
  dev->gid_index = SelectGidIndex(gids.data(), int(gids.size()), dev->ethernet);
  if (dev->gid_index < 0) {
    g_lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "RDMA port has no usable GID");
  }
  std::memcpy(dev->gid.raw, gids[dev->gid_index].raw, 16);
  dev->pd = g_lib.alloc_pd(dev->ctx);
  if (!dev->pd) {
    g_lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "ibv_alloc_pd failed");
  }
  g_dev = dev.release();
  *out = g_dev;
  return Status::Ok();
}

struct QpInfo {
  uint32_t qpn, psn;
  uint16_t lid, pad;
  uint8_t gid[16];
  uint32_t rkey;
  uint64_t addr;
};

struct VerbsConn {
  Conn* side = nullptr;  // authenticated TCP side channel (set-up, shutdown)
  Device* dev = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  void* send_buf = nullptr;
  void* recv_buf = nullptr;
  ibv_mr* send_mr = nullptr;
  ibv_mr* recv_mr = nullptr;
  QpInfo remote{};
  int credits = 1;          // frames the peer can accept
  bool write_posted = false;  // our frame is being written into the peer's slab
  bool write_done = false;
  int64_t arrived = -1;     // bytes of a frame that arrived in recv_buf, -1 if none
  int state = kReset;
};

Status Modify(VerbsConn* v, int to, ibv_qp_attr* attr) {
  DTENJAX_RETURN_IF_ERROR(CheckTransition(v->state, to));
  attr->qp_state = static_cast<ibv_qp_state>(to);
  if (g_lib.modify_qp(v->qp, attr, TransitionMask(to)) != 0) {
    return DTENJAX_ERROR(Code::kInternal, "ibv_modify_qp to state " + std::to_string(to) +
                                              " failed: " + std::strerror(errno));
  }
  v->state = to;
  return Status::Ok();
}

Status PostRecv(VerbsConn* v) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = 1;
  if (ibv_post_recv(v->qp, &wr, &bad) != 0) {
    return DTENJAX_ERROR(Code::kInternal, "ibv_post_recv failed");
  }
  return Status::Ok();
}

void Destroy(VerbsConn* v) {
  if (v->qp) g_lib.destroy_qp(v->qp);
  if (v->cq) g_lib.destroy_cq(v->cq);
  if (v->send_mr) g_lib.dereg_mr(v->send_mr);
  if (v->recv_mr) g_lib.dereg_mr(v->recv_mr);
  std::free(v->send_buf);
  std::free(v->recv_buf);
  if (v->side) TcpProvider()->close(v->side);
  delete v;
}

const Provider* VerbsProvider();

// Creates the QP and MRs, swaps QpInfo over the side channel, and brings the QP to RTS.
Status Setup(Conn* side, double deadline, Conn** out) {
  auto* v = new VerbsConn;
  v->side = side;
  Status s = OpenDevice(&v->dev);
  auto fail = [&](Status st) { Destroy(v); return st; };
  if (!s.ok()) return fail(s);
  ibv_pd* pd = v->dev->pd;
  v->cq = g_lib.create_cq(v->dev->ctx, 256, nullptr, nullptr, 0);
  if (!v->cq) return fail(DTENJAX_ERROR(Code::kInternal, "ibv_create_cq failed"));
  ibv_qp_init_attr ia{};
  ia.send_cq = v->cq;
  ia.recv_cq = v->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 64;
  ia.cap.max_recv_wr = 64;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = 1;
  v->qp = g_lib.create_qp(pd, &ia);
  if (!v->qp) return fail(DTENJAX_ERROR(Code::kInternal, "ibv_create_qp failed"));
  v->send_buf = std::aligned_alloc(4096, kSlab);
  v->recv_buf = std::aligned_alloc(4096, kSlab);
  const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  v->send_mr = v->send_buf ? g_lib.reg_mr(pd, v->send_buf, kSlab, access) : nullptr;
  v->recv_mr = v->recv_buf ? g_lib.reg_mr(pd, v->recv_buf, kSlab, access) : nullptr;
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
  for (int i = 0; i < 16; ++i) {
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
  DTENJAX_RETURN_IF_ERROR(OpenDevice(&d));
  DTENJAX_RETURN_IF_ERROR(TcpProvider()->listen(bind_address, out));
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

// Polls the completion queue empty, updating the connection's state.
Status Drain(VerbsConn* v, const std::string& peer) {
  ibv_wc wc[8];
  while (true) {
    int n = ibv_poll_cq(v->cq, 8, wc);
    if (n < 0) return DTENJAX_ERROR(Code::kInternal, "ibv_poll_cq failed");
    if (n == 0) return Status::Ok();
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        Counters().peer_failures.fetch_add(1);
        return DTENJAX_ERROR(Code::kUnavailable, "RDMA work completion with " + peer +
                                                     " failed with status " +
                                                     std::to_string(int(wc[i].status)) +
                                                     " (peer died or the fabric dropped the QP)");
      }
      if (wc[i].opcode == IBV_WC_RDMA_WRITE) {
        v->write_done = true;
      } else if (wc[i].opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
        uint32_t bytes;
        bool last;
        DecodeImm(ntohl(wc[i].imm_data), &bytes, &last);
        if (v->arrived >= 0 || bytes > kSlab) {
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

Status VerbsSendSome(Conn* c, OutFrame* f, bool* progress) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  *progress = false;
  DTENJAX_RETURN_IF_ERROR(Drain(v, c->peer));
  if (f->done()) return Status::Ok();
  if (!v->write_posted) {
    if (v->credits <= 0) return Status::Ok();
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
    wr.wr_id = 2;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(EncodeImm(uint32_t(f->total()), true));
    wr.wr.rdma.remote_addr = v->remote.addr;
    wr.wr.rdma.rkey = v->remote.rkey;
    if (ibv_post_send(v->qp, &wr, &bad) != 0) {
      return DTENJAX_ERROR(Code::kInternal, "ibv_post_send (RDMA WRITE WITH IMM) failed");
    }
    --v->credits;
    v->write_posted = true;
    v->write_done = false;
    *progress = true;
  }
  if (v->write_done) {
    v->write_posted = false;
    f->sent = f->total();
    *progress = true;
    Counters().frames_sent.fetch_add(1);
    Counters().bytes_sent.fetch_add(f->total());
  }
  return Status::Ok();
}

Status VerbsRecvSome(Conn* c, InFrame* f, bool* progress) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  *progress = false;
  DTENJAX_RETURN_IF_ERROR(Drain(v, c->peer));
  if (v->arrived < 0) return Status::Ok();
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
  wr.wr_id = 3;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  if (ibv_post_send(v->qp, &wr, &bad) != 0) {
    return DTENJAX_ERROR(Code::kInternal, "ibv_post_send (credit) failed");
  }
  return Status::Ok();
}

Status VerbsWait(const WaitItem*, int, double until) {
  // Completions are polled (no completion channel); back off briefly instead of spinning hot.
  if (NowSeconds() < until) std::this_thread::sleep_for(std::chrono::microseconds(20));
  return Status::Ok();
}

void VerbsShutdown(Conn* c) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  if (v && v->qp) {
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_ERR;
    g_lib.modify_qp(v->qp, &a, IBV_QP_STATE);  // flushes the peer's outstanding work
  }
  if (v && v->side) TcpProvider()->shutdown(v->side);
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
}

const Provider kVerbs = {"verbs", kSlab - kSealedHeadBytes - kTagBytes, VerbsCanConnect,
                         VerbsListen, VerbsConnect, VerbsAccept, VerbsSendSome, VerbsRecvSome,
                         VerbsWait, VerbsShutdown, VerbsClose, VerbsCloseListener};

const Provider* VerbsProvider() { return &kVerbs; }

}  // namespace

void verbs::SetDeviceName(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  g_want_device = name;
}

DTENJAX_REGISTER_PROVIDER(verbs, VerbsProvider);

}  // namespace dtenjax::transport
