"""Launches N worker processes with a local jax.distributed coordinator on 127.0.0.1.

Used by the multiprocess tests. Every worker has a timeout; stragglers are
killed. Each worker writes a JSON result to ``{out_dir}/rank{r}.json``.

The workers are forked from processes that have imported jax, numpy and dtenjax and started no
jax backend (tests/procs.py's ForkServer): each worker is still a process of its own with its own
environment, XLA_FLAGS, backend and jax.distributed client, but the workers pay jax's import
(1-2 s of CPU each on the 2-core CI machine) once per server instead of once each. Two servers,
even ranks from one and odd ranks from the other: each started on its own, so neighbouring ranks
have different Python hash seeds, as processes started apart do (a rank whose work depended on
a set's iteration order would still disagree with its neighbour). Inside ``with
shared_forks():`` (tests/conftest.py enters one for the session) launches share the two servers;
a launch outside one starts its own, for 4 processes or more (fewer would not pay for the two
servers). The test process adopts the forked workers (``ForkServer.start``: it is a child
subreaper while they run), so it waits for, kills and reaps them as the ``python -m`` processes
it would have started, and pytest's CPU clock counts them in the test that ran them.
``fork=False``, ``DTENJAX_TEST_FORK=0`` in the environment, or an environment whose
``JAX_*``/``PYTHON*`` variables differ from the server's (read at a process's start) start the
workers with ``python -m`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile

_SHARED: list[dict] = []     # {"servers": [ForkServer, ForkServer] or []} of shared_forks()


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath() -> str:
  """The ``PYTHONPATH`` of the workers and of the fork servers: the repository first (``-m
  tests.mp_workers...``), then the caller's. A run whose ``PYTHONPATH`` differs from the servers'
  cannot be forked (it is read at a process's start), so every test that forks uses this one."""
  return os.pathsep.join(filter(None, (_root(), os.environ.get("PYTHONPATH"))))


def _server_env() -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=pythonpath())
  return env


def _fixed(env: dict) -> dict:
  return {k: v for k, v in env.items() if k.startswith(("JAX_", "PYTHON"))}


def _procs_lib():
  try:
    from tests import procs as procs_lib
  except ImportError:
    import procs as procs_lib
  return procs_lib


def _fork_servers(out_dir: str, env: dict, **kwargs) -> list:
  return [_procs_lib().ForkServer(env, _root(), out_dir, **kwargs) for _ in range(2)]


def _close(servers) -> None:
  for server in servers:
    server.close()


@contextlib.contextmanager
def shared_forks(env: dict[str, str] | None = None, **kwargs):
  """Launches inside share two fork servers (``kwargs``: ForkServer's), started at the first
  launch and ended (their own CPU time accounted to the caller) at the exit. ``env``: variables
  the servers start with (``JAX_*`` ones, read at jax's import, e.g. JAX_ENABLE_RECOVERABILITY);
  only runs whose ``JAX_*`` and ``PYTHON*`` variables are the servers' fork from them (the
  innermost such ``shared_forks`` of those entered). tests/conftest.py enters one for the whole
  session, so every test's launches share one pair."""
  with tempfile.TemporaryDirectory(prefix="dtenjax-forks-") as tmp:    # the servers' run() files
    slot = {"servers": [], "kwargs": kwargs, "env": {**_server_env(), **(env or {})}, "tmp": tmp}
    _SHARED.append(slot)
    try:
      yield slot
    finally:
      _SHARED.remove(slot)
      _close(slot["servers"])


@contextlib.contextmanager
def one_server(env: dict, tmp_dir):
  """A fork server for runs with ``env`` (a module fixture's): one of the session's pair where it
  can fork them (``fork_servers``: a test module's server of its own imported jax and dtenjax
  again, 1.3 s of CPU), else one of the caller's own, closed at the exit."""
  servers = fork_servers([env])
  if servers:
    yield servers[0]
    return
  with _procs_lib().ForkServer(env, _root(), tmp_dir) as server:
    yield server


def fork_servers(envs: list[dict] | None = None) -> list:
  """The two servers of the innermost ``shared_forks`` whose ``JAX_*``/``PYTHON*`` variables are
  those of every env of ``envs`` (default: the servers' own), started now if not yet; [] if none
  is, or with ``DTENJAX_TEST_FORK=0``."""
  if os.environ.get("DTENJAX_TEST_FORK", "1") == "0":
    return []
  for slot in reversed(_SHARED):
    if all(_fixed(e) == _fixed(slot["env"]) for e in envs or [slot["env"]]):
      if not slot["servers"]:
        slot["servers"] = _fork_servers(slot["tmp"], slot["env"], **slot["kwargs"])
      return slot["servers"]
  return []


def launch(module: str, nprocs: int, out_dir: str, *, devices_per_proc: int = 1,
           timeout_s: float = 60, env: dict[str, str] | None = None,
           per_rank_env: dict[int, dict[str, str]] | None = None, args: list[str] | None = None,
           fork: bool = True) -> tuple[list[int | None], list[dict | None], list[str]]:
  """Runs ``python -m module`` N times; returns (exit codes (None: killed), results, logs)."""
  # here, not at the top: tests/conftest.py imports this module in every process that runs tests,
  # and dtenjax.testing imports jax (1.5 s of CPU), which a run of tests without jax (e.g.
  # tests/test_conftest.py's inner run) does not need
  from dtenjax.testing.ports import free_port
  port = free_port()
  root = _root()
  envs = []
  # The workers' XLA leaves LLVM unoptimised (a test's own XLA_FLAGS in ``env`` replaces it):
  # they check values, bits between processes of one launch and errors, not XLA's speed.
  for r in range(nprocs):
    e = dict(os.environ)
    e.update({"JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_proc}"
                           " --xla_backend_optimization_level=0",
              "DTENJAX_TEST_COORDINATOR": f"127.0.0.1:{port}",
              "DTENJAX_TEST_NPROCS": str(nprocs), "DTENJAX_TEST_RANK": str(r),
              "DTENJAX_TEST_OUT": out_dir, "DTENJAX_BIND_ADDRESS": "127.0.0.1",
              "PYTHONPATH": pythonpath()})
    e.update(env or {})
    e.update((per_rank_env or {}).get(r, {}))
    envs.append(e)
  procs_lib, own = _procs_lib(), []
  servers = fork_servers(envs) if fork else []
  if (fork and not servers and nprocs >= 4 and os.environ.get("DTENJAX_TEST_FORK", "1") != "0"
      and all(_fixed(e) == _fixed(_server_env()) for e in envs)):
    servers = own = _fork_servers(out_dir, _server_env())   # a pair for this launch alone
  logs = [os.path.join(out_dir, f"rank{r}.log") for r in range(nprocs)]
  files = []
  try:
    with contextlib.ExitStack() as stack:
      if servers:     # forked, and adopted by this process: its children, as Popen's are
        stack.enter_context(procs_lib.adopting())
        procs = {r: servers[r % 2].start(["-m", module, *(args or [])], envs[r], logs[r], cwd=root)
                 for r in range(nprocs)}
      else:
        files = [open(log, "w") for log in logs]
        procs = {r: subprocess.Popen([sys.executable, "-m", module] + (args or []), env=envs[r],
                                     stdout=files[r], stderr=subprocess.STDOUT, cwd=root)
                 for r in range(nprocs)}
      codes = procs_lib.wait_all(procs, timeout_s)
  finally:
    for f in files:
      f.close()
    _close(own)
  return [codes[r] for r in range(nprocs)], *_read(out_dir, nprocs)


def _read(out_dir: str, nprocs: int) -> tuple[list[dict | None], list[str]]:
  results, texts = [], []
  for r in range(nprocs):
    path = os.path.join(out_dir, f"rank{r}.json")
    results.append(json.load(open(path)) if os.path.exists(path) else None)
    texts.append(open(os.path.join(out_dir, f"rank{r}.log")).read())
  return results, texts
