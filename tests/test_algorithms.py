"""The algorithm records: documented reduction orders (bit-exact emulation), XLA's own order where
dtenjax relies on it, NaN propagation, the registry's choice, and routing to the NVLink kernels and
the host transport through fakes that enforce the real modules' contracts."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import common
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import host
from dtenjax._src.collectives.algorithms import nvlink
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.collectives.algorithms import xla
from dtenjax._src.collectives.all_reduce import all_reduce
from dtenjax._src.collectives.plan_all_reduce import plan_all_reduce
from dtenjax._src.contract import Contract
from dtenjax._src.gpu import p2p
from dtenjax._src.net import hostcoll
from dtenjax._src.pricing import algorithms as price_records
from dtenjax._src.pricing import costmodel
from dtenjax._src.topology.model import Topology
from tests import helpers

ALGOS = ("xla", "ring", "one_shot", "two_shot", "hierarchical")
AX = ("o", "i")


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), AX)


_smap = helpers.smap     # over AX, unchecked vma
_wide = helpers.wide
_fold = helpers.fold


# --- documented orders ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def all_algos(mesh):
  """One compiled program: every algorithm x op on the per-device row, stacked."""
  def body(x):
    outs = [all_reduce(x[0], AX, op=op, algorithm=a)
            for a in ALGOS for op in ("sum", "mean", "max", "min")]
    return jnp.stack(outs)[None]
  return _smap(mesh, body)


def test_every_algorithm_is_close_to_numpy_and_identical_on_all_ranks_and_runs(all_algos):
  x = _wide((8, 13), 0) % 7
  y = np.asarray(all_algos(x))                     # [rank, algo*op, m]
  refs = {"sum": x.sum(0), "mean": x.mean(0), "max": x.max(0), "min": x.min(0)}
  for j, (a, op) in enumerate((a, op) for a in ALGOS for op in ("sum", "mean", "max", "min")):
    np.testing.assert_allclose(y[0, j], refs[op], rtol=1e-5, atol=1e-5, err_msg=f"{a} {op}")
    np.testing.assert_array_equal(y, np.broadcast_to(y[:1], y.shape))
  np.testing.assert_array_equal(np.asarray(all_algos(x)), y)          # every run: same bits


def test_reduction_orders_are_the_documented_ones(all_algos):
  x = _wide((8, 13), 3)
  y = np.asarray(all_algos(jnp.asarray(x)))[0]
  j = {a: ALGOS.index(a) * 4 for a in ALGOS}        # op "sum" column per algorithm
  left = _fold(list(x))
  np.testing.assert_array_equal(y[j["one_shot"]], left)
  np.testing.assert_array_equal(y[j["two_shot"]], left)
  hier = _fold([_fold(list(x[0:4])), _fold(list(x[4:8]))])
  np.testing.assert_array_equal(y[j["hierarchical"]], hier)
  c = -(-13 // 8)                                   # ring: chunk q summed from rank q+1 to q
  ring = np.array([_fold([x[(e // c + 1 + s) % 8, e:e + 1] for s in range(8)])[0]
                   for e in range(13)], np.float32)
  np.testing.assert_array_equal(y[j["ring"]], ring)
  # xla on XLA:CPU in one process: rank-order fold from +0 (algorithms/xla.py)
  np.testing.assert_array_equal(y[j["xla"]], _fold(list(x), start=0.0))
  assert not np.array_equal(left, ring) and not np.array_equal(left, _fold(list(x[::-1])))


def test_mean_is_the_fold_divided_once(mesh):
  x = _wide((8, 4000), 11)
  y = np.asarray(_smap(mesh, lambda v: all_reduce(v, AX, op="mean", algorithm="one_shot"))(
      x.reshape(-1)))[:4000]
  np.testing.assert_array_equal(y, _fold(list(x)) / np.float32(8))   # IEEE division, not * 1/8


def test_bf16_sums_accumulate_in_f32_and_round_once(mesh):
  x = _wide((8, 64), 5).astype(jnp.bfloat16)
  f = _smap(mesh, lambda v: jnp.stack([all_reduce(v[0], AX, algorithm=a)
                                       for a in ("one_shot", "two_shot", "xla")])[None])
  y = np.asarray(f(x)).astype(np.float32)[0]
  xf = np.asarray(x, np.float32)
  want = _fold(list(xf)).astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(y[0], want)
  np.testing.assert_array_equal(y[1], want)
  np.testing.assert_array_equal(y[2], _fold(list(xf), start=0.0).astype(ml_dtypes.bfloat16)
                                .astype(np.float32))


# --- XLA's own order on CPU: what "xla" with deterministic=True relies on ------------------------

@pytest.mark.parametrize("size", [1, 7, 1000, 100003])
def test_cpu_psum_is_the_rank_order_fold_from_zero(cpu_devices, size):
  perm = [3, 0, 6, 1, 7, 2, 5, 4]                    # mesh position, not device id, is the rank
  mesh = Mesh(np.array(cpu_devices)[perm], ("r",))
  x = _wide((8, size), size)
  f = _smap(mesh, lambda v: lax.psum(v, "r"), "r")
  y = np.asarray(f(x.reshape(-1))).reshape(8, size)
  want = _fold(list(x), start=0.0)
  np.testing.assert_array_equal(y, np.broadcast_to(want, y.shape))       # every rank, this order
  np.testing.assert_array_equal(np.asarray(f(x.reshape(-1))).reshape(8, size), y)   # every run
  if size > 10:
    assert not np.array_equal(want, _fold(list(x[::-1]), start=0.0))    # the test has power


def test_cpu_psum_scatter_and_2d_mesh_follow_the_same_order(mesh):
  x = _wide((8, 16), 21)
  rs = _smap(mesh, lambda v: lax.psum_scatter(v, AX, scatter_dimension=0, tiled=True))
  y = np.asarray(rs(x.reshape(-1)))
  np.testing.assert_array_equal(y, _fold(list(x), start=0.0))
  inner = _smap(mesh, lambda v: lax.psum(v, "i"))(x.reshape(-1))
  got = np.asarray(inner).reshape(8, 16)
  for o in range(2):
    np.testing.assert_array_equal(got[4 * o], _fold(list(x[4 * o:4 * o + 4]), start=0.0))


def test_cpu_collective_semantics_dtenjax_corrects():
  """XLA:CPU's pmax drops NaN and a psum of -0.0 gives +0.0; if either flips, XLA changed."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("r",))
  x = np.array([[np.nan, 1.0, -0.0], [2.0, np.nan, -0.0], [0.0, 3.0, -0.0], [1.0, 0.0, -0.0]],
               np.float32)
  pm = np.asarray(_smap(mesh, lambda v: lax.pmax(v, "r"), "r")(x.reshape(-1)))[:3]
  ps = np.asarray(_smap(mesh, lambda v: lax.psum(v, "r"), "r")(x.reshape(-1)))[:3]
  np.testing.assert_array_equal(pm[:2], [2.0, 3.0])              # NaN dropped
  assert ps[2] == 0 and not np.signbit(ps[2])


def test_xla_record_uses_psum_where_the_order_is_fixed(mesh):
  x = jnp.asarray(_wide((8, 24), 2).reshape(-1))
  hlo = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="xla")).lower(x).compile().as_text()
  assert "all-reduce" in hlo and "all-gather" not in hlo
  call = base.Call("all_reduce", "sum", jnp.float32, AX, (2, 4), 96, backend="gpu")
  with _env(NCCL_NVLS_ENABLE=None):
    assert "NCCL_NVLS_ENABLE=0" in xla.ALGORITHM.why_not(call)
    assert xla.ALGORITHM.why_not(dataclasses.replace(call, op="max")) is None      # exact
    assert xla.ALGORITHM.why_not(dataclasses.replace(call, deterministic=False)) is None
  with _env(NCCL_NVLS_ENABLE="0"):
    assert xla.ALGORITHM.why_not(call) is None
  with _env(NCCL_NVLS_ENABLE="0", NCCL_TUNER_PLUGIN="libtuner.so"):
    assert "tuner plugin" in xla.ALGORITHM.why_not(call)
  gloo = dataclasses.replace(call, backend="cpu", processes=2)
  assert jax.config.jax_cpu_collectives_implementation == "gloo"
  assert "gloo ring" in xla.psum_order(gloo)[0]


@contextlib.contextmanager
def _env(**values):
  import os
  old = {k: os.environ.get(k) for k in values}
  for k, v in values.items():
    if v is None:
      os.environ.pop(k, None)
    else:
      os.environ[k] = v
  try:
    yield
  finally:
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v


# --- NaN, signed zeros and complex (issue 14, items 2 and 4) -------------------------------------

@pytest.mark.parametrize("algorithm", ALGOS + ("auto",))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_max_min_propagate_nan_with_every_algorithm(mesh, algorithm, dtype):
  x = np.zeros((8, 5), np.float32)
  x[3, 0] = np.nan                        # NaN at one rank
  x[0, 1] = np.nan                        # NaN at rank 0
  x[:, 2] = np.nan                        # all NaN
  x[:, 3] = [-0.0, 0.0] * 4               # signed zeros
  x[:, 4] = -np.arange(8)                 # no NaN
  f = _smap(mesh, lambda v: jnp.stack([all_reduce(v[0], AX, op="max", algorithm=algorithm),
                                       all_reduce(v[0], AX, op="min", algorithm=algorithm)])[None])
  y = np.asarray(f(jnp.asarray(x, dtype)).astype(jnp.float32))
  mx, mn = y[0, 0], y[0, 1]
  assert np.isnan(mx[:3]).all() and np.isnan(mn[:3]).all()
  assert mx[3] == 0 and not np.signbit(mx[3]) and mn[3] == 0 and np.signbit(mn[3])
  assert mx[4] == 0 and mn[4] == -7
  np.testing.assert_array_equal(y, np.broadcast_to(y[:1], y.shape))


def test_max_min_bits_are_the_same_for_every_algorithm(mesh):
  x = _wide((8, 40), 9)
  x[2, :5] = np.nan
  f = _smap(mesh, lambda v: jnp.stack([all_reduce(v[0], AX, op=op, algorithm=a)
                                       for a in ALGOS for op in ("max", "min")])[None])
  y = np.asarray(f(x)).view(np.uint32)[0]
  np.testing.assert_array_equal(y[0::2], np.broadcast_to(y[0], y[0::2].shape))
  np.testing.assert_array_equal(y[1::2], np.broadcast_to(y[1], y[1::2].shape))


@pytest.mark.parametrize("algorithm", ALGOS)
def test_complex_sum_is_two_float_folds(mesh, algorithm):
  re, im = _wide((8, 16), 31), _wide((8, 16), 32)
  z = (re + 1j * im).astype(np.complex64)
  y = np.asarray(_smap(mesh, lambda v: all_reduce(v[0], AX, algorithm=algorithm)[None])(z))[0]
  ry = np.asarray(_smap(mesh, lambda v: all_reduce(v[0], AX, algorithm=algorithm)[None])(re))[0]
  iy = np.asarray(_smap(mesh, lambda v: all_reduce(v[0], AX, algorithm=algorithm)[None])(im))[0]
  np.testing.assert_array_equal(y.real, ry)        # each part summed in the algorithm's order
  np.testing.assert_array_equal(y.imag, iy)


def test_complex_max_and_reproducible_are_rejected(mesh):
  z = jnp.ones((8, 4), jnp.complex64)
  with pytest.raises(errors.CollectiveError, match=r"op='max' on complex64 has no order"):
    _smap(mesh, lambda v: all_reduce(v, AX, op="max"))(z)
  with pytest.raises(errors.CollectiveError, match=r"float32 and bfloat16, got complex64"):
    _smap(mesh, lambda v: all_reduce(v, AX, reproducible=True))(z)


# --- the registry: auto ranks only what supports the call ---------------------------------------

def _call(**kw):
  base_kw = dict(kind="all_reduce", op="sum", dtype=jnp.float32, axes=("x",), axis_sizes=(8,),
                 nbytes=1 << 20, backend="cpu")
  base_kw.update(kw)
  return base.Call(**base_kw)


def test_auto_on_cpu_uses_xla_psum_from_8_kib_to_4_mib():
  for nbytes in (8 << 10, 64 << 10, 1 << 20, 4 << 20):
    ch = plan_all_reduce(nbytes, list(range(8)), axis_sizes=(2, 4))
    assert ch.algorithm == "xla", ch.reason
    assert {"xla", "one_shot", "two_shot", "ring", "hierarchical"} <= set(ch.times)
    assert not {"nvlink_one_shot", "nvlink_two_shot", "host_ring", "host_hierarchical"} & set(
        ch.times)


def _entry(hlo: str) -> str:
  """The entry computation of compiled HLO text, without metadata (names and locations)."""
  import re
  entry = hlo[hlo.index("ENTRY"):]
  return re.sub(r", metadata=\{[^}]*\}", "", entry)


@pytest.mark.parametrize("nbytes", [8 << 10, 4 << 20])
def test_auto_compiles_to_the_same_program_as_psum_on_cpu(mesh, nbytes):
  """auto >= psum by construction on CPU: the same executable (deterministic: XLA:CPU's order is
  the fixed rank-order fold, tested above)."""
  x = jnp.zeros((8 * nbytes // 4,), jnp.float32)
  psum = _smap(mesh, lambda v: lax.psum(v, AX) * 0.5).lower(x).compile().as_text()
  auto = _smap(mesh, lambda v: all_reduce(v, AX) * 0.5).lower(x).compile().as_text()
  assert _entry(auto) == _entry(psum)


def test_every_record_is_reachable_and_documents_its_order():
  names = [a.name for a in registry.REGISTRY]
  assert len(set(names)) == len(names)
  # a family takes its first record that supports the call: the kernels and the host transport
  # come before the XLA-native member of their family
  for special, native in (("nvlink_one_shot", "one_shot"), ("nvlink_two_shot", "two_shot"),
                          ("host_ring", "ring"), ("host_hierarchical", "hierarchical")):
    assert names.index(special) < names.index(native)
  assert registry.names()[:6] == ("auto", "xla", "ring", "hierarchical", "one_shot", "two_shot")
  for a in registry.REGISTRY:
    assert a.name in registry.names() and a.family in registry.FAMILIES and a.order
    assert isinstance(a.cost, costmodel.Cost) and registry.get(a.name) is a


def test_choose_lists_why_records_are_not_eligible():
  ch = registry.choose(_call(), list(range(8)), Topology.current())
  assert "nvlink_one_shot: the NVLink kernels run on GPUs" in ch.reason
  assert "host_ring: the axes do not span processes" in ch.reason
  assert "nvlink_one_shot" not in ch.times and "host_ring" not in ch.times


def test_xla_without_a_fixed_order_stands_in_with_the_one_shot_fold(mesh, monkeypatch):
  real_context = common.context
  monkeypatch.setattr(common, "context", lambda axes: real_context(axes)._replace(backend="gpu"))
  monkeypatch.setattr(nvlink, "p2p", FakeP2P())
  x = _wide((8, 16), 4)
  with _env(NCCL_NVLS_ENABLE=None):
    f = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="xla"))
    hlo = f.lower(x.reshape(-1)).compile().as_text()
    y = np.asarray(f(x.reshape(-1)))[:16]
  assert "all-gather" in hlo and " all-reduce(" not in hlo
  np.testing.assert_array_equal(y, _fold(list(x)))           # one_shot's order
  with _env(NCCL_NVLS_ENABLE="0"):
    hlo = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="xla")).lower(
        x.reshape(-1)).compile().as_text()
  assert "all-reduce" in hlo


def test_unsupported_explicit_record_names_the_reason_and_the_fix(mesh):
  with pytest.raises(errors.CollectiveError,
                     match=r"'nvlink_one_shot' cannot run.*run on GPUs.*'one_shot' or 'auto'"):
    _smap(mesh, lambda v: all_reduce(v, AX, algorithm="nvlink_one_shot"))(jnp.ones(8))
  with pytest.raises(errors.CollectiveError, match=r"'host_ring' cannot run.*do not span"):
    _smap(mesh, lambda v: all_reduce(v, AX, algorithm="host_ring"))(jnp.ones(8))


# --- the NVLink kernels, through a fake that enforces gpu/p2p.py's contract ---------------------

class FakeP2P:
  """The interface of dtenjax._src.gpu.p2p, with its contract enforced (what the real one
  rejects, this rejects), computing the collective with the caller's ``fallback`` (the real
  module lowers ``fallback`` when its set-up fails, so that path is exercised too)."""
  DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  OPS = ("sum", "mean", "max", "min")

  def __init__(self):
    self.calls = []

  def gate(self, *, world, dtype, op="sum", contract=Contract.NONE, algorithm="one_shot",
           backend="gpu", kind="all_reduce", axes=("x",), vmap_axes=(), contributions=1):
    problems = []
    if backend != "gpu":
      problems.append(f"the NVLink kernels run on GPUs, not {backend!r}")
    if kind != "all_reduce":
      problems.append(f"no {kind}")
    if len(axes) != 1:
      problems.append(f"one mesh axis only, got axis_name={tuple(axes)!r}")
    if algorithm not in ("one_shot", "two_shot"):
      problems.append(f"p2p algorithm {algorithm!r}")
    if not 1 <= world <= 8:
      problems.append(f"world size {world} is outside [1, 8]")
    if jnp.dtype(dtype) not in self.DTYPES:
      problems.append(f"dtype {jnp.dtype(dtype).name} is not float32, bfloat16 or float16")
    if op not in self.OPS:
      problems.append(f"op {op!r} is not one of {self.OPS}")
    if contract.reproducible and jnp.dtype(dtype) in self.DTYPES[2:]:
      problems.append("reproducible needs float32 or bfloat16")
    if contract.reproducible and op in ("max", "min"):
      problems.append(f"op {op!r} has no reproducible form")
    if contract.reproducible and contributions != 1:
      problems.append(f"{contributions} contributions on local_axis")
    if vmap_axes:
      problems.append(f"vmap axes {vmap_axes}")
    return p2p.Verdict(not problems, "; ".join(problems))

  def all_reduce(self, x, axis_name, *, algorithm, op, contract=Contract.NONE, fallback):
    if not isinstance(axis_name, str):
      raise errors.CollectiveError(f"p2p all_reduce takes one axis name, got {axis_name!r}")
    if not isinstance(contract, Contract):
      raise errors.CollectiveError(f"p2p all_reduce takes a Contract, got {contract!r}")
    world = int(lax.axis_size(axis_name))           # NameError when the axis is not bound
    verdict = self.gate(world=world, dtype=x.dtype, op=op, contract=contract,
                        algorithm=algorithm, axes=(axis_name,))
    if not verdict.ok:
      raise errors.CollectiveError(f"p2p all_reduce cannot run: {verdict.reason}")
    if not callable(fallback):
      raise TypeError("fallback must be callable")
    self.calls.append((axis_name, algorithm, op, contract.value if contract.reproducible
                       else False, jnp.dtype(x.dtype).name))
    return fallback(x)


@pytest.fixture
def fake_gpu(monkeypatch):
  fake = FakeP2P()
  monkeypatch.setattr(nvlink, "p2p", fake)          # the kernels' dispatch
  monkeypatch.setattr(price_records, "p2p", fake)   # their price records' gate (supports)
  real_context = common.context

  def on_gpu(axes):
    return real_context(axes)._replace(backend="gpu")
  monkeypatch.setattr(common, "context", on_gpu)
  return fake


def test_fake_p2p_rejects_what_the_real_one_rejects(monkeypatch):
  """The fake's gate against gpu/p2p.py's own, call for call, over worlds, dtypes, ops, every
  contract, contributions, axes, kinds and backends, with the real one told the kernels are
  built (on a machine without them it refuses everything, which says nothing about the rest)."""
  monkeypatch.setattr(p2p, "unavailable_reason", lambda: None)
  fake, accepted, asked = FakeP2P(), 0, 0
  for world in (0, 1, 2, 7, 8, 9, 16):
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64, jnp.int32, jnp.uint8):
      for op in ("sum", "mean", "max", "min", "prod"):
        for contract in Contract:
          for where in (dict(), dict(contributions=2), dict(axes=("a", "b")),
                        dict(kind="reduce_scatter"), dict(backend="cpu"),
                        dict(vmap_axes=("x",)), dict(algorithm="three_shot")):
            kw = dict(world=world, dtype=dtype, op=op, contract=contract, **where)
            want = p2p.gate(**kw)
            assert fake.gate(**kw).ok == want.ok, (kw, want.reason)
            accepted += want.ok
            asked += 1
  assert 0 < accepted < asked // 2                        # the grid holds both answers


def test_gpu_one_shot_and_two_shot_dispatch_to_p2p_with_the_contract_fallback(mesh, fake_gpu):
  x = _wide((4, 32), 41)
  for alg in ("one_shot", "two_shot"):
    for op in ("sum", "mean", "max"):
      y = np.asarray(_smap(mesh, lambda v: all_reduce(v, "i", op=op, algorithm=alg),
                           "i")(x.reshape(-1)))[:32]
      assert fake_gpu.calls == [("i", alg, op, False, "float32")]
      fake_gpu.calls.clear()
      # the fallback p2p lowers on a failed set-up is the p2p bit contract: rank-order fold
      want = {"sum": _fold(list(x)), "mean": _fold(list(x)) / np.float32(4),
              "max": x.max(0)}[op]
      np.testing.assert_array_equal(y, want)


def test_gpu_records_refuse_what_p2p_cannot_run(mesh, fake_gpu):
  # two axes, an int dtype: the kernels are not eligible, the XLA-native family member runs
  x = jnp.arange(8 * 4, dtype=jnp.int32)
  y = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="one_shot"))(x)
  assert fake_gpu.calls == [] and int(y[0]) == sum(range(0, 32, 4))
  call = _call(backend="gpu", dtype=jnp.int32)
  assert "int32" in nvlink.ONE_SHOT.why_not(call)
  assert "one mesh axis" in nvlink.ONE_SHOT.why_not(_call(backend="gpu", axes=AX,
                                                          axis_sizes=(2, 4)))
  assert "world size 16" in nvlink.ONE_SHOT.why_not(_call(backend="gpu", axis_sizes=(16,)))
  assert "local_axis" in nvlink.ONE_SHOT.why_not(_call(backend="gpu", contract=Contract.V3,
                                                       contributions=2))


def test_auto_never_picks_a_record_that_rejects_the_call(fake_gpu, monkeypatch):
  """On a GPU topology where the NVLink kernel is the cheapest record, auto (traced and
  plan_all_reduce) and the planner take it exactly when its supports() accepts the call: here a
  p2p that rejects op="mean", as the first kernel did."""
  real = fake_gpu.gate

  def no_mean(**kw):
    return p2p.Verdict(False, "op 'mean' is not supported") if kw["op"] == "mean" else real(**kw)
  monkeypatch.setattr(fake_gpu, "gate", no_mean)
  dgx = Topology.fixture("dgx_a100_8")
  monkeypatch.setattr(Topology, "current", classmethod(lambda cls: dgx))
  x = _wide((4, 64), 3).reshape(-1)
  m4 = Mesh(np.array(jax.devices("cpu")[:4]), ("i",))
  for op, kernel in (("sum", True), ("mean", False)):
    ch = plan_all_reduce(8 << 10, [0, 1, 2, 3], dgx, op=op, dtype=jnp.float32, backend="gpu")
    assert ch.algorithm.startswith("nvlink_") == kernel, ch.reason
    y = np.asarray(_smap(m4, lambda v, op=op: all_reduce(v, "i", op=op), "i")(x))
    assert (fake_gpu.calls != []) == kernel, fake_gpu.calls
    fake_gpu.calls.clear()
    want = x.reshape(4, 64).sum(0) if op == "sum" else x.reshape(4, 64).mean(0)
    np.testing.assert_allclose(y[:64], want, rtol=1e-5, atol=1e-5)
  assert "nvlink_one_shot: op 'mean' is not supported" in ch.reason


def test_gpu_reproducible_goes_to_the_fused_kernel_and_falls_back_to_the_same_bits(mesh,
                                                                                   fake_gpu):
  x = _wide((4, 64), 6).reshape(-1)
  m4 = Mesh(np.array(jax.devices("cpu")[:4]), ("i",))
  y = np.asarray(_smap(m4, lambda v: all_reduce(v, "i", algorithm="nvlink_two_shot",
                                                reproducible=True), "i")(x))
  assert fake_gpu.calls == [("i", "two_shot", "sum", "v3", "float32")]   # the call's contract
  want = np.asarray(_smap(m4, lambda v: all_reduce(v, "i", reproducible=True), "i")(x))
  np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))


# --- the host transport, through a fake that enforces net/hostcoll.py's contract ----------------

class FakeHostColl:
  """hostcoll's all_reduce contract (algorithms, ops, dtypes, axis shapes), computed with XLA."""
  DTYPES = hostcoll.DTYPES
  ALGORITHMS = hostcoll.ALGORITHMS

  def __init__(self):
    self.calls = []

  def all_reduce(self, x, axis_name, *, algorithm="ring", op="sum", tag=None, origin=None):
    axes = jaxapi.axis_tuple(axis_name)
    problems = []
    # origin: what the caller reduces when x is a widened form of it (a str, for the fingerprint)
    if not (origin is None or isinstance(origin, str)):
      problems.append(f"origin={origin!r}")
    # hostcoll.all_reduce's documented tags: None, an int in 0..2**32-1, a str, an int scalar
    if not (tag is None or isinstance(tag, str) or
            (isinstance(tag, int) and not isinstance(tag, bool) and 0 <= tag < 2**32) or
            (getattr(tag, "shape", None) == () and jnp.issubdtype(tag.dtype, jnp.integer))):
      problems.append(f"tag={tag!r}")
    if algorithm not in self.ALGORITHMS:
      problems.append(f"algorithm={algorithm!r}")
    if op not in hostcoll.ALL_OPS:
      problems.append(f"op={op!r}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in self.DTYPES]:
      problems.append(f"dtype {jnp.dtype(x.dtype).name}")
    if algorithm == "hierarchical" and len(axes) != 2:
      problems.append("hierarchical needs (outer, inner)")
    if problems:
      raise errors.CollectiveError(f"host all_reduce cannot run: {problems}")
    self.calls.append((axis_name, algorithm, op, jnp.dtype(x.dtype).name))
    red = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}[op]
    return red(x, axes)


@pytest.fixture
def fake_processes(monkeypatch):
  """Pretends the mesh spans 2 processes (4 devices each) and installs the fake transport."""
  fake = FakeHostColl()
  monkeypatch.setattr(host, "hostcoll", fake)
  real_context = common.context
  state = {"reaches": True}

  def two_processes(axes):
    return real_context(axes)._replace(processes=2,
                                       xla_reaches_processes=state["reaches"])
  monkeypatch.setattr(common, "context", two_processes)
  fake.state = state
  return fake


def test_explicit_ring_across_processes_uses_the_host_transport(mesh, fake_processes):
  x = jnp.asarray(_wide((8, 16), 8).reshape(-1))
  with pytest.raises(errors.CollectiveError, match=r"host_ring needs one device per process"):
    _smap(mesh, lambda v: all_reduce(v, AX, algorithm="host_ring"))(x)
  y = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="hierarchical"))(x)
  assert fake_processes.calls == [(AX, "hierarchical", "sum", "float32")]
  np.testing.assert_allclose(np.asarray(y)[:16], np.asarray(x).reshape(8, 16).sum(0),
                             rtol=1e-5, atol=1e-5)


def test_auto_keeps_arrays_off_the_host_transport_when_xla_reaches_the_processes(
    mesh, fake_processes):
  x = jnp.asarray(_wide((8, 16), 8).reshape(-1))
  hlo = _smap(mesh, lambda v: all_reduce(v, AX)).lower(x).as_text()
  assert fake_processes.calls == [] and "dtenjax_host_all_reduce" not in hlo
  fake_processes.state["reaches"] = False           # e.g. no cross-process CPU collectives
  _smap(mesh, lambda v: all_reduce(v, AX, op="max")).lower(x)
  assert fake_processes.calls == [(AX, "hierarchical", "max", "int32")]   # order keys


def test_host_reproducible_exchanges_codes_and_words(mesh, fake_processes):
  x = jnp.asarray(_wide((8, 16), 12).reshape(-1))
  y = _smap(mesh, lambda v: all_reduce(v, AX, algorithm="hierarchical",
                                       reproducible=True))(x)
  assert [c[2:] for c in fake_processes.calls] == [("max", "int32"), ("sum", "int32")]
  want = _smap(mesh, lambda v: all_reduce(v, AX, reproducible=True))(x)
  np.testing.assert_array_equal(np.asarray(y).view(np.uint32), np.asarray(want).view(np.uint32))
