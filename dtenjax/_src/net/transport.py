"""Host transport control plane: job credentials, provider choice, communicators, counters.

The data plane lives in C++ (``csrc/transport/``: a TCP provider and an RDMA verbs provider behind
one table of functions). This module drives it through plain C entry points of the already loaded
``dtenjax._ffi`` library (ctypes releases the GIL during blocking calls such as connecting a ring).

Bootstrap goes through jax.distributed's coordination store (:mod:`dtenjax._src.net.kvstore`): each
rank listens on ``DTENJAX_BIND_ADDRESS`` (port chosen by the OS), publishes its endpoint, reads its
ring neighbour's, and connects. Every connection is authenticated by an HMAC-SHA256
challenge-response keyed by the job secret: ``DTENJAX_JOB_SECRET`` if set, else random bytes made
by process 0 and shared through the store (so only members of this job can connect).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import secrets
import threading
from typing import Any

import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import kvstore

# dtenjax::Code values (csrc/common/status.h).
_OK, _INVALID, _UNAVAILABLE, _DEADLINE, _EXHAUSTED, _DENIED, _DATALOSS = 0, 1, 2, 3, 4, 5, 6
_ERR_CAP = 2048
DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2,
               np.dtype(np.int64): 3}
OP_CODES = {"sum": 0, "max": 1, "min": 2, "prod": 3}
PROVIDERS = ("tcp", "verbs")


def _bf16_code() -> dict[Any, int]:
  try:
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    return {np.dtype(ml_dtypes.bfloat16): 4}
  except ImportError:  # pragma: no cover
    return {}


DTYPE_CODES.update(_bf16_code())


@functools.cache
def lib() -> ctypes.CDLL:
  """The native library with argument types declared; ExtensionUnavailableError if not built."""
  path = ffi.module().__file__
  L = ctypes.CDLL(path)
  c = ctypes
  i64, u64, dbl, s, p, ip = c.c_int64, c.c_uint64, c.c_double, c.c_char_p, c.c_void_p, c.c_int
  sig = {
      "dtenjax_tp_num_counters": ([], ip),
      "dtenjax_tp_counter_name": ([ip], s),
      "dtenjax_tp_counters": ([p], None),
      "dtenjax_tp_hmac_sha256": ([p, u64, p, u64, p], None),
      "dtenjax_tp_sha256": ([p, u64, p], None),
      "dtenjax_tp_checksum64": ([p, u64], u64),
      "dtenjax_tp_random": ([p, u64, p, ip], ip),
      "dtenjax_tp_comm_create": ([u64, ip, ip, p, u64, dbl, s, s, s, p, p, ip, p, ip], ip),
      "dtenjax_tp_comm_connect": ([i64, s, p, ip], ip),
      "dtenjax_tp_comm_all_reduce": ([i64, p, u64, ip, ip, p, ip], ip),
      "dtenjax_tp_comm_inject_corrupt": ([i64], ip),
      "dtenjax_tp_comm_destroy": ([i64], ip),
      "dtenjax_tp_listen": ([s, p, p, ip, p, ip], ip),
      "dtenjax_tp_accept": ([i64, u64, ip, ip, p, u64, dbl, p, p, ip], ip),
      "dtenjax_tp_connect": ([s, u64, ip, ip, p, u64, dbl, p, p, ip], ip),
      "dtenjax_tp_exchange": ([i64, p, u64, i64, p, u64, u64, u64, ip, dbl, p, ip], ip),
      "dtenjax_tp_close": ([i64], None),
      "dtenjax_tp_pool_create": ([u64, c.c_uint32, u64, ip, s], i64),
      "dtenjax_tp_pool_destroy": ([i64], ip),
      "dtenjax_tp_pool_op": ([i64, ip, i64, p, p, ip], ip),
      "dtenjax_tp_pool_num_stats": ([], ip),
      "dtenjax_tp_pool_stat_name": ([ip], s),
      "dtenjax_tp_pool_stats": ([i64, p], ip),
      "dtenjax_tp_tenant_set_quota": ([s, i64, i64, dbl, dbl], None),
      "dtenjax_tp_tenant_usage": ([s, p], None),
      "dtenjax_tp_tenant_set_owner_context": ([s, i64], None),
      "dtenjax_tp_tenant_check_device_memory": ([s, u64, u64, p, ip], ip),
      "dtenjax_tp_tenant_acquire_connection": ([s, p, ip], ip),
      "dtenjax_tp_tenant_release_connection": ([s], None),
      "dtenjax_tp_tenant_take": ([s, u64, dbl, p, ip], ip),
      "dtenjax_tp_set_fake_pointer_owners": ([p, p, p, ip], None),
  }
  for name, (args, res) in sig.items():
    fn = getattr(L, name)
    fn.argtypes = args
    fn.restype = res
  return L


def is_available() -> bool:
  """Whether the native transport is in this build."""
  try:
    lib()
    return True
  except (errors.ExtensionUnavailableError, AttributeError, OSError):
    return False


def raise_for(code: int, message: str, what: str = "") -> None:
  """Raises the dtenjax error matching a native status code (no-op for OK)."""
  if code == _OK:
    return
  msg = f"{what}: {message}" if what else message
  if code == _DEADLINE:
    raise errors.CollectiveTimeoutError(msg)
  if code == _EXHAUSTED:
    raise errors.QuotaExceededError(msg)
  if code == _INVALID:
    raise errors.ConfigurationError(msg)
  raise errors.TransportError(msg)


class _Err:
  """A ctypes error buffer: ``call(fn, *args)`` appends (buf, cap) and raises on failure."""

  def __init__(self):
    self.buf = ctypes.create_string_buffer(_ERR_CAP)

  def call(self, fn, *args, what: str = "") -> None:
    code = fn(*args, self.buf, _ERR_CAP)
    raise_for(code, self.buf.value.decode(errors="replace"), what)


def counters() -> dict[str, int]:
  """Process-wide transport counters: frames/bytes moved, connections, rejections by reason."""
  L = lib()
  n = L.dtenjax_tp_num_counters()
  out = (ctypes.c_uint64 * n)()
  L.dtenjax_tp_counters(out)
  return {L.dtenjax_tp_counter_name(i).decode(): int(out[i]) for i in range(n)}


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
  """The native HMAC-SHA256 (what authenticates connections); equals Python's hmac module."""
  out = ctypes.create_string_buffer(32)
  lib().dtenjax_tp_hmac_sha256(key, len(key), msg, len(msg), out)
  return out.raw


def sha256(msg: bytes) -> bytes:
  out = ctypes.create_string_buffer(32)
  lib().dtenjax_tp_sha256(msg, len(msg), out)
  return out.raw


def checksum64(data: bytes) -> int:
  """The frame payload checksum (Fletcher-style, 64-bit)."""
  return int(lib().dtenjax_tp_checksum64(data, len(data)))


# --- job credentials --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobCredentials:
  """Who belongs to this job: a 64-bit job id in every frame header and the HMAC secret."""
  job_id: int
  secret: bytes = dataclasses.field(repr=False)

  def __post_init__(self):
    if not 0 < self.job_id < 2**64:
      raise errors.ConfigurationError(f"job_id={self.job_id} must be in (0, 2**64).")
    if len(self.secret) < 16:
      raise errors.ConfigurationError(
          f"the job secret has {len(self.secret)} bytes; use at least 16 (set "
          "DTENJAX_JOB_SECRET to a long random string, or leave it unset to have process 0 make "
          "one).")


_creds_lock = threading.Lock()
_creds: JobCredentials | None = None


def job_credentials(store: kvstore.KVStore | None = None, *, process_index: int | None = None
                    ) -> JobCredentials:
  """This job's credentials; the first call on each process is collective (reads the store)."""
  global _creds
  with _creds_lock:
    if _creds is not None:
      return _creds
    store = store or kvstore.default()
    if process_index is None:
      import jax  # pylint: disable=g-import-not-at-top
      process_index = jax.process_index()
    env = config.get_str("DTENJAX_JOB_SECRET")
    if process_index == 0:
      store.set(store.key("job", "id"), str(secrets.randbits(63) | 1), overwrite=True)
      if not env:
        store.set(store.key("job", "secret"), secrets.token_hex(32), overwrite=True)
    job_id = int(store.get(store.key("job", "id")))
    secret = env.encode() if env else bytes.fromhex(store.get(store.key("job", "secret")))
    _creds = JobCredentials(job_id, secret)
    return _creds


def reset_job_credentials() -> None:
  """Forgets cached credentials (tests)."""
  global _creds
  with _creds_lock:
    _creds = None


# --- provider choice ----------------------------------------------------------------------------

def select_provider(nics: list[dict[str, Any]] | None = None) -> tuple[str, str]:
  """(provider, reason). ``DTENJAX_TRANSPORT`` forces one; auto picks verbs on an active RDMA port
  when the build has the verbs provider, otherwise TCP, and logs why once."""
  forced = config.get_str("DTENJAX_TRANSPORT").strip().lower()
  if forced not in ("auto",) + PROVIDERS:
    raise errors.ConfigurationError(
        f"DTENJAX_TRANSPORT={forced!r} is not one of auto, tcp, verbs.")
  built = ffi.build_info().get("verbs", False)
  if forced == "tcp":
    return "tcp", "DTENJAX_TRANSPORT=tcp"
  if nics is None:
    from dtenjax._src.net import rdma  # pylint: disable=g-import-not-at-top
    nics = rdma.discover_nics()
    why_none = rdma.unavailable_reason()
  else:
    why_none = "no RDMA NIC was given"
  active = [n for n in nics if n.get("state") == "active"]
  if forced == "verbs":
    if not built:
      raise errors.ExtensionUnavailableError(
          "DTENJAX_TRANSPORT=verbs but this build has no verbs provider (install "
          "libibverbs-dev and rebuild), or unset DTENJAX_TRANSPORT to use TCP.")
    return "verbs", "DTENJAX_TRANSPORT=verbs"
  if active and built:
    return "verbs", f"active RDMA port {active[0]['name']}:{active[0]['port']}"
  if active:
    reason = "an RDMA port is active but this build has no verbs provider"
  elif nics:
    reason = "no RDMA port is active (" + ", ".join(
        f"{n['name']}:{n['port']}={n.get('state')}" for n in nics) + ")"
  else:
    reason = why_none or "no RDMA device"
  config.log_once("transport:provider", f"dtenjax host transport: using TCP because {reason} "
                  "(set DTENJAX_TRANSPORT=tcp to silence)", level=20)
  return "tcp", reason


# --- communicators ------------------------------------------------------------------------------

class Communicator:
  """One rank of an authenticated ring of processes (a native communicator)."""

  def __init__(self, name: str, rank: int, size: int, tenant: str, provider: str,
               comm_id: int, endpoint: str):
    self.name, self.rank, self.size = name, rank, size
    self.tenant, self.provider = tenant, provider
    self.comm_id, self.endpoint = comm_id, endpoint
    self._closed = False

  def __repr__(self) -> str:
    return (f"Communicator({self.name!r}, rank={self.rank}, size={self.size}, "
            f"tenant={self.tenant!r}, provider={self.provider!r}, id={self.comm_id})")

  def all_reduce(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
    """Ring all-reduce of a host array (outside jit: tests, benchmarks). Returns a new array."""
    x = np.ascontiguousarray(x)
    if x.dtype not in DTYPE_CODES:
      raise errors.CollectiveError(
          f"host all-reduce of dtype {x.dtype} is not supported; use one of "
          f"{sorted(str(d) for d in DTYPE_CODES)}.")
    if op not in OP_CODES:
      raise errors.CollectiveError(f"op={op!r} is not one of {sorted(OP_CODES)}.")
    out = x.copy()
    _Err().call(lib().dtenjax_tp_comm_all_reduce, self.comm_id,
                out.ctypes.data_as(ctypes.c_void_p), out.size, DTYPE_CODES[x.dtype],
                OP_CODES[op], what=f"all-reduce on {self!r}")
    return out

  def inject_corrupt_next_send(self) -> None:
    """Fault injection: the next frame this rank sends has one payload byte flipped."""
    lib().dtenjax_tp_comm_inject_corrupt(self.comm_id)

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      lib().dtenjax_tp_comm_destroy(self.comm_id)


def create_local_comm(rank: int, size: int, creds: JobCredentials, *, tenant: str = "default",
                      provider: str = "tcp", timeout_s: float | None = None,
                      bind_address: str | None = None, name: str = "local") -> Communicator:
  """Creates (listens) but does not connect a communicator; see :func:`connect`."""
  if not 0 <= rank < size:
    raise errors.ConfigurationError(f"rank={rank} is not in [0, size={size}).")
  timeout_s = config.get_float("DTENJAX_COLLECTIVE_TIMEOUT") if timeout_s is None else timeout_s
  bind = bind_address or config.get_str("DTENJAX_BIND_ADDRESS")
  cid = ctypes.c_int64(0)
  ep = ctypes.create_string_buffer(256)
  _Err().call(lib().dtenjax_tp_comm_create, creds.job_id, rank, size, creds.secret,
              len(creds.secret), float(timeout_s), tenant.encode(), bind.encode(),
              provider.encode(), ctypes.byref(cid), ep, 256,
              what=f"creating communicator {name!r} rank {rank} on {bind}")
  return Communicator(name, rank, size, tenant, provider, int(cid.value), ep.value.decode())


def connect(comm: Communicator, next_endpoint: str) -> None:
  """Connects ``comm`` to the next rank's endpoint and accepts the previous rank (blocking)."""
  _Err().call(lib().dtenjax_tp_comm_connect, comm.comm_id, next_endpoint.encode(),
              what=f"connecting {comm!r} to {next_endpoint}")


_names_lock = threading.Lock()
_name_uses: dict[str, int] = {}


def create_communicator(name: str, *, rank: int | None = None, size: int | None = None,
                        tenant: str = "default", store: kvstore.KVStore | None = None,
                        timeout_s: float | None = None, provider: str | None = None
                        ) -> Communicator:
  """Collectively creates a ring communicator over all processes (every process calls this with
  the same ``name``, in the same order). Endpoints are exchanged through the coordination store."""
  import jax  # pylint: disable=g-import-not-at-top
  rank = jax.process_index() if rank is None else rank
  size = jax.process_count() if size is None else size
  store = store or kvstore.default()
  provider = provider or select_provider()[0]
  creds = job_credentials(store, process_index=rank)
  with _names_lock:
    use = _name_uses.get(name, 0)
    _name_uses[name] = use + 1
  comm = create_local_comm(rank, size, creds, tenant=tenant, provider=provider,
                           timeout_s=timeout_s, name=name)
  if size > 1:
    try:
      eps = store.exchange(f"transport-{name}-{use}", rank, size, comm.endpoint,
                           timeout_s=timeout_s)
      connect(comm, eps[(rank + 1) % size])
    except BaseException:
      comm.close()
      raise
  return comm
