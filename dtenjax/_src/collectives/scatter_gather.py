"""The reduce-scatter and the all-gather of one array, each the other's derivative.

``reduce_scatter.py`` and ``all_gather.py`` check their arguments and call these per leaf. The
transpose of a reduce-scatter is an all-gather of the cotangent and that of an all-gather a
reduce-scatter, which is why the two live here together, below both public modules.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.collectives import common
from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import ring
from dtenjax._src.contract import Contract


@dataclasses.dataclass(frozen=True)
class Spec:
  """One leaf's collective, static (the custom VJP's nondifferentiable argument)."""
  axes: tuple[str, ...]
  op: str
  algorithm: str
  deterministic: bool
  dim: int
  tiled: bool = True
  contract: Contract = Contract.NONE   # parsed once, by reduce_scatter
  invariant: bool = False           # all_gather(to="invarying") over typed axes


def _rs_impl(x, s: Spec):
  ctx = common.context(s.axes)
  n = math.prod(ctx.axis_sizes)
  call = common.make_call("reduce_scatter", x.dtype, x.size * jnp.dtype(x.dtype).itemsize, ctx,
                          s.axes, s.op, s.algorithm, s.deterministic, s.contract)
  record = common.resolve(s.algorithm, call, ctx)
  blocks = jnp.moveaxis(x, s.dim, 0)
  blocks = blocks.reshape((n, blocks.shape[0] // n) + blocks.shape[1:])
  if call.reproducible:
    y = repro.reduce_scatter(blocks, call, record)
  else:
    y = record.reduce_scatter(blocks, call)
    if s.op == "mean":
      y = fixed_point.ieee_divide(y, n)
  return jnp.moveaxis(y.astype(x.dtype), 0, s.dim)


def _ag_impl(x, s: Spec):
  n = base.axis_size(s.axes)
  if s.invariant:                                         # XLA's all-gather, typed invariant
    g = jaxapi.all_gather_invariant(x, s.axes)
  elif s.algorithm == "ring":
    g = ring.gather_chunks(x, s.axes, n)                 # [n, *x.shape]
  else:
    g = lax.all_gather(x, s.axes) if n > 1 else x[None]
  g = jnp.moveaxis(g, 0, s.dim)
  if not s.tiled:
    return g
  shape = x.shape[:s.dim] + (g.shape[s.dim] * g.shape[s.dim + 1],) + x.shape[s.dim + 1:]
  return g.reshape(shape)


def _with_transpose(impl, transpose):
  """``impl(x, spec)`` as a differentiable collective whose derivative is
  ``transpose(spec, ct)`` (a tuple of one cotangent; nothing saved from the forward pass).
  Both run as one cached program each under an eager ``shard_map`` (an eager ``jax.grad``)."""
  name = impl.__name__

  def fwd(x, s):
    return common.eager_or_traced(name, lambda ls, s: [impl(ls[0], s)], [x], (s,))[0]

  def bwd(s, ct):
    if ct.dtype == jax.dtypes.float0:
      return transpose(s, ct)
    return tuple(common.eager_or_traced(name + "_transpose",
                                        lambda ls, s: list(transpose(s, ls[0])), [ct], (s,)))

  f = jax.custom_vjp(fwd, nondiff_argnums=(1,))
  f.defvjp(lambda x, s: (fwd(x, s), None), lambda s, _, ct: bwd(s, ct))
  return f


def _rs_transpose(s, ct):
  if ct.dtype == jax.dtypes.float0:
    shape = list(ct.shape)
    shape[s.dim] *= base.axis_size(s.axes)
    return (common.float0_like(tuple(shape)),)
  out = _ag_impl(ct, dataclasses.replace(s, algorithm="xla", tiled=True))
  if s.op == "mean":
    out = out / jnp.asarray(base.axis_size(s.axes), out.dtype)
  return (out,)


def _ag_transpose(s, ct):
  if s.invariant:            # one cotangent on every device: rank r's input gets its block r
    r = lax.axis_index(s.axes)
    if s.tiled:
      size = ct.shape[s.dim] // base.axis_size(s.axes)
      return (lax.dynamic_slice_in_dim(ct, r * size, size, s.dim),)
    return (lax.dynamic_index_in_dim(ct, r, s.dim, keepdims=False),)
  rs = dataclasses.replace(s, op="sum", algorithm="auto")
  if s.tiled:
    return (_rs_impl(ct, rs),)
  ct = jnp.moveaxis(ct, s.dim, 0)                      # [n, *x.shape]
  out = _rs_impl(ct, dataclasses.replace(rs, dim=0))   # [1, *x.shape]
  return (out[0],)


reduce_scatter_array = _with_transpose(_rs_impl, _rs_transpose)
all_gather_array = _with_transpose(_ag_impl, _ag_transpose)

