"""``tensor``: Megatron-style tensor parallelism inside an NVLink island; the batch is replicated
over it."""

import math

from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.planning.roles.base import Role


def options(ctx: LeafContext, taken: frozenset[int]) -> list[Option]:
  """Column-parallel on a free dimension, row-parallel on a contracted one (a product's weight
  that no gather reads), vocab-parallel on the dimension a lookup-only table's gathers index."""
  t, shape, use = ctx.size, ctx.shape, ctx.use
  out = []
  if use is not None and not ctx.gathered:
    out += [Option(k, "col", f"column-parallel over 'tensor' (dimension {k}, free)")
            for k in use.free if shape[k] % t == 0 and k not in taken]
    out += [Option(k, "row", f"row-parallel over 'tensor' (dimension {k}, contracted)")
            for k in use.contracted if shape[k] % t == 0 and k not in taken]
  if use is None and ctx.lookup is not None:
    out += [Option(k, "vocab", f"vocab-parallel over 'tensor' (dimension {k}, indexed by the "
                   "lookup: masked lookup, then an all-reduce of the rows)")
            for k in ctx.lookup[0] if shape[k] % t == 0 and k not in taken]
  return out

def sizes(ctx: MeshContext) -> list[int]:
  """Every size dividing the smallest fast island (tensor parallelism stays on NVLink)."""
  g = math.gcd(ctx.island, ctx.rest)
  return [k for k in range(1, g + 1) if g % k == 0]


def price(ctx) -> None:
  """Megatron's collectives for a weight sharded over 'tensor' (``ctx``: a PriceContext): a
  column-parallel product all-reduces its input's gradient (backward; one all-reduce shared by
  the weights that read the same input, ``WeightUse.siblings``) and, unpaired, all-gathers
  its output; a row-parallel one all-reduces its output (forward) and, unpaired, all-gathers its
  input's gradient (the pair terms are settled by the solver); a stacked dimension over 'tensor'
  is gathered like FSDP, twice per step."""
  use, pr, m = ctx.use, ctx.price, ctx.m
  shape = ctx.primary.shape
  if use is not None and m.size["tensor"] > 1:
    d = ctx.used["tensor"]
    # every use of a weight shared across layers (grad_parts) runs its own activation
    # collectives, as every layer of a scan (repeats) does
    tokens = use.tokens * use.repeats * use.grad_parts / ctx.batch_div
    item = use.act_itemsize
    width_in = math.prod(shape[k] for k in use.contracted)
    width_out = math.prod(shape[k] for k in use.free)
    if d in use.free:
      pr.tp = ("col", d)
      share = ctx.graph.act_share.get((ctx.primary.index, d), 0.0)
      pr.act_saving = (share * ctx.graph.activation_bytes / ctx.batch_div *
                       (1 - 1 / m.size["tensor"]))
      if use.input_grad:     # the input's gradient is a partial sum over 'tensor'
        nbytes = tokens * width_in * item
        if use.siblings > 1 and ctx.pricer.backend == "cpu":
          # weights reading the same input (q, k and v; gate and up; a cross-attention's k and
          # v in every decoder layer): XLA:CPU reduces their partial gradients in one tuple
          # all-reduce, one meeting of the devices that moves each operand's bytes
          ctx.price.blocking["tensor"] = ctx.price.blocking.get("tensor", 0.0) + (
              ctx.pricer.share("all_reduce", nbytes, ("tensor",), ctx.dtype) +
              ctx.pricer("all_reduce", 1, ("tensor",), ctx.dtype) / use.siblings)
          ctx.price.bytes["all_reduce[tensor]"] = (ctx.price.bytes.get("all_reduce[tensor]", 0.0)
                                                   + nbytes)
        else:
          # XLA's GPU compiler adds the siblings' partial gradients first (it reassociates
          # all-reduce(a) + all-reduce(b) into all-reduce(a + b)): one all-reduce among them
          ctx.add("all_reduce", nbytes, ("tensor",), blocking=True, times=1.0 / use.siblings)
      # unpaired, its output is gathered, unless every reader reduces over the sharded
      # dimension (logits into the loss): XLA:CPU reduces the shards in place
      # (pairs.reduced_outputs; not seen compiled for the GPU)
      if not ((ctx.primary.index, d) in ctx.graph.reduced and ctx.pricer.backend == "cpu"):
        pr.ag_fwd_bytes = tokens * width_out * item
        pr.ag_fwd = ctx.pricer("all_gather", pr.ag_fwd_bytes, ("tensor",), ctx.dtype)
    elif d in use.contracted:
      pr.tp = ("row", d)
      ctx.add("all_reduce", tokens * width_out * item, ("tensor",), blocking=True,
              times=_row_reductions(use, ctx.pricer.backend))
      if use.input_grad:
        pr.ag_bwd_bytes = tokens * width_in * item
        pr.ag_bwd = ctx.pricer("all_gather", pr.ag_bwd_bytes, ("tensor",), ctx.dtype)
  elif not ctx.vocab_axes:
    # a stacked dimension over 'tensor': gathered like FSDP
    t_shard = m.size["tensor"]
    ctx.add("all_gather", ctx.grad * t_shard, ("tensor",), blocking=False, times=2)


def _row_reductions(use, backend: str) -> int:
  """All-reduces per use of a row-parallel product's output: one per product that reads the
  weight as the forward does, so again where jax.checkpoint's backward recomputes the product,
  unless JAX dropped that recomputation (a checkpointed layer's last product, whose output no
  gradient needs). llama-1b's FSDP x TP step on a mocked 8-GPU host (module_217552, a scanned
  and checkpointed layer): 2 all-reduces of [4,2048,2048] per layer in the forward loop and 3
  in the backward's (the attention output's again, the two column-parallel input gradients),
  3645 MiB with the fsdp pieces, where one per product priced 2941. Gated on the GPU: XLA:CPU
  compiles the same (the llama-1b FSDP x TP row on 8 CPU devices: 1408 MiB = 22 x 64 MiB of
  all-reduce more than priced), but the CPU rows are priced by their own rules."""
  return use.forward_reads if backend != "cpu" else 1


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
    options=options,
    price=price,
    sizes=sizes,
)
