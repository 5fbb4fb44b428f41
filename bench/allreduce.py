"""All-reduce benchmark: every dtenjax algorithm next to XLA's psum, in nccl-tests columns.

  python bench/allreduce.py [--procs N] [--sizes 8,64K,1M,...] [--dtype float32|bfloat16]
                            [--algorithms psum,psum_oneshot,one_shot,...] [--chain 32]
                            [--json out.json] [--plot out.png]
  python -m dtenjax bench allreduce ...     (the same, wired by the CLI)

Runs on every device jax sees, in one process (the default), or with ``--procs N`` as N processes
of one GPU each (jax.distributed on 127.0.0.1, local_device_ids=[r]): the two ways people run
JAX on a multi-GPU machine. On a CPU-only machine it uses 8 simulated devices. With one device
(one GPU, or XLA_FLAGS asking for one CPU device) an all-reduce moves nothing, and the bench
refuses with exit status 3 instead of printing meaningless ratios.

Per candidate and size it measures, in one run:
  time   per-op DEVICE time: a jitted chain of K dependent all-reduces minus the same program with
         the all-reduces removed, divided by K (launch overhead amortised; CUDA graphs as XLA
         makes them). Medians of --iters calls, all candidates of a size timed round-robin so that
         drift hits them alike. With --procs the slowest process counts.
  lat    single-call latency: one jitted all-reduce, host wall clock per call (median).
  algbw = size / time, busbw = algbw * 2(n-1)/n (GB/s, nccl-tests), ratio = psum time / time.
Candidates: psum (lax.psum, XLA defaults), psum_oneshot / psum_nccl (XLA's own one-shot
all-reduce kernel forced on / off by per-executable compiler option, where this jax has the
option), and dtenjax.all_reduce with every algorithm of the registry (``algorithm=`` families;
hierarchical on the 2-D mesh only), auto, `reproducible` (auto + reproducible=True, contract v3) and `exact` (auto +
reproducible="v2", contract v2).

The table comes last; ``--json`` writes bench/_harness.py's one schema (machine, versions,
command, date, rows) and ``--plot`` a busbw chart, each saying where.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import _harness

from dtenjax.testing.ports import free_port

# XLA's psum three ways, then every algorithm of the registry, auto, reproducible and exact.
CANDIDATES = (("psum", "psum_oneshot", "psum_nccl") + _harness.algorithm_families()
              + ("auto", "reproducible", "exact"))
DEFAULT = "psum,psum_oneshot,psum_nccl,xla,one_shot,two_shot,auto,reproducible"
DEFAULT_SIZES = "8,64,512,4K,8K,32K,64K,256K,1M,4M,16M,64M,256M"
# Per-executable options that force XLA's own one-shot all-reduce kernel on / off, by jax version
# (the first one this jax accepts is used).
ONESHOT_ON = ({"xla_gpu_experimental_use_collective_kernels": "ALL_REDUCE"},
              {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True})
ONESHOT_OFF = ({"xla_gpu_experimental_use_collective_kernels": ""},
               {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": False})


def _setup_env():
  """8 simulated CPU devices unless XLA_FLAGS says otherwise (the flag only shapes the CPU
  backend; on a GPU machine the GPUs stay jax's default devices)."""
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()


def _collective(name: str, axes):
  from jax import lax
  import dtenjax
  if name.startswith("psum"):
    return lambda v: lax.psum(v, axes)
  if name == "reproducible":
    return lambda v: dtenjax.all_reduce(v, axes, reproducible=True)
  if name == "exact":
    return lambda v: dtenjax.all_reduce(v, axes, reproducible="v2")
  return lambda v: dtenjax.all_reduce(v, axes, algorithm=name)


def _options(name: str):
  return {"psum_oneshot": ONESHOT_ON, "psum_nccl": ONESHOT_OFF}.get(name, ({},))


def _compile(body, mesh, axes, x, options_list):
  """jit(shard_map(body)) compiled with the first accepted option set; (callable, options)."""
  import jax
  from jax.sharding import PartitionSpec as P
  f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
  last = None
  for opts in options_list:
    try:
      return jax.jit(f, compiler_options=opts).lower(x).compile(), opts
    except Exception as e:  # (unknown option on this jax)
      last = e
  raise RuntimeError(f"no accepted compiler options among {options_list}: {last}")


def _interleaved_medians(fns: dict, x, warmup: int, iters: int) -> dict:
  """Median wall time of each compiled fn, timed round-robin (one call of each per round) so
  that drift of the machine over the run affects every candidate alike."""
  samples = _harness.interleaved(fns, (x,), warmup=warmup, iters=iters)
  return {k: statistics.median(v) for k, v in samples.items()}


def measure(args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jax.experimental import multihost_utils

  devs = jax.devices()
  n = len(devs)
  _harness.require_world(
      "bench/allreduce.py", n,
      how=(f"jax sees {n} {devs[0].platform} device; run it where several GPUs are visible, "
           "or on CPU without XLA_FLAGS limiting the device count (8 simulated devices)."))
  two_d = args.mesh == "2d" and n >= 4 and n % 2 == 0
  mesh = Mesh(np.array(devs).reshape((2, n // 2) if two_d else (n,)),
              ("o", "i") if two_d else ("x",))
  axes = ("o", "i") if two_d else ("x",)
  dtype = jnp.dtype(args.dtype)
  algos = [a for a in args.algorithms.split(",") if a]
  sizes = args.sizes
  k = args.chain
  rows = []
  for size in _harness.progress(sizes, "allreduce", _harness.format_size):
    count = max(1, size // dtype.itemsize)
    rng = np.random.default_rng(size)
    local = rng.standard_normal((len(jax.local_devices()), count)).astype(np.float32)
    if jax.process_count() > 1:
      x = multihost_utils.host_local_array_to_global_array(
          local.astype(dtype).reshape(-1), mesh, P(axes))
    else:
      x = jax.device_put(local.astype(dtype).reshape(-1), NamedSharding(mesh, P(axes)))
    compiled = {}
    for a in algos:
      if a == "hierarchical" and not two_d:
        continue
      coll = _collective(a, axes)

      def chain(v, coll=coll, depth=k):
        for _ in range(depth):
          v = coll(v)
        return v

      try:
        fk, opts = _compile(chain, mesh, axes, x, _options(a))
        f0, _ = _compile(lambda v: v * jnp.ones((), v.dtype), mesh, axes, x, (opts,))
        f1, _ = _compile(coll, mesh, axes, x, (opts,))
      except Exception as e:
        print(f"# {a} at {size} B: not available ({type(e).__name__}: {str(e)[:200]})",
              file=sys.stderr)
        continue
      if a.startswith("psum"):
        found = fk.as_text().count("all-reduce-start(") or fk.as_text().count("all-reduce(")
        if found < k:
          print(f"# warning: {a} chain compiled to {found} all-reduces, not {k}",
                file=sys.stderr)
      compiled[(a, "chain")], compiled[(a, "base")], compiled[(a, "one")] = fk, f0, f1
    med = _interleaved_medians(compiled, x, args.warmup, args.iters)
    times = {a: (_harness.per_op_seconds(med[(a, "chain")], med[(a, "base")], k,
                                         what=f"{a} at {size} B"), med[(a, "one")])
             for a, kind in compiled if kind == "chain"}
    times = {a: v for a, v in times.items() if v[0] is not None}
    for a, (t, lat) in times.items():
      rows.append(dict(_harness.nccl_columns(count * dtype.itemsize, dtype.name, t, n),
                       algorithm=a, lat_us=lat * 1e6, world=n, procs=jax.process_count(),
                       backend=jax.default_backend(), device_kind=devs[0].device_kind,
                       chain=k))
    _harness.add_ratios(rows, "psum")
  return rows


def table(rows: list[dict]) -> str:
  r0 = rows[0] if rows else {}
  title = (f"all_reduce over {r0.get('world')} {r0.get('backend')} devices in "
           f"{r0.get('procs')} process(es); ratio = psum time / time" if rows else None)
  return _harness.table(rows, _harness.NCCL_TABLE + (("algorithm", "algorithm", "s"),) +
                        _harness.NCCL_TAIL[:1] + (("lat(us)", "lat_us", ".1f"),) +
                        _harness.NCCL_TAIL[1:] + (("vs psum", "ratio", "ratio"),), title=title)


def _plot_module():
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
  except ImportError:
    return None


def plot(rows: list[dict], path: str, plt) -> None:
  fig, ax = plt.subplots(figsize=(7.5, 4.5))
  for a in sorted({r["algorithm"] for r in rows}):
    rs = [r for r in rows if r["algorithm"] == a]
    ax.plot([r["size"] for r in rs], [r["busbw"] for r in rs], marker="o", label=a)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("bytes per rank")
  ax.set_ylabel("busbw (GB/s)")
  r0 = rows[0]
  ax.set_title(f"all_reduce {r0['type']}, {r0['world']} x {r0['backend']}, "
               f"{r0['procs']} process(es)")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)


def _merge(per_rank: list[list[dict]]) -> list[dict]:
  """The slowest process's time per (size, algorithm), ratios recomputed."""
  merged = {}
  for rows in per_rank:
    for r in rows:
      key = (r["size"], r["algorithm"])
      if key not in merged or r["time_us"] > merged[key]["time_us"]:
        merged[key] = dict(r)
  out = sorted(merged.values(), key=lambda r: (r["size"], CANDIDATES.index(r["algorithm"])))
  for r in out:
    r.update(_harness.nccl_columns(r["size"], r["type"], r["time_us"] * 1e-6, r["world"]))
  return _harness.add_ratios(out, "psum")


def _launch(args, argv: list[str]) -> list[dict]:
  """Runs this script as args.procs processes of one GPU each; returns the merged rows."""
  port = free_port()
  with tempfile.TemporaryDirectory() as out:
    procs = []
    for r in range(args.procs):
      env = dict(os.environ, DTENJAX_BENCH_RANK=str(r),
                 DTENJAX_BENCH_COORDINATOR=f"127.0.0.1:{port}", DTENJAX_BENCH_OUT=out,
                 NCCL_NVLS_ENABLE="0")
      cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + argv
      procs.append(subprocess.Popen(cmd, env=env))
    _harness.wait_workers(procs, args.timeout, "allreduce")
    return _merge([json.load(open(os.path.join(out, f"rank{r}.json")))
                   for r in range(args.procs)])


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  p = argparse.ArgumentParser(prog="dtenjax bench allreduce", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--sizes", default=_harness.sizes_arg(DEFAULT_SIZES), type=_harness.sizes_arg,
                 help="bytes per rank, comma list (K/M/G)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--algorithms", default=DEFAULT, help="comma list of " + ",".join(CANDIDATES))
  p.add_argument("--chain", type=_harness.positive_int, default=32,
                 help="all-reduces per timed program (K)")
  p.add_argument("--iters", type=_harness.positive_int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--mesh", default="1d", choices=["1d", "2d"])
  p.add_argument("--procs", type=int, default=0,
                 help="run as N processes of one GPU each (jax.distributed on 127.0.0.1)")
  p.add_argument("--timeout", type=float, default=900, help="seconds for --procs workers")
  p.add_argument("--progress", action="store_true",
                 help="(kept for old command lines: progress is always shown on stderr)")
  p.add_argument("--json", metavar="PATH")
  p.add_argument("--plot", metavar="FILE.png", help="needs matplotlib (pip install dtenjax[plot])")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  bad = [a for a in args.algorithms.split(",") if a and a not in CANDIDATES]
  if bad:
    p.error(f"unknown algorithm(s) {bad}; choose from {list(CANDIDATES)}")
  plt = None
  if args.plot and not args.worker:   # workers only measure; the launcher plots
    plt = _plot_module()
    if plt is None:
      p.error(f"--plot {args.plot} needs matplotlib, which is not installed: "
              "pip install 'dtenjax[plot]' (or drop --plot)")
  if args.worker:
    import jax
    jax.distributed.initialize(os.environ["DTENJAX_BENCH_COORDINATOR"],
                               num_processes=args.procs,
                               process_id=int(os.environ["DTENJAX_BENCH_RANK"]),
                               local_device_ids=[int(os.environ["DTENJAX_BENCH_RANK"])],
                               initialization_timeout=120)
    rows = measure(args)
    with open(os.path.join(os.environ["DTENJAX_BENCH_OUT"],
                           f"rank{jax.process_index()}.json"), "w") as f:
      json.dump(rows, f)
    return 0
  if args.procs:
    rows = _launch(args, argv)
  else:
    _setup_env()
    rows = measure(args)
  if args.json:
    r0 = rows[0] if rows else {}
    _harness.write_json(args.json, _harness.document(
        "allreduce", __file__, argv, _params(args), rows,
        machine_extra={"devices": {"backend": r0.get("backend"), "count": r0.get("world"),
                                   "kinds": {r0.get("device_kind"): r0.get("world")},
                                   "processes": r0.get("procs")}}))
  if plt is not None:
    plot(rows, args.plot, plt)
    print(f"wrote {os.path.abspath(args.plot)}", file=sys.stderr)
  print(table(rows))
  return 0


def _params(args) -> dict:
  return {k: v for k, v in vars(args).items() if k not in ("worker", "json", "plot")}


if __name__ == "__main__":
  sys.exit(main())
