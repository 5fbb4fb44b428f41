"""All-reduce benchmark: every dtenjax algorithm next to XLA's psum, in nccl-tests format.

  python bench/allreduce.py [--min-bytes 8] [--max-bytes 4M] [--dtype float32] [--iters 20]
                            [--json out.json] [--plot out.png]
  python -m dtenjax bench allreduce ...     (the same, wired by the CLI)

On a CPU-only machine set XLA_FLAGS=--xla_force_host_platform_device_count=8 (done for you when
JAX_PLATFORMS=cpu and nothing is set) to get 8 simulated devices. Works with one device too.
Columns: size (bytes per rank), count (elements), type, algorithm, time (us, median),
algbw = size / time, busbw = algbw * 2(n-1)/n (GB/s), ratio = psum time / this time (>1 faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _parse_size(s: str) -> int:
  mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
  s = s.strip().upper()
  return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def _setup_env():
  if os.environ.get("JAX_PLATFORMS", "") == "cpu" and \
      "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


CANDIDATES = ("psum", "xla", "ring", "one_shot", "two_shot", "hierarchical", "auto",
              "reproducible")


def _build(name, mesh, axes):
  import jax
  from jax import lax
  from jax.sharding import PartitionSpec as P
  from dtenjax._src.collectives import api as C

  def body(x):
    if name == "psum":
      return lax.psum(x, axes)
    if name == "reproducible":
      return C.all_reduce(x, axes, algorithm="auto", reproducible=True)
    return C.all_reduce(x, axes, algorithm=name)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                               check_vma=False))


def _time(f, x, warmup: int, iters: int) -> float:
  for _ in range(warmup):
    f(x).block_until_ready()
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def run(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devs = jax.devices()
  n = len(devs)
  shape = (2, n // 2) if n >= 4 and n % 2 == 0 else (1, n)
  mesh = Mesh(np.array(devs).reshape(shape), ("o", "i"))
  axes = ("o", "i")
  dtype = jnp.dtype(args.dtype)
  algos = [a for a in args.algorithms.split(",") if a]
  sizes = []
  s = max(args.min_bytes, dtype.itemsize)
  while s <= args.max_bytes:
    sizes.append(s)
    s *= args.step_factor
  rows = []
  try:
    from rich.progress import Progress
    progress = Progress(transient=True)
  except ImportError:
    progress = None
  total = len(sizes) * len(algos)
  ctx = progress if progress is not None else _Null()
  with ctx:
    task = progress.add_task("all_reduce", total=total) if progress else None
    for size in sizes:
      count = size // dtype.itemsize
      x = jax.random.normal(jax.random.key(0), (n, count), jnp.float32).astype(dtype)
      x = jax.device_put(x, NamedSharding(mesh, P(axes)))   # timed calls move no input data
      times = {}
      for a in algos:
        f = _build(a, mesh, axes)
        times[a] = _time(f, x, args.warmup, args.iters)
        if progress:
          progress.advance(task)
      base = times.get("psum")
      for a in algos:
        t = times[a]
        algbw = size / t / 1e9
        rows.append(dict(size=size, count=count, type=dtype.name, algorithm=a,
                         time_us=t * 1e6, algbw=algbw,
                         busbw=algbw * (2 * (n - 1) / n if n > 1 else 1.0),
                         ratio=(base / t) if base else None, world=n,
                         backend=jax.default_backend()))
  return rows


class _Null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def table(rows: list[dict]) -> str:
  hdr = (f"{'size':>10} {'count':>10} {'type':>9} {'algorithm':>13} {'time(us)':>10} "
         f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'vs psum':>8}")
  out = [hdr]
  for r in rows:
    ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
    out.append(f"{r['size']:>10} {r['count']:>10} {r['type']:>9} {r['algorithm']:>13} "
               f"{r['time_us']:>10.1f} {r['algbw']:>12.3f} {r['busbw']:>12.3f} {ratio:>8}")
  return "\n".join(out)


def plot(rows: list[dict], path: str) -> bool:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"--plot {path}: matplotlib is not installed, no plot written "
          "(pip install matplotlib).", file=sys.stderr)
    return False
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for a in sorted({r["algorithm"] for r in rows}):
    rs = [r for r in rows if r["algorithm"] == a]
    ax.plot([r["size"] for r in rs], [r["time_us"] for r in rs], marker="o", label=a)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("bytes per rank")
  ax.set_ylabel("time (us, median)")
  ax.set_title(f"all_reduce, world {rows[0]['world']}, {rows[0]['backend']}")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)
  return True


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="dtenjax bench allreduce", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--min-bytes", type=_parse_size, default=_parse_size("64"))
  p.add_argument("--max-bytes", type=_parse_size, default=_parse_size("4M"))
  p.add_argument("--step-factor", type=int, default=8)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--algorithms", default=",".join(CANDIDATES),
                 help="comma list of " + ",".join(CANDIDATES))
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--plot", metavar="FILE.png")
  args = p.parse_args(argv)
  bad = [a for a in args.algorithms.split(",") if a and a not in CANDIDATES]
  if bad:
    p.error(f"unknown algorithm(s) {bad}; choose from {list(CANDIDATES)}")
  _setup_env()
  rows = run(args)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"argv": argv if argv is not None else sys.argv[1:], "rows": rows}, f, indent=1)
  if args.plot:
    plot(rows, args.plot)
  print(table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
