"""Multi-tenant isolation of the host transport (seed 4.4): quotas, bandwidth shaping, ownership.

Every communicator belongs to a tenant (``create_communicator(..., tenant=...)``). Per tenant, the
native layer (csrc/transport/tenancy.*) enforces:

* a quota on connections (TCP sockets / RDMA RC QPs; a ring rank holds two),
* a quota on registered bytes (pinned staging buffers, RDMA MRs),
* a token-bucket bandwidth limit applied before every send is posted,
* for device memory a tenant exports or registers: the pointer must belong to the tenant's own
  CUDA context (``cudaPointerGetAttributes`` in a CUDA build; the check is replaceable, see
  :func:`use_fake_pointer_owners`, so the refusal logic is tested on CPU).

Exceeding a quota raises :class:`~dtenjax._src.errors.QuotaExceededError` naming the tenant, the
limit and the fix; a foreign pointer raises :class:`OwnershipError`.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Sequence

from dtenjax._src import errors
from dtenjax._src.net import transport


class OwnershipError(errors.DtenjaxError, PermissionError):
  """A tenant tried to register or export memory that belongs to another context."""


@dataclasses.dataclass(frozen=True)
class Quota:
  """Limits of one tenant; -1 / 0 mean unlimited."""
  max_connections: int = -1
  max_registered_bytes: int = -1
  rate_bytes_per_s: float = 0.0
  burst_bytes: float = 0.0   # bucket depth; 0: one second of rate (at least 1 MiB)

  def __post_init__(self):
    bad = []
    if self.max_connections < -1:
      bad.append(f"max_connections={self.max_connections} (use -1 for unlimited)")
    if self.max_registered_bytes < -1:
      bad.append(f"max_registered_bytes={self.max_registered_bytes} (use -1 for unlimited)")
    if self.rate_bytes_per_s < 0:
      bad.append(f"rate_bytes_per_s={self.rate_bytes_per_s} (use 0 for unlimited)")
    if self.burst_bytes < 0:
      bad.append(f"burst_bytes={self.burst_bytes} (must be >= 0)")
    if bad:
      raise errors.ConfigurationError(errors.join_problems("invalid tenant Quota:", bad))


def _name(tenant: str) -> bytes:
  if not tenant or not isinstance(tenant, str):
    raise errors.ConfigurationError(f"tenant={tenant!r} must be a non-empty string.")
  return tenant.encode()


def set_quota(tenant: str, quota: Quota) -> None:
  """Sets ``tenant``'s limits (applies to communicators and pools created from now on, and to
  the token bucket at once)."""
  transport.lib().dtenjax_tp_tenant_set_quota(_name(tenant), quota.max_connections,
                                              quota.max_registered_bytes,
                                              float(quota.rate_bytes_per_s),
                                              float(quota.burst_bytes))


def usage(tenant: str) -> dict[str, int]:
  """Current connections and registered bytes, and refusals so far."""
  out = (ctypes.c_int64 * 4)()
  transport.lib().dtenjax_tp_tenant_usage(_name(tenant), out)
  return {"connections": out[0], "registered_bytes": out[1], "quota_refusals": out[2],
          "ownership_refusals": out[3]}


def throttle(tenant: str, nbytes: int, timeout_s: float = 60.0) -> None:
  """Takes ``nbytes`` tokens from ``tenant``'s bucket, sleeping as the rate requires (the same
  call the transport makes before each send)."""
  transport._Err().call(transport.lib().dtenjax_tp_tenant_take, _name(tenant), int(nbytes),  # pylint: disable=protected-access
                        float(timeout_s), what=f"throttling tenant {tenant!r}")


def set_owner_context(tenant: str, context: int) -> None:
  """Declares the CUDA context (device ordinal) whose memory ``tenant`` may register."""
  transport.lib().dtenjax_tp_tenant_set_owner_context(_name(tenant), int(context))


def check_device_memory(tenant: str, ptr: int, nbytes: int) -> None:
  """Raises OwnershipError unless [ptr, ptr+nbytes) is memory of ``tenant``'s context."""
  err = ctypes.create_string_buffer(2048)
  code = transport.lib().dtenjax_tp_tenant_check_device_memory(_name(tenant), int(ptr),
                                                               int(nbytes), err, 2048)
  if code:
    raise OwnershipError(err.value.decode(errors="replace"))


def use_fake_pointer_owners(ranges: Sequence[tuple[int, int, int]]) -> None:
  """Replaces the ownership check by a table of (start, nbytes, context) ranges (tests on CPU)."""
  n = len(ranges)
  starts = (ctypes.c_uint64 * max(n, 1))(*[r[0] for r in ranges])
  sizes = (ctypes.c_uint64 * max(n, 1))(*[r[1] for r in ranges])
  owners = (ctypes.c_int64 * max(n, 1))(*[r[2] for r in ranges])
  transport.lib().dtenjax_tp_set_fake_pointer_owners(starts, sizes, owners, n)
