"""Alpha-beta cost model of collectives over a :class:`~dtenjax.Topology`.

Every estimate is ``steps * alpha + bytes_on_the_bottleneck * beta`` with alpha (seconds) and beta
(seconds per byte) taken from the topology's link classes -- table values, or measured ones after
:meth:`Topology.probe`. For a group of devices the bottleneck is the slowest link between any two
members, except for ``hierarchical``, which charges the inner (island) and outer (cross-island)
phases to their own links. The formulas, for ``n`` participants and ``N`` bytes per participant:

=============  ===============================================================================
ring           all-reduce ``2(n-1) a + 2 (n-1)/n N b``; reduce-scatter / all-gather half of that
one_shot       ``2 h a + (n-1) N b + n N b_local``: every rank reads every peer's whole buffer
two_shot       ``4 h a + 2 (n-1)/n N b + N b_local``: scatter-reduce then gather, one hop each
               (``h`` = 1 inside a host, where peers are read in parallel; ``n-1`` over a network)
hierarchical   reduce-scatter in islands of ``k``, all-reduce of ``N/k`` across ``m`` islands,
               all-gather in islands
xla            what XLA's own collective (NCCL / gloo / in-process) is modelled as: the best of
               ring and hierarchical, and one-shot on shared memory
=============  ===============================================================================

The model is deliberately simple: it ranks algorithms, it does not promise microseconds.
``docs/benchmarks.md`` records how its predictions compare with measured times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from dtenjax._src import errors
from dtenjax._src.topology.model import INTRA_HOST
from dtenjax._src.topology.model import Topology

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ppermute")
ALGORITHMS = ("xla", "ring", "one_shot", "two_shot", "hierarchical")
INF = math.inf


def _check(kind: str, algorithm: str, nbytes: int) -> None:
  if kind not in KINDS:
    raise errors.CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
  if algorithm not in ALGORITHMS:
    raise errors.CollectiveError(f"unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")
  if nbytes < 0:
    raise errors.CollectiveError(f"nbytes={nbytes} must be >= 0")


def island_groups(group: Sequence[int], topology: Topology) -> tuple[tuple[int, ...], ...] | None:
  """``group`` split by the topology's fast islands, or None when that split is not a proper
  two-level hierarchy (fewer than two islands, islands of one device, or unequal sizes)."""
  members = set(group)
  parts = []
  for isl in topology.fast_islands():
    part = tuple(d for d in group if d in isl)
    if part:
      parts.append(part)
  if len(parts) < 2 or len({len(p) for p in parts}) != 1 or len(parts[0]) < 2:
    return None
  assert sum(map(len, parts)) == len(members)
  return tuple(parts)


def _ring(n: int, nbytes: float, a: float, b: float, phases: int) -> float:
  """``phases`` ring passes (1: reduce-scatter or all-gather; 2: all-reduce)."""
  return phases * ((n - 1) * a + (n - 1) / n * nbytes * b)


def _hierarchical(group: Sequence[int], topology: Topology, nbytes: float, phases: int) -> float:
  """``phases`` ring passes inside islands of ``k`` plus ``phases`` passes of ``N/k`` bytes across
  the ``m`` islands: 2 for all-reduce (reduce-scatter in, all-reduce across, all-gather in), 1 for
  reduce-scatter / all-gather (one pass in, one across)."""
  parts = island_groups(group, topology)
  if parts is None:
    return INF
  k, m = len(parts[0]), len(parts)
  _, inner = topology.slowest_link(parts[0])
  _, outer = topology.slowest_link([p[0] for p in parts])
  return (phases * _ring(k, nbytes, inner.alpha, inner.beta, 1) +
          _ring(m, nbytes / k, outer.alpha, outer.beta, phases))


def collective_time(kind: str, nbytes: int, group: Sequence[int], topology: Topology,
                    algorithm: str = "ring") -> float:
  """Estimated seconds for one collective.

  Args:
    kind: one of :data:`KINDS`.
    nbytes: bytes per participant (the full, unsharded buffer for reduce_scatter/all_gather).
    group: global device ids (``jax.Device.id``) taking part, in rank order.
    topology: where they live.
    algorithm: one of :data:`ALGORITHMS`. Returns ``inf`` for an algorithm that does not apply
      (``hierarchical`` without a proper island split).
  """
  _check(kind, algorithm, nbytes)
  n = len(group)
  if n <= 1:
    return 0.0
  cls, spec = topology.slowest_link(group)
  a, b = spec.alpha, spec.beta
  b_local = topology.spec("local").beta
  if kind == "ppermute":
    return a + nbytes * b
  if kind in ("reduce_scatter", "all_gather"):
    if algorithm == "hierarchical":
      return _hierarchical(group, topology, nbytes, phases=1)
    return _ring(n, nbytes, a, b, 1)
  if kind == "all_to_all":
    return (n - 1) * a + (n - 1) / n * nbytes * b
  # all_reduce
  # Inside a host, peers' memory is read in parallel (loads over NVLink / shared memory); across
  # a network every peer is a separate message, so the latency term grows with the peer count.
  hops = 1 if cls in INTRA_HOST else n - 1
  if algorithm == "ring":
    return _ring(n, nbytes, a, b, 2)
  if algorithm == "one_shot":
    return 2 * hops * a + (n - 1) * nbytes * b + n * nbytes * b_local
  if algorithm == "two_shot":
    return 4 * hops * a + 2 * (n - 1) / n * nbytes * b + nbytes * b_local
  if algorithm == "hierarchical":
    return _hierarchical(group, topology, nbytes, phases=2)
  # xla
  options = [collective_time(kind, nbytes, group, topology, "ring"),
             collective_time(kind, nbytes, group, topology, "hierarchical")]
  if cls == "shared_memory":
    options.append(collective_time(kind, nbytes, group, topology, "one_shot"))
  return min(options)


def rank_algorithms(kind: str, nbytes: int, group: Sequence[int], topology: Topology,
                    candidates: Iterable[str] = ALGORITHMS) -> list[tuple[str, float]]:
  """``(algorithm, seconds)`` for each applicable candidate, fastest first, ties by name."""
  out = []
  for alg in candidates:
    t = collective_time(kind, nbytes, group, topology, alg)
    if t < INF:
      out.append((alg, t))
  return sorted(out, key=lambda kv: (kv[1], kv[0]))


def crossover_bytes(alg_small: str, alg_large: str, group: Sequence[int], topology: Topology,
                    kind: str = "all_reduce", hi: int = 1 << 34) -> int | None:
  """Smallest message size (bytes) at which ``alg_large`` beats ``alg_small``, found by bisection
  on the model; None if it never does below ``hi``. This is how size thresholds are derived
  from the topology instead of being constants."""
  def better(nb):
    return (collective_time(kind, nb, group, topology, alg_large) <
            collective_time(kind, nb, group, topology, alg_small))
  if not better(hi):
    return None
  if better(0):
    return 0
  lo_b, hi_b = 0, hi
  while hi_b - lo_b > 1:
    mid = (lo_b + hi_b) // 2
    if better(mid):
      hi_b = mid
    else:
      lo_b = mid
  return hi_b
