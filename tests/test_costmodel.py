"""Tests of dtenjax._src.planning.costmodel: formulas against hand-computed values (written out
here from the documented formulas and the table values), backend costs as data, island splits,
crossover thresholds derived from the model."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from dtenjax._src import contract
from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src.collectives import api as C
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.planning import costmodel as cm
from dtenjax._src.topology.model import LinkSpec, Topology

DGX = Topology.fixture("dgx_a100_8")
ROCE = Topology.fixture("roce_a100_4x8")
PCIE = Topology.fixture("pcie_8")
N = 1_000_000
# Table values the hand computations below use (asserted so a change is noticed here).
NV_A, NV_BW = 2.5e-6, 300e9
ROCE_A, ROCE_BW = 5e-6, 12.5e9
LOCAL_BW = 2000e9
GPU = cm.BackendCosts(xla_collective_us=18.0, local_pass_us=4.0, local_bandwidth_gbps=None,
                      nvlink_kernel_us=6.0, host_step_us=40.0, fixed_point_gbps=500.0)
L, P, K, S, F = 18e-6, 4e-6, 6e-6, 40e-6, 1 / 500e9
M = 1 / LOCAL_BW


def test_table_values_used_below():
  assert DGX.spec("nvlink") == LinkSpec(NV_BW / 1e9, NV_A * 1e6)
  assert ROCE.spec("roce") == LinkSpec(ROCE_BW / 1e9, ROCE_A * 1e6)
  assert DGX.spec("local").bandwidth_gbps * 1e9 == LOCAL_BW
  assert cm.BACKEND_COSTS["gpu"] == GPU
  assert DGX.device(0).platform == "gpu"


def _cost(name):
  """A record's cost formulas (they live with the record, collectives/algorithms/<name>.py)."""
  return registry.get(name).cost


def _t(kind, algorithm, group, topo=DGX, nbytes=N, **kw):
  return cm.collective_time(kind, nbytes, list(group), topo, _cost(algorithm), costs=GPU, **kw)


# --- every formula charges what its program does --------------------------------------------

AX = ("o", "i")
E = 8192                    # float32 elements per device: divisible by every chunking used
NB = 4 * E


def _coefficients(cost, kind, reproducible=False):
  """(XLA collectives, NVLink kernels, link latencies, link bytes) a formula charges for ``NB``
  bytes over devices 0-7: its derivatives in L, K, alpha and beta (each formula is linear in
  them), on pcie_8 (islands 0-3 and 4-7) with one link spec inside and across the islands, so the
  link bytes do not depend on how a formula splits them between the two."""
  def at(bw=10.0, latency_us=5.0, **fixed):
    spec = LinkSpec(bw, latency_us)
    topo = PCIE.with_links({"pcie": spec, "numa_cross": spec})
    return cm.collective_time(kind, NB, list(range(8)), topo, cost, reproducible=reproducible,
                              costs=dataclasses.replace(GPU, **fixed))
  d_l = at(xla_collective_us=1e6) - at(xla_collective_us=0.0)
  d_k = at(nvlink_kernel_us=1e6) - at(nvlink_kernel_us=0.0)
  d_a = at(latency_us=1e6) - at(latency_us=0.0)
  d_b = (at(bw=10.0) - at(bw=20.0)) / (1 / 10e9 - 1 / 20e9)
  return d_l, d_k, d_a, d_b


def _received(c):
  """Bytes one rank receives over links in collective ``c`` (an all-reduce as a ring: a
  reduce-scatter and an all-gather, (g - 1) / g of the buffer each)."""
  if c.kind == "ppermute":
    return c.nbytes
  g = len(c.replica_groups[0]) if c.replica_groups else 8
  share = (g - 1) / g * c.nbytes
  return 2 * share if c.kind == "all_reduce" else share


def _program(name, kind, reproducible, mesh):
  if kind == "all_reduce":
    f = lambda v: C.all_reduce(v, AX, algorithm=name, reproducible=reproducible)
  else:
    f = lambda v: C.reduce_scatter(v, AX, algorithm=name, tiled=True, reproducible=reproducible)
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec(AX),
                               out_specs=PartitionSpec(AX)))
  return hlo.read_compiled(step.lower(jnp.zeros((8 * E,), jnp.float32)).compile())


@pytest.mark.parametrize("kind,reproducible", [("all_reduce", False), ("reduce_scatter", False),
                                               ("all_reduce", True)])
def test_every_formula_charges_the_collectives_and_link_bytes_its_program_has(
    cpu_devices, kind, reproducible):
  """For every record that runs on CPU, the formula's number of XLA collectives (its derivative
  in L) and link bytes (in beta) are those of the program XLA compiles for it, read from the
  compiled HLO: a formula that drifts from its implementation, or a record whose formula is
  missing (inf), fails here."""
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  call = base.Call(kind, "sum", jnp.float32, AX, (2, 4), NB, backend="cpu",
                   contract=contract.parse(reproducible))
  records = [a for a in registry.REGISTRY if a.why_not(call) is None]
  assert {"xla", "ring", "one_shot", "two_shot"} <= {a.name for a in records}
  for a in records:
    module = _program(a.name, kind, reproducible, mesh)
    ops = [c for c in module.collectives()]
    assert ops and all(not c.kind.startswith("custom:") for c in ops), (a.name, ops)
    d_l, d_k, _, d_b = _coefficients(a.cost, kind, reproducible)
    assert d_l == pytest.approx(len(ops)), (a.name, [c.kind for c in ops])
    assert d_k == 0, a.name
    assert d_b == pytest.approx(sum(_received(c) for c in ops)), (a.name, ops)


def test_nvlink_formulas_charge_one_kernel_its_barriers_and_the_peer_reads():
  """docs/p2p.md: one kernel launch and no XLA collective; one_shot has every rank read the n - 1
  peers' buffers behind one barrier, two_shot reduces its segment from the peers and copies the
  others' reduced segments back, behind two barriers (a barrier is a flag write and a wait: two
  link latencies). The reproducible sums move the same bytes (converted in registers)."""
  n = 8
  for name, barriers, link_bytes in (("nvlink_one_shot", 1, (n - 1) * NB),
                                     ("nvlink_two_shot", 2, 2 * (n - 1) / n * NB)):
    for reproducible in (False, True):
      d_l, d_k, d_a, d_b = _coefficients(_cost(name), "all_reduce", reproducible)
      assert (d_l, d_k) == (0, pytest.approx(1.0)), name
      assert d_a == pytest.approx(2 * barriers) and d_b == pytest.approx(link_bytes), name
    assert _t("reduce_scatter", name, range(8)) == math.inf        # the kernels only all-reduce
    assert _t("all_reduce", name, [0, 8], ROCE) == math.inf          # nor leave the host


def test_one_shot_across_hosts_pays_latency_per_peer():
  g = [0, 8, 16, 24]
  assert _t("all_reduce", "one_shot", g, ROCE) == pytest.approx(
      L + 3 * ROCE_A + 3 * N / ROCE_BW + P + 8 * N * M)


def test_xla_across_hosts_is_the_better_of_flat_and_two_level_rings():
  g = list(range(32))
  flat = 2 * (31 * ROCE_A + 31 / 32 * N / ROCE_BW)
  two_level = 2 * (7 * NV_A + 7 / 8 * N / NV_BW) + 2 * (3 * ROCE_A + 3 / 4 * (N / 8) / ROCE_BW)
  assert two_level < flat
  assert _t("all_reduce", "xla", g, ROCE) == pytest.approx(L + two_level + 2 * N * M)


def test_hierarchical_and_host_hierarchical():
  g = list(range(32))
  k, m = 8, 4
  inner = 2 * (L + NV_A + (k - 1) / k * N / NV_BW)
  outer = L + 3 * ROCE_A + (m - 1) * (N / k) / ROCE_BW
  assert _t("all_reduce", "hierarchical", g, ROCE) == pytest.approx(
      inner + outer + 2 * P + (3 * N + 2 * m * N / k) * M)
  host_outer = 2 * (m - 1) * (S + ROCE_A) + 2 * (m - 1) / m * (N / k) / ROCE_BW
  assert _t("all_reduce", "host_hierarchical", g, ROCE) == pytest.approx(
      inner + host_outer + 3 * N * M)
  assert _t("all_reduce", "host_ring", [0, 8, 16, 24], ROCE) == pytest.approx(
      6 * (S + ROCE_A) + 2 * 3 / 4 * N / ROCE_BW + 2 * N * M)


def test_reduce_scatter_and_all_gather():
  g = range(8)
  assert _t("reduce_scatter", "xla", g) == pytest.approx(L + NV_A + 7 / 8 * N / NV_BW + 2 * N * M)
  assert _t("all_gather", "xla", g) == pytest.approx(L + NV_A + 7 / 8 * N / NV_BW + N * M)
  assert _t("reduce_scatter", "ring", g) == pytest.approx(
      7 * (L + NV_A + N / 8 / NV_BW) + 7 * P + 2 * N * M)
  assert _t("reduce_scatter", "two_shot", g) == pytest.approx(
      L + NV_A + 7 / 8 * N / NV_BW + P + 2 * N * M)
  assert _t("reduce_scatter", "nvlink_one_shot", g) == math.inf


def test_reproducible_forms():
  g, E = range(8), N / 4
  assert _t("all_reduce", "two_shot", g, reproducible=True) == pytest.approx(
      2 * L + 2 * NV_A + 7 / 8 * 2 * N / NV_BW + P + 2 * N * M + N * F + N / 8 * F)
  assert _t("all_reduce", "one_shot", g, reproducible=True, contributions=2) == pytest.approx(
      L + NV_A + 7 * 2 * N / NV_BW + P + 16 * N * M + 16 * N * F)
  for contract, w in ((True, 4), ("exact", 8)):   # v3: one int32 word per value; v2: two
    words = (L + 2 * (NV_A + 7 / 8 * E / NV_BW) + 2 * E * M) + \
        (L + 2 * (NV_A + 7 / 8 * w * E / NV_BW) + 2 * w * E * M) + 2 * P + 2 * N * F
    assert _t("all_reduce", "xla", g, reproducible=contract) == pytest.approx(words)
  # the kernels convert in registers: no extra exchange, the conversion on the GPU's cores
  assert _t("all_reduce", "nvlink_one_shot", g, reproducible=True) == pytest.approx(
      _t("all_reduce", "nvlink_one_shot", g) + 8 * N * F)


def test_hierarchical_needs_a_proper_island_split():
  assert cm.island_groups(list(range(32)), ROCE) == tuple(
      tuple(range(h * 8, h * 8 + 8)) for h in range(4))
  assert cm.island_groups([0, 1, 8, 9], ROCE) == ((0, 1), (8, 9))
  assert cm.island_groups(list(range(8)), DGX) is None          # one island
  assert cm.island_groups([0, 1, 8], ROCE) is None               # unequal islands
  assert cm.island_groups([0, 8, 16], ROCE) is None              # islands of one device
  assert cm.island_groups(list(range(8)), PCIE) == ((0, 1, 2, 3), (4, 5, 6, 7))
  for topo, g in ((DGX, range(8)), (ROCE, [0, 1, 8]), (ROCE, range(8))):
    for name in ("hierarchical", "host_hierarchical"):
      assert cm.collective_time("all_reduce", N, list(g), topo, _cost(name)) == math.inf


def test_trivial_groups_and_ppermute():
  assert cm.collective_time("all_reduce", N, [3], DGX, _cost("ring")) == 0.0
  assert cm.collective_time("all_reduce", N, [], DGX) == 0.0
  assert _t("ppermute", "xla", [0, 8], ROCE) == pytest.approx(L + ROCE_A + N / ROCE_BW)


def test_crossover_comes_from_the_model():
  g = list(range(8))
  # nvlink one_shot - two_shot = -2a + N (5.25 / bw + 6 / bw_local): two-shot wins above
  slope = 5.25 / NV_BW + 6 / LOCAL_BW
  want = math.floor(2 * NV_A / slope) + 1
  one, two = _cost("nvlink_one_shot"), _cost("nvlink_two_shot")
  got = cm.crossover_bytes(one, two, g, DGX, costs=GPU)
  assert got == want
  # a slower link latency moves the threshold up: it is not a constant
  slow = DGX.with_links({"nvlink": LinkSpec(300.0, 5.0)})
  assert cm.crossover_bytes(one, two, g, slow, costs=GPU) == \
      math.floor(2 * 5e-6 / slope) + 1
  # the NCCL/kernel launch costs decide where the NVLink kernel stops beating psum
  k = cm.crossover_bytes(one, cm.XLA, g, DGX, costs=GPU)
  slope_x = 7 / NV_BW + 9 / LOCAL_BW - 1.75 / NV_BW - 2 / LOCAL_BW
  assert k == math.floor((L - K) / slope_x) + 1
  assert cm.crossover_bytes(_cost("two_shot"), _cost("one_shot"), g, DGX, costs=GPU) is None


def test_backend_costs_are_data(tmp_path, monkeypatch):
  path = tmp_path / "costs.json"
  path.write_text(json.dumps({"gpu": {"xla_collective_us": 30.0}}))
  monkeypatch.setenv("DTENJAX_COST_PARAMS", str(path))
  assert cm.backend_costs("gpu").xla_collective_us == 30.0
  assert cm.backend_costs("gpu").nvlink_kernel_us == GPU.nvlink_kernel_us
  assert cm.backend_costs("cpu") == cm.BACKEND_COSTS["cpu"]
  assert cm.collective_time("all_reduce", N, list(range(8)), DGX) == pytest.approx(
      _t("all_reduce", "xla", range(8)) + 12e-6)
  path.write_text(json.dumps({"gpu": {"launch": 1}}))
  monkeypatch.setenv("DTENJAX_COST_PARAMS", str(tmp_path / "other.json"))
  with pytest.raises(errors.ConfigurationError, match=r"cannot be read as JSON"):
    cm.backend_costs("gpu")
  monkeypatch.setenv("DTENJAX_COST_PARAMS", str(path))
  with pytest.raises(errors.ConfigurationError, match=r"gpu.launch is not a BackendCosts field"):
    cm.backend_costs("gpu")
  with pytest.raises(errors.ConfigurationError, match=r"invalid fields \['host_step_us'\]"):
    cm.BackendCosts(1, 1, None, 1, -1, 1)


def test_errors():
  with pytest.raises(errors.CollectiveError, match="unknown collective kind 'allreduce'"):
    cm.collective_time("allreduce", N, [0, 1], DGX)
  with pytest.raises(errors.CollectiveError, match="cost='tree' is not a costmodel.Cost"):
    cm.collective_time("all_reduce", N, [0, 1], DGX, "tree")
  with pytest.raises(errors.CollectiveError, match="all_gather is priced as XLA's own op"):
    cm.collective_time("all_gather", N, [0, 1], DGX, _cost("ring"))
  with pytest.raises(errors.CollectiveError, match="nbytes=-1"):
    cm.collective_time("all_reduce", -1, [0, 1], DGX)


def test_gpu_predictions_stay_within_2x_of_the_h200_pair_measurements(capsys):
  """bench/results holds bench/allreduce.py runs on 2 x H200 (one process; one per GPU): the GPU
  cost constants must keep every prediction within 2x of them (issue 11 item 6)."""
  import pathlib  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  sys.path.insert(0, str(root / "bench"))
  import costmodel_check  # pylint: disable=g-import-not-at-top
  for name in ("2026-11-30_h200x2_1proc_f32.json", "2026-11-30_h200x2_2procs_f32.json"):
    assert costmodel_check.main([str(root / "bench" / "results" / name)]) == 0, capsys.readouterr()
    assert "40 of 40 predictions within 2x" in capsys.readouterr().out


def test_cost_params_file_is_versioned_and_checked(tmp_path, monkeypatch):
  """DTENJAX_COST_PARAMS: format dtenjax.cost-params/1 (absent: read as that), numbers only; the
  shipped JSON Schema accepts and refuses the same files."""
  import pathlib  # pylint: disable=g-import-not-at-top
  schema = json.loads((pathlib.Path(__file__).resolve().parents[1] / "dtenjax" / "schemas" /
                       "cost-params-1.schema.json").read_text())
  jsonschema = pytest.importorskip("jsonschema")
  path = tmp_path / "costs.json"
  monkeypatch.setenv("DTENJAX_COST_PARAMS", str(path))
  good = {"format": "dtenjax.cost-params/1", "gpu": {"xla_collective_us": 25.0,
                                                     "local_bandwidth_gbps": None}}
  path.write_text(json.dumps(good))
  assert cm.backend_costs("gpu").xla_collective_us == 25.0
  jsonschema.validate(good, schema)
  for bad, message in [
      ({"format": "dtenjax.cost-params/2", "gpu": {}}, "(written by a newer dtenjax?)"),
      ({"gpu": {"xla_collective_us": "fast"}}, "gpu.xla_collective_us = 'fast' must be a number"),
      ({"gpu": {"host_step_us": True}}, "gpu.host_step_us = True must be a number"),
      ({"cpu": {"nvlink_kernel_us": None}}, "cpu.nvlink_kernel_us = None must be a number"),
  ]:
    path.write_text(json.dumps(bad))
    with pytest.raises(errors.ConfigurationError) as e:
      cm.backend_costs("gpu")
    assert message in str(e.value)
    with pytest.raises(jsonschema.ValidationError):
      jsonschema.validate(bad, schema)
