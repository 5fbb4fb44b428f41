"""The native vocabularies (csrc/p2p/vocabulary.h, csrc/transport/frame.h, csrc/common/status.h)
are defined once in C++ and exported as dtenjax._ffi.vocabulary; Python reads them from there.

The expected values here come from the documented wire format (tests/transport_ref.py, the
independent codec of the frames) and from what the FFI handlers accept, never from the Python
under test.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.gpu import p2p
from dtenjax._src.net import hostcoll
from dtenjax._src.net import native
import transport_ref


def test_extension_exports_every_vocabulary():
  tables = ffi.module().vocabulary
  assert set(tables) >= {"status", "p2p.algorithm", "p2p.op", "p2p.reproducible", "p2p.dtype",
                         "p2p.dtype_reproducible", "transport.dtype", "transport.op"}
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
  assert set(v.reproducible) == {"none", "v3", "exact"}
  assert {d.name for d in v.dtypes} == {"float32", "bfloat16", "float16"}
  assert {d.name for d in v.reproducible_dtypes} == {"float32", "bfloat16"}


def test_reproducible_is_its_own_attribute():
  v = p2p.vocabulary()
  attrs = p2p._attributes("two_shot", "mean", "v3")
  assert attrs == dict(algorithm=v.algorithms["two_shot"], op=v.ops["sum"],
                       reproducible=v.reproducible["v3"], mean=1)
  plain = p2p._attributes("one_shot", "max", None)
  assert plain["reproducible"] == v.reproducible["none"] and plain["op"] == v.ops["max"]
  assert p2p._attributes("one_shot", "sum", "exact")["op"] == v.ops["sum"]


def test_p2p_checks_name_the_exported_entries():
  x = jnp.ones((4,), jnp.float16)
  with pytest.raises(dtenjax.CollectiveError, match="reproducible sum takes float32, bfloat16"):
    p2p._check(x, "one_shot", "sum", "v3")
  with pytest.raises(dtenjax.CollectiveError, match="not one of"):
    p2p._check(jnp.ones((4,), jnp.int32), "three_shot", "sum", None)
  ok, why = p2p.supported(2, 64, "float64")
  assert not ok and "float64 is not one of float32, bfloat16, float16" in why
