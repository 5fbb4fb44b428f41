"""Worker: cross-process all-reduce inside jit (ring; hierarchical when devices_per_proc > 1),
then fault injection phases chosen by DTENJAX_TEST_PHASES (comma list: correct, corrupt, kill)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback

from tests.mp_workers import common


def main():
  rank, nprocs = common.init()
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  from dtenjax._src.net import hostcoll
  from dtenjax._src.net import transport

  jax.config.update("jax_enable_x64", True)   # so the float64 case really is float64

  phases = os.environ.get("DTENJAX_TEST_PHASES", "correct").split(",")
  local = jax.local_device_count()
  res: dict = {"rank": rank, "nprocs": nprocs, "local": local}
  if local == 1:
    mesh = Mesh(np.array(jax.devices()), ("p",))
    axis, spec, algo = "p", P("p"), "ring"
  else:
    devs = np.array(jax.devices()).reshape(nprocs, local)
    mesh = Mesh(devs, ("p", "l"))
    axis, spec, algo = ("p", "l"), P(("p", "l")), "hierarchical"

  def make(fn_local_shape, dtype, op="sum"):
    def f(x):
      return hostcoll.all_reduce(x, axis, algorithm=algo, op=op)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

  def global_input(seed, n, dtype):
    # Every process builds the same global array; its devices hold their own rows.
    rng = np.random.RandomState(seed)
    full = (rng.randn(nprocs * local, n) * 10).astype(dtype)
    arr = jax.make_array_from_callback(full.shape, jax.sharding.NamedSharding(mesh, spec),
                                       lambda idx: full[idx])
    return full, arr

  try:
    if "correct" in phases:
      out = {}
      for dtype, n in (("float32", 1), ("float32", 1000), ("float64", 333), ("int32", 4097),
                       ("float32", 70000)):
        full, arr = global_input(n, n, np.dtype(dtype))
        f = make(None, dtype)
        y1 = f(arr)
        y2 = f(arr)
        rows = [np.asarray(s.data) for s in y1.addressable_shards]
        rows2 = [np.asarray(s.data) for s in y2.addressable_shards]
        ref_exact = hostcoll.reference_ring_sum(list(full))   # ring order, bit-exact
        ref64 = full.astype(np.float64).sum(axis=0)
        out[f"{dtype}-{n}"] = {
            "sha": [hashlib.sha256(r.tobytes()).hexdigest() for r in rows],
            "bit_equal_ring_reference": all(r.reshape(-1).tobytes() == ref_exact.tobytes()
                                            for r in rows),
            "max_rel_err": max(float(np.max(np.abs(r.reshape(-1) - ref64)) /
                                     max(1.0, float(np.max(np.abs(ref64))))) for r in rows),
            "repeat_equal": all(a.tobytes() == b.tobytes() for a, b in zip(rows, rows2)),
        }
      res["correct"] = out
      full, arr = global_input(5, 777, np.float32)
      ymax = [np.asarray(s.data) for s in make(None, "float32", "max")(arr).addressable_shards]
      ymean = [np.asarray(s.data) for s in make(None, "float32", "mean")(arr).addressable_shards]
      # Mixed with XLA's own cross-process collective (gloo) in one program, in both orders: the
      # async custom call must not deadlock against it.
      def mixed(x):
        a = jax.lax.psum(x, axis)
        b = hostcoll.all_reduce(x * 2, axis, algorithm=algo)
        c = jax.lax.psum(b, axis)
        return a, b, c
      g = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec),
                                check_vma=False))
      a, b, c = (np.asarray(t.addressable_shards[0].data) for t in g(arr))
      ref = full.astype(np.float64).sum(0)
      res["mixed_err"] = max(float(np.max(np.abs(a.reshape(-1) - ref))),
                             float(np.max(np.abs(b.reshape(-1) - 2 * ref))),
                             float(np.max(np.abs(c.reshape(-1) - 2 * nprocs * local * ref))))
      res["ops"] = {
          "max_exact": all(np.array_equal(y.reshape(-1), full.max(0)) for y in ymax),
          "mean_err": max(float(np.max(np.abs(y.reshape(-1) - full.astype(np.float64).mean(0))))
                          for y in ymean)}
    if "corrupt" in phases:
      comms = hostcoll.communicators(local)
      if rank == 1:
        for c in comms:
          c.inject_corrupt_next_send()
      full, arr = global_input(7, 512, np.float32)
      t0 = time.monotonic()
      try:
        make(None, "float32")(arr).block_until_ready()
        res["corrupt"] = {"error": None}
      except Exception as e:  # pylint: disable=broad-except
        res["corrupt"] = {"error": str(e)[:2000], "seconds": time.monotonic() - t0}
      res["counters_after_corrupt"] = transport.counters()
      hostcoll.reset()
    if "kill" in phases:
      full, arr = global_input(8, 4096, np.float32)
      f = make(None, "float32")
      f(arr).block_until_ready()   # builds fresh communicators, one good collective
      big_full, big = global_input(9, 1 << 20, np.float32)
      res["counters_before_kill"] = transport.counters()
      common.write(res)
      if rank == nprocs - 1:
        # Die in the middle of the next collective: throttle this rank's sends (4 MiB at 2 MB/s)
        # so the ring is mid-transfer, and exit from a timer thread 0.5 s in.
        from dtenjax._src.net import tenancy  # pylint: disable=g-import-not-at-top
        tenancy.set_quota("default", tenancy.Quota(rate_bytes_per_s=2e6, burst_bytes=65536))
        threading.Timer(0.5, os._exit, (3,)).start()
      t0 = time.monotonic()
      try:
        f(big).block_until_ready()
        res["kill"] = {"error": None}
      except Exception as e:  # pylint: disable=broad-except
        res["kill"] = {"error": str(e)[:2000], "seconds": time.monotonic() - t0}
      res["counters_after_kill"] = transport.counters()
    res["counters"] = transport.counters()
  except Exception:  # pylint: disable=broad-except
    res["exception"] = traceback.format_exc()[-4000:]
    res["counters"] = transport.counters()
  common.finish(res, expect_done=nprocs - 1 if "kill" in phases else nprocs)


if __name__ == "__main__":
  main()
