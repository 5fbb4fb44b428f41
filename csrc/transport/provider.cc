// Provider registry and the blocking frame helpers every provider shares.
#include "csrc/transport/provider.h"

#include "csrc/transport/peer_text.h"

#include <cstring>

namespace dtenjax::transport {

std::vector<const Provider*>& Providers() {
  static auto* providers = new std::vector<const Provider*>();
  return *providers;
}

const Provider* FindProvider(const std::string& name) {
  for (const Provider* p : Providers()) {
    if (name == p->name) return p;
  }
  return nullptr;
}

bool GiveUp(const Handshake& hs) {
  if (hs.cancel && hs.cancel->load()) return true;
  if (hs.give_up_at) {
    const double at = hs.give_up_at->load();
    if (at > 0 && NowSeconds() >= at) return true;
  }
  return false;
}

namespace {
Status TimedOut(const Conn* c, const std::string& what) {
  Counters().timeouts.fetch_add(1);
  return DTENJAX_ERROR(Code::kDeadlineExceeded,
                       "dtenjax transport: timed out " + what + " " + c->peer +
                           " (DTENJAX_COLLECTIVE_TIMEOUT); the peer is stalled, dead or running "
                           "a different program");
}
}  // namespace

Status SendSealed(Conn* c, FrameType type, const Descriptor& d, const void* payload, uint64_t n,
                  double deadline, const std::atomic<bool>* cancel) {
  if (!c->session) return DTENJAX_ERROR(Code::kInternal, "connection has no session");
  OutFrame f;
  DTENJAX_RETURN_IF_ERROR(Seal(*c->session, type, c->job_id, uint32_t(c->my_rank), d, payload, n, &f));
  while (!f.done()) {
    bool progress = false;
    DTENJAX_RETURN_IF_ERROR(c->provider->send_some(c, &f, &progress));
    if (f.done()) break;
    if (NowSeconds() >= deadline) {
      return TimedOut(c, std::string("sending a ") + FrameTypeName(uint16_t(type)) + " frame to");
    }
    if (cancel && cancel->load()) {
      return DTENJAX_ERROR(Code::kCancelled, std::string("dtenjax transport: stopped sending a ") +
                                                 FrameTypeName(uint16_t(type)) + " frame to " +
                                                 c->peer + " (closed locally)");
    }
    if (!progress) {
      WaitItem w{c, true, false};
      DTENJAX_RETURN_IF_ERROR(c->provider->wait(&w, 1, deadline));
    }
  }
  return Status::Ok();
}

Status RecvSealed(Conn* c, FrameType type, void* payload, uint64_t n, double deadline) {
  if (!c->session) return DTENJAX_ERROR(Code::kInternal, "connection has no session");
  InFrame f;
  while (f.stage != InFrame::kDone) {
    bool progress = false;
    DTENJAX_RETURN_IF_ERROR(c->provider->recv_some(c, &f, &progress));
    if (f.stage == InFrame::kHeadReady) {
      DTENJAX_RETURN_IF_ERROR(OpenHead(*c->session, f, c->job_id, c->peer_rank, c->peer));
      const FrameHeader& h = f.header();
      if (h.type == uint16_t(FrameType::kAbort) && type != FrameType::kAbort &&
          h.payload_bytes <= kMaxAbortText) {
        // The peer gave up and says why: read its text and make that the error.
        std::string text(h.payload_bytes, '\0');
        f.dst = reinterpret_cast<uint8_t*>(text.data());
        f.payload_bytes = h.payload_bytes;
        f.stage = InFrame::kBody;
        f.got = 0;
        while (f.stage != InFrame::kDone) {
          bool p = false;
          DTENJAX_RETURN_IF_ERROR(c->provider->recv_some(c, &f, &p));
          if (f.stage == InFrame::kDone) break;
          if (NowSeconds() >= deadline) return TimedOut(c, "reading an ABORT frame from");
          if (!p) {
            WaitItem w{c, false, true};
            DTENJAX_RETURN_IF_ERROR(c->provider->wait(&w, 1, deadline));
          }
        }
        DTENJAX_RETURN_IF_ERROR(OpenBody(*c->session, f, c->peer));
        Counters().aborts_received.fetch_add(1);
        const int code = text.empty() ? 7 : static_cast<unsigned char>(text[0]);
        const std::string why =
            text.empty() ? "(no reason given)" : PeerText(text.data() + 1, text.size() - 1);
        return Status(PeerCode(code),
                      "dtenjax transport: " + c->peer + " gave up instead of sending a " +
                          FrameTypeName(uint16_t(type)) + " frame: " + why);
      }
      if (h.type != uint16_t(type) || h.payload_bytes != n) {
        Counters().rejected_bad_header.fetch_add(1);
        return DTENJAX_ERROR(Code::kDataLoss,
                             std::string("dtenjax transport: rejected frame from ") + c->peer +
                                 ": got " + FrameTypeName(h.type) + " with " +
                                 std::to_string(h.payload_bytes) + " bytes, expected " +
                                 FrameTypeName(uint16_t(type)) + " with " + std::to_string(n));
      }
      f.dst = static_cast<uint8_t*>(payload);
      f.payload_bytes = n;
      f.stage = InFrame::kBody;
      f.got = 0;
      continue;
    }
    if (f.stage == InFrame::kDone) break;
    if (NowSeconds() >= deadline) {
      return TimedOut(c, std::string("waiting for a ") + FrameTypeName(uint16_t(type)) +
                             " frame from");
    }
    if (!progress) {
      WaitItem w{c, false, true};
      DTENJAX_RETURN_IF_ERROR(c->provider->wait(&w, 1, deadline));
    }
  }
  return OpenBody(*c->session, f, c->peer);
}

}  // namespace dtenjax::transport
