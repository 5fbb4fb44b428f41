// What the files of the verbs provider share, private to them (the rest of dtenjax sees verbs.h).
// The provider is five files, one idea each:
//   verbs_rules.cc     the device-free rules: QP transitions and masks, GID choice, MTUs, QP
//                      parameter checks, imm encoding, completion statuses (declared in verbs.h);
//   verbs_loader.cc    libibverbs loaded with dlopen, device discovery, and the one opened device;
//   verbs_provider.cc  the Provider record: connection set-up (the RC QP brought to RTS over an
//                      authenticated TCP connection), listen, connect, accept, close;
//   verbs_pump.cc      the data path: frames as RDMA WRITE WITH IMM, credits, completion waits;
//   verbs_pool.cc      the buffer pool's registration hooks (ibv_reg_mr / ibv_dereg_mr).
#pragma once

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/verbs.h"

namespace dtenjax::transport::verbs {

// --- verbs_rules.cc ------------------------------------------------------------------------------
bool IsV4Mapped(const uint8_t* gid);  // ::ffff:a.b.c.d

// --- verbs_loader.cc: libibverbs, loaded at run time, and the opened device ----------------------
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

// Opens the device (first user) or takes another reference to it.
Status AcquireDevice(Device** out);
// Drops a reference; the last one deallocates the PD and closes the device.
void ReleaseDevice();
// ibv_dereg_mr of the opened device; nullptr when no device is open.
using DeregMr = int (*)(ibv_mr*);
DeregMr OpenedDeregMr();

// --- verbs_provider.cc and verbs_pump.cc: one connection -----------------------------------------
constexpr size_t kSlab = 4 << 20;  // bytes of one frame slab per direction
constexpr int kRecvDepth = 16;     // receives kept posted (one credit's worth is ever used)
constexpr int kSendDepth = 64;
constexpr int kCqDepth = 2 * (kRecvDepth + kSendDepth);  // every WR's completion fits
enum WrId : uint64_t { kWrRecv = 1, kWrWrite = 2, kWrCredit = 3 };

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
  uint64_t write_seq = 0;     // that frame's counter (frame.h): only its write's completion sends it
  uint64_t write_bytes = 0;
  int64_t arrived = -1;     // bytes of a frame that arrived in recv_buf, -1 if none
  int state = kReset;
  InFrame side_in;          // reads of the side channel: only its end is expected
  // The first failed completion (or CQ failure), returned by every later poll: whichever caller
  // drains it (the ring's look backwards at a next rank may take a failed write's), the side
  // that owns the work still sees why it failed.
  Status failed;
};

const Provider* VerbsProvider();
Status PostRecv(VerbsConn* v);       // one receive (pump)
void ConsumeEvents(VerbsConn* v);    // acknowledges the channel's completion events (pump)
Status VerbsSendSome(Conn* c, OutFrame* f, bool* progress);  // pump
Status VerbsRecvSome(Conn* c, InFrame* f, bool* progress);   // pump
Status VerbsWait(const WaitItem* items, int n, double until);  // pump
void VerbsShutdown(Conn* c);                                  // pump

}  // namespace dtenjax::transport::verbs
