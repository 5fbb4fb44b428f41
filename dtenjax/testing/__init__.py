"""chex-style assertions for users' own test suites (and ours).

* :func:`assert_placement` -- an array is laid out with this spec / mesh / memory kind;
* :func:`assert_bitwise_equal` -- two arrays (or pytrees) have identical bits, reporting the first
  differing index and both values;
* :func:`assert_plan_strategy` -- a placement (or an ArrayPlan) picked this strategy for a shape;
* :func:`observe_launches`, :func:`per_step_summary` -- what a GPU really launched for a step
  (CUDA graph launches, kernels inside and outside graphs), from a profiler trace: the
  measurement behind ``dtenjax.jit(cuda_graphs=...)``'s claims, for examples and benchmarks.

Shared by dtenjax's own tests and benchmarks (benchmarks import nothing from tests/ and nothing
from ``dtenjax._src``), and imported by name: ``dtenjax.testing.native`` (the test-only extension
``dtenjax._ffi_testing``, present in editable installs only), ``dtenjax.testing.ports`` (loopback
ports for a local coordinator), and what benchmarks drive besides the public API:
``dtenjax.testing.demo`` (the ``dtenjax demo`` model), ``.costmodel`` (the collective cost model,
record by record), ``.planning`` (the planner's timing routine, recipes and caches), ``.report`` (tables and units as the command line prints them), ``.transport``
(the native TCP transport and its key-value store) and ``.xla`` (XLA's option keys, the
reproducibility pins, the custom-call steps switched off, loop trip counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.gpu.graph_observation import observe_launches as observe_launches
from dtenjax._src.gpu.graph_observation import per_step_summary as per_step_summary
from dtenjax._src.planning import planner
from dtenjax._src.planning.placement import Placement

__all__ = ["assert_bitwise_equal", "assert_placement", "assert_plan_strategy", "observe_launches",
           "per_step_summary"]


def _norm_spec(spec: P, ndim: int) -> tuple:
  entries = list(spec) + [None] * (ndim - len(spec))
  return tuple(tuple(e) if isinstance(e, (tuple, list)) and len(e) > 1
               else (e[0] if isinstance(e, (tuple, list)) and e else e) for e in entries)


def assert_placement(x: jax.Array, spec: P | None = None, *,
                     mesh_shape: Mapping[str, int] | None = None,
                     memory_kind: str | None = None) -> None:
  """Asserts ``x`` is a NamedSharding-laid-out array with the given spec, mesh axes and memory
  kind (each checked only when given). Lists every mismatch."""
  if isinstance(x, jax.core.Tracer):
    raise errors.ConfigurationError(
        f"assert_placement got a traced value ({x.aval.str_short()}, inside jax.jit or another "
        "transformation), whose layout XLA decides when it compiles; assert on the output of "
        "the jitted function instead")
  if spec is not None and not isinstance(spec, (P, tuple, list)):   # a tuple: P's entries
    raise errors.ConfigurationError(
        f"assert_placement: spec={spec!r} is not a PartitionSpec (or a tuple of its entries); "
        "pass the layout expected, e.g. P('data', None) (a strategy name is a Placement's, see "
        "assert_plan_strategy)")
  problems = []
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    raise AssertionError(f"expected a NamedSharding, got {type(sharding).__name__}: {sharding}")
  if spec is not None and _norm_spec(sharding.spec, x.ndim) != _norm_spec(spec, x.ndim):
    problems.append(f"spec is {sharding.spec}, expected {spec}")
  if mesh_shape is not None and dict(sharding.mesh.shape) != dict(mesh_shape):
    problems.append(f"mesh is {dict(sharding.mesh.shape)}, expected {dict(mesh_shape)}")
  if memory_kind is not None and sharding.memory_kind != memory_kind:
    problems.append(f"memory kind is {sharding.memory_kind!r}, expected {memory_kind!r}")
  if problems:
    raise AssertionError("placement mismatch for array of shape "
                         f"{tuple(x.shape)}:\n  - " + "\n  - ".join(problems))


def _bits(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  if a.dtype == np.bool_ or a.dtype.itemsize not in (1, 2, 4, 8):
    return a
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_bitwise_equal(actual: Any, expected: Any, *, name: str = "") -> None:
  """Asserts two arrays or pytrees are identical bit for bit (NaN payloads and -0.0 included).

  On failure reports, per leaf, the number of differing elements, the first differing index and
  both values at it.
  """
  a_leaves, a_tree = jax.tree.flatten(actual)
  e_leaves, e_tree = jax.tree.flatten(expected)
  if a_tree != e_tree:
    raise AssertionError(f"{name} tree structures differ: {a_tree} vs {e_tree}")
  problems = []
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(actual)[0]]
  for path, a, e in zip(paths, a_leaves, e_leaves):
    a, e = np.asarray(a), np.asarray(e)
    where = f"{name}{path}" or "array"
    if a.shape != e.shape or a.dtype != e.dtype:
      problems.append(f"{where}: shape/dtype {a.shape} {a.dtype} vs {e.shape} {e.dtype}")
      continue
    diff = _bits(a) != _bits(e)
    if np.any(diff):
      idx = tuple(int(i) for i in np.argwhere(diff)[0])
      problems.append(f"{where}: {int(diff.sum())} of {diff.size} elements differ; first at index "
                      f"{idx}: actual {a[idx]!s} vs expected {e[idx]!s}")
  if problems:
    raise AssertionError("not bitwise equal:\n  - " + "\n  - ".join(problems))


def assert_plan_strategy(plan_or_placement: planner.ArrayPlan | Placement, strategy: str,
                         shape: Sequence[int] | None = None, dtype=np.float32) -> None:
  """Asserts the planner picked ``strategy``; with a Placement, ``shape`` says for what array."""
  if isinstance(plan_or_placement, Placement):
    if shape is None:
      raise ValueError("assert_plan_strategy(placement, ...) needs shape=...")
    plan = plan_or_placement.plan(shape, dtype)
  else:
    plan = plan_or_placement
  if plan.strategy != strategy:
    raise AssertionError(f"planner picked {plan.strategy!r} for {plan.shape}, expected "
                         f"{strategy!r}:\n{plan.table()}")
