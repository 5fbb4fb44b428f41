"""tests/conftest.py's xdist groups, as scripts/test.sh runs the suite: tests of one group (marked
``xdist_group``, or ``multiprocess``: they start several processes) run in one worker. It fails on pytest 9.2, where pytest-xdist's --dist loadgroup ignores
the groups (pytest-dev/pytest-xdist#1386; hence pyproject's pytest<9.2)."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

TESTS = textwrap.dedent("""
    import json, os, pathlib, time
    import pytest

    def _ran(name):
      with open(os.environ["RAN"], "a") as f:
        f.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
      time.sleep(0.3)

    # adjacent members: a plain round robin over the tests would split them
    @pytest.mark.xdist_group("procs")
    def test_g0(): _ran("g0")
    @pytest.mark.multiprocess
    def test_g1(): _ran("g1")
    def test_s0(): _ran("s0")
    def test_s1(): _ran("s1")
    def test_s2(): _ran("s2")
    @pytest.mark.xdist_group("procs")
    def test_g2(): _ran("g2")
    @pytest.mark.multiprocess
    def test_g3(): _ran("g3")
    @pytest.mark.parametrize("i", range(4))
    def test_s3(i): _ran(f"s3{i}")
""")


def test_a_group_runs_in_one_worker(tmp_path):
  for name in ("conftest.py", "procs.py"):
    shutil.copy(ROOT / "tests" / name, tmp_path / name)
  (tmp_path / "test_groups.py").write_text(TESTS)
  ran = tmp_path / "ran.jsonl"
  env = dict(os.environ, RAN=str(ran))
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                      "--dist", "loadgroup", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                      "test_groups.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=240, check=False)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  workers = dict(json.loads(line) for line in ran.read_text().splitlines())
  assert len(workers) == 11, workers
  assert len({workers[g] for g in ("g0", "g1", "g2", "g3")}) == 1, workers
  assert set(workers.values()) == {"gw0", "gw1"}, workers      # and the rest was spread
