"""Fault-and-attack suite of the host transport (issue 14): every case is named for what is tried,
and asserts the clear error (or the survival) expected. docs/reliability.md lists them.

Attacks go through real sockets: a malicious relay between two ranks that rewrites, swaps, drops
and replays frames (there is no unkeyed checksum left to recompute: only the keyed tags stand in
the way), idle unauthenticated connections, and a Python peer that holds the keys but breaks the
protocol. tests/test_attacks.py has the floods, look-alike collectives and teardown races.
"""

import hashlib
import socket
import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.net import callsite
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import transport
from dtenjax.testing import native as native_testing
from tests import helpers
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
  # Pending before the ring starts: create_connection returns once the kernel has completed the
  # TCP handshake, so each idle connection is in its listener's backlog ahead of the peers'.
  idle = [socket.create_connection(ref.host_port(c.endpoint)) for c in cs for _ in range(2)]
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

  def served_and_timed_out():   # the first 3 served (the cap), the others turned away, one timed out
    d = delta(before, native.counters())
    return (d.get("handshakes_evicted", 0) + d.get("handshakes_refused", 0) >= 3
            and d.get("handshakes_timed_out", 0) >= 1)

  helpers.wait_until(served_and_timed_out, "rank 0's listener to turn away 3 of the 6 idle "
                     "connections and time out a served one")
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


# --- issue 35: hostile peer text, interruption, timeouts, teardown, threads ------------------------

HOSTILE = b"\x1b[2J\x1b[31mYOU ARE PWNED\x1b[0m \xff\xfe\xc3( bidi\xe2\x80\xae txt\r\nforged line"


def _assert_escaped(message: str) -> None:
  assert "\x1b" not in message and "\r" not in message and "\n" not in message, message
  assert "\u202e" not in message and "\ufffd" not in message, message
  assert "\\x1b[31mYOU ARE PWNED" in message and "\\xff\\xfe\\xc3(" in message, message
  message.encode("utf-8")   # valid text


def _rejecting_listener(payload: bytes):
  """A listener that answers every HELLO with a forged fatal REJECT carrying ``payload``."""
  lsock, ep = listener()

  def serve():
    while True:
      try:
        conn, _ = lsock.accept()
      except OSError:
        return
      with conn:
        conn.settimeout(5)
        try:
          ref.recv_exact(conn, 64 + 32)
          body = bytes([2, 1]) + payload
          conn.sendall(ref.header(ref.REJECT, job=0x5EC, src=1, payload_bytes=len(body)) + body)
        except OSError:
          pass
  threading.Thread(target=serve, daemon=True).start()
  return lsock, ep


@pytest.mark.parametrize("size", ["short", "oversized"])
def test_a_forged_reject_with_hostile_text_is_escaped_and_capped(size):
  payload = HOSTILE if size == "short" else HOSTILE + b"A" * 900   # a REJECT holds <= 1024
  lsock, ep = _rejecting_listener(payload)
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  with pytest.raises(errors.DtenjaxError) as info:   # not UnicodeDecodeError
    transport.connect(c0, ep)
  message = str(info.value)
  assert "refused the connection" in message
  _assert_escaped(message)
  assert "A" * 600 not in message   # capped at 512 bytes of the peer's text
  if size == "oversized":
    assert "bytes, cut at" in message
  lsock.close()
  c0.close()


def test_hostile_abort_text_from_a_keyed_peer_is_escaped():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  from_prev, to_next = _python_rank1(c0)
  to_next.send(ref.ABORT, b"\x01" + HOSTILE, coll_seq=1, count=8, site=3)
  with pytest.raises(errors.ConfigurationError, match="rank 1 aborted") as info:
    c0.all_reduce(np.ones(8, np.float32), site=(3, "s"))
  _assert_escaped(str(info.value))
  del from_prev
  c0.close()


def _wait_in_flight(k: int = 1) -> None:
  helpers.wait_until(lambda: native.counters()["ops_in_flight"] >= k,   # a gauge: it is running
                     f"{k} collective(s) in flight")


def test_close_interrupts_an_all_reduce_in_flight_within_100_ms():
  comms, errs = native_ring(2, creds(), timeout_s=30)
  assert not errs
  box = {}

  def waiter():
    try:
      comms[0].all_reduce(np.ones(1000, np.float32), site=(0x35, "close test"),
                          stream="waiter")
    except BaseException as e:
      box["error"], box["at"] = e, time.monotonic()
  t = threading.Thread(target=waiter, daemon=True)
  t.start()
  _wait_in_flight()
  t0 = time.monotonic()
  comms[0].close()   # rank 1 never joins; only rank 0 is closed
  t.join(5)
  assert not t.is_alive()
  assert isinstance(box["error"], errors.CollectiveError), box
  assert "closed locally" in str(box["error"]), box
  assert box["at"] - t0 < 0.1, box["at"] - t0
  # rank 1 hears of it from rank 0's ABORT: it raises naming rank 0, not the 30 s timeout
  t1 = time.monotonic()
  with pytest.raises(errors.TransportError, match="rank 0 aborted.*closed locally"):
    comms[1].all_reduce(np.ones(1000, np.float32), site=(0x35, "close test"))
  assert time.monotonic() - t1 < 2
  comms[1].close()


def test_close_interrupts_a_connect_in_flight_within_100_ms():
  """Rank 0 connects to a next rank that accepts the connection and reads its HELLO but never
  answers (a stalled peer): close() ends the handshake wait, not the 30 s set-up deadline."""
  lsock, ep = listener()
  hello = threading.Event()

  def stalled_peer():
    conn, _ = lsock.accept()
    ref.recv_exact(conn, 64 + 32)
    hello.set()
    box["conn"] = conn    # held open, never answered
  box = {}
  threading.Thread(target=stalled_peer, daemon=True).start()
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=30)

  def connecting():
    try:
      transport.connect(c0, ep)
    except BaseException as e:
      box["error"], box["at"] = e, time.monotonic()
  t = threading.Thread(target=connecting, daemon=True)
  t.start()
  assert hello.wait(20)      # rank 0 is in the handshake, waiting for the CHALLENGE
  t0 = time.monotonic()
  c0.close()
  t.join(5)
  assert not t.is_alive()
  assert isinstance(box["error"], errors.CollectiveError), box
  assert "closed locally" in str(box["error"]), box
  assert box["at"] - t0 < 0.1, box["at"] - t0
  box["conn"].close()
  lsock.close()


def test_a_peer_that_stops_reading_times_out_on_time():
  """The SIGSTOP case: rank 1 (the Python peer) stops reading mid-collective, so rank 0's sends
  fill the socket buffers. Rank 0 must raise DTENJAX_COLLECTIVE_TIMEOUT after its last progress,
  not 2 s later (it used to spend up to 2 s more trying to finish the frame to the stopped peer
  before sending its ABORT). Quiet runs measure 2.11-2.13 s for 2 s and 5.18-5.21 s for 5 s
  (docs/reliability.md); the bound here, a quarter of the old 2 s tail, leaves room for a loaded
  2-core machine (3.32 s was seen for a 3 s timeout in a full suite run) and still fails the old
  behaviour. The timeout's length is not the claim, only what comes after it: 2 s (the buffers
  fill within milliseconds)."""
  timeout = 2.0
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=timeout)
  from_prev, to_next = _python_rank1(c0)
  x = np.ones(16 << 20, np.float32)                                 # 64 MiB: buffers fill
  t0 = time.monotonic()
  with pytest.raises(errors.CollectiveTimeoutError, match="timed out after 2 s"):
    c0.all_reduce(x, site=(3, "s"))
  seconds = time.monotonic() - t0
  assert timeout <= seconds <= timeout + 0.5, seconds
  del from_prev, to_next
  c0.close()


@pytest.mark.parametrize("mode", ["close-and-exit", "exit"])   # worker modes: teardown_worker.py
def test_teardown_with_a_collective_in_flight_exits_zero(mode):
  import subprocess
  import sys
  p = subprocess.run([sys.executable, "-m", "tests.mp_workers.teardown_worker", mode],
                     capture_output=True, text=True, timeout=60,
                     cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
  assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
  assert "terminate called" not in p.stderr
  assert "waiter: CollectiveError" in p.stdout and "closed locally" in p.stdout, p.stdout


def test_a_second_thread_on_one_stream_is_refused_never_mixed():
  """Two threads of each rank issue collectives on one stream of that rank's communicator at
  once: the queue order of the two would differ between ranks and pair the wrong partners. The
  second thread is refused at once; every result that comes back is right. (Both threads do the
  same work here: a key names the work, so threads doing different work under one key are the
  program differing between ranks, which no transport can see; they need keys of their own.)"""
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  trials = 10
  start, done = threading.Barrier(4), threading.Barrier(4)
  results = {}

  def worker(r, k):
    start.wait(10)
    out = []
    for i in range(trials):
      try:
        out.append(("ok", i, comms[r].all_reduce(np.full(64, i + 1, np.float32),
                                                 site=(0x36, "one line"), tag=i,
                                                 stream="work")))
      except errors.DtenjaxError as e:
        out.append(("error", i, e))
        break
    results[(r, k)] = out
    done.wait(30)   # holders stay alive until every thread has tried (a dead one is replaced)
  ts = [threading.Thread(target=worker, args=(r, k), daemon=True)
        for r in range(2) for k in range(2)]
  for t in ts:
    t.start()
  for t in ts:
    t.join(60)
  assert not any(t.is_alive() for t in ts)
  refused = 0
  for (r, k), out in results.items():
    for kind, i, value in out:
      if kind == "ok":
        assert value.tolist() == [2.0 * (i + 1)] * 64, (r, k, i, value[:3])
      elif "may not issue on it too" in str(value):
        assert isinstance(value, errors.CollectiveError)
        assert "stream 'work'" in str(value), str(value)
        refused += 1
  assert refused == 2, results   # on each rank, the thread that came second
  close_all(comms)


def test_a_thread_that_did_not_create_the_communicator_needs_a_stream_key():
  """Issue 44: thread names are not identities (default names follow creation order on each
  rank). A thread other than the creator that names no stream is refused before anything is
  sent; with a key (argument or transport.stream block) it runs, and the creator's own calls
  need none."""
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  before = native.counters()["frames_sent"]
  box = {}

  def keyless():
    try:
      comms[0].all_reduce(np.ones(8, np.float32), site=(0x44, "keyless"))
    except errors.DtenjaxError as e:
      box["error"] = e
  t = threading.Thread(target=keyless, name="Thread-1 (worker)")
  t.start()
  t.join(10)
  e = box["error"]
  assert isinstance(e, errors.CollectiveError), e
  for fragment in ("created by thread 'MainThread'", "thread 'Thread-1 (worker)'",
                   "without a stream key", "stream='<key>'", "transport.stream(key)"):
    assert fragment in str(e), str(e)
  assert native.counters()["frames_sent"] == before      # refused before anything was sent
  for stream in ("job", None):   # an explicit key, then the enclosing block's
    def keyed(r, stream=stream):
      if stream is not None:
        return comms[r].all_reduce(np.full(8, r + 1, np.float32), site=(0x44, "keyed"),
                                   stream=stream)
      with transport.stream("job"):
        return comms[r].all_reduce(np.full(8, r + 1, np.float32), site=(0x44, "keyed"))
    outs = [None, None]
    ts = [threading.Thread(target=lambda r=r: outs.__setitem__(r, keyed(r))) for r in range(2)]
    for t in ts:
      t.start()
    for t in ts:
      t.join(20)
    assert [o.tolist() for o in outs] == [[3.0] * 8] * 2, outs
  for bad in ("", 7, "a\0b"):
    with pytest.raises(errors.CollectiveError, match="must be a non-empty str"):
      comms[0].all_reduce(np.ones(8, np.float32), stream=bad)
  close_all(comms)


def test_a_communicator_forgets_the_stream_keys_of_ended_threads():
  """A key per short-lived thread (e.g. one per request) must not grow a table without bound."""
  comm = transport.create_local_comm(0, 1, creds())
  for i in range(transport._STREAMS_KEPT + 44):
    t = threading.Thread(target=comm._claim, args=(f"request-{i}",))
    t.start()
    t.join(10)
  assert len(comm._streams) <= transport._STREAMS_KEPT, len(comm._streams)
  comm.close()


# --- issue 35 item 1: the full fingerprint -------------------------------------------------------

def _crc_colliding_tags(text: str) -> tuple[str, str]:
  """Two str tags whose site texts, as the old transport built them (text + " [tag '...']"),
  have one CRC32: found by a birthday search over random 12-letter tags (random.Random(35),
  30,863 tries, 0.5 s), kept here so the test does not search again."""
  import zlib
  a, b = "GMGtcwflSBbX", "gwNaXcZXejJL"
  crc = lambda tag: zlib.crc32((text + f" [tag {tag!r}]").encode())
  assert text == "line A" and a != b and crc(a) == crc(b)
  return a, b


B16 = np.ones(1000, np.float32).astype(__import__("ml_dtypes").bfloat16)


@pytest.mark.parametrize("case", ["shape_4x250_vs_1000", "crc32_colliding_tags", "streams"])
def test_collectives_that_differ_only_beyond_the_old_header_raise_on_every_rank(case):
  """Collectives the 32-bit header could not tell apart: same op, dtype and element count, but
  another shape; str tags whose CRC32s collide; another stream. Every rank raises naming both
  sides; no rank returns a sum."""
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  x = np.arange(1000, dtype=np.float32)
  if case == "shape_4x250_vs_1000":
    calls = [lambda: comms[0].all_reduce(x, site=(1, "helper")),
             lambda: comms[1].all_reduce(x.reshape(4, 250), site=(1, "helper"))]
    named = ("float32[1000]", "float32[4, 250]")
  elif case == "crc32_colliding_tags":
    a, b = _crc_colliding_tags("line A")
    calls = [lambda: comms[0].all_reduce(x, site=(1, "line A"), tag=a),
             lambda: comms[1].all_reduce(x, site=(1, "line A"), tag=b)]
    named = (f"[tag {a!r}]", f"[tag {b!r}]")
  else:
    calls = [lambda: comms[0].all_reduce(x, site=(1, "line A"), stream="worker-a"),
             lambda: comms[1].all_reduce(x, site=(1, "line A"), stream="worker-b")]
    named = ("thread 'worker-a'", "thread 'worker-b'")   # the record's stream field
  outs, errs = [None, None], [None, None]

  def run(r):
    try:
      with transport.stream("same"):   # the calls' own stream= wins over the block's key
        outs[r] = calls[r]()
    except BaseException as e:
      errs[r] = e
  ts = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
  for t in ts:
    t.start()
  for t in ts:
    t.join(30)
  assert outs == [None, None], outs        # no wrong sum
  for r, e in enumerate(errs):
    assert isinstance(e, errors.ConfigurationError), (r, e)
    assert "collective mismatch" in str(e) and all(v in str(e) for v in named), (r, str(e))
  close_all(comms)


@pytest.mark.parametrize("case", ["site_text", "str_tag", "multibyte_site_text"])
def test_texts_that_differ_only_past_the_record_limit_raise_on_every_rank(case):
  """Issue 44: a fingerprint record holds 2,048 bytes of call site; texts that differed only
  after them (a long call stack, a long str tag) were summed. Now a longer text travels as its
  beginning and the digest of the whole, so the ranks raise naming both."""
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  x = np.ones(8, np.float32)
  common = ("é" if case.startswith("multibyte") else "x") * 3000   # 3,000 or 6,000 bytes
  if case == "str_tag":
    calls = [lambda r=r: comms[r].all_reduce(x, site=(1, "line A"), tag=common + "AB"[r])
             for r in range(2)]
  else:
    calls = [lambda r=r: comms[r].all_reduce(x, site=(1, common + "AB"[r])) for r in range(2)]
  outs, errs, _ = run_ranks(calls)
  assert outs == [None, None], outs        # no sum
  length = len((common + "A").encode()) + (len("line A [tag '']") if case == "str_tag" else 0)
  for r, e in enumerate(errs):
    assert isinstance(e, errors.ConfigurationError), (r, e)
    assert "collective mismatch" in str(e) and f"[{length} bytes, blake2b " in str(e), str(e)
  # the rank that detected it names both sides, each digested, and the field that differs (the
  # other rank gets that text in an ABORT, whose length is capped)
  assert any(str(e).count(f"[{length} bytes, blake2b ") == 2 and "differ in: call site" in str(e)
             for e in errs), errs
  close_all(comms)


def test_wire_text_keeps_short_texts_and_digests_long_ones_whole():
  assert callsite.wire_text("helper (a.py:3)", 2048) == "helper (a.py:3)"
  fit = "y" * 2048
  assert callsite.wire_text(fit, 2048) == fit           # exactly the limit: unchanged
  for head in ("z", "é", "\U0001F600"):                # 1-, 2- and 4-byte characters
    a, b = head * 3000 + "a", head * 3000 + "b"
    wa, wb = callsite.wire_text(a, 2048), callsite.wire_text(b, 2048)
    assert wa != wb
    for w, full in ((wa, a), (wb, b)):
      raw = full.encode()
      assert len(w.encode()) <= 2048 and w.startswith(head * 100), (head, len(w.encode()))
      assert w.endswith(f"[{len(raw)} bytes, blake2b "
                        f"{hashlib.blake2b(raw, digest_size=32).hexdigest()}]")
  assert len(callsite.wire_text("s" * 300, callsite.STREAM_TEXT_BYTES).encode()) <= 256


def test_float32_and_bfloat16_from_one_line_raise_on_every_rank():
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  x = np.ones(1000, np.float32)
  _, errs, _ = run_ranks([lambda: comms[0].all_reduce(x, site=(1, "line A")),
                          lambda: comms[1].all_reduce(B16, site=(1, "line A"))])
  for r, e in enumerate(errs):
    assert isinstance(e, errors.ConfigurationError), (r, e)
    assert "dtype=float32" in str(e) and "dtype=bfloat16" in str(e), str(e)
  close_all(comms)


def test_identical_fingerprints_in_another_order_are_named_by_the_next_mismatch():
  """The undetectable case: two collectives with one fingerprint and no tag, issued in another
  order on rank 1 (their data is mixed, nothing on the wire differs). The next collective that
  differs says that the ones before it may have been paired wrongly, and that a tag fixes it."""
  comms, errs = native_ring(2, creds(), timeout_s=20)
  assert not errs
  a, b = np.full(8, 1.0, np.float32), np.full(8, 100.0, np.float32)

  def rank(r):
    first, second = (a, b) if r == 0 else (b, a)
    out = [comms[r].all_reduce(first, site=(1, "loop body")),
           comms[r].all_reduce(second, site=(1, "loop body"))]
    comms[r].all_reduce(a, "sum" if r == 0 else "max", site=(2, "after the loop"))
    return out
  outs, errs, _ = run_ranks([lambda r=r: rank(r) for r in range(2)])
  for r, e in enumerate(errs):
    assert isinstance(e, errors.ConfigurationError), (r, e)
    assert "Collectives #1 to #2" in str(e) and "identical fingerprints" in str(e), str(e)
    assert "tag" in str(e)
  close_all(comms)
