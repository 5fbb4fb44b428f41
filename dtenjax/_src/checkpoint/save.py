"""Saving: each process writes the shards it owns, in threads, into a temporary directory that
one rename makes the checkpoint.

A shard is owned by the device holding its ``replica_id == 0`` copy, so a replicated array is
written once, by the process of that device; leaves that are not jax Arrays (numpy arrays,
Python scalars such as a step counter) are written by process 0. The sequence of one save:

1. (the caller's thread) check the tree, copy every owned shard to host memory (the
   asynchronous device-to-host copies are started for all shards first), so that the caller may
   go on, donate or delete its arrays;
2. (a background thread) process 0 takes the save lock of the target (one save of a path at a
   time), creates this save's own temporary directory ``.NAME.dtenjax-tmp-<random>`` next to it
   and tells the others its name, all meet; every process writes its chunk files and the
   metadata from a thread pool (digests per block, each file fsynced), then its manifest; the
   directories are fsynced; all meet;
3. process 0 renames the temporary directory to the target (an old checkpoint there is renamed
   away first and deleted after), fsyncs the parent and releases the lock; all meet.

All file-system work goes through a :class:`storage.Storage` (``LocalStorage`` by default),
which turns every ``OSError`` into a ``CheckpointError`` naming the file; a failed save removes
its temporary directory. A process killed anywhere before 3 leaves the temporary directory and
no target: earlier checkpoints are untouched, and the next save to that target removes the
leftover (and puts back an old checkpoint a kill between the two renames left aside).
``Checkpointer.save`` returns after 1; its ``wait()``, the next ``save`` and ``restore`` join the
background part. Every process must save the same trees to the same paths in the same order
(the meetings are barriers of the coordination store, with a timeout).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import numbers
import os
import threading
import time
from typing import Any

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src.checkpoint import integrity, io as ckio, layout, storage as storage_mod

DEFAULT_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class SaveReport:
  """What one process did for one save."""
  path: str
  leaves: int
  files: int               # chunk files this process wrote
  bytes: int               # bytes of chunk data this process wrote
  seconds: float           # from save() to the commit
  blocking_seconds: float  # how long save() held the caller
  io: str                  # the I/O path: posix, kvikio-compat or kvikio-gds
  digest: str
  process: int
  processes: int

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

  def __str__(self) -> str:
    return (f"saved {self.path}: {self.leaves} leaves, process {self.process}/{self.processes} "
            f"wrote {self.files} files, {ckio.size(self.bytes)} in {self.seconds:.3f} s "
            f"({ckio.rate(self.bytes, self.seconds)}; the caller waited "
            f"{self.blocking_seconds:.3f} s), "
            f"io {self.io}, digest {self.digest}")


@dataclasses.dataclass
class _Plan:
  path: str
  leaves: list[layout.Leaf]
  writes: list[tuple[str, str, np.ndarray]]       # (leaf name, chunk file, host data)
  shardings: dict[str, dict]                      # leaf name -> orbax sharding metadata
  t0: float


def _check_leaf(keys, leaf) -> str | None:
  name = ".".join(k for k, _ in keys)
  if layout.is_empty(leaf) or isinstance(leaf, (bool, int, float, np.ndarray, np.generic)):
    return None
  if isinstance(leaf, jax.core.Tracer):
    return (f"leaf {name!r} is a traced value ({leaf.aval.str_short()}): save was called inside "
            "jax.jit, jax.grad, jax.vmap or another transformation, where arrays have no bytes "
            "yet; call it outside, on the arrays the jitted step returns")
  if isinstance(leaf, jax.Array):
    if leaf.is_deleted():
      return (f"leaf {name!r} was deleted ({leaf.aval.str_short()}): it was donated to a jitted "
              "step (donate_argnums) or .delete()d; save the arrays the step returned")
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return (f"leaf {name!r} is an array of typed PRNG keys ({leaf.dtype}); save "
              "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data")
    return None
  return (f"leaf {name!r} is a {type(leaf).__name__}; a checkpoint holds jax Arrays, numpy "
          "arrays, Python scalars and None (register other classes as pytree nodes)")


def _host_copy(shard_data: Any, copy: bool) -> np.ndarray:
  a = np.asarray(shard_data)
  return np.array(a, copy=True) if copy else a


def plan(path: str, tree: Any, *, asynchronous: bool) -> _Plan:
  """Step 1: checks and host copies (in the caller's thread)."""
  t0 = time.perf_counter()
  pairs, _ = layout.flatten(tree)
  layout.check_names([k for k, _ in pairs])
  problems = [p for p in (_check_leaf(k, v) for k, v in pairs) if p]
  if problems:
    raise errors.ConfigurationError(errors.join_problems("this tree cannot be checkpointed:",
                                                         problems))
  pid = jax.process_index()
  leaves, shardings, owned = [], {}, []
  for keys, value in pairs:
    name = ".".join(k for k, _ in keys)
    if layout.is_empty(value):
      leaves.append(layout.Leaf(keys, "None"))
      continue
    if isinstance(value, jax.Array):
      shape = tuple(value.shape)
      chunks = _chunk_shape(value.sharding.shard_shape(shape))
      leaves.append(layout.Leaf(keys, "jax.Array", shape, layout.dtype_to_zarr(value.dtype),
                                chunks))
      meta = layout.sharding_metadata(value.sharding)
      if meta is not None:
        shardings[name] = meta
      mine = [s for s in value.addressable_shards if s.replica_id == 0 and math.prod(shape)]
      for s in mine:
        s.data.copy_to_host_async()
      owned.append((leaves[-1], mine))
      continue
    arr = np.asarray(value)
    kind = "np.ndarray" if isinstance(value, np.ndarray) else "scalar"
    leaves.append(layout.Leaf(keys, kind, arr.shape, layout.dtype_to_zarr(arr.dtype),
                              _chunk_shape(arr.shape)))
    owned.append((leaves[-1], [arr] if pid == 0 and arr.size else []))
  writes = []
  for leaf, items in owned:
    for item in items:
      if isinstance(item, np.ndarray):
        index, data = (0,) * item.ndim, (np.array(item, copy=True) if asynchronous else item)
      else:
        index = tuple((sl.start or 0) // c if c else 0 for sl, c in zip(item.index, leaf.chunks))
        data = _host_copy(item.data, copy=asynchronous and item.device.platform == "cpu")
      writes.append((leaf.name, layout.chunk_file(index), data))
  return _Plan(path, leaves, writes, shardings, t0)


def _chunk_shape(shard_shape) -> tuple[int, ...]:
  """The zarr chunk shape of shards of ``shard_shape``: zarr (and tensorstore, which orbax reads
  with) wants every chunk dimension >= 1, so a zero-size dimension gets chunks of 1 -- a grid of
  no chunks, no file to write."""
  return tuple(max(1, int(n)) for n in shard_shape)


def _as_bytes(data: np.ndarray, chunks: tuple[int, ...]) -> memoryview:
  """The chunk's bytes in C order; an edge shard (smaller than the chunk) is padded with zeros,
  as zarr stores edge chunks at full size."""
  if tuple(data.shape) != tuple(chunks):
    full = np.zeros(chunks, data.dtype)
    full[tuple(slice(0, n) for n in data.shape)] = data
    data = full
  flat = np.ascontiguousarray(data).reshape(-1)
  return memoryview(flat.view(np.uint8))


def _json_bytes(obj: Any) -> memoryview:
  return memoryview(json.dumps(obj, indent=1).encode())


def _together(what: str, timeout_s: float, wait):
  """``wait()``, a wait on the other processes of the save, its failure said in the save's terms
  (which save, which stage) rather than the coordination store's (a key)."""
  try:
    return wait()
  except errors.TransportError as e:
    raise errors.CheckpointError(
        f"{what}: the processes did not all arrive within {timeout_s:g} s ({e}). Every process "
        "must call save with the same tree and path in the same order; a process may have "
        "failed (see its log).") from e


class _Sequence:
  lock = threading.Lock()
  n = 0

  @classmethod
  def next(cls) -> int:
    with cls.lock:
      cls.n += 1
      return cls.n


def write(p: _Plan, *, overwrite: bool, backend: ckio.PosixIO, threads: int,
          block_bytes: int, digest: str, timeout_s: float, seq: int,
          blocking_seconds: float | None,
          store_to: storage_mod.Storage | None = None) -> SaveReport:
  """Steps 2 and 3 (in the background thread of an asynchronous save)."""
  from dtenjax._src.net import kvstore
  st = store_to if store_to is not None else storage_mod.LocalStorage(backend)
  pid, nproc = jax.process_index(), jax.process_count()
  store = kvstore.default() if nproc > 1 else None
  tag = f"checkpoint-{seq}-{hashlib.sha256(p.path.encode()).hexdigest()[:12]}"

  def meet(stage: str) -> None:
    if store is not None:
      _together(f"saving {p.path} ({stage})", timeout_s,
                lambda: store.barrier(f"{tag}-{stage}", timeout_s=timeout_s))

  by_name = {leaf.name: leaf for leaf in p.leaves}
  stored = [leaf for leaf in p.leaves if leaf.value_type != "None"]
  needed = sum(by_name[name].chunk_nbytes for name, _, _ in p.writes)
  with contextlib.ExitStack() as held:
    tmp = None
    try:
      if pid == 0:
        held.enter_context(st.lock(p.path, timeout_s))
        try:
          tmp = st.begin(p.path, needed_bytes=needed)
          if st.committed(p.path) and not overwrite:
            raise errors.CheckpointError(
                f"{p.path} exists (another save of it committed first, or an interrupted "
                "overwrite left it); nothing was replaced: pass overwrite=True or save to "
                "another path")
          for rel in [layout.DTENJAX_DIR, "array_metadatas"] + [leaf.name for leaf in stored]:
            st.makedirs(tmp, rel)
        except BaseException as e:
          if store is not None:
            store.set(store.key(tag, "tmp"), f"error: {e}")
          raise
        if store is not None:
          store.set(store.key(tag, "tmp"), tmp)
      else:
        tmp = _together(f"saving {p.path} (process 0 beginning it)", timeout_s,
                        lambda: store.get(store.key(tag, "tmp"), timeout_s=timeout_s))
        if tmp.startswith("error: "):
          raise errors.CheckpointError(f"saving {p.path}: process 0 failed to begin: {tmp[7:]}")
      meet("open")

      def one(item):
        name, fname, data = item
        view = _as_bytes(data, by_name[name].chunks)
        digests = integrity.block_digests(view, block_bytes, digest)
        st.write(tmp, f"{name}/{fname}", view, needed_bytes=needed)
        return name, fname, len(view), digests

      # the metadata that depends only on the plan is written by the same pool as the chunks,
      # so that its many small files' fsyncs overlap the chunks' writes
      files = [(f"array_metadatas/process_{pid}", _json_bytes({"array_metadatas": [
          {"array_metadata": {"param_name": leaf.name, "write_shape": list(leaf.chunks),
                              "chunk_shape": list(leaf.chunks), "ext_metadata": None}}
          for leaf in p.leaves if leaf.value_type == "jax.Array"]}))]
      if pid == 0:
        now = time.time_ns()
        files += [(f"{leaf.name}/.zarray", _json_bytes(layout.zarray(leaf))) for leaf in stored]
        files += [
            ("_METADATA", _json_bytes(layout.orbax_tree_metadata(p.leaves))),
            ("_sharding", memoryview(layout.sharding_file(p.shardings).encode())),
            ("_CHECKPOINT_METADATA", _json_bytes({
                "item_handlers": "orbax.checkpoint._src.handlers.pytree_checkpoint_handler."
                                 "PyTreeCheckpointHandler",
                "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {layout.MARKER: layout.FORMAT}})),
            (f"{layout.DTENJAX_DIR}/{layout.MANIFEST}", _json_bytes({
                "format": layout.FORMAT, "processes": nproc, "io": backend.name,
                "digest": digest, "block_bytes": block_bytes,
                "leaves": [leaf.to_json() for leaf in p.leaves]}))]
      manifest: dict[str, dict[str, dict]] = {}
      nbytes = 0
      with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        small = [pool.submit(st.write, tmp, rel, data) for rel, data in files]
        for name, fname, n, digests in pool.map(one, p.writes):
          manifest.setdefault(name, {})[fname] = {"size": n, "digests": digests}
          nbytes += n
        st.write(tmp, f"{layout.DTENJAX_DIR}/process_{pid}.json",
                 _json_bytes({"format": layout.FORMAT, "process": pid, "chunks": manifest}))
        for f in small:
          f.result()
        dirs = [leaf.name for leaf in stored] if pid == 0 else list(manifest)
        if nproc == 1:      # nobody else writes: the top directories too, in the same batch
          dirs += [layout.DTENJAX_DIR, "array_metadatas", ""]
        list(pool.map(lambda d: st.sync_dirs(tmp, [d]), dirs))
      meet("written")
      if pid == 0:
        if nproc > 1:
          with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(lambda d: st.sync_dirs(tmp, [d]),
                          [layout.DTENJAX_DIR, "array_metadatas", ""]))
        st.commit(tmp, p.path, overwrite=overwrite)
        tmp = None
    except BaseException as e:
      if tmp is not None:
        st.abort(tmp)
        code = getattr(e, "errno", None) if isinstance(e, errors.CheckpointError) else None
        if code is not None:
          free = storage_mod.free_bytes(p.path)
          err = errors.CheckpointError(
              f"{e} (the save's temporary directory {tmp} was removed, nothing was committed; "
              f"{'?' if free is None else free} bytes are free there now)")
          err.errno = code  # type: ignore[attr-defined]
          raise err from None
      raise
  meet("committed")
  total = time.perf_counter() - p.t0
  return SaveReport(p.path, len(p.leaves), len(p.writes), nbytes, total,
                    total if blocking_seconds is None else blocking_seconds, backend.name,
                    digest, pid, nproc)


class PendingSave:
  """A save whose files are still being written; ``wait()`` returns its :class:`SaveReport`."""

  def __init__(self, path: str, fn):
    self.path = path
    self._done = threading.Event()
    self._result: SaveReport | None = None
    self._error: BaseException | None = None

    def run():
      try:
        self._result = fn()
      except BaseException as e:
        self._error = e
      finally:
        self._done.set()
    self._thread = threading.Thread(target=run, name="dtenjax-checkpoint-save", daemon=True)
    self._thread.start()

  def done(self) -> bool:
    return self._done.is_set()

  def wait(self, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> SaveReport:
    if not self._done.wait(timeout_s):
      raise errors.CheckpointError(
          f"the save of {self.path} did not finish within {timeout_s:g} s; wait longer "
          "(wait(timeout_s=...)) or look for a process that stopped")
    if self._error is not None:
      raise self._error
    assert self._result is not None
    return self._result


class Checkpointer:
  """Saves (asynchronously) and restores; one save in flight at a time.

  ``save`` returns once the shards are in host memory; the files are written in the background.
  ``wait()``, the next ``save``, ``restore`` and leaving a ``with`` block join it.
  """

  def __init__(self, *, io: str | None = None, threads: int | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, block_bytes: int = integrity.BLOCK_BYTES,
               digest: str | None = None, storage: storage_mod.Storage | None = None):
    threads = ckio.check_threads(threads)
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real)
        or not math.isfinite(timeout_s) or timeout_s <= 0):       # numbers.Real: numpy's too
      raise errors.ConfigurationError(
          f"timeout_s={timeout_s!r} must be a finite number of seconds > 0 (how long a process "
          f"waits for the others at each stage of a save; default {DEFAULT_TIMEOUT_S:g})")
    self.backend = ckio.backend(io)
    self.storage = storage if storage is not None else storage_mod.LocalStorage(self.backend)
    self.threads = threads or min(16, (os.cpu_count() or 1) * 2)
    if not isinstance(block_bytes, int) or block_bytes < 4096 or block_bytes % 16:
      raise errors.ConfigurationError(
          f"block_bytes={block_bytes!r} must be an int >= 4096 and a multiple of 16")
    self.block_bytes = block_bytes
    self.digest = digest or integrity.default_algorithm()
    integrity.hasher(self.digest)
    self.timeout_s = float(timeout_s)
    self._pending: PendingSave | None = None

  def save(self, path: str | os.PathLike, tree: Any, *, overwrite: bool = False) -> PendingSave:
    self.wait()
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    if self.storage.committed(path) and not overwrite:
      raise errors.ConfigurationError(
          f"checkpoint path {path} exists; pass overwrite=True to replace it or save to a new "
          "path (one directory per step, e.g. ckpt/step_000100)")
    p = plan(path, tree, asynchronous=True)
    seq = _Sequence.next()
    blocking = time.perf_counter() - t0
    self._pending = PendingSave(path, lambda: write(
        p, overwrite=overwrite, backend=self.backend, threads=self.threads,
        block_bytes=self.block_bytes, digest=self.digest, timeout_s=self.timeout_s, seq=seq,
        blocking_seconds=blocking, store_to=self.storage))
    return self._pending

  def wait(self, timeout_s: float | None = None) -> SaveReport | None:
    """Joins the save in flight (None when there is none). A wait that runs out keeps the save
    in flight, so the next ``wait`` (or ``save``) joins it again."""
    pending = self._pending
    if pending is None:
      return None
    try:
      return pending.wait(self.timeout_s if timeout_s is None else timeout_s)
    finally:
      if pending.done():     # finished, or failed (raised once): nothing left in flight
        self._pending = None

  def restore(self, path, target=None, **kwargs):
    from dtenjax._src.checkpoint import restore as ckrestore
    self.wait()
    kwargs.setdefault("threads", self.threads)
    kwargs.setdefault("io", self.backend.name.split("-")[0])
    kwargs.setdefault("storage", self.storage)
    return ckrestore.restore(path, target, **kwargs)

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.wait()


def save(path: str | os.PathLike, tree: Any, *, overwrite: bool = False, io: str | None = None,
         threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
         block_bytes: int = integrity.BLOCK_BYTES,
         storage: storage_mod.Storage | None = None) -> SaveReport:
  """Saves ``tree`` to the directory ``path`` and returns when it is committed (on every
  process). ``Checkpointer().save`` is the asynchronous form. ``storage``: where checkpoints
  live (default: the file system, :class:`LocalStorage`)."""
  path = os.path.abspath(os.fspath(path))
  c = Checkpointer(io=io, threads=threads, timeout_s=timeout_s, block_bytes=block_bytes,
                   storage=storage)
  if c.storage.committed(path) and not overwrite:
    raise errors.ConfigurationError(
        f"checkpoint path {path} exists; pass overwrite=True to replace it or save to a new "
        "path (one directory per step, e.g. ckpt/step_000100)")
  p = plan(path, tree, asynchronous=False)
  return write(p, overwrite=overwrite, backend=c.backend, threads=c.threads,
               block_bytes=c.block_bytes, digest=c.digest, timeout_s=c.timeout_s,
               seq=_Sequence.next(), blocking_seconds=None, store_to=c.storage)
