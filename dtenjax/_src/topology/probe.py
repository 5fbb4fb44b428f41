"""Measures alpha (latency) and beta (seconds per byte) per link class on the devices present.

For every link class that joins two local devices, one representative pair is timed copying a
small and a large buffer (``jax.device_put`` from one device to the other, synchronised, median
of several repeats). ``alpha = t_small`` and ``beta = (t_large - t_small) / (large - small)``. The
measured classes replace the table values in the returned Topology, so the planner and the
collectives' ``auto`` choice use them. Classes that cannot be measured from this process (for
example links to other hosts) keep their table values and are listed in ``notes``.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src.topology import parts as topo


def _time_copy(x, dst, repeats: int) -> float:
  jax.device_put(x, dst).block_until_ready()          # warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.device_put(x, dst).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _time_local(x, repeats: int) -> float:
  copy = jax.jit(lambda v: v + jnp.zeros((), v.dtype))
  copy(x).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    copy(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def measure(topology, small_bytes: int = 8, large_bytes: int | None = None,
            repeats: int = 7) -> tuple[dict[str, topo.LinkSpec], list[str]]:
  """Measured LinkSpecs for each link class found among local devices, and notes on what was not.

  Args:
    topology: the topology to refine (usually ``Topology.detect()``).
    small_bytes: size of the latency transfer.
    large_bytes: size of the bandwidth transfer (default 64 MiB on GPU, 8 MiB on CPU).
    repeats: timed repetitions per measurement (median).
  """
  if small_bytes <= 0 or (large_bytes is not None and large_bytes <= small_bytes):
    raise errors.ConfigurationError(
        f"probe needs 0 < small_bytes < large_bytes, got {small_bytes} and {large_bytes}")
  local = {d.id: d for d in jax.local_devices()}
  # A device counts only if it is this process's device of the same platform: a GPU fixture's
  # ids 0..7 must not be "measured" on CPU devices that happen to share the ids.
  ids = [i for i in topology.device_ids
         if i in local and local[i].platform == topology.device(i).platform]
  if not ids:
    raise errors.TopologyError(
        f"none of topology {topology.name!r}'s devices are local to this process (local: "
        f"{len(local)} {next(iter(local.values())).platform if local else 'no'} devices); probe "
        "the topology of the devices you run on (Topology.detect().probe()).")
  platform = local[ids[0]].platform
  if large_bytes is None:
    large_bytes = (64 << 20) if platform != "cpu" else (8 << 20)
  small = np.zeros(max(1, small_bytes // 4), np.float32)
  large = np.random.default_rng(0).standard_normal(large_bytes // 4).astype(np.float32)

  pairs: dict[str, tuple[int, int]] = {}
  for a in ids:
    for b in ids:
      cls = topology.link_class(a, b)
      # Only links inside a host can be timed by copies between this process's devices.
      if cls not in pairs and cls in topo.INTRA_HOST and (cls != "local" or a == b):
        pairs[cls] = (a, b)
  measured, notes = {}, []
  for cls, (a, b) in sorted(pairs.items(), key=lambda kv: topo.LINK_ORDER.index(kv[0])):
    src = local[a]
    xs, xl = jax.device_put(small, src), jax.device_put(large, src)
    if cls == "local":
      ts, tl = _time_local(xs, repeats), _time_local(xl, repeats)
      moved = 2 * (large.nbytes - small.nbytes)          # read + write
    else:
      ts, tl = _time_copy(xs, local[b], repeats), _time_copy(xl, local[b], repeats)
      moved = large.nbytes - small.nbytes
    beta = max(tl - ts, 1e-12) / moved
    measured[cls] = topo.LinkSpec(bandwidth_gbps=1.0 / beta / 1e9, latency_us=ts * 1e6)
    notes.append(f"probed {cls} on devices {a}->{b}: alpha {ts * 1e6:.1f} us, "
                 f"{1.0 / beta / 1e9:.2f} GB/s ({small.nbytes} B and {large.nbytes} B, median of "
                 f"{repeats})")
  unmeasured = sorted({c for row in topology.link_matrix for c in row} - set(measured),
                      key=topo.LINK_ORDER.index)
  if unmeasured:
    notes.append(f"not measurable from this process, table values kept: {unmeasured}")
  return measured, notes
