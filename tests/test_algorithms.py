"""The XLA-native algorithms: fixed reduction orders (bit-exact emulation), determinism, auto."""

import sys
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src.collectives import algorithms as alg
from dtenjax._src.collectives import api as C

ALGOS = ("xla", "ring", "one_shot", "two_shot", "hierarchical")
AX = ("o", "i")


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), AX)


def _smap(mesh, f):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))


@pytest.fixture(scope="module")
def all_algos(mesh):
  """One compiled program: every algorithm x op on the per-device row, stacked."""
  def body(x):
    outs = []
    for a in ALGOS:
      for op in ("sum", "mean", "max", "min"):
        outs.append(C.all_reduce(x[0], AX, op=op, algorithm=a))
    return jnp.stack(outs)[None]
  return _smap(mesh, body)


def _x(dtype=jnp.float32, m=13, seed=0):
  k = jax.random.key(seed)
  return (jax.random.normal(k, (8, m), jnp.float32) * 10.0 ** jnp.arange(m) % 7).astype(dtype)


def test_every_algorithm_matches_reference_and_is_identical_on_all_ranks(all_algos):
  x = _x()
  y = np.asarray(all_algos(x))                     # [rank, algo*op, m]
  refs = {"sum": x.sum(0), "mean": x.mean(0), "max": x.max(0), "min": x.min(0)}
  for j, (a, op) in enumerate((a, op) for a in ALGOS for op in ("sum", "mean", "max", "min")):
    np.testing.assert_allclose(y[0, j], refs[op], rtol=1e-5, atol=1e-4, err_msg=f"{a} {op}")
    for r in range(8):
      np.testing.assert_array_equal(y[r, j], y[0, j], err_msg=f"{a} {op} rank {r}")
  again = np.asarray(all_algos(x))
  np.testing.assert_array_equal(again, y)          # every run: same bits


def _fold(rows):
  acc = np.float32(rows[0])
  for r in rows[1:]:
    acc = np.float32(acc + np.float32(r))
  return acc


def test_reduction_orders_are_the_documented_ones(all_algos):
  # Large-magnitude mixed data: different orders give different bits, so equality is meaningful.
  x = np.asarray(jax.random.normal(jax.random.key(3), (8, 13)) * np.logspace(-3, 6, 13),
                 np.float32)
  y = np.asarray(all_algos(jnp.asarray(x)))[0]
  j = {a: ALGOS.index(a) * 4 for a in ALGOS}        # op "sum" column per algorithm
  left = np.array([_fold(x[:, e]) for e in range(13)], np.float32)
  np.testing.assert_array_equal(y[j["one_shot"]], left)
  np.testing.assert_array_equal(y[j["two_shot"]], left)
  np.testing.assert_array_equal(y[j["xla"]], left)   # deterministic xla == one_shot order
  hier = np.array([_fold([_fold(x[0:4, e]), _fold(x[4:8, e])]) for e in range(13)], np.float32)
  np.testing.assert_array_equal(y[j["hierarchical"]], hier)
  c = -(-13 // 8)                                   # ring: chunk q summed from rank q+1 to q
  ring = np.array([_fold([x[(e // c + 1 + s) % 8, e] for s in range(8)]) for e in range(13)],
                  np.float32)
  np.testing.assert_array_equal(y[j["ring"]], ring)
  assert not np.array_equal(left, ring), "test data should distinguish the orders"


def test_bf16_sums_accumulate_in_f32_and_round_once(mesh):
  x = _x(jnp.bfloat16, m=16, seed=5)
  f = _smap(mesh, lambda v: jnp.stack([C.all_reduce(v[0], AX, algorithm=a)
                                       for a in ("one_shot", "two_shot")])[None])
  y = np.asarray(f(x).astype(jnp.float32))[0]
  want = np.array([_fold(np.asarray(x[:, e], np.float32)) for e in range(16)], np.float32)
  want = np.asarray(jnp.asarray(want).astype(jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(y[0], want)
  np.testing.assert_array_equal(y[1], want)


def test_xla_algorithm_meaning_in_hlo(mesh):
  x = _x()
  det = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="xla"))
  raw = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="xla", deterministic=False))
  imax = _smap(mesh, lambda v: C.all_reduce(v, AX, op="max", algorithm="xla"))
  hd, hr, hm = (g.lower(x).compile().as_text() for g in (det, raw, imax))
  assert "all-gather" in hd and "all-reduce(" not in hd and "all-reduce-start" not in hd
  assert "all-reduce" in hr
  assert "all-reduce" in hm                          # max is exact in any order: psum family
  np.testing.assert_allclose(raw(x), det(x), rtol=1e-5, atol=1e-5)


def test_ring_uses_ppermute_two_shot_all_to_all(mesh):
  x = _x()
  hring = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="ring")).lower(x).compile().as_text()
  htwo = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="two_shot")).lower(x).compile().as_text()
  assert hring.count("collective-permute") >= 14      # 2 * (n - 1) steps
  assert "all-to-all" in htwo and "all-gather" in htwo


# --- auto: the cost model's choice ----------------------------------------------------------------

def test_fallback_model_thresholds_come_from_the_model():
  n = 8
  small = C.plan_all_reduce(64, list(range(n)), None,
                            candidates=("one_shot", "two_shot", "ring"))
  large = C.plan_all_reduce(64 << 20, list(range(n)), None,
                            candidates=("one_shot", "two_shot", "ring"))
  assert small.algorithm == "one_shot" and large.algorithm == "two_shot"
  assert set(small.times) == {"one_shot", "two_shot", "ring"} and "fallback" in small.reason
  # the crossover sits where the model says: alpha * bw * n / ((n-1)(n-2))
  cross = C.FALLBACK_ALPHA_S * C.FALLBACK_BW * n / ((n - 1) * (n - 2))
  lo = C.plan_all_reduce(int(cross * 0.9), list(range(n)), None, candidates=("one_shot", "two_shot"))
  hi = C.plan_all_reduce(int(cross * 1.1), list(range(n)), None, candidates=("one_shot", "two_shot"))
  assert (lo.algorithm, hi.algorithm) == ("one_shot", "two_shot")
  cross_host = C.plan_all_reduce(8 << 20, list(range(n)), None, islands=2,
                                 candidates=("one_shot", "two_shot", "ring", "hierarchical"))
  assert cross_host.algorithm == "hierarchical"


class _FakeCostModel:
  """Ranks by a table; records what it was asked."""

  def __init__(self, table):
    self.table, self.calls = table, []

  def rank_algorithms(self, kind, nbytes, group, topology, candidates):
    self.calls.append((kind, nbytes, tuple(group), topology, tuple(candidates)))
    return sorted(((c, self.table[c]) for c in candidates), key=lambda t: (t[1], t[0]))


def test_plan_uses_the_cost_model_and_breaks_ties_by_name():
  fake = _FakeCostModel({"one_shot": 2.0, "two_shot": 1.0, "ring": 1.0, "hierarchical": 9.0})
  ch = C.plan_all_reduce(1024, [0, 1, 2, 3], "topo", costmodel=fake,
                         candidates=("one_shot", "two_shot", "ring"))
  assert ch.algorithm == "ring" and ch.times["two_shot"] == 1.0 and "cost model" in ch.reason
  assert fake.calls == [("all_reduce", 1024, (0, 1, 2, 3), "topo",
                         ("one_shot", "ring", "two_shot"))]


def test_auto_inside_a_trace_follows_the_cost_model(mesh, monkeypatch):
  fake = _FakeCostModel({"one_shot": 3.0, "two_shot": 2.0, "ring": 1.0, "hierarchical": 4.0})
  cm = types.ModuleType("dtenjax._src.planning.costmodel")
  cm.rank_algorithms = fake.rank_algorithms
  topo = types.ModuleType("dtenjax._src.topology.model")
  topo.Topology = types.SimpleNamespace(current=lambda: "fake-topology")
  monkeypatch.setitem(sys.modules, "dtenjax._src.planning.costmodel", cm)
  monkeypatch.setitem(sys.modules, "dtenjax._src.topology.model", topo)
  x = _x()
  hlo = _smap(mesh, lambda v: C.all_reduce(v, AX)).lower(x).compile().as_text()
  assert hlo.count("collective-permute") >= 14          # the ring the model asked for
  kind, nbytes, group, t, cands = fake.calls[-1]
  assert (kind, nbytes, len(group), t) == ("all_reduce", 13 * 4, 8, "fake-topology")
  assert "hierarchical" in cands and "xla" not in cands  # deterministic float sum


# --- plug-ins ----------------------------------------------------------------------------------

def test_cross_process_axes_dispatch_to_hostcoll(mesh, monkeypatch):
  calls = []
  hc = types.ModuleType("dtenjax._src.net.hostcoll")
  hc.spans_processes = lambda axis_name: True

  def fake_all_reduce(x, axis_name, *, algorithm, op):
    calls.append((axis_name, algorithm, op))
    return x * 0 + 42.0
  hc.all_reduce = fake_all_reduce
  monkeypatch.setitem(sys.modules, "dtenjax._src.net.hostcoll", hc)
  y = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="ring"))(_x())
  assert calls == [(AX, "ring", "sum")] and float(y[0, 0]) == 42.0
  # one_shot is not a transport algorithm: stays XLA-native
  y = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="one_shot"))(_x())
  assert float(y[0, 0]) != 42.0


def test_gpu_one_shot_dispatches_to_p2p_when_supported(mesh, monkeypatch):
  p2p = types.ModuleType("dtenjax._src.gpu.p2p")
  asked = []
  p2p.supported = lambda n, nbytes, dtype, *, op="sum", reproducible=False: (
      asked.append((n, nbytes)) or (n == 8, "size"))
  p2p.all_reduce = lambda x, axis_name, *, algorithm, op, reproducible=False, fallback=None: (
      x * 0 + 7.0)
  monkeypatch.setitem(sys.modules, "dtenjax._src.gpu.p2p", p2p)
  monkeypatch.setattr(C.jax, "default_backend", lambda: "gpu")
  y = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="two_shot"))(_x())
  assert float(y[0, 0]) == 7.0 and asked == [(8, 13 * 4)]
  y = _smap(mesh, lambda v: C.all_reduce(v, "i", algorithm="two_shot"))(_x())
  assert float(y[0, 0]) != 7.0                       # unsupported size 4: XLA-native fallback


def test_candidates():
  assert "xla" not in alg.candidates(AX, "sum", jnp.float32, True)
  assert "xla" in alg.candidates(AX, "sum", jnp.int32, True)
  assert "xla" in alg.candidates("i", "sum", jnp.float32, False)
  assert "hierarchical" not in alg.candidates("i", "sum", jnp.float32, True)
