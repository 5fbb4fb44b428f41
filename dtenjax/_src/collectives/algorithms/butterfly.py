"""``butterfly`` (XLA-native, power-of-two worlds): a reduce-scatter by recursive halving over
``ppermute``, then XLA's all-gather.

At step s (s = 0 .. log2(n) - 1) every rank keeps one half of the chunks it still holds, sends the
other half to its partner ``r XOR 2^s`` and adds what the partner sends back; after log2(n) steps
rank r holds chunk r reduced over every rank (the chunks start in bit-reversed order so that it is
chunk r). That is log2(n) exchanges where ``ring`` needs n - 1, with the same bytes on the links.

Order per element: the balanced binary tree over the ranks in rank order, the lower block first,
``((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7))`` for n = 8 (step s adds the partial
sums of two neighbouring blocks of 2^s ranks), in the accumulation dtype (float32 for 16-bit
floats), rounded once; the same tree for every element, whatever the buffer length. Float sums
run on inputs scaled by 2^-ceil(log2 n) (exact) so that no partial sum overflows: NaN only where
an input is NaN or both infinities occur, as with lax.psum (see :func:`_overflow_scale`).
reduce_scatter: the same tree for block r on rank r. Float max/min run on order keys.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices


def _bit_reversed(n: int) -> np.ndarray:
  k = n.bit_length() - 1
  return np.array([int(f"{p:0{k}b}"[::-1], 2) if k else 0 for p in range(n)])


def reduce_chunks(chunks, axes, op: str):
  """``[n, c]`` chunks in (n a power of two), rank r's chunk reduced over every rank in tree
  order (accumulation dtype) out."""
  n = chunks.shape[0]
  scale = _overflow_scale(chunks.dtype, op, n)
  chunks = chunks.astype(base.acc_dtype(chunks.dtype, op))
  if n == 1:
    return chunks[0]
  if scale is not None:
    chunks = chunks * jnp.asarray(1 / scale, chunks.dtype)
    return _tree(chunks, axes, op, n) * jnp.asarray(scale, chunks.dtype)
  return _tree(chunks, axes, op, n)


def _overflow_scale(dtype, op: str, n: int) -> float | None:
  """The power of two ``2^m >= n`` the inputs of a float sum are divided by (and the result
  multiplied by) so that no partial sum of the tree can overflow: a tree adds two partial sums
  that may each have overflowed, with opposite signs, into a NaN that no input and no rank-order
  fold (lax.psum) gives. Scaled, a partial sum is at most ``n * max / 2^m <= max``: the result is
  NaN only where an input is NaN or both infinities occur, and +-inf where an input is or the sum
  itself overflows. The scaling is exact, so the bits are the unscaled tree's except for inputs
  below ``2^(m - 126)``, which lose their last m bits (flushed to zero on XLA:CPU, whose adds
  flush subnormals anyway): an absolute error of at most ``n * 2^(m - 126)``. None for max/min,
  non-float dtypes and accumulators with room (float16 sums in float32)."""
  if op not in base.SUMS or n <= 1 or not jnp.issubdtype(dtype, jnp.floating):
    return None
  acc = base.acc_dtype(dtype, op)
  if float(jnp.finfo(acc).max) >= n * float(jnp.finfo(dtype).max):
    return None
  return 2.0 ** (n - 1).bit_length()


def _partners(n: int, s: int) -> list[tuple[int, int]]:
  return [(i, i ^ (1 << s)) for i in range(n)]


def _tree(chunks, axes, op: str, n: int):
  comb = base.combiner(op)
  r = lax.axis_index(axes)
  held = chunks[_bit_reversed(n)]      # position p holds chunk bitrev(p); rank r ends at bitrev(r)
  for s in range(n.bit_length() - 1):
    upper = (r >> s) & 1               # rank r keeps the upper half when bit s of r is set
    halves = held.reshape(2, held.shape[0] // 2, held.shape[1])
    mine, theirs = base.take(halves, upper), base.take(halves, 1 - upper)
    got = lax.ppermute(theirs, axes, _partners(n, s))
    lower, higher = jnp.where(upper == 0, mine, got), jnp.where(upper == 0, got, mine)
    held = comb(lower, higher)         # the lower block's partial sum first
  return held[0]


_all_reduce, reduce_scatter = base.scatter_then_gather(reduce_chunks)


@base.keyed
def all_reduce(x, call: base.Call, finish):
  """``scatter_then_gather``'s all-reduce of :func:`reduce_chunks`; on XLA:CPU
  (``cpu_ffi.folds``; ``cpu_ffi.int_sums``: int32 sums, the reproducible word exchange's) the
  bit-reversed chunks, the halves kept and sent, the adds and the
  overflow scaling are custom calls at the rank's bits (``cpu_ffi.butterfly_step``): the same
  order and bits, and no compiled kernel but ``lax.axis_index``'s."""
  n = call.world
  if n == 1 or not (cpu_ffi.folds(call, x.dtype) or cpu_ffi.int_sums(call, x.dtype)):
    return _all_reduce(x, call, finish)
  scale = _overflow_scale(x.dtype, call.op, n)
  scale_log2 = 0 if scale is None else int(np.log2(scale))
  flat = x.reshape(-1)
  c = base.chunk_len(flat.shape[0], n)
  r = lax.axis_index(call.axes)
  keep, send = cpu_ffi.butterfly_step(flat, r, None, n, -1, c, scale_log2)
  for s in range(n.bit_length() - 1):
    got = lax.ppermute(send, call.axes, _partners(n, s))
    out = cpu_ffi.butterfly_step(keep, r, got, n, s, c, scale_log2)
    if s < n.bit_length() - 2:
      keep, send = out
  return base.gather_flat(finish(out), call.axes, x.shape)


ALGORITHM = base.Algorithm(price=prices.BUTTERFLY, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter)
