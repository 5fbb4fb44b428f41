// CUDA FFI handlers of the NVLink peer-to-peer all-reduce (csrc/cuda/p2p_*).
//
//   dtenjax_p2p_register(capacity)                       -> u8[128]  this device's region descriptor
//   dtenjax_p2p_connect(key, rank, world, descriptors)   -> s32[1]   maps every rank's region
//   dtenjax_p2p_all_reduce(x; key, algorithm, timeout_ms) -> like x   (command-buffer compatible)
//   dtenjax_p2p_selftest(x[N, n]; count, algorithm, iters, mode, capacity, timeout_ms) -> [N, n]
//       N simulated ranks on one GPU running the same kernels (allocates its arena once; not
//       command-buffer compatible). dtenjax_p2p_selftest_graph: the same, command-buffer
//       compatible, needs the arena made by an earlier dtenjax_p2p_selftest call.
//
// register/connect run eagerly (outside CUDA graphs) once per device; all_reduce only launches.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "csrc/cuda/p2p_allreduce.h"
#include "csrc/cuda/p2p_registry.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace p2p = dtenjax::p2p;

namespace {

ffi::ErrorOr<p2p::DType> ToDType(ffi::DataType t, const char* what) {
  switch (t) {
    case ffi::F32: return p2p::DType::kF32;
    case ffi::BF16: return p2p::DType::kBF16;
    case ffi::F16: return p2p::DType::kF16;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          std::string(what) + " supports float32, bfloat16 and float16 only"));
  }
}

ffi::ErrorOr<p2p::Algorithm> ToAlgorithm(int64_t a, const char* what) {
  if (a == 0) return p2p::Algorithm::kOneShot;
  if (a == 1) return p2p::Algorithm::kTwoShot;
  return ffi::Unexpected(ffi::Error::InvalidArgument(
      std::string(what) + ": algorithm " + std::to_string(a) +
      " is not 0 (one_shot) or 1 (two_shot)"));
}

uint64_t TimeoutNs(int64_t timeout_ms) {
  return timeout_ms <= 0 ? 0 : static_cast<uint64_t>(timeout_ms) * 1000000ull;
}

// --- register / connect ----------------------------------------------------------------------

ffi::Error Register(cudaStream_t stream, int32_t ordinal, int64_t capacity,
                    ffi::Result<ffi::Buffer<ffi::U8>> out) {
  if (out->element_count() != sizeof(p2p::Descriptor)) {
    return ffi::Error::InvalidArgument("dtenjax_p2p_register: output must be u8[128]");
  }
  p2p::Descriptor d;
  dtenjax::Status s = p2p::RegisterRegion(ordinal, static_cast<size_t>(capacity), &d);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  const cudaError_t e = cudaMemcpyAsync(out->untyped_data(), &d, sizeof(d), cudaMemcpyHostToDevice,
                                        stream);
  if (e == cudaSuccess) cudaStreamSynchronize(stream);  // `d` lives on this stack frame
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("dtenjax_p2p_register: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

ffi::Error Connect(cudaStream_t stream, int32_t ordinal, int64_t key, int64_t rank, int64_t world,
                   ffi::Span<const int64_t> descriptors, ffi::Result<ffi::Buffer<ffi::S32>> out) {
  const size_t words = sizeof(p2p::Descriptor) / sizeof(int64_t);
  if (world < 1 || world > p2p::kMaxRanks || descriptors.size() != words * world) {
    return ffi::Error::InvalidArgument("dtenjax_p2p_connect: descriptors must hold " +
                                       std::to_string(words) + " int64 words per rank for world " +
                                       std::to_string(world));
  }
  const auto* all = reinterpret_cast<const p2p::Descriptor*>(descriptors.begin());
  dtenjax::Status s = p2p::Connect(ordinal, static_cast<uint64_t>(key), static_cast<int>(rank),
                                   static_cast<int>(world), all);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, sizeof(int32_t), stream);
  if (e != cudaSuccess) {
    return ffi::Error::Internal(std::string("dtenjax_p2p_connect: ") + cudaGetErrorString(e));
  }
  return ffi::Error::Success();
}

}  // namespace

// --- all-reduce --------------------------------------------------------------------------------
//
// The communicator of each device is looked up (by ordinal and key) in the process-wide registry
// under its mutex, so one executable's handler serves all local devices from several threads.
// (An instantiate-stage State<T> would need its type registered before any handler, which
// dtenjax/_src/ffi.py's register_all does not do; see docs/p2p.md.)

namespace {

ffi::Error AllReduceExecute(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> out, int64_t key, int64_t algorithm,
                            int64_t timeout_ms) {
  auto dtype = ToDType(x.element_type(), "dtenjax_p2p_all_reduce");
  if (dtype.has_error()) return dtype.error();
  auto alg = ToAlgorithm(algorithm, "dtenjax_p2p_all_reduce");
  if (alg.has_error()) return alg.error();
  if (out->element_type() != x.element_type() || out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument("dtenjax_p2p_all_reduce: output must match the input");
  }
  p2p::Comm comm;
  dtenjax::Status s = p2p::FindComm(ordinal, static_cast<uint64_t>(key), &comm);
  if (s.ok()) s = p2p::CheckKernelError(comm.error_host, "dtenjax_p2p_all_reduce");
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  p2p::LaunchArgs a;
  a.peers = comm.peers;
  a.io[0] = {x.untyped_data(), out->untyped_data()};
  a.world = comm.world;
  a.rank0 = comm.rank;
  a.local_ranks = 1;
  a.blocks = p2p::kRealBlocks;
  a.count = static_cast<int64_t>(x.element_count());
  a.capacity = comm.capacity;
  a.dtype = dtype.value();
  a.algorithm = alg.value();
  a.timeout_ns = TimeoutNs(timeout_ms);
  a.error = comm.error_dev;
  return dtenjax::ffi::ToFfiError(p2p::LaunchAllReduce(a, stream));
}

// --- the simulated-rank harness ----------------------------------------------------------------

ffi::Error Selftest(bool create, cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                    ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm,
                    int64_t iters, int64_t mode, int64_t capacity, int64_t timeout_ms) {
  auto dtype = ToDType(x.element_type(), "dtenjax_p2p_selftest");
  if (dtype.has_error()) return dtype.error();
  auto alg = ToAlgorithm(algorithm, "dtenjax_p2p_selftest");
  if (alg.has_error()) return alg.error();
  const auto dims = x.dimensions();
  if (dims.size() != 2 || out->element_type() != x.element_type() ||
      out->element_count() != x.element_count()) {
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: input must be [ranks, n] and the output the same");
  }
  if (iters < 1 || mode < 0 || mode > 2 || count < 0 || count > dims[1]) {
    return ffi::Error::InvalidArgument(
        "dtenjax_p2p_selftest: iters must be >= 1, mode 0..2 and 0 <= count <= n");
  }
  const int world = static_cast<int>(dims[0]);
  const int64_t n = dims[1];
  const size_t row = static_cast<size_t>(n) * p2p::DTypeBytes(dtype.value());
  char* xin = static_cast<char*>(x.untyped_data());
  char* xout = static_cast<char*>(out->untyped_data());
  if (mode == 2) {  // reference: device-to-device copy of the whole stacked buffer, iters times
    for (int64_t it = 0; it < iters; ++it) {
      const cudaError_t e =
          cudaMemcpyAsync(xout, xin, row * world, cudaMemcpyDeviceToDevice, stream);
      if (e != cudaSuccess) {
        return ffi::Error::Internal(std::string("dtenjax_p2p_selftest copy: ") +
                                    cudaGetErrorString(e));
      }
    }
    return ffi::Error::Success();
  }
  p2p::SimArena arena;
  dtenjax::Status s =
      p2p::GetSimArena(ordinal, world, static_cast<size_t>(capacity), create, &arena);
  if (s.ok()) s = p2p::CheckKernelError(arena.error_host, "dtenjax_p2p_selftest");
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
  a.local_ranks = world;
  a.blocks = arena.blocks;
  a.count = count;
  a.capacity = arena.capacity;
  a.dtype = dtype.value();
  a.algorithm = alg.value();
  a.timeout_ns = TimeoutNs(timeout_ms);
  a.error = arena.error_dev;
  // mode 0 (validation): iteration 0 reduces x, the middle ones reduce their own previous output
  // (different data in both parity buffers), the last reduces x again: a stale read of an
  // earlier call's buffer or flags changes the final bits. mode 1 (timing): x every iteration.
  for (int64_t it = 0; it < iters; ++it) {
    const bool from_x = mode == 1 || it == 0 || it == iters - 1;
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
                         int64_t iters, int64_t mode, int64_t capacity, int64_t timeout_ms) {
  return Selftest(true, stream, ordinal, x, out, count, algorithm, iters, mode, capacity,
                  timeout_ms);
}

ffi::Error SelftestGraph(cudaStream_t stream, int32_t ordinal, ffi::AnyBuffer x,
                         ffi::Result<ffi::AnyBuffer> out, int64_t count, int64_t algorithm,
                         int64_t iters, int64_t mode, int64_t capacity, int64_t timeout_ms) {
  return Selftest(false, stream, ordinal, x, out, count, algorithm, iters, mode, capacity,
                  timeout_ms);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PRegister, Register,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("capacity")
                                  .Ret<ffi::Buffer<ffi::U8>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PConnect, Connect,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("key")
                                  .Attr<int64_t>("rank")
                                  .Attr<int64_t>("world")
                                  .Attr<ffi::Span<const int64_t>>("descriptors")
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PAllReduceExecute, AllReduceExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("key")
                                  .Attr<int64_t>("algorithm")
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
      .Attr<int64_t>("iters")                         \
      .Attr<int64_t>("mode")                          \
      .Attr<int64_t>("capacity")                      \
      .Attr<int64_t>("timeout_ms")

XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PSelftest, SelftestAlloc, DTENJAX_P2P_SELFTEST_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(P2PSelftestGraph, SelftestGraph, DTENJAX_P2P_SELFTEST_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});

DTENJAX_REGISTER_FFI("dtenjax_p2p_register", "CUDA", P2PRegister);
DTENJAX_REGISTER_FFI("dtenjax_p2p_connect", "CUDA", P2PConnect);
DTENJAX_REGISTER_FFI("dtenjax_p2p_all_reduce", "CUDA", P2PAllReduceExecute);
DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest", "CUDA", P2PSelftest);
DTENJAX_REGISTER_FFI("dtenjax_p2p_selftest_graph", "CUDA", P2PSelftestGraph);
