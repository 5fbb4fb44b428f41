"""Tests of the NVLink p2p all-reduce (dtenjax/_src/gpu/p2p.py, csrc/p2p/).

CPU: gating, error messages, rank order of mesh groups, the lowering-time fallback, that a CUDA
build contains the targets, and the argument checks of the simulated-rank harness (the test
extension's, dtenjax/testing/native.py). GPU (marked `gpu`): the kernels with N simulated ranks
on one GPU against independent numpy references, bit for bit, inside and outside CUDA graphs; the PUBLIC
dtenjax.all_reduce on every GPU of the machine in one process (plain jax.shard_map, jax.set_mesh,
dtenjax.mesh_map, 2-D meshes, messages larger than the registered buffer); one process per GPU
(jax.distributed on 127.0.0.1, CUDA IPC); and a peer that never arrives (the step must fail).
"""

import functools
import os
import subprocess
import sys
import tempfile
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import dtenjax
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.contract import Contract
from dtenjax._src.gpu import p2p
from dtenjax.testing.native import p2p_selftest
from tests import fixed_point_ref as fpref
from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


# --- independent references of the bit contracts (numpy, not dtenjax code) ---------------------

def fold_reference(x, op="sum"):
  """Rank-order fold over axis 0 in float32, one rounding to x's dtype."""
  x = np.asarray(x)
  v = x.astype(np.float32)
  acc = v[0].copy()
  for r in range(1, v.shape[0]):
    if op in ("sum", "mean"):
      acc = acc + v[r]
    elif op == "max":
      acc = np.where(v[r] > acc, v[r], acc)
    else:
      acc = np.where(v[r] < acc, v[r], acc)
  if op == "mean":
    acc = (acc / np.float32(v.shape[0])).astype(np.float32)
  if op in ("max", "min"):
    acc = np.where(np.isnan(v).any(axis=0), np.float32(np.nan), acc)
  return acc.astype(x.dtype)


def reproducible_reference(x, mean=False, contract=True):
  """The reproducible sums over axis 0 (contract v3 for ``reproducible=True``, v2 for
  ``"exact"``): the independent numpy references the XLA path is pinned to."""
  if contract == "exact":
    return fpref.exact_sum(np.asarray(x), mean=mean)
  return fpref.v3_sum(np.asarray(x), mean=mean)


def test_references_are_what_they_claim():
  # Fold order matters: (1e8 + 1) - 1e8 == 0 in f32; -1e8 + 1e8 + 1 == 1.
  x = np.array([[1e8], [1.0], [-1e8]], np.float32)
  assert fold_reference(x)[0] == 0.0 and fold_reference(x[[0, 2, 1]])[0] == 1.0
  assert np.signbit(fold_reference(np.array([[-0.0]], np.float32))[0])
  xb = np.array([[256.0], [1.0], [1.0]], ml_dtypes.bfloat16)
  assert float(fold_reference(xb)[0]) == 258.0
  # The reproducible sum is exact, so the order does not matter and 1 is not lost.
  assert reproducible_reference(x)[0] == 1.0 == reproducible_reference(x[[2, 1, 0]])[0]
  sub = np.array([[1e-45], [1e-45], [2e-45]], np.float32)       # subnormals add exactly
  assert reproducible_reference(sub)[0] == np.float32(4e-45)
  assert np.isnan(reproducible_reference(np.array([[np.inf], [-np.inf]], np.float32))[0])
  assert reproducible_reference(np.array([[np.inf], [1.0]], np.float32))[0] == np.inf
  assert reproducible_reference(np.array([[3e38], [3e38]], np.float32))[0] == np.inf
  assert not np.signbit(reproducible_reference(np.array([[-0.0], [-0.0]], np.float32))[0])
  # bf16: exact sum, decoded to float32, rounded once more: 256 + 1 + 1 = 258.
  assert float(reproducible_reference(xb)[0]) == 258.0
  # Against the element's exponent (1e8 < 2**27) v3 keeps 29 bits for 3 contributions (a unit of
  # 2**-2), the exact contract 40 (2**-13).
  tiny = np.array([[1e8], [0.3], [-1e8]], np.float32)
  assert reproducible_reference(tiny)[0] == 0.25
  assert reproducible_reference(tiny, contract="exact")[0] == np.float32(2458 / 8192)
  for c in (True, "exact"):
    assert reproducible_reference(x, contract=c)[0] == 1.0
    assert reproducible_reference(sub, contract=c)[0] == np.float32(4e-45)


# --- CPU ---------------------------------------------------------------------------------------

def test_cuda_build_contains_targets_and_bindings():
  info = ffi.build_info()
  if not info["built"] or not info["cuda"]:
    pytest.skip(f"extension built without CUDA: {info}")
  assert (p2p.TARGET, "CUDA") in info["targets"]
  assert "p2p" in info["bindings"]
  for name in ("p2p_register", "p2p_connect", "p2p_kernel_timeouts"):
    assert hasattr(ffi.module(), name), name


def test_native_setup_errors_are_dtenjax_errors():
  if not ffi.build_info()["cuda"]:
    pytest.skip("extension built without CUDA")
  with pytest.raises(errors.ConfigurationError, match="multiple of 16"):
    ffi.module().p2p_register(0, 17)
  with pytest.raises(errors.ConfigurationError, match="128 bytes per rank"):
    ffi.module().p2p_connect(0, 1, 0, 2, b"x" * 128)


def test_set_up_exchange_failures_are_dtenjax_errors(monkeypatch):
  # lowering falls back on a DtenjaxError only: a store failure, a peer that never publishes, and
  # the retry after it (which publishes the same key again) must all be DtenjaxErrors
  from dtenjax._src.net import kvstore
  client = kvstore.InMemoryClient()
  monkeypatch.setattr(p2p.jaxapi, "coordination_client", lambda: client)
  monkeypatch.setenv("DTENJAX_COLLECTIVE_TIMEOUT", "0.05")
  me, peer = (types.SimpleNamespace(id=i, process_index=i) for i in (0, 1))
  for _ in range(2):
    with pytest.raises(errors.CollectiveTimeoutError, match="descriptor of device 1 .process 1"):
      p2p._exchange(7, [me, peer], {0: b"d" * 8})

  class Down(kvstore.InMemoryClient):
    def key_value_set(self, key, value, allow_overwrite=False):
      raise RuntimeError("UNAVAILABLE: failed to connect to all addresses")
  client = Down()
  with pytest.raises(errors.TransportError, match="device 0 .*UNAVAILABLE"):
    p2p._exchange(7, [me, peer], {0: b"d" * 8})


def test_gate_lists_every_problem(monkeypatch):
  monkeypatch.setenv("DTENJAX_P2P_MAX_BLOCKS", "500")
  v = p2p.gate(world=9, dtype=jnp.int32, op="prod")
  assert not v.ok
  for part in ("int32", "world size 9", "'prod'", "DTENJAX_P2P_MAX_BLOCKS=500"):
    assert part in v.reason, (part, v.reason)
  assert "bytes" not in v.reason.replace("BUFFER_BYTES", "")   # any size: large ones chunk
  v = p2p.gate(world=2, dtype=jnp.float16, op="max", contract=Contract.V3)
  assert not v.ok and "float16" in v.reason and "'max' has no reproducible form" in v.reason


def test_gate_without_gpu_says_why():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  v = p2p.gate(world=2, dtype=jnp.bfloat16)
  assert not v.ok and v.failed[0] == "deployment"
  assert "no CUDA GPU" in v.reason or "not built" in v.reason or "no CUDA kernels" in v.reason


def test_bad_buffer_knob(monkeypatch):
  monkeypatch.setenv("DTENJAX_P2P_BUFFER_BYTES", "1000")
  v = p2p.gate(world=2, dtype=jnp.float32)
  assert not v.ok and "DTENJAX_P2P_BUFFER_BYTES=1000" in v.reason
  assert "multiple of 16" in v.reason     # the kernels' 16-byte vectors (csrc/p2p/vocabulary.h)


def test_all_reduce_rejects_bad_arguments(cpu_devices):
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
  run = lambda x, **kw: _smap(mesh, lambda v: p2p.all_reduce(v, "x", **kw))(x)
  with pytest.raises(errors.CollectiveError) as e:
    run(jnp.zeros((4,), jnp.int32), algorithm="three_shot", op="prod")
  msg = str(e.value)
  assert "three_shot" in msg and "'prod'" in msg and "int32" in msg
  with pytest.raises(errors.CollectiveError, match="no reproducible form"):
    run(jnp.zeros((4,), jnp.float32), op="max", contract=Contract.V3)
  with pytest.raises(errors.CollectiveError, match="is not a Contract"):
    run(jnp.zeros((4,), jnp.float32), contract="v3")
  with pytest.raises(errors.CollectiveError, match="'x' is not bound here"):
    p2p.all_reduce(jnp.zeros((4,), jnp.float32), "x")


_smap = functools.partial(helpers.smap, axes=("x",))


def test_unavailable_without_fallback_names_fix(cpu_devices):
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
  f = _smap(mesh, lambda v: p2p.all_reduce(v, "x", algorithm="one_shot"))
  with pytest.raises(errors.CollectiveError, match="algorithm='xla'"):
    f(jnp.ones((8,), jnp.float32))


def test_unavailable_with_fallback_runs_the_fallback(cpu_devices):
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("x",))
  f = _smap(mesh, lambda v: p2p.all_reduce(v, "x", fallback=lambda u: lax.psum(u, "x") + 1))
  x = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(f(x)), np.tile(x.reshape(4, 2).sum(0) + 1, 4))


@pytest.mark.parametrize("contract", list(Contract))
def test_every_contract_reaches_the_gate_and_falls_back_off_gpu(cpu_devices, contract):
  # the nvlink records pass call.contract, a Contract parsed once at the public API; on a
  # machine without the kernels each one falls back with the gate's reason instead of failing
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
  f = _smap(mesh, lambda v: p2p.all_reduce(v, "x", contract=contract,
                                           fallback=lambda u: lax.psum(u, "x")))
  x = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(f(x)), np.tile(x.reshape(2, 4).sum(0), 2))


def test_lowering_falls_back_when_not_cuda(cpu_devices, caplog):
  """The set-up decision happens while lowering: on a non-CUDA lowering the primitive lowers the
  fallback (logged), and without one it raises saying why."""
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("x",))
  x = np.arange(8, dtype=np.float32)

  def body(fallback):
    return lambda v: p2p._p2p_p.bind(v, axes=("x",), algorithm="one_shot", op="sum",
                                     contract=Contract.NONE, world=4, fallback=fallback)

  f = _smap(mesh, body(lambda u: lax.psum(u, "x") * 2))
  np.testing.assert_array_equal(np.asarray(f(x)), np.tile(x.reshape(4, 2).sum(0) * 2, 4))
  g = _smap(mesh, body(None))
  with pytest.raises(Exception, match="not CUDA"):
    g(x)


def _bind(fallback, axes=("x",)):
  return lambda v: p2p._p2p_p.bind(v, axes=axes, algorithm="one_shot", op="sum",
                                   contract=Contract.NONE, world=4, fallback=fallback)


def test_vmap_over_the_reduced_axis_uses_the_fallback():
  # jax.vmap's named axis has no GPUs: the batching rule must run the fallback over that axis.
  f = jax.jit(jax.vmap(_bind(lambda u: lax.psum(u, "v"), ("v",)), axis_name="v"))
  x = np.arange(6, dtype=np.float32).reshape(3, 2)
  np.testing.assert_array_equal(np.asarray(f(x)), np.tile(x.sum(0), (3, 1)))
  with pytest.raises(errors.CollectiveError, match="vmap axis 'v'"):
    jax.vmap(_bind(None, ("v",)), axis_name="v")(x)


def test_vmap_over_an_unnamed_batch_axis_reduces_each_element(cpu_devices):
  # An ordinary batch axis is more elements: every one reduced across the mesh independently.
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("x",))
  fb = lambda u: lax.psum(u, "x")
  f = _smap(mesh, jax.vmap(_bind(fb)))
  x = np.arange(24, dtype=np.float32).reshape(4, 6)      # per device: [1, 6] -> vmapped over 1
  got = np.asarray(f(x.reshape(4 * 1, 6)))
  np.testing.assert_array_equal(got, np.tile(x.sum(0), (4, 1)))


def test_groups_follow_axis_order(cpu_devices):
  mesh = jax.sharding.Mesh(np.array(cpu_devices).reshape(2, 4), ("a", "b"))
  ids = lambda groups: [[d.id for d in g] for g in groups]
  d = [c.id for c in cpu_devices]
  assert ids(p2p.groups_of(mesh, ("a",))) == [[d[i], d[i + 4]] for i in range(4)]
  assert ids(p2p.groups_of(mesh, ("b",))) == [d[:4], d[4:]]
  assert ids(p2p.groups_of(mesh, ("a", "b"))) == [d]
  assert ids(p2p.groups_of(mesh, ("b", "a"))) == [[d[0], d[4], d[1], d[5], d[2], d[6], d[3],
                                                   d[7]]]
  # The rank is lax.axis_index over the same axes: check it against jax itself.
  f = jax.jit(jax.shard_map(lambda v: lax.axis_index(("b", "a"))[None], mesh=mesh,
                            in_specs=jax.P(("a", "b")), out_specs=jax.P(("a", "b"))))
  where = {dev.id: int(np.asarray(s.data)[0])
           for s in f(np.zeros(8, np.int32)).addressable_shards for dev in [s.device]}
  group = ids(p2p.groups_of(mesh, ("b", "a")))[0]
  assert [where[i] for i in group] == list(range(8))
  with pytest.raises(errors.CollectiveError, match="'c'"):
    p2p.groups_of(mesh, ("c",))


# --- GPU: simulated ranks on one GPU ---------------------------------------------------------

SIZES = (1, 3, 8, 9, 1000, 4097, 65536 + 5, (1 << 20) + 3)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _stacked(world, count, dtype, seed, special=False):
  rng = np.random.default_rng(seed)
  n = -(-count // 8) * 8  # 16-byte aligned rows for every dtype
  x = rng.standard_normal((world, n)).astype(np.float32) * 4
  if special:   # widely spread exponents, zeros, subnormals and non-finite values
    x *= np.float32(2.0) ** rng.integers(-140, 120, size=x.shape).astype(np.float32)
    for r in range(world):
      x[r, rng.integers(0, n, size=max(1, n // 50))] = rng.choice(
          np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e-39, 3.3e38], np.float32))
  x[:, count:] = np.nan  # padding must never leak into the result
  return np.asarray(x).astype(dtype)


def _reference(x, op, reproducible):
  if reproducible:
    return reproducible_reference(x, mean=op == "mean", contract=reproducible)
  return fold_reference(x, op)


def _assert_bits(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  nan = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan, err_msg=what)
  np.testing.assert_array_equal(_bits(got)[~nan], _bits(want)[~nan], err_msg=what)


@pytest.mark.gpu
@pytest.mark.parametrize("world", (2, 4, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_selftest_bitwise_sum(world, dtype, algorithm):
  for i, count in enumerate(SIZES):
    x = _stacked(world, count, dtype, seed=1000 * world + i)
    out = jax.jit(lambda v: p2p_selftest(v, algorithm=algorithm, count=count, iters=3))(x)
    want = fold_reference(x[:, :count])
    for r in range(world):
      _assert_bits(np.asarray(out)[r, :count], want, f"rank {r}, count {count}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ("mean", "max", "min"))
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_selftest_bitwise_other_ops(op, algorithm):
  for world, dtype in ((3, jnp.float32), (4, jnp.bfloat16), (8, jnp.float16)):
    count = 70001
    x = _stacked(world, count, dtype, seed=world)
    x[world - 1, 5] = np.nan
    out = jax.jit(lambda v: p2p_selftest(v, algorithm=algorithm, op=op, count=count))(x)
    want = fold_reference(x[:, :count], op)
    for r in range(world):
      _assert_bits(np.asarray(out)[r, :count], want, f"{op} world {world} rank {r}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", (2, 3, 4, 8))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
@pytest.mark.parametrize("op", ("sum", "mean"))
@pytest.mark.parametrize("contract", (True, "exact"))
def test_selftest_reproducible_bitwise(world, dtype, algorithm, op, contract):
  for i, count in enumerate((1, 9, 4097, 100003)):
    x = _stacked(world, count, dtype, seed=77 * world + i, special=True)
    out = jax.jit(lambda v: p2p_selftest(v, algorithm=algorithm, op=op, reproducible=contract,
                                         count=count))(x)
    want = reproducible_reference(x[:, :count], mean=op == "mean", contract=contract)
    for r in range(world):
      _assert_bits(np.asarray(out)[r, :count], want, f"{contract} rank {r}, count {count}")


DATA = os.path.join(ROOT, "tests", "data")


def _stored_reference():
  """(name, contributions [w, 1024], op, contract, expected) from the stored CPU bits
  (tests/data, written by the numpy references): contract v3 for w = 2..8 simulated ranks (the
  first w contributions), the exact contract for all 8."""
  v3 = np.load(os.path.join(DATA, "reproducible_v3_ref.npz"), allow_pickle=False)
  v2 = np.load(os.path.join(DATA, "reproducible_ref.npz"), allow_pickle=False)
  for name in ("float32", "bfloat16"):
    view = np.float32 if name == "float32" else ml_dtypes.bfloat16
    x = v3["x_float32"] if name == "float32" else v3["x_bfloat16"].view(ml_dtypes.bfloat16)
    for op in ("sum", "mean"):
      for w in range(2, 9):
        yield f"{op}_{name}_{w}", x[:w], op, True, v3[f"{op}_{name}_{w}"].view(view)
      yield f"{op}_{name}_exact", x, op, "exact", v2[f"{op}_{name}"].view(view)


@pytest.mark.gpu
def test_reproducible_kernel_matches_stored_cpu_bits():
  """The stored CPU bits, reproduced by the fused kernels with 2..8 simulated ranks for both
  algorithms (contract v3) and with 8 (the exact contract)."""
  for name, x, op, contract, want in _stored_reference():
    for algorithm in ("one_shot", "two_shot"):
      out = jax.jit(lambda v: p2p_selftest(v, algorithm=algorithm, op=op,
                                           reproducible=contract))(x)
      for r in range(x.shape[0]):
        _assert_bits(np.asarray(out)[r], want, f"{name} {algorithm} rank {r}")


def _host_compiler():
  import shutil
  return next((c for c in (os.environ.get("CXX"), "c++", "g++", "clang++") if c and
               shutil.which(c)), None)


def test_kernel_arithmetic_of_contract_v3_built_for_the_host(tmp_path):
  """csrc/p2p/repro_v3.h is what the kernels compute per element in registers; built for
  the host (IEEE float32 with subnormals, as the kernels without -ftz) it must give the numpy
  reference's bits for every world 2..8, float32 and bfloat16, sum and mean, on the adversarial
  suite and on data in the normal range. The bfloat16 result is the RNE conversion of the float
  it returns (what the kernels' final conversion does)."""
  cxx = _host_compiler()
  if cxx is None:
    pytest.skip("no C++ compiler on PATH (the extension build needs one too)")
  exe = tmp_path / "v3host"
  r = subprocess.run([cxx, "-std=c++17", "-O2", "-ffp-contract=off", f"-I{ROOT}",
                      os.path.join(ROOT, "tests", "native", "p2p_repro_v3_main.cc"), "-o",
                      str(exe)], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr                   # a build failure fails, never skips
  rng = np.random.default_rng(0)
  for w in range(2, 9):
    wide = rng.standard_normal((w, 3000)) * np.exp2(rng.integers(-60, 120, (w, 3000)))
    base = np.concatenate([fpref.contributions(w, 4000, seed=w), wide.astype(np.float32)], 1)
    if w == 2:   # RepSum2's one addition and its error, against the words: any bits, any gap
      raw = rng.integers(0, 2**32, (2, 100000), dtype=np.uint64).astype(np.uint32)
      raw[1, ::2] = (raw[0, ::2] ^ 0x80000000) + rng.integers(-300, 300, 50000).astype(np.uint32)
      base = np.concatenate([base, raw.view(np.float32)], 1)
    for dtype in (np.float32, ml_dtypes.bfloat16):
      with np.errstate(invalid="ignore"):
        x = base.astype(dtype)         # the NaNs of the raw bits
      for mean in (False, True):
        inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
        with open(inp, "wb") as f:
          f.write(np.array([w, int(mean), int(dtype != np.float32), x.shape[1]], np.int32)
                  .tobytes())
          f.write(x.astype(np.float32).tobytes())
        subprocess.run([str(exe), str(inp), str(out)], check=True, timeout=60)
        got = np.fromfile(out, np.uint32).view(np.float32).astype(dtype)
        want = reproducible_reference(x, mean=mean)
        bad = np.nonzero(_bits(got) != _bits(want))[0]
        assert bad.size == 0, (w, dtype, mean, bad[:5], x[:, bad[:2]], got[bad[:2]],
                               want[bad[:2]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_shot_bits_equal_one_shot(dtype):
  x = _stacked(8, 100003, dtype, seed=7)
  a = np.asarray(jax.jit(lambda v: p2p_selftest(v, algorithm="one_shot", count=100003))(x))
  b = np.asarray(jax.jit(lambda v: p2p_selftest(v, algorithm="two_shot", count=100003))(x))
  np.testing.assert_array_equal(_bits(a[:, :100003]), _bits(b[:, :100003]))


def _graph_step(algorithm, count, compiler_options=None):
  def step(v):
    # Several small ops around the custom call so that XLA forms a command buffer (min size 5).
    y = p2p_selftest(v * 1.0, algorithm=algorithm, count=count, iters=2, graph=True)
    return (y + 0.0) * 1.0
  return jax.jit(step, compiler_options=compiler_options or {})


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ("default", "off"))
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_selftest_inside_and_outside_cuda_graphs(graphs, algorithm):
  world, count = 4, 50001
  x = _stacked(world, count, jnp.float32, seed=3)
  jax.jit(lambda v: p2p_selftest(v, algorithm=algorithm, count=count))(x).block_until_ready()
  opts = {"xla_gpu_enable_command_buffer": ""} if graphs == "off" else None
  step = _graph_step(algorithm, count, opts)
  want = fold_reference(x[:, :count])
  for it in range(5):  # replays: the epoch in device memory keeps increasing, no host reset
    got = np.asarray(step(x))[:, :count]
    for r in range(world):
      _assert_bits(got[r], want, f"replay {it}, rank {r}")


def _run_python(code: str, env: dict, timeout: float):
  e = dict(os.environ)
  e.update(env)
  e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e,
                        timeout=timeout, cwd=ROOT)


@pytest.mark.gpu
def test_peer_that_never_arrives_fails_the_step():
  """A barrier timeout traps the kernel: the step raises (never returns data), a watchdog line
  says which rank waited for which, and later calls report it. In a process of its own: the trap
  ends the CUDA context."""
  code = """
import numpy as np, jax
from dtenjax._src.gpu import p2p
from dtenjax.testing.native import p2p_selftest
x = np.ones((2, 1024), np.float32)
try:
  y = jax.jit(lambda v: p2p_selftest(v, mode=3, iters=1))(x)
  np.asarray(y)
  print("RESULT-RETURNED", float(np.asarray(y)[0, 0]))
except Exception as e:
  print("STEP-FAILED", type(e).__name__, e)
import os, sys, time; time.sleep(0.5)
print("TIMEOUTS", p2p.kernel_timeouts(), flush=True)
sys.stderr.flush()
os._exit(0)   # the trapped CUDA context cannot be torn down cleanly
"""
  r = _run_python(code, {"DTENJAX_COLLECTIVE_TIMEOUT": "0.5", "DTENJAX_TEST_PLATFORM": "gpu",
                       "JAX_PLATFORMS": ""},
                  timeout=120)
  out = r.stdout + r.stderr
  assert "RESULT-RETURNED" not in out, out
  assert "STEP-FAILED" in out, out
  assert "rank 0 waited past DTENJAX_COLLECTIVE_TIMEOUT for rank 1" in out, out


# --- GPU: every GPU of the machine, public API, one process ------------------------------------

def _gpus():
  return jax.devices("gpu") if jax.default_backend() == "gpu" else []


def _need_gpus(n=2):
  if len(_gpus()) < n:
    pytest.skip(f"needs {n} GPUs in this process, found {len(_gpus())}")


CASES = [("one_shot", "sum", False), ("two_shot", "sum", False), ("one_shot", "mean", False),
         ("two_shot", "max", False), ("one_shot", "min", False), ("one_shot", "sum", True),
         ("two_shot", "sum", True), ("two_shot", "mean", True)]
CASE_IDS = [f"{a}-{o}" + ("-v3" if r is True else f"-{r}" if r else "") for a, o, r in CASES]


def _public(algorithm, op, reproducible):
  return lambda v: dtenjax.all_reduce(v, "x", algorithm=algorithm, op=op,
                                      reproducible=reproducible)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ("default", "off"))
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_public_all_reduce_plain_shard_map(case, dtype, graphs):
  _need_gpus()
  algorithm, op, reproducible = case
  gpus = _gpus()
  world = len(gpus)
  mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
  opts = {"xla_gpu_enable_command_buffer": ""} if graphs == "off" else {}
  body = _public(algorithm, op, reproducible)
  f = jax.jit(jax.shard_map(lambda v: body(v * 1.0) * 1.0, mesh=mesh, in_specs=jax.P("x"),
                            out_specs=jax.P("x"), check_vma=False), compiler_options=opts)
  for n in (1003, 300007):
    x = _stacked(world, n, dtype, seed=n, special=reproducible)[:, :n]
    want = _reference(x, op, reproducible)
    for _ in range(2):
      got = np.asarray(f(x.reshape(-1))).reshape(world, n)
      for r in range(world):
        _assert_bits(got[r], want, f"{case} n={n} rank {r}")


@pytest.mark.gpu
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_public_all_reduce_under_set_mesh_and_mesh_map(algorithm):
  _need_gpus()
  gpus = _gpus()
  world = len(gpus)
  mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
  x = _stacked(world, 4099, jnp.float32, seed=5)[:, :4099]
  want = fold_reference(x)
  with jax.set_mesh(mesh):
    f = jax.jit(jax.shard_map(_public(algorithm, "sum", False), in_specs=jax.P("x"),
                              out_specs=jax.P("x"), check_vma=False))
    got = np.asarray(f(x.reshape(-1))).reshape(world, -1)
  for r in range(world):
    _assert_bits(got[r], want, f"set_mesh rank {r}")
  g = jax.jit(dtenjax.mesh_map(_public(algorithm, "sum", False), mesh, in_specs=jax.P("x"),
                               out_specs=jax.P("x"), check_vma=False))
  got = np.asarray(g(x.reshape(-1))).reshape(world, -1)
  for r in range(world):
    _assert_bits(got[r], want, f"mesh_map rank {r}")


@pytest.mark.gpu
def test_public_all_reduce_larger_than_the_buffer():
  _need_gpus()
  gpus = _gpus()
  world = len(gpus)
  mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
  n = p2p.capacity_bytes() // 4 + (3 << 20) + 5        # more than one chunk of f32
  x = np.random.default_rng(1).standard_normal((world, n)).astype(np.float32)
  want = fold_reference(x)
  for algorithm in ("one_shot", "two_shot"):
    f = jax.jit(jax.shard_map(_public(algorithm, "sum", False), mesh=mesh, in_specs=jax.P("x"),
                              out_specs=jax.P("x"), check_vma=False))
    got = np.asarray(f(x.reshape(-1))).reshape(world, n)
    for r in range(world):
      _assert_bits(got[r], want, f"{algorithm} rank {r}")


@pytest.mark.gpu
def test_public_all_reduce_over_one_axis_of_a_2d_mesh():
  _need_gpus(4)
  gpus = _gpus()[:4]
  mesh = jax.sharding.Mesh(np.array(gpus).reshape(2, 2), ("a", "b"))
  x = np.random.default_rng(2).standard_normal((2, 2, 1000)).astype(np.float32)
  for axis in ("a", "b"):
    f = jax.jit(jax.shard_map(lambda v: dtenjax.all_reduce(v, axis, algorithm="one_shot"),
                              mesh=mesh, in_specs=jax.P("a", "b"), out_specs=jax.P("a", "b"),
                              check_vma=False))
    got = np.asarray(f(x))
    dim = 0 if axis == "a" else 1
    want = fold_reference(np.moveaxis(x, dim, 0))
    np.testing.assert_array_equal(_bits(np.moveaxis(got, dim, 0)[0]), _bits(want))


# --- GPU: one process per GPU (CUDA IPC) -----------------------------------------------------

@pytest.mark.gpu
def test_public_all_reduce_one_process_per_gpu():
  _need_gpus()
  from tests.mp_workers import launch
  n = len(_gpus())
  with tempfile.TemporaryDirectory() as out:
    # This pytest process already holds most of every GPU's memory (XLA preallocates).
    env = {"JAX_PLATFORMS": "", "XLA_FLAGS": "", "DTENJAX_TEST_PLATFORM": "gpu",
           "DTENJAX_BIND_ADDRESS": "127.0.0.1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.08"}
    codes, results, logs = launch.launch("tests.gpu_workers.p2p_worker", n, out, env=env,
                                         timeout_s=300)
    assert codes == [0] * n, "\n".join(logs)
    x = np.asarray(results[0]["inputs"], np.float32)          # [n, count], rank r's input
    for (algorithm, op, reproducible) in CASES:
      name = f"{algorithm}-{op}-{reproducible}"
      want = _reference(x, op, reproducible)
      for r, res in enumerate(results):
        got = np.asarray(res["outputs"][name], np.uint32).view(np.float32)
        _assert_bits(got, want, f"{name}: rank {r}")
