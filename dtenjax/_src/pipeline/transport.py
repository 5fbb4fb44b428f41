"""How pipeline stages exchange activations, and why: the choice a pipelined step makes.

Stages send each micro-batch's activation to the next stage and its cotangent to the previous
one: one point-to-point message per tick in each direction, ``lax.ppermute`` along the stage axis,
which XLA compiles to a collective-permute. Where that permute runs:

* all stages in one process: XLA's in-process permute (device memory copies on a GPU, memcpy
  between the simulated CPU devices);
* stages in several processes on GPUs: NCCL send/recv, XLA's own;
* stages in several processes on CPU: XLA's CPU collectives reach other processes only with a
  cross-process implementation (``jax.config.update("jax_cpu_collectives_implementation",
  "gloo")``, JAX's default); without one XLA cannot connect the stages.

The design's other path, activations written over dtenjax's host transport (TCP now, RDMA verbs
where a NIC exists) as the all-reduce's ``host_ring`` does, is not built for pipelines yet: a
custom call that waits for a peer cannot sit inside XLA's lockstep loop on the simulated CPU
devices of one process (docs/architecture.md, "Measured constraints"), so it would need one
device per process and its own tick loop. :func:`choose` says so instead of choosing it.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src import tables


@dataclasses.dataclass(frozen=True)
class TransportChoice:
  """Which path carries a pipeline's activations: ``path`` is ``"xla"`` (XLA's collective-permute)
  or ``"none"`` (nothing here can connect the stages); ``reason`` says why, ``processes`` how many
  processes one group of stages spans, ``backend`` the platform."""
  path: str
  reason: str
  processes: int
  backend: str

  def table(self) -> str:
    return tables.render(["path", "processes per pipeline", "backend", "why"],
                         [[self.path, self.processes, self.backend, self.reason]],
                         align=["left", "right", "left", "left"])


def choose(mesh, axis: str = "stage") -> TransportChoice:
  """The path a pipeline along ``axis`` of ``mesh`` (a concrete ``jax.sharding.Mesh``) takes."""
  if axis not in mesh.axis_names:
    raise errors.MeshError(
        f"pipeline: the mesh has no axis {axis!r} (axes {list(mesh.axis_names)}): make one, "
        f"e.g. jax.make_mesh((stages, n), ({axis!r}, 'data'))")
  groups = jaxapi.device_groups(mesh.devices, mesh.axis_names, (axis,))
  processes = max(len({d.process_index for d in row}) for row in groups)
  backend = np.asarray(mesh.devices).flat[0].platform
  return decide(processes, backend, getattr(jax.config, "jax_cpu_collectives_implementation", None))


def decide(processes: int, backend: str, cpu_collectives: str | None) -> TransportChoice:
  """The rule of :func:`choose` on its inputs: how many processes one pipeline's stages span,
  the platform, and XLA's CPU collectives implementation."""
  if processes == 1:
    return TransportChoice("xla", "every stage of a pipeline is in one process: XLA's in-process "
                           "collective-permute", 1, backend)
  if backend != "cpu":
    return TransportChoice("xla", f"stages in {processes} processes on {backend}: XLA's "
                           "collective-permute over NCCL send/recv", processes, backend)
  if cpu_collectives in ("gloo", "mpi"):
    return TransportChoice("xla", f"stages in {processes} processes on CPU: XLA's "
                           f"collective-permute over {cpu_collectives}", processes, backend)
  return TransportChoice(
      "none", f"stages in {processes} processes on CPU, and XLA's CPU collectives reach no other "
      f"process (jax_cpu_collectives_implementation={cpu_collectives!r}); dtenjax's host "
      "transport does not carry pipeline activations yet. Set "
      "jax.config.update('jax_cpu_collectives_implementation', 'gloo') before "
      "jax.distributed.initialize()", processes, backend)
