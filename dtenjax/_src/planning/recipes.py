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
  srcs = {(p.src, p.src_dim) for p in graph.pairs}
  dsts = {(p.dst, p.dst_dim) for p in graph.pairs}
  out = []
  for gi, g in enumerate(prob.groups):
    want_tp = None
    if recipe in ("TP", "FSDP x TP"):
      for ci, pr in enumerate(prob.prices[gi]):
        if pr.tp and ((pr.tp[0] == "col" and (g[0], pr.tp[1]) in srcs) or
                      (pr.tp[0] == "row" and (g[0], pr.tp[1]) in dsts)):
          want_tp = pr.tp
          break
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


def recipe_shape(recipe: str, n: int, island: int) -> tuple[int, ...]:
  """DP over every device; FSDP over every device; TP over the fast island with data parallel
  across islands; FSDP x TP: TP over (at most half of) the island, FSDP over the rest."""
  t = math.gcd(island, n)
  t2 = t if n // t > 1 else max(1, t // 2)
  sizes = {"DP": {"data": n}, "FSDP": {"fsdp": n}, "TP": {"data": n // t, "tensor": t},
           "FSDP x TP": {"fsdp": n // t2, "tensor": t2}}[recipe]
  return tuple(sizes.get(a, 1) for a in AXES)
