"""What ``plan.jit``'s function costs per call beside the plain ``jax.jit`` a user writes with the
same shardings, on a step so small that dispatch is the whole time.

``plan.jit`` returns a thin wrapper of ``jax.jit``'s function (it binds arguments passed by name
and names the arguments JAX refuses); its call adds one Python frame to jax.jit's C++ dispatch.
Times, round-robin in one process, ``--calls`` calls of each candidate per round (waiting for the
last one's outputs), over ``--rounds`` rounds: ``jax.jit(step, in_shardings=plan.shardings(),
out_shardings=plan.out_shardings())``, ``plan.jit(step)`` called positionally, and the same called
with the batch by name (``train(params, x=x)``: the step's signature binds it). The step's
compiled program runs no collective, so that the call's dispatch is what is timed. Every candidate
gets the same arguments, laid out by ``plan.shard``; ``vs jax.jit`` is the median over the rounds
of the candidate's time over the plain jit's in that round, ``spread`` half its interquartile
range::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/plan_jit_dispatch.py \\
        --calls 100 --rounds 100 --json bench/results/DATE_plan_jit_dispatch_BRANCH.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import _harness

BENCH = "plan_jit_dispatch"


def step(p, x):
  """An 8 x 8 state moved towards the batch, both laid out by rows over the 8 devices: no
  collective (XLA:CPU's in-process all-reduce, 0.8 ms a call here, and its rendezvous stalling
  with many calls in flight, would be what is timed), microseconds of work; the rest is
  dispatch."""
  return {"w": p["w"] * 0.9 + 0.1 * jnp.tanh(x)}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--calls", type=_harness.positive_int, default=100,
                  help="calls of each candidate per round")
  ap.add_argument("--rounds", type=_harness.positive_int, default=100)
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  devices = _harness.require_devices(BENCH, 8)
  import dtenjax
  params = {"w": jnp.ones((8, 8), jnp.float32) * 0.1}
  x = jnp.ones((8, 8), jnp.float32)
  plan = dtenjax.plan(step, params, x, mesh={"fsdp": 8}, pinned=({"w": P("fsdp")}, None))
  params, x = plan.shard(params, x)
  plain = jax.jit(step, in_shardings=plan.shardings(), out_shardings=plan.out_shardings())
  train = plan.jit(step)
  fns = {"jax.jit": lambda: plain(params, x), "plan.jit": lambda: train(params, x),
         "plan.jit by name": lambda: train(params, x=x)}
  for f in fns.values():
    _harness.block(f())
  per_call = {k: [] for k in fns}
  for _ in _harness.progress(range(args.rounds), BENCH, lambda r: f"round {r + 1}"):
    for k, f in fns.items():
      t0 = time.perf_counter()
      for _ in range(args.calls):
        out = f()
      _harness.block(out)
      per_call[k].append((time.perf_counter() - t0) / args.calls)
  rows = []
  for k, times in per_call.items():
    ratios = [a / b for a, b in zip(times, per_call["jax.jit"])]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    rows.append({"candidate": k, "us_per_call": 1e6 * _harness.median(times),
                 "vs_jit": _harness.median(ratios), "spread": (q[2] - q[0]) / 2,
                 "calls": args.calls * args.rounds})
  print(_harness.table(rows, (("candidate", "candidate", "s"), ("us / call", "us_per_call", ".1f"),
                              ("vs jax.jit", "vs_jit", ".3f"), ("spread", "spread", ".3f"),
                              ("calls", "calls", "d"))), flush=True)
  if args.json:
    doc = _harness.document(BENCH, __file__, sys.argv[1:] if argv is None else argv,
                            dict(vars(args)), rows, devices=devices, kind="other")
    _harness.write_json(args.json, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
