// Error handling for dtenjax native code. Native code never calls exit/abort: every fallible call
// returns a Status carrying a message with file and line; the FFI boundary (custom_calls/) turns
// it into an xla::ffi::Error. This header has no XLA and no CUDA dependency.
#pragma once

#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

namespace dtenjax {

enum class Code : int {
  kOk = 0,
  kInvalidArgument = 1,
  kUnavailable = 2,       // a capability is missing (no device, library not loadable, ...)
  kDeadlineExceeded = 3,  // a wait ran past its timeout
  kResourceExhausted = 4, // a pool or quota is full
  kPermissionDenied = 5,  // authentication or ownership check failed
  kDataLoss = 6,          // corrupt frame / checksum mismatch
  kInternal = 7,
};

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
