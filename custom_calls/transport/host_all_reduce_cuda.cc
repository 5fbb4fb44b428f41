// GPU handler of the cross-process all-reduce (same target as the CPU one,
// dtenjax_host_all_reduce, registered for platform "CUDA"): stages through the communicator's
// pinned host buffers. D2H copy on XLA's stream, synchronise, run the ring on the communicator's
// worker thread (so it stays ordered with every other collective of that communicator), H2D copy.
// It blocks the calling thread for the duration (one GPU per process is the supported layout) and
// is not command-buffer compatible (a CUDA graph cannot wait on the network).
//
// Also installs the CUDA pointer-ownership check of the tenancy layer: device memory belongs to the
// context of the device cudaPointerGetAttributes reports.
//
// Compiled in CUDA builds; NOT RUN on any GPU yet (the GPU machine has one GPU and one process).
#include <cuda_runtime.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <future>
#include <string>

#include "csrc/transport/comm.h"
#include "csrc/transport/tenancy.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace tp = dtenjax::transport;

namespace dtenjax::ffi {
bool DTypeOf(xla::ffi::DataType t, tp::DType* out);  // custom_calls/transport/host_all_reduce.cc
}

namespace {

// An asynchronous copy on XLA's stream, waited for (the ring runs on the host in between).
dtenjax::Status CopyAndWait(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream, const char* what) {
  const std::string failed = std::string("dtenjax_host_all_reduce (CUDA): ") + what;
  DTENJAX_CUDA_CHECK_AS(cudaMemcpyAsync(dst, src, bytes, kind, stream), dtenjax::Code::kInternal,
                        failed);
  DTENJAX_CUDA_CHECK_AS(cudaStreamSynchronize(stream), dtenjax::Code::kInternal, failed);
  return dtenjax::Status::Ok();
}

dtenjax::Status CudaPointerOwner(const void* ptr, uint64_t bytes, int64_t* owner) {
  cudaPointerAttributes attr{};
  DTENJAX_CUDA_CHECK_AS(cudaPointerGetAttributes(&attr, ptr), dtenjax::Code::kPermissionDenied,
                        "cudaPointerGetAttributes failed");
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return DTENJAX_ERROR(dtenjax::Code::kPermissionDenied, "pointer is not CUDA device memory");
  }
  (void)bytes;
  *owner = attr.device;
  return dtenjax::Status::Ok();
}

struct InstallOwnerCheck {
  InstallOwnerCheck() { tp::SwapPointerOwnerFn(&CudaPointerOwner); }
} install_owner_check;

ffi::Error HostAllReduceCudaImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                 ffi::Buffer<ffi::S32> where, ffi::Result<ffi::AnyBuffer> out,
                                 ffi::Span<const int64_t> comm_ids, int32_t op, int64_t site) {
  tp::DType dt;
  if (!dtenjax::ffi::DTypeOf(x.element_type(), &dt)) {
    return ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce supports the dtypes"
        DTENJAX_TRANSPORT_DTYPES(DTENJAX_VOCAB_TEXT) " only");
  }
  if (!tp::IsReduceOp(op)) {
    return ffi::Error::InvalidArgument("dtenjax_host_all_reduce: op code " + std::to_string(op) +
                                       " is not one of" DTENJAX_TRANSPORT_OPS(DTENJAX_VOCAB_TEXT));
  }
  if (where.element_count() != 3) {
    return ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce: `where` must hold (ring position, slot, tag)");
  }
  int32_t w[3] = {-1, -1, 0};
  dtenjax::Status s = CopyAndWait(w, where.typed_data(), sizeof(w), cudaMemcpyDeviceToHost, stream,
                                  "reading the ring position, slot and tag");
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  const size_t bytes = x.size_bytes();
  const int32_t position = w[0], j = w[1];
  const uint32_t tag = uint32_t(w[2]);
  if (j < 0 || size_t(j) >= comm_ids.size()) {
    return ffi::Error::InvalidArgument("dtenjax_host_all_reduce: device slot " + std::to_string(j) +
                                       " has no communicator");
  }
  std::shared_ptr<tp::Comm> comm = tp::FindComm(comm_ids[j]);
  if (!comm) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "dtenjax_host_all_reduce: communicator " + std::to_string(comm_ids[j]) +
                          " does not exist in this process; re-trace the function");
  }
  int buf = -1;
  void* host = nullptr;
  s = comm->pool().Acquire(std::max<size_t>(bytes, 1), &buf, &host);
  if (!s.ok()) return dtenjax::ffi::ToFfiError(s);
  if (bytes) {
    s = CopyAndWait(host, x.untyped_data(), bytes, cudaMemcpyDeviceToHost, stream,
                    "staging the input to host memory");
    if (!s.ok()) {
      comm->pool().Release(buf);
      return dtenjax::ffi::ToFfiError(s);
    }
  }
  auto done = std::make_shared<std::promise<dtenjax::Status>>();
  std::future<dtenjax::Status> result = done->get_future();
  comm->pool().Post(buf);
  s = comm->Submit([comm, host, bytes, dt, op, site, position, tag, done] {
    dtenjax::Status st;
    try {
      st = comm->AllReduce(host, host, bytes / tp::DTypeSize(dt), dt,
                           static_cast<tp::ReduceOp>(op), uint64_t(site), position,
                           tag);
    } catch (const std::exception& ex) {
      st = DTENJAX_ERROR(dtenjax::Code::kInternal, std::string("exception: ") + ex.what());
    }
    done->set_value(st);
  });
  if (s.ok()) s = result.get();  // AllReduce itself is bounded by the communicator's timeout
  comm->pool().Complete(buf);
  if (s.ok() && bytes) {   // waited for: the host buffer is reused after its release
    s = CopyAndWait(out->untyped_data(), host, bytes, cudaMemcpyHostToDevice, stream,
                    "copying the result back to the device");
  }
  comm->pool().Release(buf);
  return dtenjax::ffi::ToFfiError(s);
}

ffi::Error HostAllReduceCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> comm_ids,
                             int32_t op, int64_t site) {
  try {
    return HostAllReduceCudaImpl(stream, x, where, out, comm_ids, op, site);
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("dtenjax_host_all_reduce (CUDA): ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("dtenjax_host_all_reduce (CUDA): unknown C++ exception");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostAllReduceGpu, HostAllReduceCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("comm_ids")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("site"));

DTENJAX_REGISTER_FFI("dtenjax_host_all_reduce", "CUDA", HostAllReduceGpu);
