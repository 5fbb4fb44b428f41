// libcrypto loaded at run time (crypto.h): HMAC-SHA256, constant-time comparison, random bytes
// and the GMAC that tags frames.
#include "csrc/transport/crypto.h"

#include <dlfcn.h>
#include <sys/random.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

namespace dtenjax::transport::crypto {

namespace {

// The few libcrypto entry points used, with their C signatures (OpenSSL 1.1 and 3.x).
struct Lib {
  void* handle = nullptr;
  std::string name;
  const void* (*evp_sha256)();
  unsigned char* (*hmac)(const void* md, const void* key, int key_len, const unsigned char* d,
                         size_t n, unsigned char* md_out, unsigned int* md_len);
  void* (*ctx_new)();
  void (*ctx_free)(void*);
  const void* (*aes_256_gcm)();
  int (*encrypt_init_ex)(void* ctx, const void* cipher, void* engine, const unsigned char* key,
                         const unsigned char* iv);
  int (*encrypt_update)(void* ctx, unsigned char* out, int* outl, const unsigned char* in, int inl);
  int (*encrypt_final_ex)(void* ctx, unsigned char* out, int* outl);
  int (*ctx_ctrl)(void* ctx, int type, int arg, void* ptr);
};

constexpr int kCtrlGcmGetTag = 0x10;  // EVP_CTRL_GCM_GET_TAG

std::mutex g_mu;
Lib g_lib;
Status g_status = DTENJAX_ERROR(Code::kUnavailable,
                                "libcrypto has not been loaded yet (the transport loads it when "
                                "the first communicator is created)");
bool g_tried = false;

Status TryLoad(const std::string& file, Lib* lib) {
  dlerror();
  void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return Status(Code::kUnavailable, e ? e : ("cannot dlopen " + file));
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(lib->evp_sha256, "EVP_sha256");
  sym(lib->hmac, "HMAC");
  sym(lib->ctx_new, "EVP_CIPHER_CTX_new");
  sym(lib->ctx_free, "EVP_CIPHER_CTX_free");
  sym(lib->aes_256_gcm, "EVP_aes_256_gcm");
  sym(lib->encrypt_init_ex, "EVP_EncryptInit_ex");
  sym(lib->encrypt_update, "EVP_EncryptUpdate");
  sym(lib->encrypt_final_ex, "EVP_EncryptFinal_ex");
  sym(lib->ctx_ctrl, "EVP_CIPHER_CTX_ctrl");
  if (!missing.empty()) {
    dlclose(h);
    return Status(Code::kUnavailable, file + " lacks " + missing);
  }
  lib->handle = h;
  lib->name = file;
  return Status::Ok();
}

}  // namespace

Status Load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_lib.handle) {
    if (!path.empty() && path != g_lib.name) {
      return DTENJAX_ERROR(Code::kInvalidArgument,
                           "libcrypto is already loaded from '" + g_lib.name +
                               "'; cannot switch to '" + path + "' in the same process");
    }
    return Status::Ok();
  }
  g_tried = true;
  std::vector<std::string> files;
  if (!path.empty()) {
    files.push_back(path);
  } else {
    files = {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"};
  }
  std::string why;
  for (const auto& f : files) {
    Lib lib;
    Status s = TryLoad(f, &lib);
    if (s.ok()) {
      g_lib = lib;
      g_status = Status::Ok();
      return g_status;
    }
    why += (why.empty() ? "" : "; ") + s.message();
  }
  g_status = DTENJAX_ERROR(
      Code::kUnavailable,
      "the dtenjax transport authenticates every connection and frame with OpenSSL's libcrypto, "
      "which could not be loaded (" + why + "). Install it (Debian/Ubuntu: apt-get install "
      "libssl3) or point DTENJAX_LIBCRYPTO at libcrypto.so; without it no transport connection "
      "is made (fail closed)");
  return g_status;
}

Status Loaded() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_status;
}

std::string LibraryName() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_lib.name;
}

namespace {
Status Need() {
  // g_lib is written once under g_mu before g_status turns OK; read the status under the lock.
  return Loaded();
}
}  // namespace

Status HmacSha256(const void* key, size_t key_len, const void* msg, size_t msg_len,
                  uint8_t out[32]) {
  DTENJAX_RETURN_IF_ERROR(Need());
  if (key_len > size_t(INT_MAX)) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "HMAC key of " + std::to_string(key_len) +
                                                     " bytes is too long");
  }
  unsigned int len = 0;
  static const uint8_t kEmpty[1] = {0};
  if (!g_lib.hmac(g_lib.evp_sha256(), key_len ? key : kEmpty, int(key_len),
                  static_cast<const unsigned char*>(msg_len ? msg : kEmpty), msg_len, out, &len) ||
      len != 32) {
    return DTENJAX_ERROR(Code::kInternal, "libcrypto HMAC-SHA256 failed");
  }
  return Status::Ok();
}

bool Equal(const void* a, const void* b, size_t n) {
  const volatile uint8_t* x = static_cast<const volatile uint8_t*>(a);
  const volatile uint8_t* y = static_cast<const volatile uint8_t*>(b);
  uint8_t d = 0;
  for (size_t i = 0; i < n; ++i) d |= uint8_t(x[i] ^ y[i]);
  return d == 0;
}

Status RandomBytes(void* out, size_t n) {
  uint8_t* p = static_cast<uint8_t*>(out);
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return DTENJAX_ERROR(Code::kInternal, std::string("getrandom failed: ") + std::strerror(errno));
    }
    p += got;
    n -= size_t(got);
  }
  return Status::Ok();
}

Gmac::~Gmac() {
  if (ctx_) g_lib.ctx_free(ctx_);
}

Status Gmac::Init(const uint8_t key[kKeyBytes]) {
  DTENJAX_RETURN_IF_ERROR(Need());
  if (!ctx_) ctx_ = g_lib.ctx_new();
  if (!ctx_) return DTENJAX_ERROR(Code::kResourceExhausted, "EVP_CIPHER_CTX_new failed");
  if (g_lib.encrypt_init_ex(ctx_, g_lib.aes_256_gcm(), nullptr, key, nullptr) != 1) {
    return DTENJAX_ERROR(Code::kInternal, "EVP_EncryptInit_ex(aes-256-gcm) failed");
  }
  return Status::Ok();
}

Status Gmac::Tag(uint64_t counter, uint32_t label, const void* a, size_t an, const void* b,
                 size_t bn, uint8_t out[kTagBytes]) {
  if (!ctx_) return DTENJAX_ERROR(Code::kInternal, "GMAC used before Init");
  uint8_t iv[12];
  for (int i = 0; i < 8; ++i) iv[i] = uint8_t(counter >> (8 * i));
  for (int i = 0; i < 4; ++i) iv[8 + i] = uint8_t(label >> (8 * i));
  if (g_lib.encrypt_init_ex(ctx_, nullptr, nullptr, nullptr, iv) != 1) {
    return DTENJAX_ERROR(Code::kInternal, "EVP_EncryptInit_ex (nonce) failed");
  }
  int outl = 0;
  for (const auto& [ptr, len] : {std::pair<const void*, size_t>{a, an}, {b, bn}}) {
    const uint8_t* p = static_cast<const uint8_t*>(ptr);
    size_t left = len;
    while (left > 0) {
      int piece = int(std::min<size_t>(left, size_t(1) << 30));
      if (g_lib.encrypt_update(ctx_, nullptr, &outl, p, piece) != 1) {
        return DTENJAX_ERROR(Code::kInternal, "EVP_EncryptUpdate (GMAC data) failed");
      }
      p += piece;
      left -= size_t(piece);
    }
  }
  uint8_t unused[16];
  if (g_lib.encrypt_final_ex(ctx_, unused, &outl) != 1 ||
      g_lib.ctx_ctrl(ctx_, kCtrlGcmGetTag, int(kTagBytes), out) != 1) {
    return DTENJAX_ERROR(Code::kInternal, "EVP_EncryptFinal_ex / GET_TAG failed");
  }
  return Status::Ok();
}

}  // namespace dtenjax::transport::crypto
