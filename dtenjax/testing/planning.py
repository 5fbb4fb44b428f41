"""What the planner's benchmarks drive besides ``dtenjax.plan``: the timing routine that
``plan(measure=True)`` uses, its test of two plans laying a step out alike, its count of a
compiled program's memory, the spread of per-round ratios and what the benchmarks call a win, the standard
recipes' names, the calibration's raw measurement, a host's NUMA record, the per-array
planner's caches (cleared for a cold timing, counted for a hit rate), and the whole-step cost
model with some of its terms replaced (to read a price apart).

The benchmarks time the user's own ``jax.jit`` programs with the same routine as the library times
its candidates, so that the two are compared under one method. For benchmarks and tests; not part
of the library's API.
"""

from __future__ import annotations

import contextlib

from dtenjax._src.planning import mesh as _mesh
from dtenjax._src.planning import placement as _placement
from dtenjax._src.planning import planner as _planner
from dtenjax._src.planning import pricing as _pricing
from dtenjax._src.planning import step as _step
from dtenjax._src.planning.measure import compiled_bytes as compiled_bytes
from dtenjax._src.planning.measure import ratio_spread as ratio_spread
from dtenjax._src.planning.measure import same_layout as same_layout
from dtenjax._src.planning.measure import time_calls as time_calls
from dtenjax._src.planning.planner import plan_tensor as plan_tensor
from dtenjax._src.planning.recipes import RECIPES as RECIPES
from dtenjax._src.topology.calibrate import measure as calibrate_measure
from dtenjax._src.topology.parts import NumaNode as NumaNode

__all__ = ["CLAUSE_MEMORY_SLACK", "CLAUSE_TIME_SLACK", "RECIPES", "NumaNode", "calibrate_measure",
           "clear_planner_caches", "compiled_bytes", "distinct_plans", "fastest_priced", "plan_tensor",
           "ratio_spread",
           "replaced_cost_terms", "same_layout", "time_calls"]

# What the benchmarks call a win against the fastest hand-written layout (docs/benchmarks.md,
# "wins when run"): a plan's step time at most 1.05x that layout's, its compiled memory at most
# 1.10x that layout's.
CLAUSE_TIME_SLACK = 0.05
CLAUSE_MEMORY_SLACK = 0.10

_CACHES = (_planner._plan_cached, _planner._allreduce_s, _mesh._make_mesh_cached,
           _mesh._mesh_for_shape, _placement._planning_inputs, _placement._named_sharding,
           _placement._sharding_for)


def clear_planner_caches() -> None:
  """Empties every cache of the per-array planner (plans, all-reduce times, meshes, shardings),
  so that the next ``Placement("auto")`` call is timed cold."""
  for cache in _CACHES:
    cache.cache_clear()


def distinct_plans() -> int:
  """How many distinct per-array plans the planner's cache holds."""
  return _planner._plan_cached.cache_info().currsize


@contextlib.contextmanager
def replaced_cost_terms(**attrs):
  """Within the block, ``dtenjax.plan`` prices with some of the cost model's per-mesh terms
  replaced: each keyword names a ``Pricer`` attribute (the update's ``local_s_per_byte``, each
  collective's ``step_latency``) and gives its value or a function of the priced one. A
  diagnostic for benchmarks (``bench/step_planner.py --parts terms``); the planner never changes
  them."""
  init = _pricing.Pricer.__init__

  def patched(pricer, *a, **k):
    init(pricer, *a, **k)
    for name, value in attrs.items():
      setattr(pricer, name, value(getattr(pricer, name)) if callable(value) else value)
  _pricing.Pricer.__init__ = patched
  try:
    yield
  finally:
    _pricing.Pricer.__init__ = init


@contextlib.contextmanager
def fastest_priced():
  """Within the block, ``dtenjax.plan`` returns the plan its model prices fastest, without the
  step to the leanest plan priced within ``LEAN_MARGIN`` of it (docs/planner.md, "The choice"):
  the benchmarks time the two side by side (bench/step_planner.py's wins part)."""
  margin = _step.LEAN_MARGIN
  _step.LEAN_MARGIN = 0.0
  try:
    yield
  finally:
    _step.LEAN_MARGIN = margin
