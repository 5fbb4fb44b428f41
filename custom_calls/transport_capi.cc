// Plain C entry points of the host transport for dtenjax/_src/{transport,bufferpool,tenancy}.py,
// called through ctypes on the already-loaded dtenjax._ffi module. ctypes releases the GIL for the
// duration of each call, which the blocking ones (connect, all-reduce, token bucket) need, and the
// control plane needs no edit of module.cc. Every function returns 0 or a dtenjax::Code and
// writes the error message into (err, err_cap).
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "csrc/transport/bufferpool.h"
#include "csrc/transport/comm.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/sha256.h"
#include "csrc/transport/tenancy.h"
#ifdef DTENJAX_HAVE_VERBS
#include "csrc/transport/verbs.h"
#endif

namespace tp = dtenjax::transport;
using dtenjax::Code;
using dtenjax::Status;

#define DTJ_API extern "C" __attribute__((visibility("default")))

namespace {

int Report(const Status& s, char* err, int cap) {
  if (err && cap > 0) {
    std::strncpy(err, s.message().c_str(), size_t(cap) - 1);
    err[cap - 1] = '\0';
  }
  return static_cast<int>(s.code());
}

int NotFound(const char* what, int64_t id, char* err, int cap) {
  return Report(Status(Code::kInvalidArgument, std::string("no ") + what + " with id " +
                                                   std::to_string(id)), err, cap);
}

std::mutex g_mu;
int64_t g_next = 1;
std::map<int64_t, std::unique_ptr<tp::BufferPool>> g_pools;
std::map<int64_t, tp::Listener*> g_listeners;
std::map<int64_t, tp::Conn*> g_conns;

tp::BufferPool* Pool(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_pools.find(id);
  return it == g_pools.end() ? nullptr : it->second.get();
}

const tp::Provider* ProviderNamed(const char* name) {
  if (name == nullptr || std::strcmp(name, "tcp") == 0) return tp::TcpProvider();
#ifdef DTENJAX_HAVE_VERBS
  if (std::strcmp(name, "verbs") == 0) return tp::VerbsProvider();
#endif
  return nullptr;
}

}  // namespace

// --- counters, hashing --------------------------------------------------------------------------
DTJ_API int dtenjax_tp_num_counters() { return tp::kNumCounters; }
DTJ_API const char* dtenjax_tp_counter_name(int i) {
  return (i >= 0 && i < tp::kNumCounters) ? tp::kCounterNames[i] : "";
}
DTJ_API void dtenjax_tp_counters(uint64_t* out) { tp::TransportCountersSnapshot(out); }
DTJ_API void dtenjax_tp_hmac_sha256(const void* key, uint64_t klen, const void* msg, uint64_t mlen,
                                    uint8_t* out) {
  tp::HmacSha256(key, klen, msg, mlen, out);
}
DTJ_API void dtenjax_tp_sha256(const void* msg, uint64_t mlen, uint8_t* out) {
  tp::Sha256Digest(msg, mlen, out);
}
DTJ_API uint64_t dtenjax_tp_checksum64(const void* data, uint64_t n) { return tp::Checksum64(data, n); }
DTJ_API int dtenjax_tp_random(void* out, uint64_t n, char* err, int cap) {
  return Report(tp::RandomBytes(out, n), err, cap);
}

// --- communicators ------------------------------------------------------------------------------
DTJ_API int dtenjax_tp_comm_create(uint64_t job_id, int rank, int size, const char* secret,
                                   uint64_t secret_len, double timeout_s, const char* tenant,
                                   const char* bind_address, const char* provider, int64_t* id_out,
                                   char* endpoint, int endpoint_cap, char* err, int cap) {
  tp::CommOptions o;
  o.job_id = job_id;
  o.rank = rank;
  o.size = size;
  o.secret.assign(secret, secret_len);
  o.timeout_s = timeout_s;
  o.tenant = tenant;
  o.bind_address = bind_address;
  o.provider = ProviderNamed(provider);
  if (o.provider == nullptr) {
    return Report(Status(Code::kUnavailable, std::string("transport provider '") + provider +
                                                 "' is not in this build"), err, cap);
  }
  std::shared_ptr<tp::Comm> c;
  Status s = tp::Comm::Create(o, &c);
  if (!s.ok()) return Report(s, err, cap);
  std::strncpy(endpoint, c->endpoint().c_str(), size_t(endpoint_cap) - 1);
  endpoint[endpoint_cap - 1] = '\0';
  *id_out = tp::RegisterComm(std::move(c));
  return 0;
}

DTJ_API int dtenjax_tp_comm_connect(int64_t id, const char* next_endpoint, char* err, int cap) {
  auto c = tp::FindComm(id);
  if (!c) return NotFound("communicator", id, err, cap);
  return Report(c->ConnectRing(next_endpoint), err, cap);
}

DTJ_API int dtenjax_tp_comm_all_reduce(int64_t id, void* data, uint64_t count, int dtype, int op,
                                       char* err, int cap) {
  auto c = tp::FindComm(id);
  if (!c) return NotFound("communicator", id, err, cap);
  if (op < 0 || op > 3) return Report(Status(Code::kInvalidArgument, "bad op code"), err, cap);
  return Report(c->AllReduce(data, count, static_cast<tp::DType>(dtype),
                             static_cast<tp::ReduceOp>(op)), err, cap);
}

DTJ_API int dtenjax_tp_comm_inject_corrupt(int64_t id) {
  auto c = tp::FindComm(id);
  if (!c) return 1;
  c->InjectCorruptNextSend();
  return 0;
}

DTJ_API int dtenjax_tp_comm_destroy(int64_t id) { return tp::DestroyComm(id) ? 0 : 1; }

// --- raw listener / connection (protocol tests) -------------------------------------------------
DTJ_API int dtenjax_tp_listen(const char* bind_address, int64_t* id_out, char* endpoint,
                              int endpoint_cap, char* err, int cap) {
  tp::Listener* l = nullptr;
  Status s = tp::TcpProvider()->listen(bind_address, &l);
  if (!s.ok()) return Report(s, err, cap);
  std::strncpy(endpoint, l->endpoint.c_str(), size_t(endpoint_cap) - 1);
  endpoint[endpoint_cap - 1] = '\0';
  std::lock_guard<std::mutex> lock(g_mu);
  *id_out = g_next++;
  g_listeners[*id_out] = l;
  return 0;
}

DTJ_API int dtenjax_tp_accept(int64_t lid, uint64_t job_id, int my_rank, int peer_rank,
                              const char* secret, uint64_t secret_len, double timeout_s,
                              int64_t* conn_out, char* err, int cap) {
  tp::Listener* l;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_listeners.find(lid);
    if (it == g_listeners.end()) return NotFound("listener", lid, err, cap);
    l = it->second;
  }
  tp::Handshake hs{job_id, my_rank, peer_rank, std::string(secret, secret_len)};
  tp::Conn* c = nullptr;
  Status s = l->provider->accept(l, hs, tp::NowSeconds() + timeout_s, &c);
  if (!s.ok()) return Report(s, err, cap);
  std::lock_guard<std::mutex> lock(g_mu);
  *conn_out = g_next++;
  g_conns[*conn_out] = c;
  return 0;
}

DTJ_API int dtenjax_tp_connect(const char* endpoint, uint64_t job_id, int my_rank, int peer_rank,
                               const char* secret, uint64_t secret_len, double timeout_s,
                               int64_t* conn_out, char* err, int cap) {
  tp::Handshake hs{job_id, my_rank, peer_rank, std::string(secret, secret_len)};
  tp::Conn* c = nullptr;
  Status s = tp::TcpProvider()->connect(endpoint, hs, tp::NowSeconds() + timeout_s, &c);
  if (!s.ok()) return Report(s, err, cap);
  std::lock_guard<std::mutex> lock(g_mu);
  *conn_out = g_next++;
  g_conns[*conn_out] = c;
  return 0;
}

// One data frame each way or one way (send/recv may be -1).
DTJ_API int dtenjax_tp_exchange(int64_t send_conn, const void* sbuf, uint64_t sbytes,
                                int64_t recv_conn, void* rbuf, uint64_t rbytes, uint64_t seq,
                                uint64_t job_id, int my_rank, double timeout_s, char* err, int cap) {
  tp::Conn *sc = nullptr, *rc = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (send_conn >= 0) {
      auto it = g_conns.find(send_conn);
      if (it == g_conns.end()) return NotFound("connection", send_conn, err, cap);
      sc = it->second;
    }
    if (recv_conn >= 0) {
      auto it = g_conns.find(recv_conn);
      if (it == g_conns.end()) return NotFound("connection", recv_conn, err, cap);
      rc = it->second;
    }
  }
  tp::SendOp so{sc, seq, sbuf, sbytes, false};
  tp::RecvOp ro{rc, seq, rbuf, rbytes};
  return Report(tp::TcpProvider()->exchange(sc ? &so : nullptr, rc ? &ro : nullptr, job_id, my_rank,
                                            tp::NowSeconds() + timeout_s),
                err, cap);
}

DTJ_API void dtenjax_tp_close(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (auto it = g_conns.find(id); it != g_conns.end()) {
    it->second->provider->close(it->second);
    g_conns.erase(it);
  }
  if (auto it = g_listeners.find(id); it != g_listeners.end()) {
    it->second->provider->close_listener(it->second);
    g_listeners.erase(it);
  }
}

// --- buffer pool --------------------------------------------------------------------------------
DTJ_API int64_t dtenjax_tp_pool_create(uint64_t max_bytes, uint32_t max_buffers,
                                       uint64_t max_buffer_bytes, int pin, const char* tenant) {
  tp::PoolOptions o;
  o.max_bytes = max_bytes;
  o.max_buffers = max_buffers;
  o.max_buffer_bytes = max_buffer_bytes;
  o.pin = pin != 0;
  o.tenant = tenant;
  std::lock_guard<std::mutex> lock(g_mu);
  int64_t id = g_next++;
  g_pools[id] = std::make_unique<tp::BufferPool>(o);
  return id;
}

DTJ_API int dtenjax_tp_pool_destroy(int64_t id) {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_pools.erase(id) ? 0 : 1;
}

DTJ_API int dtenjax_tp_pool_op(int64_t id, int what, int64_t arg, int64_t* out, char* err, int cap) {
  tp::BufferPool* p = Pool(id);
  if (!p) return NotFound("buffer pool", id, err, cap);
  switch (what) {
    case 0: { int b = -1; Status s = p->Acquire(uint64_t(arg), &b); *out = b; return Report(s, err, cap); }
    case 1: return Report(p->Retain(int(arg)), err, cap);
    case 2: return Report(p->Post(int(arg)), err, cap);
    case 3: return Report(p->Complete(int(arg)), err, cap);
    case 4: return Report(p->Release(int(arg)), err, cap);
    case 5: p->Trim(); return 0;
    case 6: *out = int64_t(reinterpret_cast<uintptr_t>(p->Data(int(arg)))); return 0;
    case 7: *out = int64_t(p->Size(int(arg))); return 0;
    case 8: *out = p->State(int(arg)); return 0;
    case 9: p->InjectRegistrationFailures(uint32_t(arg)); return 0;
  }
  return Report(Status(Code::kInvalidArgument, "unknown pool op"), err, cap);
}

DTJ_API int dtenjax_tp_pool_num_stats() { return tp::kNumPoolStats; }
DTJ_API const char* dtenjax_tp_pool_stat_name(int i) {
  return (i >= 0 && i < tp::kNumPoolStats) ? tp::kPoolStatNames[i] : "";
}
DTJ_API int dtenjax_tp_pool_stats(int64_t id, uint64_t* out) {
  tp::BufferPool* p = Pool(id);
  if (!p) return 1;
  tp::PoolStats s = p->Stats();
  static_assert(sizeof(tp::PoolStats) == sizeof(uint64_t) * tp::kNumPoolStats, "PoolStats layout");
  std::memcpy(out, &s, sizeof(s));
  return 0;
}

// --- tenancy ------------------------------------------------------------------------------------
DTJ_API void dtenjax_tp_tenant_set_quota(const char* name, int64_t max_connections,
                                         int64_t max_registered_bytes, double rate, double burst) {
  tp::TenantQuota q;
  q.max_connections = max_connections;
  q.max_registered_bytes = max_registered_bytes;
  q.rate_bytes_per_s = rate;
  q.burst_bytes = burst;
  tp::GetTenant(name)->SetQuota(q);
}

DTJ_API void dtenjax_tp_tenant_usage(const char* name, int64_t* out4) {
  tp::TenantUsage u = tp::GetTenant(name)->usage();
  out4[0] = u.connections;
  out4[1] = u.registered_bytes;
  out4[2] = u.quota_refusals;
  out4[3] = u.ownership_refusals;
}

DTJ_API void dtenjax_tp_tenant_set_owner_context(const char* name, int64_t ctx) {
  tp::GetTenant(name)->SetOwnerContext(ctx);
}

DTJ_API int dtenjax_tp_tenant_check_device_memory(const char* name, uint64_t ptr, uint64_t bytes,
                                                  char* err, int cap) {
  return Report(tp::GetTenant(name)->CheckDeviceMemory(reinterpret_cast<const void*>(ptr), bytes),
                err, cap);
}

DTJ_API int dtenjax_tp_tenant_acquire_connection(const char* name, char* err, int cap) {
  return Report(tp::GetTenant(name)->AcquireConnection("a connection"), err, cap);
}
DTJ_API void dtenjax_tp_tenant_release_connection(const char* name) {
  tp::GetTenant(name)->ReleaseConnection();
}

DTJ_API int dtenjax_tp_tenant_take(const char* name, uint64_t bytes, double timeout_s, char* err,
                                   int cap) {
  uint64_t slept = 0;
  return Report(tp::GetTenant(name)->bucket().Take(bytes, tp::NowSeconds() + timeout_s, &slept), err,
                cap);
}

DTJ_API void dtenjax_tp_set_fake_pointer_owners(const uint64_t* starts, const uint64_t* sizes,
                                                const int64_t* owners, int n) {
  tp::SetFakePointerOwners(starts, sizes, owners, n);
}

// --- verbs provider: device-free logic (tests/test_rdma.py) --------------------------------------
#ifdef DTENJAX_HAVE_VERBS
namespace vb = dtenjax::transport::verbs;
DTJ_API int dtenjax_tp_verbs_built() { return 1; }
DTJ_API int dtenjax_tp_verbs_check_transition(int from, int to, char* err, int cap) {
  return Report(vb::CheckTransition(from, to), err, cap);
}
DTJ_API int dtenjax_tp_verbs_transition_mask(int to) { return vb::TransitionMask(to); }
DTJ_API int dtenjax_tp_verbs_select_gid(const uint8_t* raw, const int* types, int n, int ethernet) {
  std::vector<vb::GidEntry> g(size_t(n > 0 ? n : 0));
  for (int i = 0; i < n; ++i) {
    std::memcpy(g[i].raw, raw + 16 * i, 16);
    g[i].type = types[i];
  }
  return vb::SelectGidIndex(g.data(), n, ethernet != 0);
}
// p: port, gid_index, gid_table_len, ethernet, mtu_bytes, max_send_wr, max_recv_wr, device_max_wr,
//    timeout, retry_cnt, rnr_retry, min_rnr_timer, psn, dest_qpn, dlid
DTJ_API int dtenjax_tp_verbs_validate(const int64_t* p, char* err, int cap) {
  vb::QpParams q;
  q.port = int(p[0]); q.gid_index = int(p[1]); q.gid_table_len = int(p[2]); q.ethernet = p[3] != 0;
  q.mtu_bytes = int(p[4]); q.max_send_wr = uint32_t(p[5]); q.max_recv_wr = uint32_t(p[6]);
  q.device_max_wr = uint32_t(p[7]); q.timeout = int(p[8]); q.retry_cnt = int(p[9]);
  q.rnr_retry = int(p[10]); q.min_rnr_timer = int(p[11]); q.psn = uint32_t(p[12]);
  q.dest_qpn = uint32_t(p[13]); q.dlid = uint16_t(p[14]);
  return Report(vb::ValidateQpParams(q), err, cap);
}
DTJ_API uint32_t dtenjax_tp_verbs_encode_imm(uint32_t bytes, int last) { return vb::EncodeImm(bytes, last != 0); }
DTJ_API int dtenjax_tp_verbs_mtu_enum(int bytes) { return vb::MtuEnum(bytes); }
DTJ_API int dtenjax_tp_verbs_probe(char* err, int cap) {
  int n = 0;
  dtenjax::Status s = vb::CountDevices(&n);
  return s.ok() ? 0 : Report(s, err, cap);
}
#else
DTJ_API int dtenjax_tp_verbs_built() { return 0; }
#endif
