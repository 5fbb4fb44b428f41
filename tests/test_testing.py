"""Tests of dtenjax.testing: each assertion passes on a constructed match and fails, naming the
mismatch, on a constructed miss. Expected values are written by hand, not computed with dtenjax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax import testing as dt_testing
from dtenjax._src.planning import planner


def test_reachable_as_an_attribute():
  assert dtenjax.testing is dt_testing


def test_assert_placement_passes_and_lists_all_mismatches(cpu_devices):
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), ("x", "y"))
  x = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("y", None)))
  dt_testing.assert_placement(x, P("y", None), mesh_shape={"x": 2, "y": 4},
                              memory_kind="device")
  dt_testing.assert_placement(x, P("y"))                 # trailing None is the same spec
  dt_testing.assert_placement(x, P(("y",), None))        # a one-axis tuple too
  with pytest.raises(AssertionError) as e:
    dt_testing.assert_placement(x, P("x", "y"), mesh_shape={"x": 4, "y": 2},
                                memory_kind="pinned_host")
  msg = str(e.value)
  assert "spec is P('y', None), expected P('x', 'y')" in msg
  assert "mesh is {'x': 2, 'y': 4}, expected {'x': 4, 'y': 2}" in msg
  assert "memory kind is 'device', expected 'pinned_host'" in msg
  with pytest.raises(AssertionError, match="expected a NamedSharding"):
    dt_testing.assert_placement(np.ones(3), P())


def test_assert_bitwise_equal_reports_first_difference():
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  dt_testing.assert_bitwise_equal({"a": a}, {"a": a.copy()})
  b = a.copy()
  b[1, 2] = np.nextafter(b[1, 2], np.float32(100))
  with pytest.raises(AssertionError, match=r"\['a'\]: 1 of 12 elements differ; first at index "
                     r"\(1, 2\): actual 6.0 vs expected 6.0000005"):
    dt_testing.assert_bitwise_equal({"a": a}, {"a": b})
  # -0.0 == 0.0 numerically but not bitwise
  with pytest.raises(AssertionError, match="1 of 1 elements differ"):
    dt_testing.assert_bitwise_equal(np.float32([0.0]), np.float32([-0.0]))
  nan = np.float32([np.nan])
  dt_testing.assert_bitwise_equal(nan, nan.copy())
  with pytest.raises(AssertionError, match="shape/dtype"):
    dt_testing.assert_bitwise_equal(np.zeros(2, np.float32), np.zeros(2, np.float64))


def _plan(strategy):
  cand = planner.CandidateCost(strategy, P("y", None), 1e-3, 1e-4, 9e-4, 1024.0, True)
  return planner.ArrayPlan((8, 8), "float32", strategy, P("y", None), (cand,), "constructed")


def test_assert_plan_strategy_on_a_constructed_plan():
  dt_testing.assert_plan_strategy(_plan("row"), "row")
  with pytest.raises(AssertionError, match="planner picked 'row' for \\(8, 8\\), expected '2d'"):
    dt_testing.assert_plan_strategy(_plan("row"), "2d")


def test_assert_plan_strategy_on_the_seed_table(cpu_devices):
  del cpu_devices
  # The seed's reference table: one 8 x A100 NVLink node lays a 4096 x 4096 weight out 2D (2 x 4).
  topo = dtenjax.Topology.fixture("dgx_a100_8")
  placement = dtenjax.Placement("auto", mesh=(2, 4), topology=topo)
  dt_testing.assert_plan_strategy(placement, "2d", (4096, 4096), jnp.bfloat16)
  with pytest.raises(AssertionError, match="expected 'row'"):
    dt_testing.assert_plan_strategy(placement, "row", (4096, 4096), jnp.bfloat16)
  with pytest.raises(ValueError, match="needs shape="):
    dt_testing.assert_plan_strategy(placement, "2d")
