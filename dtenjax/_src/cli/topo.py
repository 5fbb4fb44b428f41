"""``dtenjax topo``: the link matrix of this machine, a fixture or a saved topology, in the spirit
of ``nvidia-smi topo -m``, with the bandwidth and latency the cost model uses per link class."""

from __future__ import annotations

import argparse

HELP = "print the device link matrix with the bandwidths the cost model uses"
DESCRIPTION = __doc__


def add_arguments(ap: argparse.ArgumentParser) -> None:
  from dtenjax._src.topology.model import Topology  # pylint: disable=g-import-not-at-top
  src = ap.add_mutually_exclusive_group()
  src.add_argument("--fixture", metavar="NAME", choices=Topology.fixtures(),
                   help=f"a shipped topology: {', '.join(Topology.fixtures())}")
  src.add_argument("--json", metavar="FILE", help="a topology JSON file (Topology.to_json())")
  ap.add_argument("--probe", action="store_true",
                  help="measure alpha/beta of the link classes present (this machine only)")
  ap.add_argument("--save", metavar="FILE", help="write the topology shown as JSON")


def run(args: argparse.Namespace) -> int:
  # pylint: disable=g-import-not-at-top
  from dtenjax._src.topology import report
  from dtenjax._src.topology.model import Topology
  if args.fixture:
    topology = Topology.fixture(args.fixture)
  elif args.json:
    topology = Topology.from_json(args.json)
  else:
    topology = Topology.detect()
  if args.probe:
    topology = topology.probe()
  print(report.link_matrix_table(topology))
  if args.save:
    with open(args.save, "w", encoding="utf-8") as f:
      f.write(topology.to_json() + "\n")
    print(f"\nsaved to {args.save}")
  return 0
