// Static registry of XLA FFI handlers. Each custom_calls/<feature>/*.cc file defines its handlers
// with XLA_FFI_DEFINE_HANDLER_SYMBOL and registers them here with DTENJAX_REGISTER_FFI; module.cc
// exposes the whole table to Python as dtenjax._ffi.registrations(), and exactly one Python module
// (dtenjax/_src/ffi.py) registers them with jax.ffi.register_ffi_target. The test extension
// (custom_calls/testing/) has a registry of its own, registered by dtenjax/testing/native.py.
#pragma once

#include <string>
#include <vector>

#include "csrc/common/status.h"
#include "xla/ffi/api/ffi.h"

namespace dtenjax::ffi {

struct Stage {
  const char* name;  // "execute", "instantiate", "prepare" or "initialize"
  XLA_FFI_Handler* handler;
};

struct Registration {
  std::string target;    // e.g. "dtenjax_topk_pack"
  std::string platform;  // "cpu" or "CUDA"
  std::vector<Stage> stages;
};

std::vector<Registration>& Registry();

struct Registrar {
  Registrar(const char* target, const char* platform, std::vector<Stage> stages) {
    Registry().push_back(Registration{target, platform, std::move(stages)});
  }
};

// The XLA FFI error code of a dtenjax code: every dtenjax code is named as its XLA (absl)
// counterpart, so this switch is the code list itself and a code XLA lacks does not compile.
inline xla::ffi::ErrorCode ToFfiCode(Code code) {
  switch (code) {
#define DTENJAX_FFI_CODE(id, value, name) \
  case Code::id: return xla::ffi::ErrorCode::id;
    DTENJAX_STATUS_CODES(DTENJAX_FFI_CODE)
#undef DTENJAX_FFI_CODE
  }
  return xla::ffi::ErrorCode::kInternal;
}

// Turn a dtenjax::Status into an XLA FFI error.
inline xla::ffi::Error ToFfiError(const Status& s) {
  if (s.ok()) return xla::ffi::Error::Success();
  return xla::ffi::Error(ToFfiCode(s.code()), s.message());
}

}  // namespace dtenjax::ffi

#define DTENJAX_FFI_CONCAT_(a, b) a##b
#define DTENJAX_FFI_CONCAT(a, b) DTENJAX_FFI_CONCAT_(a, b)

// Register a stateless handler: DTENJAX_REGISTER_FFI("dtenjax_x", "cpu", XSymbol);
#define DTENJAX_REGISTER_FFI(target, platform, symbol)                                    \
  static ::dtenjax::ffi::Registrar DTENJAX_FFI_CONCAT(dtenjax_registrar_, __LINE__)(      \
      target, platform, {{"execute", symbol}})

// Register a handler with several stages: DTENJAX_REGISTER_FFI_STAGES("t", "CUDA",
//     {{"instantiate", Inst}, {"execute", Exec}});
#define DTENJAX_REGISTER_FFI_STAGES(target, platform, ...)                                \
  static ::dtenjax::ffi::Registrar DTENJAX_FFI_CONCAT(dtenjax_registrar_, __LINE__)(      \
      target, platform, __VA_ARGS__)
