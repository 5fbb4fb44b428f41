// RDMA verbs provider: what the rest of the transport and the Python bindings see of it. The
// device-free logic (transitions, masks, GID choice, validation, imm encoding) is unit-tested on
// any machine; the data path runs in the test suite on an emulated device (tests/fakeverbs/) that
// the provider loads in place of libibverbs (LoadLibrary). The provider itself is in verbs_*.cc
// (verbs_impl.h says which file holds what).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "csrc/common/status.h"
#include "csrc/transport/bufferpool.h"

namespace dtenjax::transport::verbs {

// ibv_qp_state values.
enum QpState : int { kReset = 0, kInit = 1, kRtr = 2, kRts = 3, kSqd = 4, kSqe = 5, kErr = 6 };

// Whether an RC QP may go from `from` to `to` (RESET->INIT->RTR->RTS, anything->ERR/RESET).
Status CheckTransition(int from, int to);
// The ibv_qp_attr_mask an RC QP needs for the transition into `to` (0 if none is defined).
int TransitionMask(int to);

struct GidEntry {
  uint8_t raw[16];
  int type;  // 0: IB / RoCE v1, 1: RoCE v2
};
// IB -> 0; RoCE -> first RoCE v2 GID holding an IPv4-mapped address, else first RoCE v2, else the
// first non-zero GID; -1 if none. Mirrors dtenjax/_src/net/rdma.py select_gid_index.
int SelectGidIndex(const GidEntry* gids, int n, bool ethernet);

// ibv_mtu enum from bytes (256..4096), -1 if not a valid MTU.
int MtuEnum(int bytes);

struct QpParams {
  int port = 1;
  int gid_index = 0;
  int gid_table_len = 1;
  bool ethernet = false;
  int mtu_bytes = 4096;
  uint32_t max_send_wr = 64, max_recv_wr = 64, device_max_wr = 16384;
  // rnr_retry is finite (7 would retry forever): the credit protocol keeps a receive posted for
  // every message, so an RNR NAK means the peer broke it, and that must end in an error.
  int timeout = 14, retry_cnt = 7, rnr_retry = 6, min_rnr_timer = 12;
  uint32_t psn = 0, dest_qpn = 1;
  uint16_t dlid = 0;
};
// Every out-of-range field, listed at once.
Status ValidateQpParams(const QpParams& p);

// Immediate data of a RDMA WRITE WITH IMM: the payload length of this piece (<= 2^31) with the
// top bit marking the last piece of a frame.
uint32_t EncodeImm(uint32_t bytes, bool last);
void DecodeImm(uint32_t imm, uint32_t* bytes, bool* last);

// ibv_wc_status name ("IBV_WC_REM_ACCESS_ERR") and what it means for this transport.
const char* WcStatusName(int status);
const char* WcStatusMeaning(int status);

// Loads the verbs library with dlopen: `path` (DTENJAX_IBVERBS_LIBRARY, read by the Python side),
// or "" for the one already loaded, else libibverbs.so.1. Another file may replace the loaded one
// only while no device is open (a test process switching to the emulated device and back).
Status LoadLibrary(const std::string& path = "");
struct LibraryInfo {
  bool loaded = false;
  std::string path;      // the file loaded (or last tried)
  bool emulated = false; // it exports fakeverbs_is_emulated: dtenjax's test device, not a NIC
  std::string error;     // why it is not loaded
};
LibraryInfo Library();

// Every port of every device the loaded library lists (opens and closes each device).
struct PortInfo {
  std::string device;
  int port = 1;
  int state = 0, link_layer = 0, lid = 0, active_mtu = 0, active_speed = 0, active_width = 0;
  std::vector<std::array<uint8_t, 16>> gids;
  std::vector<int> gid_types;  // ibv_gid_type (IB 0, RoCE v1 1, RoCE v2 2), -1: not reported
};
Status ListPorts(std::vector<PortInfo>* out);

// Number of RDMA devices, or an error (library missing, no device).
Status CountDevices(int* n);
// The device the provider opens (DTENJAX_IB_DEVICE, read by the Python side); "" = first active.
void SetDeviceName(const std::string& name);
// Users of the opened device (connections, listeners, registered buffers); 0: it is closed.
int DeviceUsers();

// Buffer-pool registration through ibv_reg_mr/ibv_dereg_mr on the opened device (each
// registration holds the device open until it is deregistered).
RegisterHooks PoolHooks();

}  // namespace dtenjax::transport::verbs
