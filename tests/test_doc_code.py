"""Every ```python block in README.md and docs/*.md runs as written: each in a fresh Python process
on 8 simulated CPU devices with JAX's defaults, from the repository root, as a reader would paste
it. Fragments that are not complete programs belong in another fence (```text)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
  out = []
  for page in PAGES:
    for i, m in enumerate(FENCE.finditer(page.read_text())):
      line = page.read_text()[:m.start()].count("\n") + 1
      out.append(pytest.param(m.group(1), id=f"{page.relative_to(ROOT)}:{line}"))
  return out


BLOCKS = _blocks()


def test_the_readme_quickstart_is_the_first_block():
  assert BLOCKS and BLOCKS[0].id.startswith("README.md:")


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_as_written(code, tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=8")
  env.pop("PYTHONPATH", None)
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=240)
  assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
