"""``dtenjax.explain``: which collectives a step runs, what each costs, and its memory.

The step is compiled (``jax.jit(fn).lower(*args).compile()``) and its optimised module is read
back through :mod:`dtenjax._src.hlo` (XLA's structured HloModuleProto where jax exposes it, the
printed text otherwise): every all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute (synchronous, ``-start``/``-done`` pairs and ``async-start`` wrappers), and
every dtenjax custom call, becomes a row with its kind, the device groups it spans (device ids
through the executable's device assignment), the operands it carries, bytes per participant and
the time the topology's alpha-beta model predicts for it. The compiled memory statistics come
from ``compiled.memory_analysis()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src import tables
from dtenjax._src.gpu import p2p
from dtenjax._src.pricing import costmodel
from dtenjax._src.topology.model import Topology


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  kind: str                     # all_reduce, all_gather, ... or "custom:<target>"
  name: str                     # HLO instruction name (the start of an async pair)
  dtype: str                    # element type of the operands ("mixed" if they differ)
  shape: tuple[int, ...]        # the first operand's shape
  nbytes: int                   # bytes per participant (full buffer for gather/scatter)
  groups: tuple[tuple[int, ...], ...]   # device ids per group (source/target pairs for ppermute)
  predicted_s: float            # alpha-beta estimate for one group
  op_name: str = ""             # the jax operation it came from
  operand_shapes: tuple[hlo.Shape, ...] = ()
  group_form: str = ""          # how XLA encoded the groups: list, iota, mesh ("" = implied)
  done: str = ""                # the matching -done of an async pair
  computation: str = ""         # where it is scheduled (the entry, a loop body, ...)

  @property
  def num_operands(self) -> int:
    return len(self.operand_shapes)


@dataclasses.dataclass(frozen=True)
class Explanation:
  collectives: tuple[CollectiveOp, ...]
  memory: dict[str, int]
  topology: str
  extra: tuple[tuple[str, str], ...] = ()
  source: str = ""              # "proto" (XLA's structured module) or "text"

  @property
  def total_predicted_s(self) -> float:
    return sum(c.predicted_s for c in self.collectives)

  def count(self, kind: str | None = None) -> int:
    return sum(1 for c in self.collectives if kind is None or c.kind == kind)

  def table(self) -> str:
    """One row per collective of the compiled step, then the totals and the compiled memory."""
    rows = []
    for i, c in enumerate(self.collectives):
      groups = _groups_text(c.groups, pairs=c.kind == "ppermute") or (
          "-" if c.kind.startswith("custom:") else "(all)")
      if c.num_operands > 1:
        operands = f"{c.num_operands} operands, {c.dtype}"
      else:
        operands = f"{c.dtype}[{','.join(map(str, c.shape))}]"
      kind = c.kind + (" (async)" if c.done else "")
      rows.append((i, kind, operands, c.nbytes, groups, f"{c.predicted_s * 1e6:.1f}",
                   c.op_name[-40:]))
    lines = [tables.render(["#", "collective", "operands", "bytes", "groups", "predicted (us)",
                            "jax op"], rows,
                           align=["right", "left", "left", "right", "left", "right", "left"])]
    if not self.collectives:
      lines.append("  (no collectives)")
    lines.append(f"total predicted communication: {self.total_predicted_s * 1e6:.1f} us "
                 f"({len(self.collectives)} collectives, topology {self.topology}, HLO read "
                 f"from {self.source or '?'})")
    mem = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.memory.items())
    lines.append(f"compiled memory: {mem}")
    for k, v in self.extra:
      lines.append(f"{k}: {v}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _groups_text(groups, pairs: bool, width: int = 34) -> str:
  """Groups as ``{0,4},{1,5},...`` cut at a group boundary, with the count when cut."""
  if pairs:
    parts = [f"{a}->{b}" for a, b in groups]
  else:
    parts = ["{" + ",".join(map(str, g)) + "}" for g in groups]
  text = ",".join(parts)
  if len(text) <= width:
    return text
  suffix = f",...({len(parts)} {'pairs' if pairs else 'groups'})"
  kept = []
  for p in parts:
    if len(",".join(kept + [p])) + len(suffix) > width:
      break
    kept.append(p)
  return ",".join(kept) + suffix


def _predict(kind: str, nbytes: int, groups, topology: Topology | None) -> float:
  if topology is None or kind.startswith("custom:") or kind not in costmodel.KINDS:
    return 0.0
  if kind == "ppermute":
    moving = [list(p) for p in groups if p[0] != p[1]]
  else:
    moving = [list(g) for g in groups if len(set(g)) > 1]
  if not moving:
    return 0.0
  try:
    return max(costmodel.collective_time(kind, nbytes, g, topology)
               for g in (moving if kind == "ppermute" else moving[:1]))
  except Exception:  # ids outside the topology
    return float("nan")


def collective_ops(module: hlo.Module, topology: Topology | None,
                   device_assignment: Sequence[Sequence[int]] | None = None
                   ) -> list[CollectiveOp]:
  """Rows of :class:`CollectiveOp` for every collective of a read module."""
  ops = []
  for c in module.collectives():
    if c.kind.startswith("custom:"):
      groups: tuple[tuple[int, ...], ...] = ()
    else:
      groups = module.device_groups(c, device_assignment)
    first = c.operand_shapes[0].leaves()[0] if c.operand_shapes else hlo.Shape("?")
    ops.append(CollectiveOp(
        kind=c.kind, name=c.name, dtype=c.dtype, shape=first.dims, nbytes=c.nbytes,
        groups=groups, predicted_s=_predict(c.kind, c.nbytes, groups, topology),
        op_name=c.op_name, operand_shapes=c.operand_shapes, group_form=c.group_form,
        done=c.done, computation=c.computation))
  return ops


def _jax_device_assignment(compiled, module: hlo.Module) -> list[list[int]] | None:
  """[replica][partition] device ids from jax, where the module itself does not carry them."""
  if module.device_assignment:
    return None
  for sh in jax.tree.leaves(getattr(compiled, "input_shardings", ()) or ()):
    da = getattr(sh, "_device_assignment", None)
    if da and len(da) == module.num_partitions * module.num_replicas:
      ids = [d.id for d in da]
      p = module.num_partitions
      return [ids[r * p:(r + 1) * p] for r in range(module.num_replicas)]
  return None


def explain(fn: Callable | Any, *args, topology: Topology | None = None, **kwargs) -> Explanation:
  """Compiles ``fn(*args, **kwargs)`` and reports its collectives and memory.

  ``fn`` may be a plain function, a ``jax.jit``-wrapped one (its shardings are kept), or an
  already compiled ``jax.stages.Compiled`` (then ``args`` are ignored). On GPU the table ends
  with every reason the NVLink gate (``gpu/p2p.gate``) gave, while the step was traced and
  lowered here, for not running a collective on the NVLink kernels (a step jax had already
  traced is not asked again). A ``StepPlan``
  (:func:`dtenjax.plan`) is returned as it is: its ``table()`` is the plan's report.
  """
  if hasattr(fn, "leaves") and hasattr(fn, "recipes") and hasattr(fn, "table"):
    return fn
  refused: list[str] = []
  if hasattr(fn, "as_text") and hasattr(fn, "memory_analysis"):
    compiled = fn
  elif not callable(fn):
    raise errors.ConfigurationError(
        f"explain: fn={fn!r} is not a function, a jax.jit-wrapped function, a compiled "
        "jax.stages.Compiled or a StepPlan; call explain(step, *args) with the function first")
  else:
    if not hasattr(fn, "lower"):     # jax.jit(fn) below: no static arguments, arrays only
      _check_array_args(args, kwargs)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    with p2p.refusals() as refused:      # the NVLink gate's reasons, asked while tracing/lowering
      compiled = jitted.lower(*args, **kwargs).compile()
  topology = topology if topology is not None else Topology.current()
  module = hlo.read_compiled(compiled)
  ops = collective_ops(module, topology, _jax_device_assignment(compiled, module))
  mem = {}
  stats = compiled.memory_analysis()
  if stats is not None:
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes"):
      mem[key.replace("_size_in_bytes", "")] = int(getattr(stats, key, 0) or 0)
  extra = tuple(("NVLink kernels not used", why) for why in dict.fromkeys(refused))
  return Explanation(collectives=tuple(ops), memory=mem, topology=topology.name, extra=extra,
                     source=module.source)


def _check_array_args(args, kwargs) -> None:
  """Every leaf of a plain function's arguments is something ``jax.jit`` traces: an array, a
  ``jax.ShapeDtypeStruct`` or a Python number (a string or an object would otherwise end in
  JAX's TypeError from deep inside the trace)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct, bool, int,
                             float, complex)) and not hasattr(leaf, "__jax_array__"):
      raise errors.ConfigurationError(
          f"explain: argument {jax.tree_util.keystr(path[1:])} is {leaf!r} "
          f"({type(leaf).__name__}), which jax.jit cannot trace; pass arrays or "
          "jax.ShapeDtypeStruct, or explain(jax.jit(fn, static_argnums=...), *args) for static "
          "arguments")
