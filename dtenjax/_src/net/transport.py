"""Host transport control plane: job credentials, provider table, communicators, counters.

The data plane lives in C++ (``csrc/transport/``: a TCP provider and an RDMA verbs provider behind
one table of functions), bound to Python with nanobind as ``dtenjax._ffi.transport``
(``custom_calls/transport/bindings.cc``); a native failure raises the dtenjax error of its status code.

Bootstrap goes through jax.distributed's coordination store (:mod:`dtenjax._src.net.kvstore`): each
rank listens on ``DTENJAX_BIND_ADDRESS`` (port chosen by the OS), publishes its endpoint, reads its
ring neighbour's, and connects. Every connection is authenticated by an HMAC-SHA256
challenge-response keyed by the job secret (``DTENJAX_JOB_SECRET`` if set, else random bytes made
by process 0 and shared through the store), and every frame after it by AES-256-GMAC under keys
derived in that handshake. Both come from OpenSSL's libcrypto, loaded at run time
(``DTENJAX_LIBCRYPTO`` to choose the file). Without libcrypto no connection is made (fail
closed): creating a multi-process communicator raises ExtensionUnavailableError saying so.

Every collective carries (number, op, dtype, count, call site, tag) in its frames; processes that
issue different collectives get an error on every rank that names both sides and both call
stacks (see :func:`~dtenjax._src.net.callsite.call_site` and
:func:`~dtenjax._src.net.callsite.tag_value`, in ``net/callsite.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import checks
from dtenjax._src.net import kvstore
from dtenjax._src.net.callsite import MAX_SITE_FRAMES as MAX_SITE_FRAMES
from dtenjax._src.net.callsite import call_site as call_site
from dtenjax._src.net.callsite import tag_value as tag_value


@functools.cache
def codes() -> tuple[dict[np.dtype, int], dict[str, int]]:
  """({dtype: code}, {op: code}) of the frames, as the extension exports them (frame.h)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  dtypes = ffi.vocabulary("transport.dtype")
  return ({np.dtype(getattr(ml_dtypes, n, n)): c for n, c in dtypes.items()},
          ffi.vocabulary("transport.op"))


# --- the native module ----------------------------------------------------------------------------

def native():
  """``dtenjax._ffi.transport``; ExtensionUnavailableError (saying why) when it is not built."""
  mod = ffi.module()
  sub = getattr(mod, "transport", None)
  if sub is None:
    raise errors.ExtensionUnavailableError(
        f"this build of dtenjax._ffi has no transport bindings (build info: "
        f"{dict(mod.build_info())}). Rebuild the extension: {ffi.BUILD_HINT}")
  return sub


def is_available() -> bool:
  """Whether the native transport is in this build."""
  try:
    native()
    return True
  except errors.ExtensionUnavailableError:
    return False


def counters() -> dict[str, int]:
  """Process-wide transport counters: frames/bytes moved, connections, rejections by reason
  (rejected_mac: modified frames, rejected_replay: replayed frames, rejected_mismatch: frames of
  another collective, ...), aborts sent/received, pending handshakes."""
  return dict(native().counters())


@functools.cache
def _crypto_loaded(path: str) -> None:
  native().crypto_load(path)


def ensure_crypto() -> str:
  """Loads libcrypto (``DTENJAX_LIBCRYPTO`` or the default names); returns the file loaded.

  Raises ExtensionUnavailableError saying what was tried and how to install it."""
  path = config.get_str("DTENJAX_LIBCRYPTO")
  _crypto_loaded(path)
  return native().crypto_status()[2]


def crypto_status() -> dict[str, Any]:
  ok, why, lib = native().crypto_status()
  return {"loaded": bool(ok), "library": lib, "error": None if ok else why}


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
  """libcrypto's HMAC-SHA256 (what authenticates connections); equals Python's hmac module."""
  ensure_crypto()
  return native().hmac_sha256(bytes(key), bytes(msg))


# --- call sites and tags (the stack walking is net/callsite.py) ----------------------------------

def register_site(tag: int, text: str) -> None:
  """Tells the native layer the text of a site tag (for error messages)."""
  native().register_site(checks.integer("site tag", tag, 0, checks.U32_MAX), str(text))


# --- job credentials ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class JobCredentials:
  """Who belongs to this job: a 64-bit job id in every frame header and the HMAC secret."""
  job_id: int
  secret: bytes = dataclasses.field(repr=False)

  def __post_init__(self):
    checks.integer("job_id", self.job_id, 1, checks.U64_MAX)
    if not isinstance(self.secret, (bytes, bytearray)):
      raise errors.ConfigurationError(
          f"the job secret must be bytes, got {type(self.secret).__name__}.")
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


# --- provider table -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProviderSpec:
  """One transport provider: its native name and when ``auto`` may pick it.

  ``usable(nics)`` returns (usable, reason); providers are tried in table order and the first
  usable one wins. The native side of a provider is one file in csrc/transport/ that registers
  itself with ``DTENJAX_REGISTER_PROVIDER``."""
  name: str
  usable: Callable[[list[dict[str, Any]]], tuple[bool, str]]
  description: str


def _verbs_usable(nics: list[dict[str, Any]]) -> tuple[bool, str]:
  active = [n for n in nics if str(n.get("state", "")).lower() == "active"]
  if not active:
    if nics:
      return False, "no RDMA port is active (" + ", ".join(
          f"{n['name']}:{n['port']}={n.get('state')}" for n in nics) + ")"
    return False, "no RDMA device"
  return True, f"active RDMA port {active[0]['name']}:{active[0]['port']}"


PROVIDERS: tuple[ProviderSpec, ...] = (
    ProviderSpec("verbs", _verbs_usable, "RDMA verbs (RC QPs, RDMA WRITE WITH IMM)"),
    ProviderSpec("tcp", lambda nics: (True, "TCP is always available"), "TCP sockets"),
)


def built_providers() -> list[str]:
  """Providers compiled into this build of the extension."""
  return list(native().providers())


def select_provider(nics: list[dict[str, Any]] | None = None) -> tuple[str, str]:
  """(provider, reason). ``DTENJAX_TRANSPORT`` forces one; ``auto`` takes the first provider of
  :data:`PROVIDERS` that is built and usable, and logs why once."""
  names = [p.name for p in PROVIDERS]
  forced = config.get_str("DTENJAX_TRANSPORT").strip().lower()
  if forced not in ("auto", *names):
    raise errors.ConfigurationError(
        f"DTENJAX_TRANSPORT={forced!r} is not one of {['auto', *names]}.")
  built = built_providers() if is_available() else []
  from dtenjax._src.net import rdma  # pylint: disable=g-import-not-at-top
  if forced != "auto":
    if forced not in built:
      raise errors.ExtensionUnavailableError(
          f"DTENJAX_TRANSPORT={forced} but this build has no {forced} provider (built: {built}); "
          + ("install libibverbs-dev and rebuild, " if forced == "verbs" else "")
          + "or unset DTENJAX_TRANSPORT.")
    reason = f"DTENJAX_TRANSPORT={forced}"
    if forced == "verbs" and rdma.emulated_nics():
      reason += " on an EMULATED device: " + _emulated_text(rdma)
      config.log_once(f"transport:emulated:{rdma.library_info()['path']}",
                      f"dtenjax host transport: verbs runs on an EMULATED RDMA device, not a NIC "
                      f"({_emulated_text(rdma)})")
    return forced, reason
  why_none = "no RDMA NIC was given"
  if nics is None:
    nics = list(rdma.discover_nics())
    why_none = rdma.unavailable_reason() or "no RDMA device"
    if rdma.emulated_nics():
      why_none += ("; auto never picks the EMULATED device (" + _emulated_text(rdma) +
                   "): set DTENJAX_TRANSPORT=verbs to run on it")
  passed_over = []
  for spec in PROVIDERS:
    if spec.name not in built:
      passed_over.append(f"{spec.name} is not in this build")
      continue
    ok, why = spec.usable(list(nics))
    if ok:
      if not passed_over:
        return spec.name, why
      reason = "; ".join(passed_over)
      config.log_once(f"transport:provider:{spec.name}:{reason}",
                      f"dtenjax host transport: using {spec.name} because {reason} (set "
                      f"DTENJAX_TRANSPORT={spec.name} to silence)", level=20)
      return spec.name, reason
    passed_over.append(f"{spec.name} is not usable: {why if nics else why_none}")
  raise errors.ExtensionUnavailableError(   # tcp is always built and usable, but say so if not
      "no transport provider is usable: " + "; ".join(passed_over))


def _emulated_text(rdma) -> str:
  ports = ", ".join(f"{n['name']}:{n['port']} {n['link_layer']}" for n in rdma.emulated_nics())
  return f"{ports} from {rdma.library_info()['path']}, dtenjax's test device"


# --- communicators --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CommSettings:
  """Transport settings of one communicator (defaults from the DTENJAX_ knobs)."""
  timeout_s: float
  segment_bytes: int
  handshake_timeout_s: float
  max_pending_handshakes: int
  bind_address: str

  def __post_init__(self):
    problems = checks.problems_of(
        lambda: checks.number("timeout_s", self.timeout_s, 0, 1e9, lo_open=True,
                              hint="seconds; DTENJAX_COLLECTIVE_TIMEOUT"),
        lambda: checks.integer("segment_bytes", self.segment_bytes, 256, 1 << 30,
                               hint="DTENJAX_TRANSPORT_SEGMENT_BYTES"),
        lambda: checks.number("handshake_timeout_s", self.handshake_timeout_s, 0, 1e9,
                              lo_open=True, hint="DTENJAX_HANDSHAKE_TIMEOUT"),
        lambda: checks.integer("max_pending_handshakes", self.max_pending_handshakes, 1, 4096,
                               hint="DTENJAX_MAX_PENDING_HANDSHAKES"),
        lambda: checks.name("bind_address", self.bind_address))
    if problems:
      raise errors.ConfigurationError(errors.join_problems("invalid transport settings:",
                                                           problems))

  @classmethod
  def from_env(cls, **overrides) -> "CommSettings":
    values = dict(timeout_s=config.get_float("DTENJAX_COLLECTIVE_TIMEOUT"),
                  segment_bytes=config.get_int("DTENJAX_TRANSPORT_SEGMENT_BYTES"),
                  handshake_timeout_s=config.get_float("DTENJAX_HANDSHAKE_TIMEOUT"),
                  max_pending_handshakes=config.get_int("DTENJAX_MAX_PENDING_HANDSHAKES"),
                  bind_address=config.get_str("DTENJAX_BIND_ADDRESS"))
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def _peer_errors(e: errors.ExtensionUnavailableError) -> errors.TransportError:
  # A live communicator reports a lost peer as UNAVAILABLE; to Python callers that is a
  # transport failure, not a missing capability.
  return errors.TransportError(str(e))


class Communicator:
  """One rank of an authenticated ring of processes (a native communicator)."""

  def __init__(self, name: str, rank: int, size: int, tenant: str, provider: str, native_comm):
    self.name, self.rank, self.size = name, rank, size
    self.tenant, self.provider = tenant, provider
    self._native = native_comm
    self.comm_id = int(native_comm.id)
    self.endpoint = native_comm.endpoint

  def __repr__(self) -> str:
    return (f"Communicator({self.name!r}, rank={self.rank}, size={self.size}, "
            f"tenant={self.tenant!r}, provider={self.provider!r}, id={self.comm_id})")

  def all_reduce(self, x: np.ndarray, op: str = "sum", *, site: tuple[int, str] | None = None,
                 tag: int | str | None = None) -> np.ndarray:
    """Ring all-reduce of a host array (outside jit: tests, benchmarks). Returns a new array.

    ``site`` (tag, text) names the call site carried in every frame; default :func:`call_site`.
    ``tag`` (see :func:`tag_value`) tells apart collectives with the same call stack, e.g. the
    iterations of a loop: every rank must pass the same one for the same collective.
    """
    x = np.ascontiguousarray(x)
    dtype_codes, op_codes = codes()
    if x.dtype not in dtype_codes:
      raise errors.CollectiveError(
          f"host all-reduce of dtype {x.dtype} is not supported; use one of "
          f"{sorted(str(d) for d in dtype_codes)}.")
    if op not in op_codes:
      raise errors.CollectiveError(f"op={op!r} is not one of {sorted(op_codes)}.")
    value, suffix = tag_value(tag)
    if value is None:
      raise errors.CollectiveError("Communicator.all_reduce takes a Python int or str tag (an "
                                   "array tag belongs inside jit: hostcoll.all_reduce).")
    site_tag, text = call_site() if site is None else site
    if suffix:
      text += suffix
      site_tag = zlib.crc32(text.encode())
    register_site(site_tag, text)
    out = np.empty_like(x)
    try:
      self._native.all_reduce(x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8),
                              out.size, dtype_codes[x.dtype], op_codes[op], site_tag, value)
    except errors.ExtensionUnavailableError as e:
      raise _peer_errors(e) from None
    return out

  def close(self) -> None:
    self._native.close()

  @property
  def closed(self) -> bool:
    return bool(self._native.closed)


def create_local_comm(rank: int, size: int, creds: JobCredentials, *, tenant: str = "default",
                      provider: str = "tcp", timeout_s: float | None = None,
                      bind_address: str | None = None, name: str = "local",
                      segment_bytes: int | None = None, handshake_timeout_s: float | None = None,
                      max_pending_handshakes: int | None = None) -> Communicator:
  """Creates (listens) but does not connect a communicator; see :func:`connect`."""
  problems = checks.problems_of(
      lambda: checks.integer("size", size, 1, 65536),
      lambda: checks.integer("rank", rank, 0, max(0, int(size) - 1) if isinstance(size, int)
                             else 0, hint=f"rank must be in [0, size={size})"),
      lambda: checks.name("tenant", tenant))
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        f"cannot create communicator {name!r}:", problems))
  if not isinstance(creds, JobCredentials):
    raise errors.ConfigurationError(f"creds must be JobCredentials, got {type(creds).__name__}.")
  settings = CommSettings.from_env(timeout_s=timeout_s, bind_address=bind_address,
                                   segment_bytes=segment_bytes,
                                   handshake_timeout_s=handshake_timeout_s,
                                   max_pending_handshakes=max_pending_handshakes)
  built = built_providers()
  if provider not in built:
    raise errors.ExtensionUnavailableError(
        f"transport provider {provider!r} is not in this build (built: {built}).")
  if size > 1:
    ensure_crypto()   # fail closed: raises saying libcrypto is missing and how to install it
  if provider == "verbs":
    from dtenjax._src.net import rdma  # pylint: disable=g-import-not-at-top
    rdma.load_library()   # DTENJAX_IBVERBS_LIBRARY
    native().verbs.set_device(config.get_str("DTENJAX_IB_DEVICE"))
  comm = native().Comm(creds.job_id, rank, size, bytes(creds.secret), settings.timeout_s, tenant,
                       settings.bind_address, provider, settings.segment_bytes,
                       settings.handshake_timeout_s, settings.max_pending_handshakes)
  return Communicator(name, rank, size, tenant, provider, comm)


def connect(comm: Communicator, next_endpoint: str) -> None:
  """Connects ``comm`` to the next rank's endpoint and accepts the previous rank (blocking), then
  checks the whole ring (a one-element all-reduce, collective #0). Once per communicator: after a
  failure every rank of the ring raises with the first cause, and a second call raises too."""
  checks.name("next_endpoint", next_endpoint)
  try:
    comm._native.connect_ring(next_endpoint)  # pylint: disable=protected-access
  except errors.ExtensionUnavailableError as e:
    raise _peer_errors(e) from None


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
    namespace = f"transport-{name}-{use}"
    try:
      try:
        eps = store.exchange(namespace, rank, size, comm.endpoint, timeout_s=timeout_s)
      except errors.CollectiveTimeoutError as e:
        raise _missing_ranks_error(store, namespace, name, size, e) from e
      connect(comm, eps[(rank + 1) % size])
    except BaseException:
      comm.close()
      raise
  return comm


def _missing_ranks_error(store: kvstore.KVStore, namespace: str, name: str, size: int,
                         cause: errors.CollectiveTimeoutError) -> errors.CollectiveTimeoutError:
  """Which processes did not join ring ``name``, and what that usually means."""
  try:
    published = {k.rsplit("/", 1)[-1] for k in store.dir(store.key(namespace))}
    missing = [r for r in range(size) if str(r) not in published]
  except errors.DtenjaxError:
    missing = []
  who = f"processes {missing}" if missing else "some processes"
  return errors.CollectiveTimeoutError(
      f"host-transport ring {name!r}: {who} did not join it (they did not publish an endpoint "
      f"within the timeout: {cause}). They died, are slower than DTENJAX_COLLECTIVE_TIMEOUT, or "
      "run a different program: e.g. they issued this all_reduce with another algorithm= (every "
      "process must choose the same one; a process running XLA's own collective instead waits "
      "there, where dtenjax cannot interrupt it) or skipped it.")
