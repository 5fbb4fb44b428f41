"""Bucketing: many small arrays reduced as a few flat buffers of at most ``bucket_bytes`` each.

A training step reduces one gradient per parameter; each collective pays a fixed latency, so a
model with hundreds of small parameters is latency-bound. Bucketing packs the arrays, in program
order and per dtype, into flat buffers and applies one collective per buffer.

Bits: with ``one_shot``, ``two_shot``, ``hierarchical``, deterministic ``xla`` and
``reproducible=True`` each element is reduced in an order that does not depend on where it sits in
the buffer, so the bucketed result is bit-identical to the unbucketed one (tested). ``ring`` is
deterministic too, but its order depends on the element's chunk, so bucketing can change bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np


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
                   stacked: bool = False) -> list:
  """Applies an elementwise-layout collective ``fn`` (flat array -> flat array) per bucket.

  ``stacked``: every leaf holds its local contributions on axis 0 (the same number in each), which
  ``fn`` reduces away: a bucket is then a ``[contributions, values]`` buffer and ``fn`` returns
  the ``[values]`` result. Each value is still reduced on its own, so the bits are the same as
  per leaf."""
  out: list = [None] * len(leaves)
  plan = plan_buckets([(int(np.prod(jnp.shape(l))), jnp.result_type(l)) for l in leaves],
                      bucket_bytes)
  lead = (jnp.shape(leaves[0])[0],) if stacked else ()
  for bucket in plan:
    if len(bucket) == 1:
      i = bucket[0]
      out[i] = fn(leaves[i])
      continue
    flat = jnp.concatenate([jnp.reshape(leaves[i], lead + (-1,)) for i in bucket], axis=-1)
    red = fn(flat)
    off = 0
    for i in bucket:
      shape = jnp.shape(leaves[i])[len(lead):]
      size = int(np.prod(shape))
      out[i] = red[off:off + size].reshape(shape)
      off += size
  return out
