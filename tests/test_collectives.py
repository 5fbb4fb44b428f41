"""Public collectives: pytrees, jit/eager, grad/jvp transposes, vmap, reproducible mode, errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src.collectives import api as C
from dtenjax._src import errors
from dtenjax._src.collectives import fixed_point

AX = ("o", "i")
ALGOS = ("xla", "ring", "one_shot", "two_shot", "hierarchical")


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), AX)


def _smap(mesh, f, jit=True, check_vma=False):
  g = jax.shard_map(f, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=check_vma)
  return jax.jit(g) if jit else g


def _rows(seed=0, m=6):
  return jax.random.normal(jax.random.key(seed), (8, m), jnp.float32)


# --- API --------------------------------------------------------------------------------------------

def test_pytree_all_reduce_buckets_and_matches_per_leaf(mesh):
  tree = {"w": _rows(1, 12), "b": _rows(2, 3), "n": jnp.arange(8, dtype=jnp.int32)[:, None]}

  def body(bucket_bytes):
    return lambda t: C.all_reduce(t, AX, algorithm="one_shot", bucket_bytes=bucket_bytes)
  spec = {"w": P(AX), "b": P(AX), "n": P(AX)}
  fused = jax.jit(jax.shard_map(body(1 << 20), mesh=mesh, in_specs=(spec,), out_specs=spec,
                                check_vma=False))
  single = jax.jit(jax.shard_map(body(0), mesh=mesh, in_specs=(spec,), out_specs=spec,
                                 check_vma=False))
  a, b = fused(tree), single(tree)
  chex.assert_trees_all_equal(a, b)                 # bucketing does not change bits
  np.testing.assert_allclose(a["w"][0], tree["w"].sum(0), rtol=1e-5, atol=1e-5)
  assert int(a["n"][0, 0]) == 28
  # f32 leaves share one bucket, the int leaf its own: 2 gathers instead of 3
  assert fused.lower(tree).compile().as_text().count("all-gather-start") <= 2 < \
      single.lower(tree).compile().as_text().count("all-gather-start") or \
      fused.lower(tree).compile().as_text().count("all-gather(") < \
      single.lower(tree).compile().as_text().count("all-gather(")


def test_eager_and_jit_agree_and_do_not_retrace(mesh):
  x = _rows(3)

  @chex.assert_max_traces(n=1)
  def body(v):
    return C.all_reduce(v, AX, algorithm="two_shot")
  f = _smap(mesh, body)
  y1, y2 = f(x), f(x + 1.0)
  del y2
  eager = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="two_shot"), jit=False)(x)
  np.testing.assert_array_equal(y1, eager)


def test_check_vma_true_with_varying_out_specs(mesh):
  x = _rows(4)
  y = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="ring"), check_vma=True)(x)
  np.testing.assert_allclose(y[3], x.sum(0), rtol=1e-5, atol=1e-5)


def test_reduce_scatter_and_all_gather(mesh):
  x = jax.random.normal(jax.random.key(5), (8, 16, 3))
  rs = {a: _smap(mesh, lambda v, a=a: C.reduce_scatter(v[0], AX, scatter_dimension=0,
                                                       algorithm=a)[None])(x)
        for a in ("ring", "one_shot", "two_shot", "xla")}
  want = x.sum(0).reshape(8, 2, 3)
  for a, y in rs.items():
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=a)
  np.testing.assert_array_equal(rs["one_shot"], rs["two_shot"])   # same rank order
  g = _smap(mesh, lambda v: C.all_gather(v, AX, axis=1, tiled=True, algorithm="ring"))(x)
  assert g.shape == (8, 128, 3)
  np.testing.assert_array_equal(g[5], jnp.concatenate(list(x), axis=0))
  s = _smap(mesh, lambda v: C.all_gather(v[0], AX, axis=0)[None])(x)
  np.testing.assert_array_equal(s[2], x)


# --- derivatives: per-device outputs, transposes ------------------------------------------------

def _weights():
  return jnp.arange(1.0, 9.0)[:, None]   # rank r's output is weighted by r+1


@pytest.mark.parametrize("algorithm", ["ring", "one_shot"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_all_reduce_grad_matches_reference(mesh, algorithm, op):
  x = _rows(6).at[2, 1].set(5.0).at[6, 1].set(5.0)   # a tie for max
  w = _weights()

  def loss(v):
    y = jax.shard_map(lambda u, ww: C.all_reduce(u, AX, op=op, algorithm=algorithm) * ww,
                      mesh=mesh, in_specs=(P(AX), P(AX)), out_specs=P(AX), check_vma=False)(v, w)
    return jnp.sum(jnp.sin(y))

  def ref(v):
    r = {"sum": v.sum(0), "mean": v.mean(0), "max": v.max(0)}[op]
    return jnp.sum(jnp.sin(r[None] * w))
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), jax.grad(ref)(x), rtol=1e-4, atol=1e-5)


def test_all_reduce_jvp(mesh):
  x, t = _rows(7), _rows(8)
  f = lambda v: _smap(mesh, lambda u: C.all_reduce(u, AX, op="mean", algorithm="two_shot"))(v)
  _, dy = jax.jvp(f, (x,), (t,))
  np.testing.assert_allclose(dy[0], t.mean(0), rtol=1e-5, atol=1e-6)


def test_reduce_scatter_and_all_gather_transpose_into_each_other(mesh):
  x = jax.random.normal(jax.random.key(9), (8, 16))
  ct = jax.random.normal(jax.random.key(10), (8, 2))
  rs = lambda v: _smap(mesh, lambda u: C.reduce_scatter(u, AX, scatter_dimension=1,
                                                        algorithm="ring"))(v)
  y, vjp = jax.vjp(rs, x)
  (g,) = vjp(ct)
  # transpose of reduce_scatter: every rank gets the all_gather of the cotangent blocks
  np.testing.assert_allclose(g, jnp.broadcast_to(ct.reshape(1, 16), (8, 16)), rtol=1e-6)
  hlo = jax.jit(lambda v, c: vjp(c)[0]).lower(x, ct).compile().as_text()
  assert "all-gather" in hlo
  ag = lambda v: _smap(mesh, lambda u: C.all_gather(u, AX, axis=1, tiled=True))(v)
  y, vjp = jax.vjp(ag, ct)
  (g,) = vjp(jnp.broadcast_to(x[:, None, :], (8, 1, 16)).reshape(8, 16))
  np.testing.assert_allclose(g, x.sum(0).reshape(8, 2), rtol=1e-5, atol=1e-5)


# --- vmap ------------------------------------------------------------------------------------------

def test_vmap_over_batch_reduces_each_element(mesh):
  x = jax.random.normal(jax.random.key(11), (8, 3, 5))     # [device, batch, m]
  f = _smap(mesh, lambda v: jax.vmap(lambda e: C.all_reduce(e, AX, algorithm="ring"),
                                     in_axes=1, out_axes=1)(v))
  np.testing.assert_allclose(f(x)[0], x.sum(0), rtol=1e-5, atol=1e-5)


def test_vmap_named_axis_is_a_valid_axis_name():
  x = jax.random.normal(jax.random.key(12), (4, 6))
  for a in ("ring", "one_shot", "two_shot"):
    y = jax.vmap(lambda e: C.all_reduce(e, "v", algorithm=a), axis_name="v")(x)
    np.testing.assert_allclose(y, jnp.broadcast_to(x.sum(0), (4, 6)), rtol=1e-5, atol=1e-5)


# --- reproducible -----------------------------------------------------------------------------------

_SHAPES = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}


def _split_run(devs, g, dtype):
  """Sum of the 8 contributions g[k] split over len(devs) devices; every algorithm at once."""
  n = len(devs)
  mesh = Mesh(np.array(devs[:n]).reshape(_SHAPES[n]), AX)

  def body(v):          # v: [8/n, m] local contributions
    outs = [C.all_reduce(v, AX, algorithm=a, reproducible=True, local_axis=0) for a in ALGOS]
    return jnp.stack(outs)[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AX), out_specs=P(AX), check_vma=False))
  return np.asarray(f(g.astype(dtype)).astype(jnp.float32))


@pytest.fixture(scope="module")
def adversarial():
  cols = [
      [1e8, 1.0, -1e8, 1.0, 3e7, -3e7, 0.5, 0.25],             # catastrophic cancellation
      [3e38, 3e38, -3e38, -3e38, 1e38, -1e38, 2e38, -1.9e38],  # near the f32 limit
      [1e-40, 2e-40, -3e-41, 1e-45, 5e-39, -1e-40, 7e-42, 0.0],  # subnormals
      [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0],
      [0.0] * 8,
      [1.0, -0.0, 1e-7, 1e7, -1e7, 3.0, -3.0, 1e-7],
  ]
  g = np.array(cols, np.float64).T.astype(np.float32)
  rnd = np.asarray(jax.random.normal(jax.random.key(13), (8, 10)) *
                   np.logspace(-20, 20, 10), np.float32)
  return jnp.asarray(np.concatenate([g, rnd], axis=1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_reproducible_same_bits_for_every_algorithm_and_device_count(cpu_devices, adversarial,
                                                                     dtype):
  results = [_split_run(cpu_devices[:n], adversarial, dtype) for n in (1, 2, 4, 8)]
  base = results[0][0, 0]
  for res in results:
    for r in range(res.shape[0]):
      for j in range(len(ALGOS)):
        np.testing.assert_array_equal(res[r, j], base, err_msg=f"rank {r} {ALGOS[j]}")


def test_reproducible_error_bound_against_float64(cpu_devices, adversarial):
  r = _split_run(cpu_devices, adversarial, jnp.float32)[0, 0]
  g = np.asarray(adversarial, np.float64)
  # XLA:CPU runs with denormals-are-zero / flush-to-zero (as GPUs do by default): subnormal
  # contributions count as zero, and the bound is stated for that arithmetic.
  g = np.where(np.abs(g) < np.finfo(np.float32).tiny, 0.0, g)
  exact = g.sum(0)
  amax = np.abs(g).max(0)
  e_max = np.where(amax > 0, np.frexp(amax)[1], -200)
  ulp = np.spacing(np.abs(r).astype(np.float32)).astype(np.float64)
  bound = 8 * np.exp2(e_max - 41.0) + 2 * ulp
  bad = np.nonzero(~(np.abs(r - exact) <= bound))[0]
  assert bad.size == 0, (bad, r[bad], exact[bad], bound[bad])
  assert r[0] == 2.75                           # cancellation is exact
  assert r[4] == 0.0 and not np.signbit(r[4])   # all-zero gives +0.0
  naive = np.float32(0)
  for v in np.asarray(adversarial)[:, 0]:
    naive = np.float32(naive + v)
  assert naive != 2.75                          # the plain float sum loses it


def test_reproducible_ieee_special_values(mesh):
  x = np.zeros((8, 4), np.float32)
  x[3, 0] = np.nan
  x[1, 1], x[5, 1] = np.inf, -np.inf
  x[2, 2], x[6, 2] = np.inf, 1.0
  x[0, 3], x[7, 3] = -np.inf, -np.inf
  y = _smap(mesh, lambda v: C.all_reduce(v, AX, algorithm="ring", reproducible=True))(x)[0]
  assert np.isnan(y[0]) and np.isnan(y[1]) and y[2] == np.inf and y[3] == -np.inf


def test_reproducible_grad_and_mean(mesh):
  x = _rows(14)
  m = _smap(mesh, lambda v: C.all_reduce(v, AX, op="mean", reproducible=True))(x)
  np.testing.assert_allclose(m[0], x.mean(0), rtol=1e-6, atol=1e-7)
  g = jax.grad(lambda v: jnp.sum(_smap(mesh, lambda u: C.all_reduce(u, AX, reproducible=True))(v)))(x)
  np.testing.assert_allclose(g, jnp.full_like(x, 8.0))


# --- errors ------------------------------------------------------------------------------------------

def _raises(mesh, f, match):
  with pytest.raises(errors.CollectiveError, match=match):
    _smap(mesh, f)(_rows(15, 8))


def test_errors_name_the_value_and_the_fix(mesh):
  _raises(mesh, lambda v: C.all_reduce(v, "model"), r"\['model'\].*axes in scope: \['i', 'o'\]")
  _raises(mesh, lambda v: C.all_reduce(v, AX, op="prod"), r"op='prod'.*sum")
  _raises(mesh, lambda v: C.all_reduce(v, AX, algorithm="tree"), r"algorithm='tree'")
  _raises(mesh, lambda v: C.all_reduce(v.astype(jnp.int32), AX, reproducible=True),
          r"int32.*reproducible=False")
  _raises(mesh, lambda v: C.all_reduce(v, "i", algorithm="hierarchical"), r"two mesh axes")
  _raises(mesh, lambda v: C.reduce_scatter(v[:, :6], AX, scatter_dimension=1),
          r"size 6 is not divisible by the size 8.*pad it")
  _raises(mesh, lambda v: C.all_reduce(v, AX, local_axis=0), r"reproducible=True")
  with pytest.raises(errors.CollectiveError, match="not bound"):
    C.all_reduce(jnp.ones(3), "i")                  # outside any mapped context
  assert fixed_point.MAX_CONTRIBUTIONS >= 8
