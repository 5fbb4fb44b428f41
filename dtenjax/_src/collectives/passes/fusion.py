"""Communication fusion: many small all-reduces become a few over flat buckets.

A training step reduces one gradient per parameter; each collective pays a fixed latency, so a
model with hundreds of small parameters is latency-bound. Bucketing packs the arrays, in program
order and per dtype, into flat buffers of at most ``bucket_bytes`` (default
``DTENJAX_BUCKET_BYTES``) and issues one all-reduce per buffer.

:func:`fuse_collectives` is a function transform over jaxprs: every ``lax.psum`` in existing code
waits while all work that does not need its result runs, then the waiting psums are reduced
together in buckets (``collectives/buckets.py``, built on ``substitute.py``'s interpreter).

Measured on XLA:CPU: XLA's own all-reduce combiner already merges a step's psums into one
variadic all-reduce, but it does not combine all-gathers / all-to-alls, so dtenjax's
deterministic algorithms need this pass to stay at a few collectives per step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.collectives.passes import substitute


def fuse_collectives(fn: Callable, *, bucket_bytes: int | None = None,
                     algorithm: str = "one_shot", deterministic: bool = True,
                     reproducible: bool | str = False) -> Callable:
  """``fn`` with its ``lax.psum``s deferred and bucketed into few ``dtenjax.all_reduce`` calls.

  Apply it to the per-device body (inside ``shard_map``) or to a function that contains the
  ``shard_map``. ``bucket_bytes`` defaults to ``DTENJAX_BUCKET_BYTES``.
  """
  if bucket_bytes is None:
    bucket_bytes = config.get_int("DTENJAX_BUCKET_BYTES")
  if not isinstance(bucket_bytes, (int, np.integer)) or isinstance(bucket_bytes, bool):
    raise errors.ConfigurationError(
        f"fuse_collectives: bucket_bytes={bucket_bytes!r} must be an int number of bytes, "
        "e.g. 4 << 20")
  if bucket_bytes <= 0:
    raise errors.ConfigurationError(f"fuse_collectives: bucket_bytes={bucket_bytes} must be > 0 "
                                    "(use substitute_psum for one collective per psum).")
  return substitute.substitute_psum(fn, algorithm=algorithm, deterministic=deterministic,
                                    reproducible=reproducible, bucket_bytes=bucket_bytes)
