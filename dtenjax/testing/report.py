"""How benchmarks print, the same as the command line: tables, rates and count arguments.

A benchmark's tables and refusals read like ``dtenjax``'s own commands (``dtenjax bench NAME``
runs them): the CLI's rich table layout, the unit ``restore(report=True)`` prints a rate in, and
the argparse type that refuses ``--steps 0``. For benchmarks and tests; not part of the library's
API.
"""

from dtenjax._src.checkpoint.io import rate as format_rate
from dtenjax._src.cli.common import whole_number as whole_number
from dtenjax._src.tables import render as render_table

__all__ = ["format_rate", "render_table", "whole_number"]
