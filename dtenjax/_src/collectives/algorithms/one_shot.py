"""``one_shot`` (XLA-native): all-gather everything, then a left fold in rank order.

Order per element: ``((x_0 + x_1) + x_2) + ... + x_{n-1}`` over ranks 0..n-1 (mesh position), in
the accumulation dtype (float32 for 16-bit floats), rounded once by ``finish``. This is the bit
contract the NVLink kernels share (``gpu/p2p.py``). reduce_scatter: the same fold of the owned
block after gathering every block.
"""

from __future__ import annotations

from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.planning import costmodel


def supports(call: base.Call) -> str | None:
  return base.xla_reaches(call)


@base.keyed
def all_reduce(x, call: base.Call, finish):
  # Every rank folds the same gathered values: the result is invariant over the axes, and the
  # gather is typed so (as lax.psum's result is).
  return finish(base.ordered_reduce(jaxapi.all_gather_invariant(x, call.axes), call.op))


@base.keyed_scatter
def reduce_scatter(blocks, call: base.Call):
  flat = blocks.reshape(blocks.shape[0], -1)
  if call.world == 1:
    out = flat[0].astype(base.acc_dtype(flat.dtype, call.op))
  else:
    g = lax.all_gather(flat, call.axes)                            # [ranks, blocks, c]
    mine = lax.dynamic_index_in_dim(g, lax.axis_index(call.axes), axis=1, keepdims=False)
    out = base.ordered_reduce(mine, call.op)
  return out.reshape(blocks.shape[1:])


def reproducible(stack, call: base.Call):
  """The reproducible sum with one_shot's data movement: one all-gather of every contribution,
  summed exactly on every rank (``reproducible.gather_all_reduce``); the same bits as the word
  exchange, with no separate exponent exchange (the latency-bound form)."""
  return repro.gather_all_reduce(stack, call)


def _all_reduce_time(t: costmodel.Terms, N: float) -> float:
  """All-gather (n N written) and a fold reading n N."""
  return t.L + t.hops * t.a + (t.n - 1) * N * t.b + t.P + 2 * t.n * N * t.m


def _reduce_scatter_time(t: costmodel.Terms, N: float) -> float:
  """Gather everything, fold the owned block."""
  return t.L + t.hops * t.a + (t.n - 1) * N * t.b + t.P + (t.n + 1) * N * t.m


def _reproducible_time(t: costmodel.Terms, N: float, itemsize: int, k: int) -> float:
  """The raw floats all-gathered (``k`` per device), every rank converts all ``n k N``."""
  del itemsize
  n = t.n
  return (t.L + t.hops * t.a + (n - 1) * k * N * t.b + t.P + n * k * N * t.m +
          n * k * N * t.f)


COST = costmodel.Cost(all_reduce=_all_reduce_time, reduce_scatter=_reduce_scatter_time,
                      reproducible=_reproducible_time)

ALGORITHM = base.Algorithm(
    name="one_shot", family="one_shot",
    order="ranks 0, 1, ..., n-1 (left fold from x_0, accumulation dtype, one rounding)",
    cost=COST, supports=supports, all_reduce=all_reduce, reduce_scatter=reduce_scatter,
    reproducible=reproducible)
