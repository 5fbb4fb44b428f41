"""Eager (outside jit) dtenjax collectives against an eager ``lax.psum``, forward and gradient,
and both jitted.

A user debugging a step, or chex's ``variants(without_jit=True)``, runs ``jax.shard_map`` outside
``jax.jit``: JAX then evaluates the body primitive by primitive, compiling a program for each
primitive on every call. dtenjax runs each collective there as one program cached per call
signature (``jaxapi.run_eager``), and under an eager ``jax.grad`` its forward and backward rules
too, so an eager call should cost about what an eager ``lax.psum`` does (target: at most 2x).
Per algorithm and reproducible mode, the median wall time of one call of ``shard_map(all_reduce)``
(mode ``eager``), of ``jax.value_and_grad`` of a loss through it (``eager grad``), and of the
forward under ``jax.jit`` (``jit``), interleaved with ``lax.psum`` in the same mode; ``x psum`` =
time / psum's time in that mode (lower is better). ``--leaves N`` reduces a tree of N arrays.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/eager.py --json eager.json
"""

from __future__ import annotations

import argparse
import os
import sys

import _harness

# Every algorithm of the registry that runs on this bench's one mesh axis (hierarchical needs two).
DEFAULT_ALGORITHMS = tuple(a for a in _harness.algorithm_families() if a != "hierarchical")


MODES = ("eager", "eager grad", "jit")


def measure(algorithms, nbytes: int, iters: int, warmup: int, world: int, leaves: int = 1,
            modes=MODES):
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dtenjax

  mesh = jax.make_mesh((world,), ("i",))
  count = max(1, nbytes // 4)
  x = jax.device_put(jnp.arange(world * count, dtype=jnp.float32).reshape(world, count) / count,
                     NamedSharding(mesh, P("i")))
  if leaves > 1:
    x = [x + i for i in range(leaves)]

  def smap(body):
    return jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P())

  fns = {("lax.psum", False): smap(lambda v: jax.lax.psum(v, "i"))}
  for a in algorithms:
    for r in (False, True):
      fns[(a, r)] = smap(lambda v, a=a, r=r: dtenjax.all_reduce(v, "i", algorithm=a,
                                                               reproducible=r))
  def wrap(f, mode):
    if mode == "jit":
      return jax.jit(f)
    if mode == "eager grad":
      return jax.value_and_grad(lambda v: sum(jnp.sum(jnp.sin(y))
                                              for y in jax.tree_util.tree_leaves(f(v))))
    return f

  rows = []
  for mode in _harness.progress(modes, "eager"):
    cands = {k: wrap(f, mode) for k, f in fns.items()}
    with jax.set_mesh(mesh):     # jax.make_mesh's Explicit axes: the scalar loss needs it
      samples = _harness.interleaved(cands, (x,), warmup=warmup, iters=iters)
    for (a, r), ts in samples.items():
      rows.append(dict(_harness.nccl_columns(count * 4, "float32", _harness.median(ts), world),
                       algorithm=a, reproducible=r, mode=mode, world=world,
                       candidate=f"{a}{' repro' if r else ''}"))
  _harness.add_ratios(rows, "lax.psum", candidate="candidate", group=("mode",),
                      ratio_key="speedup")
  for row in rows:
    row["x_psum"] = 1 / row["speedup"] if row["speedup"] else None
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m dtenjax bench eager", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                  help="comma-separated algorithm families")
  ap.add_argument("--size", type=_harness.parse_size, default=32 << 10,
                  help="bytes per device (K/M allowed)")
  ap.add_argument("--leaves", type=_harness.positive_int, default=1,
                  help="arrays in the reduced tree (each of --size bytes)")
  ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " + str(MODES))
  ap.add_argument("--iters", type=_harness.positive_int, default=7)
  ap.add_argument("--warmup", type=_harness.positive_int, default=1)
  ap.add_argument("--json", default=None, help="write the rows to this path")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  import jax
  world = jax.device_count()
  _harness.require_world("bench/eager.py", world, 2,
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
  algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  if not modes or set(modes) - set(MODES):
    ap.error(f"--modes={args.modes!r}: pick from {MODES}")
  rows = measure(algorithms, args.size, args.iters, args.warmup, world, args.leaves, modes)
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "eager", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"}, rows,
        devices=jax.devices()))
  print(f"one all-reduce of {args.leaves} x {args.size} B per device over {world} "
        f"{jax.default_backend()} "
        f"devices ({os.cpu_count()} cores), median of {args.iters} interleaved calls; "
        "x psum = time / lax.psum's time in the same mode (lower is better; target <= 2 eager)")
  print(_harness.table(rows, (("mode", "mode", "s"), ("candidate", "candidate", "s")) +
                       _harness.NCCL_TABLE + _harness.NCCL_TAIL +
                       (("x psum", "x_psum", ".2f"),)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
