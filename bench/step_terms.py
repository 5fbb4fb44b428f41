"""The training step's time split into its parts, measured and predicted side by side: which term
of the cost model is priced wrong (issue 39, "wins when run": on the 16-core host the
encoder-decoder's FSDP x TP ran 0.93x DP where the model priced it 1.13x).

For each family (bench/_families.py) and each layout a user writes (DP, FSDP, FSDP x TP, HSDP),
all on this machine's CPU devices, timed interleaved (bench/step_planner.py's shuffled turns,
medians):

* ``step``: the user's ``jax.jit`` step (the wins part's program);
* ``local``: the same step on every device at once with its local shapes and no collective:
  ``jax.shard_map`` of the step over the layout's mesh, the weights as its products read them
  (FSDP's dimensions gathered, ``tensor``'s split), the batch split as the layout splits it; the
  loss and the update are each device's own;
* ``opt gathered`` / ``opt sharded``: AdamW's update alone (optax, as the families), on every
  device at once, on the weights as ``local`` holds them and as the layout stores them; ``compute``
  is then ``local - opt gathered + opt sharded``: the step's compute without its collectives;
* ``coll``: the compiled step's collectives alone (each with its operands' shapes, a combined
  all-reduce as one, over its mesh axes; read from the compiled HLO, loop trip counts included),
  one after another in one program, less the same program making the same buffers without them;
* ``step CPU`` / ``local CPU``: this process's CPU milliseconds per call (every device's
  threads): the work done, where the wall time also counts devices waiting for each other.

Beside them the cost model's parts for the same layout (the plan with that mesh and the layout's
specs pinned, as the wins part prices a recipe), with the table priors and with this machine's
``Topology.calibrate()``: ``compute_s`` (products and optimizer update), the update alone (bytes x
the elementwise seconds per byte), the collectives (``comm_s``) and what is exposed.

Run:  python3 bench/step_terms.py [--families encdec,llama_loop] [--iters 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _families as fams
import _harness
import dtenjax
from dtenjax.testing import planning
from dtenjax.testing.xla import loop_repeats


def _drop(spec: P, axes: set[str]) -> P:
  """``spec`` without the mesh axes ``axes`` (a dimension sharded only by them becomes whole)."""
  out = []
  for e in tuple(spec):
    names = e if isinstance(e, tuple) else (e,)
    kept = tuple(a for a in names if a is not None and a not in axes)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return P(*out)


def _specs(fam, r):
  """(stored, read) specs of (params, opt_state, batch): as the layout stores them, and as the
  step's products read them (FSDP's axes gathered)."""
  _, (params, opt, batch) = fam.make()
  fsdp = {a for a in r.mesh.axis_names if a == "fsdp"}
  is_p = lambda s: isinstance(s, P)
  pspecs = r.param_specs
  ospecs = fams._like_params(opt, params, pspecs)
  bax = r.batch_axes[0] if len(r.batch_axes) == 1 else r.batch_axes
  bspecs = jax.tree.map(lambda b: P(bax), batch)
  stored = (pspecs, ospecs, bspecs)
  read = tuple(jax.tree.map(lambda s: _drop(s, fsdp), t, is_leaf=is_p) for t in stored[:2])
  return stored, read + (bspecs,)


def _named(mesh, tree):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))


def local_program(fam, r, real):
  """The step on every device with its local shapes, no collective: (fn, placed args)."""
  step, _ = fam.make()
  _, read = _specs(fam, r)
  fn = jax.jit(jax.shard_map(step, mesh=r.mesh, in_specs=read,
                             out_specs=(read[0], read[1], P()), check_vma=False))
  return fn, jax.device_put(real, _named(r.mesh, read))


def opt_program(fam, r, real, which: str):
  """AdamW's update alone on the weights as the layout stores them ('sharded') or as its products
  read them ('gathered'), every device at once."""
  stored, read = _specs(fam, r)
  specs = stored if which == "sharded" else read
  tx = optax.adamw(1e-3)

  def update(p, o):
    updates, o = tx.update(p, o, p)          # the weights as their own gradient: same bytes
    return optax.apply_updates(p, updates), o

  fn = jax.jit(jax.shard_map(update, mesh=r.mesh, in_specs=specs[:2], out_specs=specs[:2],
                             check_vma=False))
  return fn, jax.device_put(real[:2], _named(r.mesh, specs[:2]))


def _axes_of(groups, mesh) -> tuple[str, ...]:
  """The mesh axes whose devices a collective's groups (device ids) join."""
  names = mesh.axis_names
  if not groups:
    return tuple(names)
  want = {frozenset(g) for g in groups}
  ids = np.vectorize(lambda d: d.id)(mesh.devices)
  for k in range(1, len(names) + 1):
    for axes in itertools.combinations(range(len(names)), k):
      rest = [i for i in range(len(names)) if i not in axes]
      moved = np.moveaxis(ids, rest + list(axes), range(len(names)))
      size = math.prod(mesh.devices.shape[i] for i in axes)
      if {frozenset(row.tolist()) for row in moved.reshape(-1, size)} == want:
        return tuple(names[i] for i in axes)
  raise ValueError(f"groups {groups} are no set of axes of mesh {dict(mesh.shape)}")


def collective_list(compiled, mesh) -> list[tuple[str, tuple, tuple[str, ...]]]:
  """(kind, the operands' shapes and dtypes per device, axes) of every collective the compiled
  step runs, repeated by its loop trip counts (a combined all-reduce keeps its operands)."""
  repeats = loop_repeats(compiled)
  out = []
  for c in dtenjax.explain(compiled).collectives:
    shapes = tuple((tuple(s.dims), s.dtype) for op in c.operand_shapes for s in op.leaves())
    out += [(c.kind, shapes, _axes_of(c.groups, mesh))] * repeats(c.computation)
  return out


def collective_mib(colls) -> float:
  """MiB per device of the operands, as the reproduction makes them (float32: the families')."""
  return sum(4 * math.prod(d) for _, shapes, _ in colls for d, _ in shapes) / 2**20


def collective_programs(colls, mesh):
  """(with, without): one program running ``colls`` one after another (each waits for the last
  one's first element), on buffers of their operands' shapes, and the same program making the
  same buffers (kept by an optimization barrier) without the collectives."""
  def op(kind, x, axes, g):
    if kind == "all_reduce":
      return lax.psum(x, axes)
    if kind == "all_gather":
      return lax.all_gather(x, axes, tiled=True)
    if kind == "reduce_scatter":
      return lax.psum_scatter(x.reshape(-1)[:x.size // g * g], axes, tiled=True)
    if kind == "all_to_all":
      return lax.all_to_all(x.reshape(g, -1), axes, 0, 0, tiled=True)
    raise ValueError(f"collective kind {kind!r} is not reproduced")

  def body(x, run: bool):
    s = x[0]
    for kind, shapes, axes in colls:
      g = math.prod(mesh.shape[a] for a in axes)
      bufs = [jnp.full(d, s, jnp.float32) for d, _ in shapes]
      if not run:
        ys = lax.optimization_barrier(bufs)
      elif kind == "all_reduce":                  # one all-reduce of all the operands
        ys = lax.psum(bufs, axes)
      else:
        ys = [op(kind, b, axes, g) for b in bufs]
      s = s + sum(y.ravel()[0] for y in ys) * 1e-9
    return s[None]

  make = lambda run: jax.jit(jax.shard_map(lambda x: body(x, run), mesh=mesh,
                                           in_specs=P(mesh.axis_names), out_specs=P(mesh.axis_names),
                                           check_vma=False))
  x = jax.device_put(jnp.ones((mesh.devices.size,), jnp.float32),
                     NamedSharding(mesh, P(mesh.axis_names)))
  return (make(True), x), (make(False), x)


def predicted_parts(fam, r, step, args, topology) -> dict[str, float]:
  """The cost model's parts (ms) of layout ``r`` pinned: compute (products + update), the
  optimizer's update alone, every collective, the exposed collectives, the total."""
  params, opt, _ = args
  plan = dtenjax.plan(step, *args, mesh=dict(r.mesh.shape), topology=topology,
                      pinned=[r.param_specs, fams._like_params(opt, params, r.param_specs),
                              None], memory_budget=1 << 50)
  topo = topology or dtenjax.Topology.current()
  per_byte = topo.local_s_per_byte(0.0)
  update = 0.0
  for leaf, spec in zip(jax.tree.leaves(params),
                        jax.tree.leaves(r.param_specs, is_leaf=lambda s: isinstance(s, P))):
    shards = math.prod(r.mesh.shape[a] for e in tuple(spec) if e is not None
                       for a in (e if isinstance(e, tuple) else (e,)))
    nbytes = math.prod(leaf.shape) * 4
    update += (2 * 3 * nbytes + nbytes) / shards        # param and 2 moments read, 3 written
  c = plan.cost
  return {"compute": c.compute_s * 1e3, "update": update * per_byte * 1e3,
          "comm": c.comm_total_s * 1e3, "exposed": c.exposed_s * 1e3, "total": c.total_s * 1e3}


COLUMNS = (("family", "family", "s"), ("layout", "layout", "s"), ("mesh", "mesh", "s"),
           ("step", "step", ".1f"), ("local", "local", ".1f"), ("opt gath", "opt_gathered", ".1f"),
           ("opt shard", "opt_sharded", ".1f"), ("compute", "compute", ".1f"),
           ("coll", "coll", ".1f"), ("step-compute", "rest", ".1f"),
           ("pred comp", "p_compute", ".1f"), ("pred upd", "p_update", ".1f"),
           ("pred comm", "p_comm", ".1f"), ("pred total", "p_total", ".1f"),
           ("cal comp", "c_compute", ".1f"), ("cal upd", "c_update", ".1f"),
           ("cal comm", "c_comm", ".1f"), ("cal total", "c_total", ".1f"),
           ("coll MiB", "coll_mib", ".1f"), ("step CPU", "step_cpu", ".0f"),
           ("local CPU", "local_cpu", ".0f"))


def _cpu_ms(fn, args, calls: int = 3) -> float:
  """This process's CPU milliseconds per call of ``fn`` (all devices' threads): the work, where
  wall time also counts the waiting."""
  import resource
  use = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
  jax.block_until_ready(fn(*args))
  c0 = use()
  for _ in range(calls):
    jax.block_until_ready(fn(*args))
  return (use() - c0) / calls * 1e3


def family_rows(name: str, iters: int, calibrated) -> list[dict]:
  """One row per layout of family ``name`` (all times ms per step, medians)."""
  fam = fams.FAMILIES[name]()
  step, args = fam.make()
  real = fams.real_args(fam)
  fns, meta = {}, {}
  for rn in fams.RECIPES:
    r = fams.recipe(fam, rn)
    if r is None:
      continue
    fn, shardings = fams.recipe_jit(fam, r)
    compiled = fn.lower(*args).compile()
    colls = collective_list(compiled, r.mesh)
    placed = jax.device_put(real, shardings)
    fns[(rn, "step")] = (fn, placed)
    fns[(rn, "local")] = local_program(fam, r, real)
    fns[(rn, "opt_gathered")] = opt_program(fam, r, real, "gathered")
    fns[(rn, "opt_sharded")] = opt_program(fam, r, real, "sharded")
    (cw, x), (cb, _) = collective_programs(colls, r.mesh)
    fns[(rn, "coll_with")] = (cw, (x,))
    fns[(rn, "coll_base")] = (cb, (x,))
    meta[rn] = (r, collective_mib(colls))
  samples = planning.time_calls({k: (lambda f=f, a=a: f(*a)) for k, (f, a) in fns.items()},
                               warmup=2, rounds=iters)
  t = {k: _harness.median(v) * 1e3 for k, v in samples.items()}
  cpu = {k: _cpu_ms(*fns[k]) for k in fns if k[1] in ("step", "local")}
  rows = []
  for rn, (r, coll_mib) in meta.items():
    row = {"family": name, "layout": rn,
           "mesh": "x".join(f"{a}{n}" for a, n in r.mesh.shape.items()),
           "step": t[(rn, "step")], "local": t[(rn, "local")],
           "opt_gathered": t[(rn, "opt_gathered")], "opt_sharded": t[(rn, "opt_sharded")],
           "coll": t[(rn, "coll_with")] - t[(rn, "coll_base")], "coll_mib": coll_mib,
           "step_cpu": cpu[(rn, "step")], "local_cpu": cpu[(rn, "local")]}
    row["compute"] = row["local"] - row["opt_gathered"] + row["opt_sharded"]
    row["rest"] = row["step"] - row["compute"]
    for prefix, topo in (("p", None), ("c", calibrated)):
      if prefix == "c" and topo is None:
        continue
      for k, v in predicted_parts(fam, r, step, args, topo).items():
        row[f"{prefix}_{k}"] = v
    rows.append(row)
  return rows


# --probe's sizes: the elementwise buffer per device (MiB) and the product beside a collective
PROBE_MIB = (4, 64, 256)
PROBE_PRODUCTS = (256, 1024)


def probe_rows(topology) -> list[dict]:
  """The calibration's elementwise rate and its collective-between-products cost at several
  sizes (``--probe``): does the 4 MiB buffer measure the caches, and does the meeting cost grow
  with the product between the collectives?"""
  rows = []
  tiny = {"matmul": ((64, 64, 64),), "collectives": (4096,)}
  for mib in PROBE_MIB:
    cal = planning.calibrate_measure(topology, sizes={**tiny, "memory": mib << 20, "latency": 0})
    rows.append({"probe": "elementwise", "size": f"{mib} MiB per device",
                 "value": cal.memory_gbps, "unit": "GB/s per device"})
  for m in PROBE_PRODUCTS:
    cal = planning.calibrate_measure(topology, sizes={**tiny, "memory": 1 << 20, "latency": m})
    rows.append({"probe": "collective between products", "size": f"{m} x {m} product",
                 "value": cal.latency_s * 1e3, "unit": "ms"})
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/step_terms.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--families", default="encdec,llama_loop")
  ap.add_argument("--iters", type=_harness.positive_int, default=8)
  ap.add_argument("--no-calibrate", action="store_true")
  ap.add_argument("--probe", action="store_true",
                  help="first, the calibration's elementwise rate and meeting cost at several "
                  "sizes")
  ap.add_argument("--json", metavar="PATH")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  calibrated, notes = None, []
  if not args.no_calibrate:
    calibrated = dtenjax.Topology.current().calibrate()
    notes.append(calibrated.calibration.summary())
    print(notes[-1], flush=True)
  probes = probe_rows(dtenjax.Topology.current()) if args.probe else []
  if probes:
    print(_harness.table(probes, (("probe", "probe", "s"), ("size", "size", "s"),
                                  ("value", "value", ".2f"), ("unit", "unit", "s")),
                         title="the calibration's measurements at other sizes"), flush=True)
    _write(args, argv, probes, notes)
  rows = []
  for name in _harness.progress(list(filter(None, args.families.split(","))), "families"):
    rows += family_rows(name, args.iters, calibrated)
    print(_harness.table([r for r in rows if r["family"] == name], COLUMNS,
                         title=f"{name}: ms per step, measured and predicted"), flush=True)
    _write(args, argv, probes + rows, notes)     # after each family: a run cut short keeps it
  print(_write(args, argv, probes + rows, notes))
  return 0


def _write(args, argv, rows, notes) -> str:
  """Writes the JSON (with ``--json``); returns the line on the machine's load."""
  load = (f"{len(jax.devices())} {jax.devices()[0].platform} devices, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "step_terms", __file__, argv, {"families": args.families, "iters": args.iters},
        rows, kind="other", devices=jax.devices(), notes=notes + [load]))
  return load


if __name__ == "__main__":
  sys.exit(main())
