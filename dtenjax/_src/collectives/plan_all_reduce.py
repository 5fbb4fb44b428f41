"""``plan_all_reduce``: the registry's choice for one collective as data, without tracing anything
(what ``algorithm="auto"`` of ``all_reduce``, ``reduce_scatter`` or ``all_gather`` would pick).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from dtenjax._src import errors
from dtenjax._src.collectives import common
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.topology.model import Topology

AlgorithmChoice = registry.AlgorithmChoice

def plan_all_reduce(nbytes: int, group: Sequence[int], topology: Topology | None = None, *,
                    op: str = "sum", dtype: Any = jnp.float32, deterministic: bool = True,
                    reproducible: bool | str = False, kind: str = "all_reduce",
                    axis_sizes: Sequence[int] | None = None, backend: str | None = None,
                    processes: int | None = None) -> AlgorithmChoice:
  """What ``algorithm="auto"`` would pick for one collective of ``nbytes`` per rank over the
  device ids ``group`` (rank order), without tracing anything.

  ``axis_sizes`` splits the group into mesh axes (default: one axis); ``backend`` and
  ``processes`` default to what ``topology`` (default :meth:`Topology.current`) says about the
  group's devices.
  """
  if kind not in base.KINDS:
    raise errors.CollectiveError(f"plan_all_reduce: kind={kind!r} is not one of {base.KINDS}")
  common.check_common("plan_all_reduce", op, "auto")
  contract = common.contract_of(op, reproducible)
  given = group
  try:
    group = [operator.index(g) for g in group]
  except TypeError:
    group = []
  if not group:
    raise errors.CollectiveError(
        f"plan_all_reduce: group={given!r} must list the device ids taking part, in rank order "
        "(e.g. [d.id for d in mesh.devices.flat])")
  twice = sorted({g for g in group if group.count(g) > 1})
  if twice:
    raise errors.CollectiveError(
        f"plan_all_reduce: group={given!r} names device {twice[0]} twice; list each device "
        "taking part once, in rank order (e.g. [d.id for d in mesh.devices.flat])")
  try:
    dtype = jnp.dtype(dtype)
  except TypeError:
    raise errors.CollectiveError(f"plan_all_reduce: dtype={dtype!r} is not a dtype; pass e.g. "
                                 "jnp.float32 or jnp.bfloat16") from None
  common.check_leaf("plan_all_reduce", dtype, op, contract)   # what all_reduce refuses
  topology = topology if topology is not None else Topology.current()
  sizes = tuple(int(s) for s in (axis_sizes or (len(group),)))
  if math.prod(sizes) != len(group):
    raise errors.CollectiveError(f"plan_all_reduce: axis_sizes={sizes} do not multiply to the "
                                 f"group size {len(group)}")
  infos = [topology.device(g) for g in group]
  backend = backend or infos[0].platform
  if processes is None:
    processes = len({d.process_index for d in infos})
  call = base.Call(kind=kind, op=op, dtype=dtype, axes=tuple(f"axis{i}" for i in range(len(sizes))),
                   axis_sizes=sizes, nbytes=int(nbytes), backend=backend,
                   deterministic=deterministic,
                   contract=contract, processes=processes,
                   xla_reaches_processes=common.xla_reaches_processes(backend), nvls=topology.nvls)
  return registry.choose(call, group, topology)
