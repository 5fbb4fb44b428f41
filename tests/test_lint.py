"""The linter instead of comments: ruff, configured in pyproject.toml with the code's own style,
passes on the whole tree; `noqa` comments that silence nothing fail it (RUF100), and no pylint
comment remains in the tree (the project runs no pylint)."""

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# No file carries a comment that switches pylint checks off (the project runs no pylint): a reason a
# reader needs stays as a plain comment.
PYTHON_DIRS = ["bench", "dtenjax", "examples", "scripts", "tests", "docs"]


def test_ruff_is_a_test_dependency_configured_with_two_space_indentation():
  assert any(r.startswith("ruff") for r in PYPROJECT["project"]["optional-dependencies"]["test"])
  ruff = PYPROJECT["tool"]["ruff"]
  assert ruff["indent-width"] == 2 and ruff["line-length"] == 100
  assert "RUF100" in ruff["lint"]["select"]


def test_ruff_passes_on_the_tree():
  r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format",
                      "concise", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert "No module named ruff" not in r.stderr, "pip install -e '.[test]' (ruff is in it)"
  assert r.returncode == 0, f"ruff check . (`ruff check --fix .` fixes those marked [*]):\n" \
      f"{r.stdout[-4000:]}{r.stderr[-2000:]}"


def test_no_file_carries_a_pylint_comment():
  found = []
  for entry in PYTHON_DIRS:
    for f in sorted((ROOT / entry).rglob("*.py")):
      for i, line in enumerate(f.read_text().splitlines(), 1):
        if re.search(r"#.*pylint:\s*disable", line):
          found.append(f"{f.relative_to(ROOT)}:{i}")
  assert not found, found


def _module_level_calls(tree):
  """The calls a module makes when it is imported: its top-level statements' calls, not those
  inside a function or class body (a decorator's arguments and default values run at import)."""
  class Calls(ast.NodeVisitor):
    def __init__(self):
      self.found = []
    def visit_Call(self, node):
      self.found.append(node)
      self.generic_visit(node)
    def visit_FunctionDef(self, node):
      for d in node.decorator_list + node.args.defaults + node.args.kw_defaults:
        if d is not None:
          self.visit(d)
    visit_AsyncFunctionDef = visit_FunctionDef
    def visit_ClassDef(self, node):
      for d in node.decorator_list + node.bases:
        self.visit(d)
  calls = Calls()
  calls.visit(tree)
  return calls.found


def test_no_test_module_asks_for_devices_at_import():
  """The GPU suite (`pytest -m gpu`) collects every test module on whatever GPUs are there, often
  one: a module that builds an 8-device mesh or reads jax.devices() at import stops the whole
  collection ("Number of devices 1 must be >= the product of mesh_shape"), as the users' steps
  file once did on the device machine. Build meshes inside the tests or fixtures."""
  asks = {"make_mesh", "devices", "local_devices", "Mesh", "device_put", "mesh"}
  found = []
  for f in sorted((ROOT / "tests").rglob("test_*.py")):
    for call in _module_level_calls(ast.parse(f.read_text())):
      name = getattr(call.func, "attr", getattr(call.func, "id", None))
      if name in asks:
        found.append(f"{f.relative_to(ROOT)}:{call.lineno}: {name}(...)")
  assert not found, found
