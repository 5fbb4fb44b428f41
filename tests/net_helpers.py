"""Shared helpers of the host-transport tests: in-process rings of native communicators, a
threaded runner that collects results and errors, floods of connections that never
authenticate, and the skip rule for an unbuilt extension.

The skip rule: tests of the native transport skip only when the extension itself is not built
(saying why); when it is built, a missing binding is an AttributeError, i.e. a failure.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from dtenjax._src import ffi
from dtenjax._src.net import credentials
from dtenjax._src.net import transport
from tests import transport_ref as ref

requires_native = pytest.mark.skipif(
    not ffi.is_built(),
    reason=f"the native extension is not built ({ffi.build_info()['error']}); build it to run "
    "the transport tests")


def native_ring(n: int, creds: credentials.JobCredentials, *, timeout_s: float = 10.0,
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
  """Runs fns[r]() on one thread each, in stream "rank-thread"; returns (results, errors,
  seconds)."""
  n = len(fns)
  outs: list = [None] * n
  errs: list = [None] * n

  def go(r):
    try:
      with transport.stream("rank-thread"):
        outs[r] = fns[r]()
    except BaseException as e:  # noqa: BLE001
      errs[r] = e

  # The communicators were created on the test's thread: each rank's thread names one stream,
  # the same on every rank, as one thread per process doing this work would.
  ts = [threading.Thread(target=go, args=(r,), daemon=True) for r in range(n)]
  t0 = time.monotonic()
  for t in ts:
    t.start()
  for t in ts:
    t.join(join_s)
  assert not any(t.is_alive() for t in ts), "a rank did not finish within the join limit"
  return outs, errs, time.monotonic() - t0


def both_ranks(c0, c1, xs, site=(0x51, "suite")):
  """One all-reduce on ranks 0 and 1 (one thread each): (results, errors, seconds)."""
  return run_ranks([lambda: c0.all_reduce(xs[0], site=site),
                    lambda: c1.all_reduce(xs[1], site=site)])


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


FLOOD = 1000   # connections per listener in the flood tests
FLOOD_KINDS = ("idle", "slow", "garbage", "hello")


def flood(endpoint: str, k: int, kind: str, *, job: int, claim_rank: int,
          source: str | None = None) -> list[socket.socket]:
  """k connections to ``endpoint`` that never authenticate (the caller closes them):

  idle: connect and say nothing; slow: 10 bytes of a HELLO header, then nothing; garbage: 100
  random bytes; hello: a valid HELLO of job ``job`` claiming to be rank ``claim_rank`` (what an
  attacker who read the job id off the wire can send without the secret), then nothing; mixed:
  the four in turn. ``source``: the local address to connect from (e.g. "127.0.0.2")."""
  kinds = FLOOD_KINDS if kind == "mixed" else (kind,)
  hello = ref.header(ref.HELLO, job=job, src=claim_rank, payload_bytes=32)
  socks = []
  for i in range(k):
    this = kinds[i % len(kinds)]
    s = socket.socket()
    if source:
      s.bind((source, 0))
    s.settimeout(10)
    s.connect(ref.host_port(endpoint))
    if this == "slow":
      s.sendall(hello[:10])
    elif this == "garbage":
      s.sendall(os.urandom(100))
    elif this == "hello":
      s.sendall(hello + os.urandom(32))
    socks.append(s)
  return socks
