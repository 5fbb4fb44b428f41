// The emulated device's contract, checked through the verbs API as an application sees it.
// Every expectation here comes from rdma-core's man pages (ibv_post_send(3), ibv_post_recv(3),
// ibv_modify_qp(3), ibv_reg_mr(3), ibv_create_cq(3), ibv_poll_cq(3), ibv_req_notify_cq(3),
// ibv_get_cq_event(3), ibv_alloc_pd(3)) and the InfiniBand RC rules (RNR, retries, R_Key and
// L_Key checks, flush errors), never from dtenjax's provider. Usage: contract [CHECK...]; prints
// "PASS name" or "FAIL name: why" per check (all checks when none is named). Built and run by
// tests/test_verbs_fake.py.
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

extern "C" int fakeverbs_counters(int64_t* out, int n);
extern "C" const char* fakeverbs_counter_name(int i);
extern "C" int fakeverbs_num_counters(void);
extern "C" int fakeverbs_arm(const char* kind, int64_t after);

namespace {

std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

#define CHECK(cond, ...)                                          \
  do {                                                            \
    if (!(cond)) return Fmt("line %d: ", __LINE__) + Fmt(__VA_ARGS__); \
  } while (0)

int64_t Counter(const char* name) {
  int n = fakeverbs_num_counters();
  std::vector<int64_t> v(static_cast<size_t>(n));
  fakeverbs_counters(v.data(), n);
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(fakeverbs_counter_name(i), name) == 0) return v[size_t(i)];
  }
  return -1;
}

struct Dev {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_port_attr port{};
  ibv_gid gid{};
  int gid_index = 0;
  bool roce = false;
};

bool OpenDev(Dev* d) {
  int n = 0;
  ibv_device** list = (ibv_get_device_list)(&n);
  if (!list || n < 1) return false;
  d->ctx = ibv_open_device(list[0]);
  ibv_free_device_list(list);
  if (!d->ctx) return false;
  if ((ibv_query_port)(d->ctx, 1, reinterpret_cast<struct _compat_ibv_port_attr*>(&d->port))) return false;
  d->roce = d->port.link_layer == IBV_LINK_LAYER_ETHERNET;
  d->gid_index = d->roce ? d->port.gid_tbl_len - 1 : 0;
  if (ibv_query_gid(d->ctx, 1, d->gid_index, &d->gid)) return false;
  d->pd = ibv_alloc_pd(d->ctx);
  return d->pd != nullptr;
}

void CloseDev(Dev* d) {
  if (d->pd) ibv_dealloc_pd(d->pd);
  if (d->ctx) ibv_close_device(d->ctx);
}

struct Side {
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
};

Side MakeQp(Dev& d, int cqe = 64, uint32_t max_send = 16, uint32_t max_recv = 16,
            ibv_comp_channel* ch = nullptr) {
  Side s;
  s.cq = ibv_create_cq(d.ctx, cqe, nullptr, ch, 0);
  ibv_qp_init_attr ia{};
  ia.send_cq = ia.recv_cq = s.cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = max_send;
  ia.cap.max_recv_wr = max_recv;
  ia.cap.max_send_sge = 2;
  ia.cap.max_recv_sge = 2;
  s.qp = s.cq ? ibv_create_qp(d.pd, &ia) : nullptr;
  return s;
}

void Free(Side& s) {
  if (s.qp) ibv_destroy_qp(s.qp);
  if (s.cq) ibv_destroy_cq(s.cq);
  s = Side{};
}

int ToInit(ibv_qp* qp, int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = 0;
  a.port_num = 1;
  a.qp_access_flags = access;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

struct Peer {
  uint32_t qpn;
  uint16_t lid;
  ibv_gid gid;
  uint32_t psn;
};

int ToRtr(const Dev& d, ibv_qp* qp, const Peer& remote, int min_rnr = 1) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = d.roce ? IBV_MTU_1024 : IBV_MTU_4096;
  a.dest_qp_num = remote.qpn;
  a.rq_psn = remote.psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = uint8_t(min_rnr);
  a.ah_attr.port_num = 1;
  a.ah_attr.dlid = remote.lid;
  if (d.roce) {
    a.ah_attr.is_global = 1;
    a.ah_attr.grh.dgid = remote.gid;
    a.ah_attr.grh.sgid_index = uint8_t(d.gid_index);
    a.ah_attr.grh.hop_limit = 64;
  }
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int ToRts(ibv_qp* qp, uint32_t psn, int timeout = 8, int retry = 2, int rnr_retry = 2) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = psn;
  a.timeout = uint8_t(timeout);
  a.retry_cnt = uint8_t(retry);
  a.rnr_retry = uint8_t(rnr_retry);
  a.max_rd_atomic = 1;
  return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

Peer PeerOf(const Dev& d, const Side& s, uint32_t psn) {
  return Peer{s.qp->qp_num, d.port.lid, d.gid, psn};
}

struct ConnOpts {
  int timeout = 8, retry = 2, rnr_retry = 2, min_rnr = 1;
  uint32_t psn_a = 100, psn_b = 7000;
  int access_b = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  bool wrong_psn = false;
};

// Two QPs of this process connected to each other (through the emulated port).
std::string Connect(Dev& d, Side& a, Side& b, const ConnOpts& o = ConnOpts{}) {
  CHECK(a.qp && b.qp, "QP creation failed: errno %d", errno);
  CHECK(ToInit(a.qp) == 0 && ToInit(b.qp, o.access_b) == 0, "to INIT");
  Peer pa = PeerOf(d, a, o.psn_a), pb = PeerOf(d, b, o.psn_b);
  Peer pa_seen_by_b = pa;
  if (o.wrong_psn) pa_seen_by_b.psn += 1000;
  CHECK(ToRtr(d, a.qp, pb, o.min_rnr) == 0 && ToRtr(d, b.qp, pa_seen_by_b, o.min_rnr) == 0, "to RTR");
  CHECK(ToRts(a.qp, o.psn_a, o.timeout, o.retry, o.rnr_retry) == 0 &&
            ToRts(b.qp, o.psn_b, o.timeout, o.retry, o.rnr_retry) == 0,
        "to RTS");
  return "";
}

// Polls `cq` until `n` completions arrived or `seconds` passed.
std::vector<ibv_wc> Poll(ibv_cq* cq, size_t n, double seconds = 5.0) {
  std::vector<ibv_wc> out;
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (out.size() < n && std::chrono::steady_clock::now() < end) {
    ibv_wc wc[16];
    int k = ibv_poll_cq(cq, 16, wc);
    if (k < 0) break;
    for (int i = 0; i < k; ++i) out.push_back(wc[i]);
    if (k == 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return out;
}

int QpState(ibv_qp* qp) {
  ibv_qp_attr a{};
  ibv_qp_init_attr ia{};
  if (ibv_query_qp(qp, &a, IBV_QP_STATE, &ia)) return -1;
  return a.qp_state;
}

int PostWrite(ibv_qp* qp, uint64_t id, void* buf, uint32_t len, uint32_t lkey, uint64_t raddr,
              uint32_t rkey, bool imm, uint32_t imm_value = 0, bool signaled = true,
              ibv_send_wr** bad_out = nullptr) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), len, lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = len ? 1 : 0;
  wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = htonl(imm_value);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  int rc = ibv_post_send(qp, &wr, &bad);
  if (bad_out) *bad_out = bad;
  return rc;
}

int PostRecv(ibv_qp* qp, uint64_t id, void* buf = nullptr, uint32_t len = 0, uint32_t lkey = 0) {
  ibv_sge sge{reinterpret_cast<uint64_t>(buf), len, lkey};
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = buf ? 1 : 0;
  return ibv_post_recv(qp, &wr, &bad);
}

// --- checks ---------------------------------------------------------------------------------------

std::string DeviceAndPort(Dev& d) {
  int n = 0;
  ibv_device** list = (ibv_get_device_list)(&n);
  CHECK(list && n == 1, "one device listed, got %d", n);
  CHECK(std::strcmp(ibv_get_device_name(list[0]), "fakeverbs0") == 0, "device name");
  ibv_free_device_list(list);
  CHECK(d.port.state == IBV_PORT_ACTIVE, "port active");
  ibv_device_attr da{};
  CHECK(ibv_query_device(d.ctx, &da) == 0 && da.phys_port_cnt == 1 && da.max_qp_wr > 0, "query_device");
  ibv_gid g{};
  CHECK(ibv_query_gid(d.ctx, 1, d.port.gid_tbl_len, &g) == -1, "GID index past the table is an error");
  if (d.roce) {
    CHECK(d.port.lid == 0 && d.port.active_mtu == IBV_MTU_1024, "RoCE: no LID, 1500-byte MTU");
    for (int i = 0; i < d.port.gid_tbl_len; ++i) {
      ibv_gid_entry e{};
      CHECK(ibv_query_gid_ex(d.ctx, 1, uint32_t(i), &e, 0) == 0 && e.gid_index == uint32_t(i),
            "ibv_query_gid_ex %d", i);
      CHECK(e.gid_type == (i % 2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1), "GID %d type", i);
    }
    ibv_gid_entry e{};
    CHECK(ibv_query_gid_ex(d.ctx, 1, uint32_t(d.port.gid_tbl_len), &e, 0) != 0, "past the table");
  } else {
    CHECK(d.port.lid != 0 && d.port.active_mtu == IBV_MTU_4096, "IB: a LID, 4096 MTU");
  }
  return "";
}

std::string QpStateMachine(Dev& d) {
  Side a = MakeQp(d), b = MakeQp(d);
  CHECK(a.qp && QpState(a.qp) == IBV_QPS_RESET, "a new QP is in RESET");
  std::vector<uint8_t> buf(64);
  ibv_mr* mr = (ibv_reg_mr)(d.pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_send_wr* bad = nullptr;
  // ibv_post_send in RESET, INIT, RTR: an immediate error, bad_wr names the WR.
  CHECK(PostWrite(a.qp, 1, buf.data(), 8, mr->lkey, 0, 0, false, 0, true, &bad) == EINVAL && bad,
        "post_send in RESET is refused with EINVAL and bad_wr");
  CHECK(PostRecv(a.qp, 1) != 0, "post_recv in RESET is refused");
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_RTR;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE) == EINVAL && QpState(a.qp) == IBV_QPS_RESET,
        "RESET -> RTR is refused and the state is unchanged");
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_INIT;
  at.port_num = 1;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX) == EINVAL,
        "RESET -> INIT without IBV_QP_ACCESS_FLAGS (required) is refused");
  CHECK(ToInit(a.qp) == 0 && ToInit(b.qp) == 0, "RESET -> INIT");
  CHECK(PostWrite(a.qp, 1, buf.data(), 8, mr->lkey, 0, 0, false) == EINVAL, "post_send in INIT");
  CHECK(PostRecv(a.qp, 1) == 0, "post_recv in INIT is allowed");
  Peer pb = PeerOf(d, b, 5), pa = PeerOf(d, a, 9);
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTR;
  at.path_mtu = IBV_MTU_1024;
  at.dest_qp_num = pb.qpn;
  at.rq_psn = 5;
  at.ah_attr.port_num = 1;
  at.ah_attr.dlid = pb.lid;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC) == EINVAL,
        "INIT -> RTR without IBV_QP_MIN_RNR_TIMER (required) is refused");
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                     IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                     IBV_QP_MIN_RNR_TIMER | IBV_QP_SQ_PSN) == EINVAL,
        "INIT -> RTR with IBV_QP_SQ_PSN (not allowed there) is refused");
  if (d.roce) {  // RoCE is routed by GID: an address vector without a GRH is refused
    Peer nogrh = pb;
    Dev ib = d;
    ib.roce = false;
    CHECK(ToRtr(ib, a.qp, nogrh) == EINVAL, "RoCE: INIT -> RTR with is_global=0 is refused");
  }
  at.ah_attr.is_global = d.roce;
  at.ah_attr.grh.dgid = pb.gid;
  at.ah_attr.grh.sgid_index = uint8_t(d.gid_index);
  at.path_mtu = IBV_MTU_4096;
  at.min_rnr_timer = 1;
  if (d.roce) {
    CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                       IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                       IBV_QP_MIN_RNR_TIMER) == EINVAL,
          "RoCE: a path MTU above the port's active MTU (1024) is refused");
  }
  CHECK(QpState(a.qp) == IBV_QPS_INIT, "still INIT after refused modifies");
  CHECK(ToRtr(d, a.qp, pb) == 0 && ToRtr(d, b.qp, pa) == 0, "INIT -> RTR");
  CHECK(PostWrite(a.qp, 1, buf.data(), 8, mr->lkey, 0, 0, false) == EINVAL, "post_send in RTR");
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTS;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE | IBV_QP_SQ_PSN) == EINVAL,
        "RTR -> RTS without timeout/retry_cnt/rnr_retry/max_rd_atomic is refused");
  CHECK(ToRts(a.qp, 9) == 0 && QpState(a.qp) == IBV_QPS_RTS, "RTR -> RTS");
  at = ibv_qp_attr{};
  at.qp_state = IBV_QPS_RTR;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE) == EINVAL, "RTS -> RTR is refused");
  at.qp_state = IBV_QPS_ERR;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE) == 0 && QpState(a.qp) == IBV_QPS_ERR, "RTS -> ERR");
  CHECK(ToRts(a.qp, 9) == EINVAL, "ERR -> RTS is refused");
  at.qp_state = IBV_QPS_RESET;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE) == 0 && QpState(a.qp) == IBV_QPS_RESET, "ERR -> RESET");
  ibv_dereg_mr(mr);
  Free(a);
  Free(b);
  return "";
}

std::string WriteWithImmAndSend(Dev& d) {
  Side a = MakeQp(d), b = MakeQp(d);
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  const size_t n = 100000;  // several packets
  std::vector<uint8_t> src(n), dst(n + 64, 0xEE), rbuf(256, 0);
  for (size_t i = 0; i < n; ++i) src[i] = uint8_t(i * 7 + 3);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), n, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_mr* rmr = (ibv_reg_mr)(d.pd, rbuf.data(), rbuf.size(), IBV_ACCESS_LOCAL_WRITE);
  CHECK(smr && dmr && rmr, "reg_mr");
  CHECK(PostRecv(b.qp, 77) == 0, "post_recv");
  CHECK(PostWrite(a.qp, 5, src.data(), uint32_t(n), smr->lkey,
                  reinterpret_cast<uint64_t>(dst.data()) + 32, dmr->rkey, true, 0xA1B2C3D4) == 0,
        "post write with imm");
  auto wa = Poll(a.cq, 1), wb = Poll(b.cq, 1);
  CHECK(wa.size() == 1 && wa[0].status == IBV_WC_SUCCESS && wa[0].opcode == IBV_WC_RDMA_WRITE &&
            wa[0].wr_id == 5,
        "sender: one IBV_WC_RDMA_WRITE success (got %zu, status %d)", wa.size(),
        wa.empty() ? -1 : wa[0].status);
  CHECK(wb.size() == 1 && wb[0].status == IBV_WC_SUCCESS &&
            wb[0].opcode == IBV_WC_RECV_RDMA_WITH_IMM && wb[0].wr_id == 77 &&
            wb[0].byte_len == n && (wb[0].wc_flags & IBV_WC_WITH_IMM) &&
            ntohl(wb[0].imm_data) == 0xA1B2C3D4 && wb[0].qp_num == b.qp->qp_num,
        "receiver: IBV_WC_RECV_RDMA_WITH_IMM with byte_len, imm (network order), wr_id");
  CHECK(std::memcmp(dst.data() + 32, src.data(), n) == 0 && dst[31] == 0xEE && dst[32 + n] == 0xEE,
        "the bytes landed where addressed, nothing around them");
  // SEND: scattered into the receive WR's SGE.
  CHECK(PostRecv(b.qp, 78, rbuf.data(), 256, rmr->lkey) == 0, "post_recv with an SGE");
  ibv_sge sge{reinterpret_cast<uint64_t>(src.data()), 100, smr->lkey};
  ibv_send_wr wr{}, *bad = nullptr;
  wr.wr_id = 6;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  CHECK(ibv_post_send(a.qp, &wr, &bad) == 0, "post send");
  wa = Poll(a.cq, 1);
  wb = Poll(b.cq, 1);
  CHECK(wa.size() == 1 && wa[0].opcode == IBV_WC_SEND && wa[0].status == IBV_WC_SUCCESS, "send completion");
  CHECK(wb.size() == 1 && wb[0].opcode == IBV_WC_RECV && wb[0].byte_len == 100 &&
            std::memcmp(rbuf.data(), src.data(), 100) == 0,
        "receive completion and data");
  Free(a);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  ibv_dereg_mr(rmr);
  return "";
}

std::string RemoteAccess(Dev& d) {
  struct Case {
    const char* what;
    int offset;
    int access;
    bool wrong_key;
  } cases[] = {{"write past the end of the region", 1, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, false},
               {"write with a wrong rkey", 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, true},
               {"write into a region without remote write", 0, IBV_ACCESS_LOCAL_WRITE, false}};
  for (const Case& c : cases) {
    Side a = MakeQp(d), b = MakeQp(d);
    std::string e = Connect(d, a, b);
    if (!e.empty()) return e;
    std::vector<uint8_t> src(4096, 1), dst(4096, 0);
    ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
    ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), c.access);
    CHECK(PostRecv(b.qp, 1) == 0 && PostRecv(b.qp, 2) == 0, "post_recv");
    CHECK(PostWrite(a.qp, 10, src.data(), 4096, smr->lkey, reinterpret_cast<uint64_t>(dst.data()) + c.offset,
                    dmr->rkey + (c.wrong_key ? 1 : 0), true, 1) == 0,
          "post");
    CHECK(PostWrite(a.qp, 11, src.data(), 16, smr->lkey, reinterpret_cast<uint64_t>(dst.data()),
                    dmr->rkey, false) == 0,
          "post a second WR behind it");
    auto wa = Poll(a.cq, 2);
    CHECK(wa.size() == 2 && wa[0].wr_id == 10 && wa[0].status == IBV_WC_REM_ACCESS_ERR &&
              wa[1].wr_id == 11 && wa[1].status == IBV_WC_WR_FLUSH_ERR,
          "%s: IBV_WC_REM_ACCESS_ERR, then the unsignaled WR behind it flushed (got %zu: %d %d)",
          c.what, wa.size(), wa.empty() ? -1 : wa[0].status, wa.size() > 1 ? wa[1].status : -1);
    CHECK(QpState(a.qp) == IBV_QPS_ERR && QpState(b.qp) == IBV_QPS_ERR,
          "%s: both QPs are in the error state", c.what);
    auto wb = Poll(b.cq, 2);
    CHECK(wb.size() == 2 && wb[1].status == IBV_WC_WR_FLUSH_ERR, "%s: responder's receives flushed", c.what);
    CHECK(dst[0] == 0 && dst[4095] == 0, "%s: nothing was written", c.what);
    Free(a);
    Free(b);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
  }
  return "";
}

std::string LocalProtection(Dev& d) {
  for (int variant = 0; variant < 3; ++variant) {
    Side a = MakeQp(d), b = MakeQp(d);
    std::string e = Connect(d, a, b);
    if (!e.empty()) return e;
    std::vector<uint8_t> src(4096, 1), dst(4096, 0);
    Dev other;  // a second PD: its MRs are not usable by a's QP
    other.ctx = d.ctx;
    other.pd = ibv_alloc_pd(d.ctx);
    ibv_mr* smr = (ibv_reg_mr)(variant == 2 ? other.pd : d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
    ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    const uint32_t lkey = variant == 0 ? smr->lkey ^ 0x5a5a : smr->lkey;
    const uint32_t len = variant == 1 ? 4097 : 4096;  // variant 1: the SGE runs past the MR
    CHECK(PostWrite(a.qp, 20, src.data(), len, lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey,
                    false, 0, /*signaled=*/false) == 0,
          "a bad lkey is not an immediate error (it is found when the WR executes)");
    auto wa = Poll(a.cq, 1);
    CHECK(wa.size() == 1 && wa[0].status == IBV_WC_LOC_PROT_ERR && wa[0].wr_id == 20,
          "variant %d: IBV_WC_LOC_PROT_ERR even though the WR was unsignaled (got %d)", variant,
          wa.empty() ? -1 : wa[0].status);
    CHECK(QpState(a.qp) == IBV_QPS_ERR, "the QP went to the error state");
    Free(a);
    Free(b);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
    CHECK(ibv_dealloc_pd(other.pd) == 0, "dealloc the second PD");
  }
  return "";
}

std::string RegMrAccess(Dev& d) {
  std::vector<uint8_t> buf(4096);
  errno = 0;
  CHECK((ibv_reg_mr)(d.pd, buf.data(), buf.size(), IBV_ACCESS_REMOTE_WRITE) == nullptr && errno == EINVAL,
        "REMOTE_WRITE without LOCAL_WRITE fails with EINVAL");
  ibv_mr* mr = (ibv_reg_mr)(d.pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
  CHECK(mr && mr->lkey && mr->addr == buf.data() && mr->length == buf.size(), "reg_mr fields");
  CHECK(ibv_dealloc_pd(d.pd) == EBUSY, "dealloc_pd with a registered MR fails");
  CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
  return "";
}

std::string CqDepthAndOverrun(Dev& d) {
  errno = 0;
  CHECK(ibv_create_cq(d.ctx, 0, nullptr, nullptr, 0) == nullptr && errno == EINVAL, "cqe=0 is refused");
  CHECK(ibv_create_cq(d.ctx, 4, nullptr, nullptr, d.ctx->num_comp_vectors) == nullptr,
        "comp_vector must be < num_comp_vectors");
  Side a = MakeQp(d, /*cqe=*/4, /*max_send=*/16), b = MakeQp(d);
  CHECK(a.cq && a.cq->cqe >= 4, "a CQ of at least 4 entries");
  const int cap = a.cq->cqe;
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  for (int i = 0; i < cap + 2; ++i) {  // signaled writes, never polled
    CHECK(PostWrite(a.qp, uint64_t(i), src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()),
                    dmr->rkey, false) == 0,
          "post %d", i);
  }
  ibv_wc wc[8];
  bool failed = false;  // ibv_poll_cq(cq, 0, ...) looks without taking anything
  for (int i = 0; i < 5000 && !failed; ++i) {
    failed = ibv_poll_cq(a.cq, 0, wc) < 0;
    if (!failed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CHECK(failed && ibv_poll_cq(a.cq, 8, wc) < 0, "after %d completions on a CQ of %d, ibv_poll_cq fails",
        cap + 2, cap);
  CHECK(QpState(a.qp) == IBV_QPS_ERR, "the overrun CQ's QP is in the error state");
  Free(a);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  return "";
}

std::string SendQueueDepth(Dev& d) {
  Side a = MakeQp(d, 64, /*max_send=*/4), b = MakeQp(d);
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  auto post = [&](uint64_t id, bool signaled) {
    return PostWrite(a.qp, id, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()),
                     dmr->rkey, false, 0, signaled);
  };
  for (int i = 0; i < 4; ++i) CHECK(post(uint64_t(i), true) == 0, "post %d of 4", i);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // all executed, none polled
  ibv_send_wr* bad = nullptr;
  CHECK(PostWrite(a.qp, 9, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey,
                  false, 0, true, &bad) == ENOMEM && bad,
        "the 5th WR on a queue of 4 unpolled WRs fails with ENOMEM");
  CHECK(Poll(a.cq, 4).size() == 4, "four completions");
  // Unsignaled WRs hold their slots until a later signaled WR's completion is polled.
  CHECK(post(10, false) == 0 && post(11, false) == 0 && post(12, false) == 0 && post(13, true) == 0,
        "3 unsignaled + 1 signaled");
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(post(14, true) == ENOMEM, "still full until the signaled completion is polled");
  auto w = Poll(a.cq, 1);
  CHECK(w.size() == 1 && w[0].wr_id == 13, "only the signaled WR completes (got %zu)", w.size());
  CHECK(post(14, true) == 0, "polling it retired all four slots");
  CHECK(Poll(a.cq, 1).size() == 1, "last completion");
  Free(a);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  return "";
}

std::string ReceiverNotReady(Dev& d) {
  // No receive posted: RNR NAKs, rnr_retry=2 retries, then IBV_WC_RNR_RETRY_EXC_ERR.
  {
    Side a = MakeQp(d), b = MakeQp(d);
    ConnOpts o;
    o.rnr_retry = 2;
    o.min_rnr = 1;  // 0.01 ms
    std::string e = Connect(d, a, b, o);
    if (!e.empty()) return e;
    std::vector<uint8_t> src(64, 1), dst(64, 0);
    ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
    ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    const int64_t before = Counter("rnr_naks");
    CHECK(PostWrite(a.qp, 30, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey,
                    true, 5) == 0,
          "post");
    auto wa = Poll(a.cq, 1);
    CHECK(wa.size() == 1 && wa[0].status == IBV_WC_RNR_RETRY_EXC_ERR,
          "IBV_WC_RNR_RETRY_EXC_ERR (got %d)", wa.empty() ? -1 : wa[0].status);
    CHECK(Counter("rnr_naks") - before == 3, "1 + rnr_retry RNR NAKs, got %lld",
          (long long)(Counter("rnr_naks") - before));
    CHECK(QpState(a.qp) == IBV_QPS_ERR, "requester QP in error");
    Free(a);
    Free(b);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
  }
  // rnr_retry=7 retries forever: a receive posted later lets the write complete.
  {
    Side a = MakeQp(d), b = MakeQp(d);
    ConnOpts o;
    o.rnr_retry = 7;
    std::string e = Connect(d, a, b, o);
    if (!e.empty()) return e;
    std::vector<uint8_t> src(64, 1), dst(64, 0);
    ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
    ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(PostWrite(a.qp, 31, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey,
                    true, 5) == 0,
          "post");
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    CHECK(Poll(a.cq, 1, 0.01).empty(), "no completion while the receiver is not ready");
    CHECK(PostRecv(b.qp, 1) == 0, "post the receive");
    auto wa = Poll(a.cq, 1);
    CHECK(wa.size() == 1 && wa[0].status == IBV_WC_SUCCESS, "completes once a receive is posted");
    Free(a);
    Free(b);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
  }
  return "";
}

std::string Ordering(Dev& d) {
  Side a = MakeQp(d, 256, 64, 64), b = MakeQp(d, 256, 64, 64);
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  std::vector<uint8_t> src(200000, 3), dst(200000, 0);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  for (int i = 0; i < 50; ++i) CHECK(PostRecv(b.qp, uint64_t(1000 + i)) == 0, "post_recv");
  for (int i = 0; i < 50; ++i) {
    const uint32_t len = (i % 3 == 0) ? 150000 : uint32_t(8 + i);  // big and small interleaved
    CHECK(PostWrite(a.qp, uint64_t(i), src.data(), len, smr->lkey, reinterpret_cast<uint64_t>(dst.data()),
                    dmr->rkey, true, uint32_t(i)) == 0,
          "post %d", i);
  }
  auto wa = Poll(a.cq, 50, 20), wb = Poll(b.cq, 50, 20);
  CHECK(wa.size() == 50 && wb.size() == 50, "all completions (%zu, %zu)", wa.size(), wb.size());
  for (int i = 0; i < 50; ++i) {
    CHECK(wa[size_t(i)].wr_id == uint64_t(i) && wa[size_t(i)].status == IBV_WC_SUCCESS, "send %d in order", i);
    CHECK(wb[size_t(i)].wr_id == uint64_t(1000 + i) && ntohl(wb[size_t(i)].imm_data) == uint32_t(i),
          "receive %d in order", i);
  }
  Free(a);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  return "";
}

std::string DeregWhilePosted(Dev& d) {
  // WR 1 waits on RNR (no receive yet); WR 2 is queued behind it with an SGE in MR m2.
  Side a = MakeQp(d), b = MakeQp(d);
  ConnOpts o;
  o.rnr_retry = 7;
  std::string e = Connect(d, a, b, o);
  if (!e.empty()) return e;
  std::vector<uint8_t> src1(64, 1), src2(64, 2), dst(64, 0);
  ibv_mr* m1 = (ibv_reg_mr)(d.pd, src1.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* m2 = (ibv_reg_mr)(d.pd, src2.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(PostWrite(a.qp, 1, src1.data(), 8, m1->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, true, 1) == 0, "post 1");
  CHECK(PostWrite(a.qp, 2, src2.data(), 8, m2->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false) == 0, "post 2");
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  CHECK(ibv_dereg_mr(m2) == 0, "ibv_dereg_mr succeeds while a WR using it is posted");
  CHECK(PostRecv(b.qp, 7) == 0, "post the receive");
  auto wa = Poll(a.cq, 2);
  CHECK(wa.size() == 2 && wa[0].wr_id == 1 && wa[0].status == IBV_WC_SUCCESS && wa[1].wr_id == 2 &&
            wa[1].status == IBV_WC_LOC_PROT_ERR,
        "WR 1 succeeds, WR 2 (its MR gone) completes with IBV_WC_LOC_PROT_ERR (got %zu)", wa.size());
  // The responder side: a region deregistered by its owner refuses the next write.
  Side c = MakeQp(d), e2 = MakeQp(d);
  e = Connect(d, c, e2);
  if (!e.empty()) return e;
  std::vector<uint8_t> dst2(64, 0);
  ibv_mr* d2 = (ibv_reg_mr)(d.pd, dst2.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  const uint32_t rkey = d2->rkey;
  CHECK(ibv_dereg_mr(d2) == 0, "the owner deregisters its region");
  CHECK(PostWrite(c.qp, 3, src1.data(), 8, m1->lkey, reinterpret_cast<uint64_t>(dst2.data()), rkey, false) == 0,
        "post");
  auto wc = Poll(c.cq, 1);
  CHECK(wc.size() == 1 && wc[0].status == IBV_WC_REM_ACCESS_ERR, "IBV_WC_REM_ACCESS_ERR");
  Free(a);
  Free(b);
  Free(c);
  Free(e2);
  ibv_dereg_mr(m1);
  ibv_dereg_mr(dmr);
  return "";
}

std::string FlushInError(Dev& d) {
  Side a = MakeQp(d), b = MakeQp(d);
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  for (int i = 0; i < 3; ++i) CHECK(PostRecv(a.qp, uint64_t(40 + i)) == 0, "post_recv");
  ibv_qp_attr at{};
  at.qp_state = IBV_QPS_ERR;
  CHECK(ibv_modify_qp(a.qp, &at, IBV_QP_STATE) == 0, "to ERR");
  auto w = Poll(a.cq, 3);
  CHECK(w.size() == 3, "three flushed receives");
  for (int i = 0; i < 3; ++i) {
    CHECK(w[size_t(i)].status == IBV_WC_WR_FLUSH_ERR && w[size_t(i)].wr_id == uint64_t(40 + i),
          "receive %d: IBV_WC_WR_FLUSH_ERR, in order", i);
  }
  std::vector<uint8_t> src(8);
  ibv_mr* mr = (ibv_reg_mr)(d.pd, src.data(), 8, IBV_ACCESS_LOCAL_WRITE);
  CHECK(PostWrite(a.qp, 50, src.data(), 8, mr->lkey, 0, 0, false, 0, /*signaled=*/false) == 0,
        "posting in the error state is allowed");
  CHECK(PostRecv(a.qp, 51) == 0, "posting a receive in the error state is allowed");
  w = Poll(a.cq, 2);
  CHECK(w.size() == 2 && w[0].status == IBV_WC_WR_FLUSH_ERR && w[1].status == IBV_WC_WR_FLUSH_ERR,
        "... and both complete with IBV_WC_WR_FLUSH_ERR");
  Free(a);
  Free(b);
  ibv_dereg_mr(mr);
  return "";
}

std::string CompletionChannel(Dev& d) {
  ibv_comp_channel* ch = ibv_create_comp_channel(d.ctx);
  CHECK(ch && ch->fd >= 0, "channel");
  Side a = MakeQp(d, 64, 16, 16, ch), b = MakeQp(d);
  std::string e = Connect(d, a, b);
  if (!e.empty()) return e;
  CHECK(ibv_req_notify_cq(a.cq, 0) == 0, "arm");
  pollfd pfd{ch->fd, POLLIN, 0};
  CHECK(::poll(&pfd, 1, 0) == 0, "no event before a completion");
  std::vector<uint8_t> src(8), dst(8);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), 8, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(PostWrite(a.qp, 1, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false) == 0, "post");
  CHECK(::poll(&pfd, 1, 5000) == 1, "the channel fd becomes readable");
  ibv_cq* ev_cq = nullptr;
  void* ev_ctx = nullptr;
  CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == a.cq, "get_cq_event names the CQ");
  CHECK(Poll(a.cq, 1).size() == 1, "the completion");
  CHECK(PostWrite(a.qp, 2, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false) == 0, "post");
  CHECK(Poll(a.cq, 1).size() == 1, "a completion");
  CHECK(::poll(&pfd, 1, 50) == 0, "one-shot: no event without re-arming");
  int flags = fcntl(ch->fd, F_GETFL);
  fcntl(ch->fd, F_SETFL, flags | O_NONBLOCK);
  errno = 0;
  CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == -1 && errno == EAGAIN, "non-blocking channel: EAGAIN");
  CHECK(ibv_destroy_qp(a.qp) == 0, "destroy QP");
  a.qp = nullptr;
  CHECK(ibv_destroy_cq(a.cq) == EBUSY, "destroy_cq with an unacknowledged event fails");
  ibv_ack_cq_events(a.cq, 1);
  CHECK(ibv_destroy_comp_channel(ch) == EBUSY, "destroy_comp_channel while a CQ uses it fails");
  Free(a);
  CHECK(ibv_destroy_comp_channel(ch) == 0, "destroy_comp_channel");
  Side f = MakeQp(d);
  CHECK(ibv_destroy_cq(f.cq) == EBUSY, "destroy_cq while a QP uses it fails");
  Free(f);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  return "";
}

std::string RetryExceeded(Dev& d) {
  // (a) PSN mismatch: the responder expects another PSN; (b) a destination port that does not
  // exist (a dead peer); (c) a responder still in INIT (it discards what arrives): all end in
  // IBV_WC_RETRY_EXC_ERR after retry_cnt retransmissions; (d) below.
  for (int variant = 0; variant < 3; ++variant) {
    Side a = MakeQp(d), b = MakeQp(d);
    ConnOpts o;
    o.wrong_psn = variant == 0;
    o.timeout = 8;  // 1 ms
    o.retry = 2;
    std::string e;
    if (variant == 0) {
      e = Connect(d, a, b, o);
    } else if (variant == 2) {
      CHECK(ToInit(a.qp) == 0 && ToInit(b.qp) == 0, "init");
      CHECK(ToRtr(d, a.qp, PeerOf(d, b, 1)) == 0 && ToRts(a.qp, 1, o.timeout, o.retry) == 0, "rtr/rts");
    } else {
      CHECK(ToInit(a.qp) == 0, "init");
      Peer ghost = PeerOf(d, b, 1);
      ghost.lid = uint16_t(d.port.lid == 0xBFFE ? 1 : d.port.lid + 1);
      ghost.gid.raw[15] ^= 1;
      CHECK(ToRtr(d, a.qp, ghost) == 0 && ToRts(a.qp, 1, o.timeout, o.retry) == 0, "rtr/rts");
    }
    if (!e.empty()) return e;
    std::vector<uint8_t> src(8), dst(8);
    ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), 8, IBV_ACCESS_LOCAL_WRITE);
    ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    const int64_t before = Counter("retransmits");
    CHECK(PostWrite(a.qp, 60, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false) == 0, "post");
    auto w = Poll(a.cq, 1);
    CHECK(w.size() == 1 && w[0].status == IBV_WC_RETRY_EXC_ERR, "variant %d: IBV_WC_RETRY_EXC_ERR (got %d)",
          variant, w.empty() ? -1 : w[0].status);
    CHECK(Counter("retransmits") - before == 2, "variant %d: retry_cnt=2 retransmissions, got %lld", variant,
          (long long)(Counter("retransmits") - before));
    Free(a);
    Free(b);
    ibv_dereg_mr(smr);
    ibv_dereg_mr(dmr);
  }
  // (d) The acknowledgements are lost (the lost_ack fault): the responder places the message and
  // completes its receive once, answers each retransmission as a duplicate (its acknowledgement
  // lost again), and the requester still ends in IBV_WC_RETRY_EXC_ERR.
  Side a = MakeQp(d), b = MakeQp(d);
  ConnOpts o;
  std::string e = Connect(d, a, b, o);
  if (!e.empty()) return e;
  std::vector<uint8_t> src(8, 0x5A), dst(8, 0);
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), 8, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(PostRecv(b.qp, 71) == 0, "post recv");
  CHECK(fakeverbs_arm("lost_ack", 0) == 0, "arm lost_ack");
  const int64_t before = Counter("retransmits");
  CHECK(PostWrite(a.qp, 70, src.data(), 8, smr->lkey, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, true, 9) == 0, "post");
  auto w = Poll(a.cq, 1);
  CHECK(w.size() == 1 && w[0].status == IBV_WC_RETRY_EXC_ERR, "lost acks: IBV_WC_RETRY_EXC_ERR (got %d)",
        w.empty() ? -1 : w[0].status);
  CHECK(Counter("retransmits") - before == 2, "lost acks: retry_cnt=2 retransmissions, got %lld",
        (long long)(Counter("retransmits") - before));
  auto r = Poll(b.cq, 2, 0.05);
  CHECK(r.size() == 1 && r[0].status == IBV_WC_SUCCESS && r[0].wr_id == 71 && dst == src,
        "lost acks: the message placed and its receive completed once (%zu completions)", r.size());
  Free(a);
  Free(b);
  ibv_dereg_mr(smr);
  ibv_dereg_mr(dmr);
  return "";
}

// The responder in another process (the test suite's processes are one per rank).
std::string CrossProcess(Dev& d, const char* self) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[0]);
    dup2(sv[1], 3);
    execl(self, self, "--child", static_cast<char*>(nullptr));
    _exit(99);
  }
  close(sv[1]);
  struct Info {
    Peer peer;
    uint64_t addr;
    uint32_t rkey;
  } mine{}, theirs{};
  Side a = MakeQp(d);
  CHECK(ToInit(a.qp) == 0, "init");
  mine.peer = PeerOf(d, a, 4242);
  CHECK(read(sv[0], &theirs, sizeof(theirs)) == ssize_t(sizeof(theirs)), "child's QP information");
  CHECK(write(sv[0], &mine, sizeof(mine)) == ssize_t(sizeof(mine)), "send ours");
  CHECK(ToRtr(d, a.qp, theirs.peer) == 0 && ToRts(a.qp, 4242, 14, 7, 7) == 0, "rtr/rts");
  char ready;
  CHECK(read(sv[0], &ready, 1) == 1, "child ready");
  std::vector<uint8_t> src(70000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i ^ (i >> 8));
  ibv_mr* smr = (ibv_reg_mr)(d.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  CHECK(PostWrite(a.qp, 70, src.data(), uint32_t(src.size()), smr->lkey, theirs.addr, theirs.rkey, true, 99) == 0,
        "post");
  auto w = Poll(a.cq, 1);
  CHECK(w.size() == 1 && w[0].status == IBV_WC_SUCCESS, "cross-process write completes (got %d)",
        w.empty() ? -1 : w[0].status);
  char verdict = 0;
  CHECK(read(sv[0], &verdict, 1) == 1 && verdict == 'Y', "the child saw the data and the immediate");
  int status = 0;
  waitpid(pid, &status, 0);
  close(sv[0]);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exit status %d", status);
  Free(a);
  ibv_dereg_mr(smr);
  return "";
}

int Child() {
  Dev d;
  if (!OpenDev(&d)) return 2;
  Side b = MakeQp(d);
  std::vector<uint8_t> dst(70000, 0);
  ibv_mr* dmr = (ibv_reg_mr)(d.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  struct Info {
    Peer peer;
    uint64_t addr;
    uint32_t rkey;
  } mine{}, theirs{};
  if (ToInit(b.qp) || PostRecv(b.qp, 1)) return 3;
  mine.peer = PeerOf(d, b, 555);
  mine.addr = reinterpret_cast<uint64_t>(dst.data());
  mine.rkey = dmr->rkey;
  if (write(3, &mine, sizeof(mine)) != ssize_t(sizeof(mine))) return 4;
  if (read(3, &theirs, sizeof(theirs)) != ssize_t(sizeof(theirs))) return 5;
  if (ToRtr(d, b.qp, theirs.peer) || ToRts(b.qp, 555, 14, 7, 7)) return 6;
  if (write(3, "R", 1) != 1) return 7;
  auto w = Poll(b.cq, 1);
  bool ok = w.size() == 1 && w[0].status == IBV_WC_SUCCESS && ntohl(w[0].imm_data) == 99 &&
            w[0].byte_len == dst.size();
  for (size_t i = 0; ok && i < dst.size(); ++i) ok = dst[i] == uint8_t(i ^ (i >> 8));
  if (write(3, ok ? "Y" : "N", 1) != 1) return 8;
  Free(b);
  ibv_dereg_mr(dmr);
  CloseDev(&d);
  return 0;
}

std::string NoLeaks(Dev&) {
  const char* names[] = {"qps", "cqs", "mrs", "channels"};
  for (const char* n : names) CHECK(Counter(n) == 0, "%s still live after every check: %lld", n, (long long)Counter(n));
  CHECK(Counter("pds") == 1 && Counter("contexts") == 1, "only the checks' own PD and context remain");
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--child") == 0) return Child();
  Dev d;
  if (!OpenDev(&d)) {
    std::printf("FAIL open: cannot open the emulated device (errno %d)\n", errno);
    return 1;
  }
  std::vector<std::pair<const char*, std::function<std::string(Dev&)>>> checks = {
      {"device_and_port", DeviceAndPort},
      {"qp_state_machine", QpStateMachine},
      {"write_with_imm_and_send", WriteWithImmAndSend},
      {"remote_access", RemoteAccess},
      {"local_protection", LocalProtection},
      {"reg_mr_access", RegMrAccess},
      {"cq_depth_and_overrun", CqDepthAndOverrun},
      {"send_queue_depth", SendQueueDepth},
      {"receiver_not_ready", ReceiverNotReady},
      {"ordering", Ordering},
      {"dereg_while_posted", DeregWhilePosted},
      {"flush_in_error", FlushInError},
      {"completion_channel", CompletionChannel},
      {"retry_exceeded", RetryExceeded},
      {"cross_process", [&](Dev& dev) { return CrossProcess(dev, argv[0]); }},
      {"no_leaks", NoLeaks},
  };
  int failed = 0;
  for (auto& [name, fn] : checks) {
    bool wanted = argc == 1;
    for (int i = 1; i < argc; ++i) wanted |= std::strcmp(argv[i], name) == 0;
    if (!wanted) continue;
    std::string why = fn(d);
    std::printf("%s %s%s%s\n", why.empty() ? "PASS" : "FAIL", name, why.empty() ? "" : ": ", why.c_str());
    std::fflush(stdout);
    failed += !why.empty();
  }
  CloseDev(&d);
  return failed ? 1 : 0;
}
