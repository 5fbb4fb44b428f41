"""Bucketing: many small arrays reduced as a few flat buffers of at most ``bucket_bytes`` each.

A training step reduces one gradient per parameter; each collective pays a fixed latency, so a
model with hundreds of small parameters is latency-bound. Bucketing packs the arrays, in program
order and per dtype, into flat buffers and applies one collective per buffer.

Bits: with ``one_shot``, ``two_shot``, ``hierarchical``, deterministic ``xla`` and
``reproducible=True`` each element is reduced in an order that does not depend on where it sits in
the buffer, so the bucketed result is bit-identical to the unbucketed one (tested). ``ring`` is
deterministic too, but its order depends on the element's chunk, so bucketing can change bits.

Compile time: each leaf leaves the reduced buffer through a slice, and XLA compiles a kernel per
distinct fused computation (XLA:CPU: a separate LLVM module each, tens of milliseconds). A slice
at a constant offset is a computation of its own per leaf: 60 leaves, 60 kernels. With
``offsets`` (a function turning the Python offsets into traced int32 scalars that XLA cannot
fold into the kernel), every leaf takes a ``dynamic_slice`` at a runtime offset, and the leaves of
one shape share one kernel: the kernels grow with the distinct shapes, not with the leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class Copies(NamedTuple):
  """How a bucket is packed and unpacked without a compiled kernel (``cpu_ffi.pack`` and
  ``unpack``): ``pack(parts, total)`` lays the ``[*lead, s_i]`` parts one after the other and
  pads with zeros to ``total``, ``unpack(x, sizes)`` cuts the pieces back out of the reduced
  ``[>= sum(sizes)]`` buffer. The bucket is padded to a multiple of ``multiple`` (the world size):
  an algorithm that splits it into that many equal chunks then pads nothing and slices nothing
  off (a copy each, and a kernel each on XLA:CPU). The bits stay those of the unpadded bucket:
  every algorithm reduces each element on its own, and ring's chunks keep their bounds (a chunk
  is ``ceil(size / world)`` values either way)."""
  pack: Callable
  unpack: Callable
  multiple: int = 1


def plan_buckets(sizes_dtypes: Sequence[tuple[int, object]], bucket_bytes: int) -> list[list[int]]:
  """Groups leaf indices into buckets: same dtype, program order, at most ``bucket_bytes`` each.

  ``sizes_dtypes`` holds (element count, dtype) per leaf. A leaf bigger than the bucket gets a
  bucket of its own. Deterministic: depends only on the sizes, dtypes and order.
  """
  buckets: list[list[int]] = []
  open_: dict[str, tuple[list[int], int]] = {}
  for i, (size, dtype) in enumerate(sizes_dtypes):
    dt = jnp.dtype(dtype)
    nbytes = int(size) * dt.itemsize
    cur = open_.get(dt.name)
    if cur is not None and cur[1] + nbytes <= bucket_bytes:
      cur[0].append(i)
      open_[dt.name] = (cur[0], cur[1] + nbytes)
      continue
    new = [i]
    buckets.append(new)
    open_[dt.name] = (new, nbytes)
  return buckets


def bucketed_apply(leaves: Sequence, fn: Callable, bucket_bytes: int, *,
                   stacked: bool = False, offsets: Callable | None = None,
                   copies: Copies | None = None) -> list:
  """Applies an elementwise-layout collective ``fn`` (flat array -> flat array) per bucket.

  ``stacked``: every leaf holds its local contributions on axis 0 (the same number in each), which
  ``fn`` reduces away: a bucket is then a ``[contributions, values]`` buffer and ``fn`` returns
  the ``[values]`` result. Each value is still reduced on its own, so the bits are the same as
  per leaf. ``offsets``: ``tuple[int] -> tuple[int32 scalar]``, the same values as traced scalars
  the compiler cannot see through; the leaves then leave the bucket through ``dynamic_slice``s
  that share a kernel per shape (the module docstring), with the same bits (a copy is a copy)."""
  out: list = [None] * len(leaves)
  plan = plan_buckets([(int(np.prod(jnp.shape(l))), jnp.result_type(l)) for l in leaves],
                      bucket_bytes)
  lead = (jnp.shape(leaves[0])[0],) if stacked else ()
  for bucket in plan:
    if len(bucket) == 1:
      i = bucket[0]
      out[i] = fn(leaves[i])
      continue
    if copies is not None:
      shapes = [jnp.shape(leaves[i])[len(lead):] for i in bucket]
      sizes = [int(np.prod(shape)) for shape in shapes]
      total = -(-sum(sizes) // copies.multiple) * copies.multiple
      flat = copies.pack([jnp.reshape(leaves[i], lead + (-1,)) for i in bucket], total)
      for i, part, shape in zip(bucket, copies.unpack(fn(flat), sizes), shapes):
        out[i] = part.reshape(shape)
      continue
    flat = jnp.concatenate([jnp.reshape(leaves[i], lead + (-1,)) for i in bucket], axis=-1)
    red = fn(flat)
    shapes = [jnp.shape(leaves[i])[len(lead):] for i in bucket]
    sizes = [int(np.prod(shape)) for shape in shapes]
    starts = [int(s) for s in np.cumsum([0] + sizes[:-1])]
    if offsets is not None and int(np.sum(sizes)) < 2**31:
      for i, start, size, shape in zip(bucket, offsets(tuple(starts)), sizes, shapes):
        out[i] = lax.dynamic_slice_in_dim(red, start, size,
                                          allow_negative_indices=False).reshape(shape)
      continue
    for i, start, size, shape in zip(bucket, starts, sizes, shapes):
      out[i] = red[start:start + size].reshape(shape)
  return out
