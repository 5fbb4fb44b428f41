// Text that a peer sent (REJECT reasons, ABORT reasons, call-site and fingerprint texts) is data,
// never trusted to be well formed: PeerText decodes it defensively before it reaches an error
// message or a log. The result is always valid UTF-8 with no control characters: printable ASCII
// and well-formed UTF-8 sequences of printable code points pass; every other byte (invalid UTF-8,
// ANSI escapes, C0/C1 controls, newlines, bidirectional overrides) becomes `\xNN`, and a
// backslash becomes `\\`. At most `cap` bytes of the input are read; a longer text is cut there
// and says how long it was.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"

namespace dtenjax::transport {

// Longest peer text (input bytes) that reaches a message.
constexpr size_t kMaxPeerTextShown = 512;

std::string PeerText(const char* data, size_t n, size_t cap = kMaxPeerTextShown);
inline std::string PeerText(const std::string& s, size_t cap = kMaxPeerTextShown) {
  return PeerText(s.data(), s.size(), cap);
}

// The status code a peer sent (REJECT, ABORT) as this process reports it: a code that is not one
// (or ok) is kInternal, and the peer's kCancelled (it closed its own communicator) is kUnavailable
// here: for this process the peer went away, nothing was cancelled locally.
Code PeerCode(int code);

// The reason an ABORT frame carries (its payload: the sender's status code byte, then its text)
// as this process reports it: the code through PeerCode, the text through PeerText (at most `cap`
// bytes of it); an empty payload gives kInternal and "(no reason given)".
std::string AbortReason(const uint8_t* payload, size_t n, size_t cap, Code* code);

}  // namespace dtenjax::transport
