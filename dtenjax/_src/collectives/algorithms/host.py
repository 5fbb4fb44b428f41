"""``host_ring`` / ``host_hierarchical``: all-reduce across processes over dtenjax's host transport
(``net/hostcoll.py``: authenticated TCP or RDMA verbs rings, asynchronous FFI calls).

Used when the reduced axes span processes and either the caller asks for it
(``algorithm="ring"``/``"hierarchical"`` or the record name) or XLA's own collectives cannot
reach the other processes; ``auto`` never sends arrays through the host when XLA can do the job.
Sums run in the accumulation dtype (float32 for 16-bit floats) and round once; ring chunk ``c`` is
combined in rank order ``c, c+1, ..., c-1`` (``hostcoll.reference_ring_sum``). Float max/min run on
order keys (int32), so NaN propagates like every other algorithm.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dtenjax._src.collectives.algorithms import base
from dtenjax._src.net import hostcoll
from dtenjax._src.pricing import algorithms as prices


def _name(axes):
  return axes[0] if len(axes) == 1 else axes


def _origin(call: base.Call) -> str:
  """What the caller reduces, for the transport's fingerprint: the ring may carry a widened or
  keyed form of it (bfloat16 as float32), and ranks that differ in it must not be combined."""
  return f"{call.dtype.name} contract={call.contract.value}"


def _all_reduce(family: str, x, call: base.Call, finish):
  axis = _name(call.axes)
  if call.op in ("max", "min"):
    if base.uses_keys(x.dtype):
      k = base.to_key(x, call.op)
      wide = jnp.int32 if k.dtype.itemsize <= 4 else jnp.int64
      red = hostcoll.all_reduce(k.astype(wide), axis, algorithm=family, op=call.op, tag=call.tag,
                                origin=_origin(call))
      return finish(base.from_key(red.astype(k.dtype), x.dtype))
    return finish(hostcoll.all_reduce(x, axis, algorithm=family, op=call.op, tag=call.tag,
                                      origin=_origin(call)))
  acc = x.astype(base.acc_dtype(x.dtype, call.op))
  return finish(hostcoll.all_reduce(acc, axis, algorithm=family, op="sum", tag=call.tag,
                                    origin=_origin(call)))


def _code_max(family: str, codes, call: base.Call):
  red = hostcoll.all_reduce(codes.astype(jnp.int32), _name(call.axes), algorithm=family, op="max",
                            tag=call.tag, origin=_origin(call) + " codes")
  return red.astype(codes.dtype)


_PRICE = {"ring": prices.HOST_RING, "hierarchical": prices.HOST_HIERARCHICAL}


def _record(family: str) -> base.Algorithm:
  return base.Algorithm(
      price=_PRICE[family], all_reduce=functools.partial(_all_reduce, family),
      code_max=functools.partial(_code_max, family))


RING = _record("ring")
HIERARCHICAL = _record("hierarchical")
