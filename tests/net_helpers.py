"""Shared helpers of the host-transport tests: in-process rings of native communicators, a
threaded runner that collects results and errors, and the skip rule for an unbuilt extension.

The skip rule: tests of the native transport skip only when the extension itself is not built
(saying why); when it is built, a missing binding is an AttributeError, i.e. a failure.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dtenjax._src import ffi
from dtenjax._src.net import transport

requires_native = pytest.mark.skipif(
    not ffi.is_built(),
    reason=f"the native extension is not built ({ffi.build_info()['error']}); build it to run "
    "the transport tests")


def native_ring(n: int, creds: transport.JobCredentials, *, timeout_s: float = 10.0,
                join_s: float = 30.0, **kw) -> tuple[list[transport.Communicator], dict]:
  """n communicators of one process connected into a ring; returns (comms, errors by rank)."""
  comms = [transport.create_local_comm(r, n, creds, timeout_s=timeout_s, **kw) for r in range(n)]
  errs: dict[int, BaseException] = {}

  def go(r):
    try:
      transport.connect(comms[r], comms[(r + 1) % n].endpoint)
    except BaseException as e:  # noqa: BLE001 - reported to the test
      errs[r] = e

  ts = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
  for t in ts:
    t.start()
  for t in ts:
    t.join(join_s)
  assert not any(t.is_alive() for t in ts), "ring set-up did not finish"
  return comms, errs


def run_ranks(fns, join_s: float = 60.0) -> tuple[list, list, float]:
  """Runs fns[r]() on one thread each; returns (results, errors, seconds)."""
  n = len(fns)
  outs: list = [None] * n
  errs: list = [None] * n

  def go(r):
    try:
      outs[r] = fns[r]()
    except BaseException as e:  # noqa: BLE001
      errs[r] = e

  ts = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
  t0 = time.monotonic()
  for t in ts:
    t.start()
  for t in ts:
    t.join(join_s)
  assert not any(t.is_alive() for t in ts), "a rank did not finish within the join limit"
  return outs, errs, time.monotonic() - t0


def close_all(comms) -> None:
  for c in comms:
    c.close()


def delta(before: dict, after: dict) -> dict:
  return {k: after[k] - before[k] for k in after if after[k] != before.get(k)}


def listener() -> tuple[socket.socket, str]:
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  s.listen(16)
  return s, f"tcp://127.0.0.1:{s.getsockname()[1]}"
