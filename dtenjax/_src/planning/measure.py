"""The measured step as the objective: ``dtenjax.plan(..., measure=True)``.

The cost model ranks layouts by predicted step time; the prediction can miss (the planner's
compute and link estimates are priors, and XLA's fusion decides the rest). With ``measure=True``
the planner compiles its own choice and every standard recipe that fits the budget, runs each on
the devices it plans for, and keeps the fastest: the plan is then never slower than the recipes
by more than the timing noise. Each candidate is timed on its own arrays (made on the devices in
the candidate's layout, so no device holds a copy of the whole state), in two passes over the
candidates in opposite orders, and the median of its runs is kept. The times are in the plan's
``measured`` field and its report.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dtenjax._src import errors


@functools.lru_cache(maxsize=256)
def _maker(shape: tuple[int, ...], dtype, sharding) -> Callable:
  """The jitted program that makes one abstract leaf in its layout from a key: one per shape,
  dtype and layout, so that candidates (and the timing's second pass) with the same leaf reuse
  its compiled program instead of compiling a closure per call."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    def make(key):
      del key
      return jax.random.split(jax.random.key(0), max(1, math.prod(shape))).reshape(shape)
  elif jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating):
    def make(key):
      return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  else:
    def make(key):
      del key
      return jnp.zeros(shape, dtype)
  return jax.jit(make, out_shardings=sharding)


def placed_arguments(args: Sequence[Any], shardings: Sequence[Any]) -> tuple[Any, ...]:
  """The step's arguments laid out with ``shardings``: arrays are placed as they are; abstract
  ``ShapeDtypeStruct`` leaves become values made directly in their layout (normal draws for
  floating point, zeros for integers and booleans, split keys for PRNG keys)."""
  def one(x, sharding, key):
    if not isinstance(x, jax.ShapeDtypeStruct):
      return jax.device_put(x, sharding)
    return _maker(tuple(x.shape), x.dtype, sharding)(key)

  out = []
  for i, (a, s) in enumerate(zip(args, shardings)):
    leaves, tree = jax.tree.flatten(a)
    shards = jax.tree.leaves(s)
    keys = jax.random.split(jax.random.key(i), max(1, len(leaves)))
    out.append(jax.tree.unflatten(tree, [one(x, sh, k) for x, sh, k in zip(leaves, shards, keys)]))
  return tuple(out)


def time_plans(step: Callable, plans: Mapping[str, Any], args: Sequence[Any], *,
               iters: int = 6, timer: Callable[[], float] = time.perf_counter
               ) -> dict[str, float]:
  """Median seconds per call of ``plan.jit(step)`` for each named plan, on arguments placed by
  :func:`placed_arguments`. Two passes over the plans in opposite orders, ``iters // 2`` timed
  calls each after one warm-up call (the compile), so drift hits every candidate alike; one
  candidate's arrays are alive at a time."""
  if iters < 2:
    raise errors.PlacementError(f"plan: measure={iters!r} must be at least 2 timed runs")
  samples: dict[str, list[float]] = {name: [] for name in plans}
  fns = {name: p.jit(step) for name, p in plans.items()}
  names = list(plans)
  for order in (names, names[::-1]):
    for name in order:
      placed = placed_arguments(args, plans[name].shardings())
      jax.block_until_ready(fns[name](*placed))
      for _ in range(iters // 2):
        t0 = timer()
        jax.block_until_ready(fns[name](*placed))
        samples[name].append(timer() - t0)
      del placed
  return {name: statistics.median(s) for name, s in samples.items()}


def same_layout(a, b) -> bool:
  """Whether two plans lay the step out alike (mesh, device order and every spec)."""
  return (a.mesh_shape == b.mesh_shape and a.device_ids == b.device_ids and
          a.axis_names == b.axis_names and jax.tree.leaves(a.specs) == jax.tree.leaves(b.specs))


def summary(times: Mapping[str, float], kept: str) -> str:
  """The report's line: every candidate's measured time, and which was kept."""
  ranked = sorted(times.items(), key=lambda kv: kv[1])
  parts = ", ".join(f"{n} {t * 1e3:.2f} ms" for n, t in ranked)
  return (f"measured on {jax.device_count()} {jax.devices()[0].platform} devices (median per "
          f"step): {parts}; kept {kept}")

