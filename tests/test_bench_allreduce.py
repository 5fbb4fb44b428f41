"""bench/allreduce.py: its measurement runs on CPU, --procs results keep the slowest process, and
--plot fails clearly without matplotlib (issue 15 item 12)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import allreduce as bench  # noqa: E402  pylint: disable=g-import-not-at-top


def _run(*args, env=None):
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  e.update(env or {})
  return subprocess.run([sys.executable, str(ROOT / "bench" / "allreduce.py"), *args],
                        capture_output=True, text=True, env=e, timeout=600)


def test_measures_every_candidate_against_psum(tmp_path):
  out = tmp_path / "r.json"
  r = _run("--sizes", "4K", "--chain", "2", "--iters", "2", "--warmup", "1",
           "--algorithms", "psum,one_shot,auto", "--json", str(out))
  assert r.returncode == 0, r.stderr
  rows = json.loads(out.read_text())["rows"]
  assert [row["algorithm"] for row in rows] == ["psum", "one_shot", "auto"]
  assert all(row["size"] == 4096 and row["world"] == 8 and row["time_us"] > 0 for row in rows)
  assert rows[0]["ratio"] == 1.0
  assert "vs psum" in r.stdout.splitlines()[0]


def test_merge_keeps_the_slowest_process_and_recomputes_ratios():
  row = lambda alg, t: dict(size=1024, algorithm=alg, time_us=t, world=2, type="float32")
  merged = bench._merge([[row("psum", 10.0), row("one_shot", 4.0)],
                         [row("psum", 12.0), row("one_shot", 3.0)]])
  by = {r["algorithm"]: r for r in merged}
  assert by["psum"]["time_us"] == 12.0 and by["one_shot"]["time_us"] == 4.0
  assert by["one_shot"]["ratio"] == pytest.approx(3.0)
  assert by["one_shot"]["busbw"] == pytest.approx(1024 / 4e-6 / 1e9)


def test_plot_without_matplotlib_fails_before_measuring(tmp_path):
  blocker = tmp_path / "matplotlib"
  blocker.mkdir()
  (blocker / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
  r = _run("--sizes", "4K", "--plot", str(tmp_path / "p.png"),
           env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
  assert r.returncode == 2
  assert "needs matplotlib" in r.stderr and "dtenjax[plot]" in r.stderr
  assert not (tmp_path / "p.png").exists()
