// The one native extension module, dtenjax._ffi. It exposes the FFI handler table, what this
// build contains, and the Python bindings every subsystem registered (custom_calls/python.h).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <map>

#include "custom_calls/python.h"
#include "custom_calls/registry.h"

namespace nb = nanobind;

namespace dtenjax::ffi {
std::vector<Registration>& Registry() {
  static std::vector<Registration> registry;
  return registry;
}
}  // namespace dtenjax::ffi

namespace dtenjax::python {
std::vector<Binding>& Bindings() {
  static std::vector<Binding> bindings;
  return bindings;
}

namespace {
// Status code -> Python exception class, installed once by dtenjax/_src/ffi.py.
nb::dict& ErrorClasses() {
  static nb::dict* classes = new nb::dict();  // leaked on purpose: outlives interpreter teardown
  return *classes;
}
}  // namespace
}  // namespace dtenjax::python

NB_MODULE(_ffi, m) {
  m.doc() = "dtenjax native extension: XLA FFI handlers, kernels, host transports";
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
    nb::list bindings;
    for (const auto& b : dtenjax::python::Bindings()) bindings.append(b.name);
    info["bindings"] = bindings;
    return info;
  });
  m.def("set_error_classes", [](nb::dict classes) {
    // {int(dtenjax::Code): exception class} (dtenjax/_src/ffi.py builds it from
    // vocabulary["status"]); codes without a class raise RuntimeError.
    dtenjax::python::ErrorClasses().clear();
    for (auto item : classes) dtenjax::python::ErrorClasses()[item.first] = item.second;
  });
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const dtenjax::python::StatusError& e) {
      nb::int_ code(static_cast<int>(e.status().code()));
      nb::dict& classes = dtenjax::python::ErrorClasses();
      PyObject* cls = classes.contains(code) ? classes[code].ptr() : PyExc_RuntimeError;
      PyErr_SetString(cls, e.what());
    }
  });
  dtenjax::python::AddVocabulary(m, "status", {DTENJAX_STATUS_CODES(DTENJAX_VOCAB_ENTRY)});
  for (const auto& b : dtenjax::python::Bindings()) b.bind(m);
}
