"""``one_shot`` (XLA-native): all-gather everything, then a left fold in rank order.

Order per element: ``((x_0 + x_1) + x_2) + ... + x_{n-1}`` over ranks 0..n-1 (mesh position), in
the accumulation dtype (float32 for 16-bit floats), rounded once by ``finish``. This is the bit
contract the NVLink kernels share (``gpu/p2p.py``). reduce_scatter: the same fold of the owned
block after gathering every block.
"""

from __future__ import annotations

from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices


@base.keyed
def all_reduce(x, call: base.Call, finish):
  """Every rank folds the same gathered values: the result is invariant over the axes, and the
  gather is typed so (as lax.psum's result is). On XLA:CPU (``cpu_ffi.folds``) the fold is a
  custom call reading the gathered rows where they lie (the same bits, no compiled kernel)."""
  if cpu_ffi.folds(call, x.dtype) and call.world > 1:
    gathered = jaxapi.all_gather_invariant(x.reshape(-1), call.axes)      # [n, size]
    acc = base.acc_dtype(x.dtype, call.op)
    return finish(cpu_ffi.fold([gathered], acc, (x.size,)).reshape(x.shape))
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


ALGORITHM = base.Algorithm(price=prices.ONE_SHOT, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter, reproducible=reproducible)
