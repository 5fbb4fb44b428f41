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
:func:`dtenjax.make_mesh` keeps inner mesh axes on the fastest links.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform as _platform
import socket
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from dtenjax._src import config
from dtenjax._src import errors

# Fastest first. "local" is a device to itself.
LINK_ORDER = ("local", "nvswitch", "nvlink", "shared_memory", "pcie", "numa_cross",
              "infiniband", "roce", "tcp")
# Classes that stay inside one host.
INTRA_HOST = frozenset(("local", "nvswitch", "nvlink", "shared_memory", "pcie", "numa_cross"))


@dataclasses.dataclass(frozen=True)
class LinkSpec:
  """One link class: unidirectional bandwidth in GB/s (1e9 B/s) and one-way latency in us."""
  bandwidth_gbps: float
  latency_us: float

  def __post_init__(self):
    if not self.bandwidth_gbps > 0 or not self.latency_us >= 0:
      raise errors.TopologyError(
          f"LinkSpec(bandwidth_gbps={self.bandwidth_gbps}, latency_us={self.latency_us}) is "
          "invalid: bandwidth must be > 0 and latency >= 0.")

  @property
  def alpha(self) -> float:
    """Latency in seconds."""
    return self.latency_us * 1e-6

  @property
  def beta(self) -> float:
    """Seconds per byte."""
    return 1.0 / (self.bandwidth_gbps * 1e9)


# Table values, used until Topology.probe() measures the machine. Per direction.
DEFAULT_LINKS: Mapping[str, LinkSpec] = {
    "local": LinkSpec(2000.0, 0.5),        # device memory to itself (H200 copy ~2.1 TB/s each way)
    "nvswitch": LinkSpec(450.0, 2.0),      # NVLink4 through NVSwitch (H100/H200 SXM, 900 GB/s bidir)
    "nvlink": LinkSpec(300.0, 2.5),        # NVLink3 full mesh (A100 SXM, 12 links x 25 GB/s)
    "shared_memory": LinkSpec(20.0, 1.0),  # devices of one process on one host (CPU devices)
    "pcie": LinkSpec(24.0, 5.0),           # PCIe 4.0 x16 peer-to-peer
    "numa_cross": LinkSpec(16.0, 8.0),     # PCIe across the inter-socket link
    "infiniband": LinkSpec(25.0, 3.0),     # HDR 200 Gb/s
    "roce": LinkSpec(12.5, 5.0),           # RoCE v2 100 Gb/s; a ring step costs a round trip (~5 us)
    "tcp": LinkSpec(1.25, 30.0),           # 10 GbE kernel TCP
}

# Peak dense throughput used for compute estimates, FLOP/s, by device kind substring.
PEAK_FLOPS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
              ("V100", 125e12),
              ("cpu", 5e10))


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
  id: int                 # jax Device.id
  platform: str           # "gpu", "cpu", ...
  kind: str               # e.g. "NVIDIA H200", "cpu"
  memory_bytes: int       # 0 when unknown
  process_index: int
  host: str
  numa_node: int = 0
  local_index: int = 0    # index among the devices of its process

  @property
  def peak_flops(self) -> float:
    for key, flops in PEAK_FLOPS:
      if key.lower() in self.kind.lower():
        return flops
    return PEAK_FLOPS[-1][1]


@dataclasses.dataclass(frozen=True)
class NicInfo:
  name: str               # e.g. "mlx5_0"
  host: str
  port: int = 1
  link_layer: str = "Ethernet"   # "InfiniBand" or "Ethernet" (RoCE)
  state: str = "ACTIVE"
  bandwidth_gbps: float = 12.5   # GB/s per direction
  numa_node: int = 0


@dataclasses.dataclass(frozen=True)
class NumaNode:
  host: str
  id: int
  cpus: str = ""


def _freeze_links(links: Mapping[str, LinkSpec]) -> tuple[tuple[str, LinkSpec], ...]:
  return tuple(sorted(links.items(), key=lambda kv: LINK_ORDER.index(kv[0])))


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

  def __post_init__(self):
    problems = []
    n = len(self.devices)
    if n == 0:
      problems.append("it has no devices")
    ids = [d.id for d in self.devices]
    if len(set(ids)) != n:
      problems.append(f"device ids are not unique: {ids}")
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
          if self.link_matrix[j][i] != cls:
            problems.append(f"link_matrix is not symmetric at [{i}][{j}]")
            break
        if len(problems) > 8:
          break
    if problems:
      raise errors.TopologyError(errors.join_problems(
          f"Topology {self.name!r} is invalid:", problems))

  # --- lookups -------------------------------------------------------------------------------

  @functools.cached_property
  def _pos(self) -> dict[int, int]:
    return {d.id: i for i, d in enumerate(self.devices)}

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
    return dict(self.links)[self.link_class(a, b)]

  def spec(self, link_class: str) -> LinkSpec:
    return dict(self.links)[link_class]

  def slowest_link(self, group: Sequence[int]) -> tuple[str, LinkSpec]:
    """The slowest class between any two members of ``group`` (the ring's bottleneck)."""
    if len(group) < 2:
      return "local", self.spec("local")
    worst = max((self.link_class(a, b) for a in group for b in group if a != b),
                key=LINK_ORDER.index)
    return worst, self.spec(worst)

  def hosts(self) -> tuple[tuple[int, ...], ...]:
    """Device ids grouped by host, hosts in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for d in self.devices:
      groups.setdefault(d.host, []).append(d.id)
    return tuple(tuple(g) for g in groups.values())

  def islands(self, within: str = "nvlink") -> tuple[tuple[int, ...], ...]:
    """Connected groups of devices whose links are at least as fast as ``within``.

    With the default, an island is a set of GPUs joined by NVLink/NVSwitch; CPU devices of one
    process (joined by shared memory) are one island when ``within="shared_memory"``.
    """
    limit = LINK_ORDER.index(within)
    seen: set[int] = set()
    out = []
    for d in self.devices:
      if d.id in seen:
        continue
      comp, todo = [], [d.id]
      seen.add(d.id)
      while todo:
        a = todo.pop()
        comp.append(a)
        for b in self.device_ids:
          if b not in seen and LINK_ORDER.index(self.link_class(a, b)) <= limit:
            seen.add(b)
            todo.append(b)
      out.append(tuple(sorted(comp, key=self.position)))
    return tuple(out)

  def fast_islands(self) -> tuple[tuple[int, ...], ...]:
    """The natural first level of a hierarchy: NVLink islands on GPUs, a host's shared memory
    on CPUs, otherwise whole hosts."""
    for level in ("nvlink", "shared_memory", "numa_cross"):
      isl = self.islands(level)
      if len(isl) < self.num_devices:
        return isl
    return tuple((i,) for i in self.device_ids)

  def hierarchy_key(self, device_id: int) -> tuple:
    """Sort key that puts devices sharing faster links next to each other."""
    d = self.device(device_id)
    island = next(i for i, isl in enumerate(self.fast_islands()) if device_id in isl)
    host = next(i for i, h in enumerate(self.hosts()) if device_id in h)
    return (host, island, d.numa_node, self.position(device_id))

  def peak_flops(self) -> float:
    return min(d.peak_flops for d in self.devices)

  def with_links(self, links: Mapping[str, LinkSpec], source: str = "probed",
                 notes: Sequence[str] = ()) -> Topology:
    """A copy with some link classes' specs replaced (e.g. by measured values)."""
    merged = dict(self.links)
    merged.update(links)
    return dataclasses.replace(self, links=_freeze_links(merged), source=source,
                               notes=self.notes + tuple(notes))

  def subset(self, device_ids: Sequence[int]) -> Topology:
    """The topology restricted to ``device_ids`` (in that order)."""
    pos = [self.position(i) for i in device_ids]
    return dataclasses.replace(
        self, devices=tuple(self.devices[p] for p in pos),
        link_matrix=tuple(tuple(self.link_matrix[p][q] for q in pos) for p in pos))

  # --- serialisation -------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return {
        "name": self.name,
        "source": self.source,
        "devices": [dataclasses.asdict(d) for d in self.devices],
        "link_matrix": [list(r) for r in self.link_matrix],
        "links": {k: dataclasses.asdict(v) for k, v in self.links},
        "nics": [dataclasses.asdict(n) for n in self.nics],
        "numa_nodes": [dataclasses.asdict(n) for n in self.numa_nodes],
        "notes": list(self.notes),
    }

  def to_json(self, indent: int | None = 1) -> str:
    return json.dumps(self.to_dict(), indent=indent)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> Topology:
    try:
      links = dict(DEFAULT_LINKS)
      links.update({k: LinkSpec(**v) for k, v in data.get("links", {}).items()})
      return cls(
          name=data["name"],
          devices=tuple(DeviceInfo(**d) for d in data["devices"]),
          link_matrix=tuple(tuple(r) for r in data["link_matrix"]),
          links=_freeze_links(links),
          nics=tuple(NicInfo(**n) for n in data.get("nics", [])),
          numa_nodes=tuple(NumaNode(**n) for n in data.get("numa_nodes", [])),
          source=data.get("source", "json"),
          notes=tuple(data.get("notes", [])),
      )
    except errors.TopologyError as e:
      raise errors.TopologyError(f"{origin}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
      raise errors.TopologyError(
          f"{origin} does not describe a topology ({type(e).__name__}: {e}). Expected keys "
          "name, devices, link_matrix and optionally links, nics, numa_nodes; see "
          "dtenjax/fixtures/*.json or Topology.to_json().") from None

  @classmethod
  def from_json(cls, text_or_path: str | os.PathLike) -> Topology:
    origin = "<json string>"
    text = str(text_or_path)
    if not text.lstrip().startswith("{"):
      origin = text
      try:
        with open(text, encoding="utf-8") as f:
          text = f.read()
      except OSError as e:
        raise errors.TopologyError(f"cannot read topology file {origin!r}: {e}") from None
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
    """Names of the shipped reference topologies."""
    files = resources.files("dtenjax") / "fixtures"
    return tuple(sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json")))

  @classmethod
  def fixture(cls, name: str) -> Topology:
    """A shipped reference topology, e.g. ``"dgx_a100_8"`` or ``"roce_a100_4x8"``."""
    names = cls.fixtures()
    if name not in names:
      raise errors.TopologyError(f"no topology fixture named {name!r}; available: {names}")
    path = resources.files("dtenjax") / "fixtures" / f"{name}.json"
    return cls._parse(path.read_text(encoding="utf-8"), f"fixture {name!r}")

  @classmethod
  def detect(cls, devices: Sequence[Any] | None = None) -> Topology:
    """Describes the running machine (see module docstring)."""
    from dtenjax._src import detect as _detect  # pylint: disable=g-import-not-at-top
    return _detect.detect(devices)

  def probe(self, **kwargs) -> Topology:
    """Measures alpha/beta per link class on the devices present; returns an updated copy."""
    from dtenjax._src import probe as _probe  # pylint: disable=g-import-not-at-top
    return _probe.probe(self, **kwargs)

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


def set_current(topology: Topology | None) -> None:
  """Makes ``topology`` the one :meth:`Topology.current` returns (None: detect again)."""
  global _current
  _current = topology


def local_host_name() -> str:
  return socket.gethostname() or _platform.node() or "localhost"


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

