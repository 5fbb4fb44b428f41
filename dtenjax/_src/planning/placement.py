"""``Placement``: how an array is laid out over a mesh, and the functions that apply it.

A placement is a frozen value: a strategy (``"auto"``, ``"replicate"``, ``"row"``, ``"col"``,
``"2d"`` or a ``PartitionSpec``), a mesh (a ``Mesh`` or a shape such as ``(2, 4)``, laid out by
:func:`dtenjax.make_mesh`) and a memory policy (``"device"``, ``"pinned"`` or ``"unpinned"``
host memory). For a given array shape it resolves to a ``NamedSharding``; ``"auto"`` asks the
planner (:mod:`dtenjax._src.planning.planner`), and :meth:`Placement.explain` shows why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.planning import planner
from dtenjax._src.topology.model import Topology

STRATEGIES = ("auto", "replicate", "row", "col", "2d")
MEMORY_KINDS = {"device": "device", "pinned": "pinned_host", "unpinned": "unpinned_host"}


@dataclasses.dataclass(frozen=True)
class Placement:
  """How to lay an array out over a device mesh.

  Attributes:
    strategy: "auto" (the planner decides per array), "replicate", "row", "col", "2d", or a
      ``PartitionSpec`` naming mesh axes.
    mesh: a ``jax.sharding.Mesh``, a mesh shape such as ``(2, 4)`` (axes named by
      ``axis_names``), or None for the enclosing ``use_mesh`` / all devices in 1D.
    memory_policy: "device", "pinned" (page-locked host memory) or "unpinned" host memory.
    axis_names: names for a mesh given as a shape; default ("x", "y", ...).
    workload: what the planner assumes the tensor is used for (auto only).
    topology: the topology the planner and mesh use; default ``Topology.current()``.
  """
  strategy: str | P = "auto"
  mesh: Mesh | tuple[int, ...] | None = None
  memory_policy: str = "device"
  axis_names: tuple[str, ...] | None = None
  workload: planner.Workload = planner.Workload()
  topology: Topology | None = None

  def __post_init__(self):
    problems = []
    if not isinstance(self.strategy, P) and self.strategy not in STRATEGIES:
      problems.append(f"strategy={self.strategy!r} is not one of {STRATEGIES} or a "
                      "PartitionSpec")
    if self.memory_policy not in MEMORY_KINDS:
      problems.append(f"memory_policy={self.memory_policy!r} is not one of "
                      f"{tuple(MEMORY_KINDS)}")
    if self.mesh is not None and not isinstance(self.mesh, Mesh):
      try:
        shape = tuple(int(s) for s in self.mesh)
      except TypeError:
        shape = None
      if shape is None or not shape or any(s < 1 for s in shape):
        problems.append(f"mesh={self.mesh!r} must be a jax.sharding.Mesh or a shape of "
                        "positive ints such as (2, 4)")
      else:
        object.__setattr__(self, "mesh", shape)
    if self.axis_names is not None:
      object.__setattr__(self, "axis_names", tuple(self.axis_names))
    if problems:
      raise errors.PlacementError(errors.join_problems("invalid Placement:", problems))

  # --- resolution ------------------------------------------------------------------------------

  def resolved_mesh(self) -> Mesh:
    """The concrete mesh: this placement's Mesh, a topology-ordered mesh of its shape, or the
    enclosing ``use_mesh`` / all devices in 1D (``mesh=None``). Meshes are cached."""
    if isinstance(self.mesh, Mesh):
      return self.mesh
    if self.mesh is None:
      return mesh_lib.as_mesh(None)
    names = self.axis_names or ("x", "y", "z", "w")[:len(self.mesh)]
    return mesh_lib.make_mesh(self.mesh, names, topology=self._topology())

  def _topology(self) -> Topology:
    return self.topology if self.topology is not None else Topology.current()

  def plan(self, shape: Sequence[int], dtype=jnp.float32) -> planner.Plan:
    """The planner's decision for an array of ``shape``/``dtype`` on this placement's mesh."""
    return self._plan(self.resolved_mesh(), shape, dtype)

  def _plan(self, mesh: Mesh, shape: Sequence[int], dtype) -> planner.Plan:
    ids, topology = _planning_inputs(mesh, self._topology())
    return planner.plan_tensor(shape, dtype, tuple(mesh.devices.shape), tuple(mesh.axis_names),
                               ids, topology, self.workload)

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
    return self._spec(self.resolved_mesh(), tuple(shape), dtype)

  def sharding(self, shape: Sequence[int], dtype=jnp.float32) -> NamedSharding:
    """The NamedSharding (with the memory kind of the policy) for an array of ``shape``."""
    mesh = self.resolved_mesh()
    return _named_sharding(mesh, self._spec(mesh, tuple(shape), dtype),
                           MEMORY_KINDS[self.memory_policy])

  def explain(self, shape: Sequence[int], dtype=jnp.float32) -> str:
    """Why this placement lays out an array of ``shape`` the way it does: every candidate's
    estimated cost for "auto", the fixed spec otherwise."""
    mesh = self.resolved_mesh()
    head = (f"Placement(strategy={self.strategy!r}, mesh={dict(mesh.shape)}, "
            f"memory_policy={self.memory_policy!r}) for {tuple(shape)} "
            f"{jnp.dtype(dtype).name}:")
    if self.strategy == "auto":
      return head + "\n" + self._plan(mesh, shape, dtype).table()
    return head + f"\n=> {self._spec(mesh, tuple(shape), dtype)} (fixed strategy, no planning)"


@functools.lru_cache(maxsize=256)
def _planning_inputs(mesh: Mesh, topology: Topology) -> tuple[tuple[int, ...], Topology]:
  """Device ids of ``mesh`` (row-major) and the topology describing them: ``topology`` when it
  has those ids, else the detected topology of the mesh's devices."""
  ids = tuple(int(d.id) for d in mesh.devices.flat)
  if not set(ids) <= set(topology.device_ids):
    topology = Topology.detect(list(mesh.devices.flat))
  return ids, topology


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


def check_divisible(shape: Sequence[int], spec: P, mesh: Mesh) -> None:
  """Raises PlacementError listing every dimension not divisible by its mesh axes."""
  problems = []
  if len(spec) > len(shape):
    raise errors.PlacementError(
        f"PartitionSpec {spec} has {len(spec)} entries but the array has {len(shape)} "
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
        f"cannot place an array of shape {tuple(shape)} with {spec}:", problems))


try:  # jax.core.Tracer is public on jax 0.10; keep working if a later jax moves it
  _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
  from jax._src.core import Tracer as _Tracer  # pylint: disable=g-import-not-at-top


def _is_tracer(x) -> bool:
  return isinstance(x, _Tracer)


def shard(x: Any, placement: Placement | NamedSharding) -> Any:
  """Lays ``x`` (an array or a pytree of arrays, e.g. flax params or an optax state) out as
  ``placement`` says: ``device_put`` outside jit, a sharding constraint inside jit. Each leaf is
  planned on its own shape for "auto".

  Host memory policies inside jit lay the value out on device, then move it; a jit output keeps
  ``pinned_host``, but for ``unpinned_host`` outputs jax (0.10.2, CPU) reports ``device`` unless
  the jit is given ``out_shardings=placement.sharding(shape, dtype)``."""
  def one(leaf):
    if not hasattr(leaf, "shape"):
      return leaf
    sharding = (placement if isinstance(placement, NamedSharding)
                else placement.sharding(leaf.shape, leaf.dtype))
    if _is_tracer(leaf):
      if sharding.memory_kind not in (None, "device"):
        # A bare device_put to host memory inside jit loses the partitioning (measured on CPU,
        # jax 0.10.2: the result came back replicated); lay it out on device first, then move.
        on_device = jax.lax.with_sharding_constraint(leaf, sharding.with_memory_kind("device"))
        return jax.device_put(on_device, sharding)
      return jax.lax.with_sharding_constraint(leaf, sharding)
    return jax.device_put(leaf, sharding)
  return jax.tree.map(one, x)


_INITS: dict[str, Callable] = {
    "zeros": lambda key, shape, dtype: jnp.zeros(shape, dtype),
    "ones": lambda key, shape, dtype: jnp.ones(shape, dtype),
    "normal": lambda key, shape, dtype: jax.random.normal(key, shape, dtype),
    "uniform": lambda key, shape, dtype: jax.random.uniform(key, shape, dtype),
}


def tensor(shape: Sequence[int], dtype=jnp.float32, placement: Placement | None = None,
           init: str | Callable = "zeros", key: jax.Array | None = None) -> jax.Array:
  """Creates an array directly in its sharded layout: each device computes only its shard (the
  initialiser runs under jit with ``out_shardings``), so the whole array never sits on one
  device.

  Args:
    shape, dtype: of the array.
    placement: default ``Placement()`` ("auto" over all devices).
    init: "zeros", "ones", "normal", "uniform" or ``f(key, shape, dtype) -> array``.
    key: PRNG key for random initialisers (default ``jax.random.key(0)``).
  """
  placement = placement or Placement()
  shape = tuple(int(s) for s in shape)
  if isinstance(init, str):
    if init not in _INITS:
      raise errors.PlacementError(f"init={init!r} is not one of {tuple(_INITS)} or a callable "
                                  "f(key, shape, dtype)")
    init_fn = _INITS[init]
  else:
    init_fn = init
  sharding = placement.sharding(shape, dtype)
  key = jax.random.key(0) if key is None else key
  return jax.jit(lambda k: init_fn(k, shape, dtype), out_shardings=sharding)(key)
