"""Worker: faults of the RDMA verbs data path, one process per rank on the emulated device.

For every fault of DTENJAX_TEST_FAULTS (comma list; tests/fakeverbs FAULTS), on fresh
communicators: a 4 MiB all-reduce under jit (must be right), then rank DTENJAX_TEST_FAULTY arms
the fault to fire DTENJAX_TEST_AFTER RDMA writes into the same all-reduce (mid-collective; one
compiled program per set of communicators, which a trace bakes in) and
every rank records what it got: an error and how long it took, or (wrong) a result and whether
its bits were right. After each fault the communicators are closed and the emulated device's live
objects and this process's descriptors are recorded. DTENJAX_TEST_KILL=1 ends with the last rank
exiting mid-collective (the device's `exit` fault)."""

from __future__ import annotations

import os
import time
import traceback

from tests import transport_ref
from tests.mp_workers import common


def main():
  rank, nprocs = common.init()
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from dtenjax._src.net import hostcoll
  from dtenjax._src.net import native
  from tests import fakeverbs

  fake = fakeverbs.Fake()
  faults = [f for f in os.environ.get("DTENJAX_TEST_FAULTS", "").split(",") if f]
  faulty = int(os.environ.get("DTENJAX_TEST_FAULTY", "1"))
  after = int(os.environ.get("DTENJAX_TEST_AFTER", "3"))
  mesh = Mesh(np.array(jax.devices()), ("p",))
  spec = P("p")

  def make():
    return jax.jit(jax.shard_map(lambda x: hostcoll.all_reduce(x, "p", algorithm="ring"),
                                 mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))

  def global_input(seed, n):
    rng = np.random.RandomState(seed)
    full = (rng.randn(nprocs, n) * 10).astype(np.float32)
    arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda i: full[i])
    return full, arr

  def mine(y):
    return np.asarray(y.addressable_shards[0].data).reshape(-1)

  res: dict = {"rank": rank, "faults": {}}
  big_full, big = global_input(2, 1 << 20)
  big_ref = transport_ref.reference_ring_sum(list(big_full))

  def attempt(kind: str) -> dict:
    out: dict = {}
    hostcoll.reset()
    common.barrier(f"{kind}-start")
    reduce = make()
    y = mine(reduce(big))                        # fresh communicators, a good collective
    out["warmup_ok"] = y.tobytes() == big_ref.tobytes()
    common.barrier(f"{kind}-armed")
    fired_before = fake.counters()["faults_fired"]
    if rank == faulty:
      fake.arm(kind, after)
    t0 = time.monotonic()
    try:
      got = mine(reduce(big))
      out["error"] = None
      out["bits_right"] = got.tobytes() == big_ref.tobytes()
    except Exception as e:
      out["error"] = str(e)[:3000]
    out["seconds"] = time.monotonic() - t0
    out["fired"] = fake.counters()["faults_fired"] - fired_before
    fake.arm("none", 0)
    common.barrier(f"{kind}-done", timeout_s=120)
    hostcoll.reset()
    common.barrier(f"{kind}-closed", timeout_s=120)
    out["live"] = fake.live()
    out["fds"] = fakeverbs.open_fds()
    return out

  try:
    res["fds_start"] = None
    for kind in faults:
      res["faults"][kind] = attempt(kind)
      if res["fds_start"] is None:
        res["fds_start"] = res["faults"][kind]["fds"]
    res["counters"] = native.counters()
    res["fake"] = fake.counters()
    res["last_violation"] = fake.last_violation()
    if os.environ.get("DTENJAX_TEST_KILL") == "1":
      hostcoll.reset()
      common.barrier("kill-start")
      reduce = make()
      mine(reduce(big))
      common.barrier("kill-armed")
      common.write(res)
      if rank == nprocs - 1:
        fake.arm("exit", after)
      t0 = time.monotonic()
      try:
        mine(reduce(big))
        res["kill"] = {"error": None}
      except Exception as e:
        res["kill"] = {"error": str(e)[:3000], "seconds": time.monotonic() - t0}
  except Exception:
    res["exception"] = traceback.format_exc()[-4000:]
  kill = os.environ.get("DTENJAX_TEST_KILL") == "1"
  common.finish(res, expect_done=nprocs - 1 if kill else nprocs)


if __name__ == "__main__":
  main()
