"""Every ```python block in README.md and docs/*.md runs as written: each in a fresh Python process
on a CPU-only machine as a reader would paste it into plain ``python`` -- without the suite's
XLA_FLAGS, so a block that needs several devices says how it gets them (the
``--xla_force_host_platform_device_count`` line at its top) -- from the repository root, with
JAX's defaults. Fences indented under a list item count too (their indentation is removed, as
Markdown does). Fragments that are not complete programs belong in another fence (```text)."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
# a fence at any indentation; the closing fence has the same indentation
FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.S | re.M)


def blocks_of(text: str) -> list[tuple[int, str]]:
  """[(line, code)] of every python fence in ``text``, indented ones dedented."""
  out = []
  for m in FENCE.finditer(text):
    indent, body = m.group(1), m.group(2)
    lines = [ln[len(indent):] if ln.startswith(indent) else ln for ln in body.splitlines(True)]
    out.append((text[:m.start()].count("\n") + 1, textwrap.dedent("".join(lines))))
  return out


def _blocks():
  out = []
  for page in PAGES:
    for line, code in blocks_of(page.read_text()):
      out.append(pytest.param(code, id=f"{page.relative_to(ROOT)}:{line}"))
  return out


BLOCKS = _blocks()


def test_the_readme_quickstart_is_the_first_block():
  assert BLOCKS and BLOCKS[0].id.startswith("README.md:")


def test_indented_fences_are_found_and_dedented():
  text = "1. a step:\n\n   ```python\n   x = 1\n   if x:\n     y = 2\n   ```\n\n```python\nz = 3\n```\n"
  assert blocks_of(text) == [(3, "x = 1\nif x:\n  y = 2\n"), (9, "z = 3\n")]


def test_every_page_with_a_python_fence_is_collected():
  """No fence escapes: as many blocks as lines that open a python fence, at any indentation."""
  opening = sum(len(re.findall(r"^[ \t]*```python[ \t]*$", p.read_text(), re.M)) for p in PAGES)
  assert len(BLOCKS) == opening


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_as_written(code, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")       # a CPU-only machine
  for var in ("XLA_FLAGS", "PYTHONPATH"):           # not the suite's 8 devices, not its paths
    env.pop(var, None)
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=240)
  assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
