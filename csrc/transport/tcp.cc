// TCP provider: non-blocking sockets driven by poll() with deadlines, frames of frame.h, and a
// mutual HMAC-SHA256 challenge-response on every connection:
//   client -> HELLO(nonce_c)
//   server -> CHALLENGE(nonce_s || HMAC(k, "dtenjax-server" | job | client | server | nonce_c | nonce_s))
//   client -> RESPONSE(HMAC(k, "dtenjax-client" | job | client | server | nonce_s | nonce_c))
//   server -> ACCEPT (the first authenticated frame: proves both derived the same session keys)
// Each side proves knowledge of the job secret without sending it; fresh nonces defeat replay,
// and the per-connection keys (DeriveSession) authenticate every later frame.
//
// The server serves unauthenticated connections concurrently: each is a small state machine with
// its own deadline (Handshake::handshake_timeout_s); at most Handshake::max_pending are pending at
// once, and a new connection beyond that evicts the oldest pending one. A client that connects
// and stays silent therefore costs one slot for a bounded time and never delays another peer.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"

namespace dtenjax::transport {

namespace {

constexpr size_t kHdr = sizeof(FrameHeader);

struct TcpConn { int fd = -1; };

struct Pending {
  int fd = -1;
  double deadline = 0;
  std::string host;
  enum Stage { kHello, kResponse, kFlush } stage = kHello;
  uint8_t in[kHdr + 32];
  size_t have = 0;
  std::vector<uint8_t> out;
  size_t out_off = 0;
  uint8_t nonce_c[32], nonce_s[32];
  int client_rank = -1;
  std::unique_ptr<Session> session;
};

struct TcpListener {
  int fd = -1;
  std::vector<std::unique_ptr<Pending>> pending;
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

// Sends or receives exactly n bytes on a non-blocking socket by `deadline` (handshake only).
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

Status SendPlain(int fd, FrameType type, const Handshake& hs, const void* payload, uint64_t n,
                 double deadline, const std::string& peer) {
  FrameHeader h = MakePlainHeader(type, hs.job_id, uint32_t(hs.my_rank), n);
  std::vector<uint8_t> buf(kHdr + n);
  std::memcpy(buf.data(), &h, kHdr);
  if (n) std::memcpy(buf.data() + kHdr, payload, n);
  return IoAll(fd, true, buf.data(), buf.size(), deadline, peer);
}

Status RecvPlain(int fd, FrameType type, const Handshake& hs, int64_t src, void* payload,
                 uint64_t n, double deadline, const std::string& peer) {
  FrameHeader h;
  DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, &h, kHdr, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(CheckPlainHeader(h, FrameExpect{type, hs.job_id, src, n}, peer));
  if (n) DTENJAX_RETURN_IF_ERROR(IoAll(fd, false, payload, n, deadline, peer));
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

void TcpClose(Conn* c);

Status AuthFailed(const std::string& peer, const std::string& why) {
  Counters().rejected_auth.fetch_add(1);
  return DTENJAX_ERROR(Code::kPermissionDenied,
                       "dtenjax transport: " + peer + " failed authentication (" + why +
                           "); every process of the job must share one DTENJAX_JOB_SECRET");
}

Status ClientHandshake(int fd, const Handshake& hs, double deadline, const std::string& peer,
                       Conn** out) {
  uint8_t nonce_c[32], challenge[64], mine[32], response[32];
  DTENJAX_RETURN_IF_ERROR(crypto::RandomBytes(nonce_c, 32));
  DTENJAX_RETURN_IF_ERROR(SendPlain(fd, FrameType::kHello, hs, nonce_c, 32, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(
      RecvPlain(fd, FrameType::kChallenge, hs, hs.peer_rank, challenge, 64, deadline, peer));
  DTENJAX_RETURN_IF_ERROR(Proof(hs, "dtenjax-server", hs.my_rank, hs.peer_rank, nonce_c, challenge, mine));
  if (!crypto::Equal(mine, challenge + 32, 32)) return AuthFailed(peer, "its HMAC proof does not match");
  DTENJAX_RETURN_IF_ERROR(
      Proof(hs, "dtenjax-client", hs.my_rank, hs.peer_rank, challenge, nonce_c, response));
  DTENJAX_RETURN_IF_ERROR(SendPlain(fd, FrameType::kResponse, hs, response, 32, deadline, peer));
  auto session = std::make_unique<Session>();
  DTENJAX_RETURN_IF_ERROR(DeriveSession(hs.secret, hs.job_id, hs.my_rank, hs.peer_rank, nonce_c,
                                        challenge, /*is_client=*/true, session.get()));
  Conn* c = MakeConn(fd, hs.peer_rank, peer, hs, std::move(session));
  Status s = RecvSealed(c, FrameType::kAccept, nullptr, 0, deadline);
  if (!s.ok()) {
    static_cast<TcpConn*>(c->impl)->fd = -1;  // the caller closes fd
    TcpClose(c);
    if (s.code() == Code::kUnavailable) {
      return DTENJAX_ERROR(Code::kPermissionDenied,
                           "dtenjax transport: " + peer + " rejected our authentication (closed "
                           "the connection after our HMAC response); check that every process of "
                           "the job uses the same DTENJAX_JOB_SECRET");
    }
    return s;
  }
  *out = c;
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
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 128) != 0) {
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

Status TcpConnect(const std::string& ep, const Handshake& hs, double deadline, Conn** out) {
  sockaddr_in addr;
  DTENJAX_RETURN_IF_ERROR(ParseEndpoint(ep, &addr));
  DTENJAX_RETURN_IF_ERROR(crypto::Loaded());
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
      Conn* c = nullptr;
      Status s = ClientHandshake(fd, hs, deadline, peer, &c);
      if (!s.ok()) { ::close(fd); return s; }
      Counters().connections_opened.fetch_add(1);
      *out = c;
      return Status::Ok();
    }
    last = std::strerror(errno);
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Timeout("connecting (last error: " + last + ") to", peer);
}

// --- server side: concurrent handshakes ----------------------------------------------------------

void DropPending(TcpListener* t, size_t i) {
  if (t->pending[i]->fd >= 0) ::close(t->pending[i]->fd);
  t->pending.erase(t->pending.begin() + long(i));
  Counters().handshakes_pending.fetch_sub(1);
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
    return PeerGone(peer, k == 0 ? "end of stream" : std::strerror(errno));
  }
  return Status::Ok();
}

// Advances one pending handshake as far as its socket allows. *done: authenticated (p->session
// holds the keys); an error: reject it.
Status Advance(Pending* p, const Handshake& hs, const std::string& peer, bool* done) {
  *done = false;
  DTENJAX_RETURN_IF_ERROR(Flush(p, peer));
  if (p->stage == Pending::kFlush) {
    *done = p->out_off == p->out.size();
    return Status::Ok();
  }
  const size_t want = kHdr + 32;  // HELLO and RESPONSE both carry 32 bytes
  while (p->have < want) {
    const size_t upto = p->have < kHdr ? kHdr : want;  // the header alone first
    ssize_t k = ::recv(p->fd, p->in + p->have, upto - p->have, MSG_DONTWAIT);
    if (k > 0) {
      p->have += size_t(k);
      if (p->have == kHdr) {  // check the header before reading what it announces
        FrameHeader h;
        std::memcpy(&h, p->in, kHdr);
        if (p->stage == Pending::kHello) {
          DTENJAX_RETURN_IF_ERROR(
              CheckPlainHeader(h, FrameExpect{FrameType::kHello, hs.job_id, hs.peer_rank, 32}, peer));
        } else {
          DTENJAX_RETURN_IF_ERROR(CheckPlainHeader(
              h, FrameExpect{FrameType::kResponse, hs.job_id, p->client_rank, 32}, peer));
        }
      }
      continue;
    }
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return Status::Ok();
    return PeerGone(peer, k == 0 ? "end of stream" : std::strerror(errno));
  }
  FrameHeader h;
  std::memcpy(&h, p->in, kHdr);
  if (p->stage == Pending::kHello) {
    std::memcpy(p->nonce_c, p->in + kHdr, 32);
    p->client_rank = int(h.src_rank);
    uint8_t challenge[64];
    DTENJAX_RETURN_IF_ERROR(crypto::RandomBytes(p->nonce_s, 32));
    std::memcpy(challenge, p->nonce_s, 32);
    DTENJAX_RETURN_IF_ERROR(
        Proof(hs, "dtenjax-server", p->client_rank, hs.my_rank, p->nonce_c, p->nonce_s, challenge + 32));
    FrameHeader ch = MakePlainHeader(FrameType::kChallenge, hs.job_id, uint32_t(hs.my_rank), 64);
    Queue(p, &ch, kHdr);
    Queue(p, challenge, 64);
    p->stage = Pending::kResponse;
    p->have = 0;
    return Flush(p, peer);
  }
  uint8_t want_proof[32];
  DTENJAX_RETURN_IF_ERROR(
      Proof(hs, "dtenjax-client", p->client_rank, hs.my_rank, p->nonce_s, p->nonce_c, want_proof));
  if (!crypto::Equal(want_proof, p->in + kHdr, 32)) return AuthFailed(peer, "wrong job secret");
  p->session = std::make_unique<Session>();
  DTENJAX_RETURN_IF_ERROR(DeriveSession(hs.secret, hs.job_id, p->client_rank, hs.my_rank, p->nonce_c,
                                        p->nonce_s, /*is_client=*/false, p->session.get()));
  OutFrame accept;
  DTENJAX_RETURN_IF_ERROR(Seal(*p->session, FrameType::kAccept, hs.job_id, uint32_t(hs.my_rank),
                               Descriptor{}, nullptr, 0, &accept));
  Queue(p, accept.head, kSealedHeadBytes);
  Queue(p, accept.ptag, kTagBytes);
  p->stage = Pending::kFlush;
  DTENJAX_RETURN_IF_ERROR(Flush(p, peer));
  *done = p->out_off == p->out.size();
  return Status::Ok();
}

Status TcpAccept(Listener* l, const Handshake& hs, double deadline, Conn** out) {
  DTENJAX_RETURN_IF_ERROR(crypto::Loaded());
  auto* t = static_cast<TcpListener*>(l->impl);
  const std::string want = hs.peer_rank >= 0 ? "rank " + std::to_string(hs.peer_rank) : "a peer";
  const size_t cap = size_t(std::max(1, hs.max_pending));
  std::string last_rejection;
  std::vector<pollfd> pfds;
  while (true) {
    if (hs.cancel && hs.cancel->load()) {
      return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: stopped waiting for " + want +
                                                   " because connecting to the next rank failed");
    }
    const double now = NowSeconds();
    if (now >= deadline) {
      return Timeout("waiting for " + want + " to connect" +
                         (last_rejection.empty() ? "" : " (rejected meanwhile: " + last_rejection + ")") +
                         " on",
                     l->endpoint);
    }
    // Expire handshakes past their own deadline.
    for (size_t i = t->pending.size(); i-- > 0;) {
      if (now >= t->pending[i]->deadline) {
        Counters().handshakes_timed_out.fetch_add(1);
        last_rejection = "a connection from " + t->pending[i]->host + " did not complete the "
                         "handshake within " + std::to_string(hs.handshake_timeout_s) + " s";
        DropPending(t, i);
      }
    }
    double until = deadline;
    pfds.assign(1, pollfd{t->fd, POLLIN, 0});
    for (auto& p : t->pending) {
      short ev = p->out_off < p->out.size() ? POLLOUT : POLLIN;
      pfds.push_back(pollfd{p->fd, ev, 0});
      until = std::min(until, p->deadline);
    }
    ::poll(pfds.data(), nfds_t(pfds.size()), PollMs(until));
    // New connections: accept all that are waiting; at the cap, evict the oldest pending one.
    while (true) {
      sockaddr_in from;
      socklen_t len = sizeof(from);
      int fd = ::accept4(t->fd, reinterpret_cast<sockaddr*>(&from), &len,
                         SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;
      if (t->pending.size() >= cap) {
        Counters().handshakes_evicted.fetch_add(1);
        last_rejection = "evicted an unauthenticated connection from " + t->pending[0]->host +
                         " (more than " + std::to_string(cap) + " pending handshakes)";
        DropPending(t, 0);
      }
      auto p = std::make_unique<Pending>();
      p->fd = fd;
      p->deadline = NowSeconds() + hs.handshake_timeout_s;
      char host[INET_ADDRSTRLEN];
      inet_ntop(AF_INET, &from.sin_addr, host, sizeof(host));
      p->host = std::string(host) + ":" + std::to_string(ntohs(from.sin_port));
      t->pending.push_back(std::move(p));
      Counters().handshakes_pending.fetch_add(1);
    }
    // Progress every pending handshake (not only those poll flagged: cheap, and simpler).
    for (size_t i = 0; i < t->pending.size();) {
      Pending* p = t->pending[i].get();
      const std::string peer = want + " (from " + p->host + ")";
      bool done = false;
      Status s = Advance(p, hs, peer, &done);
      if (!s.ok()) {
        last_rejection = s.message();
        DropPending(t, i);
        continue;
      }
      if (done) {
        Counters().connections_accepted.fetch_add(1);
        Counters().frames_sent.fetch_add(1);   // the ACCEPT frame
        Counters().bytes_sent.fetch_add(kSealedHeadBytes + kTagBytes);
        const std::string desc = "rank " + std::to_string(p->client_rank) + " (" + p->host + ")";
        *out = MakeConn(p->fd, p->client_rank, desc, hs, std::move(p->session));
        p->fd = -1;
        DropPending(t, i);
        return Status::Ok();
      }
      ++i;
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
