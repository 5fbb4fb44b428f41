"""Worker: cross-process all-reduce inside jit (ring; hierarchical when devices_per_proc > 1),
through the internal module and the PUBLIC ``dtenjax.all_reduce`` under ``jax.shard_map``,
``dtenjax.mesh_map`` and ``jax.set_mesh``; then phases chosen by DTENJAX_TEST_PHASES (comma list:
correct, mismatch, permuted, kill, and for the verbs provider same_bits and leaks).

The provider is the environment's (DTENJAX_TRANSPORT, default auto = TCP here); the verbs tests
set it to verbs with DTENJAX_IBVERBS_LIBRARY pointing at the emulated device (tests/fakeverbs/)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
import traceback

from tests import transport_ref
from tests.mp_workers import common


def main():
  rank, nprocs = common.init()
  import jax
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  import dtenjax
  from dtenjax._src.net import hostcoll
  from dtenjax._src.net import native

  jax.config.update("jax_enable_x64", True)   # so the float64 case really is float64

  phases = os.environ.get("DTENJAX_TEST_PHASES", "correct").split(",")
  local = jax.local_device_count()
  res: dict = {"rank": rank, "nprocs": nprocs, "local": local,
               "platform": jax.devices()[0].platform}
  if local == 1:
    mesh = Mesh(np.array(jax.devices()), ("p",))
    axis, spec, algo = "p", P("p"), "ring"
  else:
    devs = np.array(jax.devices()).reshape(nprocs, local)
    mesh = Mesh(devs, ("p", "l"))
    axis, spec, algo = ("p", "l"), P(("p", "l")), "hierarchical"

  def make(dtype, op="sum"):
    del dtype
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

  def rows(y):
    return [np.asarray(s.data).reshape(-1) for s in y.addressable_shards]

  try:
    if "correct" in phases:
      out = {}
      for dtype, n in (("float32", 1), ("float32", 1000), ("float64", 333), ("int32", 4097),
                       ("float32", 70000)):
        full, arr = global_input(n, n, np.dtype(dtype))
        f = make(dtype)
        y1 = f(arr)
        y2 = f(arr)
        r1, r2 = rows(y1), rows(y2)
        ref_exact = transport_ref.reference_ring_sum(list(full))   # ring order, bit-exact
        ref64 = full.astype(np.float64).sum(axis=0)
        out[f"{dtype}-{n}"] = {
            "sha": [hashlib.sha256(r.tobytes()).hexdigest() for r in r1],
            "bit_equal_ring_reference": all(r.tobytes() == ref_exact.tobytes() for r in r1),
            "max_rel_err": max(float(np.max(np.abs(r - ref64)) /
                                     max(1.0, float(np.max(np.abs(ref64))))) for r in r1),
            "repeat_equal": all(a.tobytes() == b.tobytes() for a, b in zip(r1, r2)),
        }
      res["correct"] = out
      full, arr = global_input(5, 777, np.float32)
      ymax = rows(make("float32", "max")(arr))
      ymean = rows(make("float32", "mean")(arr))
      # Mixed with XLA's own cross-process collective (gloo) in one program, in both orders: the
      # async custom call must not deadlock against it.
      def mixed(x):
        a = jax.lax.psum(x, axis)
        b = hostcoll.all_reduce(x * 2, axis, algorithm=algo)
        c = jax.lax.psum(b, axis)
        return a, b, c
      g = jax.jit(jax.shard_map(mixed, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec),
                                check_vma=False))
      a, b, c = (rows(t)[0] for t in g(arr))
      ref = full.astype(np.float64).sum(0)
      res["mixed_err"] = max(float(np.max(np.abs(a - ref))), float(np.max(np.abs(b - 2 * ref))),
                             float(np.max(np.abs(c - 2 * nprocs * local * ref))))
      res["ops"] = {
          "max_exact": all(np.array_equal(y, full.max(0)) for y in ymax),
          "mean_err": max(float(np.max(np.abs(y - full.astype(np.float64).mean(0))))
                          for y in ymean)}

      # The PUBLIC API, three ways of giving it the mesh. Each must go through the host transport
      # (the communicators' collective counter moves) and give the ring's bits.
      full, arr = global_input(11, 2048, np.float32)
      exact = transport_ref.reference_ring_sum(list(full))
      ref64 = full.astype(np.float64).sum(0)

      def pub(x):
        return dtenjax.all_reduce(x, axis, algorithm=algo)

      runs = {
          "shard_map": lambda: jax.jit(jax.shard_map(pub, mesh=mesh, in_specs=spec,
                                                     out_specs=spec, check_vma=False))(arr),
          "mesh_map": lambda: jax.jit(dtenjax.mesh_map(pub, mesh, in_specs=spec,
                                                       out_specs=spec))(arr),
      }

      def with_set_mesh():
        with jax.set_mesh(mesh):
          return jax.jit(jax.shard_map(pub, in_specs=spec, out_specs=spec, check_vma=False))(arr)
      runs["set_mesh"] = with_set_mesh
      public = {}
      for name, run in runs.items():
        before = native.counters()["collectives"]
        try:
          ys = rows(run())
          public[name] = {
              "transport_collectives": native.counters()["collectives"] - before,
              "bit_equal_ring_reference": all(y.tobytes() == exact.tobytes() for y in ys),
              "max_abs_err": max(float(np.max(np.abs(y - ref64))) for y in ys)}
        except Exception:
          public[name] = {"error": traceback.format_exc()[-3000:]}
      res["public"] = public

    if "mismatch" in phases:
      # Rank 1 disagrees with the others; every rank must raise, naming both sides.
      mism = {}
      n = 1024
      full32, arr32 = global_input(21, n, np.float32)
      fulli, arri = global_input(21, n, np.int32)
      cases = ("dtype", "op", "skip")
      for case in cases:
        hostcoll.reset()   # fresh communicators (the last case broke them), created collectively

        def site_a(x):
          return hostcoll.all_reduce(x, axis, algorithm=algo)   # line A

        def site_b(x):
          return hostcoll.all_reduce(x, axis, algorithm=algo)   # line B

        def site_max(x):
          return hostcoll.all_reduce(x, axis, algorithm=algo, op="max")

        def jit(fn):
          return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec,
                                       check_vma=False))
        t0 = time.monotonic()
        try:
          if case == "dtype":
            jit(site_a)(arri if rank == 1 else arr32).block_until_ready()
          elif case == "op":
            jit(site_max if rank == 1 else site_a)(arr32).block_until_ready()
          else:   # rank 1 skips the collective at line A and pairs its line-B one with A
            if rank != 1:
              jit(site_a)(arr32).block_until_ready()
            jit(site_b)(arr32).block_until_ready()
          mism[case] = {"error": None}
        except Exception as e:
          mism[case] = {"error": str(e)[:3000], "seconds": time.monotonic() - t0}
        common.barrier(f"mismatch-{case}")
      res["mismatch"] = mism
      res["counters_after_mismatch"] = native.counters()
      hostcoll.reset()

    if "permuted" in phases:
      # A mesh whose process axis runs against process order: position p held by process n-1-p.
      rev = Mesh(np.array(jax.devices()[::-1]), ("p",))
      full = np.ones((nprocs, 16), np.float32)
      arr = jax.make_array_from_callback(full.shape, jax.sharding.NamedSharding(rev, P("p")),
                                         lambda idx: full[idx])
      f = jax.jit(jax.shard_map(lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"), mesh=rev,
                                in_specs=P("p"), out_specs=P("p"), check_vma=False))
      t0 = time.monotonic()
      try:
        f(arr).block_until_ready()
        res["permuted"] = {"error": None}
      except Exception as e:
        res["permuted"] = {"error": str(e)[:3000], "seconds": time.monotonic() - t0}

    if "same_bits" in phases:
      # The same jitted all-reduces over TCP and over the provider under test (fresh
      # communicators each), float32/float64/int32/bfloat16, small and large (4 MiB: many
      # segments): every result's bits must agree between the providers.
      import ml_dtypes
      under_test = os.environ.get("DTENJAX_TRANSPORT", "auto")
      same = {}
      cases = (("float32", 1000), ("float64", 333), ("int32", 4097), ("bfloat16", 7),
               ("bfloat16", 70001), ("float32", 1 << 20))
      chosen = os.environ.get("DTENJAX_TEST_SAME_BITS")    # "dtype-n,...": these cases only
      for dtype, n in [c for c in cases if not chosen or f"{c[0]}-{c[1]}" in chosen.split(",")]:
        dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
        full, arr = global_input(n + 1, n, dt)
        shas = {}
        for provider in ("tcp", under_test):
          os.environ["DTENJAX_TRANSPORT"] = provider
          # Everyone is done with the previous communicators before any closes them (a rank
          # whose next neighbour closed early fails its collective even with nothing left to
          # send it: ring.cc treats the end of that stream as the neighbour's death).
          common.barrier(f"same-bits-{dtype}-{n}-{provider}")
          hostcoll.reset()
          before = native.counters()["collectives"]
          ys = rows(make(dtype)(arr))
          shas[provider] = {"sha": [hashlib.sha256(y.tobytes()).hexdigest() for y in ys],
                            "collectives": native.counters()["collectives"] - before,
                            "providers": sorted({c.provider for g in hostcoll._comm_groups.values()
                                                 for c in g})}
        ref64 = full.astype(np.float64).sum(axis=0)
        same[f"{dtype}-{n}"] = {
            **shas, "bit_equal_ring_reference": (
                local == 1 and all(y.tobytes() == transport_ref.reference_ring_sum(list(full)).tobytes()
                                   for y in ys)),
            "max_rel_err": max(float(np.max(np.abs(y.astype(np.float64) - ref64)) /
                                     max(1.0, float(np.max(np.abs(ref64))))) for y in ys)}
      os.environ["DTENJAX_TRANSPORT"] = under_test
      common.barrier("same-bits-end")
      hostcoll.reset()
      res["same_bits"] = same

    if "leaks" in phases:
      # Communicators created and closed again leave nothing behind: descriptors, and on the
      # emulated device every context, PD, MR, CQ, QP and completion channel.
      from tests import fakeverbs
      fake = fakeverbs.Fake() if "fakeverbs" in os.environ.get("DTENJAX_IBVERBS_LIBRARY", "") else None
      full, arr = global_input(3, 5000, np.float32)
      counts = []
      for _ in range(3):
        rows(make("float32")(arr))
        live_open = fake.live() if fake else None
        common.barrier("leaks-done")
        hostcoll.reset()
        common.barrier("leaks-cycle")
        counts.append({"fds": fakeverbs.open_fds(), "live_open": live_open,
                       "live_closed": fake.live() if fake else None})
      res["leaks"] = {"cycles": counts, "fake": fake.counters() if fake else None,
                      "last_violation": fake.last_violation() if fake else None}

    if "kill" in phases:
      full, arr = global_input(8, 4096, np.float32)
      f = make("float32")
      f(arr).block_until_ready()   # builds fresh communicators, one good collective
      big_full, big = global_input(9, 1 << 20, np.float32)
      # Compiled and run once at this size first, so the 0.5 s before the kill are spent moving
      # data, not compiling (on a loaded machine compiling alone can take longer).
      f(big).block_until_ready()
      res["counters_before_kill"] = native.counters()
      common.write(res)
      if rank == nprocs - 1:
        # Die in the middle of the next collective: throttle this rank's sends (4 MiB at 2 MB/s)
        # so the ring is mid-transfer, and exit from a timer thread 0.5 s in.
        from dtenjax._src.net import tenancy
        tenancy.set_quota("default", tenancy.Quota(rate_bytes_per_s=2e6, burst_bytes=65536))
        threading.Timer(0.5, os._exit, (3,)).start()
      t0 = time.monotonic()
      try:
        f(big).block_until_ready()
        res["kill"] = {"error": None}
      except Exception as e:
        res["kill"] = {"error": str(e)[:2000], "seconds": time.monotonic() - t0}
      res["counters_after_kill"] = native.counters()
    res["counters"] = native.counters()
  except Exception:
    res["exception"] = traceback.format_exc()[-4000:]
    res["counters"] = native.counters()
  common.finish(res, expect_done=nprocs - 1 if "kill" in phases else nprocs)


if __name__ == "__main__":
  main()
