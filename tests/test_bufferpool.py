"""Registered buffer pool: state machine, limits, validation, concurrency (close during use, huge
requests failing fast), eviction under a tenant quota, and 10^4 cycles with injected failures."""

import threading
import time

import numpy as np
import pytest

from dtenjax._src.net import bufferpool as bp
from dtenjax._src import errors
from dtenjax._src.net import tenancy
from dtenjax.testing import native as native_testing
from tests.net_helpers import requires_native

pytestmark = requires_native


def test_state_machine_and_reuse():
  with bp.BufferPool(bp.PoolConfig(max_bytes=1 << 20, tenant="pool-sm")) as pool:
    b = pool.acquire(5000)
    assert pool.size(b) == 8192 and pool.state(b) == bp.IDLE
    addr = pool.address(b)
    with pytest.raises(errors.ConfigurationError, match="cannot complete"):
      pool.complete(b)                       # not posted
    pool.post(b)
    with pytest.raises(errors.ConfigurationError, match="while it is posted"):
      pool.release(b)                        # never reused or freed while posted
    pool.trim()                              # does not touch a posted buffer
    assert pool.state(b) == bp.POSTED
    pool.complete(b)
    pool.release(b)
    assert pool.state(b) == bp.IDLE
    b2 = pool.acquire(8000)                  # same size class: reused, not re-registered
    assert b2 == b and pool.address(b2) == addr
    s = pool.stats()
    assert s["registrations"] == 1 and s["reuse_hits"] == 1 and s["rejected_transitions"] == 2
    pool.retain(b2)
    pool.release(b2)
    assert pool.stats()["in_use"] == 1
    pool.release(b2)
    pool.trim()
    s = pool.stats()
    assert s["registered_bytes"] == 0 and s["deregistrations"] == 1 and s["allocated_bytes"] == 0


def test_limits():
  with bp.BufferPool(bp.PoolConfig(max_bytes=64 << 10, max_buffers=3,
                                   max_buffer_bytes=32 << 10, tenant="pool-lim")) as pool:
    with pytest.raises(errors.ConfigurationError, match="cannot acquire"):
      pool.acquire(64 << 10)
    held = [pool.acquire(16 << 10) for _ in range(3)]
    with pytest.raises(errors.QuotaExceededError, match="buffer pool of tenant 'pool-lim' full"):
      pool.acquire(4096)
    for b in held:
      pool.release(b)
    b = pool.acquire(32 << 10)               # evicts idle buffers of another size to fit
    assert pool.stats()["registered_bytes"] <= 64 << 10
    pool.release(b)
  with pytest.raises(errors.ConfigurationError, match="max_buffers=0"):
    bp.PoolConfig(max_buffers=0)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_buffers=2**32), r"max_buffers=4294967296 is out of range: it must be in 1..2\*\*31-1"),
    (dict(max_bytes=2**64), r"max_bytes=18446744073709551616 is out of range"),
    (dict(max_buffer_bytes=-1), r"max_buffer_bytes=-1 is out of range"),
    (dict(max_bytes=1.5), r"max_bytes=1.5 must be an integer"),
    (dict(pin="yes"), r"pin='yes' must be True or False"),
    (dict(tenant=""), r"tenant='' must be a non-empty string"),
])
def test_pool_config_rejects_what_does_not_fit(kwargs, fragment):
  with pytest.raises(errors.ConfigurationError, match=fragment):
    bp.PoolConfig(**kwargs)


def test_buffer_ids_that_do_not_fit_are_refused_not_wrapped():
  with bp.BufferPool(bp.PoolConfig(max_bytes=1 << 20, tenant="pool-ids", pin=False)) as pool:
    b = pool.acquire(4096)
    for bad in (b + 2**32, -1, 2**31):
      with pytest.raises(errors.ConfigurationError, match=f"buffer id={bad} is out of range"):
        pool.release(bad)
    assert pool.stats()["in_use"] == 1 and pool.state(b) == bp.IDLE   # b untouched
    with pytest.raises(errors.ConfigurationError, match="no live buffer with id 5"):
      pool.post(5)
    pool.release(b)
    with pytest.raises(errors.ConfigurationError, match=r"nbytes=-3 is out of range"):
      pool.acquire(-3)


def test_huge_request_with_huge_limits_fails_fast():
  big = 2**64 - 1
  with bp.BufferPool(bp.PoolConfig(max_bytes=big, max_buffer_bytes=big, tenant="pool-huge",
                                   pin=False)) as pool:
    for n in (2**63 + 1, 2**62 + 1):
      t0 = time.monotonic()
      with pytest.raises(errors.ConfigurationError, match=f"cannot acquire {n} bytes"):
        pool.acquire(n)
      assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    with pytest.raises(errors.QuotaExceededError, match="tenant 'pool-huge': allocating 4611686018427387904 bytes"):
      pool.acquire(2**62)   # fits the size classes, but no machine has 4 EiB
    assert time.monotonic() - t0 < 1.0


def test_close_during_use_from_another_thread_returns_promptly():
  pool = bp.BufferPool(bp.PoolConfig(max_bytes=64 << 20, tenant="pool-close", pin=False))
  stop = threading.Event()
  seen: list = []

  def churn():
    while not stop.is_set():
      try:
        b = pool.acquire(1 << 20)
        pool.post(b)
        pool.complete(b)
        pool.release(b)
      except errors.ConfigurationError as e:   # after close: refused, never a hang or crash
        seen.append(str(e))
        return

  ts = [threading.Thread(target=churn, daemon=True) for _ in range(3)]
  for t in ts:
    t.start()
  time.sleep(0.2)
  t0 = time.monotonic()
  pool.close()
  closed_in = time.monotonic() - t0
  stop.set()
  for t in ts:
    t.join(5)
  assert not any(t.is_alive() for t in ts)
  assert closed_in < 1.0, closed_in
  assert pool.closed and all("closed pool" in m for m in seen), seen
  with pytest.raises(errors.ConfigurationError, match="acquire\\(4096\\) on a closed pool"):
    pool.acquire(4096)
  s = pool.stats()
  assert s["registered_bytes"] == 0 and s["in_use"] == 0
  pool.close()   # idempotent
  assert tenancy.usage("pool-close")["registered_bytes"] == 0


def test_buffer_released_after_close_is_freed():
  pool = bp.BufferPool(bp.PoolConfig(tenant="pool-late", pin=False))
  b = pool.acquire(10_000)
  pool.post(b)
  pool.close()                      # b is posted: kept
  assert pool.state(b) == bp.POSTED and tenancy.usage("pool-late")["registered_bytes"] == 16384
  pool.complete(b)
  pool.release(b)                   # now freed, not cached
  assert pool.stats()["registered_bytes"] == 0
  assert tenancy.usage("pool-late")["registered_bytes"] == 0


def test_idle_buffers_are_evicted_when_the_tenant_quota_blocks():
  """The pool's own limits are huge; only the tenant's registered-bytes quota blocks a growing
  buffer. Idle cached buffers must make room instead of the request failing for good."""
  tenant = "pool-tenant-evict"
  tenancy.set_quota(tenant, tenancy.Quota(max_registered_bytes=200_000))
  with bp.BufferPool(bp.PoolConfig(max_bytes=1 << 40, tenant=tenant, pin=False)) as pool:
    small = [pool.acquire(40_000) for _ in range(2)]   # 2 x 64 KiB class
    for b in small:
      pool.release(b)                                   # idle, cached, still charged
    assert tenancy.usage(tenant)["registered_bytes"] == 131072
    grown = pool.acquire(100_000)                       # 128 KiB: only fits after eviction
    assert pool.size(grown) == 131072
    s = pool.stats()
    assert s["deregistrations"] >= 1 and s["registered_bytes"] <= 200_000
    refusals = tenancy.usage(tenant)["quota_refusals"]
    with pytest.raises(errors.QuotaExceededError, match="pool-tenant-evict.*registered-memory"):
      pool.acquire(150_000)                             # 256 KiB never fits: a clear refusal
    assert tenancy.usage(tenant)["quota_refusals"] == refusals + 1
    pool.release(grown)


def test_a_refusal_that_is_not_for_room_keeps_the_cache():
  # Only a refusal for want of room (ibv_reg_mr's ENOMEM: tests/test_verbs.py) frees idle
  # buffers and retries; another (the injected one is an internal error) fails at once.
  with bp.BufferPool(bp.PoolConfig(max_bytes=1 << 20, tenant="pool-refusal", pin=False)) as pool:
    pool.release(pool.acquire(4096))                  # one idle cached buffer
    native_testing.transport().fail_registrations(pool.native, 1)
    with pytest.raises(errors.DtenjaxError, match="injected registration failure"):
      pool.acquire(8192)
    s = pool.stats()
    assert (s["reg_failures"], s["deregistrations"], s["registered_buffers"]) == (1, 0, 1)
    native_testing.transport().fail_registrations(pool.native, 0)
    b = pool.acquire(4096)
    assert pool.stats()["reuse_hits"] == 1            # the cached buffer is still there
    pool.release(b)


def test_ten_thousand_cycles_with_injected_failures_leak_nothing():
  tenant = "pool-stress"
  tenancy.set_quota(tenant, tenancy.Quota(max_registered_bytes=48 << 20))
  rng = np.random.RandomState(0)
  with bp.BufferPool(bp.PoolConfig(max_bytes=16 << 20, max_buffers=64, tenant=tenant,
                                   pin=False)) as pool:
    native_testing.transport().fail_registrations(pool.native, 7)
    held: list[int] = []
    failures = {"registration": 0, "transfer": 0, "bad_release": 0}
    for i in range(10_000):
      if held and (len(held) > 12 or rng.rand() < 0.5):
        b = held.pop(rng.randint(len(held)))
        pool.post(b)
        if rng.rand() < 0.1:                 # a failed transfer: must still complete first
          failures["transfer"] += 1
          with pytest.raises(errors.ConfigurationError):
            pool.release(b)
          failures["bad_release"] += 1
        pool.complete(b)
        pool.release(b)
        continue
      try:
        held.append(pool.acquire(int(rng.choice([100, 5000, 70000, 1 << 20]))))
      except errors.DtenjaxError:
        failures["registration"] += 1
    for b in held:
      pool.release(b)
    s = pool.stats()
    assert s["in_use"] == 0 and s["posted"] == 0
    assert s["acquires"] == s["releases"]
    assert failures["registration"] > 0 and failures["transfer"] > 0
    assert s["reg_failures"] == failures["registration"]
    assert s["reuse_hits"] > 1000            # buffers are reused, not re-registered
    pool.trim()
    s = pool.stats()
    assert s["registered_bytes"] == 0 and s["registered_buffers"] == 0
    assert s["allocated_bytes"] == 0 and s["registrations"] == s["deregistrations"]
  assert tenancy.usage(tenant)["registered_bytes"] == 0   # quota charge returned too
