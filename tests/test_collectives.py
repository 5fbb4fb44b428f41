"""The public collectives end to end: pytrees, jit/eager, gradients, vmap, reproducible modes
(contract v3 and the exact contract v2 against the independent references in
tests/fixed_point_ref.py), errors."""

import pathlib
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import ml_dtypes

import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import dtenjax
from dtenjax._src import errors
from dtenjax._src.collectives import fixed_point
import fixed_point_ref as ref
from tests import helpers

AX = ("o", "i")
ALGOS = ("xla", "ring", "one_shot", "two_shot", "hierarchical")


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), AX)


_smap = helpers.smap     # over AX


def _normal(seed, shape, dtype=jnp.float32):
  """Standard normal test data made on the host: an eager jax.random.normal is a program
  compiled per shape (0.3-1 s of CPU each, some twenty shapes in this file)."""
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def _rows(seed=0, m=6):
  return _normal(seed, (8, m))


_SINGLETONS = re.compile(r"replica_groups = dense<\[\[\d+\](, \[\d+\])*\]>")


def _count(hlo: str, op: str) -> int:
  return len(re.findall(rf" {op}(-start)?\(", hlo))


# --- API --------------------------------------------------------------------------------------------

def test_pytree_all_reduce_buckets_and_matches_per_leaf(mesh):
  tree = {"w": _rows(1, 12), "b": _rows(2, 3), "n": jnp.arange(8, dtype=jnp.int32)[:, None]}
  spec = {"w": P(AX), "b": P(AX), "n": P(AX)}

  def build(bucket_bytes):
    body = lambda t: dtenjax.all_reduce(t, AX, algorithm="one_shot", bucket_bytes=bucket_bytes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec,
                                 check_vma=False))
  fused, single = build(1 << 20), build(0)
  a, b = fused(tree), single(tree)
  chex.assert_trees_all_equal(a, b)                 # bucketing does not change bits
  np.testing.assert_allclose(a["w"][0], tree["w"].sum(0), rtol=1e-5, atol=1e-5)
  assert int(a["n"][0, 0]) == 28
  # the two f32 leaves share one bucket, the int leaf has its own: 2 gathers instead of 3
  assert _count(fused.lower(tree).compile().as_text(), "all-gather") == 2
  assert _count(single.lower(tree).compile().as_text(), "all-gather") == 3


def test_a_tree_on_xla_collectives_is_left_to_xla_s_combiner(mesh):
  """Where the buckets would run on XLA's own all-reduce (``auto`` on CPU, ``xla``), dtenjax
  does not pack them: XLA combines the leaves' all-reduces itself, so the program is the one
  ``lax.psum`` of the tree compiles to (no copy into a bucket and out of it, which is a compiled
  kernel per leaf: bench/compile_time.py), one collective for the tree, the bits of the bucket
  and of leaf by leaf, and the gradient of lax.psum."""
  tree = [_normal(30 + i, (8, 3 + i)) for i in range(6)]

  def build(body, bucket_bytes=None):
    return jax.jit(jax.shard_map(lambda t: body(t, bucket_bytes), mesh=mesh, in_specs=(P(AX),),
                                 out_specs=P()))
  ours = lambda t, b: dtenjax.all_reduce(t, AX, algorithm="auto", bucket_bytes=b)
  theirs = lambda t, _: jax.lax.psum(t, AX)
  f, per_leaf, psum = build(ours), build(ours, 0), build(theirs)
  hlo = f.lower(tree).compile().as_text()
  assert _count(hlo, "all-reduce") == 1, hlo
  assert _count(hlo, "fusion") <= _count(psum.lower(tree).compile().as_text(), "fusion")
  assert "concatenate(" not in hlo
  chex.assert_trees_all_equal(f(tree), per_leaf(tree))
  chex.assert_trees_all_close(f(tree), psum(tree), rtol=1e-6, atol=1e-6)
  loss = lambda g: jax.jit(jax.grad(lambda t: sum(jnp.sum(jnp.sin(y)) for y in g(t))))
  chex.assert_trees_all_close(loss(f)(tree), loss(psum)(tree), rtol=1e-6, atol=1e-6)


def _kernels(hlo: str) -> int:
  """The distinct kernels XLA compiles (bench/compile_time.py's count)."""
  import importlib
  import sys
  bench = str(pathlib.Path(__file__).resolve().parents[1] / "bench")
  if bench not in sys.path:
    sys.path.insert(0, bench)
  return importlib.import_module("compile_time")._kernels(hlo)


@pytest.mark.parametrize("kwargs", ({"algorithm": "two_shot"}, {"reproducible": True}),
                         ids=("two_shot", "reproducible"))
def test_a_bucket_compiles_a_kernel_per_leaf_shape_not_per_leaf(mesh, kwargs):
  """XLA compiles a kernel per distinct fused computation (XLA:CPU: an LLVM module each, tens of
  ms): copies out of a bucket at constant offsets were one per leaf, 10x psum's compile time for
  a 60-leaf tree (bench/compile_time.py). With run-time offsets, a tree of 4 blocks compiles the
  kernels of a tree of 1 block of the same shapes (lax.psum's tree compiles no kernel at all,
  and XLA reuses a kernel per shape for per-leaf work such as an update). The bits are leaf by
  leaf's (test_pytree_all_reduce_buckets_and_matches_per_leaf, the stacked buckets' test)."""
  f = jax.jit(jax.shard_map(lambda t: dtenjax.all_reduce(t, AX, **kwargs), mesh=mesh,
                             in_specs=(P(AX),), out_specs=P()))
  small, big = helpers.block_tree(1), helpers.block_tree(4)
  kernels = {n: _kernels(f.lower(t).compile().as_text()) for n, t in ((6, small), (24, big))}
  assert kernels[24] <= kernels[6], kernels          # (6 leaves need padding, 24 do not)


@pytest.mark.parametrize("algorithm", ("xla", "one_shot"))
def test_stacked_contributions_are_bucketed_with_the_same_bits_and_gradients(mesh, algorithm):
  """``local_axis`` leaves (a reproducible step's per-micro-batch gradients) share buckets of
  [contributions, values]: fewer collectives, the bits and the gradient of reducing leaf by leaf,
  under plain ``jax.shard_map`` (check_vma=True)."""
  tree = {"w": _normal(70, (24, 4, 5)), "b": _normal(71, (24, 7)), "s": _normal(72, (24,))}

  def build(bucket_bytes):
    body = lambda t: dtenjax.all_reduce(t, AX, op="mean", algorithm=algorithm, reproducible=True,
                                        local_axis=0, bucket_bytes=bucket_bytes)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX),), out_specs=P()))
  bucketed, per_leaf = build(1 << 20), build(0)

  def step(f):      # the values and their gradient in one program, as a training step has them
    loss = lambda t: (lambda y: (sum(jnp.sum(jnp.sin(v)) for v in jax.tree.leaves(y)), y))(f(t))
    (_, values), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(tree)
    return values, grad
  (a, grad_a), (b, grad_b) = step(bucketed), step(per_leaf)
  chex.assert_trees_all_equal(a, b)
  for k, v in tree.items():     # the mean of all 24 contributions, rounded once
    np.testing.assert_allclose(a[k], np.asarray(v, np.float64).mean(0), rtol=1e-6, atol=1e-7)
  # The collectives the step asks for (XLA may combine per-leaf ones later, not the encodes),
  # not counting all-reduces over groups of one device (they move nothing: base.opaque).
  count = lambda f: len([line for line in f.lower(tree).as_text().splitlines()
                         if re.search(r"stablehlo\.(all_gather|all_reduce|all_to_all)\b", line)
                         and not _SINGLETONS.search(line)])
  assert count(bucketed) < count(per_leaf), (count(bucketed), count(per_leaf))
  chex.assert_trees_all_equal(grad_a, grad_b)


def test_eager_and_jit_agree_and_do_not_retrace(mesh):
  x = _rows(3)

  @chex.assert_max_traces(n=1)
  def body(v):
    return dtenjax.all_reduce(v, AX, algorithm="two_shot")
  f = _smap(mesh, body)
  y1, _ = f(x), f(x + 1.0)
  eager = _smap(mesh, lambda v: dtenjax.all_reduce(v, AX, algorithm="two_shot"), jit=False)(x)
  np.testing.assert_array_equal(y1, eager)


@pytest.mark.parametrize("algorithm", ["ring", "xla", "auto"])
def test_check_vma_true_with_varying_out_specs(mesh, algorithm):
  x = _rows(4)
  y = _smap(mesh, lambda v: dtenjax.all_reduce(v, AX, algorithm=algorithm), check_vma=True)(x)
  np.testing.assert_allclose(y[3], x.sum(0), rtol=1e-5, atol=1e-5)


def test_reduce_scatter_and_all_gather(mesh):
  x = _normal(5, (8, 16, 3))
  rs = {a: _smap(mesh, lambda v, a=a: dtenjax.reduce_scatter(v[0], AX, scatter_dimension=0,
                                                             tiled=True, algorithm=a)[None])(x)
        for a in ("ring", "one_shot", "two_shot", "xla", "auto")}
  want = x.sum(0).reshape(8, 2, 3)
  for a, y in rs.items():
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=a)
  np.testing.assert_array_equal(rs["one_shot"], rs["two_shot"])   # same rank order
  g = _smap(mesh, lambda v: dtenjax.all_gather(v, AX, axis=1, tiled=True, algorithm="ring"))(x)
  assert g.shape == (8, 128, 3)
  np.testing.assert_array_equal(g[5], jnp.concatenate(list(x), axis=0))
  s = _smap(mesh, lambda v: dtenjax.all_gather(v[0], AX, axis=0)[None])(x)
  np.testing.assert_array_equal(s[2], x)


# --- derivatives: per-device outputs, transposes ------------------------------------------------

def _weights():
  return jnp.arange(1.0, 9.0)[:, None]   # rank r's output is weighted by r+1


@pytest.mark.parametrize("algorithm", ["ring", "one_shot", "xla"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_all_reduce_grad_matches_reference(mesh, algorithm, op):
  x = _rows(6).at[2, 1].set(5.0).at[6, 1].set(5.0)   # a tie for max
  w = _weights()

  def loss(v):
    y = jax.shard_map(lambda u, ww: dtenjax.all_reduce(u, AX, op=op, algorithm=algorithm) * ww,
                      mesh=mesh, in_specs=(P(AX), P(AX)), out_specs=P(AX), check_vma=False)(v, w)
    return jnp.sum(jnp.sin(y))

  def want(v):
    r = {"sum": v.sum(0), "mean": v.mean(0), "max": v.max(0)}[op]
    return jnp.sum(jnp.sin(r[None] * w))
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(want)(x), rtol=1e-4,
                             atol=1e-5)


def test_backward_pass_runs_the_same_algorithm(mesh):
  x, w = _rows(7), _weights()
  for alg, op in (("ring", "collective-permute"), ("two_shot", "all-to-all")):
    loss = lambda v: jnp.sum(jnp.sin(_smap(mesh, lambda u: dtenjax.all_reduce(
        u, AX, algorithm=alg))(v)) * w)
    hlo = jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    fwd = jax.jit(lambda v: _smap(mesh, lambda u: dtenjax.all_reduce(u, AX, algorithm=alg))(v)
                  ).lower(x).compile().as_text()
    assert _count(hlo, op) == 2 * _count(fwd, op) > 0, alg


def test_forward_mode_is_refused_clearly(mesh):
  f = _smap(mesh, lambda u: dtenjax.all_reduce(u, AX))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(f, (_rows(7),), (_rows(8),))


def test_reduce_scatter_and_all_gather_transpose_into_each_other(mesh):
  x = _normal(9, (8, 16))
  ct = _normal(10, (8, 2))
  rs = lambda v: _smap(mesh, lambda u: dtenjax.reduce_scatter(u, AX, scatter_dimension=1,
                                                              tiled=True, algorithm="ring"))(v)
  _, vjp = jax.vjp(rs, x)
  (g,) = vjp(ct)
  np.testing.assert_allclose(g, jnp.broadcast_to(ct.reshape(1, 16), (8, 16)), rtol=1e-6)
  assert "all-gather" in jax.jit(lambda v, c: vjp(c)[0]).lower(x, ct).compile().as_text()
  ag = lambda v: _smap(mesh, lambda u: dtenjax.all_gather(u, AX, axis=1, tiled=True))(v)
  _, vjp = jax.vjp(ag, ct)
  (g,) = vjp(jnp.broadcast_to(x[:, None, :], (8, 1, 16)).reshape(8, 16))
  np.testing.assert_allclose(g, x.sum(0).reshape(8, 2), rtol=1e-5, atol=1e-5)


# --- vmap ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reproducible", [False, True])
def test_vmap_over_batch_reduces_each_element(mesh, reproducible):
  x = _normal(11, (8, 3, 5))     # [device, batch, m]
  for alg in ("ring", "xla", "auto"):
    f = _smap(mesh, lambda v: jax.vmap(lambda e: dtenjax.all_reduce(
        e, AX, algorithm=alg, reproducible=reproducible), in_axes=1, out_axes=1)(v))
    y = np.asarray(f(x))
    want = ref.reproducible_sum(np.asarray(x)) if reproducible else np.asarray(x).sum(0)
    if reproducible:
      np.testing.assert_array_equal(ref.bits(y[0]), ref.bits(want), err_msg=alg)
    else:
      np.testing.assert_allclose(y[0], want, rtol=1e-5, atol=1e-5, err_msg=alg)


@pytest.mark.parametrize("reproducible", [False, True])
def test_vmap_named_axis_is_a_valid_axis_name(reproducible):
  """Every algorithm takes a jax.vmap axis as its axis: all of them in one jitted program (one
  compile, where eager vmap compiled each primitive of each algorithm on its own), and ``auto``
  also eagerly, with the same bits."""
  x = ref.contributions(4, 64, seed=12)
  algos = ("ring", "one_shot", "two_shot", "xla", "auto")
  run = lambda a, e: dtenjax.all_reduce(e, "v", algorithm=a, reproducible=reproducible)
  every = jax.jit(jax.vmap(lambda e: tuple(run(a, e) for a in algos), axis_name="v"))(
      jnp.asarray(x))
  eager = jax.vmap(lambda e: run("auto", e), axis_name="v")(jnp.asarray(x))
  np.testing.assert_array_equal(ref.bits(np.asarray(eager)), ref.bits(np.asarray(every[-1])))
  for a, y in zip(algos, every):
    y = np.asarray(y)
    if reproducible:
      np.testing.assert_array_equal(ref.bits(y), ref.bits(np.broadcast_to(
          ref.reproducible_sum(x), y.shape)), err_msg=a)
    else:
      fin = np.isfinite(x).all(0) & (np.abs(x) < 1e37).all(0)
      np.testing.assert_allclose(y[:, fin], np.broadcast_to(x[:, fin].sum(0), y[:, fin].shape),
                                 rtol=1e-4, atol=1e-30, err_msg=a)


def test_reproducible_vmap_inside_mesh_map(cpu_devices):
  mesh = dtenjax.topology_mesh((8,), ("x",), devices=cpu_devices)
  x = ref.contributions(8, 6 * 4, seed=13).reshape(8, 6, 4)       # [device, batch, m]
  f = dtenjax.mesh_map(lambda v: jax.vmap(lambda e: dtenjax.all_reduce(e, "x", reproducible=True))
                       (v[0])[None], mesh, in_specs=P("x"), out_specs=P("x"))
  y = np.asarray(jax.jit(f)(jnp.asarray(x)))
  np.testing.assert_array_equal(ref.bits(y), ref.bits(np.broadcast_to(
      ref.reproducible_sum(x), y.shape)))


# --- reproducible -----------------------------------------------------------------------------------

_SHAPES = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}


def _split_run(devs, g, op="sum", reproducible=True):
  """The 8 contributions g[k] split over len(devs) devices (local_axis); every algorithm at once."""
  n = len(devs)
  mesh = Mesh(np.array(devs[:n]).reshape(_SHAPES[n]), AX)

  def body(v):          # v: [8/n, m] local contributions
    outs = [dtenjax.all_reduce(v, AX, op=op, algorithm=a, reproducible=reproducible,
                               local_axis=0)
            for a in ALGOS + ("auto",)]
    return jnp.stack(outs)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
  return np.asarray(f(jnp.asarray(g)))


# Which (dtype, op) cases run on which device counts. What an algorithm does with the data -- the
# word exchange (xla, ring, hierarchical), the gather (one_shot), the owner form (two_shot) -- and
# how the 8 contributions are split over devices (local_axis: 8/n each) depend on the device count
# and on the dtype (one_shot and two_shot move the raw floats); the op changes only the decode
# (and local_sum), which every algorithm and device count shares, with the count of
# contributions (8 whatever n). So every device count runs float32 sums and bfloat16 means
# (both dtypes, both ops, a split of 8/n), and 8 devices every pair.
_ALL_CASES = (("float32", "sum"), ("float32", "mean"), ("bfloat16", "sum"), ("bfloat16", "mean"))
_CASES = {8: _ALL_CASES, 4: _ALL_CASES[::3], 2: _ALL_CASES[::3], 1: _ALL_CASES[::3]}
_DATA = pathlib.Path(__file__).parent / "data"


def _stored_contributions(stored, dtype):
  x = stored[f"x_{dtype}"]
  return x.view(ref.BF16) if dtype == "bfloat16" else x


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_reproducible_bits_for_every_algorithm_and_device_count(cpu_devices, n):
  """reproducible=True (contract v3): the 8 contributions of tests/data/reproducible_v3_ref.npz
  (the bits the GPU suite also checks) split over n devices give, with every algorithm, on every
  rank, the independent numpy reference's bits and the stored ones."""
  stored = np.load(_DATA / "reproducible_v3_ref.npz")
  for dtype, op in _CASES[n]:
    g = _stored_contributions(stored, dtype)
    want = ref.bits(ref.reproducible_sum(g, mean=op == "mean"))
    np.testing.assert_array_equal(want, stored[f"{op}_{dtype}_8"])
    res = _split_run(cpu_devices[:n], g, op)
    for r in range(res.shape[0]):
      for j, alg in enumerate(ALGOS + ("auto",)):
        np.testing.assert_array_equal(ref.bits(res[r, j]), want,
                                      err_msg=f"{dtype} {op}: {n} devices, rank {r}, {alg}")


@pytest.mark.parametrize("n", [1, 2, 8])
def test_exact_contract_bits_for_every_algorithm_and_device_count(cpu_devices, n):
  """reproducible="exact" is contract v2 (the exact fixed-point sum) everywhere: the
  contributions of tests/data/reproducible_ref.npz, as above, against the reference and the
  stored bits."""
  stored = np.load(_DATA / "reproducible_ref.npz")
  for dtype, op in _CASES[n]:
    g = _stored_contributions(stored, dtype)
    want = ref.bits(ref.exact_sum(g, mean=op == "mean"))
    np.testing.assert_array_equal(want, stored[f"{op}_{dtype}"])
    res = _split_run(cpu_devices[:n], g, op, reproducible="exact")
    for r in range(res.shape[0]):
      for j, alg in enumerate(ALGOS + ("auto",)):
        np.testing.assert_array_equal(ref.bits(res[r, j]), want,
                                      err_msg=f"exact {dtype} {op}: {n} devices, rank {r}, {alg}")


@pytest.mark.parametrize("contract", [True, "exact"])
def test_reproducible_reduce_scatter(mesh, contract):
  """Every algorithm's sum and mean, each its own reduce-scatter, in one program (one compile per
  contract, where a case per algorithm compiled two programs each)."""
  g = ref.contributions(8, 8 * 12, seed=15)          # rank r owns block r of 12 columns
  want_of = ref.reproducible_sum if contract is True else ref.exact_sum
  cases = [(a, op) for a in ("xla", "ring", "one_shot", "two_shot", "auto")
           for op in ("sum", "mean")]
  outs = _smap(mesh, lambda v: tuple(dtenjax.reduce_scatter(
      v[0], AX, scatter_dimension=0, tiled=True, op=op, algorithm=a,
      reproducible=contract)[None] for a, op in cases))(g)
  for (a, op), y in zip(cases, outs):
    np.testing.assert_array_equal(ref.bits(np.asarray(y).reshape(-1)),
                                  ref.bits(want_of(g, mean=op == "mean")), err_msg=f"{a} {op}")


@pytest.mark.parametrize("n", [2, 8])
def test_reproducible_gradients_are_reproducible(cpu_devices, n):
  """d/dx of sum_r(w_r * all_reduce(x)_r) is the sum over devices of the w_r: with
  reproducible=True it is the contract-v2 sum, the same bits for every algorithm."""
  mesh = Mesh(np.array(cpu_devices[:n]).reshape(_SHAPES[n]), AX)
  w = ref.contributions(n, 40, seed=16)
  w = np.where(np.isfinite(w), w, 0).astype(np.float32)
  want = ref.bits(ref.reproducible_sum(w))
  x = jnp.zeros((8, 40), jnp.float32)          # 8 / n local contributions per device
  for alg in ("ring", "two_shot", "xla", "auto"):
    def loss(x, ww, alg=alg):
      y = jax.shard_map(lambda u, v: dtenjax.all_reduce(u, AX, algorithm=alg, local_axis=0,
                                                        reproducible=True)[None] * v,
                        mesh=mesh, in_specs=(P(AX), P(AX)), out_specs=P(AX),
                        check_vma=False)(x, ww)
      return jnp.sum(y)
    g = np.asarray(jax.jit(jax.grad(loss))(x, jnp.asarray(w)))
    for r in range(8):
      np.testing.assert_array_equal(ref.bits(g[r]), want, err_msg=f"{alg} row {r}")


def test_reproducible_ieee_special_values(mesh):
  x = np.zeros((8, 4), np.float32)
  x[3, 0] = np.nan
  x[1, 1], x[5, 1] = np.inf, -np.inf
  x[2, 2], x[6, 2] = np.inf, 1.0
  x[0, 3], x[7, 3] = -np.inf, -np.inf
  y = _smap(mesh, lambda v: dtenjax.all_reduce(v, AX, algorithm="ring", reproducible=True))(x)[0]
  assert np.isnan(y[0]) and np.isnan(y[1]) and y[2] == np.inf and y[3] == -np.inf


# --- errors ------------------------------------------------------------------------------------------

def _raises(mesh, f, match):
  with pytest.raises(errors.CollectiveError, match=match):
    _smap(mesh, f)(_rows(15, 8))


def test_errors_name_the_value_and_the_fix(mesh):
  _raises(mesh, lambda v: dtenjax.all_reduce(v, "model"),
          r"\['model'\].*axes in scope: \['i', 'o'\]")
  _raises(mesh, lambda v: dtenjax.all_reduce(v, AX, op="prod"), r"op='prod'.*sum")
  _raises(mesh, lambda v: dtenjax.all_reduce(v, AX, algorithm="tree"), r"algorithm='tree'")
  _raises(mesh, lambda v: dtenjax.all_reduce(v.astype(jnp.int32), AX, reproducible=True),
          r"int32.*reproducible=False")
  _raises(mesh, lambda v: dtenjax.all_reduce(v, "i", algorithm="hierarchical"), r"two mesh axes")
  _raises(mesh, lambda v: dtenjax.reduce_scatter(v[:, :8], AX, scatter_dimension=1, tiled=True,
                                                 algorithm="nvlink_one_shot"),
          r"nvlink_one_shot has no reduce_scatter; use algorithm='auto'")
  _raises(mesh, lambda v: dtenjax.reduce_scatter(v[:, :6], AX, scatter_dimension=1, tiled=True),
          r"size 6 is not divisible by the size 8.*pad it")
  _raises(mesh, lambda v: dtenjax.all_reduce(v, AX, local_axis=0), r"reproducible=True")
  with pytest.raises(errors.CollectiveError, match="not bound"):
    dtenjax.all_reduce(jnp.ones(3), "i")                  # outside any mapped context
  assert fixed_point.MAX_CONTRIBUTIONS == 1024


# --- across processes: the public API end to end ---------------------------------------------

@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs,local", [(2, 1), (2, 2)])
def test_public_all_reduce_across_processes(tmp_path, nprocs, local):
  from tests import compile_only
  from tests.mp_workers import launch
  # The workers' XLA: launch's (LLVM unoptimised) and the suite's fusion emitters (its LLVM IR
  # emitters, as in this process): their bits are checked against each other and the numpy
  # reference, none stored (2.5 s of CPU for both launches, 3.1 s with XLA's emitters).
  flags = helpers.xla_flags(f"--xla_force_host_platform_device_count={local}",
                            compile_only.LLVM_O0_FLAGS)
  codes, res, logs = launch.launch("tests.mp_workers.collectives_worker", nprocs, str(tmp_path),
                                   devices_per_proc=local, timeout_s=150, env={"XLA_FLAGS": flags})
  assert codes == [0] * nprocs, logs
  full = np.asarray(res[0]["input"], np.uint32).view(np.float32)
  family = "ring" if local == 1 else "hierarchical"
  want_repro = ref.bits(ref.reproducible_sum(full))
  finite = np.isfinite(full).all(0)
  for name, case in res[0]["cases"].items():
    assert "exception" not in case, (name, case)
    rows = [np.asarray(b, np.uint32) for r in res for b in r["cases"][name]["bits"]]
    for row in rows:                                        # every device of every process
      np.testing.assert_array_equal(row.reshape(-1), rows[0].reshape(-1), err_msg=name)
    assert all(r["cases"][name]["repeat_equal"] for r in res), name
    got = rows[0].reshape(-1).view(np.float32)
    # the host transport only when asked for; auto keeps arrays on XLA's collectives (gloo)
    assert case["host_transport"] == name.split("/")[1].startswith(family), name
    if "reproducible" in name:
      np.testing.assert_array_equal(got.view(np.uint32), want_repro, err_msg=name)
    elif name.endswith("_max"):
      assert np.isnan(got[3]) and np.array_equal(got[finite], full.max(0)[finite])
    else:
      assert np.isnan(got[3])
      np.testing.assert_allclose(got[finite], full.sum(0)[finite], rtol=1e-5,
                                 atol=1e-6 * np.nanmax(np.abs(full)), err_msg=name)


# --- GPU (run by scripts/gpu_check.sh on the GPU machine; skipped without a GPU) --------------

def _gpu_mesh(n):
  gpus = jax.devices("gpu")
  if len(gpus) < n:
    pytest.skip(f"needs {n} GPUs, {len(gpus)} visible")
  return Mesh(np.array(gpus[:n]), ("g",))


def _gpu_run(n, x, **kw):
  mesh = _gpu_mesh(n)
  f = jax.jit(jax.shard_map(lambda v: dtenjax.all_reduce(v, "g", **kw)[None], mesh=mesh,
                            in_specs=P("g"), out_specs=P("g"), check_vma=False))
  return np.asarray(f(jnp.asarray(x)))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_gpu_reproducible_bits_equal_the_stored_cpu_reference(n, dtype, op):
  """Every algorithm that can run the call (the fused NVLink kernels included) gives the bits in
  tests/data/reproducible_v3_ref.npz (made on CPU by the independent numpy reference)."""
  data = np.load(pathlib.Path(__file__).parent / "data" / "reproducible_v3_ref.npz")
  x = data[f"x_{dtype}"]
  x = x.view(ref.BF16) if dtype == "bfloat16" else x
  want = data[f"{op}_{dtype}_8"]
  stacked = x.reshape(n, 8 // n, -1)                     # GPU r holds contributions r*8/n..
  for alg in ("auto", "xla", "one_shot", "two_shot", "ring"):
    kw = dict(op=op, algorithm=alg, reproducible=True)
    y = _gpu_run(n, stacked, local_axis=1, **kw) if n < 8 else _gpu_run(n, stacked[:, 0], **kw)
    for r in range(n):
      np.testing.assert_array_equal(ref.bits(y[r]), want, err_msg=f"{alg} gpu {r}")
  # one contribution per GPU (what the fused NVLink kernels take): the first n contributions
  want_n = data[f"{op}_{dtype}_{n}"]
  np.testing.assert_array_equal(want_n, ref.bits(ref.reproducible_sum(x[:n], mean=op == "mean")))
  for alg in ("auto", "xla", "two_shot", "nvlink_one_shot", "nvlink_two_shot"):
    y = _gpu_run(n, x[:n], op=op, algorithm=alg, reproducible=True)
    for r in range(n):
      np.testing.assert_array_equal(ref.bits(y[r]), want_n, err_msg=f"{alg} gpu {r}, 1 each")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_gpu_exact_contract_bits_equal_the_stored_cpu_reference(n, op):
  """reproducible="exact" on GPU: every algorithm, the fused NVLink kernels included, gives the
  exact contract's stored bits (tests/data/reproducible_ref.npz)."""
  data = np.load(pathlib.Path(__file__).parent / "data" / "reproducible_ref.npz")
  x = data["x_float32"]
  stacked = x.reshape(n, 8 // n, -1)
  for alg in ("auto", "xla", "one_shot", "two_shot"):
    kw = dict(op=op, algorithm=alg, reproducible="exact")
    y = _gpu_run(n, stacked, local_axis=1, **kw) if n < 8 else _gpu_run(n, stacked[:, 0], **kw)
    for r in range(n):
      np.testing.assert_array_equal(ref.bits(y[r]), data[f"{op}_float32"], err_msg=f"{alg} {r}")
  want_n = ref.bits(ref.exact_sum(x[:n], mean=op == "mean"))
  for alg in ("nvlink_one_shot", "nvlink_two_shot"):
    y = _gpu_run(n, x[:n], op=op, algorithm=alg, reproducible="exact")
    for r in range(n):
      np.testing.assert_array_equal(ref.bits(y[r]), want_n, err_msg=f"{alg} gpu {r}, 1 each")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ALGOS[:4] + ("auto", "nvlink_one_shot", "nvlink_two_shot"))
def test_gpu_max_min_propagate_nan_and_sums_match_the_p2p_contract(algorithm):
  n = 2
  x = np.zeros((n, 1024), np.float32)
  x[1, 0] = np.nan
  x[:, 1:] = np.random.default_rng(0).standard_normal((n, 1023)) * 100
  mx = _gpu_run(n, x, op="max", algorithm=algorithm)
  assert np.isnan(mx[:, 0]).all() and np.array_equal(mx[0, 1:], x[:, 1:].max(0))
  if algorithm in ("one_shot", "two_shot", "nvlink_one_shot", "nvlink_two_shot"):
    s = _gpu_run(n, x[:, 1:], algorithm=algorithm)      # rank-order fold in f32: the p2p bits
    np.testing.assert_array_equal(s[0], (x[0, 1:] + x[1, 1:]).astype(np.float32))


@pytest.mark.gpu
def test_gpu_auto_is_never_the_host_transport_and_prefers_the_kernel_when_cheaper():
  mesh = _gpu_mesh(2)
  x = jnp.zeros((2, 2048), jnp.float32)
  f = jax.jit(jax.shard_map(lambda v: dtenjax.all_reduce(v, "g"), mesh=mesh, in_specs=P("g"),
                            out_specs=P("g"), check_vma=False))
  hlo = f.lower(x).as_text()
  assert "dtenjax_host_all_reduce" not in hlo
  plan = dtenjax.plan_all_reduce(2048 * 4, [d.id for d in mesh.devices])
  assert plan.algorithm in plan.times


@pytest.mark.parametrize("group", [[], None, ["a"], 3])
def test_plan_all_reduce_names_a_bad_group(group):
  with pytest.raises(dtenjax.CollectiveError, match=r"group=.*must list the device ids"):
    dtenjax.plan_all_reduce(1024, group, None)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mean_of_huge_values_is_finite_where_the_mean_is(mesh, dtype):
  """8 x 3e38 sums past float32's range, but the mean is 3e38: dtenjax divides by a power of
  two first (exactly), so the result is finite; ordinary values keep the bits of sum / n. Every
  algorithm's three all-reduces in one program (one compile per dtype, where a case per
  algorithm compiled three programs)."""
  x = jnp.full((8, 4), 3e38, dtype)
  r = _normal(7, (8, 32), dtype)
  algorithms = ("auto",) + ALGOS

  def body(v, u):
    return tuple((dtenjax.all_reduce(v, AX, op="mean", algorithm=a),
                  dtenjax.all_reduce(u, AX, op="mean", algorithm=a),
                  dtenjax.all_reduce(u.astype(jnp.float32), AX, algorithm=a)) for a in algorithms)
  for algorithm, (y, mean, total) in zip(algorithms, _smap(mesh, body)(x, r)):
    y = np.asarray(y)
    assert np.all(np.isfinite(y.astype(np.float32))), algorithm
    np.testing.assert_allclose(y.astype(np.float32), np.float32(x[0, 0]),
                               rtol=2 * float(jnp.finfo(dtype).eps),    # rounding of the 8-term sum
                               err_msg=algorithm)
    want = np.asarray(total) / np.float32(8)                 # the same sum, divided once (IEEE)
    np.testing.assert_array_equal(np.asarray(mean, np.float32),
                                  want.astype(dtype).astype(np.float32), err_msg=algorithm)


def _documented_zero_sign(algorithm: str, reproducible: bool) -> float:
  """docs/collectives.md: a sum of only -0.0 is -0.0 (IEEE: dtenjax's folds start from the first
  rank's value), except XLA's reduction, folded from +0 as lax.psum is, and the reproducible
  contracts, whose zero sums are +0.0."""
  return 1.0 if reproducible or algorithm == "xla" else -1.0


def test_the_sign_of_a_sum_of_negative_zeros_is_pinned_for_every_algorithm(mesh):
  """Issue 44: every algorithm (each family, and auto as resolved by plan_all_reduce), sum and
  mean, reproducible or not, gives the documented sign for eight -0.0; lax.psum is the anchor of
  algorithm='xla'. One program holds every case (one compilation)."""
  from dtenjax._src.collectives.algorithms import registry
  ids = [d.id for d in mesh.devices.flat]
  cases = [(a, op, rep) for a in ("auto",) + registry.FAMILIES for op in ("sum", "mean")
           for rep in (False, True)]
  body = lambda v: tuple(dtenjax.all_reduce(v, AX, algorithm=a, op=op, reproducible=rep)
                         for a, op, rep in cases) + (jax.lax.psum(v, AX),)
  outs = _smap(mesh, body, out_specs=(P(AX),) * (len(cases) + 1))(jnp.full((8, 3), -0.0))
  wrong = []
  for (a, op, rep), y in zip(cases, outs):
    resolved = a if a != "auto" else dtenjax.plan_all_reduce(
        12, ids, axis_sizes=(2, 4), op=op, reproducible=rep).algorithm
    want = _documented_zero_sign(resolved, rep)
    y = np.asarray(y)
    if not (np.all(y == 0) and np.all(np.copysign(1.0, y) == want)):
      wrong.append(f"{a} (-> {resolved}) op={op} reproducible={rep}: {y.ravel()[:3]}, want "
                   f"{want * 0.0}")
  assert not wrong, wrong
  assert not np.any(np.signbit(np.asarray(outs[-1])))     # lax.psum: +0.0, as xla's
  # the case: auto picks xla here, so it gives +0.0 as lax.psum does
  assert dtenjax.plan_all_reduce(12, ids, axis_sizes=(2, 4)).algorithm == "xla"


def test_a_mean_of_an_already_summed_gradient_is_flagged_once():
  """jax.grad of replicated params under check_vma=True is already summed over the axis; a mean
  of it returns n times the mean gradient (as lax.pmean does). dtenjax says so once, with the fix,
  as a DtenjaxWarning through Python's warnings (no logging set-up needed: a plain script shows
  it); per-device gradients (pvary'd params) are averaged silently."""
  from dtenjax._src import errors as errors_lib
  errors_lib._warned.discard("invariant-mean")
  mesh = dtenjax.topology_mesh((8,), ("d",))
  w = jnp.ones(3)
  x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)

  def step(trap):
    def body(w, xb):
      params = w if trap else dtenjax.compression.pvary(w, "d")
      g = jax.grad(lambda p: jnp.sum(p * xb))(params)
      return dtenjax.all_reduce(g, "d", op="mean")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))

  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    good = step(False)(w, x)
  assert not [m for m in seen if "already SUMMED" in str(m.message)]
  np.testing.assert_allclose(good, np.asarray(x).mean(0), rtol=1e-6)
  with pytest.warns(dtenjax.DtenjaxWarning, match="already SUMMED") as seen:
    bad = step(True)(w, x)
  hits = [m for m in seen if "already SUMMED" in str(m.message)]
  assert len(hits) == 1 and "compression.pvary(params, axis)" in str(hits[0].message)
  assert hits[0].filename == __file__          # attributed to the user's line, not dtenjax's
  np.testing.assert_allclose(bad, np.asarray(x).sum(0), rtol=1e-6)    # n times the mean, as JAX
  with warnings.catch_warnings():
    warnings.simplefilter("error", dtenjax.DtenjaxWarning)   # users can make it an error
    errors_lib._warned.discard("invariant-mean")
    with pytest.raises(dtenjax.DtenjaxWarning):
      step(True)(w + 1, x)


def test_all_reduce_tag_is_checked_and_takes_a_traced_value(cpu_devices):
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("i",))
  x = jnp.arange(4.0)
  run = lambda **kw: jax.jit(jax.shard_map(lambda v: dtenjax.all_reduce(v, "i", **kw), mesh=mesh,
                                           in_specs=P("i"), out_specs=P()))(x)
  np.testing.assert_array_equal(run(tag=7), run())      # XLA's collective needs no tag
  np.testing.assert_array_equal(run(tag="grad/w"), run())
  with pytest.raises(dtenjax.DtenjaxError, match="tag=-1"):
    run(tag=-1)
  # A traced integer (the index of lax.fori_loop) travels with the collective (issue 35); the
  # host transport compares it on every rank (tests/test_attacks.py), XLA's collective ignores it.
  traced = jax.jit(jax.shard_map(lambda v, t: dtenjax.all_reduce(v, "i", tag=t), mesh=mesh,
                                 in_specs=(P("i"), P()), out_specs=P()))(x, jnp.int32(3))
  np.testing.assert_array_equal(traced, run())
  looped = jax.jit(jax.shard_map(
      lambda v: jax.lax.fori_loop(0, 3, lambda i, c: c + 0 * dtenjax.all_reduce(c, "i", tag=i), v),
      mesh=mesh, in_specs=P("i"), out_specs=P("i")))(x)
  np.testing.assert_array_equal(looped, x)
  grad = jax.jit(jax.grad(jax.shard_map(
      lambda v, t: dtenjax.all_reduce(v * v, "i", tag=t).sum(), mesh=mesh,
      in_specs=(P("i"), P()), out_specs=P())))(x, jnp.int32(5))
  np.testing.assert_allclose(grad, 2 * x)        # as without a tag: d/dv sum(psum(v*v))
  with pytest.raises(dtenjax.DtenjaxError, match="tag="):
    run(tag=jnp.float32(1.5))                      # not an integer


@pytest.mark.parametrize("contract", [True, "exact"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reproducible_means_of_huge_values_stay_in_range(contract, dtype):
  """The mean of 8 x 3e38, or of 8 x the largest finite value, is finite (the sum is not): both
  contracts, float32 and bfloat16, through every way the words move (the word exchange, the
  gathered local sum, the owner form, reduce_scatter), and within the bound of docs/collectives.md
  (half an ulp of the mean for these sums, which are exact in the fixed-point grid; a quarter
  ulp more below the largest binade)."""
  big = float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32).max)
  near = float(np.asarray(3e38, dtype=np.dtype(dtype)).astype(np.float32))
  cols = np.array([[near] * 8, [big] * 8, [big] * 7 + [-big], [big] * 6 + [near, near]],
                  np.float64).T                                 # [rank, column]
  exact = cols.sum(0) / 8                                       # exact in float64 here
  mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
  x = jnp.asarray(cols, dtype)
  body = lambda v: jnp.stack(
      [dtenjax.all_reduce(v, "d", op="mean", reproducible=contract, algorithm=a)[0]
       for a in ("xla", "one_shot", "two_shot")] +
      [dtenjax.reduce_scatter(jnp.tile(v, (8, 1)), "d", op="mean", reproducible=contract,
                              tiled=True)[0]])[None]
  y = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))(x)
  y = np.asarray(y.astype(jnp.float32), np.float64)[0]           # rank 0: [path, column]
  assert np.all(np.isfinite(y)), y
  bits = 8 if dtype == jnp.bfloat16 else 24                     # significant bits of the dtype
  ulp = np.exp2(np.floor(np.log2(np.abs(exact))) - (bits - 1))
  assert np.all(np.abs(y - exact) <= ulp / 2 * 1.5), (y, exact)
  # every path gives the same bits
  assert (y == y[0]).all(), y


def test_named_vmap_axes_alone_or_with_mesh_axes_sum_like_lax_psum(cpu_devices):
  """axis_name=("i", "v") with "v" a jax.vmap axis: every algorithm (and the reproducible sum)
  gives lax.psum's values; where JAX itself cannot run a vmap collective (inside
  shard_map(check_vma=True), where lax.psum raises a bare AssertionError) the error is a
  CollectiveError naming the vmap axis and the fix."""
  mesh = Mesh(np.array(cpu_devices[:4]), ("i",))
  x = (jnp.arange(4 * 2 * 5, dtype=jnp.float32).reshape(8, 5) * 1.37) ** 1.5
  def body(axes, check):
    # hierarchical needs two axes: a lone vmap axis is a CollectiveError saying so
    algos = ("xla", "ring", "one_shot", "two_shot", "butterfly") + (
        ("hierarchical",) if axes != "v" else ())

    def lane(u):
      outs = [dtenjax.all_reduce(u, axes, algorithm=a) for a in algos]
      outs += [dtenjax.all_reduce(u, axes, reproducible=True, algorithm=a) for a in algos[:3]]
      outs += [dtenjax.all_reduce(u, axes, op=op) for op in ("mean", "max")]
      want = [jax.lax.psum(u, axes), jax.lax.pmean(u, axes), jax.lax.pmax(u, axes)]
      return jnp.stack(outs), jnp.stack(want) if not check else jnp.stack(outs[:3])
    return lambda v: jax.vmap(lane, axis_name="v", out_axes=1)(v)

  for axes in (("v", "i"), "v"):
    f = jax.jit(jax.shard_map(body(axes, False), mesh=mesh, in_specs=P("i"),
                              out_specs=P(None, "i"), check_vma=False))
    got, want = (np.asarray(a) for a in f(x))
    algos = 6 if axes != "v" else 5
    n = algos + 3
    np.testing.assert_allclose(got[:n], np.broadcast_to(want[0], got[:n].shape), rtol=1e-6)
    np.testing.assert_allclose(got[n], want[1], rtol=1e-6)
    np.testing.assert_array_equal(got[n + 1], want[2])
    if axes != "v":        # the reproducible sums agree bit for bit across algorithms
      np.testing.assert_array_equal(got[algos], got[algos + 2])
  with pytest.raises(dtenjax.CollectiveError, match=r"jax.vmap axis \['v'\].*check_vma=False"):
    jax.jit(jax.shard_map(body(("i", "v"), True), mesh=mesh, in_specs=P("i"),
                          out_specs=P(None, "i"), check_vma=True))(x)


@pytest.mark.parametrize("tiled", [False, True])
def test_all_gather_takes_to_like_lax_all_gather(cpu_devices, tiled):
  """to="invarying" (lax.all_gather's, jax 0.10.2 and 0.11.2): the gathered value is typed
  invariant, so it leaves through out_specs=P() under check_vma=True, and its gradient is
  lax's (rank r gets block r of the cotangent); a value lax does not take is a CollectiveError."""
  import inspect
  assert inspect.signature(jax.lax.all_gather).parameters["to"].default == "varying"
  assert inspect.signature(dtenjax.all_gather).parameters["to"].default == "varying"
  mesh = Mesh(np.array(cpu_devices[:4]), ("i",))
  x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6)
  w = jnp.arange(24, dtype=jnp.float32).reshape((24,) if tiled else (4, 6)) + 1.0

  def loss(gather):
    def f(v):
      return jnp.sum(jnp.sin(gather(v)) * w)
    g = jax.shard_map(jax.grad(f), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    y = jax.shard_map(gather, mesh=mesh, in_specs=P("i"), out_specs=P())
    return jax.jit(lambda v: (y(v), g(v)))(x.reshape(-1) if tiled else x)

  ours = loss(lambda v: dtenjax.all_gather(v, "i", tiled=tiled, to="invarying"))
  lax_ = loss(lambda v: jax.lax.all_gather(v, "i", tiled=tiled, to="invarying"))
  for a, b in zip(ours, lax_):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
  with pytest.raises(dtenjax.CollectiveError, match=r"to='reduced'.*jax.lax.all_gather"):
    jax.jit(jax.shard_map(lambda v: dtenjax.all_gather(v, "i", to="reduced"), mesh=mesh,
                          in_specs=P("i"), out_specs=P()))(x)


def test_an_eager_collective_is_one_program_compiled_once_per_signature(cpu_devices):
  """Outside jit, jax.shard_map compiles every primitive anew on every call; a dtenjax collective
  there is one program, compiled on the first call of a signature and then only dispatched
  (bench/eager.py measures it against lax.psum). The eager result is the jitted one, bit for bit,
  and a new signature (another algorithm, another shape) gets its own program."""
  from dtenjax._src import jaxapi
  mesh = Mesh(np.array(cpu_devices), ("d",))
  x = jax.device_put(_rows(m=5), jax.sharding.NamedSharding(mesh, P("d")))

  def f(algorithm):
    return jax.shard_map(lambda v: dtenjax.all_reduce(v, "d", algorithm=algorithm,
                                                      reproducible=True),
                         mesh=mesh, in_specs=P("d"), out_specs=P())
  start = jaxapi.eager_cache_size()
  first = f("one_shot")(x)
  assert jaxapi.eager_cache_size() == start + 1
  again = f("one_shot")(x)                        # a new shard_map, the same signature
  assert jaxapi.eager_cache_size() == start + 1
  f("ring")(x)
  assert jaxapi.eager_cache_size() == start + 2
  jitted = jax.jit(f("one_shot"))(x)
  for y in (first, again):
    np.testing.assert_array_equal(np.asarray(y).view(np.uint32), np.asarray(jitted).view(np.uint32))


def _compilations(fn, *args):
  """XLA compilations during one call of ``fn`` (JAX's own compile-time events)."""
  from jax import monitoring
  seen = []

  def listener(event, _duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      seen.append(event)
  monitoring.register_event_duration_secs_listener(listener)
  try:
    out = jax.block_until_ready(fn(*args))
  finally:
    monitoring.unregister_event_duration_listener(listener)
  return out, len(seen)


@pytest.mark.parametrize("collective,algorithm,reproducible", [
    ("all_reduce", "ring", False), ("all_reduce", "auto", True),
    ("all_reduce_max", "two_shot", False), ("reduce_scatter", "one_shot", False),
    ("all_gather", "ring", False)])
def test_an_eager_gradient_reuses_cached_programs(cpu_devices, collective, algorithm,
                                                 reproducible):
  """jax.grad of an un-jitted shard_map (a debugging session, chex's without_jit): the forward and
  backward rules of a dtenjax collective each run as one program cached per signature, so a
  second call compiles nothing for the collective -- no more programs than the same loss with
  JAX's own collective, whose primitives eager shard_map compiles itself -- and the gradient is
  the jitted one, bit for bit. A pytree goes through the buckets in the same programs."""
  from dtenjax._src import jaxapi
  mesh = Mesh(np.array(cpu_devices[:4]), ("d",))
  tree = {"a": _normal(0, (4, 8)), "b": _normal(1, (4, 4, 3))}
  tree = jax.device_put(tree, jax.sharding.NamedSharding(mesh, P("d")))
  ours = {
      "all_reduce": lambda t: dtenjax.all_reduce(t, "d", algorithm=algorithm,
                                                 reproducible=reproducible),
      "all_reduce_max": lambda t: dtenjax.all_reduce(t, "d", op="max", algorithm=algorithm),
      "reduce_scatter": lambda t: dtenjax.reduce_scatter(t, "d", scatter_dimension=1, tiled=True,
                                                         algorithm=algorithm),
      "all_gather": lambda t: dtenjax.all_gather(t, "d", tiled=True, algorithm=algorithm)}
  theirs = {
      "all_reduce": lambda t: jax.lax.psum(t, "d"),
      "all_reduce_max": lambda t: jax.tree.map(lambda y: jax.lax.all_gather(y, "d").max(0), t),
      "reduce_scatter": lambda t: jax.lax.psum_scatter(t, "d", scatter_dimension=1, tiled=True),
      "all_gather": lambda t: jax.lax.all_gather(t, "d", tiled=True)}

  def grad_of(body):
    f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    return jax.grad(lambda t: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(f(t))))

  g, lax_g = grad_of(ours[collective]), grad_of(theirs[collective])
  first, _ = _compilations(g, tree)
  programs = jaxapi.eager_cache_size()
  again, n_ours = _compilations(g, tree)
  _compilations(lax_g, tree)                      # JAX's own per-primitive programs, warmed up
  want, n_lax = _compilations(lax_g, tree)
  assert jaxapi.eager_cache_size() == programs    # nothing new was traced for the second call
  assert n_ours <= n_lax, (n_ours, n_lax)
  jitted = jax.jit(g)(tree)
  for y in (first, again):
    chex.assert_trees_all_equal(y, jitted)
  chex.assert_trees_all_close(again, want, rtol=1e-5, atol=1e-5)


_PLAIN_SCRIPT = """
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import dtenjax
mesh = dtenjax.topology_mesh((2,), ("d",))
def body(w, xb):
  g = jax.grad(lambda p: jnp.sum(p * xb))(w)       # replicated params: already summed
  return dtenjax.all_reduce(g, "d", op="mean")
f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))
print(f(jnp.ones(3), jnp.ones((2, 3))))
"""


def test_the_summed_gradient_warning_shows_in_a_plain_script(tmp_path):
  """The user's case: a plain `python script.py`, no logging set-up, no pytest: the warning is on
  stderr (Python shows UserWarnings by default). Forked from one of the session's servers: plain
  interpreters that imported jax and dtenjax and started no backend, whose warning filters are
  those of a new interpreter after the same imports (numpy's four; checked 2026-12-06)."""
  import os
  from tests.mp_workers import launch
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=launch.pythonpath(),
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  with launch.one_server(env, tmp_path) as server:
    r = server.run(["-c", _PLAIN_SCRIPT], env=env, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert "DtenjaxWarning" in r.stderr and "already SUMMED" in r.stderr, r.stderr[-2000:]
