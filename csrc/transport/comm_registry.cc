// The process-wide table of communicators (comm.h: RegisterComm, FindComm, DestroyComm): Python
// and the FFI handlers address a communicator by its id.
#include "csrc/transport/comm.h"

#include <map>
#include <memory>
#include <mutex>

namespace dtenjax::transport {

namespace {
std::mutex g_comms_mu;
std::map<int64_t, std::shared_ptr<Comm>>& Comms() {
  static auto* comms = new std::map<int64_t, std::shared_ptr<Comm>>();
  return *comms;
}
int64_t g_next_id = 1;
}  // namespace

int64_t RegisterComm(std::shared_ptr<Comm> comm) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  int64_t id = g_next_id++;
  Comms()[id] = std::move(comm);
  return id;
}

std::shared_ptr<Comm> FindComm(int64_t id) {
  std::lock_guard<std::mutex> lock(g_comms_mu);
  auto it = Comms().find(id);
  return it == Comms().end() ? nullptr : it->second;
}

bool DestroyComm(int64_t id) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> lock(g_comms_mu);
    auto it = Comms().find(id);
    if (it == Comms().end()) return false;
    c = std::move(it->second);
    Comms().erase(it);
  }
  return true;  // freed when the last queued collective holding it finishes
}

}  // namespace dtenjax::transport
