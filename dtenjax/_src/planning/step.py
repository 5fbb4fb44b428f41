"""The whole-step planner: one layout for every array of a training step, a mesh for it, and the
memory it needs (``dtenjax.plan``; ``Placement("auto")`` with ``step=``).

What it reads. :func:`~dtenjax._src.planning.stepgraph.read_step` gives the step's weights with
the role of each dimension (contracted, free, stacked), the tensor-parallel pairs, the optimizer
state tied to each parameter, the flops and the activation bytes.

What it proposes. A mesh of up to three logical axes, outermost first: ``data`` (replicas),
``fsdp`` (parameters, gradients and optimizer state sharded, gathered for compute: ZeRO-3) and
``tensor`` (Megatron-style tensor parallelism: a column-parallel weight shards a free dimension,
a row-parallel one a contracted dimension; a column->row pair keeps the activation between them
sharded). Devices are ordered by the topology so that ``tensor`` stays inside an NVLink island,
``fsdp`` next, ``data`` outermost (across hosts). The batch is sharded over ``data`` and ``fsdp``.

How it prices. For every mesh, every tied group of state leaves gets candidate layouts
(replicate, FSDP on each divisible dimension it is worth, column/row tensor parallel on each free /
contracted dimension, and their products), each with its collectives per step:

* gradient synchronisation over the batch axes it is not sharded on (an all-reduce, or a
  reduce-scatter over ``fsdp`` then an all-reduce over ``data``), overlappable with the backward
  pass;
* FSDP all-gathers of the parameter, two per step (forward, and again for the backward),
  overlappable (prefetched);
* tensor-parallel activation collectives, blocking: a row-parallel product all-reduces its output
  (forward), a column-parallel one its input gradient (backward); an unpaired column-parallel
  output is all-gathered, and so is an unpaired row-parallel input gradient.

Collectives are priced as ``algorithm="auto"`` prices them (the algorithm registry, through
:func:`dtenjax._src.planning.planner.set_all_reduce_time`; all-gathers and reduce-scatters as XLA's
own ops), with the alpha and beta of the slowest link on that mesh axis: measured ones where
``Topology.probe`` measured the class, the topology's priors otherwise. Step time = compute (the
step's flops over all devices) + blocking collectives + the part of the overlappable ones that
does not fit in ``overlap`` x compute.

How it chooses. One mixed-integer program per mesh (scipy's ``milp``, HiGHS): one binary per
(group, candidate), pair variables, the exposed-time variable, and the memory constraint (per
device: parameters, gradients, optimizer state, activations and the batch at most the budget).
The cheapest mesh wins; ties go to less memory, then the fixed order of the mesh list. The
standard recipes (DP, FSDP, TP, FSDP x TP) are priced by the same function, and their
assignments are candidates of the same program, so the plan is never worse than the best recipe
that fits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import tables
from dtenjax._src.planning import boxes
from dtenjax._src.planning import costmodel
from dtenjax._src.planning import planner
from dtenjax._src.planning import stepgraph
from dtenjax._src.topology.model import INTRA_HOST, Topology

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
RECIPES = ("DP", "FSDP", "TP", "FSDP x TP")


# --- the mesh -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class AxisLink:
  """What one mesh axis runs over: the slowest link class between its members, where that lies
  (inside an NVLink island, inside a host, across hosts) and whether alpha/beta are measured."""
  name: str
  size: int
  link: str
  span: str
  source: str          # "measured" (Topology.probe) or "prior" (the topology's table)
  alpha_us: float
  bandwidth_gbps: float


@dataclasses.dataclass(frozen=True)
class _Mesh:
  shape: tuple[int, ...]             # (data, fsdp, tensor)
  ids: np.ndarray                    # device ids, shape `shape`
  topology: Topology

  @functools.cached_property
  def size(self) -> dict[str, int]:
    return dict(zip(AXES, self.shape))

  @functools.cached_property
  def peak_flops(self) -> float:
    return self.topology.peak_flops()

  def group(self, axes: Sequence[str]) -> tuple[int, ...]:
    """Device ids of the first group spanning ``axes`` (rank order)."""
    index = tuple(slice(None) if a in axes else 0 for a in AXES)
    return tuple(int(i) for i in self.ids[index].ravel())

  def axis_sizes(self, axes: Sequence[str]) -> tuple[int, ...]:
    return tuple(self.size[a] for a in AXES if a in axes)


def _span(link: str, topology: Topology) -> str:
  if link in ("nvswitch", "nvlink"):
    return "inside an NVLink island"
  if link == "shared_memory":
    return "inside one process's devices"
  if link in INTRA_HOST:
    return "inside a host"
  return "across hosts"


def _axis_links(m: _Mesh) -> tuple[AxisLink, ...]:
  out = []
  measured = set(getattr(m.topology, "measured", ()) or ())
  for a in AXES:
    if m.size[a] == 1:
      continue
    cls, spec = m.topology.slowest_link(m.group((a,)))
    out.append(AxisLink(a, m.size[a], cls, _span(cls, m.topology),
                        "measured" if cls in measured else "prior", spec.latency_us,
                        spec.bandwidth_gbps))
  return tuple(out)


def _divisors(n: int) -> list[int]:
  return [k for k in range(1, n + 1) if n % k == 0]


def _mesh_shapes(n: int, topology: Topology, ids: Sequence[int]) -> list[tuple[int, int, int]]:
  """The meshes worth pricing: tensor within the smallest fast island, fsdp over 1, the rest of a
  host, or everything; data the remainder."""
  island = min((len([i for i in isl if i in set(ids)]) for isl in topology.fast_islands()
                if any(i in set(ids) for i in isl)), default=1)
  hosts = [h for h in topology.hosts() if any(i in set(ids) for i in h)]
  per_host = min(len(h) for h in hosts) if hosts else n
  shapes = []
  for t in _divisors(math.gcd(island, n)):
    rest = n // t
    fs = {1, rest}
    if per_host % t == 0 and rest % (per_host // t) == 0:
      # HSDP: fsdp over the rest of one host, or of 2, 4, ... hosts (a model whose state does
      # not fit one host's devices), data parallel across those groups
      f = per_host // t
      while f < rest and rest % f == 0:
        fs.add(f)
        f *= 2
    for f in sorted(fs):
      shapes.append((rest // f, f, t))
  return sorted(set(shapes), key=lambda s: (s[2], s[1]))


# --- candidate layouts --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Layout:
  spec: tuple[Any, ...]              # per dimension: None, an axis name, or a tuple of names
  note: str

  def axes_of(self, dim: int) -> tuple[str, ...]:
    e = self.spec[dim]
    return () if e is None else (e if isinstance(e, tuple) else (e,))

  def used(self) -> dict[str, int]:
    """mesh axis -> the dimension it shards"""
    return {a: d for d in range(len(self.spec)) for a in self.axes_of(d)}


def _spec_entry(axes: Sequence[str]):
  axes = tuple(axes)
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _layout(shape, tp: tuple[str, int] | None, fsdp_dim: int | None, note: str) -> _Layout:
  entries: list[list[str]] = [[] for _ in shape]
  if fsdp_dim is not None:
    entries[fsdp_dim].append("fsdp")
  if tp is not None:
    entries[tp[1]].append("tensor")
  return _Layout(tuple(_spec_entry(e) for e in entries), note)


def _fsdp_dims(shape, m: _Mesh, exclude: int | None, use) -> list[int]:
  """The dimension FSDP shards: a contracted one first (the largest that divides), as MaxText's
  "embed" -> fsdp rule does; sharding a free dimension over the axis that also shards the batch
  makes XLA's partitioner move activations (all-to-all) instead of gathering the weight."""
  f = m.size["fsdp"]
  dims = [d for d in range(len(shape)) if d != exclude and shape[d] % f == 0 and shape[d] >= f]
  contracted = set(use.contracted) if use is not None else set()
  return sorted(dims, key=lambda d: (d not in contracted, -shape[d], d))[:1]


def _candidates(graph: stepgraph.StepGraph, group: tuple[int, ...], m: _Mesh,
                pinned: tuple[P, str] | None) -> list[_Layout]:
  leaf = graph.leaves[group[0]]
  shape = leaf.shape
  if pinned is not None:
    spec, why = pinned
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return [_Layout(entries, why)]
  use = graph.weights.get(group[0])
  t, f = m.size["tensor"], m.size["fsdp"]
  tps: list[tuple[str, int] | None] = [None]
  if use is not None and t > 1 and group[0] not in graph.gathered:
    tps += [("col", k) for k in use.free if shape[k] % t == 0]
    tps += [("row", k) for k in use.contracted if shape[k] % t == 0]
  if use is None and t > 1 and group[0] in graph.lookups:
    # vocab-parallel: a table only read by lookups, sharded over the dimension they index
    tps += [("vocab", k) for k in graph.lookups[group[0]][0] if shape[k] % t == 0]
  out = []
  for tp in tps:
    fdims: list[int | None] = [None]
    if f > 1 and len(shape) >= 1:
      fdims += _fsdp_dims(shape, m, tp[1] if tp else None, use)
    for fd in fdims:
      parts = []
      if tp and tp[0] == "vocab":
        parts.append(f"vocab-parallel over 'tensor' (dimension {tp[1]}, indexed by the lookup: "
                     "masked lookup, then an all-reduce of the rows)")
      elif tp:
        parts.append(f"{'column' if tp[0] == 'col' else 'row'}-parallel over 'tensor' "
                     f"(dimension {tp[1]}, {'free' if tp[0] == 'col' else 'contracted'})")
      if fd is not None:
        parts.append(f"FSDP: dimension {fd} over 'fsdp'")
      out.append(_layout(shape, tp, fd, ", ".join(parts) or "replicated"))
  return out


# --- pricing ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Price:
  """A candidate's per-step collectives and memory, by mesh axes."""
  blocking: dict[str, float] = dataclasses.field(default_factory=dict)
  overlappable: dict[str, float] = dataclasses.field(default_factory=dict)
  bytes: dict[str, float] = dataclasses.field(default_factory=dict)      # collective -> bytes
  memory: dict[str, float] = dataclasses.field(default_factory=dict)
  ag_fwd: float = 0.0          # an unpaired column-parallel output's all-gather (s), and bytes
  ag_fwd_bytes: float = 0.0
  ag_bwd: float = 0.0          # an unpaired row-parallel input gradient's all-gather
  ag_bwd_bytes: float = 0.0
  tp: tuple[str, int] | None = None
  compute: float = 0.0         # seconds of the products it takes part in, per device
  act_saving: float = 0.0      # activation bytes per device a complete column->row pair shards
  # bytes of this weight gathered at once when its gathered copy is not kept between the forward
  # and the backward (a rematerialised read: one layer of a scanned stack); the step's peak is the
  # largest of these, not their sum
  gathered_peak: float = 0.0


def _acc(where: dict[str, float], key: str, value: float) -> None:
  where[key] = where.get(key, 0.0) + value


class _Pricer:
  """Collective times on one mesh, cached by (kind, bytes, axes)."""

  def __init__(self, m: _Mesh, price: planner.AllReduceTime):
    self.m, self.price = m, price
    self.cache: dict[tuple, float] = {}
    first = int(m.ids.ravel()[0])
    self.backend = m.topology.device(first).platform
    bw = costmodel.backend_costs(self.backend).local_bandwidth_gbps
    # seconds per byte of a local elementwise pass (the optimizer's update)
    self.local_s_per_byte = (m.topology.spec("local").beta if bw is None else 1.0 / (bw * 1e9))

  def __call__(self, kind: str, nbytes: float, axes: Sequence[str], dtype: str) -> float:
    axes = tuple(a for a in AXES if a in axes and self.m.size[a] > 1)
    if not axes or nbytes <= 0:
      return 0.0
    key = (kind, int(nbytes), axes, dtype)
    if key not in self.cache:
      group = self.m.group(axes)
      if kind == "all_reduce":
        t = self.price(int(nbytes), group, self.m.axis_sizes(axes), self.m.topology, dtype)
      else:
        t = costmodel.collective_time(kind, int(nbytes), group, self.m.topology)
      self.cache[key] = t
    return self.cache[key]


def _axis_key(axes: Sequence[str]) -> str:
  return "+".join(a for a in AXES if a in axes)


def _price(graph: stepgraph.StepGraph, group: tuple[int, ...], lay: _Layout, m: _Mesh,
           pricer: _Pricer, batch_div: int, donate: bool) -> _Price:
  leaves = [graph.leaves[i] for i in group]
  primary = leaves[0]
  shape = primary.shape
  used = lay.used()
  shards = math.prod(m.size[a] for a in used)
  t_shard = m.size["tensor"] if "tensor" in used else 1
  zero = [a for a in BATCH_AXES if a in used and m.size[a] > 1]
  batch = [a for a in BATCH_AXES if m.size[a] > 1]
  pr = _Price()
  dtype = primary.dtype
  use = graph.weights.get(primary.index)
  grad = primary.nbytes / t_shard
  # a leaf both looked up (gather) and multiplied (tied embeddings) has two gradient parts,
  # which XLA synchronises separately before adding them (seen on XLA:CPU)
  parts = 2 if (use is not None and primary.index in graph.gathered) else 1
  # gradient synchronisation
  if batch:
    if zero:
      k = _axis_key(zero)
      # XLA:CPU lowers a reduce-scatter as an all-reduce of the whole gradient followed by a
      # slice; the GPU compiler keeps the reduce-scatter: price what the plan's backend runs
      rs = "all_reduce" if pricer.backend == "cpu" else "reduce_scatter"
      _acc(pr.overlappable, k, pricer(rs, grad, zero, dtype))
      _acc(pr.bytes, f"{rs}[{k}]", grad)
      rest = [a for a in batch if a not in zero]
      if rest:
        g2 = grad / math.prod(m.size[a] for a in zero)
        k2 = _axis_key(rest)
        _acc(pr.overlappable, k2, pricer("all_reduce", g2, rest, dtype) -
               pricer("all_reduce", 1, rest, dtype))
        _acc(pr.bytes, f"all_reduce[{k2}]", g2)
    else:
      # XLA combines the gradients' all-reduces into few large ones: each leaf adds its bytes'
      # share, and the problem adds one latency (_problem)
      k = _axis_key(batch)
      _acc(pr.overlappable, k, parts * (pricer("all_reduce", grad, batch, dtype) -
                                          pricer("all_reduce", 1, batch, dtype)))
      _acc(pr.bytes, f"all_reduce[{k}]", parts * grad)
  # FSDP: the parameter gathered for the forward; XLA keeps the gathered copy for the backward
  # (one all-gather per step, the copy live in between)
  # a table only read by lookups, sharded over the dimension they index (vocab-parallel): each
  # device looks up the rows it holds (the others masked to zero) and the rows are all-reduced
  # over the axes sharding the table, for every token of the batch those axes do not split;
  # nothing is gathered and the gradient is a local scatter into the shard
  lookup = graph.lookups.get(primary.index) if use is None else None
  vocab_axes = ([a for a in used if m.size[a] > 1 and used[a] in lookup[0]]
                if lookup is not None else [])
  if vocab_axes:
    k = _axis_key(vocab_axes)
    unsplit = math.prod(m.size[a] for a in batch if a not in vocab_axes)
    nb = lookup[1] / unsplit
    _acc(pr.blocking, k, pricer("all_reduce", nb, vocab_axes, dtype))
    _acc(pr.bytes, f"all_reduce[{k}]", nb)
  if zero and not vocab_axes:
    k = _axis_key(zero)
    # gathered before its product; a read inside jax.checkpoint is gathered again for the
    # backward (the recomputed forward), and the gathered copy is not kept in between: only the
    # slice being used (one layer of a scanned stack) is live. Otherwise XLA keeps the gathered
    # weight for the backward.
    remat = use is not None and use.remat
    times = 2 if remat else 1
    _acc(pr.overlappable, k, times * pricer("all_gather", grad, zero, dtype))
    _acc(pr.bytes, f"all_gather[{k}]", times * grad)
    if remat:
      pr.gathered_peak = grad / max(1, use.layers)
    else:
      pr.memory["gathered"] = grad
  # tensor parallelism
  if "tensor" in used and use is not None and m.size["tensor"] > 1:
    d = used["tensor"]
    tokens = use.tokens * use.repeats / batch_div
    item = use.act_itemsize
    width_in = math.prod(shape[k] for k in use.contracted)
    width_out = math.prod(shape[k] for k in use.free)
    if d in use.free:
      pr.tp = ("col", d)
      share = graph.act_share.get((primary.index, d), 0.0)
      pr.act_saving = (share * graph.activation_bytes / batch_div *
                       (1 - 1 / m.size["tensor"]))
      if use.input_grad:     # the input's gradient is a partial sum over 'tensor'
        nb = tokens * width_in * item
        _acc(pr.blocking, "tensor", pricer("all_reduce", nb, ("tensor",), dtype))
        _acc(pr.bytes, "all_reduce[tensor]", nb)
      pr.ag_fwd_bytes = tokens * width_out * item
      pr.ag_fwd = pricer("all_gather", pr.ag_fwd_bytes, ("tensor",), dtype)
    elif d in use.contracted:
      pr.tp = ("row", d)
      nb = tokens * width_out * item
      _acc(pr.blocking, "tensor", pricer("all_reduce", nb, ("tensor",), dtype))
      _acc(pr.bytes, "all_reduce[tensor]", nb)
      if use.input_grad:
        pr.ag_bwd_bytes = tokens * width_in * item
        pr.ag_bwd = pricer("all_gather", pr.ag_bwd_bytes, ("tensor",), dtype)
  elif "tensor" in used and not vocab_axes:
    # a stacked dimension over 'tensor': gathered like FSDP
    _acc(pr.overlappable, "tensor", 2 * pricer("all_gather", grad * t_shard, ("tensor",),
                                                  dtype))
    _acc(pr.bytes, "all_gather[tensor]", 2 * grad * t_shard)
  if use is not None:
    split = m.size["tensor"] if pr.tp is not None else 1
    flops = use.flops / split
    for (leaf, k), f in graph.carried.items():
      if leaf == primary.index:
        flops += f / (m.size["tensor"] if pr.tp == ("col", k) else 1)
    pr.compute = flops / batch_div / m.peak_flops
  # the optimizer's update reads the parameter, its gradient and its moments and writes the
  # parameter and moments: each device updates its shard only (the work FSDP saves beside memory)
  update_bytes = (2 * sum(lf.nbytes for lf in leaves) + primary.nbytes) / shards
  pr.compute += update_bytes * pricer.local_s_per_byte
  # memory per device
  pr.memory["params"] = primary.nbytes / shards
  # A gradient is a temporary: whole before its reduction where the weight is gathered for
  # compute, sharded as the parameter otherwise. A scanned stack's gradient is accumulated layer
  # by layer into one stacked buffer, which without donation is the new state's output buffer
  # (the optimizer's update is elementwise and in place): no memory of its own (measured on
  # XLA:CPU); with donation the outputs alias the inputs and it is a temporary again.
  gathered_weight = zero and not vocab_axes and (use is not None or
                                                 primary.index in graph.gathered)
  scanned = use is not None and use.layers > 1
  if scanned:
    pr.memory["grads"] = primary.nbytes / shards if donate else 0.0
  else:
    pr.memory["grads"] = grad if gathered_weight else primary.nbytes / shards
  pr.memory["opt_state"] = sum(lf.nbytes for lf in leaves[1:]) / shards
  pr.memory["outputs"] = 0.0 if donate else sum(lf.nbytes for lf in leaves) / shards
  return pr


# --- the plan -----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LeafPlan:
  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: P
  reason: str


@dataclasses.dataclass(frozen=True)
class StepCost:
  """Predicted per step and per device."""
  compute_s: float
  comm_s: dict[str, float]          # per mesh axis (or axes), blocking + overlappable
  exposed_s: float                  # the communication not hidden behind compute
  memory: dict[str, float]          # params, grads, opt_state, activations, batch, total
  collective_bytes: dict[str, float]   # "kind[axes]" -> bytes per participant (explain's count)
  fits: bool

  @property
  def total_s(self) -> float:
    return self.compute_s + self.exposed_s

  @property
  def comm_total_s(self) -> float:
    return sum(self.comm_s.values())


@dataclasses.dataclass(frozen=True)
class Alternative:
  """A standard recipe (or another mesh) priced by the same model."""
  name: str
  mesh_shape: dict[str, int]
  cost: StepCost | None
  note: str = ""


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The planner's answer for a whole step (see the module docstring).

  ``specs`` holds one PartitionSpec per argument leaf, in the arguments' tree structure;
  :meth:`shardings` turns them into NamedShardings on :meth:`mesh`, and :meth:`shard` places
  arguments with them. ``table()`` (or ``str(plan)``) is the report."""
  axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  device_ids: tuple[int, ...]
  axes: tuple[AxisLink, ...]
  leaves: tuple[LeafPlan, ...]
  specs: tuple[Any, ...]
  cost: StepCost
  recipes: tuple[Alternative, ...]
  budget_bytes: float
  topology: str
  planning_s: float
  meshes_tried: int
  notes: tuple[str, ...] = ()
  out_specs: Any = None          # PartitionSpecs of the step's outputs (state outputs like state)
  # per argument: None, or a tree holding, for each FSDP-sharded weight, its layout for compute
  # (the spec without the batch axes) and None for every other leaf
  compute_specs: tuple[Any, ...] = ()
  donate: bool = False           # planned for a step whose state arguments are donated
  nvls: bool = False             # the topology's NVLink SHARP state the plan was priced with
  batch_argnums: tuple[int, ...] = ()

  # --- applying it -----------------------------------------------------------------------------

  def mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
    """The planned mesh over ``devices`` (default ``jax.devices()``, every process's), in the
    planned device order."""
    devices = list(jax.devices() if devices is None else devices)
    by_id = {d.id: d for d in devices}
    missing = [i for i in self.device_ids if i not in by_id]
    if missing:
      raise errors.MeshError(
          f"the plan was made for devices {list(self.device_ids)[:8]}... of topology "
          f"{self.topology!r}; devices {missing[:8]} are not among the {len(devices)} present. "
          "Plan with the topology of the devices you run on (topology=None), or run where the "
          "planned devices exist.")
    arr = np.asarray([by_id[i] for i in self.device_ids], dtype=object)
    return Mesh(arr.reshape(self.mesh_shape), self.axis_names)

  def shardings(self, devices: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """One NamedSharding per argument leaf, in the arguments' structure."""
    mesh = self.mesh(devices)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                        is_leaf=lambda s: isinstance(s, P))

  def out_shardings(self, devices: Sequence[Any] | None = None) -> Any:
    """NamedShardings for the step's outputs: new state laid out as the state, the rest
    replicated (pass as ``jax.jit(step, out_shardings=...)``)."""
    mesh = self.mesh(devices)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.out_specs,
                        is_leaf=lambda s: isinstance(s, P))

  def jit(self, step: Callable, **jit_kwargs):
    """``jax.jit(step)`` with this plan's input and output shardings, and its FSDP parameters
    gathered for compute.

    FSDP lays a parameter out sharded over ``fsdp``; the products need it whole. The returned
    function constrains each FSDP-sharded weight to its gathered layout
    (:attr:`compute_specs`) before calling ``step``, as FSDP does, so XLA all-gathers the
    weight (and reduce-scatters its gradient) instead of moving the activations: without the
    constraint XLA's partitioner, seeing the batch and the weight sharded over the same axis,
    often picks all-to-alls of activations and all-reduces of partial products (measured:
    10x the bytes on a GPT-2 step; docs/benchmarks.md). Values are unchanged."""
    mesh = self.mesh()

    def gather(x, spec):
      return x if spec is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    def planned(*args):
      args = tuple(jax.tree.map(gather, a, c, is_leaf=lambda v: v is None)
                   if c is not None else a for a, c in zip(args, self.compute_specs))
      return step(*args)
    planned.__name__ = getattr(step, "__name__", "step")
    planned.__wrapped__ = step
    return jax.jit(planned, in_shardings=self.shardings(), out_shardings=self.out_shardings(),
                   **jit_kwargs)

  def check(self, step: Callable, *args) -> "Check":
    """Compiles ``step`` with this plan's shardings (abstract arguments are fine: nothing runs)
    and compares the prediction with what XLA compiled: per-device memory
    (``memory_analysis()``) and collective bytes (read from the compiled HLO as
    :func:`dtenjax.explain` reads them)."""
    return _check(self, step, args)

  def shard(self, *args):
    """Places ``args`` (the step's arguments, as planned) with :meth:`shardings`."""
    if len(args) != len(self.specs):
      raise errors.PlacementError(
          f"StepPlan.shard: the plan has {len(self.specs)} arguments, got {len(args)}; pass the "
          "step's arguments in the order they were planned")
    out = tuple(jax.device_put(a, s) for a, s in zip(args, self.shardings()))
    return out if len(out) > 1 else out[0]

  # --- reading it ------------------------------------------------------------------------------

  def table(self) -> str:
    gib = 2**30
    lines = [f"mesh {dict(zip(self.axis_names, self.mesh_shape))} on {self.topology} "
             f"({len(self.device_ids)} devices, NVLink SHARP {'on' if self.nvls else 'off'}), "
             f"planned in {self.planning_s * 1e3:.0f} ms over {self.meshes_tried} meshes"]
    for a in self.axes:
      lines.append(f"  axis {a.name!r} x{a.size}: {a.link} {a.span}, alpha {a.alpha_us:.1f} us, "
                   f"{a.bandwidth_gbps:.1f} GB/s ({a.source})")
    c = self.cost
    lines.append(f"step time {c.total_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + "
                 f"exposed communication {c.exposed_s * 1e3:.3f} ms")
    for k, v in c.comm_s.items():
      lines.append(f"  communication over {k}: {v * 1e3:.3f} ms")
    mem = ", ".join(f"{k} {v / gib:.3f}" for k, v in c.memory.items())
    budget = f"{self.budget_bytes / gib:.1f} GiB" if self.budget_bytes else "unknown"
    lines.append(f"memory per device (GiB): {mem} (budget {budget})")
    lines.append("")
    lines.append(f"{'recipe':<12} {'mesh':<34} {'step (ms)':>10} {'exposed':>9} "
                 f"{'mem (GiB)':>10}  note")
    rows = [Alternative("chosen", dict(zip(self.axis_names, self.mesh_shape)), self.cost)]
    for r in rows + list(self.recipes):
      if r.cost is None:
        lines.append(f"{r.name:<12} {str(r.mesh_shape):<34} {'-':>10} {'-':>9} {'-':>10}  "
                     f"{r.note}")
        continue
      fit = "" if r.cost.fits else "does not fit; "
      lines.append(f"{r.name:<12} {str(r.mesh_shape):<34} {r.cost.total_s * 1e3:10.3f} "
                   f"{r.cost.exposed_s * 1e3:9.3f} {r.cost.memory['total'] / gib:10.3f}  "
                   f"{fit}{r.note}")
    lines.append("")
    width = max((len(lp.path) for lp in self.leaves), default=4)
    lines.append(f"{'leaf':<{width}} {'shape':<18} {'spec':<28} reason")
    for lp in self.leaves:
      lines.append(f"{lp.path:<{width}} {str(lp.shape):<18} {str(lp.spec):<28} {lp.reason}")
    lines.extend(self.notes)
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


# --- solving ------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Problem:
  m: _Mesh
  groups: list[tuple[int, ...]]
  cands: list[list[_Layout]]
  prices: list[list[_Price]]
  compute_s: float
  fixed_memory: dict[str, float]
  overlap: float
  grad_latency_s: float = 0.0


def _evaluate(prob: _Problem, choice: Sequence[int], graph: stepgraph.StepGraph,
              budget: float) -> StepCost:
  """The cost of one assignment (the program's objective, with the pair terms at their best)."""
  comm: dict[str, float] = {}
  blocking = overlappable = 0.0
  memory = {"params": 0.0, "grads": 0.0, "opt_state": 0.0, "gathered": 0.0, "outputs": 0.0,
            **prob.fixed_memory}
  nbytes: dict[str, float] = {}
  tp_of = {}
  compute = prob.compute_s
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    pr = prob.prices[gi][c]
    tp_of[g[0]] = pr.tp
    compute += pr.compute
    for k, v in pr.blocking.items():
      comm[k] = comm.get(k, 0.0) + v
      blocking += v
    for k, v in pr.overlappable.items():
      comm[k] = comm.get(k, 0.0) + v
      overlappable += v
    for k, v in pr.memory.items():
      memory[k] += v
    for k, v in pr.bytes.items():
      nbytes[k] = nbytes.get(k, 0.0) + v
  sources, dests = _pair_maps(graph)
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    pr = prob.prices[gi][c]
    if pr.tp is None:
      continue
    kind, d = pr.tp
    if kind == "col":
      ok = bool(sources.get((g[0], d))) and all(
          tp_of.get(dst) == ("row", q) for dst, q in sources[(g[0], d)])
      if ok:
        memory["activations"] -= pr.act_saving
      if not ok and pr.ag_fwd_bytes:
        comm["tensor"] = comm.get("tensor", 0.0) + pr.ag_fwd
        blocking += pr.ag_fwd
        nbytes["all_gather[tensor]"] = nbytes.get("all_gather[tensor]", 0.0) + pr.ag_fwd_bytes
    else:
      ok = bool(dests.get((g[0], d))) and all(
          tp_of.get(src) == ("col", k) for src, k in dests[(g[0], d)])
      if not ok and pr.ag_bwd_bytes:
        comm["tensor"] = comm.get("tensor", 0.0) + pr.ag_bwd
        blocking += pr.ag_bwd
        nbytes["all_gather[tensor]"] = nbytes.get("all_gather[tensor]", 0.0) + pr.ag_bwd_bytes
  overlappable += prob.grad_latency_s
  exposed = blocking + max(0.0, overlappable - prob.overlap * compute)
  memory["gathered"] += max((prob.prices[gi][c].gathered_peak for gi, c in enumerate(choice)),
                            default=0.0)
  memory["total"] = sum(memory.values())
  fits = not budget or memory["total"] <= budget
  return StepCost(compute, comm, exposed, memory, nbytes, fits)


def _pair_maps(graph: stepgraph.StepGraph):
  sources: dict[tuple[int, int], list[tuple[int, int]]] = {}
  dests: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for p in graph.pairs:
    sources.setdefault((p.src, p.src_dim), []).append((p.dst, p.dst_dim))
    dests.setdefault((p.dst, p.dst_dim), []).append((p.src, p.src_dim))
  return sources, dests


@contextlib.contextmanager
def _quiet_stdout():
  """HiGHS (inside scipy 1.16-1.18) prints debugging lines such as
  "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" to the process's
  standard output even with disp=False; they are not for the user."""
  try:
    fd = sys.stdout.fileno()
  except (AttributeError, OSError, ValueError):     # a replaced sys.stdout (pytest's capture)
    fd = 1
  sys.stdout.flush()
  saved = os.dup(fd)
  try:
    with open(os.devnull, "w", encoding="utf-8") as null:
      os.dup2(null.fileno(), fd)
      yield
  finally:
    os.dup2(saved, fd)
    os.close(saved)


def _solve(prob: _Problem, graph: stepgraph.StepGraph, budget: float,
           objective: str = "time", proposed: bool = True) -> list[int] | None:
  """The cheapest assignment that fits (scipy.optimize.milp), or None when none fits; with
  ``objective="memory"`` the assignment of least memory per device (no budget).

  On a mesh the planner proposes (``proposed``), a ``tensor`` axis must shard at least one
  weight over it: otherwise the devices along that axis would compute the same step on the same
  data (duplicated work). A mesh the user gave is planned as given."""
  from scipy import optimize, sparse  # pylint: disable=g-import-not-at-top
  index = {}
  costs: list[float] = []
  mem: list[float] = []
  over: list[float] = []
  for gi, (g, cands) in enumerate(zip(prob.groups, prob.cands)):
    for ci in range(len(cands)):
      pr = prob.prices[gi][ci]
      index[(gi, ci)] = len(costs)
      costs.append(sum(pr.blocking.values()) + pr.ag_fwd + pr.ag_bwd + pr.compute)
      mem.append(sum(pr.memory.values()))
      # e >= overlappable - overlap * compute: both sides depend on the layout
      over.append(sum(pr.overlappable.values()) - prob.overlap * pr.compute)
  nx = len(costs)
  group_of_leaf = {g[0]: gi for gi, g in enumerate(prob.groups)}
  sources, dests = _pair_maps(graph)

  def tp_vars(leaf, want):
    gi = group_of_leaf.get(leaf)
    if gi is None:
      return []
    return [index[(gi, ci)] for ci, pr in enumerate(prob.prices[gi]) if pr.tp == want]

  # pair variables: u = the candidate's gather is saved; u <= its own tp vars, u <= each partner's
  saves = []           # (saving seconds, activation bytes, own vars, [partner vars...])
  for gi, g in enumerate(prob.groups):
    for ci, pr in enumerate(prob.prices[gi]):
      if pr.tp is None:
        continue
      kind, d = pr.tp
      partners = (sources if kind == "col" else dests).get((g[0], d))
      saving = pr.ag_fwd if kind == "col" else pr.ag_bwd
      act = pr.act_saving if kind == "col" else 0.0
      if not partners or (saving <= 0 and act <= 0):
        continue
      want = "row" if kind == "col" else "col"
      plist = [tp_vars(leaf, (want, q)) for leaf, q in partners]
      if all(plist):
        saves.append((saving, act, [index[(gi, ci)]], plist))
  nu = len(saves)
  peaks = [[prob.prices[gi][ci].gathered_peak for ci in range(len(cands))]
           for gi, cands in enumerate(prob.cands)]
  ip = nx + nu                             # the gathered-peak variable p
  n = nx + nu + 2                          # + p and the exposed-time variable e
  c = np.zeros(n)
  if objective == "memory":
    c[:nx] = mem
    for j, (_, act, _, _) in enumerate(saves):
      c[nx + j] = -act
    c[ip] = 1.0
    budget = 0.0
  else:
    c[:nx] = costs
    for j, (saving, _, _, _) in enumerate(saves):
      c[nx + j] = -saving
    c[-1] = 1.0
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0
  for gi, ps in enumerate(peaks):                         # p >= each group's gathered peak
    if not any(ps):
      continue
    for ci, pk in enumerate(ps):
      if pk:
        rows.append(r)
        cols.append(index[(gi, ci)])
        vals.append(pk)
    rows.append(r)
    cols.append(ip)
    vals.append(-1.0)
    lo.append(-np.inf)
    hi.append(0.0)
    r += 1
  if proposed and prob.m.size["tensor"] > 1:              # no duplicated work over 'tensor'
    split = _tensor_split_flops(prob, graph)
    total = sum(u.flops for u in graph.weights.values())
    if not split or sum(max(fs.values()) for fs in split.values()) < SPLIT_SHARE * total:
      return None
    for gi, fs in split.items():
      for ci, fl in fs.items():
        rows.append(r)
        cols.append(index[(gi, ci)])
        vals.append(fl)
    lo.append(SPLIT_SHARE * total)
    hi.append(np.inf)
    r += 1
  for gi, cands in enumerate(prob.cands):                 # one layout per group
    for ci in range(len(cands)):
      rows.append(r)
      cols.append(index[(gi, ci)])
      vals.append(1.0)
    lo.append(1.0)
    hi.append(1.0)
    r += 1
  for j, (_, _, own, plist) in enumerate(saves):          # u <= own, u <= each partner
    for vs in [own] + plist:
      rows.append(r)
      cols.append(nx + j)
      vals.append(1.0)
      for v in vs:
        rows.append(r)
        cols.append(v)
        vals.append(-1.0)
      lo.append(-np.inf)
      hi.append(0.0)
      r += 1
  # e >= overlappable - overlap x compute (both per candidate, see over[]) - the fixed terms
  for k in range(nx):
    rows.append(r)
    cols.append(k)
    vals.append(over[k])
  rows.append(r)
  cols.append(n - 1)
  vals.append(-1.0)
  lo.append(-np.inf)
  hi.append(prob.overlap * prob.compute_s - prob.grad_latency_s)
  r += 1
  if budget:                                              # memory per device
    for k in range(nx):
      rows.append(r)
      cols.append(k)
      vals.append(mem[k])
    for j, (_, act, _, _) in enumerate(saves):
      if act:
        rows.append(r)
        cols.append(nx + j)
        vals.append(-act)
    rows.append(r)
    cols.append(ip)
    vals.append(1.0)
    lo.append(-np.inf)
    hi.append(budget - sum(prob.fixed_memory.values()))
    r += 1
  a = sparse.csr_array((vals, (rows, cols)), shape=(r, n))
  integrality = np.zeros(n)
  integrality[:nx] = 1
  bounds = optimize.Bounds(np.zeros(n), np.r_[np.ones(nx + nu), np.inf, np.inf])
  with _quiet_stdout():
    res = optimize.milp(c, constraints=optimize.LinearConstraint(a, lo, hi),
                        integrality=integrality, bounds=bounds,
                        options={"disp": False, "time_limit": 10.0})
  if res.x is None:
    return None
  choice = []
  for gi, cands in enumerate(prob.cands):
    vals_g = [res.x[index[(gi, ci)]] for ci in range(len(cands))]
    choice.append(int(np.argmax(vals_g)))
  return choice


# --- recipes ------------------------------------------------------------------------------------

def _recipe_choice(prob: _Problem, graph: stepgraph.StepGraph, recipe: str) -> list[int]:
  """The standard recipe's layout per group on ``prob``'s mesh (replicated where it cannot
  apply): Megatron pairs for TP (a pair's source column-, its destination row-parallel), the
  largest divisible dimension over 'fsdp' for FSDP."""
  srcs = {(p.src, p.src_dim) for p in graph.pairs}
  dsts = {(p.dst, p.dst_dim) for p in graph.pairs}
  out = []
  for gi, g in enumerate(prob.groups):
    want_tp = None
    if recipe in ("TP", "FSDP x TP"):
      for ci, pr in enumerate(prob.prices[gi]):
        if pr.tp and ((pr.tp[0] == "col" and (g[0], pr.tp[1]) in srcs) or
                      (pr.tp[0] == "row" and (g[0], pr.tp[1]) in dsts)):
          want_tp = pr.tp
          break
    want_fsdp = recipe in ("FSDP", "FSDP x TP")
    best = 0
    for ci, lay in enumerate(prob.cands[gi]):
      pr = prob.prices[gi][ci]
      has_f = "fsdp" in lay.used()
      if pr.tp == want_tp and has_f == want_fsdp:
        best = ci
        break
      if pr.tp == want_tp and not has_f:
        best = ci
    out.append(best)
  return out


def _recipe_shape(recipe: str, n: int, island: int) -> tuple[int, int, int]:
  """DP over every device; FSDP over every device; TP over the fast island with data parallel
  across islands; FSDP x TP: TP over (at most half of) the island, FSDP over the rest."""
  t = math.gcd(island, n)
  t2 = t if n // t > 1 else max(1, t // 2)
  return {"DP": (n, 1, 1), "FSDP": (1, n, 1), "TP": (n // t, 1, t),
          "FSDP x TP": (1, n // t2, t2)}[recipe]


# --- the entry point ----------------------------------------------------------------------------

def _budget(topology: Topology, ids: Sequence[int], memory_budget: float | None) -> float:
  if memory_budget is not None:
    if not memory_budget > 0:
      raise errors.PlacementError(f"plan: memory_budget={memory_budget!r} must be > 0 bytes "
                                  "(or None: the devices' memory minus the reserve)")
    return float(memory_budget)
  mem = [topology.device(i).memory_bytes for i in ids]
  if not all(mem):
    return 0.0
  reserve = config.get_float("DTENJAX_MEMORY_RESERVE")
  return min(mem) * (1.0 - reserve)


def _pinned_specs(pinned, args) -> dict[int, P]:
  """Leaf index -> the PartitionSpec the user pinned (a pytree prefix of args, None = plan)."""
  if pinned is None:
    return {}
  if not isinstance(pinned, (tuple, list)) or len(pinned) != len(args):
    raise errors.PlacementError(
        f"plan: pinned= must be a tuple with one entry per argument ({len(args)}), each None "
        "(plan it) or a pytree prefix of that argument holding PartitionSpecs or None")
  is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
  out: dict[int, P] = {}
  offset = 0
  for argnum, (tree, arg) in enumerate(zip(pinned, args)):
    n = len(jax.tree.leaves(arg))
    if tree is not None:
      try:
        per_leaf = jax.tree.map(lambda s, sub: [s] * len(jax.tree.leaves(sub)), tree, arg,
                                is_leaf=is_spec)
      except ValueError as e:
        raise errors.PlacementError(
            f"plan: pinned[{argnum}] is not a pytree prefix of argument {argnum} ({e}); give "
            "PartitionSpecs (or None) in the argument's own structure") from None
      flat = [s for lst in jax.tree.leaves(per_leaf, is_leaf=lambda x: isinstance(x, list))
              for s in lst]
      for k, s in enumerate(flat):
        if isinstance(s, P):
          out[offset + k] = s
    offset += n
  return out


def _box_pins(args, rules) -> dict[int, P]:
  """Leaf index -> the PartitionSpec flax partitioning metadata gives a boxed leaf (linen's
  ``nn.with_logical_partitioning`` / ``nn.with_partitioning``, nnx's ``out_sharding``), mapped
  to the planner's axes by ``rules`` as Placement(rules=...) maps them."""
  names_mesh = jax.sharding.AbstractMesh((1,) * len(AXES), AXES)
  out: dict[int, P] = {}
  offset = 0
  for argnum, arg in enumerate(args):
    for node in jax.tree.leaves(arg, is_leaf=boxes.is_box):
      if boxes.is_box(node):
        out[offset] = boxes.box_spec(node, names_mesh, rules,
                                     f"plan: argument {argnum}'s boxed leaf")
      offset += len(jax.tree.leaves(node))
  return out


def plan(step: Callable, *args, mesh: Mesh | dict[str, int] | None = None,
         topology: Topology | None = None, memory_budget: float | None = None,
         batch_argnums: int | Sequence[int] | None = None, pinned: Sequence[Any] | None = None,
         rules: Sequence[tuple[str, Any]] | None = None, overlap: float = 0.5,
         donate: bool = False, recipe: str | None = None) -> StepPlan:
  """Plans the layout of every argument of a training step, and the mesh.

  Args:
    step: the step function, e.g. ``step(params, opt_state, batch) -> (params, opt_state,
      loss)``; it is traced, never run.
    *args: example arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees (``jax.eval_shape`` of
      the init gives them without allocating).
    mesh: None to let the planner propose the mesh; a dict ``{"data": 2, "fsdp": 4}`` of axis
      sizes (axes among ``data``, ``fsdp``, ``tensor``) to plan on that shape; or a
      ``jax.sharding.Mesh`` whose axes are named among those.
    topology: the hardware (default: ``Topology.current()``; a fixture plans for a machine you
      are not on).
    memory_budget: bytes per device; default the smallest device memory less
      ``DTENJAX_MEMORY_RESERVE`` (none when the memory is unknown, as on CPU).
    batch_argnums: the arguments that hold the batch (sharded over ``data`` and ``fsdp`` on
      dimension 0); default the last argument.
    pinned: one entry per argument: None (plan it) or a pytree prefix of PartitionSpecs (None
      leaves are planned) that the plan keeps as they are and plans the rest around.
    rules: flax logical axis rules (``(("embed", "fsdp"), ("mlp", "tensor"), ...)``) for
      leaves boxed with flax partitioning metadata: those leaves are pinned to the layout their
      names give (the box's own rules, these, or flax's rules context), the rest is planned.
    overlap: share of the compute time that can hide gradient and FSDP traffic (0..1).
    recipe: one of :data:`RECIPES` ("DP", "FSDP", "TP", "FSDP x TP") to get that standard
      layout priced and laid out instead of the planner's choice (its mesh and assignment).
    donate: the step is jitted with its state donated (``donate_argnums``), so its new state
      reuses the old one's memory; default False, as ``jax.jit``: outputs count as a copy.

  Raises PlacementError when no layout fits the budget, naming the smallest shortfall."""
  t0 = time.perf_counter()
  if not callable(step):
    raise errors.PlacementError(f"plan: step={step!r} is not callable; pass the training step "
                                "function and its example arguments")
  if not args:
    raise errors.PlacementError("plan: give the step's example arguments, e.g. "
                                "plan(step, params, opt_state, batch)")
  if not _is_real(overlap) or not 0.0 <= overlap <= 1.0:
    raise errors.PlacementError(f"plan: overlap={overlap!r} must be a number in [0, 1]")
  if memory_budget is not None and (not _is_real(memory_budget) or not memory_budget > 0):
    raise errors.PlacementError(
        f"plan: memory_budget={memory_budget!r} must be a number of bytes > 0 (e.g. 16 * 2**30), "
        "or None: the devices' memory less the reserve")
  if batch_argnums is None:
    batch_argnums = (len(args) - 1,)
  elif isinstance(batch_argnums, int):
    batch_argnums = (batch_argnums,)
  batch_argnums = tuple(int(b) for b in batch_argnums)
  bad = [b for b in batch_argnums if not 0 <= b < len(args)]
  if bad:
    raise errors.PlacementError(f"plan: batch_argnums {bad} are not argument positions "
                                f"(0..{len(args) - 1})")
  if recipe is not None and recipe not in RECIPES:
    raise errors.PlacementError(f"plan: recipe={recipe!r} is not one of {RECIPES}")
  pins = {**{k: (v, "pinned by its flax partitioning names") for k, v in
             _box_pins(args, rules).items()},
          **{k: (v, "pinned by you") for k, v in _pinned_specs(pinned, args).items()}}
  graph = stepgraph.read_step(step, args, batch_argnums)
  topology, ids, shapes, fixed_mesh = _resolve_mesh(mesh, topology)
  if recipe is not None:
    island = min((len(i) for i in topology.fast_islands()), default=1)
    shapes = [_recipe_shape(recipe, len(ids), island)]
  budget = _budget(topology, ids, memory_budget)
  price = planner._default_all_reduce_time()  # pylint: disable=protected-access
  ordered = _order(topology, ids)
  problems: list[tuple[tuple[int, int, int], _Problem]] = []
  for shape in shapes:
    m = _Mesh(shape, np.asarray(ordered).reshape(shape), topology)
    prob = _problem(graph, m, price, pins, overlap, donate)
    if prob is not None:
      problems.append((shape, prob))
  if not problems:
    raise errors.PlacementError(
        f"plan: no mesh of {len(ids)} devices divides the batch (batch dimension sizes "
        f"{sorted({graph.leaves[i].shape[0] for i in range(len(graph.leaves)) if graph.leaves[i].is_batch and graph.leaves[i].shape})}); "
        "make the global batch a multiple of the device count")
  best = None
  shortfall = None
  solved = []
  for shape, prob in problems:
    choice = (_solve(prob, graph, budget, proposed=fixed_mesh is None) if recipe is None else
              _recipe_choice(prob, graph, recipe))
    if choice is None:
      least = _solve(prob, graph, 0.0, objective="memory", proposed=fixed_mesh is None)
      if least is None:          # no layout uses this mesh without duplicated work
        continue
      floor = _evaluate(prob, least, graph, 0.0).memory["total"]
      if shortfall is None or floor < shortfall[0]:
        shortfall = (floor, shape)
      continue
    cost = _evaluate(prob, choice, graph, budget)
    solved.append((shape, prob, choice, cost))
    key = (round(cost.total_s, 12), cost.memory["total"])
    if best is None or key < best[0]:
      best = (key, shape, prob, choice, cost)
  island = min((len(i) for i in topology.fast_islands()), default=1)
  recipes = []
  by_shape = {shape: prob for shape, prob in problems}
  for name in RECIPES:
    shape = _recipe_shape(name, len(ids), island)
    if fixed_mesh is not None and shape not in by_shape:
      continue
    prob = by_shape.get(shape)
    if prob is None:
      m = _Mesh(shape, np.asarray(ordered).reshape(shape), topology)
      prob = _problem(graph, m, price, pins, overlap, donate)
    if prob is None:
      recipes.append(Alternative(name, dict(zip(AXES, shape)), None,
                                 "the batch does not divide this mesh"))
      continue
    rchoice = _recipe_choice(prob, graph, name)
    cost = _evaluate(prob, rchoice, graph, budget)
    recipes.append(Alternative(name, dict(zip(AXES, shape)), cost))
    # a recipe that fits is a candidate of the program; this keeps the promise "never worse
    # than the best recipe that fits" exact where the solver's tolerances round
    key = (round(cost.total_s, 12), cost.memory["total"])
    if (recipe is None and cost.fits and
        (fixed_mesh is not None or _uses_its_axes(prob, rchoice, graph)) and
        (best is None or key < best[0])):
      best = (key, shape, prob, rchoice, cost)
  if best is None and shortfall is None:
    raise errors.PlacementError(
        f"plan: every mesh of {len(ids)} devices tried "
        f"({[dict(zip(AXES, s)) for s, _ in problems]}) has a 'tensor' axis over which too "
        "little of this step's weights can be sharded: its devices would compute the same step "
        "on the same data. Give a mesh without 'tensor' (mesh={'data': "
        f"{len(ids)}}}) or let the planner choose (mesh=None)")
  if best is None:
    gib = 2**30
    floor, shape = shortfall
    raise errors.PlacementError(
        f"plan: no layout of this step fits {budget / gib:.4g} GiB per device on "
        f"{len(ids)} devices of {topology.name!r}: the smallest needs {floor / gib:.4g} GiB "
        f"(mesh {dict(zip(AXES, shape))}), {(floor - budget) / gib:.4g} GiB short. Use more "
        "devices, a smaller batch per step, jax.checkpoint (remat) on the layers, or pipeline "
        "stages (dtenjax does not plan pipeline parallelism)")
  _, shape, prob, choice, cost = best
  return _report(graph, prob, choice, cost, tuple(recipes), budget, topology,
                 time.perf_counter() - t0, len(problems), args, donate)


# On a mesh the planner proposes, a 'tensor' axis (over which the batch is replicated) must split
# at least this share of the weights' product flops; otherwise most of the step would be computed
# once per device of the axis: duplicated work, which data parallelism turns into a split batch.
SPLIT_SHARE = 0.75


def _tensor_split_flops(prob: _Problem, graph: stepgraph.StepGraph) -> dict[int, dict[int, float]]:
  """group -> candidate -> the product flops it splits over 'tensor' (those that shard it)."""
  out: dict[int, dict[int, float]] = {}
  for gi, g in enumerate(prob.groups):
    use = graph.weights.get(g[0])
    if use is None:
      continue
    for ci, lay in enumerate(prob.cands[gi]):
      if "tensor" in lay.used() and use.flops > 0:
        out.setdefault(gi, {})[ci] = use.flops
  return out


def _uses_its_axes(prob: _Problem, choice: Sequence[int], graph: stepgraph.StepGraph) -> bool:
  """Whether a 'tensor' axis of more than one device splits enough of the work (see _solve)."""
  if prob.m.size["tensor"] == 1:
    return True
  split = _tensor_split_flops(prob, graph)
  done = sum(split.get(gi, {}).get(c, 0.0) for gi, c in enumerate(choice))
  total = sum(u.flops for u in graph.weights.values())
  return total > 0 and done >= SPLIT_SHARE * total


def _is_real(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and (
      math.isfinite(x))


def _order(topology: Topology, ids: Sequence[int]) -> list[int]:
  return sorted(ids, key=topology.hierarchy_key)


def _resolve_mesh(mesh, topology):
  if isinstance(mesh, Mesh):
    names = tuple(mesh.axis_names)
    unknown = [n for n in names if n not in AXES]
    if unknown:
      raise errors.PlacementError(
          f"plan: mesh axes {unknown} are not planner axes; name the axes among {AXES} "
          "(e.g. jax.make_mesh((2, 4), ('data', 'tensor'))) or pass mesh=None to let the "
          "planner propose one")
    if topology is None:
      topology = Topology.detect(list(mesh.devices.flat))
    sizes = dict(mesh.shape)
    shape = tuple(sizes.get(a, 1) for a in AXES)
    ids = [int(d.id) for d in mesh.devices.flat]
    return topology, ids, [shape], shape
  if topology is None:
    topology = Topology.current()
  ids = list(topology.device_ids)
  if isinstance(mesh, dict):
    unknown = [k for k in mesh if k not in AXES]
    bad = {k: v for k, v in mesh.items()
           if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1}
    if bad:
      raise errors.PlacementError(
          f"plan: mesh={mesh!r}: sizes {bad} are not positive ints; give each axis a whole "
          f"number of devices, e.g. {{'data': 2, 'fsdp': {max(1, len(ids) // 2)}}}")
    if unknown or math.prod(mesh.values()) != len(ids):
      raise errors.PlacementError(
          f"plan: mesh={mesh!r} must map axes among {AXES} to sizes whose product is the "
          f"topology's device count ({len(ids)})")
    shape = tuple(int(mesh.get(a, 1)) for a in AXES)
    return topology, ids, [shape], shape
  if mesh is not None:
    raise errors.PlacementError(f"plan: mesh={mesh!r} must be None, a dict of axis sizes or a "
                                "jax.sharding.Mesh")
  return topology, ids, _mesh_shapes(len(ids), topology, ids), None


def _problem(graph, m: _Mesh, price, pins, overlap, donate) -> _Problem | None:
  bdiv = m.size["data"] * m.size["fsdp"]
  batch_leaves = [lf for lf in graph.leaves if lf.is_batch]
  if bdiv > 1 and not any(_splits(lf, bdiv) for lf in batch_leaves):
    return None
  pricer = _Pricer(m, price)
  groups = [g for g in graph.groups]
  cands, prices = [], []
  for g in groups:
    cs = _candidates(graph, g, m, pins.get(g[0]))
    cands.append(cs)
    prices.append([_price(graph, g, c, m, pricer, bdiv, donate) for c in cs])
  # products without a weight (attention scores, ...) split over the batch axes only
  rest = max(0.0, graph.flops - sum(u.flops for u in graph.weights.values()) -
             sum(graph.carried.values()))
  compute = rest / bdiv / m.peak_flops
  fixed = {"activations": graph.activation_bytes / bdiv,
           "batch": sum(lf.nbytes / (bdiv if _splits(lf, bdiv) else 1) for lf in batch_leaves)}

  # one latency for the combined gradient all-reduce(s) (see _price)
  batch = [a for a in BATCH_AXES if m.size[a] > 1]
  latency = 0.0
  if batch:
    latency = pricer("all_reduce", 1, batch, "float32")
    if "fsdp" in batch and "data" in batch:
      latency = max(latency, pricer("all_reduce", 1, ["data"], "float32"))
  return _Problem(m, groups, cands, prices, compute, fixed, overlap, latency)


def _splits(leaf: stepgraph.Leaf, bdiv: int) -> bool:
  """Whether a batch leaf is split over the batch axes (its dimension 0 divides); others (a PRNG
  key, a scalar, a per-step constant) are replicated."""
  return bool(leaf.shape) and leaf.shape[0] % bdiv == 0 and leaf.dtype.find("key") < 0


def _report(graph, prob: _Problem, choice, cost, recipes, budget, topology, seconds, tried,
            args, donate: bool) -> StepPlan:
  m = prob.m
  spec_of: dict[int, tuple[P, str]] = {}
  for g, lays, c in zip(prob.groups, prob.cands, choice):
    lay = lays[c]
    spec = P(*lay.spec)
    reason = lay.note
    use = graph.weights.get(g[0])
    if use is not None and not reason.startswith("pinned"):
      reason += (f"; product contracts dims {list(use.contracted)}, keeps {list(use.free)}")
    for k, leaf in enumerate(g):
      spec_of[leaf] = (spec, reason if k == 0 else f"tied to {graph.leaves[g[0]].path}")
  batch_axes = tuple(a for a in BATCH_AXES if m.size[a] > 1)
  bspec_entry = _spec_entry(batch_axes)
  leaves = []
  specs_flat = []
  for lf in graph.leaves:
    if lf.is_batch:
      if bspec_entry is None:
        spec, reason = P(), "the batch: replicated (the mesh has no data or fsdp axis)"
      elif _splits(lf, m.size["data"] * m.size["fsdp"]):
        spec, reason = P(bspec_entry), "the batch: dimension 0 over the data-parallel axes"
      else:
        spec, reason = P(), "a batch argument whose dimension 0 does not split: replicated"
    else:
      spec, reason = spec_of.get(lf.index, (P(), "replicated"))
    spec = _trim(spec)
    leaves.append(LeafPlan(lf.path, lf.shape, lf.dtype, spec, reason))
    specs_flat.append(spec)
  specs = _per_arg(args, specs_flat)
  compute_flat = []
  for lf, spec in zip(graph.leaves, specs_flat):
    weight = lf.index in graph.weights or lf.index in graph.gathered
    drop = set(BATCH_AXES) if weight else set()
    entries = [_spec_entry([a for a in (e if isinstance(e, tuple) else (e,)) if a not in drop])
               if e is not None else None for e in spec]
    gathered_spec = _trim(P(*entries))
    compute_flat.append(gathered_spec if weight and gathered_spec != spec else None)
  compute_specs = [None if all(c is None for c in jax.tree.leaves(t, is_leaf=_is_none)) else t
                   for t in _per_arg(args, compute_flat)]
  out_specs_flat = []
  for shape, _, rep in graph.outputs:
    spec = spec_of.get(rep, (P(),))[0] if rep is not None else P()
    if rep is not None and graph.leaves[rep].shape != shape:
      spec = P()
    out_specs_flat.append(_trim(spec))
  out_specs = jax.tree_util.tree_unflatten(graph.out_tree, out_specs_flat)
  notes = () if budget else (
      "memory: the devices' memory is unknown (as on CPU), so no budget was checked; pass "
      "memory_budget= to check one",)
  return StepPlan(axis_names=AXES, mesh_shape=m.shape, out_specs=out_specs,
                  compute_specs=tuple(compute_specs), donate=donate, nvls=topology.nvls,
                  batch_argnums=tuple(sorted({lf.argnum for lf in graph.leaves if lf.is_batch})),
                  device_ids=tuple(int(i) for i in m.ids.ravel()), axes=_axis_links(m),
                  leaves=tuple(leaves), specs=tuple(specs), cost=cost, recipes=recipes,
                  budget_bytes=budget, topology=topology.name, planning_s=seconds,
                  meshes_tried=tried, notes=notes)


def _is_none(x) -> bool:
  return x is None


def _per_arg(args, flat: list) -> list:
  """``flat`` (one entry per argument leaf, in order) in the trees of ``args``, one per argument."""
  out, k = [], 0
  for a in args:
    treedef = jax.tree_util.tree_structure(a)
    out.append(jax.tree_util.tree_unflatten(treedef, flat[k:k + treedef.num_leaves]))
    k += treedef.num_leaves
  return out


@dataclasses.dataclass(frozen=True)
class Check:
  """A plan's prediction next to what XLA compiled for it (:meth:`StepPlan.check`)."""
  predicted_memory: dict[str, float]     # arguments, outputs, temp, total
  compiled_memory: dict[str, float]
  predicted_bytes: dict[str, float]      # collective kind -> bytes per participant
  compiled_bytes: dict[str, float]

  @staticmethod
  def _err(pred: float, got: float) -> float:
    return abs(pred - got) / got if got else (0.0 if not pred else math.inf)

  @property
  def memory_error(self) -> float:
    return self._err(self.predicted_memory["total"], self.compiled_memory["total"])

  @property
  def kind_errors(self) -> dict[str, float]:
    """Per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute, ...):
    the relative error of the predicted bytes per step."""
    return {k: self._err(self.predicted_bytes.get(k, 0.0), self.compiled_bytes.get(k, 0.0))
            for k in sorted(set(self.predicted_bytes) | set(self.compiled_bytes))
            if self.predicted_bytes.get(k) or self.compiled_bytes.get(k)}

  @property
  def bytes_error(self) -> float:
    """The largest error of any collective kind, relative to the step's total compiled bytes
    (a kind of a few bytes missed does not count as 100 %)."""
    total = sum(self.compiled_bytes.values())
    worst = 0.0
    for k in set(self.predicted_bytes) | set(self.compiled_bytes):
      miss = abs(self.predicted_bytes.get(k, 0.0) - self.compiled_bytes.get(k, 0.0))
      worst = max(worst, miss / total if total else (math.inf if miss else 0.0))
    return worst

  def table(self) -> str:
    mib = 2**20
    rows = []
    for k in ("arguments", "outputs", "temp", "total"):
      p, g = self.predicted_memory.get(k, 0), self.compiled_memory.get(k, 0)
      rows.append((f"memory {k}", f"{p / mib:.2f}", f"{g / mib:.2f}", "MiB",
                   f"{self._err(p, g):.1%}" if k == "total" else ""))
    for k, e in self.kind_errors.items():
      rows.append((f"{k} bytes", f"{self.predicted_bytes.get(k, 0) / mib:.2f}",
                   f"{self.compiled_bytes.get(k, 0) / mib:.2f}", "MiB", f"{e:.1%}"))
    return tables.render(("", "predicted", "compiled", "unit", "error"), rows,
                         align=("left", "right", "right", "left", "right")) + (
        f"\nmemory off by {self.memory_error:.1%}, collective bytes by {self.bytes_error:.1%} "
        "(the largest miss of one kind, of all compiled bytes)")

  def __str__(self) -> str:
    return self.table()


def _check(plan_: StepPlan, step: Callable, args) -> Check:
  from dtenjax._src.planning import explain as explain_lib  # pylint: disable=g-import-not-at-top
  abstract = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a) for a in args]
  kwargs = {}
  if plan_.donate:
    kwargs["donate_argnums"] = tuple(i for i in range(len(args))
                                     if i not in plan_.batch_argnums)
  compiled = plan_.jit(step, **kwargs).lower(*abstract).compile()
  stats = compiled.memory_analysis()
  got = {"arguments": float(stats.argument_size_in_bytes),
         "outputs": float(stats.output_size_in_bytes - stats.alias_size_in_bytes),
         "temp": float(stats.temp_size_in_bytes)}
  got["total"] = sum(got.values())
  exp = explain_lib.explain(compiled)
  repeats = _loop_repeats(compiled)
  compiled_bytes: dict[str, float] = {}
  for c in exp.collectives:      # per step: a collective in a loop body runs once per iteration
    compiled_bytes[c.kind] = compiled_bytes.get(c.kind, 0.0) + c.nbytes * repeats(c.computation)
  predicted_bytes: dict[str, float] = {}
  for k, v in plan_.cost.collective_bytes.items():
    kind = k.split("[")[0]
    predicted_bytes[kind] = predicted_bytes.get(kind, 0.0) + v
  mem = plan_.cost.memory
  pred = {"arguments": mem["params"] + mem["opt_state"] + mem["batch"],
          "outputs": mem.get("outputs", 0.0),
          "temp": mem["grads"] + mem["activations"] + mem.get("gathered", 0.0)}
  pred["total"] = sum(pred.values())
  return Check(pred, got, predicted_bytes, compiled_bytes)


def _loop_repeats(compiled) -> Callable[[str], int]:
  """computation name -> how often it runs per step: the product of the known trip counts of the
  while loops around it (1 outside loops, or where XLA knows no trip count)."""
  from dtenjax._src import hlo  # pylint: disable=g-import-not-at-top
  module = hlo.read_compiled(compiled)
  trips = module.trip_counts()
  callers = module.callers()
  memo: dict[str, int] = {}

  def repeats(comp: str, depth: int = 0) -> int:
    if comp in memo:
      return memo[comp]
    out = 1
    calls = callers.get(comp, [])
    if calls and depth < 64:
      ins = calls[0]
      out = repeats(ins.computation, depth + 1)
      if ins.opcode == "while":
        out *= trips.get(ins.name, 1)
    memo[comp] = out
    return out
  return repeats


def _trim(spec: P) -> P:
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)
