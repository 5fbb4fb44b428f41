"""The reproducible sums on XLA's collectives: contract v3 (``reproducible=True``,
``fixed_point_v3.py``) and contract v2 (``reproducible="v2"``, formerly ``"exact"``,
``fixed_point.py``).

Three ways to move the data, all with the same bits (they depend only on the multiset of
contributions, never on the algorithm, the order or how contributions are split over devices,
``local_axis``):

* :func:`gather_all_reduce` -- one collective: all-gather the raw floats, every device sums all
  contributions exactly on its own (:func:`local_sum`). The latency-bound form (``one_shot``).
* the owner form (``two_shot``, in ``algorithms/two_shot.py``): an all-to-all of the raw floats,
  each rank sums its chunk exactly, an all-gather of the rounded chunk.
* :func:`all_reduce` -- the word exchange, for records that only all-reduce (``xla``, ``ring``,
  ``hierarchical``, the host transport): a MAX of the per-element codes (``lax.pmax``; a record may
  supply its own ``code_max``), then the SUM of the integer words (one int32 per value for v3,
  two for v2) with the record's integer all-reduce, then the decode. Integer addition is
  associative, so the record and XLA's order cannot change the result.

More than ``fixed_point_v3.MAX_CONTRIBUTIONS`` contributions need more than one word per value:
``reproducible=True`` then runs contract v2 (:func:`contract_for`). The contract arrives as a
:class:`~dtenjax._src.contract.Contract`, parsed once at the public API (``contract.parse``);
:data:`ARITHMETIC` maps each to its arithmetic (adding a contract: docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax

from dtenjax._src import jaxapi
from dtenjax._src.contract import Contract
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import fixed_point
from dtenjax._src.collectives import fixed_point_v3 as v3
from dtenjax._src.collectives.algorithms import base

class Arithmetic(NamedTuple):
  """One contract's fixed-point arithmetic, in the four steps the three data movements share.

  ``codes(stack)``: per-element codes (0..255) of the ``[k, ...]`` contributions, MAX-reduced
  over axis 0; the devices MAX-reduce them too. ``encode(stack, codes, count)``: the exact
  integer words of the stack's sum against the reduced codes, for ``count`` contributions in
  all (word axes, if any, first); the devices add them up. ``decode(words, codes, count, op,
  dtype)``: the rounded result. ``local_sum(stack, op, dtype)``: all of it on one device, the
  same bits."""
  codes: Callable
  encode: Callable
  decode: Callable
  local_sum: Callable


ARITHMETIC: dict[Contract, Arithmetic] = {
    Contract.V3: Arithmetic(
        codes=v3.stack_codes,
        encode=lambda stack, codes, count: v3.encode(stack, codes.astype(jnp.int32), count),
        decode=lambda words, codes, count, op, dtype: v3.decode(
            words, codes.astype(jnp.int32), count, op, dtype),
        local_sum=v3.local_sum),
    Contract.V2: Arithmetic(
        codes=lambda stack: jnp.max(fixed_point.codes(stack), axis=0),
        encode=lambda stack, codes, count: jnp.sum(fixed_point.encode(stack, codes), axis=1),
        decode=lambda words, codes, count, op, dtype: fixed_point.decode_f32(
            words, codes, count if op == "mean" else None).astype(dtype),
        local_sum=lambda stack, op, dtype: fixed_point.local_sum_f32(
            stack, mean=op == "mean").astype(dtype)),
}


# Contract v3's codes, encode and decode as XLA:CPU custom calls (cpu_ffi.py), the same bits;
# only the word exchange's all-reduce uses them (:func:`_arithmetic`).
_V3_CPU = ARITHMETIC[Contract.V3]._replace(
    codes=cpu_ffi.repro_codes, encode=cpu_ffi.repro_encode,
    decode=lambda words, codes, count, op, dtype: cpu_ffi.repro_decode(
        words, codes.astype(jnp.uint8), count, op, dtype))


def _arithmetic(call: base.Call, contract: Contract, dtype) -> Arithmetic:
  """:data:`ARITHMETIC`'s, or contract v3's as custom calls where ``cpu_ffi`` runs the call's
  per-element work and the dtype is float32 or bfloat16."""
  if (contract is Contract.V3 and cpu_ffi.active_for(call)
      and jnp.dtype(dtype) in cpu_ffi.FLOATS):
    return _V3_CPU
  return ARITHMETIC[contract]


def contract_for(contract: Contract, contributions: int) -> Contract:
  """The contract that runs for ``contributions`` in all: v3 needs one word per value, which
  holds up to ``fixed_point_v3.MAX_CONTRIBUTIONS`` of them; past that, contract v2."""
  if contract is Contract.V3 and not v3.supports(contributions):
    return Contract.V2
  return contract


def local_sum(stack, op: str, contract: Contract, dtype=None):
  """Reproducible sum (or mean) over axis 0 of the contributions ``stack`` on one device, rounded
  to ``dtype`` (default ``stack``'s): the same bits as the word exchange of the same
  contributions spread over devices.

  ``stack`` may be a list of the contributions (arrays of one shape) rather than one array:
  contract v3 reads them one by one, so the outputs of a collective need not be stacked into
  one buffer first (on XLA:CPU an all-to-all's outputs are separate buffers, and stacking them
  is a kernel of its own)."""
  rows = isinstance(stack, (list, tuple))
  dtype = (stack[0] if rows else stack).dtype if dtype is None else dtype
  n = len(stack) if rows else stack.shape[0]
  fixed_point.check_contributions(n)       # v3 hands more than 32 to contract v2
  contract = contract_for(contract, n)
  if rows and contract is not Contract.V3:
    stack = jnp.stack(stack)
  return ARITHMETIC[contract].local_sum(stack, op, dtype)


def gather_all_reduce(stack, call: base.Call):
  """One collective: all-gather every device's ``[k, ...]`` contributions, then sum all
  ``k * world`` of them exactly on every device. Returns the call's dtype."""
  k, n = stack.shape[0], call.world
  g = jaxapi.all_gather_invariant(stack, call.axes)                   # [n, k, ...]
  if (cpu_ffi.active_for(call) and cpu_ffi.repro_sums(n * k, stack.dtype)
      and contract_for(call.contract, n * k) is Contract.V3):        # the sum as a custom call
    r = cpu_ffi.repro_sum([g.reshape(n * k, -1)], call.op, stack.dtype)
    return r.reshape(stack.shape[1:])
  return local_sum(g.reshape((n * k,) + stack.shape[1:]), call.op, call.contract)


def _int_call(call: base.Call) -> base.Call:
  return dataclasses.replace(call, op="sum", dtype=jnp.int32, contract=Contract.NONE,
                             contributions=1)


def _u8(codes):
  """Codes (0..255) as one byte each for the MAX exchange."""
  return codes.astype(jnp.uint8)


def _code_max(codes, call: base.Call, record: base.Algorithm):
  codes = _u8(codes)
  if record.code_max is not None:
    return record.code_max(codes, call)
  return lax.pmax(codes, call.axes)


def all_reduce(stack, call: base.Call, record: base.Algorithm):
  """Reproducible sum (or mean) of ``stack`` (``[k, ...]`` local contributions) over the call's
  axes by the word exchange, with ``record`` carrying the integer words. Returns the call's
  dtype."""
  k = stack.shape[0]
  count = k * call.world
  fixed_point.check_contributions(count)
  arith = _arithmetic(call, contract_for(call.contract, count), stack.dtype)
  codes = _code_max(arith.codes(stack), call, record)
  words = arith.encode(stack, codes, count)                           # exact
  total = record.all_reduce(words, _int_call(call), lambda y: y)
  return arith.decode(total, codes, count, call.op, stack.dtype)


def reduce_scatter(blocks, call: base.Call, record: base.Algorithm):
  """Reproducible reduce-scatter: codes MAX-reduced over the full input, words reduce-scattered,
  rank r decodes block r (the same bits as the all-reduce of that block). ``blocks`` is
  ``[n, ...]``; returns the input dtype."""
  n = blocks.shape[0]
  count = call.world
  fixed_point.check_contributions(count)
  mine_of = lambda a: lax.dynamic_index_in_dim(a, lax.axis_index(call.axes) if n > 1 else 0,
                                               axis=0, keepdims=False)
  arith = ARITHMETIC[contract_for(call.contract, count)]
  codes = _code_max(arith.codes(blocks[None]), call, record)         # [n, ...]
  words = arith.encode(blocks[None], codes, count)                   # [words..., n, ...]
  words = jnp.moveaxis(words, words.ndim - blocks.ndim, 0)           # [n, words..., ...]
  mine = record.reduce_scatter(words, _int_call(call))
  return arith.decode(mine, mine_of(codes), count, call.op, blocks.dtype)
