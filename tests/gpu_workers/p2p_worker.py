"""Worker: one process per GPU (CUDA IPC), the PUBLIC dtenjax.all_reduce under plain
jax.shard_map for every (algorithm, op, reproducible) case of tests/test_p2p.py::CASES. Every
process reduces the same global input (rank r's shard = row r) and writes its own output bits;
the test compares them with the numpy references."""

from __future__ import annotations

import traceback

import os

from tests.mp_workers import common

CASES = [("one_shot", "sum", False), ("two_shot", "sum", False), ("one_shot", "mean", False),
         ("two_shot", "max", False), ("one_shot", "min", False), ("one_shot", "sum", True),
         ("two_shot", "sum", True), ("two_shot", "mean", True)]
COUNT = 50021


def main():
  import jax
  # One GPU per process, all GPUs visible to CUDA (so that CUDA IPC can map the peers' memory).
  jax.distributed.initialize(
      coordinator_address=os.environ["DTENJAX_TEST_COORDINATOR"],
      num_processes=int(os.environ["DTENJAX_TEST_NPROCS"]),
      process_id=int(os.environ["DTENJAX_TEST_RANK"]),
      local_device_ids=[int(os.environ["DTENJAX_TEST_RANK"])], initialization_timeout=60)
  rank, nprocs = jax.process_index(), jax.process_count()
  import numpy as np
  from jax.experimental import multihost_utils

  import dtenjax

  res: dict = {"rank": rank}
  try:
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    rng = np.random.default_rng(1234)
    x = (rng.standard_normal((nprocs, COUNT)) * 2.0 ** rng.integers(-30, 30, (nprocs, COUNT)))
    x = x.astype(np.float32)
    x[nprocs - 1, 7] = np.nan
    res["inputs"] = x.tolist() if rank == 0 else None
    glob = multihost_utils.host_local_array_to_global_array(x[rank:rank + 1].reshape(-1), mesh,
                                                            jax.P("x"))
    res["outputs"] = {}
    for algorithm, op, reproducible in CASES:
      f = jax.jit(jax.shard_map(
          lambda v: dtenjax.all_reduce(v, "x", algorithm=algorithm, op=op,
                                       reproducible=reproducible),
          mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"), check_vma=False))
      out = f(glob)
      local = np.asarray(out.addressable_shards[0].data)
      res["outputs"][f"{algorithm}-{op}-{reproducible}"] = local.view(np.uint32).tolist()
  except Exception:
    res["error"] = traceback.format_exc()
    print(res["error"], flush=True)
    common.finish(res, 1)
  common.finish(res, 0)


if __name__ == "__main__":
  main()
