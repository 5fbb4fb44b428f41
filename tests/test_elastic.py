"""dtenjax.elastic in one process: the watchdog's detection and its error, the in-memory tier's
records, ring replicas and restore onto another mesh, which step a smaller job continues from,
the launcher's argument checks."""

import os
import threading
import time
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax
import dtenjax.checkpoint as ckpt
import dtenjax.elastic
from dtenjax._src.elastic import launcher, memory
from dtenjax._src.net import kvstore


# --- heartbeats -----------------------------------------------------------------------------------

def test_a_silent_peer_is_named_within_the_timeout_plus_ten_percent():
  client = kvstore.InMemoryClient()
  lost = []
  got = threading.Event()
  dogs = [dtenjax.elastic.Watchdog(r, 3, (lambda e: (lost.append((time.monotonic(), e)),
                                                    got.set())) if r == 0 else (lambda e: None),
                                   store=kvstore.KVStore(client), interval_s=0.05,
                                   timeout_s=1.0).start()
          for r in range(3)]
  time.sleep(1.5)                       # longer than the timeout: everyone alive, nobody lost
  assert not lost
  dogs[2].step = 7
  time.sleep(0.2)
  stopped = time.monotonic()
  dogs[2].stop()                        # rank 2 goes silent (as a SIGSTOPped process does)
  assert got.wait(5)
  dogs[1].stop()
  t, err = lost[0]
  assert isinstance(err, dtenjax.ProcessLostError) and err.lost == (2,)
  assert 0.9 <= t - stopped <= 1.1, t - stopped
  msg = str(err)
  assert "process 0/3: lost rank 2" in msg and "step 7" in msg
  assert "dtenjax/elastic/hb/2" in msg and "within 1 s" in msg


def test_a_store_that_errs_is_the_loss_of_rank_0():
  class Broken(kvstore.InMemoryClient):
    def key_value_dir_get(self, key):
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
  errs = []
  dog = dtenjax.elastic.Watchdog(1, 2, errs.append, store=kvstore.KVStore(Broken()),
                                 interval_s=0.05, timeout_s=1.0).start()
  deadline = time.monotonic() + 5
  while not errs and time.monotonic() < deadline:
    time.sleep(0.02)
  dog.stop()
  assert errs and errs[0].lost == (0,)
  assert "lost rank 0 (it hosts jax.distributed's coordination service)" in str(errs[0])
  assert "UNAVAILABLE" in str(errs[0])


def test_watchdog_arguments_are_checked():
  with pytest.raises(dtenjax.ConfigurationError) as e:
    dtenjax.elastic.Watchdog(3, 2, print, interval_s=1, timeout_s=0.5)
  assert "rank=3" in str(e.value) and "interval_s=1" in str(e.value)


# --- store= (a KVStore) and the deprecated client= ------------------------------------------------

def _make(kind, tmp_path, **kw):
  if kind == "Watchdog":
    return dtenjax.elastic.Watchdog(0, 2, print, interval_s=0.05, timeout_s=1.0, **kw)
  return dtenjax.elastic.MemoryTier(str(tmp_path / "mem"), 0, 2, timeout_s=1.0, **kw)


@pytest.mark.parametrize("kind", ["Watchdog", "MemoryTier"])
def test_store_takes_a_kvstore_without_a_warning(kind, tmp_path):
  store = kvstore.KVStore(kvstore.InMemoryClient())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    obj = _make(kind, tmp_path, store=store)
  assert obj.store is store


@pytest.mark.parametrize("kind", ["Watchdog", "MemoryTier"])
def test_client_still_works_for_a_release_and_warns_at_the_callers_line(kind, tmp_path):
  client = kvstore.InMemoryClient()
  with pytest.warns(DeprecationWarning, match=rf"{kind}\(client=...\) is deprecated.*"
                                              r"store=dtenjax\.elastic\.KVStore\(client\)") as rec:
    obj = _make(kind, tmp_path, client=client)
  assert [w.filename for w in rec] == [__file__]      # the line that passed client=
  assert isinstance(obj.store, kvstore.KVStore) and obj.store.client is client
  assert dtenjax.elastic.KVStore is kvstore.KVStore       # the replacement is public


def test_a_watchdog_given_a_client_beats_through_it():
  client = kvstore.InMemoryClient()
  with pytest.warns(DeprecationWarning):
    dog = dtenjax.elastic.Watchdog(0, 2, print, client=client, interval_s=0.05, timeout_s=1.0)
  dog.step = 3
  dog.start()
  deadline = time.monotonic() + 5
  while not client.key_value_dir_get("dtenjax/elastic/hb") and time.monotonic() < deadline:
    time.sleep(0.02)
  dog.stop()
  [(key, value)] = client.key_value_dir_get("dtenjax/elastic/hb")
  assert key == "dtenjax/elastic/hb/0" and value.endswith(":3")


def test_a_memory_tier_given_a_client_moves_its_replica_through_it(tmp_path):
  client = kvstore.InMemoryClient()
  root = str(tmp_path / "mem")
  with pytest.warns(DeprecationWarning):
    tiers = [memory.MemoryTier(root, r, 2, client=client, timeout_s=10) for r in range(2)]
  for r, t in enumerate(tiers):
    t.snapshot(5, {"x": np.full(4, r, np.int32), "n": 5})
  for t in tiers:
    t.wait()
  assert sorted(os.listdir(memory.holder(root, 1))) == ["own.1.5", "replica.0.5"]


@pytest.mark.parametrize("kind", ["Watchdog", "MemoryTier"])
def test_store_and_client_together_or_a_raw_client_as_store_are_refused(kind, tmp_path):
  client = kvstore.InMemoryClient()
  with pytest.raises(dtenjax.ConfigurationError,
                     match=rf"{kind}: got both store=.* and client=.*; pass store= only"):
    _make(kind, tmp_path, store=kvstore.KVStore(client), client=client)
  with pytest.raises(dtenjax.ConfigurationError,
                     match=rf"{kind}: store=.* is of type InMemoryClient, not a KVStore; pass "
                           r"dtenjax\.elastic\.KVStore\(client\)"):
    _make(kind, tmp_path, store=client)


# --- the in-memory tier -------------------------------------------------------------------------

def _state(mesh, spec, step):
  ref = (np.arange(12 * 8, dtype=np.float32).reshape(12, 8) * 1.5 + step).astype(np.float32)
  w = jax.make_array_from_callback(ref.shape, NamedSharding(mesh, spec), lambda i: ref[i])
  b = jax.device_put(np.float32(step) * np.ones(3, np.float32), NamedSharding(mesh, P()))
  return {"w": w, "b": b, "n": step}, ref


def _split(tree, rank, world):
  """The part of a one-process tree that process ``rank`` of ``world`` would own: a tree whose
  arrays keep only that process's devices' shards (its addressable shards, replica 0 rule)."""
  class Proc:
    def __init__(self, arr):
      devs = sorted(arr.sharding.device_set, key=lambda d: d.id)
      per = len(devs) // world
      mine = set(devs[rank * per:(rank + 1) * per])
      self.shape, self.dtype = arr.shape, arr.dtype
      self.addressable_shards = [s for s in arr.addressable_shards if s.device in mine]
  return {k: (Proc(v) if isinstance(v, jax.Array) else v) for k, v in tree.items()}


def test_records_ring_replicas_and_restore_onto_another_mesh(tmp_path):
  """4 simulated processes of 2 devices each snapshot a 4 x 2-sharded state; process 1's own
  memory is lost; its ring neighbour's replica and the others' records restore it onto 3 x 2
  and onto one device, bit for bit."""
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  client = kvstore.InMemoryClient()
  root = str(tmp_path / "mem")
  tiers = [memory.MemoryTier(root, r, 4, store=kvstore.KVStore(client), timeout_s=10)
           for r in range(4)]
  for step in (2, 4, 6):
    state, ref = _state(mesh, P("a", "b"), step)
    for r, t in enumerate(tiers):
      t.snapshot(step, _split(state, r, 4))
    for t in tiers:
      t.wait()
  assert [sorted(os.listdir(memory.holder(root, r))) for r in (0, 1)] == [
      ["own.0.4", "own.0.6", "replica.3.4", "replica.3.6"],
      ["own.1.4", "own.1.6", "replica.0.4", "replica.0.6"]]       # the 2 newest steps kept
  assert client.key_value_dir_get("dtenjax/elastic/mem") == []     # moved, then deleted
  assert memory.complete_steps(root, 4) == [4, 6]
  import shutil
  shutil.rmtree(memory.holder(root, 1))                            # process 1's host is gone
  assert memory.complete_steps(root, 4, lost=[1]) == [4, 6]
  assert memory.complete_steps(root, 4, lost=[1, 2]) == []         # neighbours: 1's copy was on 2
  mesh32 = jax.make_mesh((3, 2), ("a", "b"), devices=jax.devices()[:6])
  target, _ = _state(mesh32, P("a", None), 0)
  out = memory.restore(root, 4, [1], 6, target)
  assert out["n"] == 6 and isinstance(out["n"], int)
  assert out["w"].sharding == target["w"].sharding
  dtenjax.testing.assert_bitwise_equal(np.asarray(out["w"]), ref)
  dtenjax.testing.assert_bitwise_equal(np.asarray(out["b"]), np.full(3, 6, np.float32))
  one = jax.tree.map(lambda a: jax.device_put(a, jax.devices()[0]) if isinstance(a, jax.Array)
                     else a, target)
  dtenjax.testing.assert_bitwise_equal(np.asarray(memory.restore(root, 4, [1], 4, one)["w"]),
                                       _state(mesh, P(), 4)[1])
  with pytest.raises(dtenjax.CheckpointError, match=r"no complete snapshot of step 6.*\[1, 2\]"):
    memory.restore(root, 4, [1, 2], 6, target)
  bad = {**target, "w": jax.ShapeDtypeStruct((12, 9), np.float32, sharding=target["w"].sharding)}
  with pytest.raises(dtenjax.CheckpointError, match=r"float32\[12, 9\].*float32\[12, 8\]"):
    memory.restore(root, 4, [1], 6, bad)


def test_a_corrupt_record_is_refused(tmp_path):
  path = tmp_path / "own.0.1"
  path.write_bytes(b"not a record")
  with pytest.raises(dtenjax.CheckpointError, match="not an in-memory snapshot record"):
    memory.unpack(path.read_bytes(), str(path))
  header, bufs = memory.encode(1, 0, 1, {"x": np.arange(4, dtype=np.int32), "s": 3})
  blob = memory.pack(header, bufs)
  with pytest.raises(dtenjax.CheckpointError, match="truncated"):
    memory.unpack(blob[:-4], "record")


# --- choosing where to continue -----------------------------------------------------------------

def test_the_newest_step_wins_and_memory_wins_a_tie(tmp_path):
  root = str(tmp_path / "mem")
  for r in range(2):
    os.makedirs(memory.holder(root, r))
  blob = memory.pack(*memory.encode(6, 0, 2, {"n": 6}))
  for name in ("holder0/own.0.6", "holder1/own.1.6", "holder1/replica.0.6"):
    (tmp_path / "mem" / name).write_bytes(blob)
  ck = str(tmp_path / "ck")
  m = ckpt.CheckpointManager(ck, enable_async_checkpointing=False)
  m.save(6, {"n": 6})
  pick = launcher.choose_restore(root, 2, [0], ck, None)
  assert pick == {"source": "memory", "root": root, "world": 2, "lost": [0], "step": 6}
  m.save(8, {"n": 8})
  assert launcher.choose_restore(root, 2, [0], ck, None) == {"source": "checkpoint", "step": 8}
  # rank 1 lost too: no complete snapshot; the checkpoint, else what the generation began from
  assert launcher.choose_restore(root, 2, [0, 1], ck, None)["source"] == "checkpoint"
  prev = {"source": "memory", "root": "elsewhere", "world": 4, "lost": [3], "step": 4}
  assert launcher.choose_restore(root, 2, [0, 1], None, prev) == prev
  assert launcher.choose_restore(root, 2, [0, 1], None, None) is None


def test_launch_arguments_are_checked_at_once():
  with pytest.raises(dtenjax.ConfigurationError) as e:
    dtenjax.elastic.launch([], 2, min_nprocs=3, heartbeat_timeout_s=0, snapshot_every=-1)
  text = str(e.value)
  assert all(s in text for s in ("min_nprocs=3", "argv is empty", "heartbeat_timeout_s=0",
                                 "snapshot_every=-1"))


def test_a_job_past_its_timeout_is_killed_and_the_error_says_how_to_give_it_more(tmp_path):
  script = tmp_path / "sleeper.py"
  script.write_text("import time\ntime.sleep(60)\n")
  t0 = time.monotonic()
  with pytest.raises(dtenjax.CollectiveTimeoutError,
                     match=r"ran past its timeout at generation 0 .*killed. Pass a longer "
                           r"timeout_s \(dtenjax launch --timeout S\)"):
    dtenjax.elastic.launch([str(script)], 1, timeout_s=0.5, run_dir=str(tmp_path / "run"),
                           quiet=True)
  assert time.monotonic() - t0 < 20


def test_without_a_launcher_init_is_a_plain_single_process(monkeypatch):
  monkeypatch.delenv("DTENJAX_ELASTIC_RUN_DIR", raising=False)
  ctx = dtenjax.elastic.init()
  assert (ctx.rank, ctx.world, ctx.elastic, ctx.tier, ctx.watchdog) == (0, 1, False, None, None)
  state, step = ctx.restore({"x": 1})
  assert state == {"x": 1} and step == 0
  ctx.step_done(1, state)
  ctx.finish()                         # returns: nothing to leave


def test_a_watchdog_of_several_processes_without_a_shared_store_is_refused():
  """Without store= and without jax.distributed the beats would go to this process's own store:
  every other rank would be reported lost after the timeout. Refused at construction, naming
  the fix; one process, or an explicit store, is fine."""
  with pytest.raises(dtenjax.ConfigurationError,
                     match=r"world=2 processes, but no store= was given.*jax\.distributed\."
                           r"initialize.*store=dtenjax\.elastic\.KVStore\(client\)"):
    dtenjax.elastic.Watchdog(0, 2, print)
  dtenjax.elastic.Watchdog(0, 1, print)
  dtenjax.elastic.Watchdog(0, 2, print, store=kvstore.KVStore(kvstore.InMemoryClient()))
