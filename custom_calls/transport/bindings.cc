// Python bindings of the host transport (nanobind), as dtenjax._ffi.transport:
//
//   Comm            one rank of a ring communicator (connect_ring, all_reduce, close)
//   BufferPool      the registered buffer pool
//   set_quota, usage, set_owner_context, check_device_memory, take      tenancy
//   counters, providers, crypto_load, crypto_status, hmac_sha256, gmac, register_site
//   verbs.*         the verbs provider's device-free logic (only when the build has it)
//   _seams          a capsule of the seams the test extension uses (custom_calls/transport/seams.h)
//
// Every failure is a dtenjax::Status thrown with ThrowIfError; module.cc turns it into the
// dtenjax exception class of its code (dtenjax/_src/ffi.py STATUS_ERRORS). Calls that can block
// (connecting a ring, an all-reduce, the token bucket, registering big buffers) release the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <future>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "csrc/transport/bufferpool.h"
#include "csrc/transport/comm.h"
#include "csrc/transport/crypto.h"
#include "csrc/transport/fingerprint.h"
#include "csrc/transport/frame.h"
#include "csrc/transport/provider.h"
#include "csrc/transport/tenancy.h"
#ifdef DTENJAX_HAVE_VERBS
#include "csrc/transport/verbs.h"
#endif
#include "custom_calls/python.h"
#include "custom_calls/transport/seams.h"

namespace nb = nanobind;
namespace tp = dtenjax::transport;
using dtenjax::Code;
using dtenjax::Status;
using dtenjax::python::ThrowIfError;

namespace {

using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using ConstBytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A communicator owned by Python; the native object also lives in the process-wide table (for
// the FFI handler) until close().
class PyComm {
 public:
  PyComm(uint64_t job_id, int rank, int size, nb::bytes secret, double timeout_s,
         const std::string& tenant, const std::string& bind_address, const std::string& provider,
         uint64_t segment_bytes, double handshake_timeout_s, int max_pending_handshakes) {
    tp::CommOptions o;
    o.job_id = job_id;
    o.rank = rank;
    o.size = size;
    o.secret.assign(secret.c_str(), secret.size());
    o.timeout_s = timeout_s;
    o.tenant = tenant;
    o.bind_address = bind_address;
    o.provider = tp::FindProvider(provider);
    o.segment_bytes = segment_bytes;
    o.handshake_timeout_s = handshake_timeout_s;
    o.max_pending_handshakes = max_pending_handshakes;
    if (o.provider == nullptr) {
      std::string built;
      for (const auto* p : tp::Providers()) built += std::string(built.empty() ? "" : ", ") + p->name;
      ThrowIfError(Status(Code::kUnavailable, "transport provider '" + provider +
                                                  "' is not in this build (built: " + built + ")"));
    }
    std::shared_ptr<tp::Comm> c;
    ThrowIfError(tp::Comm::Create(o, &c));
    comm_ = c;
    id_ = tp::RegisterComm(std::move(c));
  }

  int64_t id() const { return id_; }
  std::string endpoint() const { return Get()->endpoint(); }
  int rank() const { return Get()->rank(); }
  int size() const { return Get()->size(); }
  bool closed() const { return comm_ == nullptr; }

  void ConnectRing(const std::string& next_endpoint) {
    std::shared_ptr<tp::Comm> c = Get();
    Status s;
    {
      nb::gil_scoped_release release;
      s = c->ConnectRing(next_endpoint);
    }
    ThrowIfError(s);
  }

  void AllReduce(ConstBytes src, Bytes dst, uint64_t count, int dtype, int op, uint64_t site,
                 uint32_t tag, const std::string& thread) {
    std::shared_ptr<tp::Comm> c = Get();
    const size_t esz = tp::DTypeSize(static_cast<tp::DType>(dtype));
    if (esz == 0) ThrowIfError(Status(Code::kInvalidArgument, "unknown dtype code " + std::to_string(dtype)));
    for (size_t bytes : {src.shape(0), dst.shape(0)}) {
      if (count > bytes / esz || count * esz != bytes) {
        ThrowIfError(Status(Code::kInvalidArgument,
                            "buffer of " + std::to_string(bytes) + " bytes does not hold " +
                                std::to_string(count) + " elements of " + std::to_string(esz) +
                                " bytes"));
      }
    }
    const void* in = src.data();
    void* ptr = dst.data();
    Status s;
    {
      nb::gil_scoped_release release;
      // Through the worker queue like the FFI handler, so Python and jitted collectives of one
      // communicator stay in one order.
      std::promise<Status> done;
      std::future<Status> result = done.get_future();
      Status submitted = c->Submit([&] {
        Status st;
        try {
          st = c->AllReduce(in, ptr, count, static_cast<tp::DType>(dtype),
                            static_cast<tp::ReduceOp>(op), site, -1, tag, thread);
        } catch (const std::exception& e) {
          st = DTENJAX_ERROR(Code::kInternal, std::string("all_reduce raised: ") + e.what());
        }
        done.set_value(st);
      });
      s = submitted.ok() ? result.get() : submitted;
    }
    ThrowIfError(s);
  }

  // Interrupts what runs and refuses what comes (Close without waiting); close() still drops it.
  void Interrupt() {
    if (comm_) comm_->Close(0.0);
  }

  // Interrupts the collective in flight and fails the queued ones ("closed locally"), waits for
  // the worker thread, then drops the communicator (its connections close with the last user).
  void Close() {
    if (comm_) {
      std::shared_ptr<tp::Comm> c = comm_;
      {
        nb::gil_scoped_release release;
        c->Close();
      }
      tp::DestroyComm(id_);
      comm_.reset();
    }
  }

 private:
  std::shared_ptr<tp::Comm> Get() const {
    if (!comm_) {
      ThrowIfError(Status(Code::kInvalidArgument,
                          "communicator " + std::to_string(id_) + " is closed; create a new one"));
    }
    return comm_;
  }
  std::shared_ptr<tp::Comm> comm_;
  int64_t id_ = 0;
};

int BufId(int64_t id) {
  if (id < 0 || id > INT_MAX) {
    ThrowIfError(Status(Code::kInvalidArgument,
                        "buffer pool: no buffer with id " + std::to_string(id) + " (ids are 0..2^31-1)"));
  }
  return int(id);
}

nb::dict PoolStatsDict(tp::BufferPool& p) {
  tp::PoolStats s = p.Stats();
  static_assert(sizeof(tp::PoolStats) == sizeof(uint64_t) * tp::kNumPoolStats, "PoolStats layout");
  uint64_t raw[tp::kNumPoolStats];
  std::memcpy(raw, &s, sizeof(s));
  nb::dict d;
  for (int i = 0; i < tp::kNumPoolStats; ++i) d[tp::kPoolStatNames[i]] = raw[i];
  return d;
}

void BindTransport(nb::module_& root) {
  dtenjax::python::AddVocabulary(root, "transport.dtype",
                                 {DTENJAX_TRANSPORT_DTYPES(DTENJAX_VOCAB_ENTRY)});
  dtenjax::python::AddVocabulary(root, "transport.op", {DTENJAX_TRANSPORT_OPS(DTENJAX_VOCAB_ENTRY)});
  nb::module_ m = root.def_submodule("transport", "dtenjax host transport");

  m.def("counters", [] {
    uint64_t raw[tp::kNumCounters];
    tp::TransportCountersSnapshot(raw);
    nb::dict d;
    for (int i = 0; i < tp::kNumCounters; ++i) d[tp::kCounterNames[i]] = raw[i];
    return d;
  });
  m.def("providers", [] {
    std::vector<std::string> names;
    for (const auto* p : tp::Providers()) names.push_back(p->name);
    return names;
  });
  m.def("crypto_load", [](const std::string& path) { ThrowIfError(tp::crypto::Load(path)); },
        nb::arg("path") = "");
  m.def("crypto_status", [] {
    Status s = tp::crypto::Loaded();
    return std::make_tuple(s.ok(), s.message(), tp::crypto::LibraryName());
  });
  m.def("hmac_sha256", [](nb::bytes key, nb::bytes msg) {
    uint8_t out[32];
    ThrowIfError(tp::crypto::HmacSha256(key.c_str(), key.size(), msg.c_str(), msg.size(), out));
    return nb::bytes(reinterpret_cast<const char*>(out), 32);
  });
  m.def("gmac", [](nb::bytes key, uint64_t counter, uint32_t label, nb::bytes data) {
    if (key.size() != tp::crypto::kKeyBytes) {
      ThrowIfError(Status(Code::kInvalidArgument, "GMAC key must be 32 bytes, got " +
                                                      std::to_string(key.size())));
    }
    tp::crypto::Gmac g;
    ThrowIfError(g.Init(reinterpret_cast<const uint8_t*>(key.c_str())));
    uint8_t out[tp::crypto::kTagBytes];
    ThrowIfError(g.Tag(counter, label, data.c_str(), data.size(), nullptr, 0, out));
    return nb::bytes(reinterpret_cast<const char*>(out), sizeof(out));
  });
  m.def("register_site", [](uint64_t id, const std::string& site, const std::string& signature) {
    ThrowIfError(tp::RegisterSite(id, site, signature));
  }, nb::arg("id"), nb::arg("site"), nb::arg("signature") = "");

  nb::class_<PyComm>(m, "Comm")
      .def(nb::init<uint64_t, int, int, nb::bytes, double, const std::string&, const std::string&,
                    const std::string&, uint64_t, double, int>(),
           nb::arg("job_id"), nb::arg("rank"), nb::arg("size"), nb::arg("secret"),
           nb::arg("timeout_s"), nb::arg("tenant"), nb::arg("bind_address"), nb::arg("provider"),
           nb::arg("segment_bytes"), nb::arg("handshake_timeout_s"),
           nb::arg("max_pending_handshakes"))
      .def_prop_ro("id", &PyComm::id)
      .def_prop_ro("endpoint", &PyComm::endpoint)
      .def_prop_ro("rank", &PyComm::rank)
      .def_prop_ro("size", &PyComm::size)
      .def_prop_ro("closed", &PyComm::closed)
      .def("connect_ring", &PyComm::ConnectRing)
      .def("all_reduce", &PyComm::AllReduce, nb::arg("src"), nb::arg("dst"), nb::arg("count"),
           nb::arg("dtype"), nb::arg("op"), nb::arg("site"), nb::arg("tag") = 0,
           nb::arg("thread") = "")
      .def("interrupt", &PyComm::Interrupt)
      .def("close", &PyComm::Close);

  nb::class_<tp::BufferPool>(m, "BufferPool")
      .def("__init__",
           [](tp::BufferPool* self, uint64_t max_bytes, uint32_t max_buffers,
              uint64_t max_buffer_bytes, bool pin, const std::string& tenant,
              const std::string& registration) {
             tp::PoolOptions o;
             o.max_bytes = max_bytes;
             o.max_buffers = max_buffers;
             o.max_buffer_bytes = max_buffer_bytes;
             o.pin = pin;
             o.tenant = tenant;
             ThrowIfError(tp::ValidatePoolOptions(o));
             if (registration == "verbs") {  // buffers are ibv_reg_mr regions of the RDMA device
#ifdef DTENJAX_HAVE_VERBS
               o.hooks = tp::verbs::PoolHooks();
#else
               ThrowIfError(Status(Code::kUnavailable, "registration='verbs' needs the verbs "
                                                       "provider, which this build lacks"));
#endif
             } else if (registration != "host") {
               ThrowIfError(Status(Code::kInvalidArgument, "registration='" + registration +
                                                               "' is not 'host' or 'verbs'"));
             }
             new (self) tp::BufferPool(o);
           },
           nb::arg("max_bytes"), nb::arg("max_buffers"), nb::arg("max_buffer_bytes"),
           nb::arg("pin"), nb::arg("tenant"), nb::arg("registration") = "host")
      .def("acquire",
           [](tp::BufferPool& p, uint64_t n) {
             int id = -1;
             Status s;
             {
               nb::gil_scoped_release release;
               s = p.Acquire(n, &id);
             }
             ThrowIfError(s);
             return id;
           })
      .def("retain", [](tp::BufferPool& p, int64_t id) { ThrowIfError(p.Retain(BufId(id))); })
      .def("post", [](tp::BufferPool& p, int64_t id) { ThrowIfError(p.Post(BufId(id))); })
      .def("complete", [](tp::BufferPool& p, int64_t id) { ThrowIfError(p.Complete(BufId(id))); })
      .def("release", [](tp::BufferPool& p, int64_t id) { ThrowIfError(p.Release(BufId(id))); })
      .def("trim", [](tp::BufferPool& p) {
        nb::gil_scoped_release release;
        p.Trim();
      })
      .def("close", [](tp::BufferPool& p) {
        nb::gil_scoped_release release;
        p.Close();
      })
      .def_prop_ro("closed", [](tp::BufferPool& p) { return p.closed(); })
      .def("address", [](tp::BufferPool& p, int64_t id) {
        return uint64_t(reinterpret_cast<uintptr_t>(p.Data(BufId(id))));
      })
      .def("size", [](tp::BufferPool& p, int64_t id) { return p.Size(BufId(id)); })
      .def("state", [](tp::BufferPool& p, int64_t id) { return p.State(BufId(id)); })
      .def("stats", [](tp::BufferPool& p) { return PoolStatsDict(p); });

  m.def("set_quota", [](const std::string& tenant, int64_t max_connections,
                        int64_t max_registered_bytes, double rate, double burst) {
    tp::TenantQuota q;
    q.max_connections = max_connections;
    q.max_registered_bytes = max_registered_bytes;
    q.rate_bytes_per_s = rate;
    q.burst_bytes = burst;
    ThrowIfError(tp::GetTenant(tenant)->SetQuota(q));
  });
  m.def("usage", [](const std::string& tenant) {
    tp::TenantUsage u = tp::GetTenant(tenant)->usage();
    nb::dict d;
    d["connections"] = u.connections;
    d["registered_bytes"] = u.registered_bytes;
    d["quota_refusals"] = u.quota_refusals;
    d["ownership_refusals"] = u.ownership_refusals;
    return d;
  });
  m.def("set_owner_context", [](const std::string& tenant, int64_t ctx) {
    tp::GetTenant(tenant)->SetOwnerContext(ctx);
  });
  m.def("check_device_memory", [](const std::string& tenant, uint64_t ptr, uint64_t nbytes) {
    ThrowIfError(tp::GetTenant(tenant)->CheckDeviceMemory(reinterpret_cast<const void*>(ptr), nbytes));
  });
  m.def("take", [](const std::string& tenant, uint64_t nbytes, double timeout_s) {
    uint64_t slept = 0;
    Status s;
    {
      nb::gil_scoped_release release;
      s = tp::GetTenant(tenant)->bucket().Take(nbytes, tp::NowSeconds() + timeout_s, &slept);
    }
    ThrowIfError(s);
    return slept;
  });

#ifdef DTENJAX_HAVE_VERBS
  namespace vb = dtenjax::transport::verbs;
  nb::module_ v = m.def_submodule("verbs", "device-free logic of the verbs provider");
  v.def("check_transition", [](int from, int to) { ThrowIfError(vb::CheckTransition(from, to)); });
  v.def("transition_mask", &vb::TransitionMask);
  v.def("select_gid", [](nb::bytes raw, std::vector<int> types, bool ethernet) {
    const size_t n = types.size();
    if (raw.size() != 16 * n) {
      ThrowIfError(Status(Code::kInvalidArgument, "select_gid needs 16 bytes per GID type"));
    }
    std::vector<vb::GidEntry> g(n);
    for (size_t i = 0; i < n; ++i) {
      std::memcpy(g[i].raw, raw.c_str() + 16 * i, 16);
      g[i].type = types[i];
    }
    return vb::SelectGidIndex(g.data(), int(n), ethernet);
  });
  v.def("validate_qp", [](int port, int gid_index, int gid_table_len, bool ethernet, int mtu_bytes,
                          uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t device_max_wr,
                          int timeout, int retry_cnt, int rnr_retry, int min_rnr_timer,
                          uint32_t psn, uint32_t dest_qpn, uint16_t dlid) {
    vb::QpParams q;
    q.port = port; q.gid_index = gid_index; q.gid_table_len = gid_table_len; q.ethernet = ethernet;
    q.mtu_bytes = mtu_bytes; q.max_send_wr = max_send_wr; q.max_recv_wr = max_recv_wr;
    q.device_max_wr = device_max_wr; q.timeout = timeout; q.retry_cnt = retry_cnt;
    q.rnr_retry = rnr_retry; q.min_rnr_timer = min_rnr_timer; q.psn = psn; q.dest_qpn = dest_qpn;
    q.dlid = dlid;
    ThrowIfError(vb::ValidateQpParams(q));
  }, nb::arg("port"), nb::arg("gid_index"), nb::arg("gid_table_len"), nb::arg("ethernet"),
        nb::arg("mtu_bytes"), nb::arg("max_send_wr"), nb::arg("max_recv_wr"),
        nb::arg("device_max_wr"), nb::arg("timeout"), nb::arg("retry_cnt"), nb::arg("rnr_retry"),
        nb::arg("min_rnr_timer"), nb::arg("psn"), nb::arg("dest_qpn"), nb::arg("dlid"));
  v.def("encode_imm", &vb::EncodeImm);
  v.def("mtu_enum", &vb::MtuEnum);
  v.def("probe", [] {
    int n = 0;
    ThrowIfError(vb::CountDevices(&n));
    return n;
  });
  v.def("set_device", &vb::SetDeviceName);
  v.def("load", [](const std::string& path) { ThrowIfError(vb::LoadLibrary(path)); },
        nb::arg("path") = "");
  v.def("library", [] {
    vb::LibraryInfo i = vb::Library();
    nb::dict d;
    d["loaded"] = i.loaded;
    d["path"] = i.path;
    d["emulated"] = i.emulated;
    d["error"] = i.error;
    return d;
  });
  v.def("ports", [] {
    std::vector<vb::PortInfo> ports;
    ThrowIfError(vb::ListPorts(&ports));
    nb::list out;
    for (const auto& p : ports) {
      nb::dict d;
      d["device"] = p.device;
      d["port"] = p.port;
      d["state"] = p.state;
      d["link_layer"] = p.link_layer;
      d["lid"] = p.lid;
      d["active_mtu"] = p.active_mtu;
      d["active_speed"] = p.active_speed;
      d["active_width"] = p.active_width;
      nb::list gids;
      for (const auto& g : p.gids) gids.append(nb::bytes(reinterpret_cast<const char*>(g.data()), 16));
      d["gids"] = gids;
      d["gid_types"] = p.gid_types;
      out.append(d);
    }
    return out;
  });
  v.def("device_users", &vb::DeviceUsers);
#endif

  static const tp::Seams kSeams = {
      tp::kSeamsVersion,
      &tp::SwapThreadSpawner,
      &tp::SwapPointerOwnerFn,
      [](PyObject* obj) -> tp::BufferPool* {
        tp::BufferPool* pool = nullptr;
        return nb::try_cast<tp::BufferPool*>(nb::handle(obj), pool) ? pool : nullptr;
      },
      [](tp::BufferPool* pool, tp::RegisterHooks hooks) { return pool->SwapRegisterHooks(hooks); },
      [](const Status& s) { ThrowIfError(s); },
  };
  m.attr("_seams") = nb::capsule(&kSeams, tp::kSeamsCapsule);
}

}  // namespace

DTENJAX_PYTHON_BINDINGS(transport, BindTransport);
