"""What a compiled step puts in CUDA graphs, predicted from its HLO schedule, and ``auto``'s rule.

On jax 0.10.2 and 0.11 XLA forms command buffers after HLO, from the thunk sequence
(``CommandBufferConversionPass``), so the compiled HLO shows none. This module applies that pass's
rules to the compiled, scheduled module and says what it predicts (``source="predicted"``):

* a thunk is convertible when its command type is enabled: fusions, device copies and
  partition/replica ids are FUSION; cuBLAS GEMMs CUBLAS / CUBLASLT; cuDNN fusions and attention
  CUDNN; FFI calls CUSTOM_CALL when their handler is command-buffer compatible (assumed for
  dtenjax's own targets only); collectives COLLECTIVES. Convolutions, CUB sorts and host
  callbacks are never convertible;
* a ``while`` (``conditional``) is convertible when WHILE (CONDITIONAL) is enabled and every
  thunk of its body and condition (branches) is convertible;
* consecutive convertible thunks form a run; a run of at least ``min_graph_size`` thunks becomes
  one graph, a shorter run is launched thunk by thunk; a ``while`` counts as ONE thunk of its run;
* a ``while`` that is not convertible runs its loop on the host: XLA converts its body with the
  same rules and launches it every iteration (with a known trip count, XLA's WhileThunk skips the
  condition; otherwise it evaluates the condition and waits for its value on the host each
  iteration). A convertible ``while`` left in a short run is launched op by op, body included.

From the schedule and the loops' trip counts (``known_trip_count`` in the compiled module) the
report predicts graph launches and ops launched outside graphs per step; :mod:`graph_observation`
observes what the GPU did, and ``bench/cuda_graphs.py`` prints the two side by side.

:func:`decide_auto` is the rule of ``cuda_graphs="auto"``: XLA's defaults (nothing passed, the
``jax.jit`` executable) unless the step has a loop XLA can run on the device (its body entirely
recordable) and enabling WHILE changes nothing else: then WHILE, with the smallest graph size the
loop's run needs, provided no run without such a loop changes status. Fewer host launches and no
host round trip per iteration, everything else launched exactly as before. A loop whose body XLA's
defaults already launch as one graph per iteration (known trip count) is left to them: on an H200
a 16-token decode loop run on the device was 0.985x the host-driven one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from dtenjax._src import hlo
from dtenjax._src import tables
from dtenjax._src.gpu import graph_policy as gp

_NOOPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
          "opt-barrier", "add-dependency"}
# Thunks XLA records as FUSION commands without being kernels (memset / memcpy on the device).
_FUSION_LIKE = {"partition-id", "replica-id", "copy"}
_HOST = {"send", "recv", "send-done", "recv-done", "infeed", "outfeed"}
# Ops that become kernels (a fusion on GPU) when they appear unfused, e.g. in CPU HLO.
_KERNEL_LIKE = {"sort", "dot", "reduce", "broadcast", "transpose", "reshape", "slice",
                "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "iota", "select",
                "add", "multiply", "subtract", "divide", "maximum", "minimum", "exponential",
                "convert", "compare", "reduce-window", "select-and-scatter", "scatter", "gather",
                "rng-bit-generator", "cholesky", "triangular-solve", "fft", "clamp", "negate",
                "tanh", "log", "sqrt", "rsqrt", "abs", "power", "and", "or", "not", "xor",
                "cosine", "sine", "floor", "ceil", "sign", "exponential-minus-one", "log-plus-one",
                "logistic", "reverse", "map", "reduce-precision", "round-nearest-even"}
_MAX_DEPTH = 16


def _is_dtenjax_target(target: str) -> bool:
  return target.startswith("dtenjax_")


def classify(op: hlo.Instruction, module: hlo.Module, commands: Sequence[str],
             _depth: int = 0) -> tuple[str, str]:
  """XLA's command-buffer rules as dtenjax reads them (a prediction, not an observation).

  Returns ('noop'|'command'|'split', the command type or the reason the op is not recorded).
  """
  cmds = set(commands)

  def need(kind: str, what: str) -> tuple[str, str]:
    if kind in cmds:
      return "command", kind
    return "split", f"{what} needs command type {kind}, which this policy leaves out"

  opc, tgt = op.opcode, op.custom_call_target
  if opc in _NOOPS:
    return "noop", ""
  if opc in _FUSION_LIKE:
    return need("FUSION", f"{opc} (a device memcpy/memset)")
  if opc == "fusion":
    if op.fusion_kind == "kCustom" and ("dynamic" in op.name.lower()
                                        or "address_computation" in op.name.lower()):
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
    if tgt.startswith("__cub$"):
      return "split", f"CUB call {tgt} has no command-buffer command in XLA"
    if "callback" in tgt:
      return "split", f"host callback {tgt} runs Python on the host between device launches"
    if _is_dtenjax_target(tgt):
      return need("CUSTOM_CALL", f"dtenjax FFI call {tgt} (command-buffer compatible)")
    return "split", (f"custom call {tgt!r}: recorded only if its FFI handler is marked "
                     "kCmdBufferCompatible and CUSTOM_CALL is enabled; assumed not")
  if opc == "convolution":
    return "split", "convolution (cuDNN on GPU) has no command-buffer command in XLA"
  if opc in hlo.COLLECTIVE_OPCODES:
    return need("COLLECTIVES", f"collective {opc}")
  if opc in _HOST:
    return "split", f"{opc} synchronises with the host"
  if opc in ("while", "conditional", "call"):
    kind = {"while": "WHILE", "conditional": "CONDITIONAL", "call": None}[opc]
    if kind and kind not in cmds:
      return "split", f"{opc} needs command type {kind}, which this policy leaves out"
    if _depth > _MAX_DEPTH:
      return "split", f"{opc} nests too deeply to analyse"
    for comp in op.called:
      inner_comp = module.computations.get(comp)
      for inner in inner_comp.instructions if inner_comp else ():
        status, why = classify(inner, module, commands, _depth + 1)
        if status == "split":
          return "split", f"{opc} body holds {inner.name} ({inner.opcode}): {why}"
    return ("command", kind) if kind else ("command", "FUSION")
  if opc in _KERNEL_LIKE:
    return need("FUSION", f"{opc} kernel")
  if opc.startswith("async") or opc.endswith("-start") or opc.endswith("-done"):
    return "split", f"asynchronous {opc} is recorded only with its matching start/done"
  return "split", f"{opc} has no command-buffer command in XLA"


@dataclasses.dataclass(frozen=True)
class GraphSegment:
  """One run of consecutive commands, as XLA would launch it.

  ``computation`` is where it runs (the entry, or a loop body the host drives); ``repeat`` how
  many times per step (the product of the enclosing loops' trip counts; None when unknown).
  """
  ops: tuple[str, ...]
  captured: bool
  reason: str = ""
  computation: str = ""
  repeat: int | None = 1


@dataclasses.dataclass(frozen=True)
class Splitter:
  """An op that is not recorded: it ends the run before it and is launched on its own."""
  op: str
  what: str
  reason: str
  computation: str = ""
  repeat: int | None = 1
  launches: int = 1          # device launches per execution (0 for loops, branches, callbacks)


SOURCES = {
    "predicted": "PREDICTED from XLA's command-buffer rules applied to the compiled schedule; "
                 "not observed",
    "observed": "read from command-buffer computations XLA outlined into the compiled HLO",
}


def _mul(a: int | None, b: int | None) -> int | None:
  return None if a is None or b is None else a * b


@dataclasses.dataclass(frozen=True)
class GraphReport:
  """How much of a step runs inside command buffers (CUDA graphs) and what splits them.

  ``source`` says where the rows come from: "observed" when XLA outlined its command buffers
  into HLO computations (read from the compiled module), "predicted" when dtenjax applied XLA's
  rules (:func:`classify`) to the schedule. A prediction is not a measurement: what a GPU really
  launched is what ``observe_launches`` reads from the profiler.
  """
  platform: str
  applies: bool                       # False on platforms without command buffers
  source: str                         # "observed" or "predicted"
  policy: gp.CudaGraphPolicy
  segments: tuple[GraphSegment, ...]
  splitters: tuple[Splitter, ...]
  reason: str = ""                    # why this policy (auto's decision), when known

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

  def graph_launches_per_step(self) -> int | None:
    """Predicted CUDA graph launches per step (None if a loop's trip count is unknown)."""
    total = 0
    for s in self.segments:
      if s.captured:
        if s.repeat is None:
          return None
        total += s.repeat
    return total

  def ops_outside_per_step(self) -> int | None:
    """Predicted ops launched one by one per step (loops counted every iteration)."""
    total = 0
    for s in self.segments:
      if not s.captured:
        if s.repeat is None:
          return None
        total += len(s.ops) * s.repeat
    for sp in self.splitters:
      if sp.launches:
        if sp.repeat is None:
          return None
        total += sp.launches * sp.repeat
    return total

  def launches(self) -> int | None:
    """Host launches per step: graph launches plus ops launched outside graphs."""
    g, o = self.graph_launches_per_step(), self.ops_outside_per_step()
    return None if g is None or o is None else g + o

  def to_dict(self) -> dict[str, Any]:
    return {
        "platform": self.platform, "applies": self.applies, "source": self.source,
        "source_meaning": SOURCES[self.source], "reason": self.reason,
        "policy": dataclasses.asdict(self.policy), "policy_described": self.policy.describe(),
        "num_graphs": self.num_graphs, "ops_inside": self.ops_inside,
        "ops_outside": self.ops_outside, "fraction_inside": self.fraction_inside,
        "graph_launches_per_step": self.graph_launches_per_step(),
        "ops_outside_per_step": self.ops_outside_per_step(), "launches": self.launches(),
        "segments": [dataclasses.asdict(s) for s in self.segments],
        "splitters": [dataclasses.asdict(s) for s in self.splitters],
    }

  def table(self) -> str:
    """A summary line, one row per graph / op run outside / splitting op (``?``: a count the
    compiled module does not give), and where the rows come from."""
    note = ("" if self.applies else
            f" -- command buffers do not apply on {self.platform}; rows show what a GPU would "
            "capture")
    what = "PREDICTED (not observed)" if self.is_prediction else "observed in the compiled HLO"
    fmt = lambda v: "?" if v is None else str(v)
    title = (f"CUDA graphs, {what}, policy {self.policy.mode} ({self.policy.describe()}): "
             f"{self.ops_inside} ops in {self.num_graphs} graphs, {self.ops_outside} outside; "
             f"per step {fmt(self.graph_launches_per_step())} graph launches + "
             f"{fmt(self.ops_outside_per_step())} ops launched one by one{note}")
    rows = []
    for i, s in enumerate(self.segments):
      span = s.ops[0] if len(s.ops) == 1 else f"{s.ops[0]} .. {s.ops[-1]}"
      where = ("graph" if s.captured else "outside") + (f" ({s.computation})" if s.computation
                                                        else "")
      rows.append((i, where, len(s.ops), fmt(s.repeat), span, s.reason))
    for sp in self.splitters:
      rows.append(("-", "splits" + (f" ({sp.computation})" if sp.computation else ""), 1,
                   fmt(sp.repeat), f"{sp.op} ({sp.what})", sp.reason))
    text = tables.render(["#", "where", "ops", "x/step", "first .. last", "why"], rows,
                         align=["right", "left", "right", "right", "left", "left"], title=title)
    return text + "\n" + SOURCES[self.source] + (f"; {self.reason}" if self.reason else "")

  def render(self) -> str:
    """The report as text (:meth:`table`)."""
    return self.table()

  def __str__(self) -> str:
    return self.render()


# --------------------------------------------------------------------------------------------
# The conversion pass, replayed on the schedule
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Plan:
  segments: list[GraphSegment]
  splitters: list[Splitter]
  # every run the pass forms, in every computation it visits: (computation, ops, captured)
  runs: list[tuple[str, tuple[hlo.Instruction, ...], bool]]


def _flat_ops(module: hlo.Module, comp_name: str, depth: int = 0):
  """The computation's ops in schedule order, ``call`` ops replaced by what they call (XLA:CPU
  wraps small loops in calls; on GPU the optimised module has none)."""
  comp = module.computations.get(comp_name)
  for op in comp.instructions if comp else ():
    if op.opcode == "call" and op.called and depth < _MAX_DEPTH:
      for called in op.called:
        yield from _flat_ops(module, called, depth + 1)
    elif op.opcode not in _NOOPS:
      yield op


def _while_parts(op: hlo.Instruction) -> tuple[str, str]:
  """(body, condition) of a while: both readers list the body first, as XLA numbers them."""
  body = op.called[0] if op.called else ""
  cond = op.called[1] if len(op.called) > 1 else ""
  return body, cond


def _op_by_op(op: hlo.Instruction, module: hlo.Module, trips: Mapping[str, int], comp: str,
              repeat: int | None, why: str, plan: _Plan, depth: int = 0) -> None:
  """A thunk launched by itself; a loop launched so runs its body op by op every iteration."""
  if op.opcode == "while" and depth <= _MAX_DEPTH:
    trip = trips.get(op.name)
    body, cond = _while_parts(op)
    # With a known trip count XLA's WhileThunk runs only the body; otherwise the condition too.
    for called in (body,) if trip else (body, cond):
      for i in _flat_ops(module, called):
        _op_by_op(i, module, trips, called, _mul(repeat, trip), why, plan, depth + 1)
    return
  plan.segments.append(GraphSegment((op.name,), False, why, comp, repeat))


def _convert(comp_name: str, module: hlo.Module, policy: gp.CudaGraphPolicy,
             trips: Mapping[str, int], repeat: int | None, plan: _Plan, depth: int = 0) -> None:
  """XLA's CommandBufferConversionPass over one computation (recursing into host-driven loops)."""
  where = "" if comp_name == module.entry else comp_name
  # With graphs off, group by what any policy could record, so only real splitters are listed.
  rules = policy.commands if policy.enabled else gp.ALL_COMMANDS
  run: list[hlo.Instruction] = []

  def flush():
    if not run:
      return
    captured = policy.enabled and len(run) >= policy.min_graph_size
    plan.runs.append((comp_name, tuple(run), captured))
    if captured:
      plan.segments.append(GraphSegment(tuple(o.name for o in run), True,
                                        "predicted graph", where, repeat))
    else:
      why = ("graphs are off" if not policy.enabled else
             f"run of {len(run)} < min_graph_size={policy.min_graph_size}")
      for o in run:
        _op_by_op(o, module, trips, where, repeat, why, plan)
    run.clear()

  for op in _flat_ops(module, comp_name):
    status, why = classify(op, module, rules)
    if status == "command" and policy.enabled:
      run.append(op)
      continue
    if status == "command":      # graphs off: every thunk by itself
      flush()
      run.append(op)
      flush()
      continue
    flush()
    if op.opcode == "while" and depth < _MAX_DEPTH:
      trip = trips.get(op.name)
      plan.splitters.append(Splitter(op.name, "while", why + (
          f"; the host runs its {trip} iterations" if trip else
          "; the host runs it, reading the condition back every iteration"), where, repeat, 0))
      body, cond = _while_parts(op)
      _convert(body, module, policy, trips, _mul(repeat, trip), plan, depth + 1)
      if not trip:       # the condition, launched op by op every iteration
        for i in _flat_ops(module, cond):
          plan.segments.append(GraphSegment((i.name,), False, "loop condition", cond, None))
      continue
    launches = 0 if op.opcode in ("conditional", "call") or "callback" in why else 1
    plan.splitters.append(Splitter(op.name, op.custom_call_target or op.opcode, why, where,
                                   repeat, launches))
  flush()


def plan(module: hlo.Module, policy: gp.CudaGraphPolicy,
         trips: Mapping[str, int] | None = None) -> _Plan:
  """What the conversion pass would form for the whole step under ``policy``."""
  out = _Plan([], [], [])
  _convert(module.entry, module, policy, trips or {}, 1, out)
  return out


def report_from_module(module: hlo.Module, policy: gp.CudaGraphPolicy, platform: str,
                       trips: Mapping[str, int] | None = None, reason: str = "") -> GraphReport:
  """Builds a GraphReport from a compiled module read by :mod:`dtenjax._src.hlo` (pure)."""
  entry = module.computations.get(module.entry)
  ops = entry.instructions if entry else ()
  outlined = {name for name in module.computations if name.startswith("command_buffer")}
  if outlined:
    segments: list[GraphSegment] = []
    splitters: list[Splitter] = []
    for op in ops:
      called = [c for c in op.called if c in outlined]
      if op.opcode == "call" and called:
        inner = [o.name for c in called for o in module.computations[c].instructions
                 if o.opcode not in _NOOPS]
        segments.append(GraphSegment(tuple(inner), True, "outlined by XLA"))
        continue
      status, why = classify(op, module, policy.commands)
      if status == "split":
        splitters.append(Splitter(op.name, op.custom_call_target or op.opcode, why))
      elif status == "command":
        segments.append(GraphSegment((op.name,), False,
                                     f"left out of graphs by XLA (min_graph_size="
                                     f"{policy.min_graph_size} or scheduling)"))
    return GraphReport(platform, platform == "gpu", "observed", policy, tuple(segments),
                       tuple(splitters), reason)
  p = plan(module, policy, trips)
  return GraphReport(platform, platform == "gpu", "predicted", policy, tuple(p.segments),
                     tuple(p.splitters), reason)


def report_from_hlo(text: str, policy: gp.CudaGraphPolicy, platform: str,
                    reason: str = "") -> GraphReport:
  """:func:`report_from_module` of printed HLO text (trip counts read from the same text)."""
  module = hlo.parse_text(text)
  return report_from_module(module, policy, platform, module.trip_counts(), reason)


# --------------------------------------------------------------------------------------------
# cuda_graphs="auto"
# --------------------------------------------------------------------------------------------

def _device_loops(module: hlo.Module) -> list[hlo.Instruction]:
  """Loops XLA could run on the device if WHILE were enabled, in the computations the pass
  visits under XLA's defaults (the entry and the bodies of host-driven loops)."""
  with_while = gp.CudaGraphPolicy.xla_default_plus("probe", ("WHILE",))
  found, seen = [], set()

  def visit(comp_name: str, depth: int):
    if comp_name in seen or depth > _MAX_DEPTH:
      return
    seen.add(comp_name)
    for op in _flat_ops(module, comp_name):
      if op.opcode != "while":
        continue
      if classify(op, module, with_while.commands)[0] == "command":
        found.append(op)
      else:
        visit(_while_parts(op)[0], depth + 1)

  visit(module.entry, 0)
  return found


def _one_launch_per_iteration(loop: hlo.Instruction, module: hlo.Module,
                              policy: gp.CudaGraphPolicy, trips: Mapping[str, int]) -> bool:
  """Whether the host launches ``loop``'s body as a single graph per iteration under ``policy``
  (trip count known, so no condition is read back): then running the loop on the device saves
  one graph launch per iteration and nothing else."""
  if not trips.get(loop.name):
    return False
  body = _Plan([], [], [])
  _convert(_while_parts(loop)[0], module, policy, trips, 1, body, 1)
  graphs = sum(1 for s in body.segments if s.captured)
  one_by_one = sum(1 for s in body.segments if not s.captured)
  launched = sum(sp.launches for sp in body.splitters)
  return graphs == 1 and one_by_one == 0 and launched == 0


def decide_auto_without_loops() -> tuple[gp.CudaGraphPolicy, str]:
  """auto's choice for a step with no loop it could run on the device."""
  return gp.CudaGraphPolicy.from_mode("auto"), (
      "no loop XLA could replay on the device: XLA's defaults, nothing passed (the jax.jit "
      "executable)")


def decide_auto(module: hlo.Module, trips: Mapping[str, int] | None = None
                ) -> tuple[gp.CudaGraphPolicy, str]:
  """``cuda_graphs="auto"``'s choice for a compiled module: (policy, reason).

  XLA's defaults, not explicit (the jax.jit executable), unless the step holds a loop whose body
  XLA can record and enabling WHILE changes nothing but the runs holding such loops; then XLA's
  defaults + WHILE, with min_graph_size lowered only as far as those runs need and only if no
  other run changes status.
  """
  default = gp.CudaGraphPolicy.from_mode("auto")
  trips = trips or {}
  found = _device_loops(module)
  loops = [op for op in found if not _one_launch_per_iteration(op, module, default, trips)]
  if found and not loops:
    names = ", ".join(f"{op.name} ({trips[op.name]} iterations)" for op in found)
    return default, (f"loop(s) {names} already run as one graph per iteration under XLA's "
                     "defaults (known trip count): WHILE would only save one host launch per "
                     "iteration, measured no win (docs/benchmarks.md): XLA's defaults, nothing "
                     "passed (the jax.jit executable)")
  if not loops:
    return decide_auto_without_loops()
  names = {op.name for op in loops}
  probe = gp.CudaGraphPolicy.xla_default_plus("auto", ("WHILE",))
  runs = plan(module, probe, trips).runs
  loop_runs = [ops for _, ops, _ in runs if any(o.name in names for o in ops)]
  need = min(len(ops) for ops in loop_runs) if loop_runs else gp.XLA_DEFAULT_MIN_GRAPH_SIZE
  size = min(gp.XLA_DEFAULT_MIN_GRAPH_SIZE, need)
  others = [ops for _, ops, _ in runs if not any(o.name in names for o in ops)
            and size <= len(ops) < gp.XLA_DEFAULT_MIN_GRAPH_SIZE]
  loop_desc = ", ".join(f"{op.name} ({trips[op.name]} iterations)" if op.name in trips
                        else op.name for op in loops)
  if others:
    return default, (f"loop(s) {loop_desc} could run on the device, but the graph size they "
                     f"need ({size}) would also capture {len(others)} other short run(s) that "
                     "XLA's defaults launch op by op, a change auto cannot show to be a win: "
                     "XLA's defaults, nothing passed (cuda_graphs='measure' times both)")
  chosen = gp.CudaGraphPolicy.xla_default_plus("auto", ("WHILE",), size)
  return chosen, (f"loop(s) {loop_desc} have bodies XLA can record: WHILE runs them on the "
                  "device (no host launch per iteration)" +
                  (f", min_graph_size={size} so their run becomes a graph, no other run "
                   "changes" if size < gp.XLA_DEFAULT_MIN_GRAPH_SIZE else
                   "; every other op is launched as under XLA's defaults"))
