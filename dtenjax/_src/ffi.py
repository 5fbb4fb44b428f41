"""The one place that imports the native extension ``dtenjax._ffi`` and registers its FFI targets.

Native functions bound for Python (``custom_calls/python.h``) raise dtenjax errors: a failing
``dtenjax::Status`` becomes the class :data:`STATUS_ERRORS` names for its code, installed here when
the extension loads (the one status-to-exception map).

If the extension is missing (for example a source checkout that was never built), dtenjax still
imports; anything that needs a native target calls :func:`require`, which raises
:class:`ExtensionUnavailableError` saying what is missing and how to build it.

jax is imported where a function registers targets or asks for devices, not with this module:
what the build holds (:func:`build_info`, :func:`vocabulary`) is read without it, so that the
set-up's closing report (scripts/setup.sh) does not pay jax's import (about 1.5 s of CPU) on the
set-up's last, single-core step.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

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
    from dtenjax import _ffi
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
  import jax
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
    import jax
    for target, platform, stages in mod.registrations():
      if platform not in present:
        continue
      fn = stages["execute"] if set(stages) == {"execute"} else dict(stages)
      jax.ffi.register_ffi_target(target, fn, platform=platform)
      _registered.setdefault(target, set()).add(platform)
    return _registered


def arch_mismatch(archs: str, capability: str) -> str | None:
  """Why kernels built for CMake's CUDA architecture list ``archs`` (``"80-real;90"``: SASS for
  sm_80, SASS and PTX for sm_90) cannot run on a GPU of compute capability ``capability``
  (``"8.6"``); None when they can.

  CUDA's compatibility rules: SASS for sm_XY runs on a GPU X.Z with Z >= Y (same major; the
  ``a``/``f`` variants such as ``90a`` only on X.Y itself); PTX for compute_XY is compiled by the
  driver for any GPU of capability >= X.Y. An entry ``NN`` is both SASS and PTX, ``NN-real`` SASS
  only, ``NN-virtual`` PTX only.
  """
  try:
    major, minor = (int(v) for v in str(capability).split(".")[:2])
  except ValueError:
    return f"the GPU reports compute capability {capability!r}, not MAJOR.MINOR"
  entries = [e.strip() for e in str(archs).replace(",", ";").split(";") if e.strip()]
  if not entries:
    return "the build records no CUDA architecture"
  for entry in entries:
    if entry in ("all", "all-major", "native"):   # CMake's own keywords: trust the build
      return None
    code, _, kind = entry.partition("-")
    digits = code.rstrip("af")
    if not digits.isdigit() or len(digits) < 2 or kind not in ("", "real", "virtual"):
      return f"the build's CUDA architecture {entry!r} is not one CMake writes"
    a_major, a_minor, specific = int(digits[:-1]), int(digits[-1]), code != digits
    if kind in ("", "real"):
      if specific and (a_major, a_minor) == (major, minor):
        return None
      if not specific and a_major == major and a_minor <= minor:
        return None
    if kind in ("", "virtual") and not specific and (a_major, a_minor) <= (major, minor):
      return None
  return (f"the CUDA kernels of this build are for {';'.join(entries)} (SASS runs on the same "
          f"major version, PTX on newer GPUs), not for this GPU's compute capability "
          f"{major}.{minor}; rebuild with DTENJAX_CUDA_ARCHS={major}{minor} "
          "(`DTENJAX_CUDA_ARCHS=... bash scripts/setup.sh`, README: Install)")


def gpu_kernels_reason(devices=None) -> str | None:
  """Why this build's CUDA kernels cannot run on the visible GPUs (each device's
  ``compute_capability`` against the build's recorded architectures); None when they can."""
  if devices is None:
    import jax
    try:
      devices = jax.devices("gpu")
    except RuntimeError:
      devices = []
  archs = build_info().get("cuda_archs", "")
  for d in devices:
    cap = getattr(d, "compute_capability", None)
    if cap is None:
      continue                     # a backend that does not say: nothing to check against
    why = arch_mismatch(archs, cap)
    if why:
      return f"GPU {d.id} ({getattr(d, 'device_kind', 'GPU')}): {why}"
  return None


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
