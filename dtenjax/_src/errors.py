"""Exception types raised by dtenjax.

Every error names the offending value and says how to fix it. Where several things are wrong at
once (for example several dimensions that do not divide their mesh axes) the message lists all of
them, chex style, instead of stopping at the first.
"""

from __future__ import annotations

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


class NativeError(DtenjaxError, RuntimeError):
  """Native code failed in a way no other class describes (a CUDA or system call, say)."""


class QuotaExceededError(DtenjaxError, RuntimeError):
  """A tenant asked for more connections, registered bytes or bandwidth than its quota."""


# The public classes print as dtenjax.MeshError (tracebacks, repr of the class, pickling), the
# name users catch them by, not as the module that happens to define them.
for _cls in (DtenjaxError, ConfigurationError, TopologyError, MeshError, PlacementError,
             CollectiveError, ExtensionUnavailableError, TransportError, CollectiveTimeoutError,
             NativeError, QuotaExceededError):
  _cls.__module__ = "dtenjax"
del _cls


def join_problems(header: str, problems: Iterable[str]) -> str:
  """Formats several problems into one message: a header line, then one bullet per problem."""
  lines = [header]
  lines.extend(f"  - {p}" for p in problems)
  return "\n".join(lines)
