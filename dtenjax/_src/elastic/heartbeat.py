"""Heartbeats through the coordination store: every process publishes a counter every
``interval_s``; every process reads all counters back and declares a peer lost when its counter
has not moved for ``timeout_s``.

Two threads, so that a store call that blocks (the coordination service's host is stopped) is
itself detected: the *beat* thread publishes and reads (one ``set`` and one ``dir`` of
net/kvstore.py's store per beat), and the *watch* thread only compares clocks. A peer is lost when
its counter has not changed for ``timeout_s`` (a killed, stopped or cut-off process); process 0,
which hosts the coordination service, is also lost when the store does not answer for
``timeout_s`` or answers with an error. Detection takes at most ``timeout_s`` plus one beat after
the peer's last beat.

On a loss :class:`Watchdog` calls ``on_lost`` once with a :class:`dtenjax.ProcessLostError` that
names the lost ranks and what was waited for. A thread cannot interrupt the main thread inside an
XLA collective, so the default of :mod:`dtenjax.elastic`'s workers is to report and leave the
process (the launcher restarts the job); see docs/reliability.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from dtenjax._src import errors
from dtenjax._src.elastic import store as store_lib
from dtenjax._src.net import kvstore


class Watchdog:
  """Publishes this process's heartbeat and watches everyone else's.

  ``store``: the coordination store the beats go through (a ``KVStore``; default: this process's,
  jax.distributed's when initialised). ``client`` (deprecated: jax's raw coordination client,
  wrapped in a ``KVStore``) warns and goes in the next release."""

  def __init__(self, rank: int, world: int, on_lost: Callable[[errors.ProcessLostError], Any],
               *, store: kvstore.KVStore | None = None, client: Any = None,
               namespace: str = "dtenjax/elastic/hb", interval_s: float = 0.1,
               timeout_s: float = 10.0):
    given = store_lib.given("Watchdog", store, client)
    problems = []
    if not 0 <= rank < world:
      problems.append(f"rank={rank!r} must be in [0, world={world!r})")
    if not interval_s > 0 or not timeout_s > interval_s:
      problems.append(f"interval_s={interval_s!r} and timeout_s={timeout_s!r} must satisfy "
                      "0 < interval_s < timeout_s (a beat must fit in the timeout)")
    store = given if given is not None else kvstore.KVStore()
    if world > 1 and given is None and not store.distributed:
      problems.append(f"world={world!r} processes, but no store= was given and jax.distributed "
                      "is not initialised: the beats would stay in this process and every other "
                      "rank would be reported lost; call jax.distributed.initialize(...) first, "
                      "or pass store=dtenjax.elastic.KVStore(client)")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Watchdog cannot start:", problems))
    self.rank, self.world = rank, world
    self.on_lost = on_lost
    self.store = store
    self.namespace = namespace.rstrip("/")
    self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
    self.step = 0
    self._stop = threading.Event()
    self._lock = threading.Lock()
    now = time.monotonic()
    self._seen: dict[int, tuple[str, float]] = {r: ("", now) for r in range(world) if r != rank}
    self._store_ok = now
    self._store_error: str | None = None
    self._fired = False
    self._threads: list[threading.Thread] = []
    self.lost_error: errors.ProcessLostError | None = None

  def key(self, rank: int) -> str:
    return f"{self.namespace}/{rank}"

  def start(self) -> "Watchdog":
    for name, fn in (("beat", self._beat), ("watch", self._watch)):
      t = threading.Thread(target=fn, name=f"dtenjax-elastic-{name}", daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def stop(self) -> None:
    """Stops beating and watching (before a planned exit, so that peers finishing later are not
    taken for lost). A peer that goes on watching will see this process stop: stop only at a
    point every process reaches (the job's end)."""
    self._stop.set()

  def _beat(self) -> None:
    n = 0
    while not self._stop.is_set():
      n += 1
      try:
        self.store.set(self.key(self.rank), f"{n}:{self.step}", overwrite=True)
        entries = self.store.dir(self.namespace)
        now = time.monotonic()
        with self._lock:
          self._store_ok = now
          for r, (value, at) in self._seen.items():
            v = entries.get(self.key(r), "")
            if v != value:
              self._seen[r] = (v, now)
      except Exception as e:
        with self._lock:
          self._store_error = f"{type(e).__name__}: {e}"
      self._stop.wait(self.interval_s)

  def check(self, now: float | None = None) -> errors.ProcessLostError | None:
    """The loss seen at ``now`` (None when every peer is alive)."""
    now = time.monotonic() if now is None else now
    with self._lock:
      if self._store_error is not None or now - self._store_ok > self.timeout_s:
        what = (f"the coordination store answered {self._store_error}"
                if self._store_error is not None else
                f"the coordination store did not answer for {now - self._store_ok:.1f} s")
        return errors.ProcessLostError(
            f"process {self.rank}/{self.world}: lost rank 0 (it hosts jax.distributed's "
            f"coordination service): {what} (waited for the heartbeat keys under "
            f"{self.namespace}/, timeout {self.timeout_s:g} s)", [0])
      late = {r: now - at for r, (_, at) in self._seen.items() if now - at > self.timeout_s}
    if not late:
      return None
    ranks = ", ".join(f"{r} (last beat {late[r]:.1f} s ago, step {self._last_step(r)})"
                      for r in sorted(late))
    return errors.ProcessLostError(
        f"process {self.rank}/{self.world}: lost rank{'s' if len(late) > 1 else ''} {ranks}: "
        f"no heartbeat within {self.timeout_s:g} s (waited for key{'s' if len(late) > 1 else ''} "
        f"{', '.join(self.key(r) for r in sorted(late))} to change; the process was killed, "
        "stopped or cut off)", late)

  def _last_step(self, rank: int) -> str:
    value = self._seen[rank][0]
    return value.split(":", 1)[1] if ":" in value else "unknown"

  def _watch(self) -> None:
    period = min(self.interval_s, self.timeout_s / 50)
    while not self._stop.wait(period):
      err = self.check()
      if err is not None and not self._fired:
        self._fired = True
        self.lost_error = err
        self._stop.set()
        self.on_lost(err)
        return
