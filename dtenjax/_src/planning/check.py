"""A plan's prediction against what XLA compiles for it: per-device memory (``memory_analysis()``,
donation honoured) and collective bytes per kind, a loop body's collectives counted once per
iteration (:meth:`StepPlan.check`). It compiles the function ``plan.jit`` returns."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from dtenjax._src import errors
from dtenjax._src import tables
from dtenjax._src.planning import stepgraph

# a collective kind moving less than this share of a step's compiled bytes, predicted and
# compiled, is not a miss of Check.misses
NEGLIGIBLE = 0.01


@dataclasses.dataclass(frozen=True)
class Check:
  """A plan's prediction next to what XLA compiled for it (:meth:`StepPlan.check`)."""
  predicted_memory: dict[str, float]     # arguments, outputs, temp, total
  compiled_memory: dict[str, float]
  predicted_bytes: dict[str, float]      # collective kind -> bytes per participant
  compiled_bytes: dict[str, float]
  # collective kind -> how many of it the compiled step runs (an async pair or a combined tuple
  # once, a loop body's once per iteration, one branch of a conditional): each pays its latency
  # beyond its bytes, which a plan of many small collectives (tensor-parallel convolutions whose
  # neighbours XLA splits too) pays more often than its bytes say
  compiled_counts: dict[str, int] = dataclasses.field(default_factory=dict)

  @staticmethod
  def _err(pred: float, got: float) -> float:
    return abs(pred - got) / got if got else (0.0 if not pred else math.inf)

  @property
  def memory_error(self) -> float:
    return self._err(self.predicted_memory["total"], self.compiled_memory["total"])

  @property
  def kind_errors(self) -> dict[str, float]:
    """Per collective kind (all_reduce, all_gather, reduce_scatter, all_to_all, ppermute, ...):
    the relative error of the predicted bytes per step."""
    return {k: self._err(self.predicted_bytes.get(k, 0.0), self.compiled_bytes.get(k, 0.0))
            for k in sorted(set(self.predicted_bytes) | set(self.compiled_bytes))
            if self.predicted_bytes.get(k) or self.compiled_bytes.get(k)}

  @property
  def bytes_error(self) -> float:
    """The largest error of any collective kind, relative to the step's total compiled bytes
    (a kind of a few bytes missed does not count as 100 %)."""
    total = sum(self.compiled_bytes.values())
    worst = 0.0
    for k in set(self.predicted_bytes) | set(self.compiled_bytes):
      miss = abs(self.predicted_bytes.get(k, 0.0) - self.compiled_bytes.get(k, 0.0))
      worst = max(worst, miss / total if total else (math.inf if miss else 0.0))
    return worst

  def misses(self, tolerance: float = 0.10) -> dict[str, float]:
    """What the prediction misses by more than ``tolerance``: "memory" (per device) and each
    collective kind (its bytes per step), with the error; empty when all are within. A kind
    whose predicted and compiled bytes both stay under :data:`NEGLIGIBLE` of the step's compiled
    bytes does not count (the tokens an embedding's backward permutes beside megabytes of
    gradients)."""
    if tolerance < 0:
      raise errors.ConfigurationError(
          f"Check.misses: tolerance={tolerance!r} is negative; give a fraction such as 0.10")
    floor = NEGLIGIBLE * sum(self.compiled_bytes.values())
    out = {"memory": self.memory_error} if self.memory_error > tolerance else {}
    for k, e in self.kind_errors.items():
      big = max(self.predicted_bytes.get(k, 0.0), self.compiled_bytes.get(k, 0.0)) > floor
      if e > tolerance and big:
        out[k] = e
    return out

  def worst_kind(self) -> tuple[str, float] | None:
    """The collective kind with the largest relative error, and the error (None: no
    collectives)."""
    errs = self.kind_errors
    return max(errs.items(), key=lambda kv: kv[1]) if errs else None

  def table(self) -> str:
    mib = 2**20
    rows = []
    for k in ("arguments", "outputs", "temp", "total"):
      p, g = self.predicted_memory.get(k, 0), self.compiled_memory.get(k, 0)
      rows.append((f"memory {k}", f"{p / mib:.2f}", f"{g / mib:.2f}", "MiB",
                   f"{self._err(p, g):.1%}" if k == "total" else ""))
    for k, e in self.kind_errors.items():
      rows.append((f"{k} bytes", f"{self.predicted_bytes.get(k, 0) / mib:.2f}",
                   f"{self.compiled_bytes.get(k, 0) / mib:.2f}", "MiB", f"{e:.1%}"))
    return tables.render(("", "predicted", "compiled", "unit", "error"), rows,
                         align=("left", "right", "right", "left", "right")) + (
        f"\nmemory off by {self.memory_error:.1%}, collective bytes by {self.bytes_error:.1%} "
        "(the largest miss of one kind, of all compiled bytes)")

  def __str__(self) -> str:
    return self.table()


def compare(plan_: Any, step: Callable, args, compiler_options: dict | None = None) -> Check:
  """``plan_`` (a StepPlan) compiled as its ``jit`` runs it (with ``compiler_options``), against
  its prediction."""
  from dtenjax._src.planning import explain as explain_lib
  abstract = stepgraph.abstract(args)
  compiled = plan_.jit(step).lower(*abstract).compile(compiler_options)   # donates as planned
  stats = compiled.memory_analysis()
  got = {"arguments": float(stats.argument_size_in_bytes),
         "outputs": float(stats.output_size_in_bytes - stats.alias_size_in_bytes),
         "temp": float(stats.temp_size_in_bytes)}
  got["total"] = sum(got.values())
  exp = explain_lib.explain(compiled)
  repeats = loop_repeats(compiled)
  runs = branch_runs(compiled, [(c.computation, c.nbytes * repeats(c.computation))
                                for c in exp.collectives])
  compiled_bytes: dict[str, float] = {}
  compiled_counts: dict[str, int] = {}
  for c in exp.collectives:      # per step: a collective in a loop body runs once per iteration
    n = repeats(c.computation) * runs(c.computation)
    compiled_bytes[c.kind] = compiled_bytes.get(c.kind, 0.0) + c.nbytes * n
    if n:
      compiled_counts[c.kind] = compiled_counts.get(c.kind, 0) + n
  predicted_bytes: dict[str, float] = {}
  for k, v in plan_.cost.collective_bytes.items():
    kind = k.split("[")[0]
    predicted_bytes[kind] = predicted_bytes.get(kind, 0.0) + v
  mem = plan_.cost.memory
  pred = {"arguments": mem["params"] + mem["opt_state"] + mem["batch"],
          "outputs": mem.get("outputs", 0.0),
          "temp": mem["grads"] + mem["activations"] + mem.get("gathered", 0.0)}
  pred["total"] = sum(pred.values())
  return Check(pred, got, predicted_bytes, compiled_bytes, compiled_counts)


def loop_repeats(compiled) -> Callable[[str], int]:
  """computation name -> how often it runs per step: the product of the known trip counts of the
  while loops around it (1 outside loops, or where XLA knows no trip count)."""
  from dtenjax._src import hlo
  module = hlo.read_compiled(compiled)
  trips = module.trip_counts()
  callers = module.callers()
  memo: dict[str, int] = {}

  def repeats(comp: str, depth: int = 0) -> int:
    if comp in memo:
      return memo[comp]
    out = 1
    calls = callers.get(comp, [])
    if calls and depth < 64:
      ins = calls[0]
      out = repeats(ins.computation, depth + 1)
      if ins.opcode == "while":
        out *= trips.get(ins.name, 1)
    memo[comp] = out
    return out
  return repeats


def branch_runs(compiled, collectives) -> Callable[[str], int]:
  """computation name (of ``collectives``: (computation, bytes per step) pairs) -> 1 where it
  runs in a step, 0 inside a ``conditional``'s branch other than its branch of most collective
  bytes. A step runs one branch of each conditional; summing every branch's collectives
  counted both heads of a ``lax.cond`` where one runs (the plan prices one branch:
  ``jaxpr_reader.priced_branch``, the one whose products read the most weight bytes: XLA
  reduces each weight's gradient inside the branch that reads it)."""
  from dtenjax._src import hlo
  callers = hlo.read_compiled(compiled).callers()

  def path(comp: str) -> tuple[tuple[str, str], ...]:
    out, depth = [], 0
    while callers.get(comp) and depth < 64:
      ins = callers[comp][0]
      if ins.opcode == "conditional":
        out.append((ins.name, comp))
      comp, depth = ins.computation, depth + 1
    return tuple(out)
  paths = {comp: path(comp) for comp, _ in collectives}
  weight: dict[tuple[str, str], float] = {}
  for comp, nbytes in collectives:
    for branch in paths[comp]:
      weight[branch] = weight.get(branch, 0.0) + nbytes
  largest: dict[str, tuple[float, str]] = {}
  for (cond, comp), nbytes in sorted(weight.items()):
    if nbytes > largest.get(cond, (-1.0, ""))[0]:
      largest[cond] = (nbytes, comp)
  return lambda comp: int(all(largest[cond][1] == branch for cond, branch in paths[comp]))
