// Wire format of the host transport. Every message on a TCP connection is one frame: a fixed
// 48-byte little-endian header, then `payload_bytes` of payload. The header carries what a
// receiver needs to reject anything that is not the next expected message of this job: magic,
// version, frame type, job id, sequence number, payload size, payload checksum, sender rank and a
// checksum of the header itself. Rejections are counted (TransportCounters), never fatal.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"

namespace dtenjax::transport {

constexpr uint32_t kFrameMagic = 0x584A5444;  // "DTJX" little-endian
constexpr uint16_t kFrameVersion = 1;
// Hard ceiling on one frame's payload, whatever the receiver expects (1 GiB).
constexpr uint64_t kMaxFramePayload = uint64_t(1) << 30;

enum class FrameType : uint16_t {
  kHello = 1,      // client -> server: nonce_c
  kChallenge = 2,  // server -> client: nonce_s || HMAC(server proof)
  kResponse = 3,   // client -> server: HMAC(client proof)
  kAccept = 4,     // server -> client: empty; the connection is authenticated
  kData = 5,       // collective payload
};

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t job_id;
  uint64_t seq;
  uint64_t payload_bytes;
  uint64_t payload_checksum;
  uint32_t src_rank;
  uint32_t header_checksum;  // low 32 bits of Checksum64 over the 44 bytes before it
};
static_assert(sizeof(FrameHeader) == 48, "FrameHeader must be 48 bytes with no padding");

// Fletcher-style 64-bit checksum over 32-bit words (fast: one add pair per word). Detects
// corruption, not tampering; tampering is prevented by the authenticated connection set-up.
uint64_t Checksum64(const void* data, size_t n);

FrameHeader MakeHeader(FrameType type, uint64_t job_id, uint64_t seq, uint32_t src_rank,
                       const void* payload, uint64_t payload_bytes);

// What a receiver expects of the next frame.
struct FrameExpect {
  FrameType type;
  uint64_t job_id;
  uint64_t seq;
  int64_t src_rank;        // -1: any
  uint64_t payload_bytes;  // exact size expected (for kData) ...
  bool exact_size;         // ... or, if false, an upper bound
};

// Validates a received header (not the payload). Counts and describes every rejection.
Status CheckHeader(const FrameHeader& h, const FrameExpect& want, const std::string& peer);
// Validates a received payload against its header's checksum.
Status CheckPayload(const FrameHeader& h, const void* payload, const std::string& peer);

// Process-wide counters, readable from Python (transport.counters()).
struct TransportCounters {
  std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bytes_sent{0}, bytes_received{0};
  std::atomic<uint64_t> connections_opened{0}, connections_accepted{0};
  std::atomic<uint64_t> rejected_bad_header{0}, rejected_bad_checksum{0}, rejected_oversized{0};
  std::atomic<uint64_t> rejected_auth{0}, rejected_unknown_peer{0}, rejected_out_of_order{0};
  std::atomic<uint64_t> timeouts{0}, peer_failures{0}, collectives{0}, throttled_ns{0};
  // Gauges (current values, not totals) for the runtime agent's load report.
  std::atomic<uint64_t> ops_in_flight{0}, queue_depth{0};
};
TransportCounters& Counters();
// Names in the order TransportCountersSnapshot fills them.
extern const char* const kCounterNames[];
constexpr int kNumCounters = 18;
void TransportCountersSnapshot(uint64_t* out);

}  // namespace dtenjax::transport
