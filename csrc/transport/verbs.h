// RDMA verbs provider: device-free logic, exposed so it is unit-tested on machines without an
// RDMA device (tests/test_rdma.py through the Python bindings). The provider itself is in verbs.cc.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/common/status.h"

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
  int timeout = 14, retry_cnt = 7, rnr_retry = 7, min_rnr_timer = 12;
  uint32_t psn = 0, dest_qpn = 1;
  uint16_t dlid = 0;
};
// Every out-of-range field, listed at once.
Status ValidateQpParams(const QpParams& p);

// Immediate data of a RDMA WRITE WITH IMM: the payload length of this piece (<= 2^31) with the
// top bit marking the last piece of a frame.
uint32_t EncodeImm(uint32_t bytes, bool last);
void DecodeImm(uint32_t imm, uint32_t* bytes, bool* last);

// Loads libibverbs with dlopen (once); returns why not when it cannot.
Status LoadLibrary();
// Number of RDMA devices, or an error (library missing, no device).
Status CountDevices(int* n);
// The device the provider opens (DTENJAX_IB_DEVICE, read by the Python side); "" = first active.
void SetDeviceName(const std::string& name);

}  // namespace dtenjax::transport::verbs
