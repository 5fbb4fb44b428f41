"""The command line: ``dtenjax COMMAND`` (console script) or ``python -m dtenjax COMMAND``.

One argparse parser with a subcommand per job (:data:`COMMANDS`: ``demo``, ``topo``,
``explain``, ``plan``, ``bench``, ``info``, ``launch``); each command module contributes
``add_arguments(parser)`` and ``run(args) -> int``.
``--help`` works at every level, ``prog`` names the way the user started it, a bad argument is
argparse's usage line plus one error line with exit status 2, an argument found unusable later
(``common.UsageError``: an unknown module, a mesh axis that does not exist, a shape that does not
divide its mesh axis) is one ``error:`` line with exit status 2 as well, and a failure while doing
the job (any other ``DtenjaxError``: an unwritable path, the user's code raising, a missing
optional package) is one ``error:`` line with exit status 1; never a traceback (cli/common.py).

A new command is a module with ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and
``run(args) -> int`` (optionally ``EPILOG`` and ``EXTRA``, the extra it needs) and one line in
:data:`COMMANDS`.

Without an accelerator the commands run on 8 simulated CPU devices (set before JAX starts); with
GPUs they use them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
from collections.abc import Sequence

from dtenjax._src import errors
from dtenjax._src.cli import common

EXIT_USAGE = common.EXIT_USAGE
EXIT_FAILURE = common.EXIT_FAILURE

# name -> the module under dtenjax._src.cli that implements it, in the order --help lists them
COMMANDS = {
    "demo": "demo",
    "topo": "topo",
    "explain": "explain",
    "plan": "plan",
    "bench": "bench",
    "info": "info",
    "launch": "launch",
}


def prog_name(argv0: str | None = None) -> str:
  """``dtenjax`` for the console script, ``python -m dtenjax`` otherwise."""
  argv0 = sys.argv[0] if argv0 is None else argv0
  return "dtenjax" if os.path.basename(argv0) == "dtenjax" else "python -m dtenjax"


def simulated_devices() -> None:
  """8 simulated CPU devices unless XLA_FLAGS already says how many (must run before JAX
  initialises its backends; it only shapes the CPU backend, GPUs stay the default)."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def _version() -> str:
  """The running package's ``__version__`` (pyproject.toml reads the same line): importing
  ``dtenjax`` imports no jax (its names load on first use), and nothing here imports the
  commands' heavy modules, so ``--version`` and ``--help`` answer without starting jax."""
  import dtenjax
  return dtenjax.__version__


def _plain(text: str | None) -> str | None:
  """A module docstring as help text: plain text, without reStructuredText's double backquotes
  and roles (``:data:`X``` and ``:func:`f``` read as ``X`` and ``f``)."""
  if text is None:
    return None
  text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", text)
  return text.replace("``", "").strip()


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
  prog = prog or prog_name()
  ap = argparse.ArgumentParser(
      prog=prog, description="dtenjax: deterministic, topology-aware distributed arrays and "
      "collectives for JAX. Without an accelerator every command runs on 8 simulated CPU "
      "devices.", epilog=f"'{prog} COMMAND --help' describes each command.")
  ap.add_argument("--version", action="version", version=f"dtenjax {_version()}")
  sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for name, module_name in COMMANDS.items():
    module = importlib.import_module(f"dtenjax._src.cli.{module_name}")
    p = sub.add_parser(name, help=module.HELP, description=_plain(module.DESCRIPTION),
                       epilog=_plain(getattr(module, "EPILOG", None)),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(run=module.run, parser=p, extra=getattr(module, "EXTRA", None))
  return ap


def _one_line(e: BaseException) -> str:
  """A DtenjaxError's text on one line (errors listing several problems use one line each)."""
  lines = [line.strip() for line in str(e).splitlines() if line.strip()]
  if len(lines) > 1 and lines[0].endswith(":"):       # errors.join_problems: header, bullets
    return lines[0] + " " + "; ".join(line.removeprefix("- ") for line in lines[1:])
  return " ".join(lines)


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
  simulated_devices()          # before anything imports jax (the parsers list fixtures)
  # The command line is an application: it pins NCCL as the docs tell GPU users to
  # (dtenjax.pin_nccl(); a value the user set is kept), before any collective runs.
  from dtenjax._src.gpu import environment
  environment.pin()
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser(prog)
  if argv[:1] == ["bench"] and len(argv) > 2:   # bench NAME ARGS...: ARGS belong to the bench
    args = parser.parse_args(argv[:2])
    args.args = argv[2:]
  else:
    args, unknown = parser.parse_known_args(argv)
    if unknown:                  # said by the command's own parser: its usage line, its prog
      args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
  try:
    if args.extra:
      from dtenjax._src.cli import info
      info.require(args.extra, args.command)
    return int(args.run(args) or 0)
  except common.UsageError as e:
    print(f"{args.parser.prog}: error: {_one_line(e)}", file=sys.stderr)
    return EXIT_USAGE
  except errors.DtenjaxError as e:
    print(f"{args.parser.prog}: error: {_one_line(e)}", file=sys.stderr)
    return EXIT_FAILURE
  except KeyboardInterrupt:
    print(f"{args.parser.prog}: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:        # `dtenjax topo | head`: the reader left; say nothing more
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
