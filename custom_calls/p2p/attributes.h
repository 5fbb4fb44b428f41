// The p2p handlers' attributes and buffer types decoded into the vocabulary of
// csrc/p2p/vocabulary.h (the lists themselves: values and names come from there, so a new entry
// needs no change here). Each returns InvalidArgument naming what it accepts.
#pragma once

#include <cstdint>
#include <string>

#include "csrc/p2p/vocabulary.h"
#include "xla/ffi/api/ffi.h"

namespace dtenjax::p2p::attributes {

inline xla::ffi::ErrorOr<DType> ToDType(xla::ffi::DataType t, const char* what) {
  switch (t) {
#define DTENJAX_P2P_FROM_XLA(id, value, name, bytes, rep, xla_type) \
  case xla::ffi::xla_type: return DType::id;
    DTENJAX_P2P_DTYPES(DTENJAX_P2P_FROM_XLA)
#undef DTENJAX_P2P_FROM_XLA
    default:
      return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
          std::string(what) + " supports the dtypes" DTENJAX_P2P_DTYPES(DTENJAX_VOCAB_TEXT) " only"));
  }
}

inline xla::ffi::ErrorOr<Algorithm> ToAlgorithm(int64_t a, const char* what) {
  if (IsAlgorithm(a)) return static_cast<Algorithm>(a);
  return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
      std::string(what) + ": algorithm " + std::to_string(a) +
      " is not one of" DTENJAX_P2P_ALGORITHMS(DTENJAX_VOCAB_TEXT)));
}

inline xla::ffi::ErrorOr<Op> ToOp(int64_t op, const char* what) {
  if (IsOp(op)) return static_cast<Op>(op);
  return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
      std::string(what) + ": op " + std::to_string(op) +
      " is not one of" DTENJAX_P2P_OPS(DTENJAX_VOCAB_TEXT)));
}

inline xla::ffi::ErrorOr<Reproducible> ToReproducible(int64_t r, const char* what) {
  if (IsReproducible(r)) return static_cast<Reproducible>(r);
  return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
      std::string(what) + ": reproducible " + std::to_string(r) +
      " is not one of" DTENJAX_P2P_REPRODUCIBLE(DTENJAX_VOCAB_TEXT)));
}

// What every p2p handler decodes first: the buffer's dtype and the kernel's attributes.
struct Kernel {
  DType dtype;
  Algorithm algorithm;
  Op op;
  Reproducible reproducible;
};

inline xla::ffi::ErrorOr<Kernel> ToKernel(xla::ffi::DataType t, int64_t algorithm, int64_t op,
                                          int64_t reproducible, const char* what) {
  auto dtype = ToDType(t, what);
  if (dtype.has_error()) return xla::ffi::Unexpected(dtype.error());
  auto alg = ToAlgorithm(algorithm, what);
  if (alg.has_error()) return xla::ffi::Unexpected(alg.error());
  auto rop = ToOp(op, what);
  if (rop.has_error()) return xla::ffi::Unexpected(rop.error());
  auto rep = ToReproducible(reproducible, what);
  if (rep.has_error()) return xla::ffi::Unexpected(rep.error());
  return Kernel{dtype.value(), alg.value(), rop.value(), rep.value()};
}

inline uint64_t TimeoutNs(int64_t timeout_ms) {
  return timeout_ms <= 0 ? 0 : static_cast<uint64_t>(timeout_ms) * 1000000ull;
}

}  // namespace dtenjax::p2p::attributes
