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


# CUDA's binary compatibility (CUDA C++ Programming Guide, "Binary Compatibility" and "PTX
# Compatibility"): SASS for X.Y runs on X.Z with Z >= Y only; PTX for X.Y is JIT-compiled for any
# GPU >= X.Y; arch-specific targets (sm_90a) run on exactly 9.0.
@pytest.mark.parametrize("archs, capability, runs", [
    ("90", "9.0", True),
    ("90", "8.0", False),             # neither the SASS (major 9) nor the PTX (newer) fits
    ("80-real;90", "8.6", True),      # sm_80 SASS on an RTX 30xx / A10
    ("80-real;90", "8.9", True),
    ("80-real;90", "10.0", True),     # B200: compute_90 PTX, compiled by the driver
    ("80-real;90-real", "10.0", False),
    ("86-real", "8.0", False),        # SASS never runs on a lower minor version
    ("90a", "9.0", True),
    ("90a", "10.0", False),           # arch-specific code is not forward compatible
    ("80-virtual", "12.0", True),
])
def test_arch_mismatch_follows_cudas_compatibility_rules(archs, capability, runs):
  why = ffi.arch_mismatch(archs, capability)
  assert (why is None) == runs, why
  if not runs:
    major, minor = capability.split(".")
    assert capability in why and f"DTENJAX_CUDA_ARCHS={major}{minor}" in why


def test_a_gpu_without_kernels_falls_back_to_xla_saying_why(monkeypatch):
  import types
  info = dict(ffi.build_info(), cuda_archs="90")
  monkeypatch.setattr(ffi, "build_info", lambda: info)
  a100 = types.SimpleNamespace(id=0, device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
  h100 = types.SimpleNamespace(id=1, device_kind="NVIDIA H100", compute_capability="9.0")
  assert ffi.gpu_kernels_reason([h100]) is None
  why = ffi.gpu_kernels_reason([h100, a100])
  assert why.startswith("GPU 0 (NVIDIA A100-SXM4-80GB)") and "8.0" in why
  assert ffi.arch_mismatch("", "9.0") == "the build records no CUDA architecture"
