import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src import ffi
from dtenjax._src.collectives import fixed_point as fp

needs_ext = pytest.mark.skipif(not ffi.is_built(), reason="native extension not built")


def _adversarial(rng, n=4096):
  cols = [
      rng.standard_normal(n) * 10.0 ** rng.integers(-38, 38, n),           # wide dynamic range
      np.full(n, 3.0e38) * rng.choice([-1, 1], n),                         # near f32 max
      rng.standard_normal(n) * 1e-40,                                       # subnormals
      np.zeros(n),
  ]
  x = np.stack([cols[i % 4] for i in range(8)]).astype(np.float32)
  x[:, :16] = 0.0                                                           # all-zero columns
  x[:4, 16:32] = 1e30                                                       # cancellation
  x[4:, 16:32] = -1e30
  x[0, 16:32] = 1e30 + 1e23
  return x


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype == jnp.bfloat16 else np.uint32)


@needs_ext
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ffi_matches_jnp_reference_bitwise_under_jit(dtype):
  rng = np.random.default_rng(0)
  x = jnp.asarray(_adversarial(rng)).astype(dtype)
  x = x.at[1, 40].set(jnp.nan).at[2, 41].set(jnp.inf).at[3, 42].set(-jnp.inf)
  np.testing.assert_array_equal(jax.jit(lambda v: fp.analyze(v, use_ffi=True))(x),
                                jax.jit(lambda v: fp.analyze(v, use_ffi=False))(x))
  meta = jnp.max(fp.analyze(x, use_ffi=False), axis=1)
  e = jnp.broadcast_to(meta[0], x.shape)
  w_ffi = jax.jit(lambda v, e: fp.encode(v, e, use_ffi=True))(x, e)
  w_ref = jax.jit(lambda v, e: fp.encode(v, e, use_ffi=False))(x, e)
  np.testing.assert_array_equal(w_ffi, w_ref)
  s = jnp.sum(w_ref, axis=1)
  d_ffi = jax.jit(lambda s, m: fp.decode(s, m, dtype, use_ffi=True))(s, meta)
  d_ref = jax.jit(lambda s, m: fp.decode(s, m, dtype, use_ffi=False))(s, meta)
  np.testing.assert_array_equal(_bits(d_ffi), _bits(d_ref))


@pytest.mark.parametrize("use_ffi", [False, pytest.param(True, marks=needs_ext)])
def test_exact_sum_is_order_independent_and_within_bound(use_ffi):
  rng = np.random.default_rng(1)
  x = _adversarial(rng)
  base = fp.exact_sum(jnp.asarray(x), use_ffi=use_ffi)
  for perm in (rng.permutation(8) for _ in range(4)):
    np.testing.assert_array_equal(_bits(fp.exact_sum(jnp.asarray(x[perm]), use_ffi=use_ffi)),
                                  _bits(base))
  ref = x.astype(np.float64).sum(0)
  finite = np.isfinite(ref) & (np.abs(ref) < 3.4e38)
  e_max = np.frexp(np.abs(x).max(0))[1]
  with np.errstate(over="ignore"):
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
  bound = 8 * np.ldexp(1.0, e_max - 41) + 2 * ulp
  err = np.abs(np.asarray(base, np.float64) - ref)
  assert np.all(err[finite] <= bound[finite]), np.max(err[finite] / bound[finite])


def test_catastrophic_cancellation_is_exact_at_the_fixed_point_resolution():
  x = jnp.asarray([[1e8], [1.0], [-1e8]], jnp.float32)
  # float32 summation in this order loses the 1.0 entirely; the exact sum keeps it.
  assert float(jnp.sum(x)) in (0.0, 1.0)
  assert float(fp.exact_sum(x)[0]) == 1.0


def test_ieee_special_values():
  nan, inf = float("nan"), float("inf")
  x = jnp.asarray([[nan, inf, inf, -inf, 0.0, -0.0],
                   [1.0, 1.0, -inf, -inf, 0.0, -0.0]], jnp.float32)
  r = np.asarray(fp.exact_sum(x))
  assert np.isnan(r[0]) and r[1] == inf and np.isnan(r[2]) and r[3] == -inf
  assert r[4] == 0.0 and r[5] == 0.0


def test_unsupported_dtype_names_the_dtype_and_the_fix():
  with pytest.raises(dtenjax.CollectiveError, match=r"int32.*astype"):
    fp.exact_sum(jnp.ones((2, 3), jnp.int32))


def test_too_many_contributions_is_a_clear_error():
  with pytest.raises(dtenjax.CollectiveError, match="2048"):
    fp.exact_sum(jnp.ones((fp.MAX_CONTRIBUTIONS + 1, 1), jnp.float32))


def test_no_retrace_on_repeated_calls():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return fp.exact_sum(x)
  x = jnp.ones((4, 16), jnp.float32)
  f(x)
  f(x + 1)
