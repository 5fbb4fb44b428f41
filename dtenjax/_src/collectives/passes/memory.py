"""Memory plan report: liveness of every intermediate buffer of a step, and a reuse plan.

:func:`memory_plan` traces ``fn`` to a jaxpr, gives each value produced by an equation a buffer
id, computes its live range ``[def, last use]`` (equation indices; inputs are live from -1 and
outputs until the end), and assigns it to a reuse slot greedily: a slot is free again once the
buffer holding it is dead, and it is reused only by a buffer of the same size in bytes. The
result sits next to what XLA itself plans (``compiled.memory_analysis()``), so the two can be
compared: XLA fuses and schedules, so its temp size is usually smaller than the jaxpr estimate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from dtenjax._src import errors
from dtenjax._src import tables


@dataclasses.dataclass(frozen=True)
class BufferRow:
  buffer_id: int
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  start: int            # equation index that defines it (-1: an input)
  end: int              # last equation index that reads it (len(eqns): an output)
  slot: int             # reuse slot: buffers in one slot never overlap in time
  producer: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
  rows: tuple[BufferRow, ...]
  peak_live_bytes: int        # max over time of the bytes of live buffers
  planned_bytes: int          # sum of slot sizes after reuse
  naive_bytes: int            # sum of all buffers (no reuse)
  xla: dict[str, int]         # compiled.memory_analysis() fields, when available
  xla_unavailable: str = ""   # why ``xla`` is empty (e.g. the compile's own error)

  def table(self) -> str:
    """One row per buffer (``live``: the equations from its definition to its last read), then
    the totals and XLA's own numbers."""
    rows = [(r.buffer_id, str(r.shape), r.dtype, r.nbytes, f"[{r.start},{r.end}]", r.slot,
             r.producer) for r in self.rows]
    lines = [tables.render(["id", "shape", "dtype", "bytes", "live", "slot", "op"], rows,
                           align=["right"] * 6 + ["left"])]
    lines.append(f"peak live {self.peak_live_bytes} B, planned {self.planned_bytes} B with "
                 f"reuse, {self.naive_bytes} B without")
    if self.xla:
      lines.append("XLA: " + ", ".join(f"{k}={v}" for k, v in self.xla.items()))
    elif self.xla_unavailable:
      lines.append(f"XLA: no numbers ({self.xla_unavailable})")
    return "\n".join(lines)


def _nbytes(aval) -> int:
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _xla_stats(fn, args, kwargs) -> tuple[dict[str, int], str]:
  """XLA's memory analysis of ``fn``, or ``{}`` and why not: a step that traces but does not
  compile (e.g. a custom call with no handler here) says so instead of printing a table that
  silently lacks XLA's side."""
  try:
    stats = jax.jit(fn).lower(*args, **kwargs).compile().memory_analysis()
  except Exception as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return {}, f"compiling it failed: {type(e).__name__}: {first[:300]}"
  if stats is None:
    return {}, f"the {jax.default_backend()} backend reports no memory analysis"
  keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
          "alias_size_in_bytes", "generated_code_size_in_bytes")
  return {k: int(getattr(stats, k)) for k in keys if hasattr(stats, k)}, ""


def memory_plan(fn: Callable, *args: Any, with_xla: bool = True, **kwargs: Any) -> MemoryPlan:
  """Liveness-based buffer table of ``fn(*args, **kwargs)`` (top-level jaxpr) and XLA's stats
  (``with_xla=False``: without compiling ``fn`` for them)."""
  if not callable(fn):
    raise errors.ConfigurationError(
        f"memory_plan: fn={fn!r} is not callable; call memory_plan(step, *args) with the step "
        "and the arguments it takes")
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  jaxpr = closed.jaxpr
  n_eqns = len(jaxpr.eqns)
  start: dict = {}
  producer: dict = {}
  for v in list(jaxpr.constvars) + list(jaxpr.invars):
    start[v], producer[v] = -1, "input"
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.outvars:
      if not isinstance(v, jex_core.DropVar):
        start[v], producer[v] = i, eqn.primitive.name
  end = {v: s for v, s in start.items()}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jex_core.Literal) and v in end:
        end[v] = max(end[v], i)
  for v in jaxpr.outvars:
    if not isinstance(v, jex_core.Literal) and v in end:
      end[v] = n_eqns
  order = sorted(start, key=lambda v: (start[v], str(v)))
  slots: list[tuple[int, int]] = []     # (nbytes, free from eqn index)
  rows = []
  for bid, v in enumerate(order):
    nb = _nbytes(v.aval)
    slot = next((k for k, (size, free) in enumerate(slots)
                 if size == nb and free < start[v]), None)
    if slot is None:
      slots.append((nb, end[v]))
      slot = len(slots) - 1
    else:
      slots[slot] = (nb, end[v])
    rows.append(BufferRow(bid, tuple(v.aval.shape), np.dtype(v.aval.dtype).name, nb,
                          start[v], end[v], slot, producer[v]))
  peak = 0
  for t in range(-1, n_eqns + 1):
    peak = max(peak, sum(r.nbytes for r in rows if r.start <= t <= r.end))
  xla, unavailable = _xla_stats(fn, args, kwargs) if with_xla else ({}, "with_xla=False")
  return MemoryPlan(tuple(rows), peak, sum(s for s, _ in slots),
                    sum(r.nbytes for r in rows), xla, unavailable)
