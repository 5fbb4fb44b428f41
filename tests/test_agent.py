"""Runtime agent: load reports published to the store and read back for the planner."""

import threading

import numpy as np
import pytest

from dtenjax._src.net import agent
from dtenjax._src import errors
from dtenjax._src.net import kvstore
from dtenjax._src.net import credentials
from tests.net_helpers import native_ring, requires_native, run_ranks


def test_publish_and_read_peer_loads():
  store = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=1)
  a0 = agent.Agent(0, store=store, topology={"devices": ["cpu:0"]})
  a1 = agent.Agent(1, store=store, topology={"devices": ["cpu:1"]})
  a0.publish()
  a1.publish()
  store.set("dtenjax/agent/garbage", "{not json", overwrite=True)
  loads = agent.read_peer_loads(store)
  assert sorted(loads) == [0, 1]
  assert loads[1].topology == {"devices": ["cpu:1"]}
  assert loads[0].age_s() < 5
  with pytest.raises(errors.ConfigurationError, match="process_index=-1"):
    agent.LoadReport(-1, "h", 1, 0.0, 0, 0, 0, 0, 0)


@requires_native
def test_reports_reflect_transport_load():
  store = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=1)
  ag = agent.Agent(0, store=store, topology={})
  before = ag.publish()
  comms, errs = native_ring(2, credentials.JobCredentials(11, b"g" * 32))
  assert not errs
  _, errs, _ = run_ranks([lambda c=c: c.all_reduce(np.ones(50_000, np.float32)) for c in comms])
  assert errs == [None, None]
  after = ag.publish()
  assert after.bytes_sent - before.bytes_sent >= 2 * 100_000   # each rank sends ~n/2 floats x2
  assert after.collectives - before.collectives == 2
  assert after.ops_in_flight == 0 and after.queue_depth == 0
  assert agent.read_peer_loads(store)[0].bytes_sent == after.bytes_sent
  for c in comms:
    c.close()


class _CountingClient(kvstore.InMemoryClient):
  """The in-memory store, counting the writes so a test can wait for the n-th."""

  def __init__(self):
    super().__init__()
    self.writes = 0
    self.written = threading.Condition()

  def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
    super().key_value_set(key, value, allow_overwrite)
    with self.written:
      self.writes += 1
      self.written.notify_all()

  def wait_for_writes(self, n: int, timeout_s: float = 20.0) -> None:
    with self.written:
      if not self.written.wait_for(lambda: self.writes >= n, timeout=timeout_s):
        pytest.fail(f"the agent published {self.writes} report(s) in {timeout_s:g} s, "
                    f"not {n}", pytrace=False)


def test_periodic_publishing():
  client = _CountingClient()
  store = kvstore.KVStore(client, timeout_s=1)
  ag = agent.Agent(3, store=store, topology={}).start(interval_s=0.05)
  client.wait_for_writes(3)           # three periods have passed, each with one report
  ag.stop()
  published = ag.published
  assert published >= 3
  assert 3 in agent.read_peer_loads(store)
  assert ag.published == published    # stopped: no report after stop() returned
  for bad in (0, -1, float("nan"), float("inf")):
    with pytest.raises(errors.ConfigurationError, match="interval_s="):
      agent.Agent(0, store=store, topology={}).start(interval_s=bad)


@requires_native
def test_local_topology_says_why_tcp():
  topo = agent.local_topology()
  assert topo["devices"] and topo["provider"] in ("tcp", "verbs")
  if not topo["nics"]:
    assert topo["provider"] == "tcp" and topo["rdma_unavailable_reason"]


def test_docstring_claims_only_what_is_true():
  """Nothing in dtenjax's planner reads peer loads; the module must not say it does."""
  import inspect
  from dtenjax._src.planning import planner
  assert "read_peer_loads" not in inspect.getsource(planner)
  assert "planner reads" not in agent.__doc__ and "does not read it" in agent.__doc__
