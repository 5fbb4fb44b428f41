// A peer's text made safe for messages and logs (peer_text.h), a peer's status code, and the
// reason an ABORT frame carries.
#include "csrc/transport/peer_text.h"

#include <cstdint>
#include <cstdio>

namespace dtenjax::transport {

namespace {

void Escape(std::string* out, uint8_t b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "\\x%02x", b);
  *out += buf;
}

// Length of the well-formed UTF-8 sequence of a printable code point at p (0: none).
size_t PrintableUtf8(const uint8_t* p, size_t n) {
  uint32_t cp;
  size_t len;
  if (p[0] >= 0xC2 && p[0] <= 0xDF) {
    len = 2, cp = p[0] & 0x1F;
  } else if (p[0] >= 0xE0 && p[0] <= 0xEF) {
    len = 3, cp = p[0] & 0x0F;
  } else if (p[0] >= 0xF0 && p[0] <= 0xF4) {
    len = 4, cp = p[0] & 0x07;
  } else {
    return 0;
  }
  if (len > n) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;  // overlong
  if (cp < 0xA0) return 0;                                            // C1 controls
  if (cp == 0x2028 || cp == 0x2029) return 0;                         // line separators
  if ((cp >= 0x202A && cp <= 0x202E) || (cp >= 0x2066 && cp <= 0x2069)) return 0;  // bidi
  if (cp == 0xFEFF || (cp >= 0xFFF9 && cp <= 0xFFFB)) return 0;
  return len;
}

}  // namespace

std::string PeerText(const char* data, size_t n, size_t cap) {
  const auto* p = reinterpret_cast<const uint8_t*>(data);
  const size_t take = n < cap ? n : cap;
  std::string out;
  out.reserve(take + 16);
  for (size_t i = 0; i < take;) {
    const uint8_t b = p[i];
    if (b == '\\') {
      out += "\\\\";
      ++i;
    } else if (b >= 0x20 && b < 0x7F) {
      out.push_back(char(b));
      ++i;
    } else if (size_t len = b >= 0x80 ? PrintableUtf8(p + i, take - i) : 0) {
      out.append(data + i, len);
      i += len;
    } else {
      Escape(&out, b);
      ++i;
    }
  }
  if (n > take) out += "... (" + std::to_string(n) + " bytes, cut at " + std::to_string(cap) + ")";
  return out;
}

Code PeerCode(int code) {
  if (!IsCode(code) || code == int(Code::kOk)) return Code::kInternal;
  return code == int(Code::kCancelled) ? Code::kUnavailable : static_cast<Code>(code);
}

std::string AbortReason(const uint8_t* payload, size_t n, size_t cap, Code* code) {
  if (n == 0) {
    *code = Code::kInternal;
    return "(no reason given)";
  }
  *code = PeerCode(payload[0]);
  return PeerText(reinterpret_cast<const char*>(payload) + 1, n - 1, cap);  // the peer's words
}

}  // namespace dtenjax::transport
