"""The whole-step planner's entry point: one layout for every array of a training step, a mesh for
it, and the memory it needs (``dtenjax.plan``; ``Placement("auto")`` with ``step=``).

The parts, one module each:

* :mod:`~dtenjax._src.planning.stepgraph` reads the step's jaxpr: the weights with the role of
  each dimension (contracted, free, stacked), scan layers and rematerialised reads, lookups,
  the tensor-parallel pairs, the optimizer state tied to each parameter, flops and activations;
* :mod:`~dtenjax._src.planning.roles` is the registry of mesh axis roles (``data``, ``stage``,
  ``fsdp``, ``tensor``; outermost first), each with its shard options, axis sizes and
  collectives; ``stage`` splits a scanned stack of layers into pipeline stages across hosts and
  chooses their schedule and micro-batches (:attr:`StepPlan.pipeline`);
* :mod:`~dtenjax._src.planning.candidates` proposes meshes (HSDP included) and layouts;
* :mod:`~dtenjax._src.planning.pricing` prices a layout: collectives per kind for the backend the
  plan is for, with the loop structure (a scanned FSDP stack gathered per layer, twice per step),
  compute, and memory as XLA compiles the step;
* :mod:`~dtenjax._src.planning.solver` solves one mixed-integer program per mesh (scipy's
  ``milp``) under the memory budget, with no axis of duplicated work;
* :mod:`~dtenjax._src.planning.recipes` lays out DP, FSDP, TP and FSDP x TP, priced alike (a
  recipe that fits is a candidate, so the plan is never worse than the best one);
* :mod:`~dtenjax._src.planning.result` is the answer (:class:`StepPlan`) and its application
  (``plan.jit`` gathers FSDP weights where products read them,
  :mod:`~dtenjax._src.planning.gather`); :mod:`~dtenjax._src.planning.check` compares it with
  what XLA compiles.

A plan depends only on the arguments: the topology (with its NVLink SHARP state), the step and
its example arguments, and the options below; nothing is read from NCCL's environment.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.planning import boxes
from dtenjax._src.planning import measure as measure_lib
from dtenjax._src.planning import sequence as sequence_lib
from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.candidates import CandidateMesh
from dtenjax._src.planning.candidates import mesh_shapes
from dtenjax._src.planning.candidates import order
from dtenjax._src.planning.check import Check as Check
from dtenjax._src.planning.pricing import StepCost as StepCost
from dtenjax._src.planning.recipes import RECIPES as RECIPES
from dtenjax._src.planning.recipes import recipe_choice
from dtenjax._src.planning.recipes import recipe_shape
from dtenjax._src.planning.result import Alternative as Alternative
from dtenjax._src.planning.result import LeafPlan as LeafPlan
from dtenjax._src.planning.result import StepPlan as StepPlan
from dtenjax._src.planning.result import report
from dtenjax._src.planning.roles import AXES as AXES
from dtenjax._src.planning.roles import BATCH_AXES as BATCH_AXES
from dtenjax._src.planning.roles import sequence as sequence_role
from dtenjax._src.planning.roles import stage as stage_role
from dtenjax._src.planning.roles import tensor as tensor_role
from dtenjax._src.planning.solver import LEAN_MARGIN
from dtenjax._src.planning.solver import CapSearch
from dtenjax._src.planning.solver import Problem
from dtenjax._src.planning.solver import evaluate
from dtenjax._src.planning.solver import lower_bound
from dtenjax._src.planning.solver import make_problem
from dtenjax._src.planning.solver import solve
from dtenjax._src.planning.solver import solve_lean
from dtenjax._src.planning.solver import uses_its_axes
from dtenjax._src.pricing import costmodel
from dtenjax._src.pricing import registry
from dtenjax._src.topology.model import Topology


def _budget(topology: Topology, ids: Sequence[int], memory_budget: float | None) -> float:
  if memory_budget is not None:
    if not memory_budget > 0:
      raise errors.PlacementError(f"plan: memory_budget={memory_budget!r} must be > 0 bytes "
                                  "(or None: the devices' memory minus the reserve)")
    return float(memory_budget)
  mem = [topology.device(i).memory_bytes for i in ids]
  if not all(mem):
    return 0.0
  reserve = config.get_float("DTENJAX_MEMORY_RESERVE")
  return min(mem) * (1.0 - reserve)


class _Repeated:
  """A pinned entry (a PartitionSpec or None) once per leaf of the subtree it covers; a leaf of
  the pytree it sits in (a list here would be read as the user's own list of pins)."""

  def __init__(self, spec, n: int):
    self.specs = [spec] * n


def _pinned_specs(pinned, args) -> dict[int, P]:
  """Leaf index -> the PartitionSpec the user pinned (a pytree prefix of args, None = plan)."""
  if pinned is None:
    return {}
  if not isinstance(pinned, (tuple, list)) or len(pinned) != len(args):
    raise errors.PlacementError(
        f"plan: pinned= must be a tuple with one entry per argument ({len(args)}), each None "
        "(plan it) or a pytree prefix of that argument holding PartitionSpecs or None")
  is_spec = lambda s: isinstance(s, P) or s is None
  out: dict[int, P] = {}
  offset = 0
  for argnum, (tree, arg) in enumerate(zip(pinned, args)):
    n = len(jax.tree.leaves(arg))
    if tree is not None:
      try:
        per_leaf = jax.tree.map(lambda s, sub: _Repeated(s, len(jax.tree.leaves(sub))), tree,
                                arg, is_leaf=is_spec)
      except ValueError as e:
        raise errors.PlacementError(
            f"plan: pinned[{argnum}] is not a pytree prefix of argument {argnum} ({e}); give "
            "PartitionSpecs (or None) in the argument's own structure") from None
      flat = [s for r in jax.tree.leaves(per_leaf) for s in r.specs]
      leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
      for k, s in enumerate(flat):
        if s is not None:
          _check_pin(s, argnum, *leaves[k])
          out[offset + k] = s
    offset += n
  return out


def _check_pin(spec, argnum: int, path, leaf) -> None:
  """``spec`` a PartitionSpec that ``jax.jit`` can lay ``leaf`` out with on a planner mesh: the
  planner's axes, each once, on dimensions the leaf has (else the error naming the leaf)."""
  where = f"plan: pinned[{argnum}] at {jax.tree_util.keystr(path) or '(root)'}"
  if not isinstance(spec, P):
    raise errors.PlacementError(
        f"{where} is {spec!r} ({type(spec).__name__}); pin a leaf with a "
        "jax.sharding.PartitionSpec (P('fsdp', 'tensor')), or None to plan it")
  names = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
  unknown = [a for a in names if a not in AXES]
  if unknown:
    raise errors.PlacementError(
        f"{where}: {spec} names axes {unknown} the planner does not have; name axes among "
        f"{AXES}")
  twice = sorted({a for a in names if names.count(a) > 1})
  if twice:
    raise errors.PlacementError(
        f"{where}: {spec} puts axes {twice} on more than one dimension; a mesh axis splits one "
        "dimension of a leaf")
  ndim = len(np.shape(leaf))
  if len(spec) > ndim:
    raise errors.PlacementError(
        f"{where}: {spec} has {len(spec)} entries for a leaf of shape {tuple(np.shape(leaf))} "
        f"({ndim} dimensions); give at most one entry per dimension")


def _undivided(pins, graph, shape) -> tuple | None:
  """The first pin (leaf index -> (spec, why)) whose axes on the mesh ``shape`` do not divide
  the dimension they split: (its path, spec, dimension, size, ways, why); None when all do."""
  size = dict(zip(AXES, shape))
  for k, (spec, why) in sorted(pins.items()):
    leaf = graph.leaves[k]
    for dim, e in enumerate(spec):
      n = math.prod(size[a] for a in (e if isinstance(e, tuple) else (e,))) if e else 1
      if dim < len(leaf.shape) and leaf.shape[dim] % n:
        return leaf.path, spec, dim, leaf.shape[dim], n, why
  return None


def _ungrouped(pins, graph, shape) -> tuple | None:
  """The first pin (leaf index -> (spec, why)) that splits over 'tensor' on the mesh ``shape`` a
  grouped convolution's kernel whose groups 'tensor' does not divide, or any weight row-parallel
  in a step with such a grouped convolution (roles.tensor.ungrouped: XLA's SPMD partitioner
  aborts the process on such a layout):
  (its path, spec, 'tensor' size, the groups, why); None when there is none."""
  t = dict(zip(AXES, shape))["tensor"]
  if t < 2 or not graph.conv_groups:
    return None
  for k, (spec, why) in sorted(pins.items()):
    use = graph.weights.get(k)
    for dim, e in enumerate(spec):
      if use is not None and e is not None and "tensor" in (e if isinstance(e, tuple) else (e,)):
        groups = tensor_role.ungrouped(use, t, graph.conv_groups, dim)
        if groups:
          return graph.leaves[k].path, spec, t, groups, why
  return None


def _box_pins(args, rules) -> dict[int, P]:
  """Leaf index -> the PartitionSpec flax partitioning metadata gives a boxed leaf (linen's
  ``nn.with_logical_partitioning`` / ``nn.with_partitioning``, nnx's ``out_sharding``), mapped
  to the planner's axes by ``rules`` as Placement(rules=...) maps them."""
  names_mesh = jax.sharding.AbstractMesh((1,) * len(AXES), AXES)
  out: dict[int, P] = {}
  offset = 0
  for argnum, arg in enumerate(args):
    for node in jax.tree.leaves(arg, is_leaf=boxes.is_box):
      if boxes.is_box(node):
        out[offset] = boxes.box_spec(node, names_mesh, rules,
                                     f"plan: argument {argnum}'s boxed leaf")
      offset += len(jax.tree.leaves(node))
  return out


def plan(step: Callable, *args, mesh: Mesh | dict[str, int] | None = None,
         topology: Topology | None = None, memory_budget: float | None = None,
         batch_argnums: int | Sequence[int] | None = None, pinned: Sequence[Any] | None = None,
         rules: Sequence[tuple[str, Any]] | None = None, overlap: float | None = None,
         donate: bool = False, recipe: str | None = None,
         measure: bool | int = False) -> StepPlan:
  """Plans the layout of every argument of a training step, and the mesh.

  Args:
    step: the step function, e.g. ``step(params, opt_state, batch) -> (params, opt_state,
      loss)``; it is traced, never run.
    *args: example arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees (``jax.eval_shape`` of
      the init gives them without allocating).
    mesh: None to let the planner propose the mesh; a dict ``{"data": 2, "fsdp": 4}`` of axis
      sizes (axes among ``data``, ``stage``, ``fsdp``, ``sequence``, ``expert``, ``tensor``) to
      plan on that shape; or a ``jax.sharding.Mesh`` whose axes are named among those. A
      ``stage`` axis of more than one device runs the step's scanned stack of layers as a
      pipeline (``plan.pipeline``: write the step with :func:`dtenjax.pipeline`); proposed meshes
      try stages of whole hosts. A ``sequence`` axis shards the batch's sequence dimension
      (context parallelism; the step must have a self-attention over it, whose length the axis
      divides).
    topology: the hardware (default: ``Topology.current()``; a fixture plans for a machine you
      are not on).
    memory_budget: bytes per device; default the smallest device memory less
      ``DTENJAX_MEMORY_RESERVE`` (none when the memory is unknown, as on CPU).
    batch_argnums: the arguments that hold the batch (sharded over ``data`` and ``fsdp`` on
      dimension 0); default the last argument.
    pinned: one entry per argument: None (plan it) or a pytree prefix of PartitionSpecs (None
      leaves are planned) that the plan keeps as they are and plans the rest around.
    rules: flax logical axis rules (``(("embed", "fsdp"), ("mlp", "tensor"), ...)``) for
      leaves boxed with flax partitioning metadata: those leaves are pinned to the layout their
      names give (the box's own rules, these, or flax's rules context), the rest is planned.
    overlap: share of the compute time that can hide gradient and FSDP traffic (0..1); default
      the backend's (``BackendCosts.overlap``: 0 on CPU, whose collectives are copies by the
      cores that compute; 0.5 on GPU).
    recipe: one of :data:`RECIPES` ("DP", "FSDP", "TP", "FSDP x TP") to get that standard
      layout priced and laid out instead of the planner's choice: on its standard mesh, or on
      ``mesh`` when one is given (FSDP x TP as ``{"fsdp": 4, "tensor": 2}``, or FSDP on
      ``{"data": 2, "fsdp": 4}``: HSDP).
    donate: the step is jitted with its state donated (``donate_argnums``), so its new state
      reuses the old one's memory; default False, as ``jax.jit``: outputs count as a copy.
    measure: False (default) to choose by the cost model alone; True (or a number of timed
      rounds, default 6) to compile the model's choice, its runner-ups (the model's fastest
      where the choice is a leaner plan, and the best plan of each other mesh priced within
      ``measure.RUNNER_UP_MARGIN`` of it, at most ``measure.RUNNER_UPS``) and every layout a user writes that may fit (``measure.may_fit``;
      ``measure.user_layouts``: DP, FSDP, TP, FSDP x TP at every split of a fast island, HSDP;
      the recipes on ``mesh`` when one is given), run each on the devices planned for (on
      random arrays when ``args`` are abstract) in shuffled rounds, and keep the fastest whose
      compiled memory fits the budget, or, of those within the timing's noise of it, the
      model's choice, else the one of least memory (``measure.choose``): the objective is then
      the measured step. Costs one compilation and a few steps per candidate; the plan's
      ``measured`` field and report give every candidate's time and compiled memory.

  The plan is the fastest layout the model prices that fits the budget, or, where one priced
  within 5 % of it (and no slower than any recipe or pipeline plan that fits) saves a larger
  share of memory than the share of time it adds, the one of least memory of those (the
  report's ``lean:`` note names both).

  Raises PlacementError when no layout fits the budget, naming the smallest shortfall."""
  t0 = time.perf_counter()
  batch_argnums = _checked_options(step, args, overlap, memory_budget, batch_argnums, measure,
                                   donate, topology, rules, recipe)
  pins = {**{k: (v, "pinned by its flax partitioning names") for k, v in
             _box_pins(args, rules).items()},
          **{k: (v, "pinned by you") for k, v in _pinned_specs(pinned, args).items()}}
  graph = _read_step(step, args, batch_argnums)
  stack = graph.stack()
  topology, ids, shapes, fixed_mesh = _resolve_mesh(mesh, topology, graph,
                                                    stack[0] if stack else 0)
  if fixed_mesh is not None:
    sequence_lib.check_mesh(graph.sequence, fixed_mesh[AXES.index("sequence")])
  if recipe is not None and fixed_mesh is None:
    island = min((len(i) for i in topology.fast_islands()), default=1)
    shapes = [recipe_shape(recipe, len(ids), island)]
  # a pinned leaf is laid out as pinned: only on meshes whose axes divide its dimensions
  fitting = [sh for sh in shapes if _undivided(pins, graph, sh) is None]
  if not fitting and shapes:
    path, spec, dim, size, n, how = _undivided(pins, graph, shapes[0])
    raise errors.PlacementError(
        f"plan: leaf {path} is {how} {spec}, which splits its dimension {dim} ({size}) {n} ways "
        f"on mesh {dict(zip(AXES, shapes[0]))}"
        f"{'' if fixed_mesh is not None else ' and every mesh tried'}, and {n} does not divide "
        f"{size}; pin it over axes whose sizes divide it, or give a mesh whose do")
  shapes = fitting
  # nor a convolution kernel over a 'tensor' that does not divide a grouped convolution's groups
  fitting = [sh for sh in shapes if _ungrouped(pins, graph, sh) is None]
  if not fitting and shapes:
    path, spec, t, groups, how = _ungrouped(pins, graph, shapes[0])
    ok = [d for d in range(1, t) if all(g % d == 0 for g in groups)]
    raise errors.PlacementError(
        f"plan: leaf {path} is {how} {spec}, split over 'tensor' ({t} devices on mesh "
        f"{dict(zip(AXES, shapes[0]))}{'' if fixed_mesh is not None else ' and every mesh tried'}"
        f") as a grouped convolution's kernel or row-parallel in a step with a grouped "
        f"convolution of {', '.join(map(str, groups))} groups, which {t} does not divide: XLA's "
        "SPMD partitioner aborts the process on it (convolution_handler.cc: a shard of the "
        "grouped layer's features holding part of a group). Pin the leaf without 'tensor' "
        "(FSDP's 'fsdp' is gathered before the product; a column-parallel split of another "
        "weight compiles), or give a mesh whose 'tensor' size divides the groups "
        f"({', '.join(map(str, ok))})")
  shapes = fitting
  budget = _budget(topology, ids, memory_budget)
  if overlap is None:
    overlap = costmodel.backend_costs(topology.device(ids[0]).platform).overlap
  # each distinct all-reduce priced once, as XLA's own: the planned step's are those XLA inserts
  price = registry.AllReducePrices(registry.xla_all_reduce_time)
  ordered = order(topology, ids)
  problems: list[tuple[tuple[int, int, int], Problem]] = []
  staged: list[tuple[tuple[int, ...], CandidateMesh]] = []
  pruned: list[tuple[float, CandidateMesh]] = []
  stopped: list[float] = []              # bounds of meshes with stages whose search stopped
  for shape in shapes:
    m = _with_pipeline(CandidateMesh(shape, np.asarray(ordered).reshape(shape), topology), graph,
                       budget, fixed_mesh is not None)
    if m is None:
      continue
    if m.pipeline is not None and fixed_mesh is None:
      staged.append((shape, m))           # priced after the meshes without stages (see below)
      continue
    prob = make_problem(graph, m, price, pins, overlap, donate)
    if prob is not None:
      problems.append((shape, prob))
  if not problems and not staged:
    raise errors.PlacementError(
        f"plan: no mesh of {len(ids)} devices divides the batch (batch dimension sizes "
        f"{sorted({graph.leaves[i].shape[0] for i in range(len(graph.leaves)) if graph.leaves[i].is_batch and graph.leaves[i].shape})}); "
        "make the global batch a multiple of the device count")
  best = None
  shortfall = None
  solved = []
  proposed = fixed_mesh is None

  def record(shape, prob: Problem, choice, least: Callable[[], list[int] | None],
             cost: StepCost | None = None) -> None:
    """One mesh's answer (``cost``: its evaluation, when known): the best plan so far, or (none
    fits) the least memory it needs."""
    nonlocal best, shortfall
    if choice is None:
      least_choice = least()
      if least_choice is None:     # no layout uses this mesh without duplicated work
        return
      floor = evaluate(prob, least_choice, graph, 0.0).memory["total"]
      if shortfall is None or floor < shortfall[0]:
        shortfall = (floor, shape)
      return
    cost = cost or evaluate(prob, choice, graph, budget)
    solved.append((shape, prob, choice, cost))
    key = (round(cost.total_s, 12), cost.memory["total"])
    if best is None or key < best[0]:
      best = (key, shape, prob, choice, cost)

  def least_of(prob: Problem):
    return lambda: solve(prob, graph, 0.0, objective="memory", proposed=proposed)

  if recipe is None:
    # the meshes without stages, searched best-first (solver.CapSearch): a program at a time of
    # the mesh whose bound is least, until every bound left exceeds the fastest plan found
    searches = [CapSearch(prob, graph, budget, proposed) for _, prob in problems]
    queue = [(s.bound, k) for k, s in enumerate(searches)]
    heapq.heapify(queue)
    top = math.inf                       # the fastest plan found (seconds)
    # measure=True also times the best plan of each mesh priced near the choice: search those
    stretch = 1 + measure_lib.RUNNER_UP_MARGIN if measure else 1.0
    while queue:
      k = heapq.heappop(queue)[1]
      search = searches[k]
      if search.beyond(top * stretch):
        break                            # this mesh and every one left cannot be chosen
      search.advance()
      if not search.done:
        heapq.heappush(queue, (search.bound, k))
      elif search.choice is not None:
        top = min(top, search.cost().total_s)
    for (shape, prob), search in zip(problems, searches):  # in the meshes' order (ties)
      if search.done:
        record(shape, prob, search.choice, lambda search=search: search.least, search.cost())

  def to_solve():
    """The meshes without stages (for a recipe) whose bound (solver.lower_bound) does not exceed
    the best plan so far, then those with stages whose pipeline alone (the stack's compute and
    the sends, a lower bound of their step) beats it. A mesh left out could not have been chosen:
    its plan would cost more than one already found (by more than the choice's rounding)."""
    for shape, prob in list(problems) if recipe is not None else ():
      if best is not None and lower_bound(prob) > best[0][0] + 1e-9:
        continue
      yield shape, prob
    for shape, m in sorted(staged, key=lambda x: stage_role.lower_bound(x[1].pipeline)):
      bound = stage_role.lower_bound(m.pipeline)
      if best is not None and bound >= best[0][0]:
        pruned.append((bound, m))
        continue
      prob = make_problem(graph, m, price, pins, overlap, donate)
      if prob is not None:
        problems.append((shape, prob))
        yield shape, prob

  for shape, prob in to_solve():
    if recipe is not None:
      record(shape, prob, recipe_choice(prob, graph, recipe), least_of(prob))
      continue
    # a mesh with stages whose search would end slower than the plan so far and than every mesh
    # with stages solved can be neither chosen nor the report's best with stages (_stage_notes)
    search = CapSearch(prob, graph, budget, proposed)
    staged_top = min((c.total_s for _, p, _, c in solved if p.m.pipeline is not None),
                     default=math.inf)
    if search.run(max(best[0][0] if best is not None else math.inf, staged_top)):
      record(shape, prob, search.choice, lambda search=search: search.least, search.cost())
    else:
      stopped.append(search.bound)       # its plan would be at least this slow
  island = min((len(i) for i in topology.fast_islands()), default=1)
  recipes = []
  candidates = []                        # the recipes that may be the plan
  unbudgeted = []                        # the recipes that could be it without the budget
  by_shape = {shape: prob for shape, prob in problems}
  for name in RECIPES:
    shape = recipe_shape(name, len(ids), island)
    if fixed_mesh is not None and shape not in by_shape:
      continue
    prob = by_shape.get(shape)
    if prob is None:
      m = CandidateMesh(shape, np.asarray(ordered).reshape(shape), topology)
      prob = make_problem(graph, m, price, pins, overlap, donate)
    if prob is None:
      recipes.append(Alternative(name, dict(zip(AXES, shape)), None,
                                 "the batch does not divide this mesh"))
      continue
    rchoice = recipe_choice(prob, graph, name)
    cost = evaluate(prob, rchoice, graph, budget)
    recipes.append(Alternative(name, dict(zip(AXES, shape)), cost))
    # a recipe that fits is a candidate of the program; this keeps the promise "never worse
    # than the best recipe that fits" exact where the solver's tolerances round
    key = (round(cost.total_s, 12), cost.memory["total"])
    if recipe is None and (fixed_mesh is not None or uses_its_axes(prob, rchoice, graph)):
      unbudgeted.append(cost)
      if cost.fits:
        candidates.append((shape, prob, rchoice, cost))
        if best is None or key < best[0]:
          best = (key, shape, prob, rchoice, cost)
  lean_notes: tuple[str, ...] = ()
  if recipe is None and best is not None:
    # the plan is the leanest priced near the fastest (solver.LEAN_MARGIN), the fastest
    # without the budget, so that a budget the plan fits does not change it; each mesh that may
    # hold one (its search's bound within the ceiling) is solved once more for it
    free = min([c for s in searches if (c := s.fastest_cost()) is not None] + unbudgeted +
               [best[4]], key=lambda c: c.total_s)
    staged_bounds = [b for b, _ in pruned] + stopped
    ceiling = min([max(best[4].total_s, free.total_s * (1 + LEAN_MARGIN))] +
                  [c.total_s for *_, c in candidates] + staged_bounds +
                  [c.total_s for _, p, _, c in solved if p.m.pipeline is not None and c.fits])
    leaner = [(shape, prob, choice, c) for (shape, prob), search in zip(problems, searches)
              if search.bound <= ceiling
              for choice in [solve_lean(prob, graph, ceiling, proposed)]
              if choice is not None
              for c in [evaluate(prob, choice, graph, budget)]]
    plain = [s for s in solved if s[1].m.pipeline is None]   # stages change how the step is written
    best, lean_notes = _leanest(best, free, leaner + plain + candidates, ceiling)
  if best is None and shortfall is None:
    # a batch whose dimension 0 splits over fewer devices than there are: the rest would be a
    # 'tensor' axis, refused, and a mesh of data parallelism alone would not split it either
    rows = min((lf.shape[0] for lf in graph.leaves if lf.is_batch and lf.shape), default=0)
    split = math.gcd(rows, len(ids)) if rows else len(ids)
    if split < len(ids):
      leaf = next(lf.path for lf in graph.leaves if lf.is_batch and lf.shape and
                  lf.shape[0] == rows)
      raise errors.PlacementError(
          f"plan: the batch's dimension 0 ({rows}, leaf {leaf}) splits over at most {split} of "
          f"the {len(ids)} devices, and no axis that leaves the batch whole ('tensor') shards "
          "enough of this step's weights to use the others: their devices would compute the same "
          f"step on the same data. Use a batch whose dimension 0 is a multiple of {len(ids)}, or "
          f"plan on a mesh you give (mesh={{'data': {split}, 'tensor': {len(ids) // split}}})")
    raise errors.PlacementError(
        f"plan: every mesh of {len(ids)} devices tried "
        f"({[dict(zip(AXES, s)) for s, _ in problems]}) has an axis that does not split the "
        "batch ('tensor', or 'stage' over a stack with too little of the step's work) over which "
        "too little of this step's weights can be sharded: its devices would compute the same "
        "step on the same data. Give a mesh without it (mesh={'data': "
        f"{len(ids)}}}) or let the planner choose (mesh=None)")
  if best is None:
    gib = 2**30
    floor, shape = shortfall
    raise errors.PlacementError(
        f"plan: no layout of this step fits {budget / gib:.4g} GiB per device on "
        f"{len(ids)} devices of {topology.name!r}: the smallest needs {floor / gib:.4g} GiB "
        f"(mesh {dict(zip(AXES, shape))}), {(floor - budget) / gib:.4g} GiB short. Use more "
        "devices, a smaller batch per step, jax.checkpoint (remat) on the layers, or pipeline "
        "stages (dtenjax.pipeline; the planner tries them across hosts for a step whose layers "
        "are a lax.scan over stacked weights, or give mesh={'stage': k, ...})")
  _, shape, prob, choice, cost = best
  recipes += _stage_alternatives(solved, prob)
  chosen = report(graph, prob, choice, cost, tuple(recipes), budget, topology,
                  time.perf_counter() - t0, len(problems), args, donate)
  chosen = dataclasses.replace(chosen, notes=chosen.notes + _stage_notes(graph, topology, ids,
                                                                         solved, prob, cost,
                                                                         pruned)
                               + sequence_role.notes(graph, prob.m, cost) + lean_notes)
  if not measure or recipe is not None:
    return chosen
  if chosen.pipeline is not None:
    return dataclasses.replace(chosen, notes=chosen.notes + (
        "measure: not timed: plan.jit cannot run a pipeline plan (write the step with "
        "dtenjax.pipeline); the cost model chose it",))
  others = [(c.total_s, (p, ch, c)) for _, p, ch, c in solved     # with the fastest priced
            if c.fits and p.m.pipeline is None and (p is not prob or list(ch) != list(choice))]
  near = measure_lib.runner_ups(others, cost.total_s)
  seconds = time.perf_counter() - t0
  runner_ups = [report(graph, p, ch, c, chosen.recipes, budget, topology, seconds,
                       len(problems), args, donate) for p, ch, c in near]
  return _measured(chosen, runner_ups, step, args, 6 if measure is True else int(measure),
                   dict(mesh=mesh, topology=topology, memory_budget=memory_budget,
                        batch_argnums=batch_argnums, pinned=pinned, rules=rules,
                        overlap=overlap, donate=donate))


def _leanest(best, free: StepCost, pool, ceiling: float) -> tuple[tuple, tuple[str, ...]]:
  """The plan of least memory of ``pool`` (``(shape, prob, choice, cost)``) that fits, is
  priced at most ``ceiling`` seconds, needs less memory than ``best`` (the fastest that fits,
  as ``plan``'s ``best``) and saves a larger share of the memory of ``free`` (the fastest
  without the budget) than the share of its time it adds, the faster of equals; else ``best``.
  With the report's note when it is not ``best``."""
  _, shape0, _, _, fast = best
  t0, m0 = free.total_s, free.memory["total"]
  # a slower plan must save a larger share of the memory than the share of time it costs
  pool = [p for p in pool if p[3].fits and p[3].total_s <= ceiling and
          p[3].memory["total"] < fast.memory["total"] and
          (m0 - p[3].memory["total"]) * t0 > (p[3].total_s - t0) * m0]
  if not pool:
    return best, ()
  shape, prob, choice, cost = min(pool, key=lambda p: (p[3].memory["total"], p[3].total_s))
  mib, name = 2**20, lambda sh: measure_lib.mesh_name(dict(zip(AXES, sh)))
  note = (f"lean: {name(shape)} needs {cost.memory['total'] / mib:.1f} MiB per device at "
          f"{cost.total_s * 1e3:.3f} ms, against {fast.memory['total'] / mib:.1f} MiB at "
          f"{fast.total_s * 1e3:.3f} ms for the fastest priced that fits ({name(shape0)}): of "
          f"the plans priced within {LEAN_MARGIN:.0%} of the fastest and no slower than any "
          "recipe or pipeline plan that fits, those that save a larger share of memory than of "
          "time they add, the plan is the one of least memory")
  return ((round(cost.total_s, 12), cost.memory["total"]), shape, prob, choice, cost), (note,)


def _measured(chosen: StepPlan, runner_ups: Sequence[StepPlan], step: Callable, args,
              rounds: int, kwargs) -> StepPlan:
  """The candidate kept on the devices (see ``measure`` of :func:`plan` and
  ``measure.choose``) among ``chosen``, the layouts a user writes and the first
  ``measure.RUNNER_UPS`` of the model's ``runner_ups`` (cheapest first) whose layout is none of
  theirs, with every candidate's measured time and compiled memory."""
  choice = "model's choice"
  candidates = {choice: chosen}
  n = len(chosen.device_ids)
  if kwargs["mesh"] is None:
    island = min((len(i) for i in kwargs["topology"].fast_islands()), default=1)
    layouts = measure_lib.user_layouts(n, island)
  else:
    layouts = [(name, None) for name in RECIPES]
  for name, mesh in layouts:
    try:
      alt = plan(step, *args, recipe=name, **{**kwargs, "mesh": mesh or kwargs["mesh"]})
    except errors.PlacementError:
      continue                      # the batch does not divide its mesh, or it does not fit
    if measure_lib.may_fit(alt.cost, chosen.budget_bytes) and not any(
        measure_lib.same_layout(alt, c) for c in candidates.values()):
      candidates[measure_lib.layout_name(name, mesh)] = alt
  added = 0
  for p in runner_ups:                # a plan on another mesh may be a candidate's layout
    if added < measure_lib.RUNNER_UPS and not any(measure_lib.same_layout(p, c)
                                                  for c in candidates.values()):
      shape = dict(zip(p.axis_names, p.mesh_shape))
      candidates[f"model's runner-up ({measure_lib.mesh_name(shape)})"] = p
      added += 1
  t0 = time.perf_counter()
  samples, memory, compile_s = measure_lib.time_plans(step, candidates, args, rounds=rounds)
  kept, records = measure_lib.choose(samples, memory, chosen.budget_bytes,
                                       prior=choice)
  out = candidates[kept]
  note = measure_lib.summary(records, kept, compile_s, time.perf_counter() - t0)
  return dataclasses.replace(out, measured=records, notes=out.notes + (note,))


def _read_step(step, args, batch_argnums) -> stepgraph.StepGraph:
  """``stepgraph.read_step``, a step that branches in Python on a traced value refused with the
  fix that fits it."""
  try:
    return stepgraph.read_step(step, args, batch_argnums)
  except errors.PlacementError as e:
    if not isinstance(e.__cause__, jax.errors.ConcretizationTypeError):
      raise
    # a flag or a size is a scalar among the example arguments; without one the step branches
    # on a value it computes (its loss), which jax.jit cannot trace either
    if any(np.ndim(leaf) == 0 for leaf in jax.tree.leaves(args)):
      fix = ("The step branches in Python on an argument, which plan traces as an array: bind "
             "such a value (a train flag, a size) before planning, plan(functools.partial(step, "
             "train=True), ...), and jit the same partial; or, where it branches on a value "
             "computed from its arrays, write the branch with jax.lax.cond or jnp.where")
    else:
      fix = ("The step branches in Python on a value computed from its arrays (JAX names them "
             "above), which neither plan nor jax.jit can trace: write the branch with "
             "jax.lax.cond or jnp.where (jnp.where(bad, p, new_p) to skip an update)")
    raise errors.PlacementError(f"{e}\n{fix}") from e.__cause__


def _checked_options(step, args, overlap, memory_budget, batch_argnums, measure, donate,
                     topology, rules, recipe) -> tuple[int, ...]:
  """:func:`plan`'s arguments checked, each wrong one named with its fix: the batch's argument
  positions (``batch_argnums`` as given, None for the last argument)."""
  if not callable(step):
    raise errors.PlacementError(f"plan: step={step!r} is not callable; pass the training step "
                                "function and its example arguments")
  if not args:
    raise errors.PlacementError("plan: give the step's example arguments, e.g. "
                                "plan(step, params, opt_state, batch)")
  if overlap is not None and (not _is_real(overlap) or not 0.0 <= overlap <= 1.0):
    raise errors.PlacementError(f"plan: overlap={overlap!r} must be a number in [0, 1]")
  if memory_budget is not None and (not _is_real(memory_budget) or not memory_budget > 0):
    raise errors.PlacementError(
        f"plan: memory_budget={memory_budget!r} must be a number of bytes > 0 (e.g. 16 * 2**30), "
        "or None: the devices' memory less the reserve")
  if batch_argnums is None:
    batch_argnums = (len(args) - 1,)
  elif _is_int(batch_argnums):
    batch_argnums = (batch_argnums,)
  if not isinstance(batch_argnums, (tuple, list)) or not all(_is_int(b) for b in batch_argnums):
    raise errors.PlacementError(
        f"plan: batch_argnums={batch_argnums!r} must be an int or a tuple of ints, the positions "
        f"of the arguments that hold the batch (0..{len(args) - 1}), e.g. batch_argnums=2")
  batch_argnums = tuple(int(b) for b in batch_argnums)
  bad = [b for b in batch_argnums if not 0 <= b < len(args)]
  if bad:
    raise errors.PlacementError(f"plan: batch_argnums {bad} are not argument positions "
                                f"(0..{len(args) - 1})")
  if not isinstance(measure, (bool, np.bool_)) and (not _is_int(measure) or measure == 1 or
                                                    measure < 0):
    raise errors.PlacementError(
        f"plan: measure={measure!r} must be True, False or a whole number of timed rounds, at "
        "least 2 (measure=6)")
  if not isinstance(donate, (bool, np.bool_)):
    raise errors.PlacementError(
        f"plan: donate={donate!r} must be True (the step's state is donated: "
        "jax.jit(..., donate_argnums=...)) or False")
  if topology is not None and not isinstance(topology, Topology):
    hint = (f"topology=dtenjax.Topology.fixture({topology!r})" if isinstance(topology, str)
            else "dtenjax.Topology.fixture(name) or Topology.detect()")
    raise errors.PlacementError(
        f"plan: topology={topology!r} is a {type(topology).__name__}, not a dtenjax.Topology; "
        f"give one: {hint} (the names: dtenjax.Topology.fixtures())")
  if rules is not None and (isinstance(rules, str) or not isinstance(rules, Sequence) or not all(
      isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) for r in rules)):
    raise errors.PlacementError(
        f"plan: rules={rules!r} must be flax logical axis rules: a sequence of (name, mesh axis) "
        "pairs, e.g. (('embed', 'fsdp'), ('mlp', 'tensor'))")
  if recipe is not None and recipe not in RECIPES:
    raise errors.PlacementError(f"plan: recipe={recipe!r} is not one of {RECIPES}")
  return batch_argnums


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
  return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool) and (
      math.isfinite(x))


def _with_pipeline(m: CandidateMesh, graph, budget: float, fixed: bool) -> CandidateMesh | None:
  """``m`` with its pipeline (roles.stage.choose) when it has a 'stage' axis; None when it cannot
  run one (a mesh the user gave then gets an error saying why)."""
  if m.size.get("stage", 1) <= 1:
    return m
  pipe = stage_role.choose(graph, m, budget)
  if pipe is not None:
    return dataclasses.replace(m, pipeline=pipe)
  if not fixed:
    return None
  stack = graph.stack()
  why = ("the step has no lax.scan over stacked layers (dtenjax.pipeline splits such a stack)"
         if stack is None else
         f"its scanned stack has {stack[0]} layers, which do not split into {m.size['stage']} "
         f"equal stages (stage counts that divide: "
         f"{[k for k in range(1, stack[0] + 1) if stack[0] % k == 0]})" if stack[0] % m.size["stage"]
         else "its batch has fewer rows per pipeline than one per micro-batch")
  raise errors.PlacementError(
      f"plan: mesh {dict(m.size)} has a 'stage' axis of {m.size['stage']}, but {why}; give a mesh "
      "without 'stage' (or stage 1), or write the step's layers as a lax.scan over stacked "
      "weights")


def _stage_alternatives(solved, prob: Problem) -> list[Alternative]:
  """The best plan on the other side of the stage question (with stages when the chosen has
  none, without when it has them), for the report."""
  staged = prob.m.pipeline is not None
  other = [(s, p, c) for s, p, _, c in solved if (p.m.pipeline is not None) != staged]
  if not other:
    return []
  shape, p, cost = min(other, key=lambda x: (round(x[2].total_s, 12), x[2].memory["total"]))
  if staged:
    return [Alternative("no stages", dict(zip(AXES, shape)), cost,
                        "the best plan without a pipeline")]
  pipe = p.m.pipeline
  return [Alternative("pipeline", dict(zip(AXES, shape)), cost,
                      f"{pipe.microbatches} micro-batches, {pipe.schedule!r}, bubble "
                      f"{pipe.chosen.cost.bubble:.3f}")]


def _stage_notes(graph, topology: Topology, ids, solved, prob: Problem,
                 cost: StepCost, pruned=()) -> tuple[str, ...]:
  """Why the plan has a pipeline or not, with the numbers."""
  if prob.m.pipeline is not None:
    best_flat = min((c for _, p, _, c in solved if p.m.pipeline is None),
                    key=lambda c: c.total_s, default=None)
    head = "pipeline chosen: no plan without stages fits the budget and splits the batch"
    if best_flat is not None:
      head = "pipeline chosen"
      head += (f": {prob.m.pipeline.stages} stages price the step at "
               f"{cost.total_s * 1e3:.3f} ms "
               f"against {best_flat.total_s * 1e3:.3f} ms for the best plan without stages "
               f"(whose exposed communication is {best_flat.exposed_s * 1e3:.3f} ms)")
    return (head,) + tuple(stage_role.summary(prob.m.pipeline))
  staged = [(p, c) for _, p, _, c in solved if p.m.pipeline is not None]
  if staged:
    p, c = min(staged, key=lambda x: x[1].total_s)
    return (f"no pipeline: the best with stages ({p.m.pipeline.stages} stages, "
            f"{p.m.pipeline.microbatches} micro-batches, {p.m.pipeline.schedule!r}, bubble "
            f"{p.m.pipeline.chosen.cost.bubble:.3f}, sends {p.m.pipeline.chosen.send_s * 1e3:.3f}"
            f" ms) prices the step at {c.total_s * 1e3:.3f} ms, slower than the plan's",)
  if pruned:
    bound, m = min(pruned, key=lambda x: x[0])
    pipe = m.pipeline
    return (f"no pipeline: the best with stages ({pipe.stages} stages, {pipe.microbatches} "
            f"micro-batches, {pipe.schedule!r}, bubble {pipe.chosen.cost.bubble:.3f}) needs at "
            f"least {bound * 1e3:.3f} ms for its stack's compute and sends alone, slower than "
            f"the plan's {cost.total_s * 1e3:.3f} ms",)
  stack = graph.stack()
  hosts = len([h for h in topology.hosts() if any(i in set(ids) for i in h)])
  if stack is None:
    why = "the step has no lax.scan over stacked layers to split into stages"
  elif hosts <= 1:
    why = "all devices are on one host (stages are tried across hosts only)"
  else:
    why = (f"no stage count of at most {stage_role.MAX_STAGES} divides both the {stack[0]} "
           f"layers and the {hosts} hosts, or no such mesh fits or splits the batch")
  return (f"no pipeline: {why}",)


def _resolve_mesh(mesh, topology, graph=None, layers: int = 0):
  if isinstance(mesh, Mesh):
    names = tuple(mesh.axis_names)
    unknown = [n for n in names if n not in AXES]
    if unknown:
      raise errors.PlacementError(
          f"plan: mesh axes {unknown} are not planner axes; name the axes among {AXES} "
          "(e.g. jax.make_mesh((2, 4), ('data', 'tensor'))) or pass mesh=None to let the "
          "planner propose one")
    if topology is None:
      topology = Topology.detect(list(mesh.devices.flat))
    sizes = dict(mesh.shape)
    shape = tuple(sizes.get(a, 1) for a in AXES)
    ids = [int(d.id) for d in mesh.devices.flat]
    return topology, ids, [shape], shape
  if topology is None:
    topology = Topology.current()
  ids = list(topology.device_ids)
  if isinstance(mesh, dict):
    unknown = [k for k in mesh if k not in AXES]
    bad = {k: v for k, v in mesh.items()
           if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1}
    if bad:
      raise errors.PlacementError(
          f"plan: mesh={mesh!r}: sizes {bad} are not positive ints; give each axis a whole "
          f"number of devices, e.g. {{'data': 2, 'fsdp': {max(1, len(ids) // 2)}}}")
    if unknown or math.prod(mesh.values()) != len(ids):
      raise errors.PlacementError(
          f"plan: mesh={mesh!r} must map axes among {AXES} to sizes whose product is the "
          f"topology's device count ({len(ids)})")
    shape = tuple(int(mesh.get(a, 1)) for a in AXES)
    return topology, ids, [shape], shape
  if mesh is not None:
    raise errors.PlacementError(f"plan: mesh={mesh!r} must be None, a dict of axis sizes or a "
                                "jax.sharding.Mesh")
  return topology, ids, mesh_shapes(len(ids), topology, ids, graph, layers), None
