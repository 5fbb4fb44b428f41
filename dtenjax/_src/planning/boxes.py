"""Flax partitioning metadata: which leaves are boxed, and the mesh PartitionSpec their names give.

A leaf boxed by ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` (linen) or an
``nnx.Variable`` with ``out_sharding`` is laid out by its names, mapped to mesh axes with flax's own
functions (``nn.logical_to_mesh_axes`` for logical boxes: rules in priority order, unmatched names
replicated; renaming for the others) and the rules of the box, of the caller (``rules=``) or of
flax's ``nn.logical_axis_rules`` context, in that order. A box can only come from flax, so flax is
imported (lazily) only once a box has been seen. Used by placements (``dtenjax.shard``) and the
whole-step planner (boxed leaves are pinned).
"""

from __future__ import annotations

import contextlib
import sys

from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.planning import mesh as mesh_lib


def box_kind(x) -> str | None:
  """"logical" (linen LogicallyPartitioned), "mesh" (linen Partitioned), "nnx" (an nnx.Variable
  with out_sharding), or None for anything else."""
  meta = sys.modules.get("flax.core.meta")
  if meta is not None and isinstance(x, meta.Partitioned):
    spmd = sys.modules.get("flax.linen.spmd")
    if spmd is not None and isinstance(x, spmd.LogicallyPartitioned):
      return "logical"
    return "mesh"
  variablelib = sys.modules.get("flax.nnx.variablelib")
  if variablelib is not None and isinstance(x, variablelib.Variable):
    if x.get_metadata().get("out_sharding"):
      return "nnx"
  return None


def is_box(x) -> bool:
  return box_kind(x) is not None


def box_value(box):
  return box.value if box_kind(box) != "nnx" else box.get_value()


def rebox(box, value):
  return box.replace(value) if box_kind(box) == "nnx" else box.replace_boxed(value)


@contextlib.contextmanager
def flax_rules(rules):
  """flax's logical_axis_rules context with ``rules`` (when given) in front of the current ones."""
  if rules is None:
    yield
    return
  from flax.core import spmd
  with spmd.logical_axis_rules(tuple(rules) + tuple(spmd.get_logical_axis_rules())):
    yield


def box_spec(box, mesh: Mesh, rules, where: str) -> P:
  """The mesh PartitionSpec flax's metadata gives ``box`` on ``mesh``."""
  kind = box_kind(box)
  from flax.core import spmd as core_spmd
  with flax_rules(rules):
    if kind == "logical":
      from flax.linen import spmd
      names = tuple(box.names)
      if not (box.rules or core_spmd.get_logical_axis_rules()) and any(
          isinstance(n, str) and n not in mesh.axis_names for n in names):
        raise errors.PlacementError(
            f"{where} carries flax logical axis names {names} but no logical axis rules are "
            "known, so flax would replicate it: pass Placement(..., rules=(('embed', 'data'), "
            f"...)) or wrap the call in flax.linen.logical_axis_rules(...); mesh axes: "
            f"{tuple(mesh.axis_names)}")
      spec = spmd.logical_to_mesh_axes(names, box.rules)
    elif kind == "nnx":
      from flax.nnx import spmd
      spec = spmd.get_var_pspec(box)
    else:
      names = box.get_partition_spec()
      if core_spmd.get_logical_axis_rules():
        names = core_spmd.apply_rules(names, None)
      spec = P(*names)
  unknown = sorted(mesh_lib._spec_axes(spec) - set(mesh.axis_names), key=str)
  if unknown:
    raise errors.PlacementError(
        f"{where} carries flax partitioning names that map to {spec}, but mesh "
        f"{dict(mesh.shape)} has no axes {unknown}"
        f"{''.join(mesh_lib.suggest_axis(a, mesh.axis_names) for a in unknown)}: give rules "
        "mapping these names to mesh axes (Placement(..., rules=...) or "
        "flax.linen.logical_axis_rules), or name mesh axes in the box")
  return spec


