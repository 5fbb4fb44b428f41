"""The record of a mesh axis role (:mod:`dtenjax._src.planning.roles`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


# The dtype a role prices a collective's bytes as where they already are what moves (a meeting's
# values of several dtypes, their bfloat16 share counted apart: PriceContext.add's ``wide``): the
# Pricer widens no float32 collective (calls.wire_bytes), so those bytes are not widened again by
# the weight's dtype.
WIRE = "float32"


def activation_dtype(use) -> str:
  """The dtype a product's activation collectives are priced in (``use``: its
  stepgraph.WeightUse): its activations' own, not the weight's. Only bfloat16 and the float8
  types move otherwise than they are (``calls.wire_bytes``: XLA:CPU doubles them, to float32 and
  float16), priced as bfloat16 (twice its bytes on CPU devices); every other dtype is priced at
  its bytes (``WIRE``)."""
  return "bfloat16" if use.act_bfloat16 else WIRE


@dataclasses.dataclass(frozen=True)
class Role:
  """One mesh axis role of the whole-step planner.

  Attributes:
    name: the mesh axis it names (and the name in PartitionSpecs).
    splits_batch: the batch's dimension 0 is split over it (data-parallel work); an axis that
      does not split the batch must shard most of the weights' work, or its devices would
      compute the same step twice.
    shards: which leaves and dimensions it may shard.
    collectives: what it costs per step, with the loop structure.
    memory: its effect on the memory per device.
    applied: how the layout is applied when the step runs.
    routes: a weight sharded over it stays sharded where a product reads it along a dimension
      the product batches over (an expert dimension): the tokens are routed to the shards
      (all-to-all) instead of the weight being gathered, and its gradient needs no reduction
      over the axis. Only for an axis that splits the batch.
  """
  name: str
  splits_batch: bool
  shards: str
  collectives: str
  memory: str
  applied: str
  # (LeafContext, dims taken by the roles chosen before it) -> the ways it may shard the group
  options: Callable[["LeafContext", frozenset[int]], list["Option"]] | None = None
  # (PriceContext) -> None: adds its collectives, compute and memory to ctx.price for a layout
  # that shards a dimension over it
  price: Callable[[Any], None] | None = None
  # (MeshContext) -> the axis sizes worth trying, given the roles inside it; None: the axis takes
  # the devices the others leave (one role, the outermost: data)
  sizes: Callable[["MeshContext"], list[int]] | None = None
  routes: bool = False
  # a group it offers an option for must take one (on a mesh where its axis has more than one
  # device): a pipeline's stages hold every layer of the stack, none holds them all
  mandatory: bool = False
  # it splits the batch's work along the batch's sequence dimension (planning/sequence.py), not
  # along dimension 0: context parallelism
  sequence: bool = False


@dataclasses.dataclass(frozen=True)
class MeshContext:
  """What a role may look at to propose its axis sizes: ``rest`` devices are left after the
  roles inside it took ``inner``; the smallest fast island and host of the planned devices; the
  step (a role with nothing to shard in it proposes size 1 only)."""
  n: int
  rest: int
  inner: int
  island: int
  per_host: int
  graph: Any = None          # the step's stepgraph.StepGraph (None: any step)
  layers: int = 0            # the length of the step's longest scanned stack (0: none)


@dataclasses.dataclass(frozen=True)
class Option:
  """A role sharding one dimension of a group's leaves: ``kind`` says how (role specific: for
  ``tensor`` "col", "row" or "vocab"), ``note`` is the reason the report prints."""
  dim: int
  kind: str
  note: str


@dataclasses.dataclass(frozen=True)
class LeafContext:
  """What a role may look at to offer options for one tied group on one mesh."""
  shape: tuple[int, ...]
  use: Any                   # the stepgraph.WeightUse of its first product, or None
  lookup: Any                # (indexed dims, bytes) when only gathers read it, else None
  gathered: bool             # read by a gather (an embedding table), maybe also by a product
  size: int                  # the role's mesh axis size
  stacked: int | None = None  # the dimension a scan over the step's stack of layers slices
  conv_groups: tuple[int, ...] = ()  # the step's grouped convolutions' groups (StepGraph's)
