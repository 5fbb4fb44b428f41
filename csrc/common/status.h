// Error handling for dtenjax native code. Native code never calls exit/abort: every fallible call
// returns a Status carrying a message with file and line; the FFI boundary (custom_calls/) turns
// it into an xla::ffi::Error, the Python boundary into the dtenjax exception of its code.
//
// The checks, each returning the failure as a Status from the enclosing function:
//   DTENJAX_RETURN_IF_ERROR(expr)        a fallible dtenjax call
//   DTENJAX_CHECK_ARG(cond, what)        a precondition on arguments (kInvalidArgument)
//   SYS_CHECK(call, name)                a system call that returns -1 and sets errno
//   DTENJAX_CUDA_CHECK(call)             a CUDA runtime call (kInternal)
//   DTENJAX_CUDA_CHECK_AS(call, code, what)   the same with another code and message
//   DTENJAX_CUDA_CHECK_LAUNCH(what)      cudaGetLastError() right after a kernel launch
// This header has no XLA and no CUDA dependency: the CUDA checks name the CUDA runtime only where
// they are expanded, in files that include <cuda_runtime.h>.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace dtenjax {

// The status codes, defined once: X(enumerator, value, name). The names are what Python reads
// (dtenjax._ffi.vocabulary["status"]; dtenjax/_src/ffi.py maps each to an exception class).
#define DTENJAX_STATUS_CODES(X)                                                                   \
  X(kOk, 0, "ok")                                                                                 \
  X(kInvalidArgument, 1, "invalid_argument")                                                      \
  X(kUnavailable, 2, "unavailable")            /* a capability is missing (device, library) */    \
  X(kDeadlineExceeded, 3, "deadline_exceeded") /* a wait ran past its timeout */                  \
  X(kResourceExhausted, 4, "resource_exhausted") /* a pool or quota is full */                    \
  X(kPermissionDenied, 5, "permission_denied") /* authentication or ownership check failed */     \
  X(kDataLoss, 6, "data_loss")                 /* corrupt frame / tag mismatch */                 \
  X(kInternal, 7, "internal")                                                                     \
  X(kCancelled, 8, "cancelled")                /* this process closed what the call needed */

// Helpers to expand a vocabulary list X(enumerator, value, name, ...) into an enum, a membership
// test (case labels), and a text for error messages (" 0 (one_shot) 1 (two_shot)").
#define DTENJAX_ENUM_VALUE(id, value, ...) id = value,
#define DTENJAX_ENUM_CASE(id, value, ...) case value:
#define DTENJAX_VOCAB_TEXT(id, value, name, ...) " " #value " (" name ")"

enum class Code : int { DTENJAX_STATUS_CODES(DTENJAX_ENUM_VALUE) };

// Whether `value` is one of the codes (e.g. read back from an ABORT frame).
constexpr bool IsCode(int value) {
  switch (value) {
    DTENJAX_STATUS_CODES(DTENJAX_ENUM_CASE) return true;
    default: return false;
  }
}

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status MakeStatus(Code code, const char* file, int line, const std::string& what) {
  return Status(code, what + " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace dtenjax

#define DTENJAX_ERROR(code, what) ::dtenjax::MakeStatus((code), __FILE__, __LINE__, (what))

// Return early with the Status of a fallible call.
#define DTENJAX_RETURN_IF_ERROR(expr)            \
  do {                                           \
    ::dtenjax::Status _dtj_status = (expr);      \
    if (!_dtj_status.ok()) return _dtj_status;   \
  } while (0)

// A system call that returns -1 and sets errno.
#define SYS_CHECK(call, name)                                                          \
  do {                                                                                 \
    if ((call) == -1) {                                                                \
      return DTENJAX_ERROR(::dtenjax::Code::kInternal,                                 \
                           std::string(name) + " failed: " + std::strerror(errno));    \
    }                                                                                  \
  } while (0)

// A precondition on arguments.
#define DTENJAX_CHECK_ARG(cond, what)                                                  \
  do {                                                                                 \
    if (!(cond)) return DTENJAX_ERROR(::dtenjax::Code::kInvalidArgument, (what));      \
  } while (0)

// A CUDA runtime call that failed returns Status(code, what + ": " + the CUDA error). The error
// is then cleared (cudaGetLastError), so that a later launch check reports its own launch only.
#define DTENJAX_CUDA_CHECK_AS(call, code, what)                                        \
  do {                                                                                 \
    const cudaError_t _dtj_cuda = (call);                                              \
    if (_dtj_cuda != cudaSuccess) {                                                    \
      (void)cudaGetLastError();                                                        \
      return DTENJAX_ERROR((code), std::string(what) + ": " +                          \
                                       cudaGetErrorString(_dtj_cuda));                 \
    }                                                                                  \
  } while (0)

#define DTENJAX_CUDA_CHECK(call) \
  DTENJAX_CUDA_CHECK_AS(call, ::dtenjax::Code::kInternal, #call " failed")

// After every kernel launch: a launch that failed (bad configuration, no kernel image for this
// GPU, ...) is reported by cudaGetLastError() at once.
#define DTENJAX_CUDA_CHECK_LAUNCH(what) \
  DTENJAX_CUDA_CHECK_AS(cudaGetLastError(), ::dtenjax::Code::kInternal, std::string(what) + " launch failed")
