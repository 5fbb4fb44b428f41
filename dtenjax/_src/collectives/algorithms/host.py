"""``host_ring`` / ``host_hierarchical``: all-reduce across processes over dtenjax's host transport
(``net/hostcoll.py``: authenticated TCP or RDMA verbs rings, asynchronous FFI calls).

Used when the reduced axes span processes and either the caller asks for it
(``algorithm="ring"``/``"hierarchical"`` or the record name) or XLA's own collectives cannot
reach the other processes; ``auto`` never sends arrays through the host when XLA can do the job.
Sums run in the accumulation dtype (float32 for 16-bit floats) and round once; ring chunk ``c`` is
combined in rank order ``c, c+1, ..., c-1`` (``hostcoll.reference_ring_sum``). Float max/min run on
order keys (int32), so NaN propagates like every other algorithm.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from dtenjax._src.collectives.algorithms import base
from dtenjax._src.net import hostcoll
from dtenjax._src.planning import costmodel


def _supports(family: str, call: base.Call) -> str | None:
  name = f"host_{family}"
  if call.kind != "all_reduce":
    return "the host transport only all-reduces"
  if call.processes <= 1:
    return "the axes do not span processes (the host transport joins processes)"
  if not call.mesh_axes:
    return f"axis_name={call.axes!r} includes a vmap axis; the host transport needs mesh axes"
  if call.xla_reaches_processes and call.requested not in (family, name):
    return (f"XLA's own collectives reach the other processes; the host transport runs only "
            f"when asked for (algorithm={family!r} or {name!r})")
  if family == "ring" and call.world != call.processes:
    return (f"host_ring needs one device per process along {call.axes!r} (world {call.world}, "
            f"{call.processes} processes); use algorithm='hierarchical' with "
            "axis_name=(process_axis, local_axis)")
  if family == "hierarchical" and (len(call.axes) != 2 or call.axis_sizes[0] != call.processes):
    return (f"host_hierarchical needs axis_name=(process_axis, local_axis) with one process per "
            f"entry of the first axis, got axes {call.axes!r} of sizes {call.axis_sizes}")
  dtype = base.acc_dtype(call.dtype, call.op)
  if call.op in ("max", "min") and base.uses_keys(dtype):
    dtype = jnp.dtype(jnp.int32 if dtype.itemsize <= 4 else jnp.int64)
  if dtype not in [jnp.dtype(d) for d in hostcoll.DTYPES]:
    return (f"the host transport does not carry {call.dtype.name} (it carries "
            f"{[jnp.dtype(d).name for d in hostcoll.DTYPES]})")
  return None


def _name(axes):
  return axes[0] if len(axes) == 1 else axes


def _origin(call: base.Call) -> str:
  """What the caller reduces, for the transport's fingerprint: the ring may carry a widened or
  keyed form of it (bfloat16 as float32), and ranks that differ in it must not be combined."""
  return f"{call.dtype.name} contract={call.contract.value}"


def _all_reduce(family: str, x, call: base.Call, finish):
  axis = _name(call.axes)
  if call.op in ("max", "min"):
    if base.uses_keys(x.dtype):
      k = base.to_key(x, call.op)
      wide = jnp.int32 if k.dtype.itemsize <= 4 else jnp.int64
      red = hostcoll.all_reduce(k.astype(wide), axis, algorithm=family, op=call.op, tag=call.tag,
                                origin=_origin(call))
      return finish(base.from_key(red.astype(k.dtype), x.dtype))
    return finish(hostcoll.all_reduce(x, axis, algorithm=family, op=call.op, tag=call.tag,
                                      origin=_origin(call)))
  acc = x.astype(base.acc_dtype(x.dtype, call.op))
  return finish(hostcoll.all_reduce(acc, axis, algorithm=family, op="sum", tag=call.tag,
                                    origin=_origin(call)))


def _code_max(family: str, codes, call: base.Call):
  red = hostcoll.all_reduce(codes.astype(jnp.int32), _name(call.axes), algorithm=family, op="max",
                            tag=call.tag, origin=_origin(call) + " codes")
  return red.astype(codes.dtype)


def _ring_time(t: costmodel.Terms, N: float) -> float:
  return 2 * (t.n - 1) * (t.S + t.a) + 2 * (t.n - 1) / t.n * N * t.b + 2 * N * t.m


def _hierarchical_time(t: costmodel.Terms, N: float) -> float:
  """XLA reduce-scatter in the process, host ring of N/k across processes, XLA all-gather; inf
  without a proper island split of the group."""
  s = t.split()
  if s is None:
    return costmodel.INF
  inner = 2 * (t.L + s.ia + (s.k - 1) / s.k * N * s.ib)
  outer = 2 * (s.m - 1) * (t.S + s.oa) + 2 * (s.m - 1) / s.m * (N / s.k) * s.ob
  return inner + outer + 3 * N * t.m


def _code_max_time(t: costmodel.Terms, E: float) -> float:
  """The word exchange's MAX of the codes, as int32 over the host ring."""
  return _ring_time(t, 4 * E)


_TIME = {"ring": _ring_time, "hierarchical": _hierarchical_time}


def _record(family: str) -> base.Algorithm:
  return base.Algorithm(
      name=f"host_{family}", family=family,
      order=("chunk c: ranks c, c+1, ..., c-1 (mod n)" if family == "ring" else
             "XLA reduce-scatter in the process, host ring across processes, XLA all-gather"),
      cost=costmodel.Cost(all_reduce=_TIME[family], code_max=_code_max_time),
      supports=functools.partial(_supports, family),
      all_reduce=functools.partial(_all_reduce, family),
      code_max=functools.partial(_code_max, family),
      applies=lambda call: call.processes > 1)


RING = _record("ring")
HIERARCHICAL = _record("hierarchical")
