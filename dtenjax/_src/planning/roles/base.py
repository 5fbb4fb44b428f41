"""The record of a mesh axis role (:mod:`dtenjax._src.planning.roles`)."""

from __future__ import annotations

import dataclasses


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
  """
  name: str
  splits_batch: bool
  shards: str
  collectives: str
  memory: str
  applied: str
