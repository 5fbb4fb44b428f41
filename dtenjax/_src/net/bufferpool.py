"""Registered buffer pool (C++ csrc/transport/bufferpool.*), with counters visible from Python.

Registering memory (pinning pages for TCP and GPU staging, creating MRs for RDMA) is expensive, so
buffers are registered once and reused. Each buffer is reference counted and moves through
``Idle -> Posted -> Completed -> Idle``; the pool refuses to hand out, release or deregister a
buffer while it is posted (a socket or NIC may still be reading it). Limits: total registered bytes,
number of buffers, bytes per buffer, and the owning tenant's registered-bytes quota
(:mod:`dtenjax._src.net.tenancy`); when any of them blocks a new registration, idle cached buffers
are freed first. Communicators use one internally for their staging buffers.

Every operation takes the pool's lock briefly and never blocks on it: a request that cannot be
met fails at once, and :meth:`BufferPool.close` (from any thread) returns promptly even while
other threads use the pool.
"""

from __future__ import annotations

import dataclasses

from dtenjax._src import errors
from dtenjax._src.net import checks
from dtenjax._src.net import native

IDLE, POSTED, COMPLETED = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """Limits of one pool (each must fit its native field; see the messages for the ranges)."""
  max_bytes: int = 1 << 30
  max_buffers: int = 1024
  max_buffer_bytes: int = 1 << 30
  pin: bool = True
  tenant: str = "default"
  # "host": pinned host memory; "verbs": every buffer is an RDMA memory region (ibv_reg_mr) of
  # the verbs provider's device, so the cache saves MR registrations.
  registration: str = "host"

  def __post_init__(self):
    problems = checks.problems_of(
        lambda: checks.integer("max_bytes", self.max_bytes, 1, checks.U64_MAX),
        lambda: checks.integer("max_buffers", self.max_buffers, 1, checks.I32_MAX),
        lambda: checks.integer("max_buffer_bytes", self.max_buffer_bytes, 1, checks.U64_MAX),
        lambda: checks.name("tenant", self.tenant))
    if not isinstance(self.pin, bool):
      problems.append(f"pin={self.pin!r} must be True or False")
    if self.registration not in ("host", "verbs"):
      problems.append(f"registration={self.registration!r} must be 'host' or 'verbs'")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("invalid PoolConfig:", problems))


class BufferPool:
  """A native registered buffer pool. Buffer ids are small non-negative ints."""

  def __init__(self, cfg: PoolConfig = PoolConfig()):
    if not isinstance(cfg, PoolConfig):
      raise errors.ConfigurationError(f"cfg must be a PoolConfig, got {type(cfg).__name__}.")
    self.config = cfg
    if cfg.registration == "verbs":
      from dtenjax._src.net import rdma
      rdma.load_library()
    self._pool = native.transport().BufferPool(cfg.max_bytes, cfg.max_buffers,
                                               cfg.max_buffer_bytes, cfg.pin, cfg.tenant,
                                               cfg.registration)

  @property
  def native(self):
    """The bound native pool (``dtenjax._ffi.transport.BufferPool``)."""
    return self._pool

  @staticmethod
  def _id(buf) -> int:
    return checks.integer("buffer id", buf, 0, checks.I32_MAX,
                          hint="use an id returned by acquire()")

  def acquire(self, nbytes: int) -> int:
    """A buffer of at least ``nbytes`` (reference count 1, Idle); QuotaExceededError when full."""
    return int(self._pool.acquire(checks.integer("nbytes", nbytes, 1, checks.U64_MAX)))

  def retain(self, buf: int) -> None:
    self._pool.retain(self._id(buf))

  def post(self, buf: int) -> None:
    """Idle -> Posted: handed to a socket/NIC."""
    self._pool.post(self._id(buf))

  def complete(self, buf: int) -> None:
    """Posted -> Completed: the transfer finished (or failed) and the buffer is no longer read."""
    self._pool.complete(self._id(buf))

  def release(self, buf: int) -> None:
    """Drops a reference; refused (ConfigurationError) while the buffer is posted."""
    self._pool.release(self._id(buf))

  def trim(self) -> None:
    """Deregisters and frees every idle buffer."""
    self._pool.trim()

  def address(self, buf: int) -> int:
    """The buffer's address (0 if no such buffer); valid while a reference is held."""
    return int(self._pool.address(self._id(buf)))

  def size(self, buf: int) -> int:
    return int(self._pool.size(self._id(buf)))

  def state(self, buf: int) -> int:
    """IDLE, POSTED, COMPLETED, or -1 for no such buffer."""
    return int(self._pool.state(self._id(buf)))

  def stats(self) -> dict[str, int]:
    """Counters: registered_bytes/buffers, in_use, posted, acquires, releases, registrations,
    deregistrations, reg_failures, reuse_hits, rejected_transitions, pin_failures, high_water_bytes,
    allocated_bytes."""
    return {k: int(v) for k, v in self._pool.stats().items()}

  @property
  def closed(self) -> bool:
    return bool(self._pool.closed)

  def close(self) -> None:
    """Frees idle buffers and refuses later acquires; buffers still referenced are freed when
    released. Safe to call from any thread, any number of times."""
    self._pool.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
