"""Reproducible all-reduce of stacked contributions: per leaf against bucketed, side by side.

A reproducible data-parallel step hands ``dtenjax.all_reduce`` every micro-batch's gradient
(``local_axis=0``, the contributions stacked on axis 0 of each leaf). Leaf by leaf
(``bucket_bytes=0``) each leaf gets its own encode, exchange and decode; bucketed (the default
``DTENJAX_BUCKET_BYTES``) leaves share ``[contributions, values]`` buffers. Per contract, on a
transformer-shaped gradient tree (``--layers`` blocks of 4 ``d x d`` and 2 ``d x 4d`` weights
with their biases and norms, ``--micro`` contributions per device), over every device: the
collectives the step asks for (StableHLO), the compile time (one fresh compile each, no
persistent cache) and the median time of one call (interleaved), with ``speedup`` = per leaf's
time / this candidate's (higher is better), and whether the bits agree (they must).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/stacked_buckets.py \
      --json stacked_buckets.json
"""

from __future__ import annotations

import argparse
import re
import sys
import time

import _harness


def gradient_tree(layers: int, d: int, micro: int, world: int):
  """{name: [world * micro, ...]}: one contribution per micro-batch, shaped like a transformer's
  gradients (attention and MLP weights, biases, norm scales). Drawn with numpy: an eager
  ``jax.random.normal`` compiles a program per leaf shape (about 0.7 s of CPU each, more than
  half of a small run)."""
  import numpy as np
  shapes = {}
  for i in range(layers):
    for w in ("q", "k", "v", "o"):
      shapes[f"{i}.{w}"] = (d, d)
    shapes[f"{i}.up"], shapes[f"{i}.down"] = (d, 4 * d), (4 * d, d)
    shapes[f"{i}.up_b"], shapes[f"{i}.down_b"] = (4 * d,), (d,)
    shapes[f"{i}.norm1"], shapes[f"{i}.norm2"] = (d,), (d,)
  rng = np.random.default_rng(0)
  return {name: (rng.standard_normal((world * micro, *s)) * 1e-2).astype(np.float32)
          for name, s in shapes.items()}


def measure(layers: int, d: int, micro: int, iters: int, warmup: int, contracts):
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dtenjax

  jax.config.update("jax_enable_compilation_cache", False)
  world = jax.device_count()
  mesh = jax.make_mesh((world,), ("data",))
  tree = jax.device_put(gradient_tree(layers, d, micro, world), NamedSharding(mesh, P("data")))
  nbytes = sum(v.nbytes for v in jax.tree.leaves(tree)) // world
  rows, compiled, outs = [], {}, {}
  with _harness.steps("stacked_buckets", 2 * len(contracts) + 1) as step:
    for contract in contracts:
      for name, bucket_bytes in (("per leaf", 0), ("bucketed", None)):
        step(f"compile reproducible={contract}, {name}")
        body = lambda t, c=contract, b=bucket_bytes: dtenjax.all_reduce(
            t, "data", op="mean", reproducible=c, local_axis=0, bucket_bytes=b)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"),), out_specs=P()))
        lowered = f.lower(tree)
        t0 = time.perf_counter()
        exe = lowered.compile()
        compile_s = time.perf_counter() - t0
        # collectives that move data: not all-reduces over groups of one device (run-time offsets)
        asked = sum(1 for line in lowered.as_text().splitlines()
                    if re.search(r"stablehlo\.(all_gather|all_reduce|all_to_all|reduce_scatter)\b",
                                 line)
                    and not re.search(r"replica_groups = dense<\[\[\d+\](, \[\d+\])*\]>", line))
        compiled[(contract, name)] = exe
        outs[(contract, name)] = jax.device_get(exe(tree))
        rows.append({"contract": str(contract), "candidate": name, "collectives": asked,
                     "compile_s": compile_s, "world": world})
    step(f"time {len(compiled)} candidates, {iters} rounds")
    samples = _harness.interleaved(compiled, (tree,), warmup=warmup, iters=iters)
  for row in rows:
    key = (row["contract"] if row["contract"] != "True" else True, row["candidate"])
    row.update(_harness.nccl_columns(nbytes, "float32", _harness.median(samples[key]),
                                     world))
    per_leaf = outs[(key[0], "per leaf")]
    row["same_bits"] = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(
        np.uint32)) for a, b in zip(jax.tree.leaves(outs[key]), jax.tree.leaves(per_leaf)))
  _harness.add_ratios(rows, "per leaf", candidate="candidate", group=("contract",),
                      ratio_key="speedup")
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m dtenjax bench stacked_buckets", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--layers", type=_harness.positive_int, default=4)
  ap.add_argument("--d", type=_harness.positive_int, default=128, help="model width")
  ap.add_argument("--micro", type=_harness.positive_int, default=2,
                  help="contributions (micro-batches) per device")
  ap.add_argument("--iters", type=_harness.positive_int, default=7)
  ap.add_argument("--warmup", type=_harness.positive_int, default=1)
  ap.add_argument("--json", default=None, help="write the rows to this path")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  import jax
  world = jax.device_count()
  _harness.require_world("bench/stacked_buckets.py", world, 2,
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
  rows = measure(args.layers, args.d, args.micro, args.iters, args.warmup, (True, "v2"))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "stacked_buckets", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"},
        rows, devices=jax.devices()))
  print(f"reproducible mean of {world} x {args.micro} contributions per value, "
        f"{rows[0]['size']} B per device in {8 * args.layers} leaves, {world} "
        f"{jax.default_backend()} devices; speedup = per leaf's time / this one's")
  shown = [dict(r, same_bits="yes" if r["same_bits"] else "NO") for r in rows]
  print(_harness.table(shown, (("contract", "contract", "s"), ("candidate", "candidate", "s"),
                              ("collectives", "collectives", "d"),
                              ("compile (s)", "compile_s", ".2f"),
                              ("time (us)", "time_us", ".0f"), ("speedup", "speedup", "ratio"),
                              ("same bits", "same_bits", "s"))))
  return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
