"""Cross-process all-reduce: dtenjax's TCP ring (hostcoll, an async FFI custom call inside jit)
against XLA's own cross-process CPU collectives (gloo) in the same run.

    python -m dtenjax bench transport [--procs 4] [--sizes 4096,65536,...] [--iters 20]
                                      [--json out.json]
    python bench/transport.py ...    (same)

Launches ``--procs`` processes with one CPU device each and a local jax.distributed coordinator on
127.0.0.1. Every process runs both candidates on the same float32 arrays inside ``jax.jit`` +
``jax.shard_map``: ``lax.psum`` (XLA -> gloo over TCP) and the public
``dtenjax.all_reduce(x, "p", algorithm="ring")`` (dtenjax's authenticated TCP ring). Both results
are checked against each other before timing. After warm-up, the candidates alternate iteration
by iteration (so a change in machine load hits both alike); every timed iteration starts after a
barrier of all processes and ends at ``block_until_ready``. Each rank takes the median of its
iterations; the table reports, per candidate and size, the MAX over ranks of those medians (every
rank publishes its medians through the coordination store; rank 0 gathers them), with
nccl-tests' algbw and busbw (busbw = algbw * 2(n-1)/n). Ratio = XLA time / dtenjax time
(> 1: dtenjax faster). The CPU columns are the process CPU time (user + system, all threads,
``getrusage``) per all-reduce, averaged over iterations and ranks: on a machine with fewer cores
than processes, wall time follows CPU time. One row per candidate and size, side by side;
``--json`` writes bench/_harness.py's one schema and says where.

    python bench/transport.py --crypto [--mib 64]

measures, in one run, the throughput of the two MACs the transport could use for data frames
(libcrypto's HMAC-SHA256 and AES-256-GMAC, through dtenjax's bindings) on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import _harness

from dtenjax.testing.ports import free_port

DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)   # bytes


def _worker() -> None:
  rank = int(os.environ["DTENJAX_BENCH_RANK"])
  nprocs = int(os.environ["DTENJAX_BENCH_NPROCS"])
  import jax
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):
    pass
  jax.distributed.initialize(coordinator_address=os.environ["DTENJAX_BENCH_COORD"],
                             num_processes=nprocs, process_id=rank, initialization_timeout=60)
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import dtenjax
  from dtenjax.testing import transport as native

  sizes = [int(s) for s in os.environ["DTENJAX_BENCH_SIZES"].split(",")]
  iters = int(os.environ["DTENJAX_BENCH_ITERS"])
  mesh = Mesh(np.array(jax.devices()), ("p",))
  spec = P("p")
  cands = {
      "xla_gloo": lambda x: jax.lax.psum(x, "p"),
      "dtenjax_tcp_ring": lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"),
  }
  fns = {k: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))
         for k, f in cands.items()}
  names = list(fns)
  rows = []
  store = native.key_value_store()
  for nbytes in sizes:
    if rank == 0:                      # the parent shows it (run()): the size now measured
      with open(os.environ["DTENJAX_BENCH_OUT"] + ".progress", "a") as fh:
        fh.write(f"{nbytes}\n")
    count = max(1, nbytes // 4)
    full = np.random.RandomState(count).randn(nprocs, count).astype(np.float32)
    arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda i: full[i])
    before = native.counters()["collectives"]
    outs = {k: np.asarray(f(arr).addressable_shards[0].data) for k, f in fns.items()}
    if native.counters()["collectives"] == before:
      raise RuntimeError("dtenjax.all_reduce(algorithm='ring') did not use the host transport")
    np.testing.assert_allclose(outs["xla_gloo"], outs["dtenjax_tcp_ring"], rtol=1e-5, atol=1e-4)
    for f in fns.values():
      for _ in range(2):
        f(arr).block_until_ready()
    times = {k: [] for k in names}
    cpu = {k: 0.0 for k in names}
    for i in range(iters):
      order = names if i % 2 == 0 else names[::-1]
      for k in order:
        store.barrier(f"bench-{nbytes}-{i}-{k}", timeout_s=300)
        c0 = _cpu_s()
        t0 = time.perf_counter()
        fns[k](arr).block_until_ready()
        times[k].append(time.perf_counter() - t0)
        cpu[k] += _cpu_s() - c0
    mine = {k: float(np.median(v)) for k, v in times.items()}
    mine.update({k + "_cpu": cpu[k] / iters for k in names})
    store.set(store.key(f"bench-{nbytes}", rank), json.dumps(mine), overwrite=True)
    if rank == 0:
      per_rank = [json.loads(store.get(store.key(f"bench-{nbytes}", r), timeout_s=300))
                  for r in range(nprocs)]
      row = {"bytes": count * 4, "count": count, "dtype": "float32"}
      for k in names:
        row[k] = max(p[k] for p in per_rank)
        row[k + "_per_rank"] = [p[k] for p in per_rank]
        row[k + "_cpu"] = sum(p[k + "_cpu"] for p in per_rank) / nprocs
      rows.append(row)
  if rank == 0:
    with open(os.environ["DTENJAX_BENCH_OUT"], "w") as fh:
      json.dump(rows, fh)
  store.barrier("bench-done", timeout_s=300)
  os._exit(0)


def _cpu_s() -> float:
  import resource
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def crypto(mib: int) -> int:
  """Throughput of HMAC-SHA256 and AES-256-GMAC from libcrypto, side by side, one core."""
  from dtenjax.testing import transport as native
  lib = native.ensure_crypto()
  t = native.transport()
  data = os.urandom(mib << 20)
  key = os.urandom(32)
  cands = {"HMAC-SHA256": lambda: t.hmac_sha256(key, data),
           "AES-256-GMAC": lambda: t.gmac(key, 1, 2, data)}
  best = {k: float("inf") for k in cands}
  for _ in range(5):
    for k, f in cands.items():
      t0 = time.perf_counter()
      f()
      best[k] = min(best[k], time.perf_counter() - t0)
  rows = [{"mac": k, "gbps": len(data) / v / 1e9,
           "ratio": best["HMAC-SHA256"] / v} for k, v in best.items()]
  print(_harness.table(rows, (("MAC", "mac", "s"), ("GB/s", "gbps", ".2f"),
                              ("vs HMAC", "ratio", "ratio")),
                       title=f"MAC throughput over {mib} MiB, best of 5, {lib} "
                       f"({os.cpu_count()} cores)"))
  return 0


def run(procs: int, sizes, iters: int, timeout_s: float) -> list[dict]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  port = free_port()
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.json")
    ps, log_paths = [], []
    for r in range(procs):
      env = dict(os.environ, JAX_PLATFORMS="cpu",
                 XLA_FLAGS="--xla_force_host_platform_device_count=1",
                 DTENJAX_BENCH_RANK=str(r), DTENJAX_BENCH_NPROCS=str(procs),
                 DTENJAX_BENCH_COORD=f"127.0.0.1:{port}", DTENJAX_BENCH_OUT=out,
                 DTENJAX_BENCH_SIZES=",".join(map(str, sizes)), DTENJAX_BENCH_ITERS=str(iters),
                 DTENJAX_BIND_ADDRESS="127.0.0.1",
                 PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
      log_paths.append(os.path.join(tmp, f"rank{r}.log"))
      with open(log_paths[-1], "w") as log:    # a file, not a pipe: nobody reads it meanwhile
        ps.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                   env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    with _harness.steps("transport", len(sizes)) as step:
      shown = 0

      def show_started() -> int:
        try:
          with open(out + ".progress") as fh:
            started = len(fh.read().split())
        except FileNotFoundError:
          started = 0
        for nbytes in sizes[shown:started]:
          step(f"{_harness.format_size(nbytes)} on {procs} processes")
        return max(shown, started)

      while any(p.poll() is None for p in ps) and time.monotonic() < deadline:
        shown = show_started()
        time.sleep(0.2)
      # a size the workers started and finished between two polls is still shown
      shown = show_started()
    for p in ps:
      if p.poll() is None:
        p.kill()
      p.wait()
    logs = [pathlib.Path(path).read_text() for path in log_paths]
    if not os.path.exists(out):
      raise RuntimeError("benchmark workers produced no result; rank 0 log:\n" + logs[0][-3000:])
    return json.load(open(out))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m dtenjax bench transport", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--procs", type=int, default=4)
  ap.add_argument("--sizes", default=list(DEFAULT_SIZES), type=_harness.sizes_arg,
                  help="comma-separated message sizes in bytes (K/M/G allowed)")
  ap.add_argument("--iters", type=_harness.positive_int, default=20)
  ap.add_argument("--timeout", type=float, default=540, help="seconds before workers are killed")
  ap.add_argument("--json", default=None, help="write the rows to this path")
  ap.add_argument("--crypto", action="store_true", help="measure the MACs instead")
  ap.add_argument("--mib", type=_harness.positive_int, default=64, help="MiB hashed by --crypto")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  if args.crypto:
    return crypto(args.mib)
  if args.procs < 2:
    ap.error("--procs must be at least 2")
  raw = run(args.procs, args.sizes, args.iters, args.timeout)
  n = args.procs
  names = {"xla_gloo": "xla/gloo", "dtenjax_tcp_ring": "dtenjax tcp ring"}
  rows = []
  for r in raw:
    for k, label in names.items():
      rows.append(dict(_harness.nccl_columns(r["bytes"], r["dtype"], r[k], n), candidate=label,
                       cpu_ms=r[k + "_cpu"] * 1e3, time_us_per_rank=[t * 1e6 for t in
                                                                      r[k + "_per_rank"]],
                       world=n))
  _harness.add_ratios(rows, "xla/gloo", candidate="candidate")
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "transport", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"}, rows,
        machine_extra={"devices": {"backend": "cpu", "count": n, "processes": n}}))
  print(f"all-reduce across {n} processes x 1 CPU device on 127.0.0.1 ({os.cpu_count()} cores), "
        f"float32; per rank the median of {args.iters} barrier-started iterations, max over "
        "ranks; ratio = xla/gloo time / time")
  print(_harness.table(rows, _harness.NCCL_TABLE + (("candidate", "candidate", "s"),) +
                       _harness.NCCL_TAIL + (("cpu ms", "cpu_ms", ".2f"),
                                             ("vs xla/gloo", "ratio", "ratio"))))
  return 0


if __name__ == "__main__":
  if "--worker" in sys.argv:
    _worker()
  else:
    sys.exit(main())
