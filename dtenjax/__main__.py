"""``python -m dtenjax {demo,topo,explain,plan,bench,info,launch}`` (also the ``dtenjax`` console
script).

The command line itself is dtenjax/_src/cli/main.py.
"""

from __future__ import annotations

import sys

from dtenjax._src.cli.main import main as _main


def main(argv=None) -> int:
  """Runs the command line; returns its exit status."""
  return _main(argv)


if __name__ == "__main__":
  sys.exit(main())
