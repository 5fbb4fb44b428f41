"""dtenjax topo: the link matrix of this machine, a fixture or a saved topology, in the spirit
of nvidia-smi topo -m, with the bandwidth and latency the cost model uses per link class."""

from __future__ import annotations

import argparse
import json
import pathlib

from dtenjax._src import errors
from dtenjax._src.cli import common
from dtenjax._src.cli import draw

HELP = "print the device link matrix with the bandwidths the cost model uses"
DESCRIPTION = __doc__


def add_arguments(ap: argparse.ArgumentParser) -> None:
  src = ap.add_mutually_exclusive_group()
  common.add_fixture_argument(src, "a shipped topology instead of this machine's")
  src.add_argument("--list-fixtures", action="store_true",
                   help="list the shipped topologies' names (one per line) and exit")
  src.add_argument("--load", metavar="FILE",
                   help="a saved topology (what --json FILE or Topology.to_json() wrote)")
  ap.add_argument("--probe", action="store_true",
                  help="measure alpha/beta of the link classes present (this machine only)")
  common.add_json_argument(ap, "the topology shown (Topology.to_json(), for --load)")
  ap.add_argument("--save", metavar="FILE", dest="json",
                  help="the same as --json FILE")
  ap.add_argument("--draw", metavar="FILE",
                  help="also draw the link matrix (link class per pair of devices) to a PNG, "
                  "SVG or PDF file (needs the plot extra)")


def run(args: argparse.Namespace) -> int:
  from dtenjax._src.topology import report
  from dtenjax._src.topology.model import Topology
  draw.check_path(args.draw)
  if args.list_fixtures:
    names = list(Topology.fixtures())
    if common.json_to_stdout(args):
      print(json.dumps(names))
    else:
      print("\n".join(names))
    return 0
  if args.fixture:
    topology = common.fixture(args.fixture)
  elif args.load:
    topology = Topology.from_json(pathlib.Path(args.load))   # TopologyError names the file
  else:
    topology = Topology.detect()
  if args.probe:
    try:
      with common.status("probing the links between the devices"):
        topology = topology.probe()
    except errors.TopologyError as e:
      if args.fixture or args.load:     # a topology of other devices: the arguments clash
        raise common.UsageError(f"--probe measures this machine's devices: {e}") from None
      raise
  if args.draw:
    draw.topology(topology, args.draw)
  text = topology.to_json() + "\n"
  if common.json_to_stdout(args):
    print(text, end="")
    return 0
  print(report.link_matrix_table(topology))
  if args.json is not None:
    common.write_text(args.json, text, "--json")
    print(f"\nsaved to {args.json}")
  return 0
