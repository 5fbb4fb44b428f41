"""The NCCL environment dtenjax's deterministic XLA path relies on, pinned when asked.

``algorithm="auto"`` with ``deterministic=True`` (the defaults) may use XLA's own psum on GPU only
where NCCL's reduction order is fixed (``collectives/algorithms/xla.py``): NVLink SHARP (NVLS)
reduces in the switch and is not deterministic between calls, so the XLA record claims
determinism for float sums only when ``NCCL_NVLS_ENABLE=0`` is in the environment, and otherwise
deterministic float sums use dtenjax's own algorithms. NCCL reads the variable when jax creates
its communicators (at the first collective), so it must be set before that:
``dtenjax.pin_nccl()`` does it explicitly, or ``DTENJAX_PIN_NCCL=1`` in the environment has
``import dtenjax`` do it. Importing dtenjax changes no environment variable by default; the
``dtenjax`` command line (an application, cli/main.py) pins it, and so does the test suite. A value
the user set is never overwritten. ``dtenjax.reproducible_step`` refuses a process with several
devices where NVLS is not off (``planning/reproducible.py``). Nothing else about NCCL is pinned.
"""

from __future__ import annotations

import os

from dtenjax._src import config


def pin() -> bool:
  """Sets ``NCCL_NVLS_ENABLE=0`` (NVLink SHARP off, so that XLA's GPU all-reduce is deterministic)
  unless the variable is already set; returns whether it set it. Call it before the first
  collective runs (NCCL reads the variable when jax creates its communicators)."""
  if "NCCL_NVLS_ENABLE" in os.environ:
    return False
  os.environ["NCCL_NVLS_ENABLE"] = "0"
  return True


def pin_if_asked() -> bool:
  """What ``import dtenjax`` does: :func:`pin` only when ``DTENJAX_PIN_NCCL=1``."""
  return pin() if config.get_bool("DTENJAX_PIN_NCCL") else False
