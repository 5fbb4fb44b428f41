"""The serialized ``xla.HloModuleProto`` read with Google's ``protobuf`` runtime.

jaxlib ships no Python classes for XLA's messages, and generating them would need ``protoc`` at
build time. So :data:`SCHEMA` declares the part of ``xla/service/hlo.proto`` and
``xla/xla_data.proto`` that dtenjax reads: those messages, and of each only the fields it reads,
with XLA's own field numbers and types (numbers are the wire contract and never change meaning;
names only label them here). :func:`message_class` builds a ``FileDescriptorProto`` from the table,
adds it to a private descriptor pool and takes the message class from
``message_factory.GetMessageClass``; protobuf then decodes the whole buffer (in C with its upb
backend) and skips every field the table does not declare. A buffer that does not decode raises
:class:`~.records.HloReadError`.

Replica groups come from whichever of XLA's encodings the instruction carries: explicit lists
(``collective_device_list``, or the legacy ``replica_groups``), an iota list
(``iota_collective_device_list``) or mesh axes (``mesh_axes_replica_group_list``, whose mesh lists
its devices, gives them as a transposed iota, or leaves them in order). The iota list that once
sat inside ``collective_device_list`` (its field 2) is reserved in XLA's schema since before jax
0.10.2 and is not read.
"""

from __future__ import annotations

import functools
import math

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory

from dtenjax._src.hlo.groups import iota_groups, mesh_axes_groups
from dtenjax._src.hlo.records import (PRIMITIVE_TYPES, Computation, HloReadError, Instruction,
                                      Module, Shape, known_trip_count)

# message -> fields as (name, number, type[, oneof]); a type is a scalar, "PrimitiveType" (XLA's
# enum) or a message of this table, "*" in front for a repeated field. A dotted message is nested
# in the one before the dot. Every number and type is XLA's (hlo.proto, xla_data.proto).
SCHEMA: dict[str, tuple[tuple, ...]] = {
    # hlo.proto
    "HloModuleProto": (
        ("name", 1, "string"), ("entry_computation_name", 2, "string"),
        ("computations", 3, "*HloComputationProto"), ("entry_computation_id", 6, "int64"),
        ("schedule", 7, "HloScheduleProto"),
        ("device_assignment", 15, "DeviceAssignmentProto")),
    "HloComputationProto": (
        ("name", 1, "string"), ("instructions", 2, "*HloInstructionProto"), ("id", 5, "int64"),
        ("is_fusion_computation", 7, "bool")),
    # `map<int64, InstructionSequence> sequences = 1`: a map is this repeated entry on the wire.
    "HloScheduleProto": (("sequences", 1, "*HloScheduleProto.SequencesEntry"),),
    "HloScheduleProto.InstructionSequence": (("instruction_ids", 1, "*int64"),),
    "HloScheduleProto.SequencesEntry": (
        ("key", 1, "int64"), ("value", 2, "HloScheduleProto.InstructionSequence")),
    "HloInstructionProto": (
        ("name", 1, "string"), ("opcode", 2, "string"), ("shape", 3, "ShapeProto"),
        ("metadata", 7, "OpMetadata"), ("fusion_kind", 11, "string"),
        ("dimensions", 14, "*int64"), ("channel_id", 26, "int64"),
        ("custom_call_target", 28, "string"), ("id", 35, "int64"),
        ("operand_ids", 36, "*int64"), ("called_computation_ids", 38, "*int64"),
        ("replica_groups", 49, "*ReplicaGroup"), ("source_target_pairs", 52, "*SourceTarget"),
        ("backend_config", 43, "bytes"), ("use_global_device_ids", 71, "bool"),
        ("collective_device_list", 87, "CollectiveDeviceListProto", "replica_group_list"),
        ("iota_collective_device_list", 92, "IotaReplicaGroupListProto", "replica_group_list"),
        ("mesh_axes_replica_group_list", 93, "MeshAxesReplicaGroupListProto",
         "replica_group_list")),
    # xla_data.proto
    "ShapeProto": (
        ("element_type", 2, "PrimitiveType"), ("dimensions", 3, "*int64"),
        ("tuple_shapes", 4, "*ShapeProto")),
    "OpMetadata": (("op_name", 2, "string"),),
    "ReplicaGroup": (("replica_ids", 1, "*int64"),),
    "SourceTarget": (("source", 1, "int64"), ("target", 2, "int64")),
    "CollectiveDeviceListProto": (("replica_groups", 1, "*ReplicaGroup"),),
    "IotaReplicaGroupListProto": (
        ("num_replica_groups", 1, "int64"), ("num_devices_per_group", 2, "int64"),
        ("iota_reshape_dims", 3, "*int64"), ("iota_transpose_perm", 4, "*int32")),
    "MeshProto": (
        ("axes", 1, "*MeshProto.MeshAxis"), ("device_ids", 2, "*int64"),
        ("iota_transform", 3, "MeshProto.IotaTransform")),
    "MeshProto.MeshAxis": (("size", 2, "int64"),),
    "MeshProto.IotaTransform": (
        ("reshape_dims", 1, "*int64"), ("transpose_perm", 2, "*int64")),
    "AxisRefProto": (
        ("mesh_axis_index", 1, "int64"), ("sub_axis_info", 2, "AxisRefProto.SubAxis")),
    "AxisRefProto.SubAxis": (("pre_size", 1, "int64"), ("size", 2, "int64")),
    "MeshAxesReplicaGroupListProto": (
        ("mesh", 1, "MeshProto"), ("axes", 2, "*AxisRefProto")),
    "DeviceAssignmentProto": (
        ("computation_devices", 3, "*DeviceAssignmentProto.ComputationDevice"),),
    "DeviceAssignmentProto.ComputationDevice": (("replica_device_ids", 1, "*int64"),),
}

_F = descriptor_pb2.FieldDescriptorProto
_SCALARS = {"string": _F.TYPE_STRING, "int64": _F.TYPE_INT64, "int32": _F.TYPE_INT32,
            "bool": _F.TYPE_BOOL, "bytes": _F.TYPE_BYTES}


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
  """:data:`SCHEMA` as a proto3 file of package ``xla``."""
  f = descriptor_pb2.FileDescriptorProto(name="dtenjax/xla_hlo_subset.proto", package="xla",
                                         syntax="proto3")
  # xla.PrimitiveType: proto3 enums are open, so every number reads as itself; the numbers
  # dtenjax knows are records.PRIMITIVE_TYPES. Proto3 asks only for the zero value.
  f.enum_type.add(name="PrimitiveType").value.add(name="PRIMITIVE_TYPE_INVALID", number=0)
  built: dict[str, descriptor_pb2.DescriptorProto] = {}
  for full, fields in SCHEMA.items():
    outer, _, name = full.rpartition(".")
    msg = (built[outer].nested_type if outer else f.message_type).add(name=name)
    built[full] = msg
    oneofs: dict[str, int] = {}
    for fname, number, kind, *oneof in fields:
      fd = msg.field.add(name=fname, number=number, json_name=fname,
                         label=_F.LABEL_REPEATED if kind.startswith("*") else _F.LABEL_OPTIONAL)
      kind = kind.lstrip("*")
      if kind in _SCALARS:
        fd.type = _SCALARS[kind]
      else:
        fd.type = _F.TYPE_ENUM if kind == "PrimitiveType" else _F.TYPE_MESSAGE
        fd.type_name = ".xla." + kind
      if oneof:
        if oneof[0] not in oneofs:
          oneofs[oneof[0]] = len(msg.oneof_decl)
          msg.oneof_decl.add(name=oneof[0])
        fd.oneof_index = oneofs[oneof[0]]
  return f


@functools.cache
def message_class(name: str = "HloModuleProto") -> type[message.Message]:
  """The protobuf class of ``xla.<name>`` (a message of :data:`SCHEMA`)."""
  pool = descriptor_pool.DescriptorPool()   # private: no clash with XLA's own files elsewhere
  pool.AddSerializedFile(file_descriptor().SerializeToString())
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("xla." + name))


def _shape(s, seen: dict) -> Shape:
  """One Shape record per distinct array shape of a module (``seen`` holds them)."""
  et = s.element_type
  name = PRIMITIVE_TYPES.get(et, (f"type{et}", 0))[0]
  if name == "tuple":
    return Shape("tuple", (), tuple(_shape(e, seen) for e in s.tuple_shapes))
  key = (name, tuple(s.dimensions))
  shape = seen.get(key)
  if shape is None:
    shape = seen[key] = Shape(*key)
  return shape


def _groups(im) -> tuple[tuple[tuple[int, ...], ...] | None, str]:
  """Replica groups of one instruction, from whichever encoding it carries."""
  which = im.WhichOneof("replica_group_list")
  if which == "mesh_axes_replica_group_list":
    g = im.mesh_axes_replica_group_list
    sizes = [a.size for a in g.mesh.axes]
    devices = list(g.mesh.device_ids)
    if g.mesh.HasField("iota_transform"):      # devices: iota over reshape_dims, transposed
      t = g.mesh.iota_transform
      dims = list(t.reshape_dims)
      devices = list(iota_groups(1, math.prod(dims), dims, t.transpose_perm)[0])
    axes = [(a.mesh_axis_index,
             (a.sub_axis_info.pre_size, a.sub_axis_info.size)
             if a.HasField("sub_axis_info") else None) for a in g.axes]
    return mesh_axes_groups(sizes, devices, axes), "mesh"
  if which == "iota_collective_device_list":
    i = im.iota_collective_device_list
    return iota_groups(i.num_replica_groups, i.num_devices_per_group, i.iota_reshape_dims,
                       i.iota_transpose_perm), "iota"
  if which == "collective_device_list":
    groups = tuple(tuple(g.replica_ids) for g in im.collective_device_list.replica_groups)
    return groups, "list" if groups else ""
  if im.replica_groups:
    return tuple(tuple(g.replica_ids) for g in im.replica_groups), "list"
  return None, ""


def parse_proto(data: bytes) -> Module:
  """Reads a serialized ``xla.HloModuleProto`` into a :class:`Module`."""
  mod = message_class()()
  try:
    mod.ParseFromString(bytes(data))
  except message.DecodeError as e:
    raise HloReadError(
        f"the {len(data)} bytes given are not a serialized xla.HloModuleProto ({e}); pass the "
        "bytes of as_serialized_hlo_module_proto() of a compiled module, unchanged") from None
  comp_name = {c.id: c.name for c in mod.computations}
  schedule = {e.key: list(e.value.instruction_ids) for e in mod.schedule.sequences}
  by_id: dict[int, tuple[str, Shape]] = {}
  shapes: dict = {}
  for c in mod.computations:
    for im in c.instructions:
      by_id[im.id] = (im.name, _shape(im.shape, shapes))
  computations = {}
  for c in mod.computations:
    records = []
    for im in c.instructions:
      operand_ids = list(im.operand_ids)
      missing = [o for o in operand_ids if o not in by_id]
      if missing:
        raise HloReadError(f"instruction {im.name!r} names operand ids {missing} that no "
                           "instruction of the module has")
      groups, form = _groups(im)
      name, shape = by_id[im.id]
      records.append((im.id, Instruction(
          name=name, opcode=im.opcode, shape=shape, computation=c.name,
          operands=tuple(by_id[o][0] for o in operand_ids),
          operand_shapes=tuple(by_id[o][1] for o in operand_ids),
          called=tuple(comp_name.get(k, str(k)) for k in im.called_computation_ids),
          fusion_kind=im.fusion_kind, custom_call_target=im.custom_call_target,
          channel_id=im.channel_id or None, use_global_device_ids=im.use_global_device_ids,
          replica_groups=groups, group_form=form,
          source_target_pairs=tuple((p.source, p.target) for p in im.source_target_pairs),
          dimensions=tuple(im.dimensions), op_name=im.metadata.op_name, id=im.id,
          trip_count=(known_trip_count(im.backend_config) if im.opcode == "while"
                      else None))))
    if c.id in schedule:
      pos = {iid: k for k, iid in enumerate(schedule[c.id])}
      records.sort(key=lambda r: pos.get(r[0], len(pos)))
    computations[c.name] = Computation(c.name, tuple(r for _, r in records),
                                       c.is_fusion_computation, c.id)
  entry = mod.entry_computation_name or comp_name.get(mod.entry_computation_id, "")
  assignment: tuple[tuple[int, ...], ...] = ()
  per_partition = [list(d.replica_device_ids) for d in mod.device_assignment.computation_devices]
  if per_partition and all(per_partition):
    reps = len(per_partition[0])
    assignment = tuple(tuple(p[r] for p in per_partition) for r in range(reps))
  reps = len(assignment) if assignment else 1
  parts = len(assignment[0]) if assignment else 1
  return Module(mod.name, entry, computations, "proto", assignment, reps, parts)
