// CPU FFI handler for top-k compression's packing step (csrc/topk/pack.h).
//   dtenjax_topk_pack(x: f32[n], threshold: f32[]) -> (idx: s32[k], val: f32[k], count: s32[])
// k is the size of the idx/val results.
#include <cstdint>

#include "csrc/topk/pack.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Pack(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> threshold,
                ffi::Result<ffi::Buffer<ffi::S32>> idx, ffi::Result<ffi::Buffer<ffi::F32>> val,
                ffi::Result<ffi::Buffer<ffi::S32>> count) {
  const int64_t k = static_cast<int64_t>(idx->element_count());
  if (static_cast<int64_t>(val->element_count()) != k || count->element_count() != 1 ||
      threshold.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "dtenjax_topk_pack: idx and val must have the same size, threshold and count one element");
  }
  return dtenjax::ffi::ToFfiError(dtenjax::compress::PackAboveThreshold(
      x.typed_data(), x.element_count(), threshold.typed_data()[0], k, idx->typed_data(),
      val->typed_data(), count->typed_data()));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopkPackCpu, Pack,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

DTENJAX_REGISTER_FFI("dtenjax_topk_pack", "cpu", TopkPackCpu);
