"""Contract v2 of the reproducible sum (dtenjax/_src/collectives/fixed_point.py) against the
independent numpy reference in tests/fixed_point_ref.py, the error bound against math.fsum, and
the stored reference file the GPU suite compares its kernels with."""

import math
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src.collectives import fixed_point as fp
import fixed_point_ref as ref

REF_FILE = pathlib.Path(__file__).parent / "data" / "reproducible_ref.npz"


def _dtype(name):
  return ref.BF16 if name == "bfloat16" else np.dtype(np.float32)


def test_codes_follow_the_contract():
  x = np.array([0.0, -0.0, 1.4e-45, -1e-39, 1.1754944e-38, 1.0, -3.0, 3.4e38, np.inf, -np.inf,
                np.nan], np.float32)
  want = [0, 0, 1, 1, 1, 127, 128, 254, 255, 255, 255]
  np.testing.assert_array_equal(np.asarray(fp.codes(jnp.asarray(x))), want)
  np.testing.assert_array_equal(ref.codes(x), want)        # the reference agrees
  assert fp.codes(jnp.asarray(x)).dtype == jnp.uint8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 33])
def test_exact_sum_bits_equal_the_reference(dtype, k):
  x = ref.contributions(k, 2000, seed=k).astype(_dtype(dtype))
  got = np.asarray(jax.jit(fp.exact_sum)(jnp.asarray(x)))
  want = ref.exact_sum(x)
  assert got.dtype == want.dtype
  bad = np.nonzero(ref.bits(got) != ref.bits(want))[0]
  assert bad.size == 0, (bad[:8], got[bad[:8]], want[bad[:8]])


def test_the_test_data_exercises_every_branch():
  x = ref.contributions(8, 2000, seed=8)
  r = ref.exact_sum(x)
  c = ref.codes(x).max(axis=0)
  assert {0, 255} <= set(c.tolist()) and (c == 1).any()            # zero, special, subnormal
  assert np.isnan(r).any() and np.isposinf(r).any() and np.isneginf(r).any()
  tiny = (r != 0) & (np.abs(r) < np.finfo(np.float32).tiny)
  assert tiny.any(), "some sums must be subnormal"
  assert (np.abs(r[np.isfinite(r)]) > 3e38).any()


def test_word_exchange_and_local_fold_give_the_same_bits():
  x = jnp.asarray(ref.contributions(8, 3000, seed=3))
  c = jnp.max(fp.codes(x), axis=0)
  words = jnp.sum(fp.encode(x, c), axis=1)                 # what the collectives exchange
  via_words = jax.jit(fp.decode_f32)(words, c)
  local = jax.jit(fp.local_sum_f32)(x)
  np.testing.assert_array_equal(ref.bits(np.asarray(via_words)), ref.bits(np.asarray(local)))
  assert jnp.all(words[1] >= 0) and jnp.all(words[1] < 8 << 20)  # lo sums stay small


def test_special_words_are_the_flag_counts():
  x = jnp.asarray(np.array([[np.nan, np.inf, -np.inf, 1.0], [1.0, np.inf, 2.0, 2.0]],
                           np.float32))
  c = jnp.max(fp.codes(x), axis=0)
  w = np.asarray(jnp.sum(fp.encode(x, c), axis=1))
  np.testing.assert_array_equal(w[:, :3], [[1, 0, 1], [1, 2, 0]])  # (NaN|-inf, NaN|+inf) counts


def test_order_independence():
  rng = np.random.default_rng(1)
  x = ref.contributions(16, 1000, seed=2)
  base = np.asarray(fp.exact_sum(jnp.asarray(x)))
  for _ in range(4):
    perm = rng.permutation(16)
    np.testing.assert_array_equal(ref.bits(np.asarray(fp.exact_sum(jnp.asarray(x[perm])))),
                                  ref.bits(base))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_error_bound_against_fsum(dtype):
  k = 24
  x = ref.contributions(k, 3000, seed=5).astype(_dtype(dtype))
  r = np.asarray(fp.exact_sum(jnp.asarray(x))).astype(np.float64)
  x64 = ref.widen(x).astype(np.float64)
  checked = 0
  for j in range(x64.shape[1]):
    col = x64[:, j]
    if not np.all(np.isfinite(col)) or not np.isfinite(r[j]):
      continue
    exact = math.fsum(col)
    amax = np.max(np.abs(col))
    if amax == 0:
      assert r[j] == 0 and not np.signbit(r[j])               # zero results are +0.0
      continue
    e = math.frexp(amax)[1]                                   # 2**e > max |x|
    ulp32 = float(np.spacing(np.float32(abs(r[j]))))
    bound = k * 2.0 ** (e - 41) + 2 * ulp32
    if dtype == "bfloat16":
      bound += 0.5 * float(np.spacing(np.asarray(abs(r[j]), ref.BF16)).astype(np.float64))
    assert abs(r[j] - exact) <= bound, (j, col, r[j], exact, bound)
    checked += 1
  assert checked > 2500


def test_divide_is_ieee_division_with_subnormal_quotients():
  rng = np.random.default_rng(7)
  r = np.concatenate([rng.standard_normal(4000) * np.exp2(rng.integers(-149, -100, 4000)),
                      rng.standard_normal(1000) * 1e3, [0.0, -0.0, 1.4e-45, 2.8e-45, np.inf,
                                                         -np.inf, np.nan, 1.1754942e-38]])
  r = r.astype(np.float32)
  for n in (2, 3, 8, 24, 1000):
    got = np.asarray(jax.jit(lambda v, n=n: fp.divide(v, n))(jnp.asarray(r)))
    want = r / np.float32(n)                     # numpy: IEEE, subnormals kept
    np.testing.assert_array_equal(ref.bits(got), ref.bits(want), err_msg=f"n={n}")


def test_cancellation_is_exact_at_the_fixed_point_resolution():
  x = jnp.asarray([[1e8], [1.0], [-1e8]], jnp.float32)
  naive = np.float32(np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)
  assert naive == 0.0                                       # float32 in this order loses the 1
  assert float(fp.exact_sum(x)[0]) == 1.0


def test_reference_file_holds_the_contract_bits():
  """tests/data/reproducible_ref.npz: the CPU bits the GPU suite compares its kernels with."""
  data = np.load(REF_FILE)
  for dtype in ("float32", "bfloat16"):
    x = data[f"x_{dtype}"].view(_dtype(dtype)) if dtype == "bfloat16" else data[f"x_{dtype}"]
    for op in ("sum", "mean"):
      want = data[f"{op}_{dtype}"]
      np.testing.assert_array_equal(ref.bits(ref.exact_sum(x, mean=op == "mean")), want,
                                    err_msg=f"reference drifted: {op} {dtype}")
      got = fp.exact_sum(jnp.asarray(x))
      if op == "mean":
        got = fp.local_sum_f32(jnp.asarray(x), mean=True).astype(x.dtype)
      np.testing.assert_array_equal(ref.bits(np.asarray(got)), want, err_msg=f"{op} {dtype}")


def test_unsupported_dtype_names_the_dtype_and_the_fix():
  with pytest.raises(dtenjax.CollectiveError, match=r"int32.*astype"):
    fp.exact_sum(jnp.ones((2, 3), jnp.int32))


def test_too_many_contributions_is_a_clear_error():
  with pytest.raises(dtenjax.CollectiveError, match=r"1025 contributions.*1024"):
    fp.exact_sum(jnp.ones((fp.MAX_CONTRIBUTIONS + 1, 1), jnp.float32))


def test_no_retrace_on_repeated_calls():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return fp.exact_sum(x)
  x = jnp.ones((4, 16), jnp.float32)
  f(x)
  f(x + 1)
