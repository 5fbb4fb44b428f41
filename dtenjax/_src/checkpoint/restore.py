"""Restoring onto any sharding: each process reads, for each of its devices, the boxes of the
saved chunks that the device's shard covers, and only the digest blocks holding them.

For a shard (a box ``[lo, hi)`` of the global array) and each saved chunk it intersects, the
bytes needed are a span of the chunk file from the box's first element to its last (C order);
the restore reads the digest blocks covering that span, checks each block's digest and copies
the box out. Devices holding the same box (replicas) share one read. A checkpoint orbax wrote
(no ``_dtenjax`` directory) is read through tensorstore (the ``checkpoint`` extra), which reads
only the chunks a box needs; orbax keeps no digests, so none are checked.
"""

from __future__ import annotations

import base64
import concurrent.futures
import dataclasses
import json
import os
import threading
import time
from typing import Any

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src.checkpoint import integrity, io as ckio, layout


@dataclasses.dataclass(frozen=True)
class RestoreReport:
  path: str
  leaves: int
  bytes: int              # bytes this process read from chunk files
  seconds: float
  io: str                 # posix, kvikio-compat, kvikio-gds; tensorstore for orbax's own files
  digest: str | None      # the algorithm checked (None: not checked)
  source: str             # "dtenjax" or "orbax" (who wrote the checkpoint)

  @property
  def gbps(self) -> float:
    return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

  def __str__(self) -> str:
    return (f"restored {self.path} ({self.source}): {self.leaves} leaves, read "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds:.3f} s ({self.gbps:.2f} GB/s), io "
            f"{self.io}, digests {self.digest or 'not checked'}")


def _read_json(path: str, what: str) -> Any:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise errors.CheckpointError(f"{what} {path} is missing; the checkpoint is incomplete "
                                 "(restore an earlier one)") from None
  except (OSError, ValueError) as e:
    raise errors.CheckpointError(f"{what} {path} cannot be read: {e}") from None


def _c_strides(shape) -> tuple[int, ...]:
  out, acc = [], 1
  for n in reversed(shape):
    out.append(acc)
    acc *= n
  return tuple(reversed(out))


class _Files:
  """Chunk files written by dtenjax: sizes and block digests from the process manifests."""

  def __init__(self, path: str, manifest: dict, backend: ckio.PosixIO, verify: bool):
    self.path, self.backend = path, backend
    self.block = int(manifest["block_bytes"])
    self.digest = manifest["digest"] if verify else None
    self.hash = integrity.hasher(self.digest) if verify else None
    self.table: dict[str, dict[str, dict]] = {}
    for pid in range(int(manifest["processes"])):
      mf = os.path.join(path, layout.DTENJAX_DIR, f"process_{pid}.json")
      for name, chunks in _read_json(mf, f"the manifest of process {pid}")["chunks"].items():
        self.table.setdefault(name, {}).update(chunks)
    self.lock = threading.Lock()
    self.nbytes = 0

  def region(self, leaf: layout.Leaf, index: tuple[int, ...], llo, lhi) -> np.ndarray:
    fname = layout.chunk_file(index)
    file = os.path.join(self.path, leaf.name, fname)
    entry = self.table.get(leaf.name, {}).get(fname)
    if entry is None:
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: chunk {fname} ({file}) is in no process's manifest; the "
          "checkpoint is incomplete")
    try:
      size = self.backend.size(file)
    except FileNotFoundError:
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: chunk file {file} is missing (the checkpoint lost a file; "
          "restore an earlier checkpoint)") from None
    if size != entry["size"] or size != leaf.chunk_nbytes:
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: chunk file {file} has {size} bytes, the checkpoint wrote "
          f"{entry['size']} ({'truncated' if size < entry['size'] else 'grown'}); restore an "
          "earlier checkpoint")
    it = leaf.np_dtype.itemsize
    strides = _c_strides(leaf.chunks)
    first = sum(a * s for a, s in zip(llo, strides))
    last = sum((b - 1) * s for b, s in zip(lhi, strides)) + 1
    if self.hash is not None:
      b0, b1 = first * it // self.block, -(-last * it // self.block)
      start, end = b0 * self.block, min(b1 * self.block, size)
    else:
      start, end = first * it, last * it
    buf = np.empty(end - start, np.uint8)
    n = self.backend.read_range(file, start, memoryview(buf))
    if n != len(buf):
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: reading bytes {start}-{end} of {file} returned {n} bytes "
          "(the file was truncated while being read?)")
    if self.hash is not None:
      for k in range(b0, b1):
        lo_b = (k - b0) * self.block
        got = self.hash(memoryview(buf[lo_b:lo_b + self.block]))
        if got != entry["digests"][k]:
          raise errors.CheckpointError(
              f"leaf {leaf.name!r}: chunk file {file} is corrupted: bytes "
              f"{k * self.block}-{min((k + 1) * self.block, size)} have {self.digest} digest "
              f"{got}, the checkpoint wrote {entry['digests'][k]}; restore an earlier "
              "checkpoint (or verify=False to read it anyway)")
    with self.lock:
      self.nbytes += len(buf)
    return np.ndarray(tuple(b - a for a, b in zip(llo, lhi)), leaf.np_dtype, buffer=buf,
                      offset=first * it - start, strides=tuple(s * it for s in strides))

  def read(self, leaf: layout.Leaf, lo, hi) -> np.ndarray:
    shape = tuple(b - a for a, b in zip(lo, hi))
    if not leaf.shape:
      return np.array(self.region(leaf, (), (), ()))
    if 0 in shape:
      return np.empty(shape, leaf.np_dtype)
    ranges = [range(a // c, -(-b // c)) for a, b, c in zip(lo, hi, leaf.chunks)]
    if all(len(r) == 1 for r in ranges):     # inside one chunk: the read buffer is the result
      g = tuple(r[0] for r in ranges)
      part = self.region(leaf, g, [a - gi * c for a, gi, c in zip(lo, g, leaf.chunks)],
                         [b - gi * c for b, gi, c in zip(hi, g, leaf.chunks)])
      return part if part.flags.c_contiguous else np.ascontiguousarray(part)
    out = np.empty(shape, leaf.np_dtype)
    for index in np.ndindex(*[len(r) for r in ranges]):
      g = tuple(r[i] for r, i in zip(ranges, index))
      c_lo = [max(a, gi * c) for a, gi, c in zip(lo, g, leaf.chunks)]
      c_hi = [min(b, (gi + 1) * c) for b, gi, c in zip(hi, g, leaf.chunks)]
      block = self.region(leaf, g, [a - gi * c for a, gi, c in zip(c_lo, g, leaf.chunks)],
                          [b - gi * c for b, gi, c in zip(c_hi, g, leaf.chunks)])
      out[tuple(slice(a - l, b - l) for a, b, l in zip(c_lo, c_hi, lo))] = block
    return out


class _Tensorstore:
  """Leaves of a checkpoint orbax wrote, opened with tensorstore (OCDBT or plain zarr)."""

  def __init__(self, path: str, meta: dict):
    try:
      import tensorstore as ts  # pylint: disable=g-import-not-at-top
    except ImportError:
      raise errors.ConfigurationError(
          f"{path} was written by orbax-checkpoint (it has no {layout.DTENJAX_DIR}/); reading "
          "it needs tensorstore: pip install 'dtenjax[checkpoint]'") from None
    self.ts, self.path = ts, path
    self.driver = "zarr3" if meta.get("use_zarr3") else "zarr"
    self.ocdbt = bool(meta.get("use_ocdbt"))
    self.stores: dict[str, Any] = {}
    self.lock = threading.Lock()
    self.nbytes = 0
    self.digest = None

  def open(self, name: str):
    if name not in self.stores:
      kv = ({"driver": "ocdbt", "base": f"file://{self.path}", "path": name} if self.ocdbt
            else {"driver": "file", "path": os.path.join(self.path, name)})
      try:
        self.stores[name] = self.ts.open({"driver": self.driver, "kvstore": kv},
                                         open=True).result()
      except Exception as e:
        raise errors.CheckpointError(f"leaf {name!r} of {self.path} cannot be opened: {e}") \
            from None
    return self.stores[name]

  def read(self, leaf: layout.Leaf, lo, hi) -> np.ndarray:
    store = self.open(leaf.name)
    try:
      out = np.asarray(store[tuple(slice(a, b) for a, b in zip(lo, hi))].read().result())
    except Exception as e:
      raise errors.CheckpointError(f"leaf {leaf.name!r} of {self.path} cannot be read: {e}") \
          from None
    with self.lock:
      self.nbytes += out.nbytes
    return out


def _open(path: str, backend: ckio.PosixIO, verify: bool):
  """(source, leaves, saved shardings by name, io name, source kind)."""
  if not os.path.isdir(path):
    tmp = layout.tmp_path(path)
    if os.path.isdir(tmp):
      raise errors.CheckpointError(
          f"no checkpoint at {path}: its save did not commit (an interrupted save left {tmp}); "
          "restore an earlier checkpoint")
    raise errors.CheckpointError(f"no checkpoint at {path} (no such directory)")
  shardings = {}
  sfile = os.path.join(path, "_sharding")
  if os.path.exists(sfile):
    raw = _read_json(sfile, "the sharding file")
    shardings = {base64.b64decode(k).decode(): json.loads(v) for k, v in raw.items()}
  mfile = os.path.join(path, layout.DTENJAX_DIR, layout.MANIFEST)
  if os.path.exists(mfile):
    manifest = _read_json(mfile, "the checkpoint manifest")
    if manifest.get("format") != layout.FORMAT:
      raise errors.CheckpointError(
          f"{mfile} has format {manifest.get('format')!r}; this dtenjax reads "
          f"{layout.FORMAT!r} (a newer dtenjax wrote it?)")
    leaves = [layout.Leaf.from_json(d) for d in manifest["leaves"]]
    return _Files(path, manifest, backend, verify), leaves, shardings, backend.name, "dtenjax"
  ofile = os.path.join(path, "_METADATA")
  if not os.path.exists(ofile):
    raise errors.CheckpointError(
        f"{path} is not a checkpoint: it has neither {layout.DTENJAX_DIR}/{layout.MANIFEST} nor "
        "orbax's _METADATA (an incomplete copy?)")
  meta = _read_json(ofile, "orbax's tree metadata")
  src = _Tensorstore(path, meta)
  leaves = []
  for entry in meta["tree_metadata"].values():
    keys = tuple((str(k["key"]), int(k["key_type"])) for k in entry["key_metadata"])
    vtype = entry["value_metadata"]["value_type"]
    if vtype == "None":
      leaves.append(layout.Leaf(keys, "None"))
      continue
    store = src.open(".".join(k for k, _ in keys))
    shape = tuple(int(n) for n in store.shape)
    leaves.append(layout.Leaf(keys, vtype, shape, layout.dtype_to_zarr(store.dtype.numpy_dtype),
                              tuple(store.chunk_layout.read_chunk.shape or shape)))
  return src, leaves, shardings, "tensorstore", "orbax"


def _is_sharding_leaf(x) -> bool:
  from dtenjax._src.planning import placement  # pylint: disable=g-import-not-at-top
  return x is None or isinstance(x, (jax.sharding.Sharding, placement.Placement))


def _resolve(s, leaf: layout.Leaf):
  from dtenjax._src.planning import placement  # pylint: disable=g-import-not-at-top
  if isinstance(s, placement.Placement):
    return s.sharding(leaf.shape, leaf.np_dtype)
  return s


def restore(path: str | os.PathLike, target: Any = None, *, shardings: Any = None,
            verify: bool = True, io: str | None = None, threads: int | None = None,
            report: bool = False) -> Any:
  """The tree saved at ``path``, laid out as asked.

  ``target``: a tree like the saved one (jax Arrays, ``jax.ShapeDtypeStruct``s with shardings,
  numpy arrays, scalars; flax and optax states as they are): the result has its structure, and
  its arrays' shardings unless ``shardings`` says otherwise. ``shardings``: one
  ``jax.sharding.Sharding`` or ``dtenjax.Placement`` for every array, or a tree of them shaped
  like the target. Without either, arrays come back with their saved shardings (when those
  devices exist) in nested dicts and lists, as orbax restores without a target.
  ``report=True`` returns ``(tree, RestoreReport)``.
  """
  t0 = time.perf_counter()
  path = os.path.abspath(os.fspath(path))
  backend = ckio.backend(io)
  src, leaves, saved_shardings, io_name, kind = _open(path, backend, verify)
  by_name = {leaf.name: leaf for leaf in leaves}
  problems: list[str] = []
  if target is not None:
    pairs, treedef = layout.flatten(target)
    names = [".".join(k for k, _ in keys) for keys, _ in pairs]
    wanted = dict(zip(names, (v for _, v in pairs)))
    problems += [f"target leaf {n!r} is not in the checkpoint" for n in names if n not in by_name]
    problems += [f"checkpoint leaf {n!r} has no place in the target" for n in by_name
                 if n not in wanted]
    order = [by_name[n] for n in names if n in by_name]
  else:
    wanted, treedef, order = {}, None, leaves
  single = shardings if shardings is not None and _is_sharding_leaf(shardings) else None
  by_sharding: dict[str, Any] = {}
  if shardings is not None and single is None:
    spairs, _ = jax.tree_util.tree_flatten_with_path(shardings, is_leaf=_is_sharding_leaf)
    by_sharding = {".".join(layout._key_of(e)[0] for e in p): s  # pylint: disable=protected-access
                   for p, s in spairs}
  plans = []   # (leaf, how, sharding)
  for leaf in order:
    t = wanted.get(leaf.name)
    if leaf.value_type == "None":
      plans.append((leaf, "none", None))
      continue
    if t is not None and hasattr(t, "shape") and hasattr(t, "dtype"):
      if tuple(t.shape) != leaf.shape or np.dtype(t.dtype) != leaf.np_dtype:
        problems.append(f"leaf {leaf.name!r}: the target is {np.dtype(t.dtype).name}"
                        f"{list(t.shape)}, the checkpoint holds {leaf.np_dtype.name}"
                        f"{list(leaf.shape)}")
        continue
    if target is not None:
      how = ("jax" if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) else
             "np" if isinstance(t, np.ndarray) else "npscalar" if isinstance(t, np.generic)
             else "py")
    else:
      how = {"jax.Array": "jax", "np.ndarray": "np"}.get(leaf.value_type, "py")
    sharding = None
    if how == "jax":
      sharding = _resolve(single if single is not None else by_sharding.get(leaf.name), leaf)
      if sharding is None and t is not None:
        sharding = getattr(t, "sharding", None)
      if sharding is None and leaf.name in saved_shardings:
        sharding = layout.sharding_from_metadata(saved_shardings[leaf.name])
      if sharding is None:
        problems.append(f"leaf {leaf.name!r}: no sharding to restore it onto (the saved one is "
                        "not a NamedSharding over devices present here); pass shardings= (a "
                        "Sharding, a dtenjax.Placement or a tree of them) or a target")
        continue
      try:
        sharding.shard_shape(leaf.shape)
      except Exception as e:
        problems.append(f"leaf {leaf.name!r} {list(leaf.shape)}: {sharding} does not fit: {e}")
        continue
    plans.append((leaf, how, sharding))
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        f"cannot restore {path} as asked:", problems))

  boxes: dict[tuple, tuple] = {}      # (leaf name, box) -> (leaf, lo, hi)
  where: list[Any] = []
  for leaf, how, sharding in plans:
    if how == "none":
      where.append(None)
      continue
    if how == "jax":
      per_device = []
      for dev, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        rng = [sl.indices(n)[:2] for sl, n in zip(index, leaf.shape)]
        box = tuple(rng)
        boxes[(leaf.name, box)] = (leaf, [a for a, _ in rng], [b for _, b in rng])
        per_device.append((dev, box))
      where.append(per_device)
    else:
      box = tuple((0, n) for n in leaf.shape)
      boxes[(leaf.name, box)] = (leaf, [0] * len(leaf.shape), list(leaf.shape))
      where.append(box)
  workers = threads or min(16, (os.cpu_count() or 1) * 2)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = {k: pool.submit(src.read, *v) for k, v in boxes.items()}
    data = {k: f.result() for k, f in futures.items()}
  values = []
  for (leaf, how, sharding), w in zip(plans, where):
    if how == "none":      # None, or the target's own empty node (optax's EmptyState())
      values.append(wanted.get(leaf.name) if target is not None else None)
    elif how == "jax":
      memory_kind = getattr(sharding, "memory_kind", None)
      arrays = [jax.device_put(data[(leaf.name, box)],
                               jax.sharding.SingleDeviceSharding(dev, memory_kind=memory_kind))
                for dev, box in w]
      values.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays))
    elif how == "np":
      values.append(data[(leaf.name, w)])
    elif how == "npscalar":
      values.append(data[(leaf.name, w)][()])
    else:
      values.append(data[(leaf.name, w)].item())
  out = treedef.unflatten(values) if treedef is not None else layout.unflatten_like_orbax(
      order, values)
  if not report:
    return out
  return out, RestoreReport(path, len(order), src.nbytes, time.perf_counter() - t0, io_name,
                            src.digest, kind)


def leaves(path: str | os.PathLike) -> dict[str, dict]:
  """``{leaf name: {"value_type", "shape", "dtype", "chunks"}}`` of the checkpoint at ``path``."""
  src, found, _, _, _ = _open(os.path.abspath(os.fspath(path)), ckio.PosixIO(), verify=False)
  del src
  return {leaf.name: {"value_type": leaf.value_type, "shape": leaf.shape,
                      "dtype": leaf.np_dtype.name if leaf.dtype else None, "chunks": leaf.chunks}
          for leaf in found}

