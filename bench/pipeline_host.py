"""Pipeline stages in separate processes: dtenjax's host transport against XLA's gloo path.

The same pipelined training step (``jax.value_and_grad`` of the mean loss over the micro-batches,
on the small Llama-shaped model of ``dtenjax.testing.pipeline_model``), with one stage per
process and one CPU device per process, run two ways on the same processes, timed round-robin in
one run:

* ``xla``: the SPMD pipeline (``dtenjax.pipeline`` inside ``jax.shard_map`` over a ``stage`` mesh
  axis spanning the processes): one program per process in lockstep, activations and cotangents
  by XLA's collective-permute over gloo (jax.distributed, ``jax_cpu_collectives_implementation``
  ``gloo``), or over NCCL with ``--backend gpu`` (GPU r for process r) -- what a user writes
  without dtenjax's transport;
* ``host``: ``dtenjax.HostPipeline``: each stage its own jitted programs and tick loop,
  messages over the host transport (TCP on loopback here; authenticated and MAC'd).

Each process times both; the table keeps the slowest process per candidate and gives
``ratio = xla time / host time`` (> 1: the host path is faster), and whether the two paths' losses
have the same bits. On a loaded 2-core machine with more busy processes than cores the times are
noisy; the JSON records the load.

  python bench/pipeline_host.py --procs 2 --json pipeline_host.json
  python bench/pipeline_host.py --procs 2 --backend gpu --json pipeline_host_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile

import _harness

SCHEDULES = ("gpipe", "1f1b")


def _measure(args) -> list[dict]:
  import jax
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import dtenjax
  from dtenjax.testing import pipeline_model as pm

  rank, procs = jax.process_index(), jax.process_count()
  cfg = dict(layers=args.layers, d=args.d, ffn=2 * args.d)
  params = pm.init(**cfg)
  toks = pm.tokens(args.microbatches * args.rows, **cfg)
  x = pm.embed(params["embed"], toks[:, :-1])
  targets = toks[:, 1:]
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("stage",))
  n = args.layers // procs

  def place(tree, spec):
    return jax.tree.map(lambda a: jax.make_array_from_callback(
        np.shape(a), NamedSharding(mesh, spec), lambda i, a=np.asarray(a): a[i]), tree)

  rows = []
  # one progress line per schedule, from the first process only (the others do the same)
  report = (_harness.steps("pipeline_host", len(args.schedules)) if rank == 0
            else contextlib.nullcontext(lambda label: None))
  with report as progress:
    for name in args.schedules:
      progress(f"{name}: xla and host interleaved")
      schedule = {"gpipe": dtenjax.GPipe(), "1f1b": dtenjax.OneFOneB()}[name]
      pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=procs, microbatches=args.microbatches,
                              schedule=schedule)

      def spmd(layers, head, x, t, pipe=pipe):
        return jax.value_and_grad(lambda a, b: pipe(a, b, x, t), argnums=(0, 1))(layers, head)

      step = jax.jit(jax.shard_map(spmd, mesh=mesh, in_specs=(P("stage"), P(), P(), P()),
                                   out_specs=(P(), (P("stage"), P()))))
      sharded = (place(params["layers"], P("stage")), place(params["head"], P()), place(x, P()),
                 place(targets, P()))

      def xla(step=step, sharded=sharded):
        with jax.set_mesh(mesh):
          return step(*sharded)

      mine = jax.tree.map(lambda a: a[rank * n:(rank + 1) * n], params["layers"])
      xin = x if rank == 0 else jax.ShapeDtypeStruct(x.shape, x.dtype)
      tin = targets if rank == procs - 1 else None
      with dtenjax.HostPipeline(pipe, name=f"bench-{name}") as hp:
        def host(hp=hp):
          return hp.value_and_grad(mine, params["head"], xin, tin)
        samples = _harness.interleaved({"xla": xla, "host": host}, warmup=args.warmup,
                                       iters=args.iters)
        same = np.asarray(xla()[0]).tobytes() == np.asarray(host()[0]).tobytes()
        provider = next(iter(hp.links.values())).provider
      for path, times in samples.items():
        rows.append({"schedule": name, "path": path, "stages": procs,
                     "microbatches": args.microbatches, "time_ms": _harness.median(times) * 1e3,
                     "same_loss_bits": same,
                     "transport": (("gloo" if args.backend == "cpu" else "nccl") if path == "xla"
                                   else provider)})
  return rows


def _merge(per_rank: list[list[dict]]) -> list[dict]:
  merged = {}
  for rows in per_rank:
    for r in rows:
      key = (r["schedule"], r["path"])
      if key not in merged or r["time_ms"] > merged[key]["time_ms"]:
        merged[key] = dict(r)
  out = sorted(merged.values(), key=lambda r: (SCHEDULES.index(r["schedule"]), r["path"] != "xla"))
  return _harness.add_ratios(out, "xla", candidate="path", group=("schedule",), time_key="time_ms")


def _launch(args, argv) -> list[dict]:
  from dtenjax.testing.ports import free_port
  port = free_port()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with tempfile.TemporaryDirectory() as out:
    procs = []
    for r in range(args.procs):
      env = dict(os.environ, DTENJAX_BENCH_RANK=str(r), DTENJAX_BENCH_OUT=out,
                 DTENJAX_BENCH_COORDINATOR=f"127.0.0.1:{port}", DTENJAX_BIND_ADDRESS="127.0.0.1",
                 PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
      if args.backend == "cpu":
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
      procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                     *argv], env=env))
    _harness.wait_workers(procs, args.timeout, "pipeline_host")
    return _merge([json.load(open(os.path.join(out, f"rank{r}.json")))
                   for r in range(args.procs)])


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(prog="dtenjax bench pipeline_host", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--procs", type=int, default=2, help="processes = stages (one device each)")
  p.add_argument("--backend", default="cpu", choices=["cpu", "gpu"],
                 help="cpu: one CPU device per process, XLA's path over gloo; gpu: GPU r for "
                 "process r, XLA's path over NCCL")
  p.add_argument("--schedules", default=",".join(SCHEDULES),
                 type=lambda s: [v for v in s.split(",") if v], help="comma list of gpipe,1f1b")
  p.add_argument("--microbatches", type=_harness.positive_int, default=8)
  p.add_argument("--rows", type=_harness.positive_int, default=2,
                 help="sequences per micro-batch")
  p.add_argument("--layers", type=_harness.positive_int, default=8)
  p.add_argument("--d", type=_harness.positive_int, default=32, help="model width")
  p.add_argument("--iters", type=_harness.positive_int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--timeout", type=float, default=600, help="seconds for the workers")
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.procs < 2:
    p.error(f"--procs {args.procs}: the stages must be in at least 2 processes")
  bad = [s for s in args.schedules if s not in SCHEDULES]
  if bad:
    p.error(f"unknown schedule(s) {bad}; choose from {list(SCHEDULES)}")
  if args.layers % args.procs:
    p.error(f"--layers {args.layers} does not split into {args.procs} stages")
  if args.worker:
    import jax
    rank = int(os.environ["DTENJAX_BENCH_RANK"])
    if args.backend == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["DTENJAX_BENCH_COORDINATOR"],
                               num_processes=args.procs, process_id=rank,
                               local_device_ids=[rank] if args.backend == "gpu" else None,
                               initialization_timeout=120)
    rows = _measure(args)
    with open(os.path.join(os.environ["DTENJAX_BENCH_OUT"],
                           f"rank{jax.process_index()}.json"), "w") as f:
      json.dump(rows, f)
    return 0
  rows = _launch(args, argv)
  params = {k: getattr(args, k) for k in ("procs", "backend", "schedules", "microbatches", "rows", "layers",
                                          "d", "iters", "warmup")}
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "pipeline_host", __file__, argv, params, rows, kind="other",
        machine_extra={"processes": args.procs, "devices_per_process": 1},
        notes=["ratio = xla (gloo) time / host time; > 1: the host path is faster",
               "each candidate's time is its slowest process's median"]))
  print(_harness.table(rows, (("schedule", "schedule", "s"), ("path", "path", "s"),
                              ("transport", "transport", "s"), ("step (ms)", "time_ms", ".2f"),
                              ("xla/host", "ratio", "ratio"),
                              ("same loss bits", "same_loss_bits", "")),
                       title=f"pipelined step, {args.procs} stages in {args.procs} processes "
                       f"({args.backend}), "
                       f"{args.microbatches} micro-batches of {args.rows} sequences"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
