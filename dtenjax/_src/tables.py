"""Plain-text tables for reports and benchmarks, laid out by ``rich`` (a dependency already).

One function, :func:`render`: a header row and data rows, columns aligned by rich, no box
characters and no colour, so the text reads the same in a terminal, a log file and a test, and a
row splits on whitespace into its cells (cells themselves may hold spaces, e.g. ``"300.00 GB/s"``).
The table is rendered at its natural width and never wrapped or truncated: a 32-device link
matrix stays one line per device even when stdout is not a terminal (where rich would otherwise
assume 80 columns and fold it).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any


def render(columns: Sequence[str], rows: Sequence[Sequence[Any]], *,
           align: Sequence[str] | None = None, title: str | None = None) -> str:
  """The table as text.

  Args:
    columns: header cells.
    rows: data rows, one value per column (``str()`` is applied; ``None`` shows as ``-``).
    align: per column ``"left"`` or ``"right"`` (default: left for the first column, right for
      the others, as numeric tables read best).
    title: an optional line above the table.
  """
  from rich.console import Console
  from rich.table import Table
  n = len(columns)
  if align is None:
    align = ["left"] + ["right"] * (n - 1)
  if len(align) != n or any(a not in ("left", "right") for a in align):
    raise ValueError(f"align {list(align)!r} must give 'left' or 'right' for each of {n} columns")
  bad = [i for i, r in enumerate(rows) if len(r) != n]
  if bad:
    raise ValueError(f"rows {bad[:8]} do not have {n} cells (columns {list(columns)})")
  table = Table(box=None, show_edge=False, pad_edge=False, header_style=None, padding=(0, 1),
                collapse_padding=True)
  for name, a in zip(columns, align):
    table.add_column(str(name), justify=a, no_wrap=True)
  for r in rows:
    table.add_row(*("-" if v is None else str(v) for v in r))

  def console(file, width):   # plain text: no markup, emoji or highlighting in the cells
    return Console(file=file, width=width, color_system=None, force_terminal=False,
                   highlight=False, emoji=False, markup=False, soft_wrap=False)

  width = console(io.StringIO(), 1_000_000).measure(table).maximum
  out = io.StringIO()
  console(out, max(width, 1)).print(table)
  lines = [ln.rstrip() for ln in out.getvalue().splitlines()]
  while lines and not lines[-1]:
    lines.pop()
  return "\n".join(([title] if title else []) + lines)
