// dtenjax._ffi_testing.transport: fault injection into the host transport, for dtenjax's own
// tests only. Built with -DDTENJAX_BUILD_TESTING=ON (editable installs: scripts/setup.sh,
// scripts/test.sh, scripts/gpu_check.sh), never into a wheel. It acts only through the seams the
// production extension publishes (custom_calls/transport/seams.h):
//
//   fail_thread_starts(n)             the next n thread starts fail as if pthread_create gave EAGAIN
//   fail_registrations(pool, every_n) every n-th registration of pool from now on fails with an
//                                     internal error, as ibv_reg_mr can for reasons other than
//                                     room, which evicting cached buffers does not cure (0: stop)
//   set_pointer_owners([(start, size, owner)])   device-pointer ownership from a table, so the
//                                     refusal logic is tested without CUDA
//   reset_pointer_owners()            the build's own ownership check again
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "custom_calls/transport/seams.h"

namespace nb = nanobind;
namespace tp = dtenjax::transport;
using dtenjax::Code;
using dtenjax::Status;

namespace {

const tp::Seams& Seams() {
  static const tp::Seams* seams = [] {
    nb::object cap = nb::module_::import_("dtenjax._ffi").attr("transport").attr("_seams");
    auto* s = static_cast<const tp::Seams*>(PyCapsule_GetPointer(cap.ptr(), tp::kSeamsCapsule));
    if (s == nullptr) throw nb::python_error();
    if (s->version != tp::kSeamsVersion) {
      throw std::runtime_error("dtenjax._ffi_testing was built against seams version " +
                               std::to_string(tp::kSeamsVersion) + ", dtenjax._ffi has " +
                               std::to_string(s->version) + "; rebuild both");
    }
    return s;
  }();
  return *seams;
}

// --- thread starts ---------------------------------------------------------------------------

std::atomic<int> g_thread_failures{0};
std::atomic<tp::ThreadSpawner> g_real_spawner{nullptr};

void FailingSpawner(std::function<void()> body) {
  int left = g_thread_failures.load();
  while (left > 0 && !g_thread_failures.compare_exchange_weak(left, left - 1)) {
  }
  if (left > 0) {
    throw std::system_error(std::make_error_code(std::errc::resource_unavailable_try_again),
                            "injected thread-start failure");
  }
  g_real_spawner.load()(std::move(body));
}

void FailThreadStarts(int n) {
  g_thread_failures.store(n < 0 ? 0 : n);
  tp::ThreadSpawner old = Seams().swap_thread_spawner(&FailingSpawner);
  if (old != &FailingSpawner) g_real_spawner.store(old);
}

// --- registrations ---------------------------------------------------------------------------

struct Failing {
  tp::RegisterHooks inner;
  uint32_t every_n = 0;
  uint64_t attempts = 0;
};
std::mutex g_failing_mu;

Status FailingReg(void* ctx, void* ptr, uint64_t bytes, uint64_t* handle) {
  auto* f = static_cast<Failing*>(ctx);
  if (f->every_n > 0 && ++f->attempts % f->every_n == 0) {
    return DTENJAX_ERROR(Code::kInternal, "buffer pool: injected registration failure");
  }
  return f->inner.reg ? f->inner.reg(f->inner.ctx, ptr, bytes, handle) : Status::Ok();
}

void FailingDereg(void* ctx, uint64_t handle) {
  auto* f = static_cast<Failing*>(ctx);
  if (f->inner.dereg) f->inner.dereg(f->inner.ctx, handle);
}

void FailRegistrations(nb::handle pool_obj, uint32_t every_n) {
  tp::BufferPool* pool = Seams().pool_of(pool_obj.ptr());
  if (pool == nullptr) throw nb::type_error("fail_registrations takes a dtenjax._ffi.transport.BufferPool");
  // A fresh wrapper per call, never freed (buffers registered under it are deregistered through
  // whatever hooks the pool has then, and a pool may outlive the test), around the pool's own
  // hooks: those it had, or those an earlier call wrapped. Called while the pool is quiet.
  std::lock_guard<std::mutex> lock(g_failing_mu);
  auto* f = new Failing;
  f->every_n = every_n;
  const tp::RegisterHooks prev = Seams().swap_register_hooks(pool, {&FailingReg, &FailingDereg, f});
  f->inner = prev.reg == &FailingReg ? static_cast<Failing*>(prev.ctx)->inner : prev;
}

// --- device-pointer ownership ----------------------------------------------------------------

struct Range { uint64_t start, size; int64_t owner; };
std::mutex g_owner_mu;
std::vector<Range> g_ranges;
tp::PointerOwnerFn g_real_owner = nullptr;

Status TableOwner(const void* ptr, uint64_t bytes, int64_t* owner) {
  std::lock_guard<std::mutex> lock(g_owner_mu);
  const uint64_t p = reinterpret_cast<uint64_t>(ptr);
  for (const auto& r : g_ranges) {
    if (p >= r.start && p < r.start + r.size) {
      if (bytes > r.start + r.size - p) {
        return DTENJAX_ERROR(Code::kPermissionDenied,
                             "range [ptr, ptr+bytes) runs past the end of its allocation");
      }
      *owner = r.owner;
      return Status::Ok();
    }
  }
  return DTENJAX_ERROR(Code::kPermissionDenied, "pointer is not device memory of any known context");
}

void SetPointerOwners(const std::vector<std::tuple<uint64_t, uint64_t, int64_t>>& ranges) {
  for (const auto& [start, size, owner] : ranges) {
    if (size == 0 || start + size < start) {
      Seams().throw_if_error(DTENJAX_ERROR(
          Code::kInvalidArgument, "fake owner range start=" + std::to_string(start) +
                                      " size=" + std::to_string(size) +
                                      " is empty or wraps past 2^64"));
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_owner_mu);
    g_ranges.clear();
    for (const auto& [start, size, owner] : ranges) g_ranges.push_back({start, size, owner});
  }
  tp::PointerOwnerFn old = Seams().swap_pointer_owner_fn(&TableOwner);
  if (old != &TableOwner) g_real_owner = old;
}

void ResetPointerOwners() {
  if (g_real_owner != nullptr) {
    Seams().swap_pointer_owner_fn(g_real_owner);
    g_real_owner = nullptr;
  }
  std::lock_guard<std::mutex> lock(g_owner_mu);
  g_ranges.clear();
}

}  // namespace

void BindTransportTesting(nb::module_& root) {
  nb::module_ m = root.def_submodule("transport", "fault injection into the host transport");
  m.def("fail_thread_starts", &FailThreadStarts, nb::arg("n"));
  m.def("fail_registrations", &FailRegistrations, nb::arg("pool"), nb::arg("every_n"));
  m.def("set_pointer_owners", &SetPointerOwners, nb::arg("ranges"));
  m.def("reset_pointer_owners", &ResetPointerOwners);
}
