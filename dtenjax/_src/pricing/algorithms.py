"""The price side of every collective algorithm: a :class:`Record` per algorithm says which calls it
can run (``supports``), in what order it reduces (``order``, words for docs and ``explain``) and
what it costs (``cost``, formulas in ``costmodel``'s terms).

The collectives layer builds each runnable algorithm (``collectives/algorithms/<name>.py``) from
its record here plus the implementation; the planner and ``algorithm="auto"`` rank records
through ``pricing/registry.py``. Nothing here traces or runs anything, so the planner prices
collectives without importing the layer that runs them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

from dtenjax._src.gpu import p2p
from dtenjax._src.net import hostcoll
from dtenjax._src.pricing import costmodel
from dtenjax._src.pricing.calls import Call
from dtenjax._src.pricing.calls import acc_dtype
from dtenjax._src.pricing.calls import uses_keys
from dtenjax._src.pricing.calls import wire_bytes
from dtenjax._src.pricing.calls import xla_reaches


@dataclasses.dataclass(frozen=True)
class Record:
  """What one algorithm can run and what it costs.

  Attributes:
    name: registry key; ``algorithm=name`` forces it.
    family: the public algorithm it implements; ``algorithm=family`` takes the first record of
      the family (registry order) that supports the call.
    order: the reduction order it guarantees, in words.
    cost: its cost formulas (:class:`costmodel.Cost`).
    supports: ``call -> None`` when it can run the call, else the reason it cannot.
    has_reduce_scatter: whether it implements a reduce-scatter.
    applies: whether it is relevant to the call at all (its backend, a process span); a family
      passes silently over records that do not apply.
    by_last_axis: its schedule's first stage runs over the call's last axis, so it is priced
      with the group split by that axis (``costmodel.collective_time``'s ``inner``).
    carried: ``call -> w``, the bytes one value of its partial sums takes per byte of the
      call's input (``costmodel.Terms.w``; default :func:`partial_sum_bytes`: 2 for a sum of
      16-bit floats, accumulated in float32); its cost formulas put ``w`` on the phases that
      send partial sums.
  """
  name: str
  family: str
  order: str
  cost: costmodel.Cost
  supports: Callable[[Call], str | None]
  has_reduce_scatter: bool = True
  applies: Callable[[Call], bool] = lambda call: True
  by_last_axis: bool = False
  carried: Callable[[Call], float] = lambda call: partial_sum_bytes(call)

  def why_not(self, call: Call) -> str | None:
    """None when this record can run ``call``; otherwise the reason (kind checks included)."""
    if call.kind == "reduce_scatter" and not self.has_reduce_scatter:
      return (f"{self.name} has no reduce_scatter; use algorithm='auto', 'two_shot' or "
              "'ring'")
    return self.supports(call)

  def time(self, call: Call, group, topology,
           costs: costmodel.BackendCosts | None = None) -> float:
    """The cost model's seconds for this record running ``call`` over the device ids ``group``.

    A sum of 16-bit floats sends float32 where the record's program sends partial sums
    (``carried``); a bfloat16 sum on CPU devices everywhere: XLA:CPU compiles every bfloat16
    collective in float32 with conversions around it (the compiled HLO of each record's
    bfloat16 program: tests/test_costmodel_wire.py), so there the call is priced as the
    float32 sum it runs. Its float16 collectives stay float16: priced as on a GPU. A
    reproducible all-reduce's own formula (``cost.reproducible``: one_shot's and two_shot's
    exchange of the raw floats) is priced there at the float32 bytes too; the word exchange's
    int32 words (every reproducible reduce-scatter's) are not widened."""
    nbytes, carried = int(call.nbytes), self.carried(call)
    wide = wire_bytes(call.dtype, call.backend)
    own = call.kind == "all_reduce" and self.cost.reproducible is not None
    if wide > 1 and partial_sum_bytes(call) > 1 and (not call.reproducible or own):
      nbytes, carried = int(nbytes * wide), 1.0
    return costmodel.collective_time(
        call.kind, nbytes, list(group), topology, self.cost,
        reproducible=call.contract,
        itemsize=call.itemsize, contributions=call.contributions, costs=costs,
        inner=call.axis_sizes[-1] if self.by_last_axis and len(call.axis_sizes) > 1 else None,
        carried=carried)


def partial_sum_bytes(call: Call) -> float:
  """Bytes per byte of input of a partial sum of ``call`` (``acc_dtype``): 2 for a sum or mean of
  bfloat16 / float16 (float32 partials), 1 otherwise (max/min run on order keys of the input's
  width)."""
  return acc_dtype(call.dtype, call.op).itemsize / call.itemsize


# --- xla: XLA's own psum / psum_scatter ----------------------------------------------------------

def psum_order(call: Call) -> tuple[str | None, str]:
  """``(order, why)``: the fixed order of XLA's reduction for ``call``, or None and the reason
  (the research behind each case: ``collectives/algorithms/xla.py``)."""
  if call.backend == "cpu":
    if call.processes <= 1:
      return ("rank-order left fold from +0 (XLA:CPU in-process communicator; bf16 promoted to "
              "f32)", "")
    impl = getattr(jax.config, "jax_cpu_collectives_implementation", None)
    if impl == "gloo":
      return "gloo ring: per chunk, a fixed chain around the ring (depends on size and n)", ""
    return None, f"XLA:CPU across processes uses {impl!r} collectives, whose order is not pinned"
  if call.backend == "gpu":
    problems = []
    # planning (call.nvls from the Topology) reads nothing from the environment: the Topology
    # describes the machine; a traced collective reads the process's NCCL settings
    planning = call.nvls is not None
    nvls = call.nvls if planning else os.environ.get("NCCL_NVLS_ENABLE", "") != "0"
    if nvls:
      problems.append("NVLink SHARP may be used (set NCCL_NVLS_ENABLE=0)")
    if not planning and os.environ.get("NCCL_COLLNET_ENABLE", "0") not in ("", "0"):
      problems.append("CollNet is enabled (NCCL_COLLNET_ENABLE)")
    if not planning and os.environ.get("NCCL_TUNER_PLUGIN", "") not in ("", "none"):
      problems.append("an NCCL tuner plugin is loaded (NCCL_TUNER_PLUGIN)")
    if problems:
      return None, "NCCL's order is not fixed here: " + "; ".join(problems)
    return "NCCL/XLA kernel: fixed by NCCL's static model for this size and environment", ""
  return None, f"the reduction order of {call.backend!r} collectives has not been established"


def _xla_supports(call: Call) -> str | None:
  why = xla_reaches(call)
  if why:
    return why
  if call.deterministic and not call.exact and not call.reproducible:
    order, reason = psum_order(call)
    if order is None:
      return (f"deterministic=True needs a fixed reduction order and {reason}; use a dtenjax "
              "algorithm ('one_shot', 'two_shot', 'ring') or deterministic=False")
  return None


XLA = Record(
    name="xla", family="xla",
    order="XLA's: fixed where psum_order() establishes it (CPU, gloo, pinned NCCL)",
    cost=costmodel.XLA, supports=_xla_supports)


# --- one_shot: all-gather everything, a rank-order fold ------------------------------------------

def _one_shot_all_reduce(t: costmodel.Terms, N: float) -> float:
  """All-gather (n N written) and a fold reading n N."""
  return t.L + t.hops * t.a + (t.n - 1) * N * t.b + t.P + 2 * t.n * N * t.m


def _one_shot_reduce_scatter(t: costmodel.Terms, N: float) -> float:
  """Gather everything, fold the owned block."""
  return t.L + t.hops * t.a + (t.n - 1) * N * t.b + t.P + (t.n + 1) * N * t.m


def _one_shot_reproducible(t: costmodel.Terms, N: float, itemsize: int, k: int) -> float:
  """The raw floats all-gathered (``k`` per device), every rank converts all ``n k N``."""
  del itemsize
  n = t.n
  return (t.L + t.hops * t.a + (n - 1) * k * N * t.b + t.P + n * k * N * t.m +
          n * k * N * t.f)


ONE_SHOT = Record(
    name="one_shot", family="one_shot",
    order="ranks 0, 1, ..., n-1 (left fold from x_0, accumulation dtype, one rounding)",
    cost=costmodel.Cost(all_reduce=_one_shot_all_reduce, reduce_scatter=_one_shot_reduce_scatter,
                        reproducible=_one_shot_reproducible),
    supports=xla_reaches)


# --- two_shot: all-to-all reduce-scatter, a fold of the owned chunk, all-gather ------------------

def _two_shot_all_reduce(t: costmodel.Terms, N: float) -> float:
  """All-to-all (N), a fold of the owned chunk over n ranks (N), all-gather (N)."""
  return 2 * t.L + 2 * t.hops * t.a + 2 * (t.n - 1) / t.n * N * t.b + t.P + 3 * N * t.m


def _two_shot_reduce_scatter(t: costmodel.Terms, N: float) -> float:
  """All-to-all, fold the owned block."""
  n = t.n
  return t.L + t.hops * t.a + (n - 1) / n * N * t.b + t.P + 2 * N * t.m


def _two_shot_reproducible(t: costmodel.Terms, N: float, itemsize: int, k: int) -> float:
  """The raw floats all-to-all (``k`` per device), the owner converts ``k N``, the rounded chunk
  all-gathered."""
  del itemsize
  n = t.n
  return (2 * t.L + 2 * t.hops * t.a + (n - 1) / n * (k + 1) * N * t.b + t.P +
          (k + 1) * N * t.m + k * N * t.f + N / n * t.f)


TWO_SHOT = Record(
    name="two_shot", family="two_shot",
    order="ranks 0, 1, ..., n-1 on the owned chunk (same bits as one_shot)",
    cost=costmodel.Cost(all_reduce=_two_shot_all_reduce, reduce_scatter=_two_shot_reduce_scatter,
                        reproducible=_two_shot_reproducible),
    supports=xla_reaches)


# --- ring: n - 1 ppermute steps, then an all-gather ----------------------------------------------

def _ring_all_reduce(t: costmodel.Terms, N: float) -> float:
  """n - 1 ppermutes of N/n, each followed by an add of N/n, then one all-gather of N/n each.
  The ppermutes send partial sums (``w``: float32 for a bfloat16 sum), the all-gather the
  result in the input's dtype."""
  steps = t.n - 1
  gather = t.L + t.hops * t.a + (t.n - 1) / t.n * N * t.b
  return steps * (t.L + t.a + t.w * N / t.n * t.b) + steps * t.P + gather + 3 * N * t.m


def _ring_reduce_scatter(t: costmodel.Terms, N: float) -> float:
  """The n - 1 ppermute steps of the all-reduce (partial sums), without the all-gather."""
  n = t.n
  return (n - 1) * (t.L + t.a + t.w * N / n * t.b) + (n - 1) * t.P + 2 * N * t.m


RING = Record(
    name="ring", family="ring",
    order="chunk c of the padded flat buffer: ranks c+1, c+2, ..., c (mod n)",
    cost=costmodel.Cost(all_reduce=_ring_all_reduce, reduce_scatter=_ring_reduce_scatter),
    supports=xla_reaches)


# --- hierarchical: inside the islands, then across -----------------------------------------------

def _hierarchical_supports(call: Call) -> str | None:
  if len(call.axes) < 2:
    return (f"hierarchical needs two mesh axes (islands, devices per island), got "
            f"axis_name={call.axes!r}; pass e.g. axis_name=('host', 'local') or use "
            "algorithm='two_shot'/'ring'")
  return xla_reaches(call)


def _island_split(t: costmodel.Terms) -> costmodel.Split | None:
  """The two levels the schedule runs on, where the group spans several islands (else None: no
  slow link to spare). With the call's last axis known (``t.inner``), the group split by it;
  else the group's island split where every island is a run of consecutive ranks (the
  schedule's first stage runs over the last axis of ``axis_name``, so only then are its first
  stage's peers an island's; with the islands' axis first, ``("local", "host")``, it would run
  across the islands), and None otherwise."""
  islands = _islands(tuple(t.group), t.topology)
  if islands is None:
    return None
  if t.inner is not None:
    return t.split()
  s = t.split()
  return s if all(frozenset(t.group[j:j + s.k]) in islands
                  for j in range(0, len(t.group), s.k)) else None


@functools.lru_cache(maxsize=4096)
def _islands(group: tuple[int, ...], topology) -> frozenset | None:
  """The islands of ``group``'s proper island split, as sets, or None without one."""
  parts = costmodel.island_groups(group, topology)
  return None if parts is None else frozenset(frozenset(p) for p in parts)


def _hierarchical_all_reduce(t: costmodel.Terms, N: float) -> float:
  """Inner all-to-all reduce-scatter, one-shot of N/k across islands, inner all-gather; inf
  without an island split of the group whose islands are runs of consecutive ranks. The inner
  stages send the input's dtype, the one-shot across the island partial sums (``w``). The
  all-to-all reaches each peer directly (``Split.inner_all_to_all``: where the inner axis spans
  hosts, a rank's peers on its own host over the in-host link); the all-gathers are rings, each
  step as slow as the level's slowest link."""
  s = _island_split(t)
  if s is None:
    return costmodel.INF
  gather = t.L + s.inner_hops * s.ia + (s.k - 1) / s.k * N * s.ib
  inner = t.L + s.inner_all_to_all(N) + gather
  outer = t.L + s.outer_hops * s.oa + (s.m - 1) * (t.w * N / s.k) * s.ob
  return inner + outer + 2 * t.P + (3 * N + 2 * s.m * N / s.k) * t.m


def _hierarchical_reduce_scatter(t: costmodel.Terms, N: float) -> float:
  """Inner all-to-all reduce-scatter of N on the fast link, outer all-to-all reduce-scatter of
  the island's N/k on the slow one (each byte crosses it once, a partial sum: ``w``), each
  all-to-all reaching a rank's peers on its own host over the in-host link where its level
  spans hosts (``Split.inner_all_to_all`` / ``outer_all_to_all``); local
  traffic: the chunks copied out (N), the inner fold (N read, N/k written), the outer fold (N/k
  read); inf without an island split of the group whose islands are runs of consecutive
  ranks."""
  s = _island_split(t)
  if s is None:
    return costmodel.INF
  inner = t.L + s.inner_all_to_all(N)
  outer = t.L + s.outer_all_to_all(t.w * N / s.k)
  return inner + outer + 2 * t.P + (2 * N + 2 * N / s.k) * t.m


HIERARCHICAL = Record(
    name="hierarchical", family="hierarchical",
    order="sum over outer ranks (in order) of the inner-axis sums (ranks 0..m-1)",
    cost=costmodel.Cost(all_reduce=_hierarchical_all_reduce,
                        reduce_scatter=_hierarchical_reduce_scatter),
    supports=_hierarchical_supports, by_last_axis=True)


# --- butterfly: recursive halving, then an all-gather --------------------------------------------

def _butterfly_supports(call: Call) -> str | None:
  n = call.world
  if n & (n - 1):
    return (f"butterfly needs a power-of-two number of ranks, got {n} over "
            f"axis_name={call.axes!r}; use algorithm='two_shot' or 'ring'")
  return xla_reaches(call)


def _butterfly_reduce_scatter(t: costmodel.Terms, N: float) -> float:
  """log2(n) exchanges of N/2, N/4, ..., N/n (an add after each): (n-1)/n N over the links, of
  partial sums (``w``)."""
  steps = t.n.bit_length() - 1
  return steps * (t.L + t.a + t.P) + (t.n - 1) / t.n * t.w * N * t.b + 2 * N * t.m


def _butterfly_all_reduce(t: costmodel.Terms, N: float) -> float:
  """The reduce-scatter, then one all-gather of N/n from each rank (the input's dtype)."""
  gather = t.L + t.hops * t.a + (t.n - 1) / t.n * N * t.b
  return _butterfly_reduce_scatter(t, N) + gather + N * t.m


BUTTERFLY = Record(
    name="butterfly", family="butterfly",
    order="balanced binary tree over ranks 0..n-1, lower block first: ((x_0 + x_1) + (x_2 + "
          "x_3)) + ...; the same for every element",
    cost=costmodel.Cost(all_reduce=_butterfly_all_reduce,
                        reduce_scatter=_butterfly_reduce_scatter),
    supports=_butterfly_supports)


# --- nvlink_one_shot / nvlink_two_shot: the NVLink peer-to-peer kernels --------------------------

def _nvlink_supports(call: Call) -> str | None:
  """None when the NVLink gate (``gpu/p2p.gate``, the one place that checks the kernels'
  conditions) admits ``call``, else its reason."""
  verdict = p2p.gate(world=call.world, dtype=call.dtype, op=call.op, contract=call.contract,
                     backend=call.backend, kind=call.kind, axes=call.axes,
                     vmap_axes=() if call.mesh_axes else call.axes,
                     contributions=call.contributions)
  return None if verdict.ok else verdict.reason


def _nvlink_one_shot_time(t: costmodel.Terms, N: float) -> float:
  """The kernel reads every peer's buffer (n N) and writes the result (N); inf for a group that
  leaves the host (peer memory does not reach another host)."""
  if not t.intra_host:
    return costmodel.INF
  return t.K + 2 * t.a + (t.n - 1) * N * t.b + (t.n + 1) * N * t.m


def _nvlink_two_shot_time(t: costmodel.Terms, N: float) -> float:
  """Each rank reduces its segment from every peer, then every rank reads the segments; inf for
  a group that leaves the host."""
  if not t.intra_host:
    return costmodel.INF
  return t.K + 4 * t.a + 2 * (t.n - 1) / t.n * N * t.b + 3 * N * t.m


def _nvlink_record(family: str, plain: costmodel.Formula) -> Record:
  def reproducible_time(t: costmodel.Terms, N: float, itemsize: int, k: int) -> float:
    """The plain kernel's time; the peers' floats are converted in registers as they are read
    (``n N`` bytes)."""
    del itemsize, k
    return plain(t, N) + t.n * N * t.f
  return Record(
      name=f"nvlink_{family}", family=family,
      order=f"as {family}: ranks 0..n-1, float32, one rounding (reproducible: contract v3/v2)",
      cost=costmodel.Cost(all_reduce=plain, reproducible=reproducible_time),
      supports=_nvlink_supports, has_reduce_scatter=False,
      applies=lambda call: call.backend == "gpu")


NVLINK_ONE_SHOT = _nvlink_record("one_shot", _nvlink_one_shot_time)
NVLINK_TWO_SHOT = _nvlink_record("two_shot", _nvlink_two_shot_time)


# --- host_ring / host_hierarchical: dtenjax's host transport across processes --------------------

def _host_supports(family: str, call: Call) -> str | None:
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
  dtype = acc_dtype(call.dtype, call.op)
  if call.op in ("max", "min") and uses_keys(dtype):
    dtype = jnp.dtype(jnp.int32 if dtype.itemsize <= 4 else jnp.int64)
  if dtype not in [jnp.dtype(d) for d in hostcoll.DTYPES]:
    return (f"the host transport does not carry {call.dtype.name} (it carries "
            f"{[jnp.dtype(d).name for d in hostcoll.DTYPES]})")
  return None


def _host_ring_time(t: costmodel.Terms, N: float) -> float:
  """The transport's ring, reduce-scatter and all-gather, in the carried dtype (``w``)."""
  return 2 * (t.n - 1) * (t.S + t.a) + 2 * (t.n - 1) / t.n * t.w * N * t.b + 2 * N * t.m


def _host_hierarchical_time(t: costmodel.Terms, N: float) -> float:
  """XLA reduce-scatter in the process, host ring of N/k across processes, XLA all-gather, all
  in the carried dtype (``w``); inf without a proper island split of the group."""
  s = t.split()
  if s is None:
    return costmodel.INF
  inner = 2 * (t.L + s.ia + (s.k - 1) / s.k * t.w * N * s.ib)
  outer = 2 * (s.m - 1) * (t.S + s.oa) + 2 * (s.m - 1) / s.m * (t.w * N / s.k) * s.ob
  return inner + outer + 3 * N * t.m


def _host_code_max_time(t: costmodel.Terms, E: float) -> float:
  """The word exchange's MAX of the codes, as int32 over the host ring."""
  return _host_ring_time(t, 4 * E)


def _host_carried(call: Call) -> float:
  """What the host transport carries per byte of input: sums in the accumulation dtype, float
  max/min as order keys widened to at least int32 (``collectives/algorithms/host.py``)."""
  if call.op in ("max", "min") and uses_keys(call.dtype):
    return max(call.itemsize, 4) / call.itemsize
  return partial_sum_bytes(call)


def _host_record(family: str, time: costmodel.Formula) -> Record:
  return Record(
      name=f"host_{family}", family=family,
      order=("chunk c: ranks c, c+1, ..., c-1 (mod n)" if family == "ring" else
             "XLA reduce-scatter in the process, host ring across processes, XLA all-gather"),
      cost=costmodel.Cost(all_reduce=time, code_max=_host_code_max_time),
      supports=functools.partial(_host_supports, family), has_reduce_scatter=False,
      applies=lambda call: call.processes > 1, carried=_host_carried)


HOST_RING = _host_record("ring", _host_ring_time)
HOST_HIERARCHICAL = _host_record("hierarchical", _host_hierarchical_time)
