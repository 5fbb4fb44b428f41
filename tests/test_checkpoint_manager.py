"""dtenjax.checkpoint.CheckpointManager: steps, keep-last-K, the latest complete step after a crash
mid-save, asynchronous saves overlapping steps, restore onto another mesh."""

import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax
import dtenjax.checkpoint as ckpt
from dtenjax._src.checkpoint import io as ckio


def _state(step, mesh_shape=(2, 4), names=("a", "b"), spec=P("a", "b")):
  mesh = jax.make_mesh(mesh_shape, names)
  ref = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) + step
  w = jax.make_array_from_callback(ref.shape, NamedSharding(mesh, spec), lambda i: ref[i])
  return {"w": w, "step": step}, ref


def test_saves_every_n_steps_and_keeps_the_last_k(tmp_path):
  with ckpt.CheckpointManager(tmp_path, save_interval_steps=2, max_to_keep=2) as m:
    saved = [s for s in range(9) if m.save(s, _state(s)[0])]
    m.wait_until_finished()
    assert saved == [0, 2, 4, 6, 8]
    assert m.all_steps() == [6, 8] and m.latest_step() == 8
    assert sorted(os.listdir(tmp_path)) == ["6", "8"]          # nothing else is left behind
    assert not m.should_save(8) and not m.should_save(9) and m.should_save(10)
    out = m.restore(None, _state(0)[0])
    assert out["step"] == 8
    np.testing.assert_array_equal(np.asarray(out["w"]), _state(8)[1])
    with pytest.raises(dtenjax.CheckpointError,
                       match=r"step 4 has no complete checkpoint.*\[6, 8\]"):
      m.restore(4)


def test_step_prefix_and_bad_arguments(tmp_path):
  m = ckpt.CheckpointManager(tmp_path, step_prefix="step", enable_async_checkpointing=False)
  assert m.save(3, _state(3)[0]) and os.path.isdir(tmp_path / "step_3")
  (tmp_path / "step_x").mkdir()                 # not a step
  (tmp_path / "7").mkdir()                      # another naming: not this manager's
  assert m.all_steps() == [3]
  with pytest.raises(dtenjax.ConfigurationError) as e:
    ckpt.CheckpointManager(tmp_path, save_interval_steps=0, max_to_keep=0, step_prefix="a/b")
  assert all(s in str(e.value) for s in ("save_interval_steps=0", "max_to_keep=0", "'a/b'"))
  with pytest.raises(dtenjax.ConfigurationError, match="step=-1"):
    m.save(-1, {})
  with pytest.raises(dtenjax.CheckpointError, match="no complete checkpoint"):
    ckpt.CheckpointManager(tmp_path / "empty").restore()


class _CrashingIO(ckio.PosixIO):
  """POSIX I/O whose process dies (an exception stands for the kill) after ``n`` files."""

  def __init__(self, n):
    self.left = n

  def write_file(self, path, data):
    if self.left == 0:
      raise OSError("killed in the middle of a save")
    self.left -= 1
    return super().write_file(path, data)


def test_latest_step_after_a_crash_mid_save_is_the_last_complete_one(tmp_path):
  m = ckpt.CheckpointManager(tmp_path, max_to_keep=2)
  for s in (1, 2):
    m.save(s, _state(s)[0])
  m.wait_until_finished()
  m._ckpt.storage = ckpt.LocalStorage(_CrashingIO(3))
  m.save(3, _state(3)[0])
  with pytest.raises(dtenjax.CheckpointError, match="killed in the middle"):
    m.wait_until_finished()
  # a save that fails cleans up after itself; a killed one leaves its temporary directory
  half = tmp_path / ".3.dtenjax-tmp-0123456789ab"
  half.mkdir()
  (half / "partial").write_bytes(b"half a shard")
  assert m.all_steps() == [1, 2] and m.latest_step() == 2   # and both complete steps stay
  out = m.restore(target=_state(0)[0])
  assert out["step"] == 2
  np.testing.assert_array_equal(np.asarray(out["w"]), _state(2)[1])
  m._ckpt.storage = ckpt.LocalStorage(ckio.PosixIO())
  assert m.save(3, _state(3)[0])
  m.wait_until_finished()
  assert sorted(os.listdir(tmp_path)) == ["2", "3"]         # leftover removed, K=2 kept


class _SlowIO(ckio.PosixIO):
  """POSIX I/O that holds each file until released (a slow shared file system)."""

  def __init__(self):
    self.release = threading.Event()
    self.writes = 0

  def write_file(self, path, data):
    assert self.release.wait(30)
    self.writes += 1
    return super().write_file(path, data)


def test_async_saves_overlap_the_next_steps(tmp_path):
  m = ckpt.CheckpointManager(tmp_path)
  slow = _SlowIO()
  m._ckpt.storage = ckpt.LocalStorage(slow)
  state, ref = _state(5)
  step = jax.jit(lambda w: w * 2.0)
  t0 = time.perf_counter()
  assert m.save(5, state)
  returned = time.perf_counter() - t0
  w = state["w"]
  for _ in range(3):                        # training goes on while nothing is written yet
    w = step(w)
  w.block_until_ready()
  assert slow.writes == 0 and m.all_steps() == [] and returned < 20
  state["w"].delete()                       # the save holds its own host copy
  slow.release.set()
  m.wait_until_finished()
  assert m.all_steps() == [5] and slow.writes > 0
  assert m.last_report is not None and m.last_report.blocking_seconds < m.last_report.seconds
  np.testing.assert_array_equal(np.asarray(w), ref * 8)
  out = m.restore(5, _state(0)[0])
  np.testing.assert_array_equal(np.asarray(out["w"]), ref)


def test_a_wait_that_runs_out_waits_its_timeout_once(tmp_path):
  # the save and the clean-up after it share one timeout: the error says "within 1 s", so the
  # wait is 1 s, not 1 s for the save and 1 s more for the clean-up thread waiting on it
  m = ckpt.CheckpointManager(tmp_path, max_to_keep=1)
  slow = _SlowIO()
  m._ckpt.storage = ckpt.LocalStorage(slow)
  assert m.save(5, _state(5)[0])
  t0 = time.monotonic()
  with pytest.raises(dtenjax.CheckpointError, match="did not finish within 1 s"):
    m.wait_until_finished(timeout_s=1.0)
  waited = time.monotonic() - t0
  assert 1.0 <= waited < 1.8, waited
  slow.release.set()
  m.wait_until_finished()                   # the save in flight is joined again, and finishes
  assert m.all_steps() == [5] and m.last_report is not None


def test_restore_onto_a_different_mesh(tmp_path):
  m = ckpt.CheckpointManager(tmp_path)
  m.save(10, _state(10)[0])
  target, ref = _state(0, (8,), ("x",), P("x"))
  out = m.restore(10, target)
  assert out["w"].sharding == target["w"].sharding and out["step"] == 10
  np.testing.assert_array_equal(np.asarray(out["w"]), ref + 10)
  cols = NamedSharding(jax.make_mesh((4,), ("y",), devices=jax.devices()[:4]), P(None, "y"))
  out = m.restore(10, shardings={"w": cols, "step": None})
  assert out["w"].sharding == cols and len(out["w"].sharding.device_set) == 4
  np.testing.assert_array_equal(np.asarray(out["w"]), ref + 10)
