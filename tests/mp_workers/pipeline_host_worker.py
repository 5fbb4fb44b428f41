"""One stage of tests/test_pipeline_host.py's pipeline (one process, one CPU device): the MLP of
tests/pipeline_host_model.py run by dtenjax.HostPipeline with GPipe and 1F1B, then a third step
in which the last stage dies after ``FAULT_TICK`` ticks (the others report the error they get and
how long it took). Rank 0 also computes the unpipelined reference in plain JAX. Arrays go to
``rank{r}.npz``, the rest to ``rank{r}.json``."""

import os
import sys
import time

import jax
import numpy as np

from tests.mp_workers import common

FAULT_TICK = 3


def main():
  rank, nprocs = common.init()
  import dtenjax
  from dtenjax._src.net import kvstore
  from tests import pipeline_host_model as m
  timeout_s = float(sys.argv[1])
  stacked, head, x, targets = m.init()
  n = m.LAYERS // nprocs
  mine = jax.tree.map(lambda a: a[rank * n:(rank + 1) * n], stacked)
  last = rank == nprocs - 1
  xin = x if rank == 0 else jax.ShapeDtypeStruct(x.shape, x.dtype)
  tin = targets if last else None
  arrays, result = {}, {"rank": rank}
  for name, schedule in (("gpipe", dtenjax.GPipe()), ("1f1b", dtenjax.OneFOneB())):
    pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=nprocs, microbatches=m.MICRO,
                            schedule=schedule)
    with dtenjax.HostPipeline(pipe, name=name, timeout_s=timeout_s) as hp:
      result["path"], result["table"] = hp.transport.path, hp.transport.table()
      loss, (dlayers, dhead, dx) = hp.value_and_grad(mine, head, xin, tin)
      arrays[f"{name}/forward_loss"] = hp.loss(mine, head, xin, tin)
    arrays[f"{name}/loss"] = loss
    arrays.update({f"{name}/layers/{k}": v for k, v in dlayers.items()})
    if dhead is not None:
      arrays.update({f"{name}/head/{k}": v for k, v in dhead.items()})
    if dx is not None:
      arrays[f"{name}/x"] = dx
  if rank == 0:
    loss, gl, gh, dx = m.reference(stacked, head, x, targets)
    arrays.update({"ref/loss": loss, "ref/x": dx, **{f"ref/layers/{k}": v for k, v in gl.items()},
                   **{f"ref/head/{k}": v for k, v in gh.items()}})
  np.savez(os.path.join(os.environ["DTENJAX_TEST_OUT"], f"rank{rank}.npz"),
           **{k: np.asarray(v) for k, v in arrays.items()})

  # A peer that dies mid-step: the last stage exits after FAULT_TICK ticks of a 1F1B step.
  pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=nprocs, microbatches=m.MICRO,
                          schedule=dtenjax.OneFOneB())
  hp = dtenjax.HostPipeline(pipe, name="fault", timeout_s=timeout_s)
  if last:
    real = hp._exchange

    def dying(t, *args):
      if t == FAULT_TICK:
        common.write(result)
        common.done(kvstore.default())
        os._exit(17)
      return real(t, *args)
    hp._exchange = dying
  t0 = time.monotonic()
  try:
    hp.value_and_grad(mine, head, xin, tin)
    result["fault"] = None
  except dtenjax.DtenjaxError as e:
    result["fault"] = {"type": type(e).__name__, "message": str(e),
                       "seconds": time.monotonic() - t0}
  common.finish(result)


if __name__ == "__main__":
  main()
