"""Multi-tenant isolation of the host transport (seed 4.4): quotas, bandwidth shaping, ownership.

Every communicator belongs to a tenant (``create_communicator(..., tenant=...)``). Per tenant, the
native layer (csrc/transport/tenancy.*) enforces:

* a quota on connections (TCP sockets / RDMA RC QPs; a ring rank holds two),
* a quota on registered bytes (pinned staging buffers, RDMA MRs),
* a token-bucket bandwidth limit applied before every send is posted,
* for device memory a tenant exports or registers: the pointer must belong to the tenant's own
  CUDA context (``cudaPointerGetAttributes`` in a CUDA build).

Exceeding a quota raises :class:`~dtenjax._src.errors.QuotaExceededError` naming the tenant, the
limit and the fix; a foreign pointer raises :class:`OwnershipError`. Every limit is checked here
against what its native field holds (a limit of ``2**64`` or a NaN rate is refused, not wrapped).
"""

from __future__ import annotations

import dataclasses

from dtenjax._src import errors
from dtenjax._src.net import checks
from dtenjax._src.net import native


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
    problems = checks.problems_of(
        lambda: checks.integer("max_connections", self.max_connections, -1, checks.I64_MAX,
                               hint="-1 means unlimited"),
        lambda: checks.integer("max_registered_bytes", self.max_registered_bytes, -1,
                               checks.I64_MAX, hint="-1 means unlimited"),
        lambda: checks.number("rate_bytes_per_s", self.rate_bytes_per_s, 0,
                              hint="0 means unlimited"),
        lambda: checks.number("burst_bytes", self.burst_bytes, 0,
                              hint="0 means one second of rate"))
    if problems:
      raise errors.ConfigurationError(errors.join_problems("invalid tenant Quota:", problems))


def _name(tenant: str) -> str:
  return checks.name("tenant", tenant)


def set_quota(tenant: str, quota: Quota) -> None:
  """Sets ``tenant``'s limits (applies to communicators and pools created from now on, and to
  the token bucket at once)."""
  if not isinstance(quota, Quota):
    raise errors.ConfigurationError(f"quota must be a Quota, got {type(quota).__name__}.")
  native.transport().set_quota(_name(tenant), quota.max_connections, quota.max_registered_bytes,
                               float(quota.rate_bytes_per_s), float(quota.burst_bytes))


def usage(tenant: str) -> dict[str, int]:
  """Current connections and registered bytes, and refusals so far."""
  return {k: int(v) for k, v in native.transport().usage(_name(tenant)).items()}


def throttle(tenant: str, nbytes: int, timeout_s: float = 60.0) -> None:
  """Takes ``nbytes`` tokens from ``tenant``'s bucket, sleeping as the rate requires (the same
  call the transport makes before each send)."""
  native.transport().take(_name(tenant), checks.integer("nbytes", nbytes, 0, checks.U64_MAX),
                          checks.number("timeout_s", timeout_s, 0, lo_open=True))


def set_owner_context(tenant: str, context: int) -> None:
  """Declares the CUDA context (device ordinal) whose memory ``tenant`` may register."""
  native.transport().set_owner_context(
      _name(tenant), checks.integer("context", context, -1, checks.I64_MAX,
                                    hint="a CUDA device ordinal, or -1 for none"))


def check_device_memory(tenant: str, ptr: int, nbytes: int) -> None:
  """Raises OwnershipError unless [ptr, ptr+nbytes) is memory of ``tenant``'s context."""
  ptr = checks.integer("ptr", ptr, 0, checks.U64_MAX)
  nbytes = checks.integer("nbytes", nbytes, 1, checks.U64_MAX - ptr,
                          hint="ptr + nbytes must not pass 2**64")
  try:
    native.transport().check_device_memory(_name(tenant), ptr, nbytes)
  except (errors.TransportError, errors.ExtensionUnavailableError) as e:
    raise OwnershipError(str(e)) from None
