"""What compiled HLO is made of, as dtenjax reads it: element types (with their numpy names),
shapes, instructions (a while loop with its known trip count), computations, modules and the
collectives in them (kind, operand and result shapes, bytes per participant, replica groups as
lists of logical ids, channel id, the async start/done pair).

:meth:`Module.device_groups` turns logical ids into device ids through the module's device
assignment. The readers (:mod:`.proto`, :mod:`.text`) build these records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator, Sequence

from dtenjax._src import errors


class HloReadError(errors.DtenjaxError, ValueError):
  """Compiled HLO could not be read (an unknown form, or a field that does not decode)."""


# --------------------------------------------------------------------------------------------
# Element types: xla.PrimitiveType numbers, their text names and widths in bits
# --------------------------------------------------------------------------------------------

PRIMITIVE_TYPES = {
    1: ("pred", 8), 2: ("s8", 8), 3: ("s16", 16), 4: ("s32", 32), 5: ("s64", 64),
    6: ("u8", 8), 7: ("u16", 16), 8: ("u32", 32), 9: ("u64", 64), 10: ("f16", 16),
    11: ("f32", 32), 12: ("f64", 64), 13: ("tuple", 0), 14: ("opaque", 0), 15: ("c64", 64),
    16: ("bf16", 16), 17: ("token", 0), 18: ("c128", 128), 19: ("f8e5m2", 8),
    20: ("f8e4m3fn", 8), 21: ("s4", 4), 22: ("u4", 4), 23: ("f8e4m3b11fnuz", 8),
    24: ("f8e5m2fnuz", 8), 25: ("f8e4m3fnuz", 8), 26: ("s2", 2), 27: ("u2", 2),
    28: ("f8e4m3", 8), 29: ("f8e3m4", 8), 30: ("s1", 1), 31: ("u1", 1), 32: ("f4e2m1fn", 4),
    33: ("f8e8m0fnu", 8), 34: ("buffer", 0), 35: ("f6e3m2fn", 6), 36: ("f6e2m3fn", 6),
}
BITS = {name: bits for name, bits in PRIMITIVE_TYPES.values()}
_NOT_ARRAYS = ("tuple", "opaque", "token", "buffer")
_KIND_PREFIXES = {"s": "int", "u": "uint", "f": "float", "c": "complex"}


def numpy_name(hlo_name: str) -> str | None:
  """The numpy / ml_dtypes name of an HLO element type (``f32`` -> ``float32``, ``bf16`` ->
  ``bfloat16``, ``f8e4m3fn`` -> ``float8_e4m3fn``); None for tuples, tokens and other non-arrays."""
  if hlo_name in _NOT_ARRAYS or hlo_name not in BITS:
    return None
  if hlo_name == "pred":
    return "bool"
  if hlo_name == "bf16":
    return "bfloat16"
  m = re.fullmatch(r"([sufc])(\d+)(.*)", hlo_name)
  if m is None:
    return None
  kind, bits, rest = m.groups()
  return f"{_KIND_PREFIXES[kind]}{bits}" + (f"_{rest}" if rest else "")


# {HLO element type name: numpy name} for every array type of PRIMITIVE_TYPES.
NUMPY_NAMES = {n: numpy_name(n) for n in BITS if numpy_name(n) is not None}

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
# Every opcode of an XLA collective: the synchronous forms and the start/done halves of the async
# ones (the generic async-start/async-done wrappers are not collectives by themselves).
COLLECTIVE_OPCODES = (frozenset(COLLECTIVE_KINDS) | frozenset(_STARTS)
                      | frozenset(_DONES - {"async-done"}))
# dtenjax's custom calls that are collectives (the others, such as the top-k pack kernel, are local
# work and not listed by ``collectives``); tests/test_explain.py checks it against the targets.
COLLECTIVE_TARGETS = ("dtenjax_p2p_all_reduce", "dtenjax_host_all_reduce")


def known_trip_count(backend_config: str | bytes) -> int | None:
  """The ``known_trip_count`` of a while loop's backend config (XLA's JSON
  ``{"known_trip_count":{"n":"7"},...}``); None where it has none or is not JSON."""
  if not backend_config:
    return None
  try:
    n = json.loads(backend_config).get("known_trip_count", {}).get("n")
    return int(n) if n is not None else None
  except (ValueError, TypeError, AttributeError):
    return None


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
  trip_count: int | None = None           # a while loop's known trip count, where XLA knows it


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

  def trip_counts(self) -> dict[str, int]:
    """{while op name: its known trip count}; a loop XLA could not count is left out."""
    return {i.name: i.trip_count for i in self.instructions()
            if i.opcode == "while" and i.trip_count is not None}

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
    if inner.replica_groups and all(len(g) == 1 for g in inner.replica_groups):
      # every group one device: nothing moves between devices (the CPU all-reduces that hand a
      # collective algorithm its offsets at run time, algorithms/base.opaque), not a collective
      return None
    shapes = inner.operand_shapes if inner is not ins else ins.operand_shapes
    return Collective(
        kind=COLLECTIVE_KINDS[base], name=ins.name, computation=ins.computation,
        operand_shapes=shapes, result_shape=inner.shape,
        nbytes=collective_bytes(base, shapes, inner.replica_groups or (), self.group_size(inner),
                                result=inner.shape),
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


def collective_bytes(op: str, operand_shapes: Sequence[Shape], groups, group_size: int,
                     result: Shape | None = None) -> int:
  """Bytes per participant of a collective: what each device contributes or receives in full.

  all-reduce, reduce-scatter, all-to-all, collective-broadcast: the operands (for reduce-scatter
  the whole buffer before scattering); all-gather: the gathered result, operands x group size;
  collective-permute and ragged-all-to-all: the first operand (the others are offsets or the
  output buffer of in-place forms), every operand of a combined collective-permute
  (:func:`_combined_permute`).
  """
  del groups
  if op == "collective-permute" and _combined_permute(operand_shapes, result):
    return sum(s.nbytes for s in operand_shapes)
  if op in ("collective-permute", "ragged-all-to-all"):
    return operand_shapes[0].nbytes if operand_shapes else 0
  total = sum(s.nbytes for s in operand_shapes)
  if op == "all-gather":
    return total * max(group_size, 1)
  return total


def _combined_permute(operand_shapes: Sequence[Shape], result: Shape | None) -> bool:
  """Whether a collective-permute moves all its operands: XLA:GPU combines the permutes of one
  set of pairs into one variadic op whose result is a tuple of its operands' shapes (llama_loop's
  FSDP x TP step on a mocked 8-GPU host: ``(f32[1024,256], f32[128,2048]) collective-permute``,
  the table's and the unembedding's gradient pieces), where the in-place form's result is its
  output buffer alone. Its ``-start`` form returns that tuple as its first element."""
  if result is None or not result.is_tuple or len(operand_shapes) < 2:
    return False
  operands = tuple(operand_shapes)
  first = result.elements[0] if result.elements else None
  return result.elements == operands or (first is not None and first.elements == operands)
