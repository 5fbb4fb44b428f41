"""``python -m dtenjax topo``: the link matrix of a topology, in the spirit of ``nvidia-smi topo -m``.

Each cell is a short code for the link class between two devices (legend below the matrix, with
the bandwidth and latency the cost model uses for it), followed by a summary of hosts, fast
islands, NICs and NUMA nodes, and the topology's notes (what detection could not see, what a probe
measured). ``UNK`` marks links detection could not see (GPUs without ``dtenjax[gpu]``); they are
priced like PCIe until ``--probe`` measures them. The tables are laid out by rich
(:mod:`dtenjax._src.tables`).
"""

from __future__ import annotations

import re

from collections.abc import Sequence

from dtenjax._src import tables
from dtenjax._src.topology.model import LINK_ORDER, Topology

# Short codes, as nvidia-smi prints them where one exists.
CODES = {
    "local": "X",
    "nvswitch": "NVS",
    "nvlink": "NV",
    "shared_memory": "SHM",
    "pcie": "PIX",
    "numa_cross": "SYS",
    "unknown": "UNK",
    "infiniband": "IB",
    "roce": "RoCE",
    "tcp": "TCP",
}
MEANING = {
    "local": "the device itself",
    "nvswitch": "NVLink through NVSwitch",
    "nvlink": "direct NVLink",
    "shared_memory": "devices of one process sharing host memory",
    "pcie": "PCIe peer-to-peer under one socket",
    "numa_cross": "PCIe across the inter-socket (NUMA) link",
    "unknown": "not detected (pip install 'dtenjax[gpu]'); priced as PCIe until probed",
    "infiniband": "another host over InfiniBand",
    "roce": "another host over RoCE v2",
    "tcp": "another host over TCP",
}
if set(CODES) != set(LINK_ORDER):  # pragma: no cover - a link kind added to one table only
  raise ImportError(f"topology/report.py: CODES {sorted(CODES)} and LINK_ORDER "
                    f"{sorted(LINK_ORDER)} must name the same link kinds")
# Topology notes about the host transport (detect.py), shown in their own block.
TRANSPORT_NOTES = ("host transport:", "EMULATED RDMA device", "no RDMA NIC:")


def _label(topology: Topology, i: int) -> str:
  d = topology.devices[i]
  prefix = "GPU" if d.platform == "gpu" else d.platform.upper()
  return f"{prefix}{d.id}"


def link_matrix_table(topology: Topology) -> str:
  """The link matrix, legend (bandwidth and latency per class used), summary and notes."""
  n = topology.num_devices
  labels = [_label(topology, i) for i in range(n)]
  multi_host = len(topology.hosts()) > 1
  bus = any(d.pci_bus_id for d in topology.devices)
  gpu = any(d.platform == "gpu" for d in topology.devices)
  nvls = f", NVLink SHARP {'on' if topology.nvls else 'off'}" if gpu else ""
  lines = [f"Topology {topology.name!r} (source: {topology.source}, {n} devices, "
           f"{len(topology.hosts())} host(s){nvls})", ""]
  columns = ["", *labels, "NUMA"] + (["PCI bus id"] if bus else []) + (["host"] if multi_host
                                                                       else [])
  rows = []
  for i, row in enumerate(topology.link_matrix):
    d = topology.devices[i]
    rows.append([labels[i], *(CODES[c] for c in row), d.numa_node] +
                ([d.pci_bus_id or "?"] if bus else []) + ([d.host] if multi_host else []))
  lines.append(tables.render(columns, rows, align=["left"] + ["right"] * (n + 1) +
                             ["left"] * (bus + multi_host)))
  present = sorted({c for row in topology.link_matrix for c in row}, key=LINK_ORDER.index)
  lines += ["", "Legend (bandwidth per direction and one-way latency the cost model uses):"]
  legend = [[CODES[c], c, f"{topology.spec(c).bandwidth_gbps:.2f} GB/s",
             f"{topology.spec(c).latency_us:.2f} us", MEANING[c]] for c in present]
  lines += ["  " + ln for ln in tables.render(
      ["code", "class", "bandwidth", "latency", "meaning"], legend,
      align=["left", "left", "right", "right", "left"]).splitlines()]
  lines += ["", "Summary:"]
  for k, h in enumerate(topology.hosts()):
    host = topology.device(h[0]).host
    kinds = sorted({topology.device(i).kind for i in h})
    lines.append(f"  host {k} {host!r}: devices {_ranges(h)} ({', '.join(kinds)})")
  islands = topology.fast_islands()
  lines.append(f"  fast islands: {len(islands)} -> " +
               "; ".join(_ranges(i) for i in islands[:16]) + (" ..." if len(islands) > 16 else ""))
  if topology.nics:
    for nic in topology.nics:
      lines.append(f"  NIC {nic.name} on {nic.host!r} port {nic.port}: {nic.link_layer}, "
                   f"{nic.state}, {nic.bandwidth_gbps * 8:g} Gb/s, NUMA {nic.numa_node}")
  else:
    lines.append("  NICs: none (cross-host traffic would use TCP)")
  if topology.numa_nodes:
    for node in topology.numa_nodes:
      lines.append(f"  NUMA node {node.id} on {node.host!r}: cpus {node.cpus or '?'}")
  # What the host transport runs on (and an emulated RDMA device, shown as such) comes first.
  transport = _transport_notes([n for n in topology.notes if n.startswith(TRANSPORT_NOTES)])
  others = [n for n in topology.notes if not n.startswith(TRANSPORT_NOTES)]
  if transport:
    lines += ["", "Transport:"] + [f"  {note}" for note in transport]
  if others:
    lines += ["", "Notes:"] + [f"  - {note}" for note in others]
  return "\n".join(lines)


# " (/path/to/csrc/transport/verbs.cc:338)": where a native status was made, for developers
_SOURCE_LOCATION = re.compile(r"\s*\((?:/|[A-Za-z]:\\)[^()]*\.(?:cc|cu|cpp|h|cuh):\d+\)")


def _transport_notes(notes: list[str]) -> list[str]:
  """The transport notes as a reader wants them: without native source locations, and the
  reason there is no RDMA NIC said once (the host transport's note repeats it as why verbs is
  not usable)."""
  notes = [_SOURCE_LOCATION.sub("", n) for n in notes]
  reasons = [n[len("no RDMA NIC: "):] for n in notes if n.startswith("no RDMA NIC: ")]
  out = []
  for n in notes:
    for r in reasons:
      if n.startswith("host transport:") and r and r in n:
        n = n.replace(r, "no RDMA NIC (above)")
    out.append(n)
  return out


def _ranges(ids: Sequence[int]) -> str:
  """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
  out, start, prev = [], None, None
  for i in ids:
    if start is None:
      start = prev = i
    elif i == prev + 1:
      prev = i
    else:
      out.append(f"{start}-{prev}" if prev != start else f"{start}")
      start = prev = i
  if start is not None:
    out.append(f"{start}-{prev}" if prev != start else f"{start}")
  return ",".join(out)
