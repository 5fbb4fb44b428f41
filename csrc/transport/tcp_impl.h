// What the files of the TCP provider share, private to them (everything else sees the provider
// only as TcpProvider(), provider.h). The provider is four files, one idea each:
//   tcp.cc            the Provider record; endpoints, poll slices, message texts the files share;
//   tcp_handshake.cc  the authenticated handshake (HMAC challenge-response) and its client side;
//   tcp_accept.cc     the server side: concurrent handshakes and flood resistance;
//   tcp_pump.cc       the byte pump of an authenticated connection (frames in and out, waits).
#pragma once

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"

namespace dtenjax::transport::tcp {

constexpr size_t kHdr = sizeof(FrameHeader);

// --- tcp.cc: endpoints, the poll slice, message texts --------------------------------------------
Status SetNonBlocking(int fd);
// "tcp://A.B.C.D:PORT" -> an IPv4 socket address.
Status ParseEndpoint(const std::string& ep, sockaddr_in* addr);
// poll() timeout until `until`, in slices of at most 20 ms (a waiter notices Comm::Close within).
int PollMs(double until);
std::string Seconds(double s);  // "%.3g"
// A status message without its "dtenjax transport: " prefix (to quote it inside another).
std::string Unprefixed(const std::string& message);
// A handshake connection that closed (not counted as a peer failure: the client may retry).
Status Closed(const std::string& peer, const std::string& why);

// --- tcp_handshake.cc: what both sides of the handshake use --------------------------------------
// Closes a handshake socket after (optionally, hs set) a REJECT, so that the REJECT is delivered.
void RejectAndClose(int fd, const Handshake* hs, RejectClass cls, const Status& why);
// HMAC(secret, label | job | client | server | n1 | n2): one side's proof of the job secret.
Status Proof(const Handshake& hs, const char* label, int client, int server, const uint8_t* n1,
             const uint8_t* n2, uint8_t out[32]);
Status AuthFailed(const std::string& peer, const std::string& why);

// --- tcp_pump.cc: an authenticated connection ----------------------------------------------------
// The connection over socket `fd` once its handshake succeeded (sets the data path's options).
Conn* MakeConn(int fd, int peer_rank, const std::string& peer, const Handshake& hs,
               std::unique_ptr<Session> session);

// --- the Provider record's entries (tcp.cc holds the record) -------------------------------------
// tcp_handshake.cc
bool TcpCanConnect(const std::string& ep);
Status TcpConnect(const std::string& ep, const Handshake& hs, double deadline, Conn** out);
// tcp_accept.cc
Status TcpListen(const std::string& bind_address, Listener** out);
Status TcpAccept(Listener* l, const Handshake& hs, double deadline, Conn** out);
void TcpCloseListener(Listener* l);
// tcp_pump.cc
Status TcpSendSome(Conn* c, OutFrame* f, bool* progress);
Status TcpRecvSome(Conn* c, InFrame* f, bool* progress);
Status TcpWait(const WaitItem* items, int n, double until);
void TcpShutdown(Conn* c);
void TcpClose(Conn* c);

}  // namespace dtenjax::transport::tcp
