"""What a checkpoint directory holds, in orbax-checkpoint's own layout.

A dtenjax checkpoint is the directory orbax's ``PyTreeCheckpointHandler(use_ocdbt=False,
use_zarr3=False)`` writes, with raw (uncompressed) chunks, so that ``orbax.checkpoint`` restores
it as its own:

* one directory per leaf, named by the leaf's key path joined with ``.`` (``params.dense.kernel``,
  ``opt_state.0.mu.w``), holding a zarr v2 array: ``.zarray`` and one chunk file per saved shard,
  named by its chunk-grid index (``0.1``; ``0`` for a scalar), the shard's bytes in C order;
* ``_METADATA`` (the tree: every leaf's keys and value type), ``_sharding`` (every array's
  sharding), ``_CHECKPOINT_METADATA`` and ``array_metadatas/process_N``, as orbax writes them;
* ``_dtenjax/checkpoint.json`` (the leaves, their shapes, dtypes and chunk grids, the I/O path
  and digest of the save) and ``_dtenjax/process_N.json`` (the chunks process N wrote, each with
  its size and one digest per block). orbax ignores this directory.

Key types (orbax's ``KeyType``): 1 a sequence index, 2 a dict key (attribute names of
NamedTuples and dataclasses are written as dict keys, as orbax does).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtenjax._src import errors

FORMAT = "dtenjax.checkpoint/1"
DTENJAX_DIR = "_dtenjax"
MANIFEST = "checkpoint.json"
MARKER = "dtenjax.format"    # in _CHECKPOINT_METADATA's custom_metadata: dtenjax wrote this
SEQUENCE, DICT = 1, 2
VALUE_TYPES = ("jax.Array", "np.ndarray", "scalar", "None")
RESERVED = ("_METADATA", "_sharding", "_CHECKPOINT_METADATA", "array_metadatas", DTENJAX_DIR)


def _key_of(entry: Any) -> tuple[str, int]:
  if isinstance(entry, jax.tree_util.SequenceKey):
    return str(entry.idx), SEQUENCE
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key), DICT
  if isinstance(entry, jax.tree_util.GetAttrKey):
    return str(entry.name), DICT
  if isinstance(entry, jax.tree_util.FlattenedIndexKey):
    return str(entry.key), SEQUENCE
  return str(entry), DICT


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One leaf of a saved tree: its keys, name (the directory), value type and array geometry."""
  keys: tuple[tuple[str, int], ...]
  value_type: str
  shape: tuple[int, ...] = ()
  dtype: str = ""
  chunks: tuple[int, ...] = ()

  @property
  def name(self) -> str:
    return ".".join(k for k, _ in self.keys)

  @property
  def grid(self) -> tuple[int, ...]:
    return tuple(math.ceil(s / c) if c else 0 for s, c in zip(self.shape, self.chunks))

  @property
  def np_dtype(self) -> np.dtype:
    return dtype_from_zarr(self.dtype)

  @property
  def chunk_nbytes(self) -> int:
    return int(np.prod(self.chunks, dtype=np.int64)) * self.np_dtype.itemsize

  def to_json(self) -> dict:
    return {"keys": [list(k) for k in self.keys], "value_type": self.value_type,
            "shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}

  @staticmethod
  def from_json(d: dict) -> "Leaf":
    return Leaf(tuple((str(k), int(t)) for k, t in d["keys"]), d["value_type"],
                tuple(d["shape"]), d["dtype"], tuple(d["chunks"]))


def chunk_file(index: Sequence[int]) -> str:
  """zarr v2's chunk key with ``.`` separators; ``0`` for a scalar."""
  return ".".join(str(i) for i in index) if len(index) else "0"


def is_empty(x: Any) -> bool:
  """``None`` or an empty container (optax's ``EmptyState()``, ``()``, ``{}``): orbax records
  each as a leaf of value type ``None``, and so does dtenjax."""
  return x is None or (isinstance(x, (tuple, list, dict)) and len(x) == 0)


def flatten(tree: Any) -> tuple[list[tuple[tuple[tuple[str, int], ...], Any]], Any]:
  """``[(keys, leaf)], treedef`` with ``None`` and empty containers kept as leaves."""
  pairs, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_empty)
  return [(tuple(_key_of(e) for e in path), leaf) for path, leaf in pairs], treedef


def check_names(keys: Sequence[tuple[tuple[str, int], ...]]) -> None:
  """Leaf names must be distinct directory names."""
  problems, seen = [], {}
  for k in keys:
    name = ".".join(s for s, _ in k)
    if not k:
      problems.append("the tree is a single leaf; save a dict such as {'x': x}")
    elif (any(not s or "/" in s or s.startswith(".") for s, _ in k)
          or (len(k) == 1 and k[0][0] in RESERVED)):
      problems.append(f"leaf {name!r}: a key is empty, contains '/', starts with '.' or is a "
                      "reserved file name; rename it")
    elif name in seen:
      problems.append(f"leaves {seen[name]} and {list(s for s, _ in k)} both map to the "
                      f"directory {name!r} (keys joined with '.'); rename one")
    else:
      seen[name] = [s for s, _ in k]
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        "this tree cannot be checkpointed:", problems))


# --- dtypes ------------------------------------------------------------------------------------------

def dtype_to_zarr(dtype: Any) -> str:
  """zarr v2's dtype string as tensorstore writes it: ``<f4``, ``|b1``; ``bfloat16`` and the
  other ml_dtypes types by name."""
  d = np.dtype(dtype)
  if d.kind == "V" or d.name in ("bfloat16",) or d.name.startswith(("float8", "float4", "int4",
                                                                      "uint4", "int2", "uint2")):
    return d.name
  return d.str


def dtype_from_zarr(text: str) -> np.dtype:
  try:
    return np.dtype(text)
  except TypeError:
    import ml_dtypes  # a dependency of jax
    if hasattr(ml_dtypes, text):
      return np.dtype(getattr(ml_dtypes, text))
    raise


def zarray(leaf: Leaf) -> dict:
  return {"chunks": list(leaf.chunks), "compressor": None, "dimension_separator": ".",
          "dtype": leaf.dtype, "fill_value": None, "filters": None, "order": "C",
          "shape": list(leaf.shape), "zarr_format": 2}


# --- orbax's metadata files ----------------------------------------------------------------------

def orbax_tree_metadata(leaves: Sequence[Leaf]) -> dict:
  tree = {}
  for leaf in leaves:
    value = {"value_type": leaf.value_type, "skip_deserialize": leaf.value_type == "None"}
    if leaf.value_type == "jax.Array":
      value["write_shape"] = list(leaf.chunks)
    tree[str(tuple(k for k, _ in leaf.keys))] = {
        "key_metadata": [{"key": k, "key_type": t} for k, t in leaf.keys],
        "value_metadata": value}
  return {"tree_metadata": tree, "use_ocdbt": False, "use_zarr3": False,
          "store_array_data_equal_to_fill_value": True, "custom_metadata": None}


def _spec_entry(e: Any) -> Any:
  if e is None or isinstance(e, str):
    return e
  return list(e)


def sharding_metadata(sharding: Any) -> dict | None:
  """orbax's description of a NamedSharding (None for other shardings: orbax then needs the
  sharding at restore, as dtenjax does)."""
  if isinstance(sharding, jax.sharding.SingleDeviceSharding):
    (device,) = sharding.device_set
    return {"sharding_type": "SingleDeviceSharding",
            "device_str": f"{device.platform}:{device.id}"}
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  mesh = sharding.mesh
  types = getattr(mesh, "axis_types", None) or ()
  ids = np.vectorize(lambda d: {"id": int(d.id)}, otypes=[object])(mesh.devices)
  return {"sharding_type": "NamedSharding", "shape": list(mesh.devices.shape),
          "axis_names": list(mesh.axis_names),
          "axis_types": [f"AxisType.{getattr(t, 'name', t)}" for t in types],
          "partition_spec": [_spec_entry(e) for e in sharding.spec],
          "device_mesh": {"mesh": ids.tolist()}}


def sharding_file(named: dict[str, dict]) -> str:
  return json.dumps({base64.b64encode(k.encode()).decode(): json.dumps(v)
                     for k, v in named.items()})


def sharding_from_metadata(meta: dict) -> jax.sharding.NamedSharding | None:
  """The saved sharding when every device it names exists here; else None."""
  by_id = {d.id: d for d in jax.devices()}
  if meta.get("sharding_type") == "SingleDeviceSharding":
    device = by_id.get(int(meta.get("device_str", ":-1").rpartition(":")[2] or -1))
    return jax.sharding.SingleDeviceSharding(device) if device is not None else None
  if meta.get("sharding_type") != "NamedSharding":
    return None
  ids = np.vectorize(lambda e: e["id"], otypes=[int])(np.array(meta["device_mesh"]["mesh"],
                                                               dtype=object))
  if not all(int(i) in by_id for i in ids.flat):
    return None
  devices = np.vectorize(lambda i: by_id[int(i)], otypes=[object])(ids)
  types = meta.get("axis_types") or []
  kw = {}
  if types:
    kinds = jax.sharding.AxisType
    kw["axis_types"] = tuple(getattr(kinds, t.split(".")[-1]) for t in types)
  mesh = jax.sharding.Mesh(devices, tuple(meta["axis_names"]), **kw)
  spec = jax.sharding.PartitionSpec(*[tuple(e) if isinstance(e, list) else e
                                      for e in meta["partition_spec"]])
  return jax.sharding.NamedSharding(mesh, spec)


def unflatten_like_orbax(leaves: Sequence[Leaf], values: Sequence[Any]) -> Any:
  """Nested dicts (key type 2) and lists (key type 1) from the leaves' keys, as orbax restores a
  tree without a target."""
  root: dict = {}
  kinds: dict[int, int] = {}
  for leaf, value in zip(leaves, values):
    node = root
    for depth, (k, t) in enumerate(leaf.keys):
      kinds[id(node)] = t
      if depth == len(leaf.keys) - 1:
        node[k] = value
      else:
        node = node.setdefault(k, {})

  def build(node):
    if not isinstance(node, dict) or id(node) not in kinds:
      return node
    if kinds[id(node)] == SEQUENCE:
      return [build(node[k]) for k in sorted(node, key=int)]
    return {k: build(v) for k, v in node.items()}
  return build(root)
