"""bench/pipeline.py as a user runs it, at a tiny size: the bench schema, both tables, and what its
numbers must show whatever the machine -- GPipe's compiled step holds more temporary memory than
1F1B's once micro-batches outnumber 2 x stages, the held inputs follow the schedules, the
unpipelined step is the baseline of the step table, whose rows are the schedules asked for it."""

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _harness  # noqa: E402  pylint: disable=g-import-not-at-top


def test_pipeline_bench_tables_and_json(tmp_path):
  out = tmp_path / "pipeline.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             XLA_FLAGS="--xla_force_host_platform_device_count=4")
  r = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline.py"), "--stages", "2",
                      "--micro", "8", "--schedules", "gpipe,1f1b", "--step-schedules", "1f1b",
                      "--layers", "4", "--d", "8",
                      "--seq", "4", "--iters", "1", "--json", str(out)],
                     capture_output=True, text=True, env=env, timeout=600, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "bubble and memory" in r.stdout and "speedup = unpipelined / this" in r.stdout
  doc = json.loads(out.read_text())
  assert _harness.validate(doc) == [] and doc["bench"] == "pipeline"
  bubble = {row["schedule"]: row for row in doc["rows"] if row["table"] == "bubble"}
  assert set(bubble) == {"GPipe()", "OneFOneB()"}
  assert bubble["GPipe()"]["inputs_held"] == 8 and bubble["OneFOneB()"]["inputs_held"] <= 3
  assert bubble["GPipe()"]["temp_bytes"] > bubble["OneFOneB()"]["temp_bytes"] > 0
  for row in bubble.values():
    assert row["theory"] == (2 - 1) / (8 + 2 - 1) and row["time_ms"] > 0 and row["alone_ms"] > 0
  steps = {row["candidate"]: row for row in doc["rows"] if row["table"] == "step"}
  # the step table's rows are the schedules asked for it (one: each is a pipelined step with its
  # optimizer, ~6 s of compile; GPipe's full step is checked bit for bit in test_pipeline.py)
  assert set(steps) == {"unpipelined", "1f1b p=2"}
  assert steps["unpipelined"]["speedup"] == 1.0 and steps["1f1b p=2"]["layout"].startswith("2 stages")
