// The NVLink peer-to-peer all-reduce at the boundaries (csrc/p2p/):
//
// Python bindings (eager set-up, outside any trace; called by dtenjax/_src/gpu/p2p.py):
//   p2p_register(ordinal, capacity) -> bytes[128]       this device's region descriptor
//   p2p_connect(ordinal, key, rank, world, descriptors)  maps every rank's region
//   p2p_kernel_timeouts() -> [str]                       regions whose kernel timed out
//
// FFI handlers:
//   dtenjax_p2p_all_reduce(x; key, algorithm, op, reproducible, mean, max_blocks, timeout_ms)
//       -> like x; the attributes' integers are those of csrc/p2p/vocabulary.h
//       command-buffer compatible: it only looks the communicator up and launches, one launch per
//       chunk of at most the registered buffer.
//   dtenjax_p2p_selftest(x[N, n]; count, algorithm, op, reproducible, mean, iters, mode, capacity,
//       max_blocks, timeout_ms)
//       N simulated ranks on one GPU running the same kernels (allocates its arena once; not
//       command-buffer compatible). dtenjax_p2p_selftest_graph: the same, command-buffer
//       compatible, needs the arena made by an earlier dtenjax_p2p_selftest call.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>

#include "csrc/p2p/allreduce.h"
#include "csrc/p2p/registry.h"
#include "custom_calls/p2p/attributes.h"
#include "custom_calls/python.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace p2p = dtenjax::p2p;

namespace {

using p2p::attributes::TimeoutNs;
using p2p::attributes::ToKernel;

// A device-to-device copy on XLA's stream (a reduction over one rank is a copy).
dtenjax::Status Copy(void* dst, const void* src, size_t bytes, cudaStream_t stream,
                     const char* what) {
  DTENJAX_CUDA_CHECK_AS(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                        dtenjax::Code::kInternal, std::string(what) + ": copy failed");
  return dtenjax::Status::Ok();
}

// --- all-reduce --------------------------------------------------------------------------------
//
// The communicator of each device is looked up (by ordinal and key) in the process-wide registry
// under its mutex, so one executable's handler serves all local devices from several threads.

ffi::Error AllReduceExecute(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, int64_t key, int64_t algorithm,
                            int64_t op, int64_t reproducible, int64_t mean, int64_t max_blocks,
                            int64_t timeout_ms) {
  constexpr const char* kWhat = "dtenjax_p2p_all_reduce";
  auto decoded = ToKernel(x.element_type(), algorithm, op, reproducible, kWhat);
  if (decoded.has_error()) return decoded.error();
  const p2p::attributes::Kernel kernel = decoded.value();
  if (out->element_type() != x.element_type() || out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("dtenjax_p2p_all_reduce: output must match the input");
  }
  p2p::Comm comm;
  dtenjax::Status s = p2p::FindComm(ordinal, static_cast<uint64_t>(key), &comm);
  if (s.ok()) s = p2p::CheckKernelError(ordinal, comm.error_host, kWhat);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  const size_t item = p2p::DTypeBytes(kernel.dtype);
  const int64_t n = static_cast<int64_t>(x.element_count());
  char* in = static_cast<char*>(x.untyped_data());
  char* res = static_cast<char*>(out->untyped_data());
  if (n == 0) return ffi::Error::Success();  // the same on every rank: no launch anywhere
  if (comm.world == 1) {  // one rank: the sum is the input (mean divides by 1; max/min are x)
    if (in == res) return ffi::Error::Success();
    return dtenjax::ffi::ToFfiError(Copy(res, in, n * item, stream, kWhat));
  }
  p2p::LaunchArgs a;
  a.peers = comm.peers;
  a.world = comm.world;
  a.rank0 = comm.rank;
  a.local_ranks = 1;
  a.capacity = comm.capacity;
  a.dtype = kernel.dtype;
  a.algorithm = kernel.algorithm;
  a.op = kernel.op;
  a.reproducible = kernel.reproducible;
  a.mean = mean != 0;
  a.timeout_ns = TimeoutNs(timeout_ms);
  a.error = comm.error_dev;
  // Chunks of whole 16-byte vectors that fit the registered buffer; every rank cuts the same way.
  const int64_t chunk = static_cast<int64_t>(comm.capacity / 16 * 16 / item);
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t count = n - off < chunk ? n - off : chunk;
    a.io[0] = {in + off * item, res + off * item};
    a.count = count;
    a.blocks = p2p::BlocksFor(static_cast<size_t>(count) * item, static_cast<int>(max_blocks));
    s = p2p::LaunchAllReduce(a, stream);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

// --- the simulated-rank harness ----------------------------------------------------------------

ffi::Error Selftest(bool create, cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm, int64_t op,
                    int64_t reproducible, int64_t mean, int64_t iters, int64_t mode,
                    int64_t capacity, int64_t max_blocks, int64_t timeout_ms) {
  constexpr const char* kWhat = "dtenjax_p2p_selftest";
  auto decoded = ToKernel(x.element_type(), algorithm, op, reproducible, kWhat);
  if (decoded.has_error()) return decoded.error();
  const p2p::attributes::Kernel kernel = decoded.value();
  const auto dims = x.dimensions();
  if (dims.size() != 2 || out->element_type() != x.element_type() ||
      out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: input must be [ranks, n] and the output the same");
  }
  if (iters < 1 || mode < 0 || mode > 3 || count < 0 || count > dims[1]) {
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: iters must be >= 1, mode 0..3 and 0 <= count <= n");
  }
  const int world = static_cast<int>(dims[0]);
  const int64_t n = dims[1];
  const size_t row = static_cast<size_t>(n) * p2p::DTypeBytes(kernel.dtype);
  char* xin = static_cast<char*>(x.untyped_data());
  char* xout = static_cast<char*>(out->untyped_data());
  if (mode == 2) {  // reference: device-to-device copy of the whole stacked buffer, iters times
    for (int64_t it = 0; it < iters; ++it) {
      const dtenjax::Status c = Copy(xout, xin, row * world, stream, kWhat);
      if (!c.ok()) return dtenjax::ffi::ToFfiError(c);
    }
    return ffi::Error::Success();
  }
  p2p::SimArena arena;
  dtenjax::Status s =
      p2p::GetSimArena(ordinal, world, static_cast<size_t>(capacity), create, &arena);
  if (s.ok()) s = p2p::CheckKernelError(ordinal, arena.error_host, kWhat);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  if (row % 16 != 0) {
    // Each simulated rank's row must start 16-byte aligned: the row stride n is padded, and
    // `count` (any value <= n) is what the kernels reduce, so odd sizes are still exercised.
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: n * itemsize must be a multiple of 16 (pad the rows; reduce "
        "fewer elements with `count`)");
  }
  p2p::LaunchArgs a;
  a.peers = arena.peers;
  a.world = world;
  a.rank0 = 0;
  // mode 3: only rank 0 enters (a peer that never arrives): the kernel must time out and trap.
  a.local_ranks = mode == 3 ? 1 : world;
  const int want = p2p::BlocksFor(static_cast<size_t>(count) * p2p::DTypeBytes(kernel.dtype),
                                  static_cast<int>(max_blocks));
  a.blocks = want < arena.blocks ? want : arena.blocks;
  a.count = count;
  a.capacity = arena.capacity;
  a.dtype = kernel.dtype;
  a.algorithm = kernel.algorithm;
  a.op = kernel.op;
  a.reproducible = kernel.reproducible;
  a.mean = mean != 0;
  a.timeout_ns = TimeoutNs(timeout_ms);
  a.error = arena.error_dev;
  // mode 0 (validation): iteration 0 reduces x, the middle ones reduce their own previous output
  // (different data in both parity buffers), the last reduces x again: a stale read of an
  // earlier call's buffer or flags changes the final bits. mode 1 (timing): x every iteration.
  for (int64_t it = 0; it < iters; ++it) {
    const bool from_x = mode != 0 || it == 0 || it == iters - 1;
    for (int r = 0; r < world; ++r) {
      a.io[r] = {(from_x ? xin : xout) + r * row, xout + r * row};
    }
    s = p2p::LaunchAllReduce(a, stream);
    if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  }
  return ffi::Error::Success();
}

ffi::Error SelftestAlloc(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm,
                         int64_t op, int64_t reproducible, int64_t mean, int64_t iters,
                         int64_t mode, int64_t capacity, int64_t max_blocks, int64_t timeout_ms) {
  return Selftest(true, stream, ordinal, x, out, count, algorithm, op, reproducible, mean,
                  iters, mode, capacity, max_blocks, timeout_ms);
}

ffi::Error SelftestGraph(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm,
                         int64_t op, int64_t reproducible, int64_t mean, int64_t iters,
                         int64_t mode, int64_t capacity, int64_t max_blocks, int64_t timeout_ms) {
  return Selftest(false, stream, ordinal, x, out, count, algorithm, op, reproducible, mean,
                  iters, mode, capacity, max_blocks, timeout_ms);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PAllReduceExecute, AllReduceExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("key")
                                  .Attr<int64_t>("algorithm")
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("reproducible")
                                  .Attr<int64_t>("mean")
                                  .Attr<int64_t>("max_blocks")
                                  .Attr<int64_t>("timeout_ms"),
                              {ffi::Traits::kCmdBufferCompatible});

#define DTENJAX_P2P_SELFTEST_BINDING                  \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()       \
      .Ctx<ffi::DeviceOrdinal>()                      \
      .Arg<ffi::AnyBuffer>()                          \
      .Ret<ffi::AnyBuffer>()                          \
      .Attr<int64_t>("count")                         \
      .Attr<int64_t>("algorithm")                     \
      .Attr<int64_t>("op")                            \
      .Attr<int64_t>("reproducible")                  \
      .Attr<int64_t>("mean")                          \
      .Attr<int64_t>("iters")                         \
      .Attr<int64_t>("mode")                          \
      .Attr<int64_t>("capacity")                      \
      .Attr<int64_t>("max_blocks")                    \
      .Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PSelftest, SelftestAlloc, DTENJAX_P2P_SELFTEST_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PSelftestGraph, SelftestGraph, DTENJAX_P2P_SELFTEST_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

DTENJAX_REGISTER_FFI("dtenjax_p2p_all_reduce", "CUDA", P2PAllReduceExecute);
DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest", "CUDA", P2PSelftest);
DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest_graph", "CUDA", P2PSelftestGraph);

// --- Python bindings: set-up runs eagerly, on the caller's thread, with the GIL released -------

DTENJAX_PYTHON_BINDINGS(p2p, [](nb::module_& m) {
  m.def(
      "p2p_register",
      [](int ordinal, int64_t capacity) {
        DTENJAX_CHECK_PY(capacity > 0, "p2p_register: capacity must be positive");
        p2p::Descriptor d;
        {
          nb::gil_scoped_release release;
          dtenjax::python::ThrowIfError(
              p2p::RegisterRegion(ordinal, static_cast<size_t>(capacity), &d));
        }
        return nb::bytes(reinterpret_cast<const char*>(&d), sizeof(d));
      },
      nb::arg("ordinal"), nb::arg("capacity"),
      "Allocates (once) the symmetric region of CUDA device `ordinal`; returns its descriptor.");
  m.def(
      "p2p_connect",
      [](int ordinal, int64_t key, int rank, int world, nb::bytes descriptors) {
        DTENJAX_CHECK_PY(world >= 1 && world <= p2p::kMaxRanks &&
                             descriptors.size() == sizeof(p2p::Descriptor) * world,
                         "p2p_connect: descriptors must hold 128 bytes per rank of a world in "
                         "[1, 8]");
        const std::string all(descriptors.c_str(), descriptors.size());
        nb::gil_scoped_release release;
        dtenjax::python::ThrowIfError(
            p2p::Connect(ordinal, static_cast<uint64_t>(key), rank, world,
                         reinterpret_cast<const p2p::Descriptor*>(all.data())));
      },
      nb::arg("ordinal"), nb::arg("key"), nb::arg("rank"), nb::arg("world"),
      nb::arg("descriptors"),
      "Maps every rank's region for device `ordinal` (rank `rank`) under communicator `key`.");
  m.def("p2p_kernel_timeouts", &p2p::KernelTimeouts,
        "One message per device whose p2p kernel timed out (and trapped).");
});
