"""The hardware a job runs on: devices, hosts, NUMA nodes, NICs and the link between every pair.

A :class:`Topology` is a frozen value. It comes from one of three places:

* :meth:`Topology.fixture` -- shipped reference systems (the seed's 8 x A100 NVLink node and 4 x 8
  A100 over RoCE v2, plus 8 x H200 NVLink and an 8-GPU PCIe-only box);
* :meth:`Topology.detect` -- the running machine (jax devices, GPU peer access / NVLink through
  cuda-python and NVML, RDMA NICs through pyverbs, NUMA nodes from sysfs, processes from
  ``jax.distributed``);
* :meth:`Topology.probe` -- measured alpha (latency) and beta (seconds per byte) per link class on
  the devices present, replacing the table values the planner would otherwise use.

Every pair of devices has a *link class*; each class has a :class:`LinkSpec` (bandwidth per
direction, latency). Classes are ordered fastest first (:data:`LINK_ORDER`), which is how
:func:`dtenjax.topology_mesh` keeps inner mesh axes on the fastest links.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.topology import calibrate as calibrate_lib
from dtenjax._src.topology import detect as detect_lib
from dtenjax._src.topology import probe as probe_lib
from dtenjax._src.topology.parts import CALIBRATED_KINDS as CALIBRATED_KINDS
from dtenjax._src.topology.parts import DEFAULT_LINKS as DEFAULT_LINKS
from dtenjax._src.topology.parts import Calibration as Calibration
from dtenjax._src.topology.parts import INTRA_HOST as INTRA_HOST
from dtenjax._src.topology.parts import LINK_ORDER as LINK_ORDER
from dtenjax._src.topology.parts import PEAK_FLOPS as PEAK_FLOPS
from dtenjax._src.topology.parts import DeviceInfo as DeviceInfo
from dtenjax._src.topology.parts import LinkSpec as LinkSpec
from dtenjax._src.topology.parts import NicInfo as NicInfo
from dtenjax._src.topology.parts import NumaNode as NumaNode
from dtenjax._src.topology.parts import local_host_name as local_host_name

# The JSON format Topology.to_json() writes; dtenjax/schemas/topology-1.schema.json describes it
# as a JSON Schema (for other tools; tests/test_topology.py checks that both agree).
FORMAT = "dtenjax.topology/1"
_FIELD_TYPES = {"int": ((int,), "a whole number"), "str": ((str,), "a string"),
                "float": ((int, float), "a number")}


def _type_problems(where: str, kind, item: Mapping[str, Any]) -> list[str]:
  """Fields of ``item`` whose JSON type does not match the dataclass ``kind``'s annotation."""
  out = []
  for f in dataclasses.fields(kind):
    want = _FIELD_TYPES.get(str(f.type))
    if want and f.name in item:
      v = item[f.name]
      if not isinstance(v, want[0]) or isinstance(v, bool):
        out.append(f"{where}.{f.name} = {v!r} must be {want[1]}")
  return out


def _freeze_links(links: Mapping[str, LinkSpec]) -> tuple[tuple[str, LinkSpec], ...]:
  unknown = sorted(k for k in links if k not in LINK_ORDER)
  if unknown:
    raise errors.TopologyError(f"links name unknown link classes {unknown}; use classes from "
                               f"{LINK_ORDER}")
  return tuple(sorted(links.items(), key=lambda kv: LINK_ORDER.index(kv[0])))


def _positions(row: Sequence[str], classes: Sequence[str]) -> list[int]:
  """The positions in ``row`` holding one of ``classes``."""
  out = []
  for c in classes:
    i = -1
    try:
      while True:
        i = row.index(c, i + 1)
        out.append(i)
    except ValueError:
      pass
  return out


@dataclasses.dataclass(frozen=True)
class Topology:
  """Devices and the link class between every pair, plus hosts, NICs and NUMA nodes.

  ``link_matrix[i][j]`` is the class between ``devices[i]`` and ``devices[j]`` (positions, not
  ids; use :meth:`link_class` with device ids). ``links`` maps each class to its LinkSpec.
  """
  name: str
  devices: tuple[DeviceInfo, ...]
  link_matrix: tuple[tuple[str, ...], ...]
  links: tuple[tuple[str, LinkSpec], ...] = _freeze_links(DEFAULT_LINKS)
  nics: tuple[NicInfo, ...] = ()
  numa_nodes: tuple[NumaNode, ...] = ()
  source: str = "fixture"        # "fixture", "detected", "probed", "json"
  notes: tuple[str, ...] = ()
  measured: tuple[str, ...] = ()  # link classes whose LinkSpec was measured, not the table's
  # NCCL may reduce in the NVSwitch (NVLink SHARP): set from NCCL_NVLS_ENABLE once, when the
  # machine is detected; fixtures describe NCCL as dtenjax.pin_nccl() leaves it (off). Plans read
  # it here, never from the environment, so the same inputs give the same plan everywhere.
  nvls: bool = False
  # measured compute and collective speeds of the devices working together (calibrate()); None:
  # the table priors price the plan
  calibration: Calibration | None = None

  def __post_init__(self):
    problems = []
    if self.calibration is not None and not isinstance(self.calibration, Calibration):
      problems.append(f"calibration={self.calibration!r} must be a Calibration or None")
    platforms = sorted({d.platform for d in self.devices})
    if (isinstance(self.calibration, Calibration) and platforms and
        self.calibration.platform not in platforms):
      # its FLOP/s would price another platform's products (peak_flops reads it as they are)
      problems.append(f"calibration was measured on {self.calibration.platform!r} devices, this "
                      f"topology's are {platforms}; calibrate on these devices "
                      "(Topology.detect().calibrate()) or drop it (calibration=None)")
    n = len(self.devices)
    if n == 0:
      problems.append("it has no devices")
    ids = [d.id for d in self.devices]
    if len(set(ids)) != n:
      problems.append(f"device ids are not unique: {ids}")
    bad_links = [k for k, v in self.links if k not in LINK_ORDER or not isinstance(v, LinkSpec)]
    if bad_links:
      problems.append(f"links has unknown classes or non-LinkSpec values: {bad_links}; use "
                      f"classes from {LINK_ORDER}")
    if len(self.link_matrix) != n or any(len(row) != n for row in self.link_matrix):
      problems.append(f"link_matrix must be {n} x {n}, got "
                      f"{len(self.link_matrix)} x {[len(r) for r in self.link_matrix]}")
    else:
      specs = dict(self.links)
      for i, row in enumerate(self.link_matrix):
        for j, cls in enumerate(row):
          if cls not in LINK_ORDER:
            problems.append(f"link_matrix[{i}][{j}] = {cls!r} is not a link class; use one of "
                            f"{LINK_ORDER}")
          elif cls not in specs:
            problems.append(f"link class {cls!r} (link_matrix[{i}][{j}]) has no LinkSpec in links")
          if j > i and self.link_matrix[j][i] != cls:
            problems.append(f"link_matrix is not symmetric: [{i}][{j}] = {cls!r} but "
                            f"[{j}][{i}] = {self.link_matrix[j][i]!r}; a link has one class "
                            "in both directions")
          if i == j and cls != "local":
            problems.append(f"link_matrix[{i}][{i}] = {cls!r}; a device's link to itself must "
                            "be 'local'")
        if len(problems) > 8:
          break
    if problems:
      raise errors.TopologyError(errors.join_problems(
          f"Topology {self.name!r} is invalid:", problems))

  def __hash__(self) -> int:
    # Topologies key the planner's caches; hashing every device pair on each lookup would
    # dominate planning time, so the hash is computed once (the value is frozen).
    h = self.__dict__.get("_hash")
    if h is None:
      h = hash((self.name, self.devices, self.link_matrix, self.links, self.nics,
                self.numa_nodes, self.source, self.notes, self.measured, self.nvls,
                self.calibration))
      object.__setattr__(self, "_hash", h)
    return h

  def __getstate__(self) -> dict[str, Any]:
    # Only the fields: the memoised hash (string hashes differ between processes) and derived
    # groupings must not travel with a pickled copy.
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  # --- lookups -------------------------------------------------------------------------------

  @functools.cached_property
  def _pos(self) -> dict[int, int]:
    return {d.id: i for i, d in enumerate(self.devices)}

  @functools.cached_property
  def _specs(self) -> dict[str, LinkSpec]:
    return dict(self.links)

  @functools.cached_property
  def _derived(self) -> dict[Any, Any]:
    """Memo of derived groupings (islands per level, hosts, hierarchy keys)."""
    return {}

  @property
  def device_ids(self) -> tuple[int, ...]:
    return tuple(d.id for d in self.devices)

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  def device(self, device_id: int) -> DeviceInfo:
    return self.devices[self.position(device_id)]

  def position(self, device_id: int) -> int:
    try:
      return self._pos[device_id]
    except KeyError:
      raise errors.TopologyError(
          f"device id {device_id} is not in topology {self.name!r} (ids {self.device_ids[:16]}"
          f"{'...' if self.num_devices > 16 else ''}). Use the topology of the devices you "
          "run on (Topology.detect()) or a fixture with as many devices.") from None

  def link_class(self, a: int, b: int) -> str:
    """Link class between device ids ``a`` and ``b``."""
    return self.link_matrix[self.position(a)][self.position(b)]

  def link(self, a: int, b: int) -> LinkSpec:
    return self.spec(self.link_class(a, b))

  def spec(self, link_class: str) -> LinkSpec:
    try:
      return self._specs[link_class]
    except KeyError:
      raise errors.TopologyError(
          f"topology {self.name!r} has no LinkSpec for link class {link_class!r}; it has "
          f"{tuple(self._specs)}") from None

  def slowest_link(self, group: Sequence[int]) -> tuple[str, LinkSpec]:
    """The slowest class between any two members of ``group`` (the ring's bottleneck)."""
    if len(group) < 2:
      return "local", self.spec("local")
    key = ("slowest", tuple(group))
    memo = self._derived
    if key not in memo:
      pos = [self.position(a) for a in group]
      rank = {c: LINK_ORDER.index(c) for c in LINK_ORDER}
      if "slowest_rank" not in memo:     # the slowest class anywhere: no group has a slower one
        memo["slowest_rank"] = max(rank[c] for row in self.link_matrix for c in set(row))
      worst = -1
      for p in pos:                      # row by row, done once the slowest class is found
        row = self.link_matrix[p]
        worst = max([worst] + [rank[row[q]] for q in pos if q != p])
        if worst == memo["slowest_rank"]:
          break
      if worst < 0:
        raise ValueError(f"slowest_link: {group!r} names one device only")
      memo[key] = LINK_ORDER[worst]
    return memo[key], self.spec(memo[key])

  def hosts(self) -> tuple[tuple[int, ...], ...]:
    """Device ids grouped by host, hosts in order of first appearance."""
    memo = self._derived
    if "hosts" not in memo:
      groups: dict[str, list[int]] = {}
      for d in self.devices:
        groups.setdefault(d.host, []).append(d.id)
      memo["hosts"] = tuple(tuple(g) for g in groups.values())
    return memo["hosts"]

  def islands(self, within: str = "nvlink") -> tuple[tuple[int, ...], ...]:
    """Connected groups of devices whose links are at least as fast as ``within``.

    With the default, an island is a set of GPUs joined by NVLink/NVSwitch; CPU devices of one
    process (joined by shared memory) are one island when ``within="shared_memory"``.
    """
    if within not in LINK_ORDER:
      raise errors.TopologyError(f"islands(within={within!r}): use a class from {LINK_ORDER}")
    memo = self._derived
    if ("islands", within) in memo:
      return memo[("islands", within)]
    # each device's row scanned once, in C for each fast class (tuple.index): a 1,024-GPU
    # fixture has a million pairs, and a Python loop over them was 0.04 s of the first plan
    fast = LINK_ORDER[:LINK_ORDER.index(within) + 1]
    ids = self.device_ids
    left = set(range(len(ids)))        # positions not in an island yet
    out = []
    for start in range(len(ids)):
      if start not in left:
        continue
      left.discard(start)
      comp, todo = [], [start]
      while todo:
        p = todo.pop()
        comp.append(p)
        if left:
          near = [q for q in _positions(self.link_matrix[p], fast) if q in left]
          left.difference_update(near)
          todo.extend(near)
      out.append(tuple(ids[q] for q in sorted(comp)))
    memo[("islands", within)] = tuple(out)
    return memo[("islands", within)]

  def fast_islands(self) -> tuple[tuple[int, ...], ...]:
    """The natural first level of a hierarchy: NVLink/NVSwitch islands on GPUs, a process's
    shared memory on CPUs, a PCIe switch / NUMA node on PCIe-only boxes, otherwise whole hosts
    (also when the links inside a host are "unknown").

    The first level (fastest first) at which some devices group together wins; a topology whose
    devices are all joined at that level is one island.
    """
    memo = self._derived
    if "fast_islands" not in memo:
      memo["fast_islands"] = tuple((i,) for i in self.device_ids)
      for level in ("nvlink", "shared_memory", "pcie", "numa_cross", "unknown"):
        isl = self.islands(level)
        if len(isl) < self.num_devices:
          memo["fast_islands"] = isl
          break
    return memo["fast_islands"]

  def hierarchy_key(self, device_id: int) -> tuple:
    """Sort key that puts devices sharing faster links next to each other:
    (host, fast island, NUMA node, position)."""
    memo = self._derived
    if "hkey" not in memo:
      island_of = {i: k for k, isl in enumerate(self.fast_islands()) for i in isl}
      host_of = {i: k for k, h in enumerate(self.hosts()) for i in h}
      memo["hkey"] = {d.id: (host_of[d.id], island_of[d.id], d.numa_node, p)
                      for p, d in enumerate(self.devices)}
    try:
      return memo["hkey"][device_id]
    except KeyError:
      self.position(device_id)   # raises the helpful error
      raise

  def peak_flops(self) -> float:
    """FLOP/s of the slowest device while all compute: the calibration's measured rate when
    there is one, else the table's prior, on a CPU scaled by the host's cores over its CPU
    devices (simulated devices of one process share the cores)."""
    if self.calibration is not None:
      return self.calibration.matmul_flops
    return min(calibrate_lib.scaled_prior_flops(d.peak_flops, d.platform,
                                                self._host_cores().get(d.host, 0),
                                                self._cpu_devices().get(d.host, 0))
               for d in self.devices)

  def pricing_summary(self) -> str:
    """What compute is priced with, in one line: the calibration's measurements, or the table
    prior (on a CPU scaled by the cores its devices share)."""
    if self.calibration is not None:
      return self.calibration.summary()
    d = min(self.devices, key=lambda x: (x.peak_flops, x.id))
    shared = ""
    if d.platform == "cpu":
      shared = (f", {self._cpu_devices().get(d.host, 0)} CPU devices sharing "
                f"{self._host_cores().get(d.host, 0) or 'an unknown number of'} cores")
    return (f"table priors: {self.peak_flops() / 1e9:.1f} GFLOP/s per device ({d.kind}"
            f"{shared}); Topology.calibrate() measures them")

  def _host_cores(self) -> dict[str, int]:
    """host -> CPU cores listed by its NUMA nodes (0 when none are listed)."""
    got = self._derived.get("cores")
    if got is None:
      got = {}
      for node in self.numa_nodes:
        got[node.host] = got.get(node.host, 0) + _count_cpus(node.cpus)
      self._derived["cores"] = got
    return got

  def _cpu_devices(self) -> dict[str, int]:
    got = self._derived.get("cpu_devices")
    if got is None:
      got = {}
      for d in self.devices:
        if d.platform == "cpu":
          got[d.host] = got.get(d.host, 0) + 1
      self._derived["cpu_devices"] = got
    return got

  def within_host(self, group: Sequence[int], platform: str) -> bool:
    """Whether the device ids ``group`` are all on one host and of ``platform``."""
    key = ("within_host", tuple(group), platform)
    memo = self._derived
    if key not in memo:
      infos = [self.device(g) for g in group]
      memo[key] = len({d.host for d in infos}) == 1 and all(d.platform == platform
                                                            for d in infos)
    return memo[key]

  def local_s_per_byte(self, prior: float) -> float:
    """Seconds per byte of one device's elementwise pass (read + write counted): measured by the
    calibration, else for CPU devices the share of their host (``calibrate.prior_cpu_s_per_byte``
    of :meth:`peak_flops`), else ``prior`` (the backend's table value)."""
    if self.calibration is not None:
      return 1.0 / (self.calibration.memory_gbps * 1e9)
    if all(d.platform == "cpu" for d in self.devices):
      return calibrate_lib.prior_cpu_s_per_byte(self.peak_flops())
    return prior

  def meeting_s(self, platform: str, prior: float) -> float:
    """What one collective between products adds to a step of ``platform``'s devices beyond its
    own time: the calibration's measured rendezvous, else for CPU devices the sharing of their
    host's cores (``calibrate.prior_cpu_meeting_s``, the busiest host), else ``prior`` (the
    backend's ``step_collective_us``)."""
    cal = self.calibration
    if cal is not None and cal.platform == platform:
      return cal.latency_s
    if platform == "cpu" and any(d.platform == "cpu" for d in self.devices):
      cores, devices = self._host_cores(), self._cpu_devices()
      return max(calibrate_lib.prior_cpu_meeting_s(cores.get(h, 0), n)
                 for h, n in devices.items())
    return prior

  def calibrate(self, **kwargs) -> Topology:
    """Measures this host's devices computing and running XLA's collectives together
    (``topology/calibrate.py``) and returns a copy with :attr:`calibration` set: an explicit input
    of the plans made with it, saved by :meth:`to_json` and printed by their reports."""
    cal = calibrate_lib.measure(self, **kwargs)
    return dataclasses.replace(self, calibration=cal, notes=self.notes + (cal.summary(),))

  def with_links(self, links: Mapping[str, LinkSpec], source: str = "probed",
                 notes: Sequence[str] = (), measured: bool = True) -> Topology:
    """A copy with some link classes' specs replaced: by measured values (``measured=True``,
    as :meth:`probe` does: the classes are recorded in :attr:`measured`, which the step planner
    reports), or by other priors (``measured=False``)."""
    merged = dict(self.links)
    merged.update(links)
    classes = set(self.measured)
    classes = classes | set(links) if measured else classes - set(links)
    return dataclasses.replace(self, links=_freeze_links(merged), source=source,
                               notes=self.notes + tuple(notes),
                               measured=tuple(c for c in LINK_ORDER if c in classes))

  def subset(self, device_ids: Sequence[int]) -> Topology:
    """The topology restricted to ``device_ids`` (in that order)."""
    pos = [self.position(i) for i in device_ids]
    return dataclasses.replace(
        self, devices=tuple(self.devices[p] for p in pos),
        link_matrix=tuple(tuple(self.link_matrix[p][q] for q in pos) for p in pos))

  # --- serialisation -------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": self.name,
        "source": self.source,
        "devices": [dataclasses.asdict(d) for d in self.devices],
        "link_matrix": [list(r) for r in self.link_matrix],
        "links": {k: dataclasses.asdict(v) for k, v in self.links},
        "nics": [dataclasses.asdict(n) for n in self.nics],
        "numa_nodes": [dataclasses.asdict(n) for n in self.numa_nodes],
        "notes": list(self.notes),
        **({"measured": list(self.measured)} if self.measured else {}),
        **({"nvls": True} if self.nvls else {}),
        **({"calibration": _calibration_dict(self.calibration)} if self.calibration else {}),
    }

  def to_json(self, indent: int | None = 1) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> Topology:
    """Builds a topology from :meth:`to_dict` output; every problem found is listed at once."""
    hint = (f"Expected a {FORMAT} object: keys format, name, devices, link_matrix and "
            "optionally links, nics, numa_nodes, source, notes; see dtenjax/fixtures/*.json, "
            "dtenjax/schemas/topology-1.schema.json or Topology.to_json().")
    if not isinstance(data, Mapping):
      raise errors.TopologyError(
          f"{origin} does not describe a topology: expected a JSON object, got "
          f"{type(data).__name__}. {hint}")
    fmt = data.get("format")
    if fmt is not None and fmt != FORMAT:
      newer = isinstance(fmt, str) and fmt.startswith("dtenjax.topology/")
      raise errors.TopologyError(
          f"{origin} has format {fmt!r}; this dtenjax reads {FORMAT!r}" +
          (" (the file was written by a newer dtenjax: upgrade dtenjax, or save the topology "
           "again with this one)." if newer else f". {hint}"))
    problems = [f"missing key {k!r}" for k in ("name", "devices", "link_matrix") if k not in data]
    known = {"format", "name", "devices", "link_matrix", "links", "nics", "numa_nodes", "source",
             "notes", "measured", "nvls", "calibration"}
    problems += [f"unknown key {k!r}" for k in sorted(set(data) - known)]
    for k, t in (("name", str), ("source", str)):
      if k in data and not isinstance(data[k], t):
        problems.append(f"{k!r} must be a string, got {data[k]!r}")
    notes = data.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
      problems.append("'notes' must be a list of strings")
      notes = []
    if not isinstance(data.get("nvls", False), bool):
      problems.append(f"'nvls' must be true or false, got {data['nvls']!r}")
    calibration = None
    if data.get("calibration") is not None:
      try:
        calibration = _calibration_from(data["calibration"])
      except (TypeError, ValueError, KeyError, errors.TopologyError) as e:
        problems.append(f"'calibration' is invalid ({e}); write it as Topology.to_json() does")
    measured = data.get("measured", [])
    if not isinstance(measured, list) or not all(m in LINK_ORDER for m in measured):
      problems.append(f"'measured' must be a list of link classes from {LINK_ORDER}")
      measured = []

    def records(key, kind, required):
      out = []
      items = data.get(key, [])
      if not isinstance(items, list):
        problems.append(f"{key!r} must be a list, got {type(items).__name__}")
        return out
      fields = {f.name for f in dataclasses.fields(kind)}
      for i, item in enumerate(items):
        if not isinstance(item, Mapping):
          problems.append(f"{key}[{i}] must be an object, got {item!r}")
          continue
        missing = sorted(set(required) - set(item))
        extra = sorted(set(item) - fields)
        if missing:
          problems.append(f"{key}[{i}] is missing {missing}")
        if extra:
          problems.append(f"{key}[{i}] has unknown fields {extra}")
        typed = _type_problems(f"{key}[{i}]", kind, item)
        problems.extend(typed)
        if not missing and not extra and not typed:
          try:
            out.append(kind(**item))
          except (TypeError, ValueError) as e:
            problems.append(f"{key}[{i}]: {e}")
      return out

    devices = records("devices", DeviceInfo,
                      ("id", "platform", "kind", "memory_bytes", "process_index", "host"))
    nics = records("nics", NicInfo, ("name", "host"))
    numa = records("numa_nodes", NumaNode, ("host", "id"))
    links = dict(DEFAULT_LINKS)
    raw_links = data.get("links", {})
    if not isinstance(raw_links, Mapping):
      problems.append(f"'links' must be an object, got {type(raw_links).__name__}")
      raw_links = {}
    for k, v in raw_links.items():
      if k not in LINK_ORDER:
        problems.append(f"links has unknown class {k!r}; use one of {LINK_ORDER}")
        continue
      typed = (_type_problems(f"links[{k!r}]", LinkSpec, v) if isinstance(v, Mapping) else
               [f"links[{k!r}] must be an object with bandwidth_gbps and latency_us"])
      if typed:
        problems.extend(typed)
        continue
      try:
        links[k] = LinkSpec(**v)
      except (TypeError, errors.TopologyError) as e:
        problems.append(f"links[{k!r}]: {e}")
    matrix = data.get("link_matrix", [])
    if not isinstance(matrix, list) or not all(
        isinstance(r, list) and all(isinstance(c, str) for c in r) for r in matrix):
      problems.append("'link_matrix' must be a list of lists of link class names")
      matrix = []
    if problems:
      raise errors.TopologyError(errors.join_problems(
          f"{origin} does not describe a topology. {hint}", problems))
    try:
      return cls(
          name=str(data["name"]),
          devices=tuple(devices),
          link_matrix=tuple(tuple(r) for r in matrix),
          links=_freeze_links(links),
          nics=tuple(nics),
          numa_nodes=tuple(numa),
          source=data.get("source", "json"),
          notes=tuple(notes),
          measured=tuple(measured),
          nvls=data.get("nvls", False) is True,
          calibration=calibration,
      )
    except errors.TopologyError as e:
      raise errors.TopologyError(f"{origin}: {e}") from None

  @classmethod
  def from_json(cls, text_or_path: str | os.PathLike) -> Topology:
    """Parses JSON text, or reads a file when given a path."""
    text = os.fspath(text_or_path)
    if isinstance(text_or_path, os.PathLike) or text.lstrip()[:1] not in ("{", "["):
      origin = text
      try:
        with open(text, encoding="utf-8") as f:
          text = f.read()
      except OSError as e:
        raise errors.TopologyError(
            f"cannot read topology file {origin!r}: {e.strerror or e}. Pass JSON text or the "
            "path of a file written by Topology.to_json().") from None
    else:
      origin = "<json string>"
    return cls._parse(text, origin)

  @classmethod
  def _parse(cls, text: str, origin: str) -> Topology:
    try:
      data = json.loads(text)
    except json.JSONDecodeError as e:
      raise errors.TopologyError(
          f"{origin} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); fix the "
          "file or regenerate it with Topology.to_json().") from None
    return cls.from_dict(data, origin)

  # --- constructors --------------------------------------------------------------------------

  @staticmethod
  def fixtures() -> tuple[str, ...]:
    """Names of the shipped reference topologies (JSON files) and the generated clusters."""
    files = resources.files("dtenjax") / "fixtures"
    return tuple(sorted([p.name[:-5] for p in files.iterdir() if p.name.endswith(".json")] +
                        list(CLUSTERS)))

  @classmethod
  def fixture(cls, name: str) -> Topology:
    """A reference topology, e.g. ``"dgx_a100_8"``, ``"roce_a100_4x8"`` or a generated cluster
    of 8-GPU hosts such as ``"h100_64"`` (:data:`CLUSTERS`)."""
    names = cls.fixtures()
    if name not in names:
      raise errors.TopologyError(f"no topology fixture named {name!r}; available: {names}")
    if name in CLUSTERS:
      return _cluster(name)
    path = resources.files("dtenjax") / "fixtures" / f"{name}.json"
    return cls._parse(path.read_text(encoding="utf-8"), f"fixture {name!r}")

  @classmethod
  def detect(cls, devices: Sequence[Any] | None = None) -> Topology:
    """Describes the running machine (see module docstring)."""
    return cls(**detect_lib.describe(devices))

  def probe(self, **kwargs) -> Topology:
    """Measures alpha/beta per link class on the devices present; returns an updated copy."""
    measured, notes = probe_lib.measure(self, **kwargs)
    return self.with_links(measured, source="probed", notes=notes)

  @classmethod
  def current(cls) -> Topology:
    """The topology dtenjax plans with: DTENJAX_TOPOLOGY (a JSON file) if set, else detected.

    Cached per process; :func:`set_current` replaces it (e.g. with a probed copy).
    """
    global _current
    if _current is None:
      path = config.get_str("DTENJAX_TOPOLOGY")
      _current = cls.from_json(path) if path else cls.detect()
    return _current


_current: Topology | None = None


def _count_cpus(cpus: str) -> int:
  """CPUs in a sysfs cpulist such as ``"0-3,8-11"`` (0 when empty or unreadable)."""
  total = 0
  for part in cpus.split(","):
    lo, _, hi = part.strip().partition("-")
    try:
      total += int(hi or lo) - int(lo) + 1
    except ValueError:
      continue
  return total


def _calibration_dict(cal: Calibration) -> dict[str, Any]:
  out = dataclasses.asdict(cal)
  out["collectives"] = {k: [[b, t] for b, t in pts] for k, pts in cal.collectives}
  return out


def _calibration_from(data: Mapping[str, Any]) -> Calibration:
  if not isinstance(data, Mapping):
    raise TypeError(f"expected an object, got {type(data).__name__}")
  fields = dict(data)
  coll = fields.pop("collectives", {})
  if not isinstance(coll, Mapping):
    raise TypeError("'collectives' must map a kind to [[nbytes, seconds], ...]")
  fields["collectives"] = tuple((str(k), tuple((int(b), float(t)) for b, t in pts))
                                for k, pts in coll.items())
  return Calibration(**fields)

# Generated fixtures for planning beyond this machine: hosts of 8 H100 SXM (80 GB, NVLink4 through
# NVSwitch), one 400 Gb/s NIC per GPU (InfiniBand NDR, 50 GB/s per direction); too large to ship
# as JSON (the link matrix of 1,024 GPUs has a million entries), so they are built on request.
CLUSTERS = {"h100_16": 2, "h100_64": 8, "h100_256": 32, "h100_1024": 128}


@functools.lru_cache(maxsize=8)
def _cluster(name: str) -> Topology:
  hosts = CLUSTERS[name]
  devices = [DeviceInfo(id=h * 8 + i, platform="gpu", kind="NVIDIA H100 80GB HBM3",
                        memory_bytes=80 << 30, process_index=h * 8 + i, host=f"node{h}",
                        numa_node=i // 4, local_index=i)
             for h in range(hosts) for i in range(8)]
  nics = [NicInfo(name=f"mlx5_{i}", host=f"node{h}", link_layer="InfiniBand",
                  bandwidth_gbps=50.0, numa_node=i // 4) for h in range(hosts) for i in range(8)]
  numa = [NumaNode(host=f"node{h}", id=n) for h in range(hosts) for n in range(2)]
  return uniform(name, devices, intra="nvswitch", inter="infiniband",
                 links={"infiniband": LinkSpec(50.0, 3.0)}, nics=nics, numa_nodes=numa,
                 notes=[f"{hosts} hosts x 8 H100 SXM through NVSwitch, 8 x 400 Gb/s "
                        "InfiniBand NICs per host (generated)"])


def set_current(topology: Topology | None) -> None:
  """Makes ``topology`` the one :meth:`Topology.current` returns (None: detect again)."""
  global _current
  _current = topology


def uniform(name: str, devices: Sequence[DeviceInfo], intra: str, inter: str = "tcp",
            links: Mapping[str, LinkSpec] | None = None, nics: Sequence[NicInfo] = (),
            numa_nodes: Sequence[NumaNode] = (), source: str = "fixture",
            notes: Sequence[str] = ()) -> Topology:
  """Builds a topology where devices on one host share ``intra`` and hosts are joined by
  ``inter``; devices on different NUMA nodes of one host use ``numa_cross`` when ``intra`` is
  ``pcie``."""
  matrix = []
  for a in devices:
    row = []
    for b in devices:
      if a.id == b.id:
        row.append("local")
      elif a.host != b.host:
        row.append(inter)
      elif intra == "pcie" and a.numa_node != b.numa_node:
        row.append("numa_cross")
      else:
        row.append(intra)
    matrix.append(tuple(row))
  all_links = dict(DEFAULT_LINKS)
  all_links.update(links or {})
  return Topology(name=name, devices=tuple(devices), link_matrix=tuple(matrix),
                  links=_freeze_links(all_links), nics=tuple(nics),
                  numa_nodes=tuple(numa_nodes), source=source, notes=tuple(notes))

