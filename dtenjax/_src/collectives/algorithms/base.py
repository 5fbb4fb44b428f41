"""What every algorithm record is made of: the :class:`Call` it is asked about, the
:class:`Algorithm` record itself, and the building blocks the XLA-native algorithms share.

A record answers three questions about a call: can you run it (``supports``), what would it cost
(``cost``: its own formulas, a ``planning/costmodel.py`` :class:`~costmodel.Cost` written in that
module's terms), and how (``all_reduce`` / ``reduce_scatter`` / ``reproducible``). ``registry.py``
lists the records; ``algorithm="auto"`` and the planner rank only the ones whose ``supports``
returns None, so neither can pick one that would raise.
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
from dtenjax._src.contract import Contract
from dtenjax._src.planning import costmodel

AxisName = str | tuple[str, ...]
OPS = ("sum", "mean", "max", "min")
# The ops whose result is a sum (mean: the sum divided by the count): they accumulate in float32
# for 16-bit floats, and the reproducible contracts apply to them only.
SUMS = frozenset(("sum", "mean"))
KINDS = ("all_reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Call:
  """Everything an algorithm may depend on to accept or cost one collective (static values).

  Attributes:
    kind: "all_reduce" or "reduce_scatter".
    op: "sum", "mean", "max" or "min".
    dtype: element type of the data.
    axes: the named axes reduced over, in order (their product is the group).
    axis_sizes: size of each axis.
    nbytes: bytes per participant (reduce_scatter: the full, unscattered input).
    backend: platform of the devices ("cpu", "gpu", "tpu").
    deterministic: the caller needs a fixed reduction order.
    contract: the reproducible sum that runs (``collectives/reproducible.py``), a
      :class:`~dtenjax._src.contract.Contract` parsed from the public ``reproducible=``;
      NONE unless ``op`` is one of :data:`SUMS`.
    contributions: contributions stacked on each device (``local_axis``), 1 otherwise.
    mesh_axes: every axis is a manual mesh axis (shard_map / mesh_map), not a vmap axis.
    processes: processes the group spans (1: every participant is in this process).
    xla_reaches_processes: XLA's own collectives work across those processes here.
    requested: the ``algorithm=`` the caller passed ("auto", a family or a record name).
    nvls: NCCL may use NVLink SHARP (from ``Topology.nvls`` when planning; None reads
      NCCL_NVLS_ENABLE).
    tag: the caller's ``tag=`` (None, an int or a str): the host transport compares it on every
      rank (``net/callsite.tag_value``); no choice or cost depends on it.
  """
  kind: str
  op: str
  dtype: Any
  axes: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  nbytes: int
  backend: str = "cpu"
  deterministic: bool = True
  contract: Contract = Contract.NONE
  contributions: int = 1
  mesh_axes: bool = True
  processes: int = 1
  xla_reaches_processes: bool = True
  requested: str = "auto"
  tag: int | str | None = dataclasses.field(default=None, compare=False)
  # NVLink SHARP in use (GPU): the Topology's ``nvls`` when the planner asks; None: the process
  # environment (NCCL_NVLS_ENABLE) at trace time
  nvls: bool | None = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if not isinstance(self.contract, Contract):
      raise TypeError(f"Call.contract must be a Contract (contract.parse), got {self.contract!r}")
    if self.contract.reproducible and self.op not in SUMS:
      raise ValueError(f"Call: contract {self.contract.value} with op={self.op!r}; the "
                       "reproducible contracts apply to sums only")

  @property
  def reproducible(self) -> bool:
    """Whether a reproducible fixed-point sum runs (``contract`` is not NONE)."""
    return self.contract.reproducible

  @property
  def world(self) -> int:
    return math.prod(self.axis_sizes)

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def exact(self) -> bool:
    """Whether every order of reduction gives the same bits (integer sums, max and min)."""
    return self.op not in SUMS or not jnp.issubdtype(self.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """One collective algorithm.

  Attributes:
    name: registry key; ``algorithm=name`` forces this record.
    family: the public algorithm it implements (one of ``registry.FAMILIES``);
      ``algorithm=family`` takes the first record of the family (registry order) that supports
      the call.
    order: the reduction order it guarantees, in words (docs and ``explain``).
    cost: its cost formulas (all-reduce, reduce-scatter, reproducible sum), written in the terms
      of ``planning/costmodel.py``.
    supports: ``call -> None`` when it can run the call, else the reason it cannot.
    all_reduce: ``(x, call, finish) -> result``; ``finish`` maps the accumulated value (the
      accumulation dtype, see :func:`acc_dtype`) to the result (mean division, final cast).
    reduce_scatter: ``(blocks, call) -> owned block`` in the accumulation dtype, where
      ``blocks`` is ``[n, ...]`` and rank r owns block r; None when the algorithm has none.
    reproducible: ``(stack, call) -> result`` for reproducible sums of ``stack`` (``[k, ...]``
      local contributions, ``call.contract``); None uses the generic word exchange
      (``collectives/reproducible.py``) with this record's integer all-reduce for the words.
    code_max: ``(codes, call) -> reduced codes`` for that composition; None uses ``lax.pmax``.
    applies: whether the record is relevant to the call at all (its backend, a process span);
      a family passes silently over records that do not apply and logs once when it passes
      over one that does but cannot run the call.
  """
  name: str
  family: str
  order: str
  cost: costmodel.Cost
  supports: Callable[[Call], str | None]
  all_reduce: Callable[..., Any]
  reduce_scatter: Callable[..., Any] | None = None
  reproducible: Callable[..., Any] | None = None
  code_max: Callable[..., Any] | None = None
  applies: Callable[[Call], bool] = lambda call: True

  def why_not(self, call: Call) -> str | None:
    """None when this record can run ``call``; otherwise the reason (kind checks included)."""
    if call.kind == "reduce_scatter" and self.reduce_scatter is None:
      return (f"{self.name} has no reduce_scatter; use algorithm='auto', 'two_shot' or "
              "'ring'")
    return self.supports(call)

  def time(self, call: Call, group, topology, costs: costmodel.BackendCosts | None = None) -> float:
    """The cost model's seconds for this record running ``call`` over the device ids ``group``."""
    return costmodel.collective_time(
        call.kind, int(call.nbytes), list(group), topology, self.cost,
        reproducible=call.contract,
        itemsize=call.itemsize, contributions=call.contributions, costs=costs)


# --- shared building blocks ---------------------------------------------------------------------

def axis_size(axis_name: AxisName) -> int:
  """Static size of the (possibly combined) named axis."""
  return int(lax.axis_size(jaxapi.axis_tuple(axis_name)))


def acc_dtype(dtype, op: str):
  """Accumulation dtype: float32 for sums of 16-bit floats, the input dtype otherwise."""
  dtype = jnp.dtype(dtype)
  if op in SUMS and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return jnp.dtype(jnp.float32)
  return dtype


def xla_reaches(call: Call) -> str | None:
  """None when XLA's own collectives connect the call's processes, else why not."""
  if call.processes > 1 and not call.xla_reaches_processes:
    return (f"the axes span {call.processes} processes and XLA's {call.backend} collectives do "
            "not reach across processes here (set jax_cpu_collectives_implementation='gloo' "
            "before jax.distributed.initialize, or use the host transport: "
            "algorithm='ring'/'hierarchical')")
  return None


# Order keys: a float's bits mapped to a signed integer whose order is the float's total order
# (-NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN). MAX/MIN of keys is exact and order-free, and
# with NaN made +NaN for max (-NaN for min) any NaN wins, so every algorithm propagates NaN and
# gives the same bits (XLA's pmax/pmin drop NaN on CPU, gloo and NCCL: see docs/collectives.md).
_INT_OF = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def uses_keys(dtype) -> bool:
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


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


def chunked(x, n: int, offsets: Callable | None = None):
  """Flat ``x`` padded with zeros to ``n`` equal chunks: ``[n, c]`` and the true size.

  With ``offsets`` (:func:`opaque`), the chunks are copied out at run-time offsets and stacked,
  so that an all-to-all of them (which XLA splits into one copy per chunk) compiles one kernel
  for all n copies instead of n."""
  flat = x.reshape(-1)
  size = flat.shape[0]
  c = -(-size // n) if size else 1
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
  read its step numbers at run time."""
  def core(chunks, call: Call):
    if opaque_steps:
      return reduce_chunks(chunks, call.axes, call.op, opaque=opaque_of(call))
    return reduce_chunks(chunks, call.axes, call.op)

  @keyed
  def all_reduce(x, call: Call, finish: Callable):
    chunks, size = chunked(x, call.world, opaque_of(call))
    mine = finish(core(chunks, call))
    full = jaxapi.all_gather_invariant(mine, call.axes, tiled=True)
    return full[:size].reshape(x.shape)

  @keyed_scatter
  def reduce_scatter(blocks, call: Call):
    flat = blocks.reshape(blocks.shape[0], -1)
    return core(flat, call).reshape(blocks.shape[1:])

  return all_reduce, reduce_scatter
