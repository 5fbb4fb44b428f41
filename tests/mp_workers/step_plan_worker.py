"""One process of the whole-step planner's multi-process test: plans the MLP step over every
process's devices (jax.distributed), builds the planned mesh across processes, places the state
and runs one step. Writes the plan's digest, mesh and loss."""

import hashlib
import os
import sys

import jax
import numpy as np

from tests.mp_workers import common

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))


def main():
  rank, nprocs = common.init()
  import _step_models as models
  import optax
  import dtenjax
  step, args = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  plan = dtenjax.plan(step, *args, mesh={"data": 4, "tensor": 2})
  mesh = plan.mesh()
  made = dtenjax.topology_mesh(plan.mesh_shape, plan.axis_names)     # the same mesh, by hand
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), args[0])
  opt = optax.adamw(1e-3).init(params)
  opt = jax.tree.map(np.asarray, opt)
  batch = rng.standard_normal(args[2].shape).astype(args[2].dtype)
  shardings = plan.shardings()

  def place(x, s):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  placed = [jax.tree.map(place, a, s) for a, s in zip((params, opt, batch), shardings)]
  # every local device's part of the step, not only the first device's loss: a process that
  # leaves while another of its devices is still inside a collective breaks its peers' (gloo)
  _, _, loss = jax.block_until_ready(plan.jit(step)(*placed))
  common.barrier("step-done")
  digest = hashlib.sha256(repr((plan.mesh_shape, plan.device_ids, plan.specs)).encode())
  common.finish({"rank": rank, "nprocs": nprocs, "digest": digest.hexdigest(),
                 "mesh_devices": [int(d.id) for d in mesh.devices.flat],
                 "mesh_processes": sorted({int(d.process_index) for d in mesh.devices.flat}),
                 "make_mesh_devices": [int(d.id) for d in made.devices.flat],
                 "loss": float(jax.device_get(loss))})


if __name__ == "__main__":
  main()
