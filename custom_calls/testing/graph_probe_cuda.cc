// CUDA FFI handler dtenjax_graph_probe_scale_add(x: f32[...], y: f32[...]; scale: f32) -> f32[...]
// computing scale * x + y on the XLA stream. Marked command-buffer compatible, so XLA records it
// into its CUDA graphs; bench/cuda_graphs.py uses it to show that dtenjax custom calls do not split
// graphs.
#include <cuda_runtime.h>

#include <cstdint>

#include "custom_calls/registry.h"
#include "xla/ffi/api/ffi.h"

namespace dtenjax::cuda {
Status LaunchScaleAdd(const float* x, const float* y, float scale, float* out, int64_t n,
                      cudaStream_t stream);
}  // namespace dtenjax::cuda

namespace ffi = xla::ffi;

namespace {

ffi::Error ScaleAdd(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> y,
                    float scale, ffi::Result<ffi::Buffer<ffi::F32>> out) {
  const size_t n = x.element_count();
  if (y.element_count() != n || out->element_count() != n) {
    return ffi::Error::InvalidArgument(
        "dtenjax_graph_probe_scale_add: x, y and the output must have the same element count");
  }
  return dtenjax::ffi::ToFfiError(dtenjax::cuda::LaunchScaleAdd(x.typed_data(), y.typed_data(),
                                                                scale, out->typed_data(),
                                                                static_cast<int64_t>(n), stream));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GraphProbeScaleAdd, ScaleAdd,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

DTENJAX_REGISTER_FFI("dtenjax_graph_probe_scale_add", "CUDA", GraphProbeScaleAdd);
