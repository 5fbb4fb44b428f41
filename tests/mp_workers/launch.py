"""Launches N worker processes with a local jax.distributed coordinator on 127.0.0.1.

Used by the multiprocess tests. Every worker has a timeout; stragglers are
killed. Each worker writes a JSON result to ``{out_dir}/rank{r}.json``.

The workers are forked from one process that has imported jax, numpy and dtenjax and started no
jax backend (tests/procs.py's ForkServer, started for the launch and ended with it): each worker is
still a process of its own with its own environment, XLA_FLAGS, backend and jax.distributed
client, but the N of them pay jax's import once instead of N times (1-2 s of CPU each on the
2-core CI machine). ``fork=False``, or an environment whose ``JAX_*`` variables differ from this
process's (jax reads them at import), starts them with ``python -m`` instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from dtenjax.testing.ports import free_port


def launch(module: str, nprocs: int, out_dir: str, *, devices_per_proc: int = 1,
           timeout_s: float = 60, env: dict[str, str] | None = None,
           per_rank_env: dict[int, dict[str, str]] | None = None, args: list[str] | None = None,
           fork: bool = True) -> tuple[list[int | None], list[dict | None], list[str]]:
  """Runs ``python -m module`` N times; returns (exit codes (None: killed), results, logs)."""
  port = free_port()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
  jax_vars = {k: v for k, v in os.environ.items() if k.startswith("JAX_")}
  jax_vars["JAX_PLATFORMS"] = "cpu"
  if fork and all({k: v for k, v in e.items() if k.startswith("JAX_")} == jax_vars for e in envs):
    try:
      from tests import procs as procs_lib  # pylint: disable=g-import-not-at-top
    except ImportError:
      import procs as procs_lib  # pylint: disable=g-import-not-at-top
    server_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    server_env.update(jax_vars, PYTHONPATH=envs[0]["PYTHONPATH"])
    server = procs_lib.ForkServer(server_env, root, out_dir)
    try:
      codes = server.run_many(
          [(["-m", module, *(args or [])], e, root, os.path.join(out_dir, f"rank{r}.log"),
            os.path.join(out_dir, f"rank{r}.log")) for r, e in enumerate(envs)], timeout_s)
    finally:
      server.close()
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
