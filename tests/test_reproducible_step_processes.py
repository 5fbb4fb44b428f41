"""Same bits from process to process: the demo's step (on CPU), the demo itself and larger steps
(on a GPU, marked ``gpu``), each run in two FRESH processes at once, must give the same digest.
On a GPU with reproducible_step's pins, which is what the demo uses there: without them the demo
printed two different digests in five fresh processes on an H200 (autotuning)."""

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _repro_device  # noqa: E402


def _platform_env(monkeypatch, gpu: bool):
  if gpu:
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  else:
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def _demo_digests(steps: int) -> list[str]:
  outs = _repro_device.fresh_processes(
      [["-m", "dtenjax", "demo", "--no-progress", "--steps", str(steps)]] * 2, tiny=False,
      timeout_s=280)
  lines = []
  for o in outs:
    assert "error" not in o, o
    lines.append(next(l for l in o["stdout"].splitlines() if l.startswith("losses sha256 ")))
  return lines


def _step_digests(workload: str, pins: str, tiny: bool) -> list[dict]:
  job = ["bench/_repro_workloads.py", workload, pins, "3"] + (["--tiny"] if tiny else [])
  outs = _repro_device.fresh_processes([job, job], tiny=False, timeout_s=280)
  rows = []
  for o in outs:
    assert "error" not in o, o
    rows.append(__import__("json").loads(o["stdout"].strip().splitlines()[-1]))
  return rows


@pytest.mark.slow
def test_the_demo_step_gives_the_same_bits_in_two_fresh_processes(monkeypatch):
  """The demo's training step (shard_map over 8 devices, exact all-reduce, adam), compiled as
  the demo compiles it on this backend, three steps in two fresh processes."""
  _platform_env(monkeypatch, gpu=False)
  rows = _step_digests("demo", "reproducible_step", tiny=True)
  assert rows[0]["device"] == "cpu" and rows[0]["steps"] == 3
  assert rows[0]["losses"][0] != rows[0]["losses"][-1]            # it trained
  assert rows[0]["digest"] == rows[1]["digest"], rows


@pytest.mark.gpu
def test_gpu_demo_prints_the_same_digest_in_two_fresh_processes(monkeypatch):
  _platform_env(monkeypatch, gpu=True)
  a, b = _demo_digests(60)
  assert "gpu device(s)" in a and "xla_gpu_autotune_level=0" in a, a
  assert a.split()[2] == b.split()[2], (a, b)


@pytest.mark.gpu
def test_gpu_reproducible_step_gives_the_same_bits_in_two_fresh_processes(monkeypatch):
  """A GPT-2 step (autotuned GEMMs under jax.jit; an embedding, whose gradient is a scatter-add
  with repeated indices) in two fresh processes sharing one GPU. bench/reproducible_step.py
  --device runs more workloads (ResNet's convolutions) and more processes."""
  _platform_env(monkeypatch, gpu=True)
  rows = _step_digests("gpt2_mid", "reproducible_step", tiny=False)
  assert rows[0]["device"] != "cpu"
  assert rows[0]["digest"] == rows[1]["digest"], rows


def test_fresh_processes_reports_failures_instead_of_hanging():
  # 2 s: the exiting process needs an interpreter's start (tens of milliseconds), and the test
  # waits out the whole timeout for the sleeping one
  outs = _repro_device.fresh_processes([["-c", "import sys; sys.exit(3)"],
                                       ["-c", "import time; time.sleep(30)"]], tiny=True,
                                      timeout_s=2)
  assert outs[0]["error"].startswith("exit 3")
  assert "timed out after 2 s" in outs[1]["error"]
  assert os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE") != "false"     # the caller's env kept
