"""``Placement``: how an array is laid out over a mesh, and the functions that apply it.

A placement is a frozen value: a strategy (``"auto"``, ``"replicate"``, ``"row"``, ``"col"``,
``"2d"`` or a ``PartitionSpec``), a mesh (a ``Mesh`` of any axis types, a shape such as ``(2, 4)``,
or None for the context mesh; see :func:`dtenjax._src.planning.mesh.as_mesh`), a memory policy
(``"device"``, ``"pinned"`` or ``"unpinned"`` host memory) and optional logical axis rules. For a
given array shape it resolves to a ``NamedSharding``; ``"auto"`` asks the planner
(:mod:`dtenjax._src.planning.planner`), and :meth:`Placement.explain` shows why.

Flax partitioning metadata is honoured: a leaf boxed by ``nn.with_partitioning`` /
``nn.with_logical_partitioning`` (linen) or an ``nnx.Variable`` with ``out_sharding`` is laid out
by its names, mapped to mesh axes with flax's own functions (``nn.logical_to_mesh_axes`` for
logical boxes: rules in priority order, unmatched names replicated; renaming for the others) and
the rules of the box, of the placement (``rules=``) or of flax's ``nn.logical_axis_rules``
context, in that order; the box is returned around the placed value, so box and layout agree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.planning import boxes
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.planning import planner
from dtenjax._src.topology.model import Topology

STRATEGIES = ("auto", "replicate", "row", "col", "2d")
# jax's memory kinds, and the short names dtenjax also accepts for them.
MEMORY_KINDS = {"device": "device", "pinned_host": "pinned_host", "unpinned_host": "unpinned_host",
                "pinned": "pinned_host", "unpinned": "unpinned_host"}


@dataclasses.dataclass(frozen=True)
class Placement:
  """How to lay an array out over a device mesh.

  Attributes:
    strategy: "auto" (the planner decides per array), "replicate", "row", "col", "2d", or a
      ``PartitionSpec`` naming mesh axes.
    mesh: a ``jax.sharding.Mesh``, a mesh shape such as ``(2, 4)`` (axes named by
      ``axis_names``), or None for the enclosing ``use_mesh`` / all devices in 1D.
    memory_policy: a jax memory kind -- "device", "pinned_host" (page-locked host memory) or
      "unpinned_host" -- or the short "pinned" / "unpinned".
    axis_names: names for a mesh given as a shape; default ("x", "y", ...).
    workload: what the planner assumes the tensor is used for (auto only).
    topology: the topology the planner and mesh use; default ``Topology.current()``.
    rules: logical axis rules for flax-boxed leaves, ``((logical_name, mesh_axes), ...)`` as in
      flax's ``nn.logical_axis_rules``; default: the box's own, else flax's context rules.
  """
  strategy: str | P = "auto"
  mesh: Mesh | tuple[int, ...] | None = None
  memory_policy: str = "device"
  axis_names: tuple[str, ...] | None = None
  workload: planner.Workload = planner.Workload()
  topology: Topology | None = None
  rules: tuple[tuple[str, Any], ...] | None = None

  def __post_init__(self):
    problems = []
    if self.rules is not None:
      try:
        rules = tuple((name, target) for name, target in self.rules)
      except (TypeError, ValueError):
        rules = None
      if rules is None or any(not isinstance(n, str) or not _is_rule_target(t) for n, t in rules):
        problems.append(f"rules={self.rules!r} must be pairs (logical_name, mesh_axis), the mesh "
                        "axis a name, a tuple of names or None, as in flax's "
                        "nn.logical_axis_rules")
      else:
        object.__setattr__(self, "rules", rules)
    if not isinstance(self.strategy, P) and self.strategy not in STRATEGIES:
      problems.append(f"strategy={self.strategy!r} is not one of {STRATEGIES} or a "
                      "PartitionSpec")
    if self.memory_policy not in MEMORY_KINDS:
      problems.append(f"memory_policy={self.memory_policy!r} is not one of "
                      f"{tuple(MEMORY_KINDS)}")
    if self.mesh is not None and not isinstance(self.mesh, Mesh):
      try:
        shape = tuple(operator.index(s) for s in self.mesh)
      except TypeError:
        shape = None
      if shape is None or not shape or any(s < 1 for s in shape):
        problems.append(f"mesh={self.mesh!r} must be a jax.sharding.Mesh or a shape of "
                        "positive ints such as (2, 4)")
      else:
        object.__setattr__(self, "mesh", shape)
    if self.axis_names is not None:
      object.__setattr__(self, "axis_names", tuple(self.axis_names))
    if not isinstance(self.workload, planner.Workload):
      problems.append(f"workload={self.workload!r} is not a dtenjax.Workload: pass "
                      "dtenjax.Workload(...) (what the planner assumes the tensor is used for)")
    if problems:
      raise errors.PlacementError(errors.join_problems("invalid Placement:", problems))

  # --- resolution ------------------------------------------------------------------------------

  def resolved_mesh(self) -> Mesh:
    """The concrete mesh: this placement's Mesh; for a shape, the context mesh when it has that
    shape (and ``axis_names``), else a new topology-ordered mesh (an error under a
    ``jax.set_mesh`` mesh of another shape); for None the context mesh (``use_mesh``,
    ``jax.set_mesh``), else all devices in 1D. Meshes are cached."""
    if isinstance(self.mesh, Mesh):
      return self.mesh
    return mesh_lib.as_mesh(self.mesh, self.axis_names, topology=self.topology)

  def _topology(self) -> Topology:
    return self.topology if self.topology is not None else Topology.current()

  def plan(self, shape: Sequence[int], dtype=jnp.float32) -> planner.ArrayPlan:
    """The planner's decision for an array of ``shape``/``dtype`` on this placement's mesh.

    With a ``topology`` and a mesh shape covering all of its devices (a fixture, say), the plan
    is made on that topology's own devices in its order: it depends on the arguments only, not on
    the local devices or a context mesh."""
    own = self._topology_mesh()
    if own is not None:
      mesh_shape, names, ids = own
      return planner.plan_tensor(shape, dtype, mesh_shape, names, ids, self.topology,
                                 self.workload)
    return self._plan(self.resolved_mesh(), shape, dtype)

  def _topology_mesh(self):
    """(shape, axis names, device ids) of this placement's mesh laid over its own topology's
    devices, when a topology and a mesh shape of all its devices are given; else None."""
    if self.topology is None or self.mesh is None or isinstance(self.mesh, Mesh):
      return None
    mesh_shape = tuple(int(s) for s in self.mesh)
    if math.prod(mesh_shape) != self.topology.num_devices:
      return None
    names = (tuple(self.axis_names) if self.axis_names is not None else
             mesh_lib.DEFAULT_AXIS_NAMES[:len(mesh_shape)])
    ids = tuple(sorted(self.topology.device_ids, key=self.topology.hierarchy_key))
    return mesh_shape, names, ids

  def _plan(self, mesh: Mesh, shape: Sequence[int], dtype) -> planner.ArrayPlan:
    ids, topology = _planning_inputs(mesh, self._topology())
    plan = planner.plan_tensor(shape, dtype, tuple(mesh.devices.shape), tuple(mesh.axis_names),
                               ids, topology, self.workload)
    return _typed_for_explicit_axes(plan, mesh, self.workload.time_tolerance)

  def _spec(self, mesh: Mesh, shape: Sequence[int], dtype) -> P:
    if isinstance(self.strategy, P):
      spec = self.strategy
    elif self.strategy == "auto":
      spec = self._plan(mesh, shape, dtype).spec
    else:
      spec = _fixed_spec(self.strategy, len(shape), mesh)
    check_divisible(shape, spec, mesh)
    return spec

  def spec(self, shape: Sequence[int], dtype=jnp.float32) -> P:
    """The PartitionSpec this placement gives an array of ``shape``, validated."""
    shape, dtype = _shape_and_dtype(shape, dtype, "Placement.spec")
    return self._spec(self.resolved_mesh(), shape, dtype)

  def sharding(self, shape: Sequence[int], dtype=jnp.float32) -> NamedSharding:
    """The NamedSharding (with the memory kind of the policy) for an array of ``shape``."""
    shape, dtype = _shape_and_dtype(shape, dtype, "Placement.sharding")
    return _sharding_for(self, self.resolved_mesh(), shape, dtype.name)

  def explain(self, shape: Sequence[int], dtype=jnp.float32) -> str:
    """Why this placement lays out an array of ``shape`` the way it does: every candidate's
    estimated cost for "auto", the fixed spec otherwise."""
    shape, dtype = _shape_and_dtype(shape, dtype, "Placement.explain")
    own = self._topology_mesh() if self.strategy == "auto" else None
    mesh = self.resolved_mesh() if own is None else None
    sizes = dict(mesh.shape) if own is None else dict(zip(own[1], own[0]))
    head = (f"Placement(strategy={self.strategy!r}, mesh={sizes}, "
            f"memory_policy={self.memory_policy!r}) for {tuple(shape)} "
            f"{jnp.dtype(dtype).name}:")
    if self.strategy == "auto":
      return head + "\n" + (self.plan(shape, dtype) if own is not None else
                            self._plan(mesh, shape, dtype)).table()
    return head + f"\n=> {self._spec(mesh, tuple(shape), dtype)} (fixed strategy, no planning)"


def _shape_and_dtype(shape, dtype, where: str) -> tuple[tuple[int, ...], np.dtype]:
  """``shape`` as a tuple of non-negative ints and ``dtype`` as a dtype, or a PlacementError
  naming the bad one (a bare int, a string, a negative size; a name that is no dtype)."""
  try:
    dims = None if isinstance(shape, (str, bytes)) else tuple(operator.index(d) for d in shape)
  except TypeError:
    dims = None
  if dims is None or any(d < 0 for d in dims):
    raise errors.PlacementError(f"{where}: shape={shape!r} must be a sequence of non-negative "
                                "ints, such as (4096, 1024)")
  try:
    return dims, jnp.dtype(dtype)
  except TypeError:
    raise errors.PlacementError(f"{where}: dtype={dtype!r} is not a dtype; pass one such as "
                                "jnp.float32 or 'bfloat16'") from None


EXPLICIT_STRATEGIES = ("replicate", "row")   # for arrays of 2 or more dimensions
_EXPLICIT_NOTE = ("not on Explicit mesh axes: it shards the last dimension, and a matmul on "
                  "such a product raises JAX's ShardingTypeError without out_sharding")


def _typed_for_explicit_axes(plan: planner.ArrayPlan, mesh: Mesh, tolerance: float) -> planner.ArrayPlan:
  """``plan`` restricted, on a mesh with Explicit axes (``jax.make_mesh``'s default), to layouts
  that the user's unchanged ``x @ w`` chains type-check with under JAX's sharding in types.

  With Explicit axes JAX types every product: ``x @ w`` with ``w`` sharded on its first
  (contracting) dimension gathers it, but a product whose last dimension is sharded -- after a
  "col" or "2d" weight, or a bias sharded like one -- cannot meet a row-sharded weight in the
  next product (JAX asks for ``out_sharding``). So there "auto" picks among "replicate" and
  "row" for matrices (the first of the last two dimensions, stacked layers unsharded) and
  replicates vectors; the whole-step planner (``dtenjax.plan``) sees the products and may do
  more. Auto axes keep every candidate (XLA propagates shardings itself)."""
  if not any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    return plan
  allowed = EXPLICIT_STRATEGIES if len(plan.shape) >= 2 else ("replicate",)
  if plan.strategy in allowed:
    return plan
  cands = tuple(c if c.strategy in allowed or not c.feasible else
                dataclasses.replace(c, feasible=False, note=_EXPLICIT_NOTE)
                for c in plan.candidates)
  feasible = [c for c in cands if c.feasible]
  if not feasible:
    return dataclasses.replace(plan, strategy="replicate", spec=P(), candidates=cands,
                               reason="Explicit mesh axes: replicated (no typed layout fits)")
  best = min(c.time_s for c in feasible)
  close = [c for c in feasible if c.time_s <= best * (1 + tolerance) + 1e-12]
  pick = min(close, key=lambda c: (c.memory_bytes, planner.STRATEGIES.index(c.strategy)))
  return dataclasses.replace(
      plan, strategy=pick.strategy, spec=pick.spec, candidates=cands,
      reason=(f"Explicit mesh axes: {plan.strategy!r} (estimated fastest) would shard a "
              "product's last dimension, which JAX's sharding in types rejects in the next "
              f"matmul; {pick.strategy!r} is the best layout that type-checks "
              f"({pick.time_s * 1e6:.1f} us)"))


@functools.lru_cache(maxsize=256)
def _planning_inputs(mesh: Mesh, topology: Topology) -> tuple[tuple[int, ...], Topology]:
  """Device ids of ``mesh`` (row-major) and the topology describing them: ``topology`` when it
  has those ids, else the detected topology of the mesh's devices."""
  ids = tuple(int(d.id) for d in mesh.devices.flat)
  if not set(ids) <= set(topology.device_ids):
    topology = Topology.detect(list(mesh.devices.flat))
  return ids, topology


@functools.lru_cache(maxsize=16384)
def _sharding_for(placement: Placement, mesh: Mesh, shape: tuple[int, ...],
                  dtype: str) -> NamedSharding:
  # A pytree has few distinct shapes: one planning per (placement, mesh, shape, dtype).
  return _named_sharding(mesh, placement._spec(mesh, shape, dtype),
                         MEMORY_KINDS[placement.memory_policy])


@functools.lru_cache(maxsize=4096)
def _named_sharding(mesh: Mesh, spec: P, memory_kind: str) -> NamedSharding:
  return NamedSharding(mesh, spec, memory_kind=memory_kind)


def _fixed_spec(strategy: str, ndim: int, mesh: Mesh) -> P:
  """A named strategy's spec: the same one the planner costs (see planner.strategy_spec):
  "row"/"col" shard over the innermost (fastest) mesh axis and replicate over the others
  (data parallel), "2d" shards rows over the outer axes and columns over the inner one."""
  names = tuple(mesh.axis_names)
  inner = names[-1]
  outer = None if len(names) == 1 else (names[0] if len(names) == 2 else names[:-1])
  if strategy == "col" and ndim == 1:
    raise errors.PlacementError(
        "strategy='col' needs an array with at least 2 dimensions, got 1; use 'row' or "
        "'replicate' for vectors.")
  if strategy == "2d" and (ndim < 2 or outer is None):
    raise errors.PlacementError(
        f"strategy='2d' needs a 2D mesh and an array with >= 2 dimensions; got mesh axes "
        f"{names} and ndim={ndim}. Use mesh=(a, b) or strategy='row'.")
  spec = planner.strategy_spec(strategy, ndim, outer, inner)
  return P() if spec is None else spec


def check_divisible(shape: Sequence[int], spec: P, mesh: Mesh, where: str = "") -> None:
  """Raises PlacementError listing every dimension not divisible by its mesh axes."""
  where = f"{where}: " if where else ""
  problems = []
  if len(spec) > len(shape):
    raise errors.PlacementError(
        f"{where}PartitionSpec {spec} has {len(spec)} entries but the array has {len(shape)} "
        f"dimensions (shape {tuple(shape)}); drop the extra entries.")
  sizes = dict(mesh.shape)
  for dim, entry in enumerate(spec):
    if entry is None:
      continue
    axes = entry if isinstance(entry, tuple) else (entry,)
    unknown = [a for a in axes if a not in sizes]
    if unknown:
      hints = "".join(mesh_lib.suggest_axis(a, tuple(sizes)) for a in unknown)
      problems.append(f"dimension {dim} names mesh axes {unknown} that the mesh does not have "
                      f"(mesh axes: {tuple(sizes)}){hints}; check the spelling")
      continue
    k = int(np.prod([sizes[a] for a in axes]))
    if shape[dim] % k:
      up = -(-shape[dim] // k) * k
      problems.append(
          f"dimension {dim} has size {shape[dim]}, not divisible by mesh axis "
          f"{entry!r} of size {k}: pad it to {up}, leave it unsharded (None), or use a mesh "
          f"axis whose size divides {shape[dim]}")
  if problems:
    raise errors.PlacementError(errors.join_problems(
        f"{where}cannot place an array of shape {tuple(shape)} with {spec}:", problems))


def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _is_rule_target(t) -> bool:
  return t is None or isinstance(t, str) or (
      isinstance(t, tuple) and all(isinstance(a, str) for a in t))


# --- flax partitioning metadata: dtenjax/_src/planning/boxes.py -------------------------------

_flax_box_kind = boxes.box_kind
_is_box = boxes.is_box
_box_value = boxes.box_value
_rebox = boxes.rebox
_box_spec = boxes.box_spec


# --- shard ------------------------------------------------------------------------------------

def _spec_mesh(spec: P, where: str) -> Mesh:
  mesh = mesh_lib.current_mesh()
  if mesh is None:
    raise errors.PlacementError(
        f"{where}: a bare PartitionSpec {spec} needs a mesh, and none is in context: wrap the "
        "call in jax.set_mesh(mesh) or dtenjax.use_mesh(mesh), or pass "
        "NamedSharding(mesh, spec) / Placement(spec, mesh=mesh)")
  return mesh


def _constrain(leaf, sharding: NamedSharding):
  """Lays a traced value out as ``sharding``: jax.sharding.reshard on Explicit mesh axes, a
  sharding constraint on Auto ones (flax does the same)."""
  mesh = sharding.mesh
  types = dict(zip(mesh.axis_names, mesh.axis_types))
  named = mesh_lib._spec_axes(sharding.spec)
  explicit = sorted(a for a in named if types.get(a) == AxisType.Explicit)
  auto = sorted(a for a in named if types.get(a) != AxisType.Explicit)
  if explicit and auto:
    raise errors.PlacementError(
        f"{sharding.spec} names Explicit mesh axes {explicit} and Auto axes {auto} of one "
        "mesh; inside jit dtenjax.shard lays out one kind at a time: shard over the Explicit "
        "axes (jax.sharding.reshard) and the Auto ones in two calls, or make the mesh's axes "
        "one type (make_mesh(..., axis_types=...))")
  if explicit or (not named and all(t == AxisType.Explicit for t in mesh.axis_types)):
    return jax.sharding.reshard(leaf, sharding)
  return jax.lax.with_sharding_constraint(leaf, sharding)


def _place(leaf, sharding: NamedSharding):
  if _is_tracer(leaf):
    if sharding.memory_kind not in (None, "device"):
      # A bare device_put to host memory inside jit loses the partitioning (measured on CPU,
      # jax 0.10.2: the result came back replicated); lay it out on device first, then move.
      on_device = _constrain(leaf, sharding.with_memory_kind("device"))
      return jax.device_put(on_device, sharding)
    return _constrain(leaf, sharding)
  return jax.device_put(leaf, sharding)


def _leaf_sharding(value, placement, where: str) -> NamedSharding:
  shape, dtype = tuple(value.shape), value.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    # Typed PRNG keys are laid out by their key shape; their bits are uint32 words.
    dtype = jnp.uint32
  if isinstance(placement, NamedSharding):
    check_divisible(shape, placement.spec, placement.mesh, where)
    return placement
  if isinstance(placement, P):
    mesh = _spec_mesh(placement, where)
    check_divisible(shape, placement, mesh, where)
    return _named_sharding(mesh, placement, None)
  return placement.sharding(shape, dtype)


def _shard_one(leaf, placement, where: str):
  kind = _flax_box_kind(leaf)
  if kind is None:
    if not hasattr(leaf, "shape"):
      return leaf
    if isinstance(leaf, jax.Array) and not _is_tracer(leaf) and leaf.is_deleted():
      raise errors.PlacementError(
          f"{where} was deleted ({leaf.aval.str_short()}): it was donated to a jitted step "
          "(donate_argnums) or .delete()d; shard the arrays the step returned")
    return _place(leaf, _leaf_sharding(leaf, placement, where))
  value = _box_value(leaf)
  if isinstance(placement, NamedSharding):
    mesh, memory_kind = placement.mesh, placement.memory_kind
  elif isinstance(placement, P):
    mesh, memory_kind = _spec_mesh(placement, where), None
  else:
    mesh, memory_kind = placement.resolved_mesh(), MEMORY_KINDS[placement.memory_policy]
  rules = placement.rules if isinstance(placement, Placement) else None
  spec = _box_spec(leaf, mesh, rules, where)
  check_divisible(tuple(value.shape), spec, mesh, where)
  if not (isinstance(placement, Placement) and placement.strategy == "auto"):
    asked = _leaf_sharding(value, placement, where).spec
    if _norm(asked, value.ndim) != _norm(spec, value.ndim):
      raise errors.PlacementError(
          f"{where} carries flax partitioning names that lay it out as {spec}, but the "
          f"placement asks for {asked}; the box would then describe a layout the array does "
          "not have. Use Placement('auto') (it honours the names), change the names or rules, "
          "or unbox first (flax.linen.unbox(tree) / nnx.state(model) values)")
  return _rebox(leaf, _place(value, _named_sharding(mesh, spec, memory_kind)))


def _norm(spec: P, ndim: int) -> tuple:
  entries = list(spec) + [None] * (ndim - len(spec))
  return tuple((e[0] if len(e) == 1 else tuple(e)) if isinstance(e, (tuple, list)) else e
               for e in entries)


def _is_placement(p) -> bool:
  return isinstance(p, (Placement, NamedSharding, P))


def _shard_step(x: Any, placement, step, step_args) -> Any:
  """shard(x, placement, step=...): x laid out as the whole-step plan lays out its argument."""
  from dtenjax._src.planning import step as step_lib
  if isinstance(step, step_lib.StepPlan):
    plan_ = step
  else:
    if not callable(step) or step_args is None:
      raise errors.PlacementError(
          "shard(..., step=): give step=a StepPlan (from dtenjax.plan), or step=the training "
          "step function together with step_args=(its example arguments), e.g. "
          "shard(params, Placement('auto'), step=train_step, step_args=(params, opt, batch))")
    if not (isinstance(placement, Placement) and placement.strategy == "auto"):
      raise errors.PlacementError(
          f"shard(..., step=) plans the whole step, so the placement must be Placement('auto'), "
          f"got {placement!r}")
    mesh = placement.mesh if isinstance(placement.mesh, Mesh) else None
    plan_ = step_lib.plan(step, *step_args, mesh=mesh, topology=placement.topology)
  shardings = plan_.shardings()
  want = jax.tree.structure(x)
  for arg_shardings in shardings:
    if jax.tree.structure(arg_shardings, is_leaf=lambda s: isinstance(s, NamedSharding)) == want:
      return jax.tree.map(_place, x, arg_shardings)
  if isinstance(x, tuple) and len(x) == len(shardings):
    return tuple(jax.tree.map(_place, a, s) for a, s in zip(x, shardings))
  raise errors.PlacementError(
      "shard(..., step=): x has the structure of none of the planned step's arguments; pass "
      "one of the arguments the step was planned with (params, the optimizer state, a batch) "
      "or all of them as a tuple")


def shard(x: Any, placement: Placement | NamedSharding | P | Any = None, *,
          like: Any = None, step: Any = None, step_args: Sequence[Any] | None = None) -> Any:
  """Lays ``x`` (an array or a pytree of arrays, e.g. flax params or an optax state) out as
  ``placement`` says: ``device_put`` outside jit; inside jit ``jax.sharding.reshard`` on Explicit
  mesh axes and a sharding constraint on Auto ones.

  ``like=params`` instead lays ``x`` out like ``params``: every part of ``x`` with the structure
  and shapes of ``params`` (an optax state's ``mu``, ``nu``, momentum, error-feedback residuals)
  gets the parameters' shardings leaf by leaf, everything else (step counts, scalars, leaves of
  another shape) is replicated on their mesh. ``params`` holds arrays (their ``.sharding``) or
  ``NamedSharding``s; inside jit pass the shardings, computed outside
  (``jax.tree.map(lambda a: a.sharding, params)``), unless the mesh axes are Explicit.

  ``placement`` is a :class:`Placement` (each leaf planned on its own shape for "auto"), a
  ``NamedSharding``, a bare ``PartitionSpec`` (on the context mesh: ``jax.set_mesh`` or
  :func:`dtenjax.use_mesh`), or a pytree prefix of ``x`` holding those (as ``jax.device_put``
  takes). A placement tree written for the parameters also places an optimizer state: every
  part of ``x`` with the parameters' key paths (optax's ``mu`` / ``nu``, ``nnx.state(optimizer)``)
  gets it leaf by leaf, the rest is replicated. A ``jax.sharding.Mesh`` puts ``x``'s arrays on
  that mesh with the PartitionSpecs they have: arrays on two meshes (``Placement(mesh=(2, 4))``
  and ``jax.make_mesh``'s) cannot meet in one jit, ``shard(tree, mesh)`` puts them on one.
  Flax-boxed leaves (``nn.with_partitioning``, ``nn.with_logical_partitioning``,
  ``nnx.Variable`` with ``out_sharding``) are laid out by their names (see the module docstring)
  and returned in their box; a fixed strategy that disagrees with the names is an error.

  Host memory policies inside jit lay the value out on device, then move it; a jit output keeps
  ``pinned_host``, but for ``unpinned_host`` outputs jax (0.10.2, CPU) reports ``device`` unless
  the jit is given ``out_shardings=placement.sharding(shape, dtype)``.

  ``step=`` plans the whole training step instead of each leaf on its own
  (:func:`dtenjax.plan`): ``shard(params, Placement("auto"), step=train_step,
  step_args=(params, opt_state, batch))`` lays ``x`` out as the plan lays out the argument of
  that structure (or all arguments, given as a tuple); ``step=`` may also be a ``StepPlan``."""
  if step is not None:
    return _shard_step(x, placement, step, step_args)
  if (placement is None) == (like is None):
    raise errors.PlacementError(
        "shard: give exactly one of placement (how to lay x out) and like= (a tree of arrays "
        "or NamedShardings whose layout x should follow, e.g. like=params for an optax state)")
  if like is not None:
    return _shard_like(x, like)[0]
  if isinstance(placement, Mesh):
    return _onto_mesh(x, placement)
  if not _is_placement(placement):
    def sub(p, subtree):
      if p is None:
        return subtree
      if not _is_placement(p):
        raise errors.PlacementError(
            f"shard: {p!r} is not a Placement, NamedSharding or PartitionSpec; give one of "
            "those, or a pytree prefix of x holding them (None leaves that part alone)")
      return shard(subtree, p)

    try:
      return jax.tree.map(sub, placement, x, is_leaf=lambda p: _is_placement(p) or p is None)
    except ValueError as e:
      if isinstance(e, errors.DtenjaxError):
        raise
      # Not a prefix of x: an optimizer state whose parts mirror the tree the placements were
      # written for (optax's mu / nu, nnx.state(optimizer)) gets them part by part.
      out, found = _shard_like(x, placement, placements=True)
      if found:
        return out
      raise errors.PlacementError(
          f"shard: the placement tree is not a prefix of x's tree ({e}); give one placement, "
          "or a tree of them with x's outer structure") from None

  def one(path, leaf):
    return _shard_one(leaf, placement, f"leaf {jax.tree_util.keystr(path) or '(root)'}")

  return jax.tree_util.tree_map_with_path(one, x, is_leaf=_is_box)


def _onto_mesh(x, mesh: Mesh):
  """``x``'s arrays on ``mesh`` with the PartitionSpecs they have (unplaced ones replicated):
  arrays placed on two meshes (``Placement(mesh=(2, 4))`` and ``jax.make_mesh``'s, say) cannot
  meet in one jit ("Mesh for all inputs should be equal"); this puts them on one."""
  def one(path, leaf):
    value = _leaf_value(leaf)
    if not hasattr(value, "shape"):
      return leaf
    sharding = getattr(value, "sharding", None) if not _is_tracer(value) else None
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    where = f"shard(x, mesh): leaf {jax.tree_util.keystr(path) or '(root)'}"
    check_divisible(tuple(value.shape), spec, mesh, where)
    return _shard_one(leaf, _named_sharding(mesh, spec, getattr(sharding, "memory_kind", None)),
                      where)
  return jax.tree_util.tree_map_with_path(one, x, is_leaf=lambda v: _is_box(v) or
                                          _is_variable(v))


def _sharding_of(leaf, where: str) -> NamedSharding:
  if isinstance(leaf, NamedSharding):
    return leaf
  sharding = None
  if isinstance(leaf, jax.Array) and not _is_tracer(leaf):
    sharding = leaf.sharding
  elif hasattr(leaf, "shape"):
    sharding = getattr(jax.typeof(leaf), "sharding", None)     # Explicit axes inside jit
    if sharding is not None and getattr(sharding.mesh, "empty", True):
      sharding = None
  if not isinstance(sharding, NamedSharding):
    raise errors.PlacementError(
        f"shard(like=...): {where} has no NamedSharding to follow ({type(leaf).__name__}); pass "
        "arrays laid out over a mesh (e.g. from dtenjax.shard or dtenjax.tensor), or their "
        "shardings: like=jax.tree.map(lambda a: a.sharding, params)")
  return sharding


def _is_variable(x) -> bool:
  """An ``nnx.Variable`` (Param, OptState, OptVariable, ...), boxed by flax or not."""
  variablelib = sys.modules.get("flax.nnx.variablelib")
  return variablelib is not None and isinstance(x, variablelib.Variable)


def _leaf_value(v):
  if _is_box(v):
    return _box_value(v)
  return v.get_value() if _is_variable(v) else v


def _shard_like(x, like, *, placements: bool = False):
  """``x``'s parts with ``like``'s key paths (and shapes) laid out leaf by leaf like ``like``'s
  leaves, everything else replicated. Matching goes by key paths, not node types: an optax
  state's ``mu`` (dicts or ``nnx.State`` of ``OptVariable``) mirrors the parameters (dicts or
  ``nnx.State`` of ``Param``). ``placements``: ``like`` holds Placements / NamedShardings /
  PartitionSpecs (a placement tree for the parameters) instead of arrays."""
  var_leaf = lambda v: _is_box(v) or _is_variable(v)
  like_leaf = lambda v: var_leaf(v) or isinstance(v, NamedSharding) or (
      placements and _is_placement(v))
  paths_leaves = jax.tree_util.tree_flatten_with_path(like, is_leaf=like_leaf)[0]
  if not paths_leaves:
    raise errors.PlacementError("shard(like=...): like has no arrays to follow")
  keys = tuple(jax.tree_util.keystr(p) for p, _ in paths_leaves)
  if placements:
    targets = [v for _, v in paths_leaves]
    shapes = [None] * len(targets)
    first = targets[0]
    mesh = (first.mesh if isinstance(first, NamedSharding) else
            _spec_mesh(first, "shard") if isinstance(first, P) else first.resolved_mesh())
  else:
    values = [_leaf_value(v) for _, v in paths_leaves]
    targets = [_sharding_of(v, f"like leaf {jax.tree_util.keystr(p) or '(root)'}")
               for (p, _), v in zip(paths_leaves, values)]
    shapes = [None if isinstance(v, NamedSharding) else tuple(v.shape) for v in values]
    mesh = targets[0].mesh
  replicated = NamedSharding(mesh, P())

  def parts(node):
    return jax.tree_util.tree_flatten_with_path(node, is_leaf=var_leaf)[0]

  def matches(node) -> bool:
    pl = parts(node)
    if len(pl) != len(keys) or tuple(jax.tree_util.keystr(p) for p, _ in pl) != keys:
      return False
    return all(want is None or tuple(jnp.shape(_leaf_value(v))) == want
               for (_, v), want in zip(pl, shapes))

  def put(leaf, target, where):
    return _shard_one(leaf, target, where) if hasattr(_leaf_value(leaf), "shape") else leaf

  found = []

  def visit(path, node):
    where = f"leaf {jax.tree_util.keystr(path) or '(root)'}"
    if matches(node):
      found.append(path)
      leaves, treedef = jax.tree_util.tree_flatten(node, is_leaf=var_leaf)
      return jax.tree_util.tree_unflatten(
          treedef, [put(v, t, where) for v, t in zip(leaves, targets)])
    return put(node, replicated, where)

  out = jax.tree_util.tree_map_with_path(visit, x, is_leaf=lambda n: var_leaf(n) or matches(n))
  return out, bool(found)


_INITS: dict[str, Callable] = {
    "zeros": lambda key, shape, dtype: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype: jnp.ones(shape, dtype),
    "normal": lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
    "uniform": lambda key, shape, dtype: jax.random.uniform(key, shape, dtype),
}


# --- random inits generated in chunks --------------------------------------------------------
# jax.random under jax_threefry_partitionable=True gives element i of an array the bits
# threefry2x32(key, (hi(i), lo(i))) of its linear index i, and normal / uniform are elementwise
# functions of those bits. So a device can generate its shard in chunks of global indices,
# through a PRNG implementation whose key also carries the chunk's offset, and get
# jax.random's values with temporaries of one chunk instead of several shards (XLA:CPU keeps
# the counters and both threefry outputs of the whole shard: 3x the shard). Used only where a
# probe on this jax gives jax.random's bits exactly; elsewhere the plain jit runs.

_CHUNK_FRACTION = 64       # a chunk is at most 1/64 of the shard: its temporaries < 1/4 of it


def _offset_bits(key_data, bit_width: int, shape):
  """random_bits of the offset PRNG: key_data = (k1, k2, offset_hi, offset_lo); the bits
  threefry's partitionable random_bits gives the linear indices offset, offset + 1, ..."""
  from jax.extend import random as xrandom
  n = math.prod(shape)
  step = jax.lax.iota(jnp.uint32, n)
  lo = key_data[3] + step
  hi = key_data[2] + (lo < step).astype(jnp.uint32)          # the carry
  b1, b2 = xrandom.threefry2x32_p.bind(jnp.broadcast_to(key_data[0], (n,)),
                                       jnp.broadcast_to(key_data[1], (n,)), hi, lo)
  bits = b1 ^ b2
  if bit_width != 32:
    bits = jax.lax.convert_element_type(bits, {8: jnp.uint8, 16: jnp.uint16}[bit_width])
  return bits.reshape(shape)


def _legacy_bits(key_data, bit_width: int, shape):
  """random_bits of the legacy offset PRNG: key_data = (k1, k2, size, offset); the bits that
  threefry's original (``jax_threefry_partitionable=False``) random_bits gives the elements
  offset, offset + 1, ... of an array of ``size`` elements, drawn as ``words = ceil(size *
  bit_width / 32)`` 32-bit words (jax.random asks for 8-bit ones for bfloat16's uniform, so the
  width is the one asked here, not the dtype's). There, the counters 0..words-1
  (padded with one 0 to an even count 2h) are split in halves: word i < h is the first output
  of threefry2x32(key, (i, i + h)), word i >= h the second output of threefry2x32(key, (i - h,
  i)); a 16- or 8-bit element e is bits (e % per) * width.. of word e // per."""
  from jax.extend import random as xrandom
  n = math.prod(shape)
  per = 32 // bit_width
  e = key_data[3] + jax.lax.iota(jnp.uint32, n)
  w = e // jnp.uint32(per) if per > 1 else e
  size = key_data[2]
  words = size // jnp.uint32(per) + (size % jnp.uint32(per) != 0).astype(jnp.uint32)
  h = (words + words % 2) // 2
  first = w < h
  x0 = jnp.where(first, w, w - h)
  x1 = jnp.where(first, jnp.where(w + h == words, jnp.uint32(0), w + h), w)
  b0, b1 = xrandom.threefry2x32_p.bind(jnp.broadcast_to(key_data[0], (n,)),
                                       jnp.broadcast_to(key_data[1], (n,)), x0, x1)
  bits = jnp.where(first, b0, b1)
  if per > 1:
    shift = (e % jnp.uint32(per)) * jnp.uint32(bit_width)
    bits = jax.lax.convert_element_type(jnp.right_shift(bits, shift),
                                        {8: jnp.uint8, 16: jnp.uint16}[bit_width])
  return bits.reshape(shape)


def _unsupported(*_):
  raise errors.PlacementError("internal: dtenjax's offset PRNG only draws bits for tensor()")


@functools.cache
def _offset_impl():
  from jax.extend import random as xrandom
  return xrandom.define_prng_impl(key_shape=(4,), seed=_unsupported, split=_unsupported,
                                  random_bits=_offset_bits, fold_in=_unsupported,
                                  name="dtenjax_offset_threefry", tag="dto")


@functools.cache
def _legacy_impl():
  from jax.extend import random as xrandom
  return xrandom.define_prng_impl(key_shape=(4,), seed=_unsupported, split=_unsupported,
                                  random_bits=_legacy_bits, fold_in=_unsupported,
                                  name="dtenjax_legacy_offset_threefry", tag="dtl")


def _draw(init: str, key_data, offset, size: int, dtype, legacy_size: int | None = None):
  """``size`` values of ``init`` for the global linear indices ``offset ...``: with
  ``legacy_size`` (the whole array's element count) as ``jax_threefry_partitionable=False``
  draws them, else as JAX's default flag does."""
  third = jnp.uint32(0) if legacy_size is None else jnp.uint32(legacy_size)
  data = jnp.stack([key_data[0], key_data[1], third, offset.astype(jnp.uint32)])
  impl = _offset_impl() if legacy_size is None else _legacy_impl()
  key = jax.random.wrap_key_data(data, impl=impl)
  return _INITS[init](key, (size,), dtype)


@functools.cache
def _chunks_match_jax(init: str, dtype_name: str, partitionable: bool = True) -> bool:
  """Whether chunked drawing gives ``jax.random``'s bits on this jax under the flag
  ``partitionable`` (small probes: an odd and an even element count, chunks of odd sizes, and
  offsets that carry into the second word). The chunks are drawn in one jitted program, as
  :func:`_chunked_program` draws them (eagerly, each draw compiled a program of its own: 3 s of
  CPU per probe on a 2-core machine, against jax.random's own two eager draws)."""
  dtype = jnp.dtype(dtype_name)
  probes = (((6, 7), ((0, 5), (5, 30), (35, 7))), ((5, 9), ((0, 3), (3, 23), (26, 19))))

  def chunks(data):
    return [jnp.concatenate([_draw(init, data, jnp.uint32(o), n, dtype,
                                   None if partitionable else math.prod(shape))
                             for o, n in parts]) for shape, parts in probes]
  try:
    with jax.threefry_partitionable(partitionable):
      key = jax.random.key(11)
      got = jax.jit(chunks)(jax.random.key_data(key))
      for (shape, _), drawn in zip(probes, got):
        want = np.asarray(_INITS[init](key, shape, dtype))
        if np.asarray(drawn).tobytes() != want.reshape(-1).tobytes():
          return False
    return True
  except Exception:  # a jax whose PRNG internals moved
    return False


def _chunked_init(init, key, shape, dtype, sharding: NamedSharding):
  """The array of ``init(key, shape, dtype)`` generated in chunks per device, or None where
  that does not apply: not a built-in random init, a key that is not threefry's, a shard that is
  not one contiguous range of the array (only its first dimension sharded), 2**32 elements or
  more, host memory, or a probe that says this jax draws otherwise."""
  if not isinstance(init, str) or init not in ("normal", "uniform"):
    return None
  dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize > 4 or not shape:
    return None
  if math.prod(shape) >= 2 ** 32 or sharding.memory_kind not in (None, "device"):
    return None
  try:
    if "threefry" not in str(jax.random.key_impl(key)):
      return None
    key_data = jax.random.key_data(key)
  except (TypeError, ValueError):
    return None
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  if any(e is not None for e in spec[1:]) or key_data.shape != (2,):
    return None
  partitionable = bool(jax.config.jax_threefry_partitionable)
  if not _chunks_match_jax(init, dtype.name, partitionable):
    return None
  return _chunked_program(init, tuple(shape), dtype.name, sharding, partitionable)(key_data)


def _row_sharding(shape, sharding: NamedSharding) -> NamedSharding | None:
  """A sharding of ``shape``'s first dimension over as many of the mesh's devices as divide it
  (axes in mesh order), on the same mesh: a layout :func:`_chunked_init` can draw in."""
  if not shape:
    return None
  mesh = sharding.mesh
  axes, parts = [], 1
  for name, size in dict(mesh.shape).items():
    if size > 1 and shape[0] % (parts * size) == 0:
      axes.append(name)
      parts *= size
  if not axes:
    return None
  spec = P(tuple(axes) if len(axes) > 1 else axes[0])
  return NamedSharding(mesh, spec, memory_kind=sharding.memory_kind)


@functools.lru_cache(maxsize=256)
def _chunked_program(init: str, shape: tuple[int, ...], dtype_name: str,
                     sharding: NamedSharding, partitionable: bool = True):
  """The jitted chunked generator of :func:`_chunked_init` (one per init, shape, dtype,
  sharding and threefry flag): key data in, the sharded array out."""
  dtype = jnp.dtype(dtype_name)
  words = None if partitionable else math.prod(shape)   # the legacy draw's element count
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  mesh = sharding.mesh
  axes0 = () if spec[0] is None else (spec[0] if isinstance(spec[0], tuple) else (spec[0],))
  parts = math.prod(dict(mesh.shape)[a] for a in axes0)
  local = (shape[0] // parts,) + tuple(shape[1:])
  size, row = math.prod(local), math.prod(local[1:])
  # the temporaries are 32-bit (counters, threefry words): count a 16-bit chunk at 4 bytes
  target = max(1, size * dtype.itemsize // (4 * _CHUNK_FRACTION))
  # Whole rows per chunk where a row is small enough (the buffer keeps the shard's shape, so
  # XLA updates the output in place); else flat chunks of a 1-D buffer.
  rows = max(1, target // row) if row <= target else 0
  unit, count = (rows * row, local[0] // rows) if rows else (target, size // target)
  rest = size - unit * count
  buf_shape = local if rows else (size,)

  def body(kd):
    base = (jax.lax.axis_index(axes0) * size).astype(jnp.uint32) if axes0 else jnp.uint32(0)
    out = jnp.zeros(buf_shape, dtype)
    if axes0:
      out = jax.lax.pcast(out, axes0, to="varying")

    def draw(start, n):
      vals = _draw(init, kd, base + start, n, dtype, words)
      return vals.reshape((n // row,) + local[1:]) if rows else vals

    def step(i, acc):
      start = (i * unit).astype(jnp.uint32)
      at = i * rows if rows else i * unit
      return jax.lax.dynamic_update_slice_in_dim(acc, draw(start, unit), at, 0)
    out = jax.lax.fori_loop(0, count, step, out)
    if rest:
      at = count * rows if rows else count * unit
      out = jax.lax.dynamic_update_slice_in_dim(out, draw(jnp.uint32(count * unit), rest), at, 0)
    return out.reshape(local)

  mapped = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P(*spec),
                         axis_names=set(mesh.axis_names))
  return jax.jit(mapped, out_shardings=sharding)


def tensor(shape: Sequence[int], dtype=jnp.float32, placement: Placement | None = None,
           init: str | Callable = "zeros", key: jax.Array | None = None) -> jax.Array:
  """Creates an array directly in its sharded layout: each device computes only its shard (the
  initialiser runs under jit with ``out_shardings``), so the whole array never sits on one
  device.

  The values are those of ``jax.random.normal(key, shape)`` (or ``uniform``, or your ``init``)
  under the process's own ``jax_threefry_partitionable`` flag, on every layout. Memory per
  device: "normal" and "uniform" with a threefry key on a layout that shards only the first
  dimension (or none) are drawn in chunks of the shard (at most 1.25x the shard in all, e.g. 8 +
  1.6 MiB for an 8 MiB shard), under either flag. Other layouts and callables run as one jitted
  draw, whose temporaries XLA sizes (on CPU 3x the shard for jax.random's generators), except
  "normal" and "uniform" under ``jax_threefry_partitionable=False``: there a jitted draw would
  generate the whole array's bits on every device and slice them (68 MiB of temporaries per
  device for an 8 MiB shard of a 64 MiB array, measured on CPU), so they are drawn in chunks
  sharded by rows and moved to the layout (one all-to-all). "zeros" and "ones" need none.

  Args:
    shape, dtype: of the array.
    placement: default ``Placement()`` ("auto" over all devices).
    init: "zeros", "ones", "normal", "uniform" or ``f(key, shape, dtype) -> array``.
    key: PRNG key (``jax.random.key(seed)``), required by every ``init`` but "zeros" and "ones":
      a default key would give every tensor made without one the same values.
  """
  placement = placement or Placement()
  try:
    dims = tuple(operator.index(s) for s in shape)
  except TypeError:
    dims = None
  if dims is None or any(s < 0 for s in dims):
    raise errors.PlacementError(f"tensor: shape={shape!r} must be a sequence of non-negative "
                                "ints, such as (4096, 1024)")
  shape = dims
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise errors.PlacementError(f"tensor: dtype={dtype!r} is not a dtype; pass one such as "
                                "jnp.float32 or 'bfloat16'") from None
  if (isinstance(init, str) and init in ("normal", "uniform") and
      not jnp.issubdtype(dtype, jnp.floating)):
    raise errors.PlacementError(
        f"tensor(init={init!r}) draws floats, and dtype={dtype} is not a floating dtype: pass a "
        "float dtype, or init='zeros' / 'ones' / a callable f(key, shape, dtype) for integers")
  if key is None and not (isinstance(init, str) and init in ("zeros", "ones")):
    raise errors.PlacementError(
        f"tensor(init={init!r}) needs key=: pass a PRNG key, e.g. key=jax.random.key(0), and a "
        "different one for every tensor (without one they would all get the same values)")
  if key is not None and (not hasattr(key, "dtype") or not (
      jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) or np.ndim(key) >= 1)):
    raise errors.PlacementError(
        f"tensor: key={key!r} is not a PRNG key; pass jax.random.key({key!r}) (or "
        "jax.random.PRNGKey's uint32 key data)")
  if isinstance(init, str):
    if init not in _INITS:
      raise errors.PlacementError(f"init={init!r} is not one of {tuple(_INITS)} or a callable "
                                  "f(key, shape, dtype)")
    init_fn = _INITS[init]
  else:
    init_fn = init
  sharding = placement.sharding(shape, dtype)
  key = jax.random.key(0) if key is None else key   # zeros / ones ignore it
  context = jax.sharding.get_abstract_mesh()
  if not context.empty and context != sharding.mesh.abstract_mesh:
    # the placement names its own mesh and jax.set_mesh another: make the array on the
    # placement's (JAX refuses a program over one mesh inside the other's context)
    with jax.set_mesh(sharding.mesh):
      return _create(init, init_fn, key, shape, dtype, sharding)
  return _create(init, init_fn, key, shape, dtype, sharding)


def _create(init, init_fn, key, shape, dtype, sharding: NamedSharding) -> jax.Array:
  """:func:`tensor`'s array, made in ``sharding``'s layout."""
  chunked = _chunked_init(init, key, shape, dtype, sharding)
  if chunked is not None:
    return chunked
  if not jax.config.jax_threefry_partitionable and isinstance(init, str) and init in (
      "normal", "uniform"):
    # The original threefry draws the whole array's bits on every device under jit: draw in
    # rows instead (the same values) and move them to the layout asked for.
    rows = _row_sharding(shape, sharding)
    drawn = None if rows is None else _chunked_init(init, key, shape, dtype, rows)
    if drawn is not None:
      return jax.device_put(drawn, sharding)
  return jax.jit(lambda k: init_fn(k, shape, dtype), out_shardings=sharding)(key)
