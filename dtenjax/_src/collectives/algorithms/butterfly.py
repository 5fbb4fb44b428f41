"""``butterfly`` (XLA-native, power-of-two worlds): a reduce-scatter by recursive halving over
``ppermute``, then XLA's all-gather.

At step s (s = 0 .. log2(n) - 1) every rank keeps one half of the chunks it still holds, sends the
other half to its partner ``r XOR 2^s`` and adds what the partner sends back; after log2(n) steps
rank r holds chunk r reduced over every rank (the chunks start in bit-reversed order so that it is
chunk r). That is log2(n) exchanges where ``ring`` needs n - 1, with the same bytes on the links.

Order per element: the balanced binary tree over the ranks in rank order, the lower block first,
``((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7))`` for n = 8 (step s adds the partial
sums of two neighbouring blocks of 2^s ranks), in the accumulation dtype (float32 for 16-bit
floats), rounded once; the same tree for every element, whatever the buffer length.
reduce_scatter: the same tree for block r on rank r. Float max/min run on order keys.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src.collectives.algorithms import base
from dtenjax._src.planning import costmodel


def supports(call: base.Call) -> str | None:
  n = call.world
  if n & (n - 1):
    return (f"butterfly needs a power-of-two number of ranks, got {n} over "
            f"axis_name={call.axes!r}; use algorithm='two_shot' or 'ring'")
  return base.xla_reaches(call)


def _bit_reversed(n: int) -> np.ndarray:
  k = n.bit_length() - 1
  return np.array([int(f"{p:0{k}b}"[::-1], 2) if k else 0 for p in range(n)])


def reduce_chunks(chunks, axes, op: str):
  """``[n, c]`` chunks in (n a power of two), rank r's chunk reduced over every rank in tree
  order (accumulation dtype) out."""
  n = chunks.shape[0]
  chunks = chunks.astype(base.acc_dtype(chunks.dtype, op))
  if n == 1:
    return chunks[0]
  comb = base.combiner(op)
  r = lax.axis_index(axes)
  held = chunks[_bit_reversed(n)]      # position p holds chunk bitrev(p); rank r ends at bitrev(r)
  for s in range(n.bit_length() - 1):
    upper = (r >> s) & 1               # rank r keeps the upper half when bit s of r is set
    halves = held.reshape(2, held.shape[0] // 2, held.shape[1])
    mine, theirs = base.take(halves, upper), base.take(halves, 1 - upper)
    got = lax.ppermute(theirs, axes, [(i, i ^ (1 << s)) for i in range(n)])
    lower, higher = jnp.where(upper == 0, mine, got), jnp.where(upper == 0, got, mine)
    held = comb(lower, higher)         # the lower block's partial sum first
  return held[0]


all_reduce, reduce_scatter = base.scatter_then_gather(reduce_chunks)


def _reduce_scatter_time(t: costmodel.Terms, N: float) -> float:
  """log2(n) exchanges of N/2, N/4, ..., N/n (an add after each): (n-1)/n N over the links."""
  steps = t.n.bit_length() - 1
  return steps * (t.L + t.a + t.P) + (t.n - 1) / t.n * N * t.b + 2 * N * t.m


def _all_reduce_time(t: costmodel.Terms, N: float) -> float:
  """The reduce-scatter, then one all-gather of N/n from each rank."""
  gather = t.L + t.hops * t.a + (t.n - 1) / t.n * N * t.b
  return _reduce_scatter_time(t, N) + gather + N * t.m


ALGORITHM = base.Algorithm(
    name="butterfly", family="butterfly",
    order="balanced binary tree over ranks 0..n-1, lower block first: ((x_0 + x_1) + (x_2 + "
          "x_3)) + ...; the same for every element",
    cost=costmodel.Cost(all_reduce=_all_reduce_time, reduce_scatter=_reduce_scatter_time),
    supports=supports, all_reduce=all_reduce, reduce_scatter=reduce_scatter)
