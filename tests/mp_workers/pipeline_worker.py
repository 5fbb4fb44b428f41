"""One process of the pipeline's multi-process test: jax.distributed on the test's coordinator
(XLA's CPU collectives over gloo), then, per ``STAGES:SCHEDULE`` argument (after an optional
``--layers N``, as tests/pipeline_bits.py takes them), one pipelined training
step of tests/pipeline_bits.py whose stage axis spans the first ``STAGES`` processes (one stage
per process, on its devices: the mesh is process-major); processes beyond them skip it. Writes
per configuration the digest of the loss and updated parameters, and the transport the pipeline
chose (tests/test_pipeline.py runs one configuration: 3 stages across 3 processes)."""

import sys

import jax

from tests.mp_workers import common


def main():
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  rank, nprocs = common.init()
  import dtenjax
  from tests import pipeline_bits
  out = {}
  layers, specs = pipeline_bits.options(sys.argv[1:])
  for spec in specs:
    stages, schedule = spec.split(":")
    stages = int(stages)
    if rank >= stages:          # not one of this configuration's processes
      continue
    devices = jax.devices()[:stages * jax.local_device_count()]
    mesh = jax.sharding.Mesh(pipeline_bits.np.asarray(devices).reshape(stages, -1),
                             ("stage", "data"))
    choice = dtenjax.pipeline_transport(mesh)
    out[spec] = {"digest": pipeline_bits.pipelined(stages, schedule, devices, layers=layers),
                 "path": choice.path, "processes": choice.processes, "reason": choice.reason}
  # a process that leaves early would look crashed to the coordination service, which then ends
  # the others: every process stays until all are done
  common.barrier("pipeline-done", timeout_s=300)
  common.finish({"rank": rank, "nprocs": nprocs, "runs": out})


if __name__ == "__main__":
  main()
