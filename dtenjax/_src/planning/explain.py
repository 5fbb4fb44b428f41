"""``dtenjax.explain``: which collectives a step runs, what each costs, and its memory.

The step is compiled (``jax.jit(fn).lower(*args).compile()``) and XLA's optimised HLO is read back:
every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute (and their async
``-start`` forms), and every dtenjax custom call, becomes a row with its kind, participating device
groups, dtype, bytes and the time the topology's alpha-beta model predicts for it. The compiled
memory statistics come from ``compiled.memory_analysis()``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtenjax._src.planning import costmodel
from dtenjax._src.topology.model import Topology

_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "ppermute",
}
_OP_RE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|custom-call)"
    r"(?P<start>-start)?\(")
_ARRAY_RE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
             "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
  kind: str                     # all_reduce, all_gather, ... or "custom:<target>"
  name: str                     # HLO instruction name
  dtype: str
  shape: tuple[int, ...]
  nbytes: int                   # bytes per participant (full buffer for gather/scatter)
  groups: tuple[tuple[int, ...], ...]   # device ids per group
  predicted_s: float            # alpha-beta estimate for one group
  op_name: str = ""             # the jax operation it came from


@dataclasses.dataclass(frozen=True)
class Explanation:
  collectives: tuple[CollectiveOp, ...]
  memory: dict[str, int]
  topology: str
  extra: tuple[tuple[str, str], ...] = ()

  @property
  def total_predicted_s(self) -> float:
    return sum(c.predicted_s for c in self.collectives)

  def count(self, kind: str | None = None) -> int:
    return sum(1 for c in self.collectives if kind is None or c.kind == kind)

  def table(self) -> str:
    lines = [f"{'#':>3} {'collective':<26} {'dtype':<6} {'shape':<18} {'bytes':>12} "
             f"{'groups':<24} {'predicted (us)':>14}  source"]
    for i, c in enumerate(self.collectives):
      groups = ",".join("{" + ",".join(map(str, g)) + "}" for g in c.groups[:3])
      if len(c.groups) > 3:
        groups += f",...({len(c.groups)})"
      lines.append(f"{i:>3} {c.kind:<26} {c.dtype:<6} {str(list(c.shape)):<18} {c.nbytes:>12} "
                   f"{groups[:24]:<24} {c.predicted_s * 1e6:>14.1f}  {c.op_name[-40:]}")
    if not self.collectives:
      lines.append("    (no collectives)")
    lines.append(f"total predicted communication: {self.total_predicted_s * 1e6:.1f} us "
                 f"({len(self.collectives)} collectives, topology {self.topology})")
    mem = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.memory.items())
    lines.append(f"compiled memory: {mem}")
    for k, v in self.extra:
      lines.append(f"{k}: {v}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _parse_groups(text: str, n_devices: int) -> list[list[int]]:
  m = re.search(r"replica_groups=(\{\{[0-9,{} ]*\}\}|\{\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?)",
                text)
  if m is None:
    pairs = re.search(r"source_target_pairs=\{([0-9,{} ]*)\}", text)
    if pairs:
      return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    return [list(range(n_devices))]
  g = m.group(1)
  if g == "{}":
    return [list(range(n_devices))]
  if g.startswith("{{"):
    return [[int(v) for v in grp.split(",") if v.strip()] for grp in re.findall(r"\{([0-9, ]+)\}", g)]
  iota = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", g)
  out_shape = [int(v) for v in iota.group(1).split(",")]
  dims = [int(v) for v in iota.group(2).split(",")]
  ids = np.arange(int(np.prod(dims))).reshape(dims)
  if iota.group(3):
    ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
  return ids.reshape(out_shape).tolist()


def _arrays(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
  return [(dt, tuple(int(d) for d in dims.split(",") if d))
          for dt, dims in _ARRAY_RE.findall(shape_text)]


def parse_hlo(hlo: str, device_ids: Sequence[int], topology: Topology | None) -> list[CollectiveOp]:
  """Collectives and dtenjax custom calls in optimised HLO text, with model estimates."""
  ops = []
  for line in hlo.splitlines():
    m = _OP_RE.search(line)
    if not m:
      continue
    op = m.group("op")
    name = line.split("=")[0].strip().lstrip("%").replace("ROOT ", "").strip()
    arrays = _arrays(m.group("shape"))
    if op == "custom-call":
      target = re.search(r'custom_call_target="([^"]+)"', line)
      if not target or not target.group(1).startswith("dtenjax"):
        continue
      kind = "custom:" + target.group(1)
    else:
      kind = _KINDS[op]
    if m.group("start") and op in ("all-gather", "collective-permute") and len(arrays) > 1:
      arrays = arrays[1:2]          # async form: (operand, output, ...); count the output
    nbytes = sum(_ITEMSIZE.get(dt, 4) * int(np.prod(s)) for dt, s in arrays)
    groups = [[device_ids[i] if i < len(device_ids) else i for i in g]
              for g in _parse_groups(line, len(device_ids))]
    if kind == "reduce_scatter" and groups:
      nbytes *= len(groups[0])
    predicted = 0.0
    moving = [g for g in groups if len(set(g)) > 1]
    if topology is not None and not kind.startswith("custom:") and moving:
      try:
        predicted = max(costmodel.collective_time(kind, nbytes, g, topology, "xla")
                        for g in (moving if kind == "ppermute" else moving[:1]))
      except Exception:  # pylint: disable=broad-except  (ids outside the topology)
        predicted = float("nan")
    op_name = re.search(r'op_name="([^"]*)"', line)
    dt, shp = arrays[0] if arrays else ("?", ())
    ops.append(CollectiveOp(kind=kind, name=name, dtype=dt, shape=shp, nbytes=nbytes,
                            groups=tuple(tuple(g) for g in groups), predicted_s=predicted,
                            op_name=op_name.group(1) if op_name else ""))
  return ops


def _device_ids(compiled, fallback) -> list[int]:
  for sh in jax.tree.leaves(getattr(compiled, "input_shardings", ()) or ()):
    da = getattr(sh, "_device_assignment", None)
    if da:
      return [d.id for d in da]
  return [d.id for d in fallback]


def explain(fn: Callable | Any, *args, topology: Topology | None = None, **kwargs) -> Explanation:
  """Compiles ``fn(*args, **kwargs)`` and reports its collectives and memory.

  ``fn`` may be a plain function, a ``jax.jit``-wrapped one (its shardings are kept), or an
  already compiled ``jax.stages.Compiled`` (then ``args`` are ignored).
  """
  if hasattr(fn, "as_text") and hasattr(fn, "memory_analysis"):
    compiled = fn
  else:
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = jitted.lower(*args, **kwargs).compile()
  topology = topology if topology is not None else Topology.current()
  ids = _device_ids(compiled, jax.devices())
  ops = parse_hlo(compiled.as_text(), ids, topology)
  mem = {}
  stats = compiled.memory_analysis()
  if stats is not None:
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes", "generated_code_size_in_bytes"):
      mem[key.replace("_size_in_bytes", "")] = int(getattr(stats, key, 0) or 0)
  return Explanation(collectives=tuple(ops), memory=mem, topology=topology.name)
