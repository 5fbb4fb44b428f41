"""Launches N worker processes with a local jax.distributed coordinator on 127.0.0.1.

Used by the multiprocess tests. Every worker has a timeout; stragglers are
killed. Each worker writes a JSON result to ``{out_dir}/rank{r}.json``.
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
           per_rank_env: dict[int, dict[str, str]] | None = None, args: list[str] | None = None
           ) -> tuple[list[int | None], list[dict | None], list[str]]:
  """Runs ``python -m module`` N times; returns (exit codes (None: killed), results, logs)."""
  port = free_port()
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  procs, logs = [], []
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
  results, texts = [], []
  for r in range(nprocs):
    path = os.path.join(out_dir, f"rank{r}.json")
    results.append(json.load(open(path)) if os.path.exists(path) else None)
    texts.append(open(os.path.join(out_dir, f"rank{r}.log")).read())
  return codes, results, texts
