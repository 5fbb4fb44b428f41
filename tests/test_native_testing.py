"""The test-only native code lives in its own extension, dtenjax._ffi_testing, and the shipped
dtenjax._ffi holds none of it (tests/test_wheel.py checks a real wheel; this checks the build the
suite runs on, whose _ffi is the one a wheel ships: the same sources and options but
DTENJAX_BUILD_TESTING, which only adds the second extension)."""

import pathlib

import pytest

from dtenjax._src import ffi
from tests import native_testing

# Text only fault injection or test-only targets would put into a binary.
TEST_ONLY = (b"injected thread-start failure", b"injected registration failure",
             b"fake owner range", b"dtenjax_graph_probe_scale_add")


def test_shipped_extension_has_no_test_hooks():
  mod = ffi.module()
  assert not hasattr(mod.transport, "testing")
  assert hasattr(mod.transport, "_seams")          # what the test extension acts through
  assert not any(t.startswith("dtenjax_graph_probe") for t, _ in ffi.build_info()["targets"])
  binary = pathlib.Path(mod.__file__).read_bytes()
  assert [s for s in TEST_ONLY if s in binary] == []


def test_test_extension_holds_them():
  t = native_testing.module()
  binary = pathlib.Path(t.__file__).read_bytes()
  assert [s for s in TEST_ONLY[:3] if s not in binary] == []
  for name in ("fail_thread_starts", "fail_registrations", "set_pointer_owners",
               "reset_pointer_owners"):
    assert hasattr(t.transport, name), name
  targets = {target for target, _, _ in t.registrations()}
  assert ("dtenjax_graph_probe_scale_add" in targets) == ffi.build_info()["cuda"]


def test_fail_registrations_needs_a_pool():
  with pytest.raises(TypeError, match="BufferPool"):
    native_testing.transport().fail_registrations(object(), 3)
