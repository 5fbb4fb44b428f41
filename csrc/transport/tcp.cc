// TCP provider: non-blocking sockets driven by poll() with deadlines, frames of frame.h, and a
// mutual HMAC-SHA256 challenge-response on every connection:
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
// Server, flood resistance. Unauthenticated connections are served concurrently, each a small
// state machine with its own deadline (Handshake::handshake_timeout_s); at most max_pending are
// pending at once. The backlog is SOMAXCONN deep and is drained on every poll, so connections
// queued by a flood never make the kernel drop the real peer's SYN. When a connection arrives at
// the cap, one connection gives way:
//   * never a peer that proved the secret (it leaves the pending set on its next poll);
//   * first from the source address that holds the most pending connections (an attacker on one
//     host cannot crowd out a peer on another), then the one that got least far (silent < partial
//     HELLO < complete HELLO < challenge answered... pending), then the oldest;
//   * a pending connection is protected for kGrace seconds after it arrived, unless the newcomer
//     got further than it or its source holds more pending connections than the newcomer's;
//     when none may give way, the newcomer is refused.
// Refused, evicted and timed-out connections get a REJECT saying so (class retry), and the
// dtenjax client tries again: a flood of silent, slow, garbage or HELLO-only connections costs
// the real peer at most about kGrace plus one backoff step.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/peer_text.h"
#include "csrc/transport/provider.h"

namespace dtenjax::transport {

namespace {

constexpr size_t kHdr = sizeof(FrameHeader);
constexpr size_t kHelloBytes = kHdr + 32;      // HELLO and RESPONSE both carry 32 bytes
constexpr double kGrace = 0.25;                // s a new pending handshake is protected
constexpr double kBackoffFirst = 0.005;        // s before the first retry
constexpr double kBackoffMax = 0.2;            // s between retries at most
constexpr int kMaxSilentCloses = 3;
constexpr int kAcceptBurst = 256;              // connections taken from the backlog per poll

struct TcpConn { int fd = -1; };

struct Pending {
  int fd = -1;
  double admitted = 0;
  double deadline = 0;
  std::string host;  // "address:port", for messages
  std::string ip;    // source address: the fairness key
  enum Stage { kHello, kResponse, kFlush } stage = kHello;
  uint8_t in[kHdr + kMaxRejectText];
  size_t have = 0;
  size_t want = kHdr;  // bytes of the frame being read: its header first, then what it announces
  std::vector<uint8_t> out;
  size_t out_off = 0;
  uint8_t nonce_c[32], nonce_s[32];
  int client_rank = -1;
  std::unique_ptr<Session> session;
  bool ready = false;  // poll flagged it
  // How far the handshake got; the lower, the sooner it gives way to a newcomer.
  int progress() const {
    if (stage == kFlush) return 4;
    if (stage == kResponse) return 3;
    return have == 0 ? 0 : have < kHelloBytes ? 1 : 2;
  }
};

struct TcpListener {
  int fd = -1;
  std::vector<std::unique_ptr<Pending>> pending;
  std::map<std::string, int> per_ip;  // pending connections by source address
};

int FdOf(Conn* c) { return static_cast<TcpConn*>(c->impl)->fd; }

Status SetNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  SYS_CHECK(flags, "fcntl(F_GETFL)");
  SYS_CHECK(fcntl(fd, F_SETFL, flags | O_NONBLOCK), "fcntl(F_SETFL)");
  return Status::Ok();
}

Status ParseEndpoint(const std::string& ep, sockaddr_in* addr) {
  const std::string prefix = "tcp://";
  if (ep.compare(0, prefix.size(), prefix) != 0) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "endpoint '" + ep + "' is not tcp://HOST:PORT");
  }
  std::string rest = ep.substr(prefix.size());
  size_t colon = rest.rfind(':');
  if (colon == std::string::npos) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "endpoint '" + ep + "' has no port");
  }
  std::string host = rest.substr(0, colon);
  std::string port_text = rest.substr(colon + 1);
  char* end = nullptr;
  long port = std::strtol(port_text.c_str(), &end, 10);
  std::memset(addr, 0, sizeof(*addr));
  addr->sin_family = AF_INET;
  if (port_text.empty() || *end != '\0' || port <= 0 || port > 65535 ||
      inet_pton(AF_INET, host.c_str(), &addr->sin_addr) != 1) {
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "endpoint '" + ep + "' needs a numeric IPv4 address and a port 1..65535");
  }
  addr->sin_port = htons(uint16_t(port));
  return Status::Ok();
}

int PollMs(double until) {
  double left = until - NowSeconds();
  if (left <= 0) return 0;
  // Slices of at most 20 ms: a waiter notices a cancellation (Comm::Close) within that.
  return int(std::min(left, 0.02) * 1000) + 1;
}

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g", s);
  return buf;
}

std::string Unprefixed(const std::string& message) {
  const std::string prefix = "dtenjax transport: ";
  return message.compare(0, prefix.size(), prefix) == 0 ? message.substr(prefix.size()) : message;
}

Status Timeout(const std::string& what, const std::string& peer) {
  Counters().timeouts.fetch_add(1);
  return DTENJAX_ERROR(Code::kDeadlineExceeded,
                       "dtenjax transport: timed out " + what + " " + peer +
                           " (DTENJAX_COLLECTIVE_TIMEOUT); the peer is stalled, dead or "
                           "running a different program");
}

Status PeerGone(const std::string& peer, const char* why) {
  Counters().peer_failures.fetch_add(1);
  return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: lost connection to " + peer + " (" +
                                               why + "); that process died or aborted the collective");
}

// A handshake connection that closed (not counted as a peer failure: the client may retry).
Status Closed(const std::string& peer, const std::string& why) {
  return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: " + peer + " " + why);
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

Status SendPlain(int fd, FrameType type, const Handshake& hs, const void* payload, uint64_t n,
                 double deadline, const std::string& peer) {
  FrameHeader h = MakePlainHeader(type, hs.job_id, uint32_t(hs.my_rank), n);
  std::vector<uint8_t> buf(kHdr + n);
  std::memcpy(buf.data(), &h, kHdr);
  if (n) std::memcpy(buf.data() + kHdr, payload, n);
  return IoAll(fd, true, buf.data(), buf.size(), deadline, peer);
}

// Best effort, never blocks: tells the other side of a handshake why this side closes.
void SendReject(int fd, const Handshake& hs, RejectClass cls, const Status& why) {
  const std::string f = MakeReject(hs.job_id, uint32_t(hs.my_rank), cls, why);
  (void)::send(fd, f.data(), f.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

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

Conn* MakeConn(int fd, int peer_rank, const std::string& peer, const Handshake& hs,
               std::unique_ptr<Session> session) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  auto* c = new Conn;
  c->provider = TcpProvider();
  c->peer_rank = peer_rank;
  c->peer = peer;
  c->job_id = hs.job_id;
  c->my_rank = hs.my_rank;
  c->session = std::move(session);
  c->impl = new TcpConn{fd};
  return c;
}

Status AuthFailed(const std::string& peer, const std::string& why) {
  Counters().rejected_auth.fetch_add(1);
  return DTENJAX_ERROR(Code::kPermissionDenied,
                       "dtenjax transport: " + peer + " failed authentication (" + why +
                           "); every process of the job must share one DTENJAX_JOB_SECRET");
}

// --- client side ---------------------------------------------------------------------------------

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
  RejectClass cls;
  Code code;
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

bool TcpCanConnect(const std::string& ep) {
  sockaddr_in a;
  return ParseEndpoint(ep, &a).ok();
}

Status TcpListen(const std::string& bind_address, Listener** out) {
  sockaddr_in addr;
  DTENJAX_RETURN_IF_ERROR(ParseEndpoint("tcp://" + bind_address + ":1", &addr));
  addr.sin_port = 0;
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  SYS_CHECK(fd, "socket");
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  // The deepest backlog the kernel allows: a flood of connections queued before this rank starts
  // accepting must not fill it, or the kernel drops the real peer's SYN (and it retries 1 s later).
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    int e = errno;
    ::close(fd);
    return DTENJAX_ERROR(Code::kUnavailable, "cannot listen on " + bind_address + ": " +
                                                 std::strerror(e) + " (set DTENJAX_BIND_ADDRESS)");
  }
  Status s = SetNonBlocking(fd);
  if (!s.ok()) { ::close(fd); return s; }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  char host[INET_ADDRSTRLEN];
  inet_ntop(AF_INET, &addr.sin_addr, host, sizeof(host));
  auto* l = new Listener;
  l->provider = TcpProvider();
  l->endpoint = std::string("tcp://") + host + ":" + std::to_string(ntohs(addr.sin_port));
  auto* t = new TcpListener;
  t->fd = fd;
  l->impl = t;
  *out = l;
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

// --- server side: concurrent handshakes ----------------------------------------------------------

// What happened to connections that never authenticated, for the accept timeout's message.
struct Tally {
  uint64_t refused = 0, evicted = 0, timed_out = 0, rejected = 0;
  std::string last;
  void Note(uint64_t* counter, const std::string& why) {
    ++*counter;
    last = why;
  }
  std::string Text() const {
    const uint64_t all = refused + evicted + timed_out + rejected;
    if (all == 0) return "";
    return "; meanwhile " + std::to_string(all) + " connections that did not authenticate were "
           "turned away (" + std::to_string(refused) + " refused while busy, " +
           std::to_string(evicted) + " evicted, " + std::to_string(timed_out) + " timed out, " +
           std::to_string(rejected) + " rejected), the last: " + last;
  }
};

void DropPending(TcpListener* t, size_t i) {
  Pending* p = t->pending[i].get();
  if (p->fd >= 0) ::close(p->fd);
  if (--t->per_ip[p->ip] <= 0) t->per_ip.erase(p->ip);
  t->pending.erase(t->pending.begin() + long(i));
  Counters().handshakes_pending.fetch_sub(1);
}

// Closes pending handshake i with a REJECT of class retry (when nothing else is half-sent on it).
void TurnAway(TcpListener* t, size_t i, const Handshake& hs, const Status& why) {
  Pending* p = t->pending[i].get();
  RejectAndClose(p->fd, p->out_off == p->out.size() ? &hs : nullptr, RejectClass::kRetry, why);
  p->fd = -1;
  DropPending(t, i);
}

// Index of the pending handshake that gives way to `nc` (the rules at the top of this file), or
// -1: nothing may, and the newcomer is refused.
int ChooseVictim(const TcpListener& t, const Pending& nc, double now, double grace) {
  auto count = [&](const std::string& ip) {
    auto it = t.per_ip.find(ip);
    return it == t.per_ip.end() ? 0 : it->second;
  };
  const int mine = count(nc.ip);
  int best = -1;
  std::tuple<int, int, double> best_key;
  for (size_t i = 0; i < t.pending.size(); ++i) {
    const Pending& p = *t.pending[i];
    if (p.stage == Pending::kFlush) continue;  // proved the secret: never displaced
    const int theirs = count(p.ip);
    const double age = now - p.admitted;
    if (age < grace && p.progress() >= nc.progress() && theirs <= mine + 1) continue;
    auto key = std::make_tuple(theirs, -p.progress(), age);
    if (best < 0 || key > best_key) {
      best = int(i);
      best_key = key;
    }
  }
  return best;
}

void Queue(Pending* p, const void* data, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(data);
  p->out.insert(p->out.end(), b, b + n);
}

// Writes what it can of p->out. Returns an error if the socket failed.
Status Flush(Pending* p, const std::string& peer) {
  while (p->out_off < p->out.size()) {
    ssize_t k = ::send(p->fd, p->out.data() + p->out_off, p->out.size() - p->out_off,
                       MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) { p->out_off += size_t(k); continue; }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    return Closed(peer, k == 0 ? "closed the connection" : std::strerror(errno));
  }
  return Status::Ok();
}

// Why a pending handshake failed, and whether its peer should hear it (a REJECT of class fatal):
// not for bytes that are not dtenjax at all, a peer that closed or refused us first.
struct Verdict {
  Status status;
  bool tell = false;
};

// Checks a received handshake header, then says how many bytes its frame has in all.
Verdict CheckArrivedHeader(Pending* p, const Handshake& hs, const std::string& peer) {
  FrameHeader h;
  std::memcpy(&h, p->in, kHdr);
  Verdict v;
  if (h.magic != kFrameMagic) {
    v.status = CheckMagicAndVersion(h, peer);  // counts and names the bad magic
    return v;
  }
  v.tell = true;
  if (p->stage == Pending::kResponse && h.type == uint16_t(FrameType::kReject)) {
    // The client refused our CHALLENGE (e.g. our proof does not verify with its secret).
    v.status = CheckMagicAndVersion(h, peer);
    if (v.status.ok() && (h.payload_bytes < 2 || h.payload_bytes > kMaxRejectText)) {
      Counters().rejected_oversized.fetch_add(1);
      v.status = DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: " + peer +
                                                    " sent a REJECT frame of " +
                                                    std::to_string(h.payload_bytes) + " bytes");
    }
    if (v.status.ok()) p->want = kHdr + h.payload_bytes;
    return v;
  }
  const bool hello = p->stage == Pending::kHello;
  v.status = CheckPlainHeader(
      h, FrameExpect{hello ? FrameType::kHello : FrameType::kResponse, hs.job_id,
                     hello ? int64_t(hs.peer_rank) : int64_t(p->client_rank), 32},
      peer);
  if (v.status.ok()) p->want = kHelloBytes;
  return v;
}

// Advances one pending handshake as far as its socket allows. Reads only, unless `respond`.
// *done: authenticated and ACCEPT sent (p->session holds the keys).
Verdict Advance(Pending* p, const Handshake& hs, const std::string& peer, bool respond, bool* done) {
  *done = false;
  Verdict v;
  v.status = Flush(p, peer);
  if (!v.status.ok()) return v;
  if (p->stage == Pending::kFlush) {
    *done = p->out_off == p->out.size();
    return v;
  }
  while (p->have < p->want) {
    ssize_t k = ::recv(p->fd, p->in + p->have, p->want - p->have, MSG_DONTWAIT);
    if (k > 0) {
      p->have += size_t(k);
      if (p->have == kHdr) {  // check the header before reading what it announces
        v = CheckArrivedHeader(p, hs, peer);
        if (!v.status.ok()) return v;
      }
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return v;
    v.status = Closed(peer, k == 0 ? "closed the connection during the handshake"
                                   : std::string("failed during the handshake: ") + std::strerror(errno));
    return v;
  }
  if (!respond) return v;
  FrameHeader h;
  std::memcpy(&h, p->in, kHdr);
  if (h.type == uint16_t(FrameType::kReject)) {
    const int c = static_cast<unsigned char>(p->in[kHdr + 1]);
    Counters().rejects_received.fetch_add(1);
    v.status = Status(PeerCode(c),
                      "dtenjax transport: " + peer + " refused our CHALLENGE: " +
                          PeerText(reinterpret_cast<const char*>(p->in) + kHdr + 2,
                                   p->have - kHdr - 2));
    return v;
  }
  v.tell = true;
  if (p->stage == Pending::kHello) {
    std::memcpy(p->nonce_c, p->in + kHdr, 32);
    p->client_rank = int(h.src_rank);
    uint8_t challenge[64];
    v.status = crypto::RandomBytes(p->nonce_s, 32);
    if (v.status.ok()) {
      std::memcpy(challenge, p->nonce_s, 32);
      v.status = Proof(hs, "dtenjax-server", p->client_rank, hs.my_rank, p->nonce_c, p->nonce_s,
                       challenge + 32);
    }
    if (!v.status.ok()) return v;
    FrameHeader ch = MakePlainHeader(FrameType::kChallenge, hs.job_id, uint32_t(hs.my_rank), 64);
    Queue(p, &ch, kHdr);
    Queue(p, challenge, 64);
    p->stage = Pending::kResponse;
    p->have = 0;
    p->want = kHdr;
    v.status = Flush(p, peer);
    return v;
  }
  uint8_t want_proof[32];
  v.status =
      Proof(hs, "dtenjax-client", p->client_rank, hs.my_rank, p->nonce_s, p->nonce_c, want_proof);
  if (!v.status.ok()) return v;
  if (!crypto::Equal(want_proof, p->in + kHdr, 32)) {
    v.status = AuthFailed(peer, "its proof of the job secret does not match this process's secret");
    return v;
  }
  p->session = std::make_unique<Session>();
  OutFrame accept;
  v.status = DeriveSession(hs.secret, hs.job_id, p->client_rank, hs.my_rank, p->nonce_c,
                           p->nonce_s, /*is_client=*/false, p->session.get());
  if (v.status.ok()) {
    v.status = Seal(*p->session, FrameType::kAccept, hs.job_id, uint32_t(hs.my_rank),
                    Descriptor{}, nullptr, 0, &accept);
  }
  if (!v.status.ok()) return v;
  Queue(p, accept.head, kSealedHeadBytes);
  Queue(p, accept.ptag, kTagBytes);
  p->stage = Pending::kFlush;
  v.status = Flush(p, peer);
  *done = v.status.ok() && p->out_off == p->out.size();
  return v;
}

std::string PeerOf(const std::string& want, const Pending& p) {
  return want + " (from " + p.host + ")";
}

Status TcpAccept(Listener* l, const Handshake& hs, double deadline, Conn** out) {
  DTENJAX_RETURN_IF_ERROR(crypto::Loaded());
  auto* t = static_cast<TcpListener*>(l->impl);
  const std::string want = hs.peer_rank >= 0 ? "rank " + std::to_string(hs.peer_rank) : "a peer";
  const size_t cap = size_t(std::max(1, hs.max_pending));
  const double grace = std::min(kGrace, hs.handshake_timeout_s);
  const double start = NowSeconds();
  Tally tally;
  std::vector<pollfd> pfds;
  double listen_paused_until = 0;
  // A connection claiming to be the expected peer failed for a reason retrying cannot change
  // (job, version, secret): once this rank's own set-up has failed too, nobody is coming.
  bool expected_peer_failed = false;
  auto claims_expected = [&](const Pending& p) {
    if (p.have < kHdr || hs.peer_rank < 0) return false;
    FrameHeader h;
    std::memcpy(&h, p.in, kHdr);
    return h.magic == kFrameMagic && int64_t(h.src_rank) == hs.peer_rank;
  };

  // Handles the outcome of Advance for pending handshake i; true when it authenticated.
  auto settle = [&](size_t i, const Verdict& v, bool done) -> bool {
    Pending* p = t->pending[i].get();
    if (!v.status.ok()) {
      if (v.status.code() != Code::kUnavailable && claims_expected(*p)) expected_peer_failed = true;
      if (v.tell) {
        RejectAndClose(p->fd, p->out_off == p->out.size() ? &hs : nullptr, RejectClass::kFatal,
                       v.status);
        p->fd = -1;
      }
      tally.Note(&tally.rejected, Unprefixed(v.status.message()));
      DropPending(t, i);
      return false;
    }
    if (!done) return false;
    Counters().connections_accepted.fetch_add(1);
    Counters().frames_sent.fetch_add(1);  // the ACCEPT frame
    Counters().bytes_sent.fetch_add(kSealedHeadBytes + kTagBytes);
    const std::string desc = "rank " + std::to_string(p->client_rank) + " (" + p->host + ")";
    *out = MakeConn(p->fd, p->client_rank, desc, hs, std::move(p->session));
    p->fd = -1;
    DropPending(t, i);
    return true;
  };

  while (true) {
    const bool own_setup_failed = hs.give_up_at && hs.give_up_at->load() > 0;
    if (GiveUp(hs) || (own_setup_failed && expected_peer_failed)) {
      return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: stopped waiting for " + want +
                                                   " to connect because this rank's set-up "
                                                   "failed otherwise" + tally.Text());
    }
    double now = NowSeconds();
    if (now >= deadline) {
      Counters().timeouts.fetch_add(1);
      return DTENJAX_ERROR(Code::kDeadlineExceeded,
                           "dtenjax transport: timed out after " + Seconds(now - start) +
                               " s waiting for " + want + " to connect to " + l->endpoint +
                               " (DTENJAX_COLLECTIVE_TIMEOUT)" + tally.Text() +
                               "; the peer is stalled, dead or running a different program");
    }
    // Expire handshakes past their own deadline.
    for (size_t i = t->pending.size(); i-- > 0;) {
      if (now >= t->pending[i]->deadline) {
        Counters().handshakes_timed_out.fetch_add(1);
        const std::string why = "a connection from " + t->pending[i]->host + " did not finish the "
                                "handshake within " + Seconds(hs.handshake_timeout_s) + " s";
        tally.Note(&tally.timed_out, why);
        TurnAway(t, i, hs, Status(Code::kDeadlineExceeded, why + " (DTENJAX_HANDSHAKE_TIMEOUT)"));
      }
    }
    double until = deadline;
    const bool listening = now >= listen_paused_until;
    pfds.assign(1, pollfd{listening ? t->fd : -1, POLLIN, 0});
    for (auto& p : t->pending) {
      short ev = p->out_off < p->out.size() ? POLLOUT : POLLIN;
      pfds.push_back(pollfd{p->fd, ev, 0});
      until = std::min(until, p->deadline);
    }
    if (!listening) until = std::min(until, listen_paused_until);
    ::poll(pfds.data(), nfds_t(pfds.size()), PollMs(until));
    for (size_t i = 0; i + 1 < pfds.size(); ++i) t->pending[i]->ready = pfds[i + 1].revents != 0;
    // Progress the handshakes that have something to read or write.
    for (size_t i = 0; i < t->pending.size();) {
      Pending* p = t->pending[i].get();
      if (!p->ready) { ++i; continue; }
      p->ready = false;
      bool done = false;
      const size_t before = t->pending.size();
      Verdict v = Advance(p, hs, PeerOf(want, *p), /*respond=*/true, &done);
      if (settle(i, v, done)) return Status::Ok();
      if (t->pending.size() == before) ++i;
    }
    if (!(pfds[0].revents & POLLIN)) continue;
    // New connections: drain the backlog (in bursts), admitting each by the rules above.
    for (int k = 0; k < kAcceptBurst; ++k) {
      sockaddr_in from;
      socklen_t len = sizeof(from);
      int fd = ::accept4(t->fd, reinterpret_cast<sockaddr*>(&from), &len,
                         SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) {
        if (errno == EMFILE || errno == ENFILE) {
          // Out of descriptors: free one (whatever gave way last) and look again shortly.
          tally.last = "out of file descriptors (" + std::string(std::strerror(errno)) + ")";
          if (!t->pending.empty()) {
            Pending probe;
            probe.stage = Pending::kResponse;  // outranks any unanswered connection
            int v = ChooseVictim(*t, probe, NowSeconds(), grace);
            if (v >= 0) {
              Counters().handshakes_evicted.fetch_add(1);
              tally.Note(&tally.evicted, tally.last);
              TurnAway(t, size_t(v), hs, Status(Code::kResourceExhausted, "the listener of rank " +
                                                    std::to_string(hs.my_rank) + " ran out of file descriptors"));
            }
          }
          listen_paused_until = NowSeconds() + 0.01;
        }
        break;
      }
      auto nc = std::make_unique<Pending>();
      nc->fd = fd;
      nc->admitted = NowSeconds();
      nc->deadline = nc->admitted + hs.handshake_timeout_s;
      char host[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &from.sin_addr, host, sizeof(host));
      nc->ip = host;
      nc->host = std::string(host) + ":" + std::to_string(ntohs(from.sin_port));
      const std::string peer = PeerOf(want, *nc);
      bool done = false;
      Verdict v = Advance(nc.get(), hs, peer, /*respond=*/false, &done);  // what it sent already
      if (!v.status.ok()) {
        if (v.status.code() != Code::kUnavailable && claims_expected(*nc)) expected_peer_failed = true;
        RejectAndClose(fd, v.tell ? &hs : nullptr, RejectClass::kFatal, v.status);
        tally.Note(&tally.rejected, Unprefixed(v.status.message()));
        continue;
      }
      if (t->pending.size() >= cap) {
        const int victim = ChooseVictim(*t, *nc, NowSeconds(), grace);
        const std::string busy = "the listener of rank " + std::to_string(hs.my_rank) + " has " +
                                 std::to_string(t->pending.size()) + " unauthenticated connections "
                                 "pending (DTENJAX_MAX_PENDING_HANDSHAKES=" + std::to_string(cap) + ")";
        if (victim < 0) {
          Counters().handshakes_refused.fetch_add(1);
          tally.Note(&tally.refused, "refused a connection from " + nc->host + " (" + busy + ")");
          RejectAndClose(fd, &hs, RejectClass::kRetry,
                         Status(Code::kUnavailable, busy + "; try again"));
          continue;
        }
        Counters().handshakes_evicted.fetch_add(1);
        tally.Note(&tally.evicted, "evicted a connection from " + t->pending[size_t(victim)]->host +
                                       " for one from " + nc->host + " (" + busy + ")");
        TurnAway(t, size_t(victim), hs,
                 Status(Code::kUnavailable, busy + " and this one gave way to another; try again"));
      }
      t->per_ip[nc->ip]++;
      t->pending.push_back(std::move(nc));
      Counters().handshakes_pending.fetch_add(1);
      const size_t i = t->pending.size() - 1;
      v = Advance(t->pending[i].get(), hs, peer, /*respond=*/true, &done);
      if (settle(i, v, done)) return Status::Ok();
    }
  }
}

// --- data path -----------------------------------------------------------------------------------

Status TcpSendSome(Conn* c, OutFrame* f, bool* progress) {
  *progress = false;
  while (!f->done()) {
    iovec iov[3];
    int n = 0;
    uint64_t off = f->sent;
    if (off < kSealedHeadBytes) {
      iov[n++] = iovec{f->head + off, kSealedHeadBytes - off};
      off = kSealedHeadBytes;
    }
    const uint64_t pend = kSealedHeadBytes + f->payload_bytes;
    if (off < pend) {
      iov[n++] = iovec{const_cast<uint8_t*>(f->payload) + (off - kSealedHeadBytes), pend - off};
      off = pend;
    }
    iov[n++] = iovec{f->ptag + (off - pend), kTagBytes - (off - pend)};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = size_t(n);
    ssize_t k = ::sendmsg(FdOf(c), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k > 0) {
      f->sent += uint64_t(k);
      *progress = true;
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
    return PeerGone(c->peer, k == 0 ? "end of stream" : std::strerror(errno));
  }
  Counters().frames_sent.fetch_add(1);
  Counters().bytes_sent.fetch_add(f->total());
  return Status::Ok();
}

Status TcpRecvSome(Conn* c, InFrame* f, bool* progress) {
  *progress = false;
  while (f->stage == InFrame::kHead || f->stage == InFrame::kBody) {
    ssize_t k;
    if (f->stage == InFrame::kHead) {
      k = ::recv(FdOf(c), f->head + f->got, kSealedHeadBytes - f->got, MSG_DONTWAIT);
    } else {
      iovec iov[2];
      int n = 0;
      if (f->got < f->payload_bytes) iov[n++] = iovec{f->dst + f->got, f->payload_bytes - f->got};
      uint64_t tag_off = f->got > f->payload_bytes ? f->got - f->payload_bytes : 0;
      iov[n++] = iovec{f->ptag + tag_off, kTagBytes - tag_off};
      k = ::readv(FdOf(c), iov, n);
    }
    if (k > 0) {
      *progress = true;
      f->got += uint64_t(k);
      if (f->stage == InFrame::kHead && f->got == kSealedHeadBytes) {
        f->stage = InFrame::kHeadReady;
        f->got = 0;
      } else if (f->stage == InFrame::kBody && f->got == f->payload_bytes + kTagBytes) {
        f->stage = InFrame::kDone;
        Counters().frames_received.fetch_add(1);
        Counters().bytes_received.fetch_add(kSealedHeadBytes + f->payload_bytes + kTagBytes);
      }
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
    return PeerGone(c->peer, k == 0 ? "end of stream" : std::strerror(errno));
  }
  return Status::Ok();
}

Status TcpWait(const WaitItem* items, int n, double until) {
  pollfd pfd[4];
  int np = 0;
  for (int i = 0; i < n && np < 4; ++i) {
    short ev = short((items[i].send ? POLLOUT : 0) | (items[i].recv ? POLLIN : 0));
    if (ev) pfd[np++] = pollfd{FdOf(items[i].conn), ev, 0};
  }
  int rc = ::poll(pfd, nfds_t(np), PollMs(until));
  if (rc < 0 && errno != EINTR) SYS_CHECK(rc, "poll");
  return Status::Ok();
}

void TcpShutdown(Conn* c) {
  // Half-close: the peer reads what we sent (an ABORT frame) and then end-of-stream. Closing our
  // read side too would answer the peer's in-flight data with a reset, which can overtake the
  // ABORT frame it has not read yet.
  if (c && c->impl && FdOf(c) >= 0) ::shutdown(FdOf(c), SHUT_WR);
}

void TcpClose(Conn* c) {
  if (!c) return;
  auto* t = static_cast<TcpConn*>(c->impl);
  if (t && t->fd >= 0) ::close(t->fd);
  delete t;
  delete c;
}

void TcpCloseListener(Listener* l) {
  if (!l) return;
  auto* t = static_cast<TcpListener*>(l->impl);
  if (t) {
    while (!t->pending.empty()) DropPending(t, t->pending.size() - 1);
    if (t->fd >= 0) ::close(t->fd);
  }
  delete t;
  delete l;
}

const Provider kTcp = {"tcp", 0, TcpCanConnect, TcpListen, TcpConnect, TcpAccept, TcpSendSome,
                       TcpRecvSome, TcpWait, TcpShutdown, TcpClose, TcpCloseListener};

}  // namespace

const Provider* TcpProvider() { return &kTcp; }

DTENJAX_REGISTER_PROVIDER(tcp, TcpProvider);

}  // namespace dtenjax::transport
