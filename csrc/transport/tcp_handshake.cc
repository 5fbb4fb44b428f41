// TCP provider, the handshake: a mutual HMAC-SHA256 challenge-response on every connection:
//   client -> HELLO(nonce_c)
//   server -> CHALLENGE(nonce_s || HMAC(k, "dtenjax-server" | job | client | server | nonce_c | nonce_s))
//   client -> RESPONSE(HMAC(k, "dtenjax-client" | job | client | server | nonce_s | nonce_c))
//   server -> ACCEPT (the first authenticated frame: proves both derived the same session keys)
// Each side proves knowledge of the job secret without sending it; fresh nonces defeat replay,
// and the per-connection keys (DeriveSession) authenticate every later frame. Either side may
// answer with a REJECT frame instead (unauthenticated: retry or fatal, and the reason) and close,
// so both ends of a failed handshake can name its cause.
//
// Client: retries with exponential backoff and jitter (kBackoffFirst doubling to kBackoffMax,
// each delay drawn from [0.5, 1] of it) until the set-up deadline while retrying can help: nothing
// listens yet, the listener is busy or timed us out, or it closed without a reason. A fatal
// REJECT (another protocol version, job id, ring position or secret) or a server proof that does
// not verify ends the attempt at once. kMaxSilentCloses closes in a row without a REJECT mean the
// listener is not a dtenjax of this protocol version, and say so.
//
// The server side (concurrent handshakes, flood resistance) is tcp_accept.cc.
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/peer_text.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tcp_impl.h"

namespace dtenjax::transport::tcp {

namespace {

constexpr double kBackoffFirst = 0.005;        // s before the first retry
constexpr double kBackoffMax = 0.2;            // s between retries at most
constexpr int kMaxSilentCloses = 3;

Status Timeout(const std::string& what, const std::string& peer) {
  Counters().timeouts.fetch_add(1);
  return DTENJAX_ERROR(Code::kDeadlineExceeded,
                       "dtenjax transport: timed out " + what + " " + peer +
                           " (DTENJAX_COLLECTIVE_TIMEOUT); the peer is stalled, dead or "
                           "running a different program");
}

// Sends or receives exactly n bytes on a non-blocking socket by `deadline` (handshake only).
// `hs`: when set, the wait also ends as soon as the set-up gives up (GiveUp: Comm::Close).
Status IoAll(int fd, bool write, void* buf, size_t n, double deadline, const std::string& peer,
             const Handshake* hs = nullptr) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    if (hs && GiveUp(*hs)) {
      return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: stopped the handshake with " +
                                                   peer + " because this rank's set-up gave up");
    }
    ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) { p += k; n -= size_t(k); continue; }
    if (k == 0) return Closed(peer, "closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return Closed(peer, std::string("closed the connection (") + std::strerror(errno) + ")");
    }
    if (NowSeconds() >= deadline) return Timeout(write ? "sending to" : "receiving from", peer);
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    ::poll(&pfd, 1, PollMs(deadline));
  }
  return Status::Ok();
}

// Best effort, never blocks: tells the other side of a handshake why this side closes.
void SendReject(int fd, const Handshake& hs, RejectClass cls, const Status& why) {
  const std::string f = MakeReject(hs.job_id, uint32_t(hs.my_rank), cls, why);
  (void)::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

Status SendPlain(int fd, FrameType type, const Handshake& hs, const void* payload, uint64_t n,
                 double deadline, const std::string& peer) {
  FrameHeader h = MakePlainHeader(type, hs.job_id, uint32_t(hs.my_rank), n);
  std::vector<uint8_t> buf(kHdr + n);
  std::memcpy(buf.data(), &h, kHdr);
  if (n) std::memcpy(buf.data() + kHdr, payload, n);
  return IoAll(fd, true, buf.data(), buf.size(), deadline, peer);
}

// Reads the payload of a REJECT frame whose header `h` was received: (class, code, text).
Status ReadReject(int fd, const FrameHeader& h, double deadline, const std::string& peer,
                  RejectClass* cls, Code* code, std::string* text) {
  if (h.payload_bytes < 2 || h.payload_bytes > kMaxRejectText) {
    Counters().rejected_oversized.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: " + peer + " sent a REJECT frame of " +
                                              std::to_string(h.payload_bytes) + " bytes (2.." +
                                              std::to_string(kMaxRejectText) + ")");
  }
  std::string buf(h.payload_bytes, '\0');
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, buf.data(), buf.size(), deadline, peer));
  *cls = buf[0] == char(RejectClass::kRetry) ? RejectClass::kRetry : RejectClass::kFatal;
  const int c = static_cast<unsigned char>(buf[1]);
  *code = PeerCode(c);
  *text = PeerText(buf.data() + 2, buf.size() - 2);  // the peer's words: data, escaped
  Counters().rejects_received.fetch_add(1);
  return Status::Ok();
}

void PutLe(std::vector<uint8_t>* m, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) m->push_back(uint8_t(v >> (8 * i)));
}

}  // namespace

// --- both sides ----------------------------------------------------------------------------------

// Closes a handshake socket after (optionally) a REJECT: half-close first and read what the peer
// already sent, so the kernel ends the connection with FIN (the REJECT is delivered) and not RST.
void RejectAndClose(int fd, const Handshake* hs, RejectClass cls, const Status& why) {
  if (hs) SendReject(fd, *hs, cls, why);
  ::shutdown(fd, SHUT_WR);
  char junk[4096];
  for (int i = 0; i < 16 && ::recv(fd, junk, sizeof(junk), MSG_DONTWAIT) > 0; ++i) {
  }
  ::close(fd);
}

Status Proof(const Handshake& hs, const char* label, int client, int server, const uint8_t* n1,
             const uint8_t* n2, uint8_t out[32]) {
  std::vector<uint8_t> m(label, label + std::strlen(label));
  PutLe(&m, hs.job_id, 8);
  PutLe(&m, uint32_t(client), 4);
  PutLe(&m, uint32_t(server), 4);
  m.insert(m.end(), n1, n1 + 32);
  m.insert(m.end(), n2, n2 + 32);
  return crypto::HmacSha256(hs.secret.data(), hs.secret.size(), m.data(), m.size(), out);
}

Status AuthFailed(const std::string& peer, const std::string& why) {
  Counters().rejected_auth.fetch_add(1);
  return DTENJAX_ERROR(Code::kPermissionDenied,
                       "dtenjax transport: " + peer + " failed authentication (" + why +
                           "); every process of the job must share one DTENJAX_JOB_SECRET");
}

// --- client side ---------------------------------------------------------------------------------

namespace {

// Sleeps between connection attempts: exponential backoff with jitter, never past the deadline.
class Backoff {
 public:
  explicit Backoff(double deadline) : deadline_(deadline), rng_(std::random_device{}()) {}
  // False when the deadline passed or the set-up gave up meanwhile.
  bool Sleep(const Handshake& hs) {
    std::uniform_real_distribution<double> jitter(0.5, 1.0);
    const double until = std::min(deadline_, NowSeconds() + delay_ * jitter(rng_));
    delay_ = std::min(2 * delay_, kBackoffMax);
    while (true) {
      const double left = until - NowSeconds();
      if (GiveUp(hs)) return false;
      if (left <= 0) break;
      std::this_thread::sleep_for(std::chrono::duration<double>(std::min(left, 0.02)));
    }
    return NowSeconds() < deadline_;
  }

 private:
  double delay_ = kBackoffFirst;
  double deadline_;
  std::mt19937_64 rng_;
};

// The listener answered REJECT: its reason becomes our error; *retry says whether to try again.
Status Refused(int fd, const FrameHeader& h, double deadline, const std::string& peer, bool* retry) {
  RejectClass cls = RejectClass::kFatal;  // set by ReadReject when it succeeds
  Code code = Code::kInternal;
  std::string text;
  DTENJAX_RETURN_IF_ERROR(ReadReject(fd, h, deadline, peer, &cls, &code, &text));
  *retry = cls == RejectClass::kRetry;
  return Status(*retry ? Code::kUnavailable : code,
                "dtenjax transport: " + peer + " refused the connection: " + text);
}

// One attempt's handshake on a connected socket. *retry: whether another attempt may succeed;
// *silent: the listener closed without saying why.
Status ClientHandshake(int fd, const Handshake& hs, double deadline, const std::string& peer,
                       Conn** out, bool* retry, bool* silent) {
  *retry = true;
  *silent = false;
  uint8_t nonce_c[32], challenge[64], mine[32], response[32];
  DTENJAX_RETURN_IF_ERROR(crypto::RandomBytes(nonce_c, 32));
  DTENJAX_RETURN_IF_ERROR(SendPlain(fd, FrameType::kHello, hs, nonce_c, 32, deadline, peer));
  FrameHeader h;
  Status s = IoAll(fd, false, &h, kHdr, deadline, peer, &hs);
  if (!s.ok()) {
    *silent = s.code() == Code::kUnavailable;
    return *silent ? Closed(peer, "closed the connection after our HELLO without saying why") : s;
  }
  *retry = false;
  DTENJAX_RETURN_IF_ERROR(CheckMagicAndVersion(h, peer));
  if (h.type == uint16_t(FrameType::kReject)) return Refused(fd, h, deadline, peer, retry);
  DTENJAX_RETURN_IF_ERROR(
      CheckPlainHeader(h, FrameExpect{FrameType::kChallenge, hs.job_id, hs.peer_rank, 64}, peer));
  *retry = true;
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, challenge, 64, deadline, peer, &hs));
  *retry = false;
  DTENJAX_RETURN_IF_ERROR(Proof(hs, "dtenjax-server", hs.my_rank, hs.peer_rank, nonce_c, challenge, mine));
  if (!crypto::Equal(mine, challenge + 32, 32)) {
    const std::string me = "rank " + std::to_string(hs.my_rank);
    SendReject(fd, hs, RejectClass::kFatal,
               Status(Code::kPermissionDenied,
                      me + " could not verify this listener's proof of the job secret: the two "
                           "processes have different DTENJAX_JOB_SECRET values"));
    return AuthFailed(peer, "its proof of the job secret does not match this process's secret");
  }
  DTENJAX_RETURN_IF_ERROR(
      Proof(hs, "dtenjax-client", hs.my_rank, hs.peer_rank, challenge, nonce_c, response));
  *retry = true;
  DTENJAX_RETURN_IF_ERROR(SendPlain(fd, FrameType::kResponse, hs, response, 32, deadline, peer));
  s = IoAll(fd, false, &h, kHdr, deadline, peer, &hs);
  if (!s.ok()) {
    *silent = s.code() == Code::kUnavailable;
    return *silent ? Closed(peer, "closed the connection after our RESPONSE without saying why") : s;
  }
  *retry = false;
  DTENJAX_RETURN_IF_ERROR(CheckMagicAndVersion(h, peer));
  if (h.type == uint16_t(FrameType::kReject)) return Refused(fd, h, deadline, peer, retry);
  auto session = std::make_unique<Session>();
  DTENJAX_RETURN_IF_ERROR(DeriveSession(hs.secret, hs.job_id, hs.my_rank, hs.peer_rank, nonce_c,
                                        challenge, /*is_client=*/true, session.get()));
  // The ACCEPT frame: its header arrived already; read its header tag, then its (empty) body tag.
  InFrame f;
  std::memcpy(f.head, &h, kHdr);
  *retry = true;
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, f.head + kHdr, kTagBytes, deadline, peer, &hs));
  *retry = false;
  f.stage = InFrame::kHeadReady;
  DTENJAX_RETURN_IF_ERROR(OpenHead(*session, f, hs.job_id, hs.peer_rank, peer));
  if (h.type != uint16_t(FrameType::kAccept) || h.payload_bytes != 0) {
    Counters().rejected_bad_header.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: " + peer + " sent " +
                                              FrameTypeName(h.type) + " where ACCEPT belongs");
  }
  *retry = true;
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, f.ptag, kTagBytes, deadline, peer, &hs));
  *retry = false;
  f.stage = InFrame::kDone;
  DTENJAX_RETURN_IF_ERROR(OpenBody(*session, f, peer));
  Counters().frames_received.fetch_add(1);
  Counters().bytes_received.fetch_add(kSealedHeadBytes + kTagBytes);
  *out = MakeConn(fd, hs.peer_rank, peer, hs, std::move(session));
  return Status::Ok();
}

// Waits until a non-blocking connect completes (or the deadline, or the set-up gives up).
int FinishConnect(int fd, double deadline, const Handshake& hs) {
  while (true) {
    pollfd pfd{fd, POLLOUT, 0};
    int rc = ::poll(&pfd, 1, PollMs(deadline));
    if (rc > 0) {
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      return err;
    }
    if (NowSeconds() >= deadline) return ETIMEDOUT;
    if (GiveUp(hs)) return ECANCELED;
  }
}

}  // namespace

bool TcpCanConnect(const std::string& ep) {
  sockaddr_in a;
  return ParseEndpoint(ep, &a).ok();
}

Status TcpConnect(const std::string& ep, const Handshake& hs, double deadline, Conn** out) {
  sockaddr_in addr;
  DTENJAX_RETURN_IF_ERROR(ParseEndpoint(ep, &addr));
  DTENJAX_RETURN_IF_ERROR(crypto::Loaded());
  const std::string peer = "rank " + std::to_string(hs.peer_rank) + " (" + ep + ")";
  const double start = NowSeconds();
  std::string last = "never tried";
  int attempts = 0, silent = 0;
  Backoff backoff(deadline);
  while (NowSeconds() < deadline && !GiveUp(hs)) {
    if (attempts++ > 0) Counters().connect_retries.fetch_add(1);
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    SYS_CHECK(fd, "socket");
    int err = 0;
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      err = errno == EINPROGRESS ? FinishConnect(fd, deadline, hs) : errno;
    }
    if (err == 0) {
      Conn* c = nullptr;
      bool retry = false, closed_silently = false;
      Status s = ClientHandshake(fd, hs, deadline, peer, &c, &retry, &closed_silently);
      if (s.ok()) {
        Counters().connections_opened.fetch_add(1);
        *out = c;
        return Status::Ok();
      }
      ::close(fd);
      if (!retry) return s;
      silent = closed_silently ? silent + 1 : 0;
      if (silent >= kMaxSilentCloses) {
        return DTENJAX_ERROR(
            Code::kUnavailable,
            "dtenjax transport: " + peer + " closed the connection " + std::to_string(silent) +
                " times in a row without saying why: a dtenjax listener of transport protocol "
                "version " + std::to_string(kFrameVersion) + " always sends a REJECT frame with "
                "its reason first, so the process listening there runs another dtenjax release "
                "(version 2 and older close on frames they cannot read) or is not dtenjax");
      }
      last = Unprefixed(s.message());
    } else {
      ::close(fd);
      silent = 0;
      if (err == ECANCELED) break;
      last = std::string("connect: ") + std::strerror(err);
    }
    if (!backoff.Sleep(hs)) break;
  }
  if (GiveUp(hs)) {
    return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: stopped connecting to " + peer +
                                                 " because this rank's set-up failed otherwise");
  }
  Counters().timeouts.fetch_add(1);
  return DTENJAX_ERROR(Code::kDeadlineExceeded,
                       "dtenjax transport: timed out connecting to " + peer + " after " +
                           std::to_string(attempts) + " attempts in " + Seconds(NowSeconds() - start) +
                           " s (DTENJAX_COLLECTIVE_TIMEOUT); the last: " + last);
}

}  // namespace dtenjax::transport::tcp
