"""Tests of dtenjax.reproducible_step: whole-step bit identity across differently fused programs."""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src.planning import reproducible

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import reproducible_step as bench  # noqa: E402  pylint: disable=g-import-not-at-top


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
  assert miss("gpu", "") == []


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


def test_fused_and_unfused_steps_agree_bit_for_bit_with_it():
  """The same adamw step around substitute_psum and fuse_collectives(64 KiB): identical
  parameters after 5 steps under reproducible_step (its process flag set); without it they
  differ (measured: 1067 of 26,378 parameters, bench/reproducible_step.py) on a CPU with FMA."""
  variants = ("subst one_shot", "fuse 64KiB", "subst two_shot")
  pinned = bench.run_mode("reproducible_step", 5, variants)
  assert pinned["xla_flags"].endswith("--xla_cpu_max_isa=AVX")
  for v in variants:
    assert pinned["diffs"][v] == {"1": 0, "5": 0}, (v, pinned["diffs"])
  if not _cpu_has_fma():
    pytest.skip("this CPU has no FMA, so plain jax.jit cannot show the difference")
  plain = bench.run_mode("jax.jit", 5, variants)
  assert plain["diffs"]["fuse 64KiB"]["5"] > 0, plain["diffs"]
  assert plain["diffs"]["subst two_shot"]["5"] > 0, plain["diffs"]


@pytest.mark.gpu
def test_on_gpu_it_refuses_because_fusion_still_changes_bits():
  """Measured on an H200 (jax 0.11.2): with deterministic ops and IEEE min/max pinned, fused and
  unfused steps still differ (53 and 163 of 26,378 parameters after 1 and 5 steps), so
  reproducible_step refuses on GPU. If XLA ever makes them agree, this test fails and the
  refusal should go."""
  devices = jax.devices("gpu")
  step = dtenjax.reproducible_step(lambda v: v * 2.0)
  with pytest.raises(dtenjax.ConfigurationError, match="no XLA option is known"):
    step(jax.numpy.ones(3))
  loose = functools.partial(dtenjax.reproducible_step, check_flags=False)
  out = bench.run_variants(loose, 5, ("subst one_shot", "fuse 64KiB"), devices=devices)
  assert out["diffs"]["fuse 64KiB"]["5"] > 0, out
