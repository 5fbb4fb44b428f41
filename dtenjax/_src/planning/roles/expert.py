"""``expert``: expert parallelism (GShard, MaxText's ``expert`` axis): each weight with an expert
dimension is sharded over the axis on that dimension, and the tokens routed to an expert travel to
the devices that hold it (an all-to-all) and back; the batch is split over the axis elsewhere.

An expert dimension is one that the product reading the weight keeps as a batch dimension
(``einsum("ebcd,edf->ebcf", dispatched, w_in)``: one matrix per expert, applied to that expert's
tokens), read from the step's jaxpr by :func:`expert_dims`; the leading dimension a ``lax.scan``
slices off a stacked weight is a layer, not an expert.
"""

import math

from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.planning.roles.base import Role
from dtenjax._src.planning.roles.base import activation_dtype


def expert_dims(shape: tuple[int, ...], use) -> tuple[int, ...]:
  """The dimensions of a weight (``use``: its stepgraph.WeightUse, or None) that its product
  batches over: the stacked ones (neither contracted nor free) less the leading ones a
  ``lax.scan`` slices off, whose sizes multiply to ``use.layers``."""
  if use is None or use.primitive != "dot_general":
    return ()
  stacked = list(use.stacked)
  lead = 0
  while use.layers > 1 and lead < len(stacked) and stacked[lead] == lead and (
      math.prod(shape[:lead]) < use.layers):
    lead += 1
  if math.prod(shape[:lead]) != use.layers:
    return ()
  return tuple(d for d in stacked[lead:] if shape[d] > 1)


def experts_of(graph) -> dict[int, tuple[int, ...]]:
  """State leaf -> its expert dimensions, for every weight of ``graph`` that has some."""
  out = {}
  for leaf, use in graph.weights.items():
    dims = expert_dims(graph.leaves[leaf].shape, use)
    if dims:
      out[leaf] = dims
  return out


def options(ctx: LeafContext, taken: frozenset[int]) -> list[Option]:
  """The expert dimension of a weight whose product batches over it (each device holds
  ``experts / expert`` of the experts)."""
  return [Option(d, "expert", f"expert-parallel: dimension {d} (the experts) over 'expert'")
          for d in expert_dims(ctx.shape, ctx.use)
          if d not in taken and ctx.shape[d] % ctx.size == 0]


def sizes(ctx: MeshContext) -> list[int]:
  """1, and where the step has expert weights every size dividing their expert counts (and the
  devices left): a step without experts gets no expert axis (it would be a data axis by another
  name)."""
  if ctx.graph is None:
    return [1]
  counts = [ctx.graph.leaves[leaf].shape[d] for leaf, dims in experts_of(ctx.graph).items()
            for d in dims]
  g = math.gcd(ctx.rest, *counts) if counts else 1
  return [k for k in range(1, g + 1) if g % k == 0]


def price(ctx) -> None:
  """The all-to-alls of the routed tokens over 'expert' (``ctx``: a PriceContext): the tokens a
  product reads are sent to the devices holding their experts before it (dispatch) and its
  output is sent back after it (combine), with the gradient of each on the way back, unless the
  neighbour is itself an expert product (``w_in``'s output feeds ``w_out``: the activation
  between them stays with its expert). Each all-to-all moves one device's share of the
  dispatched activation (experts x capacity x features / the batch axes), once per product and
  loop iteration."""
  use, m = ctx.use, ctx.m
  if use is None or m.size["expert"] <= 1:
    return
  graph, leaf = ctx.graph, ctx.primary.index
  shape = ctx.primary.shape
  per_token = use.tokens * use.act_itemsize / ctx.batch_div     # tokens: of every expert
  width_in = math.prod(shape[k] for k in use.contracted)
  width_out = math.prod(shape[k] for k in use.free)
  routed = experts_of(graph)
  fed = any(p.dst == leaf and p.src in routed for p in graph.pairs)
  feeds = any(p.src == leaf and p.dst in routed for p in graph.pairs)
  # the tokens' own dtype (XLA:CPU exchanges a bfloat16 activation in float32), not the weight's
  act = activation_dtype(use)
  if not fed:          # dispatch, and its gradient (when the tokens need one)
    ctx.add("all_to_all", per_token * width_in, ("expert",), blocking=True,
            times=use.repeats * (1 + int(use.input_grad)), dtype=act)
  if not feeds:        # combine, and its gradient
    ctx.add("all_to_all", per_token * width_out, ("expert",), blocking=True,
            times=use.repeats * 2, dtype=act)


ROLE = Role(
    name="expert",
    splits_batch=True,
    shards="the expert dimension of a weight whose product batches over it (a mixture of "
    "experts' stacked expert matrices); the batch's dimension 0 elsewhere",
    collectives="blocking, per expert product and per layer: an all-to-all of the dispatched "
    "tokens to their experts before it and one of its output back after it, the same two for "
    "the gradients (none between two expert products); replicated weights' gradients "
    "all-reduced over the axis as over 'data'",
    memory="an expert weight, its gradient and optimizer state / expert per device; the "
    "dispatched activations are the same size as the tokens they came from",
    applied="the expert weight's NamedSharding; plan.jit constrains the dispatched tokens "
    "(a product's operand and output along the expert dimension) to the weight's shards, so XLA "
    "emits the all-to-alls",
    options=options,
    price=price,
    sizes=sizes,
    routes=True,
)
