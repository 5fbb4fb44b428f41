// TCP provider: non-blocking sockets driven by poll() with deadlines, length-prefixed frames
// (frame.h) and a mutual HMAC-SHA256 challenge-response on every connection:
//   client -> HELLO(nonce_c)
//   server -> CHALLENGE(nonce_s || HMAC(k, "dtenjax-server" | job | client | server | nonce_c | nonce_s))
//   client -> RESPONSE(HMAC(k, "dtenjax-client" | job | client | server | nonce_s | nonce_c))
//   server -> ACCEPT
// Each side proves knowledge of the job secret without sending it; fresh nonces defeat replay.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/sha256.h"
#include "csrc/transport/tenancy.h"

namespace dtenjax::transport {

Status RandomBytes(void* out, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return DTENJAX_ERROR(Code::kInternal, std::string("getrandom failed: ") + std::strerror(errno));
    }
    p += got;
    n -= size_t(got);
  }
  return Status::Ok();
}

namespace {

struct TcpConn { int fd = -1; };
struct TcpListener { int fd = -1; };

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
  int port = std::atoi(rest.c_str() + colon + 1);
  std::memset(addr, 0, sizeof(*addr));
  addr->sin_family = AF_INET;
  addr->sin_port = htons(uint16_t(port));
  if (port <= 0 || port > 65535 || inet_pton(AF_INET, host.c_str(), &addr->sin_addr) != 1) {
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "endpoint '" + ep + "' needs a numeric IPv4 address and a port");
  }
  return Status::Ok();
}

int PollMs(double deadline) {
  double left = deadline - NowSeconds();
  if (left <= 0) return 0;
  return int(std::min(left, 0.1) * 1000) + 1;
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

// Sends or receives exactly n bytes on a non-blocking socket by `deadline`.
Status IoAll(int fd, bool write, void* buf, size_t n, double deadline, const std::string& peer) {
  uint8_t* p = static_cast<uint8_t*>(buf);
  while (n > 0) {
    ssize_t k = write ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k > 0) { p += k; n -= size_t(k); continue; }
    if (k == 0) return PeerGone(peer, "end of stream");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return PeerGone(peer, std::strerror(errno));
    if (NowSeconds() >= deadline) return Timeout(write ? "sending to" : "receiving from", peer);
    pollfd pfd{fd, short(write ? POLLOUT : POLLIN), 0};
    ::poll(&pfd, 1, PollMs(deadline));
  }
  return Status::Ok();
}

Status SendFrame(int fd, FrameType type, const Handshake& hs, const void* payload, uint64_t n,
                 double deadline, const std::string& peer) {
  FrameHeader h = MakeHeader(type, hs.job_id, 0, uint32_t(hs.my_rank), payload, n);
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, true, &h, sizeof(h), deadline, peer));
  if (n) DTENJAX_RETURN_IF_ERROR(IoAll(fd, true, const_cast<void*>(payload), n, deadline, peer));
  return Status::Ok();
}

Status RecvFrame(int fd, FrameType type, const Handshake& hs, int64_t src, void* payload,
                 uint64_t n, double deadline, const std::string& peer, FrameHeader* out) {
  FrameHeader h;
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, &h, sizeof(h), deadline, peer));
  DTENJAX_RETURN_IF_ERROR(CheckHeader(h, FrameExpect{type, hs.job_id, 0, src, n, true}, peer));
  if (n) DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, payload, n, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(CheckPayload(h, payload, peer));
  if (out) *out = h;
  return Status::Ok();
}

void PutLe(std::vector<uint8_t>* m, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) m->push_back(uint8_t(v >> (8 * i)));
}

void Proof(const Handshake& hs, const char* label, int client, int server, const uint8_t* n1,
           const uint8_t* n2, uint8_t out[32]) {
  std::vector<uint8_t> m(label, label + std::strlen(label));
  PutLe(&m, hs.job_id, 8);
  PutLe(&m, uint32_t(client), 4);
  PutLe(&m, uint32_t(server), 4);
  m.insert(m.end(), n1, n1 + 32);
  m.insert(m.end(), n2, n2 + 32);
  HmacSha256(hs.secret.data(), hs.secret.size(), m.data(), m.size(), out);
}

Status ClientHandshake(int fd, const Handshake& hs, double deadline, const std::string& peer) {
  uint8_t nonce_c[32], challenge[64], mine[32], response[32];
  DTENJAX_RETURN_IF_ERROR(RandomBytes(nonce_c, 32));
  DTENJAX_RETURN_IF_ERROR(SendFrame(fd, FrameType::kHello, hs, nonce_c, 32, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(
      RecvFrame(fd, FrameType::kChallenge, hs, hs.peer_rank, challenge, 64, deadline, peer, nullptr));
  Proof(hs, "dtenjax-server", hs.my_rank, hs.peer_rank, nonce_c, challenge, mine);
  if (!MacEqual(mine, challenge + 32, 32)) {
    Counters().rejected_auth.fetch_add(1);
    return DTENJAX_ERROR(Code::kPermissionDenied,
                         "dtenjax transport: " + peer + " failed authentication (its HMAC does not "
                         "match); every process of the job must share one DTENJAX_JOB_SECRET");
  }
  Proof(hs, "dtenjax-client", hs.my_rank, hs.peer_rank, challenge, nonce_c, response);
  DTENJAX_RETURN_IF_ERROR(SendFrame(fd, FrameType::kResponse, hs, response, 32, deadline, peer));
  Status s = RecvFrame(fd, FrameType::kAccept, hs, hs.peer_rank, nullptr, 0, deadline, peer, nullptr);
  if (!s.ok() && s.code() == Code::kUnavailable) {
    return DTENJAX_ERROR(Code::kPermissionDenied,
                         "dtenjax transport: " + peer + " rejected our authentication (closed the "
                         "connection after our HMAC response); check that every process of the job "
                         "uses the same DTENJAX_JOB_SECRET");
  }
  return s;
}

Status ServerHandshake(int fd, const Handshake& hs, double deadline, const std::string& peer,
                       int* client_rank) {
  uint8_t nonce_c[32], challenge[64], response[32], want[32];
  FrameHeader hello;
  DTENJAX_RETURN_IF_ERROR(
      RecvFrame(fd, FrameType::kHello, hs, hs.peer_rank, nonce_c, 32, deadline, peer, &hello));
  *client_rank = int(hello.src_rank);
  DTENJAX_RETURN_IF_ERROR(RandomBytes(challenge, 32));
  Proof(hs, "dtenjax-server", *client_rank, hs.my_rank, nonce_c, challenge, challenge + 32);
  DTENJAX_RETURN_IF_ERROR(SendFrame(fd, FrameType::kChallenge, hs, challenge, 64, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(
      RecvFrame(fd, FrameType::kResponse, hs, *client_rank, response, 32, deadline, peer, nullptr));
  Proof(hs, "dtenjax-client", *client_rank, hs.my_rank, challenge, nonce_c, want);
  if (!MacEqual(want, response, 32)) {
    Counters().rejected_auth.fetch_add(1);
    return DTENJAX_ERROR(Code::kPermissionDenied,
                         "dtenjax transport: " + peer + " failed authentication (wrong job secret)");
  }
  return SendFrame(fd, FrameType::kAccept, hs, nullptr, 0, deadline, peer);
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
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 64) != 0) {
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
  l->impl = new TcpListener{fd};
  *out = l;
  return Status::Ok();
}

Conn* MakeConn(int fd, int peer_rank, const std::string& peer) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  int buf = 4 << 20;
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  auto* c = new Conn;
  c->provider = TcpProvider();
  c->peer_rank = peer_rank;
  c->peer = peer;
  c->impl = new TcpConn{fd};
  return c;
}

Status TcpConnect(const std::string& ep, const Handshake& hs, double deadline, Conn** out) {
  sockaddr_in addr;
  DTENJAX_RETURN_IF_ERROR(ParseEndpoint(ep, &addr));
  const std::string peer = "rank " + std::to_string(hs.peer_rank) + " (" + ep + ")";
  std::string last = "never tried";
  while (NowSeconds() < deadline && !(hs.cancel && hs.cancel->load())) {
    int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    SYS_CHECK(fd, "socket");
    int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd pfd{fd, POLLOUT, 0};
      ::poll(&pfd, 1, std::max(1, int((deadline - NowSeconds()) * 1000)));
      int err = 0;
      socklen_t len = sizeof(err);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      rc = (pfd.revents & POLLOUT) && err == 0 ? 0 : -1;
      errno = err ? err : ETIMEDOUT;
    }
    if (rc == 0) {
      Status s = ClientHandshake(fd, hs, deadline, peer);
      if (!s.ok()) { ::close(fd); return s; }
      Counters().connections_opened.fetch_add(1);
      *out = MakeConn(fd, hs.peer_rank, peer);
      return Status::Ok();
    }
    last = std::strerror(errno);
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Timeout("connecting (last error: " + last + ") to", peer);
}

Status TcpAccept(Listener* l, const Handshake& hs, double deadline, Conn** out) {
  int lfd = static_cast<TcpListener*>(l->impl)->fd;
  const std::string want = hs.peer_rank >= 0 ? "rank " + std::to_string(hs.peer_rank) : "a peer";
  std::string last_rejection;
  while (true) {
    if (hs.cancel && hs.cancel->load()) {
      return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: stopped waiting for " + want +
                                                   " because connecting to the next rank failed");
    }
    if (NowSeconds() >= deadline) {
      return Timeout("waiting for " + want + " to connect" +
                         (last_rejection.empty() ? "" : " (rejected meanwhile: " + last_rejection + ")") +
                         " on",
                     l->endpoint);
    }
    pollfd pfd{lfd, POLLIN, 0};
    ::poll(&pfd, 1, PollMs(deadline));
    sockaddr_in from;
    socklen_t len = sizeof(from);
    int fd = ::accept4(lfd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) continue;
    char host[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &from.sin_addr, host, sizeof(host));
    const std::string peer = want + " (from " + host + ":" + std::to_string(ntohs(from.sin_port)) + ")";
    // An attacker or a stray client gets a bounded slice of time, then is dropped.
    int client = -1;
    Status s = ServerHandshake(fd, hs, std::min(deadline, NowSeconds() + 5.0), peer, &client);
    if (!s.ok()) {
      last_rejection = s.message();
      ::close(fd);
      continue;
    }
    Counters().connections_accepted.fetch_add(1);
    *out = MakeConn(fd, client, "rank " + std::to_string(client) + " (" + host + ")");
    return Status::Ok();
  }
}

Status TcpExchange(const SendOp* snd, const RecvOp* rcv, uint64_t job_id, int my_rank,
                   double deadline) {
  FrameHeader sh{};
  std::vector<uint8_t> corrupted;
  const uint8_t* spay = nullptr;
  uint64_t s_total = 0, s_done = 0;
  if (snd) {
    sh = MakeHeader(FrameType::kData, job_id, snd->seq, uint32_t(my_rank), snd->data, snd->bytes);
    spay = static_cast<const uint8_t*>(snd->data);
    if (snd->corrupt && snd->bytes > 0) {
      corrupted.assign(spay, spay + snd->bytes);
      corrupted[snd->bytes / 2] ^= 0x5A;
      spay = corrupted.data();
    }
    s_total = sizeof(sh) + snd->bytes;
  }
  FrameHeader rh{};
  uint64_t r_done = 0, r_total = rcv ? sizeof(rh) + rcv->bytes : 0;
  bool r_checked = false;
  while (s_done < s_total || r_done < r_total) {
    if (NowSeconds() >= deadline) {
      const Conn* c = (r_done < r_total) ? rcv->conn : snd->conn;
      return Timeout(r_done < r_total
                         ? "after receiving " + std::to_string(r_done) + " of " +
                               std::to_string(r_total) + " bytes from"
                         : "after sending " + std::to_string(s_done) + " of " +
                               std::to_string(s_total) + " bytes to",
                     c->peer);
    }
    pollfd pfd[2];
    int np = 0, si = -1, ri = -1;
    if (s_done < s_total) { si = np; pfd[np++] = pollfd{FdOf(snd->conn), POLLOUT, 0}; }
    if (r_done < r_total) { ri = np; pfd[np++] = pollfd{FdOf(rcv->conn), POLLIN, 0}; }
    int rc = ::poll(pfd, np, PollMs(deadline));
    if (rc < 0 && errno != EINTR) SYS_CHECK(rc, "poll");
    if (rc <= 0) continue;
    if (si >= 0 && pfd[si].revents) {
      iovec iov[2];
      int n = 0;
      if (s_done < sizeof(sh)) {
        iov[n++] = iovec{reinterpret_cast<uint8_t*>(&sh) + s_done, sizeof(sh) - s_done};
        if (snd->bytes) iov[n++] = iovec{const_cast<uint8_t*>(spay), snd->bytes};
      } else {
        iov[n++] = iovec{const_cast<uint8_t*>(spay) + (s_done - sizeof(sh)), s_total - s_done};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = n;
      ssize_t k = ::sendmsg(FdOf(snd->conn), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        s_done += uint64_t(k);
        if (s_done == s_total) {
          Counters().frames_sent.fetch_add(1);
          Counters().bytes_sent.fetch_add(s_total);
        }
      } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        return PeerGone(snd->conn->peer, std::strerror(errno));
      }
    }
    if (ri >= 0 && pfd[ri].revents) {
      uint8_t* dst;
      uint64_t want;
      if (r_done < sizeof(rh)) {
        dst = reinterpret_cast<uint8_t*>(&rh) + r_done;
        want = sizeof(rh) - r_done;
      } else {
        dst = static_cast<uint8_t*>(rcv->data) + (r_done - sizeof(rh));
        want = r_total - r_done;
      }
      ssize_t k = ::recv(FdOf(rcv->conn), dst, want, MSG_DONTWAIT);
      if (k == 0) return PeerGone(rcv->conn->peer, "end of stream");
      if (k < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          return PeerGone(rcv->conn->peer, std::strerror(errno));
        }
      } else {
        r_done += uint64_t(k);
        if (!r_checked && r_done >= sizeof(rh)) {
          r_checked = true;
          DTENJAX_RETURN_IF_ERROR(CheckHeader(
              rh, FrameExpect{FrameType::kData, job_id, rcv->seq, rcv->conn->peer_rank, rcv->bytes, true},
              rcv->conn->peer));
        }
        if (r_done == r_total) {
          DTENJAX_RETURN_IF_ERROR(CheckPayload(rh, rcv->data, rcv->conn->peer));
          Counters().frames_received.fetch_add(1);
          Counters().bytes_received.fetch_add(r_total);
        }
      }
    }
  }
  return Status::Ok();
}

void TcpShutdown(Conn* c) {
  if (c && c->impl) ::shutdown(FdOf(c), SHUT_RDWR);
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
  if (t && t->fd >= 0) ::close(t->fd);
  delete t;
  delete l;
}

const Provider kTcp = {"tcp", TcpCanConnect, TcpListen, TcpConnect, TcpAccept, TcpExchange,
                       TcpShutdown, TcpClose, TcpCloseListener};

}  // namespace

const Provider* TcpProvider() { return &kTcp; }

Status TcpRawIo(Conn* c, bool write, void* buf, size_t n, double deadline) {
  return IoAll(FdOf(c), write, buf, n, deadline, c->peer);
}

}  // namespace dtenjax::transport
