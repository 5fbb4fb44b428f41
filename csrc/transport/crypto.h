// Cryptography of the host transport, from OpenSSL's libcrypto loaded at run time (dlopen, like
// libibverbs), so the extension imports and links without it. Fail closed: when libcrypto cannot
// be loaded, every function that needs it returns kUnavailable saying which file was tried and
// how to fix it, and no connection is ever made without authentication.
//
//   HMAC-SHA256 (HMAC from libcrypto)  handshake proofs and key derivation
//   AES-256-GMAC (EVP aes-256-gcm with the data passed as additional authenticated data only)
//                                      the tag of every frame after the handshake; 4-5x faster
//                                      than HMAC-SHA256 on the machines we measured (docs/transport.md)
// There is no unkeyed checksum: TCP has its own, and only the keyed tags stop an attacker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "csrc/common/status.h"

namespace dtenjax::transport::crypto {

// Loads libcrypto once per process. `path` empty: libcrypto.so.3, then libcrypto.so.1.1, then
// libcrypto.so. A later call with another path is refused if a library is already loaded.
Status Load(const std::string& path);
// OK once loaded; otherwise why not (never tried, or the dlopen/dlsym failure).
Status Loaded();
// The file that was loaded ("" before).
std::string LibraryName();

Status HmacSha256(const void* key, size_t key_len, const void* msg, size_t msg_len,
                  uint8_t out[32]);
// Constant-time comparison.
bool Equal(const void* a, const void* b, size_t n);
// Random bytes from the kernel (getrandom); nonces and secrets.
Status RandomBytes(void* out, size_t n);

constexpr size_t kTagBytes = 16;
constexpr size_t kKeyBytes = 32;

// AES-256-GMAC under one key. The 96-bit nonce is (counter, label): every (counter, label) pair
// must be used at most once per key, which the frame layer guarantees (per-direction keys, a
// frame counter that only grows, distinct labels for header and payload tags).
class Gmac {
 public:
  Gmac() = default;
  ~Gmac();
  Gmac(const Gmac&) = delete;
  Gmac& operator=(const Gmac&) = delete;
  Status Init(const uint8_t key[kKeyBytes]);
  bool ready() const { return ctx_ != nullptr; }
  // Tag over a || b (either may be empty).
  Status Tag(uint64_t counter, uint32_t label, const void* a, size_t an, const void* b, size_t bn,
             uint8_t out[kTagBytes]);

 private:
  void* ctx_ = nullptr;  // EVP_CIPHER_CTX*
};

}  // namespace dtenjax::transport::crypto
