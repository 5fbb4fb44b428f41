"""The one wrapper around jax.distributed's coordination key-value store.

JAX has no public key-value API; the coordination client lives at
``jax._src.distributed.global_state.client`` (a ``DistributedRuntimeClient`` with ``key_value_set``,
``blocking_key_value_get``, ``key_value_dir_get``, ``key_value_increment``, ``wait_at_barrier``).
Everything in dtenjax that exchanges endpoints, secrets or load reports goes through
:class:`KVStore`, so a JAX change touches this file only. Every wait has a timeout and ends in a
:class:`~dtenjax._src.errors.CollectiveTimeoutError` naming the key it waited for.

Keys are namespaced under ``dtenjax/``. A process-local :class:`InMemoryClient` stands in when
there is one process (or in unit tests).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from dtenjax._src import config
from dtenjax._src import errors

PREFIX = "dtenjax/"


class Client(Protocol):
  """What dtenjax needs of a coordination client (DistributedRuntimeClient's method names)."""

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None: ...
  def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...
  def key_value_dir_get(self, key: str) -> list[tuple[str, str]]: ...
  def key_value_increment(self, key: str, increment: int) -> int: ...
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

  def wait_at_barrier(self, barrier_id: str, timeout_in_ms: int, process_ids: Any = None) -> None:
    del barrier_id, timeout_in_ms, process_ids   # one process: always complete


_local = InMemoryClient()


def coordination_client() -> Any | None:
  """jax.distributed's coordination client, or None when jax.distributed is not initialised."""
  try:
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - a JAX that moved it; this is the one place to fix
    return None
  return getattr(distributed.global_state, "client", None)


class KVStore:
  """Typed, namespaced, always-bounded access to a coordination key-value store."""

  def __init__(self, client: Client | None = None, *, timeout_s: float | None = None):
    self._client = client
    self._timeout_s = timeout_s

  @property
  def client(self) -> Any:
    c = self._client if self._client is not None else coordination_client()
    return c if c is not None else _local

  @property
  def distributed(self) -> bool:
    """Whether this store is shared with other processes (not the in-memory stand-in)."""
    return self.client is not _local and not isinstance(self.client, InMemoryClient)

  def timeout_s(self) -> float:
    if self._timeout_s is not None:
      return self._timeout_s
    return config.get_float("DTENJAX_COLLECTIVE_TIMEOUT")

  @staticmethod
  def key(*parts: Any) -> str:
    bad = [p for p in parts if not str(p) or "/" in str(p)]
    if bad:
      raise errors.ConfigurationError(
          f"key-value store key parts {bad!r} are empty or contain '/'; pass plain names.")
    return PREFIX + "/".join(str(p) for p in parts)

  def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
    try:
      self.client.key_value_set(key, value, allow_overwrite=overwrite)
    except Exception as e:  # the client raises its own status errors
      raise errors.TransportError(
          f"could not set key {key!r} in the coordination store: {e}. If the key exists, pass "
          "overwrite=True or choose a fresh name.") from e

  def get(self, key: str, *, timeout_s: float | None = None) -> str:
    t = self.timeout_s() if timeout_s is None else timeout_s
    try:
      return self.client.blocking_key_value_get(key, int(t * 1000))
    except Exception as e:
      raise errors.CollectiveTimeoutError(
          f"waited {t:g} s for key {key!r} in the coordination store: {e}. Another process did "
          "not publish it: it died, is slower than DTENJAX_COLLECTIVE_TIMEOUT, or runs a "
          "different program.") from e

  def dir(self, prefix: str) -> dict[str, str]:
    """Every key under ``prefix`` (a directory), with values."""
    return dict(self.client.key_value_dir_get(prefix))

  def increment(self, key: str, by: int = 1) -> int:
    return int(self.client.key_value_increment(key, by))

  def barrier(self, name: str, *, timeout_s: float | None = None) -> None:
    t = self.timeout_s() if timeout_s is None else timeout_s
    try:
      self.client.wait_at_barrier(PREFIX + name, int(t * 1000))
    except Exception as e:
      raise errors.CollectiveTimeoutError(
          f"waited {t:g} s at barrier {name!r}: {e}. Some process did not reach it.") from e

  def exchange(self, namespace: str, rank: int, size: int, value: str, *,
               timeout_s: float | None = None) -> list[str]:
    """All-gather of one string per rank: publishes ``value`` and returns everyone's, by rank."""
    self.set(self.key(namespace, rank), value, overwrite=True)
    return [value if r == rank else self.get(self.key(namespace, r), timeout_s=timeout_s)
            for r in range(size)]


def default() -> KVStore:
  """The store of this process: jax.distributed's when initialised, else the in-memory one."""
  return KVStore()
