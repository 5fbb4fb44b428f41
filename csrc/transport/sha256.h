// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104), written here so the transport's authentication
// has no OpenSSL dependency. Tested bit-for-bit against Python's hashlib/hmac (tests/test_transport.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dtenjax::transport {

class Sha256 {
 public:
  Sha256();
  void Update(const void* data, size_t n);
  void Final(uint8_t out[32]);

 private:
  void Block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

void Sha256Digest(const void* data, size_t n, uint8_t out[32]);
void HmacSha256(const void* key, size_t key_len, const void* msg, size_t msg_len, uint8_t out[32]);
// Constant-time comparison of two MACs.
bool MacEqual(const uint8_t* a, const uint8_t* b, size_t n);

}  // namespace dtenjax::transport
