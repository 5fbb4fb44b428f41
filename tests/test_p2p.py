"""Tests of the NVLink p2p all-reduce (dtenjax/_src/gpu/p2p.py, csrc/cuda/p2p_*).

CPU: gating, error messages, the numpy reference of the bit contract, rank order of mesh groups,
and that a CUDA build contains the targets. GPU (marked `gpu`): the real kernels with N simulated
ranks on one GPU against the reference, bit for bit, inside and outside CUDA graphs, and the real
all-reduce handler through shard_map.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.gpu import p2p


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16)


# --- CPU ---------------------------------------------------------------------------------------

def test_cuda_build_contains_targets():
  info = ffi.build_info()
  if not info["built"] or not info["cuda"]:
    pytest.skip(f"extension built without CUDA: {info}")
  for t in p2p.TARGETS:
    assert (t, "CUDA") in info["targets"], t


def test_supported_lists_every_problem(monkeypatch):
  monkeypatch.setenv("DTENJAX_P2P_BUFFER_BYTES", str(1 << 20))
  ok, why = p2p.supported(9, (1 << 20) + 16, jnp.int32)
  assert not ok
  assert "int32" in why and "world size 9" in why and f"{(1 << 20) + 16} bytes" in why
  if jax.default_backend() == "cpu":
    assert "no CUDA GPU" in why or "not built" in why or "no CUDA kernels" in why


def test_supported_without_gpu_says_why():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  ok, why = p2p.supported(2, 1024, jnp.bfloat16)
  assert not ok and why


def test_bad_buffer_knob(monkeypatch):
  monkeypatch.setenv("DTENJAX_P2P_BUFFER_BYTES", "1000")
  with pytest.raises(errors.ConfigurationError, match="DTENJAX_P2P_BUFFER_BYTES=1000"):
    p2p.capacity_bytes()
  ok, why = p2p.supported(2, 64, jnp.float32)
  assert not ok and "multiple of 16" in why


def test_all_reduce_rejects_bad_arguments():
  x = jnp.zeros((4,), jnp.int32)
  with pytest.raises(errors.CollectiveError) as e:
    p2p.all_reduce(x, "x", algorithm="three_shot", op="max")
  msg = str(e.value)
  assert "three_shot" in msg and "'max'" in msg and "int32" in msg


def test_all_reduce_unavailable_on_cpu_names_fix(cpu_devices):
  if jax.default_backend() != "cpu":
    pytest.skip("CPU-only check")
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
  f = jax.shard_map(lambda v: p2p.all_reduce(v, "x", algorithm="one_shot", mesh=mesh),
                    mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
  with pytest.raises(errors.CollectiveError, match="algorithm='xla'"):
    f(jnp.ones((8,), jnp.float32))


def test_reference_is_rank_order_f32_fold():
  # Order matters: (1e8 + 1) - 1e8 == 0 in f32 (1 is lost), -1e8 + 1e8 + 1 would be 1.
  x = np.array([[1e8], [1.0], [-1e8]], np.float32)
  assert p2p.reference(x)[0] == 0.0
  assert p2p.reference(x[[0, 2, 1]])[0] == 1.0
  # First term is x_0 itself: -0.0 survives a one-rank reduction.
  assert np.signbit(p2p.reference(np.array([[-0.0]], np.float32))[0])
  # bf16: accumulate in f32, round once. 256 + 1 + 1 is 258 in f32 (representable in bf16);
  # bf16 accumulation would round 256 + 1 back to 256 twice.
  xb = np.array([[256.0], [1.0], [1.0]], jnp.bfloat16)
  assert float(p2p.reference(xb)[0]) == 258.0
  assert p2p.reference(xb).dtype == jnp.bfloat16


def test_groups_follow_axis_order(cpu_devices):
  mesh = jax.sharding.Mesh(np.array(cpu_devices).reshape(2, 4), ("a", "b"))
  ga = p2p._groups(mesh, "a")
  gb = p2p._groups(mesh, "b")
  assert [[d.id for d in g] for g in ga] == [[cpu_devices[i].id, cpu_devices[i + 4].id]
                                            for i in range(4)]
  assert [[d.id for d in g] for g in gb] == [[d.id for d in cpu_devices[:4]],
                                            [d.id for d in cpu_devices[4:]]]
  assert p2p._key_of(ga) != p2p._key_of(gb)
  assert p2p._key_of(ga) == p2p._key_of(p2p._groups(mesh, "a"))
  with pytest.raises(errors.CollectiveError, match="'c'"):
    p2p._groups(mesh, "c")


def test_prepare_needs_mesh_for_world_above_one():
  with pytest.raises(errors.CollectiveError, match="mesh="):
    p2p.prepare("x", 2, mesh=None)


# --- GPU ---------------------------------------------------------------------------------------

SIZES = (1, 3, 8, 9, 1000, 4097, 65536 + 5, (1 << 20) + 3)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _stacked(world, count, dtype, seed):
  rng = np.random.default_rng(seed)
  n = -(-count // 8) * 8  # 16-byte aligned rows for every dtype
  x = rng.standard_normal((world, n)).astype(np.float32) * 4
  x[:, count:] = np.nan  # padding must never leak into the result
  return x.astype(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("world", (2, 4, 8))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_selftest_bitwise(world, dtype, algorithm):
  for i, count in enumerate(SIZES):
    x = _stacked(world, count, dtype, seed=1000 * world + i)
    out = jax.jit(lambda v: p2p.selftest(v, algorithm=algorithm, count=count, iters=3))(x)
    want = p2p.reference(x[:, :count])
    got = np.asarray(out)[:, :count]
    for r in range(world):
      np.testing.assert_array_equal(_bits(got[r]), _bits(want),
                                    err_msg=f"rank {r}, count {count}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_two_shot_bits_equal_one_shot(dtype):
  x = _stacked(8, 100003, dtype, seed=7)
  a = np.asarray(jax.jit(lambda v: p2p.selftest(v, algorithm="one_shot", count=100003))(x))
  b = np.asarray(jax.jit(lambda v: p2p.selftest(v, algorithm="two_shot", count=100003))(x))
  np.testing.assert_array_equal(_bits(a[:, :100003]), _bits(b[:, :100003]))


def _graph_step(algorithm, count, compiler_options=None):
  def step(v):
    # Several small ops around the custom call so that XLA forms a command buffer (min size 5).
    y = p2p.selftest(v * 1.0, algorithm=algorithm, count=count, iters=2, graph=True)
    return (y + 0.0) * 1.0
  return jax.jit(step, compiler_options=compiler_options or {})


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ("default", "off"))
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_selftest_inside_and_outside_cuda_graphs(graphs, algorithm):
  world, count = 4, 50001
  x = _stacked(world, count, jnp.float32, seed=3)
  jax.jit(lambda v: p2p.selftest(v, algorithm=algorithm, count=count))(x).block_until_ready()
  opts = {"xla_gpu_enable_command_buffer": ""} if graphs == "off" else None
  step = _graph_step(algorithm, count, opts)
  want = _bits(p2p.reference(x[:, :count]))
  for it in range(5):  # replays: counters in device memory keep increasing, no host reset
    got = np.asarray(step(x))[:, :count]
    for r in range(world):
      np.testing.assert_array_equal(_bits(got[r]), want, err_msg=f"replay {it}, rank {r}")


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ("default", "off"))
@pytest.mark.parametrize("algorithm", ("one_shot", "two_shot"))
def test_all_reduce_handler_through_shard_map(graphs, algorithm):
  gpus = jax.devices("gpu")
  mesh = jax.sharding.Mesh(np.array(gpus), ("x",))
  world = len(gpus)
  ok, why = p2p.supported(world, 4 * 1000, jnp.float32)
  assert ok, why
  opts = {"xla_gpu_enable_command_buffer": ""} if graphs == "off" else {}

  def body(v):
    return (p2p.all_reduce(v * 1.0, "x", algorithm=algorithm, mesh=mesh) + 0.0) * 1.0

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")),
              compiler_options=opts)
  x = np.random.default_rng(0).standard_normal((world * 1003,)).astype(np.float32)
  want = p2p.reference(x.reshape(world, 1003))
  for _ in range(3):
    got = np.asarray(f(x)).reshape(world, 1003)
    for r in range(world):
      np.testing.assert_array_equal(_bits(got[r]), _bits(want))
