"""``sequence``: context parallelism (MaxText's ``context`` axis, PyTorch's ``context_parallel``):
the batch's sequence dimension and every activation's are sharded over the axis, weights are
replicated over it (or sharded by ``fsdp`` on another axis) and their gradients reduced over it
as over ``data``; each self-attention all-gathers its keys and values over the axis (their
cotangents are reduced back in the backward). Ring attention is not built: the gather is not
overlapped with the scores' blocks.

It pays where the batch cannot be split over all devices (a long sequence, a global batch of a
few sequences): without it, the devices the batch leaves would compute the same step twice, which
the planner never proposes. It is offered only where :mod:`~dtenjax._src.planning.sequence` finds
a sequence dimension (a self-attention over a dimension of the batch), in sizes that divide its
length.
"""

from __future__ import annotations

import math

from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Role
from dtenjax._src.planning import sequence as seq_lib

AXIS = "sequence"


def sizes(ctx: MeshContext) -> list[int]:
  """1, and where the batch cannot be split over the devices left, every size dividing both
  the step's sequence length and those devices (planning/sequence.py's sizes)."""
  facts = getattr(ctx.graph, "sequence", None) if ctx.graph is not None else None
  return seq_lib.sizes(facts, ctx.rest)


def row_div(m) -> int:
  """The devices the batch's dimension 0 is split over: every batch axis's but this one's."""
  return math.prod(size for a, size in m.size.items() if a != AXIS and a in m.batch_axes)


def leaf_div(leaf, m, graph) -> int:
  """How many shards of a batch leaf the ``sequence`` axis makes (1: the leaf has no sequence
  dimension)."""
  facts = getattr(graph, "sequence", None)
  size = m.size.get(AXIS, 1)
  return size if size > 1 and facts is not None and leaf.index in facts.dims else 1


def reduction_groups(axes: list[str]) -> list[list[str]]:
  """The all-reduces of a replicated weight's gradient over the batch ``axes``: XLA's partitioner
  reduces the part summed over the sequence's shards on its own, then the batch's (two
  all-reduces of the whole gradient, measured on XLA:CPU)."""
  if AXIS in axes and len(axes) > 1:
    return [[AXIS], [a for a in axes if a != AXIS]]
  return [axes]


def adjust(prob, graph, pricer) -> None:
  """The keys' and values' collectives on a mesh with a ``sequence`` axis, layout-independent:
  per attention and loop trip, an all-gather of the keys and of the values over the axis
  (``plan.jit`` constrains them, as MaxText gathers them) and, in the backward, a reduction of
  their cotangents (XLA:CPU all-reduces them; the GPU compiler reduce-scatters). Memory: the
  gathered keys and values of every layer are kept for the backward, and one layer's
  whole-sequence cotangents are alive until their reduction. An attention inside
  ``jax.checkpoint`` is gathered again where the backward recomputes it, and only one layer's
  gathered keys and values are alive at a time."""
  m = prob.m
  size = m.size.get(AXIS, 1)
  facts = getattr(graph, "sequence", None)
  if size <= 1 or facts is None:
    return
  rows = row_div(m)
  rs = "all_reduce" if pricer.backend == "cpu" else "reduce_scatter"
  t = nb_ag = nb_rs = kept = cotangent = 0.0
  recomputed = any(a.recomputed for a in facts.attention)
  for a in facts.attention:
    kv = (a.k_bytes + a.v_bytes) / rows
    # of the keys' dtype (XLA:CPU gathers a bfloat16 one in float32: priced and recorded at
    # what moves, Pricer.wire; before, every attention was priced as float32 bytes, a bfloat16
    # one's at half what moves on CPU)
    t += a.repeats * (pricer("all_gather", a.k_bytes / rows, [AXIS], a.dtype) +
                      pricer("all_gather", a.v_bytes / rows, [AXIS], a.dtype))
    nb_ag += a.repeats * pricer.wire(kv, a.dtype)
    cotangent = max(cotangent, kv)
    if a.recomputed:
      continue
    t += a.repeats * pricer(rs, kv, [AXIS], a.dtype)
    nb_rs += a.repeats * pricer.wire(kv, a.dtype)
    kept += a.repeats * kv
  if recomputed:
    kept = cotangent
  prob.fixed_blocking[AXIS] = prob.fixed_blocking.get(AXIS, 0.0) + t
  prob.fixed_bytes[f"all_gather[{AXIS}]"] = nb_ag
  prob.fixed_bytes[f"{rs}[{AXIS}]"] = nb_rs
  prob.fixed_memory["gathered"] = prob.fixed_memory.get("gathered", 0.0) + kept + cotangent


def notes(graph, m, cost) -> tuple[str, ...]:
  """The report's line on the sequence axis of the chosen mesh ``m`` (none without one)."""
  facts = getattr(graph, "sequence", None)
  size = m.size.get(AXIS, 1)
  if size <= 1 or facts is None:
    return ()
  gathered = cost.collective_bytes.get(f"all_gather[{AXIS}]", 0.0)
  calls = sum(a.repeats for a in facts.attention if not a.recomputed)
  return (f"sequence: the batch's {facts.rows} sequences of {facts.length} tokens split over "
          f"{row_div(m)} devices and each sequence over 'sequence' x{size} "
          f"({facts.length // size} tokens per device); {calls} attention calls per step gather "
          f"their keys and values over it, {gathered / 2**20:.2f} MiB per step and device "
          "(ring attention is not built)",)


ROLE = Role(
    name=AXIS,
    splits_batch=True,
    shards="no state leaf: the batch's sequence dimension (found by following the batch through "
    "the step to a self-attention), and with it every activation's",
    collectives="per self-attention and loop trip: an all-gather of its keys and values over the "
    "axis, and a reduction of their cotangents in the backward (XLA:CPU: all-reduce; GPU: "
    "reduce-scatter); replicated weights' gradients all-reduced over the axis (separately from "
    "'data')",
    memory="activations / sequence per device, plus the gathered keys and values kept for the "
    "backward",
    applied="the batch's NamedSharding on its sequence dimension; plan.jit constrains each "
    "attention's keys and values to their gathered layout and its queries to the sharded one, "
    "inside the lax.scan body where the layers are scanned",
    sizes=sizes,
    sequence=True,
)
