"""Tests that start processes of their own: the xdist group they share, a runner that starts
them all at once, and a fork server (``ForkServer``) that starts them without paying jax's import
each time.

scripts/test.sh runs two pytest-xdist workers on a 2-core machine; two such tests at once would put
many busy processes on 2 cores (their timeouts were chosen for one test at a time), so they share
the group ``procs`` (tests/conftest.py adds it to every ``multiprocess`` test) and run one after
another in one worker while the other worker goes on with the rest.

A test that starts one busy process at a time (a fresh process for a process-wide flag such as
``--xla_cpu_max_isa=AVX``, processes run one after another) keeps one core busy while pytest
waits for it, as a test in the pytest process does: it stays out of the group, so that the
group's worker, which runs every test of the group in a row, is not the last to finish.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

PROCS = pytest.mark.xdist_group("procs")


def run_at_once(runs: dict, timeout: float, servers: list | None = None) -> dict:
  """``{key: (argv after python, env)}`` -> ``{key: stdout}``: every ``python argv`` started at
  once (each is mostly single-threaded compilation, so they overlap on 2 cores), each asserted to
  exit 0 within ``timeout`` seconds; none is left running. With ``servers`` (ForkServers, e.g.
  tests/mp_workers/launch.py's ``fork_servers()``) the runs are forked from them in turn, and
  adopted by this process, instead of started."""
  if not servers:
    procs = {k: subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
             for k, (argv, env) in runs.items()}
    out = {}
    try:
      for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, (k, stderr[-3000:])
        out[k] = stdout
    finally:
      for p in procs.values():
        if p.poll() is None:
          p.kill()
    return out
  out, texts = {}, {}
  with tempfile.TemporaryDirectory(prefix="dtenjax-runs-") as out_dir:
    files = {k: (os.path.join(out_dir, f"{i}.out"), os.path.join(out_dir, f"{i}.err"))
             for i, k in enumerate(runs)}
    with adopting():
      procs = {k: servers[i % len(servers)].start(argv, env, files[k][0], err=files[k][1])
               for i, (k, (argv, env)) in enumerate(runs.items())}
      codes = wait_all(procs, timeout)
    for k, (stdout, stderr) in files.items():
      with open(stdout) as f, open(stderr) as g:
        out[k], texts[k] = f.read(), g.read()
  for k, code in codes.items():
    if code is None:
      raise subprocess.TimeoutExpired(runs[k][0], timeout, out[k], texts[k])
    assert code == 0, (k, texts[k][-3000:])
  return out


def wait_all(procs: dict, timeout: float) -> dict:
  """``{key: process}`` (``subprocess.Popen`` or ``Adopted``) -> ``{key: exit code}``, waiting
  until each has ended or ``timeout`` seconds (for all of them) have passed; one still running
  then is killed (``Adopted``: with its process group) and its code is None."""
  deadline, codes = time.monotonic() + timeout, {}
  try:
    for k, p in procs.items():
      try:
        codes[k] = p.wait(timeout=max(0.1, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        codes[k] = None
  finally:
    for p in procs.values():
      if p.poll() is None:
        p.kill()
        p.wait(timeout=30)
  return codes


# The fork server's own program (``python -c``): imports jax and dtenjax once -- without starting a
# backend, so each child still reads its own XLA_FLAGS -- then forks one child per run of a batch
# (several at once for a multi-process job), waits for them and answers with their exit codes. A child
# is a fresh process as far as what it runs can tell: its own environment, working directory,
# argv, ``__main__`` module and jax backend, and a normal interpreter exit (atexit handlers, thread
# joins, flushes). What it does not pay is importing jax, numpy and dtenjax (1-2 s of CPU each time
# on the 2-core CI machine).
_SERVER = r"""
import gc, importlib, json, os, signal, sys, time, types, builtins
for name in sys.argv[1:]:
  importlib.import_module(name)
if "jax" in sys.modules:
  assert not sys.modules["jax"]._src.xla_bridge._backends, "the fork server started a jax backend"
# What the server has made (its modules: jax's, numpy's, dtenjax's) goes to the collector's
# permanent generation, so a child's collections -- the one at its exit too -- no longer walk it
# and copy every page of it on write: an empty child's exit took 0.42 s of CPU, 0.10 s frozen; 18
# doc blocks and 5 empty runs, 23.9 -> 16.1 s (docs/testing.md, tenth round).
gc.collect()
gc.freeze()
print("ready", flush=True)
for line in sys.stdin:
  batch = json.loads(line)                 # {"runs": [run, ...], "timeout": seconds[, "adopt": 1]}
  sys.stdout.flush(); sys.stderr.flush()
  pids = []
  for req in batch["runs"]:
    if batch.get("adopt"):                 # the run's process is left to the client (a subreaper)
      pid_r, pid_w = os.pipe()
    pid = os.fork()
    if pid == 0:
      if batch.get("adopt"):               # a go-between that leaves at once: the run is orphaned
        os.close(pid_r)
        if os.fork():
          os._exit(0)
        os.write(pid_w, str(os.getpid()).encode())
        os.close(pid_w)
        del pid_r, pid_w
      break
    if batch.get("adopt"):
      os.close(pid_w)
      pids.append(int(os.read(pid_r, 32)))
      os.close(pid_r)
      os.waitpid(pid, 0)                   # gone: the run is the client's child from now on
      continue
    try:
      os.setpgid(pid, pid)
    except OSError:
      pass
    pids.append(pid)
  else:
    if batch.get("adopt"):
      print(json.dumps({"pids": pids}), flush=True)
      continue
    deadline, codes = time.monotonic() + batch["timeout"], {}
    while len(codes) < len(pids):
      for pid in pids:
        if pid not in codes:
          done, st = os.waitpid(pid, os.WNOHANG)
          if done:
            codes[pid] = os.waitstatus_to_exitcode(st)
      if len(codes) < len(pids) and time.monotonic() > deadline:
        for pid in pids:
          if pid not in codes:
            try:
              os.killpg(pid, signal.SIGKILL)
            except OSError:
              os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
      time.sleep(0.02)
    print(json.dumps({"codes": [codes[pid] for pid in pids]}), flush=True)
    continue
  break
else:
  sys.exit(0)
try:
  os.setpgid(0, 0)
except OSError:
  pass
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
sys.stdin = open(0, closefd=False)
for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
  if fd == 2 and path == req["stdout"]:  # one log for both, as stderr=subprocess.STDOUT
    os.dup2(1, 2)
    break
  f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(f, fd)
  os.close(f)
os.environ.clear()
os.environ.update(req["env"])
os.chdir(req["cwd"])
argv = req["argv"]
main = types.ModuleType("__main__")
main.__builtins__ = builtins
sys.modules["__main__"] = main
del gc, importlib, json, signal, time, types, builtins, line, null, fd, path, pid, pids, batch
if argv[0] == "-c":                      # python -c CODE ARGS
  sys.argv = ["-c", *argv[2:]]
  sys.path[0] = ""
  exec(compile(argv[1], "<string>", "exec"), main.__dict__)
elif argv[0] == "-m":                    # python -m MODULE ARGS
  import runpy
  sys.argv = [argv[1], *argv[2:]]
  sys.path[0] = os.getcwd()
  runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:                                    # python SCRIPT ARGS
  import runpy
  sys.argv = list(argv)
  sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
  runpy.run_path(argv[0], run_name="__main__")
"""


class ForkServer:
  """``python ARGV`` in processes forked from one that has already imported jax, numpy and dtenjax
  (``preload``; and started no jax backend): for tests whose claim is about what a script, a module or a code
  block does, not about how long a fresh interpreter takes to import jax. ``run`` returns a
  ``subprocess.CompletedProcess`` as ``subprocess.run(..., capture_output=True, text=True)`` does.

  Environment variables that jax reads when it is imported (``JAX_*``) must be the server's: a
  run that asks for others is refused (start a real process for it)."""

  def __init__(self, env: dict, cwd: str, tmp_dir: str,
               preload: tuple = ("jax", "dtenjax", "numpy")):
    self.env, self.cwd, self.tmp_dir, self.count = dict(env), str(cwd), str(tmp_dir), 0
    self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, *preload], env=self.env,
                                 cwd=self.cwd,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert self.proc.stdout.readline().strip() == "ready"

  @staticmethod
  def _fixed(env: dict) -> dict:
    """What a process reads only when it starts: jax's ``JAX_*`` variables (read at jax's
    import), ``PYTHONPATH`` (sys.path) and the other ``PYTHON*`` settings (the hash seed...)."""
    return {k: v for k, v in env.items() if k.startswith(("JAX_", "PYTHON"))}

  def compatible(self, env: dict) -> bool:
    """Whether a run with this environment can be forked: what a process reads at its start
    (``_fixed``) is the server's."""
    return self._fixed(env) == self._fixed(self.env)

  def _check_env(self, env: dict) -> dict:
    env = dict(self.env if env is None else env)
    assert self.compatible(env), (
        "a forked process keeps the server's JAX_* and PYTHON* settings (read at the start): run "
        f"this in a process of its own ({self._fixed(env)} against {self._fixed(self.env)})")
    return env

  def submit(self, runs: list, timeout: float) -> None:
    """Starts every ``(argv, env, cwd, stdout_path, stderr_path)`` at once (stdout and stderr may
    be one path); ``collect`` waits for them."""
    reqs = [{"argv": [str(a) for a in argv], "env": self._check_env(env),
             "cwd": str(cwd or self.cwd), "stdout": str(out), "stderr": str(err)}
            for argv, env, cwd, out, err in runs]
    self.proc.stdin.write(json.dumps({"runs": reqs, "timeout": timeout}) + "\n")
    self.proc.stdin.flush()

  def collect(self) -> list:
    """The exit codes of the last ``submit``'s runs, once all have ended or the timeout has
    passed (negative: the signal that ended one; None: still running at the deadline, then
    killed with its process group)."""
    reply = self.proc.stdout.readline()
    assert reply, "the fork server died"
    return json.loads(reply)["codes"]

  def run_many(self, runs: list, timeout: float) -> list:
    self.submit(runs, timeout)
    return self.collect()

  def run(self, argv: list, *, env: dict | None = None, cwd=None,
          timeout: float = 240) -> subprocess.CompletedProcess:
    self.count += 1
    out = os.path.join(self.tmp_dir, f"run{self.count}")
    (code,) = self.run_many([(argv, env, cwd, out + ".out", out + ".err")], timeout)
    if code is None:
      raise subprocess.TimeoutExpired(argv, timeout)
    with open(out + ".out") as f, open(out + ".err") as g:
      return subprocess.CompletedProcess(argv, code, f.read(), g.read())

  def start(self, argv: list, env: dict, log: str, *, err: str | None = None,
            cwd=None) -> "Adopted":
    """``python ARGV`` forked and handed to this process, which must be a child subreaper
    (``adopting()``), as ``subprocess.Popen(..., stdout=log, stderr=err or STDOUT, cwd=cwd)``
    started at once: this process polls, signals, waits for and reaps it as its own child (and
    pytest's CPU clock counts it in the test that ran it). The hook dtenjax.elastic.launch's
    tests give its launcher; tests/mp_workers/launch.py's and ``run_at_once``'s runs."""
    assert _subreaper(), "start() needs this process to adopt the run: inside procs.adopting()"
    self.proc.stdin.write(json.dumps({"runs": [{
        "argv": [str(a) for a in argv], "env": self._check_env(env),
        "cwd": str(cwd or os.getcwd()), "stdout": str(log), "stderr": str(err or log)}],
        "timeout": 0, "adopt": 1}) + "\n")
    self.proc.stdin.flush()
    reply = self.proc.stdout.readline()
    assert reply, "the fork server died"
    (pid,) = json.loads(reply)["pids"]
    return Adopted(pid, argv)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self):
    self.proc.stdin.close()
    try:
      self.proc.wait(timeout=30)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
        self.proc.wait()


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37     # linux/prctl.h


def _prctl(option: int, arg) -> None:
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(option, arg, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


def _subreaper() -> bool:
  import ctypes
  flag = ctypes.c_int(0)
  _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag))
  return bool(flag.value)


@contextlib.contextmanager
def adopting():
  """This process as a child subreaper (Linux): a descendant whose parent leaves becomes its child,
  so that it can wait for it (``ForkServer.start``). At the exit it is what it was at the entry:
  inside an outer ``adopting()`` it stays on, so launches on several threads at once (each
  adopting its own runs) are safe under one outer ``adopting()``; a run started inside and still
  running at the exit stays this process's child."""
  was = _subreaper()
  _prctl(_PR_SET_CHILD_SUBREAPER, 1)
  try:
    yield
  finally:
    if not was:
      _prctl(_PR_SET_CHILD_SUBREAPER, 0)


class Adopted:
  """A process that ``ForkServer.start`` forked and this process adopted: the part of
  ``subprocess.Popen`` a launcher uses (pid, poll, wait, send_signal, returncode)."""

  def __init__(self, pid: int, argv: list):
    self.pid, self.args, self.returncode = pid, argv, None

  def poll(self) -> int | None:
    if self.returncode is None:
      pid, status = os.waitpid(self.pid, os.WNOHANG)
      if pid:
        self.returncode = os.waitstatus_to_exitcode(status)
    return self.returncode

  def wait(self, timeout: float | None = None) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while self.poll() is None:
      if deadline is not None and time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(self.args, timeout)
      time.sleep(0.01)
    return self.returncode

  def send_signal(self, sig: int) -> None:
    if self.poll() is None:
      os.kill(self.pid, sig)

  def kill(self) -> None:
    """SIGKILL to the run's process group (what it started too), as the server's timeout does."""
    if self.poll() is None:
      try:
        os.killpg(self.pid, signal.SIGKILL)
      except OSError:
        os.kill(self.pid, signal.SIGKILL)
