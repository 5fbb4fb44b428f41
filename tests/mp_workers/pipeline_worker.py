"""One process of the pipeline's multi-process test: jax.distributed on the test's coordinator
(XLA's CPU collectives over gloo), then one pipelined training step of tests/pipeline_bits.py
whose stage axis spans the processes (the mesh is process-major: stage s on process s's devices
when there are as many processes as stages). Writes the digest of the loss and updated
parameters, and the transport the pipeline chose."""

import sys

import jax

from tests.mp_workers import common


def main():
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  rank, nprocs = common.init()
  import dtenjax  # pylint: disable=g-import-not-at-top
  from tests import pipeline_bits  # pylint: disable=g-import-not-at-top
  stages, schedule = int(sys.argv[1]), sys.argv[2]
  devices = jax.devices()
  mesh = jax.sharding.Mesh(pipeline_bits.np.asarray(devices).reshape(stages, -1), ("stage", "data"))
  choice = dtenjax.pipeline_transport(mesh)
  digest = pipeline_bits.pipelined(stages, schedule, devices)
  common.finish({"rank": rank, "nprocs": nprocs, "digest": digest, "path": choice.path,
                 "processes": choice.processes, "reason": choice.reason})


if __name__ == "__main__":
  main()
