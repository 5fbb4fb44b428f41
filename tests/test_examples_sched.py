"""Smoke tests: the scheduler/CUDA-graph examples and benchmark run end to end (tiny, on CPU).

Each runs as ``python FILE``: the serving example in a process of its own, the others in processes
forked from one that has imported jax (tests/procs.py's ForkServer: the same ``__main__`` run
without paying jax's import each time)."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from tests import compile_only, helpers
from tests.mp_workers import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=launch.pythonpath())
  env.pop("XLA_FLAGS", None)
  return env


pytestmark = helpers.one_worker(__name__)    # the session's fork servers: one worker starts them


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
  with launch.one_server(_env(), tmp_path_factory.mktemp("examples")) as server:
    yield server


@pytest.fixture
def run(forks):
  def run(args, timeout=300, xla_flags=None):
    proc = forks.run(args, timeout=timeout,
                     env=None if xla_flags is None else dict(_env(), XLA_FLAGS=xla_flags))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
  return run


def _run(args, timeout=300):
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True,
                        text=True, timeout=timeout, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return proc.stdout


def test_resnet50_tiny_trains(tmp_path, run):
  # LLVM unoptimised (tests/compile_only.py), here and in the gpt2 run: the claims read the steps'
  # structure and losses, never their speed; resnet50's losses were the same bits both ways
  out = run(["examples/resnet50_train.py", "--tiny", "--json", str(tmp_path / "r.json")],
            xla_flags=compile_only.LLVM_O0_FLAGS)
  assert "images/s" in out and "auto vs jax.jit's default" in out
  results = json.loads((tmp_path / "r.json").read_text())["results"]
  assert [r["mode"] for r in results] == ["jax.jit", "auto"]      # jax.jit's default first
  for res in results:
    assert res["images_per_s"] > 0 and res["last_loss"] < res["first_loss"]
    assert res["ops_inside"] > 0 and res["report_source"] == "predicted"
    assert res["predicted_graph_launches_per_step"] > 0
  assert results[0]["first_loss"] == results[1]["first_loss"]      # the same step


def test_resnet50_sliced_pooling_matches_reduce_window_forward():
  import sys
  sys.path.insert(0, str(ROOT / "examples"))
  import jax
  import numpy as np
  import resnet50_train as rn
  # jitted as the example's step runs them: op by op, each slice, maximum and pad of each size was
  # a compile of its own (about 60); the inputs from numpy (a jax.random draw compiles per shape)
  pool = jax.jit(rn.max_pool_3x3_s2, static_argnums=1)
  for h in (7, 8, 112):
    x = np.random.default_rng(h).standard_normal((2, h, h + 1, 3), np.float32)
    np.testing.assert_array_equal(pool(x, "slices"), pool(x, "reduce_window"))


def test_gpt2_tiny_trains_and_decodes(tmp_path, run):
  out = run(["examples/gpt2_train.py", "--tiny", "--modes", "auto", "--json",
              str(tmp_path / "g.json")], xla_flags=compile_only.LLVM_O0_FLAGS)
  res = json.loads((tmp_path / "g.json").read_text())["results"]
  assert [r["mode"] for r in res] == ["jax.jit", "auto"] and "tokens/s" in out
  out = run(["examples/gpt2_train.py", "--tiny", "--decode", "--modes", "auto"],
            xla_flags=compile_only.LLVM_O0_FLAGS)
  assert "auto vs jax.jit's default" in out


def test_serve_microbatches_quick_loses_nothing():
  out = _run(["examples/serve_microbatches.py", "--quick"])
  rows = re.findall(r"│ (off|on)\s+│ (main|low_latency)\s+│ (\d+)\s+│", out)
  assert len(rows) == 4, out
  done = {(p, q): int(n) for p, q, n in rows}
  assert done[("off", "low_latency")] == done[("on", "low_latency")] == 20


def test_cuda_graphs_bench_tiny_compares_with_jax_jit_first(tmp_path, run):
  run(["bench/cuda_graphs.py", "--tiny", "--cases", "loop,split", "--out", str(tmp_path)])
  data = json.loads((tmp_path / "cuda_graphs.json").read_text())
  loop = {r["candidate"]: r for r in data["cases"]["loop"]["candidates"]}
  assert list(loop) == ["jax.jit", "auto", "auto_v1", "measure", "off"]   # jax.jit first
  assert all(r["first_output_max_abs_diff"] == 0 for r in loop.values())
  assert "+WHILE" in loop["auto"]["policy"] and loop["auto"]["new_executables"] == 1
  assert loop["measure"]["measure"]["cost_s"] > 0
  assert all(r["observed"]["executions"] == 3 for r in loop.values())   # the trace was read
  split = {r["candidate"]: r for r in data["cases"]["split"]["candidates"]}
  assert split["auto"]["new_executables"] == 0 and split["auto"]["same_hlo_as_jax_jit"]
  assert split["auto"]["compiler_options"] == {}
  assert {r["case"] for r in data["rows"]} == {"loop", "split"}


def _bench_module(name):
  import importlib
  import sys
  sys.path.insert(0, str(ROOT / "bench"))
  return importlib.import_module(name)


def test_every_bench_case_and_workload_traces(tmp_path):
  """Each case the GPU runs measure (and each reproducibility workload, under every pin set)
  traces at toy size: shapes, donation, the state threading, without compiling."""
  import jax
  import numpy as np
  # host zeros: jnp.zeros compiled a program per output shape and dtype (51 here)
  zeros = lambda tree: jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), tree)
  cg = _bench_module("cuda_graphs")
  for case in cg.CASES:
    spec = cg.build(case, tiny=True, on_gpu=False)
    out = zeros(jax.eval_shape(spec["fn"], *spec["args"]))
    nxt = spec["advance"](spec["args"], out)
    assert jax.tree.structure(nxt) == jax.tree.structure(spec["args"]), case
  rw = _bench_module("_repro_workloads")
  for name in rw.WORKLOADS:
    spec = rw.build(name, tiny=True)
    out = zeros(jax.eval_shape(spec["fn"], *spec["args"]))
    assert spec["loss"](out).shape == (), name
    assert jax.tree.structure(spec["advance"](spec["args"], out)) == jax.tree.structure(
        spec["args"]), name
    for pins in rw.PINS:
      rw.jit_with(pins, spec["fn"], spec["donate"], cache_dir=str(tmp_path / "autotune"))
