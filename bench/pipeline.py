"""Pipeline parallelism (dtenjax.pipeline): the bubble, the memory and the step time, measured.

Three tables, on the small Llama-shaped model of ``dtenjax.testing.pipeline_model``:

1. **bubble**: for each schedule, ``p`` stages (a mesh of ``p`` devices, no data axis) and ``m``
   micro-batches, the jitted ``jax.value_and_grad`` of the pipelined loss against the work one
   stage does alone (a loop on one device over the ``m`` micro-batches: forward, then the
   backward that recomputes it, as the pipeline does): measured bubble = 1 - work / pipelined,
   next to the schedule's theory ((p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m + p-1)
   interleaved) and the lockstep prediction of ``dtenjax.pipeline_cost``;
2. **memory**: per device, the temporary bytes of each compiled pipelined step
   (``memory_analysis()``) and the micro-batch inputs its schedule holds: GPipe's grow with ``m``,
   1F1B's stay below ``2p``;
3. **step time**: one adamw training step on all devices, pipelined (``p`` stages x ``n/p`` data
   shards) against the unpipelined data-parallel step a user writes (``jax.jit`` over
   ``jax.shard_map``, every layer on every device, gradient accumulation over the same
   micro-batch size, ``lax.psum``), side by side; speedup = unpipelined time / pipelined.

On simulated CPU devices the devices share the host's cores: with fewer cores than devices the
pipelined times include that contention, and the measured bubble is an upper bound. The JSON
records the core count.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/pipeline.py --json pipeline.json
"""

from __future__ import annotations

import argparse
import sys

import _harness

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")


def _ints(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: give integers >= 1, e.g. 2,4,8")
  return values


def _schedules(text: str) -> list[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in names if s not in SCHEDULE_NAMES]
  if bad or not names:
    raise argparse.ArgumentTypeError(f"schedules {bad or text!r}: choose from {SCHEDULE_NAMES}")
  return names


def _schedule(name):
  import dtenjax
  return {"gpipe": dtenjax.GPipe(), "1f1b": dtenjax.OneFOneB(),
          "interleaved": dtenjax.Interleaved(virtual=2)}[name]


def bubble_and_memory(args):
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.sharding import PartitionSpec as P

  import dtenjax
  from dtenjax.testing import pipeline_model as pm

  cfg = dict(layers=args.layers, d=args.d, ffn=2 * args.d, seq=args.seq)
  params = pm.init(**cfg)
  rows = []
  stages = [p for p in args.stages if p <= jax.device_count() and not args.layers % p]
  with _harness.steps("pipeline: bubble and memory", len(stages) * len(args.micro)) as step:
    for p in args.stages:
      if p > jax.device_count() or args.layers % p:
        continue
      mesh = jax.sharding.Mesh(jax.devices()[:p], ("stage",))
      specs = pm.param_specs(params, "stage")
      stage_layers = jax.tree.map(lambda a: a[:args.layers // p], params["layers"])
      for m in args.micro:
        step(f"{p} stages, {m} micro-batches")
        toks = pm.tokens(m * args.rows, **cfg)
        xs = pm.embed(params["embed"], toks[:, :-1]).reshape(m, args.rows, args.seq, args.d)

        def work(layers, xs):       # one stage alone: forward, then the recomputing backward
          stage = lambda w, h: lax.scan(pm.body, h, w)[0]

          def one(acc, x):
            y = stage(layers, x)
            _, pull = jax.vjp(stage, layers, x)
            g, _ = pull(y)
            return jax.tree.map(jnp.add, acc, g), None
          return lax.scan(one, jax.tree.map(jnp.zeros_like, layers), xs)[0]
        alone = jax.jit(work)
        fns, exes = {"alone": lambda: alone(stage_layers, xs)}, {}
        for name in args.schedules:
          s = _schedule(name)
          if s.check(p, m) or args.layers % (p * s.virtual):
            continue
          pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=p, microbatches=m, schedule=s)
          staged = {**params, "layers": pipe.to_stages(params["layers"])}

          def step(prm, t, pipe=pipe):
            def loss(q):
              return pipe(q["layers"], q["head"], pm.embed(q["embed"], t[:, :-1]), t[:, 1:])
            return jax.value_and_grad(loss)(prm)
          f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)))
          exe = f.lower(staged, toks).compile()
          exes[name] = (exe, pipe)
          fns[name] = lambda exe=exe, staged=staged: exe(staged, toks)
        if not exes:
          continue
        samples = _harness.interleaved(fns, (), warmup=args.warmup, iters=args.iters)
        t_alone = _harness.median(samples["alone"])
        input_bytes = args.rows * args.seq * args.d * 4
        for name, (exe, pipe) in exes.items():
          t = _harness.median(samples[name])
          cost = pipe.cost(input_bytes=input_bytes)
          mem = exe.memory_analysis()
          rows.append({"schedule": repr(pipe.schedule), "stages": p, "microbatches": m,
                       "time_ms": t * 1e3, "alone_ms": t_alone * 1e3,
                       "bubble": 1 - t_alone / t, "theory": cost.theory_bubble,
                       "predicted": cost.bubble, "inputs_held": cost.live_inputs,
                       "input_bytes": input_bytes,
                       "temp_bytes": getattr(mem, "temp_size_in_bytes", None)})
  return rows


def step_times(args):
  import jax
  import numpy as np
  import optax
  from jax.sharding import PartitionSpec as P

  import dtenjax
  from dtenjax.testing import pipeline_model as pm

  n = jax.device_count()
  cfg = dict(layers=args.layers, d=args.d, ffn=2 * args.d, seq=args.seq)
  params = pm.init(**cfg)
  tx = optax.adamw(1e-3)
  m = max(args.micro)
  rows, fns = [], {}
  toks = pm.tokens(n * m * args.rows, **cfg)     # n devices x m micro-batches of `rows` rows
  flat = jax.sharding.Mesh(np.asarray(jax.devices()), ("data",))
  rspecs = pm.param_specs(params, None)
  opt = tx.init(params)
  rospecs = pm.opt_specs(opt, params, rspecs)
  ref = jax.jit(jax.shard_map(
      pm.reference_step(m, tx, data_size=n, reproducible=False), mesh=flat,
      in_specs=(rspecs, rospecs, P("data")), out_specs=(rspecs, rospecs, P())))
  ref_exe = ref.lower(params, opt, toks).compile()
  fns["unpipelined"] = lambda: ref_exe(params, opt, toks)
  shapes = {"unpipelined": f"{n} data"}
  schedules = args.schedules if args.step_schedules is None else args.step_schedules
  stages = [p for p in args.stages if p <= n and not n % p and not args.layers % p]
  with _harness.steps("pipeline: step times", len(stages) * len(schedules) + 1) as step:
    for p in args.stages:
      if p > n or n % p or args.layers % p:
        continue
      for name in schedules:
        step(f"compile {name}, {p} stages")
        s = _schedule(name)
        mp = m * p      # each of the n/p data shards has p times the rows: the same micro-batch size
        if s.check(p, mp) or args.layers % (p * s.virtual):
          continue
        mesh = jax.sharding.Mesh(np.asarray(jax.devices()).reshape(p, n // p), ("stage", "data"))
        pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=p, microbatches=mp, schedule=s)
        staged = {**params, "layers": pipe.to_stages(params["layers"])}
        specs = pm.param_specs(params, "stage")
        sopt = tx.init(staged)
        ospecs = pm.opt_specs(sopt, params, specs)
        f = jax.jit(jax.shard_map(
            pm.pipelined_step(pipe, tx, data_size=n // p, reproducible=False), mesh=mesh,
            in_specs=(specs, ospecs, P("data")), out_specs=(specs, ospecs, P())))
        exe = f.lower(staged, sopt, toks).compile()
        key = f"{name} p={p}"
        fns[key] = lambda exe=exe, staged=staged, sopt=sopt: exe(staged, sopt, toks)
        shapes[key] = f"{p} stages x {n // p} data, {mp} micro"
    step(f"time {len(fns)} steps, {args.iters} rounds")
    samples = _harness.interleaved(fns, (), warmup=args.warmup, iters=args.iters)
  base = _harness.median(samples["unpipelined"])
  for key, sample in samples.items():
    t = _harness.median(sample)
    rows.append({"candidate": key, "layout": shapes[key], "time_ms": t * 1e3,
                 "speedup": base / t})
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m dtenjax bench pipeline", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--stages", type=_ints, default=[2, 4, 8])
  ap.add_argument("--micro", type=_ints, default=[4, 8, 16, 32], help="micro-batches per step")
  ap.add_argument("--schedules", type=_schedules, default=list(SCHEDULE_NAMES))
  ap.add_argument("--step-schedules", type=_schedules, default=None,
                  help="the schedules of the step table (default: --schedules); each is one more "
                  "compiled step with its optimizer")
  ap.add_argument("--layers", type=_harness.positive_int, default=16)
  ap.add_argument("--d", type=_harness.positive_int, default=64, help="model width")
  ap.add_argument("--seq", type=_harness.positive_int, default=16)
  ap.add_argument("--rows", type=_harness.positive_int, default=2, help="sequences per micro-batch")
  ap.add_argument("--iters", type=_harness.positive_int, default=5)
  ap.add_argument("--warmup", type=_harness.positive_int, default=1)
  ap.add_argument("--json", default=None, help="write the rows to this path")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  import os

  import jax
  _harness.require_world("bench/pipeline.py", jax.device_count(), 2,
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
  bubble = bubble_and_memory(args)
  steps = step_times(args)
  cores = os.cpu_count()
  print(f"{jax.device_count()} {jax.default_backend()} devices on {cores} cores; model: "
        f"{args.layers} layers, width {args.d}, {args.rows} x {args.seq} tokens per micro-batch")
  print(_harness.table(bubble, (
      ("schedule", "schedule", "s"), ("p", "stages", "d"), ("m", "microbatches", "d"),
      ("pipelined (ms)", "time_ms", ".1f"), ("one stage alone (ms)", "alone_ms", ".1f"),
      ("bubble", "bubble", ".3f"), ("theory", "theory", ".3f"), ("predicted", "predicted", ".3f"),
      ("inputs held", "inputs_held", "d"), ("temp bytes", "temp_bytes", "d")),
      title="bubble and memory: measured bubble = 1 - alone / pipelined"))
  print(_harness.table(steps, (("candidate", "candidate", "s"), ("layout", "layout", "s"),
                               ("step (ms)", "time_ms", ".1f"), ("speedup", "speedup", "ratio")),
                       title="one adamw step on every device; speedup = unpipelined / this"))
  if args.json:
    rows = [dict(r, table="bubble") for r in bubble] + [dict(r, table="step") for r in steps]
    config = {k: v for k, v in vars(args).items()      # the default run's config as before
              if k != "json" and not (k == "step_schedules" and v is None)}
    _harness.write_json(args.json, _harness.document(
        "pipeline", __file__, argv, config, rows,
        devices=jax.devices(), kind="other", machine_extra={"cores": cores}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
