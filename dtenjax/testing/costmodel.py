"""The collective cost model, one algorithm record at a time, on a hand-built topology: what
bench/costmodel_check.py holds against measured times.

Users see the model's answers through ``dtenjax.plan_all_reduce(...)`` (``.times``: every record
that can run the call, on ``dtenjax.Topology.fixture`` / ``from_json`` / ``current``); a check of
the model also prices records ``algorithm="auto"`` would rule out, on a uniform topology of the
run's world size, and lists the ``algorithm=`` families a benchmark compares. For benchmarks and
tests; not part of the library's API.
"""

from dtenjax._src.collectives.algorithms.registry import FAMILIES as ALGORITHM_FAMILIES
from dtenjax._src.collectives.algorithms.registry import get as algorithm
from dtenjax._src.pricing.costmodel import collective_time as collective_time
from dtenjax._src.topology.model import uniform as uniform_topology
from dtenjax._src.topology.parts import DeviceInfo as DeviceInfo

__all__ = ["ALGORITHM_FAMILIES", "DeviceInfo", "algorithm", "collective_time", "uniform_topology"]
