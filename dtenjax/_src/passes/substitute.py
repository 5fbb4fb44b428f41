"""Rewrite ``lax.psum`` in existing code into ``dtenjax.all_reduce`` with a chosen algorithm.

:func:`substitute_psum` is a jaxpr interpreter: it traces ``fn`` when called (inside whatever
named-axis context the call happens in), then evaluates the jaxpr equation by equation, replacing
every ``psum`` / ``psum_invariant`` over named axes with ``dtenjax.all_reduce``. It recurses into
nested ``jit`` calls (inlined) and into ``shard_map`` (rebuilt with ``check_vma=False``, because
dtenjax results are per-device values). Other higher-order primitives (``scan``, ``while``,
``cond``, custom derivatives) are bound unchanged: psums inside them stay XLA's.

With ``bucket_bytes > 0`` psums are deferred until a result is read and then reduced in buckets
(the fusion pass, ``fusion.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.extend import core as jex_core

_PSUMS = ("psum", "psum_invariant")
_CALLS = ("jit", "pjit", "closed_call", "core_call")
_IDENTITY = ("pvary",)


class _Options:
  def __init__(self, algorithm, deterministic, reproducible, bucket_bytes):
    self.kw = dict(algorithm=algorithm, deterministic=deterministic, reproducible=reproducible)
    self.bucket_bytes = bucket_bytes
    self.count = 0   # psums rewritten (for tests and reports)


def _eligible(eqn) -> bool:
  axes = eqn.params.get("axes", ())
  return (eqn.primitive.name in _PSUMS and eqn.params.get("axis_index_groups") is None
          and axes and all(isinstance(a, str) for a in axes))


def _reduce(vals, axes, opts: _Options):
  from dtenjax._src import collectives   # noqa: PLC0415
  import jax.numpy as jnp   # noqa: PLC0415
  out = []
  for v in vals:
    v = jnp.asarray(v)
    kw = dict(opts.kw)
    if kw["reproducible"] and v.dtype not in (jnp.float32, jnp.bfloat16):
      kw["reproducible"] = False
    if v.dtype == jnp.bool_:
      v = v.astype(jnp.int32)
    out.append(v)
  # one call per group of equal options; all_reduce buckets the list itself
  groups: dict[bool, list[int]] = {}
  for i, v in enumerate(out):
    rep = opts.kw["reproducible"] and v.dtype in (jnp.float32, jnp.bfloat16)
    groups.setdefault(rep, []).append(i)
  res = [None] * len(out)
  for rep, idx in groups.items():
    kw = dict(opts.kw, reproducible=rep)
    red = collectives.all_reduce([out[i] for i in idx], axes, op="sum",
                                 bucket_bytes=opts.bucket_bytes, **kw)
    for i, r in zip(idx, red):
      res[i] = r
  opts.count += len(vals)
  return res


def _eval_jaxpr(jaxpr, consts, args, opts: _Options):
  env: dict = {}
  pending: list = []          # (outvars, invals, axes) of deferred psums
  pending_vars: set = set()

  def flush():
    if not pending:
      return
    by_axes: dict = {}
    for outvars, vals, axes in pending:
      by_axes.setdefault(axes, []).append((outvars, vals))
    for axes, items in by_axes.items():
      flat_vals = [v for _, vals in items for v in vals]
      flat_out = [ov for outvars, _ in items for ov in outvars]
      for ov, r in zip(flat_out, _reduce(flat_vals, axes, opts)):
        env[ov] = r
    pending.clear()
    pending_vars.clear()

  def read(v):
    if isinstance(v, jex_core.Literal):
      return v.val
    if v in pending_vars:
      flush()
    return env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if _eligible(eqn):
      axes = tuple(eqn.params["axes"])
      if opts.bucket_bytes > 0:
        pending.append((list(eqn.outvars), invals, axes))
        pending_vars.update(eqn.outvars)
        continue
      outs = _reduce(invals, axes, opts)
    elif name in _IDENTITY:
      outs = invals
    elif name in _CALLS and ("jaxpr" in eqn.params or "call_jaxpr" in eqn.params):
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      closed = inner if hasattr(inner, "consts") else jex_core.ClosedJaxpr(inner, ())
      outs = _eval_jaxpr(closed.jaxpr, closed.consts, invals, opts)
    elif name == "shard_map":
      outs = _shard_map(eqn, invals, opts)
    else:
      subfuns, params = eqn.primitive.get_bind_params(eqn.params)
      outs = eqn.primitive.bind(*subfuns, *invals, **params)
      if not eqn.primitive.multiple_results:
        outs = [outs]
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _shard_map(eqn, invals, opts: _Options):
  p = eqn.params
  inner = p["jaxpr"]
  closed = inner if hasattr(inner, "consts") else jex_core.ClosedJaxpr(inner, ())

  def body(*args):
    return _eval_jaxpr(closed.jaxpr, closed.consts, args, opts)

  kwargs = dict(mesh=p["mesh"], in_specs=tuple(p["in_specs"]), out_specs=list(p["out_specs"]),
                check_vma=False)
  manual = p.get("manual_axes", p.get("newly_manual_axes"))
  if manual is not None and frozenset(manual) != frozenset(p["mesh"].axis_names):
    kwargs["axis_names"] = frozenset(manual)
  return list(jax.shard_map(body, **kwargs)(*invals))


def substitute_psum(fn: Callable, *, algorithm: str = "auto", deterministic: bool = True,
                    reproducible: bool = False, bucket_bytes: int = 0) -> Callable:
  """``fn`` with every named-axis ``lax.psum`` replaced by ``dtenjax.all_reduce``.

  ``pmean`` is covered (it is a psum and a division). The returned function has ``fn``'s
  signature; ``.psum_count`` on it reports how many psums the last call rewrote.
  """
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    opts = _Options(algorithm, deterministic, reproducible, bucket_bytes)
    flat_args = jax.tree_util.tree_leaves((args, kwargs))
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, flat_args, opts)
    wrapped.psum_count = opts.count
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  wrapped.psum_count = 0
  return wrapped
