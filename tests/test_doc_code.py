"""Every ```python block in README.md and docs/*.md runs as written: each in a fresh Python process
on a CPU-only machine as a reader would paste it into plain ``python`` -- without the suite's
XLA_FLAGS, so a block that needs several devices says how it gets them (the
``--xla_force_host_platform_device_count`` line at its top) -- from the repository root, with
JAX's defaults. Fences indented under a list item count too (their indentation is removed, as
Markdown does). Fragments that are not complete programs belong in another fence (```text).

README's first block (the quickstart) runs as ``python -c`` in a process of its own; the others in
processes forked from one that has imported jax and dtenjax but started no jax backend
(tests/procs.py's ForkServer: each block still gets its own XLA_FLAGS, ``__main__``, backend and
interpreter exit), which saves each block the 1-2 s of CPU that importing jax costs. A block that
sets a ``JAX_*`` variable (read when jax is imported) runs in a process of its own too."""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import procs
from tests import helpers

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


def test_blocks_that_count_devices_make_their_own():
  """A block that sizes its mesh with ``jax.device_count()``/``jax.devices()`` runs on a laptop's
  one CPU device too, and there proves nothing (a sum over one device, one device count of four):
  it sets the simulated device count itself, the README's line. A block whose devices come from
  the processes it starts (docs/elastic.md) counts them there."""
  counting = re.compile(r"jax\.device_count\(\)|jax\.devices\(\)")
  lacking = [b.id for b in BLOCKS if counting.search(b.values[0])
             and "xla_force_host_platform_device_count" not in b.values[0]
             and "subprocess" not in b.values[0]]
  assert not lacking, ("add the line that makes 8 simulated CPU devices (README's quickstart) to "
                       f"these blocks: {lacking}")


def _env(tmp):
  # A CPU-only machine; what the blocks write to temporary directories (tempfile.mkdtemp, the
  # elastic launcher's run directory) goes under this run's ``tmp``, not /tmp, where a directory
  # per block and run stayed behind.
  env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp))
  for var in ("XLA_FLAGS", "PYTHONPATH"):           # not the suite's 8 devices, not its paths
    env.pop(var, None)
  return env


pytestmark = helpers.one_worker(__name__)    # its fork server, made once


@pytest.fixture(scope="module")
def blocks_tmp(tmp_path_factory):
  return tmp_path_factory.mktemp("doc_blocks_tmp")


@pytest.fixture(scope="module")
def forks(tmp_path_factory, blocks_tmp):
  with procs.ForkServer(_env(blocks_tmp), ROOT, tmp_path_factory.mktemp("doc_blocks")) as server:
    yield server


def _fresh(code):
  return code is BLOCKS[0].values[0] or re.search(r"environ\b.*[\"']JAX_", code) is not None


def test_the_forked_blocks_see_their_own_xla_flags_and_a_fresh_main(forks, blocks_tmp):
  """What the forked processes rely on: the block's own XLA_FLAGS line takes effect (no backend
  was started before it), and its ``__main__`` holds only what it defines. Their temporary
  directories are the run's (``_env``), and so are the elastic launcher's run directories."""
  code = ('import os\nos.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"\n'
          'import jax, sys, tempfile\nprint(jax.device_count(), sorted(k for k in dir() if k[0] '
          '!= "_"), sys.argv, os.getcwd(), os.path.dirname(tempfile.mkdtemp()))\n')
  for _ in range(2):
    r = forks.run(["-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "['jax',", "'os',", "'sys',", "'tempfile']", "['-c']",
                                str(ROOT), str(blocks_tmp)]


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs_as_written(code, forks, blocks_tmp):
  if _fresh(code):
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(blocks_tmp),
                       capture_output=True, text=True, timeout=240)
  else:
    r = forks.run(["-c", code], timeout=240)
  assert r.returncode == 0, f"stdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-4000:]}"
