"""``hierarchical`` (XLA-native) over axes ``(outer..., inner)``: reduce-scatter inside the last
(fast, island) axis, a one-shot fold across the outer axes in their order, all-gather inside.

Order per element: ``sum_o (sum_i x[o, i])``: ranks 0..m-1 of the inner axis, then the outer
partial sums in outer-rank order.

reduce_scatter: rank ``o*m + i`` owns block ``o*m + i`` (``lax.psum_scatter``'s ownership over
the same axes). An all-to-all inside the island hands inner rank i, from every island member, the
O blocks it will own across the outer ranks (``o'*m + i``), folded in inner-rank order; an
all-to-all across the outer axes hands outer rank o the island partial sums of its block, folded
in outer-rank order. Each byte crosses the outer axes once, 1/m of the input per rank (NCCL's
and HSDP's schedule), and the order per element is the all-reduce's, so rank r's block has the
bits of the all-reduce's block r. The partial sums stay in the accumulation dtype between the
two stages (float32 for bfloat16, as the all-reduce's), rounded once.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import two_shot
from dtenjax._src.pricing import algorithms as prices


@base.keyed
def all_reduce(x, call: base.Call, finish):
  """On XLA:CPU the inner chunks are written by a custom call and both folds (``cpu_ffi.folds``)
  or both int32 sums (``cpu_ffi.int_sums``) are custom calls, as two_shot's (the same bits, no
  compiled kernel)."""
  outer, inner = call.axes[:-1], call.axes[-1]
  m = call.axis_sizes[-1]
  floats, ints = cpu_ffi.folds(call, x.dtype), cpu_ffi.int_sums(call, x.dtype)
  if floats or ints:   # ints: the reproducible word exchange's int32 words
    chunks = two_shot.exchanged(x.reshape(-1), m, inner)
    if floats:
      acc = base.acc_dtype(x.dtype, call.op)
      part = cpu_ffi.fold(chunks, acc)
      # the outer partial sums' rows, in outer-rank order, read where the all-gather left them
      part = cpu_ffi.fold([jaxapi.all_gather_invariant(part, outer)], acc, part.shape)
    else:
      gathered = jaxapi.all_gather_invariant(_int_sum(chunks), outer)   # [outer ranks, c]
      part = _int_sum([gathered.reshape(-1)], gathered.shape[0])
    return base.gather_flat(finish(part), (inner,), x.shape)
  chunks, _ = base.chunked(x, m)
  part = two_shot.reduce_chunks(chunks, inner, call.op)
  part = base.ordered_reduce(jaxapi.all_gather_invariant(part, outer), call.op, part.dtype)
  return base.gather_flat(finish(part), (inner,), x.shape)


def _int_sum(buffers, rows: int = 1):
  """The sum of int32 chunks: ``buffers`` of ``rows`` chunks each, every chunk added where it
  lies by ring's step handler (``recv + chunk j`` of a flat buffer, rank 0): a wrapping integer
  sum, the same bits in any order, no compiled kernel."""
  c = buffers[0].shape[-1] // rows
  zero, acc = jnp.zeros((), jnp.int32), None
  for flat in buffers:
    for j in range(rows):
      acc = cpu_ffi.ring_step(flat, zero, acc, rows, j, c)
  return acc


@base.keyed_scatter
def reduce_scatter(blocks, call: base.Call):
  """On XLA:CPU the chunks the inner all-to-all sends are written by a custom call
  (``cpu_ffi.unpack``) and both folds (``cpu_ffi.folds``) or both int32 sums
  (``cpu_ffi.int_sums``: the reproducible reduce-scatter's words) are custom calls reading the
  received rows where they lie, as the all-reduce's (the same bits, no compiled kernel)."""
  outer, inner = call.axes[:-1], call.axes[-1]
  m = call.axis_sizes[-1]
  o = call.world // m
  flat = blocks.reshape(o, m, -1)                       # block o'*m + i' at [o', i']
  c = flat.shape[-1]
  acc = base.acc_dtype(blocks.dtype, call.op)
  floats, ints = cpu_ffi.folds(call, blocks.dtype), cpu_ffi.int_sums(call, blocks.dtype)
  # empty blocks (c == 0) take the jnp formulation: the custom calls' chunks have a value at least
  if (floats or ints) and c:
    # chunk i: [o, c], the blocks inner rank i owns across the outer ranks
    chunks = cpu_ffi.unpack(flat.reshape(o, m * c), (c,) * m)
    got = lax.all_to_all(jnp.stack(chunks), inner, 0, 0) if m > 1 else jnp.stack(chunks)
    rows = [got[j].reshape(-1) for j in range(m)]              # inner source ranks in order
    part = cpu_ffi.fold(rows, acc) if floats else _int_sum(rows)           # [o c]
    rows = two_shot.exchanged(part, o, outer)                  # outer source ranks in order
    out = cpu_ffi.fold(rows, acc) if floats else _int_sum(rows)            # [c]
    return out.reshape(blocks.shape[1:])
  chunks = jnp.swapaxes(flat, 0, 1).reshape(m, o * c)
  part = two_shot.reduce_chunks(chunks, inner, call.op)             # [o c], accumulation dtype
  out = two_shot.reduce_chunks(part.reshape(o, c), outer, call.op)  # [c]
  return out.reshape(blocks.shape[1:])


ALGORITHM = base.Algorithm(price=prices.HIERARCHICAL, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter)
