"""Tests of dtenjax._src.planning.costmodel: formulas against hand-computed values, island splits,
crossover thresholds derived from the model."""

import math

import pytest

from dtenjax._src.planning import costmodel as cm
from dtenjax._src import errors
from dtenjax._src.topology.model import LinkSpec, Topology

DGX = Topology.fixture("dgx_a100_8")
ROCE = Topology.fixture("roce_a100_4x8")
PCIE = Topology.fixture("pcie_8")
N = 1_000_000
# Table values the hand computations below use (asserted so a change is noticed here).
NV_A, NV_BW = 2.5e-6, 300e9
ROCE_A, ROCE_BW = 5e-6, 12.5e9
LOCAL_BW = 2000e9


def test_table_values_used_below():
  assert DGX.spec("nvlink") == LinkSpec(NV_BW / 1e9, NV_A * 1e6)
  assert ROCE.spec("roce") == LinkSpec(ROCE_BW / 1e9, ROCE_A * 1e6)
  assert DGX.spec("local").bandwidth_gbps * 1e9 == LOCAL_BW


def test_ring_all_reduce_on_nvlink():
  g = list(range(8))
  want = 2 * (7 * NV_A + 7 / 8 * N / NV_BW)
  assert cm.collective_time("all_reduce", N, g, DGX, "ring") == pytest.approx(want, rel=1e-12)
  assert cm.collective_time("reduce_scatter", N, g, DGX, "ring") == pytest.approx(want / 2)
  assert cm.collective_time("all_gather", N, g, DGX, "ring") == pytest.approx(want / 2)


def test_one_and_two_shot_inside_a_host():
  g = list(range(8))
  one = 2 * NV_A + 7 * N / NV_BW + 8 * N / LOCAL_BW
  two = 4 * NV_A + 2 * 7 / 8 * N / NV_BW + N / LOCAL_BW
  assert cm.collective_time("all_reduce", N, g, DGX, "one_shot") == pytest.approx(one)
  assert cm.collective_time("all_reduce", N, g, DGX, "two_shot") == pytest.approx(two)


def test_one_shot_across_hosts_pays_latency_per_peer():
  g = [0, 8, 16, 24]
  one = 2 * 3 * ROCE_A + 3 * N / ROCE_BW + 4 * N / LOCAL_BW
  assert cm.collective_time("all_reduce", N, g, ROCE, "one_shot") == pytest.approx(one)


def test_ring_over_roce_bottleneck():
  g = list(range(32))
  want = 2 * (31 * ROCE_A + 31 / 32 * N / ROCE_BW)
  assert cm.collective_time("all_reduce", N, g, ROCE, "ring") == pytest.approx(want)


def test_hierarchical_all_reduce_and_gather():
  g = list(range(32))
  k, m = 8, 4
  inner_rs = (k - 1) * NV_A + (k - 1) / k * N / NV_BW
  cross = 2 * ((m - 1) * ROCE_A + (m - 1) / m * (N / k) / ROCE_BW)
  assert cm.collective_time("all_reduce", N, g, ROCE, "hierarchical") == pytest.approx(
      2 * inner_rs + cross)
  ag = inner_rs + (m - 1) * ROCE_A + (m - 1) / m * (N / k) / ROCE_BW
  assert cm.collective_time("all_gather", N, g, ROCE, "hierarchical") == pytest.approx(ag)
  # The two-level split is the point: it beats a flat ring over the slow links.
  assert (cm.collective_time("all_reduce", N, g, ROCE, "hierarchical") <
          cm.collective_time("all_reduce", N, g, ROCE, "ring"))


def test_hierarchical_needs_a_proper_island_split():
  assert cm.island_groups(list(range(32)), ROCE) == tuple(
      tuple(range(h * 8, h * 8 + 8)) for h in range(4))
  assert cm.island_groups([0, 1, 8, 9], ROCE) == ((0, 1), (8, 9))
  assert cm.island_groups(list(range(8)), DGX) is None          # one island
  assert cm.island_groups([0, 1, 8], ROCE) is None               # unequal islands
  assert cm.island_groups([0, 8, 16], ROCE) is None              # islands of one device
  assert cm.island_groups(list(range(8)), PCIE) == ((0, 1, 2, 3), (4, 5, 6, 7))
  for topo, g in ((DGX, range(8)), (ROCE, [0, 1, 8]), (ROCE, range(8))):
    assert cm.collective_time("all_reduce", N, list(g), topo, "hierarchical") == math.inf
    assert "hierarchical" not in dict(cm.rank_algorithms("all_reduce", N, list(g), topo))


def test_xla_is_the_best_of_ring_and_hierarchical():
  g = list(range(32))
  xla = cm.collective_time("all_reduce", N, g, ROCE, "xla")
  assert xla == min(cm.collective_time("all_reduce", N, g, ROCE, a)
                    for a in ("ring", "hierarchical"))


def test_trivial_groups_and_ppermute():
  assert cm.collective_time("all_reduce", N, [3], DGX, "ring") == 0.0
  assert cm.collective_time("all_reduce", N, [], DGX, "xla") == 0.0
  assert cm.collective_time("ppermute", N, [0, 8], ROCE) == pytest.approx(ROCE_A + N / ROCE_BW)


def test_rank_algorithms_sorted_and_ties_by_name():
  ranked = cm.rank_algorithms("all_reduce", N, list(range(8)), DGX)
  times = [t for _, t in ranked]
  assert times == sorted(times)
  assert {a for a, _ in ranked} == {"xla", "ring", "one_shot", "two_shot"}
  # ring and xla cost the same here (xla = min(ring, -)), so the name decides.
  tied = cm.rank_algorithms("all_reduce", 64, list(range(32)), ROCE, ["xla", "ring"])
  if tied[0][1] == tied[1][1]:
    assert [a for a, _ in tied] == ["ring", "xla"]
  zero = cm.rank_algorithms("all_reduce", N, [0], DGX, ["xla", "ring"])
  assert zero == [("ring", 0.0), ("xla", 0.0)]


def test_crossover_comes_from_the_model():
  g = list(range(8))
  # one_shot - two_shot = -2a + N (5.25 / bw + 7 / bw_local): two-shot wins above
  slope = 5.25 / NV_BW + 7 / LOCAL_BW
  want = math.floor(2 * NV_A / slope) + 1
  got = cm.crossover_bytes("one_shot", "two_shot", g, DGX)
  assert got == want
  assert (cm.collective_time("all_reduce", got, g, DGX, "two_shot") <
          cm.collective_time("all_reduce", got, g, DGX, "one_shot"))
  assert (cm.collective_time("all_reduce", got - 1, g, DGX, "two_shot") >=
          cm.collective_time("all_reduce", got - 1, g, DGX, "one_shot"))
  # Slower link latency moves the threshold up; it is not a constant.
  slow = DGX.with_links({"nvlink": LinkSpec(300.0, 5.0)})
  assert cm.crossover_bytes("one_shot", "two_shot", g, slow) == math.floor(
      2 * 5e-6 / slope) + 1
  faster_bw = DGX.with_links({"nvlink": LinkSpec(600.0, 2.5)})
  assert cm.crossover_bytes("one_shot", "two_shot", g, faster_bw) > got
  # Never: one-shot never beats two-shot for big messages, and a winner at 0 bytes is 0.
  assert cm.crossover_bytes("two_shot", "one_shot", g, DGX) is None
  assert cm.crossover_bytes("ring", "two_shot", g, DGX, hi=1000) == 0


def test_errors():
  with pytest.raises(errors.CollectiveError, match="unknown collective kind 'allreduce'"):
    cm.collective_time("allreduce", N, [0, 1], DGX)
  with pytest.raises(errors.CollectiveError, match="unknown algorithm 'tree'"):
    cm.collective_time("all_reduce", N, [0, 1], DGX, "tree")
  with pytest.raises(errors.CollectiveError, match="nbytes=-1"):
    cm.collective_time("all_reduce", -1, [0, 1], DGX)
