// The fingerprint of a collective: everything that must be equal on every rank before any rank
// combines its payload with another's (issue 35 item 1).
//
//   op, dtype and element count as the ring carries them; the caller's tag; the identity of the
//   call: its signature (the user's dtype and shape, the algorithm and contract, as hostcoll
//   writes them) and its call site (the user call stack) -- both registered by the caller under a
//   64-bit id (RegisterSite) -- and the name of the thread that issued it (Python callers; ""
//   inside jitted programs).
//
// Its digest is a keyed 64-bit hash (the first 8 bytes of HMAC-SHA256 under a key derived from
// the job secret) of all of these: two different texts cannot be made to collide without the
// secret, and an accidental collision has probability 2^-64 per pair (a 32-bit CRC collided in
// 17,396 tries). The collective number is not in the digest: it travels in every frame header and
// is compared there.
//
// On the wire every frame header of a collective carries its 64-bit digest (the `site` and `tag`
// fields: low and high 32 bits), which the receiver compares with its own before it reads any
// payload. The record itself (frame type FINGERPRINT) goes to the next rank before the first
// segment of a collective whose digest differs from the last record sent on that connection, so
// the receiver can name both sides of a mismatch; a loop of identical collectives sends it once.
// Texts received are peer data: decoded with PeerText before they reach a message.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/frame.h"

namespace dtenjax::transport {

constexpr size_t kFingerprintKeyBytes = 32;
// Longest signature and thread name a record carries (the site text is at most kMaxSiteText).
constexpr size_t kMaxSignatureText = 512;
constexpr size_t kMaxThreadText = 256;
constexpr uint64_t kMaxFingerprintBytes = 32 + kMaxSiteText + kMaxSignatureText + kMaxThreadText;

struct Fingerprint {
  uint64_t digest = 0;
  uint8_t op = 0;
  uint8_t dtype = 0;
  uint64_t count = 0;
  uint32_t tag = 0;
  std::string signature;  // e.g. "bfloat16[4, 250] algorithm=ring contract=none"
  std::string site;       // e.g. "helper (a.py:3) < body (train.py:10)"
  std::string thread;     // e.g. "MainThread"; "" for collectives of jitted programs
};

// The key of the digests, from the job secret (every process of a job derives the same).
Status DeriveFingerprintKey(const std::string& secret, uint64_t job_id,
                            uint8_t key[kFingerprintKeyBytes]);
// Fills `out` for a collective of descriptor `d` (op, dtype, count, tag), the call registered as
// `site_id`, issued by `thread`, and computes its digest.
Status MakeFingerprint(const uint8_t key[kFingerprintKeyBytes], const Descriptor& d,
                       uint64_t site_id, const std::string& thread, Fingerprint* out);
// The FINGERPRINT frame's payload: digest (u64) | full (u8, 1) | op u8, dtype u8, tag u32,
// count u64, then three texts, each u16 length + bytes (signature, site, thread). (full=0, the
// digest alone, is decoded but never sent: the receiver refuses it.)
std::string EncodeFingerprint(const Fingerprint& f, bool full);
// Decodes a received payload; its texts are escaped (PeerText). *full: whether it was a full
// record (else only out->digest is set).
Status DecodeFingerprint(const uint8_t* p, uint64_t n, const std::string& peer, Fingerprint* out,
                         bool* full);
// "op=sum, dtype=float32, count=1000, tag=7, bfloat16[1000] algorithm=ring, site 'f (x.py:3)',
// thread 'MainThread'" (the parts that are set).
std::string DescribeFingerprint(const Fingerprint& f);
// The fields in which a and b differ, e.g. "signature, site" (all but the digest).
std::string FingerprintDifference(const Fingerprint& a, const Fingerprint& b);

// The process-wide table of calls: id -> (site text, signature), filled by the callers (Python's
// register_site) before the collectives that name the id. An id registered again with other texts
// is refused (kInvalidArgument): two calls whose 64-bit ids collide would otherwise share one
// identity.
Status RegisterSite(uint64_t id, const std::string& site, const std::string& signature);
bool LookupSite(uint64_t id, std::string* site, std::string* signature);

}  // namespace dtenjax::transport
