"""Tests that start processes of their own: the xdist group they share and a runner that starts
them all at once.

scripts/test.sh runs two pytest-xdist workers on a 2-core machine; two such tests at once would put
many busy processes on 2 cores (their timeouts were chosen for one test at a time), so they share
the group ``procs`` (tests/conftest.py adds it to every ``multiprocess`` test) and run one after
another in one worker while the other worker goes on with the rest.

A test that starts one busy process at a time (a fresh process for a process-wide flag such as
``--xla_cpu_max_isa=AVX``, processes run one after another) keeps one core busy while pytest
waits for it, as a test in the pytest process does: it stays out of the group, so that the
group's worker, which runs every test of the group in a row, is not the last to finish.
"""

import subprocess
import sys

import pytest

PROCS = pytest.mark.xdist_group("procs")


def run_at_once(runs: dict, timeout: float) -> dict:
  """``{key: (argv after python, env)}`` -> ``{key: stdout}``: every ``python argv`` started at
  once (each is mostly single-threaded compilation, so they overlap on 2 cores), each asserted to
  exit 0 within ``timeout`` seconds; none is left running."""
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
