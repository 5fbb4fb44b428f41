"""Worker of tests/test_checkpoint.py: trains, saves and restores in a fresh process (one of
several under jax.distributed when DTENJAX_TEST_COORDINATOR is set).

  python -m tests.mp_workers.checkpoint_worker train --steps N [--restore DIR] [--save DIR] \
      [--geometry CKPT_DIR]
  python -m tests.mp_workers.checkpoint_worker geometry CKPT_DIR

(``train ... --geometry CKPT_DIR`` does both in the same processes, the geometry's result under
the key ``geometry``: one set of processes for both of the multi-process tests.)

The result is one JSON line on stdout, or (under jax.distributed) tests/mp_workers/common.py's
rank file.

train: a small MLP (common.mlp), data parallel over every device (mesh axis "data"), each
device's micro-batches' gradients averaged by dtenjax.all_reduce(op="mean", reproducible=True),
adam, compiled with dtenjax.reproducible_step; parameters whose first dimension divides the
device count are sharded along it. The batch of step s comes from numpy's generator seeded with
s, so a run that restores step 10 sees the batches a run that never stopped sees.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

from tests.mp_workers import common

MICRO = 8


def _multi() -> bool:
  return bool(os.environ.get("DTENJAX_TEST_COORDINATOR"))


def train(steps: int, restore: str | None, save: str | None) -> dict:
  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import dtenjax
  import dtenjax.checkpoint as ckpt

  n = jax.device_count()
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

  model = common.mlp(mesh, 16)
  opt = model.opt
  state = {"params": model.params, "opt": model.opt_state}
  shardings = jax.tree.map(model.layout, state)
  state = {**jax.device_put(state, shardings), "step": 0}
  if restore:
    state = ckpt.restore(restore, state)
  grads_of = model.grads_of

  def step(p, o, x, y):
    p_all = jax.tree.map(lambda a: jax.sharding.reshard(a, NamedSharding(mesh, P())), p)
    loss, grads = grads_of(p_all, x, y)
    updates, o = opt.update(grads, o, p_all)
    p = optax.apply_updates(p_all, updates)
    return (jax.tree.map(lambda a, s: jax.sharding.reshard(a, s), p, shardings["params"]),
            jax.tree.map(lambda a, s: jax.sharding.reshard(a, s), o, shardings["opt"]),
            loss)

  jstep = dtenjax.reproducible_step(step)
  batch = NamedSharding(mesh, P("data"))
  losses = []
  for _ in range(steps):
    s = state["step"]
    rng = np.random.default_rng(s)
    x = rng.standard_normal((MICRO, 2, 16), dtype=np.float32)
    y = rng.standard_normal((MICRO, 2, 4), dtype=np.float32)
    x, y = (jax.make_array_from_callback(a.shape, batch, lambda i, a=a: a[i]) for a in (x, y))
    p, o, loss = jstep(state["params"], state["opt"], x, y)
    state = {"params": p, "opt": o, "step": s + 1}
    losses.append(np.float32(loss.addressable_data(0)).tobytes().hex())
  report = None
  if save:
    report = str(ckpt.save(save, state))
  h = hashlib.sha256()
  for full in jax.tree.leaves(common.gathered({"params": state["params"], "opt": state["opt"]})):
    h.update(np.ascontiguousarray(full).tobytes())
  return {"losses": losses, "digest": h.hexdigest(), "step": state["step"], "devices": n,
          "processes": jax.process_count(), "report": report}


def geometry(ckpt_dir: str) -> dict:
  """2 processes x 4 devices: save a 2 x 4-sharded array, restore it onto 4 x 2 and onto rows
  over 8 devices; what each process wrote and read."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  import dtenjax.checkpoint as ckpt

  ref = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
  m24 = jax.make_mesh((2, 4), ("a", "b"))
  x = jax.make_array_from_callback(ref.shape, NamedSharding(m24, P("a", "b")), lambda i: ref[i])
  rep = jax.make_array_from_callback((5,), NamedSharding(m24, P()),
                                     lambda i: np.arange(5, dtype=np.int32)[i])
  saved = ckpt.save(ckpt_dir, {"x": x, "rep": rep, "step": 7}, block_bytes=4096)
  pid = jax.process_index()
  with open(os.path.join(ckpt_dir, "_dtenjax", f"process_{pid}.json")) as f:
    wrote = {k: sorted(v) for k, v in json.load(f)["chunks"].items()}
  out = {"process": pid, "saved_files": saved.files, "saved_bytes": saved.bytes, "wrote": wrote}
  m42 = jax.make_mesh((4, 2), ("a", "b"))
  m8 = jax.make_mesh((8,), ("x",))
  for label, sharding in (("4x2", NamedSharding(m42, P("a", "b"))),
                          ("rows8", NamedSharding(m8, P("x"))),
                          ("replicated", NamedSharding(m8, P()))):
    tree, report = ckpt.restore(ckpt_dir, {"x": x, "rep": rep, "step": 0},
                                shardings={"x": sharding, "rep": NamedSharding(m8, P()),
                                           "step": None}, report=True)
    ok = all(np.array_equal(np.asarray(s.data), ref[s.index])
             for s in tree["x"].addressable_shards)
    ok = ok and tree["step"] == 7 and all(
        np.array_equal(np.asarray(s.data), np.arange(5)) for s in tree["rep"].addressable_shards)
    out[label] = {"ok": bool(ok), "bytes": report.bytes,
                  "sharding": str(tree["x"].sharding.spec)}
  return out


def main() -> None:
  mode = sys.argv[1]
  if _multi():
    common.init()
  if mode == "train":
    args = sys.argv[2:]
    opt = {args[i]: args[i + 1] for i in range(0, len(args), 2)}
    result = train(int(opt["--steps"]), opt.get("--restore"), opt.get("--save"))
    if "--geometry" in opt:
      result["geometry"] = geometry(opt["--geometry"])
  else:
    result = geometry(sys.argv[2])
  if _multi():
    common.finish(result)
  else:
    print(json.dumps(result))


if __name__ == "__main__":
  main()
