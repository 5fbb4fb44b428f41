"""The training script bench/elastic.py launches: an MLP of configurable width, data parallel over
every device of the job with reproducible sums, under dtenjax.elastic.

  python bench/_elastic_worker.py OUT_DIR STEPS WIDTH [FAULT]     FAULT: generation:rank:step

Each process writes OUT_DIR/times.g<generation>.r<rank>.json: its step times (s) and the stall
of each in-memory snapshot (s).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

MICRO = 24


def main() -> None:
  out_dir, steps, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  fault = tuple(int(v) for v in sys.argv[4].split(":")) if len(sys.argv) > 4 else None
  import dtenjax
  import dtenjax.elastic
  ctx = dtenjax.elastic.init()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  k1, k2 = jax.random.split(jax.random.key(0))
  params = {"w1": jax.random.normal(k1, (width, width)) / np.sqrt(width),
            "w2": jax.random.normal(k2, (width, width)) / np.sqrt(width)}
  opt = optax.adam(1e-3)
  state = {"params": params, "opt": opt.init(params)}
  shardings = jax.tree.map(
      lambda x: NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % n == 0 else P()), state)
  state = jax.device_put(state, shardings)
  ctx.mark("planned", devices=n)
  state, step = ctx.restore(state)

  def loss_fn(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - x) ** 2)

  def local(p, x):
    losses, grads = jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(p, b), x)
    grads = dtenjax.all_reduce(grads, "data", op="mean", reproducible=True, local_axis=0)
    return dtenjax.all_reduce(losses, "data", op="mean", reproducible=True, local_axis=0), grads

  grads_of = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()),
                           check_vma=False)

  def train_step(s, x):
    p_all = jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, P())),
                         s["params"])
    loss, grads = grads_of(p_all, x)
    updates, o = opt.update(grads, s["opt"], p_all)
    new = {"params": optax.apply_updates(p_all, updates), "opt": o}
    return jax.tree.map(lambda a, sh: jax.sharding.reshard(a, sh), new, shardings), loss

  jstep = dtenjax.reproducible_step(train_step)
  batch = NamedSharding(mesh, P("data"))
  times = []
  while step < steps:
    t0 = time.perf_counter()
    x = np.random.default_rng(step).standard_normal((MICRO, 8, width), dtype=np.float32)
    x = jax.make_array_from_callback(x.shape, batch, lambda i, a=x: a[i])
    state, loss = jstep(state, x)
    loss.block_until_ready()
    step += 1
    ctx.step_done(step, state)
    times.append(time.perf_counter() - t0)
    if fault is not None and (ctx.generation, ctx.rank, step) == fault:
      if ctx.tier is not None:
        ctx.tier.wait()
      ctx.mark("fault", step=step)
      os.kill(os.getpid(), signal.SIGKILL)
  with open(os.path.join(out_dir, f"times.g{ctx.generation}.r{ctx.rank}.json"), "w") as f:
    json.dump({"steps": times, "stall": ctx.tier.stall_s if ctx.tier else [],
               "devices": n}, f)
  ctx.finish()


if __name__ == "__main__":
  main()
