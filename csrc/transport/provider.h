// The transport provider interface: a small table of functions, one provider per group of files
// (tcp*.cc, verbs*.cc), as NCCL's src/transport/ does, and a registry the providers add
// themselves to:
//
//   DTENJAX_REGISTER_PROVIDER(tcp, TcpProvider);   // at the end of tcp.cc
//
// A provider moves bytes and authenticates connections; frames, tags, collective descriptors and
// the ring schedule are provider-independent (frame.h, ring.cc). Adding a provider is one file
// here plus one line in the Python provider table (dtenjax/_src/net/transport.py PROVIDERS).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "csrc/common/status.h"
#include "csrc/transport/frame.h"

namespace dtenjax::transport {

struct Provider;

// Who we are and who we expect on the other side; the secret keys the HMAC challenge-response.
struct Handshake {
  uint64_t job_id = 0;
  int my_rank = 0;
  int peer_rank = -1;  // -1: any member of the job
  std::string secret;
  const std::atomic<bool>* cancel = nullptr;  // accept/connect give up early when set
  // accept gives up once NowSeconds() passes *give_up_at (when set and > 0): a rank whose own
  // set-up failed still waits a moment for its previous rank, to tell it why.
  const std::atomic<double>* give_up_at = nullptr;
  double handshake_timeout_s = 10;            // per unauthenticated connection (server side)
  int max_pending = 16;                       // unauthenticated connections served at once
};
// Whether accept/connect should stop now (cancelled, or past give_up_at).
bool GiveUp(const Handshake& hs);

struct Conn {
  const Provider* provider = nullptr;
  int peer_rank = -1;
  std::string peer;  // description for messages, e.g. "rank 2 (tcp://127.0.0.1:4711)"
  uint64_t job_id = 0;
  int my_rank = 0;
  std::unique_ptr<Session> session;  // keys and frame counters, from the handshake
  void* impl = nullptr;
};

struct Listener {
  const Provider* provider = nullptr;
  std::string endpoint;  // what peers pass to connect(), e.g. "tcp://127.0.0.1:4711"
  void* impl = nullptr;
};

// One connection and the directions a waiter wants to make progress in.
struct WaitItem {
  Conn* conn;
  bool send;
  bool recv;
};

struct Provider {
  const char* name;
  // Largest payload of one frame (0: no limit beyond kMaxFramePayload).
  uint64_t max_payload;
  // Whether this provider can reach `endpoint` (a string another process published).
  bool (*can_connect)(const std::string& endpoint);
  Status (*listen)(const std::string& bind_address, Listener** out);
  // Connect and authenticate as the client of the handshake. Retries with exponential backoff
  // and jitter until `deadline` while retrying can help (the peer is not listening yet, is busy,
  // or closed the connection); fails at once when the peer refused it for a reason retrying
  // cannot change (another protocol version, job, ring position or secret), naming the reason.
  Status (*connect)(const std::string& endpoint, const Handshake& hs, double deadline, Conn** out);
  // Accept and authenticate one peer. Unauthenticated connections are served concurrently, each
  // with its own deadline and at most hs.max_pending at once (tcp_accept.cc says which one gives
  // way to a newcomer); every rejected one is told why (REJECT frame), counted and skipped.
  Status (*accept)(Listener* l, const Handshake& hs, double deadline, Conn** out);
  // Hands as much of `f` to the connection as it takes now; never blocks (but verbs, once the
  // peer has closed, waits up to 1 s for the completions its last work is owed: verbs_pump.cc).
  Status (*send_some)(Conn* c, OutFrame* f, bool* progress);
  // Receives what has arrived of `f` without blocking (verbs: as send_some). Stops at
  // InFrame::kHeadReady (the caller authenticates the head, sets dst/payload_bytes and
  // stage = kBody) and at kDone.
  Status (*recv_some)(Conn* c, InFrame* f, bool* progress);
  // Blocks until one item can progress in a wanted direction, or `until` (no error at `until`).
  Status (*wait)(const WaitItem* items, int n, double until);
  // Stop sending (the peer reads what was sent, then end-of-stream) without freeing; used after
  // an abort.
  void (*shutdown)(Conn* c);
  void (*close)(Conn* c);
  void (*close_listener)(Listener* l);
};

// --- provider registry --------------------------------------------------------------------------
std::vector<const Provider*>& Providers();
const Provider* FindProvider(const std::string& name);  // nullptr if not in this build
const Provider* TcpProvider();

struct ProviderRegistrar {
  explicit ProviderRegistrar(const Provider* p) { Providers().push_back(p); }
};

#define DTENJAX_REGISTER_PROVIDER(name, getter) \
  static ::dtenjax::transport::ProviderRegistrar dtenjax_provider_registrar_##name(getter())

// --- blocking helpers over any provider (handshake ACCEPT, control frames, aborts) ---------------
// Sends one authenticated frame by `deadline`; stops early (kCancelled) once *cancel is set.
Status SendSealed(Conn* c, FrameType type, const Descriptor& d, const void* payload, uint64_t n,
                  double deadline, const std::atomic<bool>* cancel = nullptr);
// Receives one authenticated frame of `type` with exactly `n` payload bytes into `payload`. An
// ABORT frame instead is the peer's reason to give up: it is returned as the error.
Status RecvSealed(Conn* c, FrameType type, void* payload, uint64_t n, double deadline);

double NowSeconds();  // monotonic clock (tenancy.cc)

}  // namespace dtenjax::transport
