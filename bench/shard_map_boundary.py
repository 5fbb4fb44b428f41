"""A step with a ``jax.shard_map`` over the user's own mesh inside (a per-shard centring of the
batch before an MLP), on 8 CPU devices: what the plan's boundary with the shard_map costs, timed
beside what the user writes without dtenjax.

Times, round-robin in one process (each candidate its own placed arguments, one call a round,
every other round in the reverse order),
plain ``jax.jit`` on the user's mesh with ``NamedSharding``s (data-parallel: the batch split as the
shard_map's ``in_specs``, the weights replicated), ``plan.jit`` of the planner's default, and on
each forced mesh ``plan.jit`` with the shard_map's results pinned to the plan's batch layout
(``pinned``: ``StepPlan.manual`` "all") and left to XLA (``free``: XLA's partitioner picks their
layout, and on `fsdp` 4 x `tensor` 2 replicates them to get there); ``jit`` says which of the two
``plan.jit`` runs (``gather.pins_manual``). Each row has the plan's price, the compiled memory per
device and collective bytes per step, and its ``plan.check`` miss (memory and collective bytes
against XLA's compile)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/shard_map_boundary.py \\
        --iters 20 --json bench/results/DATE_shard_map_boundary_BRANCH.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _harness

BENCH = "shard_map_boundary"
MESHES = ({"data": 8}, {"fsdp": 8}, {"fsdp": 4, "tensor": 2}, {"data": 4, "tensor": 2})


def make(batch: int, d: int, hidden: int, user_mesh):
  """(step, args): the shard_map's centring over ``user_mesh`` (its "data" axis), then an MLP
  trained with adamw on the mean squared error."""
  tx = optax.adamw(1e-2)

  def loss(p, x, y):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  def step(params, opt_state, batch):
    def center(x):
      return x - jnp.mean(x, 0, keepdims=True)
    x = jax.shard_map(center, mesh=user_mesh, in_specs=P("data"), out_specs=P("data"))(
        batch["x"])
    value, grads = jax.value_and_grad(loss)(params, x, batch["y"])
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.1, jnp.float32)
  params = {"w1": normal(d, hidden), "b1": jnp.zeros((hidden,)), "w2": normal(hidden, d),
            "b2": jnp.zeros((d,))}
  return step, (params, tx.init(params), {"x": normal(batch, d), "y": normal(batch, d)})


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=_harness.positive_int, default=512)
  ap.add_argument("--dim", type=_harness.positive_int, default=512)
  ap.add_argument("--hidden", type=_harness.positive_int, default=2048)
  ap.add_argument("--iters", type=_harness.positive_int, default=10)
  ap.add_argument("--warmup", type=_harness.positive_int, default=2)
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  devices = _harness.require_devices(BENCH, 8)
  import dtenjax
  user_mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  step, concrete = make(args.batch, args.dim, args.hidden, user_mesh)
  shard = lambda spec: NamedSharding(user_mesh, spec)
  plain = (*jax.tree.map(lambda _: shard(P()), concrete[:2]),
           jax.tree.map(lambda _: shard(P("data")), concrete[2]))
  fns = {"plain jit, user's mesh": jax.jit(step, in_shardings=plain)}
  placed = {"plain jit, user's mesh": jax.device_put(concrete, plain)}
  info = {"plain jit, user's mesh": {"mesh": "data 8 (user's)"}}
  plans = [("default", dtenjax.plan(step, *concrete))]
  plans += [(" x ".join(f"{k} {v}" for k, v in m.items()), dtenjax.plan(step, *concrete, mesh=m))
            for m in MESHES]
  for name, plan in _harness.progress(plans, BENCH, lambda p: p[0]):
    mesh = " x ".join(f"{a} {n}" for a, n in zip(plan.axis_names, plan.mesh_shape) if n > 1)
    chosen = "pinned" if plan.manual else "free"
    for variant in ((chosen,) if name == "default" else ("pinned", "free")):
      run = dataclasses.replace(plan, manual="all" if variant == "pinned" else "")
      key = f"plan {name}" + ("" if name == "default" else f", {variant}")
      check = run.check(step, *concrete)
      fns[key] = run.jit(step)
      placed[key] = run.shard(*concrete)
      info[key] = {"mesh": mesh, "jit": "yes" if variant == chosen else "",
                   "priced_ms": 1e3 * plan.cost.total_s,
                   "memory_mib": check.compiled_memory["total"] / 2**20,
                   "collective_mib": sum(check.compiled_bytes.values()) / 2**20,
                   "memory_miss": check.memory_error, "bytes_miss": check.bytes_error}
  samples = {k: [] for k in fns}
  for k, f in fns.items():
    for _ in range(args.warmup):
      _harness.block(f(*placed[k]))
  order = list(fns)
  for i in range(args.iters):
    # every other round backwards: a candidate timed right after another is slower on this VM
    # (pinned and unpinned `fsdp` 8, one HLO, measured 2 to 14 % apart in one order)
    for k in (order if i % 2 == 0 else order[::-1]):
      f = fns[k]
      t0 = time.perf_counter()
      _harness.block(f(*placed[k]))
      samples[k].append(time.perf_counter() - t0)
  base = samples["plain jit, user's mesh"]
  rows = [{"candidate": k, **info[k], "ms": 1e3 * _harness.median(samples[k]),
           "vs_plain": _harness.median([a / b for a, b in zip(samples[k], base)])}
          for k in fns]
  print(_harness.table(rows, (("candidate", "candidate", "s"), ("mesh", "mesh", "s"),
                              ("plan.jit", "jit", "s"),
                              ("ms", "ms", ".2f"), ("/ plain", "vs_plain", "ratio"),
                              ("priced ms", "priced_ms", ".2f"),
                              ("memory MiB", "memory_mib", ".2f"),
                              ("moved MiB", "collective_mib", ".2f"),
                              ("memory miss", "memory_miss", ".1%"),
                              ("bytes miss", "bytes_miss", ".1%"))), flush=True)
  if args.json:
    doc = _harness.document(BENCH, __file__, sys.argv[1:] if argv is None else argv,
                            dict(vars(args)), rows, devices=devices, kind="other")
    _harness.write_json(args.json, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
