"""The mesh axis roles of the whole-step planner, one record each, in one registry.

A role is what a mesh axis does to a training step: which leaves and dimensions it may shard, the
collectives that implies per step (with the loop structure: a weight of a ``lax.scan`` stack is
gathered once per layer), its memory effect, and how the layout is applied. The registry orders
the mesh axes, outermost first (``data`` across hosts, ``tensor`` inside an NVLink island);
:data:`AXES` and :data:`BATCH_AXES` are read from it, and candidate layouts
(:mod:`~dtenjax._src.planning.candidates`) and prices (:mod:`~dtenjax._src.planning.pricing`) ask
each role for its part. A new role is one module defining ``ROLE`` and one line in
:data:`REGISTRY`.
"""

from __future__ import annotations

from dtenjax._src.planning.roles import data
from dtenjax._src.planning.roles import expert
from dtenjax._src.planning.roles import fsdp
from dtenjax._src.planning.roles import sequence
from dtenjax._src.planning.roles import stage
from dtenjax._src.planning.roles import tensor
from dtenjax._src.planning.roles.base import Role

# outermost first: the order of the planned mesh's axes
REGISTRY: tuple[Role, ...] = (
    data.ROLE,
    stage.ROLE,
    fsdp.ROLE,
    sequence.ROLE,
    expert.ROLE,
    tensor.ROLE,
)

AXES = tuple(r.name for r in REGISTRY)
BATCH_AXES = tuple(r.name for r in REGISTRY if r.splits_batch)
BY_NAME = {r.name: r for r in REGISTRY}
# batch axes whose weight shards stay put for their products, the tokens routed to them
ROUTED_AXES = tuple(r.name for r in REGISTRY if r.routes and r.splits_batch)
# batch axes that split the batch's sequence dimension instead of its dimension 0
SEQUENCE_AXES = tuple(r.name for r in REGISTRY if r.sequence and r.splits_batch)
