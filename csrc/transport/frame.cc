// The frames of the host transport (frame.h): names, header checks, session keys, sealing and
// opening, REJECT frames, the counters.
#include "csrc/transport/frame.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace dtenjax::transport {

const char* FrameTypeName(uint16_t type) {
  switch (static_cast<FrameType>(type)) {
    case FrameType::kHello: return "HELLO";
    case FrameType::kChallenge: return "CHALLENGE";
    case FrameType::kResponse: return "RESPONSE";
    case FrameType::kAccept: return "ACCEPT";
    case FrameType::kData: return "DATA";
    case FrameType::kAbort: return "ABORT";
    case FrameType::kControl: return "CONTROL";
    case FrameType::kFingerprint: return "FINGERPRINT";
    case FrameType::kReject: return "REJECT";
  }
  return "unknown";
}

size_t DTypeSize(DType dt) {
  switch (dt) {
#define DTENJAX_DTYPE_SIZE(id, value, name, bytes, ...) \
  case DType::id: return bytes;
    DTENJAX_TRANSPORT_DTYPES(DTENJAX_DTYPE_SIZE)
#undef DTENJAX_DTYPE_SIZE
  }
  return 0;
}

#define DTENJAX_VALUE_NAME(id, value, name, ...) \
  case value: return name;

const char* DTypeName(int code) {
  switch (code) { DTENJAX_TRANSPORT_DTYPES(DTENJAX_VALUE_NAME) }
  return "unknown-dtype";
}

const char* ReduceOpName(int code) {
  switch (code) { DTENJAX_TRANSPORT_OPS(DTENJAX_VALUE_NAME) }
  return "unknown-op";
}
#undef DTENJAX_VALUE_NAME

bool SameCollective(const Descriptor& a, const Descriptor& b) {
  return a.coll_seq == b.coll_seq && a.count == b.count && a.site == b.site && a.tag == b.tag &&
         a.op == b.op && a.dtype == b.dtype;
}

Descriptor DescriptorOf(const FrameHeader& h) {
  Descriptor d;
  d.coll_seq = h.coll_seq;
  d.count = h.count;
  d.site = h.site;
  d.tag = h.tag;
  d.op = h.op;
  d.dtype = h.dtype;
  d.step = h.step;
  return d;
}

std::string Describe(const Descriptor& d) {
  if (d.coll_seq == 0) return "the ring set-up check";
  char fp[24];
  std::snprintf(fp, sizeof(fp), "0x%016llx", static_cast<unsigned long long>(DigestOf(d)));
  return "all_reduce #" + std::to_string(d.coll_seq) + " (op=" + ReduceOpName(d.op) +
         ", dtype=" + DTypeName(d.dtype) + ", count=" + std::to_string(d.count) +
         ", fingerprint " + fp + ")";
}

namespace {

void PutLe(std::vector<uint8_t>* m, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) m->push_back(uint8_t(v >> (8 * i)));
}

constexpr uint32_t kHeadLabel = 1, kBodyLabel = 2;

Status Reject(std::atomic<uint64_t>& counter, Code code, const std::string& peer,
              const std::string& what) {
  counter.fetch_add(1);
  return DTENJAX_ERROR(code, "dtenjax transport: rejected frame from " + peer + ": " + what);
}

}  // namespace

Status CheckMagicAndVersion(const FrameHeader& h, const std::string& peer) {
  auto& c = Counters();
  if (h.magic != kFrameMagic) {
    char m[16];
    std::snprintf(m, sizeof(m), "0x%08x", h.magic);
    return Reject(c.rejected_bad_header, Code::kDataLoss, peer,
                  std::string("bad magic ") + m + " (not a dtenjax peer)");
  }
  if (h.version != kFrameVersion) {
    return Reject(c.rejected_bad_version, Code::kInvalidArgument, peer,
                  "it speaks transport protocol version " + std::to_string(h.version) +
                      ", this process version " + std::to_string(kFrameVersion) +
                      " (every process must run the same dtenjax release)");
  }
  return Status::Ok();
}

namespace {

// Checks shared by both kinds of frame; `sealed` frames must be one of the authenticated types.
// Magic and version come first: a peer of another version is named as such, whatever else differs.
Status CheckCommon(const FrameHeader& h, uint64_t job_id, int64_t src_rank, bool sealed,
                   const std::string& peer) {
  auto& c = Counters();
  DTENJAX_RETURN_IF_ERROR(CheckMagicAndVersion(h, peer));
  if (h.job_id != job_id) {
    return Reject(c.rejected_unknown_peer, Code::kPermissionDenied, peer,
                  "job id " + std::to_string(h.job_id) + " is not this job's (" +
                      std::to_string(job_id) + "): the two processes belong to different jobs "
                      "(process 0 of each job draws its id); connect processes of one job only");
  }
  if (src_rank >= 0 && int64_t(h.src_rank) != src_rank) {
    return Reject(c.rejected_unknown_peer, Code::kPermissionDenied, peer,
                  "sender rank " + std::to_string(h.src_rank) + ", expected " +
                      std::to_string(src_rank));
  }
  const bool is_sealed_type = h.type == uint16_t(FrameType::kAccept) ||
                              h.type == uint16_t(FrameType::kData) ||
                              h.type == uint16_t(FrameType::kAbort) ||
                              h.type == uint16_t(FrameType::kControl) ||
                              h.type == uint16_t(FrameType::kFingerprint);
  if (sealed != is_sealed_type) {
    return Reject(c.rejected_bad_header, Code::kDataLoss, peer,
                  std::string("unexpected frame type ") + std::to_string(h.type) + " (" +
                      FrameTypeName(h.type) + ") at this point of the protocol");
  }
  if (h.payload_bytes > kMaxFramePayload) {
    return Reject(c.rejected_oversized, Code::kDataLoss, peer,
                  "payload of " + std::to_string(h.payload_bytes) + " bytes exceeds the " +
                      std::to_string(kMaxFramePayload) + "-byte frame limit");
  }
  return Status::Ok();
}

}  // namespace

Status DeriveSession(const std::string& secret, uint64_t job_id, int client_rank, int server_rank,
                     const uint8_t nonce_c[32], const uint8_t nonce_s[32], bool is_client,
                     Session* out) {
  static const char kLabel[] = "dtenjax-v3-session-keys";
  std::vector<uint8_t> m(kLabel, kLabel + sizeof(kLabel) - 1);
  PutLe(&m, job_id, 8);
  PutLe(&m, uint32_t(client_rank), 4);
  PutLe(&m, uint32_t(server_rank), 4);
  m.insert(m.end(), nonce_c, nonce_c + 32);
  m.insert(m.end(), nonce_s, nonce_s + 32);
  uint8_t master[32], c2s[32], s2c[32];
  DTENJAX_RETURN_IF_ERROR(crypto::HmacSha256(secret.data(), secret.size(), m.data(), m.size(), master));
  static const char kC2s[] = "client->server", kS2c[] = "server->client";
  DTENJAX_RETURN_IF_ERROR(crypto::HmacSha256(master, 32, kC2s, sizeof(kC2s) - 1, c2s));
  DTENJAX_RETURN_IF_ERROR(crypto::HmacSha256(master, 32, kS2c, sizeof(kS2c) - 1, s2c));
  DTENJAX_RETURN_IF_ERROR(out->send_mac.Init(is_client ? c2s : s2c));
  DTENJAX_RETURN_IF_ERROR(out->recv_mac.Init(is_client ? s2c : c2s));
  out->send_seq = 0;
  out->recv_seq = 0;
  std::memset(master, 0, sizeof(master));
  std::memset(c2s, 0, sizeof(c2s));
  std::memset(s2c, 0, sizeof(s2c));
  return Status::Ok();
}

FrameHeader MakePlainHeader(FrameType type, uint64_t job_id, uint32_t src_rank,
                            uint64_t payload_bytes) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kFrameVersion;
  h.type = static_cast<uint16_t>(type);
  h.job_id = job_id;
  h.payload_bytes = payload_bytes;
  h.src_rank = src_rank;
  return h;
}

std::string MakeReject(uint64_t job_id, uint32_t src_rank, RejectClass cls, const Status& why) {
  std::string text = why.message();
  const std::string prefix = "dtenjax transport: ";
  if (text.compare(0, prefix.size(), prefix) == 0) text = text.substr(prefix.size());
  text = text.substr(0, kMaxRejectText - 2);
  FrameHeader h = MakePlainHeader(FrameType::kReject, job_id, src_rank, 2 + text.size());
  std::string out(reinterpret_cast<const char*>(&h), sizeof(h));
  out.push_back(char(static_cast<uint8_t>(cls)));
  out.push_back(char(static_cast<int>(why.code())));
  return out + text;
}

Status CheckPlainHeader(const FrameHeader& h, const FrameExpect& want, const std::string& peer) {
  DTENJAX_RETURN_IF_ERROR(CheckCommon(h, want.job_id, want.src_rank, false, peer));
  auto& c = Counters();
  if (h.type != static_cast<uint16_t>(want.type)) {
    return Reject(c.rejected_bad_header, Code::kDataLoss, peer,
                  std::string("frame type ") + FrameTypeName(h.type) + ", expected " +
                      FrameTypeName(uint16_t(want.type)));
  }
  if (h.payload_bytes != want.payload_bytes) {
    return Reject(c.rejected_oversized, Code::kDataLoss, peer,
                  "payload of " + std::to_string(h.payload_bytes) + " bytes, expected " +
                      std::to_string(want.payload_bytes));
  }
  return Status::Ok();
}

Status Seal(Session& s, FrameType type, uint64_t job_id, uint32_t src_rank, const Descriptor& d,
            const void* payload, uint64_t payload_bytes, OutFrame* f) {
  FrameHeader h{};
  h.magic = kFrameMagic;
  h.version = kFrameVersion;
  h.type = static_cast<uint16_t>(type);
  h.job_id = job_id;
  h.seq = s.send_seq;
  h.payload_bytes = payload_bytes;
  h.src_rank = src_rank;
  h.site = d.site;
  h.coll_seq = d.coll_seq;
  h.count = d.count;
  h.op = d.op;
  h.dtype = d.dtype;
  h.step = d.step;
  h.tag = d.tag;
  std::memcpy(f->head, &h, sizeof(h));
  DTENJAX_RETURN_IF_ERROR(
      s.send_mac.Tag(h.seq, kHeadLabel, &h, sizeof(h), nullptr, 0, f->head + sizeof(h)));
  DTENJAX_RETURN_IF_ERROR(
      s.send_mac.Tag(h.seq, kBodyLabel, &h, sizeof(h), payload, payload_bytes, f->ptag));
  ++s.send_seq;
  f->payload = static_cast<const uint8_t*>(payload);
  f->payload_bytes = payload_bytes;
  f->sent = 0;
  f->active = true;
  return Status::Ok();
}

Status OpenHead(Session& s, const InFrame& f, uint64_t job_id, int64_t src_rank,
                const std::string& peer) {
  const FrameHeader& h = f.header();
  DTENJAX_RETURN_IF_ERROR(CheckCommon(h, job_id, src_rank, true, peer));
  auto& c = Counters();
  uint8_t want[kTagBytes];
  DTENJAX_RETURN_IF_ERROR(s.recv_mac.Tag(h.seq, kHeadLabel, &h, sizeof(h), nullptr, 0, want));
  if (!crypto::Equal(want, f.head + sizeof(h), kTagBytes)) {
    return Reject(c.rejected_mac, Code::kPermissionDenied, peer,
                  "header authentication failed (the frame was modified in transit or does not "
                  "come from the authenticated peer)");
  }
  if (h.seq < s.recv_seq) {
    return Reject(c.rejected_replay, Code::kPermissionDenied, peer,
                  "replayed frame: counter " + std::to_string(h.seq) + " was already received "
                  "(next expected " + std::to_string(s.recv_seq) + ")");
  }
  if (h.seq > s.recv_seq) {
    return Reject(c.rejected_out_of_order, Code::kPermissionDenied, peer,
                  "frame counter " + std::to_string(h.seq) + ", expected " +
                      std::to_string(s.recv_seq) + " (frames were dropped or reordered in transit)");
  }
  return Status::Ok();
}

Status OpenBody(Session& s, const InFrame& f, const std::string& peer) {
  const FrameHeader& h = f.header();
  uint8_t want[kTagBytes];
  DTENJAX_RETURN_IF_ERROR(
      s.recv_mac.Tag(h.seq, kBodyLabel, &h, sizeof(h), f.dst, f.payload_bytes, want));
  if (!crypto::Equal(want, f.ptag, kTagBytes)) {
    return Reject(Counters().rejected_mac, Code::kPermissionDenied, peer,
                  "payload authentication failed for frame " + std::to_string(h.seq) + " (" +
                      std::to_string(h.payload_bytes) + " bytes modified in transit: corrupted "
                      "or tampered)");
  }
  ++s.recv_seq;
  return Status::Ok();
}

TransportCounters& Counters() {
  static TransportCounters counters;
  return counters;
}

namespace {
thread_local bool t_peer_failures_quiet = false;
}  // namespace

void CountPeerFailure() {
  if (!t_peer_failures_quiet) Counters().peer_failures.fetch_add(1);
}

PeerFailuresQuiet::PeerFailuresQuiet() : was_(t_peer_failures_quiet) {
  t_peer_failures_quiet = true;
}

PeerFailuresQuiet::~PeerFailuresQuiet() { t_peer_failures_quiet = was_; }

const char* const kCounterNames[] = {
    "frames_sent", "frames_received", "bytes_sent", "bytes_received",
    "connections_opened", "connections_accepted", "rejected_bad_header", "rejected_bad_version",
    "rejected_oversized", "rejected_auth", "rejected_unknown_peer", "rejected_out_of_order",
    "rejected_mac", "rejected_replay", "rejected_mismatch", "aborts_sent", "aborts_received",
    "handshakes_evicted", "handshakes_timed_out", "handshakes_refused", "connect_retries",
    "rejects_received", "timeouts", "peer_failures", "collectives",
    "throttled_ns", "waits", "ops_in_flight", "queue_depth", "handshakes_pending"};

void TransportCountersSnapshot(uint64_t* out) {
  auto& c = Counters();
  const std::atomic<uint64_t>* all[] = {
      &c.frames_sent, &c.frames_received, &c.bytes_sent, &c.bytes_received,
      &c.connections_opened, &c.connections_accepted, &c.rejected_bad_header,
      &c.rejected_bad_version, &c.rejected_oversized, &c.rejected_auth,
      &c.rejected_unknown_peer, &c.rejected_out_of_order, &c.rejected_mac, &c.rejected_replay,
      &c.rejected_mismatch, &c.aborts_sent, &c.aborts_received, &c.handshakes_evicted,
      &c.handshakes_timed_out, &c.handshakes_refused, &c.connect_retries, &c.rejects_received,
      &c.timeouts, &c.peer_failures, &c.collectives, &c.throttled_ns, &c.waits,
      &c.ops_in_flight, &c.queue_depth, &c.handshakes_pending};
  static_assert(sizeof(all) / sizeof(all[0]) == kNumCounters, "counter table size");
  static_assert(sizeof(kCounterNames) / sizeof(kCounterNames[0]) == kNumCounters,
                "counter name table size");
  for (int i = 0; i < kNumCounters; ++i) out[i] = all[i]->load();
}

}  // namespace dtenjax::transport
