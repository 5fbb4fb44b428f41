"""Elastic jobs: the stall of in-memory snapshots, the time from a kill to the first step on the
smaller mesh, and goodput with a failure against restarting from the persistent checkpoint.

    python bench/elastic.py [--procs 4] [--devices-per-proc 2] [--width 256] [--steps 30]
                            [--fail-at 16] [--snapshot-every 1] [--checkpoint-every 10]
                            [--heartbeat 5] [--json F]

Four runs of bench/_elastic_worker.py under dtenjax.elastic.launch (an MLP of WIDTH x WIDTH
layers, adam, 24 micro-batches per step summed with reproducible all-reduces, data parallel over
every device), one after another on this host:

* ``off`` / ``on``: no failure, in-memory snapshots off / every ``--snapshot-every`` steps. Per
  run, the median step time of rank 0 after 3 warm-up steps (steps with and without a snapshot
  alike), and (``on``) the median time a snapshot held the step (joining the previous snapshot's
  background work, then the device-to-host copies). stall % = stall / step time of ``off``;
  ratio = step time ``off`` / ``on`` (the background writes and replica moves included, as they
  compete with the step for the host's cores).
* ``memory`` / ``persistent``: process 1 is killed (-9) after step ``--fail-at``; the job goes on
  with one process fewer, from the in-memory tier (snapshots every step and a persistent
  checkpoint every ``--checkpoint-every`` steps) or from the persistent checkpoint alone. From the
  launcher's event log: detect (kill -> the launcher's decision), restart (-> every new process
  has jax.distributed up), plan (-> the script has built its mesh and state), restore (-> the
  state is restored), compile (-> the first step on the smaller mesh is done, i.e. compile plus
  one step). goodput = steps x the ``on`` run's step time / wall time of the job;
  redone = steps computed twice (failure step - restored step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import _harness

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "_elastic_worker.py")


def _run(args, out, *, snapshot_every, fault=None, checkpoint_dir=None):
  import dtenjax.elastic
  os.makedirs(out, exist_ok=True)
  env = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices_per_proc} "
                      "--xla_cpu_max_isa=AVX"}
  argv = [WORKER, out, str(args.steps), str(args.width)] + ([fault] if fault else [])
  t0 = time.time()
  result = dtenjax.elastic.launch(
      argv, args.procs, min_nprocs=1, env=env, run_dir=os.path.join(out, "run"),
      snapshot_every=snapshot_every, checkpoint_dir=checkpoint_dir,
      checkpoint_every=args.checkpoint_every, heartbeat_timeout_s=args.heartbeat,
      timeout_s=args.timeout, quiet=True)
  return result, time.time() - t0


def _times(out, generation=0, rank=0):
  with open(os.path.join(out, f"times.g{generation}.r{rank}.json")) as f:
    return json.load(f)


def _split(result) -> dict:
  ev = result.events()

  def first(kind, **m):
    ts = [e["t"] for e in ev if e["event"] == kind and all(e.get(k) == v for k, v in m.items())]
    return min(ts) if ts else None

  def last(kind, **m):
    ts = [e["t"] for e in ev if e["event"] == kind and all(e.get(k) == v for k, v in m.items())]
    return max(ts) if ts else None
  fault = first("fault")
  marks = [fault, first("detected"), last("initialized", generation=1),
           last("planned", generation=1), last("restored", generation=1),
           first("first_step", generation=1)]
  names = ["detect_s", "restart_s", "plan_s", "restore_s", "compile_s"]
  out = {n: (b - a if a is not None and b is not None else None)
         for n, a, b in zip(names, marks, marks[1:])}
  out["kill_to_step_s"] = marks[-1] - fault if fault and marks[-1] else None
  g1 = result.generations[1] if len(result.generations) > 1 else None
  out["restored_from"] = g1.restore["source"] if g1 and g1.restore else "start"
  out["restored_step"] = g1.restore["step"] if g1 and g1.restore else 0
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--procs", type=_harness.positive_int, default=4)
  ap.add_argument("--devices-per-proc", type=_harness.positive_int, default=2)
  ap.add_argument("--width", type=_harness.positive_int, default=256)
  ap.add_argument("--steps", type=_harness.positive_int, default=30)
  ap.add_argument("--fail-at", type=_harness.positive_int, default=16)
  ap.add_argument("--snapshot-every", type=_harness.positive_int, default=1)
  ap.add_argument("--checkpoint-every", type=_harness.positive_int, default=10)
  ap.add_argument("--heartbeat", type=float, default=5.0, help="heartbeat timeout (s)")
  ap.add_argument("--timeout", type=float, default=1200.0, help="bound on each run (s)")
  ap.add_argument("--json", metavar="FILE")
  args = ap.parse_args(argv)
  argv = sys.argv[1:] if argv is None else list(argv)
  if args.procs < 2:
    _harness.refuse("bench/elastic.py", "--procs must be >= 2 (one process is killed)")
  if args.fail_at >= args.steps:
    _harness.refuse("bench/elastic.py", f"--fail-at {args.fail_at} must be < --steps "
                    f"{args.steps}")
  work = tempfile.mkdtemp(prefix="dtenjax-bench-elastic-")
  rows = []
  step_s = {}
  with _harness.steps("elastic", 4) as step:
    for mode, every in (("off", 0), ("on", args.snapshot_every)):
      step(f"snapshots {mode}")
      result, wall = _run(args, os.path.join(work, mode), snapshot_every=every)
      t = _times(os.path.join(work, mode))
      step_s[mode] = statistics.median(t["steps"][3:] or t["steps"])
      # no snapshots: no stall; snapshots that recorded no stall: not measured (no number)
      stall = (statistics.median(t["stall"][1:] or t["stall"]) if t["stall"] else
               0.0 if not every else None)
      rows.append({"run": mode, "step_ms": step_s[mode] * 1e3,
                   "stall_ms": None if stall is None else stall * 1e3,
                   "wall_s": wall, "generations": len(result.generations)})
    for r in rows:
      r["stall_pct"] = (None if r["stall_ms"] is None else
                        100 * r["stall_ms"] / (step_s["off"] * 1e3))
      r["ratio"] = step_s["off"] / (r["step_ms"] / 1e3)
    fault = f"0:1:{args.fail_at}"
    for mode, every in (("memory", args.snapshot_every), ("persistent", 0)):
      step(f"kill -9, restart from {mode}")
      out = os.path.join(work, mode)
      result, wall = _run(args, out, snapshot_every=every, fault=fault,
                          checkpoint_dir=os.path.join(out, "ck"))
      split = _split(result)
      rows.append({"run": mode, "wall_s": wall, "generations": len(result.generations),
                   "goodput": args.steps * step_s["on"] / wall,
                   "redone": args.fail_at - split["restored_step"], **split})
  stall_table = _harness.table(
      [r for r in rows if r["run"] in ("off", "on")],
      [("snapshots", "run", "s"), ("step (ms)", "step_ms", ".2f"),
       ("stall (ms)", "stall_ms", ".3f"),
       ("stall / step", "stall_pct", ".2f"), ("off / on", "ratio", "ratio")],
      title=f"in-memory snapshots every {args.snapshot_every} steps, {args.procs} processes x "
            f"{args.devices_per_proc} devices, width {args.width}")
  fail_table = _harness.table(
      [r for r in rows if r["run"] in ("memory", "persistent")],
      [("restart from", "run", "s"), ("restored", "restored_from", "s"),
       ("step", "restored_step", "d"), ("redone", "redone", "d"),
       ("detect (s)", "detect_s", ".2f"), ("restart (s)", "restart_s", ".2f"),
       ("plan (s)", "plan_s", ".2f"), ("restore (s)", "restore_s", ".3f"),
       ("compile (s)", "compile_s", ".2f"), ("kill->step (s)", "kill_to_step_s", ".2f"),
       ("job (s)", "wall_s", ".1f"), ("goodput", "goodput", ".3f")],
      title=f"kill -9 of process 1 after step {args.fail_at} of {args.steps}")
  print(stall_table)
  print(fail_table)
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "elastic", __file__, argv, vars(args), rows, kind="other",
        notes=["stall_pct: the snapshot's hold on the step / the step time without snapshots",
               "goodput: steps x step time (snapshots on) / the job's wall time"]))


if __name__ == "__main__":
  main()
