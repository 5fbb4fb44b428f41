"""Printed HLO text read with a tokenizer (shapes with ``/*index=5*/`` comments, nested tuples,
layouts, the three replica-group forms) into the same records as the proto reader. It refuses,
naming the line, an instruction it cannot read instead of skipping it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from dtenjax._src.hlo.groups import iota_groups, mesh_axes_groups
from dtenjax._src.hlo.records import (BITS, Computation, HloReadError, Instruction, Module, Shape,
                                      known_trip_count)


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


def _mesh_device_ids(toks: Sequence[_Tok]) -> list[int]:
  """A mesh's ``device_ids=(...)``: listed, or ``([dims]T(perm))``, an iota in that shape
  transposed by ``perm``, read in row-major order."""
  inner = toks[1:-1]
  if not inner or inner[0].text != "[":
    return _ints_in(toks)
  close = next(k for k, t in enumerate(inner) if t.text == "]")
  dims = _ints_in(inner[:close + 1])
  return list(iota_groups(1, math.prod(dims), dims, _ints_in(inner[close + 1:]))[0])


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
      device_ids = _mesh_device_ids(cur.balanced())
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


def _config_text(toks: Sequence[_Tok]) -> str:
  """A ``backend_config=`` value as the JSON XLA printed: a JSON object (its tokens put back
  together, strings quoted again) or a string holding one."""
  if len(toks) == 1 and toks[0].kind == "str":
    return toks[0].text
  return "".join(json.dumps(t.text) if t.kind == "str" else t.text for t in toks)


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
  config = attrs.get("backend_config")
  ins = Instruction(
      name=name, opcode=opcode, shape=shape, computation=computation, called=tuple(called),
      fusion_kind=kind[0].text if kind else "",
      custom_call_target=target[0].text if target else "",
      channel_id=channel[0] if channel and channel[0] > 0 else None,
      use_global_device_ids=bool(use_global and use_global[0].text == "true"),
      replica_groups=groups, group_form=form, source_target_pairs=pairs,
      dimensions=tuple(_ints_in(attrs.get("dimensions", ()))),
      op_name=_metadata_op_name(attrs.get("metadata", ())),
      trip_count=known_trip_count(_config_text(config)) if opcode == "while" and config else None)
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



def trip_counts_from_text(text: str) -> dict[str, int]:
  """{while op name: known trip count} of printed compiled HLO (its first module), as
  :meth:`Module.trip_counts` of :func:`parse_text`."""
  return parse_text(text).trip_counts()
