import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax import testing as dt_testing


def test_assert_placement_passes_and_lists_all_mismatches(cpu_devices):
  del cpu_devices
  pl = dtenjax.Placement("row", mesh=(2, 4))
  x = dtenjax.shard(jnp.ones((16, 4)), pl)
  dt_testing.assert_placement(x, P("y", None), mesh_shape={"x": 2, "y": 4},
                              memory_kind="device")
  with pytest.raises(AssertionError) as e:
    dt_testing.assert_placement(x, P("x", "y"), mesh_shape={"x": 4, "y": 2},
                                memory_kind="pinned_host")
  msg = str(e.value)
  assert "spec is" in msg and "mesh is" in msg and "memory kind" in msg


def test_assert_bitwise_equal_reports_first_difference():
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  dt_testing.assert_bitwise_equal({"a": a}, {"a": a.copy()})
  b = a.copy()
  b[1, 2] = np.nextafter(b[1, 2], np.float32(100))
  with pytest.raises(AssertionError, match=r"1 of 12 elements differ; first at index \(1, 2\)"):
    dt_testing.assert_bitwise_equal({"a": a}, {"a": b})
  # -0.0 == 0.0 numerically but not bitwise
  with pytest.raises(AssertionError):
    dt_testing.assert_bitwise_equal(np.float32([0.0]), np.float32([-0.0]))
  nan = np.float32([np.nan])
  dt_testing.assert_bitwise_equal(nan, nan.copy())


def test_assert_plan_strategy():
  topo = dtenjax.Topology.fixture("dgx_a100_8")
  plan = dtenjax.Placement("auto", mesh=(2, 4), topology=topo).plan((4096, 4096), jnp.bfloat16)
  dt_testing.assert_plan_strategy(plan, plan.strategy)
  other = next(s for s in ("2d", "row", "col", "replicate") if s != plan.strategy)
  with pytest.raises(AssertionError, match="planner picked"):
    dt_testing.assert_plan_strategy(plan, other)
