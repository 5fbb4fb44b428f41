// Tenants of the host transport (tenancy.h): quotas, usage, the token bucket, the monotonic clock.
#include "csrc/transport/tenancy.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <thread>
#include <vector>

namespace dtenjax::transport {

double NowSeconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

Status ValidateQuota(const TenantQuota& q) {
  std::string bad;
  auto need = [&](bool ok, const std::string& what) {
    if (!ok) bad += (bad.empty() ? "" : "; ") + what;
  };
  need(q.max_connections >= -1,
       "max_connections=" + std::to_string(q.max_connections) + " (use -1 for unlimited or 0..2^63-1)");
  need(q.max_registered_bytes >= -1, "max_registered_bytes=" + std::to_string(q.max_registered_bytes) +
                                         " (use -1 for unlimited or 0..2^63-1)");
  need(std::isfinite(q.rate_bytes_per_s) && q.rate_bytes_per_s >= 0,
       "rate_bytes_per_s=" + std::to_string(q.rate_bytes_per_s) +
           " (a finite number >= 0; 0 means unlimited)");
  need(std::isfinite(q.burst_bytes) && q.burst_bytes >= 0,
       "burst_bytes=" + std::to_string(q.burst_bytes) + " (a finite number >= 0)");
  if (!bad.empty()) return DTENJAX_ERROR(Code::kInvalidArgument, "invalid tenant quota: " + bad);
  return Status::Ok();
}

void TokenBucket::Configure(double rate, double burst) {
  std::lock_guard<std::mutex> lock(mu_);
  rate_ = std::isfinite(rate) && rate > 0 ? rate : 0;
  burst_ = std::isfinite(burst) && burst > 0 ? burst
                                             : (rate_ > (1 << 20) ? rate_ : double(1 << 20));
  tokens_ = burst_;
  last_ = NowSeconds();
}

Status TokenBucket::Take(uint64_t bytes, double deadline, uint64_t* slept_ns) {
  *slept_ns = 0;
  double wait = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rate_ <= 0) return Status::Ok();
    double now = NowSeconds();
    tokens_ += (now - last_) * rate_;
    if (tokens_ > burst_) tokens_ = burst_;
    last_ = now;
    tokens_ -= double(bytes);  // take now, pay the debt by waiting: FIFO among senders
    if (tokens_ < 0) wait = -tokens_ / rate_;
    if (now + wait > deadline) {
      tokens_ += double(bytes);
      return DTENJAX_ERROR(Code::kDeadlineExceeded,
                           "token bucket of tenant '" + tenant_ + "': sending " +
                               std::to_string(bytes) + " bytes at " +
                               std::to_string(rate_) + " B/s needs " + std::to_string(wait) +
                               " s, past the collective timeout; raise the tenant's rate_bytes_per_s "
                               "or DTENJAX_COLLECTIVE_TIMEOUT");
    }
  }
  if (wait > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    *slept_ns = uint64_t(wait * 1e9);
  }
  return Status::Ok();
}

Status Tenant::SetQuota(const TenantQuota& q) {
  DTENJAX_RETURN_IF_ERROR(ValidateQuota(q));
  std::lock_guard<std::mutex> lock(mu_);
  quota_ = q;
  bucket_.Configure(q.rate_bytes_per_s, q.burst_bytes);
  return Status::Ok();
}

TenantQuota Tenant::quota() {
  std::lock_guard<std::mutex> lock(mu_);
  return quota_;
}

TenantUsage Tenant::usage() {
  std::lock_guard<std::mutex> lock(mu_);
  return usage_;
}

void Tenant::SetOwnerContext(int64_t ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  owner_context_ = ctx;
}

int64_t Tenant::owner_context() {
  std::lock_guard<std::mutex> lock(mu_);
  return owner_context_;
}

Status Tenant::AcquireConnections(int64_t n, const std::string& what) {
  std::lock_guard<std::mutex> lock(mu_);
  if (quota_.max_connections >= 0 && n > quota_.max_connections - usage_.connections) {
    ++usage_.quota_refusals;
    return DTENJAX_ERROR(Code::kResourceExhausted,
                         "tenant '" + name_ + "' would exceed its connection quota (" +
                             std::to_string(quota_.max_connections) + ", " +
                             std::to_string(usage_.connections) + " in use) opening " + what +
                             "; raise max_connections or close communicators it no longer uses");
  }
  usage_.connections += n;
  return Status::Ok();
}

void Tenant::ReleaseConnection() {
  std::lock_guard<std::mutex> lock(mu_);
  if (usage_.connections > 0) --usage_.connections;
}

Status Tenant::ChargeRegistered(int64_t bytes, const std::string& what, bool count_refusal) {
  std::lock_guard<std::mutex> lock(mu_);
  if (quota_.max_registered_bytes >= 0 &&
      bytes > quota_.max_registered_bytes - usage_.registered_bytes) {
    if (count_refusal) ++usage_.quota_refusals;
    return DTENJAX_ERROR(Code::kResourceExhausted,
                         "tenant '" + name_ + "' would exceed its registered-memory quota (" +
                             std::to_string(quota_.max_registered_bytes) + " bytes, " +
                             std::to_string(usage_.registered_bytes) + " registered) registering " +
                             std::to_string(bytes) + " more bytes for " + what +
                             "; raise max_registered_bytes or release buffers");
  }
  usage_.registered_bytes += bytes;
  return Status::Ok();
}

void Tenant::UnchargeRegistered(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  usage_.registered_bytes -= bytes;
  if (usage_.registered_bytes < 0) usage_.registered_bytes = 0;
}

namespace {

std::mutex g_owner_mu;

Status NoCudaOwner(const void*, uint64_t, int64_t*) {
  return DTENJAX_ERROR(Code::kUnavailable,
                       "this build has no CUDA, so device pointer ownership cannot be verified");
}

PointerOwnerFn g_owner_fn = &NoCudaOwner;

}  // namespace

PointerOwnerFn SwapPointerOwnerFn(PointerOwnerFn fn) {
  std::lock_guard<std::mutex> lock(g_owner_mu);
  PointerOwnerFn old = g_owner_fn;
  g_owner_fn = fn ? fn : &NoCudaOwner;
  return old;
}

PointerOwnerFn GetPointerOwnerFn() {
  std::lock_guard<std::mutex> lock(g_owner_mu);
  return g_owner_fn;
}

Status Tenant::CheckDeviceMemory(const void* ptr, uint64_t bytes) {
  int64_t owner = -1;
  Status s = GetPointerOwnerFn()(ptr, bytes, &owner);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", ptr);
  int64_t mine = owner_context();
  if (s.ok() && mine >= 0 && owner == mine) return Status::Ok();
  std::lock_guard<std::mutex> lock(mu_);
  ++usage_.ownership_refusals;
  std::string why = !s.ok() ? s.message()
                    : mine < 0 ? "tenant has no CUDA context set (call set_owner_context first)"
                               : "it belongs to context " + std::to_string(owner) +
                                     ", the tenant owns context " + std::to_string(mine);
  return DTENJAX_ERROR(Code::kPermissionDenied,
                       "tenant '" + name_ + "' may not register device memory " + buf + " (" +
                           std::to_string(bytes) + " bytes): " + why +
                           ". Register only memory this tenant allocated itself.");
}

Tenant* GetTenant(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Tenant>> tenants;
  std::lock_guard<std::mutex> lock(mu);
  auto& t = tenants[name];
  if (!t) t = std::make_unique<Tenant>(name);
  return t.get();
}

}  // namespace dtenjax::transport
