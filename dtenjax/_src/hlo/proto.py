"""The serialized ``xla.HloModuleProto`` read from the protobuf wire format.

jaxlib ships no Python classes for that message, so :func:`parse_proto` decodes the wire format
directly and reads only the fields it needs, by their field numbers in ``xla/service/hlo.proto``
and ``xla/xla_data.proto`` (field numbers are a wire contract and never change meaning). Replica
groups come from whichever of XLA's three encodings the instruction carries: explicit lists
(``collective_device_list``, or the legacy ``replica_groups``), an iota list
(``iota_collective_device_list``) or mesh axes (``mesh_axes_replica_group_list``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dtenjax._src.hlo.groups import iota_groups, mesh_axes_groups
from dtenjax._src.hlo.records import (PRIMITIVE_TYPES, Computation, HloReadError, Instruction,
                                      Module, Shape)


def _varint(buf: bytes, i: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    if i >= len(buf):
      raise HloReadError("truncated varint in the serialized HLO module")
    b = buf[i]
    i += 1
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result, i
    shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
  """(field number, wire type, value) of each field of one message."""
  i, n = 0, len(buf)
  while i < n:
    key, i = _varint(buf, i)
    field, wire = key >> 3, key & 7
    if wire == 0:
      value, i = _varint(buf, i)
    elif wire == 2:
      length, i = _varint(buf, i)
      value = buf[i:i + length]
      i += length
    elif wire == 1:
      value = buf[i:i + 8]
      i += 8
    elif wire == 5:
      value = buf[i:i + 4]
      i += 4
    else:
      raise HloReadError(f"wire type {wire} of field {field} is not valid protobuf")
    if i > n:
      raise HloReadError(f"field {field} runs past the end of its message")
    yield field, wire, value


def _signed(v: int) -> int:
  return v - (1 << 64) if v >= 1 << 63 else v


def _ints(wire: int, value) -> list[int]:
  """A repeated integer field's values, packed or not."""
  if wire == 0:
    return [_signed(value)]
  out, i = [], 0
  while i < len(value):
    v, i = _varint(value, i)
    out.append(_signed(v))
  return out


def _msg(buf: bytes) -> dict[int, list[tuple[int, Any]]]:
  out: dict[int, list[tuple[int, Any]]] = {}
  for f, w, v in _fields(buf):
    out.setdefault(f, []).append((w, v))
  return out


def _one(m, field, default=None):
  vals = m.get(field)
  return vals[-1][1] if vals else default


def _rep_ints(m, field) -> list[int]:
  return [x for w, v in m.get(field, ()) for x in _ints(w, v)]


def _str(b) -> str:
  return bytes(b).decode("utf-8", "replace") if b is not None else ""


def _proto_shape(buf: bytes) -> Shape:
  m = _msg(buf)
  et = _one(m, 2, 0)
  name = PRIMITIVE_TYPES.get(et, (f"type{et}", 0))[0]
  if name == "tuple":
    return Shape("tuple", (), tuple(_proto_shape(v) for _, v in m.get(4, ())))
  return Shape(name, tuple(_rep_ints(m, 3)))


def _proto_groups(m) -> tuple[tuple[tuple[int, ...], ...] | None, str]:
  """Replica groups of one instruction message, from whichever encoding it carries."""
  if 93 in m:                                  # mesh_axes_replica_group_list
    mm = _msg(_one(m, 93))
    mesh = _msg(_one(mm, 1, b""))
    sizes = [_one(_msg(v), 2, 0) for _, v in mesh.get(1, ())]
    device_ids = _rep_ints(mesh, 2)
    axes = []
    for _, v in mm.get(2, ()):
      a = _msg(v)
      sub = _one(a, 2)
      if sub is not None:
        s = _msg(sub)
        axes.append((_one(a, 1, 0), (_one(s, 1, 0), _one(s, 2, 0))))
      else:
        axes.append((_one(a, 1, 0), None))
    return mesh_axes_groups(sizes, device_ids, axes), "mesh"
  if 92 in m:                                  # iota_collective_device_list
    return _proto_iota(_msg(_one(m, 92))), "iota"
  if 87 in m:                                  # collective_device_list
    cdl = _msg(_one(m, 87))
    if 2 in cdl:
      return _proto_iota(_msg(_one(cdl, 2))), "iota"
    groups = tuple(tuple(_rep_ints(_msg(v), 1)) for _, v in cdl.get(1, ()))
    return groups, "list" if groups else ""
  if 49 in m:                                  # replica_groups (legacy)
    return tuple(tuple(_rep_ints(_msg(v), 1)) for _, v in m[49]), "list"
  return None, ""


def _proto_iota(im) -> tuple[tuple[int, ...], ...]:
  return iota_groups(_one(im, 1, 0), _one(im, 2, 0), _rep_ints(im, 3), _rep_ints(im, 4))


def parse_proto(data: bytes) -> Module:
  """Reads a serialized ``xla.HloModuleProto`` into a :class:`Module`."""
  mod = _msg(bytes(data))
  comps_raw = []
  for _, cbuf in mod.get(3, ()):
    cm = _msg(cbuf)
    comps_raw.append((_str(_one(cm, 1)), _one(cm, 5, 0), bool(_one(cm, 7, 0)),
                      [_msg(v) for _, v in cm.get(2, ())]))
  comp_name = {cid: name for name, cid, _, _ in comps_raw}
  schedule: dict[int, list[int]] = {}
  sched = _one(mod, 7)
  if sched is not None:
    for _, entry in _msg(sched).get(1, ()):
      em = _msg(entry)
      seq = _one(em, 2)
      schedule[_one(em, 1, 0)] = _rep_ints(_msg(seq), 1) if seq is not None else []
  by_id: dict[int, tuple[str, Shape]] = {}
  for _, _, _, instrs in comps_raw:
    for im in instrs:
      by_id[_one(im, 35, 0)] = (_str(_one(im, 1)), _proto_shape(_one(im, 3, b"")))
  computations = {}
  for name, cid, is_fusion, instrs in comps_raw:
    records = []
    for im in instrs:
      groups, form = _proto_groups(im)
      operand_ids = _rep_ints(im, 36)
      missing = [o for o in operand_ids if o not in by_id]
      if missing:
        raise HloReadError(f"instruction {_str(_one(im, 1))!r} names operand ids {missing} that "
                           "no instruction of the module has")
      meta = _one(im, 7)
      channel = _one(im, 26, 0)
      records.append((_one(im, 35, 0), Instruction(
          name=_str(_one(im, 1)), opcode=_str(_one(im, 2)),
          shape=_proto_shape(_one(im, 3, b"")), computation=name,
          operands=tuple(by_id[o][0] for o in operand_ids),
          operand_shapes=tuple(by_id[o][1] for o in operand_ids),
          called=tuple(comp_name.get(c, str(c)) for c in _rep_ints(im, 38)),
          fusion_kind=_str(_one(im, 11)), custom_call_target=_str(_one(im, 28)),
          channel_id=_signed(channel) if channel else None,
          use_global_device_ids=bool(_one(im, 71, 0)), replica_groups=groups, group_form=form,
          source_target_pairs=tuple((_one(p, 1, 0), _one(p, 2, 0))
                                    for p in (_msg(v) for _, v in im.get(52, ()))),
          dimensions=tuple(_rep_ints(im, 14)),
          op_name=_str(_one(_msg(meta), 2)) if meta is not None else "",
          id=_one(im, 35, 0))))
    if cid in schedule:
      pos = {iid: k for k, iid in enumerate(schedule[cid])}
      records.sort(key=lambda r: pos.get(r[0], len(pos)))
    computations[name] = Computation(name, tuple(r for _, r in records), is_fusion, cid)
  entry = _str(_one(mod, 2)) or comp_name.get(_one(mod, 6, 0), "")
  assignment: tuple[tuple[int, ...], ...] = ()
  da = _one(mod, 15)
  if da is not None:
    dm = _msg(da)
    per_partition = [_rep_ints(_msg(v), 1) for _, v in dm.get(3, ())]
    if per_partition and all(per_partition):
      reps = len(per_partition[0])
      assignment = tuple(tuple(p[r] for p in per_partition) for r in range(reps))
  reps = len(assignment) if assignment else 1
  parts = len(assignment[0]) if assignment else 1
  return Module(_str(_one(mod, 1)), entry, computations, "proto", assignment, reps, parts)
