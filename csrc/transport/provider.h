// The transport provider interface: a small table of functions, one provider per file (tcp.cc,
// verbs.cc), as NCCL's src/transport/ does. A communicator only talks to a Provider*.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"

namespace dtenjax::transport {

struct Provider;

// Who we are and who we expect on the other side; the secret keys the HMAC challenge-response.
struct Handshake {
  uint64_t job_id = 0;
  int my_rank = 0;
  int peer_rank = -1;  // -1: any member of the job
  std::string secret;
  const std::atomic<bool>* cancel = nullptr;  // accept/connect give up early when set
};

struct Conn {
  const Provider* provider = nullptr;
  int peer_rank = -1;
  std::string peer;  // description for messages, e.g. "rank 2 (tcp://127.0.0.1:4711)"
  void* impl = nullptr;
};

struct Listener {
  const Provider* provider = nullptr;
  std::string endpoint;  // what peers pass to connect(), e.g. "tcp://127.0.0.1:4711"
  void* impl = nullptr;
};

struct SendOp {
  Conn* conn;
  uint64_t seq;
  const void* data;
  uint64_t bytes;
  bool corrupt;  // fault injection: flip a payload byte after the checksum is computed
};

struct RecvOp {
  Conn* conn;
  uint64_t seq;
  void* data;
  uint64_t bytes;  // exact size expected
};

struct Provider {
  const char* name;
  // Whether this provider can reach `endpoint` (a string another process published).
  bool (*can_connect)(const std::string& endpoint);
  Status (*listen)(const std::string& bind_address, Listener** out);
  // Connect and authenticate as the client of the handshake; retries until `deadline`.
  Status (*connect)(const std::string& endpoint, const Handshake& hs, double deadline, Conn** out);
  // Accept and authenticate one peer; unauthenticated or malformed attempts are rejected, counted
  // and skipped while waiting until `deadline`.
  Status (*accept)(Listener* l, const Handshake& hs, double deadline, Conn** out);
  // Progress one send and one receive together (either may be null) so that ranks that send to
  // each other never deadlock on full buffers. Fails with kDeadlineExceeded at `deadline`.
  Status (*exchange)(const SendOp* send, const RecvOp* recv, uint64_t job_id, int my_rank,
                     double deadline);
  // Wake the peer (it sees end-of-stream) without freeing; used to propagate an abort.
  void (*shutdown)(Conn* c);
  void (*close)(Conn* c);
  void (*close_listener)(Listener* l);
};

const Provider* TcpProvider();
#ifdef DTENJAX_HAVE_VERBS
const Provider* VerbsProvider();
#endif

// Raw bytes over an authenticated TCP connection (the verbs provider's side channel for QP
// set-up): exactly n bytes by `deadline`.
Status TcpRawIo(Conn* c, bool write, void* buf, size_t n, double deadline);

// Random bytes from the kernel (getrandom); for nonces and job secrets.
Status RandomBytes(void* out, size_t n);

}  // namespace dtenjax::transport
