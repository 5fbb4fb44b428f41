"""Tenant quotas, token-bucket shaping, device-memory ownership checks, and validation of every
limit against what its native field holds."""

import math
import threading
import time

import numpy as np
import pytest

from dtenjax._src.net import bufferpool as bp
from dtenjax._src import errors
from dtenjax._src.net import tenancy
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax.testing import native as native_testing
from tests.net_helpers import native_ring, requires_native

pytestmark = requires_native


def _ring(n, tenant, timeout_s=10):
  return native_ring(n, credentials.JobCredentials(77, b"t" * 32), tenant=tenant,
                     timeout_s=timeout_s)


def test_connection_quota():
  tenancy.set_quota("t-conn", tenancy.Quota(max_connections=3))
  comms, errs = _ring(2, "t-conn", timeout_s=2)   # 2 ranks x 2 connections > 3
  assert any(isinstance(e, errors.QuotaExceededError) for e in errs.values()), errs
  msg = str(next(e for e in errs.values() if isinstance(e, errors.QuotaExceededError)))
  assert "t-conn" in msg and "connection quota (3" in msg
  for c in comms:
    c.close()
  assert tenancy.usage("t-conn")["quota_refusals"] >= 1


def test_registered_bytes_quota():
  tenancy.set_quota("t-mem", tenancy.Quota(max_registered_bytes=100_000))
  with bp.BufferPool(bp.PoolConfig(tenant="t-mem", pin=False)) as pool:
    b = pool.acquire(65536)
    assert tenancy.usage("t-mem")["registered_bytes"] == 65536
    with pytest.raises(errors.QuotaExceededError, match="t-mem.*registered-memory quota"):
      pool.acquire(65536)
    pool.release(b)
    pool.trim()
  assert tenancy.usage("t-mem")["registered_bytes"] == 0


def test_token_bucket_shapes_ring_traffic():
  rate, burst = 16e6, 64 * 1024
  tenancy.set_quota("t-rate", tenancy.Quota(rate_bytes_per_s=rate, burst_bytes=burst))
  comms, errs = _ring(2, "t-rate")
  assert not errs
  xs = [np.full(1 << 20, r + 1, np.float32) for r in range(2)]   # 4 MiB each
  before = native.counters()
  outs = [None, None]
  def run(r):
    outs[r] = comms[r].all_reduce(xs[r], stream="rank-thread")   # not the creating thread
  t0 = time.monotonic()
  ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
  [t.start() for t in ts]
  [t.join(60) for t in ts]
  elapsed = time.monotonic() - t0
  sent = native.counters()["bytes_sent"] - before["bytes_sent"]
  np.testing.assert_array_equal(outs[0], np.full(1 << 20, 3, np.float32))
  # Both ranks live in this process and share the tenant's bucket.
  floor = (sent - burst) / rate
  assert elapsed >= 0.8 * floor, (elapsed, floor)
  assert native.counters()["throttled_ns"] > before["throttled_ns"]
  for c in comms:
    c.close()


def test_token_bucket_direct():
  tenancy.set_quota("t-bucket", tenancy.Quota(rate_bytes_per_s=2e6, burst_bytes=1e5))
  t0 = time.monotonic()
  for _ in range(10):
    tenancy.throttle("t-bucket", 100_000)
  elapsed = time.monotonic() - t0
  assert elapsed >= 0.8 * (1e6 - 1e5) / 2e6
  with pytest.raises(errors.CollectiveTimeoutError, match="token bucket of tenant 't-bucket'"):
    tenancy.throttle("t-bucket", 10_000_000, timeout_s=0.5)   # would need ~5 s


@pytest.fixture
def fake_owners():
  """Replaces the ownership check by a table (testing hook), restored afterwards."""
  hooks = native_testing.transport()
  yield hooks.set_pointer_owners
  hooks.reset_pointer_owners()


def test_foreign_device_pointer_is_refused(fake_owners):
  base_a, base_b = 0x7F00_0000_0000, 0x7F10_0000_0000
  fake_owners([(base_a, 1 << 20, 0), (base_b, 1 << 20, 1)])
  tenancy.set_owner_context("tenant-a", 0)
  tenancy.set_owner_context("tenant-b", 1)
  tenancy.check_device_memory("tenant-a", base_a + 4096, 4096)
  tenancy.check_device_memory("tenant-b", base_b, 1 << 20)
  with pytest.raises(tenancy.OwnershipError, match="tenant-a.*belongs to context 1"):
    tenancy.check_device_memory("tenant-a", base_b + 16, 64)
  with pytest.raises(tenancy.OwnershipError, match="runs past the end"):
    tenancy.check_device_memory("tenant-a", base_a + (1 << 20) - 8, 64)
  with pytest.raises(tenancy.OwnershipError, match="not device memory"):
    tenancy.check_device_memory("tenant-a", 0x1000, 64)
  with pytest.raises(tenancy.OwnershipError, match="no CUDA context set"):
    tenancy.check_device_memory("tenant-without-context", base_a, 64)
  assert tenancy.usage("tenant-a")["ownership_refusals"] == 3


def test_quota_validation_lists_every_problem():
  with pytest.raises(errors.ConfigurationError) as e:
    tenancy.Quota(max_connections=-5, rate_bytes_per_s=-1)
  assert "max_connections=-5" in str(e.value) and "rate_bytes_per_s=-1" in str(e.value)


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_connections=2**64), r"max_connections=18446744073709551616 is out of range: it "
                                  r"must be in -1..2\*\*63-1"),
    (dict(max_registered_bytes=2**64 + 5), r"max_registered_bytes=18446744073709551621 is out of "
                                           r"range"),
    (dict(max_connections=2**63), r"max_connections=9223372036854775808 is out of range"),
    (dict(rate_bytes_per_s=math.nan), r"rate_bytes_per_s=nan is not allowed: it must be a finite "
                                      r"number >= 0; 0 means unlimited"),
    (dict(rate_bytes_per_s=math.inf), r"rate_bytes_per_s=inf is not allowed"),
    (dict(rate_bytes_per_s=-1e6), r"rate_bytes_per_s=-1000000.0 is not allowed"),
    (dict(burst_bytes=math.nan), r"burst_bytes=nan is not allowed"),
    (dict(max_connections=True), r"max_connections=True must be an integer"),
    (dict(max_connections=2.0), r"max_connections=2.0 must be an integer"),
])
def test_limits_that_do_not_fit_are_rejected_not_wrapped(kwargs, fragment):
  with pytest.raises(errors.ConfigurationError, match=fragment):
    tenancy.Quota(**kwargs)


def test_native_layer_refuses_bad_quotas_too():
  """Defence in depth: the native setter validates what the dataclass would have."""
  with pytest.raises(errors.ConfigurationError, match="rate_bytes_per_s=nan"):
    native.transport().set_quota("t-native", -1, -1, math.nan, 0.0)
  with pytest.raises(errors.ConfigurationError, match="max_connections=-7"):
    native.transport().set_quota("t-native", -7, -1, 0.0, 0.0)
  tenancy.set_quota("t-native", tenancy.Quota(max_connections=2**63 - 1))   # the largest fits


def test_other_tenancy_arguments_are_validated():
  with pytest.raises(errors.ConfigurationError, match=r"nbytes=18446744073709551616"):
    tenancy.throttle("t-args", 2**64)
  with pytest.raises(errors.ConfigurationError, match=r"timeout_s=nan"):
    tenancy.throttle("t-args", 1, timeout_s=math.nan)
  with pytest.raises(errors.ConfigurationError, match=r"ptr=-1 is out of range"):
    tenancy.check_device_memory("t-args", -1, 8)
  with pytest.raises(errors.ConfigurationError, match=r"ptr \+ nbytes must not pass 2\*\*64"):
    tenancy.check_device_memory("t-args", 2**64 - 8, 64)
  with pytest.raises(errors.ConfigurationError, match=r"tenant='' must be a non-empty string"):
    tenancy.usage("")
  with pytest.raises(errors.ConfigurationError, match=r"context=18446744073709551615"):
    tenancy.set_owner_context("t-args", 2**64 - 1)
