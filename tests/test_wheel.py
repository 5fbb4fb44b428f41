"""The user's install path: a wheel built from this checkout, installed with the ``demo`` extra
into a fresh virtual environment, run from outside the checkout.

The wheel is built with the development environment's build requirements (no build isolation) and
the editable install's CMake directory, so only what changed is recompiled; a plain ``pip wheel
.`` builds the same in a temporary directory (pyproject.toml: a build-dir only for editable
installs, checked below). Installing the wheel's dependencies needs the package index (or pip's
cache), so this test is marked slow; CI runs it like every other test (scripts/test.sh selects
no markers).
"""

import json
import os
import pathlib
import subprocess
import sys
import tomllib
import zipfile

import pytest
from test_setup_script import _stamp_request

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tree_state():
  """Every path git sees in the checkout, ignored ones included (build/ aside: the editable
  install's build directory, which the wheel build below reuses on purpose)."""
  out = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
                       cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return {ln for ln in out.splitlines() if not ln[3:].startswith(("build/", ".venv/"))
          and "__pycache__" not in ln and ".pytest_cache" not in ln}


def test_only_editable_installs_build_the_test_extension():
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
  assert config["cmake"]["define"]["DTENJAX_BUILD_TESTING"] == "OFF"
  on = [o for o in config.get("overrides", [])
        if o.get("cmake", {}).get("define", {}).get("DTENJAX_BUILD_TESTING") == "ON"]
  assert on and all(o["if"] == {"state": "editable"} for o in on)
  cmake = (ROOT / "CMakeLists.txt").read_text()
  assert 'option(DTENJAX_BUILD_TESTING "Build dtenjax._ffi_testing, the test-only extension" OFF)' in cmake


def test_only_editable_installs_keep_a_build_directory_in_the_tree():
  config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["scikit-build"]
  assert "build-dir" not in config                   # wheels build in a temporary directory
  overrides = [o for o in config.get("overrides", []) if "build-dir" in o]
  assert overrides and all(o["if"] == {"state": "editable"} for o in overrides)


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_venv_and_runs(tmp_path):
  before = _tree_state()
  dist = tmp_path / "dist"
  # The editable build's CUDA architectures (scripts/test.sh's request, recorded in the set-up's
  # stamp), so that the reused build directory recompiles nothing the editable build compiled.
  env = {k: v for k, v in os.environ.items() if k != "DTENJAX_CUDA_ARCHS_WITHOUT_GPU"}
  env.update(_stamp_request(ROOT / ".venv" / ".dtenjax-setup-done"))
  r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                      "--no-deps", "-w", str(dist), "-C", "build-dir=build/{wheel_tag}", "."],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800, check=False)
  assert r.returncode == 0, r.stderr[-4000:]
  assert _tree_state() == before, "building the wheel wrote into the checkout"
  (wheel,) = dist.glob("dtenjax-*.whl")

  names = zipfile.ZipFile(wheel).namelist()
  assert any(n.startswith("dtenjax/_ffi.") and n.endswith(".so") for n in names)
  assert not any(n.startswith("dtenjax/_ffi_testing") for n in names), names   # test-only
  for n in ("dtenjax/py.typed", "dtenjax/fixtures/h200_8.json",
            "dtenjax/schemas/topology-1.schema.json", "dtenjax-0.1.0.dist-info/licenses/LICENSE"):
    assert n in names, n
  assert not any(n.startswith(("tests/", "bench/", "csrc/")) for n in names)
  meta = zipfile.ZipFile(wheel).read("dtenjax-0.1.0.dist-info/METADATA").decode()
  for extra in ("gpu", "demo", "plot", "rdma", "flax", "scheduler", "test"):
    assert f"Provides-Extra: {extra}\n" in meta
  assert 'Requires-Dist: nvidia-ml-py>=12; extra == "gpu"' in meta
  assert "Classifier: License :: OSI Approved :: Apache Software License" in meta
  license_text = zipfile.ZipFile(wheel).read("dtenjax-0.1.0.dist-info/licenses/LICENSE").decode()
  assert "Apache License\n                           Version 2.0, January 2004" in license_text
  assert "END OF TERMS AND CONDITIONS" in license_text

  # A fresh virtual environment without a pip of its own (ensurepip takes seconds): this
  # environment's pip installs into it (pip --python), without byte-compiling every file it
  # installs: the commands below write the .pyc files of the modules they import (the first
  # command's are the next ones' cache), a third of the CPU time of compiling the whole of jax,
  # scipy and scikit-learn (measured: 4 s against 12 s). PYTHONDONTWRITEBYTECODE, set on our
  # machines, is left out of their environment so that they can.
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                 timeout=300)
  py, dtenjax = venv / "bin" / "python", venv / "bin" / "dtenjax"
  r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                      "--no-compile", f"{wheel}[demo]"],
                     capture_output=True, text=True, timeout=1800, check=False)
  assert r.returncode == 0, r.stderr[-4000:]

  away = tmp_path / "elsewhere"         # not the checkout: the installed package must be used
  away.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "XLA_FLAGS", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
  env["JAX_PLATFORMS"] = "cpu"

  def run(*args, timeout=600):
    return subprocess.run([str(dtenjax), *args], cwd=away, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
  installed = """
import importlib.util
import dtenjax
from dtenjax import _ffi
print(dtenjax.__file__)
assert importlib.util.find_spec("dtenjax._ffi_testing") is None
assert not hasattr(_ffi.transport, "testing"), "fault injection in the shipped extension"
assert "p2p.limits" in _ffi.vocabulary, sorted(_ffi.vocabulary)
"""
  r = subprocess.run([str(py), "-c", installed], cwd=away, env=env, capture_output=True,
                     text=True, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().startswith(str(venv))
  r = run("--version")
  assert r.stdout.strip() == "dtenjax 0.1.0"
  r = run("info", "--json")
  assert r.returncode == 0, r.stderr[-3000:]
  info = json.loads(r.stdout)
  assert info["extension"]["built"] is True
  assert info["versions"]["dtenjax_path"].startswith(str(venv))
  assert info["extras"]["demo"] == {"sklearn": True, "optax": True}
  r = run("demo", "--steps", "3", "--no-progress")
  assert r.returncode == 0, r.stderr[-3000:]
  assert "8 cpu device(s)" in r.stdout and "losses bit-identical across runs: True" in r.stdout
  r = run("bench", "allreduce")
  assert r.returncode == 2 and "benchmarks run from a source checkout" in r.stderr
