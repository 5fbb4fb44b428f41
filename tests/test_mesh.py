"""Tests of dtenjax._src.planning.mesh: topology-ordered make_mesh, as_mesh/use_mesh, mesh_map, pmap."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src import errors
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.topology import model as topo
from dtenjax._src.topology.model import DeviceInfo, Topology


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int = 0
  platform: str = "gpu"


def _cpu_topology(host_of, numa_of=None, intra="nvlink", inter="roce"):
  devs = [DeviceInfo(id=i, platform="cpu", kind="cpu", memory_bytes=0, process_index=0,
                     host=host_of(i), numa_node=(numa_of(i) if numa_of else 0), local_index=i)
          for i in range(8)]
  return topo.uniform("test", devs, intra=intra, inter=inter)


def _ids(mesh):
  return np.vectorize(lambda d: d.id)(mesh.devices)


def test_inner_axis_stays_on_fast_links(cpu_devices):
  # Devices 0, 2, 4, 6 share one host's NVLink; 1, 3, 5, 7 another's. Plain id order would put
  # every inner-axis neighbour pair across the network.
  t = _cpu_topology(lambda i: f"h{i % 2}")
  m = mesh_lib.make_mesh((2, 4), ("host", "gpu"), topology=t, devices=cpu_devices)
  assert isinstance(m, Mesh) and m.axis_names == ("host", "gpu")
  assert _ids(m).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
  for row in _ids(m):
    assert t.slowest_link(row.tolist())[0] == "nvlink"


def test_numa_then_position_inside_a_host(cpu_devices):
  # One host, two sockets with interleaved GPUs: PCIe islands are the sockets.
  t = _cpu_topology(lambda i: "h0", numa_of=lambda i: i % 2, intra="pcie")
  m = mesh_lib.make_mesh((2, 4), ("s", "g"), topology=t, devices=cpu_devices)
  assert _ids(m).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert t.slowest_link(_ids(m)[0].tolist())[0] == "pcie"


def test_ordering_is_deterministic(cpu_devices):
  t = _cpu_topology(lambda i: f"h{i % 2}")
  shuffled = list(cpu_devices)
  random.Random(0).shuffle(shuffled)
  a = mesh_lib.make_mesh((2, 4), ("a", "b"), topology=t, devices=cpu_devices)
  b = mesh_lib.make_mesh((2, 4), ("a", "b"), topology=t, devices=shuffled)
  assert _ids(a).tolist() == _ids(b).tolist()


def test_order_devices_on_roce_fixture_with_fake_devices():
  t = Topology.fixture("roce_a100_4x8")
  devs = [FakeDevice(i, process_index=i) for i in range(32)]
  random.Random(1).shuffle(devs)
  ordered = mesh_lib.order_devices(devs, t)
  rows = np.array([d.id for d in ordered]).reshape(4, 8)
  assert {t.slowest_link(r.tolist())[0] for r in rows} == {"nvlink"}
  assert t.slowest_link(rows[:, 0].tolist())[0] == "roce"
  assert [d.id for d in mesh_lib.order_devices(devs, t)] == [d.id for d in ordered]
  assert [d.id for d in mesh_lib.order_devices(devs, None)] == list(range(32))


def test_devices_not_in_topology():
  with pytest.raises(errors.TopologyError, match=r"devices \[40\] are not described"):
    mesh_lib.order_devices([FakeDevice(0), FakeDevice(40)], Topology.fixture("dgx_a100_8"))


def test_shape_device_count_mismatch_names_both_and_suggests(cpu_devices):
  with pytest.raises(errors.MeshError) as e:
    mesh_lib.make_mesh((3, 4), ("a", "b"), devices=cpu_devices)
  msg = str(e.value)
  assert "(3, 4) holds 12 devices but 8 are available" in msg
  assert "shape=(2, 4)" in msg


def test_invalid_axes_list_every_problem():
  with pytest.raises(errors.MeshError) as e:
    mesh_lib.make_mesh((2, 0, 4), ("a", "a"))
  msg = str(e.value)
  assert "has 3 axes but axis_names" in msg
  assert "positive integer" in msg
  assert "distinct" in msg


def test_as_mesh_and_use_mesh(cpu_devices):
  assert mesh_lib.as_mesh((2, 4)).axis_names == ("x", "y")
  assert mesh_lib.as_mesh((2, 4), ("d", "t")).axis_names == ("d", "t")
  m = mesh_lib.as_mesh(None)
  assert dict(m.shape) == {"x": 8}
  inner = mesh_lib.make_mesh((4, 2), ("p", "q"), devices=cpu_devices)
  assert mesh_lib.current_mesh() is None
  with mesh_lib.use_mesh(inner):
    assert mesh_lib.current_mesh() is inner
    assert mesh_lib.as_mesh(None) is inner
  assert mesh_lib.current_mesh() is None
  # Cached: the same arguments give the same Mesh object.
  assert mesh_lib.as_mesh((2, 4)) is mesh_lib.as_mesh((2, 4))


def test_mesh_map_misspelled_axis():
  with pytest.raises(errors.MeshError) as e:
    mesh_lib.mesh_map(lambda x: x, (2, 4), in_specs=P("xx", None), out_specs=P("y"))
  msg = str(e.value)
  assert "in_specs" in msg and "'xx' is not an axis" in msg and "did you mean 'x'" in msg
  assert "('x', 'y')" in msg
  with pytest.raises(errors.MeshError, match="out_specs"):
    mesh_lib.mesh_map(lambda x: x, (2, 4), in_specs=P("x"), out_specs=(P("x"), P(("x", "z"))))


def test_mesh_map_runs_per_shard_and_binds_mesh():
  mesh = mesh_lib.as_mesh((2, 4))
  seen = []

  def f(x):
    seen.append(mesh_lib.current_mesh())
    return jax.lax.psum(x.sum(keepdims=True), "y")

  g = mesh_lib.mesh_map(f, mesh, in_specs=P("x", "y"), out_specs=P("x", None))
  x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(2, 16)
  out = g(x)
  want = x.reshape(2, 4, 4).sum(axis=(1, 2))
  np.testing.assert_array_equal(np.asarray(out)[:, 0], want)
  assert seen and seen[0] is mesh
  assert mesh_lib.current_mesh() is None


def test_mesh_map_composes_with_jit_and_grad():
  mesh = mesh_lib.as_mesh((8,))

  def loss_shard(w, x):
    return jax.lax.psum(jnp.sum((x * w) ** 2), "x")

  loss = mesh_lib.mesh_map(loss_shard, mesh, in_specs=(P(), P("x")), out_specs=P())
  x = jnp.arange(16.0)
  w = jnp.float32(0.5)
  ref = lambda w: jnp.sum((x * w) ** 2)
  np.testing.assert_allclose(jax.jit(loss)(w, x), ref(w), rtol=1e-6)
  np.testing.assert_allclose(jax.jit(jax.grad(loss))(w, x), jax.grad(ref)(w), rtol=1e-6)


def test_pmap_over_leading_axis(cpu_devices):
  f = mesh_lib.pmap(lambda a, b: (a * 2 + b, jax.lax.psum(a, "i")), "i", devices=cpu_devices)
  a = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  b = jnp.ones((8, 3))
  y, s = f(a, b)
  np.testing.assert_array_equal(y, a * 2 + 1)
  np.testing.assert_array_equal(s, np.broadcast_to(a.sum(0), (8, 3)))
  y2, _ = jax.jit(f)(a, b)
  np.testing.assert_array_equal(y2, y)


def test_pmap_wrong_leading_axis_lists_all_leaves(cpu_devices):
  f = mesh_lib.pmap(lambda a, b, c: a + b, devices=cpu_devices)
  with pytest.raises(errors.MeshError) as e:
    f(jnp.ones((4, 2)), jnp.float32(1.0), jnp.ones((3,)))
  msg = str(e.value)
  assert "leaf 1 has shape ()" in msg and "in_axes 0 is not one of its axes" in msg
  assert "leaf 2 has shape (3,); its mapped axis has size 3 but the mapped size is 4" in msg
  with pytest.raises(errors.MeshError, match="mapped size 9 exceeds the 8 devices"):
    f(jnp.ones((9,)), jnp.ones((9,)), jnp.ones((9,)))


def test_pmap_takes_jax_pmaps_signature(cpu_devices):
  """axis_name=None by default, the mapped size from the arguments (fewer devices than there
  are), axis_size when nothing is mapped, and .lower -- as jax.pmap."""
  x = jnp.arange(4 * 3, dtype=jnp.float32).reshape(4, 3)
  ours = mesh_lib.pmap(lambda a: a * 2, devices=cpu_devices)
  np.testing.assert_array_equal(ours(x), jax.pmap(lambda a: a * 2, devices=cpu_devices[:4])(x))
  assert "stablehlo" in ours.lower(x).as_text() or "func" in ours.lower(x).as_text()
  assert ours.lower(x).compile()(x).shape == (4, 3)
  named = mesh_lib.pmap(lambda a: jax.lax.psum(a, "d"), axis_name="d", devices=cpu_devices)
  np.testing.assert_array_equal(named(x), np.broadcast_to(np.asarray(x).sum(0), (4, 3)))
  bcast = mesh_lib.pmap(lambda w: w + 1.0, in_axes=None, axis_size=2, devices=cpu_devices)
  np.testing.assert_array_equal(bcast(jnp.ones(3)), np.full((2, 3), 2.0))
  with pytest.raises(errors.MeshError, match="pass axis_size="):
    mesh_lib.pmap(lambda w: w, in_axes=None, devices=cpu_devices)(jnp.ones(3))
  with pytest.raises(errors.ConfigurationError, match="axis_size=0"):
    mesh_lib.pmap(lambda w: w, axis_size=0)


# --- axis types and jax's own meshes ---------------------------------------------------------

def test_make_mesh_axis_types(cpu_devices):
  from jax.sharding import AxisType
  auto = mesh_lib.make_mesh((2, 4), ("a", "b"), devices=cpu_devices)
  assert auto.axis_types == (AxisType.Auto, AxisType.Auto)
  exp = mesh_lib.make_mesh((2, 4), ("a", "b"), devices=cpu_devices,
                           axis_types=AxisType.Explicit)
  assert exp.axis_types == (AxisType.Explicit, AxisType.Explicit)
  mixed = mesh_lib.make_mesh((2, 4), ("a", "b"), devices=cpu_devices,
                             axis_types=(AxisType.Explicit, AxisType.Auto))
  assert mixed.axis_types == (AxisType.Explicit, AxisType.Auto)
  # Same devices in the same order as the Auto mesh: only the types differ.
  assert _ids(exp).tolist() == _ids(auto).tolist()
  with pytest.raises(errors.MeshError, match="one per mesh axis"):
    mesh_lib.make_mesh((2, 4), ("a", "b"), devices=cpu_devices, axis_types=(AxisType.Auto,))
  with pytest.raises(errors.MeshError, match="'explicit'"):
    mesh_lib.make_mesh((2, 4), ("a", "b"), devices=cpu_devices, axis_types=("explicit", "auto"))


def test_current_mesh_sees_jax_set_mesh_also_inside_jit(cpu_devices):
  user = jax.make_mesh((2, 4), ("data", "model"), devices=cpu_devices)
  assert mesh_lib.current_mesh() is None
  seen = []
  with jax.set_mesh(user):
    assert mesh_lib.current_mesh() is user
    jax.jit(lambda x: seen.append(mesh_lib.current_mesh()) or x)(jnp.ones(2))
    inner = mesh_lib.make_mesh((8,), ("i",), devices=cpu_devices)
    with mesh_lib.use_mesh(inner):                      # dtenjax's own context comes first
      assert mesh_lib.current_mesh() is inner
  assert seen == [user]
  assert mesh_lib.current_mesh() is None


def test_shape_only_mesh_uses_the_context_mesh_or_says_why_not(cpu_devices):
  user = jax.make_mesh((2, 4), ("data", "model"), devices=cpu_devices)
  with jax.set_mesh(user):
    assert mesh_lib.as_mesh((2, 4)) is user              # no invented "x", "y"
    assert mesh_lib.as_mesh((2, 4), ("data", "model")) is user
    assert mesh_lib.as_mesh(None) is user
    with pytest.raises(errors.MeshError) as e:
      mesh_lib.as_mesh((8,))
    msg = str(e.value)
    assert "mesh=(8,)" in msg and "{'data': 2, 'model': 4}" in msg and "mesh=None" in msg
    with pytest.raises(errors.MeshError, match="axis_names=\\('x', 'y'\\)"):
      mesh_lib.as_mesh((2, 4), ("x", "y"))
  # Without a context mesh a shape still makes a topology-ordered mesh named x, y.
  assert mesh_lib.as_mesh((2, 4)).axis_names == ("x", "y")


def test_mesh_map_follows_shard_map_default_check_vma(cpu_devices):
  mesh = mesh_lib.make_mesh((8,), ("x",), devices=cpu_devices)
  x = jnp.arange(16.0)                                  # two entries per device

  def grad_of_local_sum(w, xs):
    return jax.grad(lambda w: jnp.sum(xs * w))(w)

  # check_vma=True (the default, as jax.shard_map): w from P() is invariant and its gradient is
  # summed over the devices: sum(x) = 120 on every device.
  summed = mesh_lib.mesh_map(grad_of_local_sum, mesh, in_specs=(P(), P("x")), out_specs=P())
  assert float(jax.jit(summed)(jnp.float32(1.0), x)) == 120.0
  # check_vma=False: pmap's meaning, each device's own gradient x[2i] + x[2i+1].
  local = mesh_lib.mesh_map(lambda w, xs: grad_of_local_sum(w, xs)[None], mesh,
                            in_specs=(P(), P("x")), out_specs=P("x"), check_vma=False)
  np.testing.assert_array_equal(jax.jit(local)(jnp.float32(1.0), x),
                                [1.0, 5.0, 9.0, 13.0, 17.0, 21.0, 25.0, 29.0])


# --- pmap: the same answers as jax.pmap ------------------------------------------------------

def _same(a, b):
  jax.tree.map(lambda u, v: (np.testing.assert_array_equal(u, v),
                             np.testing.assert_equal(np.shape(u), np.shape(v))), a, b)


def test_pmap_in_axes_none_for_scalars_and_unreplicated_params(cpu_devices):
  x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  w = jnp.float32([1.0, 2.0, 3.0])

  def f(x, w, lr):
    return x * w - lr, jax.lax.psum(x, "i")

  for in_axes in ((0, None, None), [0, None, None]):
    ours = mesh_lib.pmap(f, "i", in_axes=in_axes, devices=cpu_devices)(x, w, 0.5)
    _same(ours, jax.pmap(f, "i", in_axes=(0, None, None), devices=cpu_devices)(x, w, 0.5))
  # A pytree prefix: one dict entry mapped, one broadcast.
  g = lambda d: d["a"] + d["b"]
  args = ({"a": x, "b": w},)
  _same(mesh_lib.pmap(g, in_axes=({"a": 0, "b": None},), devices=cpu_devices)(*args),
        jax.pmap(g, in_axes=({"a": 0, "b": None},), devices=cpu_devices)(*args))


def test_pmap_other_axes_and_out_axes(cpu_devices):
  xt = jnp.arange(3 * 8, dtype=jnp.float32).reshape(3, 8)      # mapped over axis 1
  f = lambda a: (a * 2, jax.lax.psum(a.sum(), "i"))
  for kw in (dict(in_axes=1), dict(in_axes=1, out_axes=(1, None)), dict(in_axes=1, out_axes=0)):
    _same(mesh_lib.pmap(f, "i", devices=cpu_devices, **kw)(xt),
          jax.pmap(f, "i", devices=cpu_devices, **kw)(xt))
  # Negative axes (jax.pmap 0.10.2 mishandles these, so the expected values are built by hand).
  y = mesh_lib.pmap(lambda a: a * 2, in_axes=-1, out_axes=-1, devices=cpu_devices)(xt)
  np.testing.assert_array_equal(y, 2 * xt)
  # Keyword arguments are mapped over axis 0, as in jax.pmap.
  x = xt.T
  _same(mesh_lib.pmap(lambda a, b=None: a + b, devices=cpu_devices)(x, b=x),
        jax.pmap(lambda a, b=None: a + b, devices=cpu_devices)(x, b=x))


def test_pmap_static_broadcasted_argnums(cpu_devices):
  x = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2)
  calls = []

  def f(x, n, act):
    calls.append((n, act))
    return (jnp.tanh(x) if act == "tanh" else x) * n

  ours = mesh_lib.pmap(f, static_broadcasted_argnums=(1, 2), devices=cpu_devices)
  ref = jax.pmap(f, static_broadcasted_argnums=(1, 2), devices=cpu_devices)
  _same(ours(x, 3, "tanh"), ref(x, 3, "tanh"))
  _same(ours(x, 2, "id"), ref(x, 2, "id"))
  n_traces = len(calls)
  ours(x, 3, "tanh")                                   # cached: no new trace
  assert len(calls) == n_traces
  with pytest.raises(errors.ConfigurationError, match="both static_broadcasted_argnums and"):
    mesh_lib.pmap(f, static_broadcasted_argnums=1, donate_argnums=1)


def test_pmap_donate_argnums_like_jax_pmap(cpu_devices):
  from jax.sharding import NamedSharding
  sharding = NamedSharding(Mesh(np.array(cpu_devices), ("i",)), P("i"))
  for pm in (mesh_lib.pmap, jax.pmap):
    a = jax.device_put(jnp.arange(16.0).reshape(8, 2), sharding)
    kept = jax.device_put(jnp.arange(16.0).reshape(8, 2), sharding)
    out = pm(lambda a, b: a + b, donate_argnums=0, devices=cpu_devices)(a, kept)
    np.testing.assert_array_equal(out, 2 * np.arange(16.0).reshape(8, 2))
    assert a.is_deleted() and not kept.is_deleted(), pm


def test_pmap_gradient_of_unmapped_params_is_per_device_like_jax_pmap(cpu_devices):
  x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
  w = jnp.ones(3)

  def g(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.sin(w * x)))(w)

  ours = mesh_lib.pmap(g, in_axes=(None, 0), devices=cpu_devices)(w, x)
  _same(ours, jax.pmap(g, in_axes=(None, 0), devices=cpu_devices)(w, x))
  np.testing.assert_allclose(ours, np.cos(np.asarray(x)) * np.asarray(x), rtol=1e-6)


def test_pmap_argument_errors(cpu_devices):
  f = mesh_lib.pmap(lambda a, b: a + b, in_axes=(0, 1), devices=cpu_devices)
  with pytest.raises(errors.MeshError) as e:
    f(jnp.ones((8, 2)), jnp.ones((2, 3)))
  assert "leaf 1 has shape (2, 3); its mapped axis has size 3 but the mapped size is 8" in \
      str(e.value)
  with pytest.raises(errors.ConfigurationError, match="in_axes has 3 entries"):
    mesh_lib.pmap(lambda a, b: a, in_axes=(0, 0, 0), devices=cpu_devices)(jnp.ones((8,)),
                                                                          jnp.ones((8,)))
  with pytest.raises(errors.MeshError, match="in_axes 2 is not one of its axes"):
    mesh_lib.pmap(lambda a: a, in_axes=2, devices=cpu_devices)(jnp.ones((8, 2)))


def test_a_mesh_larger_than_the_cpu_devices_says_how_to_simulate_them(cpu_devices):
  import traceback
  with pytest.raises(dtenjax.MeshError) as e:
    dtenjax.topology_mesh((4, 4), ("a", "b"), devices=cpu_devices)
  msg = str(e.value)
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=16" in msg
  assert "before the first import of jax" in msg and "16 devices but 8 are available" in msg
  line = traceback.format_exception_only(e.type, e.value)[-1]
  assert line.startswith("dtenjax.MeshError: mesh shape (4, 4)"), line


def test_public_errors_print_as_dtenjax_names():
  import pickle
  for name in ("DtenjaxError", "MeshError", "PlacementError", "ConfigurationError",
               "TopologyError", "CollectiveError", "ExtensionUnavailableError", "TransportError",
               "CollectiveTimeoutError", "NativeError", "QuotaExceededError"):
    cls = getattr(dtenjax, name)
    assert f"{cls.__module__}.{cls.__qualname__}" == f"dtenjax.{name}"
    assert type(pickle.loads(pickle.dumps(cls("x")))) is cls       # pickles by that name


def test_make_mesh_is_deprecated_for_topology_mesh(cpu_devices):
  import inspect
  with pytest.warns(DeprecationWarning, match="dtenjax.topology_mesh"):
    old = dtenjax.make_mesh((2, 4), ("a", "b"), devices=cpu_devices)
  new = dtenjax.topology_mesh((2, 4), ("a", "b"), devices=cpu_devices)
  assert old == new and set(new.axis_types) == {jax.sharding.AxisType.Auto}
  assert inspect.signature(dtenjax.make_mesh).parameters.keys() == (
      inspect.signature(dtenjax.topology_mesh).parameters.keys())


def test_mesh_map_takes_shard_maps_keywords_and_defaults(cpu_devices):
  import inspect
  ours = inspect.signature(dtenjax.mesh_map).parameters
  theirs = inspect.signature(jax.shard_map).parameters
  assert ours["out_specs"].default is inspect.Parameter.empty      # required, as in shard_map
  assert theirs["out_specs"].default is inspect.Parameter.empty
  assert repr(ours["in_specs"].default) == "Infer"                    # not <object object ...>
  for name in ("axis_names", "check_vma"):
    assert ours[name].default == theirs[name].default, name
  mesh = dtenjax.topology_mesh((8,), ("i",), devices=cpu_devices)
  with pytest.raises(TypeError, match="out_specs"):
    dtenjax.mesh_map(lambda x: x, mesh, in_specs=P("i"))
