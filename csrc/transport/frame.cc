#include "csrc/transport/frame.h"

#include <cstring>

namespace dtenjax::transport {

uint64_t Checksum64(const void* data, size_t n) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint64_t a = 1, b = 0, c = 0, d = 0;
  size_t i = 0;
  // Two independent lanes so the adds pipeline.
  for (; i + 8 <= n; i += 8) {
    uint32_t w0, w1;
    std::memcpy(&w0, p + i, 4);
    std::memcpy(&w1, p + i + 4, 4);
    a += w0; b += a;
    c += w1; d += c;
  }
  for (; i < n; ++i) { a += p[i]; b += a; }
  uint64_t x = (b << 32) ^ a ^ (d * 0x9E3779B97F4A7C15ull) ^ (c << 17) ^ uint64_t(n);
  return x;
}

FrameHeader MakeHeader(FrameType type, uint64_t job_id, uint64_t seq, uint32_t src_rank,
                       const void* payload, uint64_t payload_bytes) {
  FrameHeader h;
  h.magic = kFrameMagic;
  h.version = kFrameVersion;
  h.type = static_cast<uint16_t>(type);
  h.job_id = job_id;
  h.seq = seq;
  h.payload_bytes = payload_bytes;
  h.payload_checksum = payload_bytes ? Checksum64(payload, payload_bytes) : 0;
  h.src_rank = src_rank;
  h.header_checksum = uint32_t(Checksum64(&h, offsetof(FrameHeader, header_checksum)));
  return h;
}

Status CheckHeader(const FrameHeader& h, const FrameExpect& want, const std::string& peer) {
  auto& c = Counters();
  auto bad = [&](std::atomic<uint64_t>& counter, Code code, const std::string& what) {
    counter.fetch_add(1);
    return DTENJAX_ERROR(code, "dtenjax transport: rejected frame from " + peer + ": " + what);
  };
  if (h.magic != kFrameMagic) {
    return bad(c.rejected_bad_header, Code::kDataLoss,
               "bad magic 0x" + std::to_string(h.magic) + " (not a dtenjax peer)");
  }
  if (h.header_checksum != uint32_t(Checksum64(&h, offsetof(FrameHeader, header_checksum)))) {
    return bad(c.rejected_bad_checksum, Code::kDataLoss, "header checksum mismatch (corrupt header)");
  }
  if (h.version != kFrameVersion) {
    return bad(c.rejected_bad_header, Code::kDataLoss,
               "protocol version " + std::to_string(h.version) + ", expected " +
                   std::to_string(kFrameVersion) + " (all processes must run the same dtenjax)");
  }
  if (h.job_id != want.job_id) {
    return bad(c.rejected_unknown_peer, Code::kPermissionDenied,
               "job id " + std::to_string(h.job_id) + " is not this job's (" +
                   std::to_string(want.job_id) + ")");
  }
  if (h.type != static_cast<uint16_t>(want.type)) {
    return bad(c.rejected_bad_header, Code::kDataLoss,
               "frame type " + std::to_string(h.type) + ", expected " +
                   std::to_string(static_cast<int>(want.type)));
  }
  if (want.src_rank >= 0 && int64_t(h.src_rank) != want.src_rank) {
    return bad(c.rejected_unknown_peer, Code::kPermissionDenied,
               "sender rank " + std::to_string(h.src_rank) + ", expected " +
                   std::to_string(want.src_rank));
  }
  if (h.seq != want.seq) {
    return bad(c.rejected_out_of_order, Code::kDataLoss,
               "sequence number " + std::to_string(h.seq) + ", expected " + std::to_string(want.seq) +
                   " (processes issued collectives in different orders)");
  }
  if (h.payload_bytes > kMaxFramePayload ||
      (want.exact_size ? h.payload_bytes > want.payload_bytes
                       : h.payload_bytes > want.payload_bytes)) {
    return bad(c.rejected_oversized, Code::kDataLoss,
               "payload of " + std::to_string(h.payload_bytes) + " bytes exceeds the " +
                   std::to_string(want.payload_bytes) + " expected");
  }
  if (want.exact_size && h.payload_bytes != want.payload_bytes) {
    return bad(c.rejected_bad_header, Code::kDataLoss,
               "payload of " + std::to_string(h.payload_bytes) + " bytes, expected exactly " +
                   std::to_string(want.payload_bytes) + " (shapes differ between processes)");
  }
  return Status::Ok();
}

Status CheckPayload(const FrameHeader& h, const void* payload, const std::string& peer) {
  uint64_t sum = h.payload_bytes ? Checksum64(payload, h.payload_bytes) : 0;
  if (sum != h.payload_checksum) {
    Counters().rejected_bad_checksum.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: rejected frame from " + peer +
                                              ": payload checksum mismatch (corrupt data, seq " +
                                              std::to_string(h.seq) + ")");
  }
  return Status::Ok();
}

TransportCounters& Counters() {
  static TransportCounters counters;
  return counters;
}

const char* const kCounterNames[] = {
    "frames_sent", "frames_received", "bytes_sent", "bytes_received",
    "connections_opened", "connections_accepted", "rejected_bad_header", "rejected_bad_checksum",
    "rejected_oversized", "rejected_auth", "rejected_unknown_peer", "rejected_out_of_order",
    "timeouts", "peer_failures", "collectives", "throttled_ns", "ops_in_flight", "queue_depth"};

void TransportCountersSnapshot(uint64_t* out) {
  auto& c = Counters();
  const std::atomic<uint64_t>* all[kNumCounters] = {
      &c.frames_sent, &c.frames_received, &c.bytes_sent, &c.bytes_received,
      &c.connections_opened, &c.connections_accepted, &c.rejected_bad_header,
      &c.rejected_bad_checksum, &c.rejected_oversized, &c.rejected_auth,
      &c.rejected_unknown_peer, &c.rejected_out_of_order, &c.timeouts, &c.peer_failures,
      &c.collectives, &c.throttled_ns, &c.ops_in_flight, &c.queue_depth};
  for (int i = 0; i < kNumCounters; ++i) out[i] = all[i]->load();
}

}  // namespace dtenjax::transport
