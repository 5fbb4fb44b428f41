"""CUDA-graph (XLA command buffer) policy per executable, and a report of what a step captures.

XLA's GPU backend records runs of consecutive "commands" (kernel fusions, cuBLAS/cuDNN calls,
command-buffer compatible FFI custom calls, ...) into CUDA graphs and replays each run with one
launch. Two per-executable compiler options steer it:

* ``xla_gpu_enable_command_buffer``: the command types that may be recorded (an empty list turns
  graphs off). Through ``compiler_options`` only full lists are accepted, never ``+X``/``-X`` edits.
* ``xla_gpu_graph_min_graph_size``: a run shorter than this many commands is launched op by op.

:func:`jit` sets both per executable from a mode (never by editing the global ``XLA_FLAGS``):

======== ==================================================================================
``off``  no command buffers: every kernel is launched from the host.
``xla``  XLA's own defaults, untouched (``FUSION, CUBLAS, CUBLASLT, CUDNN, CUSTOM_CALL,
         DYNAMIC_SLICE_FUSION, CONDITIONAL``; runs of >= 5 commands).
``auto`` XLA's defaults, written out explicitly (so a changed XLA default does not change
         dtenjax's behaviour), plus ``WHILE`` (loops such as ``lax.scan`` gradient accumulation
         are replayed on the device with CUDA conditional nodes instead of one host round trip per
         iteration) and a minimum run of 2 commands: ops that cannot be recorded (cuDNN
         convolutions, host callbacks, collectives) cut a step into short runs, and a run of 2-4
         kernels still saves launches when replayed as one graph. A run of 1 gains nothing.
         dtenjax's own CUDA custom calls are command-buffer compatible, so ``CUSTOM_CALL`` keeps
         them inside graphs. Collectives are left out, as XLA does, because NCCL inside graphs
         needs every rank to replay in lock step.
``all``  every command type XLA knows, collectives included, and runs of any length (>= 1).
======== ==================================================================================

On a CPU backend :func:`jit` is a plain ``jax.jit``: command buffers do not exist there.

:func:`graph_report` reads the compiled (optimised, scheduled) module through
:mod:`dtenjax._src.hlo`, the reader ``explain`` uses. Where XLA has outlined command buffers into
HLO computations the report reads them (``source="observed"``); otherwise it applies XLA's
command-buffer rules to the schedule and reports what would be captured (``source="predicted"``,
and the table says PREDICTED). On jax 0.10.2 and 0.11 XLA forms command buffers after HLO (at
the thunk level), so on a GPU too the report is a prediction. What a GPU really launched is
observed by :func:`observe_launches`: it runs the step under ``jax.profiler`` and counts graph
launches and the kernels that ran inside and outside graphs (CUPTI records a graph id on every
kernel that ran as a graph node). On CPU nothing about command buffers can be observed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import hlo

# Command types XLA accepts in xla_gpu_enable_command_buffer (jax 0.10.2 and 0.11.2).
ALL_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL", "COLLECTIVES",
                "CONDITIONAL", "WHILE", "DYNAMIC_SLICE_FUSION")
XLA_DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL",
                        "DYNAMIC_SLICE_FUSION", "CONDITIONAL")
XLA_DEFAULT_MIN_GRAPH_SIZE = 5
MODES = ("auto", "off", "xla", "all")

_OPT_COMMANDS = "xla_gpu_enable_command_buffer"
_OPT_MIN_SIZE = "xla_gpu_graph_min_graph_size"


@dataclasses.dataclass(frozen=True)
class CudaGraphPolicy:
  """Which XLA command types are recorded into CUDA graphs, and the shortest run worth a graph.

  Attributes:
    mode: the name the policy was made from ("auto", "off", "xla", "all" or "custom").
    commands: enabled command types, a subset of :data:`ALL_COMMANDS`; empty means graphs off.
    min_graph_size: runs of fewer commands than this are launched op by op.
    explicit: whether to pass the options to XLA (False only for "xla": leave XLA's defaults).
  """
  mode: str = "custom"
  commands: tuple[str, ...] = XLA_DEFAULT_COMMANDS
  min_graph_size: int = XLA_DEFAULT_MIN_GRAPH_SIZE
  explicit: bool = True

  def __post_init__(self):
    problems = []
    unknown = [c for c in self.commands if c not in ALL_COMMANDS]
    if unknown:
      problems.append(f"commands {unknown} are not XLA command types; use a subset of "
                      f"{list(ALL_COMMANDS)}")
    if len(set(self.commands)) != len(self.commands):
      problems.append(f"commands {list(self.commands)} lists a type twice; list each once")
    if not isinstance(self.min_graph_size, int) or self.min_graph_size < 1:
      problems.append(f"min_graph_size={self.min_graph_size!r} must be an integer >= 1")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid CudaGraphPolicy:", problems))

  @classmethod
  def from_mode(cls, mode: str | CudaGraphPolicy) -> CudaGraphPolicy:
    """The policy of a mode name (see the module docstring), or ``mode`` itself if a policy."""
    if isinstance(mode, CudaGraphPolicy):
      return mode
    if mode == "off":
      return cls("off", (), XLA_DEFAULT_MIN_GRAPH_SIZE)
    if mode == "xla":
      return cls("xla", XLA_DEFAULT_COMMANDS, XLA_DEFAULT_MIN_GRAPH_SIZE, explicit=False)
    if mode == "auto":
      return cls("auto", XLA_DEFAULT_COMMANDS + ("WHILE",), 2)
    if mode == "all":
      return cls("all", ALL_COMMANDS, 1)
    raise errors.ConfigurationError(
        f"cuda_graphs={mode!r} is not a known mode; use one of {list(MODES)} or pass a "
        f"dtenjax.CudaGraphPolicy(commands=..., min_graph_size=...).")

  @property
  def enabled(self) -> bool:
    return bool(self.commands)

  def compiler_options(self) -> dict[str, Any]:
    """The per-executable XLA options for a GPU compile ({} for mode "xla")."""
    if not self.explicit:
      return {}
    if not self.commands:
      return {_OPT_COMMANDS: ""}
    return {_OPT_COMMANDS: ",".join(self.commands), _OPT_MIN_SIZE: self.min_graph_size}


def _backend_platform(backend: str | None) -> str:
  platform = backend or jax.default_backend()
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


@functools.cache
def _accepted_option_keys(platform: str) -> frozenset[str]:
  """Which command-buffer option keys this jaxlib accepts (probed once on the default backend)."""
  accepted = set()
  probe_values = {_OPT_COMMANDS: "FUSION", _OPT_MIN_SIZE: 2}
  for key, value in probe_values.items():
    try:
      jax.jit(lambda x: x + 1, compiler_options={key: value}).lower(
          jax.ShapeDtypeStruct((2,), "float32")).compile()
      accepted.add(key)
    except Exception as e:  # pylint: disable=broad-except
      config.log_once(f"graphs:option:{key}",
                      f"dtenjax.jit: this jaxlib rejects compiler option {key!r} ({e}); "
                      f"CUDA-graph policies compile without it.")
  return frozenset(accepted)


class GraphJitted:
  """What :func:`jit` returns: a ``jax.jit`` function that remembers its CUDA-graph policy."""

  def __init__(self, fn: Callable[..., Any], policy: CudaGraphPolicy, platform: str,
               options: dict[str, Any], jitted: Any):
    self.fn = fn
    self.policy = policy
    self.platform = platform
    self.compiler_options = dict(options)
    self.jitted = jitted
    functools.update_wrapper(self, fn)

  def __call__(self, *args, **kwargs):
    return self.jitted(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self.jitted.trace(*args, **kwargs)

  def __repr__(self):
    return (f"dtenjax.jit({getattr(self.fn, '__name__', self.fn)!r}, cuda_graphs="
            f"{self.policy.mode!r}, platform={self.platform!r}, "
            f"compiler_options={self.compiler_options})")


def jit(fn: Callable[..., Any], cuda_graphs: str | CudaGraphPolicy = "auto", *,
        backend: str | None = None, **jit_kwargs) -> GraphJitted:
  """``jax.jit`` with a CUDA-graph policy set on this executable only.

  Args:
    fn: the function to compile.
    cuda_graphs: "auto" (default), "off", "xla" (XLA's defaults), "all", or a CudaGraphPolicy.
    backend: the platform the step is meant for; default ``jax.default_backend()``. Only for
      "gpu" are options set; otherwise the policy is recorded and the result is a plain
      ``jax.jit``. (Where it runs is decided by its inputs, as for ``jax.jit``.)
    **jit_kwargs: passed to ``jax.jit`` (static_argnums, donate_argnums, ...). A
      ``compiler_options`` dict is merged; setting the command-buffer keys there too is an error.

  Returns:
    A :class:`GraphJitted` (callable like the ``jax.jit`` result; ``.lower``, ``.policy``).
  """
  policy = CudaGraphPolicy.from_mode(cuda_graphs)
  platform = _backend_platform(backend)
  user_opts = dict(jit_kwargs.pop("compiler_options", None) or {})
  clash = sorted(set(user_opts) & {_OPT_COMMANDS, _OPT_MIN_SIZE})
  if clash:
    raise errors.ConfigurationError(
        f"compiler_options sets {clash}, which cuda_graphs={policy.mode!r} controls; pass a "
        f"dtenjax.CudaGraphPolicy as cuda_graphs instead of setting them by hand.")
  options = dict(user_opts)
  if platform == "gpu":
    accepted = _accepted_option_keys(platform)
    options.update({k: v for k, v in policy.compiler_options().items() if k in accepted})
  jitted = jax.jit(fn, compiler_options=options or None, **jit_kwargs)
  return GraphJitted(fn, policy, platform, options, jitted)


# --------------------------------------------------------------------------------------------
# What the compiled step would put in command buffers (predicted from the HLO schedule)
# --------------------------------------------------------------------------------------------

_NOOPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
          "opt-barrier", "partition-id", "replica-id", "add-dependency"}
_COLLECTIVES = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "all-reduce-start", "all-reduce-done", "all-gather-start", "all-gather-done",
                "collective-permute-start", "collective-permute-done", "collective-broadcast",
                "ragged-all-to-all"}
_HOST = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}
# Ops that become kernels (a fusion on GPU) when they appear unfused, e.g. in CPU HLO.
_KERNEL_LIKE = {"copy", "sort", "dot", "reduce", "broadcast", "transpose", "reshape", "slice",
                "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "iota", "select",
                "add", "multiply", "subtract", "divide", "maximum", "minimum", "exponential",
                "convert", "compare", "reduce-window", "select-and-scatter", "scatter", "gather",
                "rng-bit-generator", "cholesky", "triangular-solve", "fft", "clamp", "negate",
                "tanh", "log", "sqrt", "rsqrt", "abs", "power", "and", "or", "not", "xor"}


def _is_dtenjax_target(target: str) -> bool:
  return target.startswith("dtenjax_")


def classify(op: hlo.Instruction, module: hlo.Module, commands: Sequence[str],
             _depth: int = 0) -> tuple[str, str]:
  """XLA's command-buffer rules as dtenjax reads them (a prediction, not an observation).

  Returns ('noop'|'command'|'split', the command type or the reason the op splits graphs).
  """
  cmds = set(commands)

  def need(kind: str, what: str) -> tuple[str, str]:
    if kind in cmds:
      return "command", kind
    return "split", f"{what} needs command type {kind}, which this policy leaves out"

  opc, tgt = op.opcode, op.custom_call_target
  if opc in _NOOPS:
    return "noop", ""
  if opc == "fusion":
    if op.fusion_kind == "kCustom" and "dynamic" in op.name.lower():
      return need("DYNAMIC_SLICE_FUSION", "dynamic-slice fusion")
    if "cudnn" in op.name.lower():
      return need("CUDNN", "cuDNN fusion")
    return need("FUSION", "kernel fusion")
  if opc == "custom-call":
    if tgt.startswith("__cublas$lt"):
      return need("CUBLASLT", f"cuBLASLt matmul {tgt}")
    if tgt.startswith("__cublas$"):
      return need("CUBLAS", f"cuBLAS gemm {tgt}")
    if tgt.startswith("__cudnn$fmha") or "fmha" in tgt.lower():
      return need("CUDNN", f"cuDNN attention {tgt}")
    if tgt.startswith("__cudnn$conv"):
      return "split", (f"cuDNN convolution {tgt} has no command-buffer command in XLA; it runs "
                       "outside graphs")
    if "callback" in tgt:
      return "split", f"host callback {tgt} runs Python on the host between device launches"
    if _is_dtenjax_target(tgt):
      return need("CUSTOM_CALL", f"dtenjax FFI call {tgt} (command-buffer compatible)")
    return "split", (f"custom call {tgt!r}: recorded only if its FFI handler is marked "
                     "kCmdBufferCompatible and CUSTOM_CALL is enabled; assumed not")
  if opc == "convolution":
    return "split", "convolution (cuDNN on GPU) has no command-buffer command in XLA"
  if opc in _COLLECTIVES:
    return need("COLLECTIVES", f"collective {opc}")
  if opc in _HOST:
    return "split", f"{opc} synchronises with the host"
  if opc in ("while", "conditional", "call"):
    kind = {"while": "WHILE", "conditional": "CONDITIONAL", "call": None}[opc]
    if kind and kind not in cmds:
      return "split", f"{opc} needs command type {kind}, which this policy leaves out"
    if _depth > 16:
      return "split", f"{opc} nests too deeply to analyse"
    for comp in op.called:
      inner_comp = module.computations.get(comp)
      for inner in inner_comp.instructions if inner_comp else ():
        status, why = classify(inner, module, commands, _depth + 1)
        if status == "split":
          return "split", f"{opc} body holds {inner.name} ({inner.opcode}): {why}"
    return ("command", kind) if kind else ("command", "FUSION")
  if opc in _KERNEL_LIKE or opc.endswith("-start") or opc.endswith("-done"):
    if opc.startswith("async") or opc.endswith("-start") or opc.endswith("-done"):
      return "split", f"asynchronous {opc} is recorded only with its matching start/done"
    return need("FUSION", f"{opc} kernel")
  return "split", f"{opc} has no command-buffer command in XLA"


@dataclasses.dataclass(frozen=True)
class GraphSegment:
  """One run of consecutive commands in the entry schedule."""
  ops: tuple[str, ...]
  captured: bool
  reason: str = ""


SOURCES = {
    "predicted": "PREDICTED from XLA's command-buffer rules applied to the compiled schedule; "
                 "not observed",
    "observed": "read from command-buffer computations XLA outlined into the compiled HLO",
}


@dataclasses.dataclass(frozen=True)
class GraphReport:
  """How much of a step runs inside command buffers (CUDA graphs) and what splits them.

  ``source`` says where the rows come from: "observed" when XLA outlined its command buffers
  into HLO computations (read from the compiled module), "predicted" when dtenjax applied XLA's
  rules (:func:`classify`) to the schedule. A prediction is not a measurement: what a GPU really
  launched is what :func:`observe_launches` reads from the profiler.
  """
  platform: str
  applies: bool                       # False on platforms without command buffers
  source: str                         # "observed" or "predicted"
  policy: CudaGraphPolicy
  segments: tuple[GraphSegment, ...]
  splitters: tuple[tuple[str, str, str], ...]   # (op name, opcode/target, reason)

  @property
  def ops_inside(self) -> int:
    return sum(len(s.ops) for s in self.segments if s.captured)

  @property
  def ops_outside(self) -> int:
    return sum(len(s.ops) for s in self.segments if not s.captured) + len(self.splitters)

  @property
  def num_graphs(self) -> int:
    return sum(1 for s in self.segments if s.captured)

  @property
  def fraction_inside(self) -> float:
    total = self.ops_inside + self.ops_outside
    return self.ops_inside / total if total else 0.0

  @property
  def is_prediction(self) -> bool:
    return self.source == "predicted"

  def launches(self) -> int:
    """Host launches per step: one per graph plus one per op outside graphs."""
    return self.num_graphs + self.ops_outside

  def to_dict(self) -> dict[str, Any]:
    return {
        "platform": self.platform, "applies": self.applies, "source": self.source,
        "source_meaning": SOURCES[self.source],
        "policy": dataclasses.asdict(self.policy), "num_graphs": self.num_graphs,
        "ops_inside": self.ops_inside, "ops_outside": self.ops_outside,
        "fraction_inside": self.fraction_inside, "launches": self.launches(),
        "segments": [dataclasses.asdict(s) for s in self.segments],
        "splitters": [{"op": n, "what": w, "reason": r} for n, w, r in self.splitters],
    }

  def table(self):
    """A rich Table: one row per graph / op run outside / splitting op."""
    from rich.table import Table  # pylint: disable=g-import-not-at-top
    note = ("" if self.applies else
            f" — command buffers do not apply on {self.platform}; rows show what a GPU would capture")
    what = "PREDICTED (not observed)" if self.is_prediction else "observed in the compiled HLO"
    t = Table(title=(f"CUDA graphs, {what}, policy {self.policy.mode}: "
                     f"{self.ops_inside} ops in {self.num_graphs} graphs, {self.ops_outside} "
                     f"outside, {100 * self.fraction_inside:.0f}% inside{note}"),
              caption=SOURCES[self.source])
    for col in ("#", "where", "ops", "first .. last", "why"):
      t.add_column(col)
    for i, s in enumerate(self.segments):
      span = s.ops[0] if len(s.ops) == 1 else f"{s.ops[0]} .. {s.ops[-1]}"
      t.add_row(str(i), "graph" if s.captured else "outside", str(len(s.ops)), span, s.reason)
    for name, what_, reason in self.splitters:
      t.add_row("-", "splits", "1", f"{name} ({what_})", reason)
    return t

  def render(self, width: int = 160) -> str:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    console = Console(width=width, record=True, file=None, force_terminal=False)
    with console.capture() as cap:
      console.print(self.table())
    return cap.get()

  def __str__(self) -> str:
    return self.render()


def report_from_module(module: hlo.Module, policy: CudaGraphPolicy, platform: str) -> GraphReport:
  """Builds a GraphReport from a compiled module read by :mod:`dtenjax._src.hlo` (pure)."""
  entry = module.computations.get(module.entry)
  ops = entry.instructions if entry else ()
  outlined = {name for name in module.computations if name.startswith("command_buffer")}
  segments: list[GraphSegment] = []
  splitters: list[tuple[str, str, str]] = []
  if outlined:
    source = "observed"
    for op in ops:
      called = [c for c in op.called if c in outlined]
      if op.opcode == "call" and called:
        inner = [o.name for c in called for o in module.computations[c].instructions
                 if o.opcode not in _NOOPS]
        segments.append(GraphSegment(tuple(inner), True, "outlined by XLA"))
        continue
      status, why = classify(op, module, policy.commands)
      if status == "split":
        splitters.append((op.name, op.custom_call_target or op.opcode, why))
      elif status == "command":
        segments.append(GraphSegment((op.name,), False,
                                     f"left out of graphs by XLA (min_graph_size="
                                     f"{policy.min_graph_size} or scheduling)"))
  else:
    source = "predicted"
    run: list[str] = []

    def flush():
      if not run:
        return
      captured = policy.enabled and len(run) >= policy.min_graph_size
      reason = ("predicted" if captured else "graphs are off" if not policy.enabled else
                f"run of {len(run)} < min_graph_size={policy.min_graph_size}")
      segments.append(GraphSegment(tuple(run), captured, reason))
      run.clear()

    # With graphs off, group by what any policy could record, so only real splitters are listed.
    rules = policy.commands if policy.enabled else ALL_COMMANDS
    for op in ops:
      status, why = classify(op, module, rules)
      if status == "noop":
        continue
      if status == "command":
        run.append(op.name)
      else:
        flush()
        splitters.append((op.name, op.custom_call_target or op.opcode, why))
    flush()
  return GraphReport(platform, platform == "gpu", source, policy, tuple(segments),
                     tuple(splitters))


def report_from_hlo(text: str, policy: CudaGraphPolicy, platform: str) -> GraphReport:
  """:func:`report_from_module` of printed HLO text."""
  return report_from_module(hlo.parse_text(text), policy, platform)


def _compiled_platform(compiled: Any) -> str:
  for sharding in jax.tree.leaves(compiled.input_shardings):
    for device in getattr(sharding, "device_set", ()):
      return _backend_platform(device.platform)
  return _backend_platform(None)


def _compile(fn_or_compiled: Any, args, kwargs, cuda_graphs) -> tuple[Any, CudaGraphPolicy]:
  if isinstance(fn_or_compiled, jax.stages.Compiled):
    return fn_or_compiled, CudaGraphPolicy.from_mode(cuda_graphs or "xla")
  if isinstance(fn_or_compiled, GraphJitted):
    policy = (CudaGraphPolicy.from_mode(cuda_graphs) if cuda_graphs is not None
              else fn_or_compiled.policy)
    return fn_or_compiled.lower(*args, **kwargs).compile(), policy
  if callable(fn_or_compiled):
    policy = CudaGraphPolicy.from_mode(cuda_graphs or "xla")
    target = fn_or_compiled if hasattr(fn_or_compiled, "lower") else jax.jit(fn_or_compiled)
    if cuda_graphs is not None and not hasattr(fn_or_compiled, "lower"):
      target = jit(fn_or_compiled, policy)
    return target.lower(*args, **kwargs).compile(), policy
  raise errors.ConfigurationError(
      f"got {type(fn_or_compiled).__name__}; pass a function, a jitted function or a "
      f"jax.stages.Compiled (from jax.jit(f).lower(*args).compile()).")


def graph_report(fn_or_compiled: Any, *args, cuda_graphs: str | CudaGraphPolicy | None = None,
                 **kwargs) -> GraphReport:
  """Reports how much of a step runs inside CUDA graphs, and which ops split them and why.

  The compiled module is read once (:mod:`dtenjax._src.hlo`, the reader ``explain`` uses).
  Unless XLA outlined its command buffers into the HLO (``source == "observed"``), the rows are
  a prediction from XLA's rules (``source == "predicted"``, said in the table's title); on jax
  0.10.2/0.11 XLA builds command buffers after HLO, so GPU reports are predictions too. Use
  :func:`observe_launches` for what a GPU really launched.

  Args:
    fn_or_compiled: a :func:`jit` result, a ``jax.jit`` function, a plain function (compiled with
      ``jax.jit``), or an already compiled ``jax.stages.Compiled``.
    *args, **kwargs: example arguments (arrays or ShapeDtypeStructs) to lower with; not used for a
      Compiled.
    cuda_graphs: the policy to read the HLO under. Default: the :func:`jit` result's own policy,
      else XLA's defaults ("xla"). For a plain function a given mode also compiles with it.

  Returns:
    A :class:`GraphReport`; ``print(report)`` shows the table, ``report.to_dict()`` the data.
  """
  try:
    compiled, policy = _compile(fn_or_compiled, args, kwargs, cuda_graphs)
  except errors.ConfigurationError as e:
    raise errors.ConfigurationError(f"graph_report {e}") from None
  return report_from_module(hlo.read_compiled(compiled), policy, _compiled_platform(compiled))


# --------------------------------------------------------------------------------------------
# What a GPU really launched (observed with jax's profiler)
# --------------------------------------------------------------------------------------------

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
  driver calls (XLA names them ``cuGraphLaunch (CudaGraph:N)``) are graph launches.
  """
  graph_launches = graph_execs = inside = outside = 0
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
                           names_out, names_in, host)


def observe_launches(fn: Any, *args, steps: int = 10, warmup: int = 3,
                     log_dir: str | None = None, **kwargs) -> LaunchObservation:
  """Runs ``fn(*args, **kwargs)`` under jax's profiler and counts what the GPU launched.

  An observation, not a prediction: ``steps`` runs after ``warmup`` (so command buffers are
  recorded before the trace starts) are traced with ``jax.profiler.start_trace``, and the trace
  is read back with ``jax.profiler.ProfileData`` (:func:`read_launches`). ``fn`` is anything
  callable on the arguments: a :func:`jit` result, a ``jax.jit`` function, a Compiled.

  On a backend without CUDA (CPU) the counts are zero and ``applies`` is False. On a GPU, a trace
  without any kernel raises ConfigurationError (CUPTI unavailable or held by another profiler):
  an empty observation must not read as "nothing was launched".
  """
  import pathlib  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  if steps < 1 or warmup < 1:
    raise errors.ConfigurationError(
        f"observe_launches(steps={steps}, warmup={warmup}): both must be >= 1 (warm-up runs "
        "record the command buffers before the trace starts).")
  out = None
  for _ in range(warmup):
    out = jax.block_until_ready(fn(*args, **kwargs))
  platform = "cpu"
  for leaf in jax.tree.leaves(out):
    for d in getattr(leaf, "devices", lambda: ())():
      platform = _backend_platform(d.platform)
  with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
    jax.profiler.start_trace(tmp)
    try:
      for _ in range(steps):
        jax.block_until_ready(fn(*args, **kwargs))
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
  return obs
