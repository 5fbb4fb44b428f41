"""dtenjax topo: the link matrix of this machine, a fixture or a saved topology, in the spirit
of nvidia-smi topo -m, with the bandwidth and latency the cost model uses per link class."""

from __future__ import annotations

import argparse
import json
import math
import pathlib

from dtenjax._src import errors
from dtenjax._src import tables
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
  ap.add_argument("--mesh", metavar="AXIS=SIZE,...",
                  help="also show which links each axis of this mesh runs over (devices in "
                  "dtenjax.topology_mesh's order), e.g. data=4,model=8; with --draw, draw it")
  ap.add_argument("--draw", metavar="FILE",
                  help="also draw the link matrix (link class per pair of devices), or with "
                  "--mesh the mesh over the topology, to a PNG, SVG or PDF file (needs the plot "
                  "extra)")


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
  where = (f"the fixture {args.fixture!r}" if args.fixture else
           f"topology {topology.name!r}" if args.load else "this machine")
  axes = mesh_over(topology, args.mesh, where) if args.mesh else None
  if args.draw and axes:
    names, shape, ids, links = axes
    draw.mesh(topology, names, shape, ids,
              [f"{n} ({size}): {link}, {spec.bandwidth_gbps:g} GB/s"
               for n, size, link, spec in links], topology.name, args.draw)
  elif args.draw:
    draw.topology(topology, args.draw)
  text = topology.to_json() + "\n"
  if common.json_to_stdout(args):
    print(text, end="")
    return 0
  print(report.link_matrix_table(topology))
  if axes:
    print()
    print(tables.render(["axis", "size", "link", "GB/s", "alpha (us)"],
                        [(n, size, link, f"{spec.bandwidth_gbps:g}", f"{spec.latency_us:g}")
                         for n, size, link, spec in axes[3]],
                        align=["left", "right", "left", "right", "right"],
                        title=f"mesh {args.mesh}: the slowest link within each axis"))
  if args.json is not None:
    common.write_text(args.json, text, "--json")
    print(f"\nsaved to {args.json}")
  return 0


def mesh_over(topology, text: str, where: str):
  """``--mesh`` over ``topology``: (names, shape, device ids in dtenjax.topology_mesh's order --
  sorted by ``Topology.hierarchy_key``, as planning/mesh.py's ``order_devices`` sorts them --,
  and per axis of size > 1 (name, size, the slowest link class within one of its groups, its
  LinkSpec))."""
  import numpy as np
  axes = common.mesh_axes(text)
  needed, have = math.prod(axes.values()), topology.num_devices
  if needed > have:
    raise common.mesh_size_error(text, needed, have, where)
  if needed < have:
    raise common.UsageError(f"--mesh {text!r}: a mesh spans every device; {where} has {have}, "
                            f"the mesh {needed}")
  names, shape = tuple(axes), tuple(axes.values())
  ids = sorted(topology.device_ids, key=topology.hierarchy_key)
  grid = np.asarray(ids).reshape(shape)
  links = []
  for k, (name, size) in enumerate(axes.items()):
    if size > 1:
      group = [int(d) for d in np.moveaxis(grid, k, -1).reshape(-1, size)[0]]
      link, spec = topology.slowest_link(group)
      links.append((name, size, link, spec))
  return names, shape, ids, links
