"""``all_reduce``: the all-reduce of an array or a pytree over named axes.

An all-reduce of a pytree packs its leaves into flat buckets of ``bucket_bytes`` (default
``DTENJAX_BUCKET_BYTES``) so a tree of many small gradients costs few collectives (see
``buckets.py``); where every bucket would run on XLA's own all-reduce the leaves go to XLA
unpacked (its combiner merges them). With ``reproducible=True`` and ``local_axis`` the input holds
several contributions stacked on that axis; each is encoded on its own, so the result equals that
of the same contributions spread over more devices. An all-reduce over mesh axes and vmap axes
together gathers the vmap lanes first. Where it runs, its semantics and the derivatives: see
``common.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import buckets
from dtenjax._src.collectives import common
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.contract import Contract
from dtenjax._src.net import callsite

AxisName = base.AxisName


# --- JAX's typing of the result ------------------------------------------------------------------

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
  typed: tuple[str, ...] = ()     # the axes with vma types (see common.typed_axes)
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
    return common.eager_or_traced("forward", lambda ls, s: [_forward_traced(ls[0], s)], [x],
                                  (spec,))[0]
  return _forward_traced(x, spec, traced_tag)


def _forward_traced(x, spec: _Spec, traced_tag=None, record=None, ctx=None):
  ctx = common.context(spec.axes) if ctx is None else ctx
  k = spec.local_size
  nbytes = x.size // k * jnp.dtype(x.dtype).itemsize
  call = common.make_call("all_reduce", x.dtype, nbytes, ctx, spec.axes, spec.op, spec.algorithm,
                          spec.deterministic, spec.contract,
                          k if spec.contract.reproducible else 1,
                          spec.tag if traced_tag is None else traced_tag)
  record = common.resolve(spec.algorithm, call, ctx) if record is None else record
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
    g = common.eager_or_traced(
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
    return (common.float0_like(x_shape),)
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
  ctx = common.context(spec.axes)
  groups: dict[str, int] = {}
  for leaf in leaves:
    dt = jnp.dtype(leaf.dtype)
    groups[dt.name] = groups.get(dt.name, 0) + leaf.size * dt.itemsize
  record = None
  for name, nbytes in groups.items():
    call = common.make_call("all_reduce", jnp.dtype(name), nbytes, ctx, spec.axes, spec.op,
                            spec.algorithm, spec.deterministic, spec.contract, 1, spec.tag)
    record = common.resolve(spec.algorithm, call, ctx)
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


# --- the public all-reduce: a pytree, its buckets, vmap lanes -------------------------------------

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
  common.check_common("all_reduce", op, algorithm)
  tag, traced_tag = _split_tag(tag)
  contract = common.contract_of(op, reproducible)
  axes = common.check_axes(axis_name, "all_reduce")
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
    out = common.eager_or_traced("all_reduce", _all_reduce_leaves, leaves, args)
  else:         # a tag that is a value travels as an operand: no cached eager program keys it
    out = _all_reduce_leaves(leaves, *args, traced_tag=traced_tag)
  return jax.tree_util.tree_unflatten(treedef, out)


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
    common.check_leaf("all_reduce", leaf, op, contract)
    part = base.ordered_reduce(stack, "sum").astype(leaf.dtype)
    y, = _all_reduce_leaves([part], mesh_axes, "sum", algorithm, deterministic, Contract.NONE,
                            None, 0, tag, traced_tag)
    if op == "mean":
      y = fixed_point.ieee_divide(y, nv * base.axis_size(mesh_axes))
    out.append(y)
  return out


def _all_reduce_leaves(leaves, axes, op, algorithm, deterministic, contract, local_axis,
                       bucket_bytes, tag, traced_tag=None):
  def kept(i, entries):            # local_axis, where given, is summed away
    if local_axis is None or not -len(entries) <= local_axis < len(entries):
      return entries
    return tuple(e for d, e in enumerate(entries) if d != local_axis % len(entries))
  return common.free_explicit_axes(
      leaves, lambda ls: _all_reduce_typed(ls, axes, op, algorithm, deterministic, contract,
                                           local_axis, bucket_bytes, tag, traced_tag), kept,
      linear=op in base.SUMS)


def _all_reduce_typed(leaves, axes, op, algorithm, deterministic, contract, local_axis,
                      bucket_bytes, tag, traced_tag=None):
  vaxes = common.vmap_axes(axes)
  with common.vmap_errors("all_reduce", axes):
    if vaxes and len(vaxes) < len(axes):
      mesh_axes = tuple(a for a in axes if a not in vaxes)
      return _all_reduce_mixed(leaves, mesh_axes, vaxes, op, algorithm, deterministic,
                               contract, local_axis, tag, traced_tag)
    return _all_reduce_plain(leaves, axes, op, algorithm, deterministic, contract,
                             local_axis, bucket_bytes, tag, traced_tag)


def _all_reduce_plain(leaves, axes, op, algorithm, deterministic, contract, local_axis,
                      bucket_bytes, tag, traced_tag=None):
  typed = common.typed_axes(axes)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  if op == "mean":
    _warn_invariant_mean(leaves, typed)
  # As lax.psum: a leaf invariant over a reduced axis is first cast to varying (so the sum of a
  # replicated value is n times it, and its gradient is summed back by the cast's transpose).
  leaves = [jaxapi.to_varying(leaf, typed) for leaf in leaves]
  specs = []
  for leaf in leaves:
    common.check_leaf("all_reduce", leaf, op, contract)
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
  ctx = common.context(axes)
  if not cpu_ffi.active(ctx.backend, ctx.mesh_axes, ctx.processes):
    return None
  return buckets.Copies(cpu_ffi.pack, cpu_ffi.unpack, math.prod(ctx.axis_sizes))


def _opaque_offsets(axes: tuple[str, ...]):
  """``buckets.bucketed_apply``'s ``offsets`` for a bucket over ``axes`` (``base.opaque``)."""
  ctx = common.context(axes)
  return base.opaque(axes, math.prod(ctx.axis_sizes), ctx.backend, ctx.mesh_axes, ctx.processes)

