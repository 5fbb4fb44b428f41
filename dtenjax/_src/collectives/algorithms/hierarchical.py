"""``hierarchical`` (XLA-native) over axes ``(outer..., inner)``: reduce-scatter inside the last
(fast, island) axis, a one-shot fold across the outer axes in their order, all-gather inside.

Order per element: ``sum_o (sum_i x[o, i])``: ranks 0..m-1 of the inner axis, then the outer
partial sums in outer-rank order.
"""

from __future__ import annotations


from dtenjax._src import jaxapi
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import two_shot
from dtenjax._src.pricing import algorithms as prices


@base.keyed
def all_reduce(x, call: base.Call, finish):
  outer, inner = call.axes[:-1], call.axes[-1]
  m = call.axis_sizes[-1]
  chunks, _ = base.chunked(x, m)
  part = two_shot.reduce_chunks(chunks, inner, call.op)
  part = base.ordered_reduce(jaxapi.all_gather_invariant(part, outer), call.op, part.dtype)
  return base.gather_flat(finish(part), (inner,), x.shape)


ALGORITHM = base.Algorithm(price=prices.HIERARCHICAL, all_reduce=all_reduce)
