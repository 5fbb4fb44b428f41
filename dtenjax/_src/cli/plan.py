"""``dtenjax plan MODULE:STEP --args MODULE:FACTORY``: the whole-step plan of a training step."""

from __future__ import annotations

import argparse
import math

from dtenjax._src import errors
from dtenjax._src.cli import common
from dtenjax._src.cli import draw

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
  common.add_fixture_argument(ap, "plan for a shipped topology instead of this machine")
  ap.add_argument("--mesh", metavar="AXIS=SIZE,...",
                  help="plan on this mesh shape, e.g. data=2,tensor=4 (default: propose one)")
  ap.add_argument("--budget-gib", type=common.number_above(0), metavar="GIB",
                  help="memory budget per device (default: device memory less the reserve)")
  ap.add_argument("--donate", action="store_true",
                  help="the step is jitted with its state donated (outputs reuse it)")
  ap.add_argument("--check", action="store_true",
                  help="also compile the step with the plan and compare the prediction with "
                  "XLA's memory and collective bytes (needs the planned devices)")
  common.add_json_argument(ap, "the plan (mesh, one spec per leaf, predicted cost, recipes)")
  ap.add_argument("--draw", metavar="FILE",
                  help="also draw the planned mesh over the topology (which axis runs over "
                  "which links) to a PNG, SVG or PDF file (needs the plot extra)")


def _mesh(text: str | None, topology, fixture: str | None) -> dict[str, int] | None:
  """``--mesh`` for the planner: its axes only, sizes that cover every device of the topology."""
  if not text:
    return None
  from dtenjax._src.planning import step as step_lib
  axes = common.mesh_axes(text)
  unknown = [a for a in axes if a not in step_lib.AXES]
  if unknown:
    raise common.UsageError(f"--mesh {text!r}: the planner's axes are {', '.join(step_lib.AXES)}; "
                            f"{', '.join(map(repr, unknown))} is not one of them")
  needed, have = math.prod(axes.values()), topology.num_devices
  where = f"the fixture {fixture!r}" if fixture else "this machine"
  if needed > have:
    raise common.mesh_size_error(text, needed, have, where)
  if needed < have:
    raise common.UsageError(f"--mesh {text!r}: a plan spans every device; {where} has {have}, "
                            f"the mesh {needed}")
  return axes


def _check_here(topology, fixture: str) -> None:
  """``--check`` compiles the plan on this machine's devices: refused, before planning, for a
  fixture whose devices are not these (its count or its platform)."""
  import jax
  here = jax.devices()
  theirs = topology.device(topology.device_ids[0]).platform
  if topology.num_devices != len(here) or theirs != here[0].platform:
    raise common.UsageError(
        f"--check with --fixture {fixture!r}: the check compiles the plan on this machine's "
        f"devices ({len(here)} {here[0].platform}), and the fixture plans for "
        f"{topology.num_devices} {theirs} devices; run --check without --fixture on the machine "
        "the plan is for")


def _plan_json(result) -> dict:
  cost = lambda c: None if c is None else {
      "total_s": c.total_s, "compute_s": c.compute_s, "exposed_s": c.exposed_s,
      "comm_s": dict(c.comm_s), "memory_bytes": dict(c.memory), "fits": c.fits}
  return {"topology": result.topology,
          "mesh": dict(zip(result.axis_names, result.mesh_shape)),
          "device_ids": list(result.device_ids),
          "axes": [{"name": a.name, "size": a.size, "link": a.link, "span": a.span,
                    "alpha_us": a.alpha_us, "bandwidth_gbps": a.bandwidth_gbps,
                    "source": a.source} for a in result.axes],
          "leaves": [{"path": lf.path, "shape": list(lf.shape), "dtype": lf.dtype,
                      "spec": str(lf.spec), "reason": lf.reason} for lf in result.leaves],
          "cost": cost(result.cost),
          "recipes": [{"name": r.name, "mesh": dict(r.mesh_shape), "cost": cost(r.cost),
                       "note": r.note} for r in result.recipes],
          "budget_bytes": result.budget_bytes, "notes": list(result.notes)}


def run(args: argparse.Namespace) -> int:
  from dtenjax._src.cli import explain
  from dtenjax._src.planning import step as step_lib
  from dtenjax._src.topology.model import Topology
  draw.check_path(args.draw)
  fn = explain.load_object(args.target, "target")
  factory = explain.load_object(args.factory, "--args")
  made, kwargs = explain._factory_args(factory, args.factory)
  if kwargs:
    raise common.UsageError(
        f"--args {args.factory!r} returned keyword arguments {sorted(kwargs)}; the planner "
        "plans the step's positional arguments: return them in 'args', or bind the others in "
        "the step (functools.partial)")
  topology = common.fixture(args.fixture) if args.fixture else None
  if args.check and topology is not None:
    _check_here(topology, args.fixture)
  budget = None if args.budget_gib is None else args.budget_gib * 2**30
  mesh = _mesh(args.mesh, topology or Topology.current(), args.fixture)
  try:
    with common.status(f"planning {args.target}: tracing it, pricing every mesh"):
      result = step_lib.plan(fn, *made, mesh=mesh, topology=topology, memory_budget=budget,
                             donate=args.donate)
  except errors.PlacementError as e:
    if isinstance(e.__cause__, Exception) and not isinstance(e.__cause__, errors.DtenjaxError):
      raise common.user_code_failed(f"tracing {args.target}", e.__cause__) from None
    raise
  if args.draw:
    draw.plan(result, topology or Topology.current(), args.draw)
  if common.json_to_stdout(args):
    common.write_json(args, _plan_json(result))
    return 0
  print(result.table())
  common.write_json(args, _plan_json(result))
  if args.check:
    print()
    with common.status(f"compiling {args.target} with the plan's shardings"):
      check = result.check(fn, *made)
    print(check.table())
  return 0
