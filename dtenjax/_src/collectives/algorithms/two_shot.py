"""``two_shot`` (XLA-native): all-to-all reduce-scatter, a rank-order fold of the owned chunk,
all-gather.

Order per element: ranks 0..n-1 like ``one_shot`` (same bits for every element and every buffer
layout); each rank folds only its ``1/n`` of the buffer, so it moves and adds ``n`` times less than
one_shot for large messages.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from dtenjax._src.contract import Contract
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices


def reduce_chunks(chunks, axes, op: str):
  """``[n, c]`` chunks in, rank r's chunk reduced over ranks 0..n-1 (accumulation dtype) out."""
  if chunks.shape[0] == 1:
    return chunks[0].astype(base.acc_dtype(chunks.dtype, op))
  return base.ordered_reduce(lax.all_to_all(chunks, axes, 0, 0), op)


_all_reduce, reduce_scatter = base.scatter_then_gather(reduce_chunks)


def exchanged(flat, n: int, axes) -> list:
  """``flat``'s n chunks of its last dimension written by a custom call (``cpu_ffi.split``) and
  sent through the all-to-all over ``axes``: the n chunks this rank receives, in source-rank
  order, each read where the all-to-all left it (no copy, no compiled kernel)."""
  chunks = cpu_ffi.split(flat, n)
  if n == 1:
    return chunks
  got = lax.all_to_all(jnp.stack(chunks), axes, 0, 0)
  return [got[j] for j in range(n)]


@base.keyed
def all_reduce(x, call: base.Call, finish):
  """``scatter_then_gather``'s all-reduce of :func:`reduce_chunks`; on XLA:CPU
  (``cpu_ffi.folds``) its chunks, the all-to-all's operands, are written by a custom call and
  the fold is one (the same bits, no compiled kernel)."""
  if not cpu_ffi.folds(call, x.dtype):
    return _all_reduce(x, call, finish)
  chunks = exchanged(x.reshape(-1), call.world, call.axes)
  mine = finish(cpu_ffi.fold(chunks, base.acc_dtype(x.dtype, call.op)))
  return base.gather_flat(mine, call.axes, x.shape)


def reproducible(stack, call: base.Call):
  """The reproducible sum with two_shot's data movement: the all-to-all hands rank r every
  contribution of its chunk (raw floats), rank r sums them exactly on its own
  (``reproducible.local_sum``), then the rounded chunk is all-gathered. The same bits as the word
  exchange: the exponent exchange is fused into the all-to-all (each owner sees every
  contribution), so the values travel once each way, in the input's width."""
  k, n = stack.shape[0], call.world
  flat = stack.reshape(k, -1)
  size = flat.shape[1]
  c = base.chunk_len(size, n)
  if (cpu_ffi.active_for(call) and cpu_ffi.repro_sums(k * n, stack.dtype)
      and repro.contract_for(call.contract, k * n) is Contract.V3):
    # on XLA:CPU: the chunks written by a custom call, the exact sum of what the all-to-all
    # received by another (contract v3 in C++, the same bits), no compiled kernel
    groups = exchanged(flat, n, call.axes)                    # n x [k, c]
    return base.gather_flat(cpu_ffi.repro_sum(groups, call.op, stack.dtype), call.axes,
                            stack.shape[1:])
  chunks = base.rows(jnp.pad(flat, ((0, 0), (0, n * c - size))), n, c, base.opaque_of(call))
  if n > 1:
    chunks = lax.all_to_all(chunks, call.axes, 0, 0)          # [source rank, k, c]
  # the contributions one by one: each received chunk is read where the all-to-all left it
  # (stacking them would be a copy, and on XLA:CPU a kernel of its own)
  r = repro.local_sum([chunks[j, i] for j in range(n) for i in range(k)], call.op,
                      call.contract)
  return base.gather_flat(r, call.axes, stack.shape[1:])


ALGORITHM = base.Algorithm(price=prices.TWO_SHOT, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter, reproducible=reproducible)
