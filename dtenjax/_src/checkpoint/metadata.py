"""Reading a checkpoint's metadata files as untrusted input (safetensors' stance).

A checkpoint directory may come from anywhere (a download, a teammate, a disk that failed). Every
metadata file is parsed here, field by field, into plain validated values, and anything
unexpected is one :class:`CheckpointError` naming the file, the field and what to do:

* JSON that does not parse, a file over :data:`MAX_METADATA_BYTES`, a field of the wrong type;
* leaf names that are not one plain path component (``..``, ``/``, empty), so that every path
  the checkpoint names stays inside it (``storage.resolve`` also refuses symlinks leading out);
* dtypes other than bool, integers, floats (ml_dtypes' too) and complex: no object, string,
  structured or datetime arrays;
* shapes and chunk shapes that are not non-negative (positive) integers of one rank, arrays over
  :data:`MAX_ELEMENTS` elements; chunk sizes and block digests that do not match the files
  (checked by the restore against the file sizes before anything is allocated);
* unknown digest algorithms, block sizes out of range, a digest list of the wrong length.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from typing import Any

import numpy as np

from dtenjax._src import errors
from dtenjax._src.checkpoint import integrity, layout, storage as storage_mod

MAX_METADATA_BYTES = 256 << 20
MAX_ELEMENTS = 1 << 50
MAX_RANK = 64
MAX_PROCESSES = 1 << 20
NUMERIC_KINDS = "biufc"
FIX = "the checkpoint is damaged or was not written by dtenjax or orbax: restore another one"


def memory_bound() -> int:
  """Bytes a restore may allocate in this process: the host's physical memory."""
  try:
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
  except (ValueError, OSError, AttributeError):
    return 1 << 40


def bad(file: str, field: str, problem: str) -> errors.CheckpointError:
  return errors.CheckpointError(f"{file}: {field} {problem}; {FIX}")


def load_json(st: Any, root: str, rel: str) -> Any:
  """The parsed JSON of ``rel`` inside the checkpoint ``root``."""
  file = f"{root}/{rel}"
  raw = st.read_bytes(root, rel, MAX_METADATA_BYTES)
  try:
    return json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, ValueError) as e:
    raise errors.CheckpointError(
        f"{file} is not valid JSON ({e}; {len(raw)} bytes, truncated?); {FIX}") from None


def field(obj: Any, name: str, kind: type | tuple[type, ...], file: str, where: str = "") -> Any:
  label = f"{where}{name}" if where else repr(name)
  if not isinstance(obj, dict):
    raise bad(file, where.rstrip(".") or "the top level", f"is a {type(obj).__name__}, not an "
              "object")
  if name not in obj:
    raise bad(file, "field " + label, "is missing")
  v = obj[name]
  if not isinstance(v, kind) or (isinstance(v, bool) and bool not in _kinds(kind)):
    raise bad(file, "field " + label, f"is {_short(v)}, not {_names(kind)}")
  return v


def _kinds(kind) -> tuple:
  return kind if isinstance(kind, tuple) else (kind,)


def _names(kind) -> str:
  return " or ".join(k.__name__ for k in _kinds(kind))


def _short(v: Any) -> str:
  text = repr(v)
  return text if len(text) < 60 else text[:57] + "..."


def int_in(v: Any, lo: int, hi: int, file: str, label: str) -> int:
  if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
    raise bad(file, label, f"is {_short(v)}, not an integer in [{lo}, {hi}]")
  return v


def dtype(text: Any, file: str, label: str) -> np.dtype:
  """A numeric or bool dtype from its zarr text; anything else refused."""
  if not isinstance(text, str) or len(text) > 32:
    raise bad(file, label, f"is {_short(text)}, not a dtype name")
  try:
    d = layout.dtype_from_zarr(text)
  except Exception:
    raise bad(file, label, f"{text!r} is not a dtype numpy or ml_dtypes knows") from None
  ml = d.kind == "V" and d.fields is None and d.type.__module__.startswith("ml_dtypes")
  if d.fields is not None or d.subdtype is not None or not (d.kind in NUMERIC_KINDS or ml):
    raise errors.CheckpointError(
        f"{file}: {label} is {text!r} ({d.kind!r} kind); a checkpoint holds only bool, integer, "
        "floating and complex arrays (no objects, strings, structured or datetime values): "
        "the checkpoint is hostile or not one of arrays")
  return d


def shape(v: Any, file: str, label: str, *, positive: bool) -> tuple[int, ...]:
  if not isinstance(v, list) or len(v) > MAX_RANK:
    raise bad(file, label, f"is {_short(v)}, not a list of at most {MAX_RANK} integers")
  out = tuple(int_in(n, 1 if positive else 0, MAX_ELEMENTS, file, f"{label}[{i}]")
              for i, n in enumerate(v))
  if math.prod(out) > MAX_ELEMENTS:
    raise bad(file, label, f"{list(out)} has more than 2**50 elements")
  return out


def keys(v: Any, file: str, label: str) -> tuple[tuple[str, int], ...]:
  if not isinstance(v, list) or not v:
    raise bad(file, label, f"is {_short(v)}, not a non-empty list of [key, key type]")
  out = []
  for i, k in enumerate(v):
    if (not isinstance(k, list) or len(k) != 2 or not isinstance(k[0], str)
        or k[1] not in (layout.SEQUENCE, layout.DICT) or isinstance(k[1], bool)):
      raise bad(file, f"{label}[{i}]", f"is {_short(k)}, not [str, 1 or 2]")
    out.append((k[0], k[1]))
  return tuple(out)


def leaf(d: Any, file: str, label: str) -> layout.Leaf:
  """One leaf: keys, value type and, for stored leaves, a geometry that holds together."""
  ks = keys(field(d, "keys", list, file, label + "."), file, f"{label}.keys")
  vt = field(d, "value_type", str, file, label + ".")
  if vt not in layout.VALUE_TYPES:
    raise bad(file, f"{label}.value_type", f"is {vt!r}, not one of {', '.join(layout.VALUE_TYPES)}")
  name = ".".join(k for k, _ in ks)
  storage_mod.check_component(name, "leaf name", file)
  if vt == "None":
    return layout.Leaf(ks, vt)
  shp = shape(field(d, "shape", list, file, label + "."), file, f"{label}.shape", positive=False)
  chunks = shape(field(d, "chunks", list, file, label + "."), file, f"{label}.chunks",
                 positive=True)
  if len(chunks) != len(shp):
    raise bad(file, f"{label}.chunks", f"{list(chunks)} has another rank than the shape "
              f"{list(shp)}")
  dtype(field(d, "dtype", str, file, label + "."), file, f"{label}.dtype")
  return layout.Leaf(ks, vt, shp, d["dtype"], chunks)


def manifest(obj: Any, file: str) -> dict:
  """``_dtenjax/checkpoint.json``: format, processes, digest, block size, leaves."""
  fmt = field(obj, "format", str, file)
  if fmt != layout.FORMAT:
    raise errors.CheckpointError(
        f"{file} has format {fmt!r}; this dtenjax reads {layout.FORMAT!r} (a newer dtenjax "
        "wrote it? upgrade dtenjax)")
  out = {
      "processes": int_in(field(obj, "processes", int, file), 1, MAX_PROCESSES, file,
                          "field 'processes'"),
      "digest": field(obj, "digest", str, file),
      "block_bytes": int_in(field(obj, "block_bytes", int, file), 16, 1 << 40, file,
                            "field 'block_bytes'"),
  }
  if out["digest"] not in integrity.ALGORITHMS:
    raise bad(file, "field 'digest'", f"is {out['digest']!r}, not one of "
              f"{', '.join(integrity.ALGORITHMS)}")
  raw = field(obj, "leaves", list, file)
  out["leaves"] = [leaf(d, file, f"leaves[{i}]") for i, d in enumerate(raw)]
  names = [x.name for x in out["leaves"]]
  if len(set(names)) != len(names):
    raise bad(file, "field 'leaves'", "names one leaf twice")
  return out


def process_manifest(obj: Any, file: str, block_bytes: int) -> dict[str, dict[str, dict]]:
  """``_dtenjax/process_N.json``: the chunks a process wrote, size and block digests each."""
  chunks = field(obj, "chunks", dict, file)
  out: dict[str, dict[str, dict]] = {}
  for name, files in chunks.items():
    storage_mod.check_component(name, "leaf name", file)
    if not isinstance(files, dict):
      raise bad(file, f"chunks[{name!r}]", f"is {_short(files)}, not an object")
    for fname, entry in files.items():
      storage_mod.check_component(fname, "chunk file name", file)
      where = f"chunks[{name!r}][{fname!r}]."
      size = int_in(field(entry, "size", int, file, where), 0, 1 << 50, file, where + "size")
      digests = field(entry, "digests", list, file, where)
      expected = max(1, -(-size // block_bytes))
      if len(digests) != expected or not all(isinstance(x, str) for x in digests):
        raise bad(file, where + "digests", f"has {len(digests)} entries, a {size}-byte file in "
                  f"{block_bytes}-byte blocks has {expected} digests (strings)")
      out.setdefault(name, {})[fname] = {"size": size, "digests": digests}
  return out


def sharding_file(raw: Any, file: str) -> dict[str, Any]:
  """``_sharding``: leaf name -> orbax's sharding description (a dict), or the reason it is
  unusable (a str, reported only if that leaf needs it)."""
  if not isinstance(raw, dict):
    raise bad(file, "the top level", f"is a {type(raw).__name__}, not an object")
  out: dict[str, Any] = {}
  for k, v in raw.items():
    try:
      name = base64.b64decode(k, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
      raise bad(file, f"key {_short(k)}", "is not a base64 leaf name") from None
    try:
      meta = json.loads(v) if isinstance(v, str) else None
    except ValueError:
      meta = None
    out[name] = meta if isinstance(meta, dict) else (
        f"{file}: the entry of leaf {name!r} is not a JSON object")
  return out


def orbax_tree(obj: Any, file: str) -> list[tuple[tuple[tuple[str, int], ...], str]]:
  """orbax's ``_METADATA``: every leaf's keys and value type."""
  tree = field(obj, "tree_metadata", dict, file)
  out = []
  for i, entry in enumerate(tree.values()):
    label = f"tree_metadata[{i}]"
    km = field(entry, "key_metadata", list, file, label + ".")
    ks = []
    for j, k in enumerate(km):
      key = field(k, "key", (str, int), file, f"{label}.key_metadata[{j}].")
      kt = field(k, "key_type", int, file, f"{label}.key_metadata[{j}].")
      if kt not in (layout.SEQUENCE, layout.DICT):
        raise bad(file, f"{label}.key_metadata[{j}].key_type", f"is {kt!r}, not 1 or 2")
      ks.append((str(key), kt))
    if not ks:
      raise bad(file, f"{label}.key_metadata", "is empty")
    vm = field(entry, "value_metadata", dict, file, label + ".")
    vt = field(vm, "value_type", str, file, label + ".value_metadata.")
    storage_mod.check_component(".".join(k for k, _ in ks), "leaf name", file)
    out.append((tuple(ks), vt))
  return out


def zarray(obj: Any, file: str) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype]:
  """A zarr v2 ``.zarray``: shape, chunk shape and dtype, validated before tensorstore opens it."""
  shp = shape(field(obj, "shape", list, file), file, "field 'shape'", positive=False)
  chunks = shape(field(obj, "chunks", list, file), file, "field 'chunks'", positive=True)
  if len(chunks) != len(shp):
    raise bad(file, "field 'chunks'", f"{list(chunks)} has another rank than the shape "
              f"{list(shp)}")
  d = dtype(field(obj, "dtype", str, file), file, "field 'dtype'")
  return shp, chunks, d
