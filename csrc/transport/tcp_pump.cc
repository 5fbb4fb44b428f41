// TCP provider, the byte pump of an authenticated connection: frames (frame.h) handed to and taken
// from a non-blocking socket as far as it goes without blocking (sendmsg/readv of head, payload
// and tag in place, no copy), waits on poll(), and the half-close that lets an ABORT frame
// arrive. The connection comes from the handshake (tcp_handshake.cc, tcp_accept.cc: MakeConn).
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tcp_impl.h"

namespace dtenjax::transport::tcp {

namespace {

struct TcpConn { int fd = -1; };

int FdOf(Conn* c) { return static_cast<TcpConn*>(c->impl)->fd; }

// A watch (InFrame::watch) is told, not counted: its caller decides whether the close failed it.
Status PeerGone(const std::string& peer, const char* why, InFrame* watch = nullptr) {
  if (watch && watch->watch) {
    watch->closed = true;
  } else {
    CountPeerFailure();
  }
  return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: lost connection to " + peer + " (" +
                                               why + "); that process died or aborted the collective");
}

}  // namespace

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
    return PeerGone(c->peer, k == 0 ? "end of stream" : std::strerror(errno), f);
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

}  // namespace dtenjax::transport::tcp
