"""One reader of compiled XLA HLO: structured records for ``explain`` and ``graph_report``.

The compiled executable's optimised module is read from XLA's own structured form where jax
exposes it: ``compiled.runtime_executable().hlo_modules()[i].as_serialized_hlo_module_proto()``
(jax 0.10.2 and 0.11.x) is an ``xla.HloModuleProto``. jaxlib ships no Python classes for that
message, so :func:`parse_proto` decodes the protobuf wire format directly and reads only the
fields it needs, by their field numbers in ``xla/service/hlo.proto`` and ``xla/xla_data.proto``
(field numbers are a wire contract and never change meaning). Replica groups come from whichever
of XLA's three encodings the instruction carries: explicit lists (``collective_device_list``, or
the legacy ``replica_groups``), an iota list (``iota_collective_device_list``: reshape, transpose,
split into groups) or mesh axes (``mesh_axes_replica_group_list``: a named mesh and the axes the
collective spans, printed as ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``).

Where only text is available, :func:`parse_text` reads the printed module with a tokenizer (shapes
with ``/*index=5*/`` comments, nested tuples, layouts, the three replica-group forms) and returns
the same records. It refuses, naming the line, an instruction it cannot read instead of skipping
it.

Records: :class:`Shape`, :class:`Instruction`, :class:`Computation`, :class:`Module` and, from
:meth:`Module.collectives`, :class:`Collective` (kind, operand and result shapes, bytes per
participant, replica groups as lists of logical ids, channel id, the async start/done pair).
:meth:`Module.device_groups` turns logical ids into device ids through the module's device
assignment.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dtenjax._src import errors


class HloReadError(errors.DtenjaxError, ValueError):
  """Compiled HLO could not be read (an unknown form, or a field that does not decode)."""


# --------------------------------------------------------------------------------------------
# Element types: xla.PrimitiveType numbers, their text names and widths in bits
# --------------------------------------------------------------------------------------------

_PRIMITIVES = {
    1: ("pred", 8), 2: ("s8", 8), 3: ("s16", 16), 4: ("s32", 32), 5: ("s64", 64),
    6: ("u8", 8), 7: ("u16", 16), 8: ("u32", 32), 9: ("u64", 64), 10: ("f16", 16),
    11: ("f32", 32), 12: ("f64", 64), 13: ("tuple", 0), 14: ("opaque", 0), 15: ("c64", 64),
    16: ("bf16", 16), 17: ("token", 0), 18: ("c128", 128), 19: ("f8e5m2", 8),
    20: ("f8e4m3fn", 8), 21: ("s4", 4), 22: ("u4", 4), 23: ("f8e4m3b11fnuz", 8),
    24: ("f8e5m2fnuz", 8), 25: ("f8e4m3fnuz", 8), 26: ("s2", 2), 27: ("u2", 2),
    28: ("f8e4m3", 8), 29: ("f8e3m4", 8), 30: ("s1", 1), 31: ("u1", 1), 32: ("f4e2m1fn", 4),
    33: ("f8e8m0fnu", 8), 34: ("buffer", 0),
}
BITS = {name: bits for name, bits in _PRIMITIVES.values()}

# Collective opcodes and the kind name explain reports them as.
COLLECTIVE_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "ppermute",
    "collective-broadcast": "collective_broadcast",
    "ragged-all-to-all": "ragged_all_to_all",
}
_STARTS = {f"{op}-start": op for op in COLLECTIVE_KINDS}
_DONES = {f"{op}-done" for op in COLLECTIVE_KINDS} | {"async-done"}
# dtenjax's custom calls that are collectives (the others, such as the top-k pack kernel, are local
# work and not listed by ``collectives``); tests/test_explain.py checks it against the targets.
COLLECTIVE_TARGETS = ("dtenjax_p2p_all_reduce", "dtenjax_host_all_reduce")


@dataclasses.dataclass(frozen=True)
class Shape:
  """An HLO shape: an array (``dtype`` and ``dims``) or a tuple of shapes (``dtype == 'tuple'``)."""
  dtype: str
  dims: tuple[int, ...] = ()
  elements: tuple[Shape, ...] = ()

  @property
  def is_tuple(self) -> bool:
    return self.dtype == "tuple"

  def leaves(self) -> tuple[Shape, ...]:
    if not self.is_tuple:
      return (self,)
    return tuple(leaf for e in self.elements for leaf in e.leaves())

  @property
  def nbytes(self) -> int:
    """Bytes of every array leaf (tokens and opaque values count 0)."""
    return sum(math.ceil(BITS.get(s.dtype, 0) * math.prod(s.dims) / 8) for s in self.leaves())

  def __str__(self) -> str:
    if self.is_tuple:
      return "(" + ", ".join(str(e) for e in self.elements) + ")"
    return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One HLO instruction, as the compiled module holds it."""
  name: str
  opcode: str
  shape: Shape
  computation: str
  operands: tuple[str, ...] = ()
  operand_shapes: tuple[Shape, ...] = ()
  called: tuple[str, ...] = ()            # computations it calls (fusion body, loop body, ...)
  fusion_kind: str = ""                   # kLoop, kInput, kOutput, kCustom for fusions
  custom_call_target: str = ""
  channel_id: int | None = None
  use_global_device_ids: bool = False
  replica_groups: tuple[tuple[int, ...], ...] | None = None   # logical ids; () = all
  group_form: str = ""                    # "list", "iota", "mesh", or "" when none is given
  source_target_pairs: tuple[tuple[int, int], ...] = ()
  dimensions: tuple[int, ...] = ()
  op_name: str = ""
  id: int = 0


@dataclasses.dataclass(frozen=True)
class Computation:
  name: str
  instructions: tuple[Instruction, ...]   # in schedule order where the module is scheduled
  is_fusion: bool = False
  id: int = 0

  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective the executable runs (an async start/done pair counts once)."""
  kind: str                         # all_reduce, all_gather, ..., or "custom:<target>"
  name: str                         # the instruction (the start of an async pair)
  computation: str                  # where it is scheduled (the entry, a loop body, ...)
  operand_shapes: tuple[Shape, ...]
  result_shape: Shape
  nbytes: int                       # bytes per participant (see :func:`collective_bytes`)
  replica_groups: tuple[tuple[int, ...], ...]   # logical ids; () = every participant
  group_form: str
  source_target_pairs: tuple[tuple[int, int], ...] = ()
  channel_id: int | None = None
  use_global_device_ids: bool = False
  done: str = ""                    # the matching -done instruction of an async pair
  op_name: str = ""

  @property
  def is_async(self) -> bool:
    return bool(self.done)

  @property
  def dtype(self) -> str:
    dts = {s.dtype for shp in self.operand_shapes for s in shp.leaves()}
    return dts.pop() if len(dts) == 1 else ("mixed" if dts else "?")


@dataclasses.dataclass(frozen=True)
class Module:
  """A compiled HLO module: computations, the entry, and how logical ids map to devices."""
  name: str
  entry: str
  computations: dict[str, Computation]
  source: str                                   # "proto" or "text"
  # device_assignment[replica][partition] = device id; empty when the module does not say.
  device_assignment: tuple[tuple[int, ...], ...] = ()
  num_replicas: int = 1
  num_partitions: int = 1

  def instructions(self) -> Iterator[Instruction]:
    for comp in self.computations.values():
      yield from comp.instructions

  def callers(self) -> dict[str, list[Instruction]]:
    """{computation name: the instructions that call it}."""
    out: dict[str, list[Instruction]] = {}
    for ins in self.instructions():
      for c in ins.called:
        out.setdefault(c, []).append(ins)
    return out

  def fusion_of(self) -> dict[str, str]:
    """{fusion computation name: the fusion instruction that runs it}."""
    return {c: ins.name for ins in self.instructions() if ins.opcode == "fusion"
            for c in ins.called}

  def roles(self) -> dict[str, tuple[str, str]]:
    """{computation: (role, the instruction that runs it)} for every called computation.

    The role is "fusion" (a fusion's body), "command_buffer" (a command buffer XLA outlined into
    the HLO, run by a ``call``), "async" (run by an ``async-start``), or the caller's opcode
    ("while", "conditional", "call", "all-reduce" for its reducer, ...). The entry has no role.
    """
    out: dict[str, tuple[str, str]] = {}
    for ins in self.instructions():
      for c in ins.called:
        if c.startswith("command_buffer"):
          role = "command_buffer"
        elif ins.opcode == "async-start":
          role = "async"
        else:
          role = ins.opcode
        out.setdefault(c, (role, ins.name))
    return out

  def collectives(self, custom_targets: tuple[str, ...] = COLLECTIVE_TARGETS
                  ) -> tuple[Collective, ...]:
    """Every collective, including the custom calls named in ``custom_targets``.

    Synchronous collectives, ``<op>-start``/``<op>-done`` pairs and ``async-start`` wrappers
    around a collective each give one record, in schedule order of their computation (the entry
    first). Computations run by an ``async-start`` are reported at the start, not again.
    """
    wrapped = {c for ins in self.instructions() if ins.opcode == "async-start" for c in ins.called}
    done_of = {}
    for ins in self.instructions():
      if ins.opcode in _DONES and ins.operands:
        done_of[ins.operands[0]] = ins.name
    order = [self.entry] + [c for c in self.computations if c != self.entry]
    out = []
    for cname in order:
      comp = self.computations.get(cname)
      if comp is None or cname in wrapped or comp.is_fusion:
        continue
      for ins in comp.instructions:
        rec = self._collective(ins, done_of, custom_targets)
        if rec is not None:
          out.append(rec)
    return tuple(out)

  def _collective(self, ins: Instruction, done_of: dict[str, str],
                  custom_targets: tuple[str, ...]) -> Collective | None:
    base, inner = None, ins
    if ins.opcode in COLLECTIVE_KINDS:
      base = ins.opcode
    elif ins.opcode in _STARTS:
      base = _STARTS[ins.opcode]
    elif ins.opcode == "async-start":
      for c in ins.called:
        for cand in self.computations[c].instructions if c in self.computations else ():
          if cand.opcode in COLLECTIVE_KINDS:
            base, inner = cand.opcode, cand
            break
        if base:
          break
      if base is None:
        return None
    elif ins.opcode == "custom-call" and ins.custom_call_target in custom_targets:
      return Collective(
          kind="custom:" + ins.custom_call_target, name=ins.name, computation=ins.computation,
          operand_shapes=ins.operand_shapes, result_shape=ins.shape,
          nbytes=sum(s.nbytes for s in ins.operand_shapes), replica_groups=(), group_form="",
          done=done_of.get(ins.name, ""), op_name=ins.op_name)
    else:
      return None
    shapes = inner.operand_shapes if inner is not ins else ins.operand_shapes
    return Collective(
        kind=COLLECTIVE_KINDS[base], name=ins.name, computation=ins.computation,
        operand_shapes=shapes, result_shape=inner.shape,
        nbytes=collective_bytes(base, shapes, inner.replica_groups or (), self.group_size(inner)),
        replica_groups=inner.replica_groups or (), group_form=inner.group_form,
        source_target_pairs=inner.source_target_pairs, channel_id=inner.channel_id,
        use_global_device_ids=inner.use_global_device_ids, done=done_of.get(ins.name, ""),
        op_name=inner.op_name or ins.op_name)

  def group_size(self, ins: Instruction) -> int:
    """Participants per group of a collective instruction."""
    if ins.replica_groups:
      return len(ins.replica_groups[0])
    if ins.use_global_device_ids:
      return self.num_replicas * self.num_partitions
    return self.num_partitions if ins.channel_id else self.num_replicas

  def device_groups(self, c: Collective | Instruction,
                    device_assignment: Sequence[Sequence[int]] | None = None
                    ) -> tuple[tuple[int, ...], ...]:
    """The groups of device ids a collective spans (pairs for a collective-permute).

    Logical ids are read the way XLA's collective modes define them: flattened ids
    (``use_global_device_ids``) are ``replica * num_partitions + partition``; with a channel id
    and no global ids, groups list partitions (one set per replica); without a channel id they
    list replicas (one set per partition). ``device_assignment[replica][partition]`` defaults to
    the module's own.
    """
    da = [list(r) for r in (device_assignment or self.device_assignment)]
    if not da:
      da = [list(range(r * self.num_partitions, (r + 1) * self.num_partitions))
            for r in range(self.num_replicas)]
    reps, parts = len(da), len(da[0])
    cross_partition = c.channel_id is not None and c.channel_id > 0

    def dev(r: int, p: int) -> int:
      return da[r][p]

    if isinstance(c, Collective) and c.kind == "ppermute" or (
        isinstance(c, Instruction) and c.opcode.startswith("collective-permute")):
      pairs = []
      if cross_partition:
        for r in range(reps):
          pairs.extend((dev(r, s), dev(r, t)) for s, t in c.source_target_pairs)
      else:
        for p in range(parts):
          pairs.extend((dev(s, p), dev(t, p)) for s, t in c.source_target_pairs)
      return tuple(pairs)
    groups = c.replica_groups
    if c.use_global_device_ids:
      if not groups:
        groups = (tuple(range(reps * parts)),)
      return tuple(tuple(dev(*divmod(i, parts)) for i in g) for g in groups)
    if cross_partition:
      groups = groups or (tuple(range(parts)),)
      return tuple(tuple(dev(r, p) for p in g) for r in range(reps) for g in groups)
    groups = groups or (tuple(range(reps)),)
    return tuple(tuple(dev(r, p) for r in g) for p in range(parts) for g in groups)


def collective_bytes(op: str, operand_shapes: Sequence[Shape], groups, group_size: int) -> int:
  """Bytes per participant of a collective: what each device contributes or receives in full.

  all-reduce, reduce-scatter, all-to-all, collective-broadcast: the operands (for reduce-scatter
  the whole buffer before scattering); all-gather: the gathered result, operands x group size;
  collective-permute and ragged-all-to-all: the first operand (the others are offsets or the
  output buffer of in-place forms).
  """
  del groups
  if op in ("collective-permute", "ragged-all-to-all"):
    return operand_shapes[0].nbytes if operand_shapes else 0
  total = sum(s.nbytes for s in operand_shapes)
  if op == "all-gather":
    return total * max(group_size, 1)
  return total


# --------------------------------------------------------------------------------------------
# Replica groups: iota lists and mesh axes, expanded to explicit groups
# --------------------------------------------------------------------------------------------

def iota_groups(num_groups: int, group_size: int, reshape_dims: Sequence[int],
                transpose_perm: Sequence[int] = ()) -> tuple[tuple[int, ...], ...]:
  """``[num_groups, group_size] <= [reshape_dims] T(transpose_perm)`` as explicit groups."""
  dims = [int(d) for d in reshape_dims]
  ids = np.arange(int(np.prod(dims)) if dims else 0).reshape(dims)
  if transpose_perm:
    ids = ids.transpose([int(p) for p in transpose_perm])
  if ids.size != num_groups * group_size:
    raise HloReadError(
        f"iota replica groups [{num_groups},{group_size}]<={dims}: {ids.size} ids do not fill "
        f"{num_groups} groups of {group_size}")
  return tuple(tuple(int(v) for v in row) for row in ids.reshape(num_groups, group_size))


def mesh_axes_groups(axis_sizes: Sequence[int], device_ids: Sequence[int],
                     axes: Sequence[tuple[int, tuple[int, int] | None]]
                     ) -> tuple[tuple[int, ...], ...]:
  """Groups of a mesh-axes replica list: devices that differ only along ``axes``.

  Args:
    axis_sizes: the mesh's axis sizes, major to minor.
    device_ids: the mesh's devices in row-major order (empty: iota).
    axes: ``(mesh axis index, sub-axis)`` per axis the collective spans, in group order; a
      sub-axis ``(pre_size, size)`` is the ``size``-long slice of its axis after ``pre_size``.

  The device array is reshaped to the axis sizes (a sub-axis splits its axis into
  ``[pre_size, size, rest]``), the spanned dimensions are moved last in the order given, and
  consecutive runs of the group size are the groups.
  """
  sizes = [int(s) for s in axis_sizes]
  total = int(np.prod(sizes)) if sizes else 1
  devices = np.asarray(list(device_ids) if device_ids else range(total), dtype=np.int64)
  if devices.size != total:
    raise HloReadError(f"mesh axes {sizes} hold {total} devices but device_ids lists "
                       f"{devices.size}")
  by_axis: dict[int, list[tuple[int, tuple[int, int] | None]]] = {}
  for pos, (idx, sub) in enumerate(axes):
    if not 0 <= idx < len(sizes):
      raise HloReadError(f"replica groups name mesh axis {idx}; the mesh has {len(sizes)} axes")
    by_axis.setdefault(idx, []).append((pos, sub))
  new_dims: list[int] = []
  grouped: dict[int, int] = {}     # position in `axes` -> dimension of the reshaped array
  for idx, size in enumerate(sizes):
    refs = by_axis.get(idx)
    if not refs:
      new_dims.append(size)
      continue
    if len(refs) == 1 and refs[0][1] is None:
      grouped[refs[0][0]] = len(new_dims)
      new_dims.append(size)
      continue
    if any(sub is None for _, sub in refs):
      raise HloReadError(f"mesh axis {idx} is named whole and as a sub-axis in one group list")
    prefix = 1
    for pos, (pre, sz) in sorted(refs, key=lambda r: r[1][0]):
      if pre % prefix:
        raise HloReadError(f"sub-axis ({pre}){sz} of mesh axis {idx} overlaps another")
      if pre != prefix:
        new_dims.append(pre // prefix)
        prefix = pre
      grouped[pos] = len(new_dims)
      new_dims.append(sz)
      prefix *= sz
    if size % prefix:
      raise HloReadError(f"sub-axes of mesh axis {idx} (size {size}) do not divide it")
    if prefix != size:
      new_dims.append(size // prefix)
  order = [grouped[p] for p in range(len(axes))]
  rest = [d for d in range(len(new_dims)) if d not in order]
  arr = devices.reshape(new_dims).transpose(rest + order)
  group_size = int(np.prod([new_dims[d] for d in order])) if order else 1
  return tuple(tuple(int(v) for v in row) for row in arr.reshape(-1, group_size))


# --------------------------------------------------------------------------------------------
# Reading the serialized HloModuleProto (protobuf wire format)
# --------------------------------------------------------------------------------------------

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
  name = _PRIMITIVES.get(et, (f"type{et}", 0))[0]
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


# --------------------------------------------------------------------------------------------
# Reading printed HLO text
# --------------------------------------------------------------------------------------------

_TOKEN_RE = re.compile(r"""
    (?P<ws>\s+)
  | (?P<comment>/\*.*?\*/)
  | (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<arrow>->|<=)
  | (?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?![\w.$-]))
  | (?P<name>[%A-Za-z_$][\w.$\-]*|\d[\w.$\-]*)
  | (?P<punct>[{}\[\]()=,:<>*?!@#^&|+/;-])
""", re.VERBOSE | re.DOTALL)


@dataclasses.dataclass(frozen=True)
class _Tok:
  kind: str
  text: str


_SIMPLE_ESCAPES = {ord("n"): 10, ord("t"): 9, ord("r"): 13, ord("\\"): 92, ord('"'): 34,
                   ord("'"): 39, ord("a"): 7, ord("b"): 8, ord("f"): 12, ord("v"): 11,
                   ord("?"): 63}


def _unescape(s: str) -> str:
  """Undoes the C escaping XLA prints strings with (``\\'``, ``\\"``, octal and hex bytes)."""
  if "\\" not in s:
    return s
  b, out, i = s.encode("utf-8"), bytearray(), 0
  while i < len(b):
    c = b[i]
    if c != 92 or i + 1 >= len(b):
      out.append(c)
      i += 1
      continue
    n = b[i + 1]
    if n in _SIMPLE_ESCAPES:
      out.append(_SIMPLE_ESCAPES[n])
      i += 2
    elif n == ord("x"):
      j = i + 2
      while j < len(b) and j < i + 4 and chr(b[j]) in "0123456789abcdefABCDEF":
        j += 1
      out.append(int(b[i + 2:j] or b"0", 16) & 0xFF)
      i = j
    elif chr(n) in "01234567":
      j = i + 1
      while j < len(b) and j < i + 4 and chr(b[j]) in "01234567":
        j += 1
      out.append(int(b[i + 1:j], 8) & 0xFF)
      i = j
    else:
      out.append(c)
      i += 1
  return out.decode("utf-8", "replace")


def tokenize(text: str) -> list[_Tok]:
  """HLO text as tokens; whitespace and ``/* ... */`` comments are dropped."""
  out, i = [], 0
  while i < len(text):
    m = _TOKEN_RE.match(text, i)
    if m is None:
      raise HloReadError(f"cannot read HLO text at {text[i:i + 40]!r}")
    i = m.end()
    kind = m.lastgroup
    if kind in ("ws", "comment"):
      continue
    tok = m.group(kind)
    if kind == "str":
      tok = _unescape(tok[1:-1])
    elif kind == "name" and tok.startswith("%"):
      tok = tok[1:]
    out.append(_Tok(kind, tok))
  return out


class _Cursor:
  def __init__(self, toks: list[_Tok], line: str):
    self.toks, self.i, self.line = toks, 0, line

  def peek(self, k: int = 0) -> _Tok | None:
    j = self.i + k
    return self.toks[j] if j < len(self.toks) else None

  def at(self, text: str, k: int = 0) -> bool:
    t = self.peek(k)
    return t is not None and t.kind != "str" and t.text == text

  def next(self) -> _Tok:
    t = self.peek()
    if t is None:
      self.fail("the line ends early")
    self.i += 1
    return t

  def expect(self, text: str) -> None:
    t = self.next()
    if t.text != text or t.kind == "str":
      self.fail(f"expected {text!r}, found {t.text!r}")

  def int(self) -> int:
    t = self.next()
    if t.kind != "num":
      self.fail(f"expected an integer, found {t.text!r}")
    return int(t.text)

  def balanced(self) -> list[_Tok]:
    """One bracketed group (the opening token is next) or a single token."""
    pairs = {"{": "}", "[": "]", "(": ")"}
    first = self.next()
    if first.kind == "str" or first.text not in pairs:
      return [first]
    depth, out = [pairs[first.text]], [first]
    while depth:
      t = self.next()
      out.append(t)
      if t.kind == "str":
        continue
      if t.text in pairs:
        depth.append(pairs[t.text])
      elif t.text in (")", "]", "}"):
        if t.text != depth[-1]:
          self.fail(f"unbalanced {t.text!r}")
        depth.pop()
    return out

  def fail(self, why: str):
    raise HloReadError(f"cannot read HLO instruction ({why}): {self.line.strip()[:300]}")


def _text_shape(cur: _Cursor) -> Shape:
  if cur.at("("):
    cur.next()
    elements = []
    while not cur.at(")"):
      elements.append(_text_shape(cur))
      if cur.at(","):
        cur.next()
    cur.next()
    return Shape("tuple", (), tuple(elements))
  t = cur.next()
  if t.kind != "name" or t.text not in BITS:
    cur.fail(f"expected a shape, found {t.text!r}")
  dims = []
  if cur.at("["):
    cur.next()
    while not cur.at("]"):
      if cur.at("<=") or cur.at("?"):
        cur.next()
        continue
      dims.append(cur.int())
      if cur.at(","):
        cur.next()
    cur.next()
  if cur.at("{"):
    cur.balanced()        # layout
  return Shape(t.text, tuple(dims))


def _ints_in(toks: Sequence[_Tok]) -> list[int]:
  return [int(t.text) for t in toks if t.kind == "num"]


def _nested_int_lists(toks: Sequence[_Tok]) -> tuple[tuple[int, ...], ...]:
  """``{{0,1},{2,3}}`` -> ((0, 1), (2, 3)); ``{}`` -> ()."""
  groups, cur, depth = [], None, 0
  for t in toks:
    if t.kind != "punct":
      if t.kind == "num" and cur is not None:
        cur.append(int(t.text))
      continue
    if t.text == "{":
      depth += 1
      if depth == 2:
        cur = []
    elif t.text == "}":
      if depth == 2 and cur is not None:
        groups.append(tuple(cur))
        cur = None
      depth -= 1
  return tuple(groups)


def _text_groups(cur: _Cursor) -> tuple[tuple[tuple[int, ...], ...], str]:
  """The value of ``replica_groups=`` in any of its printed forms."""
  if cur.at("{"):
    groups = _nested_int_lists(cur.balanced())
    return groups, "list" if groups else ""
  if cur.at("["):                                # [G,S]<=[dims]T(perm)
    shape = _ints_in(cur.balanced())
    cur.expect("<=")
    dims = _ints_in(cur.balanced())
    perm: list[int] = []
    if cur.at("T") and cur.at("(", 1):
      cur.next()
      perm = _ints_in(cur.balanced())
    if len(shape) != 2:
      cur.fail(f"iota replica groups with shape {shape}; expected [groups,size]")
    return iota_groups(shape[0], shape[1], dims, perm), "iota"
  if cur.at("mesh"):                             # mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}
    cur.next()
    inner = cur.balanced()[1:-1]
    names, sizes = [], []
    k = 0
    while k < len(inner):
      if inner[k].kind in ("str", "name") and k + 2 < len(inner) and inner[k + 1].text == "=":
        names.append(inner[k].text)
        sizes.append(int(inner[k + 2].text))
        k += 3
      else:
        k += 1
    device_ids: list[int] = []
    if cur.at(",") and cur.at("device_ids", 1):
      cur.next()
      cur.next()
      cur.expect("=")
      device_ids = _ints_in(cur.balanced())
    axes_toks = cur.balanced()[1:-1]
    axes = []
    k = 0
    while k < len(axes_toks):
      t = axes_toks[k]
      if t.kind in ("str", "name"):
        if t.text not in names:
          cur.fail(f"replica groups name mesh axis {t.text!r}; the mesh has {names}")
        sub = None
        if k + 1 < len(axes_toks) and axes_toks[k + 1].text == ":":
          # name:(pre)size
          pre = int(axes_toks[k + 3].text)
          size = int(axes_toks[k + 5].text)
          sub = (pre, size)
          k += 5
        axes.append((names.index(t.text), sub))
      k += 1
    return mesh_axes_groups(sizes, device_ids, axes), "mesh"
  cur.fail("unknown replica_groups form")
  raise AssertionError  # unreachable


def _names_in(toks: Sequence[_Tok]) -> list[str]:
  return [t.text for t in toks if t.kind == "name"]


def _metadata_op_name(toks: Sequence[_Tok]) -> str:
  for k, t in enumerate(toks):
    if t.kind == "name" and t.text == "op_name" and k + 2 < len(toks) and toks[k + 1].text == "=":
      return toks[k + 2].text
  return ""


_INSTR_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-$]+\s*=\s")
_COMP_LINE = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-$]+)\s*(\(.*)?\{\s*$")
_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "true_computation",
               "false_computation", "branch_computations", "called_computations")


def _text_instruction(line: str, computation: str) -> tuple[Instruction, list[str]]:
  cur = _Cursor(tokenize(line), line)
  if cur.at("ROOT"):
    cur.next()
  name = cur.next().text
  cur.expect("=")
  shape = _text_shape(cur)
  op = cur.next()
  if op.kind != "name":
    cur.fail(f"expected an opcode, found {op.text!r}")
  opcode = op.text
  operand_names: list[str] = []
  if not cur.at("("):
    cur.fail(f"expected '(' after {opcode}")
  inner = cur.balanced()[1:-1]
  if opcode not in ("constant", "parameter", "iota"):
    depth, span = 0, []
    for t in inner + [_Tok("punct", ",")]:
      if t.kind == "punct" and t.text in "([{":
        depth += 1
      elif t.kind == "punct" and t.text in ")]}":
        depth -= 1
      if depth == 0 and t.kind == "punct" and t.text == ",":
        names = [s.text for s in span if s.kind == "name" and s.text not in BITS]
        if names:
          operand_names.append(names[-1])
        span = []
      else:
        span.append(t)
  attrs: dict[str, Any] = {}
  while cur.peek() is not None:
    cur.expect(",")
    key = cur.next().text
    cur.expect("=")
    if key == "replica_groups":
      attrs[key] = _text_groups(cur)
      continue
    value: list[_Tok] = []
    while cur.peek() is not None and not cur.at(","):
      value.extend(cur.balanced())
    attrs[key] = value
  called: list[str] = []
  for key in _CALL_ATTRS:
    if key in attrs:
      called.extend(_names_in(attrs[key]))
  groups, form = attrs.get("replica_groups", (None, ""))
  pairs = ()
  if "source_target_pairs" in attrs:
    pairs = tuple((a, b) for a, b in _nested_int_lists(attrs["source_target_pairs"]))
  channel = _ints_in(attrs.get("channel_id", ()))
  target = attrs.get("custom_call_target")
  kind = attrs.get("kind")
  use_global = attrs.get("use_global_device_ids")
  ins = Instruction(
      name=name, opcode=opcode, shape=shape, computation=computation, called=tuple(called),
      fusion_kind=kind[0].text if kind else "",
      custom_call_target=target[0].text if target else "",
      channel_id=channel[0] if channel and channel[0] > 0 else None,
      use_global_device_ids=bool(use_global and use_global[0].text == "true"),
      replica_groups=groups, group_form=form, source_target_pairs=pairs,
      dimensions=tuple(_ints_in(attrs.get("dimensions", ()))),
      op_name=_metadata_op_name(attrs.get("metadata", ())))
  return ins, operand_names


def parse_text(text: str) -> Module:
  """Reads printed HLO (``compiled.as_text()``) into a :class:`Module`."""
  header = text.lstrip().split("\n", 1)[0]
  name_m = re.match(r"\s*HloModule\s+([\w.\-$]+)", header)
  reps = re.search(r"replica_count=(\d+)", header)
  parts = re.search(r"num_partitions=(\d+)", header)
  raw: dict[str, list[tuple[Instruction, list[str]]]] = {}
  entry = ""
  current: list | None = None
  cname = ""
  for line in text.splitlines():
    if current is None:
      m = _COMP_LINE.match(line)
      if m and not _INSTR_LINE.match(line) and not line.lstrip().startswith("HloModule"):
        cname = m.group(2)
        current = raw.setdefault(cname, [])
        if m.group(1):
          entry = cname
      continue
    if line.strip() == "}":
      current = None
      continue
    if _INSTR_LINE.match(line):
      current.append(_text_instruction(line, cname))
  computations = {}
  fused = set()
  for cname, items in raw.items():
    for ins, _ in items:
      if ins.opcode == "fusion":
        fused.update(ins.called)
  for cname, items in raw.items():
    shapes = {ins.name: ins.shape for ins, _ in items}
    records = []
    for ins, operand_names in items:
      unknown = [o for o in operand_names if o not in shapes]
      if unknown:
        raise HloReadError(f"instruction {ins.name!r} in {cname!r} uses {unknown}, which the "
                           f"computation does not define")
      records.append(dataclasses.replace(
          ins, operands=tuple(operand_names),
          operand_shapes=tuple(shapes[o] for o in operand_names)))
    computations[cname] = Computation(cname, tuple(records), cname in fused)
  if not entry and computations:
    entry = list(computations)[-1]
  r = int(reps.group(1)) if reps else 1
  p = int(parts.group(1)) if parts else 1
  return Module(name_m.group(1) if name_m else "", entry, computations, "text", (), r, p)


# --------------------------------------------------------------------------------------------
# From a jax executable
# --------------------------------------------------------------------------------------------

def serialized_modules(compiled: Any) -> list[bytes] | None:
  """The executable's HloModuleProtos, or None where this jax/backend does not expose them."""
  try:
    runtime = compiled.runtime_executable()
    modules = runtime.hlo_modules()
    return [m.as_serialized_hlo_module_proto() for m in modules]
  except Exception:  # pylint: disable=broad-except  (absent API or backend: fall back to text)
    return None


def read_compiled(compiled: Any, prefer: str = "proto") -> Module:
  """The optimised module of a ``jax.stages.Compiled`` (its first module; jax makes one).

  ``prefer="proto"`` reads XLA's structured form and falls back to the printed text where jax
  does not expose it; ``prefer="text"`` reads the text (used to cross-check the two readers).
  """
  if prefer not in ("proto", "text"):
    raise errors.ConfigurationError(f"prefer={prefer!r}; use 'proto' or 'text'")
  if prefer == "proto":
    protos = serialized_modules(compiled)
    if protos:
      return parse_proto(protos[0])
  text = compiled.as_text()
  if not text:
    raise HloReadError(f"{type(compiled).__name__} exposes neither its HLO module proto nor its "
                       "text; compile with jax.jit(f).lower(*args).compile() on a backend that "
                       "keeps them.")
  first = re.split(r"\n(?=HloModule\s)", text.strip())[0]
  return parse_text(first)
