"""Candidate meshes and candidate layouts of the whole-step planner.

Meshes: the axes of :mod:`~dtenjax._src.planning.roles` over the topology's devices in hierarchy
order, ``tensor`` of every size dividing the smallest fast island, ``fsdp`` over 1, the rest of a
host or of 2, 4, ... hosts (HSDP), or everything, ``data`` the remainder. Layouts: per tied group
of state leaves, every combination of the roles' shard options (replicated included).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec as P

from dtenjax._src.planning import stepgraph
from dtenjax._src.planning import roles
from dtenjax._src.planning.roles import AXES
from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.topology.model import INTRA_HOST, Topology


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
class CandidateMesh:
  shape: tuple[int, ...]             # axis sizes, in roles.AXES order
  ids: np.ndarray                    # device ids, shape `shape`
  topology: Topology
  # on a mesh with a 'stage' axis: the pipeline's schedule, micro-batches and their prices
  # (roles.stage.choose); None otherwise
  pipeline: Any = None

  @functools.cached_property
  def size(self) -> dict[str, int]:
    return dict(zip(AXES, self.shape))

  @functools.cached_property
  def batch_axes(self) -> frozenset[str]:
    """The axes that split the batch's work (roles.BATCH_AXES)."""
    return frozenset(roles.BATCH_AXES)

  @functools.cached_property
  def peak_flops(self) -> float:
    return _peak_flops(self.topology)

  @functools.cached_property
  def _groups(self) -> dict[tuple[str, ...], tuple[int, ...]]:
    return {}

  def group(self, axes: Sequence[str]) -> tuple[int, ...]:
    """Device ids of the first group spanning ``axes`` (rank order)."""
    key = tuple(a for a in AXES if a in axes)
    out = self._groups.get(key)
    if out is None:
      index = tuple(slice(None) if a in key else 0 for a in AXES)
      out = self._groups[key] = tuple(int(i) for i in self.ids[index].ravel())
    return out

  def axis_sizes(self, axes: Sequence[str]) -> tuple[int, ...]:
    return tuple(self.size[a] for a in AXES if a in axes)


@functools.lru_cache(maxsize=32)
def _peak_flops(topology: Topology) -> float:
  """The topology's (a frozen value) FLOP/s, read once per topology: on 1,024 devices it is a walk
  over all of them, and a plan has dozens of candidate meshes."""
  return topology.peak_flops()


def _span(link: str, topology: Topology) -> str:
  if link in ("nvswitch", "nvlink"):
    return "inside an NVLink island"
  if link == "shared_memory":
    return "inside one process's devices"
  if link in INTRA_HOST:
    return "inside a host"
  return "across hosts"


def axis_links(m: CandidateMesh) -> tuple[AxisLink, ...]:
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


def mesh_shapes(n: int, topology: Topology, ids: Sequence[int],
                graph: stepgraph.StepGraph | None = None, layers: int = 0
                ) -> list[tuple[int, ...]]:
  """The meshes worth pricing (sizes in :data:`AXES` order): each role, innermost first, proposes
  its sizes for the devices the roles inside it left (``tensor`` within the smallest fast island,
  ``fsdp`` over 1, the rest of 1, 2, 4... hosts, or everything; ``expert`` only where ``graph``
  has expert weights; ``stage`` over whole hosts dividing the ``layers`` of the step's scanned
  stack); ``data`` takes the remainder."""
  present = set(ids)
  island = min((len([i for i in isl if i in present]) for isl in topology.fast_islands()
                if any(i in present for i in isl)), default=1)
  hosts = [h for h in topology.hosts() if any(i in present for i in h)]
  per_host = min(len(h) for h in hosts) if hosts else n
  shapes = set()

  def walk(k: int, inner: int, chosen: dict[str, int]) -> None:
    if k < 0:
      shapes.add(tuple(chosen.get(a, 1) for a in AXES))
      return
    role = roles.REGISTRY[k]
    rest = n // inner
    options = ([rest] if role.sizes is None else
               role.sizes(MeshContext(n, rest, inner, island, per_host, graph, layers)))
    for size in options:
      if rest % size == 0:
        walk(k - 1, inner * size, {**chosen, role.name: size})
  walk(len(roles.REGISTRY) - 1, 1, {})
  return sorted((s for s in shapes if math.prod(s) == n), key=lambda s: tuple(reversed(s)))


def order(topology: Topology, ids: Sequence[int]) -> list[int]:
  return sorted(ids, key=topology.hierarchy_key)


def batch_div(m: CandidateMesh) -> int:
  """The devices the batch's dimension 0 is split over (every batch axis of ``m``)."""
  return math.prod(m.size[r.name] for r in roles.REGISTRY if r.splits_batch)


def splits_batch(leaf: stepgraph.Leaf, bdiv: int) -> bool:
  """Whether a batch leaf is split over the batch axes (its dimension 0 divides); others (a PRNG
  key, a scalar, a per-step constant) are replicated."""
  return bool(leaf.shape) and leaf.shape[0] % bdiv == 0 and leaf.dtype.find("key") < 0


@dataclasses.dataclass(frozen=True)
class Layout:
  spec: tuple[Any, ...]              # per dimension: None, an axis name, or a tuple of names
  note: str

  def axes_of(self, dim: int) -> tuple[str, ...]:
    e = self.spec[dim]
    return () if e is None else (e if isinstance(e, tuple) else (e,))

  def used(self) -> dict[str, int]:
    """mesh axis -> the dimension it shards"""
    return {a: d for d in range(len(self.spec)) for a in self.axes_of(d)}


def spec_entry(axes: Sequence[str]):
  axes = tuple(axes)
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def layouts(graph: stepgraph.StepGraph, group: tuple[int, ...], m: CandidateMesh,
            pinned: tuple[P, str] | None) -> list[Layout]:
  """Every combination of the roles' options for ``group`` on ``m`` (each role shards at most one
  dimension, no dimension twice), replicated first; a pinned group keeps its spec. The innermost
  role chooses first (``tensor``, then ``fsdp`` on what is left, as a user layers FSDP x TP)."""
  leaf = graph.leaves[group[0]]
  shape = leaf.shape
  if pinned is not None:
    spec, why = pinned
    entries = tuple(spec) + (None,) * (len(shape) - len(spec))
    return [Layout(entries, why)]
  use = graph.weights.get(group[0])
  lookup = graph.lookups.get(group[0]) if use is None else None
  stack = graph.stack()
  stacked = stack[1].get(group[0]) if stack is not None else None
  active = [r for r in reversed(roles.REGISTRY) if r.options is not None and m.size[r.name] > 1
            and shape]
  out: list[Layout] = []

  def walk(k: int, chosen: list[tuple[str, Option]]) -> None:
    if k == len(active):
      entries: list[list[str]] = [[] for _ in shape]
      for name, opt in chosen:
        entries[opt.dim].append(name)
      ordered = [[a for a in AXES if a in e] for e in entries]
      notes = [opt.note for _, opt in chosen]
      out.append(Layout(tuple(spec_entry(e) for e in ordered), ", ".join(notes) or "replicated"))
      return
    role = active[k]
    ctx = LeafContext(shape, use, lookup, group[0] in graph.gathered, m.size[role.name],
                      stacked, graph.conv_groups)
    opts = role.options(ctx, frozenset(o.dim for _, o in chosen))
    if not (role.mandatory and opts):
      walk(k + 1, chosen)
    for opt in opts:
      walk(k + 1, chosen + [(role.name, opt)])
  walk(0, [])
  return out
