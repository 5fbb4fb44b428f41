// A communicator: one rank of a ring of processes connected by a transport provider, running
// deterministic all-reduce over host memory. Collectives of one communicator run one at a time in
// submission order on its own worker thread (Submit), so an XLA thread never blocks on the network.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "csrc/common/status.h"
#include "csrc/transport/bufferpool.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tenancy.h"

namespace dtenjax::transport {

enum class DType : int { kF32 = 0, kF64 = 1, kS32 = 2, kS64 = 3, kBF16 = 4 };
enum class ReduceOp : int { kSum = 0, kMax = 1, kMin = 2, kProd = 3 };
size_t DTypeSize(DType dt);
// acc[i] = acc[i] (op) in[i]. Sum/prod are commutative in IEEE arithmetic, so every rank that
// combines the same two values gets the same bits.
Status Reduce(void* acc, const void* in, uint64_t count, DType dt, ReduceOp op);

struct CommOptions {
  uint64_t job_id = 0;
  int rank = 0;
  int size = 1;
  std::string secret;
  double timeout_s = 60;
  std::string tenant = "default";
  std::string bind_address = "127.0.0.1";
  const Provider* provider = nullptr;  // default: TCP
};

struct WorkQueue;

class Comm {
 public:
  static Status Create(const CommOptions& opts, std::shared_ptr<Comm>* out);
  ~Comm();
  const std::string& endpoint() const { return endpoint_; }
  int rank() const { return opts_.rank; }
  int size() const { return opts_.size; }

  // Connects to the next rank and accepts the previous one (both authenticated).
  Status ConnectRing(const std::string& next_endpoint);
  // In-place ring all-reduce of `count` elements. Reduce-scatter then all-gather over n equal
  // chunks; chunk c is combined in the fixed order ((x[c] + x[c+1]) + ...) + x[c-1] (ranks mod n), so the
  // result is identical on every rank and in every run.
  Status AllReduce(void* data, uint64_t count, DType dt, ReduceOp op);
  // Runs fn on this communicator's worker thread after everything submitted before it.
  void Submit(std::function<void()> fn);
  // Marks the communicator broken and wakes the neighbours (they see end-of-stream).
  void Abort(const Status& why);
  void InjectCorruptNextSend() { corrupt_next_.store(true); }
  BufferPool& pool() { return *pool_; }

 private:
  explicit Comm(const CommOptions& opts);
  Status Step(const void* send, uint64_t send_bytes, void* recv, uint64_t recv_bytes);

  CommOptions opts_;
  Tenant* tenant_;
  Listener* listener_ = nullptr;
  std::string endpoint_;
  Conn* next_ = nullptr;
  Conn* prev_ = nullptr;
  int connections_held_ = 0;
  std::mutex op_mu_;
  Status broken_;
  uint64_t seq_ = 1;
  std::atomic<bool> corrupt_next_{false};
  std::unique_ptr<BufferPool> pool_;
  std::shared_ptr<WorkQueue> queue_;
};

// Process-wide table of communicators, addressed by id from Python and from the FFI handlers.
int64_t RegisterComm(std::shared_ptr<Comm> comm);
std::shared_ptr<Comm> FindComm(int64_t id);
bool DestroyComm(int64_t id);

}  // namespace dtenjax::transport
