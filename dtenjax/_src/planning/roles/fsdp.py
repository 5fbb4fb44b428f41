"""``fsdp``: parameters, gradients and optimizer state sharded, each weight gathered for compute
(ZeRO-3 / FSDP), on its own slice of the batch."""

from dtenjax._src.planning.roles.base import Role

ROLE = Role(
    name="fsdp",
    splits_batch=True,
    shards="one dimension of a state leaf (a contracted one first, the largest that divides); a "
    "table read by lookups on the dimension they index (vocab-parallel)",
    collectives="an all-gather of the weight before its product, again for the backward where "
    "the read is rematerialised (jax.checkpoint), once per layer inside a lax.scan; the gradient "
    "reduce-scattered (XLA:CPU: all-reduced); a vocab-parallel lookup all-reduces its rows",
    memory="state / fsdp per device; the gathered weight while it is used (one layer of a "
    "rematerialised scan, else kept for the backward)",
    applied="the leaf's NamedSharding; plan.jit gathers each weight where it is used",
)
