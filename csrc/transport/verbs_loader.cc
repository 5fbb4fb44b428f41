// RDMA verbs provider, the library and the device. libibverbs is loaded at run time (dlopen;
// DTENJAX_IBVERBS_LIBRARY can name another file), so the extension imports on machines without
// it; only the data structures and static-inline fast paths (ibv_post_send, ibv_post_recv,
// ibv_poll_cq, ibv_req_notify_cq, which go through context->ops) come from <infiniband/verbs.h>.
// Discovery lists the ports of every device (ListPorts, CountDevices); the provider and the
// buffer pool's hooks share one opened device (AcquireDevice), open while it has users.
#include "csrc/transport/verbs.h"

#include <dlfcn.h>
#include <infiniband/verbs.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "csrc/transport/verbs_impl.h"

namespace dtenjax::transport::verbs {

namespace {

constexpr const char* kDefaultLibrary = "libibverbs.so.1";

std::mutex g_lib_mu;  // guards g_lib and g_lib_error; taken before g_dev_mu, never after
Lib g_lib;
std::string g_lib_error = "libibverbs has not been loaded yet";
int g_dev_users = 0;  // guarded by g_dev_mu (below); read under both locks to switch libraries

Status TryLoad(const std::string& file, Lib* lib) {
  dlerror();
  void* h = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    return DTENJAX_ERROR(Code::kUnavailable,
                         "cannot dlopen " + file + " (" + (e ? e : "?") +
                             "); install rdma-core / libibverbs1 to use RDMA, or set "
                             "DTENJAX_IBVERBS_LIBRARY to the library's path");
  }
  std::string missing;
  auto sym = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
    if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
  };
  sym(lib->get_device_list, "ibv_get_device_list");
  sym(lib->free_device_list, "ibv_free_device_list");
  sym(lib->get_device_name, "ibv_get_device_name");
  sym(lib->open_device, "ibv_open_device");
  sym(lib->close_device, "ibv_close_device");
  sym(lib->query_device, "ibv_query_device");
  sym(lib->query_port, "ibv_query_port");
  sym(lib->query_gid, "ibv_query_gid");
  sym(lib->alloc_pd, "ibv_alloc_pd");
  sym(lib->dealloc_pd, "ibv_dealloc_pd");
  sym(lib->create_comp_channel, "ibv_create_comp_channel");
  sym(lib->destroy_comp_channel, "ibv_destroy_comp_channel");
  sym(lib->create_cq, "ibv_create_cq");
  sym(lib->destroy_cq, "ibv_destroy_cq");
  sym(lib->get_cq_event, "ibv_get_cq_event");
  sym(lib->ack_cq_events, "ibv_ack_cq_events");
  sym(lib->create_qp, "ibv_create_qp");
  sym(lib->destroy_qp, "ibv_destroy_qp");
  sym(lib->modify_qp, "ibv_modify_qp");
  sym(lib->reg_mr, "ibv_reg_mr");
  sym(lib->dereg_mr, "ibv_dereg_mr");
  if (!missing.empty()) {
    dlclose(h);
    return DTENJAX_ERROR(Code::kUnavailable, file + " lacks the verbs " + missing);
  }
  lib->query_gid_ex = reinterpret_cast<decltype(lib->query_gid_ex)>(dlsym(h, "_ibv_query_gid_ex"));
  auto is_emulated = reinterpret_cast<int (*)()>(dlsym(h, "fakeverbs_is_emulated"));
  lib->emulated = is_emulated && is_emulated() == 1;
  lib->handle = h;
  lib->path = file;
  return Status::Ok();
}

std::mutex g_dev_mu;

Device* g_dev = nullptr;
std::string g_want_device;  // set by SetDeviceName (DTENJAX_IB_DEVICE, read in Python)

// The ibv_gid_type of a GID table entry, -1 when the library cannot say.
int GidType(const Lib& lib, ibv_context* ctx, int port, int index) {
  if (!lib.query_gid_ex) return -1;
  ibv_gid_entry e{};
  if (lib.query_gid_ex(ctx, uint32_t(port), uint32_t(index), &e, 0, sizeof(e)) != 0) return -1;
  return int(e.gid_type);
}

}  // namespace

Status LoadLibrary(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_lib_mu);
  if (g_lib.handle && (path.empty() || path == g_lib.path)) return Status::Ok();
  const std::string file = path.empty() ? kDefaultLibrary : path;
  if (g_lib.handle) {
    std::lock_guard<std::mutex> dev(g_dev_mu);
    if (g_dev_users > 0) {
      return DTENJAX_ERROR(Code::kInvalidArgument,
                           "the verbs library " + g_lib.path + " is in use (" +
                               std::to_string(g_dev_users) + " connections or registrations); "
                               "cannot switch to " + file + " (DTENJAX_IBVERBS_LIBRARY) before "
                               "they are closed");
    }
  }
  Lib lib;
  Status s = TryLoad(file, &lib);
  if (!s.ok()) {
    if (!g_lib.handle) g_lib_error = s.message();
    return s;
  }
  // The previous library stays mapped (never dlclose'd): nothing of it is in use any more, but
  // an emulated device may still have a thread winding down in it.
  g_lib = lib;
  g_lib_error.clear();
  return Status::Ok();
}

LibraryInfo Library() {
  std::lock_guard<std::mutex> lock(g_lib_mu);
  LibraryInfo i;
  i.loaded = g_lib.handle != nullptr;
  i.path = i.loaded ? g_lib.path : "";
  i.emulated = g_lib.emulated;
  i.error = i.loaded ? "" : g_lib_error;
  return i;
}

namespace {

// The function table, loading the default library first if none is loaded.
Status Functions(Lib* out) {
  DTENJAX_RETURN_IF_ERROR(LoadLibrary(""));
  std::lock_guard<std::mutex> lock(g_lib_mu);
  *out = g_lib;
  return Status::Ok();
}

}  // namespace

Status CountDevices(int* n) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  int num = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (list) lib.free_device_list(list);
  *n = list ? num : 0;
  if (*n == 0) {
    return DTENJAX_ERROR(Code::kUnavailable, lib.path + " found no RDMA device");
  }
  return Status::Ok();
}

Status ListPorts(std::vector<PortInfo>* out) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  out->clear();
  int num = 0;
  errno = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (!list) {  // rdma-core answers NULL (ENOSYS, ...) where the kernel has no RDMA support
    return DTENJAX_ERROR(Code::kUnavailable, lib.path + " lists no RDMA device (ibv_get_device_list: " +
                                                 std::strerror(errno) + ")");
  }
  for (int i = 0; i < num; ++i) {
    const std::string name = lib.get_device_name(list[i]);
    ibv_context* ctx = lib.open_device(list[i]);
    if (!ctx) continue;
    ibv_device_attr da{};
    if (lib.query_device(ctx, &da) == 0) {
      for (int port = 1; port <= int(da.phys_port_cnt); ++port) {
        ibv_port_attr pa{};
        if (lib.query_port(ctx, uint8_t(port), &pa) != 0) continue;
        PortInfo p;
        p.device = name;
        p.port = port;
        p.state = pa.state;
        p.link_layer = pa.link_layer;
        p.lid = pa.lid;
        p.active_mtu = pa.active_mtu;
        p.active_speed = pa.active_speed;
        p.active_width = pa.active_width;
        for (int g = 0; g < pa.gid_tbl_len && g < 32; ++g) {
          ibv_gid gid;
          if (lib.query_gid(ctx, uint8_t(port), g, &gid) != 0) break;
          std::array<uint8_t, 16> raw;
          std::memcpy(raw.data(), gid.raw, 16);
          p.gids.push_back(raw);
          p.gid_types.push_back(GidType(lib, ctx, port, g));
        }
        out->push_back(std::move(p));
      }
    }
    lib.close_device(ctx);
  }
  lib.free_device_list(list);
  return Status::Ok();
}

// --- the opened device, shared by the provider and the buffer pool's hooks -----------------------

// Opens the device (first user) or takes another reference to it.
Status AcquireDevice(Device** out) {
  Lib lib;
  DTENJAX_RETURN_IF_ERROR(Functions(&lib));
  std::lock_guard<std::mutex> lock(g_dev_mu);
  if (g_dev) {
    ++g_dev_users;
    *out = g_dev;
    return Status::Ok();
  }
  int num = 0;
  ibv_device** list = lib.get_device_list(&num);
  if (!list || num == 0) {
    if (list) lib.free_device_list(list);
    return DTENJAX_ERROR(Code::kUnavailable, "no RDMA device (" + lib.path + " lists none); use "
                                             "the TCP provider");
  }
  auto dev = std::make_unique<Device>();
  dev->lib = lib;
  for (int i = 0; i < num && !dev->ctx; ++i) {
    if (!g_want_device.empty() && g_want_device != lib.get_device_name(list[i])) continue;
    ibv_context* ctx = lib.open_device(list[i]);
    if (!ctx) continue;
    if (lib.query_port(ctx, 1, &dev->port_attr) == 0 && dev->port_attr.state == IBV_PORT_ACTIVE) {
      dev->ctx = ctx;
    } else {
      lib.close_device(ctx);
    }
  }
  lib.free_device_list(list);
  if (!dev->ctx) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "no RDMA device with an active port 1" +
                             (g_want_device.empty() ? std::string() : " named " + g_want_device));
  }
  dev->ethernet = dev->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET;
  std::vector<GidEntry> gids;
  for (int i = 0; i < dev->port_attr.gid_tbl_len && i < 32; ++i) {
    ibv_gid g;
    if (lib.query_gid(dev->ctx, 1, i, &g) != 0) break;
    GidEntry e;
    std::memcpy(e.raw, g.raw, 16);
    // The type from ibv_query_gid_ex where the library has it; else treat IPv4-mapped GIDs as
    // RoCE v2 candidates (a guess: a v1 GID can hold an IPv4-mapped address too).
    const int type = GidType(lib, dev->ctx, 1, i);
    e.type = type >= 0 ? (type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0) : (IsV4Mapped(g.raw) ? 1 : 0);
    gids.push_back(e);
  }
  dev->gid_index = SelectGidIndex(gids.data(), int(gids.size()), dev->ethernet);
  if (dev->gid_index < 0) {
    lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "RDMA port has no usable GID");
  }
  std::memcpy(dev->gid.raw, gids[dev->gid_index].raw, 16);
  dev->pd = lib.alloc_pd(dev->ctx);
  if (!dev->pd) {
    lib.close_device(dev->ctx);
    return DTENJAX_ERROR(Code::kUnavailable, "ibv_alloc_pd failed");
  }
  g_dev = dev.release();
  g_dev_users = 1;
  *out = g_dev;
  return Status::Ok();
}

// Drops a reference; the last one deallocates the PD and closes the device.
void ReleaseDevice() {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  if (!g_dev || --g_dev_users > 0) return;
  g_dev->lib.dealloc_pd(g_dev->pd);
  g_dev->lib.close_device(g_dev->ctx);
  delete g_dev;
  g_dev = nullptr;
}

DeregMr OpenedDeregMr() {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  return g_dev ? g_dev->lib.dereg_mr : nullptr;
}

void SetDeviceName(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  g_want_device = name;
}

int DeviceUsers() {
  std::lock_guard<std::mutex> lock(g_dev_mu);
  return g_dev_users;
}

}  // namespace dtenjax::transport::verbs
