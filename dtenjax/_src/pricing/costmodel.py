"""The one cost model of collectives: alpha-beta over a :class:`~dtenjax.Topology`, plus the fixed
costs of each backend.

An estimate adds three kinds of terms, all data rather than code:

* **links** -- ``alpha`` (seconds) and ``beta`` (seconds per byte) of the slowest link class in the
  group, from the topology's :class:`~dtenjax.LinkSpec` table (or measured by
  :meth:`Topology.probe`). Two-level forms charge the inner (island) and outer phases to their own
  links.
* **backend fixed costs** -- :class:`BackendCosts`, one record per platform (``cpu``, ``gpu``,
  ``tpu``): one XLA collective op beyond its link latency (dispatch, rendezvous, NCCL launch), one
  extra elementwise pass, one NVLink p2p kernel, one host-transport step, the memory bandwidth of
  local passes, and the throughput of the fixed-point conversion. :data:`BACKEND_COSTS` holds the
  defaults; a JSON file named by ``DTENJAX_COST_PARAMS`` (``{"format": "dtenjax.cost-params/1",
  "gpu": {"xla_collective_us": 21.0}}``, dtenjax/schemas/cost-params-1.schema.json; a file without
  "format" is read as that format) overrides fields, so calibrating from measurements never
  touches code.
* **local memory traffic** -- bytes read and written by each op / local bandwidth.

Each algorithm record owns its formulas (``cost``, a :class:`Cost`, in its own file under
``collectives/algorithms/``); this module is the language they are written in: :class:`Terms`
(for ``n`` participants, ``N`` bytes per participant, slowest link ``a``/``b``, ``h`` = 1 inside a
host or ``n - 1`` across a network, ``L`` = ``xla_collective_us``, ``P`` = ``local_pass_us``,
``K`` = ``nvlink_kernel_us``, ``S`` = ``host_step_us``, ``m`` = local seconds per byte, ``f`` =
seconds per byte of the fixed-point conversion), the link helpers (:func:`ring`,
:func:`xla_links`, :meth:`Terms.split`), XLA's own collectives (:data:`XLA`, which the ``xla``
record and ``explain`` use, ``L + 2a + 2(n-1)/n N b + 2 N m`` for an all-reduce in a host), the
reproducible word exchange every record without a fused form shares (:func:`word_exchange`), and
:func:`collective_time`, which prices one collective with one record's :class:`Cost`. The planner
and ``algorithm="auto"`` both rank through ``collectives/algorithms/registry.py``.

The model ranks algorithms; it does not promise microseconds. The ``cpu`` defaults were fitted to
``python bench/collectives.py --sizes 64,8K,1M --chain 32 --reps 9 --stat min`` on the 2-core
CI VM with 8 simulated devices (docs/collectives.md gives the command and the times); the ``gpu``
defaults come from the 2 x H200 measurements in docs/benchmarks.md and are meant to be
recalibrated from ``bench/allreduce.py`` through ``DTENJAX_COST_PARAMS``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from dtenjax._src import config
from dtenjax._src import contract as contract_lib
from dtenjax._src import errors
from dtenjax._src.contract import Contract
from dtenjax._src.topology.model import INTRA_HOST
from dtenjax._src.topology.model import LINK_ORDER
from dtenjax._src.topology.model import Topology

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ppermute")
INF = math.inf


@dataclasses.dataclass(frozen=True)
class BackendCosts:
  """Fixed costs of one backend that link specs do not capture (calibration data).

  Attributes:
    xla_collective_us: one XLA collective op beyond its link latency: dispatch and the
      rendezvous of the in-process CPU runtime, or an NCCL kernel launch on GPU.
    local_pass_us: one extra elementwise pass (a fused loop or kernel launch).
    local_bandwidth_gbps: bytes/s (1e9) of local passes; None uses the topology's ``local`` link.
    nvlink_kernel_us: launch plus peer-flag barrier of one NVLink p2p kernel (GPU only).
    host_step_us: one message step of the host transport (FFI call, socket round trip).
    fixed_point_gbps: float bytes/s (1e9) of the reproducible sum's conversion passes (codes,
      encode into int32 words and sum, decode), per byte of float input.
    overlap: share of a step's compute that collectives may hide behind (the planner's default
      ``overlap``). XLA:CPU's collectives are copies by the same cores that compute (0); a GPU
      runs NCCL kernels beside compute kernels.
    step_collective_us: what one collective adds inside a step beyond its own time: the
      rendezvous of devices that arrive after their share of compute (on a CPU, devices that
      share cores arrive one after another). :meth:`Topology.calibrate` measures it.
    product_fixed_rows: the work of one product beyond its multiply-adds that grows with its
      weight and not with the batch, in rows of the product (a ``[M, K] x [K, N]`` product costs
      as much as ``M + product_fixed_rows`` rows would): XLA:CPU's kernels pack the weight
      operand into their own layout on every call, and the backward transposes it and writes
      its whole gradient, however few rows a device multiplies (measured on CPU: 12-18 rows,
      below; 0 until the model prices what else tensor parallelism costs in a scanned loop).
      A GPU's kernels read the weight in place (0).
    update_split: 1 where XLA compiles an elementwise optimizer update (optax's AdamW and
      ``apply_updates``) into one loop per moment (its gradient and itself read, itself written)
      and one for the parameter (it and every moment read, it written): 10 bytes per parameter
      byte for AdamW, against 7 for one fused loop (0). Read from XLA:CPU's compile of the
      update (``bench/step_planner.py --parts terms``'s note; tests/test_step_planner.py).
    gather_spread: how far the arrivals of a collective's devices spread about their mean, as a
      share of the compute each did since they last met (one standard deviation): an FSDP
      weight's all-gather waits for the last of its group (``pricing.last_arrival``: 1.42
      standard deviations of 8 devices, 1.03 of 4). Fitted on CPU devices to the twelfth round's
      split on the 16-core host, where plain FSDP's gathers over 8 devices waited 0.97 and 0.96
      of the step's products (encdec, llama_loop): 0.68; its HSDP's, over 4, 0.61 and 0.71, 0.70
      priced (docs/benchmarks.md, the seventeenth round); 0 prices the backend's meeting
      (``step_collective_us``) alone.
    gather_spread_bytes: the step's parameter bytes (one whole copy) at or below which its FSDP
      gathers wait for no spread (``gather_spread`` priced 0): on the 16-core host the MLP of 2
      MiB (d 256, hidden 1024, batch 1024; three variants) and convnet (1.1 MiB) ran plain FSDP
      no slower than DP where the priced waits of 6.5-7.8 and 5.7 ms made it the slower, and
      every family of 8 MiB or more paid about the priced waits (docs/benchmarks.md, spread20b);
      set between the two.
  """
  xla_collective_us: float
  local_pass_us: float
  local_bandwidth_gbps: float | None
  nvlink_kernel_us: float
  host_step_us: float
  fixed_point_gbps: float
  overlap: float = 0.5
  step_collective_us: float = 0.0
  product_fixed_rows: float = 0.0
  update_split: float = 0.0
  gather_spread: float = 0.0
  gather_spread_bytes: float = 0.0

  def __post_init__(self):
    bad = [f.name for f in dataclasses.fields(self)
           if getattr(self, f.name) is not None and not getattr(self, f.name) >= 0]
    if self.local_bandwidth_gbps is not None and not self.local_bandwidth_gbps > 0:
      bad.append("local_bandwidth_gbps")
    if not self.fixed_point_gbps > 0:
      bad.append("fixed_point_gbps")
    if not 0.0 <= self.overlap <= 1.0:
      bad.append("overlap")
    if bad:
      raise errors.ConfigurationError(
          f"BackendCosts {self} has invalid fields {sorted(set(bad))}: times must be >= 0 and "
          "the bandwidth > 0 (or None).")


# Defaults. cpu: fitted on the 2-core CI VM with 8 simulated devices (see the module docstring;
# psum 82 us at 64 B and 1.6 ms at 1 MiB, minimum over repetitions; host_step_us not measured;
# step_collective_us: on that VM a tiny psum between products cost 1.3-4.2 ms under load, and
# the six model families' FSDP steps, with 54-84 all-gathers of 0.4 MiB, ran 160-260 ms slower
# than their DP steps with 5 all-reduces: about 3 ms a collective beyond its bytes);
# gpu: the 2 x H200 measurements in docs/benchmarks.md (psum ~19-28 us at 8 KB-1 MB, the NVLink one-shot
# kernel ~9.5 us at 8 KB; fixed_point_gbps not measured); tpu: unmeasured placeholders.
# cpu product_fixed_rows: measured, not yet the default. A float32 [M, 256] x [256, 1024]
# product's forward and backward per device on the 2-core VM, CPU seconds against M = 32..512 (a
# straight line), has 17.8 rows' worth of work that does not grow with M with 8 devices on the 2
# cores, 11.7-13.4 with 2 (two runs). {"cpu": {"product_fixed_rows": 16}} in DTENJAX_COST_PARAMS
# prices it. As the default it makes the encoder-decoder's tensor-parallel plan the VM's choice
# (0.82x DP's CPU time) but also the scanned decoder's, whose tensor-parallel plan does 1.12x DP's
# work for a reason the model does not price yet (docs/benchmarks.md, "ninth round").
BACKEND_COSTS: Mapping[str, BackendCosts] = {
    "cpu": BackendCosts(xla_collective_us=80.0, local_pass_us=5.0, local_bandwidth_gbps=1.35,
                        nvlink_kernel_us=INF, host_step_us=60.0, fixed_point_gbps=0.6,
                        overlap=0.0, step_collective_us=3000.0, update_split=1.0,
                        gather_spread=0.68, gather_spread_bytes=4 * 2**20),
    "gpu": BackendCosts(xla_collective_us=18.0, local_pass_us=4.0, local_bandwidth_gbps=None,
                        nvlink_kernel_us=6.0, host_step_us=40.0, fixed_point_gbps=500.0),
    "tpu": BackendCosts(xla_collective_us=10.0, local_pass_us=3.0, local_bandwidth_gbps=None,
                        nvlink_kernel_us=INF, host_step_us=INF, fixed_point_gbps=500.0),
}


COST_PARAMS_FORMAT = "dtenjax.cost-params/1"


def _overrides(path: str) -> dict[str, dict[str, float]]:
  if not path:
    return {}
  try:
    stat = os.stat(path)
  except OSError as e:
    raise errors.ConfigurationError(
        f"DTENJAX_COST_PARAMS={path!r} cannot be read as JSON ({e}); write a file like "
        '{"gpu": {"xla_collective_us": 21.0}} or unset it.') from None
  return _read_overrides(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_overrides(path: str, mtime_ns: int, size: int) -> dict[str, dict[str, float]]:
  del mtime_ns, size    # cache keys: a rewritten file is read again
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise errors.ConfigurationError(
        f"DTENJAX_COST_PARAMS={path!r} cannot be read as JSON ({e}); write a file like "
        '{"gpu": {"xla_collective_us": 21.0}} or unset it.') from None
  fields = {f.name for f in dataclasses.fields(BackendCosts)}
  problems = []
  if not isinstance(data, dict):
    problems.append(f"the top level must be an object keyed by platform, got {type(data).__name__}")
    data = {}
  data = dict(data)
  fmt = data.pop("format", COST_PARAMS_FORMAT)
  if fmt != COST_PARAMS_FORMAT:
    problems.append(f"format {fmt!r} is not {COST_PARAMS_FORMAT!r}, the one this dtenjax reads" +
                    (" (written by a newer dtenjax?)" if str(fmt).startswith("dtenjax.") else ""))
  for platform, values in data.items():
    if not isinstance(values, dict):
      problems.append(f"{platform!r} must map field names to numbers")
      continue
    problems += [f"{platform}.{k} is not a BackendCosts field (fields: {sorted(fields)})"
                 for k in values if k not in fields]
    problems += [f"{platform}.{k} = {v!r} must be a number" + (" or null" if k ==
                 "local_bandwidth_gbps" else "") for k, v in values.items()
                 if k in fields and not (isinstance(v, (int, float)) and not isinstance(v, bool))
                 and not (v is None and k == "local_bandwidth_gbps")]
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        f"DTENJAX_COST_PARAMS={path!r} is invalid:", problems))
  return data


def user_overrides(platform: str) -> dict[str, Any]:
  """The fields of ``platform``'s costs that the ``DTENJAX_COST_PARAMS`` file sets: they win over
  every prior, the host-sharing priors of CPU devices included."""
  return dict(_overrides(config.get_str("DTENJAX_COST_PARAMS")).get(platform, {}))


def backend_costs(platform: str) -> BackendCosts:
  """The fixed costs of ``platform``: :data:`BACKEND_COSTS` with ``DTENJAX_COST_PARAMS`` applied."""
  base = BACKEND_COSTS.get(platform, BACKEND_COSTS["gpu"])
  extra = user_overrides(platform)
  return dataclasses.replace(base, **extra) if extra else base


# --- the terms every formula is written in ------------------------------------------------------

def island_groups(group: Sequence[int], topology: Topology) -> tuple[tuple[int, ...], ...] | None:
  """``group`` split by the topology's fast islands, or None when that split is not a proper
  two-level hierarchy (fewer than two islands, islands of one device, or unequal sizes)."""
  members = set(group)
  island_of = _island_of(topology)
  by_island: dict[int, list[int]] = {}
  for d in group:
    for k in island_of.get(d, ()):
      by_island.setdefault(k, []).append(d)
  parts = [tuple(by_island[k]) for k in sorted(by_island)]
  if len(parts) < 2 or len({len(p) for p in parts}) != 1 or len(parts[0]) < 2:
    return None
  if sum(map(len, parts)) != len(members):      # fast islands overlap: not a partition
    return None
  return tuple(parts)


@functools.lru_cache(maxsize=32)
def _island_of(topology: Topology) -> dict[int, tuple[int, ...]]:
  """device id -> the indices of the fast islands holding it (computed once per topology: a
  1,024-device cluster prices hundreds of groups per plan)."""
  out: dict[int, list[int]] = {}
  for k, isl in enumerate(topology.fast_islands()):
    for d in isl:
      out.setdefault(d, []).append(k)
  return {d: tuple(ks) for d, ks in out.items()}


class Split(NamedTuple):
  """A proper two-level split of a group: ``k`` devices per inner group, ``m`` groups, the inner
  and outer links, and the hops of a message across the groups (1 inside a host, m - 1 across)
  and inside one (1, or k - 1 where an inner group spans hosts): what a ring over a level pays,
  each of its steps as slow as its slowest link. ``inner_exchange`` / ``outer_exchange``: the
  ``(latency, seconds per byte to one peer)`` of a direct exchange (an all-to-all) over a level
  whose groups span hosts but keep several ranks on one (:func:`_exchange`), where a rank's
  peers on its own host are not behind the inter-host link; None: the ring's links."""
  k: int
  m: int
  ia: float
  ib: float
  oa: float
  ob: float
  outer_hops: int
  inner_hops: int = 1
  inner_exchange: tuple[float, float] | None = None
  outer_exchange: tuple[float, float] | None = None

  def inner_all_to_all(self, nbytes: float) -> float:
    """Link seconds of an all-to-all of ``nbytes`` per rank over an inner group."""
    a, b = self.inner_exchange or (self.inner_hops * self.ia, self.ib)
    return a + (self.k - 1) / self.k * nbytes * b

  def outer_all_to_all(self, nbytes: float) -> float:
    """Link seconds of an all-to-all of ``nbytes`` per rank over an outer group."""
    a, b = self.outer_exchange or (self.outer_hops * self.oa, self.ob)
    return a + (self.m - 1) / self.m * nbytes * b


class Terms:
  """The link, backend and local terms of one group: what every formula is written in.

  ``n`` participants; ``a``/``b`` the slowest link's alpha (s) and beta (s/byte); ``hops`` 1 inside
  a host (peers are read in parallel), ``n - 1`` across a network; ``L`` one XLA collective, ``P``
  one extra elementwise pass, ``K`` one NVLink kernel, ``S`` one host-transport step (seconds);
  ``m`` local seconds per byte; ``f`` seconds per float byte of the fixed-point conversion;
  ``w`` the bytes a partial sum takes on the wire per byte of input (:meth:`carrying`; 1, or 2
  for a sum of 16-bit floats: the partial sums travel in float32, ``acc_dtype``): a formula
  multiplies by it the link bytes of the phases whose program sends partial sums.
  """
  w: float = 1.0

  def __init__(self, group: Sequence[int], topology: Topology, costs: BackendCosts | None,
               inner: int | None = None):
    self.group, self.topology, self.inner = list(group), topology, inner
    self.n = len(group)
    self._split: Split | None | bool = False         # not computed yet (:meth:`split`)
    self.cls, spec = topology.slowest_link(group)
    self.a, self.b = spec.alpha, spec.beta
    self.intra_host = self.cls in INTRA_HOST
    self.hops = 1 if self.intra_host else self.n - 1
    self.costs = costs if costs is not None else backend_costs(_platform(group, topology))
    bw = self.costs.local_bandwidth_gbps
    self.m = topology.spec("local").beta if bw is None else 1.0 / (bw * 1e9)
    self.L = self.costs.xla_collective_us * 1e-6
    self.P = self.costs.local_pass_us * 1e-6
    self.K = self.costs.nvlink_kernel_us * 1e-6
    self.S = self.costs.host_step_us * 1e-6
    self.f = 1.0 / (self.costs.fixed_point_gbps * 1e9)

  def split(self) -> Split | None:
    """The group's proper island split (:func:`island_groups`) with its links, or None; with
    ``inner`` (the size of the call's last axis: a two-level schedule's first stage runs over
    it), the split by that axis instead (:func:`_axis_split`)."""
    if self._split is False:
      self._split = (_split(tuple(self.group), self.topology) if self.inner is None else
                     _axis_split(tuple(self.group), self.topology, self.inner))
    return self._split

  def carrying(self, w: float) -> "Terms":
    """These terms for a call whose partial sums take ``w`` bytes on the wire per byte of its
    input (``Record.carried``)."""
    return self if w == self.w else _carrying(self, float(w))

  @property
  def xla(self) -> "Terms":
    """These terms for XLA's own collective over the group, whose levels are the islands
    whatever ``inner`` says: a two-level schedule's reproducible sum takes its codes' MAX with
    ``lax.pmax`` over every axis."""
    if self.inner is None:
      return self
    return _terms(tuple(self.group), self.topology, self.costs)


@functools.lru_cache(maxsize=4096)
def _carrying(t: Terms, w: float) -> Terms:
  """:meth:`Terms.carrying`: a copy of ``t`` (made once per cached terms and width) with ``w``."""
  out = copy.copy(t)
  out.w = w
  return out


@functools.lru_cache(maxsize=4096)
def _split(group: tuple[int, ...], topology: Topology) -> Split | None:
  """:meth:`Terms.split` of ``group``, computed once per group and topology (a frozen value): a
  plan prices thousands of collectives over a few dozen groups, and splitting a group of 512
  devices by island is a walk over all of them."""
  parts = island_groups(group, topology)
  if parts is None:
    return None
  _, inner = topology.slowest_link(list(parts[0]))
  outer = [p[0] for p in parts]
  cls, spec = topology.slowest_link(outer)
  return Split(len(parts[0]), len(parts), inner.alpha, inner.beta, spec.alpha, spec.beta,
               1 if cls in INTRA_HOST else len(parts) - 1)


@functools.lru_cache(maxsize=4096)
def _axis_split(group: tuple[int, ...], topology: Topology, inner: int) -> Split | None:
  """The split of ``group`` (rank ``o * inner + i``) by its last axis of size ``inner``: the
  inner groups are runs of ``inner`` consecutive ranks, the outer ones the ranks of one inner
  index; each level's links are the slowest of its groups (an inner axis smaller than a host's
  island leaves island-mates in the outer stage, which then runs on the slowest link among them;
  a larger one runs the inner stage across hosts). None where a level would have one rank."""
  n = len(group)
  if inner < 2 or n % inner or n // inner < 2:
    return None
  (icls, ispec), (ocls, ospec) = (
      _slowest(topology, [group[j:j + inner] for j in range(0, n, inner)]),
      _slowest(topology, [group[i::inner] for i in range(inner)]))
  m = n // inner
  inners = [group[j:j + inner] for j in range(0, n, inner)]
  outers = [group[i::inner] for i in range(inner)]
  return Split(inner, m, ispec.alpha, ispec.beta, ospec.alpha, ospec.beta,
               1 if ocls in INTRA_HOST else m - 1, 1 if icls in INTRA_HOST else inner - 1,
               _exchange(topology, inners), _exchange(topology, outers))


def _exchange(topology: Topology, groups: Sequence[Sequence[int]]) -> tuple[float, float] | None:
  """``(latency, seconds per byte to one peer, averaged over a rank's peers)`` of a direct
  exchange (each rank sends every peer its chunk: an all-to-all) over each of ``groups``, the
  largest of each over their ranks; None unless some group spans hosts with several of its ranks
  on one (otherwise the level's slowest link is every peer's: the ring's terms). A rank reaches
  its peers on its own host at once (one latency, the slowest link among them, as a group inside
  a host is priced) and each peer on another host over the network (one latency each, the
  slowest link from it to those hosts): a stage of 8 ranks two to a host sends 1/7 of its bytes
  over NVLink and 6/7 over the inter-host link, where the ring's terms send all 7/7 over it.
  The two parts are added, as the model adds a schedule's levels (NVLink and the network may
  carry them at once: an upper bound)."""
  latency = per_byte = 0.0
  mixed = False
  for g in groups:
    n = len(g)
    by_host: dict[str, list[int]] = {}
    for d in g:
      by_host.setdefault(topology.device(d).host, []).append(d)
    if len(by_host) == 1 or all(len(mine) == 1 for mine in by_host.values()):
      _, spec = topology.slowest_link(list(g))
      hops = 1 if len(by_host) == 1 else n - 1
      latency, per_byte = max(latency, hops * spec.alpha), max(per_byte, spec.beta)
      continue
    mixed = True
    for host, mine in by_host.items():
      a = b = 0.0
      if len(mine) > 1:
        _, spec = topology.slowest_link(mine)
        a, b = spec.alpha, (len(mine) - 1) * spec.beta
      away = n - len(mine)
      if away:
        _, spec = topology.slowest_link([mine[0]] + [ds[0] for h, ds in by_host.items()
                                                     if h != host])
        a, b = a + away * spec.alpha, b + away * spec.beta
      latency, per_byte = max(latency, a), max(per_byte, b / (n - 1))
  return (latency, per_byte) if mixed else None


@functools.lru_cache(maxsize=4096)
def _group_exchange(group: tuple[int, ...], topology: Topology) -> tuple[float, float] | None:
  """:func:`_exchange` of one group, computed once per group and topology (an all-to-all's
  price, asked for every layout of a plan)."""
  return _exchange(topology, [group])


def _slowest(topology: Topology, groups: Sequence[Sequence[int]]):
  """The slowest ``(class, spec)`` of :meth:`Topology.slowest_link` over ``groups``."""
  return max((topology.slowest_link(list(g)) for g in groups),
             key=lambda cs: LINK_ORDER.index(cs[0]))


@functools.lru_cache(maxsize=4096)
def _terms(group: tuple[int, ...], topology: Topology, costs: BackendCosts,
           inner: int | None = None) -> Terms:
  """The :class:`Terms` of ``group`` under ``costs`` (and the call's last-axis size, for a
  two-level schedule), made once per (group, topology, costs, inner): they depend on nothing
  else (a :class:`Terms` is read, never written, by the formulas)."""
  return Terms(group, topology, costs, inner)


def _platform(group: Sequence[int], topology: Topology) -> str:
  return topology.device(group[0]).platform


def ring(n: int, nbytes: float, a: float, b: float, phases: int) -> float:
  """``phases`` ring passes over links (1: reduce-scatter or all-gather; 2: all-reduce)."""
  return phases * ((n - 1) * a + (n - 1) / n * nbytes * b)


def xla_links(t: Terms, N: float, phases: int) -> float:
  """Link time of XLA's own collective (NCCL / gloo / in-process) moving ``phases`` halves of an
  all-reduce: one hop inside a host; across hosts the better of a flat and a two-level ring."""
  if t.intra_host:
    return phases * (t.a + (t.n - 1) / t.n * N * t.b)
  flat = ring(t.n, N, t.a, t.b, phases)
  s = t.split()
  if s is None:
    return flat
  return min(flat, ring(s.k, N, s.ia, s.ib, phases) + ring(s.m, N / s.k, s.oa, s.ob, phases))


# --- what a record's cost is --------------------------------------------------------------------

Formula = Callable[[Terms, float], float]


@dataclasses.dataclass(frozen=True)
class Cost:
  """The cost formulas of one algorithm record (``collectives/algorithms/<name>.py``), each in
  seconds, written in :class:`Terms`. ``N`` is bytes per participant (reduce-scatter: the full,
  unscattered input); a formula returns ``inf`` where the algorithm does not apply (e.g.
  ``hierarchical`` without a proper island split).

  Attributes:
    all_reduce: ``(t, N) -> seconds``.
    reduce_scatter: ``(t, N) -> seconds``, or None when the record has no reduce-scatter.
    reproducible: ``(t, N, itemsize, k) -> seconds`` of the record's own reproducible sum of ``k``
      contributions per device; None: the word exchange (:func:`word_exchange`) over this
      record's ``all_reduce``.
    code_max: ``(t, E) -> seconds`` of the word exchange's MAX of ``E`` one-byte codes; None:
      XLA's all-reduce of ``E`` bytes (``lax.pmax``).
  """
  all_reduce: Formula
  reduce_scatter: Formula | None = None
  reproducible: Callable[[Terms, float, int, int], float] | None = None
  code_max: Formula | None = None


def word_exchange(cost: Cost, t: Terms, N: float, itemsize: int, k: int, word_bytes: int) -> float:
  """The reproducible sum by the word exchange (``collectives/reproducible.py``): a MAX of the
  per-element codes, ``cost``'s all-reduce of ``word_bytes`` per value (4: contract v3, 8:
  contract v2; ``Contract.word_bytes``), ``k N`` bytes converted and ``N`` decoded."""
  E = N / itemsize
  codes = cost.code_max(t, E) if cost.code_max is not None else XLA.all_reduce(t.xla, E)
  return codes + cost.all_reduce(t, word_bytes * E) + 2 * t.P + (k + 1) * N * t.f


# --- XLA's own collectives: the xla record, and what explain prices -----------------------------

def _xla_all_reduce(t: Terms, N: float) -> float:
  """Each rank reduces its share and copies it out (2 N of memory traffic). The ``xla`` record
  sums 16-bit floats as float32 (``lax.psum`` of the input cast up): ``w N`` on the links."""
  return t.L + xla_links(t, t.w * N, 2) + 2 * N * t.m


def _xla_reduce_scatter(t: Terms, N: float) -> float:
  return t.L + xla_links(t, t.w * N, 1) + 2 * N * t.m


def xla_all_gather(t: Terms, N: float) -> float:
  """XLA's all-gather of ``N`` bytes in all (``N / n`` from each rank)."""
  return t.L + xla_links(t, N, 1) + N * t.m


XLA = Cost(all_reduce=_xla_all_reduce, reduce_scatter=_xla_reduce_scatter)


# --- pricing one collective ---------------------------------------------------------------------

def _check(kind: str, cost, nbytes: int) -> None:
  if kind not in KINDS:
    raise errors.CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
  if not isinstance(cost, Cost):
    raise errors.CollectiveError(
        f"cost={cost!r} is not a costmodel.Cost; pass an algorithm record's cost "
        "(registry.get(name).cost) or costmodel.XLA")
  if kind in _MOVES and cost is not XLA:
    raise errors.CollectiveError(f"{kind} is priced as XLA's own op; pass cost=costmodel.XLA")
  if nbytes < 0:
    raise errors.CollectiveError(f"nbytes={nbytes} must be >= 0")


_MOVES = ("all_gather", "all_to_all", "ppermute")


def collective_time(kind: str, nbytes: int, group: Sequence[int], topology: Topology,
                    cost: Cost = XLA, *, reproducible: Contract | bool | str = Contract.NONE,
                    itemsize: int = 4, contributions: int = 1,
                    costs: BackendCosts | None = None, inner: int | None = None,
                    carried: float = 1.0) -> float:
  """Estimated seconds for one collective.

  Args:
    kind: one of :data:`KINDS`; all_gather, all_to_all and ppermute are XLA's own ops.
    nbytes: bytes per participant (the full, unsharded buffer for reduce_scatter/all_gather).
    group: global device ids (``jax.Device.id``) taking part, in rank order.
    topology: where they live (link specs, and the platform that selects :class:`BackendCosts`).
    cost: the algorithm's formulas (an algorithm record's ``cost``; default XLA's own
      collectives). ``inf`` where it does not apply (no reduce-scatter, ``hierarchical`` without
      a proper island split, NVLink kernels off GPU).
    reproducible: the :class:`~dtenjax._src.contract.Contract` of a reproducible sum of
      ``itemsize``-byte floats (or a public ``reproducible=`` value, parsed by
      ``contract.parse``), with ``contributions`` stacked per device (``local_axis``).
    costs: override the backend's fixed costs (default: :func:`backend_costs`).
    inner: the size of the call's last axis, for a schedule whose first stage runs over it
      (``hierarchical``): its two levels are then that axis and the rest, not the islands.
    carried: bytes a partial sum of the call takes on the wire per byte of its input (the
      record's ``carried``: 2 for a sum of 16-bit floats, accumulated in float32); each formula
      applies it to the phases its program sends partial sums in (:attr:`Terms.w`). A plain
      all-reduce or reduce-scatter only: a reproducible sum's words are priced by their width.
  """
  _check(kind, cost, nbytes)
  n = len(group)
  if n <= 1:
    return 0.0
  contract = contract_lib.parse(reproducible)
  if contract.reproducible or kind not in ("all_reduce", "reduce_scatter"):
    carried = 1.0
  if cost is XLA and not contract.reproducible:
    # XLA's own collective of what it sends: the xla record's float32 sum of a bfloat16 input
    measured = calibrated_time(kind, carried * nbytes, group, topology)
    if measured is not None:
      return measured
  t = _terms(tuple(group), topology,
             costs if costs is not None else backend_costs(_platform(group, topology)),
             inner).carrying(carried)
  if kind == "ppermute":
    return t.L + t.a + nbytes * t.b
  if kind == "all_to_all":
    # each rank sends every peer its chunk directly: its host-mates' over the host's links,
    # only the chunks to other hosts over the network (:func:`_exchange`), where a group spans
    # hosts with several ranks on one (an `expert` axis over two hosts of 8); else every peer
    # is behind the group's slowest link
    a, b = _group_exchange(tuple(group), topology) or (t.hops * t.a, t.b)
    return t.L + a + (n - 1) / n * nbytes * b
  if kind == "all_gather":
    return xla_all_gather(t, nbytes)
  word_bytes = contract.word_bytes
  if kind == "all_reduce":
    if not contract.reproducible:
      return cost.all_reduce(t, nbytes)
    if cost.reproducible is not None:
      return cost.reproducible(t, nbytes, itemsize, contributions)
    return word_exchange(cost, t, nbytes, itemsize, contributions, word_bytes)
  if cost.reduce_scatter is None:
    return INF
  if not contract.reproducible:
    return cost.reduce_scatter(t, nbytes)
  # codes of the full input, words scattered, the owned block decoded
  E = nbytes / itemsize
  return (XLA.all_reduce(t.xla, E) + cost.reduce_scatter(t, word_bytes * E) + 2 * t.P +
          (nbytes + nbytes / n) * t.f)


def calibrated_time(kind: str, nbytes: float, group: Sequence[int],
                    topology: Topology) -> float | None:
  """XLA's own ``kind`` of ``nbytes`` per participant over ``group`` as the topology's
  :class:`~dtenjax.Calibration` measured it (interpolated between its sizes), or None: no
  calibration, the kind not measured, or a group that leaves the calibrated host or platform.
  The calibration timed one collective over all the host's devices at once; a smaller group of
  that host is priced alike, since the host's other devices run their own group's collective at
  the same time (a planned step runs the same collective on every group)."""
  cal = topology.calibration
  if cal is None:
    return None
  if not topology.within_host(group, cal.platform):
    return None
  return cal.collective_s(kind, nbytes)


def crossover_bytes(small: Cost, large: Cost, group: Sequence[int], topology: Topology,
                    kind: str = "all_reduce", hi: int = 1 << 34,
                    costs: BackendCosts | None = None) -> int | None:
  """Smallest message size (bytes) at which ``large`` beats ``small`` (two records' costs), found
  by bisection on the model; None if it never does below ``hi``. This is how size thresholds are
  derived from the topology instead of being constants."""
  def better(nb):
    return (collective_time(kind, nb, group, topology, large, costs=costs) <
            collective_time(kind, nb, group, topology, small, costs=costs))
  if not better(hi):
    return None
  if better(0):
    return 0
  lo_b, hi_b = 0, hi
  while hi_b - lo_b > 1:
    mid = (lo_b + hi_b) // 2
    if better(mid):
      hi_b = mid
    else:
      lo_b = mid
  return hi_b
