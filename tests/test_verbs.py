"""The RDMA verbs data path, end to end, on the emulated device (tests/fakeverbs/).

The provider (csrc/transport/verbs_*.cc) loads the emulated libibverbs through
DTENJAX_IBVERBS_LIBRARY and runs exactly as it would on a NIC: QPs, MRs, CQs, completion
channels, RDMA WRITE WITH IMM, credits. The device enforces the verbs contract
(tests/test_verbs_fake.py checks it against the man pages) and counts every refused call
("violations"): every test here that expects success also expects the provider to have made none.

In-process rings (several ranks in this process, one emulated port) cover correctness against
the ring reference and the TCP provider, every fault, and leaks, quickly; multi-process runs (one
process per rank, tests/mp_workers/) cover the jitted collectives, their bits against TCP, faults
seen by every rank, and a killed peer. What only hardware can show is listed in
docs/transport.md.
"""

import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import bufferpool as bp
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import providers
from dtenjax._src.net import rdma
from dtenjax._src.net import tenancy
from dtenjax._src.net import transport
from tests import transport_ref
from tests import fakeverbs
from tests.mp_workers import launch
from tests.net_helpers import close_all, native_ring, requires_native, run_ranks


HAS_VERBS = ffi.is_built() and bool(ffi.build_info().get("verbs", False))
pytestmark = [requires_native, pytest.mark.skipif(
    not HAS_VERBS, reason="the verbs provider is not in this build (libibverbs-dev headers were "
    "missing at build time); test_rdma.py::test_verbs_provider_is_built_where_its_headers_are "
    "fails where they are installed")]

CREDS = credentials.JobCredentials(0x5EED, b"verbs-tests-secret-0123456789ab")


@pytest.fixture
def fake(monkeypatch):
  """This process's verbs provider on a fresh emulated fabric; afterwards nothing of the device
  may be left open, and the process goes back to the default library."""
  lib = fakeverbs.build()["library"]   # a build failure fails the test (never skips)
  for k, v in fakeverbs.env(fakeverbs.fabric_name("inproc")).items():
    monkeypatch.setenv(k, v)
  monkeypatch.delenv("FAKEVERBS_LINK_LAYER", raising=False)
  monkeypatch.delenv("FAKEVERBS_PORT_STATE", raising=False)
  rdma.reset_cache()
  rdma.load_library()
  f = fakeverbs.Fake(lib)
  f.arm("none", 0)
  f.violations_before = f.counters()["violations"]
  yield f
  f.arm("none", 0)
  leftover = f.live()
  users = native.transport().verbs.device_users()
  monkeypatch.undo()
  rdma.reset_cache()
  rdma.load_library()   # back to libibverbs.so.1 for the tests that follow
  assert users == 0 and all(v == 0 for v in leftover.values()), (users, leftover)


def _violations(f):
  return f.counters()["violations"] - f.violations_before


def _ring(n, **kw):
  comms, errs = native_ring(n, CREDS, provider="verbs", **kw)
  assert not errs, errs
  return comms


def _all_reduce(comms, xs, op="sum", join_s=60.0):
  return run_ranks([lambda r=r: comms[r].all_reduce(xs[r], op, site=(11, "verbs-test"))
                    for r in range(len(comms))], join_s=join_s)


def _inputs(n, count, dtype, seed=0):
  rng = np.random.RandomState(seed)
  if np.dtype(dtype).kind == "i":
    return [rng.randint(-1000, 1000, count).astype(dtype) for _ in range(n)]
  return [(rng.randn(count) * 10.0 ** rng.randint(-3, 4, count)).astype(dtype) for _ in range(n)]


def _rank_threads(comms, xs, order, errs):
  """One started thread per rank of ``order``, in that order, each running its all_reduce of
  ``xs`` (on the stream _all_reduce's fingerprint has) and keeping its error in ``errs``."""
  def rank(r):
    try:
      with transport.stream("rank-thread"):
        comms[r].all_reduce(xs[r], "sum", site=(11, "verbs-test"))
    except Exception as e:
      errs[r] = e
  threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in order]
  for t in threads:
    t.start()
  return threads


def _until(what, cond, timeout_s=10.0):
  deadline = time.monotonic() + timeout_s
  while not cond():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.001)


# --- correctness --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,count,dtype,segment", [
    (2, 1, "float32", None), (3, 1001, "float64", None), (4, 4097, "int32", 4096),
    (3, 70001, "bfloat16", 4096), (2, 1 << 20, "float32", None), (4, 99999, "float32", 256)])
def test_ring_over_verbs_gives_the_bits_of_the_reference_and_of_tcp(fake, n, count, dtype, segment):
  import ml_dtypes
  dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  xs = _inputs(n, count, dt, seed=count)
  before = fake.counters()
  comms = _ring(n, segment_bytes=segment)
  tcp, tcp_setup_errs = native_ring(n, CREDS, provider="tcp", segment_bytes=segment)
  assert not tcp_setup_errs
  try:
    outs, errs, _ = _all_reduce(comms, xs)
    assert errs == [None] * n, errs
    ref = transport_ref.reference_ring_sum(xs)
    tcp_outs, tcp_errs, _ = _all_reduce(tcp, xs)
    assert tcp_errs == [None] * n
    for o, t in zip(outs, tcp_outs):
      assert o.tobytes() == ref.tobytes() == t.tobytes()
    after = fake.counters()
    # It really went over the emulated device: RDMA writes, one per frame at least.
    assert after["messages_received"] - before["messages_received"] >= 2 * (n - 1) * n
    assert _violations(fake) == 0, fake.last_violation()
  finally:
    close_all(comms + tcp)


def test_roce_port_routes_by_gid(fake, monkeypatch):
  monkeypatch.setenv("FAKEVERBS_LINK_LAYER", "roce")
  rdma.reset_cache()
  (nic,) = rdma.emulated_nics()
  assert (nic["link_layer"], nic["active_mtu"], nic["gid_index"]) == ("Ethernet", 1024, 3)
  comms = _ring(3)
  try:
    xs = _inputs(3, 50000, np.float32)
    outs, errs, _ = _all_reduce(comms, xs)
    assert errs == [None] * 3
    assert all(o.tobytes() == transport_ref.reference_ring_sum(xs).tobytes() for o in outs)
    assert _violations(fake) == 0, fake.last_violation()
  finally:
    close_all(comms)


def test_many_collectives_reuse_the_connections_and_leak_nothing(fake):
  files0 = fakeverbs.open_files()
  for _ in range(3):
    comms = _ring(3)
    live = fake.live()
    assert (live["qps"], live["cqs"], live["channels"], live["contexts"], live["pds"]) == (6, 6, 6, 1, 1)
    assert live["mrs"] == 12   # a send and a receive slab per connection
    for k in range(4):
      xs = _inputs(3, 1000 + k, np.float32, seed=k)
      outs, errs, _ = _all_reduce(comms, xs)
      assert errs == [None] * 3
    assert fake.live() == live
    close_all(comms)
    assert all(v == 0 for v in fake.live().values()), fake.live()
    assert native.transport().verbs.device_users() == 0
  assert not fakeverbs.opened_since(files0)
  assert _violations(fake) == 0, fake.last_violation()


# --- faults: every rank fails clearly and in time, nothing leaks ---------------------------------

FAULT_SIGNS = {
    # what the emulated device does            what some rank's error must name
    "qp_error": ("IBV_WC_WR_FLUSH_ERR", "IBV_WC_RETRY_EXC_ERR", "lost rank"),
    "wc_error": ("IBV_WC_REM_OP_ERR", "IBV_WC_LOC_QP_OP_ERR"),
    "revoke_mr": ("IBV_WC_REM_ACCESS_ERR",),
    "cq_overrun": ("ibv_poll_cq failed",),
    "rnr": ("IBV_WC_RNR_RETRY_EXC_ERR",),
}


@pytest.mark.parametrize("kind", sorted(FAULT_SIGNS))
def test_fault_mid_collective_fails_every_rank_in_time(fake, kind):
  timeout = 4.0
  files0 = fakeverbs.open_files()
  comms = _ring(3, timeout_s=timeout)
  try:
    warm = _inputs(3, 3000, np.float32)
    outs, errs, _ = _all_reduce(comms, warm)
    assert errs == [None] * 3
    fake.arm(kind, 3)
    xs = _inputs(3, 1 << 20, np.float32, seed=5)   # 4 MiB: 24 frames per rank, it fires mid-way
    fired = fake.counters()["faults_fired"]
    outs, errs, seconds = _all_reduce(comms, xs, join_s=30)
    assert fake.counters()["faults_fired"] == fired + 1, "the fault did not fire"
    assert all(isinstance(e, errors.TransportError) for e in errs), (outs, errs)   # no result
    text = " | ".join(str(e) for e in errs)
    assert any(sign in text for sign in FAULT_SIGNS[kind]), text
    assert "dtenjax transport" in text
    assert seconds < timeout + 2, seconds
  finally:
    close_all(comms)
  assert all(v == 0 for v in fake.live().values()), fake.live()
  assert not fakeverbs.opened_since(files0)


def test_peer_that_deregisters_its_region_is_refused_not_written(fake):
  """The receive slab's owner revokes it: the writer gets IBV_WC_REM_ACCESS_ERR and no byte of
  the refused frame reaches anyone's result (both ranks raise)."""
  comms = _ring(2, timeout_s=4)
  try:
    fake.arm("revoke_mr", 0)
    outs, errs, _ = _all_reduce(comms, _inputs(2, 10000, np.float32))
    assert all(isinstance(e, errors.TransportError) for e in errs), (outs, errs)
    assert any("IBV_WC_REM_ACCESS_ERR" in str(e) and "deregistered" in str(e) for e in errs), errs
  finally:
    close_all(comms)


def test_a_peer_that_goes_away_is_noticed_at_once_not_at_the_timeout(fake):
  """Rank 0 closes its communicator while rank 1 waits for its data: its QP is gone, so no
  completion will ever come; the closed TCP set-up connection says so within a second."""
  comms = _ring(2, timeout_s=20)
  try:
    t0 = time.monotonic()
    errs = {}
    t = threading.Thread(target=lambda: errs.setdefault(
        1, _capture(lambda: comms[1].all_reduce(np.ones(1000, np.float32), site=(11, "t"),
                                             stream="waiter"))))
    t.start()
    time.sleep(0.3)
    comms[0].close()
    t.join(30)
    assert not t.is_alive()
    assert isinstance(errs[1], errors.TransportError), errs
    assert "TCP set-up connection closed" in str(errs[1]), errs
    assert time.monotonic() - t0 < 3
  finally:
    close_all(comms[1:])


def _last_write_faulted(fake, fault, comms, xs):
  """Runs an all_reduce of ``xs`` with ``fault`` armed on the last RDMA write this process
  receives in it (counted on a run before) and every rank closing its communicator as soon as its
  all_reduce returns (as a pipeline stage leaving ``with HostPipeline``). Returns (results,
  errors, the peer failures native.counters() counted meanwhile)."""
  n = len(comms)
  _, errs, _ = _all_reduce(comms, xs)   # the first collective also checks the ring's set-up
  assert errs == [None] * n, errs
  before = fake.counters()["writes_received"]
  _, errs, _ = _all_reduce(comms, xs)
  assert errs == [None] * n, errs
  frames = fake.counters()["writes_received"] - before   # the RDMA writes of one all_reduce
  assert frames > 0, frames
  fired = fake.counters()["faults_fired"]
  failures = native.counters()["peer_failures"]
  fake.arm(fault, frames - 1)    # the last RDMA write this process receives

  def rank(r):
    try:
      return comms[r].all_reduce(xs[r], "sum", site=(11, "verbs-test"))
    finally:
      comms[r].close()

  outs, errs, _ = run_ranks([lambda r=r: rank(r) for r in range(n)], join_s=30)
  assert fake.counters()["faults_fired"] == fired + 1, "the fault did not fire"
  return outs, errs, native.counters()["peer_failures"] - failures


@pytest.mark.parametrize("fault,n,segment", [("late_cqe", 2, None), ("late_ack", 2, None),
                                             ("late_ack", 3, 1024)])
def test_a_peer_that_closes_right_after_its_last_exchange_loses_no_frame(fake, fault, n, segment):
  """The ranks close their communicators as soon as their last all_reduce returns, and the
  process's last frame completes late on one side (both orders are allowed: the specification
  orders neither completion).
  late_cqe: the device acknowledges it at once but posts its receive completion 0.3 s later; its
  sender's write completes, it returns and closes, and the receiver, whose CQ was empty when it
  looked, finds the set-up connection closed (race14).
  late_ack: the receive completion comes at once and the acknowledgement reaches the sender 0.3 s
  later; the receiver returns and closes while the sender's write is still in flight, and the
  sender, watching its next rank for an ABORT, finds it closed before its last frame was sent.
  Either way the frame was delivered: both take the sum, not 'lost rank', and no peer failure is
  counted (the sender's watch counted one every 20 ms while it waited for its write, abort17).
  Three ranks with four segments a chunk: the last frame in flight is the last segment of the
  last step."""
  xs = _inputs(n, 3000, np.float32, seed=7)
  want = transport_ref.reference_ring_sum(xs)
  comms = _ring(n, timeout_s=20, segment_bytes=segment)
  try:
    outs, errs, failures = _last_write_faulted(fake, fault, comms, xs)
    assert errs == [None] * n, errs
    for out in outs:
      assert out.tobytes() == want.tobytes()
    assert failures == 0, failures
  finally:
    close_all(comms)


def test_a_later_collective_that_needs_a_peer_closed_behind_our_last_write_fails_once(fake):
  """late_ack on the last frame: its receiver returns first and closes while the sender's write
  waits for its acknowledgement (the ring stops looking at the closed rank, the write decides:
  it completes). The sender's next all_reduce needs that rank: it must say at once that the rank
  closed after the previous collective, as when it closes after the last write completed, and
  count one peer failure (nothing was counted for the close before); it raised 'lost rank N'
  after the second a receive or a send waits for the peer's last words."""
  xs = _inputs(2, 3000, np.float32, seed=7)
  comms = _ring(2, timeout_s=5)
  lock, order = threading.Lock(), []

  def rank(r):
    comms[r].all_reduce(xs[r], "sum", site=(11, "verbs-test"))
    with lock:
      order.append(r)
    if len(order) == 1:     # the receiver of the late-acknowledged frame returns first
      comms[r].close()
      return None
    return comms[r].all_reduce(xs[r], "sum", site=(11, "verbs-test"))

  try:
    _, errs, _ = _all_reduce(comms, xs)
    assert errs == [None, None], errs
    before = fake.counters()["writes_received"]
    _, errs, _ = _all_reduce(comms, xs)
    failures, fired = native.counters()["peer_failures"], fake.counters()["faults_fired"]
    fake.arm("late_ack", fake.counters()["writes_received"] - before - 1)
    _, errs, _ = run_ranks([lambda r=r: rank(r) for r in range(2)], join_s=30)
    assert fake.counters()["faults_fired"] == fired + 1, "late_ack did not fire"
    assert errs[order[0]] is None, errs
    assert isinstance(errs[order[1]], errors.TransportError), errs
    assert "closed its connection after the previous collective" in str(errs[order[1]]), errs
    assert native.counters()["peer_failures"] - failures == 1
  finally:
    close_all(comms)


def test_a_closed_peer_whose_last_frame_fails_is_one_peer_failure(fake):
  """lost_ack: the last frame is placed and its receiver returns and closes, but no
  acknowledgement of it reaches its sender, whose write fails after its retries (0.5 s): the
  receiver has the sum, the sender raises that write's own error, and native.counters() counts
  one peer failure, not one per 20 ms look at the closed peer while the write was decided."""
  xs = _inputs(2, 3000, np.float32, seed=7)
  comms = _ring(2, timeout_s=5)
  try:
    outs, errs, failures = _last_write_faulted(fake, "lost_ack", comms, xs)
    (sender,) = [r for r in range(2) if errs[r] is not None]
    assert isinstance(errs[sender], errors.TransportError), errs
    text = str(errs[sender])
    assert "the RDMA write of a frame to rank" in text and "IBV_WC_RETRY_EXC_ERR" in text, text
    assert outs[1 - sender].tobytes() == transport_ref.reference_ring_sum(xs).tobytes()
    assert failures == 1, failures
  finally:
    close_all(comms)


def test_an_abort_sent_while_a_data_write_is_posted_reaches_the_peer(fake):
  """Rank 0 is closed while its first RDMA write of an all_reduce waits for its acknowledgement
  (late_ack: 0.3 s). Its ABORT to rank 1 must go out after that write, as a write of its own: it
  was marked sent when the data write completed, without being posted, and rank 1 reported a lost
  peer a second later instead of why rank 0 gave up. Rank 1 starts first and rank 2 never does,
  so the next write placed is rank 0's and nothing else tells rank 1 (rank 2 would forward rank
  0's ABORT backwards)."""
  xs = _inputs(3, 3000, np.float32, seed=3)
  comms = _ring(3, timeout_s=25)   # an ABORT waits at most 2 % of it (0.5 s) for the frame before
  try:
    _, errs, _ = _all_reduce(comms, xs)
    assert errs == [None] * 3, errs
    errs = {}
    writes = fake.counters()["writes_received"]
    threads = _rank_threads(comms, xs, (1,), errs)
    _until("rank 1's first write", lambda: fake.counters()["writes_received"] > writes)
    fired = fake.counters()["faults_fired"]
    fake.arm("late_ack", 0)
    threads += _rank_threads(comms, xs, (0,), errs)
    _until("rank 0's first write", lambda: fake.counters()["faults_fired"] > fired)
    comms[0].close()
    for t in threads:
      t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    assert "closed locally" in str(errs[0]), errs
    assert str(errs[1]).startswith("dtenjax transport: rank 0 aborted"), errs[1]
    assert "closed locally" in str(errs[1]), errs[1]
  finally:
    close_all(comms)


@pytest.mark.parametrize("fault", [None, "late_cqe"])
def test_an_abort_backwards_is_sent_when_the_one_forwards_finds_no_credit(fake, fault):
  """Rank 1 is closed while rank 0 waits for rank 2 (never started) and watches rank 1. Rank 1's
  ABORT to rank 2 finds no credit (rank 2 has not read rank 1's first segment) and waits out its
  2 % of the timeout; its ABORT to rank 0 must still go out, and rank 0 report rank 1's reason as
  over TCP. It shared that deadline: posted after it, its write was flushed by the shutdown, and
  rank 0 reported 'lost rank 1' a second later and counted a peer failure. late_cqe: that ABORT's
  receive completion reaches rank 0's CQ 0.3 s after rank 1 closed; rank 0's watch took the
  close for the end at once, without the last words a receive waits for."""
  xs = _inputs(3, 3000, np.float32, seed=3)
  comms = _ring(3, timeout_s=5)   # 0.1 s for each ABORT
  try:
    _, errs, _ = _all_reduce(comms, xs)
    assert errs == [None] * 3, errs
    writes, failures = fake.counters()["writes_received"], native.counters()["peer_failures"]
    errs = {}
    threads = _rank_threads(comms, xs, (0, 1), errs)
    _until("both ranks' first segment placed",
           lambda: fake.counters()["writes_received"] >= writes + 2)
    fired = fake.counters()["faults_fired"]
    if fault:
      fake.arm(fault, 0)   # the next write placed: rank 1's ABORT to rank 0
    comms[1].close()
    for t in threads:
      t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank did not finish"
    assert fake.counters()["faults_fired"] == fired + bool(fault), f"{fault} did not fire"
    assert "closed locally" in str(errs[1]), errs
    assert str(errs[0]).startswith("dtenjax transport: rank 1 aborted"), errs[0]
    assert "closed locally" in str(errs[0]), errs[0]
    assert native.counters()["peer_failures"] == failures, errs
  finally:
    close_all(comms)


def test_a_refused_last_write_is_reported_as_that_write_s_failure(fake):
  """The device refuses the last RDMA write of an all-reduce (revoke_mr, fired by the write before
  it: the receive slabs lose their keys). Its sender, whose receives are all in, waits with that
  frame in flight; the failed completion may be taken by the ring's look backwards at the next
  rank (the same completion queue), which lets an error pass while the last frame is in flight
  (the next rank may have closed after taking it). The connection keeps that failure for the send
  side: some rank reports the write's own IBV_WC_REM_ACCESS_ERR, not only the flushed receives
  its QP's error state leaves behind. Three rings: where the completion lands depends on when the
  sender's thread looks."""
  xs = _inputs(2, 3000, np.float32, seed=7)
  for _ in range(3):
    comms = _ring(2, timeout_s=20)
    try:
      _, errs, _ = _all_reduce(comms, xs)   # the first collective also checks the ring's set-up
      assert errs == [None, None], errs
      before = fake.counters()["writes_received"]
      _, errs, _ = _all_reduce(comms, xs)
      assert errs == [None, None], errs
      frames = fake.counters()["writes_received"] - before   # the RDMA writes of one all_reduce
      fake.arm("revoke_mr", frames - 2)    # fires once the last write but one is placed
      outs, errs, seconds = _all_reduce(comms, xs)
      assert all(isinstance(e, errors.TransportError) for e in errs), (outs, errs)
      text = " | ".join(str(e) for e in errs)
      assert "the RDMA write of a frame to rank" in text and "IBV_WC_REM_ACCESS_ERR" in text, text
      assert seconds < 5, seconds
    finally:
      close_all(comms)


def _capture(fn):
  try:
    fn()
  except Exception as e:
    return e
  return None


def test_broken_communicator_stays_broken_and_says_why(fake):
  comms = _ring(2, timeout_s=4)
  try:
    fake.arm("qp_error", 1)
    _, errs, _ = _all_reduce(comms, _inputs(2, 1 << 18, np.float32))
    assert all(errs)
    _, errs, _ = _all_reduce(comms, _inputs(2, 10, np.float32))
    assert all("unusable after an earlier failure" in str(e) for e in errs), errs
  finally:
    close_all(comms)


# --- buffer pool: registrations are MRs of the device, cached --------------------------------------

def test_buffer_pool_registers_memory_regions_once_and_reuses_them(fake):
  before = fake.counters()
  with bp.BufferPool(bp.PoolConfig(max_bytes=8 << 20, tenant="verbs-pool", pin=False,
                                   registration="verbs")) as pool:
    a = pool.acquire(5000)
    b = pool.acquire(100_000)
    assert fake.live()["mrs"] == 2 == pool.stats()["registered_buffers"]
    for _ in range(20):   # reuse: no new ibv_reg_mr
      pool.release(a)
      a = pool.acquire(8000)
    c = fake.counters()
    assert c["reg_mr_calls"] - before["reg_mr_calls"] == 2 == pool.stats()["registrations"]
    assert pool.stats()["reuse_hits"] == 20
    pool.post(b)
    with pytest.raises(errors.ConfigurationError, match="while it is posted"):
      pool.release(b)   # never deregistered under I/O
    pool.complete(b)
    pool.release(b)
    pool.release(a)
    pool.trim()
    assert fake.live()["mrs"] == 0
    assert fake.counters()["dereg_mr_calls"] - before["dereg_mr_calls"] == 2
  assert native.transport().verbs.device_users() == 0
  assert _violations(fake) == 0, fake.last_violation()


def test_buffer_pool_survives_the_device_running_out_of_regions(fake, monkeypatch):
  monkeypatch.setenv("FAKEVERBS_MAX_MR", "2")   # the device's max_mr (read when it opens)
  with bp.BufferPool(bp.PoolConfig(max_bytes=64 << 20, tenant="verbs-mr-limit", pin=False,
                                   registration="verbs")) as pool:
    held = [pool.acquire(4096), pool.acquire(8192)]
    with pytest.raises(errors.QuotaExceededError, match="ibv_reg_mr of 16384 bytes failed"):
      pool.acquire(16384)
    assert pool.stats()["reg_failures"] == 1 and fake.live()["mrs"] == 2   # nothing idle to free
    # With a cached idle region, the device's refusal frees it and the registration is retried.
    pool.release(held.pop())
    b = pool.acquire(16384)
    s = pool.stats()
    assert (s["reg_failures"], s["deregistrations"], s["registrations"]) == (2, 1, 3)
    assert fake.live()["mrs"] == 2
    pool.release(b)
    pool.release(held.pop())
  assert fake.live()["mrs"] == 0


def test_registered_bytes_quota_applies_to_verbs_regions(fake):
  tenancy.set_quota("verbs-quota", tenancy.Quota(max_registered_bytes=100_000))
  with bp.BufferPool(bp.PoolConfig(tenant="verbs-quota", pin=False, registration="verbs")) as pool:
    a = pool.acquire(65536)
    with pytest.raises(errors.QuotaExceededError, match="verbs-quota.*registered-memory quota"):
      pool.acquire(65536)
    assert fake.live()["mrs"] == 1   # the refused one was never registered
    pool.release(a)
  assert fake.live()["mrs"] == 0


# --- tenant quotas over verbs ----------------------------------------------------------------------

def test_connection_quota_refuses_a_verbs_ring_and_releases_the_device(fake):
  tenancy.set_quota("verbs-conn", tenancy.Quota(max_connections=3))
  comms, errs = native_ring(2, CREDS, provider="verbs", tenant="verbs-conn", timeout_s=2)
  assert any(isinstance(e, errors.QuotaExceededError) for e in errs.values()), errs
  close_all(comms)


def test_token_bucket_shapes_verbs_traffic(fake):
  rate, burst = 16e6, 64 * 1024
  tenancy.set_quota("verbs-rate", tenancy.Quota(rate_bytes_per_s=rate, burst_bytes=burst))
  comms, errs = native_ring(2, CREDS, provider="verbs", tenant="verbs-rate", timeout_s=20)
  assert not errs
  try:
    xs = [np.full(1 << 20, r + 1, np.float32) for r in range(2)]
    before = native.counters()
    t0 = time.monotonic()
    outs, errs, _ = _all_reduce(comms, xs)
    elapsed = time.monotonic() - t0
    assert errs == [None, None]
    np.testing.assert_array_equal(outs[0], np.full(1 << 20, 3, np.float32))
    sent = native.counters()["bytes_sent"] - before["bytes_sent"]
    assert elapsed >= 0.8 * (sent - burst) / rate, (elapsed, sent)
  finally:
    close_all(comms)


# --- selection and reporting -----------------------------------------------------------------------

def test_the_emulated_device_is_reported_as_emulated_and_never_chosen_by_auto(fake, monkeypatch):
  info = rdma.library_info()
  assert info["emulated"] and info["path"] == fake.path
  (nic,) = rdma.emulated_nics()
  assert (nic["name"], nic["state"], nic["link_layer"], nic["rate_gbit_s"]) == (
      "fakeverbs0", "active", "InfiniBand", 200.0)
  assert list(rdma.discover_nics()) == [] and "EMULATED" in rdma.unavailable_reason()
  monkeypatch.setenv("DTENJAX_TRANSPORT", "auto")
  name, why = providers.select_provider()
  assert name == "tcp" and "EMULATED" in why and "DTENJAX_TRANSPORT=verbs" in why, why
  monkeypatch.setenv("DTENJAX_TRANSPORT", "verbs")
  name, why = providers.select_provider()
  assert name == "verbs" and "EMULATED" in why and "fakeverbs0" in why, why
  from dtenjax._src.topology import detect
  from dtenjax._src.topology import report
  from dtenjax._src.topology.model import Topology
  desc = detect.describe()
  assert desc["nics"] == ()   # never a NIC of the topology
  text = report.link_matrix_table(Topology(**desc))
  assert "EMULATED RDMA device fakeverbs0" in text and "host transport: verbs" in text, text
  assert "NICs: none" in text


def test_an_emulated_port_that_is_down_is_refused(fake, monkeypatch):
  monkeypatch.setenv("FAKEVERBS_PORT_STATE", "down")
  rdma.reset_cache()
  assert rdma.emulated_nics()[0]["state"] == "down"
  with pytest.raises(errors.DtenjaxError, match="no RDMA device with an active port"):
    transport.create_local_comm(0, 2, CREDS, provider="verbs", timeout_s=2)


def test_the_library_cannot_change_under_open_connections(fake, monkeypatch):
  comms = _ring(2)
  try:
    monkeypatch.setenv("DTENJAX_IBVERBS_LIBRARY", "libibverbs.so.1")
    with pytest.raises(errors.ConfigurationError, match="is in use .*cannot switch"):
      rdma.load_library()
  finally:
    close_all(comms)
  rdma.load_library()   # nothing open any more: switching is fine
  assert not rdma.library_info()["emulated"]


def test_a_missing_library_is_named(monkeypatch, tmp_path):
  missing = str(tmp_path / "libibverbs-missing.so.1")
  monkeypatch.setenv("DTENJAX_IBVERBS_LIBRARY", missing)
  with pytest.raises(errors.ExtensionUnavailableError, match="libibverbs-missing.so.1.*DTENJAX_IBVERBS_LIBRARY"):
    rdma.load_library()
  info = rdma.library_info()
  assert not info["loaded"] and "libibverbs-missing" in info["error"]


# --- one process per rank --------------------------------------------------------------------------

def _mp_env(tag, **extra):
  return {**fakeverbs.env(fakeverbs.fabric_name(tag)), "DTENJAX_COLLECTIVE_TIMEOUT": "20", **extra}


def _check_leaks(res):
  for r in res:
    cycles = r["leaks"]["cycles"]
    assert all(all(v == 0 for v in c["live_closed"].values()) for c in cycles), cycles
    assert cycles[0]["live_open"]["qps"] >= 2 and cycles[-1]["live_open"] == cycles[0]["live_open"]
    # after a warm-up cycle no growth (a leak grows; one fewer descriptor at the end, e.g. a
    # file the runtime opened during warm-up and closed since, is not one)
    assert cycles[-1]["fds"] <= cycles[1]["fds"], cycles
    assert r["leaks"]["fake"]["violations"] == 0, r["leaks"]["last_violation"]


def _check_same_bits(res, exact):
  for name in res[0]["same_bits"]:
    shas = [r["same_bits"][name] for r in res]
    tcp = {s for c in shas for s in c["tcp"]["sha"]}
    verbs = {s for c in shas for s in c["verbs"]["sha"]}
    assert len(tcp) == 1 and tcp == verbs, name   # one result everywhere, the same on both
    for c in shas:
      assert c["tcp"]["providers"] == ["tcp"] and c["verbs"]["providers"] == ["verbs"], c
      assert c["verbs"]["collectives"] >= 1
      assert c["max_rel_err"] < (1e-2 if name.startswith("bfloat16") else 1e-5), (name, c)
      if exact:
        assert c["bit_equal_ring_reference"], name


@pytest.mark.multiprocess
def test_ring_four_processes_over_verbs(tmp_path):
  """The ring's "correct" phase over verbs gives the TCP reference ring's bits for float32,
  float64 and int32 (bit_exact), as test_hostcoll's four TCP processes do: verbs and TCP agree
  there already, so TCP against verbs in one process runs only for what "correct" has not:
  bfloat16 and a 4 MiB array (many segments). The hierarchical test runs every case."""
  from tests.test_hostcoll import _check_correct
  codes, res, logs = launch.launch(
      "tests.mp_workers.allreduce_worker", 4, str(tmp_path), timeout_s=240,
      env=_mp_env("ring4", DTENJAX_TEST_PHASES="correct,same_bits,leaks",
                  DTENJAX_TEST_SAME_BITS="bfloat16-7,bfloat16-70001,float32-1048576"))
  assert codes == [0] * 4, logs
  _check_correct(res, 4, bit_exact=True)
  assert sorted(res[0]["same_bits"]) == ["bfloat16-7", "bfloat16-70001", "float32-1048576"]
  _check_same_bits(res, exact=True)
  _check_leaks(res)


@pytest.mark.multiprocess
def test_hierarchical_two_processes_two_devices_over_verbs(tmp_path):
  from tests.test_hostcoll import _check_correct
  codes, res, logs = launch.launch(
      "tests.mp_workers.allreduce_worker", 2, str(tmp_path), devices_per_proc=2, timeout_s=240,
      env=_mp_env("hier", DTENJAX_TEST_PHASES="correct,same_bits,leaks"))
  assert codes == [0] * 2, logs
  _check_correct(res, 2, bit_exact=False)
  _check_same_bits(res, exact=False)
  _check_leaks(res)


@pytest.mark.multiprocess
def test_faults_and_a_killed_peer_fail_every_process_in_time(tmp_path):
  timeout = 5
  faults = ",".join(sorted(FAULT_SIGNS))
  codes, res, logs = launch.launch(
      "tests.mp_workers.verbs_faults_worker", 3, str(tmp_path), timeout_s=240,
      env=_mp_env("faults", DTENJAX_TEST_FAULTS=faults, DTENJAX_TEST_FAULTY="1",
                  DTENJAX_TEST_AFTER="3", DTENJAX_TEST_KILL="1",
                  DTENJAX_COLLECTIVE_TIMEOUT=str(timeout)))
  assert codes[:2] == [0, 0] and codes[2] == 17, logs   # rank 2 was killed by the device
  for r in res:
    assert r is not None and "exception" not in r, r
  for kind, signs in FAULT_SIGNS.items():
    outcomes = [r["faults"][kind] for r in res]
    assert all(o["warmup_ok"] for o in outcomes), (kind, outcomes)
    assert outcomes[1]["fired"] == 1, (kind, outcomes[1])
    for o in outcomes:   # every process: an error, never a result, within the timeout
      assert o["error"] and "bits_right" not in o, (kind, o)
      assert o["seconds"] < timeout + 2, (kind, o)
      assert all(v == 0 for v in o["live"].values()), (kind, o)   # closed: nothing left
    text = " | ".join(o["error"] for o in outcomes)
    assert any(sign in text for sign in signs), (kind, text)
  # Descriptors stay flat from fault to fault.
  for r in res:
    assert len({o["fds"] for o in r["faults"].values()}) == 1, r["faults"]
  for r in res[:2]:   # the survivors of the killed peer
    assert r["kill"]["error"] and "dtenjax transport" in r["kill"]["error"], r["kill"]
    assert r["kill"]["seconds"] < timeout + 2, r["kill"]
