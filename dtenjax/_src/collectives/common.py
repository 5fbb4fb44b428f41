"""What the public collectives share (``all_reduce``, ``reduce_scatter``, ``all_gather`` and
``plan_all_reduce``, a module each): the checks of their arguments at the Python boundary, the
context of a call (devices, backend, processes) and the registry record it resolves to, JAX's
typing of collectives, the cached program an eager ``shard_map`` runs them as, and the errors of
vmap axes.

They run wherever JAX has named axes: inside ``jax.shard_map`` / ``mesh_map`` (under jit or
not) and over ``jax.vmap(..., axis_name=...)`` axes. ``axis_name`` may be a tuple of axes (treated
as one combined axis in mesh order). Arguments may be pytrees.

Which implementation runs is a record of the algorithm registry (``algorithms/registry.py``):
``algorithm="auto"`` ranks the records that support the call with the cost model, a family name
(``"one_shot"``) takes the first record of that family that supports it, a record name forces it.

Semantics and guarantees
------------------------
- Results are per-device (``varying``) values, as with ``pmap``-era collectives. Reverse-mode
  derivatives (``jax.grad``/``vjp``) run the same algorithm on the cotangents: the transpose of
  ``all_reduce(sum)`` is ``all_reduce(sum)`` of the cotangents, with the same determinism (and the
  same reproducibility with ``reproducible=True``); ``reduce_scatter`` and ``all_gather``
  transpose into each other. Forward mode (``jax.jvp``) is not supported (custom VJP rules).
- ``deterministic=True`` (default): identical bits on every rank and every run for a given
  algorithm, world size and input shape. ``algorithm="xla"`` (and ``auto``) may use XLA's own
  reduction where its order is provably fixed (``algorithms/xla.py``), else the deterministic
  dtenjax algorithms. Max/min propagate NaN with every algorithm.
- ``reproducible=True``: a fixed-point sum (contract v3, ``fixed_point_v3.py``: one int32 word per
  value against the element's common exponent, never worse than a float32 fold): the bits do not
  depend on the algorithm or on how the same contributions are split over devices (see
  ``all_reduce.py`` for stacked local contributions). ``reproducible="v2"``: contract v2
  (``fixed_point.py``, two words per value: a finer grid, not the correctly rounded sum;
  ``"exact"`` is its deprecated name and warns). float32 / bfloat16 only.
- ``vmap``: mapping over an ordinary (unnamed) batch dimension reduces every batch element
  independently across devices; ``jax.vmap(f, axis_name="v")`` makes "v" a valid ``axis_name``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import contract as contract_lib
from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.contract import Contract
from dtenjax._src.planning import mesh as mesh_lib

AxisName = base.AxisName


# --- validation at the Python boundary ----------------------------------------------------------

def check_axes(axis_name: AxisName, what: str) -> tuple[str, ...]:
  """The axis names as a tuple; raises CollectiveError naming unbound axes and the bound ones."""
  axes = jaxapi.axis_tuple(axis_name)
  if not axes:
    raise errors.CollectiveError(f"{what}: axis_name={axis_name!r} is empty; pass a mesh axis "
                                 "name or a tuple of them.")
  positional = [a for a in axes if isinstance(a, int)]
  if positional:
    bound = jaxapi.bound_axis_sizes()
    raise errors.CollectiveError(
        f"{what}: axis_name={axis_name!r} holds positional axes {positional}; dtenjax "
        f"collectives run over named mesh (or vmap) axes: pass a name in scope here "
        f"({sorted(bound) or 'none'}), and reduce an array dimension with jnp.sum(x, axis=...).")
  bad = []
  for a in axes:
    try:
      lax.axis_size(a)
    except NameError:
      bad.append(a)
  if bad:
    bound = jaxapi.bound_axis_sizes()
    raise errors.CollectiveError(
        f"{what}: axis name(s) {bad} are not bound here (axes in scope: "
        f"{sorted(bound) or 'none'}). Call it inside jax.shard_map / dtenjax.mesh_map over a mesh "
        "with that axis (or jax.vmap(..., axis_name=...)), and spell the name as the mesh does.")
  if len(set(axes)) != len(axes):
    raise errors.CollectiveError(f"{what}: axis_name={axis_name!r} repeats an axis; name each "
                                 "mesh axis once.")
  return axes


def check_common(what: str, op: str, algorithm: str):
  problems = []
  if op not in base.OPS:
    problems.append(f"op={op!r} is not supported; use one of {list(base.OPS)}")
  if algorithm not in registry.names():
    problems.append(f"algorithm={algorithm!r} is unknown; use one of {list(registry.names())}")
  if problems:
    raise errors.CollectiveError(errors.join_problems(f"{what}: bad arguments", problems))


def contract_of(op: str, reproducible) -> Contract:
  """The public ``reproducible=`` parsed (``contract.parse``: a bad value raises, "exact" warns),
  NONE for max and min, which are exact in any order: the one contract every layer below takes."""
  contract = contract_lib.parse(reproducible)
  return contract if op in base.SUMS else Contract.NONE


def check_leaf(what: str, x, op: str, contract: Contract):
  dtype = jnp.dtype(jnp.result_type(x))
  if contract.reproducible and op in base.SUMS:
    fixed_point.check_dtype(dtype, f"{what}(reproducible={contract.public!r})")
  if dtype == jnp.dtype(bool) and op in base.SUMS:
    raise errors.CollectiveError(f"{what}: op={op!r} on a bool array; cast it first "
                                 "(x.astype(jnp.int32)).")
  if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
    raise errors.CollectiveError(f"{what}: op='mean' on {dtype.name} would truncate; "
                                 "cast to a float dtype or use op='sum'.")
  if op not in base.SUMS and jnp.issubdtype(dtype, jnp.complexfloating):
    raise errors.CollectiveError(f"{what}: op={op!r} on {dtype.name} has no order; reduce "
                                 "jnp.abs(x) or the real and imaginary parts separately.")


# --- the context of a call: which devices, which backend, which processes ----------------------

class Context(NamedTuple):
  axis_sizes: tuple[int, ...]
  group: tuple[int, ...]          # device ids of one group, in rank order
  backend: str
  mesh_axes: bool
  processes: int
  xla_reaches_processes: bool


def _concrete_mesh():
  for mesh in (mesh_lib.current_mesh(), jaxapi.concrete_mesh()):
    if mesh is not None and getattr(mesh, "devices", np.empty(0)).size:
      yield mesh


def _group_devices(axes: tuple[str, ...], n: int):
  """Devices of one group along ``axes`` (rank order) and whether a concrete mesh said so."""
  for mesh in _concrete_mesh():
    if all(a in mesh.axis_names for a in axes):
      return list(jaxapi.device_groups(mesh.devices, mesh.axis_names, axes)[0]), True
  devices = jax.devices()
  return list(devices[:n]) if len(devices) >= n else list(devices), False


def _processes_from_abstract_mesh(am, axes: tuple[str, ...]) -> int:
  """Processes a group along ``axes`` spans when no concrete mesh is known (plain
  ``jax.shard_map`` over a ``Mesh`` outside ``jax.set_mesh``): meshes list devices process by
  process (``jax.make_mesh``, ``jax.devices()`` order), so the devices of one group lie
  ``span * stride`` apart in that order, and each process holds ``local_device_count`` of them."""
  sizes = dict(am.shape)
  names = list(sizes)
  last = max(names.index(a) for a in axes)
  block = math.prod(sizes[a] for a in axes) * math.prod(sizes[n] for n in names[last + 1:])
  local = jax.local_device_count()
  return max(1, block // local) if block > local else 1


def context(axes: tuple[str, ...]) -> Context:
  sizes = tuple(base.axis_size(a) for a in axes)
  n = math.prod(sizes)
  am = jax.sharding.get_abstract_mesh()
  manual = set(getattr(am, "manual_axes", ()) or ())
  mesh_axes = all(a in manual for a in axes)
  device = getattr(am, "abstract_device", None)
  backend = getattr(device, "platform", None) or jax.default_backend()
  devices, known = _group_devices(axes, n)
  if jax.process_count() == 1 or not mesh_axes:
    processes = 1
  elif known:
    processes = len({d.process_index for d in devices})
  else:
    processes = _processes_from_abstract_mesh(am, axes)
  return Context(sizes, tuple(int(d.id) for d in devices), backend, mesh_axes, processes,
                 xla_reaches_processes(backend))


def xla_reaches_processes(backend: str) -> bool:
  """Whether XLA's own collectives connect processes on ``backend`` (NCCL on GPU; on CPU only
  with a cross-process implementation configured, JAX's default being gloo)."""
  if backend != "cpu":
    return True
  return getattr(jax.config, "jax_cpu_collectives_implementation", None) in ("gloo", "mpi")


def make_call(kind: str, dtype, nbytes: int, ctx: Context, axes, op, algorithm, deterministic,
              contract: Contract, contributions=1, tag=None) -> base.Call:
  return base.Call(kind=kind, op=op, dtype=dtype, axes=axes, axis_sizes=ctx.axis_sizes,
                   nbytes=int(nbytes), backend=ctx.backend, deterministic=bool(deterministic),
                   contract=contract, contributions=int(contributions),
                   mesh_axes=ctx.mesh_axes, processes=ctx.processes,
                   xla_reaches_processes=ctx.xla_reaches_processes, requested=algorithm, tag=tag)


def resolve(algorithm: str, call: base.Call, ctx: Context) -> base.Algorithm:
  return registry.get(registry.resolve(algorithm, call, ctx.group, None).algorithm)


# --- JAX's typing of collectives (varying manual axes) ------------------------------------------

def typed_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of ``axes`` that carry vma types here: manual mesh axes under ``check_vma=True``.

  The others (vmap axes, any axis of an unchecked shard_map or of pmap) follow pmap's rules."""
  if not jaxapi.vma_checked():
    return ()
  manual = jaxapi.manual_axes()
  return tuple(a for a in axes if a in manual)


# --- Explicit mesh axes a partly manual shard_map leaves free -------------------------------------

def _explicit_entries(x) -> tuple | None:
  """``x``'s sharding type, one spec entry per dimension, when an entry names an Explicit mesh
  axis (inside ``jax.shard_map(axis_names=...)``: an axis it left free, whose dimension stays
  sharded in the type), else None."""
  try:
    sharding = jax.typeof(x).sharding
  except TypeError:                 # not a JAX value (a Python scalar, ...): no sharding type
    return None
  spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
  if spec is None or mesh is None:
    return None
  explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit}
  entries = tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))
  named = {a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))}
  return entries if named & explicit else None


def free_explicit_axes(leaves, body, out_entries, linear: bool = True):
  """``body(leaves)``, run with the Explicit mesh axes the leaves are sharded over made Auto
  (``jax.sharding.auto_axes``) when there are any, each output laid out as
  ``out_entries(i, entries of input i)`` says (the entries of the dimensions the collective keeps).

  Inside a partly manual ``jax.shard_map`` on ``jax.make_mesh``'s Explicit axes a local array
  keeps its free axes' sharding in its type, and every reshape of such a dimension the
  algorithms do (buckets, chunks, gathered stacks) is a type error; with the axes Auto, XLA
  lays the intermediates out, as it does for ``lax.psum``. Elsewhere ``body(leaves)`` itself.

  JAX cannot differentiate through a shard_map a value that an ``auto_axes`` region saves for
  the backward pass ("Closing over inputs to shard_map where the input is sharded on Explicit
  axes"). A ``linear`` body saves nothing; one that is not (max / min, whose cotangent goes to
  the selected elements) keeps its inputs outside the region and recomputes itself, in a second
  region, in the backward pass."""
  if not jaxapi.manual_axes():
    return body(leaves)
  found = [_explicit_entries(x) for x in leaves]
  if all(e is None for e in found):
    return body(leaves)
  axes = sorted({a for e in found if e is not None for ent in e if ent is not None
                 for a in (ent if isinstance(ent, tuple) else (ent,))
                 if a not in jaxapi.manual_axes()})
  outs = [jax.sharding.PartitionSpec(*out_entries(i, e if e is not None
                                                  else (None,) * jnp.ndim(x)))
          for i, (x, e) in enumerate(zip(leaves, found))]
  run = jax.sharding.auto_axes(body, axes=tuple(axes), out_sharding=outs)
  if linear:
    return run(list(leaves))
  diff = [jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves]
  ins = [jax.sharding.PartitionSpec(*(e if e is not None else (None,) * jnp.ndim(x)))
         for x, e, d in zip(leaves, found, diff) if d]

  def pull(ls, cts):
    grads = jax.vjp(body, ls)[1](cts)[0]
    return [g for g, d in zip(grads, diff) if d]

  @jax.custom_vjp
  def recomputed(ls):
    return run(ls)

  def fwd(ls):
    return run(ls), ls

  def bwd(ls, cts):
    grads = iter(jax.sharding.auto_axes(pull, axes=tuple(axes), out_sharding=ins)(ls, cts))
    return ([next(grads) if d else None for d in diff],)

  recomputed.defvjp(fwd, bwd)
  return recomputed(list(leaves))


# --- eager shard_map: one cached program per call -----------------------------------------------

def eager_or_traced(what: str, body, leaves, args):
  """``body(leaves, *args)``; under an eager ``shard_map`` as one cached program per call
  signature (``jaxapi.run_eager``): outside jit every primitive would otherwise be compiled
  anew on every call."""
  trace = jaxapi.eager_shard_map_trace(leaves)
  if trace is None:
    if (jaxapi.eager_shard_map_below(leaves) is not None
        and all(jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x in leaves)):
      return list(_eager_differentiable(what, body, args, tuple(leaves)))
    return body(leaves, *args)
  key = (what, args, mesh_lib.current_mesh())
  return jaxapi.run_eager(trace, key, lambda ls: body(ls, *args), leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _eager_differentiable(what, body, args, leaves):
  """``body(leaves, *args)`` under an eager ``jax.grad`` of an eager ``shard_map``: the forward
  rule runs below the differentiation trace (on the eager shard_map's values) and the backward
  rule in the eager shard_map, each as one cached program, so neither the collective nor the
  packing around it (buckets, casts) is run primitive by primitive on every call."""
  return eager_or_traced(what, body, list(leaves), args)


def _eager_differentiable_fwd(what, body, args, leaves):
  return tuple(eager_or_traced(what, body, list(leaves), args)), leaves


def _eager_differentiable_bwd(what, body, args, leaves, cts):
  n = len(leaves)

  def vjp(ls, *args):     # the VJP of the same body, inside the cached program
    _, pull = jax.vjp(lambda xs: tuple(body(list(xs), *args)), tuple(ls[:n]))
    return list(pull(tuple(ls[n:]))[0])
  return (tuple(eager_or_traced(what + "_vjp", vjp, list(leaves) + list(cts), args)),)


_eager_differentiable.defvjp(_eager_differentiable_fwd, _eager_differentiable_bwd)


# --- vmap axes -----------------------------------------------------------------------------------

def vmap_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of ``axes`` that are ``jax.vmap`` axes (bound, but not manual mesh axes)."""
  manual = jaxapi.manual_axes()
  return tuple(a for a in axes if a not in manual)


@contextlib.contextmanager
def vmap_errors(what: str, axes: tuple[str, ...]):
  """JAX's own collectives over a vmap axis fail inside ``jax.shard_map(check_vma=True)`` with a
  bare AssertionError (jax 0.10.2: ``lax.psum`` too); say which axis and what to do instead."""
  try:
    yield
  except AssertionError as e:
    vaxes = vmap_axes(axes)
    if not vaxes:
      raise
    raise errors.CollectiveError(
        f"{what}: axis_name={axes!r} includes the jax.vmap axis {list(vaxes)}, and JAX cannot "
        "run a collective over a vmap axis inside jax.shard_map(check_vma=True) (lax.psum "
        "fails there too). Pass check_vma=False to jax.shard_map (dtenjax.mesh_map(..., "
        "check_vma=False)), make the vmapped dimension a mesh axis, or loop with lax.map and "
        "reduce the stacked results over the mesh axes (all_reduce(..., local_axis=0, "
        "reproducible=True) sums them exactly).") from e


def float0_like(shape):
  """The zero cotangent of an integer input of ``shape`` (JAX's ``float0``)."""
  return np.zeros(shape, jax.dtypes.float0)

