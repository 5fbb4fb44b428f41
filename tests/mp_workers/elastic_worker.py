"""Worker of tests/test_elastic_launch.py: a small MLP trained data parallel over every device the
job has, through dtenjax.elastic (alone, or under dtenjax.elastic.launch).

  python tests/mp_workers/elastic_worker.py OUT_DIR STEPS [FAULTS]

FAULTS: ``generation:rank:step:signal,...`` -- that process sends itself the signal (KILL or
STOP) after that many steps, once the step's snapshot is taken. Rank 0 of each generation
appends ``{"step", "loss", "generation", "devices"}`` lines to OUT_DIR/losses.jsonl and, at the
end, writes OUT_DIR/final.json (the parameters' and optimizer state's digest).

The model is common.mlp. Micro-batches: 24 per step (divisible by 8, 6 and 4 devices), averaged
by dtenjax.all_reduce(op="mean", reproducible=True); the batch of step s comes from numpy's
generator seeded with s; the step is dtenjax.reproducible_step (XLA_FLAGS carries
--xla_cpu_max_isa=AVX).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

from tests.mp_workers import common

MICRO = 24


def main() -> None:
  out_dir, steps = sys.argv[1], int(sys.argv[2])
  faults = [f.split(":") for f in sys.argv[3].split(",")] if len(sys.argv) > 3 else []
  import jax
  import dtenjax
  import dtenjax.elastic
  from dtenjax._src.elastic import memory

  ctx = dtenjax.elastic.init()
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

  model = common.mlp(mesh, 24)
  opt, grads_of = model.opt, model.grads_of
  state = {"params": model.params, "opt": model.opt_state}
  shardings = jax.tree.map(model.layout, state)
  state = jax.device_put(state, shardings)
  ctx.mark("planned", devices=n)
  state, step = ctx.restore(state)

  def train_step(s, x, y):
    p_all = jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, P())),
                         s["params"])
    loss, grads = grads_of(p_all, x, y)
    updates, o = opt.update(grads, s["opt"], p_all)
    new = {"params": optax.apply_updates(p_all, updates), "opt": o}
    return jax.tree.map(lambda a, sh: jax.sharding.reshard(a, sh), new, shardings), loss

  jstep = dtenjax.reproducible_step(train_step)
  batch = NamedSharding(mesh, P("data"))
  log = open(os.path.join(out_dir, "losses.jsonl"), "a") if jax.process_index() == 0 else None
  while step < steps:
    rng = np.random.default_rng(step)
    x = rng.standard_normal((MICRO, 2, 24), dtype=np.float32)
    y = rng.standard_normal((MICRO, 2, 4), dtype=np.float32)
    x, y = (jax.make_array_from_callback(a.shape, batch, lambda i, a=a: a[i]) for a in (x, y))
    state, loss = jstep(state, x, y)
    step += 1
    if log is not None:
      log.write(json.dumps({"step": step, "loss": np.float32(loss.addressable_data(0)).tobytes()
                            .hex(), "generation": ctx.generation, "devices": n}) + "\n")
      log.flush()
    ctx.step_done(step, state)
    for g, r, s, sig in faults:
      if (int(g), int(r), int(s)) == (ctx.generation, ctx.rank, step):
        if ctx.tier is not None:
          ctx.tier.wait()            # the fault comes after the step's snapshot is complete:
          # this process's own record, and its replica on the right neighbour, which that
          # process writes in its own time (on a loaded machine, after this one is gone)
          t_end = time.monotonic() + 60
          while ctx.tier.world > 1 and step not in memory.complete_steps(ctx.tier.root, ctx.tier.world, [ctx.rank]):
            assert time.monotonic() < t_end, f"step {step}'s snapshot never became complete"
            time.sleep(0.01)
        ctx.mark("fault", signal=sig, step=step)
        os.kill(os.getpid(), getattr(signal, "SIG" + sig))
        time.sleep(3600)
  h = hashlib.sha256()
  for full in jax.tree.leaves(common.gathered(state)):
    h.update(np.ascontiguousarray(full).tobytes())
  if jax.process_index() == 0:
    with open(os.path.join(out_dir, "final.json"), "w") as f:
      json.dump({"digest": h.hexdigest(), "step": step, "devices": n,
                 "generation": ctx.generation, "restored_from": ctx.restored_from}, f)
  ctx.finish()


if __name__ == "__main__":
  main()
