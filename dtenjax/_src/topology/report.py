"""``python -m dtenjax topo``: the link matrix of a topology, in the spirit of ``nvidia-smi topo -m``.

Each cell is a short code for the link class between two devices (legend below the matrix, with
the bandwidth and latency the cost model uses for it), followed by a summary of hosts, fast
islands, NICs and NUMA nodes, and the topology's notes (what detection could not see, what a probe
measured).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dtenjax._src import errors
from dtenjax._src.topology.model import LINK_ORDER, Topology

# Short codes, as nvidia-smi prints them where one exists.
CODES = {
    "local": "X",
    "nvswitch": "NVS",
    "nvlink": "NV",
    "shared_memory": "SHM",
    "pcie": "PIX",
    "numa_cross": "SYS",
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
    "infiniband": "another host over InfiniBand",
    "roce": "another host over RoCE v2",
    "tcp": "another host over TCP",
}
assert set(CODES) == set(LINK_ORDER)
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
  width = max(5, *(len(s) for s in labels), *(len(c) for c in CODES.values())) + 1
  head_w = max(len(s) for s in labels) + 1
  lines = [f"Topology {topology.name!r} (source: {topology.source}, {n} devices, "
           f"{len(topology.hosts())} host(s))", ""]
  cols = "".join(f"{s:>{width}}" for s in labels)
  extra = f"  {'NUMA':>4}  {'host' if multi_host else ''}".rstrip()
  lines.append(f"{'':<{head_w}}{cols}{extra}")
  for i, row in enumerate(topology.link_matrix):
    cells = "".join(f"{CODES[c]:>{width}}" for c in row)
    d = topology.devices[i]
    tail = f"  {d.numa_node:>4}  {d.host if multi_host else ''}".rstrip()
    lines.append(f"{labels[i]:<{head_w}}{cells}{tail}")
  present = sorted({c for row in topology.link_matrix for c in row}, key=LINK_ORDER.index)
  lines += ["", "Legend (bandwidth per direction and one-way latency the cost model uses):"]
  for c in present:
    s = topology.spec(c)
    lines.append(f"  {CODES[c]:<5} {c:<14} {s.bandwidth_gbps:>8.2f} GB/s {s.latency_us:>7.2f} us"
                 f"  {MEANING[c]}")
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
  transport = [n for n in topology.notes if n.startswith(TRANSPORT_NOTES)]
  others = [n for n in topology.notes if not n.startswith(TRANSPORT_NOTES)]
  if transport:
    lines += ["", "Transport:"] + [f"  {note}" for note in transport]
  if others:
    lines += ["", "Notes:"] + [f"  - {note}" for note in others]
  return "\n".join(lines)


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


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m dtenjax topo [--fixture NAME | --json FILE] [--probe] [--save FILE]``."""
  ap = argparse.ArgumentParser(
      prog="python -m dtenjax topo",
      description="Print the device link matrix with the bandwidths the cost model uses.")
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--fixture", metavar="NAME",
                   help=f"a shipped topology: {', '.join(Topology.fixtures())}")
  src.add_argument("--json", metavar="FILE", help="a topology JSON file (Topology.to_json())")
  ap.add_argument("--probe", action="store_true",
                  help="measure alpha/beta of the link classes present (this machine only)")
  ap.add_argument("--save", metavar="FILE", help="write the topology shown as JSON")
  args = ap.parse_args(list(argv) if argv is not None else None)
  try:
    if args.fixture:
      topology = Topology.fixture(args.fixture)
    elif args.json:
      topology = Topology.from_json(args.json)
    else:
      topology = Topology.detect()
    if args.probe:
      topology = topology.probe()
  except errors.DtenjaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(link_matrix_table(topology))
  if args.save:
    with open(args.save, "w", encoding="utf-8") as f:
      f.write(topology.to_json() + "\n")
    print(f"\nsaved to {args.save}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
