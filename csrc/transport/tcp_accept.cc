// TCP provider, the server side of the handshake (the protocol: tcp_handshake.cc).
//
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
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/peer_text.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tcp_impl.h"

namespace dtenjax::transport::tcp {

namespace {

constexpr size_t kHelloBytes = kHdr + 32;      // HELLO and RESPONSE both carry 32 bytes
constexpr double kGrace = 0.25;                // s a new pending handshake is protected
constexpr int kAcceptBurst = 256;              // connections taken from the backlog per poll

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

}  // namespace

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

namespace {

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
}  // namespace

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

}  // namespace dtenjax::transport::tcp
