"""``dtenjax info``: what the native extension was built with and which optional parts are
installed (the extras of ``pip install 'dtenjax[...]'``)."""

from __future__ import annotations

import argparse
import importlib.util
import json

HELP = "build information of the native extension and the optional packages present"
DESCRIPTION = __doc__
# extra -> the modules it provides (what `pip install 'dtenjax[extra]'` adds)
EXTRAS = {"gpu": ("cuda.bindings", "pynvml"), "demo": ("sklearn", "optax"),
          "plot": ("matplotlib",), "rdma": ("pyverbs",), "flax": ("flax",),
          "scheduler": ("prometheus_client",)}


def _present(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


PACKAGES = {"cuda.bindings": "cuda-python", "pynvml": "nvidia-ml-py", "sklearn": "scikit-learn",
            "optax": "optax", "matplotlib": "matplotlib", "pyverbs": "pyverbs", "flax": "flax",
            "prometheus_client": "prometheus_client"}


def require(extra: str, what: str) -> None:
  """Raises a ConfigurationError naming the missing packages of ``extra`` and the pip command."""
  from dtenjax._src import errors  # pylint: disable=g-import-not-at-top
  missing = [PACKAGES[m] for m in EXTRAS[extra] if not _present(m)]
  if missing:
    raise errors.ConfigurationError(
        f"{what} needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
        f"not installed: pip install 'dtenjax[{extra}]' (from a checkout: pip install "
        f"'.[{extra}]').")


def describe() -> dict:
  from dtenjax._src import ffi  # pylint: disable=g-import-not-at-top
  from dtenjax._src.checkpoint import io as checkpoint_io  # pylint: disable=g-import-not-at-top
  return {"extension": ffi.build_info(), "checkpoint_io": checkpoint_io.describe(),
          "extras": {extra: {m: _present(m) for m in mods} for extra, mods in EXTRAS.items()}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--json", action="store_true", help="print the same as JSON")


def run(args: argparse.Namespace) -> int:
  data = describe()
  if args.json:
    print(json.dumps(data, indent=1, default=str))
    return 0
  from dtenjax._src import tables  # pylint: disable=g-import-not-at-top
  ext = data["extension"]
  print(tables.render(["extension", "value"],
                      [[k, ", ".join(map(str, v)) if isinstance(v, (list, tuple)) else v]
                       for k, v in ext.items()], align=["left", "left"]))
  print()
  print(tables.render(["extra", "modules", "installed"],
                      [[e, ", ".join(m), "yes" if all(m.values()) else
                        ("partly" if any(m.values()) else "no")]
                       for e, m in data["extras"].items()], align=["left", "left", "left"]))
  print(f"\ncheckpoint io: {data['checkpoint_io']['path']} ({data['checkpoint_io']['why']})")
  return 0
