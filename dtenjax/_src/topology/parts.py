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
