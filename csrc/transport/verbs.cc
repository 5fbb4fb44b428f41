// RDMA verbs provider. libibverbs is loaded at run time (dlopen; DTENJAX_IBVERBS_LIBRARY can name
// another file), so the extension imports on machines without it; only the data structures and
// static-inline fast paths (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq, which
// go through context->ops) come from <infiniband/verbs.h>.
//
// Connection set-up: an authenticated TCP connection (the TCP provider, with its HMAC handshake
// and session keys) carries each side's QP number, PSN, LID, GID, and the rkey/address of its
// registered receive slab in authenticated CONTROL frames; then the RC QP goes RESET -> INIT ->
// RTR -> RTS, and each side tells the other it is ready (a second CONTROL frame) before anyone
// writes: a write that reached a QP not yet in RTR would be dropped and retried into an error.
// Data: one frame (frame.h: head, payload, payload tag; authenticated with the TCP connection's
// session keys like every TCP frame) is copied into the registered send slab and posted as RDMA
// WRITE WITH IMM into the peer's receive slab; the receive completion (imm = frame length) is the
// signal; the receiver copies the frame out, reposts a receive and returns one credit with a
// zero-length SEND. One frame in flight per direction; frames of both directions share the QP
// (aborts travel backwards). Waiting blocks on the CQ's completion channel; the TCP connection
// stays open as the peer's liveness signal (a dead process closes it at once).
//
// Exercised end to end in the test suite on an emulated device (tests/fakeverbs/: the ibv_*
// contract over unix sockets). NEVER RUN ON RDMA HARDWARE: timings, GPUDirect and the link-layer
// differences of real InfiniBand and RoCE fabrics are not covered (docs/transport.md).
#include "csrc/transport/verbs.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <poll.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tenancy.h"

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


const char* WcStatusName(int s) {
  switch (s) {
    case IBV_WC_SUCCESS: return "IBV_WC_SUCCESS";
    case IBV_WC_LOC_LEN_ERR: return "IBV_WC_LOC_LEN_ERR";
    case IBV_WC_LOC_QP_OP_ERR: return "IBV_WC_LOC_QP_OP_ERR";
    case IBV_WC_LOC_PROT_ERR: return "IBV_WC_LOC_PROT_ERR";
    case IBV_WC_WR_FLUSH_ERR: return "IBV_WC_WR_FLUSH_ERR";
    case IBV_WC_LOC_ACCESS_ERR: return "IBV_WC_LOC_ACCESS_ERR";
    case IBV_WC_REM_INV_REQ_ERR: return "IBV_WC_REM_INV_REQ_ERR";
    case IBV_WC_REM_ACCESS_ERR: return "IBV_WC_REM_ACCESS_ERR";
    case IBV_WC_REM_OP_ERR: return "IBV_WC_REM_OP_ERR";
    case IBV_WC_RETRY_EXC_ERR: return "IBV_WC_RETRY_EXC_ERR";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "IBV_WC_RNR_RETRY_EXC_ERR";
    case IBV_WC_FATAL_ERR: return "IBV_WC_FATAL_ERR";
    case IBV_WC_GENERAL_ERR: return "IBV_WC_GENERAL_ERR";
  }
  return "IBV_WC_(unknown)";
}

const char* WcStatusMeaning(int s) {
  switch (s) {
    case IBV_WC_WR_FLUSH_ERR:
      return "the QP is in the error state (an earlier error on it, or the device moved it there)";
    case IBV_WC_REM_ACCESS_ERR:
      return "the peer refused the RDMA write into its receive region (wrong key, out of bounds, "
             "or the region was deregistered)";
    case IBV_WC_RETRY_EXC_ERR:
      return "no acknowledgement from the peer after every retry (the peer is dead or unreachable)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer had no receive posted after every RNR retry (it broke the credit protocol)";
    case IBV_WC_LOC_PROT_ERR:
      return "a local buffer of the work request is not (or no longer) registered";
    case IBV_WC_LOC_LEN_ERR: return "a message did not fit the posted receive";
    case IBV_WC_REM_OP_ERR: return "the peer's device could not complete the operation";
    case IBV_WC_REM_INV_REQ_ERR: return "the peer found the request invalid";
    case IBV_WC_LOC_QP_OP_ERR: return "the local device found the QP inconsistent";
  }
  return "the device reported a failed work request";
}

// --- libibverbs, loaded at run time --------------------------------------------------------------
struct Lib {
  void* handle = nullptr;
  std::string path;
  bool emulated = false;
  ibv_device** (*get_device_list)(int*);
  void (*free_device_list)(ibv_device**);
  const char* (*get_device_name)(ibv_device*);
  ibv_context* (*open_device)(ibv_device*);
  int (*close_device)(ibv_context*);
  int (*query_device)(ibv_context*, ibv_device_attr*);
  int (*query_port)(ibv_context*, uint8_t, ibv_port_attr*);
  int (*query_gid)(ibv_context*, uint8_t, int, ibv_gid*);
  // Optional (rdma-core >= 35): the GID's type, to tell RoCE v2 from v1 instead of guessing.
  int (*query_gid_ex)(ibv_context*, uint32_t, uint32_t, ibv_gid_entry*, uint32_t, size_t);
  ibv_pd* (*alloc_pd)(ibv_context*);
  int (*dealloc_pd)(ibv_pd*);
  ibv_comp_channel* (*create_comp_channel)(ibv_context*);
  int (*destroy_comp_channel)(ibv_comp_channel*);
  ibv_cq* (*create_cq)(ibv_context*, int, void*, ibv_comp_channel*, int);
  int (*destroy_cq)(ibv_cq*);
  int (*get_cq_event)(ibv_comp_channel*, ibv_cq**, void**);
  void (*ack_cq_events)(ibv_cq*, unsigned int);
  ibv_qp* (*create_qp)(ibv_pd*, ibv_qp_init_attr*);
  int (*destroy_qp)(ibv_qp*);
  int (*modify_qp)(ibv_qp*, ibv_qp_attr*, int);
  ibv_mr* (*reg_mr)(ibv_pd*, void*, size_t, int);
  int (*dereg_mr)(ibv_mr*);
};

constexpr const char* kDefaultLibrary = "libibverbs.so.1";

std::mutex g_lib_mu;  // guards g_lib and g_lib_error; taken before g_dev_mu, never after
Lib g_lib;
std::string g_lib_error = "libibverbs has not been loaded yet";
int g_dev_users = 0;  // guarded by g_dev_mu (below); read under both locks to switch libraries

Status TryLoad(const std::string& file, Lib* lib) {
  dlerror();
  void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return DTENJAX_ERROR(Code::kUnavailable,
                         "cannot dlopen " + file + " (" + (e ? e : "?") +
                             "); install rdma-core / libibverbs1 to use RDMA, or set "
                             "DTENJAX_IBVERBS_LIBRARY to the library's path");
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(lib->get_device_list, "ibv_get_device_list");
  sym(lib->free_device_list, "ibv_free_device_list");
  sym(lib->get_device_name, "ibv_get_device_name");
  sym(lib->open_device, "ibv_open_device");
  sym(lib->close_device, "ibv_close_device");
  sym(lib->query_device, "ibv_query_device");
  sym(lib->query_port, "ibv_query_port");
  sym(lib->query_gid, "ibv_query_gid");
  sym(lib->alloc_pd, "ibv_alloc_pd");
  sym(lib->dealloc_pd, "ibv_dealloc_pd");
  sym(lib->create_comp_channel, "ibv_create_comp_channel");
  sym(lib->destroy_comp_channel, "ibv_destroy_comp_channel");
  sym(lib->create_cq, "ibv_create_cq");
  sym(lib->destroy_cq, "ibv_destroy_cq");
  sym(lib->get_cq_event, "ibv_get_cq_event");
  sym(lib->ack_cq_events, "ibv_ack_cq_events");
  sym(lib->create_qp, "ibv_create_qp");
  sym(lib->destroy_qp, "ibv_destroy_qp");
  sym(lib->modify_qp, "ibv_modify_qp");
  sym(lib->reg_mr, "ibv_reg_mr");
  sym(lib->dereg_mr, "ibv_dereg_mr");
  if (!missing.empty()) {
    dlclose(h);
    return DTENJAX_ERROR(Code::kUnavailable, file + " lacks the verbs " + missing);
  }
  lib->query_gid_ex = reinterpret_cast<decltype(lib->query_gid_ex)>(dlsym(h, "_ibv_query_gid_ex"));
  auto is_emulated = reinterpret_cast<int (*)()>(dlsym(h, "fakeverbs_is_emulated"));
  lib->emulated = is_emulated && is_emulated() == 1;
  lib->handle = h;
  lib->path = file;
  return Status::Ok();
}

std::mutex g_dev_mu;

Status LoadLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_lib_mu);
  if (g_lib.handle && (path.empty() || path == g_lib.path)) return Status::Ok();
  const std::string file = path.empty() ? kDefaultLibrary : path;
  if (g_lib.handle) {
    std::lock_guard<std::mutex> dev(g_dev_mu);
    if (g_dev_users > 0) {
      return DTENJAX_ERROR(Code::kInvalidArgument,
                           "the verbs library " + g_lib.path + " is in use (" +
                               std::to_string(g_dev_users) + " connections or registrations); "
                               "cannot switch to " + file + " (DTENJAX_IBVERBS_LIBRARY) before "
                               "they are closed");
    }
  }
  Lib lib;
  Status s = TryLoad(file, &lib);
  if (!s.ok()) {
    if (!g_lib.handle) g_lib_error = s.message();
    return s;
  }
  // The previous library stays mapped (never dlclose'd): nothing of it is in use any more, but
  // an emulated device may still have a thread winding down in it.
  g_lib = lib;
  g_lib_error.clear();
  return Status::Ok();
}

LibraryInfo Library() {
  std::lock_guard<std::mutex> lock(g_lib_mu);
  LibraryInfo i;
  i.loaded = g_lib.handle != nullptr;
  i.path = i.loaded ? g_lib.path : "";
  i.emulated = g_lib.emulated;
  i.error = i.loaded ? "" : g_lib_error;
  return i;
}

// The function table, loading the default library first if none is loaded.
Status Functions(Lib* out) {
  DTENJAX_RETURN_IF_ERROR(LoadLibrary(""));
  std::lock_guard<std::mutex> lock(g_lib_mu);
  *out = g_lib;
  return Status::Ok();
}

Status CountDevices(int* n) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  int num = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (list) lib.free_device_list(list);
  *n = list ? num : 0;
  if (*n == 0) {
    return DTENJAX_ERROR(Code::kUnavailable, lib.path + " found no RDMA device");
  }
  return Status::Ok();
}

// The ibv_gid_type of a GID table entry, -1 when the library cannot say.
int GidType(const Lib& lib, ibv_context* ctx, int port, int index) {
  if (!lib.query_gid_ex) return -1;
  ibv_gid_entry e{};
  if (lib.query_gid_ex(ctx, uint32_t(port), uint32_t(index), &e, 0, sizeof(e)) != 0) return -1;
  return int(e.gid_type);
}

Status ListPorts(std::vector<PortInfo>* out) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  out->clear();
  int num = 0;
  errno = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (!list) {  // rdma-core answers NULL (ENOSYS, ...) where the kernel has no RDMA support
    return DTENJAX_ERROR(Code::kUnavailable, lib.path + " lists no RDMA device (ibv_get_device_list: " +
                                                 std::strerror(errno) + ")");
  }
  for (int i = 0; i < num; ++i) {
    const std::string name = lib.get_device_name(list[i]);
    ibv_context* ctx = lib.open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr da{};
    if (lib.query_device(ctx, &da) == 0) {
      for (int port = 1; port <= int(da.phys_port_cnt); ++port) {
        ibv_port_attr pa{};
        if (lib.query_port(ctx, uint8_t(port), &pa) != 0) continue;
        PortInfo p;
        p.device = name;
        p.port = port;
        p.state = pa.state;
        p.link_layer = pa.link_layer;
        p.lid = pa.lid;
        p.active_mtu = pa.active_mtu;
        p.active_speed = pa.active_speed;
        p.active_width = pa.active_width;
        for (int g = 0; g < pa.gid_tbl_len && g < 32; ++g) {
          ibv_gid gid;
          if (lib.query_gid(ctx, uint8_t(port), g, &gid) != 0) break;
          std::array<uint8_t, 16> raw;
          std::memcpy(raw.data(), gid.raw, 16);
          p.gids.push_back(raw);
          p.gid_types.push_back(GidType(lib, ctx, port, g));
        }
        out->push_back(std::move(p));
      }
    }
    lib.close_device(ctx);
  }
  lib.free_device_list(list);
  return Status::Ok();
}

}  // namespace verbs

namespace {

using namespace verbs;  // NOLINT

constexpr size_t kSlab = 4 << 20;  // bytes of one frame slab per direction
constexpr int kRecvDepth = 16;     // receives kept posted (one credit's worth is ever used)
constexpr int kSendDepth = 64;
constexpr int kCqDepth = 2 * (kRecvDepth + kSendDepth);  // every WR's completion fits
enum WrId : uint64_t { kWrRecv = 1, kWrWrite = 2, kWrCredit = 3 };

// One opened device shared by all connections of the process, open while it has users.
struct Device {
  Lib lib;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  int port = 1;
  ibv_port_attr port_attr{};
  int gid_index = 0;
  ibv_gid gid{};
  bool ethernet = false;
};

Device* g_dev = nullptr;
std::string g_want_device;  // set by SetDeviceName (DTENJAX_IB_DEVICE, read in Python)

// Opens the device (first user) or takes another reference to it.
Status AcquireDevice(Device** out) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  std::lock_guard<std::mutex> lock(g_dev_mu);
  if (g_dev) {
    ++g_dev_users;
    *out = g_dev;
    return Status::Ok();
  }
  int num = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (!list || num == 0) {
    if (list) lib.free_device_list(list);
    return DTENJAX_ERROR(Code::kUnavailable, "no RDMA device (" + lib.path + " lists none); use "
                                             "the TCP provider");
  }
  auto dev = std::make_unique<Device>();
  dev->lib = lib;
  for (int i = 0; i < num && !dev->ctx; ++i) {
    if (!g_want_device.empty() && g_want_device != lib.get_device_name(list[i])) continue;
    ibv_context* ctx = lib.open_device(list[i]);
    if (!ctx) continue;
    if (lib.query_port(ctx, 1, &dev->port_attr) == 0 && dev->port_attr.state == IBV_PORT_ACTIVE) {
      dev->ctx = ctx;
    } else {
      lib.close_device(ctx);
    }
  }
  lib.free_device_list(list);
  if (!dev->ctx) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "no RDMA device with an active port 1" +
                             (g_want_device.empty() ? std::string() : " named " + g_want_device));
  }
  dev->ethernet = dev->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  std::vector<GidEntry> gids;
  for (int i = 0; i < dev->port_attr.gid_tbl_len && i < 32; ++i) {
    ibv_gid g;
    if (lib.query_gid(dev->ctx, 1, i, &g) != 0) break;
    GidEntry e;
    std::memcpy(e.raw, g.raw, 16);
    // The type from ibv_query_gid_ex where the library has it; else treat IPv4-mapped GIDs as
    // RoCE v2 candidates (a guess: a v1 GID can hold an IPv4-mapped address too).
    const int type = GidType(lib, dev->ctx, 1, i);
    e.type = type >= 0 ? (type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0) : (IsV4Mapped(g.raw) ? 1 : 0);
    gids.push_back(e);
  }
  dev->gid_index = SelectGidIndex(gids.data(), int(gids.size()), dev->ethernet);
  if (dev->gid_index < 0) {
    lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "RDMA port has no usable GID");
  }
  std::memcpy(dev->gid.raw, gids[dev->gid_index].raw, 16);
  dev->pd = lib.alloc_pd(dev->ctx);
  if (!dev->pd) {
    lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "ibv_alloc_pd failed");
  }
  g_dev = dev.release();
  g_dev_users = 1;
  *out = g_dev;
  return Status::Ok();
}

// Drops a reference; the last one deallocates the PD and closes the device.
void ReleaseDevice() {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  if (!g_dev || --g_dev_users > 0) return;
  g_dev->lib.dealloc_pd(g_dev->pd);
  g_dev->lib.close_device(g_dev->ctx);
  delete g_dev;
  g_dev = nullptr;
}

struct QpInfo {
  uint32_t qpn, psn;
  uint16_t lid, pad;
  uint8_t gid[16];
  uint32_t rkey;
  uint64_t addr;
};

struct VerbsConn {
  Conn* side = nullptr;  // authenticated TCP side channel (set-up; the peer's liveness after it)
  Device* dev = nullptr;
  ibv_comp_channel* channel = nullptr;
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
  InFrame side_in;          // reads of the side channel: only its end is expected
};

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

const Provider* VerbsProvider();

// The peer's process is alive while its TCP side channel is open; a dead one closed it.
Status SideAlive(VerbsConn* v, const std::string& peer) {
  bool progress = false;
  Status s = TcpProvider()->recv_some(v->side, &v->side_in, &progress);
  if (!s.ok()) {
    Counters().peer_failures.fetch_add(1);
    return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: lost " + peer +
                                                 ": its TCP set-up connection closed (that process "
                                                 "died, aborted the collective or closed its "
                                                 "communicator)");
  }
  if (v->side_in.stage != InFrame::kHead || v->side_in.got) {
    Counters().rejected_bad_header.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: " + peer + " sent bytes on the RDMA "
                                              "connection's set-up channel after set-up");
  }
  return Status::Ok();
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

Status WcFailed(const ibv_wc& wc, const std::string& peer) {
  Counters().peer_failures.fetch_add(1);
  const char* what = wc.wr_id == kWrWrite    ? "the RDMA write of a frame to"
                     : wc.wr_id == kWrCredit ? "a credit message to"
                                             : "a receive from";
  return DTENJAX_ERROR(Code::kUnavailable,
                       std::string("dtenjax transport: ") + what + " " + peer + " failed: " +
                           WcStatusName(int(wc.status)) + " (" + WcStatusMeaning(int(wc.status)) +
                           ")");
}

// Polls the completion queue empty, updating the connection's state.
Status Drain(VerbsConn* v, const std::string& peer, bool* changed = nullptr) {
  ibv_wc wc[8];
  while (true) {
    int n = ibv_poll_cq(v->cq, 8, wc);
    if (n < 0) {
      Counters().peer_failures.fetch_add(1);
      return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: ibv_poll_cq failed on the "
                                               "completion queue of the RDMA connection to " +
                                                   peer + " (the CQ overran or the device failed; "
                                                   "it cannot be used any more)");
    }
    if (n == 0) return Status::Ok();
    if (changed) *changed = true;
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) return WcFailed(wc[i], peer);
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

Status VerbsSendSome(Conn* c, OutFrame* f, bool* progress) {
  auto* v = static_cast<VerbsConn*>(c->impl);
  *progress = false;
  DTENJAX_RETURN_IF_ERROR(Drain(v, c->peer));
  if (f->done()) return Status::Ok();
  if (!v->write_posted) {
    if (v->credits <= 0) return SideAlive(v, c->peer);
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
  if (v->arrived < 0) return SideAlive(v, c->peer);
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

const Provider* VerbsProvider() { return &kVerbs; }

// --- buffer-pool registration -------------------------------------------------------------------
Status PoolReg(void*, void* ptr, uint64_t bytes, uint64_t* handle) {
  Device* d = nullptr;
  DTENJAX_RETURN_IF_ERROR(AcquireDevice(&d));
  ibv_mr* mr = d->lib.reg_mr(d->pd, ptr, size_t(bytes),
                             IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
                                 IBV_ACCESS_REMOTE_READ);
  if (!mr) {
    const int e = errno;
    ReleaseDevice();
    // ENOMEM (and EAGAIN): the device or the pinned-memory limit is out of room, which freeing
    // other regions can cure; anything else (EINVAL, EFAULT, EACCES) is a fault of the request.
    const bool room = e == ENOMEM || e == EAGAIN;
    return DTENJAX_ERROR(room ? Code::kResourceExhausted : Code::kInternal,
                         "ibv_reg_mr of " + std::to_string(bytes) + " bytes failed: " +
                             std::strerror(e) + (room ? "" : " (not a shortage of room)"));
  }
  *handle = reinterpret_cast<uint64_t>(mr);
  return Status::Ok();
}

void PoolDereg(void*, uint64_t handle) {
  int (*dereg)(ibv_mr*) = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_dev_mu);
    if (g_dev) dereg = g_dev->lib.dereg_mr;  // open: this registration holds a reference
  }
  if (dereg && handle) dereg(reinterpret_cast<ibv_mr*>(handle));
  ReleaseDevice();
}

}  // namespace

void verbs::SetDeviceName(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  g_want_device = name;
}

int verbs::DeviceUsers() {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  return g_dev_users;
}

RegisterHooks verbs::PoolHooks() {
  RegisterHooks h;
  h.reg = PoolReg;
  h.dereg = PoolDereg;
  return h;
}

DTENJAX_REGISTER_PROVIDER(verbs, VerbsProvider);

}  // namespace dtenjax::transport
