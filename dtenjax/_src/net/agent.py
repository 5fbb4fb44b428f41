"""Per-process runtime agent: publishes this process's topology and transport load to the
coordination store, and reads every peer's back.

The report lives under ``dtenjax/agent/<process_index>`` (overwritten on each publish) as JSON:
which devices and RDMA NICs this process has, which transport provider it uses, and its load —
bytes moved, collectives completed, operations in flight and queued on its communicators.
:func:`read_peer_loads` returns every process's latest report, for diagnostics and for tools
that look for skew (a straggler has a deep queue). dtenjax's own planner does not read it today:
algorithm choice depends only on the topology and message size. Publishing is periodic on a
daemon thread (:meth:`Agent.start`) or explicit (:meth:`Agent.publish`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any

from dtenjax._src import errors
from dtenjax._src.net import checks
from dtenjax._src.net import kvstore
from dtenjax._src.net import native
from dtenjax._src.net import providers

NAMESPACE = "agent"


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """One process's published state."""
  process_index: int
  hostname: str
  pid: int
  timestamp: float
  bytes_sent: int
  bytes_received: int
  collectives: int
  ops_in_flight: int
  queue_depth: int
  topology: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.process_index < 0:
      raise errors.ConfigurationError(
          f"LoadReport.process_index={self.process_index} must be >= 0.")

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self), sort_keys=True)

  @classmethod
  def from_json(cls, text: str) -> "LoadReport":
    d = json.loads(text)
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

  def age_s(self, now: float | None = None) -> float:
    return (time.time() if now is None else now) - self.timestamp


def local_topology() -> dict[str, Any]:
  """What this process contributes to the job's topology: devices, RDMA NICs, provider."""
  import jax
  from dtenjax._src.net import rdma
  nics = rdma.discover_nics()
  provider, why = providers.select_provider(list(nics))
  return {
      "devices": [f"{d.platform}:{d.id}" for d in jax.local_devices()],
      "nics": [{k: n[k] for k in ("name", "port", "state", "link_layer", "rate_gbit_s",
                                  "bandwidth_gbps")} for n in nics],
      "provider": provider, "provider_reason": why,
      "rdma_unavailable_reason": rdma.unavailable_reason(),
  }


def current_load() -> dict[str, int]:
  if not native.is_available():
    return {k: 0 for k in ("bytes_sent", "bytes_received", "collectives", "ops_in_flight",
                           "queue_depth")}
  c = native.counters()
  return {k: c[k] for k in ("bytes_sent", "bytes_received", "collectives", "ops_in_flight",
                            "queue_depth")}


class Agent:
  """Publishes this process's :class:`LoadReport`; ``start`` does so every ``interval_s``."""

  def __init__(self, process_index: int | None = None, *, store: kvstore.KVStore | None = None,
               topology: dict[str, Any] | None = None):
    if process_index is None:
      import jax
      process_index = jax.process_index()
    self.process_index = process_index
    self.store = store or kvstore.default()
    self._topology = topology
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.published = 0

  def report(self) -> LoadReport:
    if self._topology is None:
      self._topology = local_topology()
    return LoadReport(process_index=self.process_index, hostname=socket.gethostname(),
                      pid=os.getpid(), timestamp=time.time(), topology=self._topology,
                      **current_load())

  def publish(self) -> LoadReport:
    r = self.report()
    self.store.set(self.store.key(NAMESPACE, self.process_index), r.to_json(), overwrite=True)
    self.published += 1
    return r

  def start(self, interval_s: float = 5.0) -> "Agent":
    interval_s = checks.number("interval_s", interval_s, 0, 86400.0, lo_open=True,
                               hint="seconds between publishes")
    if self._thread is not None:
      return self
    self.publish()

    def loop():
      while not self._stop.wait(interval_s):
        try:
          self.publish()
        except errors.DtenjaxError:
          pass   # the store went away (job ending); the next read sees a stale timestamp

    self._thread = threading.Thread(target=loop, name="dtenjax-agent", daemon=True)
    self._thread.start()
    return self

  def stop(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
      self._thread = None


def read_peer_loads(store: kvstore.KVStore | None = None) -> dict[int, LoadReport]:
  """Every published report, by process index. Empty if nobody published."""
  store = store or kvstore.default()
  out: dict[int, LoadReport] = {}
  for key, value in store.dir(kvstore.PREFIX + NAMESPACE).items():
    try:
      r = LoadReport.from_json(value)
    except (ValueError, TypeError, KeyError):
      continue   # a foreign or half-written key: skip it, never crash the planner
    out[r.process_index] = r
  return dict(sorted(out.items()))
