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


def test_get_times_out_naming_the_key():
  s = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=0.2)
  with pytest.raises(errors.CollectiveTimeoutError, match="dtenjax/missing"):
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
