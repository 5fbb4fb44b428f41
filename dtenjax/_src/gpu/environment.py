"""The NCCL environment dtenjax's determinism relies on, pinned when dtenjax is imported.

``algorithm="auto"`` with ``deterministic=True`` (the defaults) may use XLA's own psum on GPU only
where NCCL's reduction order is fixed (``collectives/algorithms/xla.py``). NVLink SHARP (NVLS)
reduces in the switch and is not deterministic between calls, so unless the user decided
otherwise dtenjax sets ``NCCL_NVLS_ENABLE=0`` at import, before NCCL creates its communicators
(jax creates them at the first collective it runs). On machines without NVSwitch multicast this
changes nothing; where NVLS exists, users who prefer it set ``NCCL_NVLS_ENABLE`` themselves (then
deterministic float sums use dtenjax's own algorithms) or ``DTENJAX_PIN_NCCL=0``.
``dtenjax.reproducible_step`` refuses a process with several devices where NVLS is not off
(``planning/reproducible.py``). Nothing else about NCCL is pinned: its algorithm and protocol
choice is a static function of the topology, the sizes and the environment.
"""

from __future__ import annotations

import os

from dtenjax._src import config


def pin() -> bool:
  """Sets NCCL_NVLS_ENABLE=0 when it is unset and DTENJAX_PIN_NCCL allows; returns whether it did."""
  if not config.get_bool("DTENJAX_PIN_NCCL") or "NCCL_NVLS_ENABLE" in os.environ:
    return False
  os.environ["NCCL_NVLS_ENABLE"] = "0"
  return True
