import subprocess
import sys

import pytest

import dtenjax
from dtenjax._src import ffi


def test_build_info_lists_registered_targets():
  info = dtenjax.build_info()
  assert info["built"], f"the extension must be built for the test suite: {info['error']}"
  assert ("dtenjax_topk_pack", "cpu") in info["targets"]
  assert ("dtenjax_host_all_reduce", "cpu") in info["targets"]
  assert not any(t.startswith("dtenjax_fp_") for t, _ in info["targets"])   # jnp now (faster)
  assert ffi.has_target("dtenjax_topk_pack", "cpu")
  assert ffi.require("dtenjax_host_all_reduce") == "dtenjax_host_all_reduce"


def test_unknown_target_error_says_how_to_rebuild():
  assert ffi.is_built()
  with pytest.raises(dtenjax.ExtensionUnavailableError, match="not in this build.*setup.sh"):
    ffi.require("dtenjax_no_such_target")


def test_import_without_extension_still_works_and_explains():
  code = """
import sys
class Block:
  def find_spec(self, name, path=None, target=None):
    if name == "dtenjax._ffi":
      raise ImportError("blocked for the test")
sys.meta_path.insert(0, Block())
import jax.numpy as jnp
import dtenjax
from dtenjax._src import ffi
from dtenjax._src.collectives import fixed_point
assert not ffi.is_built()
# the jnp path needs no extension
print(float(fixed_point.exact_sum(jnp.ones((4, 3), jnp.float32))[0]))
try:
  ffi.require("dtenjax_topk_pack")
except dtenjax.ExtensionUnavailableError as e:
  print("ERR", e)
"""
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                     check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.splitlines()[0] == "4.0"
  assert "ERR" in r.stdout and "could not be imported" in r.stdout and "setup.sh" in r.stdout
