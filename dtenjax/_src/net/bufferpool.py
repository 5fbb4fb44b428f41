"""Registered buffer pool (C++ csrc/transport/bufferpool.*), with counters visible from Python.

Registering memory (pinning pages for TCP and GPU staging, creating MRs for RDMA) is expensive, so
buffers are registered once and reused. Each buffer is reference counted and moves through
``Idle -> Posted -> Completed -> Idle``; the pool refuses to hand out, release or deregister a
buffer while it is posted (a socket or NIC may still be reading it). Limits: total registered bytes,
number of buffers, bytes per buffer, and the owning tenant's registered-bytes quota
(:mod:`dtenjax._src.net.tenancy`). Communicators use one internally for their staging buffers.
"""

from __future__ import annotations

import ctypes
import dataclasses

from dtenjax._src import errors
from dtenjax._src.net import transport

IDLE, POSTED, COMPLETED = 0, 1, 2
_ACQUIRE, _RETAIN, _POST, _COMPLETE, _RELEASE, _TRIM, _DATA, _SIZE, _STATE, _INJECT = range(10)


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Limits of one pool."""
  max_bytes: int = 1 << 30
  max_buffers: int = 1024
  max_buffer_bytes: int = 1 << 30
  pin: bool = True
  tenant: str = "default"

  def __post_init__(self):
    bad = [f"{k}={getattr(self, k)}" for k in ("max_bytes", "max_buffers", "max_buffer_bytes")
           if int(getattr(self, k)) <= 0]
    if bad:
      raise errors.ConfigurationError(errors.join_problems(
          "PoolConfig limits must be positive:", bad))
    if not self.tenant:
      raise errors.ConfigurationError("PoolConfig.tenant must be a non-empty name.")


class BufferPool:
  """A native registered buffer pool. Buffer ids are small ints."""

  def __init__(self, cfg: PoolConfig = PoolConfig()):
    self.config = cfg
    self._lib = transport.lib()
    self._id = self._lib.dtenjax_tp_pool_create(cfg.max_bytes, cfg.max_buffers,
                                                 cfg.max_buffer_bytes, int(cfg.pin),
                                                 cfg.tenant.encode())

  def _op(self, what: int, arg: int, name: str) -> int:
    out = ctypes.c_int64(0)
    transport._Err().call(self._lib.dtenjax_tp_pool_op, self._id, what, int(arg),  # pylint: disable=protected-access
                          ctypes.byref(out), what=f"buffer pool {name}")
    return int(out.value)

  def acquire(self, nbytes: int) -> int:
    """A buffer of at least ``nbytes`` (reference count 1, Idle); QuotaExceededError when full."""
    return self._op(_ACQUIRE, nbytes, f"acquire({nbytes})")

  def retain(self, buf: int) -> None:
    self._op(_RETAIN, buf, f"retain({buf})")

  def post(self, buf: int) -> None:
    """Idle -> Posted: handed to a socket/NIC."""
    self._op(_POST, buf, f"post({buf})")

  def complete(self, buf: int) -> None:
    """Posted -> Completed: the transfer finished (or failed) and the buffer is no longer read."""
    self._op(_COMPLETE, buf, f"complete({buf})")

  def release(self, buf: int) -> None:
    """Drops a reference; refused (ConfigurationError) while the buffer is posted."""
    self._op(_RELEASE, buf, f"release({buf})")

  def trim(self) -> None:
    """Deregisters and frees every idle buffer."""
    self._op(_TRIM, 0, "trim")

  def address(self, buf: int) -> int:
    return self._op(_DATA, buf, "address")

  def size(self, buf: int) -> int:
    return self._op(_SIZE, buf, "size")

  def state(self, buf: int) -> int:
    """IDLE, POSTED, COMPLETED, or -1 for no such buffer."""
    return self._op(_STATE, buf, "state")

  def inject_registration_failures(self, every_n: int) -> None:
    """Test hook: every n-th registration fails (0 turns it off)."""
    self._op(_INJECT, every_n, "inject")

  def stats(self) -> dict[str, int]:
    """Counters: registered_bytes/buffers, in_use, posted, acquires, releases, registrations,
    deregistrations, reg_failures, reuse_hits, rejected_transitions, pin_failures, high_water_bytes,
    allocated_bytes."""
    n = self._lib.dtenjax_tp_pool_num_stats()
    out = (ctypes.c_uint64 * n)()
    self._lib.dtenjax_tp_pool_stats(self._id, out)
    return {self._lib.dtenjax_tp_pool_stat_name(i).decode(): int(out[i]) for i in range(n)}

  def close(self) -> None:
    if self._id:
      self._lib.dtenjax_tp_pool_destroy(self._id)
      self._id = 0

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
