"""The test-only native extension, dtenjax._ffi_testing (custom_calls/testing/).

It is built by editable installs (scripts/setup.sh, scripts/test.sh, scripts/gpu_check.sh: the
CMake option DTENJAX_BUILD_TESTING, pyproject.toml) and never shipped in a wheel. A test that
needs it fails (never skips) when it is missing: that is a broken build, not a missing feature.
"""

import importlib

import jax


def module():
  """``dtenjax._ffi_testing``; AssertionError saying how to build it when it is absent."""
  try:
    return importlib.import_module("dtenjax._ffi_testing")
  except ImportError as e:
    raise AssertionError(
        f"the test extension dtenjax._ffi_testing is not built ({e}); build the tree with "
        "`bash scripts/setup.sh` or `pip install --no-build-isolation -e .` (editable installs "
        "set DTENJAX_BUILD_TESTING=ON)") from None


def transport():
  """Fault injection into the host transport: fail_thread_starts, fail_registrations,
  set_pointer_owners, reset_pointer_owners."""
  return module().transport


_registered: set[tuple[str, str]] = set()


def has_target(target: str, platform: str = "CUDA") -> bool:
  """Whether the test extension has ``target`` for ``platform`` and jax has that platform."""
  return (target, platform) in _register()


def require(target: str, platform: str = "CUDA") -> str:
  """``target`` after registering the test extension's FFI handlers with jax (once)."""
  if (target, platform) not in _register():
    built = sorted((t, p) for t, p, _ in module().registrations())
    raise AssertionError(f"{target!r} for {platform} is not registered: the test extension "
                         f"has {built} and jax has the platforms {sorted(_platforms())}")
  return target


def _platforms() -> set[str]:
  return {"CUDA" if d.platform == "gpu" else d.platform for d in jax.devices()}


def _register() -> set[tuple[str, str]]:
  if not _registered:
    present = _platforms()
    for target, platform, stages in module().registrations():
      if platform in present:
        fn = stages["execute"] if set(stages) == {"execute"} else dict(stages)
        jax.ffi.register_ffi_target(target, fn, platform=platform)
        _registered.add((target, platform))
  return _registered
