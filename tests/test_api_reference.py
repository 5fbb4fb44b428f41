"""The API reference (docs/api, Sphinx autodoc + napoleon) builds from the docstrings without a
warning, and lists every public name of dtenjax and of its public submodules."""

import importlib
import pathlib
import re
import subprocess
import sys
import types

import pytest

import dtenjax

ROOT = pathlib.Path(__file__).resolve().parents[1]
INDEX = ROOT / "docs" / "api" / "index.rst"


def _documented() -> dict[str, set[str]]:
  """module -> the names its ``.. auto...::`` directives document."""
  out, module = {}, None
  for line in INDEX.read_text().splitlines():
    if m := re.match(r"\.\. currentmodule:: (\S+)", line):
      module = m.group(1)
    elif m := re.match(r"\.\. auto(?:function|class|exception|data):: (\S+)", line):
      out.setdefault(module, set()).add(m.group(1))
  return out


def test_the_reference_lists_every_public_name():
  documented = _documented()
  submodules = {n for n in dtenjax.__all__ if isinstance(getattr(dtenjax, n), types.ModuleType)}
  assert set(dtenjax.__all__) - submodules == documented["dtenjax"]
  for name in submodules:
    module = importlib.import_module(f"dtenjax.{name}")
    assert f".. automodule:: dtenjax.{name}" in INDEX.read_text(), name
    assert set(module.__all__) == documented[f"dtenjax.{name}"], name


def test_the_reference_builds_without_warnings(tmp_path):
  pytest.importorskip("sphinx", reason="sphinx is in the test extra: pip install -e '.[test]'")
  r = subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-W", "--keep-going", "-q",
                      "-E", str(INDEX.parent), str(tmp_path / "html")], cwd=ROOT,
                     capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stderr[-4000:]
  page = (tmp_path / "html" / "index.html").read_text()
  for name in ("dtenjax.all_reduce", "dtenjax.ArrayPlan", "dtenjax.compression.topk_ef",
               "dtenjax.checkpoint.save", "dtenjax.testing.assert_bitwise_equal"):
    assert f'id="{name}"' in page, name                 # an entry with its anchor
  assert "Args:" not in page                             # napoleon turned the sections into fields
