"""Tests of dtenjax._src.pricing.costmodel, none of which copies a formula: what a formula
charges (its collectives, kernels, latencies and bytes per link class, read as its derivatives)
against what the compiled HLO of the algorithm's program holds, and properties (monotone in
bytes, linear in the limit, which link carries what across hosts, two-level schedules beating a
flat ring when inter-node is slow, reproducible sums costing more, crossovers where the times
cross); backend costs as data, island splits."""

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
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.collectives.all_reduce import all_reduce
from dtenjax._src.collectives.reduce_scatter import reduce_scatter
from dtenjax._src.pricing import costmodel as cm
from dtenjax._src.topology.model import LinkSpec, Topology
# the programs' collectives are read, never run: LLVM unoptimised (tests/compile_only.py)
from tests.compile_only import LLVM_O0

DGX = Topology.fixture("dgx_a100_8")
ROCE = Topology.fixture("roce_a100_4x8")
PCIE = Topology.fixture("pcie_8")
N = 1_000_000
# Table values (asserted so a change is noticed here).
NV_A, NV_BW = 2.5e-6, 300e9
ROCE_A, ROCE_BW = 5e-6, 12.5e9
LOCAL_BW = 2000e9
GPU = cm.BackendCosts(xla_collective_us=18.0, local_pass_us=4.0, local_bandwidth_gbps=None,
                      nvlink_kernel_us=6.0, host_step_us=40.0, fixed_point_gbps=500.0)


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
  bytes over devices 0-7: its derivatives in the XLA launch cost, the kernel launch cost, alpha and beta (each formula is linear in
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
  if reproducible == "exact":   # contract v2, two int32 words per value
    reproducible = "v2"
  if kind == "all_reduce":
    f = lambda v: all_reduce(v, AX, algorithm=name, reproducible=reproducible)
  else:
    f = lambda v: reduce_scatter(v, AX, algorithm=name, tiled=True, reproducible=reproducible)
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec(AX),
                               out_specs=PartitionSpec(AX)))
  return hlo.read_compiled(step.lower(jax.ShapeDtypeStruct((8 * E,), jnp.float32))
                          .compile(LLVM_O0))


@pytest.mark.parametrize("kind,reproducible", [("all_reduce", False), ("reduce_scatter", False),
                                               ("all_reduce", True), ("all_reduce", "exact")])
def test_every_formula_charges_the_collectives_and_link_bytes_its_program_has(
    cpu_devices, kind, reproducible):
  """For every record that runs on CPU, the formula's number of XLA collectives (its derivative
  in the XLA launch cost) and link bytes (in beta) are those of the program XLA compiles for it, read from the
  compiled HLO: a formula that drifts from its implementation, or a record whose formula is
  missing (inf), fails here."""
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  call = base.Call(kind, "sum", jnp.float32, AX, (2, 4), NB, backend="cpu",
                   contract=contract.parse(reproducible))
  records = [a for a in registry.REGISTRY if a.why_not(call) is None]
  assert {"xla", "ring", "one_shot", "two_shot", "hierarchical"} <= {a.name for a in records}
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


# --- across hosts: which link carries what, read from the compiled programs --------------------

HOSTS2 = [0, 1, 2, 3, 8, 9, 10, 11]   # ROCE: two hosts of four devices, joined by RoCE


def _d(kind, cost, group, topo, link, what, nbytes=N, **kw):
  """The derivative of a formula's time in one link class's inverse bandwidth (the bytes it sends
  over that class) or latency (how many of its latencies it pays), at the topology's own values
  (a small step, so a formula that picks the cheaper of two schedules stays on one of them)."""
  spec = topo.spec(link)

  def at(bw, lat):
    return cm.collective_time(kind, nbytes, list(group),
                              topo.with_links({link: LinkSpec(bw, lat)}), cost, costs=GPU, **kw)
  if what == "bytes":
    b1, b2 = spec.bandwidth_gbps, spec.bandwidth_gbps * 1.001
    return (at(b1, spec.latency_us) - at(b2, spec.latency_us)) / (1 / (b1 * 1e9) - 1 / (b2 * 1e9))
  return (at(spec.bandwidth_gbps, spec.latency_us + 0.01) -
          at(spec.bandwidth_gbps, spec.latency_us)) / 0.01e-6


def _compiled(cpu_devices, body, shape, mesh_shape=(2, 4), axes=AX):
  mesh = Mesh(np.array(cpu_devices[:math.prod(mesh_shape)]).reshape(mesh_shape), axes)
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(axes),
                               out_specs=PartitionSpec(axes), check_vma=False))
  return hlo.read_compiled(step.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile(LLVM_O0))


def _split_by_host(module, per_host=4):
  """(bytes received across hosts, bytes received inside a host) by one rank in ``module``'s
  collectives, a group crossing hosts when its logical ids fall in different blocks of
  ``per_host`` (mesh (2, 4): the outer axis is the host)."""
  across = inside = 0.0
  for c in module.collectives():
    groups = c.replica_groups or (tuple(range(8)),)
    if c.kind == "ppermute":
      crosses = any(a // per_host != b // per_host for a, b in c.source_target_pairs)
    else:
      crosses = any(len({d // per_host for d in g}) > 1 for g in groups)
    if crosses:
      across += _received(c)
    else:
      inside += _received(c)
  return across, inside


def test_one_shot_across_hosts_pays_one_latency_per_peer_and_the_gathered_bytes(cpu_devices):
  """one_shot all-gathers every peer's buffer: with one device per host, every peer is a RoCE
  latency away and every gathered byte crosses RoCE, as many as its compiled program receives."""
  for g in (2, 3, 4):
    group = [h * 8 for h in range(g)]
    assert _d("all_reduce", _cost("one_shot"), group, ROCE, "roce", "latency") == \
        pytest.approx(g - 1)
    module = _compiled(cpu_devices, lambda v: all_reduce(v, "x", algorithm="one_shot"),
                       (g * (N // 4),), (g,), ("x",))
    received = sum(_received(c) for c in module.collectives())
    assert received == pytest.approx((g - 1) * N)          # the program: n - 1 peers' buffers
    assert _d("all_reduce", _cost("one_shot"), group, ROCE, "roce", "bytes") == \
        pytest.approx(received)


def test_hierarchical_sends_over_each_link_what_its_program_does(cpu_devices):
  """hierarchical over two hosts: the in-host stages' bytes go over NVLink, the cross-host
  stage's over RoCE, each as many as the compiled program's collectives inside and across the
  hosts receive."""
  module = _compiled(cpu_devices, lambda v: all_reduce(v, AX, algorithm="hierarchical"),
                     (8 * (N // 4),))
  across, inside = _split_by_host(module)
  assert across > 0 and inside > 0
  cost = _cost("hierarchical")
  assert _d("all_reduce", cost, HOSTS2, ROCE, "roce", "bytes") == pytest.approx(across)
  assert _d("all_reduce", cost, HOSTS2, ROCE, "nvlink", "bytes") == pytest.approx(inside)


def test_xla_across_hosts_prices_the_two_level_ring_xla_would_run(cpu_devices):
  """XLA's all-reduce across hosts is priced as NCCL's two-level ring: a reduce-scatter inside
  each host, an all-reduce of the 1/k shard across, an all-gather inside. Written with XLA's own
  ops and compiled, that program's cross-host and in-host bytes are the formula's."""
  def two_level(v):
    shard = jax.lax.psum_scatter(v, "i", tiled=True)
    return jax.lax.all_gather(jax.lax.psum(shard, "o"), "i", tiled=True)

  across, inside = _split_by_host(_compiled(cpu_devices, two_level, (8 * (N // 4),)))
  assert across == pytest.approx(N / 4) and inside == pytest.approx(2 * 3 / 4 * N)
  assert _d("all_reduce", cm.XLA, HOSTS2, ROCE, "roce", "bytes") == pytest.approx(across)
  assert _d("all_reduce", cm.XLA, HOSTS2, ROCE, "nvlink", "bytes") == pytest.approx(inside)


def test_two_level_schedules_beat_a_flat_ring_when_inter_node_is_slow():
  """Over 4 hosts of 8, the flat ppermute ring sends 2(n-1)/n of the buffer over RoCE; XLA's
  two-level ring and hierarchical send a shard. The slower RoCE is, the more they win."""
  group = list(range(32))
  flat, xla, hier = (_t("all_reduce", a, group, ROCE, nbytes=64 << 20)
                     for a in ("ring", "xla", "hierarchical"))
  assert xla < flat and hier < flat
  slow = ROCE.with_links({"roce": LinkSpec(1.25, 5.0)})
  flat_s, xla_s = (_t("all_reduce", a, group, slow, nbytes=64 << 20) for a in ("ring", "xla"))
  assert flat_s / xla_s > flat / xla > 1
  for a in ("ring", "xla", "hierarchical", "host_hierarchical"):
    assert _d("all_reduce", _cost(a) if a != "xla" else cm.XLA, group, ROCE, "roce", "bytes") \
        <= 2 * N, a
  assert _d("all_reduce", cm.XLA, group, ROCE, "roce", "bytes") < \
      _d("all_reduce", _cost("ring"), group, ROCE, "roce", "bytes") / 4


def test_host_records_send_a_kth_across_hosts_and_pay_a_host_step_per_ring_step():
  """host_hierarchical reduces inside each host with XLA first, so only a 1/k shard rides the
  host ring; host_ring over one device per host sends the whole buffer's ring share. A ring of m
  ranks takes 2(m - 1) steps (reduce-scatter, then all-gather), each a host step and a latency."""
  hosts = [0, 8, 16, 24]
  ring_bytes = _d("all_reduce", _cost("host_ring"), hosts, ROCE, "roce", "bytes")
  assert ring_bytes == pytest.approx(2 * 3 / 4 * N)           # a ring's share, twice
  hier_bytes = _d("all_reduce", _cost("host_hierarchical"), list(range(32)), ROCE, "roce", "bytes")
  assert hier_bytes == pytest.approx(ring_bytes / 8)
  for name, group in (("host_ring", hosts), ("host_hierarchical", list(range(32)))):
    steps = (_t("all_reduce", name, group, ROCE) -
             cm.collective_time("all_reduce", N, group, ROCE, _cost(name),
                                costs=dataclasses.replace(GPU, host_step_us=0.0))) / (
                                    GPU.host_step_us * 1e-6)
    assert steps == pytest.approx(6), name
    assert _d("all_reduce", _cost(name), group, ROCE, "roce", "latency") == pytest.approx(6), name


def test_all_gather_and_ppermute_charge_what_their_programs_move(cpu_devices):
  """XLA's all-gather and collective-permute: one collective each, and the bytes the compiled
  op receives over the link (8 devices of the DGX, all NVLink)."""
  module = _compiled(cpu_devices, lambda v: jax.lax.all_gather(v, "x", tiled=True)[:v.shape[0]],
                     (8 * (N // 4),), (8,), ("x",))
  (gather,) = module.collectives()
  # the all-gather of N bytes per rank's result: priced for its output size
  assert _d("all_gather", cm.XLA, range(8), DGX, "nvlink", "bytes", nbytes=gather.nbytes) == \
      pytest.approx(_received(gather))
  perm = _compiled(cpu_devices, lambda v: jax.lax.ppermute(v, "x", [(0, 1), (1, 0)]),
                   (2 * (N // 4),), (2,), ("x",))
  (c,) = perm.collectives()
  assert _d("ppermute", cm.XLA, [0, 8], ROCE, "roce", "bytes") == pytest.approx(_received(c))
  assert _d("ppermute", cm.XLA, [0, 8], ROCE, "roce", "latency") == pytest.approx(1)


def test_reduce_scatter_is_cheaper_than_all_reduce():
  """A reduce-scatter is the first half of an all-reduce: never dearer, for every record that
  prices both."""
  for a in registry.REGISTRY:
    rs, ar = _t("reduce_scatter", a.name, range(8)), _t("all_reduce", a.name, range(8))
    if rs != math.inf:
      assert rs < ar, a.name
  assert _t("all_gather", "xla", range(8)) < _t("all_reduce", "xla", range(8))


# --- properties every formula has ---------------------------------------------------------------

@pytest.mark.parametrize("topo,group", [(DGX, range(8)), (ROCE, range(32)), (PCIE, range(8)),
                                        (ROCE, [0, 8, 16, 24])])
def test_times_grow_with_bytes_and_become_linear(topo, group):
  """More bytes never cost less; at small sizes the fixed costs remain (a collective is never
  free); at large sizes the time per byte settles (doubling the size doubles the extra time)."""
  for a in registry.REGISTRY:
    for kind in ("all_reduce", "reduce_scatter"):
      times = [_t(kind, a.name, group, topo, nbytes=nb) for nb in (0, 1 << 10, 1 << 20, 1 << 26,
                                                                   1 << 27, 1 << 28)]
      if times[-1] == math.inf:
        continue
      assert times == sorted(times), (a.name, kind, times)
      assert times[0] > 0, (a.name, kind)
      assert (times[5] - times[4]) == pytest.approx(2 * (times[4] - times[3]), rel=1e-3), a.name


def test_reproducible_sums_cost_more_and_the_kernels_convert_in_registers():
  """The reproducible sum adds work to every record: the fixed-point conversion, and (outside
  the kernels) an exchange of integer words, wider for contract v2 ("exact") than for v3. The
  NVLink kernels convert in registers: their extra time is the conversion alone, whatever the
  links."""
  g = range(8)
  for a in registry.REGISTRY:
    plain = _t("all_reduce", a.name, g)
    if plain == math.inf:
      continue
    v3, v2 = _t("all_reduce", a.name, g, reproducible=True), \
        _t("all_reduce", a.name, g, reproducible="exact")
    assert plain < v3 <= v2, (a.name, plain, v3, v2)
  for name in ("nvlink_one_shot", "nvlink_two_shot"):
    extra = [_t("all_reduce", name, g, t, reproducible=True) - _t("all_reduce", name, g, t)
             for t in (DGX, DGX.with_links({"nvlink": LinkSpec(30.0, 25.0)}))]
    assert extra[0] == pytest.approx(extra[1]), name          # no link term in the difference
    fast = dataclasses.replace(GPU, fixed_point_gbps=1000.0)
    faster = (cm.collective_time("all_reduce", N, list(g), DGX, _cost(name), reproducible=True,
                                 costs=fast) - cm.collective_time("all_reduce", N, list(g), DGX,
                                                                  _cost(name), costs=fast))
    assert faster == pytest.approx(extra[0] / 2), name        # conversion at twice the speed
  # v2 words are twice as wide as v3's: the word exchange sends more bytes
  assert _d("all_reduce", cm.XLA, g, DGX, "nvlink", "bytes", reproducible="exact") > \
      _d("all_reduce", cm.XLA, g, DGX, "nvlink", "bytes", reproducible=True)


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


def test_trivial_groups():
  assert cm.collective_time("all_reduce", N, [3], DGX, _cost("ring")) == 0.0
  assert cm.collective_time("all_reduce", N, [], DGX) == 0.0


def _crosses(small, large, group, topo, costs=GPU):
  """Whether ``large`` becomes the cheaper of the two at ``c`` bytes, by evaluating both formulas
  at ``c - 1`` and ``c`` (not from their algebra)."""
  def t(cost, nb):
    return cm.collective_time("all_reduce", nb, group, topo, cost, costs=costs)
  return lambda c: t(small, c - 1) <= t(large, c - 1) and t(small, c) > t(large, c)


def test_crossover_is_where_the_times_cross():
  g = list(range(8))
  one, two = _cost("nvlink_one_shot"), _cost("nvlink_two_shot")
  got = cm.crossover_bytes(one, two, g, DGX, costs=GPU)
  assert got is not None and _crosses(one, two, g, DGX)(got), got
  # a slower link latency moves the threshold up (two_shot pays more barriers): not a constant
  slow = DGX.with_links({"nvlink": LinkSpec(300.0, 5.0)})
  got_slow = cm.crossover_bytes(one, two, g, slow, costs=GPU)
  assert got_slow > got and _crosses(one, two, g, slow)(got_slow)
  # the NCCL/kernel launch costs decide where the NVLink kernel stops beating psum
  k = cm.crossover_bytes(one, cm.XLA, g, DGX, costs=GPU)
  assert k is not None and _crosses(one, cm.XLA, g, DGX)(k)
  cheaper_launch = dataclasses.replace(GPU, xla_collective_us=9.0)
  assert cm.crossover_bytes(one, cm.XLA, g, DGX, costs=cheaper_launch) < k
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
  import pathlib
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  sys.path.insert(0, str(root / "bench"))
  import costmodel_check
  for name in ("2026-11-30_h200x2_1proc_f32.json", "2026-11-30_h200x2_2procs_f32.json"):
    assert costmodel_check.main([str(root / "bench" / "results" / name)]) == 0, capsys.readouterr()
    assert "40 of 40 predictions within 2x" in capsys.readouterr().out


def test_the_check_prices_hierarchical_on_the_mesh_bench_allreduce_ran_it_on(tmp_path, capsys):
  """bench/allreduce.py runs hierarchical on its 2-D mesh, (2, world / 2) with axes ("o", "i"):
  on 4 hosts of 8 the first stage runs over 16 ranks of two hosts: its all-to-all sends N/16 to
  each peer, the 7 on the rank's host over NVLink (one latency), the 8 on the other over RoCE
  (a latency each); its all-gather is a ring, each step on RoCE (15/16 of N, a latency per
  peer); the second stage runs over 2 ranks on two hosts (one-shot of N/16). A row measured at
  exactly that price is predicted at ratio 1.00; priced by the islands (8 per host, as without
  the mesh's axes) it would be predicted at a quarter of it."""
  import pathlib
  import sys
  root = pathlib.Path(__file__).resolve().parents[1]
  sys.path.insert(0, str(root / "bench"))
  import _harness
  import costmodel_check
  size = 64 << 20
  L, Pass = 18e-6, 4e-6                                # the GPU's fixed costs (GPU above)
  want = ((L + NV_A + 8 * ROCE_A + size / 16 * (7 / NV_BW + 8 / ROCE_BW)) +
          (L + 15 * ROCE_A + 15 / 16 * size / ROCE_BW) + (L + ROCE_A + size / 16 / ROCE_BW) +
          2 * Pass + (3 * size + 2 * 2 * size / 16) / LOCAL_BW)
  row = dict(_harness.nccl_columns(size, "float32", want, 32), algorithm="hierarchical",
             world=32, procs=4, backend="gpu", chain=16)
  path = tmp_path / "r.json"
  _harness.write_json(str(path), _harness.document("allreduce", "bench/allreduce.py", [],
                                                   {"mesh": "2d"}, [row]))
  capsys.readouterr()
  assert costmodel_check.main([str(path), "--fixture", "roce_a100_4x8"]) == 0, capsys.readouterr()
  out = capsys.readouterr().out
  assert "1 of 1 predictions within 2x" in out
  assert any(ln.split()[:2] == [str(size), "hierarchical"] and ln.split()[-1] == "1.00"
             for ln in out.splitlines()), out


def test_cost_params_file_is_versioned_and_checked(tmp_path, monkeypatch):
  """DTENJAX_COST_PARAMS: format dtenjax.cost-params/1 (absent: read as that), numbers only; the
  shipped JSON Schema accepts and refuses the same files."""
  import pathlib
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
