"""``tensor``: Megatron-style tensor parallelism inside an NVLink island; the batch is replicated
over it."""

from dtenjax._src.planning.roles.base import Role

ROLE = Role(
    name="tensor",
    splits_batch=False,
    shards="a free dimension of a product's weight (column-parallel), a contracted one "
    "(row-parallel), a lookup table's indexed dimension (vocab-parallel)",
    collectives="blocking, per product and per layer: a row-parallel output all-reduced "
    "(forward), a column-parallel input gradient all-reduced (backward), an unpaired output or "
    "input gradient all-gathered; a column -> row pair keeps the activation between them sharded",
    memory="the sharded weights and state / tensor; a pair's activations / tensor",
    applied="the leaf's NamedSharding; XLA's partitioner inserts the activation collectives",
)
