"""The coordination store an elastic component is handed: ``store=``, a :class:`KVStore`
(net/kvstore.py), or the deprecated ``client=``, jax's private coordination client.

``Watchdog`` and ``MemoryTier`` used to take the raw client (``client=``), which tied their
callers to ``jax._src.distributed``; ``KVStore`` is the project's one wrapper around it (typed,
bounded waits, errors by kind), so they take that now. ``client=`` is still accepted for one
release: it warns (``DeprecationWarning``) and is wrapped in a ``KVStore``.
"""

from __future__ import annotations

import warnings
from typing import Any

from dtenjax._src import errors
from dtenjax._src.net import kvstore


def given(what: str, store: Any, client: Any) -> kvstore.KVStore | None:
  """The store ``what`` was given (None when neither argument was), checked; ``client=`` warns.

  ``stacklevel`` 3 points the warning at the line that constructed ``what`` (this function's
  caller is its ``__init__``)."""
  if store is not None and client is not None:
    raise errors.ConfigurationError(
        f"{what}: got both store={store!r} and client={client!r}; pass store= only (client= is "
        "deprecated; dtenjax.elastic.KVStore(client) wraps a client).")
  if client is not None:
    warnings.warn(
        f"{what}(client=...) is deprecated and will be removed in the next release: pass "
        "store=dtenjax.elastic.KVStore(client), the project's wrapper around jax's coordination "
        "client (KVStore() is this process's own store).", DeprecationWarning, stacklevel=3)
    return kvstore.KVStore(client)
  if store is not None and not isinstance(store, kvstore.KVStore):
    raise errors.ConfigurationError(
        f"{what}: store={store!r} is of type {type(store).__name__}, not a KVStore; pass "
        "dtenjax.elastic.KVStore(client) for a coordination client, or "
        "dtenjax.elastic.KVStore() for this process's own store.")
  return store
