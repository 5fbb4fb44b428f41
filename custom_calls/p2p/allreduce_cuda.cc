// The NVLink peer-to-peer all-reduce at the boundaries (csrc/p2p/):
//
// Python bindings (eager set-up, outside any trace; called by dtenjax/_src/gpu/p2p.py):
//   p2p_register(ordinal, capacity) -> bytes             this device's region descriptor
//                                                        (kDescriptorBytes bytes, vocabulary.h)
//   p2p_connect(ordinal, key, rank, world, descriptors)  maps every rank's region
//   p2p_kernel_timeouts() -> [str]                       regions whose kernel timed out
//   _p2p_seams                                           a capsule of the seams the test
//                                                        extension's harness uses (seams.h)
//
// FFI handler:
//   dtenjax_p2p_all_reduce(x; key, algorithm, op, reproducible, mean, max_blocks, timeout_ms)
//       -> like x; the attributes' integers are those of csrc/p2p/vocabulary.h
//       command-buffer compatible: it only looks the communicator up and launches, one launch per
//       chunk of at most the registered buffer.
// The harness of N simulated ranks on one GPU is test-only code: dtenjax._ffi_testing
// (custom_calls/testing/p2p_selftest_cuda.cc).
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>

#include "csrc/p2p/allreduce.h"
#include "csrc/p2p/registry.h"
#include "custom_calls/p2p/attributes.h"
#include "custom_calls/p2p/launch.h"
#include "custom_calls/p2p/seams.h"
#include "custom_calls/python.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace p2p = dtenjax::p2p;

namespace {

using p2p::attributes::ToKernel;

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
    return dtenjax::ffi::ToFfiError(p2p::CopyOnStream(res, in, n * item, stream, kWhat));
  }
  p2p::LaunchArgs a = p2p::KernelLaunch(kernel, mean, timeout_ms, comm.peers, comm.world,
                                        comm.capacity, comm.error_dev);
  a.rank0 = comm.rank;   // one rank per device: this one
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

DTENJAX_REGISTER_FFI("dtenjax_p2p_all_reduce", "CUDA", P2PAllReduceExecute);

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
                         "p2p_connect: descriptors must hold " +
                             std::to_string(p2p::kDescriptorBytes) +
                             " bytes per rank of a world in [1, " +
                             std::to_string(p2p::kMaxRanks) + "]");
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
  static const p2p::Seams kSeams = {
      p2p::kSeamsVersion,
      static_cast<uint32_t>(sizeof(p2p::LaunchArgs)),
      &p2p::LaunchAllReduce,
      &p2p::MaxResidentBlocks,
      &p2p::AllocRegionOn,
      &p2p::AllocErrorWords,
      &p2p::CheckKernelError,
  };
  m.attr("_p2p_seams") = nb::capsule(&kSeams, p2p::kSeamsCapsule);
});
