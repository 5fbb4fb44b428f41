"""``reduce_scatter(algorithm="hierarchical")`` over ``(outer..., inner)``: the ownership of
``lax.psum_scatter`` over the same axes (checked against lax's result on integers, where sums are
exact), the documented order ``sum_o (sum_i x[o, i])`` (a numpy fold written from it, and the bits
of the hierarchical all-reduce's slice), max/min, ``reproducible=True`` against the numpy
reference of contract v3, the same bits without the XLA:CPU custom calls, gradients against
lax.psum_scatter's under ``check_vma=True``, its price derived by hand and its link bytes read from
the compiled program, and where ``auto`` picks it. One program per mesh for the bit matrix."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import dtenjax
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.collectives.plan_all_reduce import plan_all_reduce
from dtenjax._src.pricing import costmodel as cm
from dtenjax._src.topology.model import Topology
import fixed_point_ref as ref
from tests import helpers
from tests import test_costmodel as cmt
from tests.test_collectives import _kernels

# (mesh shape, axis names): the last axis is the island (inner) axis
MESHES = {"2x4": ((2, 4), ("o", "i")), "4x2": ((4, 2), ("o", "i")),
          "2x2x2": ((2, 2, 2), ("a", "b", "c"))}
BLOCK = (3, 5)          # each rank's block of a tiled input: [n * 3, 5]
DTYPES = (jnp.float32, jnp.bfloat16, jnp.int32)
OPS = ("sum", "max", "min")


def _mesh(cpu_devices, name):
  shape, axes = MESHES[name]
  return Mesh(np.array(cpu_devices[:math.prod(shape)]).reshape(shape), axes), axes


def _data(n, dtype, seed):
  """``[n ranks, n * 3, 5]``: wide-range floats (orders give different bits; a NaN for max/min),
  or small integers (every order of their sum is exact)."""
  if dtype == jnp.int32:
    return np.random.default_rng(seed).integers(-1000, 1000, (n, n * BLOCK[0], BLOCK[1]),
                                                dtype=np.int32)
  x = helpers.wide((n, n * BLOCK[0], BLOCK[1]), seed)
  return x.astype(ml_dtypes.bfloat16) if dtype == jnp.bfloat16 else x


def _documented_sum(x, outer: int, inner: int, dtype):
  """``sum_o (sum_i x[o, i])`` in float32 (each fold from its first term), rounded once to
  ``dtype``: the order docs/collectives.md states, written out in numpy."""
  rows = np.asarray(x).astype(np.float32).reshape((outer, inner) + x.shape[1:])
  parts = [helpers.fold(list(rows[o])) for o in range(outer)]
  return helpers.fold(parts).astype(np.asarray(x).dtype)


@pytest.mark.parametrize("name", list(MESHES))
def test_blocks_and_bits_every_dtype_op_and_tiling(cpu_devices, name):
  """Rank o*m + i gets block o*m + i: integer sums equal lax.psum_scatter's bits (tiled and
  untiled), float sums the documented order's and the hierarchical all-reduce's slice's, max and
  min the elementwise extreme (NaN wins)."""
  mesh, axes = _mesh(cpu_devices, name)
  n, inner = mesh.devices.size, mesh.devices.shape[-1]
  outer = n // inner
  names = [jnp.dtype(d).name for d in DTYPES]
  xs = {k: _data(n, d, seed=3 + i) for i, (k, d) in enumerate(zip(names, DTYPES))}
  for k in ("float32", "bfloat16"):
    xs[k][2, 4, 1] = np.nan                # rank 2's value at row 4: max and min propagate it
  untiled = lambda v: v.reshape(BLOCK[0], n, BLOCK[1])     # dimension 1 has the axis size

  def body(*vs):
    out = {}
    for k, v in zip(names, vs):
      v = v[0]
      for op in OPS:
        out[f"{k}:{op}:tiled"] = dtenjax.reduce_scatter(v, axes, tiled=True, op=op,
                                                        algorithm="hierarchical")
        out[f"{k}:{op}:untiled"] = dtenjax.reduce_scatter(
            untiled(v), axes, scatter_dimension=1, op=op, algorithm="hierarchical")
      if k == "int32":
        out[f"{k}:lax:tiled"] = lax.psum_scatter(v, axes, tiled=True)
        out[f"{k}:lax:untiled"] = lax.psum_scatter(untiled(v), axes, scatter_dimension=1)
      else:
        out[f"{k}:all_reduce"] = dtenjax.all_reduce(v, axes, algorithm="hierarchical")
    return {key: y[None] for key, y in out.items()}
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes),) * 3, out_specs=P(axes),
                            check_vma=False))
  got = {key: np.asarray(y) for key, y in f(*[jnp.asarray(xs[k]) for k in names]).items()}

  for k in names:
    x = xs[k]
    # NaN wins, as the largest key for max and the smallest (-NaN) for min (docs/collectives.md)
    full = {"max": np.max(x, axis=0), "min": np.min(x, axis=0)}
    full["min"] = np.where(np.isnan(full["min"]), -full["min"], full["min"])
    if k == "int32":
      full["sum"] = x.sum(axis=0, dtype=np.int32)
    else:
      full["sum"] = _documented_sum(x, outer, inner, x.dtype)
    for tiled in ("tiled", "untiled"):
      if k == "int32":
        np.testing.assert_array_equal(got[f"{k}:sum:{tiled}"], got[f"{k}:lax:{tiled}"],
                                      err_msg=f"{name} int32 {tiled}: vs lax.psum_scatter")
      for op in OPS:
        y = got[f"{k}:{op}:{tiled}"]
        for r in range(n):
          want = (full[op][r * BLOCK[0]:(r + 1) * BLOCK[0]] if tiled == "tiled"
                  else untiled(full[op])[:, r])
          np.testing.assert_array_equal(ref.bits(y[r]), ref.bits(want),
                                        err_msg=f"{name} {k} {op} {tiled} rank {r}")
    if k != "int32":   # the all-reduce's block r, bit for bit
      ar = got[f"{k}:all_reduce"][0].reshape(n, *BLOCK)
      np.testing.assert_array_equal(ref.bits(got[f"{k}:sum:tiled"]), ref.bits(ar),
                                    err_msg=f"{name} {k}: vs the all-reduce's slice")
      assert np.isnan(got[f"{k}:max:tiled"][4 // BLOCK[0], 4 % BLOCK[0], 1])


def test_without_the_custom_calls_the_bits_are_the_same(cpu_devices, monkeypatch):
  """DTENJAX_CPU_FFI=0 runs the jnp formulation (the one GPUs and vmap axes run): the same bits
  as the custom calls' folds and int32 sums, float32 sums (wide data) and reproducible words."""
  mesh, axes = _mesh(cpu_devices, "2x4")       # a fold of 4 in the island: its order shows
  x = jnp.asarray(_data(8, jnp.float32, 11))
  fns = lambda v: (dtenjax.reduce_scatter(v[0], axes, tiled=True, algorithm="hierarchical")[None],
                   dtenjax.reduce_scatter(v[0], axes, tiled=True, algorithm="hierarchical",
                                          reproducible=True)[None])
  run = lambda: [np.asarray(y) for y in helpers.smap(mesh, fns, axes)(x)]
  with_ffi = run()
  monkeypatch.setenv("DTENJAX_CPU_FFI", "0")
  without = run()
  for a, b in zip(with_ffi, without):
    np.testing.assert_array_equal(ref.bits(a), ref.bits(b))


def test_vmap_axes_and_the_mean(cpu_devices):
  """Over jax.vmap axes (the jnp formulation; lax.psum_scatter itself fails over two vmap
  axes in jax 0.10.2) the blocks are the sum's, in the combined axes' order; the mean has the
  hierarchical all-reduce's mean's bits."""
  xi = np.random.default_rng(5).integers(-100, 100, (2, 4, 16, 3), dtype=np.int32)
  rs = lambda e: dtenjax.reduce_scatter(e, ("a", "b"), tiled=True, algorithm="hierarchical")
  got = jax.jit(jax.vmap(jax.vmap(rs, axis_name="b"), axis_name="a"))(xi)
  want = xi.reshape(8, 16, 3).sum(0).reshape(2, 4, 2, 3)        # [a, b]: block a*4 + b
  np.testing.assert_array_equal(got, want)
  mesh, axes = _mesh(cpu_devices, "2x4")
  x = jnp.asarray(_data(8, jnp.float32, 9))
  mean, ar = helpers.smap(mesh, lambda v: (
      dtenjax.reduce_scatter(v[0], axes, tiled=True, op="mean", algorithm="hierarchical")[None],
      dtenjax.all_reduce(v[0], axes, op="mean", algorithm="hierarchical")[None]), axes)(x)
  np.testing.assert_array_equal(ref.bits(np.asarray(mean).reshape(-1)),
                                ref.bits(np.asarray(ar)[0].reshape(-1)))


@pytest.mark.skipif(not ffi.is_built(),
                    reason="the native extension is not built (bash scripts/setup.sh builds it)")
def test_on_xla_cpu_it_compiles_the_kernels_lax_psum_scatter_compiles(cpu_devices):
  """On XLA:CPU the chunks the inner all-to-all sends, both folds (float32) and both int32 sums
  are custom calls: the program compiles no more kernels than lax.psum_scatter's (none)."""
  mesh, axes = _mesh(cpu_devices, "2x4")

  def compiled(f, dtype):
    x = jax.ShapeDtypeStruct((8 * 4096,), dtype)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    return g.lower(x).compile(helpers.DEFAULT_CPU_EMITTERS).as_text()
  anchor = _kernels(compiled(lambda v: lax.psum_scatter(v, axes, tiled=True), jnp.float32))
  for dtype, target in ((jnp.float32, "dtenjax_cpu_fold"), (jnp.int32, "dtenjax_cpu_ring_step")):
    ours = compiled(lambda v: dtenjax.reduce_scatter(v, axes, tiled=True,
                                                     algorithm="hierarchical"), dtype)
    assert target in ours and "dtenjax_cpu_unpack" in ours
    assert _kernels(ours) <= anchor, (jnp.dtype(dtype).name, _kernels(ours), anchor)


@pytest.mark.parametrize("devices,shape", [(4, (2, 2)), (8, (2, 4))])
def test_reproducible_is_contract_v3_for_any_device_count(cpu_devices, devices, shape):
  """reproducible=True gives rank r the contract-v3 sum (and mean) of every rank's block r: the
  numpy reference of the contract (tests/fixed_point_ref.py) on its adversarial columns (NaN,
  infinities, -0, subnormals, cancellations), for 4 and 8 devices."""
  mesh = Mesh(np.array(cpu_devices[:devices]).reshape(shape), ("o", "i"))
  g = ref.contributions(devices, devices * 12, seed=17)       # rank r owns columns 12r..12r+11
  outs = helpers.smap(mesh, lambda v: tuple(dtenjax.reduce_scatter(
      v[0], ("o", "i"), tiled=True, op=op, algorithm="hierarchical", reproducible=True)[None]
      for op in ("sum", "mean")))(g)
  for op, y in zip(("sum", "mean"), outs):
    np.testing.assert_array_equal(ref.bits(np.asarray(y).reshape(-1)),
                                  ref.bits(ref.reproducible_sum(g, mean=op == "mean")),
                                  err_msg=f"{devices} devices {op}")


def test_gradient_is_lax_psum_scatter_s_under_check_vma(cpu_devices):
  """jax.grad through the collective inside jax.shard_map (check_vma=True, the default): the
  transpose is an all-gather of the cotangent, as lax.psum_scatter's. The loss weighs every
  output element differently, so the gradient (a copy of the weights, no rounding) shows where
  each block went, bit for bit."""
  mesh, axes = _mesh(cpu_devices, "2x2x2")
  rng = np.random.default_rng(21)
  x = jnp.asarray(rng.standard_normal((8, 8 * BLOCK[0], BLOCK[1])), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8,) + BLOCK), jnp.float32)   # rank r's output's weights

  def grad(rs):
    def loss(v):
      body = lambda u, ww: (rs(u[0]) * ww[0])[None]
      return jnp.sum(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P(axes)),
                                   out_specs=P(axes))(v, w))
    return np.asarray(jax.jit(jax.grad(loss))(x))
  ours = grad(lambda u: dtenjax.reduce_scatter(u, axes, tiled=True, algorithm="hierarchical"))
  theirs = grad(lambda u: lax.psum_scatter(u, axes, tiled=True))
  np.testing.assert_array_equal(theirs[3], np.asarray(w).reshape(8 * BLOCK[0], BLOCK[1]))
  np.testing.assert_array_equal(ours, theirs)


def test_empty_blocks_give_empty_blocks_as_lax_psum_scatter(cpu_devices):
  """A leaf with no values in its blocks (``[8, 0]`` scattered along dimension 0) gives each
  rank an empty block of lax.psum_scatter's shape, for the float32 fold and the int32 sum (the
  XLA:CPU custom calls' dtypes) and the sum in bfloat16 (the jnp formulation)."""
  mesh, axes = _mesh(cpu_devices, "2x4")
  for dtype in (jnp.float32, jnp.int32, jnp.bfloat16):
    x = jnp.zeros((8, 8, 0), dtype)
    f = lambda rs: np.asarray(helpers.smap(mesh, lambda v: rs(v[0])[None], axes)(x))
    ours = f(lambda v: dtenjax.reduce_scatter(v, axes, tiled=True, algorithm="hierarchical"))
    theirs = f(lambda v: lax.psum_scatter(v, axes, tiled=True))
    assert ours.shape == theirs.shape == (8, 1, 0) and ours.dtype == theirs.dtype, (
        jnp.dtype(dtype).name, ours.shape, theirs.shape)


def test_bad_inputs_name_the_value(cpu_devices):
  mesh, axes = _mesh(cpu_devices, "2x4")
  x = jnp.zeros((8, 8, 2))
  cases = (
      (lambda v: dtenjax.reduce_scatter(v[0], "i", tiled=True, algorithm="hierarchical"),
       r"two mesh axes.*axis_name=\('i',\)"),
      (lambda v: dtenjax.reduce_scatter(v[0, :6], axes, tiled=True, algorithm="hierarchical"),
       r"size 6 is not divisible by the size 8.*pad it"),
      (lambda v: dtenjax.reduce_scatter(v[0, :, :1], axes, scatter_dimension=1,
                                        algorithm="hierarchical"),
       r"tiled=False dimension 1 must have the size 8 .*got 1; pass tiled=True"),
  )
  for f, match in cases:
    with pytest.raises(errors.CollectiveError, match=match):
      helpers.smap(mesh, lambda v, f=f: f(v)[None], axes)(x)


# --- price ------------------------------------------------------------------------------------

def test_price_derived_by_hand():
  """4 hosts of 8 GPUs (roce_a100_4x8), N bytes per rank: an all-to-all of N inside the host
  ((8-1)/8 N over NVLink, one latency: peers are read in parallel), an all-to-all of the host's
  N/8 across the 4 hosts ((4-1)/4 of it over RoCE, a latency per peer host), two folds, the local
  traffic 2N + 2N/8 at the local bandwidth."""
  roce = cmt.ROCE
  N = 64 << 20
  L, Pass = 18e-6, 4e-6                                      # GPU's fixed costs (cmt.GPU)
  nv_a, nv_b = 2.5e-6, 1 / 300e9
  ro_a, ro_b = 5e-6, 1 / 12.5e9
  local_b = 1 / 2000e9
  want = ((L + nv_a + 7 / 8 * N * nv_b) + (L + 3 * ro_a + 3 / 4 * (N / 8) * ro_b) + 2 * Pass +
          (2 * N + 2 * N / 8) * local_b)
  got = cm.collective_time("reduce_scatter", N, list(range(32)), roce,
                           registry.get("hierarchical").cost, costs=cmt.GPU)
  assert got == pytest.approx(want, rel=1e-12)
  # the first half of the hierarchical all-reduce: never dearer than it
  assert got < cm.collective_time("all_reduce", N, list(range(32)), roce,
                                  registry.get("hierarchical").cost, costs=cmt.GPU)
  assert registry.get("hierarchical").price.has_reduce_scatter
  # one island: no hierarchy to exploit
  assert cm.collective_time("reduce_scatter", N, list(range(8)), cmt.DGX,
                            registry.get("hierarchical").cost, costs=cmt.GPU) == math.inf


def test_each_link_carries_what_the_compiled_program_sends(cpu_devices):
  """Mesh (2, 4) as two hosts of four: the bytes the compiled program's collectives receive
  inside and across the hosts are the formula's NVLink and RoCE bytes; across the hosts only the
  island's 1/4 of the input travels, half of it leaving (two hosts)."""
  n_bytes = cmt.N
  module = cmt._compiled(cpu_devices, lambda v: dtenjax.reduce_scatter(
      v, ("o", "i"), tiled=True, algorithm="hierarchical"), (8 * (n_bytes // 4),))
  across, inside = cmt._split_by_host(module)
  assert across == pytest.approx(1 / 2 * n_bytes / 4)
  assert inside == pytest.approx(3 / 4 * n_bytes)
  cost = registry.get("hierarchical").cost
  assert cmt._d("reduce_scatter", cost, cmt.HOSTS2, cmt.ROCE, "roce", "bytes") == \
      pytest.approx(across)
  assert cmt._d("reduce_scatter", cost, cmt.HOSTS2, cmt.ROCE, "nvlink", "bytes") == \
      pytest.approx(inside)


def test_with_the_island_axis_not_last_it_is_priced_by_the_levels_it_runs_on(cpu_devices):
  """axis_name=("i", "o") on mesh (2, 4) as two hosts of four: the schedule's first stage runs
  over the last axis, here the host axis, so the compiled program sends half the input across
  the hosts (the island schedule: 1/8). Without the call's axes such a group (its islands not
  runs of consecutive ranks) has no island price; with them (a call, ``plan_all_reduce``), the
  levels are the axes: across 4 hosts of 8 GPUs, axes ("local", "host") run the first stage over
  the 4 hosts (3/4 of N over RoCE, a latency per peer host) and the second inside one (7/8 of
  N/4 over NVLink), dearer than the island order, derived by hand."""
  n_bytes = cmt.N
  module = cmt._compiled(cpu_devices, lambda v: dtenjax.reduce_scatter(
      v, ("i", "o"), tiled=True, algorithm="hierarchical"), (8 * (n_bytes // 4),))
  across, inside = cmt._split_by_host(module)
  assert across == pytest.approx(1 / 2 * n_bytes)
  assert inside == pytest.approx(3 / 4 * n_bytes / 2)   # the second stage: 3/4 of the half kept
  cost = registry.get("hierarchical").cost
  transposed = [cmt.HOSTS2[o * 4 + i] for i in range(4) for o in range(2)]
  # with the call's last axis (the 2 hosts) the formula's links carry what the program sends
  for link, got in (("roce", across), ("nvlink", inside)):
    assert cmt._d("reduce_scatter", cost, transposed, cmt.ROCE, link, "bytes", inner=2) == \
        pytest.approx(got), link
  for kind in ("reduce_scatter", "all_reduce"):
    assert cm.collective_time(kind, n_bytes, transposed, cmt.ROCE, cost,
                              costs=cmt.GPU) == math.inf, kind
    assert cm.collective_time(kind, n_bytes, cmt.HOSTS2, cmt.ROCE, cost,
                              costs=cmt.GPU) < math.inf, kind
  nvls = dataclasses.replace(Topology.fixture("roce_a100_4x8"), nvls=True)
  group = [h * 8 + d for d in range(8) for h in range(4)]
  N = 64 << 20
  L, Pass, nv_a, nv_b, ro_a, ro_b, local_b = _GPU_TERMS
  want = ((L + 3 * ro_a + 3 / 4 * N * ro_b) + (L + nv_a + 7 / 8 * (N / 4) * nv_b) + 2 * Pass +
          (2 * N + 2 * N / 4) * local_b)
  ch = plan_all_reduce(N, group, nvls, kind="reduce_scatter", axis_sizes=(8, 4))
  assert ch.times["hierarchical"] == pytest.approx(want, rel=1e-12)
  island_order = plan_all_reduce(N, list(range(32)), nvls, kind="reduce_scatter",
                                 axis_sizes=(4, 8))
  assert island_order.times["hierarchical"] < want / 2


# GPU's fixed costs (cmt.GPU), NVLink's and RoCE's links of roce_a100_4x8, the local bandwidth
_GPU_TERMS = (18e-6, 4e-6, 2.5e-6, 1 / 300e9, 5e-6, 1 / 12.5e9, 1 / 2000e9)


def test_an_inner_axis_smaller_than_the_island_leaves_island_mates_in_the_outer_stage():
  """4 hosts of 8 GPUs, axes (8, 4): the first stage runs inside runs of 4 GPUs of one host
  (3/4 of N over NVLink), the second over 8 ranks, two per host: its all-to-all sends each of
  the 7 peers N/4/8, the one on the rank's host over NVLink (one latency), the 6 others over
  RoCE (a latency each). Before wire17 all 7 chunks were priced on RoCE, the stage's slowest
  link (7 RoCE latencies, 7/8 of N/4 over RoCE: 0.151 ms of RoCE bytes where 0.134 ms are).
  Priced by the islands (8 per host, as without the call's axes) the second stage would move
  3/4 of N/8: less than half the bytes it sends. The all-reduce's second stage is an all-gather,
  a ring whose every step waits for its RoCE hop: all 7 chunks on RoCE."""
  nvls = dataclasses.replace(Topology.fixture("roce_a100_4x8"), nvls=True)
  N = 64 << 20
  L, Pass, nv_a, nv_b, ro_a, ro_b, local_b = _GPU_TERMS
  want = ((L + nv_a + 3 / 4 * N * nv_b) + (L + nv_a + 6 * ro_a + N / 32 * (nv_b + 6 * ro_b)) +
          2 * Pass + (2 * N + 2 * N / 4) * local_b)
  ch = plan_all_reduce(N, list(range(32)), nvls, kind="reduce_scatter", axis_sizes=(8, 4))
  assert ch.times["hierarchical"] == pytest.approx(want, rel=1e-12)
  # the RoCE bytes: 6 chunks of N/32 on the call's axes, 3/4 of N/8 by the islands (half)
  cost = registry.get("hierarchical").cost
  assert cmt._d("reduce_scatter", cost, list(range(32)), nvls, "roce", "bytes", N,
                inner=4) == pytest.approx(6 * N / 32)
  assert cmt._d("reduce_scatter", cost, list(range(32)), nvls, "roce", "bytes", N) == \
      pytest.approx(3 / 4 * N / 8)
  assert cmt._d("reduce_scatter", cost, list(range(32)), nvls, "roce", "latency", N,
                inner=4) == pytest.approx(6)
  # the all-reduce: the same two levels, the outer one-shot of N/4 over 8 ranks
  want_ar = (2 * (L + nv_a + 3 / 4 * N * nv_b) + (L + 7 * ro_a + 7 * (N / 4) * ro_b) + 2 * Pass +
             (3 * N + 2 * 8 * N / 4) * local_b)
  ar = plan_all_reduce(N, list(range(32)), nvls, kind="all_reduce", axis_sizes=(8, 4))
  assert ar.times["hierarchical"] == pytest.approx(want_ar, rel=1e-12)
  # inside one island there is no slow link to spare, whatever the axes
  one_host = dataclasses.replace(Topology.fixture("dgx_a100_8"), nvls=True)
  for kind in ("reduce_scatter", "all_reduce"):
    ch = plan_all_reduce(N, list(range(8)), one_host, kind=kind, axis_sizes=(2, 4))
    assert ch.times["hierarchical"] == math.inf, (kind, ch.times)


def test_the_reproducible_codes_max_is_xla_s_whatever_the_call_s_axes():
  """The reproducible sum's MAX of the codes is XLA's own all-reduce (``lax.pmax`` over every
  axis), which runs by the islands, not by the call's axes: with axes (8, 4) over 4 hosts of 8
  (float32, contract v3: 4-byte words) the price is the MAX of E = N/4 one-byte codes by
  XLA's island rings (8 over NVLink, then 4 over RoCE on E/8, twice: an all-reduce), the
  hierarchical all-reduce of the N bytes of words on the call's axes, two passes and the 2N
  bytes converted (codes, then words); the reduce-scatter likewise. Priced with the call's axes the MAX would send 7/8 of E/4
  over RoCE instead of 3/4 of E/8."""
  nvls = dataclasses.replace(Topology.fixture("roce_a100_4x8"), nvls=True)
  N = 64 << 20
  E = N / 4
  L, Pass, nv_a, nv_b, ro_a, ro_b, local_b = _GPU_TERMS
  f = 1 / 500e9                                              # cmt.GPU's fixed_point_gbps
  codes = L + 2 * (7 * nv_a + 7 / 8 * E * nv_b) + 2 * (3 * ro_a + 3 / 4 * (E / 8) * ro_b) + (
      2 * E * local_b)
  words = (2 * (L + nv_a + 3 / 4 * N * nv_b) + (L + 7 * ro_a + 7 * (N / 4) * ro_b) + 2 * Pass +
           (3 * N + 2 * 8 * N / 4) * local_b)
  want = codes + words + 2 * Pass + 2 * N * f
  got = cm.collective_time("all_reduce", N, list(range(32)), nvls,
                           registry.get("hierarchical").cost, reproducible="v3", costs=cmt.GPU,
                           inner=4)
  assert got == pytest.approx(want, rel=1e-12)
  # the reduce-scatter: the same MAX, the words scattered on the call's axes, the block decoded
  # (the outer all-to-all: one of the 7 peers on the rank's host, over NVLink)
  words_rs = ((L + nv_a + 3 / 4 * N * nv_b) + (L + nv_a + 6 * ro_a + N / 32 * (nv_b + 6 * ro_b)) +
              2 * Pass + (2 * N + 2 * N / 4) * local_b)
  want_rs = codes + words_rs + 2 * Pass + (N + N / 32) * f
  got_rs = cm.collective_time("reduce_scatter", N, list(range(32)), nvls,
                              registry.get("hierarchical").cost, reproducible="v3", costs=cmt.GPU,
                              inner=4)
  assert got_rs == pytest.approx(want_rs, rel=1e-12)


def test_auto_keeps_xla_on_cpu_and_picks_hierarchical_across_hosts_without_a_pinned_order(
    cpu_devices):
  """On 8 CPU devices (one island) hierarchical has no price and auto compiles to
  lax.psum_scatter's program; across 4 hosts of 8 GPUs, deterministic=True with NCCL's order
  not pinned (NVLink SHARP on: xla is not eligible), it is the cheapest record."""
  for sizes in ((2, 4), (4, 2)):
    assert plan_all_reduce(1 << 20, list(range(8)), kind="reduce_scatter",
                           axis_sizes=sizes).algorithm == "xla"
  mesh, axes = _mesh(cpu_devices, "2x4")
  x = jnp.zeros((8 * 4096,), jnp.float32)

  def ops(f):   # the entry's instructions but its parameters and bitcasts (views, no work)
    entry = helpers.smap(mesh, f, axes).lower(x).compile().as_text().split("ENTRY")[1]
    return [op for op in re.findall(r"= \S+ ([\w-]+)\(", entry)
            if op not in ("parameter", "bitcast")]
  assert ops(lambda v: dtenjax.reduce_scatter(v, axes, tiled=True)) == \
      ops(lambda v: lax.psum_scatter(v, axes, tiled=True)) == ["reduce-scatter"]
  nvls = dataclasses.replace(Topology.fixture("roce_a100_4x8"), nvls=True)
  for nbytes in (64 << 10, 64 << 20):
    ch = plan_all_reduce(nbytes, list(range(32)), nvls, kind="reduce_scatter", axis_sizes=(4, 8))
    assert ch.algorithm == "hierarchical", ch.reason
    assert ch.times["hierarchical"] < ch.times["two_shot"] / 2
