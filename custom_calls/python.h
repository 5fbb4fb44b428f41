// Python bindings of native subsystems (nanobind), registered the way FFI handlers are: each
// custom_calls/<feature>/*.cc file that exposes functions to Python writes
//
//   DTENJAX_PYTHON_BINDINGS(p2p, [](nanobind::module_& m) { m.def("p2p_register", ...); });
//
// and module.cc runs every registered binder on dtenjax._ffi. A binding that fails returns its
// dtenjax::Status through ThrowIfError; module.cc translates the resulting StatusError into the
// dtenjax exception class that dtenjax/_src/ffi.py installed for the status code (the one
// status-to-exception map), so Python callers see DtenjaxError subclasses, never raw codes.
// Bindings release the GIL around anything that can block (nb::gil_scoped_release).
#pragma once

#include <nanobind/nanobind.h>

#include <exception>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "csrc/common/status.h"

namespace dtenjax::python {

class StatusError : public std::exception {
 public:
  explicit StatusError(Status s) : status_(std::move(s)) {}
  const char* what() const noexcept override { return status_.message().c_str(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

using Binder = std::function<void(nanobind::module_&)>;

struct Binding {
  const char* name;
  Binder bind;
};

std::vector<Binding>& Bindings();

struct BindingRegistrar {
  BindingRegistrar(const char* name, Binder bind) {
    Bindings().push_back(Binding{name, std::move(bind)});
  }
};

// Publishes a native vocabulary as dtenjax._ffi.vocabulary[name] = {entry name: value}, so that
// Python reads the integers C++ uses from the extension instead of keeping copies:
//
//   AddVocabulary(m, "p2p.op", {DTENJAX_P2P_OPS(DTENJAX_VOCAB_ENTRY)});
#define DTENJAX_VOCAB_ENTRY(id, value, name, ...) {name, value},

inline void AddVocabulary(nanobind::module_& m, const char* name,
                          std::initializer_list<std::pair<const char*, int>> entries) {
  if (!nanobind::hasattr(m, "vocabulary")) m.attr("vocabulary") = nanobind::dict();
  nanobind::dict table;
  for (const auto& [key, value] : entries) table[key] = value;
  nanobind::borrow<nanobind::dict>(m.attr("vocabulary"))[name] = table;
}

}  // namespace dtenjax::python

// A precondition on a binding's arguments: raises the kInvalidArgument class (ConfigurationError).
#define DTENJAX_CHECK_PY(cond, what)                                                           \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      ::dtenjax::python::ThrowIfError(                                                        \
          DTENJAX_ERROR(::dtenjax::Code::kInvalidArgument, (what)));                          \
    }                                                                                         \
  } while (0)

#define DTENJAX_PY_CONCAT_(a, b) a##b
#define DTENJAX_PY_CONCAT(a, b) DTENJAX_PY_CONCAT_(a, b)

#define DTENJAX_PYTHON_BINDINGS(name, ...)                                                    \
  static ::dtenjax::python::BindingRegistrar DTENJAX_PY_CONCAT(dtenjax_py_binding_, name)(  \
      #name, __VA_ARGS__)
