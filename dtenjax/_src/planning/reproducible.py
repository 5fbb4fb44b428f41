"""Whole-step bit reproducibility: what XLA must be told, and a ``jax.jit`` that tells it.

Two different promises, and what each backend needs for them:

* **Run to run, process to process** (the same program on the same inputs gives the same bits
  after a restart). XLA:CPU gives it already. XLA:GPU does not: at compile time its autotuner
  picks GEMM configurations (Triton tiles, split-K, cuBLAS), convolution algorithms and cuDNN
  plans by timing them, and timing is noisy, so two processes can compile different kernels
  whose rounding differs (measured: the demo's losses took two digests in five fresh processes
  on an H200); at run time scatter (an embedding's or a gather's gradient), select-and-scatter,
  some GEMM, convolution and attention kernels accumulate with atomics. :func:`reproducible_step`
  pins, per executable, exactly those two things: ``xla_gpu_exclude_nondeterministic_ops``
  (deterministic implementations; select-and-scatter, which has none, XLA either refuses to compile
  or, on jax 0.11.2, rewrites into a scatter, deterministic under the pin) and
  the autotuner (``xla_gpu_autotune_level=0``: XLA's heuristic choice, no timing; or
  ``autotune="cache"``: results stored in a directory, so every later process reads the first
  one's choices). Collectives: NCCL chooses its algorithm from a static model of the topology,
  the same in every run, except NVLink SHARP (NVLS), which reduces in the switch;
  ``dtenjax.pin_nccl()`` sets ``NCCL_NVLS_ENABLE=0`` (``gpu/environment.py``) and
  :func:`reproducible_step` refuses a multi-device process where it is not 0. Nothing else is pinned.
* **Across differently fused programs** (the same step with ``fuse_collectives`` or
  ``substitute_psum``, another ``bucket_bytes``): changing how gradients are reduced changes which
  operations XLA fuses together, and inside a fused loop LLVM contracts ``a * b + c`` into one
  fused multiply-add (FMA) wherever the target has one. XLA:CPU stops only with a CPU ISA
  without FMA for the whole process (``XLA_FLAGS=--xla_cpu_max_isa=AVX``, read when the backend
  starts; per-executable ``xla_cpu_max_isa`` is accepted and ignored, measured on jax 0.10.2), so
  on CPU :func:`reproducible_step` checks that flag on first call. On GPU no option is known that
  stops NVPTX's contraction; measured on an H200 with the GPU pins, fused and unfused steps still
  differ in the last bits, so on GPU this promise is not made.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import jax

from dtenjax._src import errors

# Per executable (jax.jit(compiler_options=...)). CPU: accepted by XLA on jax 0.10.2.
COMPILER_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"xla_cpu_enable_fast_math": False, "xla_cpu_enable_fast_min_max": False},
}
# GPU: each pin with what it fixes. reproducible_step uses all of them; benches time each.
GPU_PINS: dict[str, tuple[dict[str, Any], str]] = {
    "ops": ({"xla_gpu_exclude_nondeterministic_ops": True},
            "run time: deterministic scatter, GEMM, convolution and attention kernels (no "
            "atomics); select-and-scatter is refused or rewritten into a scatter"),
    "autotune": ({"xla_gpu_autotune_level": 0},
                 "compile time: no timing-based choice of GEMM configs, convolution algorithms "
                 "or cuDNN plans (XLA's heuristic choice instead)"),
}
AUTOTUNE_MODES = ("off", "cache")
# Per process (XLA_FLAGS, read when the backend starts): CPU ISAs of XLA without FMA.
CPU_ISAS_WITHOUT_FMA = ("SSE4_2", "AVX")
PROCESS_FLAGS: dict[str, tuple[str, ...]] = {"cpu": ("--xla_cpu_max_isa=AVX",),
                                             "gpu": ("NCCL_NVLS_ENABLE=0",)}
_NONDETERMINISTIC = "does not have a deterministic implementation"


def _backend(backend: str | None = None) -> str:
  b = (backend or jax.default_backend()).lower()
  return "gpu" if b in ("gpu", "cuda", "rocm") else b


def gpu_options(autotune: str = "off", autotune_cache_dir: str | None = None) -> dict[str, Any]:
  """The per-executable options reproducible_step pins on GPU."""
  if autotune not in AUTOTUNE_MODES:
    raise errors.ConfigurationError(
        f"autotune={autotune!r}; use 'off' (no autotuning: XLA's heuristic kernels) or 'cache' "
        "(autotune once, store the results in autotune_cache_dir, read them in every later run).")
  if autotune == "cache":
    if not autotune_cache_dir:
      raise errors.ConfigurationError(
          "autotune='cache' needs autotune_cache_dir: a directory every run of the program can "
          "read and the first one writes (e.g. next to the checkpoints).")
    os.makedirs(autotune_cache_dir, exist_ok=True)
    return {**GPU_PINS["ops"][0], "xla_gpu_per_fusion_autotune_cache_dir": autotune_cache_dir}
  if autotune_cache_dir:
    raise errors.ConfigurationError(
        f"autotune_cache_dir={autotune_cache_dir!r} is only read with autotune='cache'.")
  return {**GPU_PINS["ops"][0], **GPU_PINS["autotune"][0]}


def missing_process_flags(backend: str | None = None, xla_flags: str | None = None,
                          environ: dict[str, str] | None = None,
                          num_devices: int | None = None) -> list[str]:
  """The process settings reproducibility needs on ``backend`` that are missing.

  CPU: ``--xla_cpu_max_isa=AVX`` (or SSE4_2) in XLA_FLAGS (default: the environment's). GPU with
  more than one device: ``NCCL_NVLS_ENABLE=0`` in the environment.
  """
  b = _backend(backend)
  env = os.environ if environ is None else environ
  flags = env.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  if b == "cpu":
    isa = re.findall(r"--xla_cpu_max_isa=(\S+)", flags)
    if not isa or isa[-1].upper() not in CPU_ISAS_WITHOUT_FMA:
      return list(PROCESS_FLAGS["cpu"])
  if b == "gpu":
    n = jax.device_count() if num_devices is None else num_devices
    if n > 1 and env.get("NCCL_NVLS_ENABLE") != "0":
      return list(PROCESS_FLAGS["gpu"])
  return []


_TWO_MESHES = "Mesh for all inputs should be equal"


def _explain_compile_error(e: Exception) -> Exception | None:
  text = str(e)
  if _TWO_MESHES in text:
    return errors.MeshError(
        f"the step's arguments live on two meshes (JAX: {text.strip()[:400]!r}); arrays on two "
        "meshes cannot meet in one jit (e.g. arrays placed with Placement(mesh=(2, 4)) outside "
        "jax.set_mesh, which makes dtenjax's own mesh with Auto axes, and arrays on "
        "jax.make_mesh's, Explicit by default). Put them on one: move a placed tree with "
        "dtenjax.shard(tree, mesh) (it keeps every PartitionSpec), or place under "
        "jax.set_mesh(mesh) / with Placement(mesh=mesh) (docs/planner.md, 'Meshes: yours or "
        "dtenjax's').")
  if _NONDETERMINISTIC not in text:
    return None
  op = re.search(r"HLO instruction (\S+)", text)
  return errors.ConfigurationError(
      f"reproducible_step on gpu: XLA has no deterministic GPU implementation of "
      f"{op.group(1) if op else 'an op of this step'} (XLA: {text.strip()[:300]!r}). The usual "
      "one is select-and-scatter, the gradient of max pooling written with "
      "lax.reduce_window(max); write the pooling as a maximum over strided slices (its gradient "
      "is then elementwise; examples/resnet50_train.py --pool slices), or use jax.jit and "
      "accept run-to-run differences.")


def reproducible_step(fn: Callable | None = None, /, *, compiler_options: dict | None = None,
                      check_flags: bool = True, autotune: str = "off",
                      autotune_cache_dir: str | None = None, **jit_kwargs) -> Callable:
  """``jax.jit(fn)`` whose bits are the same in every run (see the module docstring).

  Use it as ``@dtenjax.reproducible_step`` or ``dtenjax.reproducible_step(step,
  donate_argnums=0)``; ``jit_kwargs`` go to ``jax.jit``. Per backend it adds:

  * GPU: ``xla_gpu_exclude_nondeterministic_ops=True`` and, with ``autotune="off"`` (default),
    ``xla_gpu_autotune_level=0``; with ``autotune="cache"`` the autotuner runs once and stores its
    choices in ``autotune_cache_dir`` (``xla_gpu_per_fusion_autotune_cache_dir``), which later
    processes read. Promise: the same program on the same inputs gives the same bits in every
    process, on the same GPU model with the same driver, CUDA libraries and jax. A step XLA
    cannot compile deterministically (select-and-scatter, where XLA refuses it) raises
    ConfigurationError saying what to change. Cost: ``autotune="off"`` costs nothing on GPT-2
    but made ResNet-50 92x slower on an H200 (XLA's untuned convolution algorithms); convolutional
    models want ``autotune="cache"`` (0.88x there). With several devices, ``NCCL_NVLS_ENABLE`` must
    be 0 (dtenjax's default).
  * CPU: ``xla_cpu_enable_fast_math=False``, ``xla_cpu_enable_fast_min_max=False``, and a check,
    on the first call, that the process runs with ``XLA_FLAGS=--xla_cpu_max_isa=AVX`` (no FMA
    contraction). Promise, beyond run to run: the same step with ``fuse_collectives``,
    ``substitute_psum`` or another ``bucket_bytes`` gives identical parameters after many adamw
    steps (tests/test_reproducible.py).

  ``check_flags=False`` skips the process check (the step is then only as reproducible as the
  process makes it). Your own ``compiler_options`` may add options, not contradict the pinned
  ones. Not covered on any backend: different reduction algorithms for the same sum (``lax.psum``
  vs ``one_shot``; use ``reproducible=True`` collectives), different device counts, jax/XLA
  versions, CPU or GPU models. Across device counts the usual trap is a ``jax.vmap`` over a
  device's share of micro-batches: its batch size changes with the device count, and so do the
  kernels XLA compiles for it; loop with ``lax.map`` and sum the stacked gradients with
  ``all_reduce(..., reproducible=True, local_axis=0)`` (docs/reproducibility.md, "Across device
  counts"). The vmap is gone from the jaxpr, so this function cannot detect it.
  """
  if fn is None:
    return functools.partial(reproducible_step, compiler_options=compiler_options,
                             check_flags=check_flags, autotune=autotune,
                             autotune_cache_dir=autotune_cache_dir, **jit_kwargs)
  if not callable(fn):
    raise errors.ConfigurationError(
        f"reproducible_step: fn={fn!r} is not callable; use @dtenjax.reproducible_step or "
        "dtenjax.reproducible_step(step, ...)")
  if compiler_options is not None and not isinstance(compiler_options, dict):
    raise errors.ConfigurationError(
        f"reproducible_step: compiler_options={compiler_options!r} must be a dict of XLA "
        "options, e.g. {'xla_cpu_enable_fast_math': False}")
  user = dict(compiler_options or {})
  gpu_pins = gpu_options(autotune, autotune_cache_dir)      # validates the arguments now
  jitted: dict[str, Callable] = {}

  def compiled(backend: str | None = None) -> Callable:
    b = _backend(backend)
    if b not in jitted:
      pinned = gpu_pins if b == "gpu" else COMPILER_OPTIONS.get(b)
      if pinned is None:
        raise errors.ConfigurationError(
            f"reproducible_step has no pinned option set for backend {b!r} (it knows "
            f"{('cpu', 'gpu')}); use jax.jit and check the bits yourself.")
      if check_flags:
        missing = missing_process_flags(b)
        if missing and b == "cpu":
          raise errors.ConfigurationError(
              f"reproducible_step on {b}: the process runs without {' '.join(missing)} "
              f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}). XLA:CPU contracts a * b + c "
              "into fused multiply-adds differently in differently fused programs, and only a "
              "CPU ISA without FMA, chosen when the backend starts, stops it. Set "
              f"XLA_FLAGS=\"$XLA_FLAGS {' '.join(missing)}\" before JAX starts (before the "
              "first jax call), or pass check_flags=False to accept FMA-dependent bits.")
        if missing:
          raise errors.ConfigurationError(
              f"reproducible_step on {b}: NCCL_NVLS_ENABLE="
              f"{os.environ.get('NCCL_NVLS_ENABLE')!r} with {jax.device_count()} devices. "
              "NVLink SHARP reduces in the switch in no fixed order; set NCCL_NVLS_ENABLE=0 "
              "before the first collective (dtenjax.pin_nccl() does, or DTENJAX_PIN_NCCL=1 at "
              "import), or pass check_flags=False.")
      clash = sorted(k for k in user if k in pinned and user[k] != pinned[k])
      if clash:
        raise errors.ConfigurationError(
            f"reproducible_step: compiler_options {clash} contradict what it pins "
            f"({', '.join(f'{k}={pinned[k]!r}' for k in clash)}); drop them or use jax.jit.")
      jitted[b] = jax.jit(fn, compiler_options={**pinned, **user}, **jit_kwargs)
    return jitted[b]

  def call(*args, **kwargs):
    try:
      return compiled()(*args, **kwargs)
    except errors.DtenjaxError:
      raise
    except Exception as e:  # XLA's compile error, explained
      explained = _explain_compile_error(e)
      if explained is None:
        raise
      raise explained from e

  wrapper = functools.wraps(fn)(call)
  wrapper.lower = lambda *a, **k: compiled().lower(*a, **k)
  wrapper.jitted = compiled
  return wrapper
