"""The in-memory tier: every few steps each process copies the shards it owns to host memory, and
keeps a replica of its ring neighbour's, so that a lost process's shards survive on another.

Storage is host memory that outlives the process: a directory on a RAM file system (``/dev/shm``
by default, as orbax's emergency checkpointing uses a local RAM disk), one per holder::

  ROOT/holder<r>/own.<r>.<step>        process r's shards at step
  ROOT/holder<r>/replica.<q>.<step>    process q = (r - 1) mod world's shards, received over the
                                       coordination store

One *record* (:func:`encode`) is one process's owned shards (``replica_id == 0``) of every leaf,
with their boxes in the global array, plus the leaves that are not arrays (the step counter). The
training step waits only for the device-to-host copies (:meth:`MemoryTier.snapshot`); writing the
record and moving it to the neighbour run on a background thread that overlaps the next steps.
A step is *complete* for a job of ``world`` processes of which ``lost`` are gone when every
process's record exists at a holder that is not lost (:func:`complete_steps`): with one lost
process, or several that are not neighbours, the newest snapshot survives.

Records are moved through jax.distributed's key-value store (net/kvstore.py's byte calls, in
chunks), which is meant for small states: every byte goes through process 0's coordination
service. The interface is four calls (``snapshot``, ``wait``, ``complete_steps``, ``restore``)
so that another mover (dtenjax's TCP transport, point to point) or another storage (a tier of
``dtenjax.checkpoint``'s storage) can replace either half.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.elastic import store as store_lib
from dtenjax._src.net import kvstore

CHUNK_BYTES = 1 << 20          # per key of the coordination store
KEEP = 2                       # snapshots kept per holder (the complete one and the one in flight)
MAGIC = b"DTJXMEM1"


def default_root() -> str:
  base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
  import tempfile
  return os.path.join(base or tempfile.gettempdir(), f"dtenjax-memory-{os.getuid()}")


def _name(path) -> str:
  return jax.tree_util.keystr(path)


def encode(step: int, rank: int, world: int, tree: Any) -> tuple[dict, list[np.ndarray]]:
  """The header and host buffers of this process's record (the device-to-host copies are all
  started before the first is waited for)."""
  pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
  leaves, pending = [], []
  for path, leaf in pairs:
    name = _name(path)
    if isinstance(leaf, jax.core.Tracer):
      raise errors.ConfigurationError(
          f"leaf {name} is a traced value ({leaf.aval.str_short()}): snapshot was called inside "
          "jax.jit, jax.grad or another transformation, where arrays have no bytes yet; call it "
          "outside, on the state the jitted step returns")
    if isinstance(leaf, jax.Array) and leaf.is_deleted():
      raise errors.ConfigurationError(
          f"leaf {name} was deleted ({leaf.aval.str_short()}): it was donated to a jitted step "
          "(donate_argnums) or .delete()d; snapshot the state the step returned")
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      raise errors.ConfigurationError(
          f"leaf {name} is an array of typed PRNG keys ({leaf.dtype}); keep "
          "jax.random.key_data(key) in the state and rebuild it with jax.random.wrap_key_data")
    if hasattr(leaf, "addressable_shards"):      # a jax.Array (or a view of one's shards)
      mine = [s for s in leaf.addressable_shards if s.replica_id == 0]
      for s in mine:
        s.data.copy_to_host_async()
      boxes = [[[sl.start or 0 for sl in s.index] if s.index else [],
                [n if sl.stop is None else sl.stop for sl, n in zip(s.index, leaf.shape)]
                if s.index else []] for s in mine]
      leaves.append({"name": name, "kind": "array", "shape": list(leaf.shape),
                     "dtype": _dtype_name(leaf.dtype), "boxes": boxes})
      pending.extend(s.data for s in mine)
    elif isinstance(leaf, (bool, int, float, np.generic, np.ndarray)):
      arr = np.asarray(leaf)
      leaves.append({"name": name, "kind": "value", "shape": list(arr.shape),
                     "dtype": _dtype_name(arr.dtype), "boxes": [[[0] * arr.ndim, list(arr.shape)]],
                     "python": type(leaf).__name__ if isinstance(leaf, (bool, int, float))
                     else None})
      pending.append(arr)
    elif leaf is None:
      continue
    else:
      raise errors.ConfigurationError(
          f"leaf {name} is a {type(leaf).__name__}; the in-memory tier holds jax Arrays, numpy "
          "arrays and Python scalars")
  # np.array(copy=True): the device buffers may be donated to the next step
  buffers = [np.array(np.asarray(d), copy=True) for d in pending]
  return {"step": step, "rank": rank, "world": world, "leaves": leaves}, buffers


def _whole(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _dtype_name(dtype) -> str:
  """How a record names a dtype: numpy's ``str`` ("<f4", with the byte order) where numpy reads
  it back as the same dtype, else the name (ml_dtypes' bfloat16, float8_*, int4: their ``str``
  is a bare void "<V2", or "<f1" for float8_e5m2, which numpy reads as nothing or no number)."""
  dt = np.dtype(dtype)
  try:
    if np.dtype(dt.str) == dt:
      return dt.str
  except TypeError:
    pass
  return dt.name


def _dtype(name: str) -> np.dtype:
  return np.dtype(jnp.dtype(name))


def pack(header: dict, buffers: Iterable[np.ndarray]) -> bytes:
  head = json.dumps(header).encode()
  parts = [MAGIC, struct.pack("<Q", len(head)), head]
  parts.extend(np.ascontiguousarray(b).tobytes() for b in buffers)
  return b"".join(parts)


def unpack(blob: bytes, where: str) -> tuple[dict, list[np.ndarray]]:
  if blob[:8] != MAGIC:
    raise errors.CheckpointError(f"{where} is not an in-memory snapshot record")
  (n,) = struct.unpack("<Q", blob[8:16])
  header = json.loads(blob[16:16 + n])
  off, buffers = 16 + n, []
  for leaf in header["leaves"]:
    dt = _dtype(leaf["dtype"])
    for lo, hi in leaf["boxes"]:
      shape = tuple(b - a for a, b in zip(lo, hi))
      size = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
      if off + size > len(blob):
        raise errors.CheckpointError(f"{where} is truncated (leaf {leaf['name']})")
      buffers.append(np.frombuffer(blob, dt, count=size // dt.itemsize, offset=off).reshape(shape))
      off += size
  return header, buffers


def _write_atomic(path: str, blob: bytes) -> None:
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(blob)
  os.replace(tmp, path)


def _steps_in(folder: str, kind: str, rank: int) -> set[int]:
  try:
    names = os.listdir(folder)
  except FileNotFoundError:
    return set()
  out = set()
  for n in names:
    parts = n.split(".")
    if len(parts) == 3 and parts[0] == kind and parts[1] == str(rank) and parts[2].isdigit():
      out.add(int(parts[2]))
  return out


def holder(root: str, r: int) -> str:
  return os.path.join(root, f"holder{r}")


def record_paths(root: str, world: int, lost: Iterable[int], step: int) -> dict[int, str] | None:
  """Where each process's record of ``step`` is (its own copy unless it is lost, else its right
  neighbour's replica); None when some process's record is nowhere."""
  lost = set(lost)
  out = {}
  for r in range(world):
    own = os.path.join(holder(root, r), f"own.{r}.{step}")
    right = (r + 1) % world
    rep = os.path.join(holder(root, right), f"replica.{r}.{step}")
    if r not in lost and os.path.exists(own):
      out[r] = own
    elif right not in lost and right != r and os.path.exists(rep):
      out[r] = rep
    else:
      return None
  return out


def complete_steps(root: str, world: int, lost: Iterable[int] = ()) -> list[int]:
  """The snapshot steps from which a job of ``world`` processes that lost ``lost`` can be
  restored, ascending."""
  lost = set(lost)
  candidates: set[int] = set()
  for r in range(world):
    candidates |= _steps_in(holder(root, r), "own", r)
  return sorted(s for s in candidates if record_paths(root, world, lost, s) is not None)


class MemoryTier:
  """One process's side of the tier: ``snapshot(step, tree)`` every few steps, ``wait()``.

  ``store``: the coordination store the replicas move through (a ``KVStore``); without one
  (None) each process keeps its own records only. ``client`` (deprecated: jax's raw coordination
  client, wrapped in a ``KVStore``) warns and goes in the next release."""

  def __init__(self, root: str, rank: int, world: int, *, store: kvstore.KVStore | None = None,
               client: Any = None, namespace: str = "dtenjax/elastic/mem",
               timeout_s: float = 60.0, keep: int = KEEP):
    problems = []
    if not _whole(world) or world < 1:
      problems.append(f"world={world!r} must be an int >= 1 (the number of processes)")
    elif not _whole(rank) or not 0 <= rank < world:
      problems.append(f"rank={rank!r} must be an int in [0, world={world})")
    if (not isinstance(timeout_s, (int, float, np.integer, np.floating))
        or isinstance(timeout_s, bool) or not timeout_s > 0 or timeout_s == float("inf")):
      problems.append(f"timeout_s={timeout_s!r} must be a finite number of seconds > 0")
    if not _whole(keep) or keep < 1:
      problems.append(f"keep={keep!r} must be an int >= 1 (how many snapshots a holder keeps)")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("MemoryTier:", problems))
    self.store = store_lib.given("MemoryTier", store, client)
    self.root, self.rank, self.world = root, int(rank), int(world)
    self.namespace = namespace.rstrip("/")
    self.timeout_s = float(timeout_s)
    self.keep = keep
    os.makedirs(holder(root, rank), exist_ok=True)
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.stall_s: list[float] = []          # how long each snapshot held the caller
    self.last_complete: int | None = None   # the newest step this process finished (own + replica)

  def snapshot(self, step: int, tree: Any) -> None:
    """Copies this process's shards to host memory and returns; the rest runs in the
    background. The previous snapshot is joined first: ``stall_s`` counts that wait and the
    device-to-host copies, all the time the caller is held."""
    # An integer scalar array (a jitted loop's counter) is a step too, as the checkpoint
    # manager takes it.
    if not (_whole(step) or (np.ndim(step) == 0 and hasattr(step, "dtype")
                             and not isinstance(step, jax.core.Tracer)
                             and jnp.issubdtype(step.dtype, jnp.integer))) or step < 0:
      raise errors.ConfigurationError(
          f"MemoryTier.snapshot: step={step!r} must be an int >= 0 (the number of steps done); "
          "a snapshot under any other name could not be found again")
    step = int(step)
    t0 = time.perf_counter()
    self.wait()
    header, buffers = encode(step, self.rank, self.world, tree)
    self.stall_s.append(time.perf_counter() - t0)
    self._thread = threading.Thread(target=self._finish, args=(step, header, buffers),
                                    name="dtenjax-memory-tier", daemon=True)
    self._thread.start()

  def _key(self, dst: int, step: int) -> str:
    return f"{self.namespace}/{dst}/{step}"

  def _finish(self, step: int, header: dict, buffers: list[np.ndarray]) -> None:
    try:
      blob = pack(header, buffers)
      _write_atomic(os.path.join(holder(self.root, self.rank), f"own.{self.rank}.{step}"), blob)
      store = self.store
      if self.world > 1 and store is not None:
        right, left = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        chunks = [blob[i:i + CHUNK_BYTES] for i in range(0, len(blob), CHUNK_BYTES)] or [b""]
        key = self._key(right, step)
        for i, c in enumerate(chunks):
          store.set_bytes(f"{key}/{i}", c)
        store.set(f"{key}/n", str(len(chunks)))
        src = self._key(self.rank, step)
        try:
          n = int(store.get(f"{src}/n", timeout_s=self.timeout_s))
          got = b"".join(store.get_bytes(f"{src}/{i}", timeout_s=self.timeout_s)
                         for i in range(n))
        except errors.DtenjaxError as e:
          raise errors.ProcessLostError(
              f"process {self.rank}: the snapshot of step {step} from rank {left} did not "
              f"arrive within {self.timeout_s:g} s (waited for key {src}/n): {e}", [left]) from e
        unpack(got, f"the replica of rank {left}'s step {step}")
        _write_atomic(os.path.join(holder(self.root, self.rank), f"replica.{left}.{step}"), got)
        for i in range(n):
          store.delete(f"{src}/{i}")
        store.delete(f"{src}/n")
      self.last_complete = step
      self._prune()
    except BaseException as e:
      self._error = e

  def _prune(self) -> None:
    """Keeps this holder's ``keep`` newest steps (own and replica records alike)."""
    folder = holder(self.root, self.rank)
    files = [(int(n.split(".")[2]), n) for n in os.listdir(folder)
             if len(n.split(".")) == 3 and n.split(".")[2].isdigit()]
    newest = sorted({s for s, _ in files})[-self.keep:]
    for s, n in files:
      if s not in newest:
        os.remove(os.path.join(folder, n))

  def wait(self) -> None:
    """Joins the snapshot in flight; raises what failed in it."""
    t, self._thread = self._thread, None
    if t is not None:
      t.join(self.timeout_s * 2)
      if t.is_alive():
        raise errors.CollectiveTimeoutError(
            f"process {self.rank}: the in-memory snapshot did not finish within "
            f"{self.timeout_s * 2:g} s (writing to {self.root} and the ring replica)")
    err, self._error = self._error, None
    if err is not None:
      raise err


def load(root: str, world: int, lost: Iterable[int], step: int) -> tuple[dict, dict]:
  """Every leaf of the snapshot of ``step``: ``({name: (shape, dtype, [(lo, hi, data)])},
  {name: python value})`` from the records :func:`record_paths` finds."""
  paths = record_paths(root, world, lost, step)
  if paths is None:
    raise errors.CheckpointError(
        f"the in-memory tier in {root} has no complete snapshot of step {step} for {world} "
        f"processes without {sorted(set(lost))} (complete: "
        f"{complete_steps(root, world, lost)})")
  arrays: dict[str, tuple] = {}
  values: dict[str, Any] = {}
  for r, path in sorted(paths.items()):
    with open(path, "rb") as f:
      header, buffers = unpack(f.read(), path)
    if header["step"] != step or header["rank"] != r or header["world"] != world:
      raise errors.CheckpointError(
          f"{path} holds step {header['step']} of rank {header['rank']}/{header['world']}, "
          f"not step {step} of rank {r}/{world}")
    it = iter(buffers)
    for leaf in header["leaves"]:
      parts = [(lo, hi, next(it)) for lo, hi in leaf["boxes"]]
      if leaf["kind"] == "value":
        if r == 0:
          v = parts[0][2].copy()
          py = leaf.get("python")
          values[leaf["name"]] = {"int": int, "float": float, "bool": bool}[py](v) if py else v
        continue
      entry = arrays.setdefault(leaf["name"], (tuple(leaf["shape"]), _dtype(leaf["dtype"]), []))
      entry[2].extend(parts)
  return arrays, values


def _on_devices(sharding):
  """``sharding`` on devices: one over an AbstractMesh (``jax.eval_shape`` of an array on
  Explicit axes) is laid on the context mesh (``jax.set_mesh``) of its axes; None without one."""
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(mesh, jax.sharding.AbstractMesh):
    return sharding
  ctx = jaxapi.concrete_mesh()
  if (ctx is None or tuple(ctx.axis_names) != tuple(mesh.axis_names)
      or ctx.devices.shape != tuple(mesh.axis_sizes)):
    return None
  devices = jax.sharding.Mesh(ctx.devices, ctx.axis_names, axis_types=mesh.axis_types)
  return jax.sharding.NamedSharding(devices, sharding.spec, memory_kind=sharding.memory_kind)


def restore(root: str, world: int, lost: Iterable[int], step: int, target: Any) -> Any:
  """The snapshot of ``step`` laid out like ``target`` (a tree of jax Arrays or
  ``jax.ShapeDtypeStruct``s with shardings, and scalars): each device gets its box, cut from the
  assembled global arrays. A numpy leaf of the target restores as numpy; a struct without a
  sharding (``jax.eval_shape``'s) as ``jnp.asarray`` places it, in a single process; one over
  an AbstractMesh (``jax.eval_shape`` of arrays on Explicit axes) on the ``jax.set_mesh`` mesh."""
  arrays, values = load(root, world, lost, step)
  pairs, treedef = jax.tree_util.tree_flatten_with_path(target)
  out, problems = [], []
  for path, t in pairs:
    name = _name(path)
    if name in values:
      out.append(values[name])
      continue
    if name not in arrays:
      problems.append(f"target leaf {name} is not in the snapshot")
      out.append(None)
      continue
    shape, dtype, parts = arrays[name]
    if tuple(t.shape) != shape or np.dtype(t.dtype) != dtype:
      problems.append(f"leaf {name}: the target is {np.dtype(t.dtype).name}{list(t.shape)}, "
                      f"the snapshot holds {dtype.name}{list(shape)}")
      out.append(None)
      continue
    full = np.empty(shape, dtype)
    covered = np.zeros(shape, bool)
    for lo, hi, data in parts:
      box = tuple(slice(a, b) for a, b in zip(lo, hi))
      full[box] = data
      covered[box] = True
    if not covered.all():
      problems.append(f"leaf {name}: the records cover {int(covered.sum())} of "
                      f"{covered.size} elements")
      out.append(None)
      continue
    if isinstance(t, np.ndarray):                 # a numpy state restores as numpy
      out.append(full)
      continue
    sharding = getattr(t, "sharding", None)
    if sharding is None:
      # jax.eval_shape's structs carry no sharding: one process places the leaf as jnp.asarray
      # does; several processes cannot agree on a layout no one gave.
      if jax.process_count() > 1:
        problems.append(f"leaf {name}: the target has no sharding to lay it out on "
                        f"{jax.process_count()} processes; pass the initial state's arrays or "
                        "jax.ShapeDtypeStruct(shape, dtype, sharding=...)")
        out.append(None)
      else:
        out.append(jnp.asarray(full))
      continue
    sharding = _on_devices(sharding)
    if sharding is None:
      problems.append(f"leaf {name}: the target's sharding is over an abstract mesh "
                      f"({dict(t.sharding.mesh.shape)}: jax.eval_shape of an array on Explicit "
                      "axes), which names no devices; restore inside jax.set_mesh(mesh) with a "
                      "mesh of those axes, or pass the initial state's arrays")
      out.append(None)
      continue
    out.append(jax.make_array_from_callback(shape, sharding, lambda i, a=full: a[i]))
  if problems:
    raise errors.CheckpointError(errors.join_problems(
        f"the in-memory snapshot of step {step} cannot be restored onto the target:", problems))
  return jax.tree_util.tree_unflatten(treedef, out)
