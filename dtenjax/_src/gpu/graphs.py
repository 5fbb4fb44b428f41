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

:func:`graph_report` reads the compiled (optimised, scheduled) HLO. Where XLA has outlined command
buffers into HLO computations the report counts them as observed; otherwise it applies XLA's
command-buffer scheduling rules to the schedule and reports what would be captured, which on a
CPU build is the prediction for the same program on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dtenjax._src import config
from dtenjax._src import errors

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
# Reading the optimised HLO
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HloOp:
  name: str
  opcode: str
  target: str = ""                  # custom_call_target, if any
  called: tuple[str, ...] = ()      # computations it calls (body, condition, branches, to_apply)
  kind: str = ""                    # fusion kind (kLoop, kCustom, ...)


_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED_RE = re.compile(
    r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TARGET_RE = re.compile(r'custom_call_target="([^"]*)"')
_KIND_RE = re.compile(r"\bkind=(k\w+)")


def _skip_type(text: str) -> str:
  """Drops the leading result type (possibly a nested tuple) of an instruction's right side."""
  text = text.lstrip()
  if text.startswith("("):
    depth = 0
    for i, ch in enumerate(text):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        return text[i + 1:].lstrip()
    return ""
  parts = text.split(None, 1)
  return parts[1] if len(parts) > 1 else ""


def parse_hlo(text: str) -> tuple[str, dict[str, list[HloOp]]]:
  """Parses HLO text into (entry name, {computation: [ops in schedule order]})."""
  comps: dict[str, list[HloOp]] = {}
  entry = ""
  current: list[HloOp] | None = None
  for line in text.splitlines():
    if current is None:
      m = _COMP_RE.match(line)
      if m and "=" not in line.split("(", 1)[0]:
        current = comps.setdefault(m.group(2), [])
        if m.group(1):
          entry = m.group(2)
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTR_RE.match(line)
    if not m:
      continue
    rest = _skip_type(m.group(2))
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
      continue
    called = list(_CALLED_RE.findall(rest))
    for group in _BRANCHES_RE.findall(rest):
      called.extend(c.strip().lstrip("%") for c in group.split(",") if c.strip())
    target = _TARGET_RE.search(rest)
    kind = _KIND_RE.search(rest)
    current.append(HloOp(m.group(1), op.group(1), target.group(1) if target else "",
                         tuple(called), kind.group(1) if kind else ""))
  if not entry and comps:
    entry = list(comps)[-1]
  return entry, comps


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


def classify(op: HloOp, comps: dict[str, list[HloOp]], commands: Sequence[str],
             _depth: int = 0) -> tuple[str, str]:
  """Pure rule: ('noop'|'command'|'split', command type or the reason it splits graphs)."""
  cmds = set(commands)

  def need(kind: str, what: str) -> tuple[str, str]:
    if kind in cmds:
      return "command", kind
    return "split", f"{what} needs command type {kind}, which this policy leaves out"

  opc, tgt = op.opcode, op.target
  if opc in _NOOPS:
    return "noop", ""
  if opc == "fusion":
    if op.kind == "kCustom" and "dynamic" in op.name.lower():
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
      for inner in comps.get(comp, ()):
        status, why = classify(inner, comps, commands, _depth + 1)
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


@dataclasses.dataclass(frozen=True)
class GraphReport:
  """How much of a step runs inside command buffers (CUDA graphs) and what splits them."""
  platform: str
  applies: bool                       # False on platforms without command buffers
  source: str                         # "observed" (outlined by XLA) or "predicted" (rules)
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

  def launches(self) -> int:
    """Host launches per step: one per graph plus one per op outside graphs."""
    return self.num_graphs + self.ops_outside

  def to_dict(self) -> dict[str, Any]:
    return {
        "platform": self.platform, "applies": self.applies, "source": self.source,
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
    t = Table(title=(f"CUDA graphs ({self.source}, policy {self.policy.mode}): "
                     f"{self.ops_inside} ops in {self.num_graphs} graphs, {self.ops_outside} "
                     f"outside, {100 * self.fraction_inside:.0f}% inside{note}"))
    for col in ("#", "where", "ops", "first .. last", "why"):
      t.add_column(col)
    for i, s in enumerate(self.segments):
      span = s.ops[0] if len(s.ops) == 1 else f"{s.ops[0]} .. {s.ops[-1]}"
      t.add_row(str(i), "graph" if s.captured else "outside", str(len(s.ops)), span, s.reason)
    for name, what, reason in self.splitters:
      t.add_row("-", "splits", "1", f"{name} ({what})", reason)
    return t

  def render(self, width: int = 160) -> str:
    from rich.console import Console  # pylint: disable=g-import-not-at-top
    console = Console(width=width, record=True, file=None, force_terminal=False)
    with console.capture() as cap:
      console.print(self.table())
    return cap.get()

  def __str__(self) -> str:
    return self.render()


def report_from_hlo(text: str, policy: CudaGraphPolicy, platform: str) -> GraphReport:
  """Builds a GraphReport from optimised HLO text (pure; see :func:`graph_report`)."""
  entry, comps = parse_hlo(text)
  ops = comps.get(entry, [])
  outlined = {name for name in comps if name.startswith("command_buffer")}
  segments: list[GraphSegment] = []
  splitters: list[tuple[str, str, str]] = []
  if outlined:
    source = "observed"
    run: list[str] = []
    for op in ops:
      called = [c for c in op.called if c in outlined]
      if op.opcode == "call" and called:
        inner = [o.name for c in called for o in comps[c] if o.opcode not in _NOOPS]
        segments.append(GraphSegment(tuple(inner), True, "outlined by XLA"))
        continue
      status, why = classify(op, comps, policy.commands)
      if status == "split":
        splitters.append((op.name, op.target or op.opcode, why))
      elif status == "command":
        segments.append(GraphSegment((op.name,), False,
                                     f"left out of graphs by XLA (min_graph_size="
                                     f"{policy.min_graph_size} or scheduling)"))
    del run
  else:
    source = "predicted"
    run = []

    def flush():
      if not run:
        return
      captured = policy.enabled and len(run) >= policy.min_graph_size
      reason = ("" if captured else "graphs are off" if not policy.enabled else
                f"run of {len(run)} < min_graph_size={policy.min_graph_size}")
      segments.append(GraphSegment(tuple(run), captured, reason))
      run.clear()

    # With graphs off, group by what any policy could record, so only real splitters are listed.
    rules = policy.commands if policy.enabled else ALL_COMMANDS
    for op in ops:
      status, why = classify(op, comps, rules)
      if status == "noop":
        continue
      if status == "command":
        run.append(op.name)
      else:
        flush()
        splitters.append((op.name, op.target or op.opcode, why))
    flush()
  return GraphReport(platform, platform == "gpu", source, policy, tuple(segments),
                     tuple(splitters))


def _compiled_platform(compiled: Any) -> str:
  for sharding in jax.tree.leaves(compiled.input_shardings):
    for device in getattr(sharding, "device_set", ()):
      return _backend_platform(device.platform)
  return _backend_platform(None)


def graph_report(fn_or_compiled: Any, *args, cuda_graphs: str | CudaGraphPolicy | None = None,
                 **kwargs) -> GraphReport:
  """Reports how much of a step runs inside CUDA graphs, and which ops split them and why.

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
  if isinstance(fn_or_compiled, jax.stages.Compiled):
    compiled = fn_or_compiled
    policy = CudaGraphPolicy.from_mode(cuda_graphs or "xla")
  elif isinstance(fn_or_compiled, GraphJitted):
    policy = (CudaGraphPolicy.from_mode(cuda_graphs) if cuda_graphs is not None
              else fn_or_compiled.policy)
    compiled = fn_or_compiled.lower(*args, **kwargs).compile()
  elif callable(fn_or_compiled):
    policy = CudaGraphPolicy.from_mode(cuda_graphs or "xla")
    target = fn_or_compiled if hasattr(fn_or_compiled, "lower") else jax.jit(fn_or_compiled)
    if cuda_graphs is not None and not hasattr(fn_or_compiled, "lower"):
      target = jit(fn_or_compiled, policy)
    compiled = target.lower(*args, **kwargs).compile()
  else:
    raise errors.ConfigurationError(
        f"graph_report got {type(fn_or_compiled).__name__}; pass a function, a jitted function "
        f"or a jax.stages.Compiled (from jax.jit(f).lower(*args).compile()).")
  return report_from_hlo(compiled.as_text(), policy, _compiled_platform(compiled))
