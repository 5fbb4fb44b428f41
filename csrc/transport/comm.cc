#include "csrc/transport/comm.h"

#include <cmath>
#include <cstring>
#include <map>
#include <thread>

#include "csrc/transport/frame.h"

namespace dtenjax::transport {

size_t DTypeSize(DType dt) {
  switch (dt) {
    case DType::kF32: case DType::kS32: return 4;
    case DType::kF64: case DType::kS64: return 8;
    case DType::kBF16: return 2;
  }
  return 0;
}

namespace {

template <typename T>
T Apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMax: return a > b ? a : b;
    case ReduceOp::kMin: return a < b ? a : b;
  }
  return a;
}

template <typename T>
void ReduceT(T* acc, const T* in, uint64_t n, ReduceOp op) {
  for (uint64_t i = 0; i < n; ++i) acc[i] = Apply(acc[i], in[i], op);
}

template <typename T>
void ReduceFloat(T* acc, const T* in, uint64_t n, ReduceOp op) {
  // max/min propagate NaN whatever the argument order, like jnp.maximum/minimum.
  if (op == ReduceOp::kMax || op == ReduceOp::kMin) {
    for (uint64_t i = 0; i < n; ++i) {
      T a = acc[i], b = in[i];
      acc[i] = std::isnan(a) ? a : std::isnan(b) ? b : Apply(a, b, op);
    }
    return;
  }
  ReduceT(acc, in, n, op);
}

float Bf16ToF32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return uint16_t((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

}  // namespace

Status Reduce(void* acc, const void* in, uint64_t n, DType dt, ReduceOp op) {
  switch (dt) {
    case DType::kF32: ReduceFloat(static_cast<float*>(acc), static_cast<const float*>(in), n, op); break;
    case DType::kF64: ReduceFloat(static_cast<double*>(acc), static_cast<const double*>(in), n, op); break;
    case DType::kS32: ReduceT(static_cast<int32_t*>(acc), static_cast<const int32_t*>(in), n, op); break;
    case DType::kS64: ReduceT(static_cast<int64_t*>(acc), static_cast<const int64_t*>(in), n, op); break;
    case DType::kBF16: {
      auto* a = static_cast<uint16_t*>(acc);
      auto* b = static_cast<const uint16_t*>(in);
      for (uint64_t i = 0; i < n; ++i) {
        float x = Bf16ToF32(a[i]), y = Bf16ToF32(b[i]);
        float r = (op == ReduceOp::kMax || op == ReduceOp::kMin) && (std::isnan(x) || std::isnan(y))
                      ? (std::isnan(x) ? x : y)
                      : Apply(x, y, op);
        a[i] = F32ToBf16(r);
      }
      break;
    }
    default:
      return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported dtype code " + std::to_string(int(dt)));
  }
  return Status::Ok();
}

// A FIFO worker thread. Detached: it owns a shared_ptr to its queue, so a Comm dropped on the
// worker thread itself never joins itself.
struct WorkQueue {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> items;
  bool stop = false;
  bool started = false;
};

Comm::Comm(const CommOptions& opts) : opts_(opts), tenant_(GetTenant(opts.tenant)) {
  PoolOptions po;
  po.tenant = opts.tenant;
  po.max_bytes = uint64_t(2) << 30;
  pool_ = std::make_unique<BufferPool>(po);
  queue_ = std::make_shared<WorkQueue>();
}

Status Comm::Create(const CommOptions& opts, std::shared_ptr<Comm>* out) {
  DTENJAX_CHECK_ARG(opts.size >= 1 && opts.rank >= 0 && opts.rank < opts.size,
                    "communicator rank " + std::to_string(opts.rank) + " is not in [0, " +
                        std::to_string(opts.size) + ")");
  DTENJAX_CHECK_ARG(opts.timeout_s > 0, "communicator timeout must be positive, got " +
                                            std::to_string(opts.timeout_s));
  DTENJAX_CHECK_ARG(!opts.secret.empty(), "communicator needs a non-empty job secret");
  std::shared_ptr<Comm> c(new Comm(opts));
  if (!c->opts_.provider) c->opts_.provider = TcpProvider();
  if (opts.size > 1) {
    DTENJAX_RETURN_IF_ERROR(c->opts_.provider->listen(opts.bind_address, &c->listener_));
    c->endpoint_ = c->listener_->endpoint;
  }
  *out = std::move(c);
  return Status::Ok();
}

Comm::~Comm() {
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->stop = true;
  }
  queue_->cv.notify_all();
  const Provider* p = opts_.provider;
  if (next_) p->close(next_);
  if (prev_) p->close(prev_);
  if (listener_) p->close_listener(listener_);
  for (int i = 0; i < connections_held_; ++i) tenant_->ReleaseConnection();
}

Status Comm::ConnectRing(const std::string& next_endpoint) {
  std::lock_guard<std::mutex> lock(op_mu_);
  if (opts_.size == 1) return Status::Ok();
  DTENJAX_CHECK_ARG(next_ == nullptr, "communicator is already connected");
  DTENJAX_CHECK_ARG(opts_.provider->can_connect(next_endpoint),
                    std::string("provider ") + opts_.provider->name + " cannot reach endpoint '" +
                        next_endpoint + "'");
  const std::string what = "a ring connection of rank " + std::to_string(opts_.rank);
  DTENJAX_RETURN_IF_ERROR(tenant_->AcquireConnection(what));
  ++connections_held_;
  DTENJAX_RETURN_IF_ERROR(tenant_->AcquireConnection(what));
  ++connections_held_;
  const double deadline = NowSeconds() + opts_.timeout_s;
  const int n = opts_.size, r = opts_.rank;
  std::atomic<bool> cancel{false};
  Handshake to_next{opts_.job_id, r, (r + 1) % n, opts_.secret, &cancel};
  Handshake from_prev{opts_.job_id, r, (r - 1 + n) % n, opts_.secret, &cancel};
  Status accept_status;
  Conn* prev = nullptr;
  std::thread acceptor([&] {
    accept_status = opts_.provider->accept(listener_, from_prev, deadline, &prev);
  });
  Conn* next = nullptr;
  Status s = opts_.provider->connect(next_endpoint, to_next, deadline, &next);
  if (!s.ok()) cancel.store(true);
  acceptor.join();
  if (!s.ok() || !accept_status.ok()) {
    if (next) opts_.provider->close(next);
    if (prev) opts_.provider->close(prev);
    broken_ = !s.ok() ? s : accept_status;
    return broken_;
  }
  next_ = next;
  prev_ = prev;
  opts_.provider->close_listener(listener_);
  listener_ = nullptr;
  return Status::Ok();
}

void Comm::Abort(const Status& why) {
  if (broken_.ok()) broken_ = why;
  if (next_) opts_.provider->shutdown(next_);
  if (prev_) opts_.provider->shutdown(prev_);
}

Status Comm::Step(const void* send, uint64_t send_bytes, void* recv, uint64_t recv_bytes) {
  uint64_t slept = 0;
  const double deadline = NowSeconds() + opts_.timeout_s;
  DTENJAX_RETURN_IF_ERROR(tenant_->bucket().Take(send_bytes, deadline, &slept));
  if (slept) Counters().throttled_ns.fetch_add(slept);
  const uint64_t seq = seq_++;
  SendOp s{next_, seq, send, send_bytes, corrupt_next_.exchange(false)};
  RecvOp rv{prev_, seq, recv, recv_bytes};
  return opts_.provider->exchange(&s, &rv, opts_.job_id, opts_.rank, NowSeconds() + opts_.timeout_s);
}

Status Comm::AllReduce(void* data, uint64_t count, DType dt, ReduceOp op) {
  std::lock_guard<std::mutex> lock(op_mu_);
  if (!broken_.ok()) {
    return Status(broken_.code(), "dtenjax transport: communicator of rank " +
                                      std::to_string(opts_.rank) +
                                      " is unusable after an earlier failure: " + broken_.message());
  }
  Counters().collectives.fetch_add(1);
  Counters().ops_in_flight.fetch_add(1);
  struct InFlight { ~InFlight() { Counters().ops_in_flight.fetch_sub(1); } } in_flight;
  const int n = opts_.size, r = opts_.rank;
  if (n == 1 || count == 0) return Status::Ok();
  if (next_ == nullptr) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "communicator is not connected (ConnectRing first)");
  }
  const size_t esz = DTypeSize(dt);
  if (esz == 0) return DTENJAX_ERROR(Code::kInvalidArgument, "unsupported dtype");
  auto off = [&](int c) { return (count / n) * uint64_t(c) + std::min<uint64_t>(c, count % n); };
  auto len = [&](int c) { return count / n + (uint64_t(c) < count % n ? 1 : 0); };
  uint8_t* base = static_cast<uint8_t*>(data);
  const uint64_t max_chunk = len(0) * esz;
  int buf = -1;
  Status s = pool_->Acquire(std::max<uint64_t>(max_chunk, 1), &buf);
  if (!s.ok()) return s;
  uint8_t* tmp = static_cast<uint8_t*>(pool_->Data(buf));
  s = pool_->Post(buf);
  for (int step = 0; s.ok() && step < n - 1; ++step) {  // reduce-scatter
    const int sc = ((r - step) % n + n) % n, rc = ((r - step - 1) % n + n) % n;
    s = Step(base + off(sc) * esz, len(sc) * esz, tmp, len(rc) * esz);
    if (s.ok()) s = Reduce(base + off(rc) * esz, tmp, len(rc), dt, op);
  }
  for (int step = 0; s.ok() && step < n - 1; ++step) {  // all-gather
    const int sc = ((r + 1 - step) % n + n) % n, rc = ((r - step) % n + n) % n;
    s = Step(base + off(sc) * esz, len(sc) * esz, base + off(rc) * esz, len(rc) * esz);
  }
  // The socket no longer reads the staging buffer whatever happened: complete, then release.
  pool_->Complete(buf);
  pool_->Release(buf);
  if (!s.ok()) Abort(s);
  return s;
}

void Comm::Submit(std::function<void()> fn) {
  std::shared_ptr<WorkQueue> q = queue_;
  std::lock_guard<std::mutex> lock(q->mu);
  q->items.push_back(std::move(fn));
  Counters().queue_depth.fetch_add(1);
  if (!q->started) {
    q->started = true;
    std::thread([q] {
      while (true) {
        std::function<void()> item;
        {
          std::unique_lock<std::mutex> l(q->mu);
          q->cv.wait(l, [&] { return q->stop || !q->items.empty(); });
          if (q->items.empty()) return;  // stopped and drained
          item = std::move(q->items.front());
          q->items.pop_front();
          Counters().queue_depth.fetch_sub(1);
        }
        item();
      }
    }).detach();
  }
  q->cv.notify_one();
}

namespace {
std::mutex g_comms_mu;
std::map<int64_t, std::shared_ptr<Comm>>& Comms() {
  static std::map<int64_t, std::shared_ptr<Comm>> comms;
  return comms;
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
