"""dtenjax's collectives are typed and differentiated exactly like the lax collectives they stand
for, wherever a JAX user writes them (issue: "typed like JAX's own").

The matrix: every algorithm x op x reproducible x check_vma x the four ways users run per-device
code (``dtenjax.mesh_map``, plain ``jax.shard_map``, ``jax.shard_map`` under ``jax.set_mesh`` with
Explicit axes, ``dtenjax.pmap``). Each case checks

* the values against numpy,
* the result's varying-manual-axes type against that of the lax collective on the same input
  (``lax.psum``/``pmean``/``pmax``/``pmin``, ``psum_scatter``, ``all_gather``), read with
  ``jax.typeof`` in the same trace,
* ``jax.grad`` of a loss through it against the gradient through ``lax.psum``/``pmean`` (max/min,
  which lax cannot differentiate, against the numpy rule: the cotangent goes to the maximum).

The references are computed with JAX's own collectives and numpy, never with dtenjax.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import dtenjax

N = 8
ALGORITHMS = ("auto", "xla", "ring", "one_shot", "two_shot")
OPS = [("sum", False), ("mean", False), ("max", False), ("min", False), ("sum", True),
       ("mean", True)]
MODES = [("mesh_map", True), ("mesh_map", False), ("shard_map", True), ("shard_map", False),
         ("set_mesh", True), ("set_mesh", False), ("pmap", False)]
LAX = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}


def varying(x) -> frozenset:
  """The vma type of ``x`` as JAX reports it (``jax.typeof``)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _data(seed=0, per=6):
  # distinct values (no ties for max/min), some negative, exactly representable sums in float64
  rng = np.random.default_rng(seed)
  return (rng.permutation(N * per).astype(np.float32) - 17.5) * np.float32(0.25)


def _runner(mode: str, check_vma: bool, body, nargs: int = 1):
  """``(run, context)``: ``run(*xs)`` runs ``body`` per device over axis "i" with ``out_specs=P()``
  (pmap: per-device outputs stacked), jitted, the way a user of that API writes it; call it (and
  differentiate it) inside ``context``."""
  if mode == "pmap":
    f = dtenjax.pmap(body, axis_name="i")
    return (lambda *xs: f(*(x.reshape(N, -1) for x in xs))), contextlib.nullcontext()
  if mode == "set_mesh":
    mesh = jax.make_mesh((N,), ("i",), axis_types=(AxisType.Explicit,))
    f = jax.jit(jax.shard_map(body, in_specs=(P("i"),) * nargs, out_specs=P(),
                              check_vma=check_vma))
    # Explicit axes: shard_map's in_specs are assertions, so the input is resharded first.
    return (lambda *xs: f(*(jax.sharding.reshard(x, P("i")) for x in xs))), jax.set_mesh(mesh)
  mesh = dtenjax.topology_mesh((N,), ("i",))
  specs = (P("i"),) * nargs
  if mode == "mesh_map":
    return jax.jit(dtenjax.mesh_map(body, mesh, in_specs=specs, out_specs=P(),
                                    check_vma=check_vma)), contextlib.nullcontext()
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(),
                               check_vma=check_vma)), contextlib.nullcontext()


def _loss(run):
  return lambda x: jnp.sum(run(x) ** 2)


@functools.cache
def _lax_reference(mode, check_vma, op):
  """Values, type and (sum/mean) gradient of the lax collective, for one data set."""
  x = jnp.asarray(_data())
  types = []

  def body(v):
    y = LAX[op](v, "i")
    types.append(varying(y))
    return y
  run, context = _runner(mode, check_vma, body)
  with context:
    if op in ("sum", "mean"):
      y, g = map(np.asarray, jax.jit(lambda v: (run(v), jax.grad(_loss(run))(v)))(x))
    else:                                       # lax.pmax/pmin have no gradient
      y, g = np.asarray(run(x)), None
  return y, types[0], g


def _numpy_all_reduce(op, x):
  rows = x.astype(np.float64).reshape(N, -1)
  return {"sum": rows.sum(0), "mean": rows.mean(0), "max": rows.max(0),
          "min": rows.min(0)}[op]


def _numpy_maxmin_grad(op, x, mode):
  """d/dx of sum(y**2), y = max/min over devices: 2y at the selected entry, 0 elsewhere.

  With ``out_specs=P()`` the loss counts the replicated result once; pmap's stacked output counts
  it on every device (N times), as jax.pmap's gradient does."""
  rows = x.reshape(N, -1)
  y = rows.max(0) if op == "max" else rows.min(0)
  g = np.where(rows == y, 2 * y, 0).reshape(-1)
  return g * (N if mode == "pmap" else 1)


# The matrix: every op under jax.shard_map (check_vma True and False) and under pmap; under the
# two front ends that reach jax.shard_map another way (dtenjax.mesh_map, jax.set_mesh: how the
# mesh, the axis and check_vma get to the collective), one op of each kind of rule: a linear one
# (sum: psum's type and transpose), an order one (max: no transpose, the selected entry's
# gradient) and a reproducible one (mean: the fixed-point sum, then the division). The cases
# left out (mean, min and the reproducible sum under mesh_map and set_mesh) are each an op whose
# rule the kept cases check under jax.shard_map, on a front end the kept cases check with an op
# of the same kind of rule; 30 cases of the 42 of the full product.
_FRONT_ENDS = [m for m in MODES if m[0] in ("mesh_map", "set_mesh")]
_ONE_OF_EACH_RULE = [("sum", False), ("max", False), ("mean", True)]
CASES = ([(*o, *m) for o in OPS for m in MODES if m not in _FRONT_ENDS] +
         [(*o, *m) for o in _ONE_OF_EACH_RULE for m in _FRONT_ENDS])


@pytest.mark.parametrize("op,reproducible,mode,check_vma", CASES)
def test_all_reduce_is_typed_and_differentiated_like_lax(op, reproducible, mode, check_vma):
  # Every algorithm runs in one program on its own copy of the data, so one compile (and one
  # gradient) covers them all; the gradient with respect to copy a is algorithm a's.
  x = jnp.asarray(_data())
  types = {}

  def body(*vs):
    outs = []
    for a, v in zip(ALGORITHMS, vs):
      y = dtenjax.all_reduce(v, "i", op=op, algorithm=a, reproducible=reproducible)
      types[a] = varying(y)
      outs.append(y)
    return tuple(outs)
  run, context = _runner(mode, check_vma, body, len(ALGORITHMS))
  xs = (x,) * len(ALGORITHMS)

  def values_and_gradients(*a):
    # The outputs and the gradients in one jitted program, as a training step has them: one
    # compile per case, where calling run and then jax.grad(run) compiled three programs (run,
    # and grad's forward with residuals and its backward).
    grads = jax.grad(lambda *b: sum(jnp.sum(y ** 2) for y in run(*b)),
                     argnums=tuple(range(len(ALGORITHMS))))(*a)
    return run(*a), grads
  with context:
    ys, gs = jax.jit(values_and_gradients)(*xs)
    ys = [np.asarray(y) for y in ys]
  ref_y, ref_type, ref_g = _lax_reference(mode, check_vma, op)

  want = _numpy_all_reduce(op, np.asarray(x))
  for a, y, g in zip(ALGORITHMS, ys, gs):
    rows = y.reshape(N, -1) if mode == "pmap" else y[None]
    for row in rows:
      np.testing.assert_allclose(row, want, rtol=1e-6, atol=1e-6, err_msg=a)
    np.testing.assert_allclose(y, ref_y, rtol=1e-6, atol=1e-6, err_msg=a)
    assert types[a] == ref_type, (a, types[a], ref_type)
    g = np.asarray(g)
    if op in ("sum", "mean"):
      np.testing.assert_allclose(g, ref_g.reshape(g.shape), rtol=1e-6, atol=1e-6, err_msg=a)
    else:
      np.testing.assert_allclose(g.reshape(-1), _numpy_maxmin_grad(op, np.asarray(x), mode),
                                 rtol=1e-6, err_msg=a)


def test_readme_pattern_types_under_shard_map_defaults():
  """The README's quickstart shape: out_specs=P() of a reproducible all-reduce, jax defaults."""
  mesh = dtenjax.topology_mesh((N,), ("i",))
  f = jax.jit(jax.shard_map(
      lambda v: dtenjax.all_reduce(v, "i", algorithm="auto", reproducible=True),
      mesh=mesh, in_specs=P("i"), out_specs=P()))
  x = jnp.arange(N * 16, dtype=jnp.float32)
  np.testing.assert_array_equal(f(x), np.arange(N * 16, dtype=np.float64).reshape(N, -1).sum(0))


def _two_axis_mesh():
  return dtenjax.topology_mesh((2, 4), ("a", "b"))


@pytest.mark.parametrize("algorithm", ALGORITHMS + ("hierarchical",))
def test_reducing_one_axis_of_two_keeps_the_other_varying(algorithm):
  mesh = _two_axis_mesh()
  axes = ("a", "b") if algorithm == "hierarchical" else "b"
  got = []

  def body(v):
    y = dtenjax.all_reduce(v, axes, algorithm=algorithm)
    got.append((varying(y), varying(lax.psum(v, axes))))
    return y
  out_spec = P() if algorithm == "hierarchical" else P("a")
  x = jnp.asarray(_data(1)).reshape(N, -1)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=out_spec))
  y = np.asarray(f(x))
  ours, ref = got[0]
  assert ours == ref == (frozenset() if algorithm == "hierarchical" else frozenset({"a"}))
  blocks = np.asarray(x, np.float64).reshape(2, 4, -1, x.shape[1])
  want = blocks.sum((0, 1)) if algorithm == "hierarchical" else blocks.sum(1).reshape(-1, x.shape[1])
  np.testing.assert_allclose(y, want, rtol=1e-6)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_an_invariant_input_is_summed_like_psum_does(algorithm):
  """psum of a replicated value is n times it, and its gradient comes back through the cast."""
  mesh = dtenjax.topology_mesh((N,), ("i",))

  def run(red):
    return jax.jit(jax.shard_map(lambda w: red(w * 1.0), mesh=mesh, in_specs=P(),
                                 out_specs=P()))
  ours = run(lambda w: dtenjax.all_reduce(w, "i", algorithm=algorithm))
  ref = run(lambda w: lax.psum(w, "i"))
  w = jnp.linspace(-1.0, 2.0, 12, dtype=jnp.float32)
  np.testing.assert_allclose(ours(w), N * np.asarray(w), rtol=1e-6)
  np.testing.assert_allclose(jax.grad(_loss(ours))(w), jax.grad(_loss(ref))(w), rtol=1e-6)


@pytest.mark.parametrize("check_vma", [True, False])
def test_reduce_scatter_and_all_gather_are_typed_like_lax(check_vma):
  mesh = dtenjax.topology_mesh((N,), ("i",))
  types = []

  def body(v):
    rs = dtenjax.reduce_scatter(v, "i", scatter_dimension=0, tiled=True)
    ag = dtenjax.all_gather(rs, "i", axis=0, tiled=True)
    types.append((varying(rs), varying(lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True)),
                  varying(ag), varying(lax.all_gather(rs, "i", axis=0, tiled=True))))
    return ag

  def lax_body(v):
    return lax.all_gather(lax.psum_scatter(v, "i", scatter_dimension=0, tiled=True), "i",
                          axis=0, tiled=True)
  x = jnp.asarray(_data(2, per=N * 2))
  mk = lambda b: jax.jit(jax.shard_map(b, mesh=mesh, in_specs=P("i"), out_specs=P("i"),
                                       check_vma=check_vma))
  ours, ref = mk(body), mk(lax_body)
  np.testing.assert_allclose(ours(x), ref(x), rtol=1e-6)
  rs, rs_ref, ag, ag_ref = types[0]
  assert rs == rs_ref and ag == ag_ref
  np.testing.assert_allclose(jax.grad(_loss(ours))(x), jax.grad(_loss(ref))(x), rtol=1e-6)


def test_reduce_scatter_defaults_are_psum_scatters():
  """scatter_dimension=0, tiled=False, as lax.psum_scatter's defaults: the scattered dimension
  disappears."""
  mesh = dtenjax.topology_mesh((N,), ("i",))
  x = jnp.asarray(_data(3, per=N * 3)).reshape(N * N, 3)
  mk = lambda red: jax.jit(jax.shard_map(red, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
  ours = mk(lambda v: dtenjax.reduce_scatter(v, "i"))
  ref = mk(lambda v: lax.psum_scatter(v, "i"))
  assert ours(x).shape == ref(x).shape == (N * 3,)     # per device: (3,), the dimension gone
  np.testing.assert_allclose(ours(x), ref(x), rtol=1e-6)


def test_pytrees_buckets_and_local_axis_are_typed_like_psum():
  mesh = _two_axis_mesh()
  got = {}

  def body(v):
    tree = {"w": v, "b": v[:, :1] * 2.0, "s": jnp.sum(v)}
    out = dtenjax.all_reduce(tree, "b")                       # bucketed
    local = dtenjax.all_reduce(jnp.stack([v, -v, v]), "b", reproducible=True, local_axis=0)
    got["tree"] = {k: varying(o) for k, o in out.items()}
    got["want"] = {k: varying(lax.psum(t, "b")) for k, t in tree.items()}
    got["local"] = (varying(local), varying(lax.psum(v, "b")))
    return out["w"] + local
  x = jnp.asarray(_data(4)).reshape(N, -1)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P("a")))
  y = np.asarray(f(x))
  assert got["tree"] == got["want"]
  assert got["local"][0] == got["local"][1] == frozenset({"a"})
  blocks = np.asarray(x, np.float64).reshape(2, 4, -1, x.shape[1]).sum(1)
  np.testing.assert_allclose(y, 2 * blocks.reshape(-1, x.shape[1]), rtol=1e-6)


@pytest.mark.parametrize("algorithm", ("auto", "one_shot", "ring"))
def test_vmap_and_jit_around_a_typed_collective(algorithm):
  mesh = dtenjax.topology_mesh((N,), ("i",))
  f = jax.shard_map(lambda v: dtenjax.all_reduce(v, "i", algorithm=algorithm), mesh=mesh,
                    in_specs=P("i"), out_specs=P())
  xs = jnp.stack([jnp.asarray(_data(s)) for s in range(3)])
  out = jax.jit(jax.vmap(f))(xs)
  for s in range(3):
    np.testing.assert_allclose(out[s], _numpy_all_reduce("sum", np.asarray(xs[s])), rtol=1e-6)
  g = jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(f)(x) ** 2)))(xs)
  ref = jax.shard_map(lambda v: lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
  g_ref = jax.grad(lambda x: jnp.sum(jax.vmap(ref)(x) ** 2))(xs)
  np.testing.assert_allclose(g, g_ref, rtol=1e-6)


# --- the NVLink kernels (GPU suite: on whatever GPUs are present, one rank per GPU) -------------

@pytest.mark.gpu
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("op,reproducible", [("sum", False), ("mean", False), ("max", False),
                                             ("sum", True), ("mean", True)])
@pytest.mark.parametrize("record", ["nvlink_one_shot", "nvlink_two_shot"])
def test_nvlink_kernels_are_typed_and_differentiated_like_lax(record, op, reproducible,
                                                             check_vma):
  gpus = jax.devices("gpu")
  n = len(gpus)
  mesh = jax.sharding.Mesh(np.array(gpus), ("i",))
  x = jnp.asarray((np.random.default_rng(3).permutation(n * 64) - 30).astype(np.float32) * 0.5)
  types = {}

  def make(red, key):
    def body(v):
      y = red(v)
      types[key] = varying(y)
      return y
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P(),
                                 check_vma=check_vma))
  ours = make(lambda v: dtenjax.all_reduce(v, "i", op=op, algorithm=record,
                                           reproducible=reproducible), "ours")
  ref = make(lambda v: LAX[op](v, "i"), "lax")
  assert "dtenjax_p2p_all_reduce" in ours.lower(x).compile().as_text()   # the kernel, no fallback
  want = {"sum": np.sum, "mean": np.mean, "max": np.max}[op](
      np.asarray(x, np.float64).reshape(n, -1), axis=0)
  np.testing.assert_allclose(np.asarray(ours(x)), want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ours(x)), np.asarray(ref(x)), rtol=1e-6, atol=1e-6)
  assert types["ours"] == types["lax"], types
  g = np.asarray(jax.grad(_loss(ours))(x))
  if op in ("sum", "mean"):
    np.testing.assert_allclose(g, np.asarray(jax.grad(_loss(ref))(x)), rtol=1e-6, atol=1e-6)
  else:
    rows = np.asarray(x).reshape(n, -1)
    y = rows.max(0)
    np.testing.assert_allclose(g, np.where(rows == y, 2 * y, 0).reshape(-1), rtol=1e-6)
