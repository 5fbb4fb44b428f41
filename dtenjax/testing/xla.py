"""What benchmarks compile against besides dtenjax's defaults: XLA's option keys, the
reproducibility pins one at a time, the custom-call steps switched off, the FFI targets built
(``TOPK_TARGET``: the kernel of ``dtenjax.compression.pack(pack="ffi")``), and the loop trip
counts that weigh compiled collectives.

Each names a piece of dtenjax's own machinery so that a benchmark's "before" or "baseline" row is
the form dtenjax really replaces (not a copy of it that could drift). For benchmarks and tests;
not part of the library's API.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from dtenjax._src.compression.topk import TARGET as TOPK_TARGET
from dtenjax._src.ffi import has_target as has_ffi_target
from dtenjax._src.gpu.graph_policy import OPT_PROFILING as OPT_PROFILING
from dtenjax._src.gpu.graph_policy import accepted_option_keys as accepted_option_keys
from dtenjax._src.planning.check import loop_repeats as loop_repeats
from dtenjax._src.planning.reproducible import GPU_PINS as GPU_PINS

__all__ = ["GPU_PINS", "OPT_PROFILING", "TOPK_TARGET", "accepted_option_keys", "has_ffi_target", "jnp_steps",
           "loop_repeats"]


@contextlib.contextmanager
def jnp_steps() -> Iterator[None]:
  """Within it, XLA:CPU collectives trace their steps as jnp (chunk copies and a jnp fold) instead
  of dtenjax's custom-call steps: the form before those steps, which bench/compile_time.py's
  "(jnp steps)" rows compile beside the current one."""
  from unittest import mock

  from dtenjax._src.collectives import cpu_ffi
  with mock.patch.object(cpu_ffi, "folds", lambda call, dtype: False):
    yield
