"""Fault-and-attack suite of the host transport (issue 14): every case is named for what is tried,
and asserts the clear error (or the survival) expected. docs/reliability.md lists them.

Attacks go through real sockets: a malicious relay between two ranks that rewrites, swaps, drops
and replays frames (recomputing every unkeyed checksum, as an attacker without the keys can), idle
unauthenticated connections, and a Python peer that holds the keys but breaks the protocol.
"""

import socket
import struct
import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.net import hostcoll
from dtenjax._src.net import transport
from tests import transport_ref as ref
from tests.net_helpers import (close_all, delta, listener, native_ring, requires_native,
                               run_ranks)

pytestmark = requires_native

SECRET = b"reliability suite secret 0123456"


def creds(job=0x5EC):
  return transport.JobCredentials(job, SECRET)


# --- a malicious relay -----------------------------------------------------------------------------

class Relay(threading.Thread):
  """Sits between rank 0 (client) and rank 1 (server): rank 0 connects to the relay believing it
  is rank 1. Passes the handshake through, then hands every authenticated frame rank 0 sends to
  ``mutate(index, frame_bytes) -> list[bytes]`` (the frames to forward instead)."""

  def __init__(self, target_endpoint: str, mutate):
    super().__init__(daemon=True)
    self.lsock, self.endpoint = listener()
    self.target = ref.host_port(target_endpoint)
    self.mutate = mutate
    self.frames: list[bytes] = []   # every authenticated frame seen, as sent by rank 0
    self.error = None

  def run(self):
    try:
      client, _ = self.lsock.accept()
      server = socket.create_connection(self.target, timeout=30)
      threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
      client.settimeout(30)
      fwd = server.sendall
      fwd(ref.recv_exact(client, 96))    # HELLO
      fwd(ref.recv_exact(client, 96))    # RESPONSE
      index = 0
      while True:
        head = ref.recv_exact(client, 80)
        h = ref.parse_header(head[:64])
        body = ref.recv_exact(client, h["payload_bytes"] + 16)
        frame = head + body
        self.frames.append(frame)
        for out in self.mutate(index, frame):
          fwd(out)
        index += 1
    except (ConnectionError, OSError) as e:
      self.error = e

  @staticmethod
  def _pipe(src, dst):
    try:
      while True:
        b = src.recv(1 << 16)
        if not b:
          break
        dst.sendall(b)
    except OSError:
      pass


def is_data(frame: bytes) -> bool:
  return ref.parse_header(frame[:64])["type"] == ref.DATA


def relayed_pair(mutate, *, timeout_s=5.0, **kw):
  """Ranks 0 and 1 of one process; rank 0 -> rank 1 goes through a Relay."""
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=timeout_s, **kw)
  c1 = transport.create_local_comm(1, 2, creds(), timeout_s=timeout_s, **kw)
  relay = Relay(c1.endpoint, mutate)
  relay.start()
  _, errs, _ = run_ranks([lambda: transport.connect(c0, relay.endpoint),
                          lambda: transport.connect(c1, c0.endpoint)])
  assert errs == [None, None], errs
  return c0, c1, relay


def both_ranks(c0, c1, xs, site=(0x51, "suite")):
  return run_ranks([lambda: c0.all_reduce(xs[0], site=site), lambda: c1.all_reduce(xs[1], site=site)])


def flip_payload_byte(index, frame):
  if not is_data(frame):
    return [frame]
  f = bytearray(frame)
  f[80 + 7] ^= 0x01           # one bit of the payload; there is no unkeyed checksum to recompute
  return [bytes(f)]


def test_relay_rewrites_payload_rejected_on_both_ranks():
  before = transport.counters()
  c0, c1, _ = relayed_pair(flip_payload_byte)
  xs = [np.arange(4096, dtype=np.float32), np.ones(4096, np.float32)]
  outs, errs, seconds = both_ranks(c0, c1, xs)
  assert outs == [None, None]
  assert isinstance(errs[1], errors.TransportError), errs
  assert "payload authentication failed" in str(errs[1])
  assert isinstance(errs[0], errors.TransportError), errs
  assert "rank 1 aborted" in str(errs[0]) and "payload authentication failed" in str(errs[0])
  assert seconds < 4   # told at once, not after the timeout
  d = delta(before, transport.counters())
  assert d["rejected_mac"] == 1 and d["aborts_received"] >= 1, d
  close_all([c0, c1])


def test_relay_rewrites_header_and_recomputes_crc_rejected():
  def rewrite_count(index, frame):
    if not is_data(frame):
      return [frame]
    h = bytearray(frame[:64])
    struct.pack_into("<Q", h, 48, 999)             # the collective's count
    return [ref.recompute_crc(bytes(h)) + frame[64:]]
  c0, c1, _ = relayed_pair(rewrite_count)
  _, errs, _ = both_ranks(c0, c1, [np.ones(64, np.float32)] * 2)
  assert "header authentication failed" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  close_all([c0, c1])


def test_swap_of_two_blocks_512kib_apart_is_detected():
  """The old 64-bit Fletcher checksum missed this; the payload tag does not."""
  def swap(index, frame):
    if not is_data(frame):
      return [frame]
    f = bytearray(frame)
    a, b = 80 + 1024, 80 + 1024 + (512 << 10)
    assert len(f) >= b + 16 + 16
    f[a:a + 16], f[b:b + 16] = f[b:b + 16], f[a:a + 16]
    return [bytes(f)]
  before = transport.counters()
  c0, c1, _ = relayed_pair(swap, segment_bytes=1 << 20)
  n = 1 << 19   # 2 MiB per rank: 1 MiB chunks, one 1 MiB segment each
  rng = np.random.RandomState(0)
  _, errs, _ = both_ranks(c0, c1, [rng.randn(n).astype(np.float32) for _ in range(2)])
  assert "payload authentication failed" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, transport.counters())["rejected_mac"] == 1
  close_all([c0, c1])


def _replay_pair(make_mutation):
  """Collective #1 passes; in #2 the relay replays #1's first data frame."""
  state = {"recorded": None, "data_seen": 0}

  def mutate(index, frame):
    if not is_data(frame):
      return [frame]
    state["data_seen"] += 1
    if state["recorded"] is None:
      state["recorded"] = frame
      return [frame]
    if state["data_seen"] == 3:   # the first data frame of collective #2 (one per step, 2 steps)
      return make_mutation(state["recorded"], frame)
    return [frame]
  return relayed_pair(mutate)


def test_replayed_frame_with_rewritten_sequence_number_is_rejected():
  def replay_as_current(old, current):
    h = bytearray(old[:64])
    struct.pack_into("<Q", h, 16, ref.parse_header(current[:64])["seq"])   # next counter
    return [ref.recompute_crc(bytes(h)) + old[64:]]
  before = transport.counters()
  c0, c1, _ = _replay_pair(replay_as_current)
  x = [np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)]
  outs, errs, _ = both_ranks(c0, c1, x)
  assert errs == [None, None] and outs[0].tolist() == [3.0] * 64    # collective #1 passes
  _, errs, _ = both_ranks(c0, c1, x)
  assert "header authentication failed" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, transport.counters())["rejected_mac"] == 1
  close_all([c0, c1])


def test_verbatim_replay_of_an_old_frame_is_rejected_as_replay():
  before = transport.counters()
  c0, c1, _ = _replay_pair(lambda old, current: [old, current])
  x = [np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)]
  both_ranks(c0, c1, x)
  _, errs, _ = both_ranks(c0, c1, x)
  assert "replayed frame" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, transport.counters())["rejected_replay"] == 1
  close_all([c0, c1])


def test_dropped_frame_is_detected_by_its_successor():
  def drop_second_data(index, frame):
    if is_data(frame) and ref.parse_header(frame[:64])["step"] == 0:
      return []
    return [frame]
  before = transport.counters()
  c0, c1, _ = relayed_pair(drop_second_data, timeout_s=3)
  _, errs, seconds = both_ranks(c0, c1, [np.ones(64, np.float32)] * 2)
  assert "frames were dropped or reordered in transit" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert seconds < 3   # the successor gives it away; no timeout needed
  assert delta(before, transport.counters())["rejected_out_of_order"] == 1
  close_all([c0, c1])


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
  before = transport.counters()

  def run(r):
    for x, op, site in calls[r]:
      comms[r].all_reduce(x, op, site=site)
  _, errs, seconds = run_ranks([lambda r=r: run(r) for r in range(n)])
  assert all(isinstance(e, errors.ConfigurationError) for e in errs), errs
  for r, e in enumerate(errs):
    assert "collective mismatch" in str(e), (r, e)
    assert all(v in str(e) for v in named), (r, named, str(e))
  assert seconds < 10   # not the 20 s timeout
  assert delta(before, transport.counters())["rejected_mismatch"] >= 1
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
  done.join(10)
  return box["from_prev"], box["to_next"]


def test_oversized_abort_text_is_rejected():
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  from_prev, to_next = _python_rank1(c0)
  before = transport.counters()
  to_next.send(ref.ABORT, b"\x07" + b"x" * 5000, coll_seq=1)
  with pytest.raises(errors.TransportError, match="ABORT text of 5001 bytes exceeds 4096"):
    c0.all_reduce(np.ones(8, np.float32), site=(3, "s"))
  assert delta(before, transport.counters())["rejected_oversized"] == 1
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
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5, handshake_timeout_s=0.5,
                                    max_pending_handshakes=3)
  c1 = transport.create_local_comm(1, 2, creds(), timeout_s=5)
  before = transport.counters()
  idle = [socket.create_connection(ref.host_port(c0.endpoint)) for _ in range(6)]
  t = threading.Thread(target=transport.connect, args=(c0, c1.endpoint), daemon=True)
  t.start()
  time.sleep(1.0)    # the first connections are evicted (cap 3) or time out (0.5 s)
  transport.connect(c1, c0.endpoint)
  t.join(10)
  d = delta(before, transport.counters())
  assert d.get("handshakes_evicted", 0) >= 3, d
  assert d.get("handshakes_timed_out", 0) >= 1, d
  assert transport.counters()["handshakes_pending"] <= 3
  for s in idle:
    s.close()
  close_all([c0, c1])


# --- native failures stay errors ------------------------------------------------------------------

def test_thread_that_cannot_start_is_an_error_not_a_crash():
  hooks = transport.testing_hooks()
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
  expected = hostcoll.reference_ring_sum(xs)
  for seg in (256, 4096, 1 << 20):
    comms, errs = native_ring(3, creds(), segment_bytes=seg)
    assert not errs
    outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(xs[r]) for r in range(3)])
    assert errs == [None] * 3
    assert all(o.tobytes() == expected.tobytes() for o in outs), seg
    close_all(comms)
