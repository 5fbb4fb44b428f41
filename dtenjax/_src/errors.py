"""Exception types raised by dtenjax.

Every error names the offending value and says how to fix it. Where several things are wrong at
once (for example several dimensions that do not divide their mesh axes) the message lists all of
them, chex style, instead of stopping at the first.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterable


class DtenjaxError(Exception):
  """Base class of every error dtenjax raises on purpose."""


class ConfigurationError(DtenjaxError, ValueError):
  """An argument or environment setting has a value dtenjax cannot use."""


class TopologyError(DtenjaxError, ValueError):
  """A topology description is malformed or does not match the devices present."""


class MeshError(DtenjaxError, ValueError):
  """A mesh shape, axis name or device list does not fit."""


class PlacementError(DtenjaxError, ValueError):
  """An array cannot be laid out the way a placement asks."""


class CollectiveError(DtenjaxError, ValueError):
  """A collective was called with an axis, op, dtype or algorithm it cannot serve."""


class ExtensionUnavailableError(DtenjaxError, RuntimeError):
  """The native extension (or one of its capabilities) is not available in this build."""


class TransportError(DtenjaxError, RuntimeError):
  """A cross-process transport failed: a peer died, timed out, or sent something invalid."""


class CollectiveTimeoutError(TransportError, TimeoutError):
  """A wait for a peer, key or completion ran past its timeout."""


class ProcessLostError(TransportError):
  """A process of the job stopped answering (killed, stopped or cut off); names the lost rank
  and what was waited for. ``lost`` holds the ranks."""

  def __init__(self, message: str, lost: Iterable[int] = ()):
    super().__init__(message)
    self.lost = tuple(sorted(set(lost)))


class NativeError(DtenjaxError, RuntimeError):
  """Native code failed in a way no other class describes (a CUDA or system call, say)."""


class CheckpointError(DtenjaxError, RuntimeError):
  """A checkpoint is missing, incomplete, truncated or corrupted, or its save did not finish."""


class QuotaExceededError(DtenjaxError, RuntimeError):
  """A tenant asked for more connections, registered bytes or bandwidth than its quota."""


class DtenjaxWarning(UserWarning):
  """Something a user must see: a result that is probably not what was meant (the mean of values
  that do not vary, i.e. gradients already summed), a fallback to another algorithm, a deprecated
  argument. A ``UserWarning``, so Python shows it by default; filter it
  (``warnings.filterwarnings("ignore", category=dtenjax.DtenjaxWarning)``) or turn it into an
  error (``"error"``, or pytest's ``-W error::dtenjax.DtenjaxWarning``)."""


_warned: set[str] = set()


def _user_stacklevel() -> int:
  """The ``stacklevel`` of the first frame outside dtenjax and jax: the user's line."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # .../dtenjax/
  jax_file = getattr(sys.modules.get("jax"), "__file__", None)
  jax_dir = os.path.dirname(os.path.abspath(jax_file)) + os.sep if jax_file else here
  frame, level = sys._getframe(2), 2  # caller of warn_once
  while frame is not None:
    name = os.path.abspath(frame.f_code.co_filename)
    if not (name.startswith(here) or name.startswith(jax_dir) or "<frozen" in name):
      return level
    frame, level = frame.f_back, level + 1
  return 2


def warn_once(key: str, message: str) -> bool:
  """Issues ``message`` as a :class:`DtenjaxWarning` the first time ``key`` is seen in this
  process, attributed to the user's line (the first frame outside dtenjax and jax); Python's own
  filters then decide whether it shows. Returns whether it warned.

  Once per key rather than per call site: a collective traced inside a user's loop would
  otherwise repeat it per trace."""
  if key in _warned:
    return False
  _warned.add(key)
  warnings.warn(message, DtenjaxWarning, stacklevel=_user_stacklevel())
  return True


# The public classes print as dtenjax.MeshError (tracebacks, repr of the class, pickling), the
# name users catch them by, not as the module that happens to define them.
for _cls in (DtenjaxError, ConfigurationError, TopologyError, MeshError, PlacementError,
             CollectiveError, ExtensionUnavailableError, TransportError, CollectiveTimeoutError,
             NativeError, QuotaExceededError, CheckpointError, ProcessLostError,
             DtenjaxWarning):
  _cls.__module__ = "dtenjax"
del _cls


def join_problems(header: str, problems: Iterable[str]) -> str:
  """Formats several problems into one message: a header line, then one bullet per problem."""
  lines = [header]
  lines.extend(f"  - {p}" for p in problems)
  return "\n".join(lines)
