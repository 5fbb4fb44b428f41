"""The measured step as the objective: ``dtenjax.plan(..., measure=True)``.

The cost model ranks layouts by predicted step time; the prediction can miss (the planner's
compute and link estimates are priors, and XLA's fusion decides the rest). With ``measure=True``
the planner compiles its own choice and every layout a user writes that fits the budget
(:func:`user_layouts`: DP, FSDP, TP, FSDP x TP at every split of a fast island, HSDP), runs each
on the devices it plans for, and keeps the fastest: the plan is then never slower than those
layouts by more than the timing noise. Each candidate is timed on its own arrays (made on the
devices in the candidate's layout at the start of each of its turns, so no device holds a copy
of the whole state and one candidate's arrays are alive at a time) by :func:`time_calls`, the
routine bench/step_planner.py's wins part times the user's own programs with: shuffled rounds
of warm turns, medians. The times are in the plan's ``measured`` field and its report.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dtenjax._src import errors
from dtenjax._src.planning.recipes import RECIPES


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


def time_calls(calls: Mapping[str, Callable[[], Any]], *, rounds: int, warmup: int = 1,
               per_turn: int = 2, seed: int = 0, timer: Callable[[], float] = time.perf_counter,
               enter: Callable[[str], None] | None = None,
               leave: Callable[[str], None] | None = None) -> dict[str, list[float]]:
  """Seconds per call of each of ``calls`` (zero-argument functions whose result is waited for),
  one sample per round: ``warmup`` untimed calls of each first (the compiles), then ``rounds``
  rounds that give every candidate one turn, in an order drawn afresh each round (seeded): an
  untimed call, then ``per_turn`` timed calls back to back, as a training loop repeats its
  step; the turn's mean is the round's sample. ``enter(name)`` / ``leave(name)`` run around each
  turn and the warm-up, untimed (placing and dropping a candidate's arrays).

  Timed right after another candidate's step, a step pays for the caches and memory that step
  left: with a fixed order (each candidate after the same neighbour, or two passes in opposite
  orders of one warm-up and three calls, the first right after its compile) the 16-core machine
  timed the plan's program 1.15-1.19x the identical program of the user's DP, and
  ``measure=True`` kept the encoder-decoder's ``fsdp 8``, which the wins part then timed 1.10x
  the model's ``data 8`` that it had timed too. The library's ``measure=True`` and
  bench/step_planner.py's wins part both time with this routine."""
  if rounds < 1 or per_turn < 1 or warmup < 0:
    raise errors.PlacementError(f"timing: rounds={rounds}, per_turn={per_turn} must be >= 1 and "
                                f"warmup={warmup} >= 0")
  enter = enter or (lambda name: None)
  leave = leave or (lambda name: None)
  names = list(calls)
  for k in names:
    enter(k)
    for _ in range(warmup):
      jax.block_until_ready(calls[k]())
    leave(k)
  samples: dict[str, list[float]] = {k: [] for k in names}
  rng = random.Random(seed)
  for _ in range(rounds):
    for k in rng.sample(names, len(names)):
      enter(k)
      jax.block_until_ready(calls[k]())
      t0 = timer()
      for _ in range(per_turn):
        jax.block_until_ready(calls[k]())
      samples[k].append((timer() - t0) / per_turn)
      leave(k)
  return samples


def time_plans(step: Callable, plans: Mapping[str, Any], args: Sequence[Any], *,
               rounds: int = 6, timer: Callable[[], float] = time.perf_counter
               ) -> dict[str, float]:
  """Median seconds per call of ``plan.jit(step)`` for each named plan (:func:`time_calls`), on
  arguments placed by :func:`placed_arguments` at the start of each of its turns and dropped
  after it: one candidate's arrays are alive at a time, so candidates that each fill a device
  can be timed in one process."""
  if rounds < 2:
    raise errors.PlacementError(f"plan: measure={rounds!r} must be at least 2 timed rounds")
  fns = {name: p.jit(step) for name, p in plans.items()}
  placed: dict[str, tuple] = {}

  def enter(name):
    placed[name] = placed_arguments(args, plans[name].shardings())

  samples = time_calls({name: (lambda name=name: fns[name](*placed[name])) for name in plans},
                       rounds=rounds, timer=timer, enter=enter,
                       leave=lambda name: placed.pop(name))
  return {name: statistics.median(s) for name, s in samples.items()}


def user_layouts(n: int, island: int) -> list[tuple[str, dict[str, int] | None]]:
  """(recipe, mesh) of the layouts a user writes on ``n`` devices whose fast islands hold
  ``island`` (None: the recipe's standard mesh, ``recipes.recipe_shape``): DP, FSDP, TP and
  FSDP x TP, then FSDP x TP with every other ``tensor`` size that divides an island (Megatron
  recipes write 2 and 4 as often as the island), and HSDP (FSDP inside each such group of
  devices, data across them). On 8 CPU devices the user's fsdp 4 x tensor 2 ran the
  encoder-decoder 0.93x DP on the 16-core host, and the standard FSDP x TP is fsdp 2 x tensor
  4: without the other splits ``measure=True`` never timed the fastest layout."""
  out: list[tuple[str, dict[str, int] | None]] = [(r, None) for r in RECIPES]
  g = math.gcd(max(1, island), n)
  for k in range(2, min(g, n - 1) + 1):
    if g % k == 0:
      out.append(("FSDP x TP", {"fsdp": n // k, "tensor": k}))
      out.append(("FSDP", {"data": n // k, "fsdp": k}))
  return out


def layout_name(recipe: str, mesh: Mapping[str, int] | None) -> str:
  """A candidate's name in the report: the recipe, with its mesh when it is not the standard
  one (FSDP on a data x fsdp mesh is HSDP)."""
  if mesh is None:
    return recipe
  name = "HSDP" if recipe == "FSDP" and mesh.get("data", 1) > 1 else recipe
  return f"{name} ({' x '.join(f'{a} {k}' for a, k in mesh.items() if k > 1)})"


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

