"""Smoke tests: the scheduler/CUDA-graph examples and benchmark run end to end (tiny, on CPU)."""

import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(args, timeout=300):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_resnet50_tiny_trains(tmp_path):
  out = _run(["examples/resnet50_train.py", "--tiny", "--json", str(tmp_path / "r.json")])
  assert "images/s" in out
  res = json.loads((tmp_path / "r.json").read_text())["results"][0]
  assert res["mode"] == "auto" and res["images_per_s"] > 0
  assert res["last_loss"] < res["first_loss"]      # it learns the synthetic batch
  assert res["ops_inside"] > 0 and res["report_source"] == "predicted"


def test_serve_microbatches_quick_loses_nothing():
  out = _run(["examples/serve_microbatches.py", "--quick"])
  rows = re.findall(r"│ (off|on)\s+│ (main|low_latency)\s+│ (\d+)\s+│", out)
  assert len(rows) == 4, out
  done = {(p, q): int(n) for p, q, n in rows}
  assert done[("off", "low_latency")] == done[("on", "low_latency")] == 20


def test_cuda_graphs_bench_quick_runs_on_cpu(tmp_path):
  _run(["bench/cuda_graphs.py", "--quick", "--json", str(tmp_path / "b.json")])
  data = json.loads((tmp_path / "b.json").read_text())
  rows = data["rows"]
  assert {r["policy"] for r in rows} == {"off", "xla", "auto", "all"}
  assert all(r["max_abs_diff_vs_off"] < 1e-5 for r in rows)
  loop = {r["policy"]: r for r in rows if r["case"] == "loop"}
  assert loop["auto"]["launches_per_step"] < loop["xla"]["launches_per_step"]
