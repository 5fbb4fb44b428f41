// Fingerprints of collectives (fingerprint.h): their key, digest, wire encoding, descriptions and
// differences, and the table of call sites.
#include "csrc/transport/fingerprint.h"

#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "csrc/transport/crypto.h"
#include "csrc/transport/peer_text.h"

namespace dtenjax::transport {

namespace {

void PutLe(std::string* m, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) m->push_back(char(uint8_t(v >> (8 * i))));
}

uint64_t GetLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(p[i]) << (8 * i);
  return v;
}

void PutText(std::string* m, const std::string& s, size_t cap, int len_bytes) {
  const std::string t = s.substr(0, cap);
  PutLe(m, t.size(), len_bytes);
  *m += t;
}

std::mutex g_sites_mu;
std::map<uint64_t, std::pair<std::string, std::string>>& Sites() {
  static auto* sites = new std::map<uint64_t, std::pair<std::string, std::string>>();
  return *sites;
}
constexpr size_t kMaxSites = 1 << 20;

}  // namespace

Status DeriveFingerprintKey(const std::string& secret, uint64_t job_id,
                            uint8_t key[kFingerprintKeyBytes]) {
  std::string m = "dtenjax-fingerprint-key";
  PutLe(&m, job_id, 8);
  return crypto::HmacSha256(secret.data(), secret.size(), m.data(), m.size(), key);
}

Status MakeFingerprint(const uint8_t key[kFingerprintKeyBytes], const Descriptor& d,
                       uint64_t site_id, const std::string& thread, Fingerprint* out) {
  out->op = d.op;
  out->dtype = d.dtype;
  out->count = d.count;
  out->tag = d.tag;
  out->thread = thread.substr(0, kMaxThreadText);
  if (!LookupSite(site_id, &out->site, &out->signature)) {
    char id[32];
    std::snprintf(id, sizeof(id), "id 0x%016llx", static_cast<unsigned long long>(site_id));
    out->site = id;   // not registered in this process: the id itself identifies the call
    out->signature.clear();
  }
  std::string m = "dtenjax-fingerprint-v1";
  m.push_back(char(out->op));
  m.push_back(char(out->dtype));
  PutLe(&m, out->count, 8);
  PutLe(&m, out->tag, 4);
  PutText(&m, out->signature, kMaxSignatureText, 4);
  PutText(&m, out->site, kMaxSiteText, 4);
  PutText(&m, out->thread, kMaxThreadText, 4);
  uint8_t mac[32];
  DTENJAX_RETURN_IF_ERROR(crypto::HmacSha256(key, kFingerprintKeyBytes, m.data(), m.size(), mac));
  out->digest = GetLe(mac, 8);
  return Status::Ok();
}

std::string EncodeFingerprint(const Fingerprint& f, bool full) {
  std::string m;
  PutLe(&m, f.digest, 8);
  m.push_back(char(full ? 1 : 0));
  if (!full) return m;
  m.push_back(char(f.op));
  m.push_back(char(f.dtype));
  PutLe(&m, f.tag, 4);
  PutLe(&m, f.count, 8);
  PutText(&m, f.signature, kMaxSignatureText, 2);
  PutText(&m, f.site, kMaxSiteText, 2);
  PutText(&m, f.thread, kMaxThreadText, 2);
  return m;
}

Status DecodeFingerprint(const uint8_t* p, uint64_t n, const std::string& peer, Fingerprint* out,
                         bool* full) {
  auto bad = [&](const std::string& what) {
    Counters().rejected_bad_header.fetch_add(1);
    return DTENJAX_ERROR(Code::kDataLoss, "dtenjax transport: rejected FINGERPRINT frame from " +
                                              peer + ": " + what);
  };
  if (n < 9) return bad(std::to_string(n) + " bytes (at least 9)");
  out->digest = GetLe(p, 8);
  *full = p[8] != 0;
  if (!*full) return n == 9 ? Status::Ok() : bad("a digest-only record of " + std::to_string(n) + " bytes");
  uint64_t at = 9;
  if (n < at + 14) return bad("a record cut short");
  out->op = p[at];
  out->dtype = p[at + 1];
  out->tag = uint32_t(GetLe(p + at + 2, 4));
  out->count = GetLe(p + at + 6, 8);
  at += 14;
  std::string* texts[3] = {&out->signature, &out->site, &out->thread};
  const size_t caps[3] = {kMaxSignatureText, kMaxSiteText, kMaxThreadText};
  for (int i = 0; i < 3; ++i) {
    if (n < at + 2) return bad("a record cut short");
    const uint64_t len = GetLe(p + at, 2);
    at += 2;
    if (len > caps[i] || n < at + len) return bad("a text of " + std::to_string(len) + " bytes");
    *texts[i] = PeerText(reinterpret_cast<const char*>(p + at), len, caps[i]);
    at += len;
  }
  if (at != n) return bad(std::to_string(n - at) + " bytes after the record");
  return Status::Ok();
}

std::string DescribeFingerprint(const Fingerprint& f) {
  std::string s = std::string("op=") + ReduceOpName(f.op) + ", dtype=" + DTypeName(f.dtype) +
                  ", count=" + std::to_string(f.count);
  if (f.tag) s += ", tag=" + std::to_string(f.tag);
  if (!f.signature.empty()) s += ", " + f.signature;
  s += ", site '" + f.site + "'";
  if (!f.thread.empty()) s += ", thread '" + f.thread + "'";
  return s;
}

std::string FingerprintDifference(const Fingerprint& a, const Fingerprint& b) {
  std::vector<std::string> d;
  if (a.op != b.op) d.push_back("op");
  if (a.dtype != b.dtype) d.push_back("dtype");
  if (a.count != b.count) d.push_back("count");
  if (a.tag != b.tag) d.push_back("tag");
  if (a.signature != b.signature) d.push_back("signature (dtype, shape, algorithm, contract)");
  if (a.site != b.site) d.push_back("call site");
  if (a.thread != b.thread) d.push_back("thread");
  std::string s;
  for (const auto& x : d) s += (s.empty() ? "" : ", ") + x;
  return s.empty() ? "the digest only (different texts that print alike)" : s;
}

Status RegisterSite(uint64_t id, const std::string& site, const std::string& signature) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  auto value = std::make_pair(site.substr(0, kMaxSiteText), signature.substr(0, kMaxSignatureText));
  auto it = Sites().find(id);
  if (it != Sites().end()) {
    if (it->second == value) return Status::Ok();
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "dtenjax transport: call-site id " + std::to_string(id) +
                             " is registered for '" + it->second.first + "' [" +
                             it->second.second + "] and now for '" + value.first + "' [" +
                             value.second + "]: two calls may not share an id (pass another "
                             "site=(id, text), or leave site= to the default)");
  }
  if (Sites().size() >= kMaxSites) {
    return DTENJAX_ERROR(Code::kResourceExhausted,
                         "dtenjax transport: more than " + std::to_string(kMaxSites) +
                             " distinct collective call sites in this process (are call sites "
                             "generated, e.g. by a str tag per step? pass an int tag instead)");
  }
  Sites()[id] = std::move(value);
  return Status::Ok();
}

bool LookupSite(uint64_t id, std::string* site, std::string* signature) {
  std::lock_guard<std::mutex> lock(g_sites_mu);
  auto it = Sites().find(id);
  if (it == Sites().end()) return false;
  *site = it->second.first;
  *signature = it->second.second;
  return true;
}

}  // namespace dtenjax::transport
