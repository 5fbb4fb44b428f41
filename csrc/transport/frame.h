// Wire format of the host transport (version 3; docs/transport.md has the byte layout).
//
// Every message is one frame: a fixed 64-byte little-endian header, then, for authenticated
// frames, a 16-byte header tag, the payload, and a 16-byte payload tag.
//
// * Handshake frames (HELLO, CHALLENGE, RESPONSE, REJECT) carry no tags: what matters in them
//   (job, ranks, nonces) is bound by the HMAC-SHA256 proofs of the handshake, and a corrupted
//   field fails a check or a proof. There is no unkeyed checksum: TCP already carries one, and
//   against an attacker only the keyed tags count (version 2 had a CRC32C; it was redundant).
// * A receiver checks the magic, then the protocol version, before anything else, so a peer of
//   another version is reported as such, whatever else differs.
// * Every frame after the handshake (ACCEPT, DATA, ABORT, CONTROL, FINGERPRINT) is authenticated with
//   AES-256-GMAC under a per-connection, per-direction key derived in the handshake. The nonce is
//   the frame counter `seq` of that direction, so a frame cannot be modified (header tag over the
//   header, payload tag over header || payload), replayed (its counter is not the next one) or
//   moved to another connection (other key) without being rejected and counted.
// * Every DATA and ABORT frame names the collective it belongs to: its number on the
//   communicator, op, dtype, element count, fingerprint digest and user tag (Descriptor). A
//   receiver compares it with its own and rejects a frame of a different collective, naming both
//   sides; before the first segment of a collective comes its full fingerprint (fingerprint.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/crypto.h"

namespace dtenjax::transport {

constexpr uint32_t kFrameMagic = 0x584A5444;  // "DTJX" little-endian
constexpr uint16_t kFrameVersion = 4;  // 4: FINGERPRINT frames (fingerprint.h) replace SITE
// Hard ceiling on one frame's payload, whatever the receiver expects (1 GiB).
constexpr uint64_t kMaxFramePayload = uint64_t(1) << 30;
// Longest text an ABORT frame may carry.
constexpr uint64_t kMaxAbortText = 4096;
// Longest call-site text a FINGERPRINT frame may carry (a user call stack).
constexpr uint64_t kMaxSiteText = 2048;
// Longest payload of a REJECT frame (class byte + text).
constexpr uint64_t kMaxRejectText = 1024;

enum class FrameType : uint16_t {
  kHello = 1,      // client -> server: nonce_c
  kChallenge = 2,  // server -> client: nonce_s || HMAC(server proof)
  kResponse = 3,   // client -> server: HMAC(client proof)
  kAccept = 4,     // server -> client, authenticated, empty: keys agree
  kData = 5,       // one segment of a collective
  kAbort = 6,      // text: why the sender gave up on the collective; forwarded around the ring
  kControl = 7,    // provider set-up data (verbs QP information)
  kFingerprint = 8,  // a collective's fingerprint (fingerprint.h), before its first segment
  kReject = 9,     // either side of a handshake, unauthenticated: why it closes (RejectClass + text)
};

// What the receiver of a REJECT frame should do.
enum class RejectClass : uint8_t {
  kRetry = 1,  // the listener is busy or the handshake took too long: connect again later
  kFatal = 2,  // the two sides disagree (version, job, rank, secret): retrying cannot help
};
const char* FrameTypeName(uint16_t type);

// Element types and reductions as they travel in frames (stable codes), defined once; Python
// reads them as dtenjax._ffi.vocabulary["transport.dtype"] / ["transport.op"].
// X(enumerator, value, name, bytes, xla): xla names the xla::ffi::DataType the FFI handlers map
// to it (only custom_calls/ expands that field).
#define DTENJAX_TRANSPORT_DTYPES(X)   \
  X(kF32, 0, "float32", 4, F32)       \
  X(kF64, 1, "float64", 8, F64)       \
  X(kS32, 2, "int32", 4, S32)         \
  X(kS64, 3, "int64", 8, S64)         \
  X(kBF16, 4, "bfloat16", 2, BF16)
// X(enumerator, value, name)
#define DTENJAX_TRANSPORT_OPS(X) \
  X(kSum, 0, "sum")              \
  X(kMax, 1, "max")              \
  X(kMin, 2, "min")              \
  X(kProd, 3, "prod")

enum class DType : int { DTENJAX_TRANSPORT_DTYPES(DTENJAX_ENUM_VALUE) };
enum class ReduceOp : int { DTENJAX_TRANSPORT_OPS(DTENJAX_ENUM_VALUE) };
size_t DTypeSize(DType dt);  // 0 for an unknown code
const char* DTypeName(int code);
const char* ReduceOpName(int code);
constexpr bool IsReduceOp(int64_t code) {
  switch (code) {
    DTENJAX_TRANSPORT_OPS(DTENJAX_ENUM_CASE) return true;
    default: return false;
  }
}

struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t job_id;
  uint64_t seq;            // frame counter of this direction (0 for handshake frames)
  uint64_t payload_bytes;
  uint32_t src_rank;
  uint32_t site;           // low 32 bits of the collective's fingerprint digest (fingerprint.h)
  uint64_t coll_seq;       // number of the collective on its communicator (1, 2, ...)
  uint64_t count;          // elements of the whole collective
  uint8_t op;              // ReduceOp
  uint8_t dtype;           // DType
  uint16_t step;           // ring step of this segment
  uint32_t tag;            // high 32 bits of the digest (the user's tag is inside the digest)
};
static_assert(sizeof(FrameHeader) == 64, "FrameHeader must be 64 bytes with no padding");
constexpr size_t kTagBytes = crypto::kTagBytes;
constexpr size_t kSealedHeadBytes = sizeof(FrameHeader) + kTagBytes;  // header + header tag

// Which collective a frame belongs to.
struct Descriptor {
  uint64_t coll_seq = 0;   // 0: the ring set-up check (ConnectRing), 1, 2, ...: collectives
  uint64_t count = 0;
  uint32_t site = 0;       // low 32 bits of the fingerprint digest (0 for the set-up check)
  uint32_t tag = 0;        // the user's tag until the digest is made, then its high 32 bits
  uint8_t op = 0;
  uint8_t dtype = 0;
  uint16_t step = 0;
};
bool SameCollective(const Descriptor& a, const Descriptor& b);  // all but `step`
Descriptor DescriptorOf(const FrameHeader& h);
// "all_reduce #3 (op=sum, dtype=float32, count=1000, tag=7, fingerprint 0x1234abcd)": what a
// header says; a rank describes its own collective in full (DescribeFingerprint).
std::string Describe(const Descriptor& d);
inline uint64_t DigestOf(const Descriptor& d) { return (uint64_t(d.tag) << 32) | d.site; }

// Per-connection authentication state, created by the handshake.
struct Session {
  crypto::Gmac send_mac, recv_mac;
  uint64_t send_seq = 0;  // counter of the next frame sent
  uint64_t recv_seq = 0;  // counter the next received frame must carry
};
// Derives both directions' keys from the job secret and the handshake transcript.
Status DeriveSession(const std::string& secret, uint64_t job_id, int client_rank, int server_rank,
                     const uint8_t nonce_c[32], const uint8_t nonce_s[32], bool is_client,
                     Session* out);

// --- handshake (unauthenticated) frames ---------------------------------------------------------
FrameHeader MakePlainHeader(FrameType type, uint64_t job_id, uint32_t src_rank,
                            uint64_t payload_bytes);
struct FrameExpect {
  FrameType type;
  uint64_t job_id;
  int64_t src_rank;        // -1: any
  uint64_t payload_bytes;  // exact size
};
// Validates a received handshake header (magic, then version, then the rest). Counts and
// describes every rejection; the message says which field differs and both values.
Status CheckPlainHeader(const FrameHeader& h, const FrameExpect& want, const std::string& peer);
// Magic and protocol version only: what must hold before any other field means anything.
Status CheckMagicAndVersion(const FrameHeader& h, const std::string& peer);
// A REJECT frame: header and payload (class byte, status code byte, text; at most
// kMaxRejectText bytes), built from the status that made the sender give up.
std::string MakeReject(uint64_t job_id, uint32_t src_rank, RejectClass cls, const Status& why);

// --- authenticated frames -----------------------------------------------------------------------
// An outgoing frame: header + header tag, payload (not copied), payload tag.
struct OutFrame {
  uint8_t head[kSealedHeadBytes];
  const uint8_t* payload = nullptr;
  uint64_t payload_bytes = 0;
  uint8_t ptag[kTagBytes];
  uint64_t sent = 0;  // bytes handed to the transport so far
  bool active = false;
  uint64_t total() const { return kSealedHeadBytes + payload_bytes + kTagBytes; }
  bool done() const { return sent == total(); }
};
// Fills and tags `f` as the next frame of `s` (consumes one send counter).
Status Seal(Session& s, FrameType type, uint64_t job_id, uint32_t src_rank, const Descriptor& d,
            const void* payload, uint64_t payload_bytes, OutFrame* f);

// An incoming frame, received in stages by a provider: the head first (kHeadReady: the caller
// checks it with OpenHead and chooses where the payload goes), then payload and tag (kDone).
struct InFrame {
  enum Stage { kHead = 0, kHeadReady = 1, kBody = 2, kDone = 3 };
  Stage stage = kHead;
  uint8_t head[kSealedHeadBytes];
  uint8_t* dst = nullptr;
  uint64_t payload_bytes = 0;
  uint8_t ptag[kTagBytes];
  uint64_t got = 0;  // bytes of the current stage received
  // A watch: nothing is owed on this direction, only an ABORT may come (the ring's look backwards
  // at the next rank); a provider reports a closed peer at once instead of waiting for a frame,
  // sets `closed` and leaves it out of peer_failures: whether a closed peer failed anything is
  // the watcher's to say (it may have closed having taken all it needed), and it counts it then.
  bool watch = false;
  bool closed = false;
  const FrameHeader& header() const { return *reinterpret_cast<const FrameHeader*>(head); }
  void Reset() { stage = kHead; dst = nullptr; payload_bytes = 0; got = 0; }
};
// Authenticates a received head: magic, version, job, sender, the header tag, and that its
// counter is the next one (replayed or reordered frames are rejected and counted).
Status OpenHead(Session& s, const InFrame& f, uint64_t job_id, int64_t src_rank,
                const std::string& peer);
// Authenticates the payload against its tag and consumes the receive counter.
Status OpenBody(Session& s, const InFrame& f, const std::string& peer);

// Process-wide counters, readable from Python (transport.counters()).
struct TransportCounters {
  std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bytes_sent{0}, bytes_received{0};
  std::atomic<uint64_t> connections_opened{0}, connections_accepted{0};
  std::atomic<uint64_t> rejected_bad_header{0}, rejected_bad_version{0}, rejected_oversized{0};
  std::atomic<uint64_t> rejected_auth{0}, rejected_unknown_peer{0}, rejected_out_of_order{0};
  std::atomic<uint64_t> rejected_mac{0}, rejected_replay{0}, rejected_mismatch{0};
  std::atomic<uint64_t> aborts_sent{0}, aborts_received{0};
  std::atomic<uint64_t> handshakes_evicted{0}, handshakes_timed_out{0}, handshakes_refused{0};
  std::atomic<uint64_t> connect_retries{0}, rejects_received{0};
  std::atomic<uint64_t> timeouts{0}, peer_failures{0}, collectives{0}, throttled_ns{0}, waits{0};
  // Gauges (current values, not totals) for the runtime agent's load report.
  std::atomic<uint64_t> ops_in_flight{0}, queue_depth{0}, handshakes_pending{0};
};
TransportCounters& Counters();
// peer_failures: a peer's failure (it closed or died, a completion failed) where it ends this
// rank's collective or set-up. What the ABORT frames that report a failure meet on their way (the
// closed peer's other messages failing meanwhile) is that failure again: Comm::SendAborts sends
// them under a PeerFailuresQuiet, and nothing counts on its thread while one lives.
void CountPeerFailure();
class PeerFailuresQuiet {
 public:
  PeerFailuresQuiet();
  ~PeerFailuresQuiet();
  PeerFailuresQuiet(const PeerFailuresQuiet&) = delete;
  PeerFailuresQuiet& operator=(const PeerFailuresQuiet&) = delete;

 private:
  bool was_;
};
// Names in the order TransportCountersSnapshot fills them.
extern const char* const kCounterNames[];
constexpr int kNumCounters = 30;
void TransportCountersSnapshot(uint64_t* out);

}  // namespace dtenjax::transport
