"""Measures alpha (latency) and beta (seconds per byte) per link class on the devices present.

Device time, not Python dispatch: every measurement is a jitted chain of K dependent transfers
minus the same program without them, divided by K (the method of bench/allreduce.py), so launch
overhead is amortised and the numbers describe the link. For a pair of devices joined by a class
the transfer is an exchange of the same buffer in both directions (XLA's collective-permute:
NCCL send/recv on GPU), timed at ``small_bytes`` and ``large_bytes``; ``alpha`` is the small
time and ``beta = (t_large - t_small) / (large - small)`` per direction. The ``local`` class is a
device's own memory: a chain of elementwise passes (read + write). Classes that cannot be
measured from this process (for example links to other hosts) keep their table values and are
listed in the notes.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import errors
from dtenjax._src.topology import parts as topo


def _median_wall(f, x, repeats: int) -> float:
  f(x).block_until_ready()                             # compile and warm up
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def _per_step(step, mesh, x, chain: int, repeats: int) -> float:
  """Device seconds of one ``step`` from a jitted chain of ``chain`` steps minus zero steps."""
  from jax.sharding import PartitionSpec as P

  def program(depth):
    def body(v):
      for _ in range(depth):
        v = step(v)
      return v
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("p"), out_specs=P("p"),
                                 check_vma=False))
  tk = _median_wall(program(chain), x, repeats)
  t0 = _median_wall(program(0), x, repeats)
  return max(tk - t0, 1e-9) / chain


def _time_class(cls: str, a, b, nbytes: int, chain: int, repeats: int) -> float:
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = [a] if cls == "local" else [a, b]
  mesh = Mesh(np.array(devs), ("p",))
  n = max(1, nbytes // 4)
  host = np.random.default_rng(0).standard_normal(len(devs) * n).astype(np.float32)
  x = jax.device_put(host, NamedSharding(mesh, P("p")))
  if cls == "local":
    step = lambda v: v * jnp.float32(1.0000001)       # one read and one write of the buffer
  else:
    step = lambda v: lax.ppermute(v, "p", [(0, 1), (1, 0)])
  return _per_step(step, mesh, x, chain, repeats)


def measure(topology, small_bytes: int = 8, large_bytes: int | None = None,
            repeats: int = 7) -> tuple[dict[str, topo.LinkSpec], list[str]]:
  """Measured LinkSpecs for each link class found among local devices, and notes on what was not.

  Args:
    topology: the topology to refine (usually ``Topology.detect()``).
    small_bytes: size of the latency transfer.
    large_bytes: size of the bandwidth transfer (default 64 MiB on GPU, 4 MiB on CPU).
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
    large_bytes = (64 << 20) if platform != "cpu" else (4 << 20)
  chain = 16 if platform != "cpu" else 4

  pairs: dict[str, tuple[int, int]] = {}
  for a in ids:
    for b in ids:
      cls = topology.link_class(a, b)
      # Only links inside a host can be timed between this process's devices.
      if cls not in pairs and cls in topo.INTRA_HOST and (cls != "local" or a == b):
        pairs[cls] = (a, b)
  measured, notes = {}, []
  for cls, (a, b) in sorted(pairs.items(), key=lambda kv: topo.LINK_ORDER.index(kv[0])):
    ts = _time_class(cls, local[a], local[b], small_bytes, chain, repeats)
    tl = _time_class(cls, local[a], local[b], large_bytes, chain, repeats)
    moved = (large_bytes - small_bytes) * (2 if cls == "local" else 1)
    beta = max(tl - ts, 1e-12) / moved
    measured[cls] = topo.LinkSpec(bandwidth_gbps=1.0 / beta / 1e9, latency_us=ts * 1e6)
    notes.append(f"probed {cls} on devices {a}->{b}: alpha {ts * 1e6:.1f} us, "
                 f"{1.0 / beta / 1e9:.2f} GB/s per direction (device time of a chain of {chain} "
                 f"transfers of {small_bytes} B and {large_bytes} B, median of {repeats})")
  unmeasured = sorted({c for row in topology.link_matrix for c in row} - set(measured),
                      key=topo.LINK_ORDER.index)
  if unmeasured:
    notes.append(f"not measurable from this process, table values kept: {unmeasured}")
  return measured, notes
