"""``data``: replicas of the whole state, each on its own slice of the batch (data parallelism)."""

from dtenjax._src.planning.roles.base import Role

ROLE = Role(
    name="data",
    splits_batch=True,
    shards="the batch's dimension 0; no state leaf",
    collectives="one gradient all-reduce per step over the data axis, combined by XLA into few "
    "large ones and overlappable with the backward (for an FSDP leaf: of its shard only)",
    memory="none: every replica holds the state the other axes leave it",
    applied="the batch's NamedSharding; jax.jit inserts the gradient all-reduce",
)
