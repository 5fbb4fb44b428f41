// dtenjax._ffi.vocabulary["p2p.*"]: the p2p all-reduce's lists and limits
// (csrc/p2p/vocabulary.h) for dtenjax/_src/gpu/p2p.py. Host code, in every build: a build
// without CUDA has no p2p kernels, but Python and the tests still read the one table.
#include "csrc/p2p/vocabulary.h"
#include "custom_calls/python.h"

namespace {

// {dtype name: 1 when the reproducible contracts have kernels for it, else 0}
#define DTENJAX_P2P_REP_ENTRY(id, value, name, bytes, rep, ...) {name, rep ? 1 : 0},

void BindP2PVocabulary(nanobind::module_& m) {
  using dtenjax::python::AddVocabulary;
  AddVocabulary(m, "p2p.algorithm", {DTENJAX_P2P_ALGORITHMS(DTENJAX_VOCAB_ENTRY)});
  AddVocabulary(m, "p2p.op", {DTENJAX_P2P_OPS(DTENJAX_VOCAB_ENTRY)});
  AddVocabulary(m, "p2p.reproducible", {DTENJAX_P2P_REPRODUCIBLE(DTENJAX_VOCAB_ENTRY)});
  AddVocabulary(m, "p2p.dtype", {DTENJAX_P2P_DTYPES(DTENJAX_VOCAB_ENTRY)});
  AddVocabulary(m, "p2p.dtype_reproducible", {DTENJAX_P2P_DTYPES(DTENJAX_P2P_REP_ENTRY)});
  AddVocabulary(m, "p2p.limits", {DTENJAX_P2P_LIMITS(DTENJAX_VOCAB_ENTRY)});
}

}  // namespace

DTENJAX_PYTHON_BINDINGS(p2p_vocabulary, BindP2PVocabulary);
