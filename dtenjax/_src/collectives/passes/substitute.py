"""Rewrite ``lax.psum`` in existing code into ``dtenjax.all_reduce`` with a chosen algorithm.

:func:`substitute_psum` is a jaxpr interpreter: it traces ``fn`` when called (inside whatever
named-axis context the call happens in), then evaluates the jaxpr equation by equation, replacing
every ``psum`` / ``psum_invariant`` over named axes with ``dtenjax.all_reduce``. It recurses into
nested ``jit`` calls (inlined), into ``shard_map`` (rebuilt with the same ``check_vma``:
``dtenjax.all_reduce`` is typed as ``lax.psum``, so the program keeps its types and its
gradients), and into the bodies of ``lax.scan`` (a layer stack, ``fori_loop`` with static
bounds), ``lax.while_loop``, ``lax.cond`` / ``lax.switch`` and ``jax.checkpoint``, each rebuilt
with the same parameters. Other higher-order primitives (custom derivatives, a scan whose
equation jax has pruned) are bound unchanged: psums inside them stay XLA's, and a warning says
so where the call asked for ``reproducible`` sums.

With ``bucket_bytes > 0`` psums are deferred: everything that does not need their results runs
first, then the ready psums are reduced together in buckets (the fusion pass, ``fusion.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from dtenjax._src import contract as contract_lib
from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import all_reduce as collectives
from dtenjax._src.collectives import fixed_point
from dtenjax._src.contract import Contract

_PSUMS = ("psum", "psum_invariant")
_CALLS = ("jit", "pjit", "closed_call", "core_call")


class _Options:
  def __init__(self, algorithm, deterministic, contract: Contract, bucket_bytes):
    self.kw = dict(algorithm=algorithm, deterministic=deterministic)
    self.contract = contract
    self.bucket_bytes = bucket_bytes
    self.count = 0   # psums rewritten (for tests and reports)


def _eligible(eqn) -> bool:
  axes = eqn.params.get("axes", ())
  return (eqn.primitive.name in _PSUMS and eqn.params.get("axis_index_groups") is None
          and axes and all(isinstance(a, str) for a in axes))


def _reduce(vals, axes, opts: _Options):
  out = []
  for v in vals:
    v = jnp.asarray(v)
    if v.dtype == jnp.bool_:
      v = v.astype(jnp.int32)
    out.append(v)
  # one call per group of equal options; all_reduce buckets the list itself
  # the contract covers the floats it takes; the other psums (integers, float16) stay plain sums
  groups: dict[Contract, list[int]] = {}
  for i, v in enumerate(out):
    rep = opts.contract if v.dtype in fixed_point.SUPPORTED_DTYPES else Contract.NONE
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
  """Evaluates ``jaxpr`` with psums rewritten.

  With bucketing on, evaluation goes in rounds: every equation that does not depend on a
  not-yet-reduced psum runs first (in program order), then all psums ready in that round are
  reduced together (bucketed), then the round repeats for the equations that waited. Equations
  are pure, so running them in any order that respects data dependencies gives the same values.
  """
  env: dict = {}

  def read(v):
    return v.val if isinstance(v, jex_core.Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  remaining = list(jaxpr.eqns)
  while remaining:
    waiting, ready, blocked = [], [], set()
    for eqn in remaining:
      ins = [v for v in eqn.invars if not isinstance(v, jex_core.Literal)]
      if opts.bucket_bytes > 0 and any(v in blocked for v in ins):
        waiting.append(eqn)
        blocked.update(eqn.outvars)
        continue
      if _eligible(eqn) and opts.bucket_bytes > 0:
        ready.append(eqn)
        blocked.update(eqn.outvars)
        continue
      outs = _run_eqn(eqn, [read(v) for v in eqn.invars], opts)
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    by_axes: dict = {}
    for eqn in ready:
      by_axes.setdefault(tuple(eqn.params["axes"]), []).append(eqn)
    for axes, eqns in by_axes.items():
      vals = [read(v) for e in eqns for v in e.invars]
      outvars = [v for e in eqns for v in e.outvars]
      for v, r in zip(outvars, _reduce(vals, axes, opts)):
        env[v] = r
    remaining = waiting
  return [read(v) for v in jaxpr.outvars]


def _run_eqn(eqn, invals, opts: _Options):
  name = eqn.primitive.name
  if _eligible(eqn):
    return _reduce(invals, tuple(eqn.params["axes"]), opts)
  if name in _CALLS and ("jaxpr" in eqn.params or "call_jaxpr" in eqn.params):
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    closed = inner if hasattr(inner, "consts") else jex_core.ClosedJaxpr(inner, ())
    return _eval_jaxpr(closed.jaxpr, closed.consts, invals, opts)
  if name == "shard_map":
    return _shard_map(eqn, invals, opts)
  rebuild = _REBUILD.get(name)
  if rebuild is not None and _holds_psum(eqn):
    out = rebuild(eqn, invals, opts)
    if out is not None:
      return out
  if opts.contract != Contract.NONE and _holds_psum(eqn):
    errors.warn_once(
        f"substitute-{name}",
        f"substitute_psum(reproducible=...): a lax.psum inside a {name!r} equation stays XLA's "
        "(its sum is not the reproducible one); call dtenjax.all_reduce(..., reproducible=True) "
        "there yourself.")
  return jaxapi.bind(eqn, invals)


def _closed(j):
  return j if hasattr(j, "consts") else jex_core.ClosedJaxpr(j, ())


def _sub_jaxprs(eqn):
  for v in eqn.params.values():
    for j in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(j, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        yield _closed(j).jaxpr


def _holds_psum(eqn) -> bool:
  """Whether a psum the pass would rewrite sits anywhere below ``eqn``."""
  todo = list(_sub_jaxprs(eqn))
  while todo:
    for e in todo.pop().eqns:
      if _eligible(e):
        return True
      todo.extend(_sub_jaxprs(e))
  return False


def _call(closed, opts: _Options):
  return lambda *args: _eval_jaxpr(closed.jaxpr, closed.consts, list(args), opts)


def _scan(eqn, invals, opts: _Options):
  body = _closed(eqn.params["jaxpr"])
  if len(eqn.outvars) != len(body.jaxpr.outvars):
    return None          # jax 0.11 drops outputs that only forward an input: bind it unchanged
  nc, ncarry = jaxapi.scan_counts(eqn)
  consts, init, xs = invals[:nc], invals[nc:nc + ncarry], invals[nc + ncarry:]
  run = _call(body, opts)

  def step(carry, x):
    outs = run(*consts, *carry, *x)
    return tuple(outs[:ncarry]), tuple(outs[ncarry:])

  p = eqn.params
  carry, ys = jax.lax.scan(step, tuple(init), tuple(xs), length=p.get("length"),
                           reverse=bool(p.get("reverse", False)), unroll=p.get("unroll", 1))
  return [*carry, *ys]


def _while(eqn, invals, opts: _Options):
  p = eqn.params
  cn, bn = int(p["cond_nconsts"]), int(p["body_nconsts"])
  cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
  cond, body = _call(_closed(p["cond_jaxpr"]), opts), _call(_closed(p["body_jaxpr"]), opts)
  out = jax.lax.while_loop(lambda c: cond(*cconsts, *c)[0], lambda c: tuple(body(*bconsts, *c)),
                           tuple(init))
  return list(out)


def _cond(eqn, invals, opts: _Options):
  branches = [_call(_closed(b), opts) for b in eqn.params["branches"]]
  return list(jax.lax.switch(invals[0], [lambda *a, f=f: tuple(f(*a)) for f in branches],
                             *invals[1:]))


def _remat(eqn, invals, opts: _Options):
  p = eqn.params
  run = _call(_closed(p["jaxpr"]), opts)
  return list(jax.checkpoint(lambda *a: tuple(run(*a)), prevent_cse=bool(p["prevent_cse"]),
                             policy=p.get("policy"))(*invals))


_REBUILD = {"scan": _scan, "while": _while, "cond": _cond, "remat2": _remat, "checkpoint": _remat}


def _shard_map(eqn, invals, opts: _Options):
  p = eqn.params
  inner = p["jaxpr"]
  closed = inner if hasattr(inner, "consts") else jex_core.ClosedJaxpr(inner, ())

  def body(*args):
    return _eval_jaxpr(closed.jaxpr, closed.consts, args, opts)

  kwargs = dict(mesh=p["mesh"], in_specs=tuple(p["in_specs"]), out_specs=list(p["out_specs"]),
                check_vma=bool(p.get("check_vma", True)))
  manual = p.get("manual_axes", p.get("newly_manual_axes"))
  if manual is not None and frozenset(manual) != frozenset(p["mesh"].axis_names):
    kwargs["axis_names"] = frozenset(manual)
  return list(jax.shard_map(body, **kwargs)(*invals))


def substitute_psum(fn: Callable, *, algorithm: str = "auto", deterministic: bool = True,
                    reproducible: bool | str = False, bucket_bytes: int = 0) -> Callable:
  """``fn`` with every named-axis ``lax.psum`` replaced by ``dtenjax.all_reduce``.

  ``pmean`` is covered (it is a psum and a division). The returned function has ``fn``'s
  signature; ``.psum_count`` on it reports how many psums the last call rewrote.
  ``reproducible`` takes ``all_reduce``'s values, for the float32 and bfloat16 psums.
  """
  contract = contract_lib.parse(reproducible, "substitute_psum: reproducible")
  if not callable(fn):
    raise errors.ConfigurationError(
        f"substitute_psum: fn={fn!r} is not callable; pass the step (or the shard_map'd body) "
        "whose lax.psums to replace")
  if (not isinstance(bucket_bytes, (int, np.integer)) or isinstance(bucket_bytes, bool)
      or bucket_bytes < 0):
    raise errors.ConfigurationError(
        f"substitute_psum: bucket_bytes={bucket_bytes!r} must be an int >= 0 (0: one "
        "all_reduce per psum; > 0: psums bucketed, as fuse_collectives does)")

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
    opts = _Options(algorithm, deterministic, contract, bucket_bytes)
    flat_args = jax.tree_util.tree_leaves((args, kwargs))
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, flat_args, opts)
    wrapped.psum_count = opts.count
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  wrapped.psum_count = 0
  return wrapped
