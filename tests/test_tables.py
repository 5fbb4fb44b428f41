"""dtenjax/_src/tables.py, the one renderer of report tables, and the rule that nothing in
dtenjax/, bench/ or examples/ aligns a table by hand (f-string widths, ``ljust``/``rjust``)."""

import ast
import pathlib
import re

import pytest

from dtenjax._src import tables

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A format spec that pads to a width: "{x:>10}", "{x:<{width}}", "{x:10.3f}", "{x:^8}" (not
# zero-padded numbers such as "{i:03d}" or "{b:02x}": names and hex, not columns).
PADDED = re.compile(r"^(.?[<>^=])?[+\- ]?#?([1-9]|\{)")
# Files worth parsing: a brace with such a spec, or ljust/rjust (the AST then decides).
SUSPECT = re.compile(r"\{[^{}\n]*?:(.?[<>^=])?[+\- ]?#?([1-9]|\{)|\.(ljust|rjust|center)\(")


def _hand_aligned(path: pathlib.Path) -> list[str]:
  found = []
  text = path.read_text()
  if not SUSPECT.search(text):
    return found
  for node in ast.walk(ast.parse(text, filename=str(path))):
    if isinstance(node, ast.FormattedValue) and isinstance(node.format_spec, ast.JoinedStr):
      spec = "".join(v.value if isinstance(v, ast.Constant) else "{" for v in
                     node.format_spec.values)
      if PADDED.match(spec):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {{...:{spec}}}")
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in ("ljust", "rjust", "center")):
      found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.func.attr}()")
  return found


def test_no_table_is_aligned_by_hand():
  paths = (sorted((ROOT / "dtenjax").rglob("*.py")) + sorted((ROOT / "bench").glob("*.py"))
           + sorted((ROOT / "examples").glob("*.py")))
  found = [hit for p in paths for hit in _hand_aligned(p)]
  assert not found, ("lay tables out with dtenjax/_src/tables.render (bench/: _harness.table; "
                     f"examples/, public names only: rich's Table); aligned by hand: {found}")


def test_the_rule_sees_every_form(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text('w = 8\nrows = [f"{1:>10}", f"{2:<{w}}", f"{3.0:10.3f}", f"{4:^8}", '
                 '"a".ljust(4), "b".rjust(w)]\nok = [f"{5:.2f}", f"{6:,}", f"{7!r}", f"{8:x}", f"{9:03d}"]\n')
  global ROOT
  root, ROOT = ROOT, tmp_path
  try:
    found = _hand_aligned(bad)
  finally:
    ROOT = root
  assert sorted(f.split(": ", 1)[1] for f in found) == sorted([
      "{...:>10}", "{...:<{}", "{...:10.3f}", "{...:^8}", ".ljust()", ".rjust()"]), found


def test_render_aligns_columns_and_keeps_cells_whole():
  text = tables.render(["name", "GB/s", "note"], [["nvlink", "300.00 GB/s", None],
                                                   ["roce", "12.50 GB/s", "across hosts"]],
                       align=["left", "right", "left"], title="links")
  lines = text.splitlines()
  assert lines[0] == "links"
  assert lines[1].split() == ["name", "GB/s", "note"]
  assert lines[2].split() == ["nvlink", "300.00", "GB/s", "-"]       # None shows as "-"
  assert lines[2].index("GB/s") == lines[3].index("GB/s")             # right-aligned column
  assert all(line == line.rstrip() for line in lines)
  with pytest.raises(ValueError, match="do not have 3 cells"):
    tables.render(["a", "b", "c"], [[1, 2]])
