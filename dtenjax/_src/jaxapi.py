"""The one module that reaches into JAX's private modules, and the JAX-context helpers built on them.

JAX's public API does not (yet) expose everything a library of collectives needs: the
varying-manual-axes (vma) type of a traced value, whether ``shard_map``'s type check is on, the
concrete mesh while tracing under ``jax.set_mesh``. Each is
read here, so a JAX release that moves one touches this file only (checked on jax 0.10.2 and
0.11.2).

Varying manual axes in one paragraph: under ``jax.shard_map(..., check_vma=True)`` (JAX's default)
every value carries the set of manual mesh axes along which it may differ between devices.
``lax.psum`` over ``a`` takes a value varying over ``a`` to one invariant over ``a``; when its
input is invariant over ``a`` JAX first casts it to varying (``lax.pcast(..., to="varying")``,
whose transpose is a psum), so ``psum`` of a replicated value is ``n`` times that value. The
transpose of a varying -> invariant collective is the invariant -> varying cast (no
communication). With ``check_vma=False`` (and in ``pmap`` and ``vmap``) there are no types and the
transpose of ``psum`` is ``psum``. dtenjax's collectives follow exactly these rules.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Sequence

import jax
import jax.extend.core as jcore
from jax import lax
import numpy as np
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax._src import distributed as _jax_distributed
from jax._src import mesh as _jax_mesh


def scan_counts(eqn) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation: jax 0.10 names them in its parameters;
  jax 0.11 gives ``ft_in``, a flat tree over the operands whose three top-level groups are the
  consts, the carry and the scanned-over operands (and leaves out of the equation the outputs
  that only forward an input)."""
  params = eqn.params
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
  return len(list(consts)), len(list(carry))


def bind(eqn, vals) -> list:
  """Binds ``eqn``'s primitive to ``vals`` as ``jax.core.eval_jaxpr`` does (its parameters as
  the primitive wants them bound, under the equation's context): the outputs, as a list.
  ``get_bind_params`` returns the parameters (jax 0.11) or a pair (subfuns, parameters)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  subfuns = ()
  if isinstance(params, tuple):
    subfuns, params = params
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  with ctx if ctx is not None else contextlib.nullcontext():
    out = eqn.primitive.bind(*subfuns, *vals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def inlined_by_jax(eqn) -> bool:
  """A call of ``jax.jit(f, inline=True)`` (optax's ``tree_bias_correction``, ...): jax 0.10
  puts its body into the enclosing jaxpr while tracing; jax 0.11 keeps the call equation
  (``inline=Inline.JAX_LATE``) and inlines it when lowering. Either way XLA sees no call."""
  if eqn.primitive.name not in ("jit", "pjit"):
    return False
  inline = eqn.params.get("inline")
  return inline is True or getattr(inline, "name", "") in ("JAX_EARLY", "JAX_LATE")


def inline_calls(closed):
  """``closed`` (a ClosedJaxpr) with the calls :func:`inlined_by_jax` at its top level (and
  inside those) replaced by their bodies, traced again: the jaxpr jax 0.10 traces, for readers
  that price what XLA compiles. ``closed`` itself when it has none (always under jax 0.10)."""
  if not any(inlined_by_jax(e) for e in closed.jaxpr.eqns):
    return closed

  def inline(eqn, vals):
    if not inlined_by_jax(eqn):
      return bind(eqn, vals)
    body = eqn.params["jaxpr"]
    return interpret(body.jaxpr, body.consts, vals, inline)

  return retrace(closed, inline)


def interpret(jaxpr, consts, args, evaluate) -> list:
  """``jaxpr``'s outputs for ``args``, evaluated equation by equation: ``evaluate(eqn, vals)``
  gives each equation's outputs (:func:`bind` for the equation as it stands)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
  for eqn in jaxpr.eqns:
    env.update(zip(eqn.outvars, evaluate(eqn, [read(v) for v in eqn.invars])))
  return [read(v) for v in jaxpr.outvars]


def retrace(closed, evaluate, result=lambda outs: outs):
  """``closed`` (a ClosedJaxpr) traced again through :func:`interpret` with ``evaluate``, its
  outputs passed through ``result``: a jaxpr with some equations written otherwise."""
  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
  return jax.make_jaxpr(lambda *a: result(interpret(closed.jaxpr, closed.consts, a, evaluate)))(
      *avals)


def vma_checked() -> bool:
  """Whether values carry vma types here (inside ``shard_map(check_vma=True)``)."""
  return bool(_jax_config._check_vma.value)


def vma(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map`` or without the check)."""
  aval = _jax_core.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def manual_axes() -> frozenset:
  """The manual axes of the current abstract mesh (the axes of the enclosing ``shard_map``s)."""
  am = jax.sharding.get_abstract_mesh()
  return frozenset(getattr(am, "manual_axes", ()) or ())


def to_varying(x, axes: Sequence[str]):
  """``x`` cast to varying over those of ``axes`` it is invariant over (psum's implicit cast).

  Only manual mesh axes carry types: vmap axes and an unchecked ``shard_map`` return ``x``.
  """
  if not vma_checked():
    return x
  missing = tuple(a for a in axes if a in manual_axes() and a not in vma(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def all_gather_invariant(x, axes: Sequence[str], *, axis: int = 0, tiled: bool = False):
  """JAX's varying -> invariant all-gather (``lax.all_gather(..., to="invarying")``): every device
  gets the same gathered value, typed so.

  The same HLO all-gather as ``lax.all_gather``; only the result type differs (``lax.all_gather``
  is varying -> varying, because its transpose is a reduce-scatter). Over vmap axes alone there
  are no types, and this is ``lax.all_gather``.
  """
  axes = tuple(axes)
  if not manual_axes() & frozenset(axes):
    return lax.all_gather(x, axes, axis=axis, tiled=tiled)
  return lax.all_gather(x, axes, axis=axis, tiled=tiled, to="invarying")


def reduced_type(aval, axes: Sequence[str]):
  """``aval`` with ``axes`` removed from its varying axes: the type rule of ``lax.psum``."""
  mat = getattr(aval, "mat", None)
  if mat is None:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=mat.varying - frozenset(axes)))


def reduced_struct(x, axes: Sequence[str]) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` like ``x`` typed as ``lax.psum(x, axes)`` would be: the result type
  of a custom call that all-reduces ``x`` over ``axes``."""
  aval = _jax_core.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is None or not mat.varying:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  # A manual-axis type is only meaningful with the (abstract) mesh of its sharding.
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=aval.sharding, manual_axis_type=mat.update(
      varying=mat.varying - frozenset(axes)))


def concrete_mesh():
  """The concrete mesh of ``jax.set_mesh`` (also while tracing under jit), else None.

  Outside such a block JAX returns an *empty* mesh (no axes): that is not a mesh."""
  try:
    mesh = _jax_mesh.get_concrete_mesh()
  except AttributeError:  # pragma: no cover - a jax that moved it
    return None
  if mesh is None or getattr(mesh, "empty", True) or not tuple(getattr(mesh, "axis_names", ())):
    return None
  return mesh


# --- eager shard_map: one cached program per call signature ---------------------------------
# Outside jit, jax.shard_map evaluates its body primitive by primitive, compiling a fresh
# program for every primitive on every call (jax 0.10.2: four compilations for one lax.psum).
# A dtenjax collective is dozens of primitives, so it runs here as ONE program instead, cached
# by the call's static signature: the first call compiles it, later calls only dispatch it.

_EAGER_CACHE: collections.OrderedDict = collections.OrderedDict()
_EAGER_CACHE_SIZE = 512        # programs kept (least recently used dropped first)


def eager_shard_map_trace(leaves):
  """The eager (not jitted) ``shard_map`` trace all of ``leaves`` belong to, or None: under jit,
  vmap, grad, outside shard_map, or with a JAX whose internals moved (the caller then takes its
  ordinary path, which is correct, only slower)."""
  try:
    from jax._src import shard_map as _sm
    trace = _jax_core.trace_ctx.trace
    tracer_type = _sm.ShardMapTracer
    trace_type = _sm.ShardMapTrace
  except (ImportError, AttributeError):  # pragma: no cover - a jax that moved them
    return None
  if type(trace) is not trace_type or not leaves:
    return None
  if not all(isinstance(x, tracer_type) and x._trace is trace for x in leaves):
    return None
  if not all(hasattr(trace, a) for a in ("mesh", "manual_axes", "check", "to_val_mat_pair")):
    return None  # pragma: no cover
  return trace


def eager_shard_map_below(leaves):
  """The eager ``shard_map`` trace under the differentiation traces (``jax.grad``'s linearize,
  ``jax.vjp``) that ``leaves`` belong to, or None. An eager ``jax.grad`` of an eager ``shard_map``
  runs its body under such a trace: the primal values are computed eagerly below it, primitive
  by primitive, and so is the backward pass."""
  try:
    from jax._src import shard_map as _sm
    from jax._src.interpreters import ad as _ad
    diff_traces = (_ad.LinearizeTrace, _ad.JVPTrace)
    trace_type = _sm.ShardMapTrace
  except (ImportError, AttributeError):  # pragma: no cover - a jax that moved them
    return None
  trace = _jax_core.trace_ctx.trace
  if not leaves or type(trace) not in diff_traces:
    return None
  if not all(isinstance(x, _jax_core.Tracer) and x._trace is trace for x in leaves):
    return None
  while type(trace) in diff_traces:
    trace = getattr(trace, "parent_trace", None)
  if type(trace) is not trace_type:
    return None
  if not all(hasattr(trace, a) for a in ("mesh", "manual_axes", "check", "to_val_mat_pair")):
    return None  # pragma: no cover
  return trace


@contextlib.contextmanager
def _outside(trace):
  """The context JAX's eager shard_map runs each primitive's program in: no trace, the mesh of
  the shard_map (abstract and concrete) in context."""
  from jax._src import sharding_impls as _si
  with (_jax_core.eval_context(), _jax_mesh.use_abstract_mesh(trace.amesh),
        _si._internal_use_concrete_mesh(trace.mesh)):
    yield


def run_eager(trace, key, body, leaves):
  """``body(leaves) -> list of arrays`` run under the eager shard_map ``trace`` as one compiled
  program (``jax.jit`` of a ``shard_map`` over the trace's mesh, as JAX runs each primitive),
  kept in a cache keyed by ``key`` (hashable: everything static the body depends on), the mesh,
  the manual axes, the type check and the inputs' layouts; returns the output tracers.

  Each value of the eager trace is the global array of the per-device values (a leading
  singleton axis laid out over the axes it varies over); the outputs are typed by what ``body``
  returned while it was traced (their varying axes), as JAX types its own collectives."""
  from jax._src import shard_map as _sm
  from jax.sharding import PartitionSpec as P
  mesh, manual, check = trace.mesh, frozenset(trace.manual_axes), bool(trace.check)
  vals, mats = zip(*(trace.to_val_mat_pair(x) for x in leaves))
  everything = P(_jax_core.order_wrt_mesh(mesh, manual))
  if check:
    in_specs = tuple(P(_jax_core.order_wrt_mesh(mesh, m.varying)) for m in mats)
  else:
    in_specs = (everything,) * len(vals)
  ck = (key, mesh, manual, check, in_specs,
        tuple((tuple(v.shape), str(v.dtype)) for v in vals))
  entry = _EAGER_CACHE.get(ck)
  if entry is not None:
    _EAGER_CACHE.move_to_end(ck)
  else:
    out_vmas: list = []

    def inner(*xs):
      outs = body([lax.squeeze(x, [0]) for x in xs])
      out_vmas[:] = [vma(o) for o in outs]
      return [lax.expand_dims(o, [0]) for o in outs]

    def mapped(out_specs):
      return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names=set(manual), check_vma=check)

    with _outside(trace):
      jax.eval_shape(mapped(everything), *vals)            # types the outputs
      out_specs = [P(_jax_core.order_wrt_mesh(mesh, v)) if check else everything
                   for v in out_vmas]
      entry = (jax.jit(mapped(out_specs)), [frozenset(v) for v in out_vmas])
    _EAGER_CACHE[ck] = entry
    while len(_EAGER_CACHE) > _EAGER_CACHE_SIZE:
      _EAGER_CACHE.popitem(last=False)
  fn, out_vmas = entry
  with _outside(trace):
    outs = fn(*vals)
  return [_sm.ShardMapTracer(trace, _jax_core.ManualAxisType(varying=v) if check
                             else _jax_core.empty_mat, o) for o, v in zip(outs, out_vmas)]


def eager_cache_size() -> int:
  """Programs compiled for eager calls so far (tests check that a repeated call adds none)."""
  return len(_EAGER_CACHE)


def backends_started() -> bool:
  """Whether JAX has started its backends (after which XLA_FLAGS is no longer read)."""
  from jax._src import xla_bridge as _xb
  started = getattr(_xb, "backends_are_initialized", None)
  return True if started is None else bool(started())


def distributed_state():
  """jax.distributed's global state (its ``client`` is the coordination service's key-value
  store; ``num_processes`` what it was initialised for), or None."""
  return getattr(_jax_distributed, "global_state", None)


def bound_axis_sizes() -> dict[str, int]:
  """Named axes bound here (shard_map and vmap axes) and their sizes, for error messages."""
  try:
    return dict(_jax_core.get_axis_env().axis_sizes)
  except AttributeError:  # pragma: no cover - a jax that moved it
    return {}


def coordination_client():
  """jax.distributed's coordination-service client (its key-value store), or None before
  ``jax.distributed.initialize()``."""
  return getattr(distributed_state(), "client", None)


# --- shared JAX-context helpers (public API only) ------------------------------------------------

def axis_tuple(axis_name) -> tuple:
  """``axis_name`` (one name, or a tuple/list of names) as a tuple of names."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def device_groups(devices, axis_names: Sequence[str], axes: Sequence[str]):
  """The devices of every group along ``axes`` of a mesh's device array: an array of shape
  (groups, group size), each row in rank order (``lax.axis_index(axes)``, the first name major),
  rows in the C order of the remaining axes. Every name of ``axes`` must be in ``axis_names``."""
  devs = np.asarray(devices)
  names = list(axis_names)
  rest = [names.index(n) for n in names if n not in axes]
  devs = np.transpose(devs, rest + [names.index(a) for a in axes])
  return devs.reshape(-1, math.prod(devs.shape[len(rest):]))
