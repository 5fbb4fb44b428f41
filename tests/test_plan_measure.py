"""dtenjax.plan(..., measure=True): the model's choice and the recipes that fit are compiled and
run on the devices, and the fastest is kept (dtenjax/_src/planning/measure.py)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import measure

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _step_models as models


def test_the_kept_layout_is_the_fastest_candidate_measured():
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  # Concrete arguments, which each candidate's timing places in its layout with device_put: from
  # abstract ones it compiles a jitted draw per leaf and layout (16 of this test's 21 programs,
  # about half its CPU); that path is test_abstract_arguments_are_made_in_their_layout's.
  rng = np.random.default_rng(0)
  args = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
                      if jnp.issubdtype(s.dtype, jnp.floating) else np.zeros(s.shape, s.dtype),
                      abstract)
  model_only = dtenjax.plan(step, *args)
  got = dtenjax.plan(step, *args, measure=2)
  names = [n for n, _ in got.measured]
  assert "model's choice" in names
  times = dict(got.measured)
  assert all(np.isfinite(t) and t > 0 for t in times.values())
  kept = min(times, key=times.get)
  assert names[0] == kept                       # fastest first
  # the returned plan is the candidate that ran fastest: the model's choice, or that layout
  island = min(len(i) for i in dtenjax.Topology.current().fast_islands())
  layouts = {measure.layout_name(r, m): (r, m) for r, m in measure.user_layouts(8, island)}
  assert set(names) - {"model's choice"} <= set(layouts)
  if kept == "model's choice":
    expected = model_only
  else:
    expected = dtenjax.plan(step, *args, recipe=layouts[kept][0], mesh=layouts[kept][1])
  assert measure.same_layout(got, expected)
  assert any("measured on" in n and f"kept {kept}" in n for n in got.notes)
  # the measured plan still runs as a plan
  out = got.jit(step)(*measure.placed_arguments(args, got.shardings()))
  assert np.isfinite(float(out[2]))


def test_abstract_arguments_are_made_in_their_layout():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  args = ({"w": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)},
          jax.ShapeDtypeStruct((8, 4), jnp.int32),
          jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype))
  shardings = ({"w": NamedSharding(mesh, P("fsdp"))}, NamedSharding(mesh, P("data")),
               NamedSharding(mesh, P()))
  w, tokens, keys = measure.placed_arguments(args, shardings)
  assert w["w"].dtype == jnp.bfloat16 and w["w"].sharding == shardings[0]["w"]
  assert float(jnp.std(w["w"].astype(jnp.float32))) > 0      # not zeros: real arithmetic
  assert tokens.dtype == jnp.int32 and tokens.sharding == shardings[1]
  assert keys.shape == (4,) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
  # a second call (the timing's second pass, or another candidate with these layouts) reuses
  # the programs that made the leaves: no compile per leaf and call
  hits = measure._maker.cache_info().hits
  again = measure.placed_arguments(args, shardings)
  assert measure._maker.cache_info().hits == hits + 3
  np.testing.assert_array_equal(np.asarray(again[0]["w"], np.float32),
                                np.asarray(w["w"], np.float32))
  concrete = measure.placed_arguments((jnp.arange(8.0),), (NamedSharding(mesh, P("data")),))
  np.testing.assert_array_equal(np.asarray(concrete[0]), np.arange(8.0))


def test_a_measure_of_fewer_than_two_runs_is_refused():
  step, args = models.mlp_step(d=64, f=256, layers=1, batch=16, seq=8)
  with pytest.raises(dtenjax.PlacementError, match="measure=1"):
    dtenjax.plan(step, *args, measure=1)
