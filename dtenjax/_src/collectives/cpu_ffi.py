"""The per-element work of the XLA-native collectives as custom calls on XLA:CPU.

XLA:CPU compiles every fused computation of a program as an LLVM module of its own (tens of
milliseconds each, whatever its size), while ``lax.psum`` of a gradient tree compiles none: a
bucket's concatenate, the chunks an all-to-all sends, the fold or the exact sum, and the copies
out of the bucket were the compile time of a bucketed or reproducible all-reduce
(docs/benchmarks.md, issue 43 item 3). Here that work is pre-compiled C++ (``csrc/cpu/``,
``custom_calls/cpu/``) called through ``jax.ffi.ffi_call``: a custom call is a thunk on XLA:CPU,
with no code generation, as the CUDA kernels are on GPU.

Each call gives the bits of the jnp formulation it replaces (tests/test_cpu_ffi.py compares them):

* :func:`pack` / :func:`unpack`: a bucket's concatenate (padded with zeros) and the copies out of
  it, and the chunks two_shot's all-to-all sends; byte copies of any dtype, differentiable (each
  is the other's transpose).
* :func:`fold`: ``base.ordered_reduce`` of float32/bfloat16 contributions, a left fold in float32
  with XLA:CPU's flushing of subnormals (its kernels run with flush-to-zero and
  denormals-are-zero, so the handler does too).
* :func:`ring_step`: a step of ring's reduce-scatter, ``recv + chunk`` with the chunk read out
  of the flat buffer at the ring's rank (``algorithms/ring.py``'s order: received partial
  first), with XLA:CPU's flushing as the fold.
* :func:`butterfly_step`: a step of butterfly's recursive halving (``algorithms/butterfly.py``:
  the chunks in bit-reversed order, scaled against overflow, the half kept and the half sent at
  the rank's bit, the lower block's partial sum first), with XLA:CPU's flushing as the fold.
* :func:`repro_codes`, :func:`repro_encode`, :func:`repro_decode`: contract v3's word exchange
  (``fixed_point_v3.stack_codes``, ``encode``, ``decode``), for the algorithms that only
  all-reduce (``reproducible.py``), IEEE arithmetic.
* :func:`repro_sum`: contract v3's local sum (``fixed_point_v3.local_sum``) of 2..32
  contributions, per element as the NVLink kernels compute it (``csrc/p2p/repro_v3.h``), with
  IEEE arithmetic.

Where: :func:`active` -- the CPU backend, manual mesh axes of one process (where XLA:CPU
compiles the kernels these replace), with the targets built. Elsewhere, without the extension,
or with ``DTENJAX_CPU_FFI=0``, the jnp formulation runs, with the same bits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import config
from dtenjax._src import ffi
from dtenjax._src import jaxapi

PACK = "dtenjax_cpu_pack"
UNPACK = "dtenjax_cpu_unpack"
FOLD = "dtenjax_cpu_fold"
RING_STEP = "dtenjax_cpu_ring_step"
BUTTERFLY = "dtenjax_cpu_butterfly"
REPRO_SUM = "dtenjax_cpu_repro_sum"
REPRO_CODES = "dtenjax_cpu_repro_codes"
REPRO_ENCODE = "dtenjax_cpu_repro_encode"
REPRO_DECODE = "dtenjax_cpu_repro_decode"
TARGETS = (PACK, UNPACK, FOLD, RING_STEP, BUTTERFLY, REPRO_SUM, REPRO_CODES, REPRO_ENCODE,
           REPRO_DECODE)
FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
MAX_CONTRIBUTIONS = 32          # the handler's contract-v3 sums (fixed_point_v3.MAX_CONTRIBUTIONS)


def built() -> bool:
  """Whether every target is in this build of the extension and registered for the CPU."""
  return all(ffi.has_target(t, "cpu") for t in TARGETS)


def active(backend: str, mesh_axes: bool = True, processes: int = 1) -> bool:
  """Whether collectives over these devices run their per-element work here: XLA:CPU, manual
  mesh axes of one process (the places ``algorithms/base.py``'s ``opaque`` serves), the targets
  built, and ``DTENJAX_CPU_FFI`` not 0."""
  if backend != "cpu" or not mesh_axes or processes != 1:
    return False
  return config.get_bool("DTENJAX_CPU_FFI") and built()


def active_for(call) -> bool:
  """:func:`active` for the devices of a ``base.Call``."""
  return active(call.backend, call.mesh_axes, call.processes)


def folds(call, dtype) -> bool:
  """Whether :func:`fold` (two_shot), :func:`ring_step` (ring) and :func:`butterfly_step` run ``call``'s float sum (or
  mean) of ``dtype``: float32 only.
  XLA:CPU runs a bfloat16 all-to-all and all-gather in float32 with conversions around them,
  which XLA fuses into jnp chunk copies and a jnp fold but must compile on their own around
  custom calls (a 12-leaf bfloat16 tree: 13 kernels with the jnp chunks and fold, 21 without)."""
  return call.op in ("sum", "mean") and jnp.dtype(dtype) == FLOATS[0] and active_for(call)


def int_sums(call, dtype) -> bool:
  """Whether :func:`ring_step` and :func:`butterfly_step` run ``call``'s sum of ``dtype``: int32 (the reproducible
  word exchange's words; an integer sum has the same bits in any order)."""
  return call.op == "sum" and jnp.dtype(dtype) == jnp.dtype(jnp.int32) and active_for(call)


def _ffi(target: str, outs, operands, aliases=None, **attrs):
  """``ffi_call`` of ``target`` (``aliases``: its ``input_output_aliases``), its results typed
  as varying over every manual axis an operand varies over (as a jnp operation's would be; an
  FFI call's results are otherwise invariant).
  ``broadcast_all``: under ``jax.vmap`` every operand gets the batch dimensions in front, which
  every handler reads as leading dimensions shared by all its buffers."""
  vma = frozenset().union(*(jaxapi.vma(x) for x in operands))
  res = jax.ffi.ffi_call(ffi.require(target), outs, vmap_method="broadcast_all",
                         input_output_aliases=aliases)(
      *operands, **{k: np.int64(v) for k, v in attrs.items()})
  res = list(res) if isinstance(res, (list, tuple)) else [res]
  return [jaxapi.to_varying(r, tuple(vma)) for r in res]


# --- copies: pack and unpack, each the other's transpose ----------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _pack(sizes: tuple[int, ...], total: int, parts):
  lead = parts[0].shape[:-1]
  return _ffi(PACK, jax.ShapeDtypeStruct(lead + (total,), parts[0].dtype), list(parts))[0]


def _pack_fwd(sizes, total, parts):
  return _pack(sizes, total, parts), None


def _pack_bwd(sizes, total, _, ct):
  return (tuple(_unpack(sizes, total, ct)),)


_pack.defvjp(_pack_fwd, _pack_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _unpack(sizes: tuple[int, ...], total: int, x):
  lead = x.shape[:-1]
  return tuple(_ffi(UNPACK, [jax.ShapeDtypeStruct(lead + (s,), x.dtype) for s in sizes], [x]))


def _unpack_fwd(sizes, total, x):
  return _unpack(sizes, total, x), None


def _unpack_bwd(sizes, total, _, cts):
  return (_pack(sizes, total, tuple(cts)),)


_unpack.defvjp(_unpack_fwd, _unpack_bwd)


def pack(parts: Sequence, total: int):
  """``[*lead, total]``: the ``[*lead, s_i]`` arrays ``parts`` (one dtype, the same leading
  dimensions) one after the other along the last axis, then zeros up to ``total``:
  ``jnp.pad(jnp.concatenate(parts, -1), ...)``."""
  parts = tuple(jnp.asarray(p) for p in parts)
  return _pack(tuple(int(p.shape[-1]) for p in parts), int(total), parts)


def unpack(x, sizes: Sequence[int]) -> list:
  """The consecutive pieces ``[*lead, s_i]`` of the last axis of ``x`` from its start, zeros where
  a piece runs past its end: ``x[..., a:a + s_i]`` of ``x`` padded with zeros."""
  x = jnp.asarray(x)
  return list(_unpack(tuple(int(s) for s in sizes), int(x.shape[-1]), x))


def split(x, n: int):
  """``x`` (``[*lead, size]``) as ``n`` chunks ``[*lead, c]``, ``c = ceil(size / n)``, the last
  ones padded with zeros: ``base.chunked``'s rows as separate arrays (an all-to-all of them,
  stacked, reads each where this call wrote it)."""
  size = x.shape[-1]
  c = -(-size // n) if size else 1
  return unpack(x, (c,) * n)


# --- folds: no derivative of their own (they run inside the collectives' custom VJPs) -----------

def fold(parts: Sequence, dtype=jnp.float32, shape=None):
  """``base.ordered_reduce(jnp.stack(parts), "sum", jnp.float32).astype(dtype)``: the left fold
  ``((p0 + p1) + p2) + ...`` in float32 of float32 or bfloat16 arrays of one shape, rounded once
  to ``dtype`` (float32 or bfloat16). With ``shape`` ``[c]``, a part may also be ``[m, c]``: its
  m rows are m contributions in order, read where they lie (no copy of a row)."""
  shape = parts[0].shape if shape is None else tuple(shape)
  return _ffi(FOLD, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), list(parts))[0]


def ring_step(flat, rank, recv, n: int, shift: int, c: int):
  """``recv + chunk`` in float32 (the chunk alone where ``recv`` is None): chunk
  ``(rank + shift) mod n`` of ``c`` values of the flat ``[*lead, size]`` float32 or bfloat16
  buffer (or all int32, :func:`int_sums`), read as if it were padded with zeros to ``n * c``;
  ``rank``: ``lax.axis_index`` of the
  ring. The result is written over ``recv`` (XLA copies it first where ``recv`` is used again):
  a ring step's received partial is read once."""
  lead = flat.shape[:-1]
  operands = [flat, rank.astype(jnp.int32)] + ([recv] if recv is not None else [])
  acc = jnp.int32 if flat.dtype == jnp.int32 else jnp.float32
  return _ffi(RING_STEP, jax.ShapeDtypeStruct(lead + (c,), acc), operands,
              {2: 0} if recv is not None else None, n=n, shift=shift)[0]


def butterfly_step(src, rank, recv, n: int, step: int, c: int, scale_log2: int):
  """Step ``step`` of butterfly's reduce-scatter over ``n`` (a power of two) ranks, float32 (or
  int32, :func:`int_sums`, with ``scale_log2`` 0).

  ``step`` -1 (``recv`` None): the flat ``[*lead, size]`` float32 buffer as ``n`` chunks of
  ``c`` values (padded with zeros) in bit-reversed order, times ``2^-scale_log2``: ``(keep,
  send)``, the halves ``[*lead, n/2, c]`` at and off the rank's bit 0. ``step`` s >= 0: ``src``
  (the kept half, ``[*lead, h, c]``) plus ``recv`` (the partner's half), the lower block's
  partial first (``src + recv`` where the rank's bit s is 0): its halves at and off bit s + 1
  as ``(keep, send)``, or at the last step (h = 1) the rank's chunk ``[*lead, c]`` times
  ``2^scale_log2``. ``rank``: ``lax.axis_index`` of the group."""
  lead = src.shape[:-1] if recv is None else src.shape[:-2]
  h = n // 2 if recv is None else src.shape[-2] // 2
  outs = ([jax.ShapeDtypeStruct(lead + (h, c), src.dtype)] * 2 if h >= 1
          else [jax.ShapeDtypeStruct(lead + (c,), src.dtype)])
  operands = [src, rank.astype(jnp.int32)] + ([recv] if recv is not None else [])
  res = _ffi(BUTTERFLY, outs, operands, n=n, step=step, scale_log2=scale_log2)
  return tuple(res) if h >= 1 else res[0]


def repro_sum(groups: Sequence, op: str, dtype):
  """Contract v3's sum (``op`` "sum") or mean of the contributions ``groups``: arrays
  ``[m_i, c]`` (float32 or bfloat16, one dtype) of ``m_i`` contributions each, ``2 <= sum(m_i)
  <= 32``, rounded to ``dtype``: ``fixed_point_v3.local_sum`` of all of them, ``[c]``."""
  lead = groups[0].shape[:-2]
  c = groups[0].shape[-1]
  return _ffi(REPRO_SUM, jax.ShapeDtypeStruct(lead + (c,), jnp.dtype(dtype)), list(groups),
              mean=int(op == "mean"))[0]


def repro_codes(stack):
  """``fixed_point_v3.stack_codes`` of the ``[k, ...]`` contributions as uint8 (``[...]``)."""
  flat = stack.reshape(stack.shape[0], math.prod(stack.shape[1:]))
  return _ffi(REPRO_CODES, jax.ShapeDtypeStruct(flat.shape[1:], jnp.uint8),
              [flat])[0].reshape(stack.shape[1:])


def repro_encode(stack, codes, count: int):
  """``fixed_point_v3.encode``: the int32 sum of the words of the ``[k, ...]`` contributions
  ``stack`` against the reduced uint8 ``codes``, for ``count`` contributions in all."""
  flat = stack.reshape(stack.shape[0], math.prod(stack.shape[1:]))
  return _ffi(REPRO_ENCODE, jax.ShapeDtypeStruct(flat.shape[1:], jnp.int32),
              [flat, codes.reshape(-1)], count=count)[0].reshape(stack.shape[1:])


def repro_decode(words, codes, count: int, op: str, dtype):
  """``fixed_point_v3.decode``: the ``dtype`` sum (or mean, ``op``) of ``count`` contributions
  from their summed int32 ``words`` and their uint8 ``codes``."""
  return _ffi(REPRO_DECODE, jax.ShapeDtypeStruct(words.shape, jnp.dtype(dtype)),
              [words, codes], count=count, mean=int(op == "mean"))[0]


def repro_sums(count: int, dtype) -> bool:
  """Whether :func:`repro_sum` takes ``count`` contributions of ``dtype``."""
  return 2 <= count <= MAX_CONTRIBUTIONS and jnp.dtype(dtype) in FLOATS
