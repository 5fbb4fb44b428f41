"""Tests of dtenjax._src.planning.planner: the seed's reference table, tie-breaks, infeasible candidates,
the explain table."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dtenjax._src.planning import costmodel
from dtenjax._src import errors
from dtenjax._src.planning import planner
from dtenjax._src.planning.planner import Workload
from dtenjax._src.topology.model import Topology

DGX = Topology.fixture("dgx_a100_8")
ROCE = Topology.fixture("roce_a100_4x8")


def _plan(t, shape, mesh_shape, names, dtype="bfloat16", workload=Workload()):
  ids = np.array(sorted(t.device_ids, key=t.hierarchy_key)).reshape(mesh_shape)
  return planner.plan_tensor(shape, dtype, mesh_shape, names, ids, t, workload)


def _cand(plan, strategy):
  return next(c for c in plan.candidates if c.strategy == strategy)


def test_seed_table_dgx_a100_goes_2d():
  p = _plan(DGX, (4096, 4096), (2, 4), ("x", "y"))
  assert p.strategy == "2d" and p.spec == P("x", "y")
  # every collective of the 2d plan stays inside the node, on NVLink
  assert DGX.slowest_link(list(range(8)))[0] == "nvlink"
  assert _cand(p, "2d").memory_bytes == 4096 * 4096 * 2 * 4 / 8
  assert all(c.feasible for c in p.candidates)


def test_seed_table_roce_goes_row_with_cross_host_gradient_allreduce():
  w = Workload()
  p = _plan(ROCE, (4096, 4096), (4, 8), ("host", "gpu"), workload=w)
  assert p.strategy == "row" and p.spec == P("gpu", None)
  row = _cand(p, "row")
  assert "all-reduced across 'host'" in row.note
  # The row estimate is: activation all-reduce inside a node + the exposed part of the gradient
  # all-reduce of the row shard across the 4 hosts (one device per host, over RoCE).
  inner, outer = list(range(8)), [0, 8, 16, 24]
  assert ROCE.slowest_link(inner)[0] == "nvlink" and ROCE.slowest_link(outer)[0] == "roce"

  def ar(nb, g):
    return costmodel.rank_algorithms("all_reduce", nb, g, ROCE, planner._AR_CANDIDATES)[0][1]

  act = (4096 // 4) * 4096 * 2
  grad = 4096 * 4096 * 2 // 8
  assert row.comm_s == pytest.approx(ar(act, inner) + (1 - w.grad_overlap) * ar(grad, outer))
  # 2d would put an activation all-reduce on the RoCE axis every micro-batch: slower.
  assert _cand(p, "2d").time_s > row.time_s * (1 + w.time_tolerance)


def test_micro_batches_accumulate_gradients_once():
  one = _cand(_plan(ROCE, (4096, 4096), (4, 8), ("host", "gpu")), "row")
  four = _cand(_plan(ROCE, (4096, 4096), (4, 8), ("host", "gpu"),
                     workload=Workload(microbatches=4)), "row")
  assert "4 micro-batch(es)" in four.note
  assert four.comm_s > one.comm_s  # four activation all-reduces, still one gradient all-reduce


def test_ties_broken_deterministically():
  # Square weight: row and col cost exactly the same; the fixed order picks row.
  p = _plan(ROCE, (4096, 4096), (4, 8), ("host", "gpu"), workload=Workload(time_tolerance=0))
  assert _cand(p, "row").time_s == _cand(p, "col").time_s
  assert p.strategy == "row"
  again = _plan(ROCE, (4096, 4096), (4, 8), ("host", "gpu"), workload=Workload(time_tolerance=0))
  assert again == p
  # Without tolerance the fastest wins outright; with it, least memory among the near-fastest.
  assert _plan(DGX, (4096, 4096), (2, 4), ("x", "y"),
               workload=Workload(time_tolerance=0)).strategy == _fastest(DGX)
  assert "within 20% of the fastest" in _plan(DGX, (4096, 4096), (2, 4), ("x", "y")).reason


def _fastest(t):
  p = _plan(t, (4096, 4096), (2, 4), ("x", "y"))
  return min(p.candidates, key=lambda c: (c.time_s, planner.STRATEGIES.index(c.strategy))
             ).strategy


def test_infeasible_candidates_reported_with_reasons():
  p = _plan(DGX, (4093, 4096), (2, 4), ("x", "y"))
  row, d2 = _cand(p, "row"), _cand(p, "2d")
  assert not row.feasible and "rows (4093) not divisible by axis 'y' (4)" in row.note
  assert not d2.feasible and "(4093, 4096) not divisible by mesh (2, 4)" in d2.note
  assert p.strategy in ("col", "replicate") and _cand(p, p.strategy).feasible
  table = p.table()
  assert "rows (4093) not divisible" in table


def test_memory_limit_makes_candidates_infeasible():
  p = _plan(DGX, (1 << 17, 1 << 17), (2, 4), ("x", "y"))    # 32 GiB bf16, x4 state = 128 GiB
  rep = _cand(p, "replicate")
  assert not rep.feasible and "needs 128.0 GiB per device, has 80.0" in rep.note
  assert p.strategy != "replicate"


def test_nothing_fits_falls_back_to_replicate_and_says_why():
  p = _plan(DGX, (1 << 19, 1 << 19 | 1), (2, 4), ("x", "y"))
  assert not any(c.feasible for c in p.candidates)
  assert p.strategy == "replicate" and p.spec == P()
  assert p.reason.startswith("no candidate fits: needs")


def test_explain_table_lists_all_candidates():
  p = _plan(DGX, (4096, 4096), (2, 4), ("x", "y"))
  lines = p.table().splitlines()
  assert lines[0].split()[:2] == ["strategy", "spec"]
  body = lines[1:-1]
  assert [ln[1:].split()[0] for ln in body] == ["2d", "row", "col", "replicate"]
  assert [ln for ln in body if ln.startswith("*")] == [body[0]]
  assert lines[-1].startswith("=> 2d: ")


def test_shapes_and_meshes():
  one_d = _plan(DGX, (4096, 4096), (8,), ("x",))
  assert [c.strategy for c in one_d.candidates] == ["row", "col", "replicate"]
  vec = _plan(DGX, (4096,), (2, 4), ("x", "y"))
  assert {c.strategy for c in vec.candidates} == {"row", "replicate"}
  assert _cand(vec, "row").spec == P("y")
  scalar = _plan(DGX, (), (2, 4), ("x", "y"))
  assert scalar.strategy == "replicate" and len(scalar.candidates) == 1
  stacked = _plan(DGX, (3, 4096, 4096), (2, 4), ("x", "y"))
  assert stacked.spec in (P(None, "x", "y"), P(None, "y", None), P(None, None, "y"), P())
  with pytest.raises(errors.PlacementError, match="1D and 2D meshes"):
    planner.plan_tensor((8, 8), "float32", (2, 2, 2), ("a", "b", "c"), np.arange(8), DGX)


def test_workload_validation_lists_all():
  with pytest.raises(errors.ConfigurationError) as e:
    Workload(tokens=0, microbatches=0, grad_overlap=2.0, state_factor=0, time_tolerance=-1)
  msg = str(e.value)
  for part in ("tokens=0", "microbatches=0", "grad_overlap=2.0", "state_factor=0",
               "time_tolerance=-1"):
    assert part in msg
