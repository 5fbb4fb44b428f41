// The one native extension module, dtenjax._ffi. It exposes the FFI handler table and what this
// build contains; the handlers themselves live in the other custom_calls/ files.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "custom_calls/registry.h"

namespace nb = nanobind;

namespace dtenjax::ffi {
std::vector<Registration>& Registry() {
  static std::vector<Registration> registry;
  return registry;
}
}  // namespace dtenjax::ffi

NB_MODULE(_ffi, m) {
  m.doc() = "dtenjax native extension: XLA FFI handlers, kernels and host transports";
  m.def("registrations", []() {
    // [(target, platform, {stage: capsule})], capsules as jax.ffi.register_ffi_target wants them.
    nb::list out;
    for (const auto& r : dtenjax::ffi::Registry()) {
      nb::dict stages;
      for (const auto& s : r.stages) {
        stages[s.name] = nb::capsule(reinterpret_cast<void*>(s.handler));
      }
      out.append(nb::make_tuple(r.target, r.platform, stages));
    }
    return out;
  });
  m.def("build_info", []() {
    nb::dict info;
#ifdef DTENJAX_HAVE_CUDA
    info["cuda"] = true;
    info["cuda_archs"] = std::string(DTENJAX_CUDA_ARCHS);
#else
    info["cuda"] = false;
    info["cuda_archs"] = std::string("");
#endif
#ifdef DTENJAX_HAVE_VERBS
    info["verbs"] = true;
#else
    info["verbs"] = false;
#endif
    return info;
  });
}
