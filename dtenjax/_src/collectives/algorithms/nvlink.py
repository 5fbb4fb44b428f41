"""``nvlink_one_shot`` / ``nvlink_two_shot``: the NVLink peer-to-peer CUDA kernels (``gpu/p2p.py``).

Same bits as the XLA-native form of their family (the p2p contract): sum/mean are the rank-order
float32 fold rounded once (``one_shot``'s order; two_shot reduces each segment on its owner with the
same fold), max/min propagate NaN, the reproducible sums (contract v3, and v2 for
``reproducible="v2"``) are fused into the kernel. Which calls they take is the NVLink gate's
answer (``p2p.gate``), which :func:`supports` returns. The
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
  """None when the NVLink gate (``gpu/p2p.gate``, the one place that checks the kernels'
  conditions) admits ``call``, else its reason."""
  verdict = p2p.gate(world=call.world, dtype=call.dtype, op=call.op, contract=call.contract,
                     backend=call.backend, kind=call.kind, axes=call.axes,
                     vmap_axes=() if call.mesh_axes else call.axes,
                     contributions=call.contributions)
  return None if verdict.ok else verdict.reason


def _all_reduce(family: str, x, call: base.Call, finish):
  twin = _TWIN[family]
  return p2p.all_reduce(x, call.axes[0], algorithm=family, op=call.op,
                        fallback=lambda v: twin.all_reduce(v, call, finish))


def _reproducible(family: str, stack, call: base.Call):
  fallback = lambda v: repro.all_reduce(v[None], call, xla.ALGORITHM)
  return p2p.all_reduce(stack[0], call.axes[0], algorithm=family, op=call.op,
                        contract=call.contract, fallback=fallback)


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
