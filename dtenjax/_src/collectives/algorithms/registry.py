"""The algorithm registry: one record per algorithm, and the choice among them.

Order matters only within a family: ``algorithm="one_shot"`` takes the first record of that family
that supports the call (the NVLink kernel on GPU, the XLA-native form elsewhere), and
``algorithm="ring"`` across processes the host transport. ``algorithm="auto"`` ranks every record
that supports the call by the cost model (``planning/costmodel.py``) and takes the cheapest
(ties: the name that sorts first). A record's own name forces it (an error says why when it
cannot run the call).

Everything else is derived from :data:`REGISTRY`: the families (and so the values ``algorithm=``
accepts), the candidates of ``auto`` and of the planner (``planning/planner.py`` prices all-reduces
with :func:`choose`, handed to it by ``collectives/api.py``).

Adding an algorithm: write ``algorithms/<name>.py`` defining a :class:`~base.Algorithm` (supports,
implementation, order, its cost formulas) and add it to :data:`REGISTRY` below.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import butterfly
from dtenjax._src.collectives.algorithms import hierarchical
from dtenjax._src.collectives.algorithms import host
from dtenjax._src.collectives.algorithms import nvlink
from dtenjax._src.collectives.algorithms import one_shot
from dtenjax._src.collectives.algorithms import ring
from dtenjax._src.collectives.algorithms import two_shot
from dtenjax._src.collectives.algorithms import xla
from dtenjax._src.topology.model import Topology

REGISTRY: tuple[base.Algorithm, ...] = (
    nvlink.ONE_SHOT,
    nvlink.TWO_SHOT,
    host.RING,
    host.HIERARCHICAL,
    xla.ALGORITHM,
    ring.ALGORITHM,
    hierarchical.ALGORITHM,
    one_shot.ALGORITHM,
    two_shot.ALGORITHM,
    butterfly.ALGORITHM,
)

# The public algorithms: every record's family, those with an XLA-native record of that name first.
FAMILIES = tuple(dict.fromkeys(a.family for a in sorted(REGISTRY, key=lambda a: a.name != a.family)))
# A family none of whose records can run the call may name a stand-in: algorithm="xla" with
# deterministic=True where XLA's order is not provably fixed keeps XLA's collectives for data
# movement only (all-gather + the rank-order fold of one_shot).
STAND_INS = {"xla": "one_shot"}


def names() -> tuple[str, ...]:
  """Every value ``algorithm=`` accepts: "auto", the families, then the record names."""
  return ("auto",) + FAMILIES + tuple(a.name for a in REGISTRY if a.name not in FAMILIES)


def get(name: str) -> base.Algorithm:
  for a in REGISTRY:
    if a.name == name:
      return a
  raise errors.CollectiveError(f"no algorithm record named {name!r}; known: {list(names())}")


class AlgorithmChoice(NamedTuple):
  """What was chosen for one collective and why: data for ``explain``."""
  algorithm: str                  # the record name, e.g. "xla", "two_shot", "nvlink_one_shot"
  times: dict[str, float]         # the cost model's seconds for every record that supports it
  reason: str


def supported(call: base.Call) -> tuple[list[base.Algorithm], dict[str, str]]:
  """Records that can run ``call`` (registry order) and, for the others, why not."""
  ok, why = [], {}
  for a in REGISTRY:
    reason = a.why_not(call)
    if reason is None:
      ok.append(a)
    else:
      why[a.name] = reason
  return ok, why


@functools.cache
def _detected() -> Topology:
  return Topology.detect()


def _rank(call: base.Call, records: Sequence[base.Algorithm], group: Sequence[int],
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


def choose(call: base.Call, group: Sequence[int], topology: Topology) -> AlgorithmChoice:
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


def resolve(requested: str, call: base.Call, group: Sequence[int],
            topology: Topology | None) -> AlgorithmChoice:
  """The record that runs ``call`` for ``algorithm=requested`` (auto, a family, or a record)."""
  if requested == "auto":
    return choose(call, group, topology if topology is not None else Topology.current())
  if requested in FAMILIES:
    tried, skipped = [], []
    for a in REGISTRY:
      if a.family != requested:
        continue
      reason = a.why_not(call)
      if reason is None:
        if skipped:
          config.log_fallback(f"{requested}:{skipped[0]}",
                              f"dtenjax: algorithm={requested!r} runs as {a.name} ({skipped[0]})")
        return AlgorithmChoice(a.name, {}, f"algorithm={requested!r}: {a.name}")
      tried.append(f"{a.name}: {reason}")
      if a.applies(call):
        skipped.append(f"{a.name}: {reason}")
    stand_in = STAND_INS.get(requested)
    if stand_in is not None and get(stand_in).why_not(call) is None:
      config.log_fallback(f"{requested}:stand-in:{tried[0]}",
                          f"dtenjax: algorithm={requested!r} runs as {stand_in} ({tried[0]})")
      return AlgorithmChoice(stand_in, {}, f"algorithm={requested!r}: {stand_in} ({tried[0]})")
    raise errors.CollectiveError(errors.join_problems(
        f"algorithm={requested!r} cannot run this {call.kind} (op={call.op!r}, dtype="
        f"{call.dtype.name}, axes={call.axes!r}):", tried))
  record = get(requested)
  reason = record.why_not(call)
  if reason is not None:
    raise errors.CollectiveError(
        f"algorithm={requested!r} cannot run this {call.kind} (op={call.op!r}, dtype="
        f"{call.dtype.name}, axes={call.axes!r}): {reason}. Use algorithm={record.family!r} "
        "or 'auto' to let dtenjax pick one that can.")
  return AlgorithmChoice(record.name, {}, f"algorithm={requested!r}")
