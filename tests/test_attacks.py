"""Attacks and races against the host transport, on loopback (issue 23): floods of connections
that never authenticate, look-alike collectives, mid-stream mutation by a relay, and set-up and
teardown races. Each case asserts the outcome docs/reliability.md promises, with its time bound.

In-process cases run n ranks of one process on threads; cross-process cases launch workers
(tests/mp_workers/attack_worker.py) with a jax.distributed coordinator on 127.0.0.1 and use the
public ``dtenjax.all_reduce`` inside ``jax.jit``. Measured numbers (formation time under flood,
detection times) go to docs/reliability.md.
"""

import concurrent.futures
import os
import re
import resource
import signal
import socket
import struct
import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import tenancy
from dtenjax._src.net import transport
from tests import procs
from tests import transport_ref as ref
from tests.mp_workers import launch
from tests.net_helpers import (FLOOD, both_ranks, close_all, delta, flood, listener,
                               native_ring, requires_native, run_ranks)

pytestmark = requires_native

SECRET = b"attack suite secret 0123456789ab"
JOB = 0xA77AC


def creds(job=JOB, secret=SECRET):
  return credentials.JobCredentials(job, secret)


def measured(what: str, seconds: float) -> None:
  """The numbers docs/reliability.md quotes (shown with pytest -s)."""
  print(f"[measured] {what}: {seconds:.3f} s")


@pytest.fixture(scope="module")
def fd_limit():
  """The descriptors this process may open, after raising the soft RLIMIT_NOFILE to what 4
  listeners x FLOOD connections need (or to the hard limit)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  want = 4 * FLOOD + 512
  new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
  if soft < new_soft:
    resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
  yield max(soft, new_soft)
  resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def flood_size(fd_limit: int, listeners: int) -> int:
  """FLOOD connections per listener, or as many as the descriptor limit allows (the attacker's
  ends; the listeners hold only their pending slots)."""
  k = min(FLOOD, (fd_limit - 256) // listeners)
  if k < 200:
    pytest.skip(f"RLIMIT_NOFILE allows {fd_limit} descriptors: too few for a flood of "
                f"{listeners} listeners")
  return k


# --- floods of connections that never authenticate ------------------------------------------------

@pytest.mark.parametrize("n,kind,order", [
    (2, "idle", "flood_first"), (2, "idle", "peer_first"),
    (2, "slow", "flood_first"), (2, "slow", "peer_first"),
    (2, "garbage", "flood_first"), (2, "garbage", "peer_first"),
    (2, "hello", "flood_first"), (2, "hello", "peer_first"),
    (4, "mixed", "flood_first"), (4, "mixed", "peer_first"), (4, "hello", "flood_first"),
])
def test_ring_forms_in_under_a_second_through_a_flood(n, kind, order, fd_limit):
  """1000 connections per listener that never authenticate (silent; 10 header bytes then
  nothing; random bytes; a valid HELLO claiming to be the expected peer, without the secret;
  or a mix), queued before the listener accepts, either before the real peer connects or after
  it (its HELLO already waiting in the backlog). The ring forms in < 1 s and computes."""
  k = flood_size(fd_limit, n)
  comms = [transport.create_local_comm(r, n, creds(), timeout_s=10) for r in range(n)]
  before = native.counters()
  early = []
  if order == "peer_first":   # rank 0 has connected to rank 1 before the flood lands there
    early = [threading.Thread(target=transport.connect, args=(comms[0], comms[1].endpoint),
                              daemon=True)]
    early[0].start()
    time.sleep(0.1)
  socks = [s for r, c in enumerate(comms)
           for s in flood(c.endpoint, k, kind, job=JOB, claim_rank=(r - 1) % n)]
  try:
    first = 1 if early else 0
    _, errs, seconds = run_ranks(
        [lambda r=r: transport.connect(comms[r], comms[(r + 1) % n].endpoint)
         for r in range(first, n)], join_s=30)
    for t in early:
      t.join(30)
    assert errs == [None] * (n - first), errs
    measured(f"{n} ranks form through {k} {kind} connections per listener ({order})", seconds)
    assert seconds < 1.0, f"the ring took {seconds:.3f} s to form through the flood"
    outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(np.full(5, r + 1.0, np.float32))
                               for r in range(n)])
    assert errs == [None] * n and all(o.tolist() == [n * (n + 1) / 2] * 5 for o in outs)
    d = delta(before, native.counters())
    turned_away = sum(d.get(k, 0) for k in ("handshakes_refused", "handshakes_evicted",
                                            "rejected_bad_header"))
    assert turned_away >= k, d     # the flood was really there, and was served
  finally:
    for s in socks:
      s.close()
    close_all(comms)


def test_a_flood_from_another_source_address_cannot_crowd_out_the_peer(fd_limit):
  """Flood connections from 127.0.0.2 hold every pending slot within their grace period; the
  real peer, from 127.0.0.1, displaces one of them at once (fairness by source address)."""
  flood_size(fd_limit, 2)
  comms = [transport.create_local_comm(r, 2, creds(), timeout_s=10) for r in range(2)]
  before = native.counters()
  socks = []
  for c in comms:
    socks += flood(c.endpoint, 200, "hello", job=JOB, claim_rank=1 - c.rank, source="127.0.0.2")
  try:
    _, errs, seconds = run_ranks([lambda r=r: transport.connect(comms[r], comms[1 - r].endpoint)
                                  for r in range(2)])
    assert errs == [None, None] and seconds < 1.0, (errs, seconds)
    d = delta(before, native.counters())
    assert d.get("connect_retries", 0) == 0, d   # never refused: it got a slot at once
  finally:
    for s in socks:
      s.close()
    close_all(comms)


# --- a malicious relay: mid-stream mutation -------------------------------------------------------

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
          if out is None:      # the mutation ends the stream here (shutdown: the pipe thread
            for sock in (server, client):   # still blocks in recv on these sockets)
              sock.shutdown(socket.SHUT_RDWR)
              sock.close()
            return
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
  """A DATA frame of a user collective (not of the ring set-up check, collective #0)."""
  h = ref.parse_header(frame[:64])
  return h["type"] == ref.DATA and h["coll_seq"] > 0


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


def flip_payload_byte(index, frame):
  if not is_data(frame):
    return [frame]
  f = bytearray(frame)
  f[80 + 7] ^= 0x01           # one bit of the payload; there is no unkeyed checksum to recompute
  return [bytes(f)]


def test_relay_rewrites_payload_rejected_on_both_ranks():
  before = native.counters()
  c0, c1, _ = relayed_pair(flip_payload_byte)
  xs = [np.arange(4096, dtype=np.float32), np.ones(4096, np.float32)]
  outs, errs, seconds = both_ranks(c0, c1, xs)
  assert outs == [None, None]
  assert isinstance(errs[1], errors.TransportError), errs
  assert "payload authentication failed" in str(errs[1])
  assert isinstance(errs[0], errors.TransportError), errs
  assert "rank 1 aborted" in str(errs[0]) and "payload authentication failed" in str(errs[0])
  assert seconds < 4   # told at once, not after the timeout
  d = delta(before, native.counters())
  assert d["rejected_mac"] == 1 and d["aborts_received"] >= 1, d
  close_all([c0, c1])


def test_relay_rewrites_header_rejected():
  def rewrite_count(index, frame):
    if not is_data(frame):
      return [frame]
    h = bytearray(frame[:64])
    struct.pack_into("<Q", h, 48, 999)             # the collective's count
    return [bytes(h) + frame[64:]]
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
  before = native.counters()
  c0, c1, _ = relayed_pair(swap, segment_bytes=1 << 20)
  n = 1 << 19   # 2 MiB per rank: 1 MiB chunks, one 1 MiB segment each
  rng = np.random.RandomState(0)
  _, errs, _ = both_ranks(c0, c1, [rng.randn(n).astype(np.float32) for _ in range(2)])
  assert "payload authentication failed" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, native.counters())["rejected_mac"] == 1
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
    return [bytes(h) + old[64:]]
  before = native.counters()
  c0, c1, _ = _replay_pair(replay_as_current)
  x = [np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)]
  outs, errs, _ = both_ranks(c0, c1, x)
  assert errs == [None, None] and outs[0].tolist() == [3.0] * 64    # collective #1 passes
  _, errs, _ = both_ranks(c0, c1, x)
  assert "header authentication failed" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, native.counters())["rejected_mac"] == 1
  close_all([c0, c1])


def test_verbatim_replay_of_an_old_frame_is_rejected_as_replay():
  before = native.counters()
  c0, c1, _ = _replay_pair(lambda old, current: [old, current])
  x = [np.full(64, 1.0, np.float32), np.full(64, 2.0, np.float32)]
  both_ranks(c0, c1, x)
  _, errs, _ = both_ranks(c0, c1, x)
  assert "replayed frame" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert delta(before, native.counters())["rejected_replay"] == 1
  close_all([c0, c1])


def test_dropped_frame_is_detected_by_its_successor():
  def drop_second_data(index, frame):
    if is_data(frame) and ref.parse_header(frame[:64])["step"] == 0:
      return []
    return [frame]
  before = native.counters()
  c0, c1, _ = relayed_pair(drop_second_data, timeout_s=3)
  _, errs, seconds = both_ranks(c0, c1, [np.ones(64, np.float32)] * 2)
  assert "frames were dropped or reordered in transit" in str(errs[1]), errs
  assert "rank 1 aborted" in str(errs[0]), errs
  assert seconds < 3   # the successor gives it away; no timeout needed
  assert delta(before, native.counters())["rejected_out_of_order"] == 1
  close_all([c0, c1])


def truncate_mid_frame(index, frame):
  if is_data(frame):
    return [frame[:len(frame) // 2], None]   # None: the relay closes the connection
  return [frame]


def inject_forged_frame(index, frame):
  if is_data(frame) and ref.parse_header(frame[:64])["step"] == 0:
    h = ref.parse_header(frame[:64])
    forged = ref.header(ref.DATA, job=h["job"], src=h["src"], payload_bytes=h["payload_bytes"],
                        seq=h["seq"], site=h["site"], coll_seq=h["coll_seq"], count=h["count"],
                        op=h["op"], dtype=h["dtype"], step=0, tag=h["tag"])
    body = bytes(h["payload_bytes"])   # zeros in place of the data, tags made up
    return [forged + os.urandom(16) + body + os.urandom(16), frame]
  return [frame]


def reorder_first_two_data_frames():
  held = []

  def mutate(index, frame):
    if is_data(frame) and not held:
      held.append(frame)
      return []
    if held:
      return [frame, held.pop()]
    return [frame]
  return mutate


@pytest.mark.parametrize("make,counter,fragment", [
    (lambda: truncate_mid_frame, None, "lost connection"),   # seen by rank 1, or by rank 0 first
    (lambda: inject_forged_frame, "rejected_mac", "header authentication failed"),
    (reorder_first_two_data_frames, "rejected_out_of_order",
     "frames were dropped or reordered in transit"),
], ids=["truncate", "inject", "reorder"])
def test_mid_stream_mutation_never_yields_a_sum(make, counter, fragment):
  """Whatever a relay without the keys does to the stream, no rank returns a result: the
  receiving rank names what it saw, the sending rank hears it by ABORT, both at once."""
  before = native.counters()
  c0, c1, _ = relayed_pair(make(), segment_bytes=1024)
  xs = [np.arange(2048, dtype=np.float32), np.ones(2048, np.float32)]
  outs, errs, seconds = both_ranks(c0, c1, xs)
  assert outs == [None, None], outs
  assert isinstance(errs[1], errors.TransportError) and fragment in str(errs[1]), errs
  assert isinstance(errs[0], errors.TransportError), errs
  assert seconds < 4, seconds   # not the 5 s timeout
  if counter:
    assert delta(before, native.counters())[counter] >= 1
  close_all([c0, c1])


def test_tampering_with_the_set_up_check_fails_the_set_up_on_both_ranks():
  """The relay flips a bit of the ring set-up check (collective #0): the ring never forms, and
  both ranks say why at set-up, not at their first collective."""
  def flip_setup(index, frame):
    h = ref.parse_header(frame[:64])
    if h["type"] == ref.DATA and h["coll_seq"] == 0:
      f = bytearray(frame)
      f[70] ^= 0x10   # a header byte
      return [bytes(f)]
    return [frame]
  c0 = transport.create_local_comm(0, 2, creds(), timeout_s=5)
  c1 = transport.create_local_comm(1, 2, creds(), timeout_s=5)
  relay = Relay(c1.endpoint, flip_setup)
  relay.start()
  _, errs, seconds = run_ranks([lambda: transport.connect(c0, relay.endpoint),
                                lambda: transport.connect(c1, c0.endpoint)])
  assert "header authentication failed" in str(errs[1]), errs
  assert "ring set-up check" in str(errs[0]) and "header authentication failed" in str(errs[0])
  assert seconds < 4
  close_all([c0, c1])


# --- look-alike collectives -----------------------------------------------------------------------

def _helper(comm, value, **kw):
  return comm.all_reduce(np.full(4, value, np.float32), **kw)   # one line for every collective


def _two_lines(comm, swap):
  """The helper called from two lines; `swap` issues them in the other order."""
  if swap:
    b = _helper(comm, 200.0)
    a = _helper(comm, 2.0)
  else:
    a = _helper(comm, 1.0)
    b = _helper(comm, 100.0)
  return a, b


STACK = re.compile(r"_helper \(test_attacks\.py:\d+\) < _two_lines \(test_attacks\.py:(\d+)\)")


@pytest.mark.parametrize("n", [2, 4])
def test_one_helper_called_in_another_order_raises_on_every_rank_naming_both_stacks(n):
  """Rank 1 issues the helper's two calls in the other order: before, every rank got 201/102
  instead of 3/300 (the call site was the helper's line). Now every rank raises, and each
  message names both call stacks (the caller's two lines)."""
  comms, errs = native_ring(n, creds(), timeout_s=10)
  assert not errs
  _, errs, seconds = run_ranks([lambda r=r: _two_lines(comms[r], swap=r == 1) for r in range(n)])
  assert all(isinstance(e, errors.ConfigurationError) for e in errs), errs
  for r, e in enumerate(errs):
    lines = set(STACK.findall(str(e)))
    assert "collective mismatch" in str(e) and len(lines) == 2, (r, str(e))
  measured(f"{n} ranks: helper called in another order detected on every rank", seconds)
  assert seconds < 2, seconds
  close_all(comms)


def _loop(comm, skip, tag):
  for i in range(3):
    if i == skip:
      continue
    _helper(comm, float(i + 1), **({"tag": i} if tag else {}))


def test_a_skipped_iteration_with_a_tag_raises_on_every_rank_naming_both_tags():
  comms, errs = native_ring(2, creds(), timeout_s=10)
  assert not errs
  _, errs, seconds = run_ranks([lambda r=r: _loop(comms[r], 1 if r == 1 else None, True)
                                for r in range(2)])
  for r, e in enumerate(errs):
    assert isinstance(e, errors.ConfigurationError), (r, e)
    assert "collective mismatch" in str(e) and "tag=1" in str(e) and "tag=2" in str(e), str(e)
  measured("2 ranks: skipped tagged iteration detected on every rank", seconds)
  assert seconds < 2, seconds
  close_all(comms)


def test_a_skipped_iteration_without_a_tag_is_the_documented_limit():
  """Iterations of one loop without a tag have the same stack, op, dtype and shape: nothing tells
  them apart, so ranks pair iteration 1 of one with iteration 2 of the other (docs/reliability.md,
  "Look-alike collectives"). The rank with a collective left over times out. If this test starts
  failing because the mix-up is caught, update the docs."""
  comms, errs = native_ring(2, creds(), timeout_s=1)
  assert not errs
  results = [[], []]

  def run(r):
    for i in range(3):
      if r == 1 and i == 1:
        continue
      results[r].append(_helper(comms[r], float(10 ** i * (r + 1))).tolist()[0])
  _, errs, _ = run_ranks([lambda r=r: run(r) for r in range(2)])
  assert results[1] == [3.0, 10.0 + 200.0], results    # iteration 1 of rank 0 met 2 of rank 1
  assert isinstance(errs[0], errors.CollectiveTimeoutError) and errs[1] is None, errs
  close_all(comms)


def test_a_str_tag_names_the_collective_in_the_message():
  comms, errs = native_ring(2, creds(), timeout_s=10)
  assert not errs
  _, errs, _ = run_ranks([lambda r=r: _helper(comms[r], 1.0, tag=("grad/w" if r else "grad/b"))
                          for r in range(2)])
  assert all("[tag 'grad/w']" in str(e) and "[tag 'grad/b']" in str(e) for e in errs), errs
  close_all(comms)


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, True, np.ones(2, np.int32), np.float32(3)])
def test_tags_that_cannot_travel_are_refused(bad):
  one = transport.create_local_comm(0, 1, creds())
  with pytest.raises(errors.DtenjaxError, match="tag="):
    one.all_reduce(np.ones(2, np.float32), tag=bad)
  one.close()


# --- set-up and teardown races --------------------------------------------------------------------

@pytest.mark.parametrize("quota", [8, 6])
def test_rings_racing_for_a_connection_quota_form_or_fail_fast_with_the_quota_error(quota):
  """10 rings of 2 ranks, one tenant limited to 8 (or 6) connections; a rank needs 2. Before,
  ranks took their connections one by one, and a ring whose other rank was refused waited for it
  until the timeout (with 6, 3 ranks get theirs: one ring is always split). Now each rank takes
  both at once or none, a refused rank tells its neighbour why, and every ring either forms or
  fails on both ranks with the quota error, fast; the failed ones give their quota back."""
  tenancy.set_quota("racers", tenancy.Quota(max_connections=quota))
  try:
    rings = [[transport.create_local_comm(r, 2, creds(), timeout_s=10, tenant="racers")
              for r in range(2)] for _ in range(10)]
    fns = [lambda c=c, ring=ring: transport.connect(c, ring[1 - c.rank].endpoint)
           for ring in rings for c in ring]
    _, errs, seconds = run_ranks(fns)
    measured(f"10 rings of 2 racing for a quota of {quota}: all formed or failed", seconds)
    assert seconds < 3, seconds      # nobody waits for the 10 s timeout
    formed = 0
    for i in range(10):
      pair = errs[2 * i:2 * i + 2]
      if pair == [None, None]:
        formed += 1
        continue
      assert all(isinstance(e, errors.QuotaExceededError) for e in pair), (i, pair)
      assert all(f"tenant 'racers' would exceed its connection quota ({quota}" in str(e)
                 for e in pair), pair
    assert tenancy.usage("racers")["connections"] == 4 * formed <= quota
    for ring in rings:
      close_all(ring)
    assert tenancy.usage("racers")["connections"] == 0
  finally:
    tenancy.set_quota("racers", tenancy.Quota())


def test_a_second_connect_after_a_failed_one_raises_and_counts_nothing_twice():
  tenancy.set_quota("second", tenancy.Quota(max_connections=4))
  try:
    c = transport.create_local_comm(0, 2, creds(), timeout_s=0.5, tenant="second")
    nobody = socket.socket()
    nobody.bind(("127.0.0.1", 0))   # bound, not listening: connections are refused
    dead = f"tcp://127.0.0.1:{nobody.getsockname()[1]}"
    with pytest.raises(errors.CollectiveTimeoutError, match="[Cc]onnection refused"):
      transport.connect(c, dead)
    assert tenancy.usage("second")["connections"] == 0    # given back at once
    with pytest.raises(errors.ConfigurationError, match="failed to connect .*create a new one"):
      transport.connect(c, dead)
    assert tenancy.usage("second")["connections"] == 0
    c.close()
    nobody.close()
  finally:
    tenancy.set_quota("second", tenancy.Quota())


def test_different_job_ids_with_one_secret_are_named_on_both_ranks():
  c0 = transport.create_local_comm(0, 2, creds(job=111), timeout_s=10)
  c1 = transport.create_local_comm(1, 2, creds(job=222), timeout_s=10)
  _, errs, seconds = run_ranks([lambda: transport.connect(c0, c1.endpoint),
                                lambda: transport.connect(c1, c0.endpoint)])
  assert all(isinstance(e, errors.TransportError) for e in errs), errs
  assert "job id 111 is not this job's (222)" in str(errs[0]), errs[0]
  assert "job id 222 is not this job's (111)" in str(errs[1]), errs[1]
  measured("different job ids refused on both ranks", seconds)
  assert seconds < 3, seconds
  close_all([c0, c1])


def test_closing_right_after_a_collective_never_fails_a_neighbour_still_finishing():
  """Each rank closes its communicator the moment its collective returns. Before, a neighbour
  still finishing raised "end of stream" (4 of 20 trials with 3 ranks)."""
  for trial in range(20):
    comms, errs = native_ring(3, creds(), timeout_s=5)
    assert not errs

    def run(r, c=comms):
      out = c[r].all_reduce(np.full(1 << 14, r + 1.0, np.float32))
      c[r].close()
      return out
    outs, errs, _ = run_ranks([lambda r=r: run(r) for r in range(3)])
    assert errs == [None] * 3, (trial, errs)
    assert all(float(o[0]) == 6.0 for o in outs)


def test_a_neighbour_that_closed_is_named_by_the_next_collective():
  comms, errs = native_ring(2, creds(), timeout_s=5)
  assert not errs
  outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(np.ones(8, np.float32))
                             for r in range(2)])
  assert errs == [None, None]
  comms[1].close()
  t0 = time.monotonic()
  with pytest.raises(errors.TransportError, match="rank 1"):
    comms[0].all_reduce(np.ones(8, np.float32))
  assert time.monotonic() - t0 < 2    # told by the closed connection, not the 5 s timeout
  comms[0].close()


# --- across processes (jax.distributed on 127.0.0.1, the public API inside jax.jit) ---------------

def _launch(tmp_path, nprocs, phases, timeout_s=120, env=None):
  e = {"DTENJAX_TEST_PHASES": phases, "DTENJAX_COLLECTIVE_TIMEOUT": "4"}
  e.update(env or {})
  return launch.launch("tests.mp_workers.attack_worker", nprocs, str(tmp_path),
                       timeout_s=timeout_s, env=e)


THREAD_TRIALS = 50
# Phase (4) waits for a ring its peer never joins: the whole timeout, whatever its length, and the
# same error (the peer is in XLA's collective, never in dtenjax's). The other phases keep
# DTENJAX_COLLECTIVE_TIMEOUT=4, which their detections must beat.
ALGORITHMS_TIMEOUT = 1


def _check_thread_trials(res: list[dict]) -> dict:
  """Issue 44 (the worker's "threads" phase): two worker threads per process with default names
  ("Thread-N (worker)"), started in the opposite order on rank 1, each reduce their job's array
  (100 k + rank + 1): thread names coincide across the ranks while the jobs do not. In
  THREAD_TRIALS trials of each variant every outcome is the right sum or a clear error, never a
  mix: on one communicator without a stream key both threads are refused; with
  stream=f"job-{k}" on a shared communicator a different queue order is a mismatch naming both
  streams; with a communicator of its own per thread every sum is right. (With thread names in
  the fingerprint, half of the shared variant's outcomes were mixed sums.)"""
  counts = {}
  for r in res:
    for variant, runs in r["threads"]["outcomes"].items():
      assert len(runs) == THREAD_TRIALS, (variant, len(runs))
      for run in runs:
        assert all(re.fullmatch(r"Thread-\d+ \(worker\)", n) for n in run["names"]), run
        for k, out in run["jobs"].items():
          key = (variant, "sum" if "value" in out else "error")
          counts[key] = counts.get(key, 0) + 1
          if "value" in out:
            assert out["value"] == [2 * 100.0 * int(k) + 3] * 8, (r["rank"], variant, run)
          elif variant == "shared":
            assert out["error"].startswith("CollectiveError") and (
                "without a stream key" in out["error"]), out
          elif variant == "keyed":
            assert any(m in out["error"] for m in (
                "collective mismatch", "unusable after an earlier failure")), out
          else:
            raise AssertionError(("a communicator of its own failed", r["rank"], run))
    measured(f"2 processes, {THREAD_TRIALS} trials x 3 variants of two threads "
             f"(rank {r['rank']})", r["threads"]["seconds"])
  assert counts.get(("shared", "sum"), 0) == 0, counts       # refused before anything is sent
  assert counts[("own", "sum")] == 2 * 2 * THREAD_TRIALS, counts   # both ranks, jobs, trials
  keyed_errors = [o["error"] for r in res for run in r["threads"]["outcomes"]["keyed"]
                  for o in run["jobs"].values() if "error" in o]
  if keyed_errors:     # a mismatch names both streams (the record's stream field)
    assert any("thread 'job-0'" in e and "thread 'job-1'" in e for e in keyed_errors), keyed_errors
  return counts


@pytest.mark.multiprocess
def test_across_processes_floods_look_alikes_and_algorithm_mismatches(tmp_path):
  """Two processes: (1) 1000 connections that never authenticate per listener, queued before
  either rank connects: the ring forms in < 1 s and the jitted all_reduce is right; (2) one
  helper called from two lines in the other order on rank 1: both raise naming both stacks;
  (3) a tagged step that rank 1 skips (hostcoll's traced tag, and dtenjax.all_reduce's static
  one): both raise naming tag=1 and tag=2; (3b) the public all_reduce in lax.fori_loop tagged
  with its traced index, rank 1 one iteration ahead: both raise naming the tags (the same loop on
  every rank computes); one line reducing another shape or dtype (same element count) on rank 1:
  both raise naming both; (4) rank 0 asks for
  the host ring while rank 1 runs XLA's collective: rank 0 raises within the timeout naming
  process 1 and algorithm=, and rank 1 is released by rank 0's own XLA collective after it;
  (5) threads started in opposite orders (:func:`_check_thread_trials`)."""
  codes, res, logs = _launch(tmp_path, 2, "flood,lookalike,tagged,fori,differ,threads,algorithms",
                             env={"DTENJAX_TEST_THREAD_TRIALS": str(THREAD_TRIALS),
                                  "DTENJAX_TEST_ALGORITHMS_TIMEOUT": str(ALGORITHMS_TIMEOUT)})
  assert codes == [0, 0], logs
  for r in res:
    assert "exception" not in r, r["exception"]
  print("thread trials:", _check_thread_trials(res))
  x = np.stack([np.full(8, 10.0 ** r, np.float32) for r in range(2)])
  for _ in range(3):       # fori_same: c + 0.5 * sum over ranks, three times
    x = x + 0.5 * x.sum(0)
  for r in res:   # issue 35: traced tags, shapes and dtypes are part of the fingerprint
    assert r["fori_same"]["error"] is None and r["fori_same"]["value"] == [x[r["rank"]].tolist()], r
    for case, named in (("fori", ("tag=1",)), ("shapes", ("float32[1000]", "float32[4, 250]")),
                        ("dtypes", ("float32 contract=none", "bfloat16 contract=none"))):
      err = r[case]["error"]
      assert err and "collective mismatch" in err and all(v in err for v in named), (case, err)
      assert r[case]["seconds"] < 4, (case, r[case])
      measured(f"2 processes, jit: {case} mismatch raised (rank {r['rank']})", r[case]["seconds"])
  for r in res:
    assert "exception" not in r, r
    f = r["flood"]
    assert f["error"] is None, f
    assert f["value"] == [[11.0] * 8], f
    for s in f["formation_s"].values():
      measured(f"2 processes form through {f['connections']} mixed connections per listener "
               f"(rank {r['rank']})", s)
      assert s < 1.0, f["formation_s"]
    assert f["connections"] >= 200, f   # FLOOD, unless the descriptor limit is lower
    assert f["turned_away"] >= f["connections"] - 16, f   # all but the 16 pending slots
    look = r["lookalike"]["error"]
    assert look and "collective mismatch" in look, look
    lines = set(re.findall(r"helper \(attack_worker\.py:\d+\) < step \(attack_worker\.py:(\d+)\)",
                           look))
    assert len(lines) == 2, look     # both call stacks are named
    tagged = r["tagged"]["error"]
    assert tagged and "tag=1" in tagged and "tag=2" in tagged, tagged
    public = r["tagged_public"]["error"]      # dtenjax.all_reduce(..., tag=i) reaches the ring
    assert public and "tag=1" in public and "tag=2" in public, public
    measured(f"2 processes, jit: helper in another order detected (rank {r['rank']})",
             r["lookalike"]["seconds"])
    measured(f"2 processes, jit: skipped tagged step detected (rank {r['rank']})",
             r["tagged"]["seconds"])
    assert r["lookalike"]["seconds"] < 4 and r["tagged"]["seconds"] < 4
  alg0, alg1 = res[0]["algorithms"], res[1]["algorithms"]
  assert alg0["error"] and "processes [1] did not join" in alg0["error"], alg0
  measured(f"ring vs xla: the ring rank raises (DTENJAX_COLLECTIVE_TIMEOUT={ALGORITHMS_TIMEOUT})",
           alg0["seconds"])
  assert "algorithm=" in alg0["error"] and alg0["seconds"] < ALGORITHMS_TIMEOUT + 3, alg0
  assert alg1["error"] is None and alg1["value"] == [[11.0] * 8], alg1
  assert res[0]["released"] == [[11.0] * 8]


@pytest.fixture(scope="module")
def recoverable_forks():
  """The launches below with JAX_ENABLE_RECOVERABILITY=1 (6 processes) fork their workers from
  one pair of servers that imported jax with it set (tests/mp_workers/launch.py); the one
  without it (jax's default, off) forks from the session's pair."""
  with launch.shared_forks(env={"JAX_ENABLE_RECOVERABILITY": "1"}):
    yield


@pytest.mark.multiprocess
def test_a_dead_process_is_a_dtenjax_error_and_jax_recoverability_keeps_the_survivors(
    tmp_path, recoverable_forks):
  """The last of 3 processes exits between two collectives. The survivors' next jitted
  all_reduce raises at once in both cases, naming the lost rank. Then JAX decides: with
  jax_enable_recoverability its coordination service lets them live (exit 0); without it, it
  terminates them (SIGABRT) once the dead process misses its heartbeats (here 2 s). The two jobs
  (3 processes each) run at once: both mostly wait (the heartbeat, the 5 s watch), and one after
  the other the job without recoverability was 3 s of idle wall beside the other's."""
  def job(recoverable):
    out = tmp_path / f"recoverable={recoverable}"
    out.mkdir()
    env = {"DTENJAX_TEST_HEARTBEAT": "2", "DTENJAX_TEST_WATCH": "5",
           **({"JAX_ENABLE_RECOVERABILITY": "1"} if recoverable else {})}
    return _launch(out, 3, "peer_loss", timeout_s=90, env=env)
  with procs.adopting(), concurrent.futures.ThreadPoolExecutor(2) as pool:
    jobs = {recoverable: pool.submit(job, recoverable) for recoverable in (True, False)}
    done = {recoverable: f.result() for recoverable, f in jobs.items()}
  for recoverable, (codes, res, logs) in done.items():
    assert codes[2] == 3, (recoverable, logs)
    for r in res[:2]:
      assert r["first"]["error"] is None, (recoverable, r)
      err = r["second"]["error"]
      # raised by XLA's runtime (JaxRuntimeError) with the transport's message, seen by this rank
      # or forwarded by the other survivor's ABORT
      assert err and "dtenjax transport" in err and "lost connection to rank 2" in err, (
          recoverable, err)
      measured(f"dead peer detected by a survivor's jitted all_reduce (recoverable={recoverable})",
               r["second"]["seconds"])
      assert r["second"]["seconds"] < 2, (recoverable, r["second"])
    if recoverable:
      assert codes[:2] == [0, 0], logs
      assert all(r["alive_after_s"] >= 4.5 for r in res[:2]), [r["alive_after_s"] for r in res]
    else:
      assert codes[:2] == [-signal.SIGABRT] * 2, (codes, logs)
      assert all("detected fatal errors" in log for log in logs[:2]), logs


@pytest.mark.multiprocess
def test_the_coordinator_is_a_single_point_of_failure(tmp_path, recoverable_forks):
  """SIGKILL of process 0, which hosts jax.distributed's coordination service: JAX aborts every
  other process (SIGABRT) within moments, before dtenjax can raise anything. No option of
  jax.distributed (0.10.2, 0.11) changes this (docs/reliability.md, "Coordinator loss"): this
  test pins JAX's behaviour so the docs are updated when it changes."""
  codes, res, logs = _launch(tmp_path, 3, "coordinator_loss", timeout_s=60,
                             env={"JAX_ENABLE_RECOVERABILITY": "1"})
  assert codes[0] == -signal.SIGKILL, codes
  assert codes[1:] == [-signal.SIGABRT] * 2, (codes, logs)
  killed = res[0]["killed_at"]
  for r, log in zip(res[1:], logs[1:]):
    assert "Terminating process because the JAX distributed service detected fatal errors" in log
    measured("coordinator SIGKILLed: a survivor's last sign of life after it",
             max(r["beats"]) - killed)
    assert max(r["beats"]) - killed < 1.0, (max(r["beats"]) - killed)   # dead within a second
