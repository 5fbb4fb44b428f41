"""Tests of dtenjax._src.collectives.algorithms.butterfly: its stated order bit for bit against a
numpy tree written from the docstring, its typing under check_vma=True, its gate (power-of-two
worlds) and that the registry, auto and the planner treat it as any other record."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import dtenjax
from dtenjax._src import errors
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import butterfly
from dtenjax._src.collectives.algorithms import registry
from tests import helpers

AX = ("o", "i")


_wide = helpers.wide


def _tree(rows, dtype=np.float32):
  """The stated order: the lower half's tree plus the upper half's, down to single ranks."""
  if len(rows) == 1:
    return rows[0].astype(dtype)
  half = len(rows) // 2
  return (_tree(rows[:half], dtype) + _tree(rows[half:], dtype)).astype(dtype)


_fold = helpers.fold


def _vma(x) -> frozenset:
  """The varying manual axes of ``x`` as JAX reports them (``jax.typeof``)."""
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


_smap = functools.partial(helpers.smap, check_vma=True)


def test_numpy_tree_is_not_another_order():
  x = _wide((8, 101), 0)
  assert not np.array_equal(_tree(list(x)), _fold(list(x)))          # not one_shot's left fold
  assert not np.array_equal(_tree(list(x)), _tree(list(np.roll(x, 1, axis=0))))
  assert not np.array_equal(_tree(list(x)), _tree(list(x[[0, 4, 1, 5, 2, 6, 3, 7]])))  # pairs 0+4...


@pytest.mark.parametrize("n,shape,axes", [(8, (2, 4), AX), (8, (8,), "x"), (4, (4,), "x"),
                                          (2, (2,), "x")])
@pytest.mark.parametrize("size", [1, 13, 1000])
def test_all_reduce_is_the_stated_tree_on_every_rank(cpu_devices, n, shape, axes, size):
  names = axes if isinstance(axes, tuple) else (axes,)
  mesh = Mesh(np.array(cpu_devices[:n]).reshape(shape), names)
  x = _wide((n, size), size + n)
  f = _smap(mesh, lambda v: dtenjax.all_reduce(v, axes, algorithm="butterfly"), axes)
  y = np.asarray(f(x.reshape(-1))).reshape(n, size)
  np.testing.assert_array_equal(y, np.broadcast_to(_tree(list(x)), y.shape))
  np.testing.assert_array_equal(np.asarray(f(x.reshape(-1))).reshape(n, size), y)   # every run


def test_bf16_sums_in_f32_and_rounds_once_and_mean_divides_once(cpu_devices):
  mesh = Mesh(np.array(cpu_devices), ("x",))
  x = _wide((8, 64), 5)
  xb = x.astype(ml_dtypes.bfloat16)
  f = _smap(mesh, lambda v: dtenjax.all_reduce(v, "x", algorithm="butterfly"), "x")
  want = _tree(list(xb.astype(np.float32))).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(xb.reshape(-1)))).reshape(8, 64)[0],
                                want)
  m = _smap(mesh, lambda v: dtenjax.all_reduce(v, "x", op="mean", algorithm="butterfly"), "x")
  np.testing.assert_array_equal(np.asarray(m(x.reshape(-1))).reshape(8, 64)[0],
                                _tree(list(x)) / np.float32(8))


def test_reduce_scatter_leaves_rank_r_with_block_r_in_tree_order(cpu_devices):
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  x = _wide((8, 8, 5), 7)                           # [rank, block, elements]
  f = _smap(mesh, lambda v: dtenjax.reduce_scatter(v[0], AX, algorithm="butterfly")[None], AX)
  y = np.asarray(f(x))                              # [rank, elements]
  for r in range(8):
    np.testing.assert_array_equal(y[r], _tree(list(x[:, r])))


def test_max_min_propagate_nan_like_every_algorithm(cpu_devices):
  mesh = Mesh(np.array(cpu_devices), ("x",))
  x = _wide((8, 4), 9)
  x[3, 0] = np.nan
  x[:, 1] = [-0.0, 0.0] * 4
  f = _smap(mesh, lambda v: jnp.stack([dtenjax.all_reduce(v, "x", op=op, algorithm=a)
                                       for op in ("max", "min") for a in ("butterfly", "one_shot")]),
            "x", out_specs=P(None, "x"))
  y = np.asarray(f(x.reshape(-1))).reshape(4, 8, 4)[:, 0]
  np.testing.assert_array_equal(y[0].view(np.uint32), y[1].view(np.uint32))      # max
  np.testing.assert_array_equal(y[2].view(np.uint32), y[3].view(np.uint32))      # min
  assert np.isnan(y[0, 0]) and not np.signbit(y[0, 1]) and np.signbit(y[2, 1])


def test_typed_and_differentiated_like_psum_under_check_vma(cpu_devices):
  """Invariant over the reduced axes (out_specs=P() accepts it, as psum's), and jax.grad through
  it is psum's: the all-reduce's transpose."""
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  x = _wide((8, 6), 11).reshape(-1)

  def types(v):
    mine = dtenjax.all_reduce(v, AX, algorithm="butterfly")
    ref = lax.psum(v, AX)
    assert _vma(mine) == _vma(ref) == frozenset() and _vma(v) == {"o", "i"}
    inner = dtenjax.all_reduce(v, "i", algorithm="butterfly")
    assert _vma(inner) == _vma(lax.psum(v, "i")) == {"o"}
    return mine
  y = _smap(mesh, types, AX, out_specs=P())(x)
  np.testing.assert_array_equal(np.asarray(y), _tree(list(x.reshape(8, 6))))

  def loss(v, alg):
    s = dtenjax.all_reduce(v * v, AX, algorithm=alg) if alg else lax.psum(v * v, AX)
    return jnp.sum(jnp.sin(s))
  grads = [jax.grad(lambda v, a=a: _smap(mesh, lambda w: loss(w, a), AX, out_specs=P())(v))(x)
           for a in ("butterfly", None)]
  np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-6)


def test_reproducible_sum_gives_the_contract_bits(cpu_devices):
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  x = _wide((8, 33), 13).reshape(-1)
  got = [np.asarray(_smap(mesh, lambda v, a=a: dtenjax.all_reduce(v, AX, algorithm=a,
                                                                    reproducible=True), AX)(x))
         for a in ("butterfly", "one_shot")]
  np.testing.assert_array_equal(got[0].view(np.uint32), got[1].view(np.uint32))


def test_only_power_of_two_worlds(cpu_devices):
  call = base.Call("all_reduce", "sum", jnp.float32, ("x",), (6,), 64)
  assert "power-of-two number of ranks, got 6" in butterfly.ALGORITHM.why_not(call)
  assert butterfly.ALGORITHM.why_not(base.Call("all_reduce", "sum", jnp.float32, ("x",), (8,),
                                               64)) is None
  mesh = Mesh(np.array(cpu_devices[:6]), ("x",))
  with pytest.raises(errors.CollectiveError, match=r"(?s)'butterfly' cannot run.*power-of-two.*got 6"):
    _smap(mesh, lambda v: dtenjax.all_reduce(v, "x", algorithm="butterfly"), "x")(jnp.ones(6))


def test_the_registry_auto_and_the_planner_rank_it_where_it_can_run():
  topo = dtenjax.Topology.fixture("dgx_a100_8")
  assert "butterfly" in registry.names()
  # a power of two: ranked (and on this GPU fixture never cheaper than two_shot, which moves the
  # same bytes in two collectives where butterfly needs log2(n) + 1)
  ch = dtenjax.plan_all_reduce(1 << 20, list(range(8)), topo)
  assert ch.times["butterfly"] > ch.times["two_shot"]
  two = dtenjax.plan_all_reduce(64, [0, 1, 2, 3], topo)
  assert "butterfly" in two.times
  # not a power of two: neither auto nor the planner can count on it
  six = dtenjax.plan_all_reduce(1 << 20, list(range(6)), topo)
  assert "butterfly" not in six.times and "butterfly: butterfly needs a power-of-two" in six.reason


def test_overflowing_partial_sums_give_lax_inf_nan_semantics_not_nan(cpu_devices):
  """A tree adds partial sums that each overflowed, with opposite signs: unscaled that is NaN
  where no input is NaN or infinite and lax.psum (a rank-order fold) gives a number or an
  infinity. Butterfly gives NaN only where an input is NaN or both infinities occur, +-inf where
  an input is infinite or the sum overflows, and the sum itself where it is finite."""
  mesh = Mesh(np.array(cpu_devices), ("x",))
  big = np.finfo(np.float32).max
  cols = np.array([
      [big, big, big, big, -big, -big, -big, -big],        # 0: the exact sum is 0
      [big, big, -big, -big, 1, 2, 3, 4],                  # 1: exact sum 10
      [np.inf, big, big, big, -big, -big, -big, -big],     # 2: +inf
      [np.inf, 0, 0, 0, 0, 0, 0, -np.inf],                 # 3: both infinities: NaN
      [1, 2, np.nan, 3, 4, 5, 6, 7],                       # 4: NaN
      [big] * 8,                                           # 5: the sum overflows: +inf
      [-big] * 8,                                          # 6: -inf
  ], np.float32).T                                         # [rank, column]
  f = _smap(mesh, lambda v: jnp.stack([dtenjax.all_reduce(v, "x", algorithm="butterfly"),
                                       lax.psum(v, "x")]), "x", out_specs=P(None, "x"))
  y, lax_y = np.asarray(f(cols.reshape(-1))).reshape(2, 8, -1)[:, 0]
  np.testing.assert_array_equal(y, [0, 10, np.inf, np.nan, np.nan, np.inf, -np.inf])
  assert np.isnan(y).tolist() == np.isnan(lax_y).tolist()          # NaN exactly where lax's is
  # bfloat16 accumulates in float32, whose range bfloat16's max nearly fills: scaled as well
  bmax = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
  xb = jnp.asarray((cols / big * bmax).astype(ml_dtypes.bfloat16).reshape(-1))
  g = _smap(mesh, lambda v: dtenjax.all_reduce(v, "x", algorithm="butterfly"), "x")
  yb = np.asarray(g(xb)).reshape(8, -1)[0].astype(np.float32)
  np.testing.assert_array_equal(yb[[2, 3, 4, 5, 6]], [np.inf, np.nan, np.nan, np.inf, -np.inf])
  assert np.all(np.isfinite(yb[[0, 1]]))
