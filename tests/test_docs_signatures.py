"""The signatures README.md and docs/ quote agree with the code (inspect.signature), and the
defaults they quote for DTENJAX_* knobs agree with dtenjax/_src/config.py.

A quote is an inline code span ``name(args)`` or ``dtenjax.name(args)`` whose name is public API
(``dtenjax.__all__``, or a dotted path from it such as ``compression.topk_ef``). Every argument
name it gives must be a parameter, in the signature's order; a default it quotes (``x=0``) must be
the real default; and a quote that marks keyword-only arguments (``*``) or gives four or more
arguments is a full signature unless it ends in ``...``: it lists every parameter. Spans whose
names are not parameters (``shard(opt_state, like=params)``), and spans of keyword arguments only
whose values are not the defaults (``PreemptionPolicy(enabled="no")`` in a table of refused
values), are calls, not quotes, and skipped.
"""

import ast
import inspect
import pathlib
import re

import pytest

import dtenjax
from dtenjax._src import config

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
SPAN = re.compile(r"`((?:dtenjax\.)?[A-Za-z_][\w.]*)\(([^`]*)\)`")


def _split(args: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for ch in args:
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      parts.append("".join(cur).strip())
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur).strip())
  return parts


def _resolve(name: str):
  path = name.removeprefix("dtenjax.").split(".")
  if path[0] not in dtenjax.__all__:
    return None
  obj = dtenjax
  for part in path:
    obj = getattr(obj, part, None)
    if obj is None:
      return None
  return obj if callable(obj) else None


def _literal(item: str):
  """The literal after ``=`` (the first of ``"a"|"b"``), None where there is none."""
  if "=" not in item:
    return None
  try:
    value = ast.literal_eval(item.split("=", 1)[1].split("|")[0].strip())
  except (ValueError, SyntaxError):
    return None
  return None if value is Ellipsis else value


def quotes():
  out = []
  for page in PAGES:
    text = page.read_text()
    for m in SPAN.finditer(text.replace("\n", " ")):
      obj = _resolve(m.group(1))
      if obj is None:
        continue
      try:
        sig = inspect.signature(obj)
      except (TypeError, ValueError):
        continue
      line = text[:m.start()].count("\n") + 1
      out.append(pytest.param(m.group(1), m.group(2), sig, id=f"{page.name}:{line}:{m.group(1)}"))
  return out


QUOTES = quotes()


def test_quotes_are_found():
  names = {q.values[0].removeprefix("dtenjax.") for q in QUOTES}
  assert {"all_reduce", "Placement", "topology_mesh", "mesh_map"} <= names, names


@pytest.mark.parametrize("name,args,sig", QUOTES)
def test_a_quoted_signature_is_the_real_one(name, args, sig):
  items = _split(args)
  params = [p for p in sig.parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
  names = [p.name for p in params]
  quoted = []
  for item in items:
    if item in ("*", "/", "...") or item.startswith("*"):
      continue
    key = re.split(r"[=:]", item, maxsplit=1)[0].strip()
    quoted.append((key, item))
  if not quoted or any(k not in names for k, _ in quoted):
    pytest.skip(f"a call, not a signature quote: {name}({args})")
  if "*" not in items and all("=" in item for _, item in quoted) and any(
      _literal(item) not in (None, sig.parameters[k].default) for k, item in quoted):
    pytest.skip(f"keyword arguments with example values: a call, not a quote: {name}({args})")
  order = [names.index(k) for k, _ in quoted]
  assert order == sorted(order), f"{name}({args}) lists parameters out of order: {names}"
  signature_like = "*" in items or len(quoted) >= 4      # not an example call's values
  for key, item in quoted:
    if "=" not in item or not signature_like:
      continue
    text = item.split("=", 1)[1].strip()
    try:
      value = ast.literal_eval(text.split("|")[0].strip())   # "sum"|"mean": the first is the default
    except (ValueError, SyntaxError):
      continue                                             # a description (Workload(), ...)
    if value is Ellipsis:
      continue
    default = sig.parameters[key].default
    assert default is not inspect.Parameter.empty and default == value, (
        f"{name}: the docs quote {key}={text}, the code's default is {default!r}")
  full = signature_like and not any(i.endswith("...") for i in items)
  if full:
    missing = [n for n in names if n not in dict(quoted)]
    assert not missing, f"{name}({args}) leaves out {missing} of {sig}"


_DEFAULT = re.compile(r"`(DTENJAX_[A-Z0-9_]+)`[^`.;]{0,12}?\(?default:? (\d+(?:\.\d+)?)( ?[a-zA-Z]+)?")
_UNITS = {None: 1, "s": 1, "ms": 1e-3, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def _knob_defaults():
  out = []
  for page in PAGES:
    text = page.read_text()
    for m in _DEFAULT.finditer(text.replace("\n", " ")):
      out.append(pytest.param(*m.groups(), id=f"{page.name}:{m.group(1)}"))
  return out


KNOB_DEFAULTS = _knob_defaults()


def test_knob_defaults_are_found():
  assert {"DTENJAX_COLLECTIVE_TIMEOUT", "DTENJAX_HANDSHAKE_TIMEOUT"} <= {
      p.values[0] for p in KNOB_DEFAULTS}


@pytest.mark.parametrize("knob,number,unit", KNOB_DEFAULTS)
def test_a_quoted_knob_default_is_the_configured_one(knob, number, unit):
  assert knob in config.KNOBS, f"the docs name {knob}, which config.py does not define"
  unit = unit.strip() if unit else None
  if unit not in _UNITS:
    unit = None                      # a word after the number ("blocks of ..."), not a unit
  default = config.KNOBS[knob].default
  assert float(default) == pytest.approx(float(number) * _UNITS[unit]), (
      f"the docs say {knob} defaults to {number}{' ' + unit if unit else ''}; config.py: {default!r}")
