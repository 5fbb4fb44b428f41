"""Host-transport communicators: their settings, the ring of processes, and its bootstrap.

A :class:`Communicator` is one rank of an authenticated ring of processes: a native communicator
of ``dtenjax._ffi.transport`` (:mod:`dtenjax._src.net.native`) over the provider that
:mod:`dtenjax._src.net.providers` selects. Bootstrap goes through jax.distributed's coordination
store (:mod:`dtenjax._src.net.kvstore`): each rank listens on ``DTENJAX_BIND_ADDRESS`` (port
chosen by the OS), publishes its endpoint, reads its ring neighbour's, and connects. Every
connection is authenticated by an HMAC-SHA256 challenge-response keyed by the job secret
(:mod:`dtenjax._src.net.credentials`), and every frame after it by AES-256-GMAC under keys
derived in that handshake. Both come from OpenSSL's libcrypto
(:func:`~dtenjax._src.net.native.ensure_crypto`, ``DTENJAX_LIBCRYPTO``). Without libcrypto no
connection is made (fail closed): creating a multi-process communicator raises
ExtensionUnavailableError saying so.

Identity of a collective (docs/transport.md, "The identity rule"): the communicator, its number
on that communicator (in every frame header), and its fingerprint: op, dtype, count, tag, the
call's signature and call site (texts of any length, counted whole:
:func:`~dtenjax._src.net.callsite.wire_text`) and its stream, under a keyed 64-bit digest
(csrc/transport/fingerprint.h) that every rank checks against its previous rank's before it
combines any payload; processes that issue different collectives get an error on every rank that
names both sides (see :func:`~dtenjax._src.net.callsite.call_site` and
:func:`~dtenjax._src.net.callsite.tag_value`).

The stream is never a thread's name: default names such as ``Thread-1 (worker)`` follow the
order in which a process created its threads, so they coincide across processes for threads
doing different work. A communicator's collectives come from the thread that created it (its
default stream), or from threads that name their stream explicitly (``stream=`` or
:func:`stream`), one live thread per key.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import dataclasses
import threading
import weakref

import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.net import callsite
from dtenjax._src.net import checks
from dtenjax._src.net import credentials
from dtenjax._src.net import kvstore
from dtenjax._src.net import native
from dtenjax._src.net import providers
from dtenjax._src.net import rdma


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


# Teardown (issue 35 item 3). A Python thread blocked in a native call (GIL released) that wakes
# while the interpreter finalizes is ended by CPython with pthread_exit, whose unwinding through
# the binding's GIL guard terminates the process ("terminate called without an active
# exception"). So at exit every live communicator is closed, which interrupts its calls, and exit
# waits until every thread has left its native call.
_calls = threading.Condition()
_threads_in_native = 0
_live: "weakref.WeakSet[Communicator]" = weakref.WeakSet()
EXIT_WAIT_S = 5.0   # how long interpreter exit waits for threads to leave native calls


@contextlib.contextmanager
def _native_call():
  global _threads_in_native
  with _calls:
    _threads_in_native += 1
  try:
    yield
  finally:
    with _calls:
      _threads_in_native -= 1
      _calls.notify_all()


def _close_at_exit() -> None:
  comms = list(_live)
  for comm in comms:     # first interrupt them all: closing one must not fail its ring
    try:                 # neighbours in this process with "lost connection" instead
      comm._native.interrupt()
    except Exception:
      pass
  for comm in comms:
    try:
      comm.close()
    except Exception:
      pass
  with _calls:
    _calls.wait_for(lambda: _threads_in_native == 0, timeout=EXIT_WAIT_S)


atexit.register(_close_at_exit)


_stream: contextvars.ContextVar[str | None] = contextvars.ContextVar("dtenjax_stream",
                                                                     default=None)


def _check_stream(key) -> str:
  if not isinstance(key, str) or not key or "\0" in key:
    raise errors.CollectiveError(
        f"stream={key!r} must be a non-empty str without NUL characters that names the work of "
        "the issuing thread and is the same on every rank (e.g. 'prefetch' or f'job-{job_id}').")
  return key


@contextlib.contextmanager
def stream(key: str):
  """The collectives this thread issues inside the block (on any :class:`Communicator`) belong to
  stream ``key``, as if each passed ``stream=key``: wrap the body of a worker thread that uses a
  communicator it did not create. The key names the thread's work and must be the same on every
  rank (never the thread's name, which follows creation order)."""
  token = _stream.set(_check_stream(key))
  try:
    yield
  finally:
    _stream.reset(token)


_STREAMS_KEPT = 256   # a communicator forgets the keys of ended threads beyond this many


class Communicator:
  """One rank of an authenticated ring of processes (a native communicator).

  Its collectives (:meth:`all_reduce`) belong to streams. Without a key they belong to its
  default stream, which only the thread that created it may issue on; any other thread is
  refused with CollectiveError at once, before anything is sent: a thread's name says nothing
  about which thread of another process it corresponds to (default names follow creation order),
  so two threads per rank would pair with the wrong partners and mix data. A thread that uses a
  communicator it did not create names its stream (``stream=`` or :func:`stream`), with a key
  that means the same work on every rank; the key travels in every collective's fingerprint, and
  one live thread holds a key at a time. Collectives of two streams issued in a different order
  on each rank raise on every rank, naming both streams. :meth:`close` may be called from any
  thread: it interrupts the collective in flight (CollectiveError "closed locally", within about
  20 ms) and every queued one."""

  def __init__(self, name: str, rank: int, size: int, tenant: str, provider: str, native_comm):
    self.name, self.rank, self.size = name, rank, size
    self.tenant, self.provider = tenant, provider
    self._native = native_comm
    self.comm_id = int(native_comm.id)
    self.endpoint = native_comm.endpoint
    self._creator = threading.current_thread()
    self._streams: dict[str, threading.Thread] = {}   # stream key -> the thread issuing on it
    self._owner_lock = threading.Lock()
    _live.add(self)

  def _claim(self, key: str | None) -> str:
    """The stream text of the calling thread's collective ("" for the default stream), or
    CollectiveError at once when this thread may not issue on that stream."""
    me = threading.current_thread()
    where = f"communicator {self.name!r} (rank {self.rank} of {self.size})"
    if key is None:
      if me is self._creator:
        return ""
      raise errors.CollectiveError(
          f"{where} was created by thread {self._creator.name!r}; thread {me.name!r} issues a "
          "collective on it without a stream key. A thread's name does not say which thread of "
          "another process it pairs with (default names such as 'Thread-1 (worker)' follow the "
          "order threads were created), so collectives of threads other than the creator could "
          "be paired with another thread's collectives on the other ranks (mixed data). Pass "
          "stream='<key>' naming this thread's work, the same key on every rank (or wrap the "
          "thread's body in transport.stream(key)), or give the thread a communicator of its "
          "own (create_communicator in that thread, with a name for its work).")
    with self._owner_lock:
      owner = self._streams.get(key)
      if owner is None or owner is me or not owner.is_alive():
        if owner is None and len(self._streams) >= _STREAMS_KEPT:   # keys of ended threads go
          self._streams = {k: t for k, t in self._streams.items() if t.is_alive()}
        self._streams[key] = me
        return callsite.wire_text(key, callsite.STREAM_TEXT_BYTES)
    raise errors.CollectiveError(
        f"stream {key!r} of {where} is issued by thread {owner.name!r}; thread {me.name!r} may "
        "not issue on it too: the collectives of two threads would be queued in a different "
        "order on each rank and paired with the wrong partners (mixed data). Give each thread "
        "a stream key of its own, or its own communicator.")

  def __repr__(self) -> str:
    return (f"Communicator({self.name!r}, rank={self.rank}, size={self.size}, "
            f"tenant={self.tenant!r}, provider={self.provider!r}, id={self.comm_id})")

  def all_reduce(self, x: np.ndarray, op: str = "sum", *, site: tuple[int, str] | None = None,
                 tag: int | str | None = None, stream: str | None = None) -> np.ndarray:
    """Ring all-reduce of a host array (outside jit: tests, benchmarks). Returns a new array.

    ``site`` (tag, text) names the call site carried in every frame; default
    :func:`~dtenjax._src.net.callsite.call_site`. ``tag`` (see
    :func:`~dtenjax._src.net.callsite.tag_value`) tells apart collectives with the same call
    stack, e.g. the iterations of a loop: every rank must pass the same one for the same
    collective. ``stream``: the key of the issuing thread's stream (default: the one of an
    enclosing :func:`stream` block, else the communicator's default stream, which only its
    creating thread may use; see :class:`Communicator`).
    """
    stream = _stream.get() if stream is None else _check_stream(stream)
    x = np.ascontiguousarray(x)
    dtype_codes, op_codes = native.codes()
    if x.dtype not in dtype_codes:
      raise errors.CollectiveError(
          f"host all-reduce of dtype {x.dtype} is not supported; use one of "
          f"{sorted(str(d) for d in dtype_codes)}.")
    if op not in op_codes:
      raise errors.CollectiveError(f"op={op!r} is not one of {sorted(op_codes)}.")
    value, suffix = callsite.tag_value(tag)
    if value is None:
      raise errors.CollectiveError(
          f"Communicator.all_reduce got tag={tag!r}: it takes a Python int or str tag (an array "
          "tag belongs inside jit: hostcoll.all_reduce).")
    base, text = callsite.call_site() if site is None else site
    text += suffix
    sig = f"{x.dtype.name}{list(x.shape)}"
    site_id = callsite.site_id(text, sig, base=base)
    native.register_site(site_id, text, sig)
    stream_text = self._claim(stream)
    out = np.empty_like(x)
    try:
      with _native_call():
        self._native.all_reduce(x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8),
                                out.size, dtype_codes[x.dtype], op_codes[op], site_id, value,
                                stream_text)
    except errors.ExtensionUnavailableError as e:
      raise _peer_errors(e) from None
    return out

  def close(self) -> None:
    """Closes this communicator (from any thread): its collective in flight and the queued ones
    fail with CollectiveError "closed locally", a connect in progress gives up, its worker thread
    is joined. Closing twice is harmless."""
    self._native.close()
    _live.discard(self)

  @property
  def closed(self) -> bool:
    return bool(self._native.closed)


def create_local_comm(rank: int, size: int, creds: credentials.JobCredentials, *,
                      tenant: str = "default", provider: str = "tcp",
                      timeout_s: float | None = None, bind_address: str | None = None,
                      name: str = "local",
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
  if not isinstance(creds, credentials.JobCredentials):
    raise errors.ConfigurationError(f"creds must be JobCredentials, got {type(creds).__name__}.")
  settings = CommSettings.from_env(timeout_s=timeout_s, bind_address=bind_address,
                                   segment_bytes=segment_bytes,
                                   handshake_timeout_s=handshake_timeout_s,
                                   max_pending_handshakes=max_pending_handshakes)
  built = providers.built_providers()
  if provider not in built:
    raise errors.ExtensionUnavailableError(
        f"transport provider {provider!r} is not in this build: pass provider= one of {built} "
        "(or leave it to providers.select_provider, which DTENJAX_TRANSPORT steers).")
  if size > 1:
    native.ensure_crypto()   # fail closed: raises saying libcrypto is missing and how to install it
  if provider == "verbs":
    rdma.load_library()   # DTENJAX_IBVERBS_LIBRARY
    native.transport().verbs.set_device(config.get_str("DTENJAX_IB_DEVICE"))
  comm = native.transport().Comm(creds.job_id, rank, size, bytes(creds.secret),
                                 settings.timeout_s, tenant, settings.bind_address, provider,
                                 settings.segment_bytes, settings.handshake_timeout_s,
                                 settings.max_pending_handshakes)
  return Communicator(name, rank, size, tenant, provider, comm)


def connect(comm: Communicator, next_endpoint: str) -> None:
  """Connects ``comm`` to the next rank's endpoint and accepts the previous rank (blocking), then
  checks the whole ring (a one-element all-reduce, collective #0). Once per communicator: after a
  failure every rank of the ring raises with the first cause, and a second call raises too."""
  checks.name("next_endpoint", next_endpoint)
  try:
    with _native_call():
      comm._native.connect_ring(next_endpoint)
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
  import jax
  rank = jax.process_index() if rank is None else rank
  size = jax.process_count() if size is None else size
  store = store or kvstore.default()
  provider = provider or providers.select_provider()[0]
  creds = credentials.job_credentials(store, process_index=rank)
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
