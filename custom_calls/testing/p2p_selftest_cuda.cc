// The p2p kernels' simulated-rank harness, for dtenjax's own tests and bench/p2p_allreduce.py
// only (dtenjax._ffi_testing; Python: dtenjax.testing.native.p2p_selftest). N simulated ranks on
// one GPU run the shipped kernels in one launch (blockIdx.y = rank): an arena of N regions on the
// device and one block of error words, with as many blocks per rank as let all N ranks' blocks be
// resident together. Everything it does to dtenjax._ffi goes through the seams that extension
// publishes (custom_calls/p2p/seams.h); the launch is filled as dtenjax_p2p_all_reduce fills its
// own (custom_calls/p2p/launch.h).
//
// The extension loads the seams when it is imported (LoadP2PSeams, module.cc) and refuses to
// import when they are of another version.
//
// FFI handlers:
//   dtenjax_p2p_selftest(x[N, n]; count, algorithm, op, reproducible, mean, iters, mode, capacity,
//       max_blocks, timeout_ms) -> like x
//       allocates the arena of (device, N) on first use, so it is not command-buffer compatible.
//   dtenjax_p2p_selftest_graph: the same, command-buffer compatible; needs the arena made by an
//       earlier dtenjax_p2p_selftest call with the same N on the same device.
//   mode 0 validates (a chain of iters calls, see below), 1 times iters identical calls, 2 times a
//   device-to-device copy instead, 3 launches rank 0 alone so that its barrier times out and traps.
#include <Python.h>
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "csrc/common/status.h"
#include "csrc/p2p/allreduce.h"
#include "custom_calls/p2p/attributes.h"
#include "custom_calls/p2p/launch.h"
#include "custom_calls/p2p/seams.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;
namespace p2p = dtenjax::p2p;
using dtenjax::Code;
using dtenjax::Status;

namespace {

const p2p::Seams* g_seams = nullptr;   // set once at import (BindP2PTesting), read-only after

// N simulated ranks on one device: N regions, one block of error words (rank 0's, which every
// simulated rank's kernel writes), blocks per rank such that all N ranks are resident at once.
struct SimArena {
  int world = 0;
  int blocks = 0;
  size_t capacity = 0;
  p2p::Peers peers{};
  uint32_t* error_host = nullptr;
  uint32_t* error_dev = nullptr;
};

std::mutex g_arenas_mu;
std::map<std::pair<int, int>, SimArena> g_arenas;   // by (ordinal, world); never freed

// Every rank's blocks must be resident together or the barriers could never complete: the fewest
// resident blocks over every kernel the arena may run, split over the ranks.
Status BlocksPerRank(int ordinal, int world, int* blocks) {
  int resident = 1 << 30;
  for (p2p::Algorithm alg : {p2p::Algorithm::kOneShot, p2p::Algorithm::kTwoShot}) {
    for (p2p::DType dt : {p2p::DType::kF32, p2p::DType::kBF16, p2p::DType::kF16}) {
      for (p2p::Reproducible rep :
           {p2p::Reproducible::kNone, p2p::Reproducible::kV3, p2p::Reproducible::kExact}) {
        if (rep != p2p::Reproducible::kNone && !p2p::ReproducibleDType(dt)) continue;
        p2p::LaunchArgs la;
        la.world = world;
        la.algorithm = alg;
        la.dtype = dt;
        la.reproducible = rep;
        int b = 0;
        DTENJAX_RETURN_IF_ERROR(g_seams->max_resident_blocks(la, ordinal, &b));
        resident = b < resident ? b : resident;
      }
    }
  }
  *blocks = resident / world > p2p::kMaxBlocks ? p2p::kMaxBlocks : resident / world;
  if (*blocks < 1) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "p2p harness: " + std::to_string(world) +
                             " simulated ranks cannot all be resident on device " +
                             std::to_string(ordinal));
  }
  return Status::Ok();
}

// The arena of (ordinal, world); created with `capacity` when `create` (never inside a CUDA graph:
// that is why the graph-compatible target passes create=false).
Status GetSimArena(int ordinal, int world, size_t capacity, bool create, SimArena* out) {
  DTENJAX_CHECK_ARG(world >= 2 && world <= p2p::kMaxRanks,
                    "p2p harness: simulated ranks " + std::to_string(world) +
                        " is outside [2, 8]");
  std::lock_guard<std::mutex> lock(g_arenas_mu);
  const auto id = std::make_pair(ordinal, world);
  auto it = g_arenas.find(id);
  if (it != g_arenas.end()) {
    *out = it->second;
    return Status::Ok();
  }
  if (!create) {
    return DTENJAX_ERROR(Code::kUnavailable,
                         "p2p harness: no arena for " + std::to_string(world) +
                             " simulated ranks on device " + std::to_string(ordinal) +
                             "; run the non-graph selftest once first (it allocates)");
  }
  DTENJAX_CHECK_ARG(capacity > 0 && capacity % 16 == 0,
                    "p2p harness: capacity must be a positive multiple of 16");
  SimArena a;
  a.world = world;
  a.capacity = capacity;
  DTENJAX_RETURN_IF_ERROR(BlocksPerRank(ordinal, world, &a.blocks));
  for (int r = 0; r < world; ++r) {
    DTENJAX_RETURN_IF_ERROR(g_seams->alloc_region(ordinal, capacity, &a.peers.region[r]));
  }
  DTENJAX_RETURN_IF_ERROR(g_seams->alloc_error_words(ordinal, &a.error_host, &a.error_dev));
  g_arenas[id] = a;
  *out = a;
  return Status::Ok();
}

ffi::Error Selftest(bool create, cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm, int64_t op,
                    int64_t reproducible, int64_t mean, int64_t iters, int64_t mode,
                    int64_t capacity, int64_t max_blocks, int64_t timeout_ms) {
  constexpr const char* kWhat = "dtenjax_p2p_selftest";
  if (g_seams == nullptr) {
    return ffi::Error::Internal("dtenjax_p2p_selftest: dtenjax._ffi_testing was not imported "
                                "(dtenjax/testing/native.py imports it and loads the p2p seams)");
  }
  auto decoded = p2p::attributes::ToKernel(x.element_type(), algorithm, op, reproducible, kWhat);
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
  const size_t item = p2p::DTypeBytes(kernel.dtype);
  const size_t row = static_cast<size_t>(n) * item;
  char* xin = static_cast<char*>(x.untyped_data());
  char* xout = static_cast<char*>(out->untyped_data());
  if (mode == 2) {  // reference: device-to-device copy of the whole stacked buffer, iters times
    for (int64_t it = 0; it < iters; ++it) {
      const Status c = p2p::CopyOnStream(xout, xin, row * world, stream, kWhat);
      if (!c.ok()) return dtenjax::ffi::ToFfiError(c);
    }
    return ffi::Error::Success();
  }
  SimArena arena;
  Status s = GetSimArena(ordinal, world, static_cast<size_t>(capacity), create, &arena);
  if (s.ok()) s = g_seams->check_kernel_error(ordinal, arena.error_host, kWhat);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  if (row % 16 != 0) {
    // Each simulated rank's row must start 16-byte aligned: the row stride n is padded, and
    // `count` (any value <= n) is what the kernels reduce, so odd sizes are still exercised.
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: n * itemsize must be a multiple of 16 (pad the rows; reduce "
        "fewer elements with `count`)");
  }
  p2p::LaunchArgs a = p2p::KernelLaunch(kernel, mean, timeout_ms, arena.peers, world,
                                        arena.capacity, arena.error_dev);
  // All ranks in one launch; mode 3: only rank 0 enters (a peer that never arrives), so the
  // kernel must time out and trap.
  a.local_ranks = mode == 3 ? 1 : world;
  const int want = p2p::BlocksFor(static_cast<size_t>(count) * item, static_cast<int>(max_blocks));
  a.blocks = want < arena.blocks ? want : arena.blocks;
  a.count = count;
  // mode 0 (validation): iteration 0 reduces x, the middle ones reduce their own previous output
  // (different data in both parity buffers), the last reduces x again: a stale read of an
  // earlier call's buffer or flags changes the final bits. mode 1 (timing): x every iteration.
  for (int64_t it = 0; it < iters; ++it) {
    const bool from_x = mode != 0 || it == 0 || it == iters - 1;
    for (int r = 0; r < world; ++r) {
      a.io[r] = {(from_x ? xin : xout) + r * row, xout + r * row};
    }
    s = g_seams->launch_all_reduce(a, stream);
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

DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest", "CUDA", P2PSelftest);
DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest_graph", "CUDA", P2PSelftestGraph);

// Loads dtenjax._ffi's p2p seams (at import, with the GIL: the handlers run on XLA's threads).
void LoadP2PSeams() {
  nb::object cap = nb::module_::import_("dtenjax._ffi").attr("_p2p_seams");
  auto* s = static_cast<const p2p::Seams*>(PyCapsule_GetPointer(cap.ptr(), p2p::kSeamsCapsule));
  if (s == nullptr) throw nb::python_error();
  if (s->version != p2p::kSeamsVersion || s->launch_args_bytes != sizeof(p2p::LaunchArgs)) {
    throw std::runtime_error(
        "dtenjax._ffi_testing was built against p2p seams version " +
        std::to_string(p2p::kSeamsVersion) + " (LaunchArgs of " +
        std::to_string(sizeof(p2p::LaunchArgs)) + " bytes), dtenjax._ffi has version " +
        std::to_string(s->version) + " (" + std::to_string(s->launch_args_bytes) +
        " bytes); rebuild both");
  }
  g_seams = s;
}
