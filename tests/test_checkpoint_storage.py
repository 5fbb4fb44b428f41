"""dtenjax/_src/checkpoint/storage.py: saves that race or fail lose nothing. Two saves of one path
(two threads, two processes) run one after the other and every commit is complete and verified;
a full disk, a file-size limit and a read-only directory give one CheckpointError naming the file
(with the bytes needed and free) and leave no temporary directory; a kill between an overwrite's
two renames loses nothing."""

import contextlib
import errno
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
import dtenjax.checkpoint as ckpt
from dtenjax._src.checkpoint import storage
from procs import run_at_once
from tests.mp_workers import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
ENV.pop("XLA_FLAGS", None)


def _tree(v, n=256):
  return {"w": jnp.full((n,), v, jnp.float32), "b": np.full((4,), v, np.int32), "step": int(v)}


def _check(path, allowed):
  """The checkpoint restores, verified, and is one of the trees saved (not a mix)."""
  out = ckpt.restore(path)
  v = int(out["step"])
  assert v in allowed, v
  assert np.all(np.asarray(out["w"]) == v) and np.all(out.get("b", v) == v)
  return v


def _leftovers(parent):
  return sorted(p for p in os.listdir(parent) if ".dtenjax-" in p)


def test_local_storage_is_a_storage_and_each_save_gets_its_own_directory(tmp_path):
  assert ckpt.Storage is storage.Storage and ckpt.LocalStorage is storage.LocalStorage
  assert {"Storage", "LocalStorage"} <= set(ckpt.__all__)
  st = storage.LocalStorage()
  assert isinstance(st, storage.Storage)
  path = str(tmp_path / "c")
  a = st.begin(path)
  b = st.begin(path)                 # a second save (after a killed first): its own directory
  assert a != b and os.path.isdir(b) and not os.path.exists(a)    # the leftover is removed
  st.write(b, "f", memoryview(b"abc"))
  st.sync_dirs(b, [""])
  st.commit(b, path, overwrite=False)
  assert st.read_bytes(path, "f", 10) == b"abc" and _leftovers(tmp_path) == []


def test_two_threads_saving_one_path_50_times_never_lose_a_commit(tmp_path):
  path = tmp_path / "c"
  errors_seen = []

  def worker(base):
    c = ckpt.Checkpointer(threads=2, timeout_s=60)
    try:
      for i in range(25):
        c.save(path, _tree(base + i), overwrite=True)
        c.wait()
    except Exception as e:
      errors_seen.append(e)

  threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 1000)]
  for t in threads:
    t.start()
  seen = set()
  while any(t.is_alive() for t in threads):
    try:
      seen.add(_check(path, set(range(25)) | set(range(1000, 1025))))
    except dtenjax.CheckpointError as e:      # before the first commit only: not there yet
      assert str(e).startswith(f"no checkpoint at {path}") and not seen, e
  for t in threads:
    t.join()
  assert not errors_seen, errors_seen
  assert _check(path, {24, 1024}) in (24, 1024) and len(seen) > 1
  assert _leftovers(tmp_path) == []


def test_a_read_that_an_overwrite_mixed_up_is_read_again(tmp_path, monkeypatch):
  # the fifty-saves test above once saw a restore fail "as asked" (no _sharding entry: read
  # between an overwrite's two renames); whatever a read that raced a commit concludes, the
  # restore reads the new checkpoint again
  from dtenjax._src.checkpoint import restore as restore_mod
  path = tmp_path / "c"
  ckpt.save(path, _tree(1))
  real, calls = restore_mod._restore_once, []

  def racing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 1:
      ckpt.save(path, _tree(2), overwrite=True)     # the commit lands during this read
      raise dtenjax.ConfigurationError("cannot restore as asked: a leaf without its sharding")
    return real(*args, **kwargs)

  monkeypatch.setattr(restore_mod, "_restore_once", racing)
  assert int(ckpt.restore(path)["step"]) == 2 and len(calls) == 2


def test_without_overwrite_the_second_of_two_saves_is_refused_clearly(tmp_path):
  path = tmp_path / "c"
  results = []

  def worker(v):
    try:
      ckpt.save(path, _tree(v))
      results.append("ok")
    except (dtenjax.CheckpointError, dtenjax.ConfigurationError) as e:
      results.append(str(e))

  threads = [threading.Thread(target=worker, args=(v,)) for v in (1, 2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(r == "ok" for r in results) == [False, True], results
  (refusal,) = [r for r in results if r != "ok"]
  assert str(path) in refusal and "overwrite=True" in refusal
  _check(path, {1, 2})
  assert _leftovers(tmp_path) == []


SAVER = r"""
import sys
import jax.numpy as jnp, numpy as np
import dtenjax.checkpoint as ckpt
path, base = sys.argv[1], int(sys.argv[2])
for i in range(25):
  v = base + i
  ckpt.save(path, {"w": jnp.full((256,), v, jnp.float32), "b": np.full((4,), v, np.int32),
                   "step": v}, overwrite=True, timeout_s=60)
  out = ckpt.restore(path)              # whichever process committed last: complete, verified
  s = int(out["step"])
  assert np.all(np.asarray(out["w"]) == s) and np.all(out["b"] == s), s
print("DONE", flush=True)
"""


@pytest.mark.multiprocess
def test_two_processes_saving_one_path_50_times_never_lose_a_commit(tmp_path):
  """Forked from the session's servers (tests/mp_workers/launch.py), both at once."""
  path = tmp_path / "c"
  env = dict(ENV, PYTHONPATH=launch.pythonpath())
  runs = {b: (["-c", SAVER, str(path), str(b)], env) for b in (0, 1000)}
  outs = run_at_once(runs, 240, launch.fork_servers([env]))   # each exits 0
  assert all("DONE" in out for out in outs.values()), outs
  assert _check(path, {24, 1024}) in (24, 1024)
  assert _leftovers(tmp_path) == []


FSIZE = r"""
import json, resource, sys
import jax.numpy as jnp
import dtenjax, dtenjax.checkpoint as ckpt
path = sys.argv[1]
ckpt.save(path, {"w": jnp.full((1024,), 1.0, jnp.float32), "step": 1})       # 4 KiB: fits
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
  ckpt.save(path, {"w": jnp.full((64 << 10,), 2.0, jnp.float32), "step": 2}, overwrite=True)
  print(json.dumps({"error": None}))
except dtenjax.CheckpointError as e:
  print(json.dumps({"error": str(e), "type": type(e).__name__}))
"""


def test_a_file_size_limit_is_one_error_and_the_previous_checkpoint_stays(tmp_path):
  path = tmp_path / "c"
  r = subprocess.run([sys.executable, "-c", FSIZE, str(path)], env=ENV, capture_output=True,
                     text=True, timeout=120, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  err = json.loads(r.stdout.strip().splitlines()[-1])["error"]
  assert err and os.strerror(errno.EFBIG) in err and "RLIMIT_FSIZE" in err, err
  assert str(tmp_path / ".c.dtenjax-tmp-") in err and "was removed" in err
  assert int(re.search(r"needs (\d+) bytes", err).group(1)) >= 262144
  assert _check(path, {1}) == 1
  assert _leftovers(tmp_path) == []


@contextlib.contextmanager
def _tmpfs(where, size):
  os.makedirs(where, exist_ok=True)
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                     capture_output=True, text=True, check=False)
  if r.returncode:
    pytest.skip(f"mounting a small tmpfs needs root with CAP_SYS_ADMIN: {r.stderr.strip()}")
  try:
    yield where
  finally:
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_disk_is_one_error_naming_the_file_needed_and_free(tmp_path):
  with _tmpfs(tmp_path / "small", "256k") as small:
    ckpt.save(small / "c", _tree(1))
    with pytest.raises(dtenjax.CheckpointError) as e:
      ckpt.save(small / "c", _tree(2, n=1 << 18), overwrite=True)        # 1 MiB
    msg = str(e.value)
    assert os.strerror(errno.ENOSPC) in msg and str(small) in msg, msg
    assert int(re.search(r"needs (\d+) bytes", msg).group(1)) >= 1 << 20, msg
    assert re.search(r"was removed.* \d+ bytes are free there now", msg), msg
    assert _leftovers(small) == []
    assert _check(small / "c", {1}) == 1


def test_a_read_only_directory_is_one_error_and_restores_still_work(tmp_path):
  with _tmpfs(tmp_path / "ro", "1m") as ro:
    ckpt.save(ro / "c", _tree(1))
    subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
    with pytest.raises(dtenjax.CheckpointError, match="not writable.*writable directory") as e:
      ckpt.save(ro / "d", _tree(2))
    assert str(ro) in str(e.value)
    c = ckpt.Checkpointer()
    c.save(ro / "e", _tree(3))
    with pytest.raises(dtenjax.CheckpointError, match="not writable"):
      c.wait()
    assert _check(ro / "c", {1}) == 1                  # reading needs no write access


def test_permission_errors_name_the_file_and_the_fix(tmp_path):
  e = storage.os_error(PermissionError(errno.EACCES, "Permission denied", "/x/y"), "/x/y",
                       "writing 5 bytes to")
  assert isinstance(e, dtenjax.CheckpointError) and "/x/y" in str(e)
  assert "Permission denied" in str(e) and "writable directory" in str(e)


def test_a_parent_that_is_a_file_is_a_checkpoint_error(tmp_path):
  (tmp_path / "f").write_text("")
  with pytest.raises(dtenjax.CheckpointError, match="is a file, not a directory|Not a directory"):
    ckpt.save(tmp_path / "f" / "c", _tree(1))
  c = ckpt.Checkpointer()
  c.save(tmp_path / "f" / "c", _tree(1))
  with pytest.raises(dtenjax.CheckpointError, match=str(tmp_path / "f")):
    c.wait()


def test_a_save_waits_for_the_lock_then_says_what_it_waited_for(tmp_path):
  st = storage.LocalStorage()
  with st.lock(str(tmp_path / "c"), 1.0):
    with pytest.raises(dtenjax.CheckpointError, match=r"another save of .*c held its lock"):
      ckpt.save(tmp_path / "c", _tree(1), timeout_s=0.3)
  ckpt.save(tmp_path / "c", _tree(1))
  assert _leftovers(tmp_path) == []


KILL_BETWEEN_RENAMES = r"""
import os, sys
import jax.numpy as jnp, numpy as np
import dtenjax.checkpoint as ckpt
path = sys.argv[1]
real = os.rename
def rename(src, dst):
  real(src, dst)
  if src == path:                          # the old checkpoint was renamed away: stop here
    print("BETWEEN", flush=True)
    sys.stdin.read()
os.rename = rename
ckpt.save(path, {"w": jnp.full((256,), 2.0, jnp.float32), "b": np.full((4,), 2, np.int32),
                 "step": 2}, overwrite=True)
"""


# One process at a time (not "several processes talking over loopback"): outside the procs
# group (tests/procs.py), so the other worker may run it.
def test_a_kill_between_the_two_renames_of_an_overwrite_loses_nothing(tmp_path):
  path = tmp_path / "c"
  ckpt.save(path, _tree(1))
  p = subprocess.Popen([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(path)], env=ENV,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  try:
    ready, _, _ = select.select([p.stdout], [], [], 120)
    assert ready and p.stdout.readline().strip() == "BETWEEN", p.stderr.read()[-3000:]
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
  finally:
    if p.poll() is None:
      p.kill()
  assert not path.exists() and (tmp_path / ".c.dtenjax-old").is_dir()
  with pytest.warns(dtenjax.DtenjaxWarning, match="interrupted between its two renames"):
    assert _check(path, {1}) == 1                       # restore finds the previous checkpoint
  assert ckpt.leaves(path)["w"]["shape"] == (256,)
  ckpt.save(path, _tree(3), overwrite=True)             # puts it back, then replaces it
  assert _check(path, {3}) == 3 and _leftovers(tmp_path) == []
  # without overwrite the next save also puts the old one back first, and refuses
  ckpt.save(tmp_path / "d", _tree(4))
  os.rename(tmp_path / "d", tmp_path / ".d.dtenjax-old")
  with pytest.raises(dtenjax.CheckpointError, match="overwrite=True"):
    ckpt.save(tmp_path / "d", _tree(5))
  assert _check(tmp_path / "d", {4}) == 4


class MemoryStorage:
  """A second tier in a dict, written against the Storage protocol's documented contract (a
  save's files are invisible until its commit; the commit replaces the whole checkpoint at once;
  paths stay inside a checkpoint), to show the interface is all save and restore need."""
  name = "memory"

  def __init__(self):
    self.committed_dirs: dict[str, dict[str, bytes]] = {}
    self.pending: dict[str, dict[str, bytes]] = {}
    self.locks: dict[str, threading.Lock] = {}
    self.ops: list[str] = []

  @contextlib.contextmanager
  def lock(self, path, timeout_s):
    lk = self.locks.setdefault(path, threading.Lock())
    if not lk.acquire(timeout=timeout_s):
      raise dtenjax.CheckpointError(f"another save of {path} held its lock")
    try:
      yield
    finally:
      lk.release()

  def begin(self, path, *, needed_bytes=0):
    tmp = f"{path}#tmp{len(self.ops)}"
    self.pending[tmp] = {}
    self.ops.append("begin")
    return tmp

  def makedirs(self, tmp, rel):
    pass

  def write(self, tmp, rel, data, *, needed_bytes=0):
    self.pending[tmp][rel] = bytes(data)
    return len(data)

  def sync_dirs(self, tmp, rels):
    pass

  def commit(self, tmp, path, *, overwrite):
    if path in self.committed_dirs and not overwrite:
      raise dtenjax.CheckpointError(f"{path} exists")
    self.committed_dirs[path] = self.pending.pop(tmp)
    self.ops.append("commit")

  def abort(self, tmp):
    self.pending.pop(tmp, None)

  def committed(self, path):
    return path in self.committed_dirs

  def identity(self, path):
    d = self.committed_dirs.get(path)
    return None if d is None else id(d)

  def open_checkpoint(self, path):
    if path not in self.committed_dirs:
      raise dtenjax.CheckpointError(f"no checkpoint at {path}")
    return path, None

  def check_links(self, root):
    pass

  def resolve(self, root, rel):
    if rel.startswith("/") or ".." in rel.split("/"):
      raise dtenjax.CheckpointError(f"{rel!r} is outside {root}")
    return rel

  def exists(self, root, rel):
    files = self.committed_dirs[root]
    return rel in files or any(k.startswith(rel + "/") for k in files)

  def size(self, root, rel):
    return len(self.committed_dirs[root][self.resolve(root, rel)])

  def read_range(self, root, rel, offset, out):
    data = self.committed_dirs[root][self.resolve(root, rel)][offset:offset + len(out)]
    out[:len(data)] = data
    return len(data)

  def read_bytes(self, root, rel, limit):
    return self.committed_dirs[root][self.resolve(root, rel)][:limit + 1]


def test_a_second_tier_is_one_more_storage_implementation(tmp_path):
  from jax.sharding import NamedSharding, PartitionSpec as P
  mem = MemoryStorage()
  assert isinstance(mem, storage.Storage)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  ref = np.arange(8 * 32, dtype=np.float32).reshape(8, 32)
  w = jax.make_array_from_callback(ref.shape, NamedSharding(mesh, P("a", "b")), lambda i: ref[i])
  path = str(tmp_path / "mem" / "step_1")
  with ckpt.Checkpointer(storage=mem) as c:
    c.save(path, {"w": w, "step": 1})
  assert mem.ops == ["begin", "commit"] and not mem.pending
  assert not os.path.exists(tmp_path / "mem")                  # nothing touched the disk
  assert "w/1.3" in mem.committed_dirs[path] and "_dtenjax/checkpoint.json" in mem.committed_dirs[path]
  rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  out = ckpt.restore(path, shardings={"w": rows, "step": None}, storage=mem)
  np.testing.assert_array_equal(np.asarray(out["w"]), ref)
  assert out["w"].sharding == rows and out["step"] == 1
  mem.committed_dirs[path]["w/1.3"] = b"\0" * len(mem.committed_dirs[path]["w/1.3"])
  with pytest.raises(dtenjax.CheckpointError, match="corrupted"):   # digests in every tier
    ckpt.restore(path, storage=mem)
  with pytest.raises(dtenjax.ConfigurationError, match="exists"):
    ckpt.save(path, {"w": w}, storage=mem)
