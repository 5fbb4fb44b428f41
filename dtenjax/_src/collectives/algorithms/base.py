"""What every runnable algorithm is made of: its price record (``pricing/algorithms.py``: which
calls it supports, its order, its cost) and its implementation, plus the building blocks the
XLA-native algorithms share.

The :class:`Call` it is asked about and the vocabulary of ops live in ``pricing/calls.py`` (the
layer below, which the planner reads too) and are re-exported here. ``registry.py`` lists the
algorithms; ``algorithm="auto"`` and the planner rank only the records whose ``supports`` returns
None (``pricing/registry.py``), so neither can pick one that would raise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.pricing import algorithms as prices
from dtenjax._src.pricing import costmodel
from dtenjax._src.pricing.calls import KINDS as KINDS
from dtenjax._src.pricing.calls import OPS as OPS
from dtenjax._src.pricing.calls import SUMS as SUMS
from dtenjax._src.pricing.calls import Call as Call
from dtenjax._src.pricing.calls import acc_dtype as acc_dtype
from dtenjax._src.pricing.calls import uses_keys as uses_keys
from dtenjax._src.pricing.calls import xla_reaches as xla_reaches

AxisName = str | tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One collective algorithm: its price record and how it runs.

  Attributes:
    price: what it supports, its order and its cost (``pricing/algorithms.py``); ``name``,
      ``family``, ``order``, ``cost``, ``supports``, ``applies``, :meth:`why_not` and
      :meth:`time` read it.
    all_reduce: ``(x, call, finish) -> result``; ``finish`` maps the accumulated value (the
      accumulation dtype, see :func:`acc_dtype`) to the result (mean division, final cast).
    reduce_scatter: ``(blocks, call) -> owned block`` in the accumulation dtype, where
      ``blocks`` is ``[n, ...]`` and rank r owns block r; None when the algorithm has none
      (then ``price.has_reduce_scatter`` is False).
    reproducible: ``(stack, call) -> result`` for reproducible sums of ``stack`` (``[k, ...]``
      local contributions, ``call.contract``); None uses the generic word exchange
      (``collectives/reproducible.py``) with this record's integer all-reduce for the words.
    code_max: ``(codes, call) -> reduced codes`` for that composition; None uses ``lax.pmax``.
  """
  price: prices.Record
  all_reduce: Callable[..., Any]
  reduce_scatter: Callable[..., Any] | None = None
  reproducible: Callable[..., Any] | None = None
  code_max: Callable[..., Any] | None = None

  def __post_init__(self):
    if (self.reduce_scatter is not None) != self.price.has_reduce_scatter:
      raise ValueError(f"algorithm {self.price.name!r}: its reduce_scatter "
                       f"({self.reduce_scatter!r}) and its price record's has_reduce_scatter "
                       f"({self.price.has_reduce_scatter}) disagree")

  @property
  def name(self) -> str:
    return self.price.name

  @property
  def family(self) -> str:
    return self.price.family

  @property
  def order(self) -> str:
    return self.price.order

  @property
  def cost(self) -> costmodel.Cost:
    return self.price.cost

  @property
  def supports(self) -> Callable[[Call], str | None]:
    return self.price.supports

  @property
  def applies(self) -> Callable[[Call], bool]:
    return self.price.applies

  def why_not(self, call: Call) -> str | None:
    """None when this algorithm can run ``call``; otherwise the reason (kind checks included)."""
    return self.price.why_not(call)

  def time(self, call: Call, group, topology, costs: costmodel.BackendCosts | None = None) -> float:
    """The cost model's seconds for this algorithm running ``call`` over the device ids ``group``."""
    return self.price.time(call, group, topology, costs)


# --- shared building blocks ---------------------------------------------------------------------

def axis_size(axis_name: AxisName) -> int:
  """Static size of the (possibly combined) named axis."""
  return int(lax.axis_size(jaxapi.axis_tuple(axis_name)))


# Order keys: a float's bits mapped to a signed integer whose order is the float's total order
# (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN). MAX/MIN of keys is exact and order-free, and
# with NaN made +NaN for max (-NaN for min) any NaN wins, so every algorithm propagates NaN and
# gives the same bits (XLA's pmax/pmin drop NaN on CPU, gloo and NCCL: see docs/collectives.md).
_INT_OF = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def to_key(x, op: str):
  """Integer order keys of float ``x`` for ``op`` "max"/"min" (other dtypes pass through)."""
  if not uses_keys(x.dtype):
    return x
  dt = jnp.dtype(x.dtype)
  width = dt.itemsize
  it = _INT_OF[width]
  nan_bits = np.array(np.nan, dt).view(np.dtype(it))            # +NaN: the largest key
  if op == "min":
    nan_bits = nan_bits | np.array(-0.0, dt).view(np.dtype(it))  # -NaN: the smallest key
  b = lax.bitcast_convert_type(x, it)
  b = jnp.where(jnp.isnan(x), nan_bits, b)
  flip = np.array((1 << (8 * width - 1)) - 1, np.dtype(it))
  return b ^ (jnp.right_shift(b, 8 * width - 1) & flip)


def from_key(k, dtype):
  """Inverse of :func:`to_key` (the map is an involution on the bits)."""
  if not uses_keys(dtype):
    return k
  width = jnp.dtype(dtype).itemsize
  flip = np.array((1 << (8 * width - 1)) - 1, np.dtype(_INT_OF[width]))
  return lax.bitcast_convert_type(k ^ (jnp.right_shift(k, 8 * width - 1) & flip), dtype)


def combiner(op: str) -> Callable:
  return {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}[op]


def ordered_reduce(stack, op: str, dtype=None):
  """Reduces ``stack`` over axis 0 left to right: ``((s[0] + s[1]) + s[2]) + ...``.

  An explicit chain of binary ops (XLA does not reassociate floating-point adds), unlike
  ``jnp.sum`` whose order is up to the backend's reduction emitter. Float max/min go through
  order keys (NaN wins, -0 < +0), so they are exact in any order.
  """
  if op in ("max", "min") and uses_keys(stack.dtype):
    return from_key(ordered_reduce(to_key(stack, op), op), stack.dtype)
  dtype = dtype or acc_dtype(stack.dtype, op)
  comb = combiner(op)
  acc = stack[0].astype(dtype)
  for i in range(1, stack.shape[0]):
    acc = comb(acc, stack[i].astype(dtype))
  return acc


def opaque(axes: tuple[str, ...], world: int, backend: str, mesh_axes: bool = True,
           processes: int = 1) -> Callable | None:
  """``values -> traced int32 scalars`` equal to the Python ints ``values`` that XLA cannot fold
  into a kernel, where XLA:CPU compiles kernels; else None (use constants).

  XLA compiles one kernel per distinct fused computation, and XLA:CPU compiles each as an LLVM
  module of its own (tens of milliseconds). Copies out of one buffer at constant offsets (the
  leaves out of a bucket, the chunks of an all-to-all) are distinct computations, one kernel
  each; at offsets read at run time, the copies of one shape are one kernel. The values leave
  through one ``lax.pmax`` over groups of one device each: an all-reduce with nobody to wait
  for (no data moves between devices), typed invariant over ``axes`` like any ``pmax``. Only on
  CPU, in one process, over manual mesh axes (a vmap axis or a group across processes has no
  such free all-reduce)."""
  if backend != "cpu" or not mesh_axes or processes != 1:
    return None
  groups = [[r] for r in range(world)]

  def values_of(values: tuple[int, ...]):
    if not values or max(values) >= 2**31:
      return tuple(values)
    try:
      return lax.pmax(tuple(np.int32(v) for v in values), axes, axis_index_groups=groups)
    except (NotImplementedError, ValueError, TypeError):   # a JAX without axis_index_groups here
      return tuple(values)
  return values_of


def opaque_of(call: Call) -> Callable | None:
  """:func:`opaque` for the devices of ``call``."""
  return opaque(call.axes, call.world, call.backend, call.mesh_axes, call.processes)


def chunk_len(size: int, n: int) -> int:
  """Values per chunk of a flat buffer of ``size`` values cut into ``n`` equal chunks (the last
  ones padded with zeros)."""
  return -(-size // n) if size else 1


def gather_flat(mine, axes, shape):
  """XLA's all-gather of every rank's reduced chunk ``mine``, typed invariant as lax.psum's
  result, cut back to the ``shape`` of the all-reduced array (data movement only)."""
  full = jaxapi.all_gather_invariant(mine, axes, tiled=True)
  return full[:math.prod(shape)].reshape(shape)


def chunked(x, n: int, offsets: Callable | None = None):
  """Flat ``x`` padded with zeros to ``n`` equal chunks: ``[n, c]`` and the true size.

  With ``offsets`` (:func:`opaque`), the chunks are copied out at run-time offsets and stacked,
  so that an all-to-all of them (which XLA splits into one copy per chunk) compiles one kernel
  for all n copies instead of n."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  c = chunk_len(size, n)
  flat = jnp.pad(flat, (0, n * c - size))
  return rows(flat, n, c, offsets), size


def rows(flat, n: int, c: int, offsets: Callable | None = None):
  """``[..., n * c]`` -> ``[n, ..., c]``: chunk j of the last axis (see :func:`chunked`)."""
  if offsets is None or n == 1:
    return jnp.moveaxis(flat.reshape(flat.shape[:-1] + (n, c)), -2, 0)
  starts = offsets(tuple(j * c for j in range(n)))
  return jnp.stack([lax.dynamic_slice_in_dim(flat, s, c, axis=flat.ndim - 1,
                                             allow_negative_indices=False) for s in starts])


def take(chunks, i):
  return lax.dynamic_index_in_dim(chunks, i, axis=0, keepdims=False)


def keyed(fn: Callable) -> Callable:
  """Wraps an ``all_reduce(x, call, finish)`` so float max/min run on order keys."""
  def wrapped(x, call: Call, finish: Callable):
    if call.op in ("max", "min") and uses_keys(x.dtype):
      kcall = dataclasses.replace(call, dtype=_INT_OF[jnp.dtype(x.dtype).itemsize])
      return finish(from_key(fn(to_key(x, call.op), kcall, lambda y: y), x.dtype))
    return fn(x, call, finish)
  return wrapped


def keyed_scatter(fn: Callable) -> Callable:
  """Wraps a ``reduce_scatter(blocks, call)`` so float max/min run on order keys."""
  def wrapped(blocks, call: Call):
    if call.op in ("max", "min") and uses_keys(blocks.dtype):
      kcall = dataclasses.replace(call, dtype=_INT_OF[jnp.dtype(blocks.dtype).itemsize])
      return from_key(fn(to_key(blocks, call.op), kcall), blocks.dtype)
    return fn(blocks, call)
  return wrapped


def scatter_then_gather(reduce_chunks: Callable, *,
                        opaque_steps: bool = False) -> tuple[Callable, Callable]:
  """``(all_reduce, reduce_scatter)`` of an algorithm whose core ``reduce_chunks(chunks[n, c],
  axes, op)`` leaves on rank i the reduction of every rank's chunk i, in the algorithm's order.

  The all-reduce pads ``x`` to n chunks, reduces them and ends with XLA's all-gather: data
  movement only (the bits are fixed by the reduction), typed invariant as lax.psum's result.
  ``opaque_steps``: ``reduce_chunks`` also takes ``opaque=`` (:func:`opaque_of` the call) to
  read its step numbers at run time, and reads every chunk at a run-time index (``take``): the
  chunks are then a reshape of the padded buffer, not copies of it stacked (``rows``), which
  spares XLA:CPU the stack's kernel (ring: 7 -> 6 kernels for a 60-leaf bucket)."""
  def core(chunks, call: Call):
    if opaque_steps:
      return reduce_chunks(chunks, call.axes, call.op, opaque=opaque_of(call))
    return reduce_chunks(chunks, call.axes, call.op)

  @keyed
  def all_reduce(x, call: Call, finish: Callable):
    # chunks copied out at opaque offsets where a collective takes them as operands (XLA
    # splits an all-to-all into one copy per chunk); a plain reshape for a core that
    # indexes them at run time
    chunks, _ = chunked(x, call.world, None if opaque_steps else opaque_of(call))
    return gather_flat(finish(core(chunks, call)), call.axes, x.shape)

  @keyed_scatter
  def reduce_scatter(blocks, call: Call):
    flat = blocks.reshape(blocks.shape[0], -1)
    return core(flat, call).reshape(blocks.shape[1:])

  return all_reduce, reduce_scatter
