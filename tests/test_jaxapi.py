"""dtenjax/_src/jaxapi.py, the one module that reads JAX's private state, against what JAX itself
reports publicly (jax.typeof, lax.psum's result type, jax.set_mesh)."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from dtenjax._src import jaxapi


def _public_vma(x) -> frozenset:
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return jax.sharding.Mesh(np.array(cpu_devices).reshape(2, 4), ("a", "b"),
                           axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize("check_vma", [True, False])
def test_types_agree_with_jax(mesh, check_vma):
  seen = {}

  def body(v, w):
    seen["checked"] = jaxapi.vma_checked()
    seen["manual"] = jaxapi.manual_axes()
    seen["v"] = (jaxapi.vma(v), _public_vma(v))
    seen["w"] = (jaxapi.vma(w), _public_vma(w))
    cast = jaxapi.to_varying(w, ("b",))
    seen["cast"] = (jaxapi.vma(cast), _public_vma(lax.pcast(w, "b", to="varying"))
                    if check_vma else frozenset())
    g = jaxapi.all_gather_invariant(v, ("b",))
    seen["gather"] = (jaxapi.vma(g), _public_vma(lax.psum(v, "b")))
    seen["struct"] = jaxapi.reduced_struct(v, ("b",))
    return g.sum(0)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), P()), out_specs=P("a"),
                            check_vma=check_vma))
  x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  y = f(x, jnp.ones(3))
  np.testing.assert_array_equal(y, np.asarray(x).reshape(2, 4, 3).sum(1))
  assert seen["checked"] is check_vma
  assert seen["manual"] == {"a", "b"}
  for key in ("v", "w", "cast", "gather"):
    ours, theirs = seen[key]
    assert ours == theirs, (key, ours, theirs)
  if check_vma:
    assert seen["v"][0] == {"a", "b"} and seen["gather"][0] == {"a"}
  struct = seen["struct"]
  assert struct.shape == (1, 3) and struct.dtype == jnp.float32


def test_outside_shard_map_there_are_no_types():
  x = jnp.ones(3)
  assert jaxapi.vma(x) == frozenset() and jaxapi.manual_axes() == frozenset()
  assert jaxapi.to_varying(x, ("a",)) is x


def test_concrete_mesh_only_under_set_mesh(cpu_devices):
  assert jaxapi.concrete_mesh() is None                 # jax's empty mesh is not a mesh
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Explicit,), devices=cpu_devices)
  with jax.set_mesh(mesh):
    assert jaxapi.concrete_mesh() == mesh
    seen = []
    jax.jit(lambda v: seen.append(jaxapi.concrete_mesh()) or v)(jnp.ones(8))
    assert seen == [mesh]                               # also while tracing under jit


def test_vmap_axes_gather_without_types():
  out = jax.vmap(lambda v: jaxapi.all_gather_invariant(v, ("v",)), axis_name="v")(jnp.arange(4.0))
  np.testing.assert_array_equal(out, np.broadcast_to(np.arange(4.0), (4, 4)))


def test_distributed_state_without_initialize():
  state = jaxapi.distributed_state()
  assert state is not None and getattr(state, "client", None) is None
  assert jaxapi.coordination_client() is None


@pytest.mark.parametrize("axes", [("a",), ("c", "a"), ("b", "c"), ("a", "b", "c")])
def test_device_groups_follow_lax_axis_index(cpu_devices, axes):
  """Row r of a group is the device whose ``lax.axis_index(axes)`` is r (JAX's own rank), and a
  row's devices agree on every other axis: read from a shard_map run, not from the helper."""
  mesh = jax.sharding.Mesh(np.array(cpu_devices).reshape(2, 2, 2), ("a", "b", "c"))
  rest = tuple(n for n in mesh.axis_names if n not in axes)

  def body(v):
    other = lax.axis_index(rest) if rest else 0
    return jnp.stack([lax.axis_index(axes), other])[None] + 0 * v

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b", "c")),
                              out_specs=P(("a", "b", "c"))))(np.zeros((8, 2), np.int32))
  rank = {s.device: tuple(int(t) for t in np.asarray(s.data)[0]) for s in out.addressable_shards}
  groups = jaxapi.device_groups(mesh.devices, mesh.axis_names, axes)
  size = int(np.prod([mesh.shape[a] for a in axes]))
  assert groups.shape == (8 // size, size)
  for g, row in enumerate(groups):
    assert [rank[d] for d in row] == [(r, g) for r in range(size)]


def test_axis_tuple():
  assert jaxapi.axis_tuple("a") == ("a",)
  assert jaxapi.axis_tuple(("a", "b")) == jaxapi.axis_tuple(["a", "b"]) == ("a", "b")


def test_inline_calls_puts_an_inlined_call_s_body_in_place():
  # jax 0.11 keeps a jax.jit(inline=True) call in the jaxpr (Inline.JAX_LATE) where jax 0.10
  # inlined it while tracing; the planner reads the inlined form (what XLA compiles). Built on
  # either version: a plain call's equations, marked inline as jax 0.10 marks them.
  f = jax.jit(lambda a, b: jnp.tanh(a) * b)
  closed = jax.make_jaxpr(lambda x, y: f(x, y) + f(y, x))(jnp.ones(3), jnp.ones(3))
  calls = [e for e in closed.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
  assert len(calls) == 2 and not any(jaxapi.inlined_by_jax(e) for e in calls)
  assert jaxapi.inline_calls(closed) is closed            # nothing to inline: unchanged
  marked = closed.replace(jaxpr=closed.jaxpr.replace(eqns=[
      e.replace(params={**e.params, "inline": True}) if e is calls[0] else e
      for e in closed.jaxpr.eqns]))
  out = jaxapi.inline_calls(marked)
  names = [e.primitive.name for e in out.jaxpr.eqns]
  assert names.count("jit") + names.count("pjit") == 1, names   # the unmarked call stays
  assert names[:2] == ["tanh", "mul"], names
  x, y = jnp.arange(3.0), jnp.arange(3.0) + 1
  np.testing.assert_array_equal(jax.extend.core.jaxpr_as_fun(out)(x, y)[0], f(x, y) + f(y, x))
  # the real thing where this JAX keeps such calls (0.11; jax 0.10 leaves none to inline)
  g = jax.jit(lambda a: jnp.exp(a) + 1, inline=True)
  real = jaxapi.inline_calls(jax.make_jaxpr(lambda x: g(x) * 2)(jnp.ones(3)))
  assert [e.primitive.name for e in real.jaxpr.eqns] == ["exp", "add", "mul"]
