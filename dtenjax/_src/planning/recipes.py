"""The standard recipes a user writes without a planner (DP, FSDP, TP, FSDP x TP): their meshes
and their layouts on a priced problem, priced by the same model as the plan."""

from __future__ import annotations

import math

from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.roles import AXES
from dtenjax._src.planning.solver import Problem


RECIPES = ("DP", "FSDP", "TP", "FSDP x TP")


def recipe_choice(prob: Problem, graph: stepgraph.StepGraph, recipe: str) -> list[int]:
  """The standard recipe's layout per group on ``prob``'s mesh (replicated where it cannot
  apply): Megatron pairs for TP (a pair's source column-, its destination row-parallel), the
  largest divisible dimension over 'fsdp' for FSDP."""
  megatron = _megatron(graph) if recipe in ("TP", "FSDP x TP") else {}
  out = []
  for gi, g in enumerate(prob.groups):
    want_tp = None
    if g[0] in megatron:
      available = {pr.tp for pr in prob.prices[gi] if pr.tp}
      want_tp = megatron[g[0]] if megatron[g[0]] in available else None
    want_fsdp = recipe in ("FSDP", "FSDP x TP")
    best = 0
    for ci, lay in enumerate(prob.cands[gi]):
      pr = prob.prices[gi][ci]
      has_f = "fsdp" in lay.used()
      if pr.tp == want_tp and has_f == want_fsdp:
        best = ci
        break
      if pr.tp == want_tp and not has_f:
        best = ci
    out.append(best)
  return out


def _megatron(graph: stepgraph.StepGraph) -> dict[int, tuple[str, int]]:
  """Megatron's assignment along the column -> row pairs: a weight that only feeds pairs is
  column-parallel, its partners row-parallel; a weight both fed and feeding (the output kernel of
  one pair, the input of the next) is row-parallel, since its output is reduced anyway; the
  chain restarts column-parallel after a row."""
  as_dst = {}
  for p in graph.pairs:
    as_dst.setdefault(p.dst, p.dst_dim)
  out: dict[int, tuple[str, int]] = {}
  for p in graph.pairs:
    if p.src not in as_dst:
      out.setdefault(p.src, ("col", p.src_dim))
  changed = True
  while changed:
    changed = False
    for p in graph.pairs:
      if out.get(p.src, ("",))[0] == "col" and p.dst not in out:
        out[p.dst] = ("row", p.dst_dim)
        changed = True
      elif out.get(p.src, ("",))[0] == "row" and p.dst not in out and p.dst not in as_dst:
        pass
      elif p.src not in out and out.get(next((q.src for q in graph.pairs if q.dst == p.src),
                                             None), ("",))[0] == "row":
        out[p.src] = ("col", p.src_dim)
        changed = True
  return out


def recipe_shape(recipe: str, n: int, island: int) -> tuple[int, ...]:
  """DP over every device; FSDP over every device; TP over the fast island with data parallel
  across islands; FSDP x TP: TP over (at most half of) the island, FSDP over the rest."""
  t = math.gcd(island, n)
  t2 = t if n // t > 1 else max(1, t // 2)
  sizes = {"DP": {"data": n}, "FSDP": {"fsdp": n}, "TP": {"data": n // t, "tensor": t},
           "FSDP x TP": {"fsdp": n // t2, "tensor": t2}}[recipe]
  return tuple(sizes.get(a, 1) for a in AXES)
