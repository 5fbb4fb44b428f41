"""``ring`` (XLA-native): a reduce-scatter over ``n - 1`` ``ppermute`` steps, then an all-gather.

Order: chunk ``c`` of the padded flat buffer is combined in rank order ``c+1, c+2, ..., c``
(mod n): step s sends rank r's partial of chunk ``(r-1-s) mod n`` to rank r+1, which adds its own
value (received partial first, own value second). The bits depend on the element's chunk, i.e. on
the buffer length and n, never on timing.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices


def reduce_chunks(chunks, axes, op: str, opaque=None):
  """Ring reduce-scatter: rank r ends with chunk r reduced (accumulation dtype).

  ``opaque`` (``base.opaque``): the step numbers are read at run time, so the n - 1 steps' adds
  are one compiled kernel instead of one each."""
  n = chunks.shape[0]
  chunks = chunks.astype(base.acc_dtype(chunks.dtype, op))
  if n == 1:
    return chunks[0]
  comb = base.combiner(op)
  r = lax.axis_index(axes)
  perm = [(i, (i + 1) % n) for i in range(n)]
  c = chunks.shape[1]
  if chunks.size < 2**31:
    # chunk i as a slice of the flat buffer at i * c: read in place, and a step's kernel reads
    # c values of it (indexing the [n, c] view reads through a reshape of the whole buffer,
    # which XLA:CPU's cost model then splits over threads: measured slower on CPU)
    flat = chunks.reshape(-1)
    take = lambda i: lax.dynamic_slice_in_dim(flat, i * c, c, allow_negative_indices=False)
  else:
    take = lambda i: base.take(chunks, i)
  send = take((r - 1) % n)
  steps = opaque(tuple(range(n - 1))) if opaque is not None else range(n - 1)
  for s in steps:
    recv = lax.ppermute(send, axes, perm)
    send = comb(recv, take((r - 2 - s) % n))
  return send


def gather_chunks(chunk, axes, n: int):
  """Ring all-gather: rank r contributes ``chunk`` as block r of ``[n, ...]``."""
  if n == 1:
    return chunk[None]
  r = lax.axis_index(axes)
  perm = [(i, (i + 1) % n) for i in range(n)]
  out = jnp.zeros((n,) + chunk.shape, chunk.dtype)
  out = lax.dynamic_update_index_in_dim(out, chunk, r, axis=0)
  cur = chunk
  for s in range(n - 1):
    cur = lax.ppermute(cur, axes, perm)
    out = lax.dynamic_update_index_in_dim(out, cur, (r - 1 - s) % n, axis=0)
  return out


all_reduce, reduce_scatter = base.scatter_then_gather(reduce_chunks, opaque_steps=True)


ALGORITHM = base.Algorithm(price=prices.RING, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter)
