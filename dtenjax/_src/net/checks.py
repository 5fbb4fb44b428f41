"""Validation of values that cross into native code (the host transport's C++ layer).

Native fields are fixed-width integers and IEEE doubles: a Python int that does not fit would
wrap (``2**64`` becoming ``0``), and NaN or infinity would slip through comparisons (``nan < 0``
is False). Every value is checked here, at the Python boundary, against the range the native
field can hold, and rejected with a message that names the value and the allowed range.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from dtenjax._src import errors

U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
I64_MAX = 2**63 - 1
U64_MAX = 2**64 - 1


def _range(lo: int, hi: int) -> str:
  def fmt(v: int) -> str:
    for base, name in ((U64_MAX, "2**64-1"), (I64_MAX, "2**63-1"), (U32_MAX, "2**32-1"),
                       (I32_MAX, "2**31-1")):
      if v == base:
        return name
    return str(v)
  return f"{fmt(lo)}..{fmt(hi)}"


def integer(name: str, value: Any, lo: int, hi: int, hint: str = "") -> int:
  """``value`` as an int in [lo, hi]; ConfigurationError naming it otherwise (bools refused)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise errors.ConfigurationError(
        f"{name}={value!r} must be an integer in {_range(lo, hi)}"
        f"{'; ' + hint if hint else ''} (got {type(value).__name__}).")
  v = int(value)
  if not lo <= v <= hi:
    raise errors.ConfigurationError(
        f"{name}={v} is out of range: it must be in {_range(lo, hi)}{'; ' + hint if hint else ''}.")
  return v


def number(name: str, value: Any, lo: float, hi: float = math.inf, *, lo_open: bool = False,
           hint: str = "") -> float:
  """``value`` as a finite float in [lo, hi] (or (lo, hi] when ``lo_open``)."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise errors.ConfigurationError(
        f"{name}={value!r} must be a finite number{'; ' + hint if hint else ''} "
        f"(got {type(value).__name__}).")
  v = float(value)
  low_ok = v > lo if lo_open else v >= lo
  if not math.isfinite(v) or not low_ok or v > hi:
    bound = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if math.isfinite(hi) else "")
    raise errors.ConfigurationError(
        f"{name}={value!r} is not allowed: it must be a finite number {bound}"
        f"{'; ' + hint if hint else ''}.")
  return v


def name(what: str, value: Any) -> str:
  """A non-empty str without NUL bytes (native code treats NUL as the end)."""
  if not isinstance(value, str) or not value or "\0" in value:
    raise errors.ConfigurationError(
        f"{what}={value!r} must be a non-empty string without NUL characters.")
  return value


def problems_of(*checks) -> list[str]:
  """Runs zero-argument checks and collects every ConfigurationError message (chex style)."""
  out = []
  for check in checks:
    try:
      check()
    except errors.ConfigurationError as e:
      out.append(str(e).rstrip("."))
  return out
