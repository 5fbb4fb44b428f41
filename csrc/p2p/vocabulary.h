// The vocabulary of the p2p (NVLink peer-to-peer) all-reduce, defined once: every list below is
// X(enumerator, value, name[, ...]) and expands into the C++ enum here, the checks of the FFI
// handler (custom_calls/p2p/) and the tables Python reads (dtenjax._ffi.vocabulary["p2p.*"],
// custom_calls/p2p/vocabulary.cc; dtenjax/_src/gpu/p2p.py reads them, keeping no copy). No CUDA here.
#pragma once

#include <cstddef>
#include <cstdint>

#include "csrc/common/status.h"

namespace dtenjax::p2p {

// Algorithms callers choose (the FFI attribute `algorithm`).
#define DTENJAX_P2P_ALGORITHMS(X) \
  X(kOneShot, 0, "one_shot")      \
  X(kTwoShot, 1, "two_shot")

// Reductions (the attribute `op`; mean is the sum with the attribute `mean` = 1). kSum folds in
// rank order in float32; kMax/kMin propagate NaN (as the canonical quiet NaN).
#define DTENJAX_P2P_OPS(X) \
  X(kSum, 0, "sum")        \
  X(kMax, 1, "max")        \
  X(kMin, 2, "min")

// The reproducible contracts the kernels implement (the attribute `reproducible`,
// docs/collectives.md); each name is the value of Python's Contract member for it
// (dtenjax/_src/contract.py): kV3 is contract v3 (reproducible=True), kV2 the fixed-point sum of
// contract v2 (reproducible="v2"). A contract Python has and this list lacks is one the kernels
// do not run (the gate, gpu/p2p.py, refuses it). The value is also the kernels' template
// parameter (kernels.h).
#define DTENJAX_P2P_REPRODUCIBLE(X) \
  X(kNone, 0, "none")               \
  X(kV3, 1, "v3")                   \
  X(kV2, 2, "v2")

// Element types, taken from the buffer's type: X(enumerator, value, name, bytes, reproducible,
// xla), reproducible: whether the reproducible contracts have kernels for it; xla: the name of
// the xla::ffi::DataType the FFI handler maps to it (only custom_calls/ expands that field).
#define DTENJAX_P2P_DTYPES(X)            \
  X(kF32, 0, "float32", 4, true, F32)    \
  X(kBF16, 1, "bfloat16", 2, true, BF16) \
  X(kF16, 2, "float16", 2, false, F16)

// The kernels' limits, X(constant, value, name): the C++ constants below and, exported as
// dtenjax._ffi.vocabulary["p2p.limits"], the only source of these numbers in Python (the gate in
// gpu/p2p.py reads them). max_world: ranks of one all-reduce (landing slots per block);
// max_blocks: thread blocks per rank of one launch (DTENJAX_P2P_MAX_BLOCKS' range);
// vector_bytes: the 16-byte vectors the kernels move (buffer sizes and chunks are multiples);
// descriptor_bytes: one rank's region descriptor (registry.h), exchanged across processes.
#define DTENJAX_P2P_LIMITS(X)            \
  X(kMaxRanks, 8, "max_world")           \
  X(kMaxBlocks, 128, "max_blocks")       \
  X(kVectorBytes, 16, "vector_bytes")    \
  X(kDescriptorBytes, 128, "descriptor_bytes")

#define DTENJAX_P2P_LIMIT_CONSTANT(id, value, name) constexpr int id = value;
DTENJAX_P2P_LIMITS(DTENJAX_P2P_LIMIT_CONSTANT)
#undef DTENJAX_P2P_LIMIT_CONSTANT

// kOneShotLL is not chosen by callers: LaunchAllReduce runs one-shot calls of at most
// kLLMaxBytes with it (a function of the size only, so every rank of a call makes the same
// choice).
enum class Algorithm : int { DTENJAX_P2P_ALGORITHMS(DTENJAX_ENUM_VALUE) kOneShotLL = 2 };
enum class Op : int { DTENJAX_P2P_OPS(DTENJAX_ENUM_VALUE) };
// kExact: contract v2's enumerator before it was named for its contract; the kernels
// (allreduce.cuh, kernels_inst.cuh) still spell it so.
enum class Reproducible : int { DTENJAX_P2P_REPRODUCIBLE(DTENJAX_ENUM_VALUE) kExact = kV2 };
enum class DType : int { DTENJAX_P2P_DTYPES(DTENJAX_ENUM_VALUE) };

constexpr bool IsAlgorithm(int64_t v) {
  switch (v) {
    DTENJAX_P2P_ALGORITHMS(DTENJAX_ENUM_CASE) return true;
    default: return false;
  }
}

constexpr bool IsOp(int64_t v) {
  switch (v) {
    DTENJAX_P2P_OPS(DTENJAX_ENUM_CASE) return true;
    default: return false;
  }
}

constexpr bool IsReproducible(int64_t v) {
  switch (v) {
    DTENJAX_P2P_REPRODUCIBLE(DTENJAX_ENUM_CASE) return true;
    default: return false;
  }
}

constexpr size_t DTypeBytes(DType t) {
  switch (t) {
#define DTENJAX_P2P_DTYPE_BYTES(id, value, name, bytes, ...) \
  case DType::id: return bytes;
    DTENJAX_P2P_DTYPES(DTENJAX_P2P_DTYPE_BYTES)
#undef DTENJAX_P2P_DTYPE_BYTES
  }
  return 0;
}

// Whether the reproducible contracts have kernels for `t`.
constexpr bool ReproducibleDType(DType t) {
  switch (t) {
#define DTENJAX_P2P_DTYPE_REP(id, value, name, bytes, rep, ...) \
  case DType::id: return rep;
    DTENJAX_P2P_DTYPES(DTENJAX_P2P_DTYPE_REP)
#undef DTENJAX_P2P_DTYPE_REP
  }
  return false;
}

}  // namespace dtenjax::p2p
