"""``python -m dtenjax explain [MODULE:FUNCTION] [example arguments]``: explain a step from the shell.

Like a profiler, it loads your step by name and compiles it with example arguments you describe:

  python -m dtenjax explain train:step --shape-args 'f32[8,128],f32[128]'
  python -m dtenjax explain train:step --mesh data=2,model=4 \\
      --shape-args 'f32[16,64]{-,model},f32[32,16]{data,-}'
  python -m dtenjax explain path/to/train.py:step --args train:make_args

* ``MODULE:FUNCTION``: an importable module (the current directory is on the path) or a
  ``.py`` file, then the function (a dotted attribute path is allowed). A ``jax.jit`` function
  keeps its own shardings and static arguments; a plain function is wrapped in ``jax.jit``.
* ``--shape-args``: one ``DTYPE[DIMS]`` per positional argument, comma separated (``f32``,
  ``bf16``, ``s32``, ``pred``, ... or numpy names such as ``float32``). With ``--mesh``, every
  argument is placed on the mesh: ``{AXES}`` after the dims gives one entry per dimension, a mesh
  axis name, ``a+b`` for several axes, or ``-`` for none; an argument without ``{...}`` is
  replicated.
* ``--args MODULE:FACTORY``: a function called with no arguments that returns the example
  arguments: a tuple (positional), a dict ``{"args": (...), "kwargs": {...}}``, or one value.
  Arrays keep their shardings; ``jax.ShapeDtypeStruct`` values are fine.
* ``--mesh NAME=SIZE,...``: a ``jax.sharding.Mesh`` over the first devices, set as the current
  mesh while the step is traced.

Without a target it explains the demo's training step (``python -m dtenjax demo``). The command
prints every collective with its device groups, bytes and predicted time, then the compiled
memory; ``--json FILE`` writes the same as data (``--json`` alone prints it instead of the table)
and ``--dump-hlo FILE`` the optimised HLO text.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import pathlib
import re
import sys
from typing import Any

from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src.cli import common

# HLO's element type names (hlo/records.py), with i8..i64 for s8..s64 and "bool" for pred.
_DTYPES = {**hlo.NUMPY_NAMES, "bool": "bool",
           **{"i" + n[1:]: v for n, v in hlo.NUMPY_NAMES.items() if n[0] == "s"}}
_ARG_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\[([0-9,\s]*)\]\s*(?:\{([^}]*)\})?\s*$")


def _split_top(text: str) -> list[str]:
  """Splits at commas outside brackets and braces."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "[{(":
      depth += 1
    elif ch in "]})":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


def parse_mesh(text: str):
  """``data=2,model=4`` -> a jax.sharding.Mesh over the first devices (as many as it needs)."""
  import jax
  import numpy as np
  axes = common.mesh_axes(text)
  n = int(np.prod(list(axes.values())))
  devices = jax.devices()
  if n > len(devices):
    raise common.mesh_size_error(text, n, len(devices), "this machine")
  return jax.sharding.Mesh(np.array(devices[:n]).reshape(list(axes.values())), tuple(axes))


def parse_shape_args(text: str, mesh=None) -> list[Any]:
  """``'f32[8,128],f32[128]{model}'`` -> ShapeDtypeStructs (sharded over ``mesh`` if given)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  out, problems = [], []
  for i, part in enumerate(_split_top(text)):
    m = _ARG_RE.match(part)
    if not m:
      problems.append(f"argument {i}: {part.strip()!r} is not DTYPE[DIMS] or "
                      "DTYPE[DIMS]{AXES}")
      continue
    dt_name, dims_text, axes_text = m.groups()
    try:
      dtype = jax.numpy.dtype(_DTYPES.get(dt_name.lower(), dt_name))
    except TypeError:
      problems.append(f"argument {i}: dtype {dt_name!r} is unknown; use one of "
                      f"{sorted(_DTYPES)} or a numpy dtype name")
      continue
    dims = tuple(int(d) for d in dims_text.replace(" ", "").split(",") if d)
    sharding = None
    if axes_text is not None or mesh is not None:
      if mesh is None:
        problems.append(f"argument {i}: {{{axes_text}}} places it on mesh axes, but no --mesh "
                        "was given")
        continue
      entries = [a.strip() for a in axes_text.split(",")] if axes_text is not None else []
      if entries and len(entries) != len(dims):
        problems.append(f"argument {i}: {{{axes_text}}} has {len(entries)} entries for "
                        f"{len(dims)} dimensions; give one per dimension ('-' for none)")
        continue
      spec, ok = [], True
      for d, e in enumerate(entries):
        if e in ("-", "", "None", "none"):
          spec.append(None)
          continue
        names = tuple(e.split("+"))
        unknown = [a for a in names if a not in mesh.axis_names]
        if unknown:
          problems.append(f"argument {i}: axis {unknown} is not in the mesh "
                          f"{list(mesh.axis_names)}")
          ok = False
          continue
        parts = int(np.prod([mesh.shape[a] for a in names]))
        if dims[d] % parts:
          problems.append(f"argument {i}: dimension {d} of size {dims[d]} does not divide "
                          f"into {parts} shards over {'+'.join(names)}; use a multiple of "
                          f"{parts} or another axis")
          ok = False
        spec.append(names[0] if len(names) == 1 else names)
      if not ok:
        continue
      sharding = NamedSharding(mesh, P(*spec))
    out.append(jax.ShapeDtypeStruct(dims, dtype, sharding=sharding))
  if problems:
    raise common.UsageError(errors.join_problems(
        f"--shape-args {text!r}: write one DTYPE[DIMS] per argument, e.g. "
        "'f32[8,128],bf16[128]{model}':", problems))
  return out


def load_object(spec: str, what: str = "target") -> Any:
  """``module:attr.path`` or ``path/file.py:attr`` -> the object (like profilers load targets)."""
  if ":" not in spec:
    raise common.UsageError(
        f"{what} {spec!r} is not MODULE:FUNCTION; write e.g. train:step or path/train.py:step.")
  mod_name, attr = spec.rsplit(":", 1)
  if not mod_name or not attr:
    raise common.UsageError(f"{what} {spec!r}: both MODULE and FUNCTION are needed.")
  if mod_name.endswith(".py") or os.sep in mod_name:
    path = pathlib.Path(mod_name).resolve()
    if not path.is_file():
      raise common.UsageError(f"{what} {spec!r}: no file {path}.")
    if str(path.parent) not in sys.path:
      sys.path.insert(0, str(path.parent))
    name = path.stem
    module = sys.modules.get(name)
    if module is None or getattr(module, "__file__", None) != str(path):
      mspec = importlib.util.spec_from_file_location(name, path)
      module = importlib.util.module_from_spec(mspec)
      sys.modules[name] = module
      try:
        mspec.loader.exec_module(module)
      except Exception as e:  # (the user's module, any error)
        del sys.modules[name]
        raise common.user_code_failed(f"importing {path}", e) from None
  else:
    if os.getcwd() not in sys.path and "" not in sys.path:
      sys.path.insert(0, os.getcwd())
    try:
      module = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
      if e.name and mod_name.startswith(e.name):
        raise common.UsageError(
            f"{what} {spec!r}: no module {mod_name!r} on the path (current directory "
            f"{os.getcwd()}); run from the directory that holds it or give path/to/file.py:"
            f"{attr}.") from None
      raise common.user_code_failed(f"importing {mod_name!r}", e) from None
    except Exception as e:  # (the user's module, any error)
      raise common.user_code_failed(f"importing {mod_name!r}", e) from None
  obj = module
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n)))
      raise common.UsageError(
          f"{what} {spec!r}: {type(obj).__name__} {getattr(obj, '__name__', obj)!r} has no "
          f"attribute {part!r}; callables there: {names[:20]}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise common.UsageError(f"{what} {spec!r} is a {type(obj).__name__}, not callable.")
  return obj


def _factory_args(factory, spec: str) -> tuple[tuple, dict]:
  try:
    made = factory()
  except Exception as e:  # (the user's factory, any error)
    raise common.user_code_failed(f"the --args factory {spec}", e) from None
  if isinstance(made, dict) and set(made) <= {"args", "kwargs"}:
    return tuple(made.get("args", ())), dict(made.get("kwargs", {}))
  if isinstance(made, (tuple, list)):
    return tuple(made), {}
  return (made,), {}


def _demo_step(seed: int = 0, batch: int = 128):
  """The demo's jitted training step and the arguments of its first step."""
  import jax
  from dtenjax._src.cli import demo
  from dtenjax._src.planning import mesh as mesh_lib
  from dtenjax._src.planning.placement import Placement
  from dtenjax._src.topology.model import Topology
  topology = Topology.current()
  shape = demo.mesh_shape_for(len(jax.devices()))
  mesh = mesh_lib.make_mesh(shape, ("data", "model"), topology=topology)
  placement = Placement(strategy="auto", mesh=mesh)
  _, _, jstep, example = demo.train(1, batch, placement, demo.load_digits(seed), seed,
                                    progress=False)
  return jstep, tuple(example), {}


def _rows(explanation) -> list[dict[str, Any]]:
  return [{
      "kind": c.kind, "name": c.name, "dtype": c.dtype, "nbytes": c.nbytes,
      "operand_shapes": [str(s) for s in c.operand_shapes],
      "groups": [list(g) for g in c.groups], "group_form": c.group_form,
      "predicted_us": c.predicted_s * 1e6, "async": bool(c.done),
      "computation": c.computation, "op_name": c.op_name,
  } for c in explanation.collectives]


HELP = "compile a step and list its collectives, device groups, bytes and memory"
DESCRIPTION = ("Compile a step and list every collective it runs (kind, device groups, bytes, "
               "predicted time) and its compiled memory.")
EPILOG = __doc__.split("\n\n", 1)[1]


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("target", nargs="?", metavar="MODULE:FUNCTION",
                  help="the step to explain (default: the demo's training step)")
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--shape-args", metavar="SPEC",
                   help="example arguments by shape, e.g. 'f32[8,128],f32[128]'")
  src.add_argument("--args", metavar="MODULE:FACTORY", dest="factory",
                   help="a function returning the example arguments")
  ap.add_argument("--mesh", metavar="NAME=SIZE,...",
                  help="a device mesh for --shape-args placements (and the current mesh)")
  common.add_fixture_argument(ap, "predict times on a shipped topology instead of this machine's")
  common.add_json_argument(ap, "the collectives, memory and predicted times")
  ap.add_argument("--dump-hlo", metavar="FILE", help="write the optimised HLO text")


def run(args: argparse.Namespace) -> int:
  import jax
  from dtenjax._src.planning import explain as explain_lib
  from dtenjax._src.topology.model import Topology
  topology = common.fixture(args.fixture) if args.fixture else Topology.current()
  mesh = parse_mesh(args.mesh) if args.mesh else None
  if args.target is None:
    if args.shape_args or args.factory or args.mesh:
      raise common.UsageError(
          "--shape-args, --args and --mesh describe the arguments of your own step; name it "
          "first: python -m dtenjax explain MODULE:FUNCTION --shape-args ...")
    from dtenjax._src.cli import info
    info.require("demo", "explaining the demo's step (explain without MODULE:FUNCTION)")
    fn, call_args, call_kwargs = _demo_step()
    label = "the demo's training step"
  else:
    fn = load_object(args.target)
    if args.factory:
      call_args, call_kwargs = _factory_args(load_object(args.factory, "--args"),
                                             args.factory)
    elif args.shape_args is not None:
      call_args, call_kwargs = tuple(parse_shape_args(args.shape_args, mesh)), {}
    else:
      call_args, call_kwargs = (), {}
    label = args.target
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  ctx = jax.set_mesh(mesh) if mesh is not None and hasattr(jax, "set_mesh") else (
      contextlib.nullcontext())
  try:
    with ctx, common.status(f"compiling {label}"):
      compiled = jitted.lower(*call_args, **call_kwargs).compile()
  except TypeError as e:
    raise common.UsageError(
        f"{label} could not be compiled with the example arguments ({_one_line(e)}); describe "
        "every positional argument with --shape-args or return them from an --args "
        "factory.") from None
  except NameError as e:
    if re.match(r"name '.*' is not defined", str(e)):     # Python's own: a bug in the step
      raise common.user_code_failed(f"{label}, traced with the example arguments,", e) from None
    raise common.UsageError(                              # jax: an axis name not in the mesh
        f"{label} could not be compiled with the example arguments: {_one_line(e)} (check "
        "the axis names the step uses against --mesh).") from None
  except ValueError as e:   # jax: a bad sharding, an axis name not in the mesh
    raise common.UsageError(
        f"{label} could not be compiled with the example arguments: {_one_line(e)} (check "
        "the axis names the step uses against --mesh, and that every sharded dimension "
        "divides its mesh axes).") from None
  except Exception as e:  # (the user's step raised while traced)
    where = common.user_frame(e)
    if where is None:
      raise
    raise common.user_code_failed(f"{label}, traced with the example arguments,", e) from None
  explanation = explain_lib.explain(compiled, topology=topology)
  if not common.json_to_stdout(args):
    print(f"== explain({label}) on {len(jax.devices())} {jax.devices()[0].platform} "
          "device(s) ==")
    print(explanation.table())
  if args.dump_hlo:
    common.write_text(args.dump_hlo, compiled.as_text() or "", "--dump-hlo")
  common.write_json(args, {
      "target": label, "topology": explanation.topology, "source": explanation.source,
      "memory": explanation.memory, "collectives": _rows(explanation),
      "total_predicted_us": explanation.total_predicted_s * 1e6})
  return 0


def _one_line(e: BaseException, limit: int = 400) -> str:
  """JAX's message without its traceback-like tail, on one line."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: " + (text if len(text) <= limit else text[:limit] + " ...")
