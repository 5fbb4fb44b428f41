// CUDA FFI handler for top-k compression's packing step (csrc/topk/pack_cuda.h).
//   dtenjax_topk_pack(x: f32[n], threshold: f32[])
//       -> (idx: s32[k], val: f32[k], count: s32[], workspace: s32[B])
// The workspace is an explicit result (no allocation inside), so the handler is command-buffer
// compatible; dtenjax/_src/compression/topk.py chooses B. The CPU handler has the same first three results.
#include <cstdint>

#include <cuda_runtime_api.h>

#include "csrc/topk/pack_cuda.h"
#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error PackCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> threshold,
                    ffi::Result<ffi::Buffer<ffi::S32>> idx, ffi::Result<ffi::Buffer<ffi::F32>> val,
                    ffi::Result<ffi::Buffer<ffi::S32>> count,
                    ffi::Result<ffi::Buffer<ffi::S32>> workspace) {
  const int64_t k = static_cast<int64_t>(idx->element_count());
  if (static_cast<int64_t>(val->element_count()) != k || count->element_count() != 1 ||
      threshold.element_count() != 1 || workspace->element_count() < 1) {
    return ffi::Error::InvalidArgument(
        "dtenjax_topk_pack: idx and val must have the same size, threshold and count one "
        "element, workspace at least one");
  }
  return dtenjax::ffi::ToFfiError(dtenjax::compress::LaunchPackAboveThreshold(
      x.typed_data(), static_cast<int64_t>(x.element_count()), threshold.typed_data(), k, workspace->typed_data(),
      static_cast<int64_t>(workspace->element_count()), idx->typed_data(), val->typed_data(), count->typed_data(),
      stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopkPackCuda, PackCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

DTENJAX_REGISTER_FFI("dtenjax_topk_pack", "CUDA", TopkPackCuda);
