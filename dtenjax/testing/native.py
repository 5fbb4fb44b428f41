"""The test-only native extension, dtenjax._ffi_testing (custom_calls/testing/), from Python.

It is built by editable installs (scripts/setup.sh, scripts/test.sh, scripts/gpu_check.sh: the
CMake option DTENJAX_BUILD_TESTING, pyproject.toml) and never shipped in a wheel. A test that
needs it fails (never skips) when it is missing: that is a broken build, not a missing feature.

Besides the transport's fault injection and the graph-probe kernel it holds the p2p kernels'
simulated-rank harness (:func:`p2p_selftest`), which tests/test_p2p.py and bench/p2p_allreduce.py
run (bench/cuda_graphs.py uses the probe kernel). It is shipped with dtenjax.testing so that the
tests and the benchmarks share it (benchmarks import nothing from tests/); in a wheel, which has
no test extension, every function here raises ExtensionUnavailableError saying how to build it.
"""

import importlib

import jax
import numpy as np

from dtenjax._src import contract as contract_lib
from dtenjax._src import errors
from dtenjax._src.gpu import p2p

MODULE = "dtenjax._ffi_testing"
FIX = ("build the tree as an editable install, which sets DTENJAX_BUILD_TESTING=ON: "
       "`pip install --no-build-isolation -e .` (or `bash scripts/setup.sh`); a wheel never "
       "contains it")


def module():
  """``dtenjax._ffi_testing``; ExtensionUnavailableError saying how to build it when absent."""
  try:
    return importlib.import_module(MODULE)
  except ImportError as e:
    raise errors.ExtensionUnavailableError(
        f"the test extension {MODULE} is not built ({e}); {FIX}") from None


def transport():
  """Fault injection into the host transport: fail_thread_starts, fail_registrations,
  set_pointer_owners, reset_pointer_owners."""
  return module().transport


_registered: set[tuple[str, str]] = set()


def has_target(target: str, platform: str = "CUDA") -> bool:
  """Whether the test extension has ``target`` for ``platform`` and jax has that platform."""
  return (target, platform) in _register()


def require(target: str, platform: str = "CUDA") -> str:
  """``target`` after registering the test extension's FFI handlers with jax (once);
  ExtensionUnavailableError naming what the extension has and the platforms jax has otherwise."""
  if (target, platform) not in _register():
    built = sorted((t, p) for t, p, _ in module().registrations())
    raise errors.ExtensionUnavailableError(
        f"{target!r} for {platform} is not registered: the test extension {MODULE} has {built} "
        f"and jax has the platforms {sorted(_platforms())} (CUDA targets are built where nvcc "
        "is found and run where jax sees a GPU)")
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


# --- the p2p kernels with simulated ranks on one GPU (custom_calls/testing/p2p_selftest_cuda.cc)

P2P_SELFTEST = "dtenjax_p2p_selftest"
P2P_SELFTEST_GRAPH = "dtenjax_p2p_selftest_graph"


def p2p_selftest(x, *, algorithm: str = "one_shot", op: str = "sum",
                 reproducible: bool | str = False, count: int | None = None, iters: int = 3,
                 mode: int = 0, graph: bool = False, capacity: int | None = None):
  """Runs the shipped p2p kernels with ``x.shape[0]`` simulated ranks on one GPU; returns [W, n].

  ``x`` is [W, n] with n * itemsize a multiple of 16 (each rank's row 16-byte aligned); the
  kernels reduce the first ``count`` (default n) elements of every row, the rest of the output
  is unspecified. mode 0 chains ``iters`` calls so that a stale buffer or flag changes the final
  bits; mode 1 repeats the same call ``iters`` times (timing); mode 2 times a device-to-device
  copy of ``x`` instead; mode 3 launches rank 0 alone, so its barrier times out and the kernel
  traps (run it in a process of its own). ``graph`` uses the command-buffer-compatible target,
  which needs an earlier non-graph call with the same W to have allocated the arena
  (``capacity`` bytes per rank, default the registered-buffer size). The attributes are those
  ``dtenjax_p2p_all_reduce`` gets (algorithm, op, reproducible contract, DTENJAX_P2P_MAX_BLOCKS,
  DTENJAX_COLLECTIVE_TIMEOUT).
  """
  contract = contract_lib.parse(reproducible)
  if x.ndim != 2 or x.shape[0] < 2:
    raise errors.CollectiveError(f"p2p_selftest input must be [ranks >= 2, n], got {x.shape}")
  # the NVLink gate on the call's arguments (world, dtype, op, contract, knobs); the harness
  # brings its own ranks on one GPU, so not on this process's deployment
  verdict = p2p.gate(world=x.shape[0], dtype=x.dtype, op=op, contract=contract,
                     algorithm=algorithm, deployment=False)
  if not verdict.ok:
    raise errors.CollectiveError(f"p2p_selftest cannot run: {verdict.reason}")
  count = x.shape[1] if count is None else count
  target = require(P2P_SELFTEST_GRAPH if graph else P2P_SELFTEST, "CUDA")
  attributes = p2p._attributes(algorithm, op, contract)
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, count=np.int64(count), **attributes, iters=np.int64(iters), mode=np.int64(mode),
      capacity=np.int64(capacity if capacity is not None else p2p.capacity_bytes()),
      max_blocks=np.int64(p2p.max_blocks()),
      timeout_ms=np.int64(p2p._timeout_ms()))
