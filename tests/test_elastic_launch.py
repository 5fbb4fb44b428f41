"""dtenjax.elastic.launch with loopback processes: 4 processes x 2 CPU devices train; processes
are killed (-9, process 0 included) or stopped (SIGSTOP) at a step; the job continues on fewer
processes from the in-memory tier (peers' replicas), and every logged loss and the final
parameters are bit-identical to an uninterrupted 8-device run. The failures share one run (one
generation each), so the processes started for them are paid once."""

import json
import os
import subprocess
import sys

import pytest

import dtenjax
import dtenjax.checkpoint as ckpt
import dtenjax.elastic
import procs
from dtenjax._src.elastic import launcher
from tests import helpers
from tests import compile_only
from tests.mp_workers import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "mp_workers", "elastic_worker.py")
STEPS = 8
HEARTBEAT_S = 4.0
# reproducible_step's CPU flag (docs/reproducibility.md), and LLVM unoptimised: every run's bits
# are compared with the reference run's in this session, never with a stored digest.
FLAGS = "--xla_cpu_max_isa=AVX " + compile_only.LLVM_O0_FLAGS


def _env(devices):
  return {"JAX_PLATFORMS": "cpu", "PYTHONPATH": launch.pythonpath(),
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FLAGS}"}


def _losses(out_dir):
  """{step: loss hex}; a step computed twice (after a restore from an earlier snapshot) must have
  given the same bits both times."""
  by_step = {}
  with open(os.path.join(out_dir, "losses.jsonl")) as f:
    for line in f:
      e = json.loads(line)
      assert by_step.setdefault(e["step"], e["loss"]) == e["loss"], e
  return [by_step[s] for s in sorted(by_step)]


# The workers of the jobs below are forked (tests/procs.py) from the session's two servers
# (tests/mp_workers/launch.py), which have imported jax and dtenjax, even ranks from one and odd
# ranks from the other (so that neighbours differ in their hash seeds, as processes started apart
# do), through the launcher's one seam for starting a worker (``launcher._start``): a job's 10
# process starts no longer pay jax's import (1-2 s of CPU each). This process adopts them (a
# child subreaper), so the launcher polls, signals and waits for them as for its own children.
# The launcher's own ``subprocess.Popen`` path is what the other tests here (and `dtenjax
# launch`'s) run. DTENJAX_TEST_FORK=0 starts them as the launcher does.
@pytest.fixture(scope="session")
def forks():
  return launch.fork_servers([{**os.environ, **_env(1)}])


@pytest.fixture
def forked_workers(forks, monkeypatch):
  if not forks:
    yield
    return
  monkeypatch.setattr(launcher, "_start", lambda argv, env, log: forks[
      int(env["DTENJAX_ELASTIC_RANK"]) % 2].start(argv, env, log))
  with procs.adopting():
    yield


@pytest.fixture(scope="module")
def reference(tmp_path_factory, forks):
  """The uninterrupted run: one process of 8 devices, no launcher."""
  out = tmp_path_factory.mktemp("reference")
  argv, env = [WORKER, str(out), str(STEPS)], {**os.environ, **_env(8)}
  procs.run_at_once({"reference": (argv, env)}, 240, forks)
  with open(out / "final.json") as f:
    final = json.load(f)
  assert final["devices"] == 8 and final["step"] == STEPS
  return _losses(out), final["digest"]


def _launch(tmp_path, faults, **kwargs):
  out = tmp_path / "out"
  out.mkdir()
  result = dtenjax.elastic.launch(
      [WORKER, str(out), str(STEPS), faults], 4, min_nprocs=1, env=_env(2),
      run_dir=str(tmp_path / "run"), snapshot_every=2, heartbeat_timeout_s=HEARTBEAT_S,
      # under pytest's 300 s: a job that stalls ends in the launcher's own error, which names
      # the generation, the exit codes and the run's logs (pytest's timeout names none of them)
      timeout_s=240, quiet=True, **kwargs)
  with open(out / "final.json") as f:
    final = json.load(f)
  return result, _losses(out), final


def _first(events, kind, **match):
  return min(e["t"] for e in events if e["event"] == kind
             and all(e.get(k) == v for k, v in match.items()))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_kill_9_of_process_0_then_a_stop_then_a_kill_9_same_bits(tmp_path, reference,
                                                                  forked_workers):
  """Three failures in one run, one generation each (4, 3, 2 and 1 processes: the scenarios of
  two runs in ten process starts instead of sixteen), with persistent checkpoints every 2 steps:
  kill -9 of process 0 (the coordination service's host) at step 2; SIGSTOP of process 1 of the
  3-process job at step 4: both survivors name it within the heartbeat timeout + 10 %; kill -9 of
  process 1 of the 2-process job at step 6: the launcher sees it within 2 s. Every restore reads
  peers' memory although checkpoints exist, and the job ends on 1 process with every logged loss
  and the final parameters and optimizer state of the uninterrupted run, bit for bit."""
  ref_losses, ref_digest = reference
  result, losses, final = _launch(tmp_path, "0:0:2:KILL,1:1:4:STOP,2:1:6:KILL",
                                  checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
  assert result.code == 0
  assert [(g.world, g.lost) for g in result.generations] == [(4, [0]), (3, [1]), (2, [1]),
                                                             (1, [])], result.summary()
  g0, g1, g2, g3 = result.generations
  # persistent checkpoints were written (up to step 8), but the in-memory tier always held a
  # step at least as new: no restore read a checkpoint
  assert ckpt.CheckpointManager(tmp_path / "ck").all_steps()[-1] == 8
  assert all(g.restore["source"] == "memory" for g in (g1, g2, g3))
  assert g1.restore["step"] == 2 and g2.restore["step"] in (2, 4) and g3.restore["step"] in (4, 6)
  events = result.events()
  assert {e["source"] for e in events if e["event"] == "restored" and e["generation"] > 0} == {
      "memory"}
  # the survivors of generation 1 (ranks 0 and 2) each named rank 1
  assert sorted(r["rank"] for r in g1.reports) == [0, 2] and all(
      r["lost"] == [1] and "lost rank 1" in r["message"] and "no heartbeat within 4 s"
      in r["message"] for r in g1.reports)
  stopped = _first(events, "fault", generation=1)
  named = min(r["t"] for r in g1.reports) - stopped
  assert g1.codes[1] is None                           # stopped, then killed by the launcher
  killed = _first(events, "fault", generation=2)
  detect = _first(events, "detected", generation=2) - killed
  resumed = _first(events, "first_step", generation=3) - killed
  print(f"SIGSTOP at step 4: named by a survivor after {named:.2f} s (timeout {HEARTBEAT_S:g} s); "
        f"kill -9 at step 6: detected after {detect:.2f} s, first step on 1 process after "
        f"{resumed:.1f} s")
  assert named <= HEARTBEAT_S * 1.1
  assert detect < 2.0 and resumed < 200
  assert final["devices"] == 2 and final["restored_from"] == "memory"
  assert losses == ref_losses                          # every step's loss, bit for bit
  assert final["digest"] == ref_digest                 # parameters and optimizer state


def test_fewer_than_min_nprocs_stops_the_job_with_the_lost_ranks(tmp_path):
  script = tmp_path / "die.py"
  script.write_text("import os, signal\n"
                    "if os.environ['DTENJAX_ELASTIC_RANK'] == '1':\n"
                    "  os.kill(os.getpid(), signal.SIGKILL)\n"
                    "import time; time.sleep(60)\n")
  with pytest.raises(dtenjax.ProcessLostError) as e:
    dtenjax.elastic.launch([str(script)], 2, min_nprocs=2, run_dir=str(tmp_path / "run"),
                           timeout_s=60, quiet=True)
  assert e.value.lost == (1,)
  assert "1 processes would remain, fewer than min_nprocs=2" in str(e.value)


_LAGGING_SURVIVOR = """\
import os, sys, time
rank = int(os.environ["DTENJAX_ELASTIC_RANK"])
run = os.environ["DTENJAX_ELASTIC_RUN_DIR"]
if os.environ["DTENJAX_ELASTIC_GENERATION"] != "0":
  sys.exit(0)
pid_file = os.path.join(run, "rank0.pid")
if rank == 1:                    # stopped: never exits, never reports
  time.sleep(60)
  sys.exit(1)
import dtenjax                   # (the worker module imports jax: only the survivors import it)
from dtenjax._src.elastic import worker
if rank == 2:                    # imported: ready to watch
  open(os.path.join(run, "rank2.ready"), "w").close()
if rank == 0:                    # process 0 sees rank 1 silent first
  while not os.path.exists(os.path.join(run, "rank2.ready")):
    time.sleep(0.01)
  with open(pid_file + ".tmp", "w") as f:
    f.write(str(os.getpid()))
  os.replace(pid_file + ".tmp", pid_file)
  worker._lost(run, 0, 3, 0, 5.0)(dtenjax.ProcessLostError("process 0/3: lost rank 1", [1]))
while not os.path.exists(pid_file):
  time.sleep(0.01)
time.sleep(1.5)                  # rank 2 sees it 1.5 s later (a loaded host)
try:                             # its store is process 0's: gone if process 0 has left
  with open("/proc/%s/stat" % open(pid_file).read()) as f:
    store_up = f.read().rsplit(")", 1)[1].split()[0] != "Z"
except OSError:
  store_up = False
worker._lost(run, 2, 3, 0, 5.0)(dtenjax.ProcessLostError(
    "process 2/3: lost rank " + ("1" if store_up else "0"), [1] if store_up else [0]))
"""


def test_a_survivor_that_sees_a_stopped_peer_later_is_waited_for(tmp_path):
  """Process 0 names a silent rank 1 first; rank 2 names it 1.5 s later. Process 0 hosts the
  coordination store, so it must stay until rank 2 has reported (else rank 2's store fails and
  it names rank 0, as a loaded run of the kill -9 test once did), and the launcher must wait for
  rank 2's report (it waited 0.2 s): only rank 1 is lost, named by both survivors."""
  script = tmp_path / "lag.py"
  script.write_text(_LAGGING_SURVIVOR)
  result = dtenjax.elastic.launch([str(script)], 3, min_nprocs=1, env={"PYTHONPATH": ROOT},
                                  run_dir=str(tmp_path / "run"), heartbeat_timeout_s=5.0,
                                  snapshot_every=0, timeout_s=60, quiet=True)
  g0 = result.generations[0]
  assert [(g.world, g.lost) for g in result.generations] == [(3, [1]), (2, [])], result.summary()
  assert [(r["rank"], r["lost"]) for r in g0.reports] == [(0, [1]), (2, [1])]
  assert g0.codes[1] is None                           # stopped, then killed by the launcher


# One process at a time (not "several processes talking over loopback"): outside the procs
# group (tests/procs.py), so the other worker may run it.
def test_dtenjax_launch_says_what_it_checked_and_runs_the_job(tmp_path):
  script = tmp_path / "hello.py"
  script.write_text("import sys, dtenjax.elastic\n"
                    "ctx = dtenjax.elastic.init()\n"
                    "print('rank', ctx.rank, 'of', ctx.world, sys.argv[1:])\n"
                    "ctx.finish()\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": launch.pythonpath()}
  env.pop("XLA_FLAGS", None)
  # the command forked from the session's servers (its launcher still starts its worker with
  # subprocess.Popen): a process of its own without jax's import (1.3 s of CPU)
  out = procs.run_at_once(
      {"launch": (["-m", "dtenjax", "launch", "--nprocs", "1", "--cpu-devices-per-proc", "1",
                   "--reproducible", "--run-dir", str(tmp_path / "run"), str(script), "--steps",
                   "3"], env)}, 180, launch.fork_servers([env]))["launch"]
  assert "ok  process settings for reproducible steps: present" in out
  assert "ok  the script joins the elastic job (dtenjax.elastic.init): yes" in out
  assert "NO  the script compiles its step with dtenjax.reproducible_step: not found" in out
  assert "generation 0: 1 processes from the start; finished" in out
  log = (tmp_path / "run" / "g0.r0.log").read_text()
  assert "rank 0 of 1 ['--steps', '3']" in log      # the script's own arguments reach it
  # Usage errors come before jax is imported (1.3 s of CPU each): here jax cannot be imported,
  # and the errors are still the usage errors.
  env["PYTHONPATH"] = os.pathsep.join([helpers.without_jax(tmp_path / "nojax"), ROOT])
  r = subprocess.run([sys.executable, "-m", "dtenjax", "launch", "--nprocs", "2",
                      str(tmp_path / "nosuch.py")], env=env, capture_output=True, text=True,
                     timeout=120, check=False)
  assert r.returncode == 2 and "is not a file" in r.stderr, r.stderr[-2000:]
  r = subprocess.run([sys.executable, "-m", "dtenjax", "launch", "--nprocs", "2", "--min-nprocs",
                      "3", str(script)], env=env, capture_output=True, text=True, timeout=120,
                     check=False)
  assert r.returncode == 2 and "--min-nprocs 3: more than --nprocs 2; give at most 2" in r.stderr


GROW = """
import json, os, signal, sys, time
import numpy as np
import dtenjax.elastic
ctx = dtenjax.elastic.init()
state, step = ctx.restore({"x": np.zeros(4)})
while step < 24:
  state = {"x": state["x"] + step}
  step += 1
  time.sleep(0.05)
  ctx.step_done(step, state)
  if (ctx.generation, ctx.rank, step) == (0, 1, 4):
    os.kill(os.getpid(), signal.SIGKILL)
if ctx.rank == 0:
  with open(sys.argv[1], "w") as f:
    json.dump({"x": state["x"].tolist(), "world": ctx.world}, f)
ctx.finish()
"""


@pytest.mark.multiprocess
def test_a_shrunk_job_grows_back_at_the_next_snapshot_when_capacity_returns(tmp_path,
                                                                            forked_workers):
  script = tmp_path / "grow.py"
  script.write_text(GROW)
  out = tmp_path / "out.json"
  looks = []

  def capacity():                         # no room at the launcher's first look, then room for 2
    looks.append(1)
    return 1 if len(looks) == 1 else 2
  result = dtenjax.elastic.launch(
      [str(script), str(out)], 2, min_nprocs=1, run_dir=str(tmp_path / "run"), quiet=True,
      heartbeat_timeout_s=4, timeout_s=180, env={"JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT},
      capacity=capacity)
  worlds = [g.world for g in result.generations]
  assert worlds == [2, 1, 2], result.summary()
  g0, g1, g2 = result.generations
  assert g0.lost == [1] and g1.grown_at is not None and not g1.lost
  assert g2.restore == {"source": "memory", "root": g2.restore["root"], "world": 1, "lost": [],
                        "step": g1.grown_at}
  assert f"stopped to grow at step {g1.grown_at}" in result.summary()
  final = json.loads(out.read_text())
  assert final == {"x": [float(sum(range(24)))] * 4, "world": 2}


def test_two_runs_whose_directories_share_a_last_name_get_their_own_memory_tier(tmp_path):
  """The in-memory tier's directory is removed when its run ends: two jobs on one host whose run
  directories were both named ``run`` shared ``/dev/shm/dtenjax-memory-UID/run``, and the first
  to end removed the other's records (a side-by-side test run failed with FileNotFoundError on
  ``.../run/gen0/holder0/own.0.2.tmp``)."""
  root = str(tmp_path / "shm")
  a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
  dirs = {launcher.memory_dir(root, str(a)), launcher.memory_dir(root, str(b))}
  assert len(dirs) == 2
  assert all(os.path.dirname(d) == root and os.path.basename(d).startswith("run-") for d in dirs)
  assert launcher.memory_dir(root, str(a)) == launcher.memory_dir(root, str(a) + "/")
