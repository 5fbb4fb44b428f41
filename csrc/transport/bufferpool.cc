// The registered buffer pool (bufferpool.h): size classes, registration through the hooks,
// the buffers' state machine, eviction of idle buffers under the tenant's quota.
#include "csrc/transport/bufferpool.h"

#include <sys/mman.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

namespace dtenjax::transport {

const char* const kPoolStatNames[] = {
    "registered_bytes", "registered_buffers", "in_use", "posted", "acquires", "releases",
    "registrations", "deregistrations", "reg_failures", "reuse_hits", "rejected_transitions",
    "pin_failures", "high_water_bytes", "allocated_bytes"};

namespace {
constexpr uint64_t kMinClass = 4096;
constexpr uint64_t kMaxClass = uint64_t(1) << 62;  // the largest power of two a request rounds to
// The power of two >= bytes (at least 4 KiB); 0 if bytes exceed kMaxClass.
uint64_t SizeClass(uint64_t bytes) {
  if (bytes > kMaxClass) return 0;
  uint64_t c = kMinClass;
  while (c < bytes) c <<= 1;
  return c;
}
}  // namespace

Status ValidatePoolOptions(const PoolOptions& o) {
  std::string bad;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) bad += (bad.empty() ? "" : "; ") + what;
  };
  need(o.max_bytes >= 1, "max_bytes=" + std::to_string(o.max_bytes) + " (1..2^64-1)");
  need(o.max_buffers >= 1 && o.max_buffers <= uint32_t(INT32_MAX),
       "max_buffers=" + std::to_string(o.max_buffers) + " (1..2^31-1)");
  need(o.max_buffer_bytes >= 1, "max_buffer_bytes=" + std::to_string(o.max_buffer_bytes) +
                                    " (1..2^64-1)");
  need(!o.tenant.empty(), "tenant='' (a non-empty name)");
  if (!bad.empty()) return DTENJAX_ERROR(Code::kInvalidArgument, "invalid buffer pool limits: " + bad);
  return Status::Ok();
}

BufferPool::BufferPool(PoolOptions opts) : opts_(std::move(opts)), tenant_(GetTenant(opts_.tenant)) {}

BufferPool::~BufferPool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < bufs_.size(); ++i) {
    Buf& b = bufs_[i];
    if (b.live && b.state != BufState::kPosted) FreeBuf(int(i));
  }
}

Status BufferPool::Lookup(int id, Buf** b) {
  if (id < 0 || size_t(id) >= bufs_.size() || !bufs_[id].live) {
    ++st_.rejected_transitions;
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "buffer pool: no live buffer with id " + std::to_string(id));
  }
  *b = &bufs_[id];
  return Status::Ok();
}

void BufferPool::FreeBuf(int id) {
  Buf& b = bufs_[id];
  if (opts_.hooks.dereg) opts_.hooks.dereg(opts_.hooks.ctx, b.handle);
  if (b.pinned) munlock(b.ptr, b.bytes);
  std::free(b.ptr);
  st_.allocated_bytes -= b.bytes;
  st_.registered_bytes -= b.bytes;
  --st_.registered_buffers;
  ++st_.deregistrations;
  tenant_->UnchargeRegistered(int64_t(b.bytes));
  b = Buf();
  free_slots_.push_back(id);
}

bool BufferPool::EvictOneIdle() {
  if (idle_.empty()) return false;
  auto it = idle_.begin();  // the smallest idle buffer first
  int victim = it->second;
  idle_.erase(it);
  FreeBuf(victim);
  return true;
}

Status BufferPool::RegisterNew(uint64_t cls, int* id) {
  // Make room under the pool limits by dropping idle buffers of other sizes first.
  while ((cls > opts_.max_bytes - std::min(opts_.max_bytes, st_.registered_bytes) ||
          st_.registered_buffers + 1 > opts_.max_buffers) && EvictOneIdle()) {
  }
  if (cls > opts_.max_bytes - std::min(opts_.max_bytes, st_.registered_bytes) ||
      st_.registered_buffers + 1 > opts_.max_buffers) {
    return DTENJAX_ERROR(Code::kResourceExhausted,
                         "buffer pool of tenant '" + opts_.tenant + "' full: " +
                             std::to_string(st_.registered_buffers) + " buffers, " +
                             std::to_string(st_.registered_bytes) + " of " +
                             std::to_string(opts_.max_bytes) + " bytes registered and in use; "
                             "raise max_bytes/max_buffers or release buffers");
  }
  // The tenant's quota may be what blocks: free idle cached buffers of this pool until it fits.
  while (!tenant_->ChargeRegistered(int64_t(cls), "a buffer pool buffer", false).ok()) {
    if (!EvictOneIdle()) {
      DTENJAX_RETURN_IF_ERROR(tenant_->ChargeRegistered(int64_t(cls), "a buffer pool buffer"));
      break;
    }
  }
  Buf b;
  b.bytes = cls;
  b.ptr = std::aligned_alloc(4096, cls);
  if (b.ptr == nullptr) {
    tenant_->UnchargeRegistered(int64_t(cls));
    ++st_.reg_failures;
    return DTENJAX_ERROR(Code::kResourceExhausted,
                         "buffer pool of tenant '" + opts_.tenant + "': allocating " +
                             std::to_string(cls) + " bytes failed");
  }
  std::memset(b.ptr, 0, cls);  // touch the pages so pinning and first use cost nothing later
  Status s;
  while (opts_.hooks.reg) {
    s = opts_.hooks.reg(opts_.hooks.ctx, b.ptr, cls, &b.handle);
    if (s.ok()) break;
    ++st_.reg_failures;
    // The device is out of regions or pinnable memory (ibv_reg_mr's ENOMEM): the idle cached
    // buffers hold some of them, so free one and try again; any other refusal is final.
    if (s.code() != Code::kResourceExhausted || !EvictOneIdle()) break;
  }
  if (!s.ok()) {
    std::free(b.ptr);
    tenant_->UnchargeRegistered(int64_t(cls));
    if (s.code() == Code::kResourceExhausted) {   // the device's room, charged to this tenant
      return Status(s.code(), "buffer pool of tenant '" + opts_.tenant + "': " + s.message());
    }
    return s;
  }
  if (opts_.pin) {
    if (mlock(b.ptr, cls) == 0) b.pinned = true; else ++st_.pin_failures;
  }
  b.live = true;
  st_.allocated_bytes += cls;
  st_.registered_bytes += cls;
  ++st_.registered_buffers;
  ++st_.registrations;
  if (st_.registered_bytes > st_.high_water_bytes) st_.high_water_bytes = st_.registered_bytes;
  if (!free_slots_.empty()) {
    *id = free_slots_.back();
    free_slots_.pop_back();
    bufs_[*id] = b;
  } else {
    *id = int(bufs_.size());
    bufs_.push_back(b);
  }
  return Status::Ok();
}

Status BufferPool::Acquire(uint64_t bytes, int* id, void** data) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) {
    return DTENJAX_ERROR(Code::kInvalidArgument, "buffer pool: acquire(" + std::to_string(bytes) +
                                                     ") on a closed pool; create a new pool");
  }
  const uint64_t limit = std::min(opts_.max_buffer_bytes, kMaxClass);
  if (bytes == 0 || bytes > limit) {
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "buffer pool: cannot acquire " + std::to_string(bytes) +
                             " bytes (allowed: 1 to " + std::to_string(limit) +
                             ", the smaller of max_buffer_bytes and 2^62)");
  }
  const uint64_t cls = SizeClass(bytes);
  auto it = idle_.find(cls);
  if (it != idle_.end()) {
    *id = it->second;
    idle_.erase(it);
    ++st_.reuse_hits;
  } else {
    DTENJAX_RETURN_IF_ERROR(RegisterNew(cls, id));
  }
  Buf& b = bufs_[*id];
  b.refs = 1;
  b.state = BufState::kIdle;
  ++st_.in_use;
  ++st_.acquires;
  if (data) *data = b.ptr;
  return Status::Ok();
}

Status BufferPool::Retain(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  Buf* b;
  DTENJAX_RETURN_IF_ERROR(Lookup(id, &b));
  if (b->refs <= 0) {
    ++st_.rejected_transitions;
    return DTENJAX_ERROR(Code::kInvalidArgument, "buffer pool: retain of unreferenced buffer " +
                                                     std::to_string(id));
  }
  ++b->refs;
  return Status::Ok();
}

Status BufferPool::Transition(int id, BufState from, BufState to, const char* what) {
  std::lock_guard<std::mutex> lock(mu_);
  Buf* b;
  DTENJAX_RETURN_IF_ERROR(Lookup(id, &b));
  if (b->refs <= 0 || b->state != from) {
    ++st_.rejected_transitions;
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         std::string("buffer pool: cannot ") + what + " buffer " +
                             std::to_string(id) + " in state " + std::to_string(int(b->state)) +
                             " with " + std::to_string(b->refs) + " references");
  }
  if (to == BufState::kPosted) ++st_.posted;
  if (from == BufState::kPosted) --st_.posted;
  b->state = to;
  return Status::Ok();
}

Status BufferPool::Post(int id) { return Transition(id, BufState::kIdle, BufState::kPosted, "post"); }
Status BufferPool::Complete(int id) {
  return Transition(id, BufState::kPosted, BufState::kCompleted, "complete");
}

Status BufferPool::Release(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  Buf* b;
  DTENJAX_RETURN_IF_ERROR(Lookup(id, &b));
  if (b->refs <= 0 || (b->refs == 1 && b->state == BufState::kPosted)) {
    ++st_.rejected_transitions;
    return DTENJAX_ERROR(Code::kInvalidArgument,
                         "buffer pool: cannot release buffer " + std::to_string(id) +
                             (b->refs <= 0 ? " (not referenced)" : " while it is posted; complete it first"));
  }
  if (--b->refs == 0) {
    b->state = BufState::kIdle;
    --st_.in_use;
    ++st_.releases;
    if (closed_) {
      FreeBuf(id);
    } else {
      idle_.emplace(b->bytes, id);
    }
  }
  return Status::Ok();
}

void BufferPool::Trim() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [cls, id] : idle_) FreeBuf(id);
  idle_.clear();
}

void BufferPool::Close() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  for (auto& [cls, id] : idle_) FreeBuf(id);
  idle_.clear();
}

bool BufferPool::closed() {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

void* BufferPool::Data(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  return (id >= 0 && size_t(id) < bufs_.size() && bufs_[id].live) ? bufs_[id].ptr : nullptr;
}
uint64_t BufferPool::Size(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  return (id >= 0 && size_t(id) < bufs_.size() && bufs_[id].live) ? bufs_[id].bytes : 0;
}
uint64_t BufferPool::RegHandle(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  return (id >= 0 && size_t(id) < bufs_.size() && bufs_[id].live) ? bufs_[id].handle : 0;
}
int BufferPool::State(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  return (id >= 0 && size_t(id) < bufs_.size() && bufs_[id].live) ? int(bufs_[id].state) : -1;
}

PoolStats BufferPool::Stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return st_;
}

RegisterHooks BufferPool::SwapRegisterHooks(RegisterHooks hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  RegisterHooks old = opts_.hooks;
  opts_.hooks = hooks;
  return old;
}

}  // namespace dtenjax::transport
