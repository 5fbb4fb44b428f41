"""What every command shares: the two kinds of failure and their exit status, the ``--json``
flag, writing files, and running the user's own code.

Exit status (cli/main.py): 0 done; 2 a usage error (argparse's own, or :class:`UsageError`: an
argument dtenjax cannot use, such as an unknown module, a bad ``--shape-args`` or a mesh larger
than the devices); 1 a failure while doing the job (any other ``DtenjaxError``: a file that
cannot be read or written, the user's code raising, a missing optional package). Both print one
``PROG: error: ...`` line and no traceback. A traceback means a bug in dtenjax.

``--json`` means the same in every command: the command's result as JSON, written to FILE (the
table is still printed), or printed to stdout in place of the table when FILE is ``-`` or left
out (``dtenjax info --json``). The benchmarks' ``--json PATH`` (``dtenjax bench``) is the FILE
form.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import sys
import sysconfig
import traceback
from typing import Any

from dtenjax._src import errors

EXIT_FAILURE = 1
EXIT_USAGE = 2


class UsageError(errors.ConfigurationError):
  """A command-line argument the command cannot use (exit status 2)."""


class CommandError(errors.DtenjaxError):
  """The command could not do its job: a file, the user's code, the environment (exit 1)."""


@contextlib.contextmanager
def status(text: str):
  """A spinner with ``text`` on stderr while a long step runs (tracing, compiling, probing),
  on a terminal only: in a log, a pipe or a test nothing is printed, and stdout (tables,
  ``--json``) is never touched. Gone when the step ends."""
  if not sys.stderr.isatty():
    yield
    return
  from rich.console import Console
  with Console(stderr=True).status(text):
    yield


def line_buffered_stdout() -> None:
  """Each line on stdout as it is printed, also into a pipe or a file (`dtenjax demo | tee
  log`), where Python would otherwise hold a command's report back until it ends."""
  reconfigure = getattr(sys.stdout, "reconfigure", None)
  if reconfigure is not None:
    reconfigure(line_buffering=True)


def add_fixture_argument(ap: argparse.ArgumentParser, what: str) -> None:
  """``--fixture NAME``, the same in every command: the name is checked when the command runs
  (:func:`fixture`), so a wrong one is one line with exit status 2 everywhere."""
  ap.add_argument("--fixture", metavar="NAME",
                  help=f"{what} (the names: dtenjax topo --list-fixtures)")


def fixture(name: str):
  """The shipped topology ``name``; an unknown name is a UsageError listing the names."""
  from dtenjax._src.topology.model import Topology
  names = Topology.fixtures()
  if name not in names:
    raise UsageError(f"--fixture {name!r}: no shipped topology has that name; choose one of "
                     f"{', '.join(names)}")
  return Topology.fixture(name)


def mesh_axes(text: str) -> dict[str, int]:
  """``--mesh data=2,model=4`` -> ``{"data": 2, "model": 4}``, the same grammar in every
  command; every syntax problem at once, as one UsageError."""
  out, problems = {}, []
  for part in text.split(",") if text.strip() else []:
    m = re.match(r"^\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*$", part)
    if not m:
      problems.append(f"{part.strip()!r} is not NAME=SIZE")
    elif m.group(1) in out:
      problems.append(f"axis {m.group(1)!r} is given twice")
    elif int(m.group(2)) < 1:
      problems.append(f"axis {m.group(1)!r} has size {m.group(2)}; sizes are at least 1")
    else:
      out[m.group(1)] = int(m.group(2))
  if not out and not problems:
    problems.append("no axes given")
  if problems:
    raise UsageError(f"--mesh {text!r}: write it as NAME=SIZE,... (e.g. data=2,model=4): "
                     + "; ".join(problems))
  return out


def mesh_size_error(text: str, needed: int, available: int, where: str) -> UsageError:
  """The one message for a mesh that does not fit the devices, in every command."""
  return UsageError(f"--mesh {text!r}: the mesh needs {needed} devices; {where} has "
                    f"{available}")


def whole_number(minimum: int):
  """argparse ``type=`` for a count of at least ``minimum`` (steps, processes, restarts): the
  same two messages in every command (``argument --steps: 'x' is not a whole number``,
  ``argument --nprocs: 0 is less than 1``), exit status 2."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
    return value
  return parse


def number_above(bound: float):
  """argparse ``type=`` for an amount that must exceed ``bound`` (seconds, GiB), with the
  messages of :func:`whole_number`'s kind: ``'x' is not a number``, ``0 is not more than 0``."""
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > bound:            # NaN too
      raise argparse.ArgumentTypeError(f"{text} is not more than {bound:g}")
    return value
  return parse


def add_json_argument(ap: argparse.ArgumentParser, what: str) -> None:
  ap.add_argument("--json", nargs="?", const="-", metavar="FILE",
                  help=f"{what} as JSON: written to FILE (the table is printed too), or to "
                  "stdout instead of the table without FILE or with '-'")


def json_to_stdout(args: argparse.Namespace) -> bool:
  return getattr(args, "json", None) == "-"


def write_json(args: argparse.Namespace, data: Any) -> None:
  """``data`` as JSON where ``--json`` says (nothing without the flag)."""
  if getattr(args, "json", None) is None:
    return
  text = json.dumps(data, indent=1, default=str) + "\n"
  if args.json == "-":
    print(text, end="")
  else:
    write_text(args.json, text, "--json")


def write_text(path: str | os.PathLike, text: str, flag: str) -> None:
  """Writes ``text`` to ``path``; a path that cannot be written is one CommandError line."""
  try:
    pathlib.Path(path).write_text(text, encoding="utf-8")
  except OSError as e:
    raise CommandError(f"{flag} {str(path)!r}: cannot write it ({e.strerror or e}); give a path "
                       "in a directory you can write to.") from None


def read_text(path: str | os.PathLike, flag: str) -> str:
  try:
    return pathlib.Path(path).read_text(encoding="utf-8")
  except OSError as e:
    raise CommandError(f"{flag} {str(path)!r}: cannot read it ({e.strerror or e}).") from None


def _ours(filename: str) -> bool:
  """Frames of dtenjax itself, of installed packages (JAX) and of Python's standard library
  (the import machinery, json, ...): not the user's code."""
  import dtenjax
  if filename.startswith("<"):            # <frozen importlib._bootstrap>, <string>
    return True
  f = os.path.realpath(filename)
  roots = {os.path.dirname(os.path.realpath(dtenjax.__file__))}
  roots |= {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib", "platlib")}
  return any(f.startswith(r + os.sep) for r in roots) or f"{os.sep}site-packages{os.sep}" in f


def user_frame(e: BaseException) -> str | None:
  """``file:line in function`` of the innermost frame of the traceback that is the user's code
  (not dtenjax's, JAX's or the import machinery's); for a SyntaxError, where it is."""
  if isinstance(e, SyntaxError) and e.filename:
    return f"{e.filename}:{e.lineno}"
  frames = traceback.extract_tb(e.__traceback__)
  mine = [f for f in frames if not _ours(f.filename)]
  if not mine:
    return None
  f = mine[-1]
  return f"{f.filename}:{f.lineno} in {f.name}"


def one_line(e: BaseException, limit: int = 400) -> str:
  text = " ".join(str(e).split())
  text = text if len(text) <= limit else text[:limit] + " ..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def user_code_failed(what: str, e: BaseException) -> CommandError:
  """The error for the user's code (a module being imported, a factory called) raising ``e``."""
  where = user_frame(e)
  return CommandError(f"{what} raised {one_line(e)}" + (f" (at {where})" if where else ""))
