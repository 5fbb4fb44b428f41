"""``nvlink_one_shot`` / ``nvlink_two_shot``: the NVLink peer-to-peer CUDA kernels (``gpu/p2p.py``).

Same bits as the XLA-native form of their family (the p2p contract): sum/mean are the rank-order
float32 fold rounded once (``one_shot``'s order; two_shot reduces each segment on its owner with the
same fold), max/min propagate NaN, the reproducible sums (contract v3, and v2 for
``reproducible="v2"``) are fused into the kernel. Which calls they take is the NVLink gate's
answer (``p2p.gate``), which their price records' ``supports`` return. The
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
from dtenjax._src.pricing import algorithms as prices

_TWIN = {"one_shot": one_shot.ALGORITHM, "two_shot": two_shot.ALGORITHM}


def _all_reduce(family: str, x, call: base.Call, finish):
  twin = _TWIN[family]
  return p2p.all_reduce(x, call.axes[0], algorithm=family, op=call.op,
                        fallback=lambda v: twin.all_reduce(v, call, finish))


def _reproducible(family: str, stack, call: base.Call):
  fallback = lambda v: repro.all_reduce(v[None], call, xla.ALGORITHM)
  return p2p.all_reduce(stack[0], call.axes[0], algorithm=family, op=call.op,
                        contract=call.contract, fallback=fallback)


_PRICE = {"one_shot": prices.NVLINK_ONE_SHOT, "two_shot": prices.NVLINK_TWO_SHOT}


def _record(family: str) -> base.Algorithm:
  return base.Algorithm(
      price=_PRICE[family], all_reduce=functools.partial(_all_reduce, family),
      reproducible=functools.partial(_reproducible, family))


ONE_SHOT = _record("one_shot")
TWO_SHOT = _record("two_shot")
