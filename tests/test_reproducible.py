"""Tests of dtenjax.reproducible_step: whole-step bit identity across differently fused programs."""

import functools
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src.planning import reproducible

from tests import helpers
from tests.mp_workers import launch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import reproducible_step as bench
from _repro_variants import run_variants


def _cpu_has_fma() -> bool:
  try:
    return " fma " in pathlib.Path("/proc/cpuinfo").read_text().replace("\n", " ")
  except OSError:
    return False


def test_process_flags_are_read_from_xla_flags():
  miss = reproducible.missing_process_flags
  assert miss("cpu", "") == ["--xla_cpu_max_isa=AVX"]
  assert miss("cpu", "--xla_force_host_platform_device_count=8") == ["--xla_cpu_max_isa=AVX"]
  assert miss("cpu", "--xla_cpu_max_isa=AVX") == []
  assert miss("cpu", "--xla_cpu_max_isa=sse4_2") == []
  assert miss("cpu", "--xla_cpu_max_isa=AVX2") == ["--xla_cpu_max_isa=AVX"]      # has FMA
  assert miss("cpu", "--xla_cpu_max_isa=AVX --xla_cpu_max_isa=AVX512") != []    # last wins
  # GPU: nothing per process on one device; NVLS off with several (collectives)
  assert miss("gpu", "", environ={}, num_devices=1) == []
  assert miss("gpu", "", environ={}, num_devices=2) == ["NCCL_NVLS_ENABLE=0"]
  assert miss("gpu", "", environ={"NCCL_NVLS_ENABLE": "1"}, num_devices=8) == [
      "NCCL_NVLS_ENABLE=0"]
  assert miss("gpu", "", environ={"NCCL_NVLS_ENABLE": "0"}, num_devices=8) == []


def test_gpu_pins_are_the_documented_ones_and_arguments_are_checked(tmp_path):
  assert reproducible.gpu_options() == {"xla_gpu_exclude_nondeterministic_ops": True,
                                        "xla_gpu_autotune_level": 0}
  cache = str(tmp_path / "tune")
  assert reproducible.gpu_options("cache", cache) == {
      "xla_gpu_exclude_nondeterministic_ops": True,
      "xla_gpu_per_fusion_autotune_cache_dir": cache}
  with pytest.raises(dtenjax.ConfigurationError, match="autotune='sometimes'"):
    dtenjax.reproducible_step(lambda x: x, autotune="sometimes")
  with pytest.raises(dtenjax.ConfigurationError, match="needs autotune_cache_dir"):
    dtenjax.reproducible_step(lambda x: x, autotune="cache")
  with pytest.raises(dtenjax.ConfigurationError, match="only read with autotune='cache'"):
    dtenjax.reproducible_step(lambda x: x, autotune_cache_dir=cache)
  # every pinned key is an XLA option this jaxlib accepts (CPU compiles and ignores GPU ones)
  for opts in (reproducible.gpu_options(), reproducible.gpu_options("cache", cache)):
    jax.jit(lambda x: x + 1, compiler_options=opts).lower(jnp.ones(2)).compile()


def test_xlas_no_deterministic_implementation_error_is_explained():
  # XLA's message (IrEmitterUnnested::AssertNonDeterminismIsOkay) for select-and-scatter
  xla = RuntimeError("UNIMPLEMENTED: HLO instruction select-and-scatter.3 does not have a "
                     "deterministic implementation, but run-to-run determinism is required.")
  e = reproducible._explain_compile_error(xla)
  assert isinstance(e, dtenjax.ConfigurationError)
  assert "select-and-scatter.3" in str(e) and "--pool slices" in str(e)
  assert reproducible._explain_compile_error(RuntimeError("out of memory")) is None


def test_arrays_of_two_meshes_meeting_in_the_step_name_the_fix():
  """The user's real case: parameters placed on dtenjax's own mesh (Placement(mesh=(2, 4))
  outside jax.set_mesh, Auto axes) and a batch on jax.make_mesh's (Explicit axes) meet in the
  step; JAX's "Mesh for all inputs should be equal" becomes a MeshError naming the fix."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  placement = dtenjax.Placement(P("data", "model"), mesh=(2, 4), axis_names=("data", "model"))
  w = dtenjax.shard(jnp.ones((8, 16)), placement)
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", "model")))
  step = dtenjax.reproducible_step(lambda w, x: w + x, check_flags=False)
  with pytest.raises(dtenjax.MeshError, match=r"two meshes.*dtenjax.shard\(tree, mesh\)"):
    step(w, x)
  np.testing.assert_array_equal(step(dtenjax.shard(w, mesh), x), 2 * np.ones((8, 16)))


def test_refuses_to_run_without_the_process_flag():
  # The test process runs without --xla_cpu_max_isa (conftest sets only the device count).
  assert reproducible.missing_process_flags("cpu")
  step = dtenjax.reproducible_step(lambda x: x * 2 + 1)
  with pytest.raises(dtenjax.ConfigurationError) as e:
    step(jnp.ones(4))
  msg = str(e.value)
  assert "--xla_cpu_max_isa=AVX" in msg and "XLA_FLAGS" in msg and "check_flags=False" in msg


def test_jits_with_the_pinned_options_and_checks_user_options():
  @dtenjax.reproducible_step(check_flags=False, static_argnums=1)
  def f(x, n):
    return x * n + 1.0
  np.testing.assert_array_equal(f(jnp.arange(4.0), 3), np.arange(4.0) * 3 + 1)
  text = f.lower(jnp.arange(4.0), 3).as_text()
  assert "x" in text                       # lowered through jax.jit with its kwargs
  clash = dtenjax.reproducible_step(lambda x: x, check_flags=False,
                                    compiler_options={"xla_cpu_enable_fast_math": True})
  with pytest.raises(dtenjax.ConfigurationError, match="xla_cpu_enable_fast_math"):
    clash(jnp.ones(2))
  with pytest.raises(dtenjax.ConfigurationError, match="no pinned option set for backend 'tpu'"):
    dtenjax.reproducible_step(lambda x: x).jitted("tpu")


@pytest.mark.slow
def test_fused_and_unfused_steps_agree_bit_for_bit_with_it(monkeypatch, tmp_path):
  """The same adamw step around substitute_psum and fuse_collectives(64 KiB): identical
  parameters after 5 steps under reproducible_step (its process flag set); without it they
  differ (measured: 1067 of 26,378 parameters, bench/reproducible_step.py) on a CPU with FMA.
  Both runs trace the collectives' sums as XLA operations (DTENJAX_CPU_FFI=0, as on a GPU or
  without the extension): on XLA:CPU the custom calls sum outside XLA's fusions, so plain
  jax.jit's fused and unfused steps then agree (0 differences in every variant) and would show
  nothing about the pins. Both compile with XLA's default fusion emitters: with the suite's
  (tests/conftest.py) plain jax.jit's variants agree too (0 differences, measured 2026-12-06)."""
  monkeypatch.setenv("DTENJAX_CPU_FFI", "0")      # read at trace time, here and in the fork
  variants = ("subst one_shot", "fuse 64KiB", "subst two_shot")
  fma = _cpu_has_fma()
  # The pinned run needs a process of its own (--xla_cpu_max_isa=AVX is read when XLA starts):
  # forked from one of the session's servers (imported jax and dtenjax, started no backend, so
  # it reads its own XLA_FLAGS), one busy process at a time, so this test stays out of the
  # "procs" group (tests/procs.py).
  path = launch.pythonpath()
  with launch.one_server(dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path), tmp_path) as server:
    pinned = bench.run_mode("reproducible_step", 5, variants, run=lambda argv, env, timeout:
                            server.run(argv, env=dict(env, PYTHONPATH=path), timeout=timeout))
  assert pinned["xla_flags"].endswith("--xla_cpu_max_isa=AVX")
  for v in variants:
    assert pinned["diffs"][v] == {"1": 0, "5": 0}, (v, pinned["diffs"])
  if not fma:
    pytest.skip("this CPU has no FMA, so plain jax.jit cannot show the difference")
  # Plain jax.jit needs no process flag: it runs here, on this process's 8 CPU devices, each
  # step with XLA's default emitters as its own compiler option (bench.run_mode("jax.jit") in a
  # process of its own took 2-3 s of CPU more, most of it importing and starting XLA); the same
  # 591 differing parameters after 5 steps either way (2026-12-06).
  plain = run_variants(functools.partial(jax.jit, compiler_options=helpers.DEFAULT_CPU_EMITTERS),
                       5, variants)
  # Which variant XLA contracts differently depends on its fusions (the buckets' copies out at
  # run-time offsets, base.opaque, changed the 64 KiB one's): at least one differs.
  assert any(plain["diffs"][v]["5"] > 0 for v in variants), plain["diffs"]


@pytest.mark.gpu
def test_gpu_pins_leave_no_nondeterministic_select_and_scatter():
  """Max pooling's gradient is a select-and-scatter, which XLA:GPU has run with atomics. Under the
  pins XLA either refuses to compile it (documented for XLA; reproducible_step must then raise
  ConfigurationError naming the fix) or rewrites it (jax 0.11.2 on an H200: a scatter fusion,
  which the pins make deterministic): then no select-and-scatter instruction is left and
  repeated runs give the same bits."""
  def pooled_grad(x):
    pool = lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                           "SAME")
    return jax.grad(lambda v: pool(v).sum())(x)
  x = jax.random.normal(jax.random.key(0), (2, 16, 16, 4))
  step = dtenjax.reproducible_step(pooled_grad)
  try:
    first = np.asarray(step(x))
  except dtenjax.ConfigurationError as e:
    assert "strided slices" in str(e), e
    return
  pins = reproducible.gpu_options("off", None)
  pinned = jax.jit(pooled_grad, compiler_options=pins).lower(x).compile().as_text()
  assert " select-and-scatter(" not in pinned, pinned
  for _ in range(3):
    assert np.asarray(step(x)).tobytes() == first.tobytes()


@pytest.mark.gpu
def test_gpu_fused_and_unfused_steps_still_differ_under_the_pins():
  """What reproducible_step does not promise on GPU: measured on an H200 (jax 0.11.2) with
  deterministic ops pinned, the same adamw step around fuse_collectives and substitute_psum
  differed in 53 and 163 of 26,378 parameters after 1 and 5 steps (NVPTX contracts FMAs per
  fusion). If XLA ever makes them agree, this fails: promise it then (docs/reproducibility.md)."""
  devices = jax.devices("gpu")
  loose = functools.partial(dtenjax.reproducible_step, check_flags=False)
  out = bench.run_variants(loose, 5, ("subst one_shot", "fuse 64KiB"), devices=devices)
  print(out["diffs"])
  assert out["diffs"]["fuse 64KiB"]["5"] > 0, out
