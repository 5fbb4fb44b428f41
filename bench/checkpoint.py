"""Checkpoint save and restore throughput: dtenjax.checkpoint against orbax.checkpoint's default
and its fastest layout, on the same sharded arrays, with the disk's own write bandwidth as the
roofline, all in the same run.

    python bench/checkpoint.py [--sizes 1G,4G] [--reps 3] [--leaves 16] [--dir DIR] [--json PATH]

The state is ``--leaves`` float32 arrays (normal random bits, so compression gains nothing, as
with real weights) of SIZE bytes in all, each sharded over a 2 x 4 mesh of the 8 simulated CPU
devices (``P("a", "b")``; 2 x n/2 or 1 x n for n other devices, e.g. 1 x 1 on one GPU, where the
state lives in device memory and a save is device-to-file). Each repetition saves and restores with every candidate in turn
(the order alternates from one repetition to the next, so drift of a shared machine hits both),
each into a fresh directory under ``--dir`` that is deleted afterwards:

* ``dtenjax``: ``dtenjax.checkpoint.save`` (blocking, until committed) and ``restore`` onto the
  same shardings; its I/O path (posix, kvikio-compat or kvikio-gds) is in the table;
* ``orbax``: ``orbax.checkpoint.PyTreeCheckpointer()`` with its defaults (OCDBT, zstd), ``save``
  and ``restore`` with ``restore_args`` for the same shardings;
* ``orbax_zarr``: orbax's fastest layout, ``PyTreeCheckpointHandler(use_ocdbt=False)`` (one zarr
  array per leaf, one file per shard, the layout dtenjax writes, zstd-compressed);
* ``disk`` (save only): the roofline. The same shards' bytes written as the same files, from the
  same number of threads, each file fsynced and the directories too, with no digests and no
  metadata: what the file system itself gives.

Every restore is checked bit for bit against the saved arrays (outside the timing). Rows give
the median time (and the best of the repetitions: on a shared machine the best is the least
disturbed) and the median's bandwidth (bytes of state per second, in the unit that shows the figure:
GB/s, MB/s or kB/s) of each candidate, with ``vs orbax`` = orbax's time / the row's time, the
same against ``orbax_zarr`` (> 1: faster than it), and ``of disk`` = the roofline's time / the
row's time (1.00 = the disk's speed). The files go through the page cache as a user's would;
every candidate fsyncs (tensorstore's file driver fsyncs each file it writes). Needs the
``checkpoint`` extra (orbax-checkpoint).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import _harness

CANDIDATES = ("dtenjax", "orbax", "orbax_zarr", "disk")
ORBAX = {"orbax": "tensorstore (ocdbt, zstd)", "orbax_zarr": "tensorstore (zarr, zstd)"}


def duration(seconds: float) -> str:
  return f"{seconds:.3f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2f} ms"


def _disk_roofline(state, path: str, threads: int) -> float:
  """Seconds to write every addressable shard of ``state`` as its own file (pwrite, fsync each,
  then the directories), from ``threads`` threads: the file system's own speed."""
  import concurrent.futures
  import numpy as np
  jobs = []
  for k, v in state.items():
    for i, s in enumerate(v.addressable_shards):
      if s.replica_id == 0:
        jobs.append((k, str(i), memoryview(np.ascontiguousarray(s.data).reshape(-1).view(np.uint8))))

  def one(job):
    k, name, data = job
    fd = os.open(os.path.join(path, k, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      done = 0
      while done < len(data):
        done += os.pwrite(fd, data[done:], done)
      os.fsync(fd)
    finally:
      os.close(fd)

  def fsync_dir(d):
    fd = os.open(d, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
  t0 = time.perf_counter()
  for k in state:
    os.makedirs(os.path.join(path, k))
  with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
    list(pool.map(one, jobs))
  for k in state:
    fsync_dir(os.path.join(path, k))
  fsync_dir(path)
  return time.perf_counter() - t0


def make_state(total: int, leaves: int):
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = len(jax.devices())
  mesh = jax.make_mesh((2, n // 2) if n % 2 == 0 else (1, n), ("a", "b"))
  sharding = NamedSharding(mesh, P("a", "b"))
  per = total // leaves // 4
  cols = 1024
  rows = max(8, per // cols // 8 * 8)
  rng = np.random.default_rng(0)
  state = {}
  for i in range(leaves):
    host = rng.standard_normal((rows, cols), dtype=np.float32)
    state[f"w{i:02d}"] = jax.make_array_from_callback(host.shape, sharding,
                                                      lambda idx, h=host: h[idx])
    del host
  return state, sharding


def _same(a, b) -> bool:
  import numpy as np
  return all(np.array_equal(np.asarray(x.data).view(np.uint32), np.asarray(y.data).view(np.uint32))
             for k in a for x, y in zip(a[k].addressable_shards, b[k].addressable_shards))


def run(candidate: str, state, sharding, root: str) -> tuple[float, float | None, str]:
  """(save seconds, restore seconds, io path) of one candidate, checked bit for bit."""
  import jax
  path = tempfile.mkdtemp(prefix=f"{candidate}-", dir=root)
  if candidate != "disk":
    os.rmdir(path)
  try:
    if candidate == "disk":
      threads = min(16, (os.cpu_count() or 1) * 2)      # dtenjax's default
      return _disk_roofline(state, path, threads), None, f"posix, {threads} threads"
    if candidate == "dtenjax":
      import dtenjax.checkpoint as ckpt
      t0 = time.perf_counter()
      report = ckpt.save(path, state)
      t1 = time.perf_counter()
      out = ckpt.restore(path, state)
      jax.block_until_ready(out)
      t2 = time.perf_counter()
      io = report.io
    else:
      import orbax.checkpoint as ocp
      ckptr = (ocp.PyTreeCheckpointer() if candidate == "orbax" else
               ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)))
      t0 = time.perf_counter()
      ckptr.save(path, state)
      t1 = time.perf_counter()
      abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
                  for k, v in state.items()}
      out = ckptr.restore(path, args=ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
      jax.block_until_ready(out)
      t2 = time.perf_counter()
      io = ORBAX[candidate]
    if not _same(state, out):
      raise SystemExit(f"bench/checkpoint.py: {candidate} restored different bits")
    del out
    return t1 - t0, t2 - t1, io
  finally:
    shutil.rmtree(path, ignore_errors=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/checkpoint.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", type=_harness.sizes_arg, default=_harness.sizes_arg("1G,4G"),
                  help="total bytes of state per run (default 1G,4G)")
  ap.add_argument("--reps", type=_harness.positive_int, default=3)
  ap.add_argument("--leaves", type=_harness.positive_int, default=16)
  ap.add_argument("--dir", default=None, help="where checkpoints are written (default: the "
                  "system's temporary directory)")
  ap.add_argument("--candidates", default=",".join(CANDIDATES),
                  help="comma list of dtenjax, orbax, orbax_zarr, disk (default: all four)")
  ap.add_argument("--json", default=None, metavar="PATH")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  cands = tuple(c for c in args.candidates.split(",") if c)
  if not cands or set(cands) - set(CANDIDATES):
    ap.error(f"--candidates {args.candidates!r}: choose from {', '.join(CANDIDATES)}")
  if {"orbax", "orbax_zarr"} & set(cands):
    try:
      import orbax.checkpoint  # noqa: F401  (is it installed?)
    except ImportError:
      _harness.refuse("checkpoint", "orbax-checkpoint, the baseline, is not installed: pip "
                      "install '.[checkpoint]' (or --candidates dtenjax,disk, without orbax's ratios)")
  import jax
  from dtenjax.testing import report
  root = args.dir or tempfile.gettempdir()
  free = shutil.disk_usage(root).free
  if max(args.sizes) * 1.2 > free:
    _harness.refuse("checkpoint", f"{max(args.sizes)} bytes of state need as much free disk in "
                    f"{root}, which has {free}; pass --dir or smaller --sizes")
  rows, io_path = [], ""
  with _harness.steps("checkpoint", len(args.sizes) * args.reps * len(cands)) as step:
    for size in args.sizes:
      state, sharding = make_state(size, args.leaves)
      nbytes = sum(v.nbytes for v in state.values())
      times = {c: {"save": [], "restore": []} for c in cands}
      ios = {}
      for rep in range(args.reps):
        for c in (cands if rep % 2 == 0 else cands[::-1]):
          step(f"{_harness.format_size(size)}, {c}, {rep + 1} of {args.reps}")
          s, r, io = run(c, state, sharding, root)
          times[c]["save"].append(s)
          if r is not None:
            times[c]["restore"].append(r)
          ios[c] = io
          if c == "dtenjax":
            io_path = io
      for op in ("save", "restore"):
        for c in cands:
          if not times[c][op]:
            continue
          t = _harness.median(times[c][op])
          rows.append({"size": nbytes, "candidate": c, "op": op, "seconds": t,
                       "gbps": nbytes / t / 1e9, "samples": times[c][op], "io": ios[c],
                       "time": duration(t), "bandwidth": report.format_rate(nbytes, t),
                       "best": duration(min(times[c][op]))})
      del state
  _harness.add_ratios(rows, "orbax", candidate="candidate", group=("size", "op"),
                      time_key="seconds", ratio_key="vs_orbax")
  _harness.add_ratios(rows, "orbax_zarr", candidate="candidate", group=("size", "op"),
                      time_key="seconds", ratio_key="vs_orbax_zarr")
  _harness.add_ratios(rows, "disk", candidate="candidate", group=("size", "op"),
                      time_key="seconds", ratio_key="of_disk")
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "checkpoint", __file__, argv, {"sizes": args.sizes, "reps": args.reps,
                                       "leaves": args.leaves, "dir": root},
        rows, kind="other", devices=jax.devices(),
        notes=[f"dtenjax I/O path: {io_path}", "orbax: PyTreeCheckpointer() defaults",
               "orbax_zarr: PyTreeCheckpointHandler(use_ocdbt=False)",
               "disk: the shards as files, pwrite + fsync, no digests or metadata"]))
  print(f"checkpoint save/restore, {args.leaves} float32 leaves sharded over "
        f"{len(jax.devices())} {jax.default_backend()} devices, median of {args.reps}; "
        f"dtenjax io {io_path}; vs X = X's time / this time; of disk = the disk's time / this")
  print(_harness.table(rows, (("size", "size", "d"), ("op", "op", "s"),
                              ("candidate", "candidate", "s"), ("time", "time", "s"),
                              ("best", "best", "s"),
                              ("bandwidth", "bandwidth", "s"), ("vs orbax", "vs_orbax", "ratio"),
                              ("vs orbax_zarr", "vs_orbax_zarr", "ratio"),
                              ("of disk", "of_disk", "ratio"))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
