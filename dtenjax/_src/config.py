"""Every environment knob dtenjax reads, in one place. All are prefixed ``DTENJAX_``.

Values are read when asked for (not at import), so tests and users can set them at run time.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from dtenjax._src import errors

logger = logging.getLogger("dtenjax")


@dataclasses.dataclass(frozen=True)
class Knob:
  name: str
  default: str
  help: str

  def raw(self) -> str:
    return os.environ.get(self.name, self.default)


KNOBS: dict[str, Knob] = {
    k.name: k
    for k in (
        Knob("DTENJAX_LOG_LEVEL", "WARNING", "logging level of the 'dtenjax' logger"),
        Knob("DTENJAX_SILENCE_FALLBACK", "0",
             "1 silences the one-line notice printed when a custom algorithm falls back to XLA"),
        Knob("DTENJAX_TOPOLOGY", "", "path of a topology JSON file to use instead of detection"),
        Knob("DTENJAX_COLLECTIVE_TIMEOUT", "60",
             "seconds a cross-process collective waits for a peer before raising"),
        Knob("DTENJAX_BIND_ADDRESS", "127.0.0.1", "address the host transport listens on"),
        Knob("DTENJAX_JOB_SECRET", "", "per-job secret authenticating transport connections"),
        Knob("DTENJAX_TRANSPORT", "auto", "host transport provider: auto, tcp or verbs"),
        Knob("DTENJAX_IB_DEVICE", "",
             "RDMA device the verbs provider opens (default: the first with an active port)"),
        Knob("DTENJAX_BUCKET_BYTES", str(4 << 20), "default bucket size of the fusion pass"),
        Knob("DTENJAX_COST_PARAMS", "",
             "path of a JSON file overriding the cost model's per-backend fixed costs "
             "(planning/costmodel.py BackendCosts), e.g. calibrated from bench/allreduce.py"),
        Knob("DTENJAX_P2P_BUFFER_BYTES", str(64 << 20),
             "bytes of the registered symmetric buffer per GPU for the NVLink kernels"),
    )
}


def get_str(name: str) -> str:
  return KNOBS[name].raw()


def get_int(name: str) -> int:
  raw = KNOBS[name].raw()
  try:
    return int(raw)
  except ValueError:
    raise errors.ConfigurationError(
        f"{name}={raw!r} is not an integer; set it to a whole number "
        f"(default {KNOBS[name].default}) or unset it.") from None


def get_float(name: str) -> float:
  raw = KNOBS[name].raw()
  try:
    return float(raw)
  except ValueError:
    raise errors.ConfigurationError(
        f"{name}={raw!r} is not a number; set it to a number "
        f"(default {KNOBS[name].default}) or unset it.") from None


def get_bool(name: str) -> bool:
  raw = KNOBS[name].raw().strip().lower()
  if raw in ("1", "true", "yes", "on"):
    return True
  if raw in ("0", "false", "no", "off", ""):
    return False
  raise errors.ConfigurationError(f"{name}={raw!r} is not a boolean; use 1 or 0.")


_said: set[str] = set()


def log_once(key: str, message: str, level: int = logging.WARNING) -> bool:
  """Logs ``message`` the first time ``key`` is seen in this process. Returns whether it logged."""
  if key in _said:
    return False
  _said.add(key)
  if not logger.handlers and not logging.getLogger().handlers:
    logging.basicConfig(format="%(name)s: %(message)s")
  logger.setLevel(get_str("DTENJAX_LOG_LEVEL").upper())
  logger.log(level, message)
  return True


def log_fallback(key: str, message: str) -> bool:
  """Logs a custom-algorithm fallback once, unless silenced by DTENJAX_SILENCE_FALLBACK=1."""
  if get_bool("DTENJAX_SILENCE_FALLBACK"):
    return False
  return log_once("fallback:" + key,
                  message + " (set DTENJAX_SILENCE_FALLBACK=1 to silence this notice)")
