"""The measured step as the objective: ``dtenjax.plan(..., measure=True)``.

The cost model ranks layouts by predicted step time; the prediction can miss (the planner's
compute and link estimates are priors, and XLA's fusion decides the rest), by more than the
gaps between close layouts. With ``measure=True`` the planner compiles its own choice, its
runner-ups (the best plan of each other mesh priced within :data:`RUNNER_UP_MARGIN` of the
choice, at most :data:`RUNNER_UPS` of them) and every layout a user writes that may fit the
budget (:func:`user_layouts`: DP, FSDP, TP, FSDP x TP at every split of a fast island, HSDP;
:func:`may_fit`), reads each compile's memory (:func:`compile_plan`), runs each on the devices
it plans for and keeps one by :func:`choose`: the fastest whose compiled memory fits the budget,
or, among those timed within the noise of it, the model's choice, else the one of least memory. Each candidate is
timed on its own arrays (made on the devices in the candidate's layout at the start of each of
its turns, so no device holds a copy of the whole state and one candidate's arrays are alive at
a time) by :func:`time_calls`, the routine bench/step_planner.py's wins part times the user's
own programs with: shuffled rounds of warm turns, medians. Every candidate's time and compiled
memory are in the plan's ``measured`` field and its report.
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
from jax.sharding import NamedSharding

from dtenjax._src import errors
from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.recipes import RECIPES
from dtenjax._src.planning.result import Measured

# The model's runner-ups that are timed beside its choice: the best plan of each other mesh
# priced at most this much dearer than the choice. The model's error between layouts sets it:
# over the layouts timed on the 16-core host (thirteenth round) and on the 2-core VM, every
# pair measured more than 3 % apart in the order the model did not predict was priced at most
# 6.3 % apart (convnet's HSDP against fsdp 8; moe's expert 4 x tensor 2, measured 0.89x the
# choice expert 8, 4.9 %; encdec's fsdp 4 x tensor 2, 0.79x, 0.1 %), so a runner-up priced
# within 8 % may be the faster, and one priced further off never was.
RUNNER_UP_MARGIN = 0.08
# At most this many runner-ups are compiled (the cheapest first), so measure=True compiles at
# most 1 + RUNNER_UPS + len(user_layouts(...)) programs (12 on 8 devices with islands of 8).
RUNNER_UPS = 3
# The most a candidate kept for its smaller memory may be slower than the fastest (a median
# per-round ratio within the rounds' spread, never more than this): what "as fast" allows.
TIME_SLACK = 0.05
# The memory model's largest miss against XLA:CPU's compile on the planner's rows (14.2 % low,
# docs/benchmarks.md, "The fourth slot as an upper bound"): a user layout priced up to this much
# over the budget may compile within it, so measure=True compiles it to see: a budget that plain
# FSDP fits by its compile is never refused.
MODEL_MEMORY_ERROR = 0.15


def may_fit(cost, budget: float) -> bool:
  """Whether a layout priced at ``cost`` may compile within ``budget`` (0: none)."""
  return cost.fits or cost.memory["total"] <= budget * (1 + MODEL_MEMORY_ERROR)


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


def compile_plan(step: Callable, plan, args: Sequence[Any]) -> tuple[Callable, float]:
  """``plan.jit(step)`` compiled for the arguments' shapes, and its compiled memory per device
  (:func:`compiled_bytes`). The program returned is the one timed, compiled with nothing donated:
  the timed turns call it again on the same arrays (a compiled program called on a donated
  buffer crashes XLA:CPU's process). For a plan made with ``donate=True`` the memory is that of
  a second compile, ``plan.jit(step)``'s own, which donates the state (as ``plan.check``
  compiles it)."""
  abstract = stepgraph.abstract(args)
  compiled = plan.jit(step, donate_argnums=()).lower(*abstract).compile()
  donated = compiled
  if plan.donate:
    donated = plan.jit(step).lower(*abstract).compile()
  return compiled, compiled_bytes(donated)


def compiled_bytes(compiled) -> float:
  """Bytes per device of a compiled program: its arguments, its outputs that do not reuse a
  donated argument's memory, and its temporaries (``memory_analysis()``, as the wins part and
  ``plan.check`` count them)."""
  stats = compiled.memory_analysis()
  return float(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def time_plans(step: Callable, plans: Mapping[str, Any], args: Sequence[Any], *,
               rounds: int = 6, timer: Callable[[], float] = time.perf_counter
               ) -> tuple[dict[str, list[float]], dict[str, float], float]:
  """Each named plan's step compiled (:func:`compile_plan`) and timed by :func:`time_calls`, on
  arguments placed by :func:`placed_arguments` at the start of each of its turns and dropped
  after it (one candidate's arrays are alive at a time, so candidates that each fill a device
  can be timed in one process): (seconds per call in each round, compiled bytes per device,
  wall seconds the compiles took)."""
  if rounds < 2:
    raise errors.PlacementError(f"plan: measure={rounds!r} must be at least 2 timed rounds")
  fns, memory = {}, {}
  t0 = time.perf_counter()
  for name, p in plans.items():
    fns[name], memory[name] = compile_plan(step, p, args)
  compile_s = time.perf_counter() - t0
  placed: dict[str, tuple] = {}

  def enter(name):
    placed[name] = placed_arguments(args, plans[name].shardings())

  samples = time_calls({name: (lambda name=name: fns[name](*placed[name])) for name in plans},
                       rounds=rounds, timer=timer, enter=enter,
                       leave=lambda name: placed.pop(name))
  return samples, memory, compile_s


def ratio_spread(xs: Sequence[float]) -> float:
  """Half the distance between the first and third quartiles of ``xs``: the noise of a median
  of per-round ratios."""
  xs = sorted(xs)
  q = lambda f: xs[min(len(xs) - 1, int(f * (len(xs) - 1) + 0.5))]
  return (q(0.75) - q(0.25)) / 2


def choose(samples: Mapping[str, Sequence[float]], memory: Mapping[str, float],
           budget: float, prior: str | None = None) -> tuple[str, tuple[Measured, ...]]:
  """The candidate to keep, and every candidate's record (fastest first), from each one's
  seconds per round (``samples``, paired: round ``i`` of every candidate is one shuffled round)
  and compiled bytes (``memory``).

  Not kept: a candidate whose compile exceeds ``budget`` (0: unknown, none checked). Of the rest,
  the fastest by median time; then, among those whose median per-round ratio to it is within the
  noise, ``prior`` (the model's choice) when it is one of them, else the one of least memory.
  Where the rounds cannot tell candidates apart the model's ranking decides: on the 16-core host
  three such "ties" timed again were 4-11 % apart, each in the order the model predicted
  (docs/benchmarks.md, sixteenth round). The noise is the ratio's own spread
  (:func:`ratio_spread`, the rounds' spread of this pair), never more than :data:`TIME_SLACK`, so
  a candidate kept within the noise is at most 1.05x the time of the fastest. A candidate faster beyond the noise is kept
  whatever its memory within the budget: the budget is the user's limit on memory, and time is
  the objective under it. Raises PlacementError when every candidate compiles over the budget."""
  mib = 2**20
  median = {k: statistics.median(v) for k, v in samples.items()}

  def ratio(k: str, ref: str) -> list[float]:
    return [a / b for a, b in zip(samples[k], samples[ref])]

  def within(k: str, ref: str) -> bool:
    r = ratio(k, ref)
    return statistics.median(r) <= 1 + min(TIME_SLACK, ratio_spread(r))

  why: dict[str, str] = {}
  if budget:
    for k in samples:
      if memory[k] > budget:
        why[k] = (f"not kept: compiled {memory[k] / mib:.1f} MiB, over the budget "
                  f"({budget / mib:.1f} MiB)")
  if len(why) == len(samples):
    least = min(samples, key=memory.get)
    raise errors.PlacementError(
        f"plan: measure: every candidate compiles over the budget of {budget / mib:.1f} MiB per "
        f"device; the least is {least} at {memory[least] / mib:.1f} MiB. Raise memory_budget, "
        "use more devices or a smaller batch per step")
  eligible = [k for k in samples if k not in why]
  fastest = min(eligible, key=median.get)
  tied = {k for k in eligible if within(k, fastest)}
  by_prior = prior in tied and prior != fastest
  kept = prior if prior in tied else min(tied, key=lambda k: (memory[k], median[k], k))
  reason = "the model's choice" if by_prior else "less memory"
  for k in eligible:
    why[k] = (("kept: the fastest" if k == fastest else
               f"kept: within the noise of {fastest}, {reason}") if k == kept else
              f"the fastest; {kept} is within its noise, {reason}" if k == fastest else
              f"within the noise of {fastest}, not kept" if k in tied else "slower")
  records = []
  for k in sorted(samples, key=median.get):
    r = ratio(k, fastest)
    records.append(Measured(k, median[k], memory[k], statistics.median(r), ratio_spread(r),
                            why[k]))
  return kept, tuple(records)


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


def runner_ups(priced: Sequence[tuple[float, Any]], best_s: float) -> list[Any]:
  """Of ``priced`` ((predicted seconds, plan) pairs, one per other mesh), those priced within
  :data:`RUNNER_UP_MARGIN` of the choice's ``best_s``, the cheapest first (``plan``'s measured
  mode times the first :data:`RUNNER_UPS` of them whose layout no other candidate has)."""
  near = [(s, k) for k, (s, _) in enumerate(priced) if s <= best_s * (1 + RUNNER_UP_MARGIN)]
  return [priced[k][1] for _, k in sorted(near)]


def mesh_name(mesh: Mapping[str, int]) -> str:
  """``fsdp 4 x tensor 2``: the axes of a mesh that have more than one device."""
  return " x ".join(f"{a} {k}" for a, k in mesh.items() if k > 1) or "one device"


def layout_name(recipe: str, mesh: Mapping[str, int] | None) -> str:
  """A candidate's name in the report: the recipe, with its mesh when it is not the standard
  one (FSDP on a data x fsdp mesh is HSDP)."""
  if mesh is None:
    return recipe
  name = "HSDP" if recipe == "FSDP" and mesh.get("data", 1) > 1 else recipe
  return f"{name} ({mesh_name(mesh)})"


def same_layout(a, b) -> bool:
  """Whether two plans lay the step out alike: the same mesh, device order and specs, or, on
  different meshes, every argument, output and gathered weight placed alike on the devices (a
  plan on ``fsdp 8`` that shards no weight over ``fsdp`` is ``data 8``'s: one program, timed
  once)."""
  if (a.mesh_shape == b.mesh_shape and a.device_ids == b.device_ids and
      a.axis_names == b.axis_names and jax.tree.leaves(a.specs) == jax.tree.leaves(b.specs)):
    return True
  if a.pipeline is not None or b.pipeline is not None:
    return False
  ma, mb = a.mesh(), b.mesh()
  is_spec = lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec)

  def alike(x, y) -> bool:
    xs, ys = jax.tree.leaves(x, is_leaf=is_spec), jax.tree.leaves(y, is_leaf=is_spec)
    return len(xs) == len(ys) and all(
        (s is None) == (t is None) and (s is None or NamedSharding(ma, s).is_equivalent_to(
            NamedSharding(mb, t), max(len(s), len(t), 1))) for s, t in zip(xs, ys))
  return (alike(a.specs, b.specs) and alike(a.out_specs, b.out_specs) and
          alike(a.compute_specs, b.compute_specs))


def summary(records: Sequence[Measured], kept: str, compile_s: float, total_s: float) -> str:
  """The report's line: which candidate was kept, among how many, and what measuring cost (the
  report's measured table, ``StepPlan.table``, gives each one's time and compiled memory)."""
  why = next(r.note for r in records if r.name == kept).removeprefix("kept: ")
  return (f"measured on {jax.device_count()} {jax.devices()[0].platform} devices: "
          f"{len(records)} candidates compiled ({compile_s:.1f} s) and timed "
          f"({total_s - compile_s:.1f} s); kept {kept}: {why}")
