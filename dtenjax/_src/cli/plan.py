"""``dtenjax plan MODULE:STEP --args MODULE:FACTORY``: the whole-step plan of a training step."""

from __future__ import annotations

import argparse

from dtenjax._src import errors
from dtenjax._src.cli import common

HELP = "plan the layout of a whole training step (mesh, specs, memory, recipes)"
DESCRIPTION = """Plans every argument of a training step: the mesh (data, fsdp, tensor axes over
the topology), one PartitionSpec per leaf with the reason, the predicted step time and per-device
memory, and the standard recipes (DP, FSDP, TP, FSDP x TP) side by side. The step is traced, never
run. --args names a function that returns the step's example arguments (arrays or
jax.ShapeDtypeStruct pytrees, e.g. from jax.eval_shape)."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("target", metavar="MODULE:STEP", help="the training step function")
  ap.add_argument("--args", metavar="MODULE:FACTORY", dest="factory", required=True,
                  help="a function returning the step's example arguments as a tuple")
  ap.add_argument("--fixture", metavar="NAME",
                  help="plan for a reference topology (dtenjax topo --list-fixtures) instead of "
                  "this machine")
  ap.add_argument("--mesh", metavar="AXIS=SIZE,...",
                  help="plan on this mesh shape, e.g. data=2,tensor=4 (default: propose one)")
  ap.add_argument("--budget-gib", type=float, metavar="GIB",
                  help="memory budget per device (default: device memory less the reserve)")
  ap.add_argument("--donate", action="store_true",
                  help="the step is jitted with its state donated (outputs reuse it)")
  ap.add_argument("--check", action="store_true",
                  help="also compile the step with the plan and compare the prediction with "
                  "XLA's memory and collective bytes (needs the planned devices)")


def _mesh(text: str | None):
  if not text:
    return None
  out = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    try:
      out[name.strip()] = int(size)
    except ValueError:
      raise common.UsageError(
          f"--mesh {text!r}: write AXIS=SIZE pairs such as data=2,tensor=4") from None
  return out


def run(args: argparse.Namespace) -> int:
  # pylint: disable=g-import-not-at-top
  from dtenjax._src.cli import explain
  from dtenjax._src.planning import step as step_lib
  from dtenjax._src.topology.model import Topology
  fn = explain.load_object(args.target, "target")
  factory = explain.load_object(args.factory, "--args")
  made, _ = explain._factory_args(factory, args.factory)  # pylint: disable=protected-access
  topology = Topology.fixture(args.fixture) if args.fixture else None
  budget = args.budget_gib * 2**30 if args.budget_gib else None
  mesh = _mesh(args.mesh)
  try:
    result = step_lib.plan(fn, *made, mesh=mesh, topology=topology, memory_budget=budget,
                           donate=args.donate)
  except errors.PlacementError as e:
    if isinstance(e.__cause__, Exception) and not isinstance(e.__cause__, errors.DtenjaxError):
      raise common.user_code_failed(f"tracing {args.target}", e.__cause__) from None
    raise
  print(result.table())
  if args.check:
    print()
    print(result.check(fn, *made).table())
  return 0
