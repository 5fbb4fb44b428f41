"""NVLink peer-to-peer all-reduce on GPU: one-shot and two-shot CUDA kernels as XLA FFI calls.

The kernels (``csrc/p2p/allreduce.cuh``) read every rank's data straight out of peer memory:

* ``one_shot``: each rank copies its input into its registered buffer, the ranks meet at a GPU-side
  barrier, then every rank reads all W buffers and reduces the whole message. Best for small and
  medium messages (one barrier, W reads per element).
* ``two_shot``: reduce-scatter then all-gather. Rank r reduces segment r of every buffer in place,
  a second barrier, then every rank copies the other W-1 reduced segments. Moves ~2x fewer bytes
  per link for large messages.

Bit contract (tested in ``tests/test_p2p.py``), identical on every rank and for both algorithms,
rank r = position along the (combined) mesh axes:

* ``sum``: ``acc = f32(x_0); acc = acc + f32(x_r)`` for r = 1..W-1 (IEEE f32, RNE, no FMA), then one
  rounding to the dtype; ``mean`` divides the f32 sum by W before that rounding. This is exactly
  the XLA-native ``one_shot`` of ``collectives/algorithms/one_shot.py`` (all-gather + the same fold).
* ``max`` / ``min``: the rank-order fold of ``>`` / ``<`` selections; any NaN gives NaN.
* ``reproducible=True`` (``sum``/``mean``, float32/bfloat16): the reproducible sum of contract v3
  (docs/collectives.md), fused into the same kernels: each rank reads its peers' float data,
  derives the per-element exponent from the values it read, sums one int32 word per value in
  registers and rounds once (no extra pass, no extra bytes). ``reproducible="exact"``: the exact
  contract v2 the same way, with 64-bit integers. Same bits as the XLA path on any backend and
  any device count.

Which GPU is which rank is learnt at LOWERING time from the concrete mesh of the enclosing
``shard_map`` (also under ``jax.set_mesh`` and plain ``jax.jit``); the caller passes no mesh. Set-up
(allocating one symmetric region per GPU, exchanging 128-byte descriptors over
``jax.distributed``'s key-value store across processes, and mapping peers with
``cudaDeviceEnablePeerAccess`` in one process or CUDA IPC across processes) runs once per device
group, eagerly, while lowering. If it fails, the reason is logged once and the caller's
``fallback`` (the same collective with XLA's ops) is lowered instead; the failure is remembered
only when retrying cannot help (e.g. no peer access between the GPUs). The traced call only
launches kernels, so it is CUDA-graph (command buffer) compatible. Messages larger than the
registered buffer (``DTENJAX_P2P_BUFFER_BYTES``) run as several chunks.

A barrier that waits past ``DTENJAX_COLLECTIVE_TIMEOUT`` traps the kernel: the step fails with a
CUDA error (never with made-up data), a watchdog prints which rank waited for which, and
:func:`kernel_timeouts` returns the same text.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import batching
from jax.interpreters import mlir

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src import jaxapi

MAX_WORLD = 8
DESCRIPTOR_BYTES = 128
TARGET = "dtenjax_p2p_all_reduce"
_KV_PREFIX = "dtenjax/p2p"

# Python's op names beyond the kernels' own: mean is the sum with the attribute mean = 1.
_SUM_FORMS = {"mean": "sum"}

_lock = threading.Lock()
_connected: dict[int, int] = {}          # communicator key -> world size
_failures: dict[int, str] = {}           # key -> why set-up failed for good (not worth retrying)


# --- the kernels' vocabulary (csrc/p2p/vocabulary.h, exported by the extension) ---------------

@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """The integers of the kernels' FFI attributes, read from ``dtenjax._ffi.vocabulary``."""
  algorithms: dict[str, int]        # the attribute `algorithm`
  ops: dict[str, int]               # the attribute `op`, Python's names (mean included)
  reproducible: dict[str, int]      # the attribute `reproducible`: "none", "v3", "exact"
  dtypes: tuple[Any, ...]           # the buffer types the kernels take
  reproducible_dtypes: tuple[Any, ...]   # those with reproducible kernels


@functools.cache
def vocabulary() -> Vocabulary:
  """The p2p vocabulary as this build exports it; ExtensionUnavailableError without a build."""
  ops = ffi.vocabulary("p2p.op")
  ops.update({py: ops[native] for py, native in _SUM_FORMS.items()})
  rep = ffi.vocabulary("p2p.dtype_reproducible")
  return Vocabulary(
      algorithms=ffi.vocabulary("p2p.algorithm"), ops=ops,
      reproducible=ffi.vocabulary("p2p.reproducible"),
      dtypes=tuple(jnp.dtype(n) for n in ffi.vocabulary("p2p.dtype")),
      reproducible_dtypes=tuple(jnp.dtype(n) for n, ok in rep.items() if ok))


def _attributes(algorithm: str, op: str, reproducible: str | None) -> dict[str, np.int64]:
  v = vocabulary()
  return dict(algorithm=np.int64(v.algorithms[algorithm]), op=np.int64(v.ops[op]),
              reproducible=np.int64(v.reproducible[reproducible or "none"]),
              mean=np.int64(op == "mean"))


# --- availability ------------------------------------------------------------------------------

def capacity_bytes() -> int:
  """Bytes of one registered stage buffer per GPU (``DTENJAX_P2P_BUFFER_BYTES``)."""
  cap = config.get_int("DTENJAX_P2P_BUFFER_BYTES")
  if cap <= 0 or cap % 16:
    raise errors.ConfigurationError(
        f"DTENJAX_P2P_BUFFER_BYTES={cap} must be a positive multiple of 16 (default "
        f"{config.KNOBS['DTENJAX_P2P_BUFFER_BYTES'].default}).")
  return cap


def max_blocks() -> int:
  """Most thread blocks per GPU a call may use (``DTENJAX_P2P_MAX_BLOCKS``)."""
  n = config.get_int("DTENJAX_P2P_MAX_BLOCKS")
  if not 1 <= n <= 128:
    raise errors.ConfigurationError(
        f"DTENJAX_P2P_MAX_BLOCKS={n} must be in [1, 128] (default "
        f"{config.KNOBS['DTENJAX_P2P_MAX_BLOCKS'].default}).")
  return n


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
  if (TARGET, "CUDA") not in info["targets"]:
    return f"the build lacks the CUDA target {TARGET!r}; rebuild the extension"
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    gpus = []
  if not gpus:
    return f"no CUDA GPU is visible to jax (backend {jax.default_backend()!r})"
  if not ffi.has_target(TARGET, "CUDA"):
    return f"FFI target {TARGET!r} could not be registered for CUDA"
  return None


def supported(world: int, nbytes: int, dtype, *, op: str = "sum",
              reproducible: bool = False) -> tuple[bool, str]:
  """Whether the kernels can all-reduce ``nbytes`` of ``dtype`` with ``op`` over ``world`` ranks.

  Returns ``(True, "")`` or ``(False, reason)`` listing every problem. Any message size works
  (large ones run in chunks). Which GPUs take part is only known when the call is lowered; a
  set-up failure there makes that call fall back (see the module docstring).
  """
  del nbytes   # no size limit: messages larger than the registered buffer run in chunks
  if not ffi.is_built():
    return False, unavailable_reason()
  v = vocabulary()
  problems = []
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if op not in v.ops:
    problems.append(f"op {op!r} is not one of {sorted(v.ops)}")
  if reproducible:
    if dt not in v.reproducible_dtypes:
      problems.append(f"the reproducible sum takes {_names(v.reproducible_dtypes)}, not {dtype}")
    if _SUM_FORMS.get(op, op) != "sum":
      problems.append(f"op {op!r} has no reproducible form (sum and mean do)")
  elif dt not in v.dtypes:
    problems.append(f"dtype {dtype} is not one of {_names(v.dtypes)}")
  if not isinstance(world, (int, np.integer)) or not 1 <= world <= MAX_WORLD:
    problems.append(f"world size {world} is outside [1, {MAX_WORLD}]")
  for knob in (capacity_bytes, max_blocks):
    try:
      knob()
    except errors.ConfigurationError as e:
      problems.append(str(e))
  why = unavailable_reason()
  if why:
    problems.append(why)
  return (not problems, "; ".join(problems))


def _names(dtypes) -> str:
  return ", ".join(d.name for d in dtypes)


def kernel_timeouts() -> list[str]:
  """One message per GPU of this process whose kernel timed out (its CUDA context is gone)."""
  return list(ffi.module().p2p_kernel_timeouts())


# --- communicator set-up (eager, while lowering) -----------------------------------------------

def groups_of(mesh, axes: Sequence[str]) -> list[list[Any]]:
  """Devices of every group along ``axes`` (combined in the given order), each in rank order.

  Rank = ``lax.axis_index(axes)``: the position along the named axes, the first name major.
  """
  missing = [a for a in axes if a not in mesh.axis_names]
  if missing:
    raise errors.CollectiveError(
        f"axes {missing} are not axes of the mesh {dict(mesh.shape)}")
  return [list(g) for g in jaxapi.device_groups(mesh.devices, mesh.axis_names, axes)]


def _key_of(groups: list[list[Any]]) -> int:
  text = ";".join(",".join(str(d.id) for d in g) for g in groups)
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _kv_client():
  """jax.distributed's coordination client."""
  client = jaxapi.coordination_client()
  if client is None:
    raise errors.CollectiveError(
        "p2p all-reduce across processes needs jax.distributed.initialize() first")
  return client


def _exchange(key: int, group: list[Any], local: dict[int, bytes]) -> bytes:
  """All ranks' descriptors of one group, in rank order (over the KV store across processes)."""
  if all(d.id in local for d in group):
    return b"".join(local[d.id] for d in group)
  client = _kv_client()
  for d in group:
    if d.id in local:
      client.key_value_set(f"{_KV_PREFIX}/{key}/{d.id}", local[d.id].hex())
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
          f"(process {d.process_index}) and got none ({e}); make sure every process runs the "
          "same program, or raise DTENJAX_COLLECTIVE_TIMEOUT") from None
    out.append(bytes.fromhex(raw))
  return b"".join(out)


def prepare(groups: list[list[Any]]) -> int:
  """Registers, exchanges and peer-maps the buffers of ``groups``; returns the communicator key.

  Idempotent per device grouping. Raises a DtenjaxError saying why when it cannot be done.
  """
  key = _key_of(groups)
  with _lock:
    if key in _connected:
      return key
    if key in _failures:
      raise errors.CollectiveError(_failures[key])
    native = ffi.module()
    cap = capacity_bytes()
    pid = jax.process_index()
    try:
      local = {d.id: native.p2p_register(int(d.local_hardware_id), cap)
               for g in groups for d in g if d.process_index == pid}
      for g in groups:
        if not any(d.id in local for d in g):
          continue
        descs = _exchange(key, g, local)
        for rank, d in enumerate(g):
          if d.id in local:
            native.p2p_connect(int(d.local_hardware_id), key, rank, len(g), descs)
    except (errors.ConfigurationError, errors.ExtensionUnavailableError) as e:
      # Retrying the same grouping cannot help (no peer access, another host, bad buffer size).
      _failures[key] = f"{e}"
      raise
    _connected[key] = len(groups[0])
  return key


def _concrete_mesh(ctx):
  """The concrete mesh a shard_map body is being lowered for, or a reason why there is none."""
  axis_ctx = ctx.module_context.axis_context
  mesh = getattr(axis_ctx, "mesh", None)
  if mesh is not None and not isinstance(mesh, jax.sharding.AbstractMesh):
    return mesh, None
  concrete = jaxapi.concrete_mesh()   # shard_map over an abstract mesh: jax.set_mesh's, if any
  if concrete is not None:
    return concrete, None
  return None, (f"lowered outside a shard_map over a concrete mesh (axis context "
                f"{type(axis_ctx).__name__}), so which GPU is which rank is unknown")


# --- the primitive -------------------------------------------------------------------------------

_p2p_p = jex_core.Primitive("dtenjax_p2p_all_reduce")
# Typed as lax.psum: every rank ends with the same reduced value, invariant over the axes.
_p2p_p.def_abstract_eval(lambda x, *, axes, **_: jaxapi.reduced_type(x, axes))


def _batch(axis_data, args, dims, **params):
  (x,), (d,) = args, dims
  if axis_data.name in params["axes"]:
    # A reduction over the vmapped axis itself has no GPUs to run kernels on: it is the
    # fallback's (XLA ops) job, vmapped under the same axis name.
    fallback = params["fallback"]
    if fallback is None:
      raise errors.CollectiveError(
          f"p2p all_reduce over the vmap axis {axis_data.name!r}: the NVLink kernels reduce "
          "across GPUs of a mesh; use dtenjax.all_reduce (which falls back) or algorithm='xla'")
    return jax.vmap(fallback, in_axes=d, axis_name=axis_data.name,
                    axis_size=axis_data.size)(x), 0
  # An ordinary batch axis: every element is reduced across devices independently.
  return _p2p_p.bind(x, **params), d


batching.fancy_primitive_batchers[_p2p_p] = _batch


def _lower(ctx, x, *, axes, algorithm, op, reproducible, fallback):
  why = None
  if tuple(ctx.module_context.platforms) != ("cuda",):
    why = f"lowered for {list(ctx.module_context.platforms)}, not CUDA"
  else:
    mesh, why = _concrete_mesh(ctx)
    if mesh is not None:
      try:
        key = prepare(groups_of(mesh, axes))
      except errors.DtenjaxError as e:
        why = f"set-up failed: {e}"
  if why is not None:
    if fallback is None:
      raise errors.CollectiveError(f"p2p all_reduce({algorithm}) over {axes}: {why}")
    config.log_fallback(f"p2p-lower:{why}", f"dtenjax: {algorithm} NVLink kernel not used "
                        f"over {axes} ({why}); using the XLA form instead")
    return mlir.lower_fun(fallback, multiple_results=False)(ctx, x)
  return jax.ffi.ffi_lowering(TARGET)(
      ctx, x, key=np.int64(key), **_attributes(algorithm, op, reproducible),
      max_blocks=np.int64(max_blocks()), timeout_ms=np.int64(_timeout_ms()))


mlir.register_lowering(_p2p_p, _lower)


# --- the collective ----------------------------------------------------------------------------

def _contract(reproducible) -> str | None:
  """None, or the reproducible contract ("v3" for True, "exact")."""
  if reproducible is True:
    return "v3"
  if not reproducible:
    return None
  if reproducible in ("v3", "exact"):     # "v3": the collectives layer's name for True
    return reproducible
  raise errors.CollectiveError(f"reproducible={reproducible!r} is not False, True (contract v3) "
                               "or 'exact' (contract v2)")


def _check(x, algorithm: str, op: str, reproducible) -> None:
  v = vocabulary()
  problems = []
  if algorithm not in v.algorithms:
    problems.append(f"algorithm {algorithm!r} is not one of {sorted(v.algorithms)}")
  dt = jnp.dtype(x.dtype)
  if op not in v.ops:
    problems.append(f"op {op!r} is not one of {sorted(v.ops)}")
  elif reproducible and _SUM_FORMS.get(op, op) != "sum":
    problems.append(f"op {op!r} has no reproducible form; use op='sum' or 'mean'")
  if reproducible and dt not in v.reproducible_dtypes:
    problems.append(f"dtype {dt.name}: the reproducible sum takes {_names(v.reproducible_dtypes)}")
  elif dt not in v.dtypes:
    problems.append(f"dtype {dt.name} is not one of {_names(v.dtypes)}; cast the input or "
                    "use algorithm='xla'")
  if problems:
    raise errors.CollectiveError(errors.join_problems("p2p all_reduce cannot run:", problems))


def all_reduce(x, axis_name, *, algorithm: str = "one_shot", op: str = "sum",
               reproducible: bool | str = False, fallback: Callable | None = None):
  """All-reduce of ``x`` over ``axis_name`` with the NVLink kernels (inside shard_map on GPU).

  Bits follow the contract in this module's docstring. ``fallback(x)`` must compute the same
  collective with XLA's ops: it runs instead when the kernels cannot (no GPU, or the set-up fails
  while lowering; the reason is logged once). Without a fallback those cases raise
  CollectiveError with the reason.
  """
  if not ffi.is_built():   # no vocabulary to check names against, and no kernels to run
    why = unavailable_reason()
    if fallback is None:
      raise errors.CollectiveError(f"p2p all_reduce({algorithm}) is unavailable: {why}")
    config.log_fallback(f"p2p:{why}", f"dtenjax: {algorithm} NVLink kernel not used ({why}); "
                        "using the XLA form instead")
    return fallback(x)
  _check(x, algorithm, op, reproducible)
  reproducible = _contract(reproducible)
  axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  world = int(lax.axis_size(axes))
  nbytes = int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
  ok, why = supported(world, nbytes, x.dtype, op=op, reproducible=reproducible)
  if not ok:
    if fallback is None:
      raise errors.CollectiveError(
          f"p2p all_reduce({algorithm}) over {axes} is unavailable: {why}. Use "
          "algorithm='xla' (or 'auto', which falls back to it)")
    config.log_fallback(f"p2p:{why}", f"dtenjax: {algorithm} NVLink kernel not used ({why}); "
                        "using the XLA form instead")
    return fallback(x)
  return _p2p_p.bind(x, axes=axes, algorithm=algorithm, op=op, reproducible=reproducible,
                     fallback=fallback)
