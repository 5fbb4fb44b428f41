"""The one wrapper around jax.distributed's coordination key-value store.

JAX has no public key-value API; the coordination client lives at
``jax._src.distributed.global_state.client`` (a ``DistributedRuntimeClient`` with ``key_value_set``,
``blocking_key_value_get``, their ``_bytes`` forms, ``key_value_dir_get``, ``key_value_increment``,
``key_value_delete``, ``wait_at_barrier``). Everything in dtenjax that exchanges endpoints,
secrets, load reports, heartbeats or the elastic memory tier's records goes through
:class:`KVStore`, so a JAX change touches this file only (gpu/p2p.py, one layer down beside net,
reads the client through jaxapi). Failures are reported by kind:

* a wait that ran out: :class:`~dtenjax._src.errors.CollectiveTimeoutError` naming the key and
  the seconds waited;
* no coordination client (``jax.distributed`` was initialised for several processes and then shut
  down, or this JAX's client lacks a method dtenjax uses; or a cross-process exchange without
  ``jax.distributed``): :class:`~dtenjax._src.errors.TransportError` starting "no coordination
  client", saying what to call;
* anything else the client reports (the coordination service died or is unreachable, a key that
  already exists, ...): :class:`~dtenjax._src.errors.TransportError` starting "coordination store
  error", with the client's own message.

Keys are namespaced under ``dtenjax/``. A process-local :class:`InMemoryClient` stands in when
there is one process (or in unit tests).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Protocol

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import jaxapi

PREFIX = "dtenjax/"


class Client(Protocol):
  """What dtenjax needs of a coordination client (DistributedRuntimeClient's method names)."""

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
  def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
  def key_value_increment(self, key: str, increment: int) -> int: ...
  def key_value_set_bytes(self, key: str, value: bytes, allow_overwrite: bool = False) -> None: ...
  def blocking_key_value_get_bytes(self, key: str, timeout_in_ms: int) -> bytes: ...
  def key_value_delete(self, key: str) -> None: ...
  def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int,
                      process_ids: Any = None) -> None: ...


class InMemoryClient:
  """A single-process stand-in with the coordination client's semantics (for one process/tests)."""

  def __init__(self):
    self._cv = threading.Condition()
    self._data: dict[str, str] = {}

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    with self._cv:
      if key in self._data and not allow_overwrite:
        raise RuntimeError(f"ALREADY_EXISTS: key {key!r} is already set")
      self._data[key] = value
      self._cv.notify_all()

  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
    with self._cv:
      if not self._cv.wait_for(lambda: key in self._data, timeout=timeout_in_ms / 1000):
        raise RuntimeError(f"DEADLINE_EXCEEDED: key {key!r} not set")
      return self._data[key]

  def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
    d = key if key.endswith("/") else key + "/"
    with self._cv:
      return sorted((k, v) for k, v in self._data.items() if k.startswith(d))

  def key_value_increment(self, key: str, increment: int) -> int:
    with self._cv:
      v = int(self._data.get(key, "0")) + increment
      self._data[key] = str(v)
      self._cv.notify_all()
      return v

  key_value_set_bytes = key_value_set               # values are kept as given
  blocking_key_value_get_bytes = blocking_key_value_get

  def key_value_delete(self, key: str) -> None:
    with self._cv:
      self._data.pop(key, None)

  def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int, process_ids: Any = None) -> None:
    del barrier_id, timeout_in_ms, process_ids   # one process: always complete


_local = InMemoryClient()


coordination_client = jaxapi.coordination_client   # the raw client (None before initialize)


def _initialised_processes() -> int:
  """How many processes jax.distributed was initialised for (1 if never)."""
  try:
    return int(getattr(jaxapi.distributed_state(), "num_processes", 1) or 1)
  except (TypeError, ValueError):
    return 1


class MissingClientError(errors.TransportError):
  """There is no coordination client to talk to (see the message for what to call)."""


def _store_error(op: str, key: str, e: Exception, timeout_s: float | None = None) -> Exception:
  """The dtenjax error for a client failure, by kind."""
  text = f"{type(e).__name__}: {e}"
  if isinstance(e, (AttributeError, TypeError)):
    return MissingClientError(
        f"no coordination client usable for {op} of key {key!r}: jax's client failed with "
        f"{text}. This JAX changed its private coordination API; dtenjax/_src/net/kvstore.py is "
        "the one place to update.")
  if isinstance(e, TimeoutError) or "DEADLINE_EXCEEDED" in str(e):
    waited = f"waited {timeout_s:g} s" if timeout_s is not None else "timed out"
    return errors.CollectiveTimeoutError(
        f"coordination store timeout: {waited} for key {key!r} ({op}): {e}. Another process did "
        "not publish it: it died, is slower than DTENJAX_COLLECTIVE_TIMEOUT, or runs a different "
        "program.")
  hint = ("If the key exists, pass overwrite=True or choose a fresh name."
          if "ALREADY_EXISTS" in str(e) else
          "The coordination service (hosted by process 0) may have exited or be unreachable.")
  return errors.TransportError(
      f"coordination store error during {op} of key {key!r}: {text}. {hint}")


class KVStore:
  """Typed, namespaced, always-bounded access to a coordination key-value store."""

  def __init__(self, client: Client | None = None, *, timeout_s: float | None = None):
    self._client = client
    self._timeout_s = timeout_s

  @property
  def client(self) -> Any:
    if self._client is not None:
      return self._client
    c = coordination_client()
    if c is not None:
      return c
    n = _initialised_processes()
    if n > 1:
      raise MissingClientError(
          f"no coordination client: jax.distributed was initialised for {n} processes but its "
          "client is gone (jax.distributed.shutdown() was called?); dtenjax's cross-process "
          "calls need it running.")
    return _local

  @property
  def distributed(self) -> bool:
    """Whether this store is shared with other processes (not the in-memory stand-in)."""
    return self.client is not _local and not isinstance(self.client, InMemoryClient)

  def timeout_s(self) -> float:
    t = self._timeout_s if self._timeout_s is not None else config.get_float(
        "DTENJAX_COLLECTIVE_TIMEOUT")
    if not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
      raise errors.ConfigurationError(
          f"key-value store timeout {t!r} must be a finite number of seconds > 0 (argument "
          "timeout_s or DTENJAX_COLLECTIVE_TIMEOUT).")
    return float(t)

  @staticmethod
  def key(*parts: Any) -> str:
    bad = [p for p in parts if not str(p) or "/" in str(p)]
    if bad:
      raise errors.ConfigurationError(
          f"key-value store key parts {bad!r} are empty or contain '/'; pass plain names.")
    return PREFIX + "/".join(str(p) for p in parts)

  def _call(self, op: str, key: str, fn, timeout_s: float | None = None):
    client = self.client   # MissingClientError propagates as is
    try:
      return fn(client)
    except errors.DtenjaxError:
      raise
    except Exception as e:
      raise _store_error(op, key, e, timeout_s) from e

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    self._call("set", key, lambda c: c.key_value_set(key, value, allow_overwrite=overwrite))

  def get(self, key: str, *, timeout_s: float | None = None) -> str:
    t = self._wait_s(timeout_s)
    return self._call("get", key, lambda c: c.blocking_key_value_get(key, int(t * 1000)), t)

  def set_bytes(self, key: str, value: bytes) -> None:
    self._call("set", key, lambda c: c.key_value_set_bytes(key, value))

  def get_bytes(self, key: str, *, timeout_s: float | None = None) -> bytes:
    t = self._wait_s(timeout_s)
    return self._call("get", key, lambda c: c.blocking_key_value_get_bytes(key, int(t * 1000)),
                      t)

  def delete(self, key: str) -> None:
    self._call("delete", key, lambda c: c.key_value_delete(key))

  def _wait_s(self, timeout_s: float | None) -> float:
    """A call's wait: ``timeout_s`` (validated) or this store's."""
    return self.timeout_s() if timeout_s is None else KVStore(timeout_s=timeout_s).timeout_s()

  def dir(self, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` (a directory), with values."""
    return dict(self._call("dir", prefix, lambda c: c.key_value_dir_get(prefix)))

  def increment(self, key: str, by: int = 1) -> int:
    return int(self._call("increment", key, lambda c: c.key_value_increment(key, by)))

  def barrier(self, name: str, *, timeout_s: float | None = None) -> None:
    t = self._wait_s(timeout_s)
    self._call("barrier", PREFIX + name,
               lambda c: c.wait_at_barrier(PREFIX + name, int(t * 1000)), t)

  def exchange(self, namespace: str, rank: int, size: int, value: str, *,
               timeout_s: float | None = None) -> list[str]:
    """All-gather of one string per rank: publishes ``value`` and returns everyone's, by rank."""
    if size > 1 and self._client is None and self.client is _local:
      raise MissingClientError(
          f"no coordination client: exchanging {namespace!r} among {size} processes needs "
          "jax.distributed; call jax.distributed.initialize(...) in every process first.")
    self.set(self.key(namespace, rank), value, overwrite=True)
    return [value if r == rank else self.get(self.key(namespace, r), timeout_s=timeout_s)
            for r in range(size)]


def default() -> KVStore:
  """The store of this process: jax.distributed's when initialised, else the in-memory one."""
  return KVStore()
