"""The linter instead of comments: ruff, configured in pyproject.toml with the code's own style,
passes on the whole tree; `noqa` comments that silence nothing fail it (RUF100), and no pylint
comment remains in the tree (the project runs no pylint)."""

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
