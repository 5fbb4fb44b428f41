"""Measures how fast this host's devices compute and run XLA's collectives while all of them work
at once (:meth:`Topology.calibrate`), for the planner to price a step with instead of the table
priors.

Every number is device time of a jitted program over all the host's local devices of the
topology's platform (``jax.shard_map``, one shard each), so devices that share something -- the
CPU devices of one process share the host's cores and memory -- are measured sharing it:

* ``matmul_flops``: a chain of float32 products per device, ``2 m k n`` FLOP each, at two sizes
  (the median of their rates).
* ``memory_gbps``: a chain of elementwise passes per device (each step behind an optimization
  barrier, so XLA cannot fuse the chain into one pass): read + write bytes per second.
* ``collectives``: XLA's all-reduce, all-gather and reduce-scatter over all the devices at three
  sizes, a chain of dependent ops minus the same chain without them.
* ``latency_s``: rounds of a product followed by a tiny all-reduce of its result, minus the rounds
  without it: the cost of one rendezvous in the middle of compute (on a CPU, 8 devices sharing 2
  cores meet at a collective after their share of the compute, which costs far more than the
  same collective alone).
* ``stream_gbps`` (CPU): AdamW's update of a parameter, its gradient and two moments of tens of
  MiB per device, every device at once: the optimizer's pass over a state beyond the caches,
  which the elementwise pass above (a buffer the caches hold) does not see. Bytes are counted as
  the cost model counts the update XLA:CPU compiles (:data:`UPDATE_BYTES_PER_PARAM_BYTE`).

A calibration is an explicit input: ``Topology.detect().calibrate()`` returns a new topology
whose :attr:`~Topology.calibration` holds the numbers (saved by ``to_json``, printed by the plan's
report), and a plan made with it depends on those numbers only, never on a measurement taken
behind the caller's back.
"""

from __future__ import annotations

import os
import statistics
import time
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import errors
from dtenjax._src.topology import parts as topo

# Defaults per platform: product sizes (m, k, n), the elementwise buffer, the collective sizes
# (bytes per participant), the product of the latency rounds, and the bytes of each of the
# update's four buffers per device (0: not measured; a GPU's update is priced at its table's
# local rate).
_SIZES = {
    "cpu": {"matmul": ((512, 512, 512),), "memory": 4 << 20,
            "collectives": (64 << 10, 1 << 20, 8 << 20), "latency": 256, "stream": 16 << 20},
    "gpu": {"matmul": ((4096, 4096, 4096), (8192, 2048, 8192)), "memory": 256 << 20,
            "collectives": (1 << 20, 16 << 20, 128 << 20), "latency": 2048, "stream": 0},
}

# Bytes AdamW's update moves per parameter byte as XLA:CPU compiles it and the cost model counts
# it (pricing.update_bytes with BackendCosts.update_split): a loop per moment reads the gradient
# and the moment and writes the moment (3 + 3), the parameter's reads the parameter and both
# moments and writes the parameter (4). XLA:CPU compiles the update below to those three loops,
# as it compiles optax.adamw's (tests/test_calibration.py reads the compiled program).
UPDATE_BYTES_PER_PARAM_BYTE = 10


def adamw_update(p, g, m, v):
  """AdamW's arithmetic on one parameter (bias corrections and decay at fixed scalars): what the
  calibration streams, and what tests compile to count its bytes."""
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  p = p - 1e-3 * (m / 0.1 / (jnp.sqrt(v / 0.001) + 1e-8) + 1e-4 * p)
  return p, m, v


def _wall(f, args, repeats: int) -> float:
  jax.block_until_ready(f(*args))                       # compile and warm up
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return min(ts)       # the least-disturbed run: other work on the host is not the step's


def _devices(topology) -> list:
  local = {d.id: d for d in jax.local_devices()}
  ids = [i for i in topology.device_ids
         if i in local and local[i].platform == topology.device(i).platform]
  if len(ids) < 1:
    raise errors.TopologyError(
        f"none of topology {topology.name!r}'s devices are local to this process (local: "
        f"{len(local)} {next(iter(local.values())).platform if local else 'no'} devices); "
        "calibrate the topology of the devices you run on (Topology.detect().calibrate()).")
  host = topology.device(ids[0]).host
  return [local[i] for i in ids if topology.device(i).host == host]


def measure(topology, *, repeats: int = 3, chain: int = 4,
            sizes: dict | None = None) -> topo.Calibration:
  """The :class:`~dtenjax._src.topology.parts.Calibration` of ``topology``'s devices on this host
  (see the module docstring). ``sizes`` replaces the platform's defaults (keys ``matmul``,
  ``memory``, ``collectives``, ``latency``, ``stream``; 0 to leave ``latency_s`` or
  ``stream_gbps`` at 0; tests use small ones)."""
  if repeats < 1 or chain < 1:
    raise errors.ConfigurationError(
        f"calibrate: repeats={repeats} and chain={chain} must be >= 1")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = _devices(topology)
  platform = devs[0].platform
  cfg = dict(_SIZES.get(platform, _SIZES["gpu"]))
  cfg.update(sizes or {})
  n = len(devs)
  mesh = Mesh(np.array(devs), ("c",))

  def program(body, *specs):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("c"),
                                 check_vma=False))

  def put(shape):
    host = np.full((n * shape[0],) + tuple(shape[1:]), 1.0 / max(shape[-1], 1), np.float32)
    return jax.device_put(host, NamedSharding(mesh, P("c")))

  def per_step(step, *args) -> float:
    """Device seconds of one ``step`` (a function of the carried value and the other arguments):
    a ``fori_loop`` of ``2 chain`` steps minus one of ``chain``, divided by ``chain``; both are one
    dispatch of one program, so launch overhead cancels and no pass is fused with the next."""
    def prog(trips):
      def body(v, *rest):
        return lax.fori_loop(0, trips, lambda i, u: step(u, *rest), v)
      return program(body, *(P("c") for _ in args))
    long, short = _wall(prog(2 * chain), args, repeats), _wall(prog(chain), args, repeats)
    # on a busy host the difference can drown in noise: then the long loop's mean (dispatch
    # included, so an upper bound) is the estimate
    return (long - short) / chain if long - short > long / 8 else long / (2 * chain)

  # products: (m, k) -> (m, n) -> (m, k), 4 m k n FLOP a step
  rates = []
  for m, k, nn in cfg["matmul"]:
    t = per_step(lambda x, b, p: jnp.tanh((x @ b) @ p), put((m, k)), put((k, nn)), put((nn, k)))
    rates.append(4.0 * m * k * nn / t)
  flops = statistics.median(rates)

  # elementwise passes: one read and one write of the buffer a step
  words = max(1, cfg["memory"] // 4)
  t = per_step(lambda v: v * jnp.float32(1.0000001) + jnp.float32(1e-7), put((words,)))
  memory_gbps = 2.0 * words * 4 / t / 1e9

  # collectives: a step is the collective and one elementwise pass; the pass alone is subtracted
  table = []
  if n > 1:
    points = {k: [] for k in topo.CALIBRATED_KINDS}
    for nbytes in sorted(cfg["collectives"]):
      w = max(n, nbytes // 4 // n * n)
      x = put((w,))
      scale = jnp.float32(1.0 / n)
      ops = {
          "all_reduce": lambda v: lax.psum(v, "c") * scale,
          "all_gather": lambda v: lax.all_gather(v[:w // n], "c", tiled=True) * scale,
          "reduce_scatter": lambda v: jnp.tile(lax.psum_scatter(v, "c", tiled=True), n) * scale,
      }
      base = per_step(lambda v: v * scale, x)
      for kind, op in ops.items():
        points[kind].append((w * 4, max(per_step(op, x) - base, 1e-7)))
    for kind in topo.CALIBRATED_KINDS:
      pts, last = [], 0.0
      for b, t in points[kind]:
        last = max(last, t)            # a larger message never costs less (noise on a busy host)
        pts.append((b, last))
      table.append((kind, tuple(pts)))

  # one small collective between products
  latency = 0.0
  if n > 1 and cfg["latency"] > 0:
    a = put((cfg["latency"], cfg["latency"]))
    plain = per_step(lambda v: jnp.tanh(v @ v), a)
    met = per_step(lambda v: jnp.tanh(v @ v) + lax.psum(v[:1, :8], "c").sum() * 1e-9, a)
    latency = max(0.0, met - plain)
  # the optimizer's update over a state beyond the caches: one call of the update a step (no
  # loop: a loop would hoist the gradient's share out of it), its outputs new buffers as the
  # step's are; the least-disturbed of the calls
  stream = 0.0
  if cfg.get("stream", 0) > 0:
    words = max(1, cfg["stream"] // 4)
    update = jax.jit(jax.shard_map(adamw_update, mesh=mesh, in_specs=(P("c"),) * 4,
                                   out_specs=(P("c"),) * 3, check_vma=False))
    t = _wall(update, tuple(put((words,)) for _ in range(4)), max(repeats, 3))
    stream = UPDATE_BYTES_PER_PARAM_BYTE * words * 4 / t / 1e9
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return topo.Calibration(platform=platform, devices=n, cores=int(cores or 1),
                          matmul_flops=float(flops), memory_gbps=float(memory_gbps),
                          collectives=tuple(table), latency_s=float(latency),
                          stream_gbps=float(stream))


# --- the table priors of CPU devices that share a host's cores -------------------------------------
#
# The CPU devices of one process (``--xla_force_host_platform_device_count``) share the host's
# cores and memory. Without a calibration the planner prices them with a model of that sharing:
#
# * products: one core's FLOP/s (the device table's figure) times the cores each device gets,
#   at most one (:func:`scaled_prior_flops`);
# * elementwise passes (the optimizer's update): the same share of the host, at
#   :data:`CPU_FLOP_PER_BYTE` FLOP per byte read or written (:func:`prior_cpu_s_per_byte`). A
#   fixed bandwidth prior that does not scale with the share priced the update of 8 devices on 16
#   cores 40x above what the calibration measures (1.35 against 67.7 GB/s), so every layout that
#   shards the optimizer's state looked 100 ms cheaper than DP on a 170 ms step;
# * a collective between products (:func:`prior_cpu_meeting_s`): the devices' wake-up when every
#   device has a core of its own (the calibration measures 63 us for 8 devices on 16 cores), plus,
#   when devices outnumber the cores, a share of the operating system's scheduling slice: a
#   device that arrives last waits for a core (about 3 ms a collective on 2 cores for 8 devices,
#   from the six families' FSDP steps against their DP steps).
#
# Measured on 8 devices of a 16-core host (Topology.calibrate(), 2026-12-05): 108 GFLOP/s and
# 67.7 GB/s per device, 1.6 FLOP per byte; on the loaded 2-core VM three calibrations gave
# 2-5 FLOP per byte. 2.5 sits between them.
CPU_FLOP_PER_BYTE = 2.5
# * the optimizer's update and the work beside the products: they stream every device's whole
#   state, and the step's activations, through the host's memory, where the elementwise pass
#   above stays in the caches. Measured against the products of the same 8 devices at once
#   (docs/benchmarks.md, the sixteenth round): AdamW's update of encdec's and llama_loop's DP
#   state (21-23 MB per device, 10 bytes each) ran at 11-12 FLOP per byte against the steps' own
#   products and 19-22 against the calibration's 512 x 512 ones on the 16-core host (the
#   twelfth round's split), 17.5-27.6 against a 1024 x 1024 chain on the loaded 2-core VM; a
#   least-squares fit of the split's eight update times at the priors' product scale gives
#   12.7. 14 sits at the steps' end: the priors price the steps' products.
CPU_STREAM_FLOP_PER_BYTE = 14.0
CPU_WAKE_S = 60e-6
CPU_SLICE_S = 4e-3


def prior_cpu_s_per_byte(device_flops: float) -> float:
  """Seconds per byte (read + write) of one CPU device's elementwise pass, from its FLOP/s
  prior (already scaled by the device's share of the cores): the host's balance of compute and
  memory, :data:`CPU_FLOP_PER_BYTE`."""
  return CPU_FLOP_PER_BYTE / device_flops


def prior_cpu_stream_s_per_byte(device_flops: float) -> float:
  """Seconds per byte of one CPU device's pass over buffers far larger than its caches (the
  optimizer's update of the whole state), from its FLOP/s: :data:`CPU_STREAM_FLOP_PER_BYTE`."""
  return CPU_STREAM_FLOP_PER_BYTE / device_flops


def prior_cpu_meeting_s(cores: int, devices_on_host: int) -> float:
  """What one collective between products adds to a step of ``devices_on_host`` CPU devices
  sharing ``cores`` cores (0 or less: unknown, priced as one): the wake-up of the devices, and
  while devices outnumber cores, the scheduling slice a device waits for a core, in proportion
  to the share of devices without one (``1 - cores / devices``)."""
  cores = max(1, cores)
  waiting = max(0.0, 1.0 - cores / max(1, devices_on_host))
  return CPU_WAKE_S + CPU_SLICE_S * waiting


def scaled_prior_flops(kind_flops: float, platform: str, cores: int,
                       devices_on_host: int) -> float:
  """The table prior of one device's FLOP/s when nothing was measured: a CPU device of a process
  that simulates several shares the host's cores (``n`` devices on ``c`` cores run about ``n /
  c`` times slower each; the table's CPU figure is one core's), other devices are their own."""
  if platform != "cpu" or devices_on_host <= 0:
    return kind_flops
  return kind_flops * min(1.0, max(1, cores) / devices_on_host)

