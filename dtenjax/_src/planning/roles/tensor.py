"""``tensor``: Megatron-style tensor parallelism inside an NVLink island; the batch is replicated
over it."""

import dataclasses
import math

from dtenjax._src.planning.jaxpr_reader import input_width
from dtenjax._src.planning.jaxpr_reader import output_tokens
from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.planning.roles.base import Role
from dtenjax._src.planning.roles.base import WIRE
from dtenjax._src.planning.roles.base import activation_dtype


def options(ctx: LeafContext, taken: frozenset[int]) -> list[Option]:
  """Column-parallel on a free dimension, row-parallel on a contracted one (a product's weight
  that no gather reads), vocab-parallel on the dimension a lookup-only table's gathers index."""
  t, shape, use = ctx.size, ctx.shape, ctx.use
  out = []
  if use is not None and use.groups > 1 and ungrouped(use, t, ctx.conv_groups):
    return out             # a grouped kernel 't' does not divide: XLA aborts on any split
  if use is not None and not ctx.gathered:
    out += [Option(k, "col", f"column-parallel over 'tensor' (dimension {k}, free)")
            for k in use.free if shape[k] % t == 0 and k not in taken]
    out += [Option(k, "row", f"row-parallel over 'tensor' (dimension {k}, contracted)")
            for k in use.contracted if shape[k] % t == 0 and k not in taken
            and not ungrouped(use, t, ctx.conv_groups, k)]
  if use is None and ctx.lookup is not None:
    out += [Option(k, "vocab", f"vocab-parallel over 'tensor' (dimension {k}, indexed by the "
                   "lookup: masked lookup, then an all-reduce of the rows)")
            for k in ctx.lookup[0] if shape[k] % t == 0 and k not in taken]
  return out

def ungrouped(use, t: int, groups: tuple[int, ...], dim: int | None = None) -> tuple[int, ...]:
  """The group counts that forbid splitting ``use``'s weight over 'tensor' of ``t`` devices (on
  ``dim``; None: on any dimension), empty where none does: the kernel's own
  (``use.groups``) where ``t`` does not divide it, or, for a row-parallel split (a contracted
  dimension), those of the step's grouped convolutions (``groups``,
  jaxpr_reader.convolution_groups) that ``t`` does not divide.

  XLA's SPMD partitioner aborts the process (a failed CHECK in convolution_handler.cc, no Python
  error) on a grouped convolution's kernel gradient whose input features a split over 'tensor'
  leaves holding part of a group (jaxpr_reader.convolution_groups), and its sharding propagation
  carries a split there from the grouped kernel itself and from a row-parallel weight that
  contracts the grouped layer's output features (its output's gradient split on them, the
  gradient's convolution aligned to it). Compiled on 8 CPU devices (jax 0.10.2, plain jax.jit
  with NamedShardings or plan.check, each layout in its own process; 3 x 3 convolutions of 8 ->
  32 -> 32 -> 8 features, the middle one of 4 groups, and dense layers before and after it): on
  `tensor` 8 the grouped kernel split on its output or its input features aborts, and so do the
  next convolution's kernel split on its input features alone and a dense kernel contracting the
  grouped layer's output features (per pixel, or pooled over the pixels) row-parallel; the
  kernels before it column-parallel (a convolution's, a dense per-pixel one's), a dense head's
  column split and a row split of a product's output compile. Which row split propagation
  carries onto the grouped layer depends on the other layouts (the next kernel's row split
  beside the first one's column split compiles), so none is offered in such a step. On `tensor`
  4 and 2 (dividing the 4 groups) every split compiles; an FSDP split is gathered before the
  product (compiled, fsdp 8)."""
  if use.groups > 1 and use.groups % t:
    return (use.groups,)
  if dim is None or dim in use.contracted:
    return tuple(g for g in groups if g % t)
  return ()


def sizes(ctx: MeshContext) -> list[int]:
  """Every size dividing the smallest fast island (tensor parallelism stays on NVLink)."""
  g = math.gcd(ctx.island, ctx.rest)
  return [k for k in range(1, g + 1) if g % k == 0]


def price(ctx) -> None:
  """Megatron's collectives for a weight sharded over 'tensor' (``ctx``: a PriceContext): a
  column-parallel product all-reduces its input's gradient (backward; one all-reduce shared by
  the weights that read the same input, ``WeightUse.siblings``) and, unpaired, all-gathers
  its output; a row-parallel one all-reduces its output (forward, and again where
  jax.checkpoint's backward recomputes it) and, unpaired, all-gathers its
  input's gradient (the pair terms are settled by the solver); a stacked dimension over 'tensor'
  is gathered like FSDP, twice per step."""
  use, pr, m = ctx.use, ctx.price, ctx.m
  shape = ctx.primary.shape
  if use is not None and m.size["tensor"] > 1:
    d = ctx.used["tensor"]
    # every use of a weight shared across layers (grad_parts) runs its own activation
    # collectives, as every layer of a scan (repeats) does
    tokens = use.tokens * use.repeats * use.grad_parts / ctx.batch_div
    # a convolution's output has its window positions, not its input's pixels, as tokens
    outputs = tokens * output_tokens(use) / max(1, use.tokens)
    item = use.act_itemsize
    # of the activations' dtype, not the weight's: XLA:CPU all-reduces a bfloat16 activation in
    # f32 (its all-reduce promotion; the HLO's reducer is add.clone_promoted), and all-gathers
    # it in f32 (a float16 one stays float16: the compiled HLO, tests/test_costmodel_wire.py),
    # which the Pricer prices and records (Pricer.wire)
    act = activation_dtype(use)
    width_in = input_width(use, shape)
    width_out = math.prod(shape[k] for k in use.free)
    if d in use.free:
      pr.tp = ("col", d)
      share = ctx.graph.act_share.get((ctx.primary.index, d), 0.0)
      pr.act_saving = (share * ctx.graph.activation_bytes / ctx.batch_div *
                       (1 - 1 / m.size["tensor"]))
      pr.token_saving = (ctx.graph.token_share.get((ctx.primary.index, d), 0.0) *
                         ctx.graph.token_bytes / ctx.batch_div * (1 - 1 / m.size["tensor"]) *
                         ctx.pricer.beside_s_per_byte)
      if use.input_grad:     # the input's gradient is a partial sum over 'tensor'
        nbytes = tokens * width_in * item
        if use.siblings > 1 and ctx.pricer.backend == "cpu":
          # weights reading the same input (q, k and v; gate and up; a cross-attention's k and
          # v in every decoder layer): XLA:CPU reduces their partial gradients in one tuple
          # all-reduce, one meeting of the devices that moves each operand's bytes
          ctx.price.blocking["tensor"] = ctx.price.blocking.get("tensor", 0.0) + (
              ctx.pricer.share("all_reduce", nbytes, ("tensor",), act,
                               of=nbytes * use.siblings) +
              ctx.pricer("all_reduce", 1, ("tensor",), WIRE) / use.siblings)
          ctx.price.bytes["all_reduce[tensor]"] = (ctx.price.bytes.get("all_reduce[tensor]", 0.0)
                                                   + ctx.pricer.wire(nbytes, act))
        else:
          # XLA's GPU compiler adds the siblings' partial gradients first (it reassociates
          # all-reduce(a) + all-reduce(b) into all-reduce(a + b)): one all-reduce among them
          ctx.add("all_reduce", nbytes, ("tensor",), blocking=True, times=1.0 / use.siblings,
                  dtype=act)
      # unpaired, its output is gathered, unless every reader reduces over the sharded
      # dimension (logits into the loss): XLA:CPU reduces the shards in place
      # (pairs.reduced_outputs; not seen compiled for the GPU)
      if not ((ctx.primary.index, d) in ctx.graph.reduced and ctx.pricer.backend == "cpu"):
        pr.ag_fwd_bytes = ctx.pricer.wire(outputs * width_out * item, act)
        if use.carried_input and use.repeats > 1 and ctx.pricer.backend == "cpu":
          # a loop's carry read by the product (``tanh(h @ w)`` in a fori_loop or scan): the
          # carry stays split over 'tensor', so XLA:CPU gathers it in every iteration of the
          # forward's body (the iteration's input) and once after the loop (its last output,
          # for the product that reads it), and the backward's body gathers each iteration's
          # input again from the stacked residuals (split as the carry) for the weight's
          # gradient: 2 * repeats + 1 gathers of an iteration's output where one per product
          # was priced (compiled on 8 CPU devices, `fsdp` 4 x `tensor` 2, w [128, 128] pinned
          # column-parallel, batch 64: 7 all-gathers of f32[16,128] for a loop of 3, 11 for 5;
          # -36.4 % and -40.0 % of all-gather before, scan21). The one after the loop is for a
          # carry this product makes (``carried_output``): where another product of the body
          # makes the carry (``tanh(tanh(h @ w0) @ w1)`` over two stacks pinned
          # P(None, None, 'tensor')), the gathers of w0's output are the forward's and the
          # backward's, 2 * repeats (compiled, [4, 256, 256] stacks on `fsdp` 4 x `tensor` 2 at
          # batch 64: two all-gathers of f32[16,256] in each loop's body, tensor22)
          pr.ag_fwd_bytes *= (2 * use.repeats + use.carried_output) / use.repeats
        pr.ag_fwd = ctx.pricer("all_gather", pr.ag_fwd_bytes, ("tensor",), WIRE)
      elif (ctx.primary.index, d) in ctx.graph.routed_gathers:
        # a router's logits reduced in place, but the experts' split they hand on to the gates
        # and masks is gathered where the experts' layout needs the routed tokens whole
        # (stepgraph._routed_gathers: on XLA:CPU, in float32 for bfloat16 values)
        nb, wide = ctx.graph.routed_gathers[(ctx.primary.index, d)]
        ctx.add("all_gather", nb / ctx.batch_div, ("tensor",), blocking=True, dtype=WIRE,
                wide=wide / ctx.batch_div)
      elif ((use.carried_input or use.carried_output) and use.repeats > 1
            and ctx.pricer.backend == "cpu"):
        # (or the body's last product, which makes the carry the next iteration's first
        # product reads: its output gathered for that product and again in the backward's
        # body, tensor22's two stacks above, 8 of their 16 all-gathers, none priced before)
        # a loop's carry whose every reader contracts the split features (the next
        # iteration's product, a mean after the loop: pairs.reduced_outputs), the layers of a
        # stack scanned over ``tanh(h @ w)``: XLA:CPU still gathers the carry for the next
        # iteration's product in the forward's body and each iteration's input again in the
        # backward's, 2 * repeats gathers and none after the loop (review21b, compiled on 8 CPU
        # devices, a [4, 256, 256] stack P(None, 'fsdp', 'tensor') on `fsdp` 4 x `tensor` 2 at
        # batch 64: 8 all-gathers of f32[16,256] over 'tensor', none priced, all-gather -11.1 %)
        # (no pair term: the solver takes the reduced output's column for complete)
        ctx.add("all_gather", 2 * outputs * width_out * item, ("tensor",), blocking=True,
                dtype=act)
    elif d in use.contracted:
      pr.tp = ("row", d)
      # each forward product all-reduces its output: jax.checkpoint's recomputed ones too
      forward = (output_tokens(use) * use.repeats * (use.forward_reads or use.grad_parts) /
                 ctx.batch_div)
      ctx.add("all_reduce", forward * width_out * item, ("tensor",), blocking=True, dtype=act)
      if use.input_grad:
        pr.ag_bwd_bytes = ctx.pricer.wire(tokens * width_in * item, act)
        pr.ag_bwd = ctx.pricer("all_gather", pr.ag_bwd_bytes, ("tensor",), WIRE)
  elif not ctx.vocab_axes:
    # a stacked dimension over 'tensor': gathered like FSDP
    t_shard = m.size["tensor"]
    ctx.add("all_gather", ctx.grad * t_shard, ("tensor",), blocking=False, times=2)


def sliced(ctx, zero: list[str], moved: float, uses: int) -> dict:
  """:func:`sliced_on` for each free dimension of the weight that starts a pair (dimension ->
  the layout's price where its output is sliced on it)."""
  dims = sorted({p.src_dim for p in ctx.graph.pairs if p.src == ctx.primary.index})
  out = {k: sliced_on(ctx, k, zero, moved, uses) for k in dims}
  return {k: v for k, v in out.items() if v is not None}


def sliced_on(ctx, dim: int, zero: list[str], moved: float, uses: int):
  """The price of a weight 'tensor' replicates (``ctx``: its PriceContext, priced) where its
  product's output meets, on dimension ``dim``, a pair sharded over 'tensor' (a row-parallel
  partner, beside a column-parallel one: grouped-query attention's k and v kernels where
  'tensor' does not divide the kv heads, q's and the output projection's sharded on the
  heads), or None. XLA:CPU's
  partitioner slices the output to the pair's shards in place (no collective in the forward)
  and makes the weight's backward sharded over the ``g`` devices that hold distinct slices (the
  gcd of the sliced dimension and 'tensor'): the output's gradient, partial where 'tensor' has
  more devices than slices, is all-reduced over the ``t / g`` that share one; the input's
  gradient is all-reduced over ``g`` where the weight is replicated in place, or the output's
  gradient all-gathered over ``g`` where it is gathered for its product (FSDP); the optimizer
  updates each slice and all-gathers the new parameter and state; and of FSDP's permuted pieces
  (pricing._spread_reduction) only the slice's ``1 / g`` moves. Compiled on 16 and 32 CPU
  devices (Llama 1B's 32 heads and 8 kv heads under `tensor` 16 and `fsdp` 2 x `tensor` 16, a
  small one of the same heads; Llama 8B's `fsdp` 2 x `tensor` 32 on 64): f32[16, 128, 1, 16]
  all-reduced over pairs of devices, f32[16, 128, 512] over 8 (TP) or f32[16, 128, 1, 16]
  all-gathered over 8 (FSDP x TP), the kernels' [2, 512, 8, 16] and their two moments
  all-gathered over 8 after the update. Not seen compiled for the GPU."""
  use, m, primary = ctx.use, ctx.m, ctx.primary
  t = m.size["tensor"]
  if (use is None or t < 2 or "tensor" in ctx.used or ctx.pricer.backend != "cpu"
      or use.primitive != "dot_general"):
    return None
  g = math.gcd(primary.shape[dim], t)
  pr = ctx.price
  out = dataclasses.replace(pr, blocking=dict(pr.blocking), overlappable=dict(pr.overlappable),
                            bytes=dict(pr.bytes), memory=dict(pr.memory), sliced={})
  sub = dataclasses.replace(ctx, price=out)
  tokens = use.tokens * use.repeats * use.grad_parts / ctx.batch_div
  item = use.act_itemsize
  width_in = input_width(use, primary.shape)
  width_out = math.prod(primary.shape[k] for k in use.free)
  act = activation_dtype(use)
  if t > g:
    sub.add("all_reduce", tokens * width_out / g * item, ("tensor",), blocking=True, dtype=act)
  if zero:
    sub.add("all_gather", tokens * width_out * item, ("tensor",), blocking=True, dtype=act)
  else:
    sub.add("all_reduce", tokens * width_in * item, ("tensor",), blocking=True, dtype=act)
  sub.add("all_gather", pr.memory["params"] + pr.memory["opt_state"], ("tensor",),
          blocking=False)
  # the pieces' permute (priced whole, ``uses`` times, at the bytes that move: Pricer.wire)
  # moves the slices only
  if moved:
    sub.add("ppermute", moved, zero + ["tensor"], blocking=False, times=-uses, dtype=WIRE)
    sub.add("ppermute", moved / g, zero + ["tensor"], blocking=False, times=uses, dtype=WIRE)
  return out


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
