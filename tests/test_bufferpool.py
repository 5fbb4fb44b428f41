"""Registered buffer pool: state machine, limits, and 10^4 cycles with injected failures."""

import numpy as np
import pytest

from dtenjax._src.net import bufferpool as bp
from dtenjax._src import errors
from dtenjax._src.net import tenancy
from dtenjax._src.net import transport

pytestmark = pytest.mark.skipif(not transport.is_available(), reason="native extension not built")


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
    with pytest.raises(errors.QuotaExceededError, match="buffer pool full"):
      pool.acquire(4096)
    for b in held:
      pool.release(b)
    b = pool.acquire(32 << 10)               # evicts idle buffers of another size to fit
    assert pool.stats()["registered_bytes"] <= 64 << 10
    pool.release(b)
  with pytest.raises(errors.ConfigurationError, match="max_buffers=0"):
    bp.PoolConfig(max_buffers=0)


def test_ten_thousand_cycles_with_injected_failures_leak_nothing():
  tenant = "pool-stress"
  tenancy.set_quota(tenant, tenancy.Quota(max_registered_bytes=48 << 20))
  rng = np.random.RandomState(0)
  with bp.BufferPool(bp.PoolConfig(max_bytes=16 << 20, max_buffers=64, tenant=tenant,
                                   pin=False)) as pool:
    pool.inject_registration_failures(7)
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
