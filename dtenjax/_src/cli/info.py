"""dtenjax info: the versions a bug report needs (dtenjax, jax, jaxlib, Python, the platform,
the devices JAX sees, CUDA and the driver when present), what the native extension was built
with, and which optional parts are installed (the extras of pip install 'dtenjax[...]')."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys

from dtenjax._src.cli import common

HELP = "versions, devices, the native extension's build and the optional packages present"
DESCRIPTION = __doc__
# extra -> the modules it provides (what `pip install 'dtenjax[extra]'` adds)
# (every extra of pyproject.toml: tests/test_install.py keeps the two lists together)
EXTRAS = {"gpu": ("cuda.bindings", "pynvml"), "demo": ("sklearn", "optax"),
          "plot": ("matplotlib",), "rdma": ("pyverbs",), "flax": ("flax",),
          "scheduler": ("prometheus_client",),
          "checkpoint": ("xxhash", "orbax.checkpoint", "tensorstore"), "gds": ("kvikio",),
          "test": ("pytest", "pytest_timeout", "xdist", "chex", "optax", "flax", "sklearn",
                   "prometheus_client", "jsonschema", "xxhash", "orbax.checkpoint",
                   "tensorstore", "ruff", "sphinx", "matplotlib")}
# the distributions whose versions describe a JAX installation on GPU (jax[cuda12] and friends)
CUDA_DISTRIBUTIONS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin",
                      "jax-cuda13-pjrt")


def _present(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


PACKAGES = {"cuda.bindings": "cuda-python", "pynvml": "nvidia-ml-py", "sklearn": "scikit-learn",
            "optax": "optax", "matplotlib": "matplotlib", "pyverbs": "pyverbs", "flax": "flax",
            "prometheus_client": "prometheus_client", "xxhash": "xxhash",
            "orbax.checkpoint": "orbax-checkpoint", "tensorstore": "tensorstore",
            "kvikio": "kvikio-cu12", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
            "xdist": "pytest-xdist", "chex": "chex", "jsonschema": "jsonschema", "ruff": "ruff",
            "sphinx": "sphinx"}


def require(extra: str, what: str) -> None:
  """Raises a ConfigurationError naming the missing packages of ``extra`` and the pip command."""
  from dtenjax._src import errors
  missing = [PACKAGES[m] for m in EXTRAS[extra] if not _present(m)]
  if missing:
    raise errors.ConfigurationError(
        f"{what} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
        f"not installed: pip install 'dtenjax[{extra}]' (from a checkout: pip install "
        f"'.[{extra}]').")


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def _driver() -> str | None:
  """The NVIDIA driver version (NVML when installed, else nvidia-smi), None without one."""
  if _present("pynvml"):
    try:
      import pynvml
      pynvml.nvmlInit()
      try:
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
      finally:
        pynvml.nvmlShutdown()
    except Exception:  # (no driver, no GPU: NVMLError subclasses)
      pass
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return None
  try:
    r = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True, timeout=20, check=False)
  except (OSError, subprocess.TimeoutExpired):
    return None
  lines = [ln.strip() for ln in r.stdout.splitlines() if ln.strip()]
  return lines[0] if r.returncode == 0 and lines else None


def versions() -> dict:
  """dtenjax, jax, jaxlib, Python and the platform; CUDA packages and the driver when present."""
  import jax
  import jaxlib
  import numpy as np
  import dtenjax
  out = {"dtenjax": dtenjax.__version__, "dtenjax_path": os.path.dirname(dtenjax.__file__),
         "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", _version("jaxlib")),
         "numpy": np.__version__, "python": platform.python_version(),
         "python_executable": sys.executable, "platform": platform.platform()}
  cuda = {d: v for d in CUDA_DISTRIBUTIONS if (v := _version(d)) is not None}
  out["cuda_packages"] = cuda
  out["nvidia_driver"] = _driver()
  return out


def devices() -> dict:
  """The backend JAX uses and its devices (kind and count), and XLA_FLAGS as this process saw
  it (where simulated CPU devices come from)."""
  import jax
  devs = jax.devices()
  kinds: dict[str, int] = {}
  for d in devs:
    kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
  return {"backend": jax.default_backend(), "count": len(devs),
          "kinds": kinds, "process_count": jax.process_count(),
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def describe() -> dict:
  from dtenjax._src import ffi
  from dtenjax._src.checkpoint import io as checkpoint_io
  ext = ffi.build_info()
  ext["targets"] = [f"{t} ({p})" for t, p in ext.get("targets", [])]
  return {"versions": versions(), "devices": devices(), "extension": ext,
          "checkpoint_io": checkpoint_io.describe(),
          "extras": {extra: {m: _present(m) for m in mods} for extra, mods in EXTRAS.items()}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
  common.add_json_argument(ap, "everything shown")


def _cell(v) -> str:
  if isinstance(v, bool):
    return "yes" if v else "no"
  if isinstance(v, (list, tuple)):
    return ", ".join(map(str, v)) if v else "-"
  if isinstance(v, dict):
    return ", ".join(f"{k} {w}" for k, w in v.items()) if v else "-"
  return "-" if v in (None, "") else str(v)


def run(args: argparse.Namespace) -> int:
  data = describe()
  if common.json_to_stdout(args):
    common.write_json(args, data)
    return 0
  from dtenjax._src import tables
  v, d = data["versions"], data["devices"]
  rows = [["dtenjax", f"{v['dtenjax']} ({v['dtenjax_path']})"],
          ["jax", v["jax"]], ["jaxlib", v["jaxlib"]], ["numpy", v["numpy"]],
          ["python", f"{v['python']} ({v['python_executable']})"], ["platform", v["platform"]],
          ["cuda packages", _cell(v["cuda_packages"]) if v["cuda_packages"] else "none"],
          ["nvidia driver", v["nvidia_driver"] or "none"],
          ["devices", f"{d['count']} {d['backend']} "
                      f"({', '.join(f'{n} x {k}' for k, n in d['kinds'].items())}), "
                      f"{d['process_count']} process(es)"],
          ["XLA_FLAGS", d["xla_flags"] or "-"]]
  print(tables.render(["version", "value"], rows, align=["left", "left"]))
  print()
  ext = data["extension"]
  print(tables.render(["extension", "value"], [[k, _cell(x)] for k, x in ext.items()],
                      align=["left", "left"]))
  print()
  print(tables.render(["extra", "modules", "installed"],
                      [[e, ", ".join(m), "yes" if all(m.values()) else
                        ("partly" if any(m.values()) else "no")]
                       for e, m in data["extras"].items()], align=["left", "left", "left"]))
  print(f"\ncheckpoint io: {data['checkpoint_io']['path']} ({data['checkpoint_io']['why']})")
  common.write_json(args, data)
  return 0
