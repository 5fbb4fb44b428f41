"""``xla``: XLA's own all-reduce (``lax.psum``) and reduce-scatter (``lax.psum_scatter``).

The reduction order is XLA's, which is fixed per backend for the same compiled program and mesh
where :func:`psum_order` (``pricing/algorithms.py``, which this record's ``supports`` asks)
says so (research and tests: docs/collectives.md, "Determinism"):

* XLA:CPU in one process (the in-process communicator): per element a left fold in rank (mesh
  position) order starting from +0, ``((0 + x_0) + x_1) + ...``; bf16 is promoted to f32 by XLA
  and rounded once. Participant r reduces chunk r and copies it to the others: every rank gets
  the same bits, whatever the thread timing.
* XLA:CPU across processes (gloo): gloo's ring, whose order depends on the element's chunk (size
  and n), with the finished chunks copied around: deterministic and identical on every rank.
* XLA:GPU (NCCL, or XLA's own one-/two-shot kernel): NCCL picks algorithm, protocol and channels
  from a static model, and ranks receive copies of one reduced value, so the bits are fixed for
  a fixed environment: NVLink SHARP (NVLS) off (``NCCL_NVLS_ENABLE=0``, it is not deterministic
  between calls), no CollNet, no tuner plugin. Otherwise the order is not provably fixed.

Where the order is not provably fixed, this record supports ``deterministic=True`` only for exact
reductions (integer sums, max, min). Sums are computed in the accumulation dtype (float32 for
16-bit floats) and rounded once. Float max/min reduce order keys with an integer pmax/pmin: XLA's
float pmax/pmin drop NaN (CPU: ``std::max`` from -inf; NCCL: ``fmaxf``), dtenjax propagates it.
"""

from __future__ import annotations

from jax import lax

from dtenjax._src.collectives.algorithms import base
from dtenjax._src.pricing import algorithms as prices
from dtenjax._src.pricing.algorithms import psum_order as psum_order


def all_reduce(x, call: base.Call, finish):
  if call.op in base.SUMS:
    return finish(lax.psum(x.astype(base.acc_dtype(x.dtype, call.op)), call.axes))
  red = lax.pmax if call.op == "max" else lax.pmin
  return finish(base.from_key(red(base.to_key(x, call.op), call.axes), x.dtype))


def reduce_scatter(blocks, call: base.Call):
  n = blocks.shape[0]
  flat = blocks.reshape(n, -1)
  if call.op not in base.SUMS:   # max/min: no pmax_scatter; reduce everything, keep the owned one
    red = lax.pmax if call.op == "max" else lax.pmin
    full = base.from_key(red(base.to_key(flat, call.op), call.axes), flat.dtype)
    out = lax.dynamic_index_in_dim(full, lax.axis_index(call.axes), axis=0, keepdims=False)
  elif n == 1:
    out = flat[0].astype(base.acc_dtype(flat.dtype, call.op))
  else:
    out = lax.psum_scatter(flat.astype(base.acc_dtype(flat.dtype, call.op)), call.axes,
                           scatter_dimension=0, tiled=False)
  return out.reshape(blocks.shape[1:])


ALGORITHM = base.Algorithm(price=prices.XLA, all_reduce=all_reduce,
                           reduce_scatter=reduce_scatter)
