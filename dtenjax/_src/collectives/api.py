"""Public collectives: ``all_reduce``, ``reduce_scatter``, ``all_gather``, and ``plan_all_reduce``.

They run wherever JAX has named axes: inside ``jax.shard_map`` / ``mesh_map`` (under jit or
not) and over ``jax.vmap(..., axis_name=...)`` axes. ``axis_name`` may be a tuple of axes (treated
as one combined axis in mesh order). Arguments may be pytrees; an all-reduce of a pytree packs
its leaves into flat buckets of ``bucket_bytes`` (default ``DTENJAX_BUCKET_BYTES``) so a tree of
many small gradients costs few collectives (see ``buckets.py``).

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
  depend on the algorithm or on how the same contributions are split over devices. With
  ``local_axis`` the input holds several contributions stacked on that axis; each is encoded on
  its own, so the result equals that of the same contributions spread over more devices.
  ``reproducible="v2"``: contract v2 (``fixed_point.py``, two words per value: a finer grid, not
  the correctly rounded sum; ``"exact"`` is its deprecated name and warns).
  float32 / bfloat16 only.
- ``vmap``: mapping over an ordinary (unnamed) batch dimension reduces every batch element
  independently across devices; ``jax.vmap(f, axis_name="v")`` makes "v" a valid ``axis_name``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import config
from dtenjax._src import contract as contract_lib
from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import buckets
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.collectives.algorithms import ring
from dtenjax._src.contract import Contract
from dtenjax._src.net import callsite
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.topology.model import Topology

AxisName = base.AxisName
AlgorithmChoice = registry.AlgorithmChoice


# --- validation at the Python boundary ----------------------------------------------------------

def check_axes(axis_name: AxisName, what: str) -> tuple[str, ...]:
  """The axis names as a tuple; raises CollectiveError naming unbound axes and the bound ones."""
  axes = jaxapi.axis_tuple(axis_name)
  if not axes:
    raise errors.CollectiveError(f"{what}: axis_name={axis_name!r} is empty; pass a mesh axis "
                                 "name or a tuple of them.")
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


def _check_common(what: str, op: str, algorithm: str):
  problems = []
  if op not in base.OPS:
    problems.append(f"op={op!r} is not supported; use one of {list(base.OPS)}")
  if algorithm not in registry.names():
    problems.append(f"algorithm={algorithm!r} is unknown; use one of {list(registry.names())}")
  if problems:
    raise errors.CollectiveError(errors.join_problems(f"{what}: bad arguments", problems))


def _contract_of(op: str, reproducible) -> Contract:
  """The public ``reproducible=`` parsed (``contract.parse``: a bad value raises, "exact" warns),
  NONE for max and min, which are exact in any order: the one contract every layer below takes."""
  contract = contract_lib.parse(reproducible)
  return contract if op in base.SUMS else Contract.NONE


def _check_leaf(what: str, x, op: str, contract: Contract):
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

class _Context(NamedTuple):
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


def _context(axes: tuple[str, ...]) -> _Context:
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
  return _Context(sizes, tuple(int(d.id) for d in devices), backend, mesh_axes, processes,
                  _xla_reaches_processes(backend))


def _xla_reaches_processes(backend: str) -> bool:
  """Whether XLA's own collectives connect processes on ``backend`` (NCCL on GPU; on CPU only
  with a cross-process implementation configured, JAX's default being gloo)."""
  if backend != "cpu":
    return True
  return getattr(jax.config, "jax_cpu_collectives_implementation", None) in ("gloo", "mpi")


def _make_call(kind: str, dtype, nbytes: int, ctx: _Context, axes, op, algorithm, deterministic,
               contract: Contract, contributions=1, tag=None) -> base.Call:
  return base.Call(kind=kind, op=op, dtype=dtype, axes=axes, axis_sizes=ctx.axis_sizes,
                   nbytes=int(nbytes), backend=ctx.backend, deterministic=bool(deterministic),
                   contract=contract, contributions=int(contributions),
                   mesh_axes=ctx.mesh_axes, processes=ctx.processes,
                   xla_reaches_processes=ctx.xla_reaches_processes, requested=algorithm, tag=tag)


def _resolve(algorithm: str, call: base.Call, ctx: _Context) -> base.Algorithm:
  return registry.get(registry.resolve(algorithm, call, ctx.group, None).algorithm)


# --- JAX's typing of collectives (varying manual axes) ------------------------------------------

def _typed_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of ``axes`` that carry vma types here: manual mesh axes under ``check_vma=True``.

  The others (vmap axes, any axis of an unchecked shard_map or of pmap) follow pmap's rules."""
  if not jaxapi.vma_checked():
    return ()
  manual = jaxapi.manual_axes()
  return tuple(a for a in axes if a in manual)


def _check_reduced_type(x, y, axes: tuple[str, ...], record: str):
  """``y`` must be typed as ``lax.psum(x, axes)``; a record that is not is a dtenjax bug."""
  want = jaxapi.vma(x) - frozenset(axes)
  got = jaxapi.vma(y)
  if got != want:
    raise errors.CollectiveError(
        f"internal error: algorithm {record!r} returned a value varying over {sorted(got)} where "
        f"an all-reduce over {axes} must vary over {sorted(want)} (as lax.psum's result does); "
        "please report it, and use algorithm='xla' meanwhile.")
  return y


def _warn_invariant_mean(leaves, typed: tuple[str, ...]) -> None:
  """The migration trap JAX has too, said once: a mean over axes the value does not vary over."""
  if not typed:
    return
  inv = [i for i, leaf in enumerate(leaves)
         if jnp.issubdtype(leaf.dtype, jnp.inexact) and not jaxapi.vma(leaf) & set(typed)]
  if inv:
    errors.warn_once(
        "invariant-mean",
        f"dtenjax.all_reduce(op='mean') over {typed} got values that do not vary over those axes "
        f"(leaves {inv[:5]}{'...' if len(inv) > 5 else ''}): the mean of n equal copies is the "
        "value itself. If it is a gradient with respect to parameters passed with in_specs=P(), "
        "jax.grad has already SUMMED it over the devices, so this returns n times the mean "
        "gradient (lax.pmean does the same). Differentiate with respect to "
        "dtenjax.compression.pvary(params, axis) (jax.lax.pcast(params, axis, to='varying')) to "
        "get per-device gradients to average, or use the summed gradient divided by n.")


# --- single-array all-reduce and its VJP --------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Spec:
  axes: tuple[str, ...]
  op: str
  algorithm: str
  deterministic: bool
  contract: Contract                # parsed once, by all_reduce (contract.parse)
  local_axis: int | None = None
  local_size: int = 1
  typed: tuple[str, ...] = ()     # the axes with vma types (see _typed_axes)
  tag: int | str | None = None    # static part, checked by _split_tag


def _split_tag(tag):
  """``tag`` checked as the transport reads it: (static tag for the spec, traced tag or None).

  A traced integer scalar (e.g. the index of ``lax.fori_loop``) cannot live in the static spec:
  it travels as an operand of the collective instead (the host transport compares its value on
  every rank, like a static tag's)."""
  if tag is None or isinstance(tag, str) or (isinstance(tag, (int, np.integer))
                                             and not isinstance(tag, bool)):
    callsite.tag_value(tag)                 # raises CollectiveError naming a bad value
    return (tag if tag is None or isinstance(tag, str) else int(tag)), None
  try:
    if callsite.tag_value(tag)[0] is None:  # an integer scalar array: traced or concrete
      return None, jnp.asarray(tag)
  except errors.CollectiveError as e:
    raise errors.CollectiveError(f"all_reduce: {e}") from None
  raise errors.CollectiveError(f"all_reduce: tag={tag!r} is not a tag.")  # pragma: no cover


def _forward(x, spec: _Spec, traced_tag=None):
  """The all-reduce of one array; under an eager ``shard_map`` (also the forward pass of an eager
  ``jax.grad``, which runs the custom VJP's forward rule there) one cached program."""
  if traced_tag is None:
    return _eager_or_traced("forward", lambda ls, s: [_forward_traced(ls[0], s)], [x],
                            (spec,))[0]
  return _forward_traced(x, spec, traced_tag)


def _forward_traced(x, spec: _Spec, traced_tag=None, record=None, ctx=None):
  ctx = _context(spec.axes) if ctx is None else ctx
  k = spec.local_size
  nbytes = x.size // k * jnp.dtype(x.dtype).itemsize
  call = _make_call("all_reduce", x.dtype, nbytes, ctx, spec.axes, spec.op, spec.algorithm,
                    spec.deterministic, spec.contract, k if spec.contract.reproducible else 1,
                    spec.tag if traced_tag is None else traced_tag)
  record = _resolve(spec.algorithm, call, ctx) if record is None else record
  if call.reproducible:
    stack = jnp.moveaxis(x, spec.local_axis, 0) if spec.local_axis is not None else x[None]
    if record.reproducible is not None:
      return _check_reduced_type(x, record.reproducible(stack, call), spec.axes, record.name)
    return _check_reduced_type(x, repro.all_reduce(stack, call, record), spec.axes, record.name)
  if spec.local_axis is not None:       # max / min over local contributions: exact in any order
    x = base.ordered_reduce(jnp.moveaxis(x, spec.local_axis, 0), spec.op)
  out_dtype, count = x.dtype, call.world

  def finish(y):
    if spec.op == "mean":
      y = fixed_point.ieee_divide(y, count)
    return y.astype(out_dtype)

  scale = _mean_scale(x.dtype, spec.op, count)
  y = record.all_reduce(x if scale is None else x * (1 / scale), call, finish)
  if scale is not None:
    y = y * jnp.asarray(scale, y.dtype)
  return _check_reduced_type(x, y, spec.axes, record.name)


def _mean_scale(dtype, op: str, count: int) -> float | None:
  """The power of two 2^k >= ``count`` by which a mean's inputs are divided (and its result
  multiplied) when their sum could overflow the accumulator although the mean cannot.

  Scaling by a power of two is exact, and so is the rounding of a scaled value, so the bits are
  those of ``sum / count`` whenever neither overflows nor underflows; inputs below
  ``2^(k - 126)`` (float32, bfloat16) lose their last k bits to the subnormal range instead
  (an absolute error of at most ``count * 2^-150``). None when the accumulator has the room
  (float16 sums in float32) or for non-float dtypes.
  """
  if op != "mean" or count <= 1 or not jnp.issubdtype(dtype, jnp.floating):
    return None
  acc = base.acc_dtype(dtype, op)
  if float(jnp.finfo(acc).max) >= count * float(jnp.finfo(dtype).max):
    return None
  return 2.0 ** math.ceil(math.log2(count))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _all_reduce_array(x, traced_tag, spec: _Spec):
  return _forward(x, spec, traced_tag)


def _ar_fwd(x, traced_tag, spec: _Spec):
  y = _forward(x, spec, traced_tag)
  return y, (((x, y) if spec.op not in base.SUMS else None), traced_tag)


def _float0_like(shape):
  return np.zeros(shape, jax.dtypes.float0)


def _sum_untyped(ct, spec: _Spec, traced_tag=None):
  """The cotangent summed over the axes without vma types (pmap's transpose of psum is psum);
  over typed axes the invariant cotangent is one value and needs no communication."""
  plain = tuple(a for a in spec.axes if a not in spec.typed)
  if not plain:
    return ct
  return _forward(ct, dataclasses.replace(spec, axes=plain, op="sum", local_axis=None,
                                          local_size=1, typed=()), traced_tag)


def _ar_bwd(spec: _Spec, res, ct):
  res, traced_tag = res
  if traced_tag is None and ct.dtype != jax.dtypes.float0:
    # An eager jax.grad runs this rule under the eager shard_map: one cached program, not one
    # compilation per primitive on every call.
    arrays = [ct] + (list(res) if res is not None else [])
    g = _eager_or_traced(
        "all_reduce_bwd",
        lambda ls, s: list(_ar_bwd_x(s, tuple(ls[1:]) or None, ls[0], None)), arrays, (spec,))
    return tuple(g) + (None,)
  return _ar_bwd_x(spec, res, ct, traced_tag) + (None,)


def _ar_bwd_x(spec: _Spec, res, ct, traced_tag):
  """The transpose of lax.psum / pmean in both of JAX's typings: over typed axes, invariant
  cotangent -> varying (``pcast``, no communication); over untyped axes, a sum of cotangents."""
  la, k = spec.local_axis, spec.local_size
  x_shape = ct.shape if la is None else ct.shape[:la] + (k,) + ct.shape[la:]
  if ct.dtype == jax.dtypes.float0:
    return (_float0_like(x_shape),)
  if spec.op in base.SUMS:
    g = _sum_untyped(ct, spec, traced_tag)
    if spec.op == "mean":
      g = g / jnp.asarray(base.axis_size(spec.axes) * k, g.dtype)
    if la is not None:
      g = jnp.broadcast_to(jnp.expand_dims(g, la), x_shape)
    return (jaxapi.to_varying(g, spec.typed),)
  # max / min: the cotangent goes to the selected element(s), ties share equally (like jnp.max)
  x, y = res
  yb = jnp.expand_dims(y, la) if la is not None else y
  mask = ((x == yb) | (jnp.isnan(x) & jnp.isnan(yb))).astype(ct.dtype)
  count = mask if la is None else jnp.sum(mask, axis=la)
  plain = dataclasses.replace(spec, op="sum", local_axis=None, local_size=1,
                              contract=Contract.NONE)
  share = _sum_untyped(ct, plain, traced_tag) / _forward(count, plain, traced_tag)
  return (jaxapi.to_varying(mask * (jnp.expand_dims(share, la) if la is not None else share),
                            spec.typed),)


_all_reduce_array.defvjp(_ar_fwd, _ar_bwd)


def _xla_combines(leaves, spec: _Spec):
  """The context and ``xla`` record when every dtype group of ``leaves`` (a sum or mean without
  stacked contributions) would be bucketed onto XLA's own all-reduce, else None.

  XLA combines the all-reduces of one program itself (its all-reduce combiner: one collective
  whose operands are the leaves), so dtenjax's buckets would only add a copy into the bucket and
  a copy out of it per leaf: a compiled kernel per leaf, the compile time of the step."""
  if spec.op not in base.SUMS or spec.contract.reproducible or spec.local_axis is not None:
    return None
  ctx = _context(spec.axes)
  groups: dict[str, int] = {}
  for leaf in leaves:
    dt = jnp.dtype(leaf.dtype)
    groups[dt.name] = groups.get(dt.name, 0) + leaf.size * dt.itemsize
  record = None
  for name, nbytes in groups.items():
    call = _make_call("all_reduce", jnp.dtype(name), nbytes, ctx, spec.axes, spec.op,
                      spec.algorithm, spec.deterministic, spec.contract, 1, spec.tag)
    record = _resolve(spec.algorithm, call, ctx)
    if record.family != "xla":
      return None
  return ctx, record


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_reduce_combined(leaves, spec: _Spec):
  """The leaves all-reduced by the ``xla`` record, one ``lax.psum`` each in one program (XLA
  combines them): the same bits as leaf by leaf, and as the bucket."""
  combined = _xla_combines(leaves, spec)
  ctx, record = combined
  return tuple(_forward_traced(x, spec, None, record, ctx) for x in leaves)


def _combined_fwd(leaves, spec: _Spec):
  return _all_reduce_combined(leaves, spec), None


def _combined_bwd(spec: _Spec, _, cts):
  return (tuple(_ar_bwd_x(spec, None, ct, None)[0] for ct in cts),)


_all_reduce_combined.defvjp(_combined_fwd, _combined_bwd)


def all_reduce(x, axis_name: AxisName, *, op: str = "sum", algorithm: str = "auto",
               deterministic: bool = True, reproducible: bool | str = False,
               local_axis: int | None = None, bucket_bytes: int | None = None,
               tag: int | str | None = None):
  """All-reduce of ``x`` (array or pytree) over the named axis/axes ``axis_name``.

  Args:
    op: "sum", "mean", "max" or "min".
    algorithm: "auto" (cost model over every algorithm that supports the call), a family --
      "xla", "ring", "hierarchical" (needs >= 2 axes: the last is the fast island axis),
      "one_shot", "two_shot", "butterfly" (power-of-two worlds) -- or a registry record such as
      "nvlink_one_shot" or "host_ring" (``algorithms/registry.py`` lists them).
    deterministic: fixed reduction order (see the module docstring for what "xla" means here).
    reproducible: True for the fixed-point sum of contract v3 (one word per value), "v2" for
      contract v2 (two words per value; "exact" is its deprecated name); the same bits for every
      algorithm and device split.
    local_axis: with reproducible=True or op max/min, the axis of ``x`` holding several local
      contributions (summed exactly with the other devices'; the axis is removed).
    bucket_bytes: pytree leaves are packed into flat buffers of at most this many bytes
      (default DTENJAX_BUCKET_BYTES; 0 = one collective per leaf); with ``local_axis``, into
      ``[contributions, values]`` buffers when every leaf holds as many contributions (each
      value is still reduced on its own: the same bits as leaf by leaf).
    tag: tells apart collectives across processes whose call stacks look alike, e.g. the
      iterations of a Python loop around one step (pass the step number, an int in 0..2**32-1),
      of a ``lax.fori_loop`` (pass its traced index: an integer scalar array) or collectives
      issued in a process-dependent order (a str naming each). The host transport compares it
      on every rank and raises on a mismatch (docs/reliability.md); the other algorithms need
      none (XLA orders its collectives) and ignore it.
  """
  _check_common("all_reduce", op, algorithm)
  tag, traced_tag = _split_tag(tag)
  contract = _contract_of(op, reproducible)
  axes = check_axes(axis_name, "all_reduce")
  if local_axis is not None and not contract.reproducible and op in base.SUMS:
    raise errors.CollectiveError(
        f"all_reduce: local_axis={local_axis} with op={op!r} needs reproducible=True (it is the "
        "exact sum of stacked local contributions); sum the axis yourself otherwise.")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  if bucket_bytes is None:
    bucket_bytes = config.get_int("DTENJAX_BUCKET_BYTES")
  args = (axes, op, algorithm, bool(deterministic), contract, local_axis, int(bucket_bytes),
          tag)
  if traced_tag is None:
    out = _eager_or_traced("all_reduce", _all_reduce_leaves, leaves, args)
  else:         # a tag that is a value travels as an operand: no cached eager program keys it
    out = _all_reduce_leaves(leaves, *args, traced_tag=traced_tag)
  return jax.tree_util.tree_unflatten(treedef, out)


def _eager_or_traced(what: str, body, leaves, args):
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
  return _eager_or_traced(what, body, list(leaves), args)


def _eager_differentiable_fwd(what, body, args, leaves):
  return tuple(_eager_or_traced(what, body, list(leaves), args)), leaves


def _eager_differentiable_bwd(what, body, args, leaves, cts):
  n = len(leaves)

  def vjp(ls, *args):     # the VJP of the same body, inside the cached program
    _, pull = jax.vjp(lambda xs: tuple(body(list(xs), *args)), tuple(ls[:n]))
    return list(pull(tuple(ls[n:]))[0])
  return (tuple(_eager_or_traced(what + "_vjp", vjp, list(leaves) + list(cts), args)),)


_eager_differentiable.defvjp(_eager_differentiable_fwd, _eager_differentiable_bwd)


def _vmap_axes(axes: tuple[str, ...]) -> tuple[str, ...]:
  """The axes of ``axes`` that are ``jax.vmap`` axes (bound, but not manual mesh axes)."""
  manual = jaxapi.manual_axes()
  return tuple(a for a in axes if a not in manual)


@contextlib.contextmanager
def _vmap_errors(what: str, axes: tuple[str, ...]):
  """JAX's own collectives over a vmap axis fail inside ``jax.shard_map(check_vma=True)`` with a
  bare AssertionError (jax 0.10.2: ``lax.psum`` too); say which axis and what to do instead."""
  try:
    yield
  except AssertionError as e:
    vaxes = _vmap_axes(axes)
    if not vaxes:
      raise
    raise errors.CollectiveError(
        f"{what}: axis_name={axes!r} includes the jax.vmap axis {list(vaxes)}, and JAX cannot "
        "run a collective over a vmap axis inside jax.shard_map(check_vma=True) (lax.psum "
        "fails there too). Pass check_vma=False to jax.shard_map (dtenjax.mesh_map(..., "
        "check_vma=False)), make the vmapped dimension a mesh axis, or loop with lax.map and "
        "reduce the stacked results over the mesh axes (all_reduce(..., local_axis=0, "
        "reproducible=True) sums them exactly).") from e


def _gather_vmap(leaf, vaxes: tuple[str, ...]):
  """``[n_vmap, *leaf.shape]``: every vmap lane's ``leaf``, in rank order of ``vaxes`` (the first
  name major), the same on every lane."""
  g = leaf
  for a in reversed(vaxes):
    g = lax.all_gather(g, a)
  return g.reshape((-1,) + leaf.shape)


def _all_reduce_mixed(leaves, mesh_axes, vaxes, op, algorithm, deterministic, contract,
                      local_axis, tag, traced_tag=None):
  """An all-reduce over mesh axes and vmap axes together, with lax.psum's semantics: the vmap
  lanes' values are gathered (a local stack, rank order of the vmap axes), then reduced over the
  mesh axes with the algorithm asked for -- exactly (``local_axis``) for reproducible sums and
  max/min, for plain sums as the lanes' rank-order fold followed by the algorithm. Every lane
  gets the same result, as with ``lax.psum(x, (mesh_axis, vmap_axis))``."""
  nv = math.prod(base.axis_size(a) for a in vaxes)
  if algorithm == "hierarchical" and len(mesh_axes) < 2:
    algorithm = "auto"      # the lanes are the island: the gather and fold are its first level
  out = []
  for leaf in leaves:
    leaf = jnp.asarray(leaf)
    if local_axis is not None:
      if not -leaf.ndim <= local_axis < leaf.ndim:
        raise errors.CollectiveError(f"all_reduce: local_axis={local_axis} is out of range for "
                                     f"shape {leaf.shape}; pass an axis of x.")
      leaf = jnp.moveaxis(leaf, local_axis, 0)
      stack = _gather_vmap(leaf, vaxes)
      stack = stack.reshape((-1,) + leaf.shape[1:])
    else:
      stack = _gather_vmap(leaf, vaxes)
    if contract.reproducible or op not in base.SUMS:
      out += _all_reduce_leaves([stack], mesh_axes, op, algorithm, deterministic, contract,
                                0, 0, tag, traced_tag)
      continue
    _check_leaf("all_reduce", leaf, op, contract)
    part = base.ordered_reduce(stack, "sum").astype(leaf.dtype)
    y, = _all_reduce_leaves([part], mesh_axes, "sum", algorithm, deterministic, Contract.NONE,
                            None, 0, tag, traced_tag)
    if op == "mean":
      y = fixed_point.ieee_divide(y, nv * base.axis_size(mesh_axes))
    out.append(y)
  return out


def _all_reduce_leaves(leaves, axes, op, algorithm, deterministic, contract, local_axis,
                       bucket_bytes, tag, traced_tag=None):
  vaxes = _vmap_axes(axes)
  with _vmap_errors("all_reduce", axes):
    if vaxes and len(vaxes) < len(axes):
      mesh_axes = tuple(a for a in axes if a not in vaxes)
      return _all_reduce_mixed(leaves, mesh_axes, vaxes, op, algorithm, deterministic,
                               contract, local_axis, tag, traced_tag)
    return _all_reduce_plain(leaves, axes, op, algorithm, deterministic, contract,
                             local_axis, bucket_bytes, tag, traced_tag)


def _all_reduce_plain(leaves, axes, op, algorithm, deterministic, contract, local_axis,
                      bucket_bytes, tag, traced_tag=None):
  typed = _typed_axes(axes)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  if op == "mean":
    _warn_invariant_mean(leaves, typed)
  # As lax.psum: a leaf invariant over a reduced axis is first cast to varying (so the sum of a
  # replicated value is n times it, and its gradient is summed back by the cast's transpose).
  leaves = [jaxapi.to_varying(leaf, typed) for leaf in leaves]
  specs = []
  for leaf in leaves:
    _check_leaf("all_reduce", leaf, op, contract)
    la, k = None, 1
    if local_axis is not None:
      if not -leaf.ndim <= local_axis < leaf.ndim:
        raise errors.CollectiveError(f"all_reduce: local_axis={local_axis} is out of range for "
                                     f"shape {leaf.shape}; pass an axis of x.")
      la = local_axis % leaf.ndim
      k = leaf.shape[la]
    specs.append(_Spec(axes, op, algorithm, deterministic, contract, la, k, typed, tag))
  if len(leaves) > 1 and bucket_bytes > 0 and len({s.local_size for s in specs}) == 1:
    spec, stacked = specs[0], local_axis is not None
    if traced_tag is None and _xla_combines(leaves, spec) is not None:
      return list(_all_reduce_combined(tuple(leaves), spec))
    if stacked:   # contributions on local_axis (a reproducible step's per-micro-batch gradients):
      # buckets of [contributions, values], one encode and collective per bucket, not per leaf
      leaves = [jnp.moveaxis(leaf, s.local_axis, 0) for leaf, s in zip(leaves, specs)]
      spec = dataclasses.replace(spec, local_axis=0)
    copies = _bucket_copies(spec.axes)
    return buckets.bucketed_apply(
        leaves, lambda flat: _all_reduce_array(flat, traced_tag, spec), bucket_bytes,
        stacked=stacked, copies=copies,
        offsets=None if copies is not None else _opaque_offsets(spec.axes))
  return [_all_reduce_array(leaf, traced_tag, s) for leaf, s in zip(leaves, specs)]


def _bucket_copies(axes: tuple[str, ...]) -> buckets.Copies | None:
  """The custom calls that pack and unpack a bucket over ``axes`` where they run
  (``cpu_ffi.active``: XLA:CPU, one process), padding it to a multiple of the world size."""
  ctx = _context(axes)
  if not cpu_ffi.active(ctx.backend, ctx.mesh_axes, ctx.processes):
    return None
  return buckets.Copies(cpu_ffi.pack, cpu_ffi.unpack, math.prod(ctx.axis_sizes))


def _opaque_offsets(axes: tuple[str, ...]):
  """``buckets.bucketed_apply``'s ``offsets`` for a bucket over ``axes`` (``base.opaque``)."""
  ctx = _context(axes)
  return base.opaque(axes, math.prod(ctx.axis_sizes), ctx.backend, ctx.mesh_axes, ctx.processes)


# --- reduce_scatter / all_gather: transposes of each other ----------------------------------------

@dataclasses.dataclass(frozen=True)
class _RSSpec:
  axes: tuple[str, ...]
  op: str
  algorithm: str
  deterministic: bool
  dim: int
  tiled: bool = True
  contract: Contract = Contract.NONE   # parsed once, by reduce_scatter
  invariant: bool = False           # all_gather(to="invarying") over typed axes


def _rs_impl(x, s: _RSSpec):
  ctx = _context(s.axes)
  n = math.prod(ctx.axis_sizes)
  call = _make_call("reduce_scatter", x.dtype, x.size * jnp.dtype(x.dtype).itemsize, ctx,
                    s.axes, s.op, s.algorithm, s.deterministic, s.contract)
  record = _resolve(s.algorithm, call, ctx)
  blocks = jnp.moveaxis(x, s.dim, 0)
  blocks = blocks.reshape((n, blocks.shape[0] // n) + blocks.shape[1:])
  if call.reproducible:
    y = repro.reduce_scatter(blocks, call, record)
  else:
    y = record.reduce_scatter(blocks, call)
    if s.op == "mean":
      y = fixed_point.ieee_divide(y, n)
  return jnp.moveaxis(y.astype(x.dtype), 0, s.dim)


def _ag_impl(x, s: _RSSpec):
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
    return _eager_or_traced(name, lambda ls, s: [impl(ls[0], s)], [x], (s,))[0]

  def bwd(s, ct):
    if ct.dtype == jax.dtypes.float0:
      return transpose(s, ct)
    return tuple(_eager_or_traced(name + "_transpose", lambda ls, s: list(transpose(s, ls[0])),
                                  [ct], (s,)))

  f = jax.custom_vjp(fwd, nondiff_argnums=(1,))
  f.defvjp(lambda x, s: (fwd(x, s), None), lambda s, _, ct: bwd(s, ct))
  return f


def _rs_transpose(s, ct):
  if ct.dtype == jax.dtypes.float0:
    shape = list(ct.shape)
    shape[s.dim] *= base.axis_size(s.axes)
    return (_float0_like(tuple(shape)),)
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


_reduce_scatter_array = _with_transpose(_rs_impl, _rs_transpose)
_all_gather_array = _with_transpose(_ag_impl, _ag_transpose)


def reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False,
                   op: str = "sum", algorithm: str = "auto", deterministic: bool = True,
                   reproducible: bool | str = False):
  """Reduces over ``axis_name`` and leaves rank r with block r of ``scatter_dimension``.

  The arguments and result shapes are ``lax.psum_scatter``'s: with ``tiled=False`` (the default)
  the scattered dimension must have the axis size and is removed; with ``tiled=True`` it is split
  into equal blocks. The result varies over ``axis_name`` (as psum_scatter's); the transpose is
  :func:`all_gather`.
  Algorithms: "ring" (ppermute ring), "butterfly" (recursive halving over ppermute, power-of-two
  worlds), "one_shot" (all_gather + ordered reduction of the owned block), "two_shot"
  (all_to_all + ordered reduction), "xla" (psum_scatter where its order is fixed, see
  ``algorithms/xla.py``), "auto". ``reproducible=True`` (contract v3) or ``"v2"``
  (``"exact"``, deprecated): the codes are MAX-reduced over the full input, the int32 words
  reduce-scattered, rank r decodes block r (the same bits as ``all_reduce(...,
  reproducible=...)`` of that block).
  """
  _check_common("reduce_scatter", op, algorithm)
  contract = _contract_of(op, reproducible)
  axes = check_axes(axis_name, "reduce_scatter")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  args = (axes, axis_name, scatter_dimension, bool(tiled), op, algorithm, bool(deterministic),
          contract)
  with _vmap_errors("reduce_scatter", axes):
    out = _eager_or_traced("reduce_scatter", _reduce_scatter_leaves, leaves, args)
  return jax.tree_util.tree_unflatten(treedef, out)


def _reduce_scatter_leaves(leaves, axes, axis_name, scatter_dimension, tiled, op, algorithm,
                           deterministic, contract):
  n = base.axis_size(axes)
  problems, out = [], []
  typed = _typed_axes(axes)
  for i, leaf in enumerate(leaves):
    leaf = jaxapi.to_varying(jnp.asarray(leaf), typed)     # as lax.psum_scatter
    _check_leaf("reduce_scatter", leaf, op, contract)
    if not -leaf.ndim <= scatter_dimension < leaf.ndim:
      problems.append(f"leaf {i} shape {leaf.shape}: scatter_dimension={scatter_dimension} is "
                      "out of range")
      continue
    dim = scatter_dimension % leaf.ndim
    if not tiled and leaf.shape[dim] != n:
      problems.append(f"leaf {i} shape {leaf.shape}: with tiled=False dimension {dim} must have "
                      f"the size {n} of axis {axis_name!r} (one slice per rank), got "
                      f"{leaf.shape[dim]}; pass tiled=True to split it into {n} blocks")
      continue
    if leaf.shape[dim] % n:
      problems.append(f"leaf {i} shape {leaf.shape}: dimension {dim} of size {leaf.shape[dim]} "
                      f"is not divisible by the size {n} of axis {axis_name!r}; pad it to a "
                      f"multiple of {n} or pick another scatter_dimension")
      continue
    y = _reduce_scatter_array(leaf, _RSSpec(axes, op, algorithm, deterministic, dim,
                                            contract=contract))
    out.append(y if tiled else jnp.squeeze(y, dim))
  if problems:
    raise errors.CollectiveError(errors.join_problems("reduce_scatter: bad inputs", problems))
  return out


ALL_GATHER_TO = ("varying", "invarying")


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               to: str = "varying", algorithm: str = "auto", deterministic: bool = True):
  """Gathers ``x`` from every rank along ``axis`` (stacked, or concatenated when ``tiled``).

  Pure data movement, so the bits never depend on the algorithm: "ring" is a ppermute ring,
  every other name uses XLA's all-gather. The transpose is :func:`reduce_scatter` (chosen by
  ``auto`` with the same ``deterministic``).

  ``to`` is ``lax.all_gather``'s (jax 0.10.2 and 0.11.2): the result's type over typed manual
  axes (``shard_map(check_vma=True)``). "varying" (default): it varies over ``axis_name`` (the
  transpose is a reduce-scatter). "invarying": every device holds the same gathered value, typed
  invariant (it can leave through ``out_specs=P()``); XLA's all-gather for any ``algorithm``,
  and the transpose takes rank r's block of the (invariant) cotangent, with no communication.
  Over vmap axes or without the type check there are no types and both are the same. lax's
  third value, "reduced", belongs to its unreduced/reduced types and is refused here (use
  ``jax.lax.all_gather(..., to="reduced")``).
  """
  _check_common("all_gather", "sum", algorithm)
  if to not in ALL_GATHER_TO:
    raise errors.CollectiveError(
        f"all_gather: to={to!r} is not one of {ALL_GATHER_TO} (lax.all_gather's varying and "
        "invarying result types); for to='reduced' call jax.lax.all_gather directly.")
  axes = check_axes(axis_name, "all_gather")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  args = (axes, axis, bool(tiled), algorithm, bool(deterministic), to)
  with _vmap_errors("all_gather", axes):
    out = _eager_or_traced("all_gather", _all_gather_leaves, leaves, args)
  return jax.tree_util.tree_unflatten(treedef, out)


def _all_gather_leaves(leaves, axes, axis, tiled, algorithm, deterministic, to="varying"):
  out, problems = [], []
  typed = _typed_axes(axes)
  invariant = to == "invarying" and bool(axes) and set(typed) == set(axes)
  for i, leaf in enumerate(leaves):
    leaf = jaxapi.to_varying(jnp.asarray(leaf), typed)     # as lax.all_gather
    nd = leaf.ndim if tiled else leaf.ndim + 1
    if not -nd <= axis < nd or (tiled and leaf.ndim == 0):
      problems.append(f"leaf {i} shape {leaf.shape}: axis={axis} is out of range "
                      f"(tiled={tiled})")
      continue
    out.append(_all_gather_array(leaf, _RSSpec(axes, "sum", algorithm, deterministic,
                                               axis % nd, tiled, invariant=invariant)))
  if problems:
    raise errors.CollectiveError(errors.join_problems("all_gather: bad inputs", problems))
  return out


# --- the choice as data ----------------------------------------------------------------------------

def plan_all_reduce(nbytes: int, group: Sequence[int], topology: Topology | None = None, *,
                    op: str = "sum", dtype: Any = jnp.float32, deterministic: bool = True,
                    reproducible: bool | str = False, kind: str = "all_reduce",
                    axis_sizes: Sequence[int] | None = None, backend: str | None = None,
                    processes: int | None = None) -> AlgorithmChoice:
  """What ``algorithm="auto"`` would pick for one collective of ``nbytes`` per rank over the
  device ids ``group`` (rank order), without tracing anything.

  ``axis_sizes`` splits the group into mesh axes (default: one axis); ``backend`` and
  ``processes`` default to what ``topology`` (default :meth:`Topology.current`) says about the
  group's devices.
  """
  if kind not in base.KINDS:
    raise errors.CollectiveError(f"plan_all_reduce: kind={kind!r} is not one of {base.KINDS}")
  _check_common("plan_all_reduce", op, "auto")
  contract = _contract_of(op, reproducible)
  given = group
  try:
    group = [operator.index(g) for g in group]
  except TypeError:
    group = []
  if not group:
    raise errors.CollectiveError(
        f"plan_all_reduce: group={given!r} must list the device ids taking part, in rank order "
        "(e.g. [d.id for d in mesh.devices.flat])")
  topology = topology if topology is not None else Topology.current()
  sizes = tuple(int(s) for s in (axis_sizes or (len(group),)))
  if math.prod(sizes) != len(group):
    raise errors.CollectiveError(f"plan_all_reduce: axis_sizes={sizes} do not multiply to the "
                                 f"group size {len(group)}")
  infos = [topology.device(g) for g in group]
  backend = backend or infos[0].platform
  if processes is None:
    processes = len({d.process_index for d in infos})
  call = base.Call(kind=kind, op=op, dtype=dtype, axes=tuple(f"axis{i}" for i in range(len(sizes))),
                   axis_sizes=sizes, nbytes=int(nbytes), backend=backend,
                   deterministic=deterministic,
                   contract=contract, processes=processes,
                   xla_reaches_processes=_xla_reaches_processes(backend), nvls=topology.nvls)
  return registry.choose(call, group, topology)
