"""Worker of tests/test_attacks.py: attacks and faults across processes, through the public
``dtenjax.all_reduce`` inside ``jax.jit`` (one CPU device per process). Phases (comma list in
DTENJAX_TEST_PHASES), in this order:

* flood: before any ring connects, every rank opens FLOOD connections that never authenticate
  (mixed kinds) to the listener of its next rank, then the ring forms and computes;
* lookalike: one helper called from two lines of the jitted step; rank 1 calls them in the
  other order;
* tagged: a jitted step whose collective is tagged with the (traced) step number; rank 1 skips
  step 1;
* fori: the public all_reduce inside lax.fori_loop tagged with the traced index; first every rank
  runs iterations 0..2, then rank 1 runs 1..3;
* differ: one helper line reduces a (4, 250) array on rank 1 and a (1000,) one elsewhere, then
  bfloat16 on rank 1 and float32 elsewhere;
* threads: THREAD_TRIALS trials of two worker threads per rank (default names, one target, data
  that depends on the thread's job), started in the opposite order on rank 1, each reducing its
  job's array through Communicator.all_reduce: (shared) on one communicator of the main thread,
  no stream key; (keyed) on one communicator per trial, stream=f"job-{k}"; (own) each on a
  communicator its thread creates; every outcome (sum or error text) is recorded;
* algorithms: rank 0 asks for algorithm="ring", the others for "xla"; afterwards rank 0 runs the
  xla collective too, which releases the others. Rank 0 waits for a ring that nobody joins, so
  its wait is the timeout: DTENJAX_TEST_ALGORITHMS_TIMEOUT, when set, is this phase's
  DTENJAX_COLLECTIVE_TIMEOUT (the others keep theirs);
* peer_loss: the last rank exits between two collectives; the others run the second one;
* coordinator_loss: process 0 (the jax.distributed coordinator) SIGKILLs itself; the others keep
  writing a heartbeat into their result until they die or 10 s pass.
"""

from __future__ import annotations

import os
import resource
import signal
import time
import traceback

from tests.mp_workers import common


def main():
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)   # room for the flood's sockets
  limit = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard)
  if soft < limit:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
  rank, nprocs = common.init()
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  import dtenjax
  from dtenjax._src.net import credentials
  from dtenjax._src.net import hostcoll
  from dtenjax._src.net import kvstore
  from dtenjax._src.net import native
  from dtenjax._src.net import transport
  from tests import net_helpers

  phases = os.environ.get("DTENJAX_TEST_PHASES", "flood").split(",")
  mesh = Mesh(np.array(jax.devices()), ("p",))
  spec = P("p")
  res: dict = {"rank": rank}
  full = np.stack([np.full(8, 10.0 ** r, np.float32) for r in range(nprocs)])
  arr = jax.make_array_from_callback(full.shape, NamedSharding(mesh, spec), lambda i: full[i])

  def jit(fn, in_specs=spec):
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=spec))

  def rows(y):
    return [np.asarray(s.data).reshape(-1).tolist() for s in y.addressable_shards]

  def attempt(name, fn):
    t0 = time.monotonic()
    try:
      res[name] = {"value": fn(), "error": None, "seconds": time.monotonic() - t0}
    except Exception as e:
      res[name] = {"error": f"{type(e).__name__}: {e}"[:6000], "seconds": time.monotonic() - t0}
    common.write(res)

  try:
    if "flood" in phases:
      real_connect = transport.connect
      held = []
      formation = {}
      size = min(net_helpers.FLOOD, max(soft, limit) - 512)

      def flooded_connect(comm, next_endpoint):
        job = credentials.job_credentials().job_id
        held.extend(net_helpers.flood(next_endpoint, size, "mixed", job=job, claim_rank=rank))
        common.barrier(f"flooded-{comm.name}")   # every listener is flooded before anyone connects
        t0 = time.monotonic()
        real_connect(comm, next_endpoint)
        formation[comm.name] = time.monotonic() - t0
      transport.connect = flooded_connect
      before = native.counters()
      ring = jit(lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"))
      attempt("flood", lambda: rows(ring(arr)))
      transport.connect = real_connect
      res["flood"]["formation_s"] = formation
      res["flood"]["connections"] = size
      after = native.counters()
      res["flood"]["turned_away"] = sum(after[k] - before[k] for k in (
          "handshakes_refused", "handshakes_evicted", "rejected_bad_header"))
      for s in held:
        s.close()
      common.barrier("flood-done")

    if "lookalike" in phases:
      def helper(v):
        return dtenjax.all_reduce(v, "p", algorithm="ring")

      def step(x):
        if rank == 1:
          b = helper(x * 100)
          a = helper(x)
        else:
          a = helper(x)
          b = helper(x * 100)
        return a + b
      attempt("lookalike", lambda: rows(jit(step)(arr)))
      hostcoll.reset()
      common.barrier("lookalike-done")

    if "tagged" in phases:
      f = jit(lambda x, i: hostcoll.all_reduce(x, "p", algorithm="ring", tag=i),
              in_specs=(spec, P()))

      def loop():
        out = []
        for i in range(3):
          if rank == 1 and i == 1:
            continue
          out.append(rows(f(arr, jnp.int32(i))))
        return out
      attempt("tagged", loop)
      hostcoll.reset()
      common.barrier("tagged-done")

      def public_loop():   # the public all_reduce, a static tag per step of a Python loop
        out = []
        for i in range(3):
          if rank == 1 and i == 1:
            continue
          out.append(rows(jit(lambda x, i=i: dtenjax.all_reduce(x, "p", algorithm="ring",
                                                                tag=i))(arr)))
        return out
      attempt("tagged_public", public_loop)
      hostcoll.reset()
      common.barrier("tagged-public-done")

    if "fori" in phases:   # the public all_reduce in lax.fori_loop, tagged with its index
      def loop_step(start):
        def body(i, c):
          return c + 0.5 * dtenjax.all_reduce(c, "p", algorithm="ring", tag=i)
        return jit(lambda x: jax.lax.fori_loop(start, start + 3, body, x))
      attempt("fori_same", lambda: rows(loop_step(0)(arr)))            # every rank 0..2
      attempt("fori", lambda: rows(loop_step(1 if rank == 1 else 0)(arr)))  # rank 1: 1..3
      hostcoll.reset()
      common.barrier("fori-done")

    if "differ" in phases:   # one line, another shape or dtype on rank 1 (same element count)
      def helper(v):
        return dtenjax.all_reduce(v, "p", algorithm="ring")

      def shapes(x):
        v = jnp.tile(x.reshape(-1), 125)                       # 1000 elements
        y = helper(v.reshape(4, 250) if rank == 1 else v)
        return x + y.reshape(-1)[:8].reshape(x.shape)

      def dtypes(x):
        v = x.astype(jnp.bfloat16) if rank == 1 else x
        return helper(v).astype(jnp.float32)
      attempt("shapes", lambda: rows(jit(shapes)(arr)))
      hostcoll.reset()
      common.barrier("shapes-done")
      attempt("dtypes", lambda: rows(jit(dtypes)(arr)))
      hostcoll.reset()
      common.barrier("dtypes-done")

    if "threads" in phases:
      import threading
      trials = int(os.environ.get("DTENJAX_TEST_THREAD_TRIALS", "50"))
      outcomes = {"shared": [], "keyed": [], "own": []}
      shared = transport.create_communicator("threads-shared")
      order = [0, 1] if rank == 0 else [1, 0]      # rank 1 starts its threads the other way round

      def run_trial(variant, t, comm):
        box = {}
        def worker(k):
          x = np.full(8, 100.0 * k + rank + 1, np.float32)   # job k's data on this rank
          try:
            if variant == "shared":
              y = shared.all_reduce(x)
            elif variant == "keyed":
              y = comm.all_reduce(x, stream=f"job-{k}")
            else:
              own = transport.create_communicator(f"threads-own-{k}-{t}")
              try:
                y = own.all_reduce(x)
              finally:
                own.close()
            box[k] = {"value": y.tolist()}
          except Exception as e:
            box[k] = {"error": f"{type(e).__name__}: {e}"[:600]}
        ts = [threading.Thread(target=worker, args=(k,)) for k in order]   # "Thread-N (worker)"
        for th in ts:
          th.start()
        for th in ts:
          th.join(30)
        outcomes[variant].append({"trial": t, "names": [th.name for th in ts],
                                  "jobs": {str(k): v for k, v in box.items()}})

      t0 = time.monotonic()
      for t in range(trials):
        common.barrier(f"threads-{t}")
        run_trial("shared", t, None)
        keyed = transport.create_communicator(f"threads-keyed-{t}")
        try:
          run_trial("keyed", t, keyed)
        finally:
          keyed.close()
        run_trial("own", t, None)
      shared.close()
      res["threads"] = {"outcomes": outcomes, "seconds": time.monotonic() - t0}
      common.write(res)

    if "algorithms" in phases:
      xla = jit(lambda x: dtenjax.all_reduce(x, "p", algorithm="xla"))
      if rank == 0:
        if "DTENJAX_TEST_ALGORITHMS_TIMEOUT" in os.environ:   # read when the ring is made
          os.environ["DTENJAX_COLLECTIVE_TIMEOUT"] = os.environ["DTENJAX_TEST_ALGORITHMS_TIMEOUT"]
        attempt("algorithms", lambda: rows(jit(
            lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"))(arr)))
        res["released"] = rows(xla(arr))   # what the others are waiting for in XLA's collective
      else:
        attempt("algorithms", lambda: rows(xla(arr)))

    if "peer_loss" in phases:
      f = jit(lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"))
      attempt("first", lambda: rows(f(arr)))
      common.barrier("first-done")
      if rank == nprocs - 1:
        common.write(res)
        os._exit(3)
      time.sleep(0.5)   # it is gone
      attempt("second", lambda: rows(f(arr)))
      res["alive_after_s"] = 0.0
      t0 = time.monotonic()
      while time.monotonic() - t0 < float(os.environ.get("DTENJAX_TEST_WATCH", "0")):
        time.sleep(0.2)
        res["alive_after_s"] = time.monotonic() - t0
        common.write(res)
      common.finish(res, expect_done=nprocs - 1, wait_s=10)

    if "coordinator_loss" in phases:
      kvstore.default().barrier("before-kill", timeout_s=30)
      res["beats"] = []
      common.write(res)
      if rank == 0:
        time.sleep(0.3)
        res["killed_at"] = time.time()
        common.write(res)
        os.kill(os.getpid(), signal.SIGKILL)
      t0 = time.monotonic()
      while time.monotonic() - t0 < 10:
        res["beats"].append(time.time())
        common.write(res)
        time.sleep(0.01)
  except Exception:
    res["exception"] = traceback.format_exc()[-4000:]
  common.finish(res)


if __name__ == "__main__":
  main()
