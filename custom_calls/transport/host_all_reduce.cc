// CPU FFI handler of the cross-process all-reduce (dtenjax/_src/net/hostcoll.py).
//   dtenjax_host_all_reduce(x: T[...], where: int32[3]) -> T[...]   (written without copying x)
//     where = (position of this device along the reduced process axis, process-local ring slot,
//              the caller's tag of this collective: 0 or e.g. the step number, compared by the
//              ring like the other fields of the collective's descriptor)
//     attrs: comm_ids: int64[k] (one communicator per process-local ring slot), op: int32,
//            site: int64 (the call's id; hostcoll registers its call stack and signature)
// Asynchronous: the handler queues the collective on the communicator's own worker thread and
// returns an xla::ffi::Future, so XLA's threads never block on the network. Collectives of one
// communicator run in the order XLA issues them (the call has side effects, so XLA keeps program
// order), and every frame names its collective, so processes that disagree get an error.
// Nothing thrown in here (bad_alloc, a thread that cannot start) crosses into XLA: every failure
// becomes an ffi::Error.
#include <cstring>
#include <exception>

#include "csrc/transport/comm.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace tp = dtenjax::transport;

namespace dtenjax::ffi {

bool DTypeOf(xla::ffi::DataType t, tp::DType* out) {
  switch (t) {
#define DTENJAX_TRANSPORT_FROM_XLA(id, value, name, bytes, xla_type) \
  case xla::ffi::xla_type: *out = tp::DType::id; return true;
    DTENJAX_TRANSPORT_DTYPES(DTENJAX_TRANSPORT_FROM_XLA)
#undef DTENJAX_TRANSPORT_FROM_XLA
    default: return false;
  }
}

xla::ffi::Future FailedFuture(xla::ffi::Error e) {
  xla::ffi::Promise p;
  xla::ffi::Future f(p);
  p.SetError(std::move(e));
  return f;
}

}  // namespace dtenjax::ffi

namespace {

ffi::Future HostAllReduceImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where,
                              ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> comm_ids,
                              int32_t op, int64_t site) {
  tp::DType dt;
  if (!dtenjax::ffi::DTypeOf(x.element_type(), &dt)) {
    return dtenjax::ffi::FailedFuture(ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce supports the dtypes"
        DTENJAX_TRANSPORT_DTYPES(DTENJAX_VOCAB_TEXT) " only"));
  }
  if (!tp::IsReduceOp(op)) {
    return dtenjax::ffi::FailedFuture(ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce: op code " + std::to_string(op) +
        " is not one of" DTENJAX_TRANSPORT_OPS(DTENJAX_VOCAB_TEXT)));
  }
  if (where.element_count() != 3) {
    return dtenjax::ffi::FailedFuture(ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce: `where` must hold (ring position, slot, tag)"));
  }
  const int32_t position = where.typed_data()[0];
  const int32_t j = where.typed_data()[1];
  const uint32_t tag = uint32_t(where.typed_data()[2]);
  if (j < 0 || size_t(j) >= comm_ids.size()) {
    return dtenjax::ffi::FailedFuture(ffi::Error::InvalidArgument(
        "dtenjax_host_all_reduce: device slot " + std::to_string(j) + " has no communicator (" +
        std::to_string(comm_ids.size()) + " slots)"));
  }
  std::shared_ptr<tp::Comm> comm = tp::FindComm(comm_ids[j]);
  if (!comm) {
    return dtenjax::ffi::FailedFuture(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "dtenjax_host_all_reduce: communicator " + std::to_string(comm_ids[j]) +
            " does not exist in this process (destroyed, or the executable was compiled in "
            "another process); re-trace the function"));
  }
  const void* src = x.untyped_data();
  void* dst = out->untyped_data();
  const uint64_t count = x.element_count();
  ffi::Promise promise;
  ffi::Future future(promise);
  dtenjax::Status submitted = comm->Submit([comm, src, dst, count, dt, op, site, position, tag,
                                            promise]() mutable {
    try {
      dtenjax::Status s = comm->AllReduce(src, dst, count, dt, static_cast<tp::ReduceOp>(op),
                                          uint64_t(site), position, tag);
      if (s.ok()) {
        promise.SetAvailable();
      } else {
        promise.SetError(dtenjax::ffi::ToFfiError(s));
      }
    } catch (const std::exception& e) {
      promise.SetError(ffi::Error::Internal(std::string("dtenjax_host_all_reduce: ") + e.what()));
    } catch (...) {
      promise.SetError(ffi::Error::Internal("dtenjax_host_all_reduce: unknown C++ exception"));
    }
  });
  if (!submitted.ok()) return dtenjax::ffi::FailedFuture(dtenjax::ffi::ToFfiError(submitted));
  return future;
}

ffi::Future HostAllReduce(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> where,
                          ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> comm_ids,
                          int32_t op, int64_t site) {
  try {
    return HostAllReduceImpl(x, where, out, comm_ids, op, site);
  } catch (const std::exception& e) {
    return dtenjax::ffi::FailedFuture(
        ffi::Error::Internal(std::string("dtenjax_host_all_reduce: ") + e.what()));
  } catch (...) {
    return dtenjax::ffi::FailedFuture(
        ffi::Error::Internal("dtenjax_host_all_reduce: unknown C++ exception"));
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HostAllReduceCpu, HostAllReduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("comm_ids")
                                  .Attr<int32_t>("op")
                                  .Attr<int64_t>("site"));

DTENJAX_REGISTER_FFI("dtenjax_host_all_reduce", "cpu", HostAllReduceCpu);
