"""``reproducible=True`` on XLA's collectives: contract v2 (``fixed_point.py``) as three exchanges.

1. each contribution's uint8 code, the local max over stacked contributions, then a MAX across
   devices (``lax.pmax``, one byte per element; a record may supply its own ``code_max``);
2. the contributions encoded against the reduced codes into int32 ``(hi, lo)`` words, summed
   locally, then a SUM across devices of the stacked ``[2, ...]`` words with the chosen
   algorithm's integer all-reduce (or reduce-scatter): integer addition is associative, so the
   algorithm and XLA's order cannot change the result;
3. decode to float32, divide for ``mean``, round once to the output dtype.

The bits depend only on the multiset of contributions, not on the algorithm nor on how the
contributions are split over devices (``local_axis``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives.algorithms import base


def _int_call(call: base.Call) -> base.Call:
  return dataclasses.replace(call, op="sum", dtype=jnp.int32, reproducible=False,
                             contributions=1)


def _code_max(codes, call: base.Call, record: base.Algorithm):
  if record.code_max is not None:
    return record.code_max(codes, call)
  return lax.pmax(codes, call.axes)


def all_reduce(stack, call: base.Call, record: base.Algorithm):
  """Reproducible sum (or mean) of ``stack`` (``[k, ...]`` local contributions) over the call's
  axes, with ``record`` carrying the integer words. Returns the call's dtype."""
  k = stack.shape[0]
  fixed_point.check_contributions(k * call.world)
  codes = _code_max(jnp.max(fixed_point.codes(stack), axis=0), call, record)
  words = jnp.sum(fixed_point.encode(stack, codes), axis=1)          # [2, ...], exact
  total = record.all_reduce(words, _int_call(call), lambda y: y)
  r = fixed_point.decode_f32(total, codes)
  if call.op == "mean":
    r = fixed_point.divide(r, k * call.world)
  return r.astype(stack.dtype)


def reduce_scatter(blocks, call: base.Call, record: base.Algorithm):
  """Reproducible reduce-scatter: codes MAX-reduced over the full input, words reduce-scattered,
  rank r decodes block r. ``blocks`` is ``[n, ...]``; returns float32 (the caller casts)."""
  n = blocks.shape[0]
  fixed_point.check_contributions(call.world)
  codes = _code_max(fixed_point.codes(blocks), call, record)         # [n, ...]
  words = jnp.moveaxis(fixed_point.encode(blocks, codes), 1, 0)     # [n, 2, ...]
  mine = record.reduce_scatter(words, _int_call(call))               # [2, ...]
  my_codes = lax.dynamic_index_in_dim(codes, lax.axis_index(call.axes) if n > 1 else 0,
                                      axis=0, keepdims=False)
  r = fixed_point.decode_f32(mine, my_codes)
  return fixed_point.divide(r, call.world) if call.op == "mean" else r
