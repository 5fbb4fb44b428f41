import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src import ffi
from dtenjax._src.compression import topk

needs_ext = pytest.mark.skipif(not ffi.has_target(topk.TARGET, "cpu"),
                               reason="native extension with dtenjax_topk_pack not built")
METHODS = ["cumsum", pytest.param("ffi", marks=needs_ext)]


def _ref_pack(x, t, k):
  """numpy reference: first k indices with |x| >= t in ascending order, padded with n / 0."""
  x = np.asarray(x, np.float32)
  sel = np.flatnonzero(np.abs(x) >= t)
  idx = np.full(k, len(x), np.int32)
  val = np.zeros(k, np.float32)
  idx[:min(k, len(sel))] = sel[:k]
  val[:min(k, len(sel))] = x[sel[:k]]
  return idx, val, len(sel)


# Every size under jax.jit; called eagerly (each op dispatched on its own, the custom call too)
# at two of them: pack branches on no value, so an eager call computes what the jitted program
# does, and each eager size was a dozen programs of its own (6 cases of 20 left out).
_SIZES = [(1, 1, 0.0), (1003, 50, 2.0), (1003, 5, 1.0), (4097, 4097, 0.5), (64, 3, 10.0)]
_EAGER_SIZES = [(1003, 50, 2.0), (4097, 4097, 0.5)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("jit,n,k,t", [(True, *s) for s in _SIZES] +
                         [(False, *s) for s in _EAGER_SIZES])
def test_pack_matches_numpy_reference(method, jit, n, k, t):
  rng = np.random.default_rng(n + k)
  x = rng.standard_normal(n).astype(np.float32)
  if n > 10:
    x[7] = np.nan                                   # NaN never passes
  f = lambda x: topk.pack(x, jnp.float32(t), k, pack=method)
  idx, val, count = (jax.jit(f) if jit else f)(jnp.asarray(x))
  ridx, rval, rcount = _ref_pack(x, t, k)
  np.testing.assert_array_equal(np.asarray(idx), ridx)
  np.testing.assert_array_equal(np.asarray(val), rval)
  assert int(count) == rcount


@needs_ext
def test_ffi_and_cumsum_agree_bitwise_bf16():
  x = jnp.asarray(np.random.default_rng(3).standard_normal(5000), jnp.bfloat16)
  a = topk.pack(x, jnp.float32(1.5), 200, pack="ffi")
  b = topk.pack(x, jnp.float32(1.5), 200, pack="cumsum")
  assert a[1].dtype == jnp.bfloat16
  for u, v in zip(a, b):
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("method", METHODS)
def test_pack_at_exact_kth_value_gives_exact_topk_set(method):
  rng = np.random.default_rng(5)
  x = rng.permutation(np.linspace(-3, 3, 20001)).astype(np.float32)   # distinct magnitudes...
  x = x + np.float32(1e-4) * np.sign(x)                                # ... except +-pairs: break
  x[x > 0] += np.float32(3e-5)
  k = 200
  ref_idx, ref_val = topk.exact_topk(jnp.asarray(x), k)
  t = jnp.min(jnp.abs(ref_val))
  idx, val, count = topk.pack(jnp.asarray(x), t, k, pack=method)
  assert int(count) == k
  assert set(np.asarray(idx).tolist()) == set(np.asarray(ref_idx).tolist())
  np.testing.assert_array_equal(np.sort(np.asarray(val)), np.sort(np.asarray(ref_val)))


@pytest.mark.parametrize("method", METHODS)
def test_sampled_select_is_close_to_exact(method):
  x = jnp.asarray(np.random.default_rng(7).standard_normal(200_000), jnp.float32)
  k = 2000
  idx, val, count = jax.jit(lambda x: topk.select(x, k, pack=method))(x)
  ref, _ = topk.exact_topk(x, k)
  assert 0.5 * k <= int(count) <= 1.5 * k
  overlap = len(set(np.asarray(idx).tolist()) & set(np.asarray(ref).tolist())) / k
  assert overlap > 0.8, overlap
  # Values are the entries of x at the indices (padding slots have idx = n, val = 0).
  ii = np.asarray(idx)
  ok = ii < x.shape[0]
  np.testing.assert_array_equal(np.asarray(val)[ok], np.asarray(x)[ii[ok]])
  assert np.all(np.asarray(val)[~ok] == 0)


def test_sample_avoids_row_aliasing_and_small_vectors_are_exact():
  # A matrix whose large entries all sit in one column: a plain stride-64 sample would see
  # only that column (or never), and the cut would be far off.
  n_rows, n_cols = 2048, 64
  x = np.full((n_rows, n_cols), 0.01, np.float32)
  x[:, 3] = np.linspace(1.0, 2.0, n_rows)
  t = float(topk.sample_threshold(jnp.asarray(x.ravel()), 1024, sample_ratio=0.02))
  count = int((np.abs(x) >= t).sum())
  assert 512 <= count <= 1536, count
  small = jnp.asarray(np.random.default_rng(1).standard_normal(3000), jnp.float32)
  ref = jax.lax.top_k(jnp.abs(small), 30)[0][-1]
  assert float(topk.sample_threshold(small, 30)) == float(ref)


@pytest.mark.parametrize("method", METHODS)
def test_far_off_cut_falls_back_to_exact(method):
  # k large values hidden where the sample does not look: the sampled cut is 0, every element
  # passes, count = n > 1.5 k, so select recomputes with lax.top_k.
  n, k = 100_000, 64
  x = np.zeros(n, np.float32)
  sample = set(topk._sample_indices(n, topk.sample_size(n, 0.01, k)).tolist())
  free = [i for i in range(n) if i not in sample][::700][:k]
  assert len(free) == k
  x[free] = np.arange(1, k + 1, dtype=np.float32)
  idx, val, count = topk.select(jnp.asarray(x), k, pack=method)
  assert int(count) == k
  assert set(np.asarray(idx).tolist()) == set(free)


def test_select_exact_is_lax_top_k_and_traces_once():
  x = jnp.asarray(np.random.default_rng(9).standard_normal(5000), jnp.float32)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return topk.select(x, 100)

  for _ in range(3):
    f(x + 1.0)
  idx, _, _ = topk.select(x, 100, selection="exact")
  ref = jax.lax.top_k(jnp.abs(x), 100)[1]
  np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref))


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(dtenjax.CollectiveError, match="int32 is not supported"):
    topk.select(jnp.arange(10), 2)
  with pytest.raises(dtenjax.ConfigurationError, match="pack method 'fast'"):
    topk.pack(jnp.ones(10), 0.5, 2, pack="fast")
  with pytest.raises(dtenjax.ConfigurationError, match="selection 'approx'"):
    topk.select(jnp.ones(10), 2, selection="approx")


def test_num_selected():
  assert topk.num_selected(1000, 0.01) == 10
  assert topk.num_selected(1001, 0.01) == 11
  assert topk.num_selected(10, 0.001) == 1
  assert topk.num_selected(10, 1.0) == 10
  assert topk.num_selected(0, 0.5) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,t", [(1, 1, 0.0), (1023, 7, 2.5), (1_000_003, 10_000, 2.0),
                                   (1_000_003, 100, 3.0), (5_000_000, 60_000, 2.5)])
def test_cuda_kernel_matches_cumsum_and_numpy_on_gpu(n, k, t):
  if not ffi.has_target(topk.TARGET, "CUDA"):
    pytest.skip("dtenjax_topk_pack is not built for CUDA")
  gpu = jax.devices("gpu")[0]
  x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
  if n > 10:
    x[5] = np.nan
  xd = jax.device_put(jnp.asarray(x), gpu)
  for _ in range(2):                                        # poison-free: outputs fully written
    a = jax.jit(lambda x: topk.pack(x, jnp.float32(t), k, pack="ffi"))(xd)
  b = jax.jit(lambda x: topk.pack(x, jnp.float32(t), k, pack="cumsum"))(xd)
  ref = _ref_pack(x, t, k)
  for u, v, r in zip(a, b, ref):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(u), r)
