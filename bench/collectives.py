"""dtenjax's collective policy next to ``lax.psum``: per-op time of every algorithm, ``auto`` and
``reproducible=True``, measured side by side in one run; and its reduce-scatters (``rs_*``) next
to ``lax.psum_scatter``.

  python bench/collectives.py [--sizes 8K,64K,256K,1M,4M] [--dtype float32] [--chain 32]
                              [--reps 5] [--candidates psum,auto,...] [--mesh 2x4]
                              [--json out.json]

Per-op time: a jitted chain of ``--chain`` dependent all-reduces inside ``shard_map`` (each result
scaled by 1/n and fed to the next), minus the same chain without the collectives, divided by the
chain length; candidates are interleaved over ``--reps`` repetitions and the median (or, with
``--stat min``, the minimum) is reported. A reduce-scatter's chain (``lax.psum_scatter`` and
``rs_<algorithm>``: ``dtenjax.reduce_scatter(..., tiled=True, algorithm=...)``) tiles each
rank's block back to the input's size before the next one, and its empty chain does the same
copy (``jnp.tile`` of a block of the input), so the per-op time is the reduce-scatter's alone.
ratio = psum time / candidate time (>= 1: at least as fast as psum); for the reduce-scatters
lax.psum_scatter's time / the candidate's. Every row has nccl-tests' columns: size (bytes per
rank; a reduce-scatter's input), count, type, time, algbw = size / time and busbw = algbw x
2(n-1)/n (all-reduces), (n-1)/n (reduce-scatters, lax.all_gather, lax.all_to_all). On a CPU-only
machine 8 simulated devices are used (mesh ``--mesh``, default 2 x 4, axes ('o', 'i'): 'i' is
the inner axis of ``hierarchical``) unless XLA_FLAGS says otherwise; with one device it refuses
(exit status 3): a collective of one rank moves nothing. ``--json`` writes bench/_harness.py's
one schema and says where.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import _harness

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and \
    os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

_FAMILIES = _harness.algorithm_families()
CANDIDATES = (("psum", "auto") + _FAMILIES + ("reproducible",)
              + tuple(f"reproducible_{a}" for a in _FAMILIES) + ("exact",)
              + tuple(f"exact_{a}" for a in _FAMILIES)
              + ("lax.pmax", "lax.all_to_all", "lax.all_gather", "lax.all_gather_fold")
              + ("lax.psum_scatter", "rs_auto") + tuple(f"rs_{a}" for a in _FAMILIES))
# Every algorithm of the registry, plain, reproducible=True (reproducible*, contract v3) and
# reproducible="v2" (exact*, contract v2).
# lax.*: XLA's building blocks on the same bytes (all_gather of each rank's 1/n, so its output is
# the size of the others' input), for reading what the algorithms cost.
BUS_OP = {"lax.all_to_all": "all_to_all", "lax.all_gather": "all_gather"}   # others: all_reduce
# the reduce-scatters (rs_*: dtenjax.reduce_scatter by algorithm), against lax.psum_scatter


def _scatters(name: str) -> bool:
  return name in ("lax.psum_scatter", "none_rs") or name.startswith("rs_")


def _bus_op(name: str) -> str:
  return "reduce_scatter" if _scatters(name) else BUS_OP.get(name, "all_reduce")
# lax.all_gather_fold: every rank's whole input gathered and folded in rank order, an all-reduce
# with one collective and the cheapest local sum: the floor of reproducible_one_shot.


def _op(name, axes):
  import jax.numpy as jnp
  from jax import lax
  import dtenjax
  if name == "none":
    return lambda y: y
  if _scatters(name):     # the block tiled back to the input's size (none_rs: that copy alone)
    def scatter(y):
      n = lax.axis_size(axes)
      if name == "none_rs":
        block = y[:y.shape[0] // n]
      elif name == "lax.psum_scatter":
        block = lax.psum_scatter(y, axes, tiled=True)
      else:
        block = dtenjax.reduce_scatter(y, axes, tiled=True, algorithm=name[len("rs_"):])
      return jnp.tile(block, n)
    return scatter
  if name == "psum":
    return lambda y: lax.psum(y, axes)
  if name == "lax.pmax":
    return lambda y: lax.pmax(y, axes)
  if name == "lax.all_to_all":
    return lambda y: lax.all_to_all(y.reshape(lax.axis_size(axes), -1), axes, 0, 0).reshape(
        y.shape)
  if name == "lax.all_gather":
    def gather(y):
      n = lax.axis_size(axes)
      return lax.all_gather(y.reshape(n, -1)[0], axes, tiled=True).reshape(y.shape)
    return gather
  if name == "lax.all_gather_fold":
    def gather_fold(y):
      rows = lax.all_gather(y, axes)
      total = rows[0]
      for k in range(1, rows.shape[0]):
        total = total + rows[k]
      return total
    return gather_fold
  if name == "reproducible":
    return lambda y: dtenjax.all_reduce(y, axes, reproducible=True)
  if name.startswith("reproducible_"):
    algorithm = name[len("reproducible_"):]
    return lambda y: dtenjax.all_reduce(y, axes, algorithm=algorithm, reproducible=True)
  if name == "exact":
    return lambda y: dtenjax.all_reduce(y, axes, reproducible="v2")
  if name.startswith("exact_"):
    algorithm = name[len("exact_"):]
    return lambda y: dtenjax.all_reduce(y, axes, algorithm=algorithm, reproducible="v2")
  return lambda y: dtenjax.all_reduce(y, axes, algorithm=name)


def _chain(name, mesh, axes, length, scale):
  import jax
  from jax.sharding import PartitionSpec as P
  op = _op(name, axes)

  def body(x):
    y = x
    for _ in range(length):
      y = (op(y) * scale).astype(x.dtype)
    return y
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes),
                               check_vma=False))


def _once(f, x) -> float:
  t0 = time.perf_counter()
  f(x).block_until_ready()
  return time.perf_counter() - t0


def run(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  devs = jax.devices()
  n = len(devs)
  _harness.require_world("bench/collectives.py", n,
                         how="XLA_FLAGS limits the CPU device count; leave it unset (8).")
  shape = _mesh_shape(args.mesh, n)
  axes = ("o", "i")
  mesh = Mesh(np.array(devs).reshape(shape), axes)
  dtype = jnp.dtype(args.dtype)
  names = [c for c in args.candidates.split(",") if c]
  rows = []
  for size in _harness.progress(args.sizes, "collectives", _harness.format_size):
    count = max(size // dtype.itemsize, 1)
    # numpy's draw: an eager jax.random.normal compiles a program per size
    x = np.random.default_rng(0).standard_normal(n * count, np.float32).astype(dtype)
    x = jax.device_put(x, NamedSharding(mesh, P(axes)))
    empty = ["none"] + (["none_rs"] if any(map(_scatters, names)) else [])
    fns = {c: _chain(c, mesh, axes, args.chain, 1.0 / n) for c in empty + names}
    for f in fns.values():               # compile and warm up
      f(x).block_until_ready()
    samples = {c: [] for c in fns}
    for _ in range(args.reps):
      for c, f in fns.items():
        samples[c].append(_once(f, x))
    stat = min if args.stat == "min" else statistics.median
    base = {c: stat(samples[c]) for c in empty}
    per_op = {c: _harness.per_op_seconds(stat(samples[c]),
                                         base["none_rs" if _scatters(c) else "none"], args.chain,
                                         what=f"{c} at {count * dtype.itemsize} B")
              for c in names}
    for c in [c for c in names if per_op[c] is not None]:
      rows.append(dict(_harness.nccl_columns(count * dtype.itemsize, dtype.name, per_op[c], n,
                                             _bus_op(c)),
                       candidate=c, world=n, mesh="x".join(map(str, shape)),
                       backend=jax.default_backend()))
    _harness.add_ratios([r for r in rows if not _scatters(r["candidate"])], "psum",
                        candidate="candidate")
    _harness.add_ratios([r for r in rows if _scatters(r["candidate"])], "lax.psum_scatter",
                        candidate="candidate")
    print(table([r for r in rows if r["size"] == count * dtype.itemsize]), flush=True)
  return rows


def _mesh_shape(text: str, n: int) -> tuple[int, int]:
  """``--mesh OxI`` for ``n`` devices; the default "auto": 2 x n/2 (1 x n for odd n)."""
  if text == "auto":
    return (2, n // 2) if n >= 4 and n % 2 == 0 else (1, n)
  o, i = (int(v) for v in text.split("x"))
  if o * i != n:
    raise SystemExit(f"bench/collectives.py: --mesh {text} has {o * i} devices, this machine "
                     f"{n}; pass --mesh OxI with O * I = {n}")
  return o, i


def _mesh_arg(text: str) -> str:
  import argparse
  if text != "auto":
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise argparse.ArgumentTypeError(f"{text!r} is not OxI (e.g. 2x4) nor 'auto'")
  return text


def table(rows) -> str:
  return _harness.table(rows, _harness.NCCL_TABLE + (("candidate", "candidate", "s"),) +
                        _harness.NCCL_TAIL + (("vs psum", "ratio", "ratio"),))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="bench/collectives.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default=_harness.sizes_arg("8K,64K,256K,1M,4M"),
                 type=_harness.sizes_arg, help="bytes per rank, comma list (K/M/G)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--chain", type=_harness.positive_int, default=32)
  p.add_argument("--reps", type=_harness.positive_int, default=5)
  p.add_argument("--candidates", default=",".join(CANDIDATES))
  p.add_argument("--stat", default="median", choices=["median", "min"],
                 help="median (default) or min over the repetitions (least disturbed by load)")
  p.add_argument("--mesh", default="auto", type=_mesh_arg,
                 help="OxI: the mesh of axes ('o', 'i') (default: 2 x n/2)")
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args(argv)
  bad = [c for c in args.candidates.split(",") if c and c not in CANDIDATES]
  if bad:
    p.error(f"unknown candidate(s) {bad}; choose from {list(CANDIDATES)}")
  rows = run(args)
  if args.json:
    import jax
    argv = sys.argv[1:] if argv is None else list(argv)
    _harness.write_json(args.json, _harness.document(
        "collectives", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"},
        rows, devices=jax.devices()))
  print("\n" + table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
