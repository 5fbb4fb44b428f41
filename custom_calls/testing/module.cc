// dtenjax._ffi_testing: native code that exists only for dtenjax's own tests and benchmarks (a
// separate extension, built only with -DDTENJAX_BUILD_TESTING=ON; a wheel never contains it).
// Python reaches it through dtenjax/testing/native.py, which registers its FFI handlers
// (registrations(), the same form as dtenjax._ffi's) with jax.
//   transport.*                       fault injection into the host transport (transport.cc)
//   dtenjax_graph_probe_scale_add     CUDA: a small command-buffer compatible kernel (CUDA builds)
//   dtenjax_p2p_selftest[_graph]      CUDA: the p2p kernels with N simulated ranks on one GPU,
//                                     through dtenjax._ffi's p2p seams (p2p_selftest_cuda.cc)
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <vector>

#include "custom_calls/registry.h"

namespace nb = nanobind;

namespace dtenjax::ffi {
std::vector<Registration>& Registry() {
  static std::vector<Registration> registry;
  return registry;
}
}  // namespace dtenjax::ffi

void BindTransportTesting(nb::module_& m);
#ifdef DTENJAX_HAVE_CUDA
void LoadP2PSeams();
#endif

NB_MODULE(_ffi_testing, m) {
  m.doc() = "dtenjax's test-only native code (never shipped)";
  nb::module_::import_("dtenjax._ffi");   // the seams come from the production extension
  m.def("registrations", []() {
    nb::list out;
    for (const auto& r : dtenjax::ffi::Registry()) {
      nb::dict stages;
      for (const auto& s : r.stages) stages[s.name] = nb::capsule(reinterpret_cast<void*>(s.handler));
      out.append(nb::make_tuple(r.target, r.platform, stages));
    }
    return out;
  });
  BindTransportTesting(m);
#ifdef DTENJAX_HAVE_CUDA
  LoadP2PSeams();
#endif
}
