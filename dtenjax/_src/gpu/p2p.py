"""NVLink peer-to-peer all-reduce on GPU: one-shot and two-shot CUDA kernels as XLA FFI calls.

The kernels (``csrc/cuda/p2p_allreduce.cuh``) read every rank's data straight out of peer memory:

* ``one_shot``: each rank copies its input into its registered buffer, the ranks meet at a GPU-side
  barrier, then every rank reads all W buffers and reduces the whole message. Best for small and
  medium messages (one barrier, W reads per element).
* ``two_shot``: reduce-scatter then all-gather. Rank r reduces segment r of every buffer in place,
  a second barrier, then every rank copies the other W-1 reduced segments. Moves ~2x fewer bytes
  per link for large messages.

Bit contract (tested in ``tests/test_p2p.py``). For float32, bfloat16 and float16 inputs x_0..x_{W-1}
(rank r = position along the mesh axis), BOTH algorithms return, on every rank, for every element::

    acc = float32(x_0)
    for r in 1..W-1:  acc = acc + float32(x_r)      # IEEE f32 add, round-to-nearest-even, no FMA
    result = acc.astype(dtype)                        # one rounding (RNE); identity for float32

i.e. a left fold over ranks in increasing order, starting from x_0 itself (not from 0, so -0.0 is
kept), accumulated in float32 and rounded once. Two-shot reduces each element on its segment owner
with exactly this fold and then copies the bits, so ``two_shot`` bits == ``one_shot`` bits.
Relation to the XLA-native forms in ``collectives.py``: the XLA-native ``one_shot`` (all-gather,
then this same fold in f32 over the gathered axis, then one cast) is bit-identical to both p2p
kernels. An XLA-native ``two_shot`` built from ``psum_scatter`` + ``all_gather`` sums in NCCL's
order (and in bf16/f16 precision for those dtypes), so it is NOT bit-identical in general; it is
equal only when every partial sum is exact (e.g. small integers in float).

Buffers: one symmetric region per GPU (``DTENJAX_P2P_BUFFER_BYTES`` per stage buffer, two stage
buffers + a 4 KiB flag header), allocated once per device and peer-mapped: devices of this process
through ``cudaDeviceEnablePeerAccess``, devices of other processes through CUDA IPC handles
exchanged over ``jax.distributed``'s key-value store. Messages larger than the buffer are not
supported here (``supported`` says so; ``algorithm="auto"`` then uses XLA).

Everything that allocates or maps memory happens eagerly, before tracing, in :func:`prepare`; the
traced ``dtenjax_p2p_all_reduce`` call only launches a kernel, so it is CUDA-graph compatible.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi

ALGORITHMS: dict[str, int] = {"one_shot": 0, "two_shot": 1}
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_WORLD = 8
DESCRIPTOR_BYTES = 128
TARGETS = ("dtenjax_p2p_register", "dtenjax_p2p_connect", "dtenjax_p2p_all_reduce",
           "dtenjax_p2p_selftest", "dtenjax_p2p_selftest_graph")
_KV_PREFIX = "dtenjax/p2p"

_lock = threading.Lock()
_connected: dict[int, int] = {}          # communicator key -> world size
_failures: dict[int, str] = {}           # communicator key -> why setting it up failed
_last_failure: list[str] = []            # most recent setup failure (for supported())


# --- availability ------------------------------------------------------------------------------

def capacity_bytes() -> int:
  """Bytes of one registered stage buffer per GPU (``DTENJAX_P2P_BUFFER_BYTES``)."""
  cap = config.get_int("DTENJAX_P2P_BUFFER_BYTES")
  if cap <= 0 or cap % 16:
    raise errors.ConfigurationError(
        f"DTENJAX_P2P_BUFFER_BYTES={cap} must be a positive multiple of 16 (default "
        f"{config.KNOBS['DTENJAX_P2P_BUFFER_BYTES'].default}).")
  return cap


def _timeout_ms() -> int:
  return max(1, int(config.get_float("DTENJAX_COLLECTIVE_TIMEOUT") * 1000))


def unavailable_reason() -> str | None:
  """Why the p2p kernels cannot run in this process at all (None when they can)."""
  info = ffi.build_info()
  if not info["built"]:
    return f"the native extension is not built ({info['error']}). {ffi.BUILD_HINT}"
  if not info["cuda"]:
    return ("this build of dtenjax._ffi has no CUDA kernels (nvcc was not found when it was "
            "built); rebuild on a machine with the CUDA toolkit")
  missing = [t for t in TARGETS if (t, "CUDA") not in info["targets"]]
  if missing:
    return f"the build lacks the CUDA targets {missing}; rebuild the extension"
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    return f"no CUDA GPU is visible to jax (backend {jax.default_backend()!r})"
  for t in TARGETS:
    if not ffi.has_target(t, "CUDA"):
      return f"FFI target {t!r} could not be registered for CUDA"
  return None


def supported(axis_size: int, nbytes: int, dtype) -> tuple[bool, str]:
  """Whether the p2p kernels can all-reduce ``nbytes`` of ``dtype`` over ``axis_size`` ranks.

  Returns ``(True, "")`` or ``(False, reason)``; the reason lists every problem and is meant for
  ``config.log_fallback``. Peer access between the participants is checked when the communicator
  is set up (:func:`prepare`); a failure there is remembered and reported here afterwards.
  """
  problems = []
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in SUPPORTED_DTYPES:
    problems.append(f"dtype {dtype} is not float32, bfloat16 or float16")
  if not isinstance(axis_size, (int, np.integer)) or not 1 <= axis_size <= MAX_WORLD:
    problems.append(f"world size {axis_size} is outside [1, {MAX_WORLD}]")
  try:
    cap = capacity_bytes()
    if nbytes > cap:
      problems.append(f"message of {nbytes} bytes exceeds the registered buffer of {cap} bytes "
                      "(raise DTENJAX_P2P_BUFFER_BYTES)")
  except errors.ConfigurationError as e:
    problems.append(str(e))
  why = unavailable_reason()
  if why:
    problems.append(why)
  elif jax.process_count() == 1 and isinstance(axis_size, (int, np.integer)):
    n_gpu = len(jax.local_devices(backend="gpu"))
    if axis_size > n_gpu:
      problems.append(f"world size {axis_size} exceeds the {n_gpu} GPUs of this process")
  if _last_failure:
    problems.append(_last_failure[-1])
  return (not problems, "; ".join(problems))


# --- communicator set-up (eager, outside any trace) -------------------------------------------

def _run_on(device, fn):
  """Runs the zero-argument jax function ``fn`` eagerly on ``device`` and returns numpy."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  with jax.ensure_compile_time_eval():
    return np.asarray(jax.jit(fn, out_shardings=sharding)())


def _register(device, cap: int) -> np.ndarray:
  target = ffi.require("dtenjax_p2p_register", "CUDA")
  out = jax.ShapeDtypeStruct((DESCRIPTOR_BYTES,), jnp.uint8)
  desc = _run_on(device, lambda: jax.ffi.ffi_call(target, out)(capacity=np.int64(cap)))
  return desc.view(np.int64)


def _connect(device, key: int, rank: int, world: int, descriptors: np.ndarray) -> None:
  target = ffi.require("dtenjax_p2p_connect", "CUDA")
  out = jax.ShapeDtypeStruct((1,), jnp.int32)
  _run_on(device, lambda: jax.ffi.ffi_call(target, out)(
      key=np.int64(key), rank=np.int64(rank), world=np.int64(world),
      descriptors=np.ascontiguousarray(descriptors, dtype=np.int64)))


def _groups(mesh, axis_name: str) -> list[list[Any]]:
  """Devices of every group along ``axis_name``, each in rank (axis index) order."""
  if axis_name not in mesh.axis_names:
    raise errors.CollectiveError(
        f"axis {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}; pass the mesh that "
        "the shard_map runs over (mesh=...)")
  devs = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis_name), -1)
  return [list(g) for g in devs.reshape(-1, devs.shape[-1])]


def _key_of(groups: list[list[Any]]) -> int:
  text = ";".join(",".join(str(d.id) for d in g) for g in groups)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _kv_client():
  """jax.distributed's coordination client (the one place that touches this private API)."""
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client = distributed.global_state.client
  if client is None:
    raise errors.CollectiveError(
        "p2p all-reduce across processes needs jax.distributed.initialize() first")
  return client


def _exchange(key: int, group: list[Any], local: dict[int, np.ndarray]) -> np.ndarray:
  """All ranks' descriptors of one group, in rank order (over the KV store across processes)."""
  if all(d.id in local for d in group):
    return np.concatenate([local[d.id] for d in group])
  client = _kv_client()
  for d in group:
    if d.id in local:
      client.key_value_set(f"{_KV_PREFIX}/{key}/{d.id}", local[d.id].tobytes().hex())
  out = []
  for d in group:
    if d.id in local:
      out.append(local[d.id])
      continue
    try:
      raw = client.blocking_key_value_get(f"{_KV_PREFIX}/{key}/{d.id}", _timeout_ms())
    except Exception as e:  # pylint: disable=broad-except
      raise errors.CollectiveTimeoutError(
          f"p2p set-up waited {_timeout_ms()} ms for the buffer descriptor of device {d.id} "
          f"(process {d.process_index}) and got none ({e}); make sure every process calls the "
          "same collective, or raise DTENJAX_COLLECTIVE_TIMEOUT") from None
    out.append(np.frombuffer(bytes.fromhex(raw), dtype=np.int64))
  return np.concatenate(out)


def prepare(axis_name: str, axis_size: int, mesh=None) -> int:
  """Allocates, exchanges and peer-maps the buffers for ``axis_name``; returns the comm key.

  Runs eagerly (also when called while tracing) and only once per device group. ``mesh`` is the
  concrete mesh of the shard_map; without it the mesh set by ``jax.set_mesh`` is used. A world of
  one needs no mesh (every local GPU forms its own group).
  """
  if mesh is None and axis_size != 1:
    try:
      mesh = jax.sharding.get_mesh()   # raises while tracing under jit on jax 0.11
    except ValueError:
      mesh = None
    if mesh is None or getattr(mesh, "empty", True) or not hasattr(mesh, "devices"):
      mesh = None
  if mesh is None:
    if axis_size != 1:
      raise errors.CollectiveError(
          f"p2p all_reduce over axis {axis_name!r} (size {axis_size}) needs the concrete mesh to "
          "know which GPU is which rank: pass mesh=... or run under jax.set_mesh(mesh)")
    groups = [[d] for d in jax.local_devices(backend="gpu")]
  else:
    groups = _groups(mesh, axis_name)
  key = _key_of(groups)
  with _lock:
    if key in _connected:
      return key
    if key in _failures:
      raise errors.CollectiveError(_failures[key])
    cap = capacity_bytes()
    try:
      pid = jax.process_index()
      local = {d.id: _register(d, cap) for g in groups for d in g if d.process_index == pid}
      for g in groups:
        if not any(d.id in local for d in g):
          continue
        descs = _exchange(key, g, local)
        for rank, d in enumerate(g):
          if d.id in local:
            _connect(d, key, rank, len(g), descs)
    except errors.CollectiveTimeoutError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      msg = (f"p2p set-up for axis {axis_name!r} failed: {e}. Use algorithm='xla' (or 'auto', "
             "which falls back to it)")
      _failures[key] = msg
      _last_failure.append(msg)
      raise errors.CollectiveError(msg) from None
    _connected[key] = len(groups[0])
  return key


# --- the collective ----------------------------------------------------------------------------

def _check(x, algorithm: str, op: str) -> None:
  problems = []
  if algorithm not in ALGORITHMS:
    problems.append(f"algorithm {algorithm!r} is not one of {sorted(ALGORITHMS)}")
  if op != "sum":
    problems.append(f"op {op!r} is not supported by the p2p kernels (only 'sum'); use "
                    "algorithm='xla' for other reductions")
  if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
    problems.append(f"dtype {jnp.dtype(x.dtype).name} is not float32, bfloat16 or float16; "
                    "cast the input or use algorithm='xla'")
  if problems:
    raise errors.CollectiveError(errors.join_problems("p2p all_reduce cannot run:", problems))


def all_reduce(x, axis_name: str, *, algorithm: str = "one_shot", op: str = "sum", mesh=None):
  """Sum of ``x`` over ``axis_name`` with the NVLink p2p kernels (inside shard_map/jit on GPU).

  Bits follow the contract in this module's docstring. Raises CollectiveError (with the reason)
  when :func:`supported` says no; callers that want a fallback check :func:`supported` first.
  """
  _check(x, algorithm, op)
  axis_size = int(jax.lax.axis_size(axis_name))
  nbytes = int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
  ok, why = supported(axis_size, nbytes, x.dtype)
  if not ok:
    raise errors.CollectiveError(
        f"p2p all_reduce({algorithm}) over {axis_name!r} is unavailable: {why}. Use "
        "algorithm='xla' (or 'auto', which falls back to it)")
  key = prepare(axis_name, axis_size, mesh)
  target = ffi.require("dtenjax_p2p_all_reduce", "CUDA")
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, key=np.int64(key), algorithm=np.int64(ALGORITHMS[algorithm]),
      timeout_ms=np.int64(_timeout_ms()))


# --- the simulated-rank harness (one GPU, N ranks) -------------------------------------------

def reference(x: np.ndarray) -> np.ndarray:
  """The contract in numpy: rank-order f32 fold over axis 0 of ``x`` [W, ...], one rounding."""
  x = np.asarray(x)
  acc = x[0].astype(np.float32)
  for r in range(1, x.shape[0]):
    acc = acc + x[r].astype(np.float32)
  return acc.astype(x.dtype)


def selftest(x, *, algorithm: str = "one_shot", count: int | None = None, iters: int = 3,
             mode: int = 0, graph: bool = False, capacity: int | None = None):
  """Runs the real kernels with ``x.shape[0]`` simulated ranks on one GPU; returns [W, n].

  ``x`` is [W, n] with n * itemsize a multiple of 16 (each rank's row 16-byte aligned); the
  kernels reduce the first ``count`` (default n) elements of every row, the rest of the output
  is unspecified. mode 0 chains ``iters`` calls so that a stale buffer or flag changes the final
  bits; mode 1 repeats the same call ``iters`` times (timing); mode 2 times a device-to-device
  copy of ``x`` instead. ``graph`` uses the command-buffer-compatible target, which needs an
  earlier non-graph call with the same W to have allocated the arena (``capacity`` bytes per
  rank, default the registered-buffer size).
  """
  _check(x, algorithm, "sum")
  if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_WORLD:
    raise errors.CollectiveError(f"selftest input must be [ranks <= 8, n], got {x.shape}")
  n = x.shape[1]
  count = n if count is None else count
  target = ffi.require("dtenjax_p2p_selftest_graph" if graph else "dtenjax_p2p_selftest", "CUDA")
  return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
      x, count=np.int64(count), algorithm=np.int64(ALGORITHMS[algorithm]),
      iters=np.int64(iters), mode=np.int64(mode),
      capacity=np.int64(capacity if capacity is not None else capacity_bytes()),
      timeout_ms=np.int64(_timeout_ms()))
