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
shared_forks():`` (a test module's fixture) the module's launches share the two servers; a
launch outside one starts its own, for 4 processes or more (fewer would not pay for the two
servers). ``fork=False``, ``DTENJAX_TEST_FORK=0`` in the environment, or an environment whose
``JAX_*``/``PYTHON*`` variables differ from the server's (read at a process's start) start the
workers with ``python -m`` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

from dtenjax.testing.ports import free_port

_SHARED: list[dict] = []     # {"servers": [ForkServer, ForkServer] or []} of shared_forks()


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _server_env() -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=_root() + os.pathsep + env.get("PYTHONPATH", ""))
  return env


def _fork_servers(out_dir: str, env: dict, **kwargs) -> list:
  try:
    from tests import procs as procs_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    import procs as procs_lib  # pylint: disable=g-import-not-at-top
  return [procs_lib.ForkServer(env, _root(), out_dir, **kwargs) for _ in range(2)]


def _close(servers) -> None:
  for server in servers:
    server.close()


@contextlib.contextmanager
def shared_forks(env: dict[str, str] | None = None, **kwargs):
  """Launches inside share two fork servers (``kwargs``: ForkServer's), started at the first
  launch and ended (their CPU time accounted to the caller) at the exit. ``env``: variables the
  servers start with (``JAX_*`` ones, read at jax's import, e.g. JAX_ENABLE_RECOVERABILITY);
  only launches whose ``JAX_*`` and ``PYTHON*`` variables are the servers' fork."""
  slot = {"servers": [], "kwargs": kwargs, "env": {**_server_env(), **(env or {})}}
  _SHARED.append(slot)
  try:
    yield slot
  finally:
    _SHARED.remove(slot)
    _close(slot["servers"])


def launch(module: str, nprocs: int, out_dir: str, *, devices_per_proc: int = 1,
           timeout_s: float = 60, env: dict[str, str] | None = None,
           per_rank_env: dict[int, dict[str, str]] | None = None, args: list[str] | None = None,
           fork: bool = True) -> tuple[list[int | None], list[dict | None], list[str]]:
  """Runs ``python -m module`` N times; returns (exit codes (None: killed), results, logs)."""
  port = free_port()
  root = _root()
  envs = []
  for r in range(nprocs):
    e = dict(os.environ)
    e.update({"JAX_PLATFORMS": "cpu",
              "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_proc}",
              "DTENJAX_TEST_COORDINATOR": f"127.0.0.1:{port}",
              "DTENJAX_TEST_NPROCS": str(nprocs), "DTENJAX_TEST_RANK": str(r),
              "DTENJAX_TEST_OUT": out_dir, "DTENJAX_BIND_ADDRESS": "127.0.0.1",
              "PYTHONPATH": root + os.pathsep + e.get("PYTHONPATH", "")})
    e.update(env or {})
    e.update((per_rank_env or {}).get(r, {}))
    envs.append(e)
  fixed = lambda e: {k: v for k, v in e.items() if k.startswith(("JAX_", "PYTHON"))}
  server_env = _SHARED[-1]["env"] if _SHARED else _server_env()
  fork = (fork and os.environ.get("DTENJAX_TEST_FORK", "1") != "0" and (_SHARED or nprocs >= 4)
          and all(fixed(e) == fixed(server_env) for e in envs))
  if fork:
    if _SHARED and not _SHARED[-1]["servers"]:
      _SHARED[-1]["servers"] = _fork_servers(out_dir, server_env, **_SHARED[-1]["kwargs"])
    servers = _SHARED[-1]["servers"] if _SHARED else _fork_servers(out_dir, server_env)
    try:
      logs = [os.path.join(out_dir, f"rank{r}.log") for r in range(nprocs)]
      mine = [[r for r in range(nprocs) if r % 2 == k] for k in (0, 1)]
      for server, ranks in zip(servers, mine):
        if ranks:
          server.submit([(["-m", module, *(args or [])], envs[r], root, logs[r], logs[r])
                         for r in ranks], timeout_s)
      codes: list[int | None] = [None] * nprocs
      for server, ranks in zip(servers, mine):
        if ranks:
          for r, code in zip(ranks, server.collect()):
            codes[r] = code
    finally:
      if not _SHARED:
        _close(servers)
    return codes, *_read(out_dir, nprocs)
  procs, logs = [], []
  for r, e in enumerate(envs):
    log = open(os.path.join(out_dir, f"rank{r}.log"), "w")
    logs.append(log)
    procs.append(subprocess.Popen([sys.executable, "-m", module] + (args or []), env=e,
                                  stdout=log, stderr=subprocess.STDOUT, cwd=root))
  deadline = time.monotonic() + timeout_s
  codes: list[int | None] = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      codes.append(None)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait(timeout=10)
  for log in logs:
    log.close()
  return codes, *_read(out_dir, nprocs)


def _read(out_dir: str, nprocs: int) -> tuple[list[dict | None], list[str]]:
  results, texts = [], []
  for r in range(nprocs):
    path = os.path.join(out_dir, f"rank{r}.json")
    results.append(json.load(open(path)) if os.path.exists(path) else None)
    texts.append(open(os.path.join(out_dir, f"rank{r}.log")).read())
  return results, texts
