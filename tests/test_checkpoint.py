"""dtenjax.checkpoint: bit-identical round trips, restores onto other meshes reading only what
each device needs, integrity errors, atomic commits under kill -9, orbax interoperability (both
directions), asynchronous saves, and continuation in fresh processes (also across device and
process counts) with reproducible collectives."""

import importlib.abc
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dtenjax
import dtenjax.checkpoint as ckpt
from dtenjax._src.checkpoint import io as ckio
from tests.mp_workers import launch as mp_launch
from procs import run_at_once


def _bits(x):
  a = np.ascontiguousarray(np.asarray(x))
  return a.dtype, a.shape, a.reshape(-1).view(np.uint8).tobytes()


def _assert_bits(a, b):
  la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
  lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
  assert ta == tb, (ta, tb)
  for x, y in zip(la, lb):
    assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (x, y)
    if x is None or isinstance(x, (int, float, bool)):
      assert x == y and type(x) is type(y)
    else:
      assert _bits(x) == _bits(y)


def _sharded(mesh_shape, names, spec, ref):
  mesh = jax.make_mesh(mesh_shape, names)
  return jax.make_array_from_callback(ref.shape, NamedSharding(mesh, spec), lambda i: ref[i])


def _f32_with_odd_bits(n):
  a = np.arange(n, dtype=np.float32) / 7
  bits = a.view(np.uint32)
  bits[:4] = [0x7FC00001, 0xFFC12345, 0x80000000, 0x00000001]   # NaN payloads, -0.0, denormal
  return a


def test_round_trip_is_bit_identical_for_every_kind_of_leaf(tmp_path):
  f32 = _f32_with_odd_bits(8 * 24).reshape(8, 24)
  bf16 = (np.arange(64, dtype=np.float32) / 3).astype(jnp.bfloat16).reshape(8, 8)
  tree = {"f32": _sharded((2, 4), ("a", "b"), P("a", "b"), f32),
          "bf16": _sharded((2, 4), ("a", "b"), P(None, "b"), bf16),
          "i32": _sharded((8,), ("x",), P("x"), np.arange(-8, 8, dtype=np.int32)),
          "u8": jax.device_put(np.arange(5, dtype=np.uint8)),
          "bool": _sharded((2, 4), ("a", "b"), P(), np.array([True, False, True])),
          "pinned": jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(
              jax.make_mesh((8,), ("x",)), P("x"), memory_kind="pinned_host")),
          "scalar": jnp.float32(-0.0), "np": np.arange(6, dtype=np.int64).reshape(2, 3),
          "step": 12, "lr": 0.5, "none": None, "seq": [jnp.int8(3), (np.float16(1.5),)]}
  report = ckpt.save(tmp_path / "c", tree)
  assert report.io == "posix" and report.digest == "xxh3_64" and report.processes == 1
  out = ckpt.restore(tmp_path / "c", tree)
  _assert_bits(out, tree)
  for k in ("f32", "bf16", "i32", "bool", "pinned"):
    assert out[k].sharding == tree[k].sharding, k         # memory kinds too
  # without a target: orbax's shape of the tree (dicts and lists), the saved shardings
  bare = ckpt.restore(tmp_path / "c")
  assert bare["f32"].sharding == tree["f32"].sharding and bare["step"] == 12
  assert isinstance(bare["seq"], list) and isinstance(bare["seq"][1], list)
  assert _bits(bare["bf16"]) == _bits(bf16)


def test_flax_and_optax_state_round_trip(tmp_path):
  flax = pytest.importorskip("flax")
  optax = pytest.importorskip("optax")
  del flax
  import flax.linen as nn
  model = nn.Sequential([nn.Dense(16), nn.relu, nn.Dense(8)])
  # flax's init and optax's update jitted: eagerly each of their ops compiled a program of its own
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8)))
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  params = jax.tree.map(lambda x: jax.device_put(
      x, NamedSharding(mesh, P(None, "b") if x.ndim == 2 else P())), params)
  tx = optax.adamw(1e-3)
  with jax.set_mesh(mesh):          # jax.make_mesh's axes are Explicit: a jit runs inside it
    opt_state = jax.jit(lambda p: tx.update(jax.tree.map(jnp.ones_like, p), tx.init(p), p)[1])(
        params)
  state = {"params": params, "opt_state": opt_state, "step": jnp.int32(1)}
  ckpt.save(tmp_path / "s", state)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)
  out = ckpt.restore(tmp_path / "s", target)
  _assert_bits(out, state)
  assert type(out["opt_state"][0]) is type(opt_state[0])       # optax's NamedTuple, not a dict
  assert jax.tree.map(lambda x: x.sharding, out) == jax.tree.map(lambda x: x.sharding, state)


def test_restore_chain_2x4_4x2_8_1_reads_each_byte_once(tmp_path):
  ref = _f32_with_odd_bits(64 * 256).reshape(64, 256)     # 64 KiB; 4 KiB digest blocks
  x = _sharded((2, 4), ("a", "b"), P("a", "b"), ref)
  path = tmp_path / "s0"
  ckpt.save(path, {"x": x}, block_bytes=4096)
  targets = [((4, 2), ("a", "b"), P("a", "b")), ((8,), ("x",), P("x")), ((1,), ("x",), P())]
  for i, (shape, names, spec) in enumerate(targets):
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
    out, report = ckpt.restore(path, {"x": x}, shardings=NamedSharding(mesh, spec), report=True)
    assert out["x"].sharding == NamedSharding(mesh, spec)
    assert _bits(out["x"]) == _bits(ref)
    for s in out["x"].addressable_shards:
      assert _bits(s.data) == _bits(ref[s.index])
    path = tmp_path / f"s{i + 1}"
    ckpt.save(path, {"x": out["x"]}, block_bytes=4096)
    x = out["x"]
  # rows over 8 devices from 2 x 4 chunks of [32, 64]: each device's box is 8 whole rows of
  # 4 chunks, spans of 8 x 256 B inside them, 4 KiB blocks: every byte read once
  rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
  ckpt.save(tmp_path / "wide", {"x": _sharded((2, 1), ("a", "b"), P("a"), ref)},
            block_bytes=4096)
  _, report = ckpt.restore(tmp_path / "wide", shardings=rows, report=True)
  assert report.bytes == ref.nbytes
  # the same onto P() on 8 devices: one read of each box, shared by the replicas
  _, report = ckpt.restore(tmp_path / "wide", shardings=NamedSharding(rows.mesh, P()),
                           report=True)
  assert report.bytes == ref.nbytes


def test_restore_takes_a_placement(tmp_path):
  ref = np.arange(64, dtype=np.float32).reshape(8, 8)
  ckpt.save(tmp_path / "c", {"w": _sharded((2, 4), ("a", "b"), P("a", "b"), ref)})
  placement = dtenjax.Placement("row", mesh=dtenjax.topology_mesh((8,), ("x",)))
  out = ckpt.restore(tmp_path / "c", shardings=placement)
  assert out["w"].sharding == placement.sharding((8, 8))
  assert _bits(out["w"]) == _bits(ref)


def test_asynchronous_save_returns_before_writing_and_joins(tmp_path):
  ref = np.arange(8 * 128, dtype=np.float32).reshape(8, 128)
  x = _sharded((8,), ("x",), P("x"), ref)
  c = ckpt.Checkpointer(threads=2)
  first = c.save(tmp_path / "a", {"x": x, "step": 1})
  x.delete()                       # the caller may drop (or donate) its arrays at once
  y = _sharded((8,), ("x",), P("x"), ref + 1)
  second = c.save(tmp_path / "b", {"x": y, "step": 2})    # joins the first
  assert first.done() and os.path.isdir(tmp_path / "a")
  report = c.wait()
  assert second.done() and report.path == str(tmp_path / "b") and report.files == 9   # 8 shards, the step
  assert c.wait() is None
  assert _bits(ckpt.restore(tmp_path / "a")["x"]) == _bits(ref)
  with ckpt.Checkpointer() as c2:
    c2.save(tmp_path / "c", {"y": y})
  assert _bits(c2.restore(tmp_path / "c")["y"]) == _bits(ref + 1)


def test_a_wait_that_runs_out_leaves_the_save_to_join_again(tmp_path):
  # the time-out says "wait longer (wait(timeout_s=...))": the next wait must still find that
  # save (it once found nothing in flight, and a next save would have overlapped it)
  release = threading.Event()

  class SlowStorage(ckpt.LocalStorage):
    def write(self, *args, **kwargs):
      release.wait(60)
      return super().write(*args, **kwargs)

  c = ckpt.Checkpointer(threads=2, storage=SlowStorage())
  pending = c.save(tmp_path / "a", {"w": np.arange(4.0)})
  with pytest.raises(dtenjax.CheckpointError, match="did not finish within 0.05 s"):
    c.wait(timeout_s=0.05)
  assert not pending.done()
  release.set()
  report = c.wait()
  assert report is not None and report.path == str(tmp_path / "a") and pending.done()
  assert c.wait() is None
  np.testing.assert_array_equal(ckpt.restore(tmp_path / "a")["w"], np.arange(4.0))


def test_a_failed_save_raises_once(tmp_path):
  class FailingStorage(ckpt.LocalStorage):
    def write(self, *args, **kwargs):
      raise OSError("disk gone")

  c = ckpt.Checkpointer(threads=2, storage=FailingStorage())
  c.save(tmp_path / "a", {"w": np.arange(4.0)})
  with pytest.raises(OSError, match="disk gone"):
    c.wait()
  assert c.wait() is None           # reported once; the Checkpointer is free for the next save


def test_a_process_that_waits_for_the_others_says_which_save_and_stage(tmp_path, monkeypatch):
  # one process of two, the other never comes: each wait of the save fails within its timeout
  # with the save's path and stage, not only a key of the coordination store
  from dtenjax._src.net import kvstore

  class NoPeer(kvstore.InMemoryClient):
    def wait_at_barrier(self, barrier_id, timeout_in_ms, process_ids=None):
      raise RuntimeError(f"DEADLINE_EXCEEDED: barrier {barrier_id} timed out")

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(kvstore, "default", lambda: kvstore.KVStore(NoPeer()))
  tree = {"w": np.arange(4.0)}
  with pytest.raises(dtenjax.CheckpointError,
                     match=r"saving .*/a \(open\): the processes did not all arrive within 0.2 s"):
    ckpt.save(tmp_path / "a", tree, timeout_s=0.2)                    # process 0
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with pytest.raises(dtenjax.CheckpointError, match=r"saving .*/b \(process 0 beginning it\): "
                     r"the processes did not all arrive within 0.2 s"):
    ckpt.save(tmp_path / "b", tree, timeout_s=0.2)                    # process 1


def _saved(tmp_path, name="c"):
  ref = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)   # chunks of 16 KiB: 4 blocks
  ckpt.save(tmp_path / name, {"params": {"w": _sharded((2, 4), ("a", "b"), P("a", "b"), ref)},
                              "step": 3}, block_bytes=4096)
  return tmp_path / name, ref


def test_a_corrupted_chunk_names_the_leaf_the_file_and_the_bytes(tmp_path):
  path, ref = _saved(tmp_path)
  f = path / "params.w" / "1.2"
  data = bytearray(f.read_bytes())
  data[5000] ^= 0x01                                     # one bit, in the second block
  f.write_bytes(bytes(data))
  with pytest.raises(dtenjax.CheckpointError) as e:
    ckpt.restore(path)
  msg = str(e.value)
  assert "'params.w'" in msg and str(f) in msg and "corrupted" in msg and "4096-8192" in msg
  out = ckpt.restore(path, verify=False)                 # on request, read it anyway
  assert not np.array_equal(np.asarray(out["params"]["w"]), ref)


def test_a_truncated_chunk_is_an_error(tmp_path):
  path, _ = _saved(tmp_path)
  f = path / "params.w" / "0.3"
  f.write_bytes(f.read_bytes()[:-4])
  with pytest.raises(dtenjax.CheckpointError, match=r"'params.w'.*0\.3 has 16380 bytes.*truncated"):
    ckpt.restore(path)


def test_a_missing_chunk_or_manifest_is_an_error(tmp_path):
  path, _ = _saved(tmp_path)
  (path / "params.w" / "0.0").unlink()
  with pytest.raises(dtenjax.CheckpointError, match=r"'params.w': chunk file .*0\.0 is missing"):
    ckpt.restore(path)
  path, _ = _saved(tmp_path, "d")
  (path / "_dtenjax" / "process_0.json").unlink()
  with pytest.raises(dtenjax.CheckpointError, match="manifest of process 0 .* is missing"):
    ckpt.restore(path)
  with pytest.raises(dtenjax.CheckpointError, match="no checkpoint at .*nowhere"):
    ckpt.restore(tmp_path / "nowhere")


def test_bad_input_gets_clear_errors(tmp_path):
  path, _ = _saved(tmp_path)
  with pytest.raises(dtenjax.ConfigurationError, match="exists; pass overwrite=True"):
    ckpt.save(path, {"a": jnp.ones(2)})
  with pytest.raises(dtenjax.ConfigurationError) as e:
    ckpt.save(tmp_path / "bad", {"a": object(), "k": jax.random.key(0)})
  assert "leaf 'a' is a object" in str(e.value) and "key_data" in str(e.value)
  wrong = {"params": {"w": jax.ShapeDtypeStruct((8, 1000), jnp.float32)}, "stepp": 0}
  with pytest.raises(dtenjax.ConfigurationError) as e:
    ckpt.restore(path, wrong)
  msg = str(e.value)
  assert "'stepp' is not in the checkpoint" in msg and "'step' has no place" in msg
  assert "float32[8, 1000], the checkpoint holds float32[8, 4096]" in msg
  with pytest.raises(dtenjax.ConfigurationError, match="checkpoint I/O 'gds' is unknown"):
    ckpt.save(tmp_path / "x", {"a": jnp.ones(2)}, io="gds")


def test_overwrite_replaces_in_one_rename(tmp_path):
  path, _ = _saved(tmp_path)
  ckpt.save(path, {"a": jnp.arange(3)}, overwrite=True)
  assert sorted(ckpt.leaves(path)) == ["a"]
  assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


KILL_WORKER = r"""
import os, sys
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import dtenjax.checkpoint as ckpt
from dtenjax._src.checkpoint import io as ckio
real, count = ckio.PosixIO.write_file, [0]
def write_file(self, path, data):
  n = real(self, path, data)
  count[0] += 1
  if count[0] == 3:                       # mid-save: some chunks are on disk, not all
    print("WROTE", flush=True)
    sys.stdin.read()                      # the test kills this process here
  return n
ckio.PosixIO.write_file = write_file
mesh = jax.make_mesh((8,), ("x",))
x = jax.device_put(np.full((8, 256), 7, np.float32), NamedSharding(mesh, P("x")))
ckpt.save(sys.argv[1], {"x": x, "step": 99}, overwrite=True)
"""


# One process at a time (not "several processes talking over loopback"): outside the procs
# group (tests/procs.py), so the other worker may run it.
def test_kill_9_during_a_save_leaves_the_previous_checkpoint(tmp_path):
  path, ref = _saved(tmp_path)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  p = subprocess.Popen([sys.executable, "-c", KILL_WORKER, str(path)], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
  try:
    ready, _, _ = select.select([p.stdout], [], [], 120)
    assert ready and p.stdout.readline().strip() == "WROTE", p.stderr.read()[-3000:]
    (tmp,) = tmp_path.glob(".c.dtenjax-tmp-*")              # this save's own directory
    assert (tmp / "x").is_dir()                              # the new save was under way
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
  finally:
    if p.poll() is None:
      p.kill()
  assert p.returncode == -signal.SIGKILL
  out = ckpt.restore(path)                                 # the old checkpoint, intact
  assert _bits(out["params"]["w"]) == _bits(ref) and out["step"] == 3
  ckpt.save(tmp_path / "d", {"a": jnp.ones(2)})            # later saves are unaffected
  os.rename(tmp, tmp_path / ".e.dtenjax-tmp-killed")
  with pytest.raises(dtenjax.CheckpointError, match="save did not commit"):
    ckpt.restore(tmp_path / "e")
  ckpt.save(tmp_path / "e", {"a": jnp.ones(2)})            # and clean up what a kill left
  assert not list(tmp_path.glob(".e.dtenjax-*"))


def test_orbax_restores_what_dtenjax_saved(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  ref = _f32_with_odd_bits(8 * 16).reshape(8, 16)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  tree = {"w": _sharded((2, 4), ("a", "b"), P("a", "b"), ref),
          "b": jax.device_put(jnp.arange(4, dtype=jnp.bfloat16), NamedSharding(mesh, P())),
          "step": 5, "n": np.arange(3, dtype=np.int32)}
  ckpt.save(tmp_path / "c", tree)
  out = ocp.PyTreeCheckpointer().restore(str(tmp_path / "c"))
  assert out["w"].sharding == tree["w"].sharding
  assert _bits(out["w"]) == _bits(ref) and _bits(out["b"]) == _bits(tree["b"])
  assert out["step"] == 5 and _bits(out["n"]) == _bits(tree["n"])
  # onto another mesh, orbax's way
  m8 = jax.make_mesh((8,), ("x",))
  abstract = {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(m8, P("x"))),
              "b": jax.ShapeDtypeStruct((4,), jnp.bfloat16, sharding=NamedSharding(m8, P())),
              "step": 0, "n": np.zeros(3, np.int32)}
  out = ocp.PyTreeCheckpointer().restore(
      str(tmp_path / "c"), args=ocp.args.PyTreeRestore(
          item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)))
  assert out["w"].sharding == NamedSharding(m8, P("x")) and _bits(out["w"]) == _bits(ref)


def test_orbax_and_dtenjax_name_optax_state_alike(tmp_path):
  """An optax state (NamedTuples inside a tuple) saved by either one restores with the other
  into the same structure: the leaf names agree."""
  ocp = pytest.importorskip("orbax.checkpoint")
  optax = pytest.importorskip("optax")
  params = {"w": _sharded((2, 4), ("a", "b"), P("a", "b"), np.ones((8, 8), np.float32))}
  tx = optax.adam(1e-2)
  opt = tx.update(params, tx.init(params), params)[1]
  tree = {"params": params, "opt": opt}
  ckpt.save(tmp_path / "d", tree)
  ocp.PyTreeCheckpointer(use_ocdbt=False).save(str(tmp_path / "o"), tree)
  stored = {n for n, v in ckpt.leaves(tmp_path / "d").items() if v["value_type"] != "None"}
  assert "opt.1" in ckpt.leaves(tmp_path / "d")             # optax's EmptyState, as orbax says
  assert stored == {p.name for p in (tmp_path / "o").iterdir() if p.is_dir() and "." in p.name}
  by_orbax = ocp.PyTreeCheckpointer().restore(str(tmp_path / "d"), item=tree)
  by_dtenjax = ckpt.restore(tmp_path / "o", tree)
  _assert_bits(by_orbax, tree)
  _assert_bits(by_dtenjax, tree)


@pytest.mark.parametrize("ocdbt", [True, False])
def test_dtenjax_restores_what_orbax_saved(tmp_path, ocdbt):
  ocp = pytest.importorskip("orbax.checkpoint")
  ref = _f32_with_odd_bits(8 * 16).reshape(8, 16)
  tree = {"w": _sharded((2, 4), ("a", "b"), P("a", "b"), ref),
          "opt": [{"mu": jnp.arange(6, dtype=jnp.bfloat16)}], "step": 5}
  ocp.PyTreeCheckpointer(use_ocdbt=ocdbt).save(str(tmp_path / "o"), tree)
  rows = NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P("a", "b"))
  out, report = ckpt.restore(tmp_path / "o", tree, shardings={"w": rows, "opt": [{"mu": None}],
                                                              "step": None}, report=True)
  assert report.source == "orbax" and report.digest is None and report.io == "tensorstore"
  assert out["w"].sharding == rows and _bits(out["w"]) == _bits(ref)
  assert _bits(out["opt"][0]["mu"]) == _bits(tree["opt"][0]["mu"]) and out["step"] == 5


class _FakeKvikIO(types.ModuleType):
  """kvikio's documented Python API, as far as dtenjax uses it: ``CuFile(path, flags)`` with
  ``pwrite(buf, size, file_offset)`` / ``pread(buf, size, file_offset)`` returning futures whose
  ``get()`` is the byte count, ``close()``; ``defaults.get("compat_mode")`` (a CompatMode)."""

  def __init__(self, compat):
    super().__init__("kvikio")
    self.calls = []
    fake = self

    class Future:
      def __init__(self, n):
        self.n = n

      def get(self):
        return self.n

    class CuFile:
      def __init__(self, path, flags="r"):
        assert flags in ("r", "w"), flags
        self.path = str(path)
        self.f = open(path, "rb" if flags == "r" else "wb")   # kvikio opens (and truncates) it

      def pwrite(self, buf, size, file_offset=0):
        fake.calls.append(("pwrite", self.path))
        self.f.seek(file_offset)
        return Future(self.f.write(memoryview(buf)[:size]))

      def pread(self, buf, size, file_offset=0):
        fake.calls.append(("pread", self.path))
        self.f.seek(file_offset)
        return Future(self.f.readinto(memoryview(buf)[:size]))

      def close(self):
        self.f.close()

    mode = types.SimpleNamespace(name="ON" if compat else "OFF")
    self.CuFile = CuFile
    self.defaults = types.SimpleNamespace(get=lambda k: mode if k == "compat_mode" else None)
    self.__version__ = "26.10.0-fake"


@pytest.mark.parametrize("compat,name", [(True, "kvikio-compat"), (False, "kvikio-gds")])
def test_kvikio_when_installed_and_the_report_says_so(tmp_path, monkeypatch, compat, name):
  fake = _FakeKvikIO(compat)
  monkeypatch.setitem(sys.modules, "kvikio", fake)
  assert ckpt.io_info()["path"] == name and ckpt.io_info()["kvikio"] == "26.10.0-fake"
  ref = np.arange(8 * 64, dtype=np.float32).reshape(8, 64)
  report = ckpt.save(tmp_path / "k", {"x": _sharded((8,), ("x",), P("x"), ref)})
  chunks = str(tmp_path / "k" / "x")
  written = str(tmp_path / ".k.dtenjax-tmp-")            # renamed to k/ at the commit
  assert report.io == name and sum(op == "pwrite" and p.startswith(written) and "/x/" in p
                                   and "zarray" not in p
                                   for op, p in fake.calls) == 8
  out, rr = ckpt.restore(tmp_path / "k", report=True)
  assert rr.io == name and ("pread", chunks + "/3.0") in fake.calls and _bits(out["x"]) == _bits(ref)
  assert json.loads((tmp_path / "k" / "_dtenjax" / "checkpoint.json").read_text())["io"] == name
  monkeypatch.setenv("DTENJAX_CHECKPOINT_IO", "posix")
  assert ckpt.io_info()["path"] == "posix"
  assert ckpt.save(tmp_path / "p", {"x": out["x"]}).io == "posix"
  assert ((tmp_path / "p" / "x" / "3.0").read_bytes() == (tmp_path / "k" / "x" / "3.0").read_bytes())


def test_without_kvikio_posix_runs_and_info_says_why(monkeypatch):
  monkeypatch.setitem(sys.modules, "kvikio", None)        # import kvikio raises ImportError
  info = ckpt.io_info()
  assert info["path"] == "posix" and "kvikio is not installed" in info["why"]
  with pytest.raises(dtenjax.ConfigurationError, match="kvikio does not import"):
    ckio.backend("kvikio")


def test_a_kvikio_that_is_installed_and_broken_is_not_called_missing(monkeypatch):
  # a kvikio whose import fails (say, a CUDA library it cannot load) is reported with its own
  # error: "pip install" would not mend it
  class Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
      if name == "kvikio":
        raise OSError("libcufile.so.0: cannot open shared object file")
      return None
  monkeypatch.delitem(sys.modules, "kvikio", raising=False)
  monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
  info = ckpt.io_info()
  assert info["path"] == "posix" and "installed and does not import" in info["why"]
  assert "libcufile.so.0" in info["why"]
  with pytest.raises(dtenjax.ConfigurationError, match="OSError: libcufile.so.0"):
    ckio.backend("kvikio")


# --- fresh processes: continuation and the 2 x 4 geometry ---------------------------------------

def _env(devices):
  e = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=mp_launch.pythonpath(),
           XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} --xla_cpu_max_isa=AVX")
  return e


def _train(*args):
  return ["-m", "tests.mp_workers.checkpoint_worker", "train", *args]


# Session-scoped: the `slow` test below runs first in its xdist worker (tests/conftest.py), far
# from the other; a module fixture was torn down between them and its job run twice.
@pytest.fixture(scope="session")
def two_processes(tmp_path_factory):
  """One jax.distributed job of 2 processes x 4 devices for both tests below (the processes'
  start paid once): 10 training steps saved at step 10, then the 2 x 4 geometry checkpoint.
  Returns (directory, results by rank)."""
  tmp = tmp_path_factory.mktemp("two_processes")
  out_dir = tmp / "mp"
  out_dir.mkdir()
  codes, results, logs = mp_launch.launch(
      "tests.mp_workers.checkpoint_worker", 2, str(out_dir), devices_per_proc=4, timeout_s=300,
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_max_isa=AVX"},
      args=["train", "--steps", "10", "--save", str(tmp / "step10"), "--geometry",
            str(tmp / "g")])
  assert codes == [0, 0], logs
  return tmp, results


@pytest.mark.multiprocess
@pytest.mark.slow
def test_continuation_is_bit_identical_across_processes_and_device_counts(two_processes):
  """20 steps in one 8-device process == 10 steps in 2 processes x 4 devices, save, then 10
  more in a fresh process of 4 devices after a restore (the process count, the device count and
  the parameters' sharding all change)."""
  tmp, results = two_processes
  saved = str(tmp / "step10")
  first = {k: v for k, v in results[0].items() if k != "geometry"}
  assert first["processes"] == 2 and first["devices"] == 8
  assert {**results[1], "report": None, "geometry": None} == {**first, "report": None,
                                                              "geometry": None}
  assert "process 0/2" in first["report"] and "process 1/2" in results[1]["report"]
  runs = {"ref": (_train("--steps", "20"), _env(8)),
          "restored": (_train("--steps", "10", "--restore", saved), _env(4))}
  outs = run_at_once(runs, 240, mp_launch.fork_servers([e for _, e in runs.values()]))
  ref, r = (json.loads(outs[k].splitlines()[-1]) for k in ("ref", "restored"))
  assert ref["devices"] == 8 and ref["processes"] == 1 and len(set(ref["losses"])) == 20
  assert first["losses"] == ref["losses"][:10]
  assert r["devices"] == 4 and r["step"] == 20
  assert r["losses"] == ref["losses"][10:]               # bit for bit, float32 hex
  assert r["digest"] == ref["digest"]                    # parameters and optimizer state


@pytest.mark.multiprocess
def test_two_processes_write_their_own_shards_and_read_only_theirs(two_processes):
  tmp_path, results = two_processes
  results = [r["geometry"] for r in results]
  nbytes = 64 * 1024 * 4
  for pid, r in enumerate(results):
    # 2 x 4 mesh rows: process 0 holds chunk row 0, process 1 row 1; the replicated leaf and
    # the step counter have their replica 0 on device 0 (process 0)
    assert r["wrote"]["x"] == [f"{pid}.{j}" for j in range(4)]
    assert ("rep" in r["wrote"], "step" in r["wrote"]) == (pid == 0, pid == 0)
    assert r["saved_bytes"] == nbytes // 2 + (pid == 0) * (5 * 4 + 8)
    for label in ("4x2", "rows8", "replicated"):
      assert r[label]["ok"], (pid, label, r)
    assert r["rows8"]["bytes"] == nbytes // 2 + 5 * 4 + 8     # its 4 row blocks, no more
    assert r["4x2"]["bytes"] == nbytes // 2 + 5 * 4 + 8
    assert r["replicated"]["bytes"] == nbytes + 5 * 4 + 8
  # in one process of 8 devices (the saved shardings name the other processes' device ids)
  m = jax.make_mesh((2, 4), ("a", "b"))
  full = ckpt.restore(tmp_path / "g", shardings={"x": NamedSharding(m, P("a", "b")),
                                                 "rep": NamedSharding(m, P()), "step": None})
  ref = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
  assert _bits(full["x"]) == _bits(ref) and full["step"] == 7


def test_reports_print_small_figures_in_a_unit_that_shows_them(tmp_path):
  report = ckpt.save(tmp_path / "c", {"x": jnp.ones((1 << 10,), jnp.float32)})
  text = str(report)
  assert "4.10 kB in" in text and "0.00 GB/s" not in text, text
  assert re.search(r"\(\d+\.\d\d (MB|kB|GB)/s;", text), text
  _, rr = ckpt.restore(tmp_path / "c", report=True)
  assert "0.00 GB/s" not in str(rr) and re.search(r"\d\.\d\d (GB|MB|kB)/s", str(rr)), str(rr)
  assert ckio.rate(1e6, 1.0) == "1.00 MB/s" and ckio.rate(5e9, 2.0) == "2.50 GB/s"
  assert ckio.rate(10, 1.0) == "10 B/s"


def test_checkpoint_io_is_in_dtenjax_info(monkeypatch, capsys):
  """``dtenjax info`` reads DTENJAX_CHECKPOINT_IO when it runs, so the command runs in this
  process (a ``python -m dtenjax info`` of its own was 1.3 s of CPU importing jax; the command
  line's own process is tests/test_main.py's and tests/test_cli.py's)."""
  from dtenjax import __main__ as cli
  monkeypatch.setenv("DTENJAX_CHECKPOINT_IO", "posix")
  assert cli.main(["info"]) == 0
  assert "checkpoint io: posix" in capsys.readouterr().out



@pytest.mark.gpu
def test_gpu_arrays_round_trip_asynchronously(tmp_path):
  """Device memory -> file -> device memory on a GPU, through an asynchronous save whose caller
  deletes its arrays at once (the shards were copied to the host before save() returned)."""
  gpus = jax.devices("gpu")
  ref = _f32_with_odd_bits(len(gpus) * 4096).reshape(len(gpus), 4096)
  mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
  x = jax.make_array_from_callback(ref.shape, NamedSharding(mesh, P("x")), lambda i: ref[i])
  bf = jax.device_put(jnp.asarray(ref[0], jnp.bfloat16), gpus[0])
  with ckpt.Checkpointer() as c:
    c.save(tmp_path / "g", {"x": x, "bf": bf, "step": 1})
    expected_bf = _bits(bf)
    x.delete()
    bf.delete()
  out, report = ckpt.restore(tmp_path / "g", report=True)
  assert out["x"].sharding.device_set == set(gpus) and _bits(out["x"]) == _bits(ref)
  assert list(out["bf"].devices())[0].platform == "gpu" and _bits(out["bf"]) == expected_bf
  assert report.io == ckio.describe()["path"]
