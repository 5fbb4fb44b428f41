"""Whole-step bit reproducibility: what XLA must be told, and a ``jax.jit`` that tells it.

dtenjax's collectives give the same bits on every rank and every run, and a bucketed reduction
(``fuse_collectives``) gives the same bits as an unbucketed one (``substitute_psum``). The rest of
a training step does not follow from that: changing how gradients are reduced changes which
operations XLA fuses together, and inside a fused loop LLVM contracts ``a * b + c`` into one
fused multiply-add (FMA), rounded once instead of twice, wherever the target has FMA. Which
products get contracted depends on the fusion, so the same adamw step compiled around
``fuse_collectives`` and around ``substitute_psum`` differs in the last bits of some parameters
(measured: ``bench/reproducible_step.py``, docs/reproducibility.md).

XLA:CPU always allows contraction; no per-executable option turns it off (``compiler_options``
with ``xla_cpu_max_isa`` is accepted and ignored, measured on jax 0.10.2). What does turn it off is
a CPU ISA without FMA for the whole process: ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (or ``SSE4_2``),
set before JAX starts its CPU backend. :func:`reproducible_step` is ``jax.jit`` plus the
per-executable options that matter (no fast math, IEEE min/max; on GPU, deterministic ops) and a
check, on first call, that the process-wide flags are in place; it refuses to run without them,
naming the flag to set.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import jax

from dtenjax._src import errors

# Per executable (jax.jit(compiler_options=...)): accepted by XLA on jax 0.10.2.
COMPILER_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_cpu_enable_fast_math": False, "xla_cpu_enable_fast_min_max": False},
    "gpu": {"xla_gpu_enable_fast_min_max": False, "xla_gpu_deterministic_ops": True},
}
# Per process (XLA_FLAGS, read when the backend starts): CPU ISAs of XLA without FMA.
CPU_ISAS_WITHOUT_FMA = ("SSE4_2", "AVX")
PROCESS_FLAGS: dict[str, tuple[str, ...]] = {"cpu": ("--xla_cpu_max_isa=AVX",), "gpu": ()}


def _backend(backend: str | None = None) -> str:
  b = (backend or jax.default_backend()).lower()
  return "gpu" if b in ("gpu", "cuda", "rocm") else b


def missing_process_flags(backend: str | None = None, xla_flags: str | None = None) -> list[str]:
  """The XLA_FLAGS entries whole-step reproducibility needs on ``backend`` that ``xla_flags``
  (default: the environment's XLA_FLAGS) lacks."""
  b = _backend(backend)
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  if b == "cpu":
    isa = re.findall(r"--xla_cpu_max_isa=(\S+)", flags)
    if not isa or isa[-1].upper() not in CPU_ISAS_WITHOUT_FMA:
      return list(PROCESS_FLAGS["cpu"])
  return []


def reproducible_step(fn: Callable | None = None, /, *, compiler_options: dict | None = None,
                      check_flags: bool = True, **jit_kwargs) -> Callable:
  """``jax.jit(fn)`` whose whole-step bits do not depend on how XLA fused the program.

  Use it as ``@dtenjax.reproducible_step`` or ``dtenjax.reproducible_step(step,
  donate_argnums=0)``; ``jit_kwargs`` go to ``jax.jit``. It adds the per-executable options of
  :data:`COMPILER_OPTIONS` for the backend (yours in ``compiler_options`` may add others, not
  contradict these) and, on the first call, checks that the process runs with the flags of
  :data:`PROCESS_FLAGS` (CPU: ``XLA_FLAGS=--xla_cpu_max_isa=AVX``, no FMA contraction), raising
  ConfigurationError naming what to set otherwise; ``check_flags=False`` skips that check (the
  step is then only as reproducible as the process flags make it).

  With it, the same step with ``fuse_collectives``, ``substitute_psum`` or another
  ``bucket_bytes`` gives identical parameters after many adamw steps (tests/test_reproducible.py).
  It does not make different algorithms (``lax.psum`` vs ``one_shot``), device counts, jax/XLA
  versions or CPU models agree. On GPU it refuses (measured: fusion still changes bits there)
  unless ``check_flags=False``.
  """
  if fn is None:
    return functools.partial(reproducible_step, compiler_options=compiler_options,
                             check_flags=check_flags, **jit_kwargs)
  user = dict(compiler_options or {})
  jitted: dict[str, Callable] = {}

  def compiled(backend: str | None = None) -> Callable:
    b = _backend(backend)
    if b not in jitted:
      if b not in COMPILER_OPTIONS:
        raise errors.ConfigurationError(
            f"reproducible_step has no pinned option set for backend {b!r} (it knows "
            f"{tuple(COMPILER_OPTIONS)}); use jax.jit and check the bits yourself.")
      if check_flags and b == "gpu":
        raise errors.ConfigurationError(
            "reproducible_step on gpu: no XLA option is known that stops NVPTX from contracting "
            "a * b + c into fused multiply-adds differently in differently fused programs; "
            "measured on an H200 (jax 0.11.2) with deterministic ops pinned, the same adamw step "
            "around fuse_collectives and substitute_psum differs in 53 of 26,378 parameters "
            "after one step (tests/test_reproducible.py). dtenjax's collective outputs are still "
            "bit-identical; for whole-step bits run the step on CPU, or pass check_flags=False "
            "to get the pinned options without the guarantee.")
      if check_flags:
        missing = missing_process_flags(b)
        if missing:
          raise errors.ConfigurationError(
              f"reproducible_step on {b}: the process runs without {' '.join(missing)} "
              f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}). XLA:CPU contracts a * b + c "
              "into fused multiply-adds differently in differently fused programs, and only a "
              "CPU ISA without FMA, chosen when the backend starts, stops it. Set "
              f"XLA_FLAGS=\"$XLA_FLAGS {' '.join(missing)}\" before JAX starts (before the "
              "first jax call), or pass check_flags=False to accept FMA-dependent bits.")
      pinned = COMPILER_OPTIONS[b]
      clash = sorted(k for k in user if k in pinned and user[k] != pinned[k])
      if clash:
        raise errors.ConfigurationError(
            f"reproducible_step: compiler_options {clash} contradict what it pins "
            f"({', '.join(f'{k}={pinned[k]!r}' for k in clash)}); drop them or use jax.jit.")
      jitted[b] = jax.jit(fn, compiler_options={**pinned, **user}, **jit_kwargs)
    return jitted[b]

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return compiled()(*args, **kwargs)

  wrapper.lower = lambda *a, **k: compiled().lower(*a, **k)
  wrapper.jitted = compiled
  return wrapper
