"""scripts/gpu_check.sh on the machines it meets: with one GPU it must pass and say what it
skipped (collective benchmarks and the cost-model check need >= 2 ranks); with two it runs them.

``nvidia-smi`` and the Python it runs are replaced by recording stubs on PATH (the script's
contract is which commands it runs and what it prints and returns, not what they measure)."""

import os
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(tmp_path, gpus: int, parts: list[str]):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  smi = bin_dir / "nvidia-smi"
  smi.write_text("#!/bin/sh\n" + "".join(f'echo "GPU {i}: NVIDIA H200 (UUID: GPU-{i})"\n'
                                          for i in range(gpus)))
  calls = tmp_path / "calls.txt"
  py = bin_dir / "py"
  py.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
  for f in (smi, py):
    f.chmod(0o755)
  env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(py),
             LOGS=str(tmp_path / "logs"))
  env.pop("OUT", None)
  r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *parts], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=120, check=False)
  ran = calls.read_text().splitlines() if calls.exists() else []
  return r, ran


def test_one_gpu_skips_collectives_and_the_cost_model_and_says_why(tmp_path):
  r, ran = _run(tmp_path, 1, ["bench", "topo"])
  assert r.returncode == 0, r.stdout + r.stderr
  assert not any("bench/allreduce.py" in c or "costmodel_check" in c for c in ran), ran
  assert any(c.startswith("-m dtenjax topo") for c in ran)
  assert any(c.startswith("-m dtenjax demo") for c in ran)
  summary = r.stdout.split("== gpu_check summary (1 GPUs)")[1]
  assert "skipped  allreduce_benchmarks: 1 GPU(s): a collective needs >= 2 ranks" in summary
  assert "skipped  costmodel_check: 1 GPU(s)" in summary


def test_two_gpus_run_the_collective_benchmarks(tmp_path):
  r, ran = _run(tmp_path, 2, ["bench"])
  assert r.returncode == 0, r.stdout + r.stderr
  benches = [c for c in ran if c.startswith("bench/allreduce.py")]
  assert len(benches) == 4 and sum("--procs 2" in c for c in benches) == 2, benches
  assert "skipped" not in r.stdout.split("== gpu_check summary")[1]


def test_graphs_and_repro_parts_run_the_two_harnesses(tmp_path):
  r, ran = _run(tmp_path, 1, ["graphs", "repro"])
  assert r.returncode == 0, r.stdout + r.stderr
  assert [c.split()[0] for c in ran] == ["bench/cuda_graphs.py", "bench/reproducible_step.py"]
  assert "--device" in ran[1] and "--out" in ran[0]
