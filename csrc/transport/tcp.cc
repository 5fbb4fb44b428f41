// TCP provider: non-blocking sockets driven by poll() with deadlines, frames of frame.h, and a
// mutual HMAC-SHA256 challenge-response on every connection (tcp_handshake.cc), served
// concurrently and resistant to floods of unauthenticated connections on the listening side
// (tcp_accept.cc); authenticated connections move frames with the byte pump (tcp_pump.cc).
// This file holds the Provider record and what those files share (tcp_impl.h): endpoints, the
// poll slice, message texts.
#include "csrc/transport/tcp_impl.h"

#include <arpa/inet.h>
#include <fcntl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "csrc/transport/provider.h"

namespace dtenjax::transport {
namespace tcp {

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

// A handshake connection that closed (not counted as a peer failure: the client may retry).
Status Closed(const std::string& peer, const std::string& why) {
  return DTENJAX_ERROR(Code::kUnavailable, "dtenjax transport: " + peer + " " + why);
}

}  // namespace tcp

namespace {

using namespace tcp;  // NOLINT

const Provider kTcp = {"tcp", 0, TcpCanConnect, TcpListen, TcpConnect, TcpAccept, TcpSendSome,
                       TcpRecvSome, TcpWait, TcpShutdown, TcpClose, TcpCloseListener};

}  // namespace

const Provider* TcpProvider() { return &kTcp; }

DTENJAX_REGISTER_PROVIDER(tcp, TcpProvider);

}  // namespace dtenjax::transport
