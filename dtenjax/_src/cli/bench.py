"""``dtenjax bench NAME [ARGS]``: runs ``bench/NAME.py`` of a source checkout with ARGS.

The benchmark runs in a child Python with the checkout on ``PYTHONPATH``; its arguments, output
and exit status pass through unchanged (``bench NAME --help`` is the benchmark's own help; exit
status 3 means it cannot measure on this machine and says why).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

from dtenjax._src.cli import common

HELP = "run bench/NAME.py from a source checkout; ARGS and the exit status pass through"
ROOT = pathlib.Path(__file__).resolve().parents[3]
BENCH_DIR = ROOT / "bench"


def available() -> list[str]:
  """Benchmark names (bench/*.py without the private helpers)."""
  if not BENCH_DIR.is_dir():
    return []
  return sorted(p.stem for p in BENCH_DIR.glob("*.py") if not p.stem.startswith("_"))


DESCRIPTION = __doc__.split("\n\n", 1)[1] + (
    f"\nAvailable here: {', '.join(available())}." if available() else
    f"\nNo bench/ directory next to this dtenjax ({ROOT}): benchmarks run from a source "
    "checkout of dtenjax.")


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("name", metavar="NAME", nargs="?", help="the benchmark, e.g. allreduce")
  ap.add_argument("args", nargs="*", metavar="ARGS",
                  help="passed to bench/NAME.py unchanged (options included)")


def run(args: argparse.Namespace) -> int:
  names = available()
  if args.name is None:
    args.parser.error("which benchmark? give NAME: " + (", ".join(names) or
                                                      "(none here: no bench/ directory)"))
  if args.name not in names:
    where = (f"available: {', '.join(names)}" if names else
             "no bench/ directory here; benchmarks run from a source checkout of dtenjax")
    raise common.UsageError(f"no benchmark {args.name!r} in {BENCH_DIR} ({where}).")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  proc = subprocess.Popen([sys.executable, str(BENCH_DIR / f"{args.name}.py"), *args.args],
                          env=env)
  try:
    rc = proc.wait()
  except KeyboardInterrupt:      # the child got the same SIGINT; wait for it to finish
    rc = proc.wait()
  return 128 - rc if rc < 0 else rc     # a child killed by signal N reports -N; shells say 128+N
