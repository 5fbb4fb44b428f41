"""The decision engine: picks a sharding strategy per tensor with an alpha-beta cost model.

A tensor of shape ``[..., m, n]`` is treated as the weight of ``Y = X @ W`` in a training step
(:class:`Workload`: tokens per step, micro-batches, how much of the gradient synchronisation hides
behind the backward pass). On a mesh ``(outer, inner)`` -- ``inner`` on the fastest links, as
:func:`dtenjax.topology_mesh` lays it out -- the candidates are:

==========  ==================  ===========================================================
replicate   ``P()``             data parallel everywhere: one gradient all-reduce of W per step
row         ``P(inner, None)``  rows over the fast axis (tensor parallel inside the island),
                                data parallel across ``outer`` with the gradients of the shard
                                accumulated over micro-batches and all-reduced once per step
col         ``P(None, inner)``  the same with columns
2d          ``P(outer, inner)`` tensor parallel over both axes: activation all-reduces on both
                                axes every micro-batch, no gradient all-reduce
==========  ==================  ===========================================================

Estimated step time = compute (the same for every candidate) + blocking activation collectives +
the exposed part of gradient synchronisation. Candidates within ``time_tolerance`` of the fastest
are equivalent; among them the one with the least memory per device wins, then the fixed order
``2d, row, col, replicate``. Infeasible candidates (a dimension not divisible by its axis, more
memory than the device has) are kept in the report with the reason.

With the defaults this reproduces the seed's reference table: on one 8 x A100 NVLink node a
4096 x 4096 weight goes 2D over a 2 x 4 mesh; on 4 x 8 A100 over RoCE v2 it goes 1D row-wise with
cross-node gradient accumulation (``tests/test_planner.py`` pins both). A gradient's all-reduce
is priced as ``dtenjax.all_reduce(algorithm="auto")`` runs it; a sharded product's partial
activations are all-reduced by XLA's partitioner (the arrays are laid out by ``NamedSharding``)
and priced as XLA's own collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Callable, Sequence

import numpy as np
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src import tables
from dtenjax._src.pricing import calls, registry
from dtenjax._src.topology.model import Topology

STRATEGIES = ("2d", "row", "col", "replicate")     # also the tie-break order

# How the planner prices one all-reduce: ``(nbytes, group, axis_sizes, topology, dtype) ->
# seconds`` of the cheapest algorithm that can run a sum of ``nbytes`` of ``dtype`` per participant
# over the device ids ``group`` (rank order) split into mesh axes of ``axis_sizes``. The default
# is the pricing layer's (``pricing.registry.all_reduce_time``: the records ``algorithm="auto"``
# ranks), which planning imports from below; nothing installs it.
AllReduceTime = Callable[[int, tuple[int, ...], tuple[int, ...], Topology, str], float]


@dataclasses.dataclass(frozen=True)
class Workload:
  """What a tensor is used for, as far as the planner needs to know.

  Attributes:
    tokens: rows of the activation multiplied by the weight in one training step (global).
    microbatches: gradient-accumulation steps per training step.
    grad_overlap: fraction of gradient synchronisation hidden behind backward compute (0..1).
    state_factor: bytes kept per parameter byte (param + grad + two Adam moments = 4).
    time_tolerance: relative step-time difference under which candidates count as equal.
  """
  tokens: int = 4096
  microbatches: int = 1
  grad_overlap: float = 0.5
  state_factor: float = 4.0
  time_tolerance: float = 0.2

  def __post_init__(self):
    problems = []
    if self.tokens < 1:
      problems.append(f"tokens={self.tokens} must be >= 1")
    if self.microbatches < 1:
      problems.append(f"microbatches={self.microbatches} must be >= 1")
    if not 0.0 <= self.grad_overlap <= 1.0:
      problems.append(f"grad_overlap={self.grad_overlap} must be in [0, 1]")
    if self.state_factor <= 0:
      problems.append(f"state_factor={self.state_factor} must be > 0")
    if self.time_tolerance < 0:
      problems.append(f"time_tolerance={self.time_tolerance} must be >= 0")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("invalid Workload:", problems))


@dataclasses.dataclass(frozen=True)
class CandidateCost:
  strategy: str
  spec: P
  time_s: float          # estimated step time attributable to this tensor
  comm_s: float
  compute_s: float
  memory_bytes: float    # per device
  feasible: bool
  note: str = ""


@dataclasses.dataclass(frozen=True)
class ArrayPlan:
  """The planner's answer for one tensor: the strategy, its spec, and every candidate's cost."""
  shape: tuple[int, ...]
  dtype: str
  strategy: str
  spec: P
  candidates: tuple[CandidateCost, ...]
  reason: str

  def table(self) -> str:
    """Every candidate's cost (``*`` marks the chosen one; ``-``: it does not fit), then the
    choice and why."""
    rows = [(("*" if c.strategy == self.strategy else " ") + c.strategy, str(c.spec),
             f"{c.time_s * 1e6:.1f}" if c.feasible else None,
             f"{c.comm_s * 1e6:.1f}" if c.feasible else None,
             f"{c.memory_bytes / 2**20:.2f}", c.note) for c in self.candidates]
    text = tables.render(["strategy", "spec", "time (us)", "comm (us)", "mem/dev (MiB)", "note"],
                         rows, align=["left"] * 2 + ["right"] * 3 + ["left"])
    return text + f"\n=> {self.strategy}: {self.reason}"


def _axes(mesh_shape: Sequence[int], axis_names: Sequence[str]):
  """(outer name, outer size, inner name, inner size); 1D meshes have no outer axis."""
  if len(mesh_shape) == 1:
    return None, 1, axis_names[0], mesh_shape[0]
  if len(mesh_shape) == 2:
    return axis_names[0], mesh_shape[0], axis_names[1], mesh_shape[1]
  raise errors.PlacementError(
      f"the planner handles 1D and 2D meshes, got mesh shape {tuple(mesh_shape)}; reshape the "
      "mesh (e.g. (hosts, devices_per_host)) or give an explicit PartitionSpec.")


def strategy_spec(strategy: str, ndim: int, outer: str | tuple[str, ...] | None,
                  inner: str) -> P | None:
  """The PartitionSpec of a named strategy for an array of ``ndim`` dimensions on a mesh whose
  fast (inner) axis is ``inner`` and whose other axes are ``outer`` (None on a 1D mesh); None
  when the strategy does not apply. Shared by the planner and fixed-strategy placements, so
  ``Placement("row")`` and an ``"auto"`` placement that picks ``"row"`` agree."""
  if strategy == "replicate":
    return P()
  if ndim == 0:
    return None
  if ndim == 1:
    return P(inner) if strategy == "row" else None
  pad = (None,) * (ndim - 2)
  if strategy == "row":
    return P(*pad, inner, None)
  if strategy == "col":
    return P(*pad, None, inner)
  if strategy == "2d":
    return P(*pad, outer, inner) if outer is not None else None
  raise errors.PlacementError(f"unknown strategy {strategy!r}; use one of {STRATEGIES}")


class _Groups:
  """Device-id groups of a mesh laid out by rows: inner = one row, outer = one column."""

  def __init__(self, device_ids: np.ndarray):
    self.ids = device_ids if device_ids.ndim == 2 else device_ids.reshape(1, -1)
    self.inner = tuple(int(i) for i in self.ids[0])
    self.outer = tuple(int(i) for i in self.ids[:, 0])
    self.all = tuple(int(i) for i in self.ids.ravel())


@functools.lru_cache(maxsize=65536)
def _allreduce_s(nbytes: int, group: tuple[int, ...], axis_sizes: tuple[int, ...],
                 topology: Topology, dtype: str, price: AllReduceTime) -> float:
  if len(group) <= 1 or nbytes <= 0:
    return 0.0
  return price(nbytes, group, axis_sizes, topology, dtype)


def plan_tensor(shape: Sequence[int], dtype, mesh_shape: Sequence[int], axis_names: Sequence[str],
                device_ids: np.ndarray, topology: Topology,
                workload: Workload = Workload(), *,
                all_reduce_time: AllReduceTime | None = None) -> ArrayPlan:
  """Costs every strategy for one tensor and picks one (see the module docstring).

  ``all_reduce_time`` prices the all-reduces (default: the gradients' by the pricing layer's
  ``pricing.registry.all_reduce_time``, the cheapest record whose ``supports`` accepts a sum of
  ``dtype``, as they go through ``dtenjax.all_reduce(algorithm="auto")``; the activations' of a
  sharded product by ``pricing.registry.xla_all_reduce_time``, the all-reduce XLA's partitioner
  inserts for the ``NamedSharding``, never a ``dtenjax.all_reduce``)."""
  price = all_reduce_time if all_reduce_time is not None else registry.all_reduce_time
  act_price = all_reduce_time if all_reduce_time is not None else registry.xla_all_reduce_time
  try:
    dims = tuple(operator.index(s) for s in shape)
  except TypeError:
    dims = None
  if dims is None or any(d < 0 for d in dims):
    raise errors.PlacementError(
        f"plan_tensor: shape={tuple(shape) if dims is None else dims!r} must be a tuple of "
        "non-negative ints (the array's shape, e.g. (4096, 4096))")
  return _plan_cached(tuple(int(s) for s in shape), np.dtype(dtype).name, tuple(mesh_shape),
                      tuple(axis_names), tuple(int(i) for i in np.asarray(device_ids).ravel()),
                      topology, workload, price, act_price)


@functools.lru_cache(maxsize=16384)
def _plan_cached(shape, dtype, mesh_shape, axis_names, device_ids, topology, workload,
                 price, act_price) -> ArrayPlan:
  itemsize = np.dtype(dtype).itemsize
  outer, a, inner, b = _axes(mesh_shape, axis_names)
  groups = _Groups(np.asarray(device_ids).reshape(mesh_shape))

  def allreduce_s(nbytes, group, axis_sizes):
    """A gradient's all-reduce (``dtenjax.all_reduce``)."""
    return _allreduce_s(int(nbytes), group, axis_sizes, topology, dtype, price)

  def activation_s(nbytes, group, axis_sizes):
    """A sharded product's partial activations, all-reduced by XLA: XLA:CPU runs a bfloat16
    collective in float32 (``calls.wire_bytes``); a GPU's NCCL sends the input's bytes."""
    if act_price is not price and group:
      nbytes = nbytes * calls.wire_bytes(dtype, topology.device(group[0]).platform)
    return _allreduce_s(int(nbytes), group, axis_sizes, topology, dtype, act_price)
  ndev = a * b
  if len(shape) >= 2:
    m, n = shape[-2], shape[-1]
    lead = math.prod(shape[:-2])
  elif len(shape) == 1:
    m, n, lead = shape[0], 1, 1
  else:
    m, n, lead = 1, 1, 1
  nbytes = lead * m * n * itemsize
  w = workload
  mb = w.microbatches
  flops = 6.0 * w.tokens * lead * m * n
  compute = flops / ndev / topology.peak_flops()
  state = nbytes * w.state_factor
  mem_limit = min((d.memory_bytes for d in topology.devices if d.memory_bytes), default=0)

  cands = []
  for strategy in STRATEGIES:
    spec = strategy_spec(strategy, len(shape), outer, inner)
    if spec is None:
      continue
    note = ""
    feasible = True
    if strategy == "replicate":
      comm = (1 - w.grad_overlap) * allreduce_s(nbytes, groups.all, tuple(mesh_shape))
      mem = state
    elif strategy in ("row", "col"):
      dim, size = (m, "rows") if strategy == "row" else (n, "columns")
      if dim % b:
        feasible, note = False, f"{size} ({dim}) not divisible by axis {inner!r} ({b})"
      act = int(w.tokens / (a * mb)) * (n if strategy == "row" else m) * itemsize * lead
      comm = (mb * activation_s(act, groups.inner, (b,)) +
              (1 - w.grad_overlap) * allreduce_s(nbytes // b, groups.outer, (a,)))
      mem = state / b
      if a > 1:
        note = note or f"grads accumulated over {mb} micro-batch(es), all-reduced across {outer!r}"
    else:  # 2d
      if m % a or n % b:
        feasible = False
        note = f"shape ({m}, {n}) not divisible by mesh ({a}, {b})"
      t_mb = int(w.tokens / mb)
      comm = mb * (activation_s(t_mb * (n // max(b, 1)) * itemsize * lead, groups.outer, (a,))
                   + activation_s(t_mb * (m // max(a, 1)) * itemsize * lead, groups.inner, (b,)))
      mem = state / (a * b)
    if feasible and mem_limit and mem > mem_limit:
      feasible, note = False, f"needs {mem / 2**30:.1f} GiB per device, has {mem_limit / 2**30:.1f}"
    cands.append(CandidateCost(strategy, spec, compute + comm, comm, compute, mem, feasible, note))

  feasible = [c for c in cands if c.feasible]
  if not feasible:
    replicate = next(c for c in cands if c.strategy == "replicate")
    return ArrayPlan(shape, dtype, "replicate", P(), tuple(cands),
                "no candidate fits: " + (replicate.note or "falling back to replication"))
  best = min(c.time_s for c in feasible)
  close = [c for c in feasible if c.time_s <= best * (1 + w.time_tolerance) + 1e-12]
  pick = min(close, key=lambda c: (c.memory_bytes, STRATEGIES.index(c.strategy)))
  fastest = min(feasible, key=lambda c: (c.time_s, STRATEGIES.index(c.strategy)))
  if pick is fastest:
    reason = f"fastest estimate ({pick.time_s * 1e6:.1f} us)"
  else:
    reason = (f"within {w.time_tolerance:.0%} of the fastest ({fastest.strategy}, "
              f"{fastest.time_s * 1e6:.1f} us) and uses the least memory per device "
              f"({pick.memory_bytes / 2**20:.1f} MiB)")
  if len(shape) >= 3:
    reason += (f"; a {len(shape)}-D array is costed as {lead} stacked ({m}, {n}) matrices with the "
               "leading dimensions unsharded (layers stacked by scan): for one weight with several "
               "input or output dimensions, such as a flax attention kernel (features, heads, "
               "head_dim), give it flax logical axis names (Placement(rules=...)) or a "
               "PartitionSpec")
  return ArrayPlan(shape, dtype, pick.strategy, pick.spec, tuple(cands), reason)
