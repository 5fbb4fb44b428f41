"""``fsdp``: parameters, gradients and optimizer state sharded, each weight gathered for compute
(ZeRO-3 / FSDP), on its own slice of the batch."""

from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.planning.roles.base import Role


def options(ctx: LeafContext, taken: frozenset[int]) -> list[Option]:
  """The dimension FSDP shards: a contracted one first (the largest that divides), as MaxText's
  "embed" -> fsdp rule does; sharding a free dimension over the axis that also shards the batch
  makes XLA's partitioner move activations (all-to-all) instead of gathering the weight."""
  f = ctx.size
  dims = [d for d in range(len(ctx.shape)) if d not in taken and ctx.shape[d] % f == 0 and
          ctx.shape[d] >= f]
  contracted = set(ctx.use.contracted) if ctx.use is not None else set()
  best = sorted(dims, key=lambda d: (d not in contracted, -ctx.shape[d], d))[:1]
  return [Option(d, "fsdp", f"FSDP: dimension {d} over 'fsdp'") for d in best]

def sizes(ctx: MeshContext) -> list[int]:
  """1, everything left, and HSDP: the rest of one host, or of 2, 4, ... hosts (a model whose
  state does not fit one host's devices), data parallel across those groups."""
  out = {1, ctx.rest}
  if ctx.per_host % ctx.inner == 0 and ctx.rest % (ctx.per_host // ctx.inner) == 0:
    f = ctx.per_host // ctx.inner
    while f < ctx.rest and ctx.rest % f == 0:
      out.add(f)
      f *= 2
  return sorted(out)


ROLE = Role(
    name="fsdp",
    splits_batch=True,
    shards="one dimension of a state leaf (a contracted one first, the largest that divides); a "
    "table read by lookups on the dimension they index (vocab-parallel)",
    collectives="an all-gather of the weight before its product, again for the backward where "
    "the read is rematerialised (jax.checkpoint) inside a loop, once per layer inside a lax.scan "
    "(outside a loop XLA merges the backward's gather with the forward's); the gradient "
    "reduce-scattered (XLA:CPU: all-reduced); a vocab-parallel lookup all-reduces its rows "
    "(priced on XLA:CPU; on a GPU the table is gathered like any FSDP weight); on XLA:CPU a "
    "lookup's gradient is scattered into the shard after an all-gather of its rows (where they "
    "are smaller than the table) or an all-to-all (a table sharded on its features)",
    memory="state / fsdp per device; the gathered weight while it is used (one layer of a "
    "rematerialised scan, else kept for the backward)",
    applied="the leaf's NamedSharding; plan.jit gathers each weight where it is used",
    options=options,
    sizes=sizes,
)
