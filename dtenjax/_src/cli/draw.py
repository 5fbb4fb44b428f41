"""``--draw FILE`` of ``dtenjax topo`` and ``dtenjax plan``: pictures of the topology and of a
planned mesh over it (matplotlib, the ``plot`` extra; PNG, SVG or PDF by the file's suffix).

* the topology: its link matrix, one cell per pair of devices coloured by link class (what
  ``dtenjax topo`` prints as text), hosts outlined;
* a mesh over it (a plan's, or ``topo --mesh``'s in ``dtenjax.topology_mesh``'s device order):
  the mesh as a grid of device ids (the last axis across, the others down), each device
  coloured by its host, and per axis the link class it runs over with its bandwidth
  (``StepPlan.axes``, or the topology's slowest link within the axis): which axis crosses which
  links.
"""

from __future__ import annotations

import pathlib
from typing import Any

from dtenjax._src.cli import common

SUFFIXES = (".png", ".svg", ".pdf")


def check_path(path: str | None) -> None:
  """A usage error for a file matplotlib cannot write (checked before any work)."""
  if path is not None and pathlib.Path(path).suffix.lower() not in SUFFIXES:
    raise common.UsageError(f"--draw {path!r}: name a {', '.join(SUFFIXES)} file; the suffix "
                            "says the format")


def _pyplot():
  try:
    import matplotlib
  except ImportError:
    raise common.CommandError("--draw needs matplotlib, which is not installed: pip install "
                              "'dtenjax[plot]'") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _save(fig, plt, path: str) -> None:
  try:
    fig.savefig(path, bbox_inches="tight")     # the legend and labels outside the axes too
  except OSError as e:
    raise common.CommandError(f"--draw {path!r}: cannot write it ({e.strerror or e}); give a "
                              "path in a directory you can write to.") from None
  finally:
    plt.close(fig)
  print(f"drew {path}")


def topology(topo: Any, path: str) -> None:
  """The link matrix of ``topo`` coloured by link class, hosts outlined."""
  plt = _pyplot()
  from matplotlib.colors import ListedColormap
  from matplotlib.patches import Patch, Rectangle
  ids = list(topo.device_ids)
  classes = sorted({topo.link_class(a, b) for a in ids for b in ids if a != b},
                   key=lambda c: -topo.spec(c).bandwidth_gbps)
  index = {c: i for i, c in enumerate(classes)}
  grid = [[index[topo.link_class(a, b)] if a != b else -1 for b in ids] for a in ids]
  palette = plt.get_cmap("tab10").colors
  n = len(ids)
  size = min(12.0, 2.5 + 0.35 * n)
  fig, ax = plt.subplots(figsize=(size + 2.5, size), dpi=80)
  cmap = ListedColormap(["#ffffff"] + [palette[i % 10] for i in range(len(classes))])
  ax.imshow([[v + 1 for v in row] for row in grid], cmap=cmap, vmin=0, vmax=len(classes),
            interpolation="nearest")
  start = 0
  for host in topo.hosts():
    ax.add_patch(Rectangle((start - 0.5, start - 0.5), len(host), len(host), fill=False, lw=2))
    start += len(host)
  if n <= 32:
    ax.set_xticks(range(n), [str(i) for i in ids], fontsize=7)
    ax.set_yticks(range(n), [str(i) for i in ids], fontsize=7)
  ax.set_title(f"{topo.name}: {n} devices, {len(topo.hosts())} host(s); link class per pair",
               fontsize=9)
  ax.legend(handles=[Patch(color=palette[index[c] % 10],
                           label=f"{c}: {topo.spec(c).bandwidth_gbps:g} GB/s")
                     for c in classes], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
  fig.tight_layout()
  _save(fig, plt, path)


def plan(result: Any, topo: Any, path: str) -> None:
  """The planned mesh as a grid of device ids, coloured by host, each axis with its link."""
  mesh(topo, result.axis_names, result.mesh_shape, result.device_ids,
       [f"{a.name} ({a.size}): {a.link} {a.span}, {a.bandwidth_gbps:g} GB/s" for a in result.axes],
       f"plan on {result.topology}", path)


def mesh(topo: Any, names, shape, device_ids, axis_labels: list[str], title: str,
         path: str) -> None:
  """A mesh (``names``/``shape``, ``device_ids`` in its order) as a grid of device ids coloured
  by host (the last axis across, the others down), with one legend line per axis."""
  plt = _pyplot()
  from matplotlib.patches import Patch
  import numpy as np
  ids = np.asarray(device_ids).reshape(shape)
  rows = ids.reshape(-1, shape[-1]) if ids.ndim > 1 else ids.reshape(1, -1)
  host_of = {d: h for h, members in enumerate(topo.hosts()) for d in members}
  palette = plt.get_cmap("tab20").colors
  nr, nc = rows.shape
  fig, ax = plt.subplots(figsize=(min(14.0, 2.0 + 0.6 * nc), min(10.0, 2.2 + 0.45 * nr)),
                         dpi=80)
  for r in range(nr):
    for c in range(nc):
      d = int(rows[r, c])
      ax.add_patch(plt.Rectangle((c, nr - 1 - r), 0.95, 0.95,
                                 color=palette[host_of.get(d, 0) % 20]))
      if nr * nc <= 256:
        ax.text(c + 0.47, nr - 1 - r + 0.47, str(d), ha="center", va="center", fontsize=7)
  ax.set_xlim(0, nc)
  ax.set_ylim(0, nr)
  ax.set_aspect("equal")
  ax.set_xticks([])
  ax.set_yticks([])
  # the axes of size 1 take no room in the grid and none in its labels
  axes = list(zip(names, shape))
  ax.set_xlabel(f"across: {axes[-1][0]} ({axes[-1][1]})", fontsize=9)
  ax.set_ylabel("down: " + (" x ".join(f"{n} ({s})" for n, s in axes[:-1] if s > 1) or "-"),
                fontsize=9)
  sizes = ", ".join(f"{n}={s}" for n, s in axes if s > 1) or "one device"
  ax.set_title(f"{title}\nmesh {sizes}", fontsize=9)
  legend = [Patch(color="none", label=label) for label in axis_labels]
  legend += [Patch(color=palette[h % 20], label=f"host {h}")
             for h in sorted({host_of.get(int(d), 0) for d in ids.flat})][:8]
  ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
  fig.tight_layout()
  _save(fig, plt, path)
