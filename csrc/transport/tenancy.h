// Multi-tenant isolation for the host transport (seed 4.4). Every communicator belongs to a
// tenant; a tenant has quotas on connections (TCP sockets or RC QPs) and on registered bytes
// (pinned host memory or RDMA MRs), and a token bucket that shapes its send bandwidth before
// anything is posted. Device memory a tenant registers is first checked to belong to the tenant's
// own CUDA context; the check is a replaceable function so the refusal logic is tested on CPU.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "csrc/common/status.h"

namespace dtenjax::transport {

double NowSeconds();  // monotonic clock

struct TenantQuota {
  int64_t max_connections = -1;       // -1: unlimited
  int64_t max_registered_bytes = -1;  // -1: unlimited
  double rate_bytes_per_s = 0;        // 0: unlimited
  double burst_bytes = 0;             // bucket depth; 0 means one second of rate (or 1 MiB)
};
// Every out-of-range field at once (limits below -1, rates that are negative, NaN or infinite).
Status ValidateQuota(const TenantQuota& q);

class TokenBucket {
 public:
  explicit TokenBucket(std::string tenant = "") : tenant_(std::move(tenant)) {}
  void Configure(double rate_bytes_per_s, double burst_bytes);
  // Blocks until `bytes` tokens are available (the bucket may go into debt for one oversize
  // request so large sends are shaped, not refused). Fails with kDeadlineExceeded if the wait would
  // pass `deadline`. Returns the nanoseconds slept in *slept_ns.
  Status Take(uint64_t bytes, double deadline, uint64_t* slept_ns);
  double rate() const { return rate_; }

 private:
  std::mutex mu_;
  std::string tenant_;  // named in its errors
  double rate_ = 0, burst_ = 0, tokens_ = 0, last_ = -1;
};

struct TenantUsage {
  int64_t connections = 0;
  int64_t registered_bytes = 0;
  int64_t quota_refusals = 0;
  int64_t ownership_refusals = 0;
};

class Tenant {
 public:
  explicit Tenant(std::string name) : name_(std::move(name)), bucket_(name_) {}
  const std::string& name() const { return name_; }
  Status SetQuota(const TenantQuota& q);
  TenantQuota quota();
  TenantUsage usage();
  void SetOwnerContext(int64_t ctx);
  int64_t owner_context();

  Status AcquireConnection(const std::string& what) { return AcquireConnections(1, what); }
  // All n or none (a ring rank needs two: taking them one by one lets racing rings each hold half).
  Status AcquireConnections(int64_t n, const std::string& what);
  void ReleaseConnection();
  // count_refusal=false: a refusal the caller may still resolve (by evicting idle buffers).
  Status ChargeRegistered(int64_t bytes, const std::string& what, bool count_refusal = true);
  void UnchargeRegistered(int64_t bytes);
  TokenBucket& bucket() { return bucket_; }
  // Refuses memory that does not belong to this tenant's context (PermissionDenied).
  Status CheckDeviceMemory(const void* ptr, uint64_t bytes);

 private:
  std::mutex mu_;
  std::string name_;
  TenantQuota quota_;
  TenantUsage usage_;
  int64_t owner_context_ = -1;
  TokenBucket bucket_;
};

// The tenant called `name`, created with unlimited quotas on first use. Never freed.
Tenant* GetTenant(const std::string& name);

// Who owns device memory: writes an opaque context id (the CUDA device ordinal in a CUDA build).
using PointerOwnerFn = Status (*)(const void* ptr, uint64_t bytes, int64_t* owner_context);
// Installs fn (nullptr: "unverifiable", the default without CUDA) and returns the previous one.
// The CUDA build installs its own at load time; the test extension swaps in a table so that the
// refusal logic is tested on machines without CUDA.
PointerOwnerFn SwapPointerOwnerFn(PointerOwnerFn fn);
PointerOwnerFn GetPointerOwnerFn();

}  // namespace dtenjax::transport
