"""The public collectives as a chex user tests them: every test runs jitted and eagerly
(``chex.variants(with_jit=True, without_jit=True)``), the eager variant through a plain
``jax.shard_map`` outside jit. The eager variants stay as cheap as their jitted twins because a
dtenjax collective runs there as one program cached per call signature (``jaxapi.run_eager``);
before, this file took minutes. Expected values come from ``lax`` or numpy, never from dtenjax."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import parameterized
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import dtenjax
from tests import helpers

N = 8


def _mesh():
  return Mesh(np.array(jax.devices()[:N]), ("d",))


def _rows(m=6, seed=0, dtype=jnp.float32):
  x = np.random.default_rng(seed).standard_normal((N, m)) * np.exp2(
      np.random.default_rng(seed + 1).integers(-8, 8, (N, m)))
  return jax.device_put(jnp.asarray(x, dtype), NamedSharding(_mesh(), P("d")))


class CollectivesVariantsTest(parameterized.TestCase):

  def _smap(self, body, out_specs=P("d")):
    """shard_map over "d" (vma checked, as jax's default), then chex's variant: jit or not."""
    return self.variant(helpers.smap(_mesh(), body, "d", out_specs=out_specs, check_vma=True,
                                     jit=False))

  @chex.variants(with_jit=True, without_jit=True)
  def test_sum_xla_is_lax_psum_bit_for_bit(self):
    x = _rows()
    ours = self._smap(lambda v: dtenjax.all_reduce(v, "d", algorithm="xla"), P())(x)
    want = jax.jit(jax.shard_map(lambda v: lax.psum(v, "d"), mesh=_mesh(), in_specs=P("d"),
                                 out_specs=P()))(x)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(want))

  @chex.variants(with_jit=True, without_jit=True)
  def test_every_algorithm_sums_like_numpy(self):
    x = _rows(seed=1)
    f = self._smap(lambda v: jnp.stack([dtenjax.all_reduce(v, "d", algorithm=a)
                                        for a in ("ring", "one_shot", "two_shot", "butterfly")]),
                   P())
    y = np.asarray(f(x))
    want = np.asarray(x, np.float64).sum(0, keepdims=True)
    for row in y:
      np.testing.assert_allclose(row, want, rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reproducible_sum_has_the_same_bits_for_every_algorithm(self):
    x = _rows(seed=2)
    f = self._smap(lambda v: jnp.stack([dtenjax.all_reduce(v, "d", reproducible=True,
                                                           algorithm=a)
                                        for a in ("xla", "ring", "one_shot", "two_shot")]), P())
    y = np.asarray(f(x))
    for row in y[1:]:
      np.testing.assert_array_equal(row.view(np.uint32), y[0].view(np.uint32))
    np.testing.assert_allclose(y[0], np.asarray(x, np.float64).sum(0, keepdims=True), rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reproducible_v2_and_bfloat16(self):
    x = _rows(seed=3)
    xb = _rows(seed=3, dtype=jnp.bfloat16)
    f = self._smap(lambda v: dtenjax.all_reduce(v, "d", reproducible="v2"), P())
    g = self._smap(lambda v: dtenjax.all_reduce(v, "d", reproducible=True), P())
    np.testing.assert_allclose(np.asarray(f(x)), np.asarray(x, np.float64).sum(0, keepdims=True),
                               rtol=1e-6)
    yb = g(xb)
    self.assertEqual(yb.dtype, jnp.bfloat16)
    np.testing.assert_allclose(np.asarray(yb, np.float32),
                               np.asarray(xb, np.float64).sum(0, keepdims=True), rtol=1e-2)

  @chex.variants(with_jit=True, without_jit=True)
  def test_mean_max_min_like_lax(self):
    x = np.array(_rows(seed=4))
    x[3, 0] = np.nan
    x = jax.device_put(jnp.asarray(x), NamedSharding(_mesh(), P("d")))
    f = self._smap(lambda v: jnp.stack([dtenjax.all_reduce(v, "d", op=op)
                                        for op in ("mean", "max", "min")]), P())
    y = np.asarray(f(x))
    xs = np.asarray(x)
    np.testing.assert_allclose(y[0, 0, 1:], xs[:, 1:].mean(0), rtol=1e-6)
    np.testing.assert_array_equal(y[1, 0, 1:], xs[:, 1:].max(0))
    np.testing.assert_array_equal(y[2, 0, 1:], xs[:, 1:].min(0))
    self.assertTrue(np.isnan(y[:, 0, 0]).all())            # NaN propagates in every op

  @chex.variants(with_jit=True, without_jit=True)
  def test_pytree_of_leaves_is_bucketed_and_summed(self):
    x = _rows(seed=5)
    tree = {"a": x, "b": (x * 2, x[:, :2])}
    f = self._smap(lambda t: dtenjax.all_reduce(t, "d", bucket_bytes=64), P())
    out = f(tree)
    s = np.asarray(x, np.float64).sum(0, keepdims=True)
    np.testing.assert_allclose(np.asarray(out["a"]), s, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["b"][0]), 2 * s, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out["b"][1]), s[:, :2], rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_reduce_scatter_is_lax_psum_scatter(self):
    x = _rows(m=16, seed=6)
    for algorithm in ("ring", "two_shot"):
      f = self._smap(lambda v, a=algorithm: dtenjax.reduce_scatter(
          v, "d", scatter_dimension=1, tiled=True, algorithm=a))
      want = jax.jit(jax.shard_map(lambda v: lax.psum_scatter(v, "d", scatter_dimension=1,
                                                              tiled=True),
                                   mesh=_mesh(), in_specs=P("d"), out_specs=P("d")))(x)
      np.testing.assert_allclose(np.asarray(f(x)), np.asarray(want), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_all_gather_is_lax_all_gather(self):
    x = _rows(seed=7)
    f = self._smap(lambda v: dtenjax.all_gather(v, "d", tiled=True, algorithm="ring"))
    g = self._smap(lambda v: dtenjax.all_gather(v, "d", tiled=True, to="invarying"), P())
    want = np.asarray(x)
    np.testing.assert_array_equal(np.asarray(f(x)), np.tile(want, (N, 1)))
    np.testing.assert_array_equal(np.asarray(g(x)), want)

  @chex.variants(with_jit=True, without_jit=True)
  def test_gradient_of_a_sum_is_lax_psum_gradient(self):
    x = _rows(seed=8)

    def loss(allreduce):
      return lambda v: jax.grad(lambda u: jnp.sum(jnp.sin(allreduce(u))))(v)

    ours = self._smap(loss(lambda u: dtenjax.all_reduce(u, "d", algorithm="one_shot")))(x)
    want = jax.jit(jax.shard_map(loss(lambda u: lax.psum(u, "d")), mesh=_mesh(),
                                 in_specs=P("d"), out_specs=P("d")))(x)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(want), rtol=1e-5)

  @chex.variants(with_jit=True, without_jit=True)
  def test_local_axis_sums_stacked_contributions_exactly(self):
    x = _rows(m=12, seed=9)
    f = self._smap(lambda v: dtenjax.all_reduce(v.reshape(3, 4), "d", reproducible=True,
                                                local_axis=0)[None], P())
    y = np.asarray(f(x))[0]
    want = np.asarray(x, np.float64).reshape(N * 3, 4).sum(0)
    np.testing.assert_allclose(y, want, rtol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_two_axes_and_an_already_invariant_value(self):
    mesh = Mesh(np.array(jax.devices()[:N]).reshape(2, 4), ("a", "b"))
    x = jax.device_put(jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3),
                       NamedSharding(mesh, P(("a", "b"))))
    f = self.variant(jax.shard_map(
        lambda v: (dtenjax.all_reduce(v, ("a", "b")), dtenjax.all_reduce(jnp.ones(3), "a")),
        mesh=mesh, in_specs=P(("a", "b")), out_specs=(P(), P())))
    total, twice = f(x)
    np.testing.assert_array_equal(np.asarray(total)[0], np.asarray(x).sum(0))
    np.testing.assert_array_equal(np.asarray(twice), 2 * np.ones(3))   # as lax.psum: n copies

  @chex.variants(with_jit=True, without_jit=True)
  def test_bad_input_is_a_collective_error_in_both_modes(self):
    x = _rows(seed=10)
    with self.assertRaisesRegex(dtenjax.CollectiveError, "axis name"):
      self._smap(lambda v: dtenjax.all_reduce(v, "nope"))(x)
    with self.assertRaisesRegex(dtenjax.CollectiveError, "reproducible"):
      self._smap(lambda v: dtenjax.all_reduce(v.astype(jnp.int32), "d", reproducible=True))(x)
