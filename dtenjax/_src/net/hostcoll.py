"""Cross-process all-reduce inside jit, over the host transport (an asynchronous FFI custom call).

``dtenjax.all_reduce`` (collectives.py) dispatches here when the reduced axis spans processes and
the algorithm is ``"ring"`` or ``"hierarchical"``. Use inside ``jax.shard_map``.

Supported configurations, checked before tracing the custom call (others raise CollectiveError):

* ``algorithm="ring"``: ``axis_name`` is one mesh axis (or a tuple of axes) covering exactly one
  device per process, ``jax.process_count()`` devices in all, in process order (position p along
  the axis held by process p; checked at run time). Each process's device runs one rank of an
  authenticated TCP (or verbs) ring.
* ``algorithm="hierarchical"``: ``axis_name=(outer, inner)`` where ``inner`` covers the devices of
  one process and ``outer`` one device per process. Stage 1 is XLA's own reduce-scatter over
  ``inner`` (psum_scatter), stage 2 the transport ring over ``outer`` on each device's shard (device
  j of every process forms ring j, so no custom call ever waits for another device of its own
  process), stage 3 XLA's all-gather over ``inner``.

Why not several devices of one process in one ring: a custom call that rendezvouses across the
CPU devices of one process deadlocks XLA's CPU runtime (measured: docs/architecture.md). A
custom call here only waits for peers in other processes, and asynchronously: the handler queues the
collective on the communicator's own thread and returns an ``xla::ffi::Future``, so XLA's threads
are never blocked on the network. The call has side effects, so XLA keeps program order among
them; every collective's fingerprint (number, op, dtype, count, the caller's ``tag``, its
signature -- the dtype and shape of the caller's value, algorithm, contract -- and call site, the
user call stack of the traced equation) is checked by every rank before any payload is combined,
so processes that issue different collectives, or the same ones in different orders, get an
error on every rank naming both sides and both call stacks, not wrong data. What stays undetectable: collectives identical in all of
these, e.g. iterations of one loop without a tag (docs/reliability.md, "Look-alike
collectives"), and two Python threads running such programs at once on one process, which share
this process's communicators (run them from one thread; docs/transport.md, "The identity rule").
Call-site texts and str tags count whole, however long (:func:`callsite.wire_text`). A dead or
stalled peer makes every survivor fail within ``DTENJAX_COLLECTIVE_TIMEOUT`` seconds (a dead
peer's sockets close at once; a stalled one times out and the survivors that detect it close
their sockets, which wakes the rest).

Determinism: ring chunk ``c`` is combined in the fixed rank order ``c, c+1, ..., c-1`` (mod n),
and every rank receives the same reduced bits, so results are identical on all ranks and in every
run; ``tests/transport_ref.py``'s ``reference_ring_sum`` reproduces them bit for bit in numpy.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src import jaxapi
from dtenjax._src.net import callsite
from dtenjax._src.net import native
from dtenjax._src.net import transport

TARGET = "dtenjax_host_all_reduce"
# Stage 1 of "hierarchical" reduces over the process's own devices with XLA before the ring: the
# ops with such a local reduction are the transport's ops (frame.h) this module can offer.
_LOCAL_REDUCE = {"sum": jax.lax.psum_scatter, "max": jax.lax.pmax, "min": jax.lax.pmin}


def _ops() -> tuple[str, ...]:
  """The transport's ops (as the extension exports them) that have a local stage-1 reduction."""
  return tuple(op for op in native.codes()[1] if op in _LOCAL_REDUCE)


def _all_ops() -> tuple[str, ...]:
  """:func:`_ops` and mean (sum / axis size)."""
  return _ops() + ("mean",)


def __getattr__(name: str):
  # What the frames carry and which ops they combine come from the extension (no copy kept here).
  if name == "DTYPES":
    return tuple(native.codes()[0])
  if name == "OPS":
    return _ops()
  if name == "ALL_OPS":
    return _all_ops()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_lock = threading.Lock()
_comm_groups: dict[tuple[int, str], list[transport.Communicator]] = {}


def _check(x, axes: tuple[str, ...], algorithm: str, op: str) -> tuple[int, int]:
  """Validates before tracing; returns (processes in the ring, devices per process)."""
  problems = []
  if algorithm not in ALGORITHMS:
    problems.append(f"algorithm={algorithm!r} is not one of {ALGORITHMS}")
  all_ops = _all_ops()
  if op not in all_ops:
    problems.append(f"op={op!r} is not one of {sorted(all_ops)}")
  dtypes = tuple(native.codes()[0])
  if jnp.dtype(x.dtype) not in dtypes:
    problems.append(f"dtype {jnp.dtype(x.dtype).name} is not one of {[d.name for d in dtypes]}")
  sizes = dict(jax.sharding.get_abstract_mesh().shape)   # the enclosing shard_map's mesh axes
  unknown = [a for a in axes if a not in sizes]
  if unknown:
    problems.append(f"axis {unknown} is not a mesh axis of the enclosing shard_map "
                    f"({list(sizes)})")
  nproc = jax.process_count()
  local = 1
  if not unknown:
    mesh_size = math.prod(sizes.values())
    if algorithm == "ring":
      span = math.prod(sizes[a] for a in axes)
      if span != nproc or mesh_size != nproc:
        problems.append(
            f"ring over {axes} needs exactly one mesh device per process: the axes span {span} "
            f"devices and the mesh has {mesh_size}, but there are {nproc} processes. Use "
            "algorithm='hierarchical' with axis_name=(process_axis, local_axis), or a mesh with "
            "one device per process")
    elif algorithm == "hierarchical":
      if len(axes) != 2:
        problems.append(f"hierarchical needs axis_name=(outer, inner), got {axes}")
      else:
        outer, inner = axes
        local = sizes[inner]
        if sizes[outer] != nproc or mesh_size != nproc * local:
          problems.append(
              f"hierarchical needs outer axis {outer!r} of size {nproc} (one entry per process) "
              f"and inner axis {inner!r} covering each process's devices; got sizes "
              f"{dict(sizes)} for a mesh of {mesh_size} devices")
  if problems:
    raise errors.CollectiveError(errors.join_problems(
        "dtenjax cross-process all_reduce cannot run this call:", problems))
  return nproc, local


def communicators(local_slots: int, tenant: str = "default") -> list[transport.Communicator]:
  """The rings of this process, one per process-local device slot (created collectively once)."""
  with _lock:
    key = (local_slots, tenant)
    if key not in _comm_groups:
      _comm_groups[key] = [
          transport.create_communicator(f"hostcoll-{tenant}-{local_slots}-{j}", tenant=tenant)
          for j in range(local_slots)]
    return _comm_groups[key]


def reset() -> None:
  """Closes this process's collective communicators (a new trace creates fresh ones)."""
  with _lock:
    for group in _comm_groups.values():
      for c in group:
        c.close()
    _comm_groups.clear()


def _tag_operand(tag):
  """The tag as the int32 bit pattern of its 32-bit value (static int or traced integer)."""
  if isinstance(tag, int):
    return jnp.asarray(np.array(tag, np.uint32).view(np.int32))
  return jax.lax.bitcast_convert_type(jnp.asarray(tag).astype(jnp.uint32), jnp.int32)


def _ring_call(x, position, slot, comm_ids: Sequence[int], op: str, site: int,
               reduced: Sequence[str], tag=0):
  """One ring all-reduce across processes; the result is typed invariant over ``reduced`` (the
  axes along which every participant now holds the same value), as lax.psum's would be."""
  ffi.require(TARGET, "CUDA" if jax.default_backend() == "gpu" else "cpu")
  where = jnp.stack([jnp.asarray(position, jnp.int32), jnp.asarray(slot, jnp.int32),
                     _tag_operand(tag)])
  # A custom call's operands must vary over the same axes.
  x = jaxapi.to_varying(x, tuple(jaxapi.vma(where)))
  where = jaxapi.to_varying(where, tuple(jaxapi.vma(x)))
  call = jax.ffi.ffi_call(TARGET, jaxapi.reduced_struct(x, reduced), has_side_effect=True)
  return call(x, where, comm_ids=np.asarray(comm_ids, np.int64), op=np.int32(native.codes()[1][op]),
              site=np.int64(site))


def signature(x, algorithm: str, origin: str | None = None) -> str:
  """What a collective is, for its fingerprint: the dtype and shape of ``x``, ``origin`` (what
  the caller reduces when ``x`` is a widened form of it, e.g. ``"bfloat16 contract=none"`` for
  bfloat16 carried as float32) and the algorithm: ``"float32[4, 250] (bfloat16 contract=none)
  algorithm=ring"``."""
  return (f"{jnp.dtype(x.dtype).name}{list(x.shape)}" + (f" ({origin})" if origin else "")
          + f" algorithm={algorithm}")


def all_reduce(x, axis_name, *, algorithm: str = "ring", op: str = "sum",
               tenant: str = "default", site: tuple[int, str] | None = None, tag=None,
               origin: str | None = None):
  """All-reduce of ``x`` over ``axis_name`` across processes, through the host transport.

  Call inside ``jax.shard_map`` (or ``dtenjax.mesh_map``); see the module docstring for the
  supported meshes. Deterministic: identical bits on every rank and every run. ``site`` (tag,
  text) identifies the call site in every frame (default: the caller's user call stack, see
  :func:`dtenjax._src.net.callsite.call_site`). ``tag`` tells apart collectives whose call
  stacks are the same, e.g. the iterations of a loop: an int in [0, 2**32), an integer scalar
  array (traced, e.g. the step number inside ``lax.fori_loop``), or a str naming the collective
  (:func:`dtenjax._src.net.callsite.tag_value`). Every process must pass the same tag for the
  same collective; a rank that differs raises on every rank, naming both. ``origin`` says what
  the caller reduces when ``x`` is a widened form of it (see :func:`signature`).

  Every rank checks, before it combines any payload, that its previous rank runs the same
  collective: op, dtype, element count, tag, signature (dtype and shape of the caller's value,
  algorithm, contract) and call site, under a keyed 64-bit digest (docs/reliability.md).
  """
  axes = jaxapi.axis_tuple(axis_name)
  nproc, local = _check(x, axes, algorithm, op)
  value, suffix = callsite.tag_value(tag)
  if site is None:
    site = callsite.call_site()
  if suffix:
    site = (site[0], site[1] + suffix)
  tag = value if value is not None else tag   # a traced tag travels as an operand
  sig = signature(x, algorithm, origin)
  if op == "mean":
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise errors.CollectiveError(
          f"op='mean' needs a floating dtype, got {jnp.dtype(x.dtype).name}; cast first or use "
          "op='sum'.")
    total = all_reduce(x, axis_name, algorithm=algorithm, op="sum", tenant=tenant, site=site,
                       tag=tag, origin=f"{origin or jnp.dtype(x.dtype).name} mean")
    return (total / jnp.asarray(nproc * local, total.dtype)).astype(x.dtype)
  if jax.process_count() == 1:
    # one process, one device on the axes: nothing to combine (the gather of one is typed as
    # the all-reduce's result)
    return jaxapi.all_gather_invariant(x, axes)[0]
  comms = communicators(local, tenant)
  site_tag = callsite.site_id(site[1], sig, base=site[0])
  native.register_site(site_tag, site[1], sig)
  ids = [c.comm_id for c in comms]
  return _ALGORITHMS[algorithm](x, axes, local, ids, op, site_tag, tag)


def _ring(x, axes, local, ids, op, site_tag, tag):
  del local   # one device per process (checked)
  return _ring_call(x, jax.lax.axis_index(axes), 0, ids, op, site_tag, axes, tag)


def _hierarchical(x, axes, local, ids, op, site_tag, tag):
  outer, inner = axes
  position = jax.lax.axis_index(outer)
  if local == 1:
    return _ring_call(x, position, 0, ids, op, site_tag, axes, tag)
  slot = jax.lax.axis_index(inner)
  if op != "sum":
    # max/min: reduce locally, then every slot reduces the whole array on its own ring.
    local_red = _LOCAL_REDUCE[op](x, inner)
    return _ring_call(local_red, position, slot, ids, op, site_tag, axes, tag)
  flat = x.reshape(-1)
  pad = (-flat.size) % local
  flat = jnp.pad(flat, (0, pad))
  shard = _LOCAL_REDUCE["sum"](flat.reshape(local, -1), inner, scatter_dimension=0, tiled=False)
  shard = _ring_call(shard, position, slot, ids, op, site_tag, (outer,), tag)
  full = jaxapi.all_gather_invariant(shard, (inner,), axis=0, tiled=False).reshape(-1)
  return full[:flat.size - pad].reshape(x.shape) if pad else full.reshape(x.shape)


# The algorithms: their names are the keys of this table of implementations.
_ALGORITHMS = {"ring": _ring, "hierarchical": _hierarchical}
ALGORITHMS = tuple(_ALGORITHMS)


def status() -> dict[str, Any]:
  """What the host collectives would use here (for explain/diagnostics)."""
  return {"available": native.is_available() and ffi.has_target(TARGET, "cpu"),
          "processes": jax.process_count(), "local_devices": jax.local_device_count(),
          "communicators": {f"{k[1]}/{k[0]}": [c.comm_id for c in v]
                            for k, v in _comm_groups.items()}}
