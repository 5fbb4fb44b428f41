"""What a GPU really launched: CUDA graph launches and kernels inside / outside graphs.

An observation, not a prediction (:mod:`graph_prediction` predicts): :func:`observe_launches`
runs a step under ``jax.profiler`` and :func:`read_launches` counts, in the trace, host
``cuGraphLaunch`` calls and device kernels with and without a CUDA graph id (CUPTI records one on
every kernel that ran as a graph node). On CPU nothing about command buffers can be observed.

XLA runs a command buffer op by op while a profiler session is active unless the executable was
compiled with ``xla_enable_command_buffers_during_profiling`` (XLA's work-around for CUPTI and
graphs, CommandBufferThunk::ExecuteOnStream). So a trace of an ordinary executable can show no
graphs although the untraced step uses them: :func:`observe_launches` traces a twin of a
``dtenjax.jit`` step compiled with that option (``LaunchObservation.profiling_graphs``); for any
other callable compile it with ``compiler_options={OPT_PROFILING: True}`` yourself.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from dtenjax._src import errors
from dtenjax._src.gpu import graph_policy as gp


@dataclasses.dataclass(frozen=True)
class LaunchObservation:
  """Launches counted in a profiler trace of ``steps`` runs of a compiled step.

  Attributes:
    platform: the backend the step ran on.
    steps: how many runs the trace covers.
    graph_launches: host-side CUDA graph launches (``cuGraphLaunch`` driver calls).
    graph_executions: device-side graph executions (CUPTI graph-level trace records).
    kernels_in_graphs: device kernels that ran as nodes of a CUDA graph (they carry a graph id).
    kernels_outside: device kernels launched one by one (no graph id).
    kernel_names_outside: {kernel name: count} of those launched one by one.
    host_events: {driver API or host event name: count} of launch-related host events.
    executions: host records of an executable run (``...Executable::ExecuteHelper...``), i.e.
      how many runs of the step the trace holds; on every backend.
    profiling_graphs: whether the traced executable kept its CUDA graphs under the profiler
      (compiled with ``xla_enable_command_buffers_during_profiling``); None when not known.
  """
  platform: str
  steps: int
  graph_launches: int = 0
  graph_executions: int = 0
  kernels_in_graphs: int = 0
  kernels_outside: int = 0
  kernel_names_outside: dict[str, int] = dataclasses.field(default_factory=dict)
  kernel_names_inside: dict[str, int] = dataclasses.field(default_factory=dict)
  host_events: dict[str, int] = dataclasses.field(default_factory=dict)
  executions: int = 0
  profiling_graphs: bool | None = None

  @property
  def applies(self) -> bool:
    return self.platform == "gpu"

  @property
  def saw_gpu_activity(self) -> bool:
    return bool(self.graph_launches or self.graph_executions or self.kernels_in_graphs
                or self.kernels_outside)

  @property
  def graphs_used(self) -> bool:
    return bool(self.graph_launches or self.graph_executions or self.kernels_in_graphs)

  def per_step(self, count: int) -> float:
    return count / self.steps if self.steps else 0.0

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(applies=self.applies, graphs_used=self.graphs_used,
             kernels_outside_per_step=self.per_step(self.kernels_outside),
             graph_launches_per_step=self.per_step(self.graph_launches))
    return d


def _stat(stats, key_part: str) -> Any:
  for name, value in stats:
    if key_part in str(name):
      return value
  return None


def read_launches(profile: Any, platform: str, steps: int) -> LaunchObservation:
  """Counts launches in a ``jax.profiler.ProfileData`` (pure apart from reading it).

  Device planes (``/device:GPU:N``): events on stream lines are kernels (memcpy/memset
  excluded); a kernel with a non-zero ``cuda_graph_id`` stat ran inside a graph; events named
  ``CudaGraphExec:N`` are whole graphs (CUPTI graph-level tracing). Host planes: ``cuGraphLaunch``
  driver calls (XLA names them ``cuGraphLaunch (CudaGraph:N)``) are graph launches; PjRt's
  ``...Executable::ExecuteHelper...`` records count the step's runs.
  """
  graph_launches = graph_execs = inside = outside = executions = 0
  names_out: dict[str, int] = {}
  names_in: dict[str, int] = {}
  host: dict[str, int] = {}
  for plane in profile.planes:
    pname = plane.name
    on_device = pname.startswith("/device:GPU")
    for line in plane.lines:
      lname = line.name or ""
      for ev in line.events:
        name = ev.name or ""
        if not on_device:
          if "Executable::ExecuteHelper" in name:
            executions += 1
          if "GraphLaunch" in name or "(CudaGraph:" in name:
            graph_launches += 1
            host[name.split(" (")[0]] = host.get(name.split(" (")[0], 0) + 1
          elif name.startswith("cu") and "Launch" in name:
            host[name] = host.get(name, 0) + 1
          continue
        if not lname.startswith("Stream"):
          continue
        if name.startswith("CudaGraphExec"):
          graph_execs += 1
          continue
        if name.startswith(("Memcpy", "Memset", "MemoryAlloc", "MemoryFree")):
          continue
        gid = _stat(ev.stats, "graph_id")
        if gid not in (None, 0, "0"):
          inside += 1
          names_in[name] = names_in.get(name, 0) + 1
        else:
          outside += 1
          names_out[name] = names_out.get(name, 0) + 1
  return LaunchObservation(platform, steps, graph_launches, graph_execs, inside, outside,
                           names_out, names_in, host, executions)


def per_step_summary(obs: LaunchObservation) -> dict[str, float]:
  """The per-step counts benches print next to the prediction."""
  return {"graph_launches_per_step": obs.per_step(max(obs.graph_launches, obs.graph_executions)),
          "kernels_in_graphs_per_step": obs.per_step(obs.kernels_in_graphs),
          "kernels_outside_per_step": obs.per_step(obs.kernels_outside)}


def observe_launches(fn: Any, *args, steps: int = 10, warmup: int = 3,
                     log_dir: str | None = None, **kwargs) -> LaunchObservation:
  """Runs ``fn(*args, **kwargs)`` under jax's profiler and counts what the GPU launched.

  An observation, not a prediction: ``steps`` runs after ``warmup`` (so command buffers are
  recorded before the trace starts) are traced with ``jax.profiler.start_trace``, and the trace
  is read back with ``jax.profiler.ProfileData`` (:func:`read_launches`). ``fn`` is anything
  callable on the arguments; for a ``dtenjax.jit`` result the trace runs its profiling twin (the
  same policy, compiled with ``xla_enable_command_buffers_during_profiling``, see the module
  docstring). Donated arguments: pass a closure that threads the state, as training does.

  On a backend without CUDA (CPU) the counts are zero and ``applies`` is False. On a GPU, a trace
  without any kernel raises ConfigurationError (CUPTI unavailable or held by another profiler):
  an empty observation must not read as "nothing was launched".
  """
  import pathlib
  import tempfile
  if steps < 1 or warmup < 1:
    raise errors.ConfigurationError(
        f"observe_launches(steps={steps}, warmup={warmup}): both must be >= 1 (warm-up runs "
        "record the command buffers before the trace starts).")
  out = None
  for _ in range(warmup):
    out = jax.block_until_ready(fn(*args, **kwargs))
  profiling_graphs = None
  twin = getattr(fn, "profiling_twin", None)
  if callable(twin):
    target, profiling_graphs = twin()
    for _ in range(warmup):
      out = jax.block_until_ready(target(*args, **kwargs))
  else:
    target = fn
  platform = "cpu"
  for leaf in jax.tree.leaves(out):
    for d in getattr(leaf, "devices", lambda: ())():
      platform = gp.backend_platform(d.platform)
  with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
    jax.profiler.start_trace(tmp)
    try:
      for _ in range(steps):
        jax.block_until_ready(target(*args, **kwargs))
    finally:
      jax.profiler.stop_trace()
    files = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
    if not files:
      raise errors.ConfigurationError(
          f"jax.profiler wrote no .xplane.pb under {tmp}; observe_launches needs jax's profiler "
          "(jax.profiler.start_trace) to work in this process.")
    profile = jax.profiler.ProfileData.from_file(str(files[-1]))
    obs = read_launches(profile, platform, steps)
  if platform == "gpu" and not obs.saw_gpu_activity:
    raise errors.ConfigurationError(
        f"the profiler recorded no GPU kernel in {steps} runs on {platform}: CUPTI is unavailable "
        "or another profiler holds it (e.g. nsys). Nothing was observed; do not read this as "
        "zero launches.")
  return dataclasses.replace(obs, profiling_graphs=profiling_graphs)
