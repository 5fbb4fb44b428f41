"""Fault-and-attack suite of the host transport (issue 14): every case is named for what is tried,
and asserts the clear error (or the survival) expected. docs/reliability.md lists them.

Attacks go through real sockets: a malicious relay between two ranks that rewrites, swaps, drops
and replays frames (there is no unkeyed checksum left to recompute: only the keyed tags stand in
the way), idle unauthenticated connections, and a Python peer that holds the keys but breaks the
protocol. tests/test_attacks.py has the floods, look-alike collectives and teardown races.
"""

import socket
import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import transport
from tests import native_testing
from tests import transport_ref as ref
from tests.net_helpers import (both_ranks, close_all, delta, listener, native_ring,
                               requires_native, run_ranks)

pytestmark = requires_native

SECRET = b"reliability suite secret 0123456"


def creds(job=0x5EC):
  return credentials.JobCredentials(job, SECRET)


# --- mismatched collectives ------------------------------------------------------------------------

A32 = np.ones(1000, np.float32)
I32 = np.ones(1000, np.int32)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case,rank1_calls,named", [
    ("dtype_f32_vs_i32", [(I32, "sum", (1, "line A"))], ("dtype=float32", "dtype=int32")),
    ("op_sum_vs_max", [(A32, "max", (1, "line A"))], ("op=sum", "op=max")),
    ("skip_one_collective", [(A32, "sum", (2, "line B"))], ("'line A'", "'line B'")),
    ("count_1000_vs_999", [(A32[:999], "sum", (1, "line A"))], ("count=1000", "count=999")),
])
def test_mismatched_collective_raises_on_every_rank_naming_both(n, case, rank1_calls, named):
  del case
  comms, errs = native_ring(n, creds(), timeout_s=20)
  assert not errs
  others = [(A32, "sum", (1, "line A")), (A32, "sum", (2, "line B"))]
  calls = [rank1_calls if r == 1 else others for r in range(n)]
  before = native.counters()

  def run(r):
    for x, op, site in calls[r]:
      comms[r].all_reduce(x, op, site=site)
  _, errs, seconds = run_ranks([lambda r=r: run(r) for r in range(n)])
  assert all(isinstance(e, errors.ConfigurationError) for e in errs), errs
  for r, e in enumerate(errs):
    assert "collective mismatch" in str(e), (r, e)
    assert all(v in str(e) for v in named), (r, named, str(e))
  assert seconds < 10   # not the 20 s timeout
  assert delta(before, native.counters())["rejected_mismatch"] >= 1
  for c in comms:    # broken for good, saying why
    with pytest.raises(errors.ConfigurationError, match="unusable after an earlier failure"):
      c.all_reduce(A32, site=(1, "line A"))
  close_all(comms)


def test_different_segment_sizes_are_named():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=10, segment_bytes=4096)
  c1 = transport.create_local_comm(1, 2, creds(), timeout_s=10, segment_bytes=8192)
  run_ranks([lambda: transport.connect(c0, c1.endpoint), lambda: transport.connect(c1, c0.endpoint)])
  _, errs, _ = both_ranks(c0, c1, [np.ones(10000, np.float32)] * 2)
  assert any("DTENJAX_TRANSPORT_SEGMENT_BYTES must be equal" in str(e) for e in errs), errs
  assert all(e is not None for e in errs)
  close_all([c0, c1])


# --- a peer with the keys that breaks the protocol ---------------------------------------------------

def _python_rank1(c0):
  """Ranks 0 (native) and 1 (Python, holding the keys): returns the channels of rank 1."""
  lsock, ep1 = listener()
  box = {}

  def serve():
    conn, _ = lsock.accept()
    conn.settimeout(10)
    box["from_prev"] = ref.server_handshake(conn, SECRET, 0x5EC, me=1, client=0)
  t = threading.Thread(target=serve, daemon=True)
  t.start()
  done = threading.Thread(target=transport.connect, args=(c0, ep1), daemon=True)
  done.start()
  t.join(10)
  box["to_next"] = ref.client_handshake(c0.endpoint, SECRET, 0x5EC, me=1, server=0)
  ref.setup_check(box["to_next"], box["from_prev"], me=1, n=2)
  done.join(10)
  assert not done.is_alive()
  return box["from_prev"], box["to_next"]


def test_oversized_abort_text_is_rejected():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  from_prev, to_next = _python_rank1(c0)
  before = native.counters()
  to_next.send(ref.ABORT, b"\x07" + b"x" * 5000, coll_seq=1)
  with pytest.raises(errors.TransportError, match="ABORT text of 5001 bytes exceeds 4096"):
    c0.all_reduce(np.ones(8, np.float32), site=(3, "s"))
  assert delta(before, native.counters())["rejected_oversized"] == 1
  del from_prev
  c0.close()


def test_data_sent_backwards_is_rejected():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  from_prev, to_next = _python_rank1(c0)
  from_prev.send(ref.DATA, b"\0" * 16, coll_seq=1, count=8)   # on the connection rank 0 sends on
  with pytest.raises(errors.TransportError, match="sent a DATA frame backwards"):
    c0.all_reduce(np.ones(8, np.float32), site=(3, "s"))
  del to_next
  c0.close()


def test_abort_from_a_peer_is_raised_with_its_reason_and_code():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  from_prev, to_next = _python_rank1(c0)
  to_next.send(ref.ABORT, b"\x03" + b"rank 1 ran out of patience", coll_seq=1, count=8, site=3)
  with pytest.raises(errors.CollectiveTimeoutError,   # code 3: DEADLINE_EXCEEDED
                     match="rank 1 aborted all_reduce #1.*rank 1 ran out of patience.*this rank "
                           r"\(0\) was in all_reduce #1"):
    c0.all_reduce(np.ones(8, np.float32), site=(3, "s"))
  del from_prev
  c0.close()


# --- unauthenticated connections ------------------------------------------------------------------

def test_idle_unauthenticated_connections_do_not_stop_the_ring():
  """Two connections that never speak (slowloris) to each rank's listener; the handshake timeout
  is longer than the ring's, so serving them one at a time would miss the ring's deadline."""
  cs = [transport.create_local_comm(r, 2, creds(), timeout_s=3, handshake_timeout_s=10)
        for r in range(2)]
  idle = [socket.create_connection(ref.host_port(c.endpoint)) for c in cs for _ in range(2)]
  time.sleep(0.2)   # the idle ones are pending before the ring starts
  _, errs, seconds = run_ranks([lambda: transport.connect(cs[0], cs[1].endpoint),
                                lambda: transport.connect(cs[1], cs[0].endpoint)])
  assert errs == [None, None] and seconds < 3, (errs, seconds)
  outs, errs, _ = run_ranks([lambda c=c: c.all_reduce(np.ones(4, np.float32)) for c in cs])
  assert errs == [None, None] and outs[0].tolist() == [2.0] * 4
  for s in idle:
    s.close()
  close_all(cs)


def test_pending_handshakes_are_capped_and_time_out():
  """6 idle connections against a cap of 3: 3 are served, the others turned away (refused while
  the first are in their grace period, or evicted), and the served ones time out after 0.5 s;
  the real peer gets in all the same."""
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5, handshake_timeout_s=0.5,
                                    max_pending_handshakes=3)
  c1 = transport.create_local_comm(1, 2, creds(), timeout_s=5)
  before = native.counters()
  idle = [socket.create_connection(ref.host_port(c0.endpoint)) for _ in range(6)]
  t = threading.Thread(target=transport.connect, args=(c0, c1.endpoint), daemon=True)
  t.start()
  time.sleep(1.0)    # the first connections are served (cap 3) or turned away, then time out
  transport.connect(c1, c0.endpoint)
  t.join(10)
  d = delta(before, native.counters())
  assert d.get("handshakes_evicted", 0) + d.get("handshakes_refused", 0) >= 3, d
  assert d.get("handshakes_timed_out", 0) >= 1, d
  assert native.counters()["handshakes_pending"] <= 3
  for s in idle:
    s.close()
  close_all([c0, c1])


# --- native failures stay errors ------------------------------------------------------------------

def test_thread_that_cannot_start_is_an_error_not_a_crash():
  hooks = native_testing.transport()
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=2)
  hooks.fail_thread_starts(1)
  with pytest.raises(errors.NativeError, match="could not start a thread for accepting"):
    transport.connect(c0, "tcp://127.0.0.1:9")
  one = transport.create_local_comm(0, 1, creds())
  hooks.fail_thread_starts(1)
  with pytest.raises(errors.NativeError, match="could not start a thread for the communicator"):
    one.all_reduce(np.ones(3, np.float32))
  hooks.fail_thread_starts(0)
  assert one.all_reduce(np.ones(3, np.float32)).tolist() == [1.0, 1.0, 1.0]   # recovers
  close_all([c0, one])


def test_closed_communicator_says_so():
  c = transport.create_local_comm(0, 1, creds())
  c.close()
  with pytest.raises(errors.ConfigurationError, match="is closed; create a new one"):
    c.all_reduce(np.ones(2, np.float32))


def test_reduction_order_is_unchanged_by_pipelining():
  """Segments far smaller than a chunk (pipelined forwarding) give the same bits."""
  rng = np.random.RandomState(3)
  xs = [(rng.randn(50_001) * 10.0 ** rng.randint(-3, 4, 50_001)).astype(np.float32)
        for _ in range(3)]
  expected = ref.reference_ring_sum(xs)
  for seg in (256, 4096, 1 << 20):
    comms, errs = native_ring(3, creds(), segment_bytes=seg)
    assert not errs
    outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(xs[r]) for r in range(3)])
    assert errs == [None] * 3
    assert all(o.tobytes() == expected.tobytes() for o in outs), seg
    close_all(comms)
