"""Topology detection for the running machine (see :meth:`dtenjax.Topology.detect`).

Sources, each optional, each recorded in ``Topology.notes`` when it was missing:
* jax: devices, platforms, kinds, memory, process indices (``jax.distributed`` when initialised);
* cuda-python: peer access between local GPUs; NVML (pynvml or cuda-python's nvml) for NVLink;
* pyverbs through :mod:`dtenjax._src.net.rdma`: RDMA NICs ("no device" means no RDMA);
* sysfs: NUMA nodes and their CPUs (devices are recorded on NUMA node 0; jax does not expose
  a GPU's PCI address).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from typing import Any

import jax

from dtenjax._src.topology import parts as topo


def _numa_nodes(host: str) -> list[topo.NumaNode]:
  nodes = []
  for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*")):
    try:
      with open(os.path.join(path, "cpulist"), encoding="utf-8") as f:
        cpus = f.read().strip()
    except OSError:
      cpus = ""
    nodes.append(topo.NumaNode(host=host, id=int(path.rsplit("node", 1)[1]), cpus=cpus))
  return nodes or [topo.NumaNode(host=host, id=0, cpus=f"0-{(os.cpu_count() or 1) - 1}")]


def _memory_bytes(d) -> int:
  try:
    stats = d.memory_stats() or {}
  except Exception:  # pylint: disable=broad-except  (CPU devices raise or return None)
    stats = {}
  return int(stats.get("bytes_limit", 0))


def _gpu_links(local_gpus: list[Any], notes: list[str]) -> dict[tuple[int, int], str]:
  """Link class between local GPU ordinals, from NVML NVLink state and CUDA peer access."""
  n = len(local_gpus)
  links: dict[tuple[int, int], str] = {}
  if n < 2:
    return links
  peer = None
  try:
    try:
      from cuda.bindings import runtime as cudart  # pylint: disable=g-import-not-at-top
    except ImportError:
      from cuda import cudart  # type: ignore  # pylint: disable=g-import-not-at-top
    peer = {}
    for i in range(n):
      for j in range(n):
        if i != j:
          err, ok = cudart.cudaDeviceCanAccessPeer(i, j)
          peer[(i, j)] = bool(ok) and int(err) == 0
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"cuda-python unavailable ({type(e).__name__}); GPU peer access not checked")
  nvlinks = None
  try:
    import pynvml  # type: ignore  # pylint: disable=g-import-not-at-top
    pynvml.nvmlInit()
    nvlinks = {}
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    bus = [pynvml.nvmlDeviceGetPciInfo(h).busId for h in handles]
    bus = [b.decode() if isinstance(b, bytes) else b for b in bus]
    for i, h in enumerate(handles):
      for link in range(18):
        try:
          if pynvml.nvmlDeviceGetNvLinkState(h, link) != 1:
            continue
          remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId
          remote = remote.decode() if isinstance(remote, bytes) else remote
        except Exception:  # pylint: disable=broad-except
          break
        if remote in bus:
          nvlinks[(i, bus.index(remote))] = "nvlink"
        else:
          nvlinks[("switch", i)] = "nvswitch"   # the remote end is an NVSwitch
  except Exception as e:  # pylint: disable=broad-except
    notes.append(f"NVML unavailable ({type(e).__name__}); NVLink inferred from peer access")
  for i in range(n):
    for j in range(n):
      if i == j:
        continue
      if nvlinks is not None and (("switch", i) in nvlinks and ("switch", j) in nvlinks):
        links[(i, j)] = "nvswitch"
      elif nvlinks is not None and ((i, j) in nvlinks or (j, i) in nvlinks):
        links[(i, j)] = "nvlink"
      elif peer is not None and peer.get((i, j)):
        links[(i, j)] = "pcie"
      else:
        links[(i, j)] = "numa_cross" if peer is not None else "pcie"
  return links


def exchange_hostnames(host: str, rank: int, size: int, store: Any = None) -> dict[int, str]:
  """Every process's host name, by process index, through the coordination key-value store
  (:mod:`dtenjax._src.net.kvstore`). Raises if the store is missing or a peer does not answer."""
  if store is None:
    from dtenjax._src.net import kvstore  # pylint: disable=g-import-not-at-top
    store = kvstore.default()
  names = store.exchange("topology-hosts", rank, size, host)
  return {p: str(n) for p, n in enumerate(names)}


def inter_host_class(nics) -> str:
  """The link class between hosts: InfiniBand if an active NIC has that link layer (in any
  spelling pyverbs or sysfs gives), RoCE if an active NIC is Ethernet, else TCP."""
  active = [n for n in nics if n.state.upper().startswith("ACTIVE")]
  if not active:
    return "tcp"
  return "infiniband" if any(n.link_layer.lower() == "infiniband" for n in active) else "roce"


def _transport_note() -> str:
  """Which host transport provider communicators would use here, and why (verbs or not)."""
  try:
    from dtenjax._src.net import transport  # pylint: disable=g-import-not-at-top
    if not transport.is_available():
      return "host transport: unavailable (the native extension has no transport)"
    name, why = transport.select_provider()
    return f"host transport: {name} ({why})"
  except Exception as e:  # pylint: disable=broad-except  (a bad DTENJAX_TRANSPORT, say)
    return f"host transport: none can be chosen ({type(e).__name__}: {e})"


def describe(devices: Sequence[Any] | None = None) -> dict[str, Any]:
  """The running machine as ``Topology`` constructor arguments (see :meth:`Topology.detect`)."""
  devices = list(jax.devices() if devices is None else devices)
  notes: list[str] = []
  host = topo.local_host_name()
  me = jax.process_index()
  n_proc = jax.process_count()
  hosts = {p: (host if p == me else f"process{p}") for p in range(n_proc)}
  if n_proc > 1:
    try:
      hosts.update(exchange_hostnames(host, me, n_proc))
    except Exception as e:  # pylint: disable=broad-except
      notes.append(f"host names of other processes unknown ({type(e).__name__}: {e}); each "
                   "process is treated as its own host")
  local_gpus = [d for d in devices if d.process_index == me and d.platform == "gpu"]
  gpu_links = _gpu_links(local_gpus, notes)
  gpu_pos = {d.id: i for i, d in enumerate(local_gpus)}

  nics: list[topo.NicInfo] = []
  try:
    from dtenjax._src.net import rdma  # pylint: disable=g-import-not-at-top
    for nic in rdma.discover_nics():
      nics.append(topo.NicInfo(name=nic["name"], host=host, port=int(nic.get("port", 1)),
                               link_layer=nic.get("link_layer", "Ethernet"),
                               state=nic.get("state", "ACTIVE"),
                               bandwidth_gbps=float(nic.get("bandwidth_gbps", 12.5)),
                               numa_node=int(nic.get("numa_node", 0))))
    if not nics:
      notes.append("no RDMA NIC: " + str(rdma.unavailable_reason()))
    for e in rdma.emulated_nics():   # a test device: visible as what it is, never a link
      notes.append(f"EMULATED RDMA device {e['name']} port {e['port']} ({e['link_layer']}, "
                   f"{e['state']}, {e['rate_gbit_s']:g} Gb/s) from {e['source']}: dtenjax's "
                   "test device (DTENJAX_IBVERBS_LIBRARY), not a NIC; no link uses it")
  except ImportError:
    notes.append("no RDMA NIC: dtenjax._src.net.rdma is not available")
  except Exception as e:  # pylint: disable=broad-except  (pyverbs errors mean "no RDMA")
    notes.append(f"no RDMA NIC: discovery failed ({type(e).__name__}: {e})")
  inter = inter_host_class(nics)
  notes.append(_transport_note())

  infos = []
  local_counts: dict[int, int] = {}
  for d in devices:
    li = local_counts.get(d.process_index, 0)
    local_counts[d.process_index] = li + 1
    infos.append(topo.DeviceInfo(
        id=d.id, platform=d.platform, kind=getattr(d, "device_kind", d.platform),
        memory_bytes=_memory_bytes(d) if d.process_index == me else 0,
        process_index=d.process_index, host=hosts.get(d.process_index, host), numa_node=0,
        local_index=li))

  def cls(a: topo.DeviceInfo, b: topo.DeviceInfo) -> str:
    if a.id == b.id:
      return "local"
    if a.host != b.host:
      return inter
    if a.platform == "gpu" and b.platform == "gpu":
      if a.id in gpu_pos and b.id in gpu_pos:
        return gpu_links.get((gpu_pos[a.id], gpu_pos[b.id]), "pcie")
      return "pcie"   # GPUs of other processes on this host: no peer information here
    return "shared_memory" if a.process_index == b.process_index else "numa_cross"

  matrix = tuple(tuple(cls(a, b) for b in infos) for a in infos)
  platform = devices[0].platform if devices else "none"
  if platform == "cpu":
    notes.append(f"{len(devices)} CPU devices of {n_proc} process(es); devices of one process "
                 "share memory ('shared_memory' links)")
  return dict(name=f"detected:{host}:{platform}x{len(devices)}", devices=tuple(infos),
              link_matrix=matrix, nics=tuple(nics), numa_nodes=tuple(_numa_nodes(host)),
              source="detected", notes=tuple(notes))
