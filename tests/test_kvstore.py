"""The coordination-store wrapper: namespacing, timeouts that name the key, all-gather."""

import threading

import pytest

from dtenjax._src import errors
from dtenjax._src.net import kvstore


def test_set_get_dir_increment():
  s = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=1)
  k = s.key("a", "b")
  assert k == "dtenjax/a/b"
  s.set(k, "1")
  assert s.get(k) == "1"
  with pytest.raises(errors.TransportError, match="overwrite=True"):
    s.set(k, "2")
  s.set(k, "2", overwrite=True)
  s.set(s.key("a", "c"), "3")
  assert s.dir("dtenjax/a") == {"dtenjax/a/b": "2", "dtenjax/a/c": "3"}
  assert s.increment("dtenjax/n") == 1 and s.increment("dtenjax/n", 5) == 6
  with pytest.raises(errors.ConfigurationError, match="contain '/'"):
    s.key("x/y")


def test_bytes_and_delete():
  # the elastic memory tier's calls: chunks of a record as bytes, deleted once moved
  s = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=1)
  s.set_bytes("dtenjax/r/0", b"\x00\xffab")
  assert s.get_bytes("dtenjax/r/0") == b"\x00\xffab"
  s.delete("dtenjax/r/0")
  s.delete("dtenjax/r/0")                  # deleting what is gone is no error
  assert s.dir("dtenjax/r") == {}
  with pytest.raises(errors.CollectiveTimeoutError, match="waited 0.1 s for key .dtenjax/r/0"):
    s.get_bytes("dtenjax/r/0", timeout_s=0.1)


def test_get_times_out_naming_the_key():
  s = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=0.2)
  with pytest.raises(errors.CollectiveTimeoutError, match="timeout: waited 0.2 s for key .dtenjax/missing"):
    s.get("dtenjax/missing")


def test_exchange_is_an_all_gather():
  client = kvstore.InMemoryClient()
  out = {}
  def run(r):
    out[r] = kvstore.KVStore(client, timeout_s=5).exchange("ep", r, 3, f"addr{r}")
  ts = [threading.Thread(target=run, args=(r,)) for r in range(3)]
  [t.start() for t in ts]
  [t.join(10) for t in ts]
  assert out == {r: ["addr0", "addr1", "addr2"] for r in range(3)}


def test_default_store_without_jax_distributed_is_local():
  s = kvstore.default()
  assert not s.distributed
  s.set(s.key("local-test", "x"), "v", overwrite=True)
  assert s.get(s.key("local-test", "x")) == "v"


class _Failing(kvstore.InMemoryClient):
  """A client whose blocking get fails the way jax's coordination client does."""

  def __init__(self, exc):
    super().__init__()
    self.exc = exc

  def blocking_key_value_get(self, key, timeout_in_ms):
    raise self.exc


class _NoGet:
  """A client from a JAX whose API moved: it lacks blocking_key_value_get."""

  def key_value_set(self, key, value, allow_overwrite=False):
    pass


@pytest.mark.parametrize("exc,cls,fragment", [
    (RuntimeError("DEADLINE_EXCEEDED: Barrier timed out"), errors.CollectiveTimeoutError,
     "coordination store timeout: waited 0.5 s for key 'dtenjax/k'"),
    (TimeoutError("slow"), errors.CollectiveTimeoutError, "coordination store timeout"),
    (RuntimeError("UNAVAILABLE: failed to connect to all addresses"), errors.TransportError,
     "coordination store error during get of key 'dtenjax/k': RuntimeError: UNAVAILABLE"),
    (RuntimeError("INTERNAL: the service crashed"), errors.TransportError,
     "process 0\\) may have exited"),
])
def test_errors_are_reported_by_kind(exc, cls, fragment):
  s = kvstore.KVStore(_Failing(exc), timeout_s=0.5)
  with pytest.raises(cls, match=fragment) as e:
    s.get("dtenjax/k")
  if cls is errors.TransportError:
    assert not isinstance(e.value, errors.CollectiveTimeoutError)   # not called a timeout


def test_missing_client_is_its_own_kind(monkeypatch):
  with pytest.raises(kvstore.MissingClientError, match="changed its private coordination API"):
    kvstore.KVStore(_NoGet(), timeout_s=0.5).get("dtenjax/k")
  # An exchange among several processes without jax.distributed fails at once, saying what to do.
  with pytest.raises(kvstore.MissingClientError, match="call jax.distributed.initialize"):
    kvstore.KVStore(timeout_s=30).exchange("ns", 0, 2, "v")
  # jax.distributed initialised for 4 processes, then shut down: no silent fallback.
  from jax._src import distributed
  monkeypatch.setattr(distributed.global_state, "num_processes", 4)
  monkeypatch.setattr(distributed.global_state, "client", None)
  with pytest.raises(kvstore.MissingClientError, match="initialised for 4 processes"):
    kvstore.default().get("dtenjax/k")
  assert issubclass(kvstore.MissingClientError, errors.TransportError)
  assert not issubclass(kvstore.MissingClientError, errors.CollectiveTimeoutError)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf")])
def test_timeouts_must_be_finite_and_positive(bad):
  with pytest.raises(errors.ConfigurationError, match="timeout"):
    kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=bad).get("dtenjax/x")
