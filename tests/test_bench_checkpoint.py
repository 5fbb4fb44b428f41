"""bench/checkpoint.py as a user runs it, at a toy size: every candidate (orbax's two layouts and
the disk roofline too), bit-checked restores, the common JSON schema with ratios against them
(these check the plumbing, not performance)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _harness  # noqa: E402


def test_checkpoint_bench_writes_both_candidates_and_ratios(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  out = tmp_path / "c.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, str(ROOT / "bench" / "checkpoint.py"), "--sizes", "1M",
                      "--reps", "2", "--leaves", "2", "--dir", str(tmp_path), "--json", str(out)],
                     capture_output=True, text=True, env=env, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  doc = _harness.load(str(out))
  assert doc["bench"] == "checkpoint" and doc["command"].startswith("python bench/checkpoint.py ")
  rows = {(row["candidate"], row["op"]): row for row in doc["rows"]}
  assert set(rows) == ({(c, op) for c in ("dtenjax", "orbax", "orbax_zarr")
                        for op in ("save", "restore")} | {("disk", "save")})
  for (c, op), row in rows.items():
    assert row["size"] == 1 << 20 and len(row["samples"]) == 2 and row["gbps"] > 0
    for base, key in (("orbax", "vs_orbax"), ("orbax_zarr", "vs_orbax_zarr")):
      assert row[key] == pytest.approx(rows[(base, op)]["seconds"] / row["seconds"])
    if op == "save":
      assert row["of_disk"] == pytest.approx(rows[("disk", "save")]["seconds"] / row["seconds"])
    assert row["bandwidth"].split()[1] in ("GB/s", "MB/s", "kB/s", "B/s")
    assert not row["bandwidth"].startswith("0.00 ")       # a unit that shows the figure
  assert rows[("dtenjax", "save")]["io"] == "posix"
  header = r.stdout.splitlines()[1]
  assert "vs orbax" in header and "vs orbax_zarr" in header and "of disk" in header
  # checkpoints removed; the JSON and, where matplotlib is installed, its chart stay
  assert sorted(p.name for p in tmp_path.iterdir()) in (["c.json"], ["c.json", "c.png"])


@pytest.mark.parametrize("name", ["2026-12-02_cpu8_checkpoint.json",
                                  "2026-12-02_h200_checkpoint_dtenjax.json",
                                  "2026-12-05_cpu8_checkpoint.json",
                                  "2026-12-05_cpu8_checkpoint_512M.json"])
def test_stored_checkpoint_results_keep_the_schema(name):
  """docs/benchmarks.md quotes these runs."""
  doc = _harness.load(str(ROOT / "bench" / "results" / name))
  assert doc["bench"] == "checkpoint"
  assert {r["candidate"] for r in doc["rows"]} <= {"dtenjax", "orbax", "orbax_zarr", "disk"}
