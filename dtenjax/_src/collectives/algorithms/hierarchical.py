"""``hierarchical`` (XLA-native) over axes ``(outer..., inner)``: reduce-scatter inside the last
(fast, island) axis, a one-shot fold across the outer axes in their order, all-gather inside.

Order per element: ``sum_o (sum_i x[o, i])``: ranks 0..m-1 of the inner axis, then the outer
partial sums in outer-rank order.
"""

from __future__ import annotations


import jax.numpy as jnp

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


ALGORITHM = base.Algorithm(price=prices.HIERARCHICAL, all_reduce=all_reduce)
