"""Topology detection for the running machine (see :meth:`dtenjax.Topology.detect`).

Sources, each optional, each recorded in ``Topology.notes`` when it was missing:

* jax: devices, platforms, kinds, memory, process indices (``jax.distributed`` when initialised);
* GPUs, with ``pip install 'dtenjax[gpu]'`` (cuda-python and nvidia-ml-py):

  - each jax GPU's PCI bus id from the CUDA runtime (``cudaDeviceGetPCIBusId`` of the device's
    CUDA ordinal, ``Device.local_hardware_id``), so devices are matched to NVML by bus id and not
    by index (NVML ignores ``CUDA_VISIBLE_DEVICES``; CUDA renumbers);
  - the NUMA node of each GPU from ``/sys/bus/pci/devices/<bus id>/numa_node``;
  - NVLink from NVML, read per link of every GPU of this host by bus id (``nvmlDeviceGetHandleBy
    PciBusId_v2``, ``nvmlDeviceGetNvLinkState``, ``...RemoteDeviceType``, ``...RemotePciInfo_v2``):
    a link to another GPU makes the pair ``nvlink``; GPUs whose links go to NVSwitches are
    ``nvswitch`` to each other; other pairs are ``pcie`` on one NUMA node and ``numa_cross``
    across nodes;
  - GPUs of other processes on the same host are included: processes exchange their GPUs' bus ids
    and NUMA nodes through the coordination store (:mod:`dtenjax._src.net.kvstore`), each host's
    first process publishes the link classes it read, and every process builds the same matrix
    (plans must agree across processes);
  - without the extra, or when NVML fails, GPU pairs of one host are ``unknown`` (priced like
    PCIe, see :mod:`~dtenjax._src.topology.parts`), logged once with how to install the extra;

* pyverbs through :mod:`dtenjax._src.net.rdma`: RDMA NICs ("no device" means no RDMA);
* sysfs: NUMA nodes and their CPUs.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from dtenjax._src import config
from dtenjax._src.topology import parts as topo

INSTALL_HINT = ("pip install 'dtenjax[gpu]' (cuda-python and nvidia-ml-py) to detect NVLink and "
                "NUMA placement; until then such pairs are 'unknown', priced like PCIe, and "
                "`dtenjax topo --probe` (Topology.probe()) measures them")


# --- PCI bus ids, NUMA nodes -----------------------------------------------------------------------

_BUS_RE = re.compile(r"^\s*(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})"
                     r"(?:\.([0-7]))?\s*$")


def normalize_bus_id(bus_id: str | bytes) -> str:
  """A PCI bus id as sysfs spells it (``0000:1b:00.0``), from CUDA's (``0000:1B:00.0``) or NVML's
  (``00000000:1B:00.0``) spelling. Raises ValueError for anything else."""
  text = bus_id.decode(errors="replace") if isinstance(bus_id, bytes) else str(bus_id)
  text = text.split("\x00", 1)[0]
  m = _BUS_RE.match(text)
  if not m:
    raise ValueError(f"{text!r} is not a PCI bus id (domain:bus:device.function)")
  domain, bus, dev, fn = m.groups()
  return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0')}"


def numa_node_of(bus_id: str, sysfs: str = "/sys") -> int | None:
  """The NUMA node sysfs gives the PCI device, or None (no file, or -1: no affinity reported)."""
  try:
    with open(os.path.join(sysfs, "bus", "pci", "devices", bus_id, "numa_node"),
              encoding="utf-8") as f:
      node = int(f.read().strip())
  except (OSError, ValueError):
    return None
  return node if node >= 0 else None


def load_cudart() -> Any:
  """cuda-python's runtime bindings (raises ImportError without them)."""
  try:
    from cuda.bindings import runtime as cudart
  except ImportError:
    from cuda import cudart  # type: ignore
  return cudart


def load_nvml() -> Any:
  """nvidia-ml-py's ``pynvml`` (raises ImportError without it)."""
  import pynvml  # type: ignore
  return pynvml


def cuda_bus_ids(gpus: Sequence[Any], cudart: Any) -> tuple[dict[int, str], list[str]]:
  """``{jax device id: bus id}`` of this process's GPUs from their CUDA ordinals, and notes."""
  out, notes = {}, []
  for d in gpus:
    ordinal = getattr(d, "local_hardware_id", None)
    if ordinal is None:
      notes.append(f"GPU {d.id}: jax gives no CUDA ordinal (local_hardware_id); bus id unknown")
      continue
    err, raw = cudart.cudaDeviceGetPCIBusId(32, int(ordinal))
    if int(err) != 0:
      notes.append(f"GPU {d.id}: cudaDeviceGetPCIBusId({ordinal}) failed with {err!r}")
      continue
    try:
      out[d.id] = normalize_bus_id(raw)
    except ValueError as e:
      notes.append(f"GPU {d.id}: {e}")
  return out, notes


# --- NVLink through NVML -----------------------------------------------------------------------------

def _nvml_code(nvml: Any, e: Exception) -> int | None:
  return getattr(e, "value", None) if isinstance(e, nvml.NVMLError) else None


def _links_of(nvml: Any, handle: Any) -> list[tuple[str | None, str]]:
  """(remote type, remote bus id) of every active NVLink of one GPU: type "gpu", "switch",
  "other", or None where the driver cannot say; an empty list for a GPU without NVLink."""
  names = {nvml.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu", nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch"}
  out = []
  for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
    try:
      state = nvml.nvmlDeviceGetNvLinkState(handle, link)
    except nvml.NVMLError as e:
      # INVALID_ARGUMENT: past this GPU's last link; NOT_SUPPORTED: no NVLink on this GPU.
      if _nvml_code(nvml, e) in (nvml.NVML_ERROR_INVALID_ARGUMENT,
                                 nvml.NVML_ERROR_NOT_SUPPORTED):
        break
      raise
    if state != nvml.NVML_FEATURE_ENABLED:
      continue
    remote = normalize_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
    try:
      kind = nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link)
    except nvml.NVMLError as e:   # drivers before the call existed: decide by the remote bus id
      if _nvml_code(nvml, e) not in (nvml.NVML_ERROR_NOT_SUPPORTED,
                                     nvml.NVML_ERROR_FUNCTION_NOT_FOUND):
        raise
      kind = None
    out.append((None if kind is None else names.get(kind, "other"), remote))
  return out


def nvlink_classes(nvml: Any, bus_ids: Sequence[str],
                   numa: Mapping[str, int | None]) -> dict[tuple[str, str], str]:
  """The link class of every pair of the GPUs ``bus_ids`` (one host), read from NVML: ``nvlink``
  for a direct link, ``nvswitch`` when both reach NVSwitches, else ``pcie`` (same or unknown NUMA
  node) or ``numa_cross``. Keys are (a, b) with a < b. Raises ``nvml.NVMLError`` on failure."""
  gpus = set(bus_ids)
  direct: set[frozenset[str]] = set()
  switched: set[str] = set()
  nvml.nvmlInit()
  try:
    for bus in bus_ids:
      handle = nvml.nvmlDeviceGetHandleByPciBusId(bus)
      for kind, remote in _links_of(nvml, handle):
        if kind == "gpu" or (kind is None and remote in gpus):
          if remote in gpus and remote != bus:
            direct.add(frozenset((bus, remote)))
        elif kind == "switch" or kind is None:   # untyped: not a GPU of this host, a switch
          switched.add(bus)
  finally:
    nvml.nvmlShutdown()
  out = {}
  for a in sorted(gpus):
    for b in sorted(gpus):
      if a < b:
        if a in switched and b in switched:
          out[(a, b)] = "nvswitch"
        elif frozenset((a, b)) in direct:
          out[(a, b)] = "nvlink"
        elif numa.get(a) is not None and numa.get(b) is not None and numa[a] != numa[b]:
          out[(a, b)] = "numa_cross"
        else:
          out[(a, b)] = "pcie"
  return out


# --- the exchange between processes ---------------------------------------------------------------

def exchange(namespace: str, value: Any, rank: int, size: int, store: Any = None) -> list[Any]:
  """Every process's JSON ``value``, by process index, through the coordination key-value store
  (:mod:`dtenjax._src.net.kvstore`). Raises if the store is missing or a peer does not answer."""
  if size == 1:
    return [value]
  if store is None:
    from dtenjax._src.net import kvstore
    store = kvstore.default()
  return [json.loads(v) for v in store.exchange(namespace, rank, size, json.dumps(value))]


def inter_host_class(nics) -> str:
  """The link class between hosts: InfiniBand if an active NIC has that link layer (in any
  spelling pyverbs or sysfs gives), RoCE if an active NIC is Ethernet, else TCP."""
  active = [n for n in nics if n.state.upper().startswith("ACTIVE")]
  if not active:
    return "tcp"
  return "infiniband" if any(n.link_layer.lower() == "infiniband" for n in active) else "roce"


# --- the machine ---------------------------------------------------------------------------------------

def _numa_nodes(host: str, sysfs: str = "/sys") -> list[topo.NumaNode]:
  nodes = []
  for path in sorted(glob.glob(os.path.join(sysfs, "devices", "system", "node", "node[0-9]*"))):
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
  except Exception:  # CPU devices raise or return None
    stats = {}
  return int(stats.get("bytes_limit", 0))


def _local_gpu_facts(gpus: Sequence[Any], notes: list[str], cudart: Any,
                     sysfs: str) -> dict[int, dict[str, Any]]:
  """``{device id: {"bus": bus id or None, "numa": node or None}}`` of this process's GPUs."""
  facts = {d.id: {"bus": None, "numa": None} for d in gpus}
  if not gpus:
    return facts
  if cudart is None:
    try:
      cudart = load_cudart()
    except ImportError:
      notes.append("cuda-python is not installed: GPU PCI bus ids, NUMA nodes and links are "
                   "unknown; " + INSTALL_HINT)
      return facts
  try:
    bus, more = cuda_bus_ids(gpus, cudart)
  except Exception as e:  # a CUDA runtime that cannot start
    notes.append(f"cuda-python could not report GPU bus ids ({type(e).__name__}: {e})")
    return facts
  notes += more
  for dev_id, b in bus.items():
    facts[dev_id] = {"bus": b, "numa": numa_node_of(b, sysfs)}
  missing = [i for i, f in facts.items() if f["bus"] and f["numa"] is None]
  if missing:
    notes.append(f"GPUs {missing}: sysfs reports no NUMA node (numa_node missing or -1); "
                 "recorded as node 0")
  return facts


def _host_links(bus_ids: list[str], numa: dict[str, int | None], notes: list[str],
                nvml: Any) -> dict[str, str]:
  """``{"a|b": class}`` for the GPU pairs of this host, or {} when NVML cannot tell."""
  if len(bus_ids) < 2:
    return {}
  if nvml is None:
    try:
      nvml = load_nvml()
    except ImportError:
      notes.append("nvidia-ml-py (pynvml) is not installed: NVLink between GPUs is unknown; " +
                   INSTALL_HINT)
      return {}
  try:
    classes = nvlink_classes(nvml, bus_ids, numa)
  except Exception as e:  # NVMLError: no driver, lost GPU, ...
    notes.append(f"NVML could not report NVLink ({type(e).__name__}: {e}); GPU links unknown")
    return {}
  return {f"{a}|{b}": c for (a, b), c in classes.items()}


def _transport_note() -> str:
  """Which host transport provider communicators would use here, and why (verbs or not)."""
  try:
    from dtenjax._src.net import native
    from dtenjax._src.net import providers
    if not native.is_available():
      return "host transport: unavailable (the native extension has no transport)"
    name, why = providers.select_provider()
    return f"host transport: {name} ({why})"
  except Exception as e:  # a bad DTENJAX_TRANSPORT, say
    return f"host transport: none can be chosen ({type(e).__name__}: {e})"


def describe(devices: Sequence[Any] | None = None, *, cudart: Any = None, nvml: Any = None,
             sysfs: str = "/sys", store: Any = None, process: tuple[int, int] | None = None,
             host: str | None = None) -> dict[str, Any]:
  """The running machine as ``Topology`` constructor arguments (see :meth:`Topology.detect`).

  ``cudart``, ``nvml``, ``sysfs``, ``store``, ``process`` (index, count) and ``host`` replace
  cuda-python's runtime, pynvml, the sysfs root, the coordination store, jax's process index and
  count and the host name (tests give recorded answers through them).
  """
  devices = list(jax.devices() if devices is None else devices)
  notes: list[str] = []
  host = topo.local_host_name() if host is None else host
  me, n_proc = (jax.process_index(), jax.process_count()) if process is None else process
  local_gpus = [d for d in devices if d.process_index == me and d.platform == "gpu"]
  link_notes: list[str] = []     # why GPU links are unknown, if they are
  facts = _local_gpu_facts(local_gpus, link_notes, cudart, sysfs)

  # Round 1: every process's host name, the bus id / NUMA node of each of its GPUs and the
  # memory of each of its devices.
  mine = {"host": host, "gpus": {str(k): v for k, v in facts.items()},
          "memory": {str(d.id): _memory_bytes(d) for d in devices if d.process_index == me}}
  try:
    everyone = exchange("topology-gpus", mine, me, n_proc, store)
  except Exception as e:
    notes.append(f"host names and GPUs of other processes unknown ({type(e).__name__}: {e}); "
                 "each process is treated as its own host")
    everyone = [mine if p == me else {"host": f"process{p}", "gpus": {}, "memory": {}}
                for p in range(n_proc)]
  hosts = {p: str(v["host"]) for p, v in enumerate(everyone)}
  gpu_facts = {int(k): f for v in everyone for k, f in v["gpus"].items()}
  memory = {int(k): int(m) for v in everyone for k, m in v["memory"].items()}
  first = {h: min(p for p, g in hosts.items() if g == h) for h in hosts.values()}

  # Round 2: the first process of each host reads that host's links and publishes them, so
  # every process builds the same matrix.
  process_of = {d.id: d.process_index for d in devices}
  links: dict[str, str] = {}
  if me == first[host]:
    here = {f["bus"]: f["numa"] for i, f in gpu_facts.items()
            if f["bus"] and hosts.get(process_of.get(i, -1)) == host}
    links = _host_links(sorted(here), here, link_notes, nvml)
  host_links = {host: links}      # bus ids repeat across hosts: links are kept per host
  if n_proc > 1:
    try:
      published = exchange("topology-links", links, me, n_proc, store)
      host_links = {h: published[p] for h, p in first.items()}
    except Exception as e:
      notes.append(f"GPU links read by other processes unknown ({type(e).__name__}: {e})")
  notes += link_notes

  nics: list[topo.NicInfo] = []
  try:
    from dtenjax._src.net import rdma
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
  except Exception as e:  # pyverbs errors mean "no RDMA"
    notes.append(f"no RDMA NIC: discovery failed ({type(e).__name__}: {e})")
  inter = inter_host_class(nics)
  notes.append(_transport_note())

  infos = []
  local_counts: dict[int, int] = {}
  for d in devices:
    li = local_counts.get(d.process_index, 0)
    local_counts[d.process_index] = li + 1
    f = gpu_facts.get(d.id, {})
    infos.append(topo.DeviceInfo(
        id=d.id, platform=d.platform, kind=getattr(d, "device_kind", d.platform),
        memory_bytes=memory.get(d.id, 0),
        process_index=d.process_index, host=hosts.get(d.process_index, host),
        numa_node=f.get("numa") or 0, local_index=li, pci_bus_id=f.get("bus") or ""))

  unknown_pairs = []

  def cls(a: topo.DeviceInfo, b: topo.DeviceInfo) -> str:
    if a.id == b.id:
      return "local"
    if a.host != b.host:
      return inter
    if a.platform == "gpu" and b.platform == "gpu":
      key = "|".join(sorted((a.pci_bus_id, b.pci_bus_id)))
      known = host_links.get(a.host, {})
      if a.pci_bus_id and b.pci_bus_id and key in known:
        return known[key]
      unknown_pairs.append((a.id, b.id))
      return "unknown"
    return "shared_memory" if a.process_index == b.process_index else "numa_cross"

  matrix = tuple(tuple(cls(a, b) for b in infos) for a in infos)
  if unknown_pairs:
    why = "; ".join(link_notes) or f"no link information; {INSTALL_HINT}"
    config.log_once("topology-links-unknown",
                    f"dtenjax: the links of {len(unknown_pairs) // 2} GPU pair(s) within a host "
                    f"are 'unknown': {why}")
  platform = devices[0].platform if devices else "none"
  if platform == "cpu":
    notes.append(f"{len(devices)} CPU devices of {n_proc} process(es); devices of one process "
                 "share memory ('shared_memory' links)")
  # NVLink SHARP: NCCL uses it on NVSwitch systems unless NCCL_NVLS_ENABLE=0; read once here so
  # that plans depend on the Topology, not on the environment at plan time
  nvls = (platform == "gpu" and os.environ.get("NCCL_NVLS_ENABLE", "") != "0" and
          any("nvswitch" in row for row in matrix))
  return dict(name=f"detected:{host}:{platform}x{len(devices)}", devices=tuple(infos),
              link_matrix=matrix, nics=tuple(nics), numa_nodes=tuple(_numa_nodes(host, sysfs)),
              source="detected", notes=tuple(notes), nvls=nvls)

