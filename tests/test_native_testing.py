"""The test-only native code lives in its own extension, dtenjax._ffi_testing, and the shipped
dtenjax._ffi holds none of it (tests/test_wheel.py checks a real wheel; this checks the build the
suite runs on, whose _ffi is the one a wheel ships: the same sources and options but
DTENJAX_BUILD_TESTING, which only adds the second extension)."""

import importlib
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax.testing import native as native_testing

# Text only the transport's fault injection would put into a binary.
TRANSPORT_ONLY = (b"injected thread-start failure", b"injected registration failure",
                  b"fake owner range")
# Text only the p2p kernels' simulated-rank harness would: its targets and its error messages;
# and its arena's name, which a build that links the arena into _ffi's registry keeps in
# exported symbols (main's did; the test extension's arena is file-local and named nowhere).
P2P_HARNESS = (b"dtenjax_p2p_selftest", b"p2p harness")
TEST_ONLY = (TRANSPORT_ONLY + (b"dtenjax_graph_probe_scale_add",) + P2P_HARNESS +
             (b"SimArena",))
TEST_TARGET_PREFIXES = ("dtenjax_graph_probe", "dtenjax_p2p_selftest")


def test_shipped_extension_has_no_test_code():
  mod = ffi.module()
  cuda = ffi.build_info()["cuda"]
  assert not hasattr(mod.transport, "testing")
  assert hasattr(mod.transport, "_seams")          # what the test extension acts through
  assert hasattr(mod, "_p2p_seams") == cuda        # what the p2p harness launches through
  targets = [t for t, _ in ffi.build_info()["targets"]]
  assert [t for t in targets if t.startswith(TEST_TARGET_PREFIXES)] == []
  binary = pathlib.Path(mod.__file__).read_bytes()
  assert [s for s in TEST_ONLY if s in binary] == []


def test_test_extension_holds_them():
  t = native_testing.module()
  cuda = ffi.build_info()["cuda"]
  binary = pathlib.Path(t.__file__).read_bytes()
  assert [s for s in TRANSPORT_ONLY if s not in binary] == []
  if cuda:
    assert [s for s in P2P_HARNESS if s not in binary] == []
  for name in ("fail_thread_starts", "fail_registrations", "set_pointer_owners",
               "reset_pointer_owners"):
    assert hasattr(t.transport, name), name
  targets = {target for target, _, _ in t.registrations()}
  want = {"dtenjax_graph_probe_scale_add", native_testing.P2P_SELFTEST,
          native_testing.P2P_SELFTEST_GRAPH}
  assert targets == (want if cuda else set())


def test_fail_registrations_needs_a_pool():
  with pytest.raises(TypeError, match="BufferPool"):
    native_testing.transport().fail_registrations(object(), 3)


def test_missing_test_extension_names_it_and_the_fix(monkeypatch):
  real = importlib.import_module

  def without_testing(name, *args):
    if name == native_testing.MODULE:
      raise ImportError(f"No module named {name!r}")
    return real(name, *args)

  monkeypatch.setattr(native_testing.importlib, "import_module", without_testing)
  monkeypatch.setattr(native_testing, "_registered", set())
  x = jnp.zeros((2, 8), jnp.float32)
  for call in (native_testing.module, lambda: native_testing.p2p_selftest(x)):
    with pytest.raises(errors.ExtensionUnavailableError) as e:
      call()
    msg = str(e.value)
    assert "dtenjax._ffi_testing is not built" in msg, msg
    assert "pip install --no-build-isolation -e ." in msg, msg


def test_p2p_selftest_checks_its_arguments():
  with pytest.raises(errors.CollectiveError, match=r"world size 9 is outside \[1, 8\]"):
    native_testing.p2p_selftest(np.zeros((9, 8), np.float32))
  with pytest.raises(errors.CollectiveError, match=r"got \(8,\)"):
    native_testing.p2p_selftest(np.zeros((8,), np.float32))
  with pytest.raises(errors.CollectiveError) as e:
    native_testing.p2p_selftest(np.zeros((2, 8), np.int32), algorithm="three_shot")
  assert "three_shot" in str(e.value) and "int32" in str(e.value)


def test_p2p_selftest_without_a_gpu_says_so():
  if native_testing._platforms() != {"cpu"}:
    pytest.skip("checks the CPU-only refusal")
  with pytest.raises(errors.ExtensionUnavailableError, match=r"platforms \['cpu'\]"):
    native_testing.p2p_selftest(np.zeros((2, 8), np.float32))
