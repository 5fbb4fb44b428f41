// An emulated RDMA device for dtenjax's tests: a shared library exporting the ibv_* entry points
// the verbs provider loads (csrc/transport/verbs_loader.cc dlopens it through DTENJAX_IBVERBS_LIBRARY),
// with the semantics rdma-core's man pages and the InfiniBand specification's verbs and RC
// transport chapters document. It is built only by the test suite (tests/fakeverbs/__init__.py)
// and is never installed. It exports `fakeverbs_is_emulated`, which no real libibverbs has; the
// provider uses it to report the device as EMULATED.
//
// Model (one emulated HCA per process, one port):
// * The port is an abstract unix SOCK_SEQPACKET socket "dtenjax-fakeverbs:<fabric>:<id>"; the id
//   is the port's LID (InfiniBand) and is encoded in its GIDs (RoCE). A fabric is a name
//   (FAKEVERBS_FABRIC) so concurrent test runs never meet. The port exists while a context is
//   open; a progress thread (the "HCA") executes work requests, moves packets and runs timers.
// * RC transport: one PSN per packet (32 KiB of payload), stop-and-wait per QP (one message in
//   flight; the others wait in order, so completions are per-QP ordered). The responder checks
//   PSNs (duplicates are re-acknowledged, gaps get one PSN-sequence NAK), needs a posted receive
//   for SEND and RDMA WRITE WITH IMM (else an RNR NAK carrying its min_rnr_timer), checks the
//   R_Key, the MR's and the QP's remote-write access and the bounds of the whole message. A remote
//   access error, an invalid request or a remote operational error NAKs the requester (its WR
//   completes with IBV_WC_REM_ACCESS_ERR / REM_INV_REQ_ERR / REM_OP_ERR) and moves both QPs to
//   the error state. The requester retransmits after 4.096 us * 2^timeout (retry_cnt times, then
//   IBV_WC_RETRY_EXC_ERR) and after an RNR NAK (rnr_retry times, 7 = forever, then
//   IBV_WC_RNR_RETRY_EXC_ERR). Local SGEs are checked when the WR executes (lkey, PD, bounds,
//   local-write access for receives): IBV_WC_LOC_PROT_ERR. A QP in the error state completes
//   every outstanding and every newly posted WR with IBV_WC_WR_FLUSH_ERR.
// * Queues: ibv_post_send / ibv_post_recv fail with EINVAL in a state that may not post (send:
//   RESET, INIT, RTR; receive: RESET) or for a malformed WR, and with ENOMEM when the queue holds
//   max_send_wr / max_recv_wr outstanding WRs (a WR is outstanding until the completion that
//   retires it has been polled; an unsignaled send is retired by the next signaled one). A CQ
//   holds exactly the entries it was created with; one more overruns it: the CQ is unusable
//   (ibv_poll_cq returns -1) and its QPs go to the error state.
// * ibv_modify_qp enforces the RC transition table and the required and optional attribute masks
//   of ibv_modify_qp(3); ibv_dereg_mr succeeds while work is posted, and the work then completes
//   with a protection error (local) or a remote access error (remote), as hardware does.
// * Deviations, documented: ibv_destroy_cq with unacknowledged events returns EBUSY (rdma-core
//   waits forever); RNR is decided on a message's first packet; RDMA READ, atomics, SRQs, UD/UC,
//   inline data, memory windows and asynchronous events are not implemented (EOPNOTSUPP/EINVAL).
//
// Every call the contract refuses is counted ("violations", with the last one's text), as are
// live objects, packets, retransmissions and error completions (fakeverbs_counters); tests read
// them through ctypes and arm faults with fakeverbs_arm (or FAKEVERBS_FAULT=kind:after).
#include <infiniband/verbs.h>
// verbs.h turns these into inline wrappers; this file defines the exported functions themselves.
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_get_device_list
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#define FV_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr uint32_t kPsnMask = 0xffffff;
constexpr size_t kPktPayload = 32 << 10;
constexpr int kMaxQpWr = 4096, kMaxSge = 4, kMaxCqe = 65536, kMaxQpRdAtom = 16;
constexpr uint32_t kMaxMsg = 1u << 31;
constexpr double kLateSeconds = 0.3;  // the late_cqe and late_ack faults' delay
constexpr int kSupportedAccess = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC |
                                 IBV_ACCESS_RELAXED_ORDERING;

enum Counter {
  kContexts, kPds, kMrs, kCqs, kQps, kChannels, kRegMrCalls, kDeregMrCalls, kPacketsSent,
  kPacketsDropped, kRnrNaks, kRetransmits, kErrorCompletions, kFlushCompletions, kViolations,
  kFaultsFired, kMessagesReceived, kWritesReceived, kNumCounters
};
const char* const kCounterNames[kNumCounters] = {
    "contexts", "pds", "mrs", "cqs", "qps", "channels", "reg_mr_calls", "dereg_mr_calls",
    "packets_sent", "packets_dropped", "rnr_naks", "retransmits", "error_completions",
    "flush_completions", "violations", "faults_fired", "messages_received",
    "writes_received"};  // writes: the messages a fault's `after` counts

std::mutex g_mu;  // guards everything below; the HCA thread and every verb take it
int64_t g_count[kNumCounters];
std::string g_last_violation;

// Refuses a call that breaks the documented contract: counts it, remembers why, sets errno.
int Violation(int err, const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  ++g_count[kViolations];
  g_last_violation = buf;
  errno = err;
  return err;
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// --- configuration (read when the port opens) -----------------------------------------------------
struct Config {
  std::string fabric = "default";
  bool roce = false;
  bool port_active = true;
  int devices = 1;
  int max_mr = 1 << 16;
};

Config ReadConfig() {
  Config c;
  if (const char* v = getenv("FAKEVERBS_FABRIC"); v && *v) c.fabric = v;
  if (const char* v = getenv("FAKEVERBS_LINK_LAYER"); v) c.roce = std::string(v) == "roce";
  if (const char* v = getenv("FAKEVERBS_PORT_STATE"); v) c.port_active = std::string(v) != "down";
  if (const char* v = getenv("FAKEVERBS_DEVICES"); v && *v) c.devices = atoi(v) > 0 ? 1 : 0;
  if (const char* v = getenv("FAKEVERBS_MAX_MR"); v && *v) c.max_mr = std::max(0, atoi(v));
  return c;
}

// --- objects ------------------------------------------------------------------------------------
struct Ctx {
  ibv_context ctx;  // first: the verbs hand out &ctx
};
struct Pd {
  ibv_pd pd;
  int refs = 0;  // MRs and QPs
};
struct Mr {
  ibv_mr mr;
  Pd* pd;
  int access;
  bool revoked = false;  // fault: as if the owner had deregistered it (keys no longer valid)
};
struct Cq;
struct Channel {
  ibv_comp_channel ch;
  std::deque<Cq*> events;
  int cqs = 0;
};
struct Entry {
  ibv_wc wc;
  int sq_slots = 0, rq_slots = 0;  // queue entries this completion retires when polled
};
struct Cq {
  ibv_cq cq;
  int cap;
  std::deque<Entry> q;
  bool overrun = false;
  bool armed = false, solicited_only = false;
  Channel* channel;
  int qps = 0;
  uint64_t got = 0, acked = 0;
};
struct Sge {
  uint64_t addr;
  uint32_t length;
  uint32_t lkey;
};
struct SendWqe {
  uint64_t wr_id;
  int opcode;
  bool signaled;
  bool solicited;
  uint32_t imm;
  uint64_t raddr;
  uint32_t rkey;
  std::vector<Sge> sges;
  uint64_t length = 0;
  bool started = false;  // gathered and numbered
  std::vector<uint8_t> data;
  uint32_t first_psn = 0, npkts = 1;
};
struct RecvWqe {
  uint64_t wr_id;
  std::vector<Sge> sges;
  uint64_t length = 0;
};
struct Qp {
  ibv_qp qp;
  Pd* pd;
  Cq *scq, *rcq;
  ibv_qp_cap cap;
  bool sig_all;
  int state = IBV_QPS_RESET;
  // attributes
  int pkey_index = 0, port = 0, access = 0, path_mtu = 0;
  uint32_t dest_qpn = 0, rq_psn = 0, sq_psn = 0;
  int timeout = 0, retry_cnt = 0, rnr_retry = 0, min_rnr_timer = 0;
  int max_rd_atomic = 0, max_dest_rd_atomic = 0;
  ibv_ah_attr ah{};
  int dest_port = -1;  // port id the address vector resolves to
  // queues
  std::deque<SendWqe> sq;
  std::deque<RecvWqe> rq;
  int sq_used = 0, rq_used = 0, unsignaled_done = 0;
  // requester
  bool inflight = false;
  double deadline = 0, resend_at = 0;
  int retries_left = 0, rnr_left = 0;
  uint32_t next_psn = 0;
  // responder
  uint32_t epsn = 0;
  bool nak_sent = false;
  // lost_ack: every acknowledgement of this PSN (the first and those of retransmissions) is lost
  // on the wire, so its requester retries and fails although the message was placed.
  bool ack_lost = false;
  uint32_t lost_psn = 0;
  struct {
    bool active = false;
    int op = 0;  // IBV_WR_*
    uint64_t raddr = 0, total = 0, got = 0;
    uint32_t rkey = 0, imm = 0;
    bool has_recv = false;
    RecvWqe recv;
  } msg;
};

// --- the port and its wire ----------------------------------------------------------------------
enum PktType : uint8_t { kReq = 1, kAck = 2, kNak = 3 };
enum Syndrome : uint8_t { kNakSeq = 1, kNakRnr = 2, kNakRemAccess = 3, kNakInvReq = 4, kNakRemOp = 5 };
constexpr uint32_t kPktMagic = 0x46564250;  // "PBVF"

struct PktHdr {
  uint32_t magic;
  uint8_t type, op, syndrome, rnr_timer;
  uint16_t src_port, dst_lid;
  uint8_t src_gid[16], dst_gid[16];
  uint32_t src_qpn, dst_qpn, psn;
  uint32_t imm;
  uint64_t raddr;
  uint32_t rkey;
  uint32_t total;   // whole message
  uint32_t offset;  // of this packet's payload in the message
  uint32_t length;  // payload bytes of this packet
  uint8_t first, last, has_imm, solicited;
  uint8_t late;     // late_ack: the requester takes this acknowledgement kLateSeconds late
};

struct Wire {
  int fd = -1;
  std::deque<std::vector<uint8_t>> out;
};

struct Port {
  Config cfg;
  int id = 0;  // LID on InfiniBand; encoded in the GIDs on RoCE
  int lfd = -1, wake = -1;
  std::map<int, Wire*> out;  // to peer port ids
  std::vector<Wire*> in;
  std::map<uint32_t, Qp*> qps;
  uint32_t next_qpn = 0;
  int ngids = 0;
  ibv_gid gids[4];
  std::thread thread;
  bool stop = false;
  int contexts = 0;
  // late_cqe: receive completions of messages already placed and acknowledged, due later.
  struct Late {
    double due;
    uint32_t qpn;
    RecvWqe recv;
    uint32_t bytes, imm, src_qp;
    bool with_imm, solicited;
  };
  std::vector<Late> late;
  // late_ack: acknowledgements that reached this port, taken when due (the wire delivered them;
  // the sender may be gone by then, as a fabric's packets outlive the process that sent them).
  std::vector<std::pair<double, PktHdr>> late_acks;
};

Port* g_port = nullptr;
std::map<uint32_t, Mr*> g_keys;  // lkey == rkey
uint32_t g_next_key = 0;
// Every object handed out, with its kind, so a stale or foreign pointer is refused, not used.
enum Kind { kCtxKind = 1, kPdKind, kMrKind, kChannelKind, kCqKind, kQpKind };
std::map<const void*, int> g_live;
ibv_device g_device;
bool g_device_init = false;

// fault injection
std::string g_fault;
int64_t g_fault_after = -1;      // messages (RDMA WRITEs received) until the fault fires
bool g_fault_nak_next = false;   // wc_error: NAK the next message with a remote operational error
bool g_hide_rq = false;          // rnr: receive queues look empty

std::string SocketName(const std::string& fabric, int id) {
  return "dtenjax-fakeverbs:" + fabric + ":" + std::to_string(id);
}

sockaddr_un Address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = 0;  // abstract namespace: the name disappears with the process
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof(a.sun_path) - 2));
  *len = socklen_t(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof(a.sun_path) - 2));
  return a;
}

void MakeGids(Port* p) {
  const uint8_t hi = uint8_t(p->id >> 8), lo = uint8_t(p->id);
  auto set = [&](int i, std::initializer_list<uint8_t> head) {
    std::memset(p->gids[i].raw, 0, 16);
    int k = 0;
    for (uint8_t b : head) p->gids[i].raw[k++] = b;
    p->gids[i].raw[14] = hi;
    p->gids[i].raw[15] = lo;
  };
  if (!p->cfg.roce) {  // subnet prefix fe80::/64 and a GUID
    set(0, {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0xfa, 0xce, 0xff, 0xfe, 0x00});
    p->ngids = 1;
  } else {  // link-local (RoCE v1, v2), then ::ffff:10.233.hi.lo (v1, v2)
    set(0, {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0xfa, 0xce, 0xff, 0xfe, 0x00});
    set(1, {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0xfa, 0xce, 0xff, 0xfe, 0x00});
    set(2, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 233});
    set(3, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 233});
    p->ngids = 4;
  }
}

// The port id a GID names, or -1 when it is not a GID of this fabric.
int PortOfGid(const uint8_t* g) {
  static const uint8_t ll[14] = {0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0xfa, 0xce, 0xff, 0xfe, 0x00};
  static const uint8_t v4[14] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 233};
  if (std::memcmp(g, ll, 14) != 0 && std::memcmp(g, v4, 14) != 0) return -1;
  return (int(g[14]) << 8) | g[15];
}

bool OwnGid(const Port* p, const uint8_t* g) {
  for (int i = 0; i < p->ngids; ++i) {
    if (std::memcmp(p->gids[i].raw, g, 16) == 0) return true;
  }
  return false;
}

void CloseWire(Wire* w) {
  if (w->fd >= 0) ::close(w->fd);
  delete w;
}

bool FlushWire(Wire* w) {  // false: the connection died
  while (!w->out.empty()) {
    const auto& pkt = w->out.front();
    ssize_t k = ::send(w->fd, pkt.data(), pkt.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (k >= 0) {
      w->out.pop_front();
      continue;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    if (errno == EINTR) continue;
    g_count[kPacketsDropped] += int64_t(w->out.size());
    return false;
  }
  return true;
}

// Sends a packet to port `dest` (best effort: an unreachable port drops it, as a fabric would,
// and the requester's timer retransmits).
void SendPacket(Port* p, int dest, const PktHdr& h, const uint8_t* payload) {
  ++g_count[kPacketsSent];
  Wire*& w = p->out[dest];
  if (!w) {
    int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    socklen_t len;
    sockaddr_un a = Address(SocketName(p->cfg.fabric, dest), &len);
    if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), len) != 0) {
      if (fd >= 0) ::close(fd);
      p->out.erase(dest);
      ++g_count[kPacketsDropped];
      return;
    }
    int buf = 1 << 20;
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    w = new Wire;
    w->fd = fd;
  }
  std::vector<uint8_t> pkt(sizeof(PktHdr) + h.length);
  std::memcpy(pkt.data(), &h, sizeof(PktHdr));
  if (h.length) std::memcpy(pkt.data() + sizeof(PktHdr), payload, h.length);
  w->out.push_back(std::move(pkt));
  if (w->out.size() == 1 && !FlushWire(w)) {  // on the wire now, as hardware would put it
    CloseWire(w);
    p->out.erase(dest);
  }
}

// --- completions --------------------------------------------------------------------------------
void QpToError(Qp* qp);

void Push(Cq* cq, const ibv_wc& wc, int sq_slots, int rq_slots, bool solicited) {
  if (wc.status != IBV_WC_SUCCESS) {
    ++g_count[wc.status == IBV_WC_WR_FLUSH_ERR ? kFlushCompletions : kErrorCompletions];
  }
  if (cq->overrun) return;
  if (int(cq->q.size()) >= cq->cap) {  // CQ overrun: the CQ is unusable, its QPs go to error
    cq->overrun = true;
    if (g_port) {
      for (auto& [num, qp] : g_port->qps) {
        if (qp->scq == cq || qp->rcq == cq) QpToError(qp);
      }
    }
    return;
  }
  cq->q.push_back(Entry{wc, sq_slots, rq_slots});
  if (cq->armed && (!cq->solicited_only || solicited || wc.status != IBV_WC_SUCCESS)) {
    cq->armed = false;
    if (cq->channel) {
      cq->channel->events.push_back(cq);
      uint64_t one = 1;
      (void)!::write(cq->channel->ch.fd, &one, sizeof(one));
    }
  }
}

int WcOpcode(int wr_opcode) {
  switch (wr_opcode) {
    case IBV_WR_RDMA_WRITE: case IBV_WR_RDMA_WRITE_WITH_IMM: return IBV_WC_RDMA_WRITE;
    default: return IBV_WC_SEND;
  }
}

// Retires the head send WQE with `status` (a completion is generated when signaled or on error).
void CompleteSend(Qp* qp, int status) {
  SendWqe w = std::move(qp->sq.front());
  qp->sq.pop_front();
  qp->inflight = false;
  qp->retries_left = qp->retry_cnt;
  qp->rnr_left = qp->rnr_retry;
  if (status == IBV_WC_SUCCESS && !w.signaled) {
    ++qp->unsignaled_done;
    return;
  }
  ibv_wc wc{};
  wc.wr_id = w.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = static_cast<ibv_wc_opcode>(WcOpcode(w.opcode));
  wc.qp_num = qp->qp.qp_num;
  const int slots = 1 + qp->unsignaled_done;
  qp->unsignaled_done = 0;
  Push(qp->scq, wc, slots, 0, false);
}

void CompleteRecv(Qp* qp, const RecvWqe& r, int status, int opcode, uint32_t bytes, uint32_t imm,
                  bool with_imm, uint32_t src_qp, bool solicited) {
  ibv_wc wc{};
  wc.wr_id = r.wr_id;
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = static_cast<ibv_wc_opcode>(opcode);
  wc.byte_len = bytes;
  wc.imm_data = imm;
  wc.wc_flags = with_imm ? IBV_WC_WITH_IMM : 0;
  wc.qp_num = qp->qp.qp_num;
  wc.src_qp = src_qp;
  Push(qp->rcq, wc, 0, 1, solicited);
}

void QpToError(Qp* qp) {
  if (qp->state == IBV_QPS_ERR) return;
  qp->state = IBV_QPS_ERR;
  qp->qp.state = IBV_QPS_ERR;
  qp->inflight = false;
  while (!qp->sq.empty()) CompleteSend(qp, IBV_WC_WR_FLUSH_ERR);
  if (qp->msg.active && qp->msg.has_recv) {
    CompleteRecv(qp, qp->msg.recv, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0, false, 0, false);
  }
  qp->msg.active = false;
  while (!qp->rq.empty()) {
    RecvWqe r = std::move(qp->rq.front());
    qp->rq.pop_front();
    CompleteRecv(qp, r, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0, false, 0, false);
  }
}

// --- requester ----------------------------------------------------------------------------------
PktHdr Header(Port* p, Qp* qp, uint8_t type) {
  PktHdr h{};
  h.magic = kPktMagic;
  h.type = type;
  h.src_port = uint16_t(p->id);
  h.dst_lid = qp->ah.dlid;
  const int sgid = qp->ah.is_global ? qp->ah.grh.sgid_index : 0;
  std::memcpy(h.src_gid, p->gids[sgid < p->ngids ? sgid : 0].raw, 16);
  std::memcpy(h.dst_gid, qp->ah.grh.dgid.raw, 16);
  h.src_qpn = qp->qp.qp_num;
  h.dst_qpn = qp->dest_qpn;
  return h;
}

double TimeoutSeconds(int t) { return t == 0 ? 1e30 : 4.096e-6 * double(uint64_t(1) << t); }

double RnrSeconds(int t) {
  static const double ms[32] = {655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32,
                                0.48, 0.64, 0.96, 1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36,
                                20.48, 30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76, 327.68,
                                491.52};
  return ms[t & 31] * 1e-3;
}

bool InMr(const Mr* m, uint64_t addr, uint64_t len) {
  const uint64_t base = reinterpret_cast<uint64_t>(m->mr.addr);
  return addr >= base && len <= m->mr.length && addr - base <= m->mr.length - len;
}

// A local SGE: the lkey names a live MR of the QP's PD holding the whole range (and local-write
// access when the HCA writes into it).
bool LocalOk(const Qp* qp, const Sge& s, bool write) {
  auto it = g_keys.find(s.lkey);
  if (it == g_keys.end() || it->second->revoked) return false;
  const Mr* m = it->second;
  if (m->pd != qp->pd || !InMr(m, s.addr, s.length)) return false;
  return !write || (m->access & IBV_ACCESS_LOCAL_WRITE);
}

// An RDMA WRITE target: the R_Key names a live MR of the QP's PD with remote-write access that
// holds the whole message, and the QP itself allows remote writes.
bool RemoteOk(const Qp* qp, uint32_t rkey, uint64_t addr, uint64_t len) {
  auto it = g_keys.find(rkey);
  const Mr* m = it == g_keys.end() ? nullptr : it->second;
  return (qp->access & IBV_ACCESS_REMOTE_WRITE) && m && !m->revoked && m->pd == qp->pd &&
         (m->access & IBV_ACCESS_REMOTE_WRITE) && InMr(m, addr, len);
}

bool RecvSgesOk(const Qp* qp, const RecvWqe& r) {
  for (const Sge& s : r.sges) {
    if (!LocalOk(qp, s, true)) return false;
  }
  return true;
}

void Transmit(Port* p, Qp* qp) {
  SendWqe& w = qp->sq.front();
  for (uint32_t i = 0; i < w.npkts; ++i) {
    PktHdr h = Header(p, qp, kReq);
    h.op = uint8_t(w.opcode);
    h.psn = (w.first_psn + i) & kPsnMask;
    h.imm = w.imm;
    h.raddr = w.raddr;
    h.rkey = w.rkey;
    h.total = uint32_t(w.length);
    h.offset = uint32_t(i * kPktPayload);
    h.length = uint32_t(std::min<uint64_t>(kPktPayload, w.length - h.offset));
    h.first = i == 0;
    h.last = i + 1 == w.npkts;
    h.has_imm = w.opcode == IBV_WR_RDMA_WRITE_WITH_IMM || w.opcode == IBV_WR_SEND_WITH_IMM;
    h.solicited = w.solicited;
    SendPacket(p, qp->dest_port, h, w.data.data() + h.offset);
  }
  qp->inflight = true;
  qp->resend_at = 0;
  qp->deadline = Now() + TimeoutSeconds(qp->timeout);
}

// Starts the head WQE of an RTS QP: gathers its local data (checking the SGEs) and sends it.
void Execute(Port* p, Qp* qp) {
  SendWqe& w = qp->sq.front();
  if (!w.started) {
    for (const Sge& s : w.sges) {
      if (!LocalOk(qp, s, false)) {
        CompleteSend(qp, IBV_WC_LOC_PROT_ERR);
        QpToError(qp);
        return;
      }
    }
    w.data.resize(w.length);
    size_t off = 0;
    for (const Sge& s : w.sges) {
      std::memcpy(w.data.data() + off, reinterpret_cast<const void*>(s.addr), s.length);
      off += s.length;
    }
    w.first_psn = qp->next_psn;
    w.npkts = uint32_t(std::max<uint64_t>(1, (w.length + kPktPayload - 1) / kPktPayload));
    qp->next_psn = (qp->next_psn + w.npkts) & kPsnMask;
    w.started = true;
  }
  Transmit(p, qp);
}

void RequesterTimers(Port* p, Qp* qp, double now) {
  if (qp->state != IBV_QPS_RTS || qp->sq.empty()) return;
  if (qp->resend_at > 0) {
    if (now >= qp->resend_at) {
      ++g_count[kRetransmits];
      Transmit(p, qp);
    }
    return;
  }
  if (qp->inflight && now >= qp->deadline) {
    if (qp->retries_left > 0) {
      --qp->retries_left;
      ++g_count[kRetransmits];
      Transmit(p, qp);
    } else {
      CompleteSend(qp, IBV_WC_RETRY_EXC_ERR);
      QpToError(qp);
    }
  }
}

// --- responder ----------------------------------------------------------------------------------
void Reply(Port* p, Qp* qp, uint8_t type, uint8_t syndrome, uint32_t psn, bool late = false) {
  if (type == kAck && qp->ack_lost && (psn & kPsnMask) == qp->lost_psn) {
    ++g_count[kPacketsDropped];
    return;
  }
  PktHdr h = Header(p, qp, type);
  h.late = late;
  h.syndrome = syndrome;
  h.rnr_timer = uint8_t(qp->min_rnr_timer);
  h.psn = psn & kPsnMask;
  SendPacket(p, qp->dest_port, h, nullptr);
}

void FireFault(Port* p, Qp* qp) {
  ++g_count[kFaultsFired];
  const std::string f = g_fault;
  g_fault.clear();
  if (f == "qp_error") {
    QpToError(qp);
  } else if (f == "revoke_mr") {
    for (auto& [key, m] : g_keys) {
      if (m->access & IBV_ACCESS_REMOTE_WRITE) m->revoked = true;
    }
  } else if (f == "rnr") {
    g_hide_rq = true;
  } else if (f == "cq_overrun") {
    qp->rcq->overrun = true;
    for (auto& [num, q] : p->qps) {
      if (q->scq == qp->rcq || q->rcq == qp->rcq) QpToError(q);
    }
  } else if (f == "wc_error") {
    g_fault_nak_next = true;
  } else if (f == "exit") {
    _exit(17);
  }  // late_cqe, late_ack and lost_ack have already acted on their message (OnRequest)
}

void OnReply(Port* p, Qp* qp, const PktHdr& h);

// Posts the held-back receive completions that are due (a QP that went to the error state
// meanwhile flushes its receive; a destroyed one takes it along), and takes the late
// acknowledgements that are due (a QP no longer there or no longer sending ignores them).
void DeliverLate(Port* p, double now, double* next) {
  for (auto it = p->late_acks.begin(); it != p->late_acks.end();) {
    if (it->first > now) {
      *next = std::min(*next, it->first);
      ++it;
      continue;
    }
    if (auto q = p->qps.find(it->second.dst_qpn); q != p->qps.end()) {
      OnReply(p, q->second, it->second);
    }
    it = p->late_acks.erase(it);
  }
  for (auto it = p->late.begin(); it != p->late.end();) {
    if (it->due > now) {
      *next = std::min(*next, it->due);
      ++it;
      continue;
    }
    if (auto q = p->qps.find(it->qpn); q != p->qps.end()) {
      Qp* qp = q->second;
      if (qp->state == IBV_QPS_ERR) {
        CompleteRecv(qp, it->recv, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0, false, 0, false);
      } else {
        CompleteRecv(qp, it->recv, IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, it->bytes, it->imm,
                     it->with_imm, it->src_qp, it->solicited);
      }
    }
    it = p->late.erase(it);
  }
}

// A remote-caused error on the message at epsn (Class A/C): NAK, retire the receive WQE it used
// with `recv_status`, and move this QP to the error state.
void ResponderError(Port* p, Qp* qp, uint8_t syndrome, uint32_t psn, bool took_recv,
                    const RecvWqe& r, int recv_status) {
  Reply(p, qp, kNak, syndrome, psn);
  if (took_recv) CompleteRecv(qp, r, recv_status, IBV_WC_RECV, 0, 0, false, 0, false);
  QpToError(qp);
}

void OnRequest(Port* p, Qp* qp, const PktHdr& h, const uint8_t* payload) {
  const uint32_t d = (h.psn - qp->epsn) & kPsnMask;
  if (d != 0) {
    if (d >= 0x800000) {  // duplicate (an ACK was lost or late): acknowledge again, do not redo
      if (h.last) Reply(p, qp, kAck, 0, (qp->epsn - 1) & kPsnMask);
    } else if (!qp->nak_sent) {  // a gap: one sequence NAK, then silence until epsn arrives
      Reply(p, qp, kNak, kNakSeq, qp->epsn);
      qp->nak_sent = true;
    }
    ++g_count[kPacketsDropped];
    return;
  }
  const bool is_write = h.op == IBV_WR_RDMA_WRITE || h.op == IBV_WR_RDMA_WRITE_WITH_IMM;
  const bool needs_recv = h.op == IBV_WR_SEND || h.op == IBV_WR_SEND_WITH_IMM ||
                          h.op == IBV_WR_RDMA_WRITE_WITH_IMM;
  if (h.first) {
    if (needs_recv && (qp->rq.empty() || g_hide_rq)) {  // receiver not ready (Class B)
      ++g_count[kRnrNaks];
      Reply(p, qp, kNak, kNakRnr, h.psn);
      qp->nak_sent = true;
      return;
    }
    RecvWqe r;
    if (needs_recv) {
      r = std::move(qp->rq.front());
      qp->rq.pop_front();
    }
    if (g_fault_nak_next) {
      g_fault_nak_next = false;
      ResponderError(p, qp, kNakRemOp, h.psn, needs_recv, r, IBV_WC_LOC_QP_OP_ERR);
      return;
    }
    if (is_write) {
      if (!RemoteOk(qp, h.rkey, h.raddr, h.total)) {
        ResponderError(p, qp, kNakRemAccess, h.psn, needs_recv, r, IBV_WC_REM_ACCESS_ERR);
        return;
      }
    } else {
      if (h.total > r.length) {
        ResponderError(p, qp, kNakInvReq, h.psn, true, r, IBV_WC_LOC_LEN_ERR);
        return;
      }
      if (!RecvSgesOk(qp, r)) {
        ResponderError(p, qp, kNakRemOp, h.psn, true, r, IBV_WC_LOC_PROT_ERR);
        return;
      }
    }
    qp->msg.active = true;
    qp->msg.op = h.op;
    qp->msg.raddr = h.raddr;
    qp->msg.rkey = h.rkey;
    qp->msg.total = h.total;
    qp->msg.got = 0;
    qp->msg.imm = h.imm;
    qp->msg.has_recv = needs_recv;
    qp->msg.recv = std::move(r);
  } else if (!qp->msg.active) {
    ++g_count[kPacketsDropped];
    return;
  } else if (is_write ? !RemoteOk(qp, qp->msg.rkey, qp->msg.raddr, qp->msg.total)
                      : !RecvSgesOk(qp, qp->msg.recv)) {
    // The region was deregistered while the message was arriving: its later packets find no MR.
    RecvWqe r = std::move(qp->msg.recv);
    const bool took = qp->msg.has_recv;
    qp->msg.active = false;
    ResponderError(p, qp, is_write ? kNakRemAccess : kNakRemOp, h.psn, took, r,
                   is_write ? IBV_WC_REM_ACCESS_ERR : IBV_WC_LOC_PROT_ERR);
    return;
  }
  // place the payload
  if (h.length) {
    if (is_write) {
      std::memcpy(reinterpret_cast<void*>(qp->msg.raddr + h.offset), payload, h.length);
    } else {
      uint64_t at = h.offset, left = h.length;
      const uint8_t* src = payload;
      for (const Sge& s : qp->msg.recv.sges) {
        if (at >= s.length) {
          at -= s.length;
          continue;
        }
        const uint64_t n = std::min<uint64_t>(left, s.length - at);
        std::memcpy(reinterpret_cast<void*>(s.addr + at), src, n);
        src += n;
        left -= n;
        at = 0;
        if (!left) break;
      }
    }
  }
  qp->msg.got += h.length;
  qp->epsn = (qp->epsn + 1) & kPsnMask;
  qp->nak_sent = false;
  if (!h.last) return;
  qp->msg.active = false;
  // Acknowledged as it is placed, before the application sees it; late_ack: the acknowledgement
  // leaves now but its requester takes it kLateSeconds later (after this side may have closed);
  // lost_ack: no acknowledgement of it arrives, its requester retransmits until retry_cnt runs out.
  if (is_write && g_fault == "lost_ack" && g_fault_after == 0) {
    qp->ack_lost = true;
    qp->lost_psn = h.psn & kPsnMask;
  }
  Reply(p, qp, kAck, 0, h.psn, is_write && g_fault == "late_ack" && g_fault_after == 0);
  if (qp->msg.has_recv && is_write && g_fault == "late_cqe" && g_fault_after == 0) {
    // The requester's completion may come before the responder's (the specification orders
    // neither): this one reaches the CQ kLateSeconds after the acknowledgement left.
    p->late.push_back(Port::Late{Now() + kLateSeconds, qp->qp.qp_num, qp->msg.recv,
                                 uint32_t(qp->msg.total), h.has_imm ? qp->msg.imm : 0,
                                 h.src_qpn, h.has_imm, h.solicited});
  } else if (qp->msg.has_recv) {
    const bool imm = h.has_imm;
    CompleteRecv(qp, qp->msg.recv, IBV_WC_SUCCESS,
                 h.op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RECV_RDMA_WITH_IMM : IBV_WC_RECV,
                 uint32_t(qp->msg.total), imm ? qp->msg.imm : 0, imm, h.src_qpn, h.solicited);
  }
  ++g_count[kMessagesReceived];
  if (is_write) ++g_count[kWritesReceived];
  if (is_write && !g_fault.empty() && g_fault_after >= 0 && --g_fault_after < 0) FireFault(p, qp);
}

void OnReply(Port* p, Qp* qp, const PktHdr& h) {
  if (qp->state != IBV_QPS_RTS || qp->sq.empty() || !qp->sq.front().started) return;
  SendWqe& w = qp->sq.front();
  const uint32_t last = (w.first_psn + w.npkts - 1) & kPsnMask;
  const uint32_t in_wqe = (h.psn - w.first_psn) & kPsnMask;
  if (h.type == kAck) {
    if (h.psn == last && qp->inflight) CompleteSend(qp, IBV_WC_SUCCESS);
    return;
  }
  if (in_wqe >= w.npkts) return;  // a NAK for another message
  switch (h.syndrome) {
    case kNakSeq:
      if (qp->retries_left > 0) {
        --qp->retries_left;
        ++g_count[kRetransmits];
        Transmit(p, qp);
      } else {
        CompleteSend(qp, IBV_WC_RETRY_EXC_ERR);
        QpToError(qp);
      }
      break;
    case kNakRnr:
      if (qp->rnr_retry == 7 || qp->rnr_left > 0) {
        if (qp->rnr_retry != 7) --qp->rnr_left;
        qp->inflight = false;
        qp->resend_at = Now() + RnrSeconds(h.rnr_timer);
      } else {
        CompleteSend(qp, IBV_WC_RNR_RETRY_EXC_ERR);
        QpToError(qp);
      }
      break;
    case kNakRemAccess: CompleteSend(qp, IBV_WC_REM_ACCESS_ERR); QpToError(qp); break;
    case kNakInvReq: CompleteSend(qp, IBV_WC_REM_INV_REQ_ERR); QpToError(qp); break;
    default: CompleteSend(qp, IBV_WC_REM_OP_ERR); QpToError(qp); break;
  }
}

// A packet from the wire: find the QP it is for and check that it comes from that QP's peer.
void OnPacket(Port* p, const uint8_t* buf, size_t n) {
  if (n < sizeof(PktHdr)) return;
  PktHdr h;
  std::memcpy(&h, buf, sizeof(h));
  if (h.magic != kPktMagic || sizeof(PktHdr) + h.length != n) {
    ++g_count[kPacketsDropped];
    return;
  }
  auto it = p->qps.find(h.dst_qpn);
  Qp* qp = it == p->qps.end() ? nullptr : it->second;
  bool ok = qp && (qp->state == IBV_QPS_RTR || qp->state == IBV_QPS_RTS) &&
            h.src_qpn == qp->dest_qpn && h.src_port == qp->dest_port;
  if (ok && p->cfg.roce) ok = OwnGid(p, h.dst_gid);
  if (ok && !p->cfg.roce) ok = h.dst_lid == p->id;
  if (!ok) {  // not for a connected QP in a receiving state: silently dropped
    ++g_count[kPacketsDropped];
    return;
  }
  if (h.type == kReq) {
    OnRequest(p, qp, h, buf + sizeof(PktHdr));
  } else if (h.type == kAck && h.late) {
    h.late = 0;
    p->late_acks.emplace_back(Now() + kLateSeconds, h);
  } else {
    OnReply(p, qp, h);
  }
}

// --- the HCA thread -----------------------------------------------------------------------------
void Run(Port* p) {
  std::vector<uint8_t> buf(sizeof(PktHdr) + kPktPayload);
  std::vector<pollfd> pfds;
  std::vector<Wire*> order;
  while (true) {
    double next = 1e30;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      if (p->stop) {  // what is queued leaves before the port closes
        for (auto& [id, w] : p->out) FlushWire(w);
        return;
      }
      const double now = Now();
      DeliverLate(p, now, &next);
      for (auto& [num, qp] : p->qps) {
        RequesterTimers(p, qp, now);
        if (qp->state == IBV_QPS_RTS && !qp->sq.empty() && !qp->inflight && qp->resend_at == 0) {
          Execute(p, qp);
        }
        if (qp->state == IBV_QPS_RTS && !qp->sq.empty()) {
          next = std::min(next, qp->resend_at > 0 ? qp->resend_at : qp->deadline);
        }
      }
      for (auto it = p->out.begin(); it != p->out.end();) {
        if (!FlushWire(it->second)) {
          CloseWire(it->second);
          it = p->out.erase(it);
        } else {
          ++it;
        }
      }
      pfds.assign({pollfd{p->lfd, POLLIN, 0}, pollfd{p->wake, POLLIN, 0}});
      order.clear();
      for (Wire* w : p->in) {
        pfds.push_back(pollfd{w->fd, POLLIN, 0});
        order.push_back(w);
      }
      for (auto& [id, w] : p->out) {
        pfds.push_back(pollfd{w->fd, short(w->out.empty() ? 0 : POLLOUT), 0});
        order.push_back(w);
      }
    }
    const double wait = std::max(0.0, std::min(next - Now(), 0.05));
    ::poll(pfds.data(), nfds_t(pfds.size()), int(wait * 1000) + (wait > 0 ? 1 : 0));
    std::lock_guard<std::mutex> lock(g_mu);
    if (p->stop) {
      for (auto& [id, w] : p->out) FlushWire(w);
      return;
    }
    if (pfds[1].revents & POLLIN) {
      uint64_t v;
      (void)!::read(p->wake, &v, sizeof(v));
    }
    if (pfds[0].revents & POLLIN) {
      while (true) {
        int fd = ::accept4(p->lfd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        auto* w = new Wire;
        w->fd = fd;
        p->in.push_back(w);
      }
    }
    std::set<Wire*> dead;
    for (size_t i = 0; i < order.size(); ++i) {
      Wire* w = order[i];
      const short ev = pfds[i + 2].revents;
      if (!ev) continue;
      if (ev & (POLLIN | POLLHUP | POLLERR)) {
        while (true) {
          ssize_t k = ::recv(w->fd, buf.data(), buf.size(), MSG_DONTWAIT);
          if (k > 0) {
            OnPacket(p, buf.data(), size_t(k));
            continue;
          }
          if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
          if (k < 0 && errno == EINTR) continue;
          dead.insert(w);  // end of stream or error: the peer's port closed
          break;
        }
      }
    }
    if (!dead.empty()) {
      for (auto it = p->in.begin(); it != p->in.end();) {
        if (dead.count(*it)) {
          CloseWire(*it);
          it = p->in.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = p->out.begin(); it != p->out.end();) {
        if (dead.count(it->second)) {
          CloseWire(it->second);
          it = p->out.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
}

void Wake() {
  if (g_port) {
    uint64_t one = 1;
    (void)!::write(g_port->wake, &one, sizeof(one));
  }
}

// Opens the port (first context): binds the first free id of the fabric, starts the HCA thread.
int OpenPort() {
  if (g_port) {
    ++g_port->contexts;
    return 0;
  }
  auto* p = new Port;
  p->cfg = ReadConfig();
  int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    delete p;
    return errno;
  }
  const int start = int(getpid() % 40000) + 1;
  for (int k = 0; k < 0xBFFE && !p->id; ++k) {
    const int id = (start + k - 1) % 0xBFFE + 1;
    socklen_t len;
    sockaddr_un a = Address(SocketName(p->cfg.fabric, id), &len);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), len) == 0) p->id = id;
  }
  if (!p->id || ::listen(fd, 128) != 0) {
    ::close(fd);
    delete p;
    return EADDRINUSE;
  }
  p->lfd = fd;
  p->wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  p->next_qpn = 0x100 + uint32_t(getpid() % 1000) * 0x100;
  MakeGids(p);
  p->contexts = 1;
  g_port = p;
  if (const char* v = getenv("FAKEVERBS_FAULT"); v && *v && g_fault.empty()) {
    std::string s = v;
    const size_t c = s.find(':');
    g_fault = s.substr(0, c);
    g_fault_after = c == std::string::npos ? 0 : atoll(s.c_str() + c + 1);
  }
  try {
    p->thread = std::thread(Run, p);
  } catch (...) {
    ::close(p->lfd);
    ::close(p->wake);
    g_port = nullptr;
    delete p;
    return ENOMEM;
  }
  return 0;
}

void ClosePort(std::unique_lock<std::mutex>& lock) {
  if (!g_port || --g_port->contexts > 0) return;
  Port* p = g_port;
  p->stop = true;
  Wake();
  g_port = nullptr;
  lock.unlock();
  p->thread.join();
  lock.lock();
  for (auto& [id, w] : p->out) CloseWire(w);
  for (Wire* w : p->in) CloseWire(w);
  ::close(p->lfd);
  ::close(p->wake);
  g_hide_rq = false;
  g_fault_nak_next = false;
  delete p;
}

template <typename T> constexpr int KindOf();
template <> constexpr int KindOf<Ctx>() { return kCtxKind; }
template <> constexpr int KindOf<Pd>() { return kPdKind; }
template <> constexpr int KindOf<Mr>() { return kMrKind; }
template <> constexpr int KindOf<Channel>() { return kChannelKind; }
template <> constexpr int KindOf<Cq>() { return kCqKind; }
template <> constexpr int KindOf<Qp>() { return kQpKind; }

template <typename T>
bool Live(const T* x) {
  auto it = g_live.find(x);
  return x && it != g_live.end() && it->second == KindOf<T>();
}
template <typename T>
void Track(const T* x) { g_live[x] = KindOf<T>(); }

void InitDevice() {
  if (g_device_init) return;
  std::memset(&g_device, 0, sizeof(g_device));
  g_device.node_type = IBV_NODE_CA;
  g_device.transport_type = IBV_TRANSPORT_IB;
  std::snprintf(g_device.name, sizeof(g_device.name), "fakeverbs0");
  std::snprintf(g_device.dev_name, sizeof(g_device.dev_name), "uverbs-fake0");
  std::snprintf(g_device.dev_path, sizeof(g_device.dev_path), "/nonexistent/fakeverbs0");
  std::snprintf(g_device.ibdev_path, sizeof(g_device.ibdev_path), "/nonexistent/fakeverbs0");
  g_device_init = true;
}

// --- data-path verbs (installed in ibv_context.ops) ---------------------------------------------
int PostSend(ibv_qp* q, ibv_send_wr* wr, ibv_send_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  Qp* qp = reinterpret_cast<Qp*>(q);
  if (bad) *bad = nullptr;
  if (!Live(qp)) return Violation(EINVAL, "ibv_post_send on an unknown QP");
  for (; wr; wr = wr->next) {
    auto fail = [&](int err) { if (bad) *bad = wr; return err; };
    if (qp->state == IBV_QPS_RESET || qp->state == IBV_QPS_INIT || qp->state == IBV_QPS_RTR) {
      return fail(Violation(EINVAL, "ibv_post_send on QP %u in state %d (needs RTS)",
                            qp->qp.qp_num, qp->state));
    }
    if (qp->sq_used >= int(qp->cap.max_send_wr)) {
      return fail(Violation(ENOMEM, "ibv_post_send: send queue of QP %u is full (%u outstanding "
                                    "WRs; poll their completions first)",
                            qp->qp.qp_num, qp->cap.max_send_wr));
    }
    const int op = wr->opcode;
    if (op != IBV_WR_SEND && op != IBV_WR_SEND_WITH_IMM && op != IBV_WR_RDMA_WRITE &&
        op != IBV_WR_RDMA_WRITE_WITH_IMM) {
      errno = EINVAL;
      return fail(EINVAL);  // valid on RC hardware, not implemented by the fake
    }
    if (wr->num_sge < 0 || wr->num_sge > int(qp->cap.max_send_sge) ||
        (wr->num_sge > 0 && !wr->sg_list)) {
      return fail(Violation(EINVAL, "ibv_post_send: num_sge=%d (max_send_sge=%u)", wr->num_sge,
                            qp->cap.max_send_sge));
    }
    if (wr->send_flags & IBV_SEND_INLINE) {
      return fail(Violation(EINVAL, "ibv_post_send: IBV_SEND_INLINE with max_inline_data=0"));
    }
    SendWqe w;
    w.wr_id = wr->wr_id;
    w.opcode = op;
    w.signaled = qp->sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w.solicited = wr->send_flags & IBV_SEND_SOLICITED;
    w.imm = wr->imm_data;
    w.raddr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
    for (int i = 0; i < wr->num_sge; ++i) {
      w.sges.push_back(Sge{wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey});
      w.length += wr->sg_list[i].length;
    }
    if (w.length > kMaxMsg) {
      return fail(Violation(EINVAL, "ibv_post_send: message of %llu bytes > max_msg_sz",
                            (unsigned long long)w.length));
    }
    ++qp->sq_used;
    qp->sq.push_back(std::move(w));
    if (qp->state == IBV_QPS_ERR) {  // posted in the error state: completed with a flush error
      while (!qp->sq.empty()) CompleteSend(qp, IBV_WC_WR_FLUSH_ERR);
    }
  }
  Wake();
  return 0;
}

int PostRecv(ibv_qp* q, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  std::lock_guard<std::mutex> lock(g_mu);
  Qp* qp = reinterpret_cast<Qp*>(q);
  if (bad) *bad = nullptr;
  if (!Live(qp)) return Violation(EINVAL, "ibv_post_recv on an unknown QP");
  for (; wr; wr = wr->next) {
    auto fail = [&](int err) { if (bad) *bad = wr; return err; };
    if (qp->state == IBV_QPS_RESET) {
      return fail(Violation(EINVAL, "ibv_post_recv on QP %u in RESET", qp->qp.qp_num));
    }
    if (qp->rq_used >= int(qp->cap.max_recv_wr)) {
      return fail(Violation(ENOMEM, "ibv_post_recv: receive queue of QP %u is full (%u)",
                            qp->qp.qp_num, qp->cap.max_recv_wr));
    }
    if (wr->num_sge < 0 || wr->num_sge > int(qp->cap.max_recv_sge) ||
        (wr->num_sge > 0 && !wr->sg_list)) {
      return fail(Violation(EINVAL, "ibv_post_recv: num_sge=%d (max_recv_sge=%u)", wr->num_sge,
                            qp->cap.max_recv_sge));
    }
    RecvWqe r;
    r.wr_id = wr->wr_id;
    for (int i = 0; i < wr->num_sge; ++i) {
      r.sges.push_back(Sge{wr->sg_list[i].addr, wr->sg_list[i].length, wr->sg_list[i].lkey});
      r.length += wr->sg_list[i].length;
    }
    ++qp->rq_used;
    if (qp->state == IBV_QPS_ERR) {
      CompleteRecv(qp, r, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0, 0, false, 0, false);
    } else {
      qp->rq.push_back(std::move(r));
    }
  }
  Wake();
  return 0;
}

int PollCq(ibv_cq* c, int n, ibv_wc* wc) {
  std::lock_guard<std::mutex> lock(g_mu);
  Cq* cq = reinterpret_cast<Cq*>(c);
  if (!Live(cq)) return -Violation(EINVAL, "ibv_poll_cq on an unknown CQ");
  if (cq->overrun) {  // IBV_EVENT_CQ_ERR: "the CQ cannot be used"
    errno = EIO;
    return -1;
  }
  if (n < 0) return -Violation(EINVAL, "ibv_poll_cq: num_entries=%d", n);
  int k = 0;
  while (k < n && !cq->q.empty()) {
    Entry e = cq->q.front();
    cq->q.pop_front();
    wc[k++] = e.wc;
    if (g_port) {
      auto it = g_port->qps.find(e.wc.qp_num);
      if (it != g_port->qps.end()) {
        Qp* qp = it->second;  // (a QP reset since then has already released everything)
        qp->sq_used = std::max(0, qp->sq_used - e.sq_slots);
        qp->rq_used = std::max(0, qp->rq_used - e.rq_slots);
      }
    }
  }
  return k;
}

int ReqNotifyCq(ibv_cq* c, int solicited_only) {
  std::lock_guard<std::mutex> lock(g_mu);
  Cq* cq = reinterpret_cast<Cq*>(c);
  if (!Live(cq)) return Violation(EINVAL, "ibv_req_notify_cq on an unknown CQ");
  if (!cq->channel) return Violation(EINVAL, "ibv_req_notify_cq on a CQ without a completion channel");
  cq->armed = true;
  cq->solicited_only = solicited_only != 0;
  return 0;
}

}  // namespace

// --- exported verbs -----------------------------------------------------------------------------
FV_EXPORT ibv_device** ibv_get_device_list(int* num) {
  std::lock_guard<std::mutex> lock(g_mu);
  InitDevice();
  const int n = ReadConfig().devices;
  auto** list = static_cast<ibv_device**>(calloc(size_t(n + 1), sizeof(ibv_device*)));
  if (!list) {
    errno = ENOMEM;
    return nullptr;
  }
  if (n) list[0] = &g_device;
  if (num) *num = n;
  return list;
}

FV_EXPORT void ibv_free_device_list(ibv_device** list) { free(list); }

FV_EXPORT const char* ibv_get_device_name(ibv_device* d) { return d ? d->name : nullptr; }

FV_EXPORT ibv_context* ibv_open_device(ibv_device* d) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (d != &g_device) {
    Violation(ENODEV, "ibv_open_device on a device this library did not list");
    return nullptr;
  }
  if (int err = OpenPort()) {
    errno = err;
    return nullptr;
  }
  auto* c = new Ctx;
  std::memset(&c->ctx, 0, sizeof(c->ctx));
  c->ctx.device = d;
  c->ctx.cmd_fd = -1;
  c->ctx.async_fd = -1;
  c->ctx.num_comp_vectors = 1;
  pthread_mutex_init(&c->ctx.mutex, nullptr);
  c->ctx.ops.post_send = PostSend;
  c->ctx.ops.post_recv = PostRecv;
  c->ctx.ops.poll_cq = PollCq;
  c->ctx.ops.req_notify_cq = ReqNotifyCq;
  Track(c);
  ++g_count[kContexts];
  return &c->ctx;
}

FV_EXPORT int ibv_close_device(ibv_context* ctx) {
  std::unique_lock<std::mutex> lock(g_mu);
  auto* c = reinterpret_cast<Ctx*>(ctx);
  if (!Live(c)) return Violation(EINVAL, "ibv_close_device on an unknown context");
  g_live.erase(c);
  --g_count[kContexts];
  delete c;
  ClosePort(lock);
  return 0;
}

FV_EXPORT int ibv_query_device(ibv_context* ctx, ibv_device_attr* a) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx))) return Violation(EINVAL, "ibv_query_device: unknown context");
  std::memset(a, 0, sizeof(*a));
  std::snprintf(a->fw_ver, sizeof(a->fw_ver), "dtenjax-fakeverbs (emulated)");
  a->node_guid = 0xfacefacefaceULL;
  a->max_mr_size = uint64_t(1) << 40;
  a->page_size_cap = 4096;
  a->max_qp = 1 << 16;
  a->max_qp_wr = kMaxQpWr;
  a->max_sge = kMaxSge;
  a->max_cq = 1 << 16;
  a->max_cqe = kMaxCqe;
  a->max_mr = g_port ? g_port->cfg.max_mr : ReadConfig().max_mr;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = a->max_qp_init_rd_atom = kMaxQpRdAtom;
  a->max_pkeys = 1;
  a->phys_port_cnt = 1;
  return 0;
}

// The exported symbol takes the compat struct (the prefix of ibv_port_attr up to `flags`).
FV_EXPORT int ibv_query_port(ibv_context* ctx, uint8_t port, struct _compat_ibv_port_attr* a) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx)) || !g_port) return Violation(EINVAL, "ibv_query_port: unknown context");
  if (port != 1) return Violation(EINVAL, "ibv_query_port: port %d (the device has port 1)", port);
  // Callers of the exported symbol pass the compat struct: fill only the fields it has.
  ibv_port_attr full{};
  const Config& c = g_port->cfg;
  full.state = c.port_active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  full.max_mtu = IBV_MTU_4096;
  full.active_mtu = c.roce ? IBV_MTU_1024 : IBV_MTU_4096;  // RoCE: a 1500-byte Ethernet MTU
  full.gid_tbl_len = g_port->ngids;
  full.max_msg_sz = kMaxMsg;
  full.pkey_tbl_len = 1;
  full.lid = c.roce ? 0 : uint16_t(g_port->id);
  full.sm_lid = c.roce ? 0 : 1;
  full.active_width = 2;   // 4x
  full.active_speed = 64;  // HDR: 50 Gb/s per lane
  full.phys_state = c.port_active ? 5 : 3;
  full.link_layer = c.roce ? IBV_LINK_LAYER_ETHERNET : IBV_LINK_LAYER_INFINIBAND;
  std::memcpy(static_cast<void*>(a), &full, offsetof(ibv_port_attr, port_cap_flags2));
  return 0;
}

FV_EXPORT int ibv_query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx)) || !g_port || port != 1 || index < 0 ||
      index >= g_port->ngids) {
    Violation(EINVAL, "ibv_query_gid: port %d index %d (table of %d)", port, index,
              g_port ? g_port->ngids : 0);
    return -1;
  }
  *gid = g_port->gids[index];
  return 0;
}

// ibv_query_gid_ex's exported half: the entry with its type (RoCE: link-local v1, v2, then the
// IPv4-mapped address as v1, v2; InfiniBand: IB).
FV_EXPORT int _ibv_query_gid_ex(ibv_context* ctx, uint32_t port, uint32_t index,
                                ibv_gid_entry* entry, uint32_t flags, size_t entry_size) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx)) || !g_port || port != 1 || flags ||
      entry_size < sizeof(ibv_gid_entry)) {
    return Violation(EINVAL, "ibv_query_gid_ex: port %u flags %u entry_size %zu", port, flags,
                     entry_size);
  }
  if (index >= uint32_t(g_port->ngids)) return ENODATA;
  std::memset(entry, 0, sizeof(*entry));
  entry->gid = g_port->gids[index];
  entry->gid_index = index;
  entry->port_num = port;
  entry->gid_type = !g_port->cfg.roce ? IBV_GID_TYPE_IB
                                       : (index % 2 ? IBV_GID_TYPE_ROCE_V2 : IBV_GID_TYPE_ROCE_V1);
  return 0;
}

FV_EXPORT ibv_pd* ibv_alloc_pd(ibv_context* ctx) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx))) {
    Violation(EINVAL, "ibv_alloc_pd: unknown context");
    return nullptr;
  }
  auto* pd = new Pd;
  pd->pd.context = ctx;
  pd->pd.handle = uint32_t(g_count[kPds] + 1);
  Track(pd);
  ++g_count[kPds];
  return &pd->pd;
}

FV_EXPORT int ibv_dealloc_pd(ibv_pd* p) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* pd = reinterpret_cast<Pd*>(p);
  if (!Live(pd)) return Violation(EINVAL, "ibv_dealloc_pd: unknown PD");
  if (pd->refs) return Violation(EBUSY, "ibv_dealloc_pd: %d MRs/QPs still use the PD", pd->refs);
  g_live.erase(pd);
  --g_count[kPds];
  delete pd;
  return 0;
}

FV_EXPORT ibv_mr* ibv_reg_mr(ibv_pd* p, void* addr, size_t length, int access) {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_count[kRegMrCalls];
  auto* pd = reinterpret_cast<Pd*>(p);
  if (!Live(pd)) {
    Violation(EINVAL, "ibv_reg_mr: unknown PD");
    return nullptr;
  }
  if ((access & ~kSupportedAccess) ||
      ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) &&
       !(access & IBV_ACCESS_LOCAL_WRITE))) {
    Violation(EINVAL, "ibv_reg_mr: access 0x%x (remote write/atomic need local write)", access);
    return nullptr;
  }
  if (!addr && length) {
    Violation(EFAULT, "ibv_reg_mr: NULL address for %zu bytes", length);
    return nullptr;
  }
  if (g_count[kMrs] >= (g_port ? g_port->cfg.max_mr : ReadConfig().max_mr)) {
    errno = ENOMEM;  // the device's max_mr: a resource limit, not a misuse
    return nullptr;
  }
  auto* m = new Mr;
  std::memset(&m->mr, 0, sizeof(m->mr));
  do {
    g_next_key = g_next_key * 1103515245u + 12345u + uint32_t(getpid());
  } while (g_next_key == 0 || g_keys.count(g_next_key));
  m->mr.context = p->context;
  m->mr.pd = p;
  m->mr.addr = addr;
  m->mr.length = length;
  m->mr.lkey = m->mr.rkey = g_next_key;
  m->pd = pd;
  m->access = access;
  g_keys[g_next_key] = m;
  Track(m);
  ++pd->refs;
  ++g_count[kMrs];
  return &m->mr;
}

FV_EXPORT int ibv_dereg_mr(ibv_mr* mr) {
  std::lock_guard<std::mutex> lock(g_mu);
  ++g_count[kDeregMrCalls];
  auto* m = reinterpret_cast<Mr*>(mr);
  if (!Live(m)) return Violation(EINVAL, "ibv_dereg_mr: unknown MR");
  g_keys.erase(m->mr.lkey);  // work still posted with its keys fails when it executes
  g_live.erase(m);
  --m->pd->refs;
  --g_count[kMrs];
  delete m;
  return 0;
}

FV_EXPORT ibv_comp_channel* ibv_create_comp_channel(ibv_context* ctx) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!Live(reinterpret_cast<Ctx*>(ctx))) {
    Violation(EINVAL, "ibv_create_comp_channel: unknown context");
    return nullptr;
  }
  int fd = eventfd(0, EFD_CLOEXEC | EFD_SEMAPHORE);
  if (fd < 0) return nullptr;
  auto* ch = new Channel;
  ch->ch.context = ctx;
  ch->ch.fd = fd;
  ch->ch.refcnt = 0;
  Track(ch);
  ++g_count[kChannels];
  return &ch->ch;
}

FV_EXPORT int ibv_destroy_comp_channel(ibv_comp_channel* c) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* ch = reinterpret_cast<Channel*>(c);
  if (!Live(ch)) return Violation(EINVAL, "ibv_destroy_comp_channel: unknown channel");
  if (ch->cqs) return Violation(EBUSY, "ibv_destroy_comp_channel: %d CQs still use it", ch->cqs);
  ::close(ch->ch.fd);
  g_live.erase(ch);
  --g_count[kChannels];
  delete ch;
  return 0;
}

FV_EXPORT ibv_cq* ibv_create_cq(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* c,
                                int comp_vector) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* ch = reinterpret_cast<Channel*>(c);
  if (!Live(reinterpret_cast<Ctx*>(ctx)) || (c && (!Live(ch) || c->context != ctx))) {
    Violation(EINVAL, "ibv_create_cq: unknown context or channel");
    return nullptr;
  }
  if (cqe < 1 || cqe > kMaxCqe || comp_vector < 0 || comp_vector >= ctx->num_comp_vectors) {
    Violation(EINVAL, "ibv_create_cq: cqe=%d (1..%d), comp_vector=%d (0..%d)", cqe, kMaxCqe,
              comp_vector, ctx->num_comp_vectors - 1);
    return nullptr;
  }
  auto* cq = new Cq;
  std::memset(&cq->cq, 0, sizeof(cq->cq));
  cq->cq.context = ctx;
  cq->cq.channel = c;
  cq->cq.cq_context = cq_context;
  cq->cq.cqe = cqe;
  pthread_mutex_init(&cq->cq.mutex, nullptr);
  pthread_cond_init(&cq->cq.cond, nullptr);
  cq->cap = cqe;
  cq->channel = ch;
  if (ch) ++ch->cqs;
  Track(cq);
  ++g_count[kCqs];
  return &cq->cq;
}

FV_EXPORT int ibv_destroy_cq(ibv_cq* c) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* cq = reinterpret_cast<Cq*>(c);
  if (!Live(cq)) return Violation(EINVAL, "ibv_destroy_cq: unknown CQ");
  if (cq->qps) return Violation(EBUSY, "ibv_destroy_cq: %d QPs still use the CQ", cq->qps);
  if (cq->got != cq->acked) {
    return Violation(EBUSY, "ibv_destroy_cq: %llu completion events not acknowledged "
                            "(rdma-core would wait forever)",
                     (unsigned long long)(cq->got - cq->acked));
  }
  if (Channel* ch = cq->channel) {  // events not yet read leave the channel with the CQ
    for (auto it = ch->events.begin(); it != ch->events.end();) {
      if (*it == cq) {
        uint64_t v;
        (void)!::read(ch->ch.fd, &v, sizeof(v));
        it = ch->events.erase(it);
      } else {
        ++it;
      }
    }
    --ch->cqs;
  }
  g_live.erase(cq);
  --g_count[kCqs];
  delete cq;
  return 0;
}

FV_EXPORT int ibv_get_cq_event(ibv_comp_channel* c, ibv_cq** cq, void** cq_context) {
  int fd;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto* ch = reinterpret_cast<Channel*>(c);
    if (!Live(ch)) {
      Violation(EINVAL, "ibv_get_cq_event: unknown channel");
      return -1;
    }
    fd = ch->ch.fd;
    const bool nonblocking = fcntl(fd, F_GETFL) & O_NONBLOCK;
    if (nonblocking && ch->events.empty()) {
      errno = EAGAIN;
      return -1;
    }
  }
  pollfd pfd{fd, POLLIN, 0};
  while (true) {
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto* ch = reinterpret_cast<Channel*>(c);
      if (!Live(ch)) {
        errno = EINVAL;
        return -1;
      }
      if (!ch->events.empty()) {
        uint64_t v;
        (void)!::read(fd, &v, sizeof(v));
        Cq* q = ch->events.front();
        ch->events.pop_front();
        ++q->got;
        *cq = &q->cq;
        *cq_context = q->cq.cq_context;
        return 0;
      }
    }
    ::poll(&pfd, 1, -1);
  }
}

FV_EXPORT void ibv_ack_cq_events(ibv_cq* c, unsigned int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* cq = reinterpret_cast<Cq*>(c);
  if (!Live(cq)) {
    Violation(EINVAL, "ibv_ack_cq_events: unknown CQ");
    return;
  }
  if (cq->acked + n > cq->got) {
    Violation(EINVAL, "ibv_ack_cq_events: %u events acknowledged, %llu outstanding", n,
              (unsigned long long)(cq->got - cq->acked));
    cq->acked = cq->got;
    return;
  }
  cq->acked += n;
}

FV_EXPORT ibv_qp* ibv_create_qp(ibv_pd* p, ibv_qp_init_attr* a) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* pd = reinterpret_cast<Pd*>(p);
  auto* scq = a ? reinterpret_cast<Cq*>(a->send_cq) : nullptr;
  auto* rcq = a ? reinterpret_cast<Cq*>(a->recv_cq) : nullptr;
  if (!Live(pd) || !a || !Live(scq) || !Live(rcq) || !g_port) {
    Violation(EINVAL, "ibv_create_qp: unknown PD or CQ");
    return nullptr;
  }
  if (a->qp_type != IBV_QPT_RC || a->srq) {
    errno = EOPNOTSUPP;  // only RC QPs without SRQ are emulated
    return nullptr;
  }
  const ibv_qp_cap& c = a->cap;
  if (c.max_send_wr < 1 || c.max_send_wr > uint32_t(kMaxQpWr) || c.max_recv_wr > uint32_t(kMaxQpWr) ||
      c.max_send_sge > uint32_t(kMaxSge) || c.max_recv_sge > uint32_t(kMaxSge) || c.max_inline_data) {
    Violation(EINVAL, "ibv_create_qp: cap send_wr=%u recv_wr=%u send_sge=%u recv_sge=%u inline=%u "
                      "(device: %d WRs, %d SGEs, no inline data)",
              c.max_send_wr, c.max_recv_wr, c.max_send_sge, c.max_recv_sge, c.max_inline_data,
              kMaxQpWr, kMaxSge);
    return nullptr;
  }
  auto* qp = new Qp;
  std::memset(&qp->qp, 0, sizeof(qp->qp));
  qp->qp.context = p->context;
  qp->qp.qp_context = a->qp_context;
  qp->qp.pd = p;
  qp->qp.send_cq = a->send_cq;
  qp->qp.recv_cq = a->recv_cq;
  qp->qp.qp_type = IBV_QPT_RC;
  qp->qp.state = IBV_QPS_RESET;
  pthread_mutex_init(&qp->qp.mutex, nullptr);
  pthread_cond_init(&qp->qp.cond, nullptr);
  do {
    qp->qp.qp_num = g_port->next_qpn++ & kPsnMask;
  } while (qp->qp.qp_num < 2 || g_port->qps.count(qp->qp.qp_num));
  qp->pd = pd;
  qp->scq = scq;
  qp->rcq = rcq;
  qp->cap = c;
  qp->sig_all = a->sq_sig_all != 0;
  ++pd->refs;
  ++scq->qps;
  ++rcq->qps;
  g_port->qps[qp->qp.qp_num] = qp;
  Track(qp);
  ++g_count[kQps];
  return &qp->qp;
}

FV_EXPORT int ibv_destroy_qp(ibv_qp* q) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<Qp*>(q);
  if (!Live(qp)) return Violation(EINVAL, "ibv_destroy_qp: unknown QP");
  if (g_port) g_port->qps.erase(qp->qp.qp_num);
  --qp->pd->refs;
  --qp->scq->qps;
  --qp->rcq->qps;
  g_live.erase(qp);
  --g_count[kQps];
  delete qp;
  return 0;
}

namespace {

int ModifyQp(Qp* qp, ibv_qp_attr* a, int mask) {
  const int cur = qp->state;
  const int to = (mask & IBV_QP_STATE) ? int(a->qp_state) : cur;
  if ((mask & IBV_QP_CUR_STATE) && int(a->cur_qp_state) != cur) {
    return Violation(EINVAL, "ibv_modify_qp: cur_qp_state=%d but QP %u is in %d", a->cur_qp_state,
                     qp->qp.qp_num, cur);
  }
  // The RC rows of ibv_modify_qp(3) and the IB specification: required and optional attributes.
  int req = -1, opt = 0;
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
    req = IBV_QP_STATE;
  } else if (cur == IBV_QPS_RESET && to == IBV_QPS_INIT) {
    req = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_INIT) {
    req = 0;
    opt = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  } else if (cur == IBV_QPS_INIT && to == IBV_QPS_RTR) {
    req = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
          IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    opt = IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX;
  } else if (cur == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    req = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_RETRY_CNT |
          IBV_QP_RNR_RETRY | IBV_QP_TIMEOUT;
    opt = IBV_QP_CUR_STATE | IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER |
          IBV_QP_PATH_MIG_STATE;
  } else if (cur == IBV_QPS_RTS && to == IBV_QPS_RTS) {
    req = 0;
    opt = IBV_QP_STATE | IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_ALT_PATH |
          IBV_QP_PATH_MIG_STATE | IBV_QP_MIN_RNR_TIMER;
  }
  if (req < 0) {
    return Violation(EINVAL, "ibv_modify_qp: QP %u cannot go from state %d to %d (RC: RESET -> "
                             "INIT -> RTR -> RTS; any -> RESET or ERR)", qp->qp.qp_num, cur, to);
  }
  if ((mask & req) != req || (mask & ~(req | opt | IBV_QP_CUR_STATE))) {
    return Violation(EINVAL, "ibv_modify_qp: QP %u %d -> %d with attr_mask 0x%x: required 0x%x, "
                             "optional 0x%x", qp->qp.qp_num, cur, to, mask, req, opt);
  }
  const Config& c = g_port->cfg;
  std::string bad;
  auto need = [&](bool ok, const char* what) { if (!ok) bad += std::string(bad.empty() ? "" : ", ") + what; };
  int dest_port = qp->dest_port;
  if (mask & IBV_QP_PORT) need(a->port_num == 1, "port_num");
  if (mask & IBV_QP_PKEY_INDEX) need(a->pkey_index == 0, "pkey_index");
  if (mask & IBV_QP_ACCESS_FLAGS) {
    need(!(a->qp_access_flags & ~(IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                  IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)),
         "qp_access_flags");
  }
  if (mask & IBV_QP_PATH_MTU) {
    const int active = c.roce ? IBV_MTU_1024 : IBV_MTU_4096;
    need(a->path_mtu >= IBV_MTU_256 && a->path_mtu <= active, "path_mtu (above the port's active MTU)");
  }
  if (mask & IBV_QP_DEST_QPN) need(a->dest_qp_num <= kPsnMask, "dest_qp_num");
  if (mask & IBV_QP_RQ_PSN) need(a->rq_psn <= kPsnMask, "rq_psn");
  if (mask & IBV_QP_SQ_PSN) need(a->sq_psn <= kPsnMask, "sq_psn");
  if (mask & IBV_QP_MIN_RNR_TIMER) need(a->min_rnr_timer <= 31, "min_rnr_timer");
  if (mask & IBV_QP_TIMEOUT) need(a->timeout <= 31, "timeout");
  if (mask & IBV_QP_RETRY_CNT) need(a->retry_cnt <= 7, "retry_cnt");
  if (mask & IBV_QP_RNR_RETRY) need(a->rnr_retry <= 7, "rnr_retry");
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) need(a->max_rd_atomic <= kMaxQpRdAtom, "max_rd_atomic");
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) need(a->max_dest_rd_atomic <= kMaxQpRdAtom, "max_dest_rd_atomic");
  if (mask & IBV_QP_AV) {
    const ibv_ah_attr& ah = a->ah_attr;
    need(ah.port_num == 1, "ah_attr.port_num");
    if (c.roce) {  // RoCE is routed by GID: the address vector needs a GRH
      need(ah.is_global == 1, "ah_attr.is_global (RoCE needs a GRH)");
      need(ah.grh.sgid_index < g_port->ngids, "ah_attr.grh.sgid_index");
      dest_port = PortOfGid(ah.grh.dgid.raw);
      need(dest_port > 0, "ah_attr.grh.dgid (not a GID of this fabric)");
    } else {
      need(ah.is_global || (ah.dlid >= 1 && ah.dlid < 0xC000), "ah_attr.dlid (unicast LID)");
      if (ah.is_global) need(ah.grh.sgid_index < g_port->ngids, "ah_attr.grh.sgid_index");
      dest_port = ah.dlid;
    }
  }
  if (!bad.empty()) {
    return Violation(EINVAL, "ibv_modify_qp: QP %u %d -> %d: invalid %s", qp->qp.qp_num, cur, to,
                     bad.c_str());
  }
  // Valid: apply (nothing was modified above).
  if (mask & IBV_QP_PORT) qp->port = a->port_num;
  if (mask & IBV_QP_PKEY_INDEX) qp->pkey_index = a->pkey_index;
  if (mask & IBV_QP_ACCESS_FLAGS) qp->access = a->qp_access_flags;
  if (mask & IBV_QP_PATH_MTU) qp->path_mtu = a->path_mtu;
  if (mask & IBV_QP_DEST_QPN) qp->dest_qpn = a->dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) qp->rq_psn = a->rq_psn;
  if (mask & IBV_QP_SQ_PSN) qp->sq_psn = a->sq_psn;
  if (mask & IBV_QP_MIN_RNR_TIMER) qp->min_rnr_timer = a->min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) qp->timeout = a->timeout;
  if (mask & IBV_QP_RETRY_CNT) qp->retry_cnt = a->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) qp->rnr_retry = a->rnr_retry;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) qp->max_rd_atomic = a->max_rd_atomic;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) qp->max_dest_rd_atomic = a->max_dest_rd_atomic;
  if (mask & IBV_QP_AV) {
    qp->ah = a->ah_attr;
    qp->dest_port = dest_port;
  }
  if (to == IBV_QPS_RESET) {  // everything posted is discarded without completions
    qp->sq.clear();
    qp->rq.clear();
    qp->msg.active = false;
    qp->sq_used = qp->rq_used = qp->unsignaled_done = 0;
    qp->inflight = false;
    qp->resend_at = 0;
  } else if (to == IBV_QPS_ERR) {
    QpToError(qp);
  } else if (to == IBV_QPS_RTR && cur == IBV_QPS_INIT) {
    qp->epsn = qp->rq_psn;
    qp->nak_sent = false;
  } else if (to == IBV_QPS_RTS && cur == IBV_QPS_RTR) {
    qp->next_psn = qp->sq_psn;
    qp->retries_left = qp->retry_cnt;
    qp->rnr_left = qp->rnr_retry;
  }
  qp->state = to;
  qp->qp.state = static_cast<ibv_qp_state>(to);
  Wake();
  return 0;
}

}  // namespace

FV_EXPORT int ibv_modify_qp(ibv_qp* q, ibv_qp_attr* a, int mask) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<Qp*>(q);
  if (!Live(qp) || !a || !g_port) return Violation(EINVAL, "ibv_modify_qp: unknown QP");
  return ModifyQp(qp, a, mask);
}

FV_EXPORT int ibv_query_qp(ibv_qp* q, ibv_qp_attr* a, int mask, ibv_qp_init_attr* init) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto* qp = reinterpret_cast<Qp*>(q);
  if (!Live(qp) || !a) return Violation(EINVAL, "ibv_query_qp: unknown QP");
  (void)mask;
  std::memset(a, 0, sizeof(*a));
  a->qp_state = a->cur_qp_state = static_cast<ibv_qp_state>(qp->state);
  a->path_mtu = static_cast<ibv_mtu>(qp->path_mtu);
  a->rq_psn = qp->epsn;
  a->sq_psn = qp->next_psn;
  a->dest_qp_num = qp->dest_qpn;
  a->qp_access_flags = qp->access;
  a->cap = qp->cap;
  a->ah_attr = qp->ah;
  a->min_rnr_timer = uint8_t(qp->min_rnr_timer);
  a->port_num = uint8_t(qp->port);
  a->timeout = uint8_t(qp->timeout);
  a->retry_cnt = uint8_t(qp->retry_cnt);
  a->rnr_retry = uint8_t(qp->rnr_retry);
  if (init) {
    std::memset(init, 0, sizeof(*init));
    init->send_cq = qp->qp.send_cq;
    init->recv_cq = qp->qp.recv_cq;
    init->cap = qp->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = qp->sig_all;
  }
  return 0;
}

// --- the emulation's own interface (tests, and the provider's EMULATED report) -------------------
FV_EXPORT int fakeverbs_is_emulated(void) { return 1; }

FV_EXPORT int fakeverbs_num_counters(void) { return kNumCounters; }

FV_EXPORT const char* fakeverbs_counter_name(int i) {
  return i >= 0 && i < kNumCounters ? kCounterNames[i] : nullptr;
}

FV_EXPORT int fakeverbs_counters(int64_t* out, int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (int i = 0; i < n && i < kNumCounters; ++i) out[i] = g_count[i];
  return kNumCounters;
}

// Copies the text of the last refused call into buf (NUL-terminated); returns its length.
FV_EXPORT int fakeverbs_last_violation(char* buf, int n) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (n > 0) std::snprintf(buf, size_t(n), "%s", g_last_violation.c_str());
  return int(g_last_violation.size());
}

// Arms a fault that fires after `after` more RDMA WRITE messages have been received by this
// process: qp_error (the receiving QP goes to the error state), revoke_mr (every remote-writable
// MR loses its keys, as if deregistered), rnr (receive queues look empty: RNR NAKs), cq_overrun
// (the receiving CQ overruns), wc_error (the next message is answered with a remote operational
// error NAK), exit (the process exits with status 17), late_cqe (that message is acknowledged at
// once, its receive completion reaches the CQ kLateSeconds later), late_ack (its receive
// completion is posted at once, its sender takes the acknowledgement, and so completes the write,
// kLateSeconds later), lost_ack (it is placed and its receive completes, but every acknowledgement
// of it is lost on the wire: its sender's write fails with IBV_WC_RETRY_EXC_ERR after its
// retries); "none" disarms. Returns 0, or -1 for an unknown kind.
FV_EXPORT int fakeverbs_arm(const char* kind, int64_t after) {
  static const char* const kinds[] = {"qp_error", "revoke_mr", "rnr",     "cq_overrun",
                                      "wc_error", "exit",      "late_cqe", "late_ack",
                                      "lost_ack"};
  std::lock_guard<std::mutex> lock(g_mu);
  if (kind && std::strcmp(kind, "none") == 0) {
    g_fault.clear();
    return 0;
  }
  for (const char* k : kinds) {
    if (kind && std::strcmp(kind, k) == 0) {
      g_fault = k;
      g_fault_after = after;
      return 0;
    }
  }
  return -1;
}

// The endpoint facts of this process's port (-1 when no context is open): id (LID), link layer.
FV_EXPORT int fakeverbs_port_id(void) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_port ? g_port->id : -1;
}
