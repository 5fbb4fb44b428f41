"""``nvlink_one_shot`` / ``nvlink_two_shot``: the NVLink peer-to-peer CUDA kernels (``gpu/p2p.py``).

Same bits as the XLA-native form of their family (the p2p contract): sum/mean are the rank-order
float32 fold rounded once (``one_shot``'s order; two_shot reduces each segment on its owner with the
same fold), max/min propagate NaN, the reproducible sums (contract v3, and v2 for
``reproducible="v2"``) are fused into the kernel. The
concrete mesh is resolved by ``p2p`` at lowering time; when its set-up fails there it logs why
once and lowers ``fallback`` instead, which is the bit-identical XLA-native form computed here.
"""

from __future__ import annotations

import functools

from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import one_shot
from dtenjax._src.collectives.algorithms import two_shot
from dtenjax._src.collectives.algorithms import xla
from dtenjax._src.gpu import p2p
from dtenjax._src.planning import costmodel

_TWIN = {"one_shot": one_shot.ALGORITHM, "two_shot": two_shot.ALGORITHM}


def supports(call: base.Call) -> str | None:
  if call.backend != "gpu":
    return f"the NVLink kernels run on GPUs (backend {call.backend!r})"
  if call.kind != "all_reduce":
    return "the NVLink kernels only all-reduce"
  if len(call.axes) != 1 or not call.mesh_axes:
    return (f"the NVLink kernels reduce over one mesh axis of a shard_map/mesh_map, got "
            f"axis_name={call.axes!r}" + ("" if call.mesh_axes else " (a vmap axis)"))
  if call.reproducible and call.contributions != 1:
    return (f"the fused reproducible kernel takes one contribution per GPU, got "
            f"{call.contributions} stacked on local_axis")
  ok, why = p2p.supported(call.world, call.nbytes, call.dtype, op=call.op,
                          reproducible=call.reproducible)
  return None if ok else why


def _all_reduce(family: str, x, call: base.Call, finish):
  twin = _TWIN[family]
  return p2p.all_reduce(x, call.axes[0], algorithm=family, op=call.op, reproducible=False,
                        fallback=lambda v: twin.all_reduce(v, call, finish))


def _reproducible(family: str, stack, call: base.Call):
  fallback = lambda v: repro.all_reduce(v[None], call, xla.ALGORITHM)
  return p2p.all_reduce(stack[0], call.axes[0], algorithm=family, op=call.op,
                        reproducible=call.contract, fallback=fallback)


def _one_shot_time(t: costmodel.Terms, N: float) -> float:
  """The kernel reads every peer's buffer (n N) and writes the result (N); inf for a group that
  leaves the host (peer memory does not reach another host)."""
  if not t.intra_host:
    return costmodel.INF
  return t.K + 2 * t.a + (t.n - 1) * N * t.b + (t.n + 1) * N * t.m


def _two_shot_time(t: costmodel.Terms, N: float) -> float:
  """Each rank reduces its segment from every peer, then every rank reads the segments; inf for
  a group that leaves the host."""
  if not t.intra_host:
    return costmodel.INF
  return t.K + 4 * t.a + 2 * (t.n - 1) / t.n * N * t.b + 3 * N * t.m


_TIME = {"one_shot": _one_shot_time, "two_shot": _two_shot_time}


def _cost(family: str) -> costmodel.Cost:
  plain = _TIME[family]

  def reproducible_time(t: costmodel.Terms, N: float, itemsize: int, k: int) -> float:
    """The plain kernel's time; the peers' floats are converted in registers as they are read
    (``n N`` bytes)."""
    del itemsize, k
    return plain(t, N) + t.n * N * t.f
  return costmodel.Cost(all_reduce=plain, reproducible=reproducible_time)


def _record(family: str) -> base.Algorithm:
  return base.Algorithm(
      name=f"nvlink_{family}", family=family,
      order=f"as {family}: ranks 0..n-1, float32, one rounding (reproducible: contract v3/v2)",
      cost=_cost(family), supports=supports,
      all_reduce=functools.partial(_all_reduce, family),
      reproducible=functools.partial(_reproducible, family),
      applies=lambda call: call.backend == "gpu")


ONE_SHOT = _record("one_shot")
TWO_SHOT = _record("two_shot")
