"""Every environment knob dtenjax reads, in one place. All are prefixed ``DTENJAX_``.

Values are read when asked for (not at import), so tests and users can set them at run time.

Logging: dtenjax logs through its own ``"dtenjax"`` logger, which carries a ``NullHandler`` (the
library convention) and never configures the root logger or any handler of the application.
Records propagate to whatever the application configured (``logging.basicConfig(...)`` shows
them); ``DTENJAX_LOG_LEVEL``, when set, sets the level of the ``"dtenjax"`` logger only.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from dtenjax._src import errors

logger = logging.getLogger("dtenjax")
if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
  logger.addHandler(logging.NullHandler())


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
        Knob("DTENJAX_LOG_LEVEL", "",
             "level of the 'dtenjax' logger (DEBUG, INFO, WARNING, ...); unset: the "
             "application's logging configuration decides"),
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
        Knob("DTENJAX_IBVERBS_LIBRARY", "libibverbs.so.1",
             "file (name or path) the verbs provider dlopens as libibverbs; the test suite points "
             "it at its emulated device, which is then reported as EMULATED, never as a NIC"),
        Knob("DTENJAX_LIBCRYPTO", "",
             "path of OpenSSL's libcrypto for transport authentication (default: "
             "libcrypto.so.3, then .so.1.1, then .so); without it no connection is made"),
        Knob("DTENJAX_HANDSHAKE_TIMEOUT", "10",
             "seconds an unauthenticated transport connection may take to finish its handshake"),
        Knob("DTENJAX_MAX_PENDING_HANDSHAKES", "16",
             "unauthenticated transport connections served at once; a newcomer beyond it "
             "displaces the least advanced one or is refused (docs/transport.md)"),
        Knob("DTENJAX_TRANSPORT_SEGMENT_BYTES", str(256 << 10),
             "largest frame payload of the host ring; chunks are pipelined in segments of this "
             "size (must be equal on every process)"),
        Knob("DTENJAX_BUCKET_BYTES", str(4 << 20), "default bucket size of the fusion pass"),
        Knob("DTENJAX_CPU_FFI", "1",
             "0 runs the collectives' per-element work on XLA:CPU as jnp (compiled kernels) "
             "instead of dtenjax's custom calls (the same bits; docs/collectives.md)"),
        Knob("DTENJAX_MEMORY_RESERVE", "0.1",
             "share of each device's memory the step planner (dtenjax.plan) keeps free for XLA's "
             "workspace and fragmentation: the default budget is memory x (1 - this)"),
        Knob("DTENJAX_COST_PARAMS", "",
             "path of a JSON file overriding the cost model's per-backend fixed costs "
             "(pricing/costmodel.py BackendCosts), e.g. calibrated from bench/allreduce.py"),
        Knob("DTENJAX_P2P_BUFFER_BYTES", str(64 << 20),
             "bytes of the registered symmetric buffer per GPU for the NVLink kernels"),
        Knob("DTENJAX_PIN_NCCL", "0",
             "1: import dtenjax sets NCCL_NVLS_ENABLE=0 when unset, as dtenjax.pin_nccl() does "
             "(NVLS is not deterministic); 0: importing dtenjax sets nothing"),
        Knob("DTENJAX_P2P_MAX_BLOCKS", "128",
             "most thread blocks per GPU an NVLink kernel call uses (same on every process)"),
        Knob("DTENJAX_CHECKPOINT_IO", "auto",
             "file I/O of dtenjax.checkpoint: auto (KvikIO when installed), posix or kvikio"),
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
  apply_log_level()
  logger.log(level, message)
  return True


def apply_log_level() -> None:
  """Sets the 'dtenjax' logger's level from DTENJAX_LOG_LEVEL when that is set (else leaves it)."""
  raw = get_str("DTENJAX_LOG_LEVEL").strip().upper()
  if not raw:
    return
  if not isinstance(logging.getLevelName(raw), int):
    raise errors.ConfigurationError(
        f"DTENJAX_LOG_LEVEL={raw!r} is not a logging level; use DEBUG, INFO, WARNING, ERROR or "
        "CRITICAL, or unset it.")
  logger.setLevel(raw)


def log_fallback(key: str, message: str) -> bool:
  """Says once that a custom algorithm fell back to another, unless silenced by
  DTENJAX_SILENCE_FALLBACK=1: a :class:`~errors.DtenjaxWarning` (seen without any logging set-up)
  and a record on the "dtenjax" logger."""
  if get_bool("DTENJAX_SILENCE_FALLBACK"):
    return False
  text = message + (" (set DTENJAX_SILENCE_FALLBACK=1 or filter dtenjax.DtenjaxWarning to "
                    "silence this notice)")
  if not log_once("fallback:" + key, text):
    return False
  errors.warn_once("fallback:" + key, text)
  return True
