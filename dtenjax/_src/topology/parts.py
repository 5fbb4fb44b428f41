"""The parts a topology is made of: link classes and their specs, devices, NICs, NUMA nodes.

Plain frozen values with no behaviour beyond validation, shared by the model (``model.py``), the
detector (``detect.py``) and the prober (``probe.py``), which import them from here and never from
each other.
"""

from __future__ import annotations

import dataclasses
import platform as _platform
import socket
from collections.abc import Mapping

from dtenjax._src import errors

# Fastest first. "local" is a device to itself. "unknown" is a link inside one host that
# detection could not see (GPUs without dtenjax[gpu]'s cuda-python and NVML, or NVML failing):
# it ranks below every measured intra-host class, so meshes never put an unknown pair on a
# fast axis ahead of a known NVLink, and it is priced like PCIe (DEFAULT_LINKS) so no plan
# counts on bandwidth nobody saw. Topology.probe() measures it like any other class.
LINK_ORDER = ("local", "nvswitch", "nvlink", "shared_memory", "pcie", "numa_cross", "unknown",
              "infiniband", "roce", "tcp")
# Classes that stay inside one host.
INTRA_HOST = frozenset(("local", "nvswitch", "nvlink", "shared_memory", "pcie", "numa_cross",
                        "unknown"))


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
    "unknown": LinkSpec(24.0, 5.0),        # not detected: priced as PCIe until probed
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
  pci_bus_id: str = ""    # GPUs: "dddd:bb:dd.f" as sysfs spells it; "" when unknown

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


def local_host_name() -> str:
  return socket.gethostname() or _platform.node() or "localhost"


# Kinds of collective a Calibration may time (XLA's own ops over all the measured devices).
CALIBRATED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Calibration:
  """Measured speeds of one host's devices while all of them work at once
  (:meth:`Topology.calibrate`): what the planner prices compute and XLA's collectives with in
  place of the table priors.

  Attributes:
    platform: the devices' platform ("cpu", "gpu", ...).
    devices: how many devices ran each measurement together (the whole host's).
    cores: host CPU cores (devices of a CPU platform share them).
    matmul_flops: FLOP/s of one device's float32 matrix products while every device computes.
    memory_gbps: bytes/s (1e9) one device reads plus writes in elementwise passes, all at once.
    collectives: ``((kind, ((nbytes, seconds), ...)), ...)``: one XLA collective over all the
      measured devices, ``nbytes`` per participant (all-gather and reduce-scatter: the full,
      gathered or unscattered buffer), from a jitted chain; sizes ascending.
    latency_s: the extra seconds of one small collective placed between products (the devices'
      rendezvous while they share the host; on a CPU more than the collective alone).
    stream_gbps: bytes/s (1e9) one device moves in the optimizer's update of a state beyond its
      caches, all at once, counted as the cost model counts AdamW's update on XLA:CPU (10 bytes
      per parameter byte); 0 where not measured (a GPU, or a record from before it was).
  """
  platform: str
  devices: int
  cores: int
  matmul_flops: float
  memory_gbps: float
  collectives: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
  latency_s: float = 0.0
  stream_gbps: float = 0.0

  def __post_init__(self):
    problems = []
    if self.devices < 1 or self.cores < 1:
      problems.append(f"devices={self.devices} and cores={self.cores} must be >= 1")
    if not self.matmul_flops > 0 or not self.memory_gbps > 0:
      problems.append(f"matmul_flops={self.matmul_flops} and memory_gbps={self.memory_gbps} must "
                      "be > 0")
    if not self.latency_s >= 0:
      problems.append(f"latency_s={self.latency_s} must be >= 0")
    if not self.stream_gbps >= 0:
      problems.append(f"stream_gbps={self.stream_gbps} must be >= 0 (0: not measured)")
    for kind, points in self.collectives:
      if kind not in CALIBRATED_KINDS:
        problems.append(f"collectives has kind {kind!r}; use one of {CALIBRATED_KINDS}")
      sizes = [b for b, _ in points]
      if not points or sizes != sorted(set(sizes)) or any(b <= 0 or not t > 0 for b, t in points):
        problems.append(f"collectives[{kind!r}] = {points!r} must be (nbytes > 0, seconds > 0) "
                        "pairs with sizes strictly ascending")
    if problems:
      raise errors.TopologyError(errors.join_problems("invalid Calibration:", problems))

  def collective_s(self, kind: str, nbytes: float) -> float | None:
    """Seconds of one ``kind`` of ``nbytes`` (per participant) over the measured devices:
    piecewise linear between the measured sizes, the last segment's slope beyond them, the
    smallest size's time below it; None when ``kind`` was not measured."""
    points = dict(self.collectives).get(kind)
    if not points:
      return None
    if nbytes <= points[0][0] or len(points) == 1:
      if len(points) == 1:
        return points[0][1] * max(1.0, nbytes / points[0][0])
      return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
      if nbytes <= b1:
        return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
    (b0, t0), (b1, t1) = points[-2], points[-1]
    return t1 + max(t1 - t0, 0.0) / (b1 - b0) * (nbytes - b1)

  def summary(self) -> str:
    kinds = ", ".join(f"{k} " + "/".join(f"{t * 1e3:.2f}" for _, t in pts) + " ms at " +
                      "/".join(_size(b) for b, _ in pts) for k, pts in self.collectives)
    return (f"calibrated on {self.devices} {self.platform} devices sharing {self.cores} cores: "
            f"{self.matmul_flops / 1e9:.1f} GFLOP/s and {self.memory_gbps:.2f} GB/s per device, "
            f"a collective between products {self.latency_s * 1e6:.0f} us"
            + (f", the optimizer's update streaming {self.stream_gbps:.2f} GB/s per device"
               if self.stream_gbps > 0 else "")
            + (f"; {kinds}" if kinds else ""))


def _size(nbytes: int) -> str:
  for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
    if nbytes >= 1 << shift:
      return f"{nbytes / (1 << shift):g} {unit}"
  return f"{nbytes} B"
