"""bench/allreduce.py: its measurement runs on CPU, --procs results keep the slowest process,
--plot fails clearly without matplotlib (issue 15 item 12), the JSON is bench/_harness.py's schema
and one device is refused instead of measured."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _harness  # noqa: E402
import allreduce as bench  # noqa: E402


def _run(*args, env=None, bare=False):
  """The bench in a process of its own; ``bare``: as started directly on a CPU machine, without
  JAX_PLATFORMS and the suite's XLA_FLAGS."""
  e = {k: v for k, v in os.environ.items() if not bare or k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  e.update({} if bare else {"JAX_PLATFORMS": "cpu"}, PYTHONPATH=str(ROOT))
  e.update(env or {})
  return subprocess.run([sys.executable, str(ROOT / "bench" / "allreduce.py"), *args],
                        capture_output=True, text=True, env=e, timeout=600)


def test_measures_every_candidate_against_psum_on_8_simulated_devices(tmp_path):
  """Started directly on a CPU machine (no JAX_PLATFORMS, no XLA_FLAGS) it measures 8 devices,
  not 1 (issue 19: it used to report world=1 with meaningless ratios), every candidate against
  psum. One run for both claims (each was a process of its own)."""
  out = tmp_path / "r.json"
  # a chain of 4 over 3 iterations at 256 KiB: a candidate not measurably slower than the empty
  # chain gets no row rather than a made-up time, and smaller sizes can drown in the noise of the
  # suite's other worker
  r = _run("--sizes", "256K", "--chain", "4", "--iters", "3", "--warmup", "1",
           "--algorithms", "psum,one_shot,auto", "--json", str(out), bare=True)
  assert r.returncode == 0, r.stderr
  doc = _harness.load(str(out))                   # validates against the one schema
  assert doc["bench"] == "allreduce" and doc["argv"][:2] == ["--sizes", "256K"]
  assert doc["machine"]["devices"]["count"] == 8
  rows = doc["rows"]
  assert [row["algorithm"] for row in rows] == ["psum", "one_shot", "auto"]
  assert all(row["size"] == 262144 and row["count"] == 65536 and row["world"] == 8 and
             row["time_us"] > 0 for row in rows)
  for row in rows:   # nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n
    assert row["algbw"] == pytest.approx(262144 / (row["time_us"] * 1e-6) / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"] * 2 * 7 / 8)
    assert row["ratio"] == pytest.approx(rows[0]["time_us"] / row["time_us"])
  lines = r.stdout.splitlines()
  assert lines[1].split() == ["size", "count", "type", "algorithm", "time(us)", "lat(us)",
                              "algbw(GB/s)", "busbw(GB/s)", "vs", "psum"]
  assert lines[2].split()[:4] == ["262144", "65536", "float32", "psum"]
  assert lines[2].split()[-1] == "1.00x"
  assert f"wrote {out}" in r.stderr


def test_one_device_is_refused_not_measured():
  r = _run("--sizes", "4K", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert r.returncode == 3
  assert r.stderr.strip().splitlines() == [
      "bench/allreduce.py: cannot measure here: a collective over 1 rank(s) moves no data; it "
      "needs at least 2. jax sees 1 cpu device; run it where several GPUs are visible, or on CPU "
      "without XLA_FLAGS limiting the device count (8 simulated devices)."]
  assert r.stdout == ""


def test_merge_keeps_the_slowest_process_and_recomputes_ratios():
  row = lambda alg, t: dict(size=1024, algorithm=alg, time_us=t, world=2, type="float32")
  merged = bench._merge([[row("psum", 10.0), row("one_shot", 4.0)],
                         [row("psum", 12.0), row("one_shot", 3.0)]])
  by = {r["algorithm"]: r for r in merged}
  assert by["psum"]["time_us"] == 12.0 and by["one_shot"]["time_us"] == 4.0
  assert by["one_shot"]["ratio"] == pytest.approx(3.0)
  assert by["one_shot"]["busbw"] == pytest.approx(1024 / 4e-6 / 1e9)   # 2(n-1)/n = 1 for n=2
  assert by["one_shot"]["count"] == 256


def test_plot_without_matplotlib_fails_before_measuring(tmp_path):
  blocker = tmp_path / "matplotlib"
  blocker.mkdir()
  (blocker / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
  r = _run("--sizes", "4K", "--plot", str(tmp_path / "p.png"),
           env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
  assert r.returncode == 2
  assert "needs matplotlib" in r.stderr and "dtenjax[plot]" in r.stderr
  assert not (tmp_path / "p.png").exists()
