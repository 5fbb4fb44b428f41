"""The algorithm registry: one runnable algorithm per price record, and the choice among them.

Order matters only within a family: ``algorithm="one_shot"`` takes the first record of that family
that supports the call (the NVLink kernel on GPU, the XLA-native form elsewhere), and
``algorithm="ring"`` across processes the host transport. ``algorithm="auto"`` takes what
``pricing/registry.py`` chooses: the cheapest record that supports the call by the cost model
(ties: the name that sorts first). A record's own name forces it (an error says why when it
cannot run the call).

Everything else is derived from :data:`REGISTRY`, which lists the algorithms in the order of the
price records (``pricing.registry.RECORDS``; the import fails if they differ): the families (and
so the values ``algorithm=`` accepts) and the candidates of ``auto``. The planner ranks the same
records from the pricing layer below, without importing this one.

Adding an algorithm: its price record (supports, order, cost formulas) in
``pricing/algorithms.py`` and a line in ``pricing/registry.py``; its implementation in
``algorithms/<name>.py`` (a :class:`~base.Algorithm` of that record) and a line below.
"""

from __future__ import annotations

from collections.abc import Sequence

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
from dtenjax._src.pricing import registry as prices
from dtenjax._src.pricing.registry import AlgorithmChoice as AlgorithmChoice
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
if tuple(a.price for a in REGISTRY) != prices.RECORDS:  # pragma: no cover - a list edited alone
  raise ImportError("collectives/algorithms/registry.py: REGISTRY must list one algorithm per "
                    "price record of pricing/registry.py's RECORDS, in the same order")

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


def supported(call: base.Call) -> tuple[list[base.Algorithm], dict[str, str]]:
  """Algorithms that can run ``call`` (registry order) and, for the others, why not."""
  ok, why = prices.supported(call)
  names = {r.name for r in ok}
  return [a for a in REGISTRY if a.name in names], why


def choose(call: base.Call, group: Sequence[int], topology: Topology) -> AlgorithmChoice:
  """The cheapest algorithm that supports ``call`` (``algorithm="auto"``)."""
  return prices.choose(call, group, topology)


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
