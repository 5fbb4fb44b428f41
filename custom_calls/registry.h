// Static registry of XLA FFI handlers. Each custom_calls/*.cc file defines its handlers with
// XLA_FFI_DEFINE_HANDLER_SYMBOL and registers them here with DTENJAX_REGISTER_FFI; module.cc
// exposes the whole table to Python as dtenjax._ffi.registrations(), and exactly one Python module
// (dtenjax/_src/ffi.py) registers them with jax.ffi.register_ffi_target.
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
  std::string target;    // e.g. "dtenjax_fixed_point_encode"
  std::string platform;  // "cpu" or "CUDA"
  std::vector<Stage> stages;
};

std::vector<Registration>& Registry();

struct Registrar {
  Registrar(const char* target, const char* platform, std::vector<Stage> stages) {
    Registry().push_back(Registration{target, platform, std::move(stages)});
  }
};

// Turn a dtenjax::Status into an XLA FFI error.
inline xla::ffi::Error ToFfiError(const Status& s) {
  if (s.ok()) return xla::ffi::Error::Success();
  xla::ffi::ErrorCode code = xla::ffi::ErrorCode::kInternal;
  switch (s.code()) {
    case Code::kInvalidArgument: code = xla::ffi::ErrorCode::kInvalidArgument; break;
    case Code::kUnavailable: code = xla::ffi::ErrorCode::kUnavailable; break;
    case Code::kDeadlineExceeded: code = xla::ffi::ErrorCode::kDeadlineExceeded; break;
    case Code::kResourceExhausted: code = xla::ffi::ErrorCode::kResourceExhausted; break;
    case Code::kPermissionDenied: code = xla::ffi::ErrorCode::kPermissionDenied; break;
    case Code::kDataLoss: code = xla::ffi::ErrorCode::kDataLoss; break;
    default: break;
  }
  return xla::ffi::Error(code, s.message());
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
