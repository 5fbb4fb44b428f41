"""The native vocabularies (csrc/p2p/vocabulary.h, csrc/transport/frame.h, csrc/common/status.h)
are defined once in C++ and exported as dtenjax._ffi.vocabulary; Python reads them from there.

The expected values here come from the documented wire format (tests/transport_ref.py, the
independent codec of the frames) and from what the FFI handlers accept, never from the Python
under test.
"""

import jax.numpy as jnp
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.contract import Contract
from dtenjax._src.gpu import p2p
from dtenjax._src.net import hostcoll
from dtenjax._src.net import native
import transport_ref


def test_extension_exports_every_vocabulary():
  tables = ffi.module().vocabulary
  assert set(tables) >= {"status", "p2p.algorithm", "p2p.op", "p2p.reproducible", "p2p.dtype",
                         "p2p.dtype_reproducible", "p2p.limits", "transport.dtype",
                         "transport.op"}
  with pytest.raises(errors.ExtensionUnavailableError, match="no vocabulary 'nope'"):
    ffi.vocabulary("nope")


def test_status_errors_are_keyed_by_exported_names():
  codes = ffi.vocabulary("status")
  assert codes["ok"] == 0 and "ok" not in ffi.STATUS_ERRORS
  assert set(ffi.STATUS_ERRORS) == set(codes) - {"ok"}   # every failing code has its class
  assert len(set(codes.values())) == len(codes)


def test_transport_codes_are_the_wire_formats():
  dtype_codes, op_codes = native.codes()
  assert op_codes == transport_ref.OPS
  assert {d.name: c for d, c in dtype_codes.items()} == transport_ref.DTYPES
  assert {jnp.dtype(d).name for d in hostcoll.DTYPES} == set(transport_ref.DTYPES)
  assert set(hostcoll.OPS) <= set(op_codes)


def test_p2p_vocabulary_is_the_exported_one():
  v = p2p.vocabulary()
  assert v.algorithms == ffi.vocabulary("p2p.algorithm") == {"one_shot": 0, "two_shot": 1}
  native_ops = ffi.vocabulary("p2p.op")
  assert set(native_ops) == {"sum", "max", "min"}   # no op code means "reproducible sum"
  assert v.ops == {**native_ops, "mean": native_ops["sum"]}
  assert set(v.reproducible) == {"none", "v3", "v2"}
  assert {d.name for d in v.dtypes} == {"float32", "bfloat16", "float16"}
  assert {d.name for d in v.reproducible_dtypes} == {"float32", "bfloat16"}


def test_p2p_limits_are_the_native_constants():
  # the documented limits (docs/p2p.md: 2..8 GPUs, DTENJAX_P2P_MAX_BLOCKS <= 128, 16-byte
  # vectors) and the descriptor the extension's p2p_register returns
  assert ffi.vocabulary("p2p.limits") == {"max_world": 8, "max_blocks": 128,
                                          "vector_bytes": 16, "descriptor_bytes": 128}
  assert p2p.vocabulary().limits == p2p.Limits(**ffi.vocabulary("p2p.limits"))
  if ffi.build_info()["cuda"]:
    with pytest.raises(errors.ConfigurationError, match="128 bytes per rank of a world in"
                       r" \[1, 8\]"):
      ffi.module().p2p_connect(0, 1, 0, 2, b"x" * 100)


def test_every_native_contract_is_a_python_contract():
  # the kernels' contracts are named as Python's Contract members; a Python contract the
  # kernels lack runs on XLA's collectives (the gate refuses it), never the other way round
  native = ffi.vocabulary("p2p.reproducible")
  assert set(native) <= {c.value for c in Contract}
  assert native["none"] == 0 and Contract.NONE.value == "none"
  assert {"v3", "v2"} <= set(native)          # docs/p2p.md: both contracts run in the kernels


def test_reproducible_is_its_own_attribute():
  v = p2p.vocabulary()
  attrs = p2p._attributes("two_shot", "mean", Contract.V3)
  assert attrs == dict(algorithm=v.algorithms["two_shot"], op=v.ops["sum"],
                       reproducible=v.reproducible["v3"], mean=1)
  plain = p2p._attributes("one_shot", "max", Contract.NONE)
  assert plain["reproducible"] == v.reproducible["none"] and plain["op"] == v.ops["max"]
  assert p2p._attributes("one_shot", "sum", Contract.V2)["op"] == v.ops["sum"]


def test_p2p_checks_name_the_exported_entries(monkeypatch):
  monkeypatch.setattr(p2p, "unavailable_reason", lambda: None)
  v = p2p.gate(world=2, dtype=jnp.float16, contract=Contract.V3)
  assert not v.ok and "reproducible sum takes float32, bfloat16" in v.reason
  v = p2p.gate(world=2, dtype=jnp.int32, algorithm="three_shot")
  assert not v.ok and "not one of ['one_shot', 'two_shot']" in v.reason
  v = p2p.gate(world=2, dtype="float64")
  assert not v.ok and "float64 is not one of float32, bfloat16, float16" in v.reason
