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

For ``n`` participants, ``N`` bytes per participant, slowest link ``a``/``b``, ``h`` = 1 inside a
host (peers are read in parallel) or ``n - 1`` across a network, ``L`` = ``xla_collective_us``,
``P`` = ``local_pass_us``, ``K`` = ``nvlink_kernel_us``, ``S`` = ``host_step_us`` and ``m`` =
local seconds per byte, the all-reduce formulas are:

=====================  ===========================================================================
``xla``                ``L + 2a + 2(n-1)/n N b + 2 N m`` in a host (each rank reduces its share
                       and copies it out); across hosts ``L`` + the better of a flat and a
                       two-level ring
``one_shot``           all-gather + fold: ``L + h a + (n-1) N b + P + 2 n N m``
``two_shot``           all-to-all, fold, all-gather: ``2L + 2 h a + 2(n-1)/n N b + P + 3 N m``
``ring``               ``(n-1)(L + a + N/n b) + (n-1) P`` (ppermute reduce-scatter) + an XLA
                       all-gather ``L + h a + (n-1)/n N b`` + ``3 N m``
``hierarchical``       3 XLA ops: reduce-scatter in islands, one-shot across, all-gather in islands
``nvlink_one_shot``    ``K + 2a + (n-1) N b + (n+1) N m``
``nvlink_two_shot``    ``K + 4a + 2(n-1)/n N b + 3 N m``
``host_ring``          ``2(n-1)(S + a) + 2(n-1)/n N b + 2 N m``
``host_hierarchical``  XLA reduce-scatter in the process, host ring of ``N/k`` across, all-gather
=====================  ===========================================================================

The reproducible sums (``reproducible=True``: contract v3, ``collectives/fixed_point_v3.py``, one
int32 word per value; ``"exact"``: contract v2, two): see :func:`_reproducible_all_reduce`; the
conversion runs at ``fixed_point_gbps``.

The model ranks algorithms; it does not promise microseconds. The ``cpu`` defaults were fitted to
``python bench/collectives.py --sizes 64,8K,1M --chain 32 --reps 9 --stat min`` on the 2-core
CI VM with 8 simulated devices (docs/collectives.md gives the command and the times); the ``gpu``
defaults come from the 2 x H200 measurements in docs/benchmarks.md and are meant to be
recalibrated from ``bench/allreduce.py`` through ``DTENJAX_COST_PARAMS``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.topology.model import INTRA_HOST
from dtenjax._src.topology.model import Topology

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "ppermute")
ALGORITHMS = ("xla", "ring", "one_shot", "two_shot", "hierarchical", "nvlink_one_shot",
              "nvlink_two_shot", "host_ring", "host_hierarchical")
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
  """
  xla_collective_us: float
  local_pass_us: float
  local_bandwidth_gbps: float | None
  nvlink_kernel_us: float
  host_step_us: float
  fixed_point_gbps: float

  def __post_init__(self):
    bad = [f.name for f in dataclasses.fields(self)
           if getattr(self, f.name) is not None and not getattr(self, f.name) >= 0]
    if self.local_bandwidth_gbps is not None and not self.local_bandwidth_gbps > 0:
      bad.append("local_bandwidth_gbps")
    if not self.fixed_point_gbps > 0:
      bad.append("fixed_point_gbps")
    if bad:
      raise errors.ConfigurationError(
          f"BackendCosts {self} has invalid fields {sorted(set(bad))}: times must be >= 0 and "
          "the bandwidth > 0 (or None).")


# Defaults. cpu: fitted on the 2-core CI VM with 8 simulated devices (see the module docstring;
# psum 82 us at 64 B and 1.6 ms at 1 MiB, minimum over repetitions; host_step_us not measured);
# gpu: the 2 x H200 measurements in docs/benchmarks.md (psum ~19-28 us at 8 KB-1 MB, the NVLink one-shot
# kernel ~9.5 us at 8 KB; fixed_point_gbps not measured); tpu: unmeasured placeholders.
BACKEND_COSTS: Mapping[str, BackendCosts] = {
    "cpu": BackendCosts(xla_collective_us=80.0, local_pass_us=5.0, local_bandwidth_gbps=1.35,
                        nvlink_kernel_us=INF, host_step_us=60.0, fixed_point_gbps=0.6),
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


def backend_costs(platform: str) -> BackendCosts:
  """The fixed costs of ``platform``: :data:`BACKEND_COSTS` with ``DTENJAX_COST_PARAMS`` applied."""
  base = BACKEND_COSTS.get(platform, BACKEND_COSTS["gpu"])
  extra = _overrides(config.get_str("DTENJAX_COST_PARAMS")).get(platform, {})
  return dataclasses.replace(base, **extra) if extra else base


# --- helpers ----------------------------------------------------------------------------------

def _check(kind: str, algorithm: str, nbytes: int) -> None:
  if kind not in KINDS:
    raise errors.CollectiveError(f"unknown collective kind {kind!r}; use one of {KINDS}")
  if algorithm not in ALGORITHMS:
    raise errors.CollectiveError(f"unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")
  if nbytes < 0:
    raise errors.CollectiveError(f"nbytes={nbytes} must be >= 0")


def island_groups(group: Sequence[int], topology: Topology) -> tuple[tuple[int, ...], ...] | None:
  """``group`` split by the topology's fast islands, or None when that split is not a proper
  two-level hierarchy (fewer than two islands, islands of one device, or unequal sizes)."""
  members = set(group)
  parts = []
  for isl in topology.fast_islands():
    part = tuple(d for d in group if d in isl)
    if part:
      parts.append(part)
  if len(parts) < 2 or len({len(p) for p in parts}) != 1 or len(parts[0]) < 2:
    return None
  assert sum(map(len, parts)) == len(members)
  return tuple(parts)


def _platform(group: Sequence[int], topology: Topology) -> str:
  return topology.device(group[0]).platform


def _ring(n: int, nbytes: float, a: float, b: float, phases: int) -> float:
  """``phases`` ring passes over links (1: reduce-scatter or all-gather; 2: all-reduce)."""
  return phases * ((n - 1) * a + (n - 1) / n * nbytes * b)


class _Terms:
  """The link, backend and local terms of one group (what every formula is written in)."""

  def __init__(self, group: Sequence[int], topology: Topology, costs: BackendCosts | None):
    self.group, self.topology = list(group), topology
    self.n = len(group)
    self.cls, spec = topology.slowest_link(group)
    self.a, self.b = spec.alpha, spec.beta
    self.hops = 1 if self.cls in INTRA_HOST else self.n - 1
    self.costs = costs if costs is not None else backend_costs(_platform(group, topology))
    bw = self.costs.local_bandwidth_gbps
    self.m = topology.spec("local").beta if bw is None else 1.0 / (bw * 1e9)
    self.L = self.costs.xla_collective_us * 1e-6
    self.P = self.costs.local_pass_us * 1e-6
    self.K = self.costs.nvlink_kernel_us * 1e-6
    self.S = self.costs.host_step_us * 1e-6
    self.f = 1.0 / (self.costs.fixed_point_gbps * 1e9)

  def islands(self):
    return island_groups(self.group, self.topology)

  def links_of(self, sub: Sequence[int]):
    _, spec = self.topology.slowest_link(sub)
    return spec.alpha, spec.beta


# --- all-reduce formulas (N bytes per participant) ---------------------------------------------

def _split(t: _Terms):
  """(k, m, inner a, inner b, outer a, outer b, outer hops) of a proper island split, or None."""
  parts = t.islands()
  if parts is None:
    return None
  k, m = len(parts[0]), len(parts)
  ia, ib = t.links_of(parts[0])
  outer = [p[0] for p in parts]
  cls, _ = t.topology.slowest_link(outer)
  oa, ob = t.links_of(outer)
  return k, m, ia, ib, oa, ob, (1 if cls in INTRA_HOST else m - 1)


def _xla_links(t: _Terms, N: float, phases: int) -> float:
  """Link time of XLA's own collective (NCCL / gloo / in-process) moving ``phases`` halves of an
  all-reduce: one hop inside a host; across hosts the better of a flat and a two-level ring."""
  if t.cls in INTRA_HOST:
    return phases * (t.a + (t.n - 1) / t.n * N * t.b)
  flat = _ring(t.n, N, t.a, t.b, phases)
  s = _split(t)
  if s is None:
    return flat
  k, m, ia, ib, oa, ob, _ = s
  return min(flat, _ring(k, N, ia, ib, phases) + _ring(m, N / k, oa, ob, phases))


def _ar_xla(t: _Terms, N: float) -> float:
  """XLA's all-reduce: each rank reduces its share and copies it out (2 N of memory traffic)."""
  return t.L + _xla_links(t, N, 2) + 2 * N * t.m


def _ar_one_shot(t: _Terms, N: float) -> float:
  """All-gather (n N written) and a fold reading n N."""
  return t.L + t.hops * t.a + (t.n - 1) * N * t.b + t.P + 2 * t.n * N * t.m


def _ar_two_shot(t: _Terms, N: float) -> float:
  """All-to-all (N), a fold of the owned chunk over n ranks (N), all-gather (N)."""
  return 2 * t.L + 2 * t.hops * t.a + 2 * (t.n - 1) / t.n * N * t.b + t.P + 3 * N * t.m


def _ar_ring(t: _Terms, N: float) -> float:
  """n - 1 ppermutes of N/n, each followed by an add of N/n, then one all-gather of N/n each."""
  steps = t.n - 1
  gather = t.L + t.hops * t.a + (t.n - 1) / t.n * N * t.b
  return steps * (t.L + t.a + N / t.n * t.b) + steps * t.P + gather + 3 * N * t.m


def _ar_hierarchical(t: _Terms, N: float) -> float:
  """Inner all-to-all reduce-scatter, one-shot of N/k across islands, inner all-gather."""
  s = _split(t)
  if s is None:
    return INF
  k, m, ia, ib, oa, ob, ho = s
  inner = 2 * (t.L + ia + (k - 1) / k * N * ib)
  outer = t.L + ho * oa + (m - 1) * (N / k) * ob
  return inner + outer + 2 * t.P + (3 * N + 2 * m * N / k) * t.m


def _ar_nvlink_one_shot(t: _Terms, N: float) -> float:
  """The kernel reads every peer's buffer (n N) and writes the result (N)."""
  return t.K + 2 * t.a + (t.n - 1) * N * t.b + (t.n + 1) * N * t.m


def _ar_nvlink_two_shot(t: _Terms, N: float) -> float:
  return t.K + 4 * t.a + 2 * (t.n - 1) / t.n * N * t.b + 3 * N * t.m


def _ar_host_ring(t: _Terms, N: float) -> float:
  return 2 * (t.n - 1) * (t.S + t.a) + 2 * (t.n - 1) / t.n * N * t.b + 2 * N * t.m


def _ar_host_hierarchical(t: _Terms, N: float) -> float:
  """XLA reduce-scatter in the process, host ring of N/k across processes, XLA all-gather."""
  s = _split(t)
  if s is None:
    return INF
  k, m, ia, ib, oa, ob, _ = s
  inner = 2 * (t.L + ia + (k - 1) / k * N * ib)
  outer = 2 * (m - 1) * (t.S + oa) + 2 * (m - 1) / m * (N / k) * ob
  return inner + outer + 3 * N * t.m


_ALL_REDUCE = {
    "xla": _ar_xla, "one_shot": _ar_one_shot, "two_shot": _ar_two_shot, "ring": _ar_ring,
    "hierarchical": _ar_hierarchical, "nvlink_one_shot": _ar_nvlink_one_shot,
    "nvlink_two_shot": _ar_nvlink_two_shot, "host_ring": _ar_host_ring,
    "host_hierarchical": _ar_host_hierarchical,
}


def _reproducible_all_reduce(t: _Terms, algorithm: str, N: float, itemsize: int, k: int,
                             word_bytes: int = 4) -> float:
  """A reproducible sum (``N`` bytes of ``itemsize`` floats per contribution, ``k`` per device,
  ``word_bytes`` of integer words per value: 4 for contract v3, 8 for the exact contract):

  * ``one_shot`` / ``two_shot`` move the raw floats (all-gather; all-to-all + all-gather) and sum
    exactly where they land: ``n k N`` / ``k N`` bytes converted per rank;
  * the NVLink kernels convert in registers as they read the peers' floats: the plain kernel's
    time plus ``n N`` converted;
  * every other record exchanges words: a MAX of one-byte codes (int32 over the host transport),
    the record's all-reduce of ``word_bytes E`` bytes of int32 words, ``k N`` converted and ``N``
    decoded.
  """
  E = N / itemsize
  n = t.n
  if algorithm == "one_shot":
    return (t.L + t.hops * t.a + (n - 1) * k * N * t.b + t.P + n * k * N * t.m +
            n * k * N * t.f)
  if algorithm == "two_shot":
    return (2 * t.L + 2 * t.hops * t.a + (n - 1) / n * (k + 1) * N * t.b + t.P +
            (k + 1) * N * t.m + k * N * t.f + N / n * t.f)
  if algorithm.startswith("nvlink_"):
    return _ALL_REDUCE[algorithm](t, N) + n * N * t.f
  codes = _ar_host_ring(t, 4 * E) if algorithm.startswith("host_") else _ar_xla(t, E)
  return codes + _ALL_REDUCE[algorithm](t, word_bytes * E) + 2 * t.P + (k + 1) * N * t.f


# --- reduce-scatter / all-gather (N = the full, unsharded buffer per participant) ---------------

def _rs_ag(t: _Terms, kind: str, algorithm: str, N: float) -> float:
  n = t.n
  fold = kind == "reduce_scatter"
  if algorithm == "xla" or (algorithm in ("one_shot", "two_shot") and not fold):
    return t.L + _xla_links(t, N, 1) + (2 if fold else 1) * N * t.m
  if algorithm == "two_shot":     # all-to-all, fold the owned block
    return t.L + t.hops * t.a + (n - 1) / n * N * t.b + t.P + 2 * N * t.m
  if algorithm == "one_shot":     # gather everything, fold the owned block
    return t.L + t.hops * t.a + (n - 1) * N * t.b + t.P + (n + 1) * N * t.m
  if algorithm == "ring":
    return (n - 1) * (t.L + t.a + N / n * t.b) + ((n - 1) * t.P if fold else 0.0) + \
        (2 if fold else 1) * N * t.m
  if algorithm == "hierarchical":
    s = _split(t)
    if s is None:
      return INF
    k, m, ia, ib, oa, ob, ho = s
    return (2 * t.L + ia + (k - 1) / k * N * ib + ho * oa + (m - 1) / m * (N / k) * ob +
            (2 * t.P if fold else 0.0) + (2 if fold else 1) * N * t.m)
  return INF    # the NVLink kernels and the host transport have no reduce-scatter / all-gather


def collective_time(kind: str, nbytes: int, group: Sequence[int], topology: Topology,
                    algorithm: str = "ring", *, reproducible: bool | str = False,
                    itemsize: int = 4,
                    contributions: int = 1, costs: BackendCosts | None = None) -> float:
  """Estimated seconds for one collective.

  Args:
    kind: one of :data:`KINDS`.
    nbytes: bytes per participant (the full, unsharded buffer for reduce_scatter/all_gather).
    group: global device ids (``jax.Device.id``) taking part, in rank order.
    topology: where they live (link specs, and the platform that selects :class:`BackendCosts`).
    algorithm: a formula of :data:`ALGORITHMS`. Returns ``inf`` for one that does not apply
      (``hierarchical`` without a proper island split, NVLink kernels off GPU).
    reproducible: a reproducible sum of ``itemsize``-byte floats (True or "v3": contract v3,
      "exact": contract v2), with ``contributions`` stacked per device (``local_axis``).
    costs: override the backend's fixed costs (default: :func:`backend_costs`).
  """
  _check(kind, algorithm, nbytes)
  n = len(group)
  if n <= 1:
    return 0.0
  t = _Terms(group, topology, costs)
  if kind == "ppermute":
    return t.L + t.a + nbytes * t.b
  if kind == "all_to_all":
    return t.L + t.hops * t.a + (n - 1) / n * nbytes * t.b
  word_bytes = 8 if reproducible == "exact" else 4
  if kind == "all_reduce":
    if reproducible:
      return _reproducible_all_reduce(t, algorithm, nbytes, itemsize, contributions, word_bytes)
    return _ALL_REDUCE[algorithm](t, nbytes)
  if reproducible:   # reduce_scatter: codes of the full input, words scattered, owned block decoded
    E = nbytes / itemsize
    return (_ar_xla(t, E) + _rs_ag(t, kind, algorithm, word_bytes * E) + 2 * t.P +
            (nbytes + nbytes / n) * t.f)
  return _rs_ag(t, kind, algorithm, nbytes)


def rank_algorithms(kind: str, nbytes: int, group: Sequence[int], topology: Topology,
                    candidates: Iterable[str] = ("xla", "ring", "one_shot", "two_shot",
                                                 "hierarchical"),
                    *, reproducible: bool = False, itemsize: int = 4, contributions: int = 1,
                    costs: BackendCosts | None = None) -> list[tuple[str, float]]:
  """``(algorithm, seconds)`` for each applicable candidate, fastest first, ties by name."""
  out = []
  for alg in candidates:
    t = collective_time(kind, nbytes, group, topology, alg, reproducible=reproducible,
                        itemsize=itemsize, contributions=contributions, costs=costs)
    if t < INF:
      out.append((alg, t))
  return sorted(out, key=lambda kv: (kv[1], kv[0]))


def crossover_bytes(alg_small: str, alg_large: str, group: Sequence[int], topology: Topology,
                    kind: str = "all_reduce", hi: int = 1 << 34,
                    costs: BackendCosts | None = None) -> int | None:
  """Smallest message size (bytes) at which ``alg_large`` beats ``alg_small``, found by bisection
  on the model; None if it never does below ``hi``. This is how size thresholds are derived
  from the topology instead of being constants."""
  def better(nb):
    return (collective_time(kind, nb, group, topology, alg_large, costs=costs) <
            collective_time(kind, nb, group, topology, alg_small, costs=costs))
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
