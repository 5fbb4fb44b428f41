"""The one place that imports the native extension ``dtenjax._ffi`` and registers its FFI targets.

Native functions bound for Python (``custom_calls/python.h``) raise dtenjax errors: a failing
``dtenjax::Status`` becomes the class :data:`STATUS_ERRORS` names for its code, installed here when
the extension loads (the one status-to-exception map).

If the extension is missing (for example a source checkout that was never built), dtenjax still
imports; anything that needs a native target calls :func:`require`, which raises
:class:`ExtensionUnavailableError` saying what is missing and how to build it.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import jax

from dtenjax._src import errors

BUILD_HINT = ("Build it from the repository root with `bash scripts/setup.sh` (or "
              "`pip install --no-build-isolation -e .` once scikit-build-core, nanobind and jax "
              "are installed).")

# The name of a dtenjax::Code (csrc/common/status.h, exported as vocabulary("status")) -> the
# exception a native binding raises for it. Keyed by name: the integers are the extension's.
STATUS_ERRORS: dict[str, type[Exception]] = {
    "invalid_argument": errors.ConfigurationError,
    "unavailable": errors.ExtensionUnavailableError,  # a capability (device, library) is missing
    "deadline_exceeded": errors.CollectiveTimeoutError,
    "resource_exhausted": errors.QuotaExceededError,
    "permission_denied": errors.TransportError,       # authentication / ownership
    "data_loss": errors.TransportError,               # corrupt frame
    "internal": errors.NativeError,
    "cancelled": errors.CollectiveError,             # closed locally while the call was in flight
}

_lock = threading.Lock()
_registered: dict[str, set[str]] = {}   # target -> platforms registered with XLA


@functools.cache
def _load() -> tuple[Any, str | None]:
  try:
    from dtenjax import _ffi  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, f"the native extension dtenjax._ffi could not be imported ({e})"
  codes = _ffi.vocabulary["status"]
  unknown = sorted(set(STATUS_ERRORS) - set(codes))
  if unknown:
    return None, (f"dtenjax._ffi exports the status codes {sorted(codes)}, which lack {unknown} "
                  "that dtenjax/_src/ffi.py maps to exceptions (a stale build?)")
  _ffi.set_error_classes({codes[name]: cls for name, cls in STATUS_ERRORS.items()})
  return _ffi, None


def is_built() -> bool:
  """Whether the native extension can be imported."""
  return _load()[0] is not None


def build_info() -> dict[str, Any]:
  """What this build contains: {'built', 'cuda', 'cuda_archs', 'verbs', 'targets', 'error'}."""
  mod, err = _load()
  if mod is None:
    return {"built": False, "cuda": False, "cuda_archs": "", "verbs": False, "targets": [],
            "error": err}
  info = dict(mod.build_info())
  info.update(built=True, error=None,
              targets=sorted({(t, p) for t, p, _ in mod.registrations()}))
  return info


def vocabulary(name: str) -> dict[str, int]:
  """A native vocabulary, {entry name: the integer C++ uses}, as the extension exports it.

  ``name`` is e.g. "status", "p2p.algorithm", "p2p.op", "p2p.reproducible", "p2p.dtype",
  "transport.dtype", "transport.op" (each defined once in csrc/, published by
  custom_calls/python.h's AddVocabulary). ExtensionUnavailableError without the extension: Python
  keeps no second copy of these tables.
  """
  tables = module().vocabulary
  if name not in tables:
    raise errors.ExtensionUnavailableError(
        f"this build of dtenjax._ffi exports no vocabulary {name!r} (it has {sorted(tables)}). "
        f"Rebuild the extension: {BUILD_HINT}")
  return dict(tables[name])


def module():
  """The extension module itself, or ExtensionUnavailableError."""
  mod, err = _load()
  if mod is None:
    raise errors.ExtensionUnavailableError(f"{err}. {BUILD_HINT}")
  return mod


def _platforms_present() -> set[str]:
  present = set()
  for d in jax.devices() + (jax.devices("cpu") if jax.default_backend() != "cpu" else []):
    present.add("CUDA" if d.platform == "gpu" else d.platform)
  return present


def register_all() -> dict[str, set[str]]:
  """Registers every target of the extension for the platforms jax has. Idempotent."""
  mod = module()
  with _lock:
    if _registered:
      return _registered
    present = _platforms_present()   # also starts the backends, which FFI registration needs
    for target, platform, stages in mod.registrations():
      if platform not in present:
        continue
      fn = stages["execute"] if set(stages) == {"execute"} else dict(stages)
      jax.ffi.register_ffi_target(target, fn, platform=platform)
      _registered.setdefault(target, set()).add(platform)
    return _registered


def has_target(target: str, platform: str = "cpu") -> bool:
  """Whether ``target`` is built and registered for ``platform`` ("cpu" or "CUDA")."""
  if not is_built():
    return False
  return platform in register_all().get(target, set())


def require(target: str, platform: str = "cpu") -> str:
  """Returns ``target`` after making sure it is registered; raises a clear error otherwise."""
  mod = module()
  if has_target(target, platform):
    return target
  known = sorted({(t, p) for t, p, _ in mod.registrations()})
  built_for = [p for t, p in known if t == target]
  if not built_for:
    raise errors.ExtensionUnavailableError(
        f"FFI target {target!r} is not in this build of dtenjax._ffi (build info: "
        f"{dict(mod.build_info())}). Rebuild the extension: {BUILD_HINT}")
  raise errors.ExtensionUnavailableError(
      f"FFI target {target!r} is built for {built_for} but platform {platform!r} is not "
      f"available to jax here (backends: {sorted(_platforms_present())}).")
