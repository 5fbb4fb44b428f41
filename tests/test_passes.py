"""jaxpr passes: psum substitution, communication fusion (counted in compiled HLO), memory plan."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.collectives import buckets
from dtenjax._src.collectives.passes import fusion
from dtenjax._src.collectives.passes import memory
from dtenjax._src.collectives.passes import substitute

AX = ("o", "i")
LAYERS = 6


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices).reshape(2, 4), AX)


# Test data from numpy: an eager jax.random draw (or jnp op) is a compiled program per shape.
def _normal(seed, shape):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _params():
  return [{"w": _normal(10 + i, (8, 8)) * np.float32(0.3), "b": np.full((8,), 0.01 * i, np.float32)}
          for i in range(LAYERS)]


def step(params, x, y):
  """A real data-parallel step: per-device loss, grad, pmean of every gradient, SGD update."""
  def loss(ps):
    h = x
    for p in ps:
      h = jnp.tanh(h @ p["w"] + p["b"])
    return jnp.mean((h - y) ** 2)
  l, g = jax.value_and_grad(loss)(params)
  g = jax.tree.map(lambda t: lax.pmean(t, AX), g)
  new = jax.tree.map(lambda p, t: p - 0.1 * t, params, g)
  return new, lax.pmean(l, AX)


def _compile(mesh, body):
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AX), P(AX)),
                            out_specs=(P(), P()), check_vma=False))
  return f


def _data():
  x = _normal(1, (32, 8))
  return x, np.sin(x)


def _count(hlo, op):
  """Collectives ``op`` that move data (not all-reduces over groups of one device each: the
  run-time offsets of algorithms/base.py's ``opaque``)."""
  return sum(len(re.findall(rf" {op}(-start)?\(", line)) for line in hlo.splitlines()
             if not re.search(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}", line))


@pytest.fixture(scope="module")
def compiled(mesh):
  args = (_params(),) + _data()
  plain = _compile(mesh, step)
  subst = _compile(mesh, substitute.substitute_psum(step, algorithm="one_shot"))
  fused = _compile(mesh, fusion.fuse_collectives(step, bucket_bytes=1 << 20,
                                                 algorithm="one_shot"))
  return args, {k: (f, f.lower(*args).compile().as_text())
                for k, f in (("plain", plain), ("subst", subst), ("fused", fused))}


def test_fusion_reduces_collectives_and_keeps_bits(compiled):
  args, c = compiled
  n_params = 2 * LAYERS
  # XLA's own all-reduce combiner already merges psums into one variadic all-reduce ...
  assert _count(c["plain"][1], "all-reduce") == 1
  # ... but not all-gathers: unbucketed dtenjax collectives cost one per gradient (+ the loss)
  assert _count(c["subst"][1], "all-gather") == n_params + 1
  assert _count(c["fused"][1], "all-gather") == 1             # gradients and loss in one bucket
  assert _count(c["fused"][1], "all-reduce") == 0
  a, b = c["subst"][0](*args), c["fused"][0](*args)
  jax.tree.map(np.testing.assert_array_equal, a, b)          # bucketed == unbucketed, bitwise
  ref = c["plain"][0](*args)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, ref)


def test_substitute_psum_picks_the_algorithm(mesh):
  x = _normal(2, (8, 5))
  body = lambda v: lax.psum(v, AX) * 2.0
  wrapped = substitute.substitute_psum(body, algorithm="ring")
  f = jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=P(AX), out_specs=P(AX),
                            check_vma=False))
  hlo = f.lower(x).compile().as_text()
  # ring: n-1 permutes for the reduce-scatter, one all-gather, no all-reduce
  assert _count(hlo, "collective-permute") == 7 and _count(hlo, "all-reduce") == 0
  assert _count(hlo, "all-gather") == 1
  assert wrapped.psum_count == 1
  np.testing.assert_allclose(f(x)[0], 2 * x.sum(0), rtol=1e-5, atol=1e-6)


def test_substitute_recurses_into_shard_map_and_jit(mesh):
  x = _normal(3, (8, 5))

  @jax.jit
  def inner(v):
    return lax.psum(v, "i")
  outer = jax.shard_map(lambda v: inner(v) + 1.0, mesh=mesh, in_specs=P(AX), out_specs=P(AX),
                        check_vma=True)
  wrapped = substitute.substitute_psum(outer, algorithm="two_shot")
  hlo = jax.jit(wrapped).lower(x).compile().as_text()
  assert _count(hlo, "all-to-all") == 1 and _count(hlo, "all-reduce") == 0
  np.testing.assert_allclose(jax.jit(wrapped)(x), outer(x), rtol=1e-5, atol=1e-6)


def test_fusion_rejects_non_positive_bucket():
  with pytest.raises(errors.ConfigurationError, match="bucket_bytes=0"):
    fusion.fuse_collectives(step, bucket_bytes=0)


def test_plan_buckets():
  plan = buckets.plan_buckets([(10, jnp.float32), (5, jnp.int32), (20, jnp.float32),
                              (100, jnp.float32), (1, jnp.float32)], bucket_bytes=128)
  assert plan == [[0, 2], [1], [3], [4]]


def test_memory_plan_table():
  def f(a, b):
    c = a * 2.0
    d = c + b
    e = jnp.sin(d)
    g = e * e
    return g.sum()
  a = jnp.ones((64, 64))
  plan = memory.memory_plan(f, a, a)
  ids = {r.buffer_id for r in plan.rows}
  assert len(ids) == len(plan.rows) >= 6
  rows = {r.producer: r for r in plan.rows if r.producer != "input"}
  assert rows["mul"].start < rows["mul"].end                  # c lives until d uses it
  slots = [r.slot for r in plan.rows if r.shape == (64, 64)]
  assert len(set(slots)) < len(slots)                         # dead buffers are reused
  assert plan.planned_bytes < plan.naive_bytes
  assert plan.peak_live_bytes >= 3 * 64 * 64 * 4
  assert plan.xla.get("argument_size_in_bytes") == 2 * 64 * 64 * 4
  assert "peak live" in plan.table() and "XLA:" in plan.table()
  assert plan.xla_unavailable == ""


def test_memory_plan_says_why_xla_has_no_numbers():
  # a step that traces but does not compile (a custom call with no handler on this backend):
  # the table says so, with the compiler's error, instead of silently lacking XLA's line
  def f(a):
    call = jax.ffi.ffi_call("dtenjax_test_no_such_target", jax.ShapeDtypeStruct(a.shape, a.dtype))
    return call(a) * 2.0
  plan = memory.memory_plan(f, jnp.ones((8,)))
  assert plan.xla == {} and len(plan.rows) >= 3
  assert plan.xla_unavailable.startswith("compiling it failed: ")
  assert "dtenjax_test_no_such_target" in plan.xla_unavailable, plan.xla_unavailable
  assert f"XLA: no numbers ({plan.xla_unavailable})" in plan.table()
  assert memory.memory_plan(f, jnp.ones((8,)), with_xla=False).xla_unavailable == "with_xla=False"
