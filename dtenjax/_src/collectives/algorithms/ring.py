"""``ring`` (XLA-native): a reduce-scatter over ``n - 1`` ``ppermute`` steps, then an all-gather.

Order: chunk ``c`` of the padded flat buffer is combined in rank order ``c+1, c+2, ..., c``
(mod n): step s sends rank r's partial of chunk ``(r-1-s) mod n`` to rank r+1, which adds its own
value (received partial first, own value second). The bits depend on the element's chunk, i.e. on
the buffer length and n, never on timing.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices


def _next(n: int) -> list[tuple[int, int]]:
  """The ring's permutation: rank i sends to rank i + 1."""
  return [(i, (i + 1) % n) for i in range(n)]


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
    recv = lax.ppermute(send, axes, _next(n))
    send = comb(recv, take((r - 2 - s) % n))
  return send


def gather_chunks(chunk, axes, n: int):
  """Ring all-gather: rank r contributes ``chunk`` as block r of ``[n, ...]``."""
  if n == 1:
    return chunk[None]
  r = lax.axis_index(axes)
  out = jnp.zeros((n,) + chunk.shape, chunk.dtype)
  out = lax.dynamic_update_index_in_dim(out, chunk, r, axis=0)
  cur = chunk
  for s in range(n - 1):
    cur = lax.ppermute(cur, axes, _next(n))
    out = lax.dynamic_update_index_in_dim(out, cur, (r - 1 - s) % n, axis=0)
  return out


_all_reduce, reduce_scatter = base.scatter_then_gather(reduce_chunks, opaque_steps=True)


@base.keyed
def all_reduce(x, call: base.Call, finish):
  """``scatter_then_gather``'s all-reduce of :func:`reduce_chunks`; on XLA:CPU
  (``cpu_ffi.folds``; ``cpu_ffi.int_sums``: int32 sums, the reproducible word exchange's) the
  first chunk sent and every step's add are custom calls reading the
  flat buffer at the ring's rank, each step written over the partial it received: the same
  order and bits, and no compiled kernel but ``lax.axis_index``'s."""
  if not (cpu_ffi.folds(call, x.dtype) or cpu_ffi.int_sums(call, x.dtype)):
    return _all_reduce(x, call, finish)
  n = call.world
  flat = x.reshape(-1)
  c = base.chunk_len(flat.shape[0], n)
  r = lax.axis_index(call.axes)
  send = cpu_ffi.ring_step(flat, r, None, n, -1, c)
  for s in range(n - 1):
    send = cpu_ffi.ring_step(flat, r, lax.ppermute(send, call.axes, _next(n)), n, -2 - s, c)
  return base.gather_flat(finish(send), call.axes, x.shape)


ALGORITHM = base.Algorithm(price=prices.RING, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter)
