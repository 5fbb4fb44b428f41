"""``hierarchical`` (XLA-native) over axes ``(outer..., inner)``: reduce-scatter inside the last
(fast, island) axis, a one-shot fold across the outer axes in their order, all-gather inside.

Order per element: ``sum_o (sum_i x[o, i])``: ranks 0..m-1 of the inner axis, then the outer
partial sums in outer-rank order.
"""

from __future__ import annotations


from dtenjax._src import jaxapi
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import two_shot
from dtenjax._src.planning import costmodel


def supports(call: base.Call) -> str | None:
  if len(call.axes) < 2:
    return (f"hierarchical needs two mesh axes (islands, devices per island), got "
            f"axis_name={call.axes!r}; pass e.g. axis_name=('host', 'local') or use "
            "algorithm='two_shot'/'ring'")
  return base.xla_reaches(call)


@base.keyed
def all_reduce(x, call: base.Call, finish):
  outer, inner = call.axes[:-1], call.axes[-1]
  m = call.axis_sizes[-1]
  chunks, size = base.chunked(x, m)
  part = two_shot.reduce_chunks(chunks, inner, call.op)
  part = base.ordered_reduce(jaxapi.all_gather_invariant(part, outer), call.op, part.dtype)
  mine = finish(part)
  full = jaxapi.all_gather_invariant(mine, (inner,), tiled=True)
  return full[:size].reshape(x.shape)


def _all_reduce_time(t: costmodel.Terms, N: float) -> float:
  """Inner all-to-all reduce-scatter, one-shot of N/k across islands, inner all-gather; inf
  without a proper island split of the group."""
  s = t.split()
  if s is None:
    return costmodel.INF
  inner = 2 * (t.L + s.ia + (s.k - 1) / s.k * N * s.ib)
  outer = t.L + s.outer_hops * s.oa + (s.m - 1) * (N / s.k) * s.ob
  return inner + outer + 2 * t.P + (3 * N + 2 * s.m * N / s.k) * t.m


COST = costmodel.Cost(all_reduce=_all_reduce_time)

ALGORITHM = base.Algorithm(
    name="hierarchical", family="hierarchical",
    order="sum over outer ranks (in order) of the inner-axis sums (ranks 0..m-1)",
    cost=COST, supports=supports, all_reduce=all_reduce)
