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

The design's other path writes activations over dtenjax's host transport (TCP now, RDMA verbs
where a NIC exists; the provider table picks): :class:`dtenjax.HostPipeline`
(:mod:`dtenjax._src.pipeline.host`) runs each stage as programs of its own in its own process
(one device per process) with a tick loop that exchanges the messages between jitted programs.
It cannot run inside the SPMD program: a custom call that waits for a peer cannot sit inside
XLA's lockstep loop on the simulated CPU devices of one process (docs/architecture.md, "Measured
constraints"). :func:`choose` takes it (``path="host"``) when the stages are in several processes
and XLA cannot connect them, or when asked (``transport="host"``), and its table lists every
path with why it was or was not taken, as an all-reduce's explanation does.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src import tables


PATHS = ("auto", "xla", "host")


@dataclasses.dataclass(frozen=True)
class TransportChoice:
  """Which path carries a pipeline's activations: ``path`` is ``"xla"`` (XLA's collective-permute
  inside the SPMD program), ``"host"`` (dtenjax's host transport between the stages' own
  programs: :class:`dtenjax.HostPipeline`) or ``"none"`` (nothing here can connect the stages);
  ``reason`` says why, ``processes`` how many processes one group of stages spans, ``backend``
  the platform; ``candidates`` every path as ``(path, usable, why)``."""
  path: str
  reason: str
  processes: int
  backend: str
  candidates: tuple = ()

  def table(self) -> str:
    rows = [[("* " if c[0] == self.path else "  ") + c[0], "yes" if c[1] else "no", c[2]]
            for c in self.candidates] or [["* " + self.path, "yes", self.reason]]
    return tables.render(["path", "usable", "why"], rows, align=["left", "left", "left"],
                         title=f"pipeline activations: {self.path} ({self.processes} processes "
                         f"per pipeline, {self.backend}): {self.reason}")


def host_status(provider: str | None = None) -> tuple[bool, str]:
  """Whether dtenjax's host transport can connect processes here, and over what (or why not)."""

  from dtenjax._src.net import native
  from dtenjax._src.net import providers
  try:
    native.transport()
    native.ensure_crypto()
    name, why = (provider, "asked for") if provider else providers.select_provider()
  except errors.DtenjaxError as e:
    return False, f"dtenjax's host transport is unavailable: {e}"
  return True, f"dtenjax's host transport over {name} ({why})"


def host_choice(processes: int, backend: str, provider: str | None = None) -> TransportChoice:
  """The choice :class:`dtenjax.HostPipeline` makes (asked for the host path), with the
  alternatives; raises ExtensionUnavailableError when the host transport cannot run here."""
  choice = decide(processes, backend, getattr(jax.config, "jax_cpu_collectives_implementation",
                                              None), "host", host_status(provider))
  if choice.path != "host":
    raise errors.ExtensionUnavailableError(f"HostPipeline: {choice.reason}")
  return choice


def choose(mesh, axis: str = "stage", transport: str = "auto") -> TransportChoice:
  """The path a pipeline along ``axis`` of ``mesh`` (a concrete ``jax.sharding.Mesh``) takes;
  ``transport``: ``"auto"`` (XLA's collective-permute where XLA connects the stages, else the
  host transport), ``"xla"`` or ``"host"`` to ask for one."""
  if transport not in PATHS:
    raise errors.ConfigurationError(
        f"pipeline transport={transport!r} is not one of {list(PATHS)}")
  if not isinstance(mesh, jax.sharding.Mesh):
    raise errors.MeshError(
        f"pipeline_transport: mesh={mesh!r} is not a jax.sharding.Mesh: pass the concrete mesh "
        "the pipeline runs on (jax.make_mesh, dtenjax.topology_mesh), which says which devices "
        "and processes its stages span")
  if axis not in mesh.axis_names:
    raise errors.MeshError(
        f"pipeline: the mesh has no axis {axis!r} (axes {list(mesh.axis_names)}): make one, "
        f"e.g. jax.make_mesh((stages, n), ({axis!r}, 'data'))")
  groups = jaxapi.device_groups(mesh.devices, mesh.axis_names, (axis,))
  processes = max(len({d.process_index for d in row}) for row in groups)
  backend = np.asarray(mesh.devices).flat[0].platform
  if transport == "xla":
    host = (False, "not asked for (transport='xla')")
  elif processes == 1:
    host = (True, "")      # decide() says why one process has no use for it
  else:
    host = host_status()
  return decide(processes, backend, getattr(jax.config, "jax_cpu_collectives_implementation", None),
                transport, host)


def decide(processes: int, backend: str, cpu_collectives: str | None, transport: str = "auto",
           host: tuple[bool, str] = (False, "not considered")) -> TransportChoice:
  """The rule of :func:`choose` on its inputs: how many processes one pipeline's stages span,
  the platform, XLA's CPU collectives implementation, the path asked for, and whether the host
  transport can run here (``(usable, why)``, :func:`host_status`)."""
  xla_ok, xla_why = _xla(processes, backend, cpu_collectives)
  host_ok, host_why = host
  if host_ok and processes == 1:
    host_ok, host_why = False, ("every stage is in one process: the host path needs one process "
                                "per stage (its waits cannot sit inside one SPMD program)")
  elif host_ok:
    host_why += ": each stage its own programs and tick loop (dtenjax.HostPipeline)"
  candidates = (("xla", xla_ok, xla_why), ("host", host_ok, host_why))
  if transport == "host":
    if host_ok:
      return TransportChoice("host", f"asked for (transport='host'): {host_why}", processes,
                             backend, candidates)
    return TransportChoice("none", f"transport='host' was asked for, but {host_why}", processes,
                           backend, candidates)
  if xla_ok:
    return TransportChoice("xla", xla_why, processes, backend, candidates)
  if transport == "auto" and host_ok:
    return TransportChoice("host", f"{xla_why}; {host_why}", processes, backend, candidates)
  return TransportChoice("none", xla_why + ("" if transport == "auto" else
                                           " (transport='xla' was asked for)"),
                         processes, backend, candidates)


def _xla(processes: int, backend: str, cpu_collectives: str | None) -> tuple[bool, str]:
  if processes == 1:
    return (True, "every stage of a pipeline is in one process: XLA's in-process "
            "collective-permute")
  if backend != "cpu":
    return (True, f"stages in {processes} processes on {backend}: XLA's "
            "collective-permute over NCCL send/recv")
  if cpu_collectives in ("gloo", "mpi"):
    return (True, f"stages in {processes} processes on CPU: XLA's collective-permute over "
            f"{cpu_collectives}")
  return (False, f"stages in {processes} processes on CPU, and XLA's CPU collectives reach "
          f"no other process (jax_cpu_collectives_implementation={cpu_collectives!r}): set "
          "jax.config.update('jax_cpu_collectives_implementation', 'gloo') before "
          "jax.distributed.initialize()")
