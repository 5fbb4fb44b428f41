"""Restoring onto any sharding: each process reads, for each of its devices, the boxes of the
saved chunks that the device's shard covers, and only the digest blocks holding them.

For a shard (a box ``[lo, hi)`` of the global array) and each saved chunk it intersects, the
bytes needed are a span of the chunk file from the box's first element to its last (C order);
the restore reads the digest blocks covering that span, checks each block's digest and copies
the box out. Devices holding the same box (replicas) share one read. A checkpoint orbax wrote
(no ``_dtenjax`` directory) is read through tensorstore (``orbax_read``) (the ``checkpoint`` extra), which reads
only the chunks a box needs; orbax keeps no digests, so none are checked (a warning says so).

A checkpoint is untrusted input: every metadata file goes through ``metadata`` (validated
fields, numeric dtypes only, sizes checked against the files and the host's memory before
anything is allocated), every path through ``Storage.resolve`` (nothing outside the checkpoint),
and a checkpoint dtenjax wrote whose digests are missing is refused unless ``verify=False``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src.checkpoint import integrity, io as ckio, layout, metadata, orbax_read
from dtenjax._src.checkpoint import storage as storage_mod


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
            f"{ckio.size(self.bytes)} in {self.seconds:.3f} s "
            f"({ckio.rate(self.bytes, self.seconds)}), io "
            f"{self.io}, digests {self.digest or 'not checked'}")


def _c_strides(shape) -> tuple[int, ...]:
  out, acc = [], 1
  for n in reversed(shape):
    out.append(acc)
    acc *= n
  return tuple(reversed(out))


REREADS = 3     # reads again when an overwrite commits during a restore


class _Files:
  """Chunk files written by dtenjax: sizes and block digests from the process manifests,
  checked against every leaf's chunk grid before anything is read."""

  def __init__(self, root: str, manifest: dict, st: storage_mod.Storage, verify: bool):
    self.path, self.st = root, st
    self.block = manifest["block_bytes"]
    self.digest = manifest["digest"] if verify else None
    self.hash = integrity.hasher(self.digest) if verify else None
    self.table: dict[str, dict[str, dict]] = {}
    for pid in range(manifest["processes"]):
      rel = f"{layout.DTENJAX_DIR}/process_{pid}.json"
      if not st.exists(root, rel):
        raise errors.CheckpointError(
            f"the manifest of process {pid} {root}/{rel} is missing; the checkpoint is "
            "incomplete (restore an earlier one)")
      chunks = metadata.process_manifest(metadata.load_json(st, root, rel), f"{root}/{rel}",
                                         self.block)
      for name, files in chunks.items():
        self.table.setdefault(name, {}).update(files)
    for leaf in manifest["leaves"]:
      if leaf.value_type == "None":
        continue
      files = self.table.get(leaf.name, {})
      grid = leaf.grid
      count = 1
      for g in grid:
        count *= g
      where = f"{root}/{layout.DTENJAX_DIR}"
      if len(files) != count:
        raise errors.CheckpointError(
            f"leaf {leaf.name!r}: {list(leaf.shape)} in chunks of {list(leaf.chunks)} is "
            f"{count} chunk files, the process manifests in {where} list {len(files)}; the "
            "checkpoint is incomplete or damaged (restore an earlier one)")
      for fname, entry in files.items():
        parts = fname.split(".")
        ok = (len(parts) == max(1, len(grid)) and all(p.isdigit() for p in parts)
              and (not grid or all(int(p) < g for p, g in zip(parts, grid))))
        if not ok or entry["size"] != leaf.chunk_nbytes:
          raise errors.CheckpointError(
              f"leaf {leaf.name!r}: chunk {fname!r} in {where} is {entry['size']} bytes in a "
              f"grid of {list(grid)}; a chunk of {list(leaf.chunks)} {leaf.np_dtype.name} is "
              f"{leaf.chunk_nbytes} bytes at an index inside the grid: the checkpoint is "
              "damaged (restore an earlier one)")
    self.lock = threading.Lock()
    self.nbytes = 0

  def region(self, leaf: layout.Leaf, index: tuple[int, ...], llo, lhi) -> np.ndarray:
    fname = layout.chunk_file(index)
    rel = f"{leaf.name}/{fname}"
    file = os.path.join(self.path, rel)
    entry = self.table.get(leaf.name, {}).get(fname)
    if entry is None:
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: chunk {fname} ({file}) is in no process's manifest; the "
          "checkpoint is incomplete")
    if not self.st.exists(self.path, rel):
      raise errors.CheckpointError(
          f"leaf {leaf.name!r}: chunk file {file} is missing (the checkpoint lost a file; "
          "restore an earlier checkpoint)")
    size = self.st.size(self.path, rel)
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
    n = self.st.read_range(self.path, rel, start, memoryview(buf))
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


def _dtenjax_marker(st: storage_mod.Storage, root: str) -> bool:
  """Whether ``_CHECKPOINT_METADATA`` says dtenjax wrote the checkpoint."""
  if not st.exists(root, "_CHECKPOINT_METADATA"):
    return False
  try:
    meta = metadata.load_json(st, root, "_CHECKPOINT_METADATA")
  except errors.CheckpointError:
    return False
  custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
  return isinstance(custom, dict) and layout.MARKER in custom


def _open(path: str, st: storage_mod.Storage, verify: bool):
  """(source, leaves, saved shardings by name, io name, source kind, directory read)."""
  root, note = st.open_checkpoint(path)
  if note:
    warnings.warn(note, errors.DtenjaxWarning, stacklevel=3)
  st.check_links(root)
  shardings: dict[str, Any] = {}
  if st.exists(root, "_sharding"):
    shardings = metadata.sharding_file(metadata.load_json(st, root, "_sharding"),
                                       f"{root}/_sharding")
  mrel = f"{layout.DTENJAX_DIR}/{layout.MANIFEST}"
  if st.exists(root, mrel):
    manifest = metadata.manifest(metadata.load_json(st, root, mrel), f"{root}/{mrel}")
    leaves = manifest["leaves"]
    return (_Files(root, manifest, st, verify), leaves, shardings, st.name, "dtenjax", root)
  if st.exists(root, layout.DTENJAX_DIR) or _dtenjax_marker(st, root):
    if verify:
      raise errors.CheckpointError(
          f"{root} was written by dtenjax, and its digests ({mrel}) are missing: the checkpoint "
          "was damaged or tampered with, and cannot be verified. Restore an earlier one, or pass "
          "verify=False to read it without digests (as an orbax checkpoint)")
    warnings.warn(f"{root}: dtenjax's digests ({mrel}) are missing; reading it without them "
                  "(verify=False)", errors.DtenjaxWarning, stacklevel=3)
  if not st.exists(root, "_METADATA"):
    raise errors.CheckpointError(
        f"{root} is not a checkpoint: it has neither {mrel} nor orbax's _METADATA (an "
        "incomplete copy?)")
  src, leaves = orbax_read.open_orbax(root, st)
  if verify:
    warnings.warn(f"{root} was written by orbax-checkpoint, which keeps no digests: its bytes "
                  "are not verified (only dtenjax's own checkpoints carry digests)",
                  errors.DtenjaxWarning, stacklevel=3)
  return src, leaves, shardings, "tensorstore", "orbax", root


def _saved_sharding(meta: Any, leaf: layout.Leaf, root: str):
  """The sharding ``_sharding`` records for ``leaf`` (None when its devices are not here)."""
  fix = ("pass shardings= (a Sharding, a dtenjax.Placement or a tree of them) or a target to "
         "restore it without the saved sharding")
  if isinstance(meta, str):
    raise errors.CheckpointError(f"{meta}; {fix}")
  try:
    return layout.sharding_from_metadata(meta)
  except Exception as e:
    raise errors.CheckpointError(
        f"{root}/_sharding: the entry of leaf {leaf.name!r} does not describe a sharding "
        f"({type(e).__name__}: {e}); {fix}") from None


def _is_sharding_leaf(x) -> bool:
  from dtenjax._src.planning import placement
  return x is None or isinstance(x, (jax.sharding.Sharding, jax.sharding.PartitionSpec,
                                     placement.Placement))


def _resolve(s, leaf: layout.Leaf):
  """The sharding ``s`` (an entry of ``shardings=``) gives ``leaf``: a Placement's choice, a bare
  PartitionSpec on the context mesh (as ``dtenjax.shard`` takes it)."""
  from dtenjax._src.planning import mesh as mesh_lib
  from dtenjax._src.planning import placement
  if isinstance(s, placement.Placement):
    return s.sharding(leaf.shape, leaf.np_dtype)
  if isinstance(s, jax.sharding.PartitionSpec):
    mesh = mesh_lib.current_mesh()
    if mesh is None:
      raise errors.ConfigurationError(
          f"a bare PartitionSpec {s} needs a mesh, and none is in context: restore inside "
          "jax.set_mesh(mesh) or dtenjax.use_mesh(mesh), or pass NamedSharding(mesh, spec)")
    return jax.sharding.NamedSharding(mesh, s)
  return s


def _above(prefix: str, names) -> bool:
  """Whether ``prefix`` names a subtree holding some of the leaves ``names``."""
  return any(n.startswith(prefix + ".") for n in names)


def _entry(by_sharding: dict[str, Any], name: str):
  """The ``shardings=`` entry for leaf ``name``: its own, else that of the nearest subtree above
  it (a prefix of the target, as ``jax.jit``'s in_shardings takes it), else None."""
  parts = name.split(".")
  for k in range(len(parts), 0, -1):
    key = ".".join(parts[:k])
    if key in by_sharding:
      return by_sharding[key]
  return None


def _scalar_onto(leaf: layout.Leaf, t) -> bool:
  """Whether a saved Python scalar (numpy's int64 / float64 / bool, not a dtype the user chose)
  may come back in ``t``'s dtype of its kind: ``jax.eval_shape`` of a state holding ``step=0``
  says int32, as jnp would make it."""
  if leaf.value_type != "scalar" or leaf.shape or tuple(t.shape):
    return False
  kind, want = leaf.np_dtype.kind, np.dtype(t.dtype).kind
  return want == kind or (kind in "iu" and want in "iu")


def _cast_scalar(leaf: layout.Leaf, value: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
  """``value`` as ``dtype`` (None: as read); an integer that does not fit and a finite float
  past the dtype's range are refused. Integers are compared as Python ints: cast back to the
  saved dtype, a wrap across signedness (uint64 2**64 - 1 as int32 -1) would compare equal."""
  if dtype is None:
    return value
  with np.errstate(over="ignore"):
    out = value.astype(dtype)
  wrong = (out.item() != value.item() if dtype.kind in "iu"
           else dtype.kind == "f" and bool(np.isfinite(value)) and not np.isfinite(out))
  if wrong:
    raise errors.ConfigurationError(
        f"leaf {leaf.name!r}: the saved value {value.item()!r} does not fit the target's "
        f"{dtype.name}; restore it into a wider dtype or a Python "
        f"{'int' if dtype.kind in 'iu' else 'float'}")
  return out


def _concrete(sharding, saved_meta: Any, leaf: layout.Leaf, root: str):
  """``sharding`` (a target leaf's), on devices: ``jax.eval_shape`` of an array on Explicit mesh
  axes (``jax.make_mesh``'s) gives a NamedSharding over an AbstractMesh, which names no device;
  it is laid on the context mesh (``jax.set_mesh``) or the saved one, whichever has its axes."""
  from dtenjax._src.planning import mesh as mesh_lib
  mesh = getattr(sharding, "mesh", None)
  if not isinstance(mesh, jax.sharding.AbstractMesh):
    return sharding
  saved = _saved_sharding(saved_meta, leaf, root) if saved_meta is not None else None
  for m in (mesh_lib.current_mesh(), getattr(saved, "mesh", None)):
    if (isinstance(m, jax.sharding.Mesh) and tuple(m.axis_names) == tuple(mesh.axis_names)
        and m.devices.shape == tuple(mesh.axis_sizes)):
      devices = jax.sharding.Mesh(m.devices, m.axis_names, axis_types=mesh.axis_types)
      return jax.sharding.NamedSharding(devices, sharding.spec, memory_kind=sharding.memory_kind)
  raise errors.ConfigurationError(
      f"the target's sharding {sharding} is over an abstract mesh (jax.eval_shape of an array "
      "on Explicit mesh axes) that neither the context mesh nor the saved one matches; restore "
      "inside jax.set_mesh(mesh) with a mesh of those axes, or pass shardings=")


def restore(path: str | os.PathLike, target: Any = None, *, shardings: Any = None,
            verify: bool = True, io: str | None = None, threads: int | None = None,
            report: bool = False, storage: storage_mod.Storage | None = None) -> Any:
  """The tree saved at ``path``, laid out as asked.

  ``target``: a tree like the saved one (jax Arrays, ``jax.ShapeDtypeStruct``s with shardings,
  numpy arrays, scalars; flax and optax states as they are): the result has its structure, and
  its arrays' shardings unless ``shardings`` says otherwise. ``shardings``: one
  ``jax.sharding.Sharding``, ``dtenjax.Placement`` or bare ``PartitionSpec`` (on the context
  mesh: ``jax.set_mesh`` or ``dtenjax.use_mesh``) for every array, or a tree of them shaped like
  the target or a prefix of it (an entry for a subtree applies to each leaf under it), whose
  every entry must name a saved leaf or subtree. Without either, arrays come back with
  their saved shardings (when those devices exist) in nested dicts and lists, as orbax restores
  without a target.
  ``report=True`` returns ``(tree, RestoreReport)``. ``storage``: where checkpoints live
  (default: the file system); orbax-written checkpoints are read from the file system only.
  """
  t0 = time.perf_counter()
  threads = ckio.check_threads(threads)
  path = os.path.abspath(os.fspath(path))
  st = storage if storage is not None else storage_mod.LocalStorage(ckio.backend(io))
  for attempt in range(REREADS + 1):
    before = st.identity(path)
    try:
      out = _restore_once(path, st, target, shardings, verify, threads, report, t0)
    except (errors.CheckpointError, errors.ConfigurationError):
      # an overwrite committed while we read (what we read may mix the two checkpoints, e.g. no
      # _sharding seen between the commit's renames): read the new checkpoint
      if attempt < REREADS and st.identity(path) != before:
        continue
      raise
    if st.identity(path) == before:
      return out
  raise errors.CheckpointError(
      f"{path} was replaced by {REREADS + 1} overwrites while it was being read; restore it "
      "when saves of it pause, or save each step to its own path")


def _restore_once(path: str, st: storage_mod.Storage, target: Any, shardings: Any, verify: bool,
                  threads: int | None, report: bool, t0: float) -> Any:
  src, leaves, saved_shardings, io_name, kind, root = _open(path, st, verify)
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
    by_sharding = {".".join(layout._key_of(e)[0] for e in p): s
                   for p, s in spairs}
    problems += [f"shardings names {n!r}, which is not a leaf of the checkpoint nor a subtree of "
                 f"leaves (its leaves: {sorted(by_name)}); check the spelling"
                 for n in by_sharding if n not in by_name and not _above(n, by_name)]
  plans = []   # (leaf, how, sharding, the dtype a saved Python scalar is cast to)
  for leaf in order:
    t = wanted.get(leaf.name)
    if leaf.value_type == "None":
      plans.append((leaf, "none", None, None))
      continue
    cast = None
    if t is not None and hasattr(t, "shape") and hasattr(t, "dtype"):
      if tuple(t.shape) != leaf.shape or np.dtype(t.dtype) != leaf.np_dtype:
        if not _scalar_onto(leaf, t):
          problems.append(f"leaf {leaf.name!r}: the target is {np.dtype(t.dtype).name}"
                          f"{list(t.shape)}, the checkpoint holds {leaf.np_dtype.name}"
                          f"{list(leaf.shape)}")
          continue
        cast = np.dtype(t.dtype)
    if target is not None:
      how = ("jax" if isinstance(t, (jax.Array, jax.ShapeDtypeStruct)) else
             "np" if isinstance(t, np.ndarray) else "npscalar" if isinstance(t, np.generic)
             else "py")
    else:
      how = {"jax.Array": "jax", "np.ndarray": "np"}.get(leaf.value_type, "py")
    sharding = None
    if how == "jax":
      try:
        sharding = _resolve(single if single is not None else _entry(by_sharding, leaf.name),
                            leaf)
      except errors.ConfigurationError as e:
        problems.append(f"leaf {leaf.name!r}: {e}")
        continue
      if sharding is None and t is not None:
        try:
          sharding = _concrete(getattr(t, "sharding", None), saved_shardings.get(leaf.name),
                               leaf, root)
        except errors.ConfigurationError as e:
          problems.append(f"leaf {leaf.name!r}: {e}")
          continue
      if sharding is None and leaf.name in saved_shardings:
        sharding = _saved_sharding(saved_shardings[leaf.name], leaf, root)
      if sharding is None and t is not None and _scalar_onto(leaf, t):
        # a saved Python scalar onto a target without a sharding (of its dtype or another of
        # its kind): as jnp.asarray makes it
        plans.append((leaf, "jnp", None, np.dtype(t.dtype)))
        continue
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
    plans.append((leaf, how, sharding, cast))
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        f"cannot restore {path} as asked:", problems))

  boxes: dict[tuple, tuple] = {}      # (leaf name, box) -> (leaf, lo, hi)
  where: list[Any] = []
  for leaf, how, sharding, _ in plans:
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
  need = sum(v[0].np_dtype.itemsize * int(np.prod([b - a for a, b in zip(v[1], v[2])],
                                                  dtype=object))
             for v in boxes.values())
  if need > metadata.memory_bound():
    raise errors.CheckpointError(
        f"restoring {path} onto this process's devices needs {need} bytes of host memory, more "
        f"than the host has ({metadata.memory_bound()} bytes); restore onto more processes, restore "
        "fewer leaves, or check the checkpoint's shapes (a hostile checkpoint may declare huge "
        "arrays)")
  workers = threads or min(16, (os.cpu_count() or 1) * 2)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = {k: pool.submit(src.read, *v) for k, v in boxes.items()}
    data = {k: f.result() for k, f in futures.items()}
  values = []
  for (leaf, how, sharding, cast), w in zip(plans, where):
    if how == "none":      # None, or the target's own empty node (optax's EmptyState())
      values.append(wanted.get(leaf.name) if target is not None else None)
    elif how == "jnp":
      values.append(jnp.asarray(_cast_scalar(leaf, data[(leaf.name, w)], cast)))
    elif how == "jax":
      memory_kind = getattr(sharding, "memory_kind", None)
      arrays = [jax.device_put(_cast_scalar(leaf, data[(leaf.name, box)], cast),
                               jax.sharding.SingleDeviceSharding(dev, memory_kind=memory_kind))
                for dev, box in w]
      values.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays))
    elif how == "np":
      values.append(_cast_scalar(leaf, data[(leaf.name, w)], cast))
    elif how == "npscalar":
      values.append(_cast_scalar(leaf, data[(leaf.name, w)], cast)[()])
    else:
      values.append(data[(leaf.name, w)].item())
  out = treedef.unflatten(values) if treedef is not None else layout.unflatten_like_orbax(
      order, values)
  if not report:
    return out
  return out, RestoreReport(path, len(order), src.nbytes, time.perf_counter() - t0, io_name,
                            src.digest, kind)


def leaves(path: str | os.PathLike, *,
           storage: storage_mod.Storage | None = None) -> dict[str, dict]:
  """``{leaf name: {"value_type", "shape", "dtype", "chunks"}}`` of the checkpoint at ``path``."""
  st = storage if storage is not None else storage_mod.LocalStorage()
  src, found, _, _, _, _ = _open(os.path.abspath(os.fspath(path)), st, verify=False)
  del src
  return {leaf.name: {"value_type": leaf.value_type, "shape": leaf.shape,
                      "dtype": leaf.np_dtype.name if leaf.dtype else None, "chunks": leaf.chunks}
          for leaf in found}

