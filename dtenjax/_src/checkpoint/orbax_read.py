"""Reading checkpoints orbax-checkpoint wrote (no ``_dtenjax/``), through tensorstore.

orbax's PyTree layout, with OCDBT (its default) or without (one zarr v2 array per leaf): the
leaves come from ``_METADATA`` and each leaf's ``.zarray`` (read from the directory, or from
inside OCDBT), both validated by ``metadata`` before tensorstore opens anything, since
tensorstore aborts the process on some absurd shapes. The arrays are read with tensorstore,
which reads only the chunks a box needs. orbax keeps no digests: nothing is verified.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from dtenjax._src import errors
from dtenjax._src.checkpoint import layout, metadata, storage as storage_mod


class TensorstoreReader:
  """Leaves of a checkpoint orbax wrote, opened with tensorstore (OCDBT or plain zarr), each
  ``.zarray`` validated first (tensorstore aborts the process on some absurd shapes)."""

  def __init__(self, path: str, meta: dict, st: storage_mod.Storage):
    try:
      import tensorstore as ts
    except ImportError:
      raise errors.ConfigurationError(
          f"{path} was written by orbax-checkpoint (it has no {layout.DTENJAX_DIR}/); reading "
          "it needs tensorstore: pip install 'dtenjax[checkpoint]'") from None
    self.ts, self.path, self.st = ts, path, st
    self.driver = "zarr3" if meta.get("use_zarr3") else "zarr"
    self.ocdbt = bool(meta.get("use_ocdbt"))
    self.stores: dict[str, Any] = {}
    self.lock = threading.Lock()
    self.nbytes = 0
    self.digest = None
    self._kv = None

  def _zarray(self, name: str) -> dict:
    rel = f"{name}/.zarray"
    file = f"{self.path}/{rel}"
    if self.driver != "zarr":
      raise errors.CheckpointError(
          f"{self.path} uses zarr v3 (use_zarr3=True), which dtenjax does not read; restore it "
          "with orbax.checkpoint")
    if not self.ocdbt:
      if not self.st.exists(self.path, rel):
        raise errors.CheckpointError(f"{file} is missing; the checkpoint is incomplete")
      return metadata.load_json(self.st, self.path, rel)
    try:
      if self._kv is None:
        self._kv = self.ts.KvStore.open({"driver": "ocdbt",
                                         "base": f"file://{self.path}"}).result()
      raw = self._kv.read(rel).result().value
    except Exception as e:
      raise errors.CheckpointError(f"{file} (inside OCDBT) cannot be read: {e}") from None
    if len(raw) > metadata.MAX_METADATA_BYTES:
      raise metadata.bad(file, "the file", "is too large")
    try:
      return json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise errors.CheckpointError(f"{file} is not valid JSON ({e}); {metadata.FIX}") from None

  def geometry(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype]:
    file = f"{self.path}/{name}/.zarray"
    shape, chunks, dtype = metadata.zarray(self._zarray(name), file)
    chunk_bytes = dtype.itemsize
    for c in chunks:
      chunk_bytes *= c
    if chunk_bytes > metadata.memory_bound():
      raise errors.CheckpointError(
          f"{file}: a chunk of {list(chunks)} {dtype.name} is {chunk_bytes} bytes, more than "
          f"this host's memory ({metadata.memory_bound()} bytes); {metadata.FIX}")
    return shape, chunks, dtype

  def open(self, name: str):
    if name not in self.stores:
      if self.ocdbt:
        kv = {"driver": "ocdbt", "base": f"file://{self.path}", "path": name}
      else:
        kv = {"driver": "file", "path": self.st.resolve(self.path, name)}
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


def open_orbax(root: str, st: storage_mod.Storage) -> tuple[TensorstoreReader, list[layout.Leaf]]:
  """The reader and the leaves of the orbax checkpoint at ``root`` (file system only)."""
  if not isinstance(st, storage_mod.LocalStorage):
    raise errors.CheckpointError(
        f"{root} in {st.name} storage has no {layout.DTENJAX_DIR}/{layout.MANIFEST}: only "
        "dtenjax's own checkpoints are read from storage other than the file system")
  meta = metadata.load_json(st, root, "_METADATA")
  entries = metadata.orbax_tree(meta, f"{root}/_METADATA")
  src = TensorstoreReader(root, meta, st)
  leaves = []
  for keys, vtype in entries:
    if vtype == "None":
      leaves.append(layout.Leaf(keys, "None"))
      continue
    name = ".".join(k for k, _ in keys)
    if vtype not in layout.VALUE_TYPES:
      raise errors.CheckpointError(
          f"{root}/_METADATA: leaf {name!r} has value type {vtype!r}; dtenjax restores arrays "
          f"and scalars ({', '.join(layout.VALUE_TYPES)}): restore this one with orbax")
    shape, chunks, dtype = src.geometry(name)
    leaves.append(layout.Leaf(keys, vtype, shape, layout.dtype_to_zarr(dtype), chunks))
  return src, leaves
