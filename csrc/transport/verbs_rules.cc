// RDMA verbs provider, the device-free rules (verbs.h): which RC QP state transitions are legal
// and the attribute mask of each, the GID a RoCE or InfiniBand port is addressed by, MTUs, the
// QP parameters' ranges, the immediate data of a frame's RDMA WRITE, and what a completion
// status means. Only <infiniband/verbs.h>'s constants are used: unit-tested on any machine.
#include "csrc/transport/verbs.h"

#include <infiniband/verbs.h>

#include <string>

#include "csrc/transport/verbs_impl.h"

namespace dtenjax::transport::verbs {

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

namespace {

bool IsZero(const uint8_t* g) {
  for (int i = 0; i < 16; ++i) if (g[i]) return false;
  return true;
}

}  // namespace

bool IsV4Mapped(const uint8_t* g) {
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

}  // namespace dtenjax::transport::verbs
