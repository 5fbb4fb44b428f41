"""tests/procs.py's ForkServer, which the tests that run scripts, doc blocks and multi-process jobs
use instead of a fresh ``python`` each time: what a forked run must share with a fresh process
(its own environment, argv, ``__main__``, exit status, output, a timeout that kills it) and what
tests/mp_workers/launch.py adds (neighbouring ranks with different hash seeds, as processes started
apart have), and ``start``, a run handed to this process as a ``subprocess.Popen`` child (the
elastic launcher's workers in tests/test_elastic_launch.py). The servers here import nothing (``preload=()``): the runs are plain Python."""

import os
import signal
import subprocess
import time

import pytest

import procs
from tests.mp_workers import launch


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  with procs.ForkServer(env, os.getcwd(), tmp_path_factory.mktemp("forks"), preload=()) as server:
    yield server


def test_a_forked_run_is_a_process_of_its_own(forks, tmp_path):
  code = ("import os, sys\nprint(os.getpid() != int(sys.argv[1]), sys.argv[1:], __name__,\n"
          "      sorted(k for k in dir() if not k.startswith('_')), os.environ['ONLY_HERE'],\n"
          "      os.getcwd())\nprint('to stderr', file=sys.stderr)\nsys.exit(7)\n")
  r = forks.run(["-c", code, str(os.getpid()), "x"], env=dict(forks.env, ONLY_HERE="1"),
                cwd=tmp_path)
  assert r.returncode == 7, r.stderr
  assert r.stdout == f"True ['{os.getpid()}', 'x'] __main__ ['os', 'sys'] 1 {tmp_path}\n"
  assert r.stderr == "to stderr\n"
  r = forks.run(["-c", "import os\nprint('ONLY_HERE' in os.environ)\n1 / 0\n"])
  assert r.returncode == 1 and r.stdout == "False\n"               # the previous run's env: gone
  assert r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
  script = tmp_path / "script.py"
  script.write_text("import sys, atexit\natexit.register(print, 'atexit ran')\n"
                    "print(sys.argv, sys.path[0])\n")
  r = forks.run([str(script), "--flag"])
  assert r.returncode == 0, r.stderr
  assert r.stdout == f"[{str(script)!r}, '--flag'] {tmp_path}\natexit ran\n"


@pytest.mark.parametrize("how", ["run", "run_at_once"])
def test_a_run_past_its_timeout_is_killed_with_what_it_started(forks, tmp_path, how):
  """The server's timeout (``run``), and this process's for the runs it adopted (``run_at_once``
  with servers, tests/mp_workers/launch.py's forked workers). 0.5 s: the run writes its child's
  pid within milliseconds of its start (a fork of a server that imported nothing, then one
  ``Popen``: 14-40 ms over 15 runs at load 7-10, 2026-12-06), and the test waits out the whole
  timeout."""
  pid_file = tmp_path / "child.pid"
  code = ("import subprocess, sys, time\n"
          "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          f"open({str(pid_file)!r}, 'w').write(str(p.pid))\ntime.sleep(60)\n")
  with pytest.raises(subprocess.TimeoutExpired):
    if how == "run":
      forks.run(["-c", code], timeout=0.5)
    else:
      procs.run_at_once({"sleeper": (["-c", code], forks.env)}, 0.5, [forks])
  child = int(pid_file.read_text())
  # the grandchild was in the run's process group: killed too (a zombie until its parent's
  # reaper, init, collects it; never left running)
  for _ in range(100):
    try:
      state = open(f"/proc/{child}/stat").read().split()[2]
    except FileNotFoundError:
      break
    if state == "Z":
      break
    import time
    time.sleep(0.05)
  else:
    raise AssertionError(f"process {child} is still running")


def test_what_a_process_reads_at_its_start_is_refused(forks):
  with pytest.raises(AssertionError, match="JAX_\\*"):
    forks.run(["-c", "pass"], env=dict(forks.env, JAX_PLATFORMS="cuda"))
  with pytest.raises(AssertionError, match="PYTHON"):
    forks.run(["-c", "pass"], env=dict(forks.env, PYTHONPATH="/elsewhere"))


def test_neighbouring_ranks_of_a_launch_have_different_hash_seeds(tmp_path):
  """Forked from two servers: ranks 0 and 2 have the string hashes of one server, ranks 1 and 3
  those of the other (a fork keeps its server's hash seed), so a rank whose work depends on a
  set's order disagrees with its neighbour, as processes started apart would."""
  with launch.shared_forks(preload=()) as slot:
    codes, results, logs = launch.launch("tests.mp_workers.hash_worker", 4, str(tmp_path),
                                         timeout_s=60)
    seeds = [int(s.run(["-c", "print(hash('dtenjax'))"]).stdout) for s in slot["servers"]]
  assert codes == [0] * 4, logs
  assert len({r["pid"] for r in results}) == 4
  assert [r["hash"] for r in results] == seeds * 2
  if os.environ.get("PYTHONHASHSEED", "random") == "random":    # else every process has one seed
    assert seeds[0] != seeds[1]


def _parent(pid: int) -> int:
  return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_a_started_run_is_this_processs_child_as_popen_makes_one(forks, tmp_path):
  """``start`` (dtenjax.elastic.launch's workers in tests/test_elastic_launch.py): the run is
  forked and adopted by this process, which polls, signals and waits for it as the launcher does
  a ``subprocess.Popen``: exit status, death by a signal, a stopped run, a wait that times out."""
  log = tmp_path / "run.log"
  with pytest.raises(AssertionError, match="adopting"):
    forks.start(["-c", "pass"], forks.env, log)
  with procs.adopting():
    p = forks.start(["-c", "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)"],
                    forks.env, log)
    assert p.wait(timeout=30) == 3 and p.poll() == 3 and p.returncode == 3
    assert sorted(log.read_text().split()) == ["err", "out"]          # one log for both
    p = forks.start(["-c", "import time\ntime.sleep(60)"], forks.env, tmp_path / "sleep.log")
    assert _parent(p.pid) == os.getpid() and p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
      p.wait(timeout=0.2)
    p.send_signal(signal.SIGSTOP)            # stopped is not ended
    time.sleep(0.1)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    p.send_signal(signal.SIGKILL)            # after its end: nothing to signal, as Popen
  assert not procs._subreaper()


def test_adopting_nests_and_the_outermost_exit_ends_it(forks, tmp_path):
  """Two launches at once on threads (tests/test_attacks.py's dead-process jobs) each adopt their
  runs inside one outer ``adopting()``: the first to finish must not turn adoption off under the
  other, whose runs may still be starting."""
  with procs.adopting():
    with procs.adopting():
      assert procs._subreaper()
    assert procs._subreaper()                # the inner exit leaves the outer's adoption on
    p = forks.start(["-c", "pass"], forks.env, tmp_path / "run.log")
    assert p.wait(timeout=30) == 0
  assert not procs._subreaper()
