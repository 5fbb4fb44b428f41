"""The price records in registry order, and the choice among them: what ``algorithm="auto"``
picks and what the planner pays for an all-reduce.

Order matters only within a family: ``algorithm="one_shot"`` takes the first record of that family
that supports the call (the NVLink kernel on GPU, the XLA-native form elsewhere), and
``algorithm="ring"`` across processes the host transport. :func:`choose` ranks every record that
supports the call by the cost model and takes the cheapest (ties: the name that sorts first).
``collectives/algorithms/registry.py`` lists the runnable algorithms in the same order, one per
record here (a test keeps the two lists equal).

Adding an algorithm: its record (supports, order, cost formulas) in ``pricing/algorithms.py`` and
a line below; its implementation in ``collectives/algorithms/<name>.py`` and a line there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

from dtenjax._src import errors
from dtenjax._src.pricing import algorithms
from dtenjax._src.pricing import costmodel
from dtenjax._src.pricing.calls import Call
from dtenjax._src.topology.model import Topology

RECORDS: tuple[algorithms.Record, ...] = (
    algorithms.NVLINK_ONE_SHOT,
    algorithms.NVLINK_TWO_SHOT,
    algorithms.HOST_RING,
    algorithms.HOST_HIERARCHICAL,
    algorithms.XLA,
    algorithms.RING,
    algorithms.HIERARCHICAL,
    algorithms.ONE_SHOT,
    algorithms.TWO_SHOT,
    algorithms.BUTTERFLY,
)


class AlgorithmChoice(NamedTuple):
  """What was chosen for one collective and why: data for ``explain``."""
  algorithm: str                  # the record name, e.g. "xla", "two_shot", "nvlink_one_shot"
  times: dict[str, float]         # the cost model's seconds for every record that supports it
  reason: str


def supported(call: Call) -> tuple[list[algorithms.Record], dict[str, str]]:
  """Records that can run ``call`` (registry order) and, for the others, why not."""
  ok, why = [], {}
  for a in RECORDS:
    reason = a.why_not(call)
    if reason is None:
      ok.append(a)
    else:
      why[a.name] = reason
  return ok, why


@functools.cache
def _detected() -> Topology:
  return Topology.detect()


def _rank(call: Call, records: Sequence[algorithms.Record], group: Sequence[int],
          topology: Topology) -> list[tuple[str, float]]:
  try:
    topology.slowest_link(list(group))
  except errors.TopologyError as e:
    errors.warn_once(f"auto-topology:{topology.name}",
                     f"dtenjax: the topology {topology.name!r} does not describe the devices of "
                     f"this collective ({e}); algorithm='auto' ranks with the detected topology.")
    topology = _detected()
  times = {a.name: a.time(call, group, topology) for a in records}
  return sorted(times.items(), key=lambda kv: (kv[1], kv[0]))


def choose(call: Call, group: Sequence[int], topology: Topology) -> AlgorithmChoice:
  """The cheapest record that supports ``call`` (``algorithm="auto"``)."""
  ok, why = supported(call)
  if not ok:
    raise errors.CollectiveError(errors.join_problems(
        f"no algorithm can run this {call.kind} (op={call.op!r}, dtype={call.dtype.name}, "
        f"axes={call.axes!r}):", [f"{k}: {v}" for k, v in why.items()]))
  ranked = _rank(call, ok, group, topology)
  best = ranked[0][0]
  reason = (f"cost model: {best} is fastest for {call.nbytes} B over {call.world} ranks on "
            f"{call.backend} (" + ", ".join(f"{k}={v * 1e6:.1f}us" for k, v in ranked) + ")")
  if why:
    reason += "; not eligible: " + "; ".join(f"{k}: {v}" for k, v in why.items())
  return AlgorithmChoice(best, dict(ranked), reason)


def all_reduce_time(nbytes: int, group: Sequence[int], axis_sizes: Sequence[int],
                    topology: Topology, dtype) -> float:
  """The per-array planner's price of an all-reduce (its arrays are reduced by
  ``dtenjax.all_reduce``): the cost of what ``algorithm="auto"`` picks for a sum
  of ``nbytes`` of ``dtype`` per participant over the device ids ``group`` (rank order) split
  into mesh axes of ``axis_sizes``, with ``all_reduce``'s defaults (deterministic, no
  reproducible contract; XLA's collectives reach every process of the group, as they do where a
  planned step runs: NCCL on GPU, gloo on CPU)."""
  sizes = tuple(int(s) for s in axis_sizes)
  if math.prod(sizes) != len(group):
    raise errors.CollectiveError(f"all_reduce_time: axis_sizes={sizes} do not multiply to the "
                                 f"group size {len(group)}")
  group = tuple(group)
  platform, processes = _where(group, topology)
  call = Call(kind="all_reduce", op="sum", dtype=dtype,
              axes=tuple(f"axis{i}" for i in range(len(sizes))), axis_sizes=sizes,
              nbytes=int(nbytes), backend=platform, processes=processes, nvls=topology.nvls)
  return min(choose(call, list(group), topology).times.values())


@functools.lru_cache(maxsize=1024)
def _where(group: tuple[int, ...], topology: Topology) -> tuple[str, int]:
  """The platform of ``group``'s first device and the processes it spans (once per group and
  topology, a frozen value)."""
  infos = [topology.device(g) for g in group]
  return infos[0].platform, len({d.process_index for d in infos})


def xla_all_reduce_time(nbytes: int, group: Sequence[int], axis_sizes: Sequence[int],
                        topology: Topology, dtype) -> float:
  """XLA's own all-reduce of ``nbytes`` per participant over ``group`` (the whole-step planner's
  price: a planned step's all-reduces are the ones XLA inserts, whatever ``algorithm="auto"``
  would pick for a ``dtenjax.all_reduce`` of the same call); the signature of
  :func:`all_reduce_time`."""
  return costmodel.collective_time("all_reduce", int(nbytes), list(group), topology)


class AllReducePrices:
  """An all-reduce price (default :func:`all_reduce_time`) with its answers kept: one planning
  prices the same all-reduce (bytes, group, dtype) on many candidate layouts and meshes. Keep one
  for one planning only: a price also reads the process's settings (``DTENJAX_COST_PARAMS``,
  the NVLink kernels' availability), which may change between plans."""

  def __init__(self, price=None):
    self._price = price if price is not None else all_reduce_time
    self._times: dict[tuple, float] = {}

  def __call__(self, nbytes: int, group: Sequence[int], axis_sizes: Sequence[int],
               topology: Topology, dtype) -> float:
    key = (int(nbytes), tuple(group), tuple(axis_sizes), topology, str(dtype))
    t = self._times.get(key)
    if t is None:
      t = self._times[key] = self._price(nbytes, group, axis_sizes, topology, dtype)
    return t
