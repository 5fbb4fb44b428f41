"""Tests of dtenjax._src.planning.placement: strategies to NamedSharding, memory kinds, shard, tensor."""

import functools
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.topology import model as topo
from dtenjax._src.planning.placement import Placement, check_divisible, shard, tensor
from dtenjax._src.topology.model import Topology
from tests.compile_only import USERS_PROGRAM
from tests.helpers import one_worker


# One xdist worker for the module: its cases draw and compile the same references (jax.random's
# values per shape and flag, tensor's chunked programs, the cached flax variables), which a
# worker that had not made them made again. Its tests split in two processes at once (the second
# with test_bufferpool.py) against all in one: 30.5, 30.2 -> 27.5, 28.1 s of CPU, ABBA
# (docs/testing.md, sixteenth round); not for its mesh fixture, which is cheap (twelfth round).
pytestmark = one_worker(__name__)


@pytest.fixture(scope="module")
def mesh24(cpu_devices):
  return mesh_lib.make_mesh((2, 4), ("x", "y"), devices=cpu_devices)


@pytest.mark.parametrize("strategy,spec", [
    ("replicate", P()),
    ("row", P("y", None)),
    ("col", P(None, "y")),
    ("2d", P("x", "y")),
    (P(("x", "y")), P(("x", "y"))),
])
def test_strategies_resolve(strategy, spec, mesh24):
  s = Placement(strategy, mesh=mesh24).sharding((16, 8))
  assert isinstance(s, NamedSharding)
  assert s.spec == spec and s.mesh is mesh24 and s.memory_kind == "device"


def test_strategies_on_1d_mesh_and_other_ranks(mesh24):
  one = Placement("row", mesh=(8,))
  assert one.spec((16, 4)) == P("x", None)
  assert one.spec((16,)) == P("x")
  assert one.spec(()) == P()
  assert Placement("col", mesh=(8,)).spec((3, 4, 16)) == P(None, None, "x")
  assert Placement("2d", mesh=mesh24).spec((5, 2, 4)) == P(None, "x", "y")
  assert Placement("replicate", mesh=mesh24).spec((3, 5)) == P()


def test_mesh_shape_is_topology_ordered(cpu_devices):
  devs = [topo.DeviceInfo(id=i, platform="cpu", kind="cpu", memory_bytes=0, process_index=0,
                          host=f"h{i % 2}", numa_node=0, local_index=i) for i in range(8)]
  t = topo.uniform("interleaved", devs, intra="nvlink", inter="roce")
  m = Placement("row", mesh=(2, 4), topology=t).resolved_mesh()
  assert np.vectorize(lambda d: d.id)(m.devices).tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
  assert Placement(mesh=[2, 4]).mesh == (2, 4)


@pytest.mark.parametrize("policy,kind", [
    ("device", "device"), ("pinned", "pinned_host"), ("unpinned", "unpinned_host"),
    ("pinned_host", "pinned_host"), ("unpinned_host", "unpinned_host")])
def test_memory_policies(policy, kind, mesh24):
  p = Placement("row", mesh=mesh24, memory_policy=policy)
  assert p.sharding((8, 8)).memory_kind == kind
  x = shard(jnp.ones((8, 8)), p)
  assert x.sharding.memory_kind == kind
  assert x.sharding.spec == P("y", None)


@pytest.mark.parametrize("policy", ["pinned", "unpinned"])
def test_host_memory_inside_jit_keeps_the_partitioning(policy, mesh24):
  p = Placement("row", mesh=mesh24, memory_policy=policy)
  y = jax.jit(lambda v: shard(v * 2, p))(jnp.ones((8, 8)))
  assert y.sharding.is_equivalent_to(p.sharding((8, 8)).with_memory_kind(y.sharding.memory_kind),
                                     2)
  assert {s.data.shape for s in y.addressable_shards} == {(2, 8)}
  np.testing.assert_array_equal(y, np.full((8, 8), 2.0))
  if policy == "pinned":
    assert y.sharding.memory_kind == "pinned_host"
  # jax 0.10.2 on CPU reports an in-jit unpinned_host result as "device"; out_shardings (the
  # documented route) does place it there.
  z = jax.jit(lambda v: shard(v * 2, p), out_shardings=p.sharding((8, 8)))(jnp.ones((8, 8)))
  assert z.sharding.memory_kind == p.sharding((8, 8)).memory_kind


def test_invalid_placement_lists_every_problem():
  with pytest.raises(errors.PlacementError) as e:
    Placement("rows", mesh=(2, -1), memory_policy="gpu")
  msg = str(e.value)
  assert "strategy='rows'" in msg and "'auto'" in msg
  assert "memory_policy='gpu'" in msg and "'pinned'" in msg
  assert "mesh=(2, -1)" in msg


def test_strategy_shape_errors(mesh24):
  with pytest.raises(errors.PlacementError, match="'col' needs an array with at least 2"):
    Placement("col", mesh=mesh24).spec((8,))
  with pytest.raises(errors.PlacementError, match="'2d' needs a 2D mesh"):
    Placement("2d", mesh=(8,)).spec((8, 8))
  with pytest.raises(errors.PlacementError, match="has 2 entries but the array has 1"):
    Placement(P("x", "y"), mesh=mesh24).spec((8,))


def test_non_divisible_dimension_names_everything(mesh24):
  with pytest.raises(errors.PlacementError) as e:
    Placement("2d", mesh=mesh24).spec((7, 10))
  msg = str(e.value)
  assert "dimension 0 has size 7, not divisible by mesh axis 'x' of size 2" in msg
  assert "dimension 1 has size 10, not divisible by mesh axis 'y' of size 4" in msg
  assert "pad it to 12" in msg and "leave it unsharded (None)" in msg
  with pytest.raises(errors.PlacementError, match=r"\('x', 'y'\) of size 8"):
    check_divisible((12,), P(("x", "y")), mesh24)


def test_misspelled_axis_in_spec(mesh24):
  with pytest.raises(errors.PlacementError, match=r"\['yy'\].*did you mean 'y'"):
    Placement(P("yy"), mesh=mesh24).spec((8,))


def test_shard_eager_and_inside_jit(mesh24):
  p = Placement("2d", mesh=mesh24)
  x = jnp.arange(64.0).reshape(8, 8)
  y = shard(x, p)
  assert y.sharding.spec == P("x", "y")
  np.testing.assert_array_equal(y, x)
  assert {s.data.shape for s in y.addressable_shards} == {(4, 2)}

  @jax.jit
  def f(v):
    return shard(v * 2, p)

  z = f(x)
  assert z.sharding.spec == P("x", "y")
  assert "sharding_constraint" in str(jax.make_jaxpr(f)(x))
  np.testing.assert_array_equal(z, x * 2)


def test_shard_pytrees_optax_and_flax(mesh24):
  model = nn.Dense(16)
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  opt_state = optax.adam(1e-3).init(params)
  p = Placement("row", mesh=mesh24)
  sp = shard(params, p)
  assert sp["params"]["kernel"].sharding.spec == P("y", None)
  assert sp["params"]["bias"].sharding.spec == P("y")
  so = shard(opt_state, p)
  assert so[0].mu["params"]["kernel"].sharding.spec == P("y", None)
  assert so[0].count.sharding.spec == P()          # scalar step count replicated
  chex_equal = jax.tree.map(lambda a, b: np.array_equal(a, b), so, opt_state)
  assert all(jax.tree.leaves(chex_equal))
  assert jax.tree.structure(so) == jax.tree.structure(opt_state)
  # Non-array leaves pass through.
  assert shard({"a": jnp.ones((8, 8)), "n": None, "s": "tag"}, p)["s"] == "tag"


def test_shard_accepts_named_sharding(mesh24):
  s = NamedSharding(mesh24, P(None, "x"))
  assert shard(jnp.ones((4, 4)), s).sharding == s


def test_tensor_created_sharded(mesh24):
  p = Placement("2d", mesh=mesh24)
  t = tensor((8, 16), jnp.float32, p, init="ones")
  assert t.sharding.spec == P("x", "y")
  assert [s.data.shape for s in t.addressable_shards] == [(4, 4)] * 8
  np.testing.assert_array_equal(t, np.ones((8, 16)))
  r = tensor((8, 16), jnp.float32, p, init="normal", key=jax.random.key(3))
  np.testing.assert_array_equal(r, jax.random.normal(jax.random.key(3), (8, 16)))
  custom = tensor((8, 8), jnp.int32, Placement("row", mesh=mesh24),
                  init=lambda k, s, d: jnp.full(s, 7, d), key=jax.random.key(0))
  assert custom.dtype == jnp.int32 and [s.data.shape for s in custom.addressable_shards] == [
      (2, 8)] * 8


def test_tensor_never_materialises_the_whole_array(mesh24):
  p = Placement("2d", mesh=mesh24)
  init = lambda k, s, d: jnp.zeros(s, d)
  lowered = jax.jit(lambda k: init(k, (8, 16), jnp.float32),
                    out_shardings=p.sharding((8, 16))).lower(jax.random.key(0))
  # After SPMD partitioning each device's program only builds its (4, 4) shard.
  hlo = lowered.compile(USERS_PROGRAM).as_text()      # read, never run (tests/compile_only.py)
  assert "f32[4,4]" in hlo and "f32[8,16]" not in hlo
  assert tensor((8, 16), placement=p).sharding.spec == P("x", "y")


def test_tensor_memory_kind_and_bad_init(mesh24):
  t = tensor((8, 8), placement=Placement("row", mesh=mesh24, memory_policy="pinned"))
  assert t.sharding.memory_kind == "pinned_host"
  with pytest.raises(errors.PlacementError, match="init='gaussian'"):
    tensor((8, 8), placement=Placement("row", mesh=mesh24), init="gaussian",
           key=jax.random.key(0))


@pytest.mark.parametrize("init", ["normal", "uniform", lambda k, s, d: jnp.zeros(s, d)])
def test_random_tensors_need_a_key(init, mesh24):
  """Without a key every tensor would get the same values: it is refused, naming the fix."""
  with pytest.raises(errors.PlacementError, match=r"needs key=.*jax.random.key"):
    tensor((8, 8), placement=Placement("row", mesh=mesh24), init=init)


def test_random_tensors_of_two_keys_differ(mesh24):
  """What the key is for, once: it does not depend on the init refused above without one (each
  init's case drew these two tensors, about 1.5 s of CPU where a case ran in the other worker)."""
  a = tensor((8, 8), placement=Placement("row", mesh=mesh24), init="normal",
             key=jax.random.key(1))
  b = tensor((8, 8), placement=Placement("row", mesh=mesh24), init="normal",
             key=jax.random.key(2))
  assert not np.array_equal(a, b)


@pytest.mark.parametrize("shape", [(-8, 8), (2.5, 3), "ab", None])
def test_tensor_rejects_bad_shapes(shape, mesh24):
  with pytest.raises(errors.PlacementError, match=r"shape=.*non-negative ints"):
    tensor(shape, placement=Placement("row", mesh=mesh24))


def test_auto_uses_the_planner_and_explains(cpu_devices):
  t = Topology.fixture("dgx_a100_8")
  p = Placement("auto", mesh=(2, 4), topology=t)
  assert p.spec((4096, 4096), jnp.bfloat16) == P("x", "y")
  assert p.plan((4096, 4096), jnp.bfloat16).strategy == "2d"
  text = p.explain((4096, 4096), jnp.bfloat16)
  for name in ("2d", "row", "col", "replicate", "=> 2d"):
    assert name in text
  fixed = Placement("row", mesh=(2, 4), topology=t).explain((8, 8))
  assert "P('y', None)" in fixed and "fixed strategy" in fixed
  # Fixed "row" is the planner's "row".
  assert Placement("row", mesh=(2, 4), topology=t).spec((4096, 4096)) == [
      c.spec for c in p.plan((4096, 4096)).candidates if c.strategy == "row"][0]
  del cpu_devices


def test_auto_with_default_mesh_and_detected_topology(cpu_devices):
  topo.set_current(None)
  p = Placement()
  s = p.sharding((64, 32))
  assert s.mesh.devices.size == 8 and s.mesh.axis_names == ("x",)
  assert s.spec == p.plan((64, 32)).spec           # what the planner picked for this shape
  with mesh_lib.use_mesh(mesh_lib.make_mesh((4, 2), ("a", "b"), devices=cpu_devices)) as m:
    assert Placement("row").sharding((8, 8)).mesh is m


# --- bare PartitionSpecs, NamedShardings and jax's own meshes -------------------------------

@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_shard_with_a_bare_spec_under_jax_set_mesh(axis_type, cpu_devices):
  from jax.sharding import AxisType
  types = (getattr(AxisType, axis_type),) * 2
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=types, devices=cpu_devices)
  tree = {"w": jnp.arange(32.0).reshape(8, 4), "b": jnp.arange(8.0)}
  with jax.set_mesh(mesh):
    eager = shard(tree, P("data"))
    traced = jax.jit(lambda t: shard(t, P("data")))(tree)
    by_ns = jax.jit(lambda t: shard(t, NamedSharding(mesh, P(None, "model"))))(
        {"w": tree["w"]})
    by_tree = shard(tree, {"w": P("data", "model"), "b": None})
  for out in (eager, traced):
    for k in tree:
      assert out[k].sharding.mesh.axis_names == ("data", "model")
      assert out[k].sharding.spec[0] == "data"
      assert {s.data.shape[0] for s in out[k].addressable_shards} == {tree[k].shape[0] // 2}
      np.testing.assert_array_equal(out[k], tree[k])
  assert by_ns["w"].sharding.spec == P(None, "model")
  assert by_tree["w"].sharding.spec == P("data", "model")
  assert by_tree["b"] is tree["b"]                     # None leaves that part alone


def test_shard_with_a_bare_spec_under_use_mesh_and_without_a_mesh(mesh24):
  with mesh_lib.use_mesh(mesh24):
    y = jax.jit(lambda v: shard(v, P("x", "y")))(jnp.ones((4, 8)))
  assert y.sharding.mesh is mesh24 and y.sharding.spec == P("x", "y")
  with pytest.raises(errors.PlacementError) as e:
    shard({"w": jnp.ones((8, 8))}, P("x"))
  msg = str(e.value)
  assert "leaf ['w']" in msg and "jax.set_mesh" in msg and "NamedSharding(mesh, spec)" in msg
  with pytest.raises(errors.PlacementError, match=r"leaf \['w'\]: cannot place .*\n.*not divisible"):
    with mesh_lib.use_mesh(mesh24):
      shard({"w": jnp.ones((3, 8))}, P("x"))
  with pytest.raises(errors.PlacementError, match="is not a Placement, NamedSharding"):
    shard({"w": jnp.ones((8, 8))}, {"w": "row"})


def test_placement_shape_uses_the_users_jax_mesh_in_a_training_step(cpu_devices):
  """A user's own jax.make_mesh mesh under jax.set_mesh: Placement(mesh=(2, 4)) lays params out
  on that mesh (not on an invented ("x", "y") one), so a plain jitted optax step runs."""
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_devices)
  model = nn.Dense(16)
  params = model.init(jax.random.key(0), jnp.ones((1, 8)))
  tx = optax.adamw(1e-3)
  with jax.set_mesh(mesh):
    params = shard(params, Placement("row", mesh=(2, 4)))
    assert params["params"]["kernel"].sharding.mesh is mesh
    assert params["params"]["kernel"].sharding.spec == P("model", None)
    opt = tx.init(params)
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("data")))

    @jax.jit
    def step(p, o, x):
      g = jax.grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(p)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o

    new, _ = step(params, opt, x)
    with pytest.raises(errors.MeshError, match="does not fit the mesh jax.set_mesh"):
      Placement("row", mesh=(8,)).sharding((8, 8))
  assert new["params"]["kernel"].shape == (8, 16)


# --- flax partitioning metadata ---------------------------------------------------------------

RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("heads", "model"),
         ("kv", None))


class _Block(nn.Module):
  """A transformer-ish block whose params carry flax partitioning metadata."""

  @nn.compact
  def __call__(self, x):
    ki = nn.initializers.lecun_normal()
    h = nn.Dense(64, kernel_init=nn.with_logical_partitioning(ki, ("embed", "mlp")))(x)
    h = nn.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=32,
        kernel_init=nn.with_logical_partitioning(ki, ("embed", "heads", "kv")),
        out_kernel_init=nn.with_logical_partitioning(ki, ("heads", "kv", "embed")))(h[..., :16])
    return nn.Dense(16, kernel_init=nn.with_partitioning(ki, ("model", None)))(h)


def _boxes(tree):
  return {jax.tree_util.keystr(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, nn.Partitioned))}


@functools.cache
def _block_variables():
  """_Block's boxed variables, initialised in one jitted program (eagerly, flax's init compiled
  each of its ops on its own); shared by the tests that place them."""
  return jax.jit(_Block().init)(jax.random.key(0), jnp.ones((1, 4, 16)))


def test_shard_honours_flax_logical_names_with_rules(mesh24):
  from jax.sharding import Mesh
  mesh = Mesh(mesh24.devices, ("data", "model"))
  variables = _block_variables()
  out = _boxes(shard(variables, Placement("auto", mesh=mesh, rules=RULES)))
  # flax.linen.logical_to_mesh_axes with RULES, worked by hand:
  want = {
      "['params']['Dense_0']['kernel']": P("data", "model"),                       # embed, mlp
      "['params']['MultiHeadDotProductAttention_0']['query']['kernel']": P("data", "model", None),
      "['params']['MultiHeadDotProductAttention_0']['out']['kernel']": P("model", None, "data"),
      "['params']['Dense_1']['kernel']": P("model", None),                         # mesh names
  }
  for path, spec in want.items():
    box = out[path]
    assert isinstance(box, nn.Partitioned), path             # the box comes back ...
    assert box.value.sharding.spec == spec, (path, box.value.sharding.spec)   # ... laid out
  assert out["['params']['Dense_0']['kernel']"].names == ("embed", "mlp")
  # Unboxed leaves (biases) are planned as usual; these small ones are replicated.
  assert out["['params']['Dense_0']['bias']"].sharding.spec == P()
  # flax's own logical_axis_rules context works the same.
  with nn.logical_axis_rules(RULES):
    ctx = _boxes(shard(variables, Placement("auto", mesh=mesh)))
  assert ctx["['params']['Dense_0']['kernel']"].value.sharding.spec == P("data", "model")


def test_flax_boxes_errors_name_the_leaf_and_the_fix(mesh24):
  from jax.sharding import Mesh
  mesh = Mesh(mesh24.devices, ("data", "model"))
  variables = _block_variables()
  with pytest.raises(errors.PlacementError) as e:
    shard(variables, Placement("auto", mesh=mesh))                 # no rules anywhere
  msg = str(e.value)
  assert "['params']['Dense_0']['kernel']" in msg and "('embed', 'mlp')" in msg
  assert "rules=" in msg and "logical_axis_rules" in msg
  with pytest.raises(errors.PlacementError) as e:                    # strategy contradicts box
    shard(variables, Placement("row", mesh=mesh, rules=RULES))
  assert "lay it out as P('data', 'model')" in str(e.value) and "Placement('auto')" in str(e.value)
  mis = nn.Partitioned(jnp.ones((8, 8)), ("data", "modle"))
  with pytest.raises(errors.PlacementError, match=r"no axes \['modle'\].*did you mean 'model'"):
    shard({"k": mis}, Placement("auto", mesh=mesh))


class _Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    ki = nn.initializers.lecun_normal()
    h = nn.relu(nn.Dense(64, kernel_init=nn.with_logical_partitioning(ki, ("embed", "mlp")))(x))
    return nn.Dense(16, kernel_init=nn.with_logical_partitioning(ki, ("mlp", "embed")))(h)


def test_flax_boxed_params_train_in_a_jitted_step_under_set_mesh(cpu_devices):
  # (flax 0.12.8's own MultiHeadDotProductAttention cannot apply logically boxed kernels under
  # a mesh: its constraint has the wrong rank. That is flax's; an MLP shows the flow.)
  from jax.sharding import AxisType
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                       devices=cpu_devices)
  model = _Mlp()
  x = jnp.ones((8, 4, 16))
  tx = optax.adam(1e-3)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    variables = jax.jit(lambda k: shard(model.init(k, x[:1]), Placement("auto")))(
        jax.random.key(0))
    opt = tx.init(variables)

    @jax.jit
    def step(v, o, x):
      g = jax.grad(lambda v: jnp.mean(model.apply(v, x) ** 2))(v)
      u, o = tx.update(g, o, v)
      return optax.apply_updates(v, u), o

    new, _ = step(variables, opt, x)
  kernel = _boxes(variables)["['params']['Dense_0']['kernel']"]
  assert kernel.value.sharding.spec == P("data", "model")
  assert _boxes(new)["['params']['Dense_0']['kernel']"].names == ("embed", "mlp")


def test_shard_honours_nnx_out_sharding(mesh24):
  from flax import nnx
  from jax.sharding import Mesh
  mesh = Mesh(mesh24.devices, ("data", "model"))

  class Model(nnx.Module):
    def __init__(self, rngs):
      init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
      self.up = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
      self.down = nnx.Linear(64, 16, rngs=rngs)

  with nnx.use_eager_sharding(False):
    model = Model(nnx.Rngs(0))
  state = shard(nnx.state(model), Placement("auto", mesh=mesh, rules=RULES))
  assert isinstance(state["up"]["kernel"], nnx.Param)
  assert state["up"]["kernel"].get_value().sharding.spec == P("data", "model")
  nnx.update(model, state)
  assert model.up.kernel.get_value().sharding.spec == P("data", "model")


def test_planner_says_how_it_reads_attention_kernels():
  t = Topology.fixture("dgx_a100_8")
  plan = Placement("auto", mesh=(2, 4), topology=t).plan((4096, 32, 128), jnp.bfloat16)
  assert "costed as 4096 stacked (32, 128) matrices" in plan.reason
  assert "flax attention kernel (features, heads, head_dim)" in plan.reason
  assert "stacked" not in Placement("auto", mesh=(2, 4), topology=t).plan((64, 64)).reason


def test_optimizer_state_follows_its_parameters(mesh24):
  """shard(opt_state, like=params): adamw's mu and nu get each parameter's layout (tensor
  parallel here), its step count is replicated; also inside jit given the shardings."""
  import optax
  params = {"w1": shard(jnp.ones((8, 16)), Placement("row", mesh=mesh24)),
            "w2": shard(jnp.ones((16, 8)), Placement("col", mesh=mesh24)),
            "b": shard(jnp.ones((8,)), Placement("replicate", mesh=mesh24))}
  tx = optax.adamw(1e-3)
  state = shard(tx.init(params), like=params)
  adam = state[0]
  for moments in (adam.mu, adam.nu):
    for k, p in params.items():
      assert moments[k].sharding.is_equivalent_to(p.sharding, p.ndim), (k, moments[k].sharding)
  assert adam.count.sharding.spec == P() and adam.count.sharding.mesh == mesh24
  # the usual mistake: one Placement for the whole state replicates every moment of a TP param
  wrong = shard(tx.init(params), Placement("replicate", mesh=mesh24))
  assert wrong[0].mu["w1"].sharding.spec == P()
  shardings = jax.tree.map(lambda a: a.sharding, params)
  inside = jax.jit(lambda s: shard(s, like=shardings))(tx.init(params))
  assert inside[0].nu["w2"].sharding.is_equivalent_to(params["w2"].sharding, 2)
  with pytest.raises(errors.PlacementError, match="exactly one of placement"):
    shard(state)
  with pytest.raises(errors.PlacementError, match="no NamedSharding to follow"):
    shard(tx.init(params), like={"w1": np.ones((8, 16)), "w2": np.ones((16, 8)), "b": np.ones(8)})


def _tp_mlp_placements(mesh):
  return {"l1": {"kernel": NamedSharding(mesh, P(None, "model")),
                 "bias": NamedSharding(mesh, P("model"))},
          "l2": {"kernel": NamedSharding(mesh, P("model", None)),
                 "bias": NamedSharding(mesh, P())}}


def _tp_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))


def test_shard_optax_state_with_the_params_placement_tree_places_each_moment_like_its_param():
  """What users write: shard(tx.init(params), placement). A placement tree written for the params
  is not a prefix of the optax state, but its mu / nu mirror the params: each moment gets its
  parameter's layout, the step count is replicated."""
  mesh = _tp_mesh()
  placement = _tp_mlp_placements(mesh)
  params = {"l1": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones(16)},
            "l2": {"kernel": jnp.ones((16, 8)), "bias": jnp.ones(8)}}
  params = shard(params, placement)
  state = shard(optax.adam(1e-3).init(params), placement)
  adam = state[0]
  want = jax.tree.map(lambda s: s.spec, placement)
  for moments in (adam.mu, adam.nu):
    assert jax.tree.map(lambda a: a.sharding.spec, moments) == want
  assert adam.count.sharding.spec == P() and adam.count.sharding.mesh == mesh
  with pytest.raises(errors.PlacementError, match="not a prefix"):       # nothing mirrors it
    shard({"other": jnp.ones(3)}, placement)


def test_shard_nnx_optimizer_state_like_the_model_state_and_with_the_placement_tree():
  """nnx.state(optimizer) holds OptVariables in the model's key paths: like=nnx.state(model)
  works on the NNX states directly (no to_pure_dict), and so does the params' placement tree."""
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(8, 16, rngs=rngs)
      self.l2 = nnx.Linear(16, 8, rngs=rngs)

  mesh = _tp_mesh()
  placement = _tp_mlp_placements(mesh)
  model = MLP(nnx.Rngs(0))
  nnx.update(model, shard(nnx.to_pure_dict(nnx.state(model)), placement))
  opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  want = jax.tree.map(lambda s: s.spec, placement)
  for out in (shard(nnx.state(opt), like=nnx.state(model)), shard(nnx.state(opt), placement)):
    pure = nnx.to_pure_dict(out)
    adam = pure["opt_state"][0]
    for moments in (adam["mu"], adam["nu"]):
      assert jax.tree.map(lambda a: a.sharding.spec, moments) == want
    assert adam["count"].sharding.spec == P()
    nnx.update(opt, out)                                  # the placed state goes back in


@pytest.mark.parametrize("partitionable", [True, False])
def test_tensor_gives_jax_random_values_under_the_users_flag_drawn_per_shard(partitionable):
  """tensor(init="normal", key=k) is jax.random.normal(k, shape) under the process's own
  jax_threefry_partitionable, both settings (the README's promise), without the whole array on a
  device: with the flag off a jitted jax.random.normal with out_shardings makes every device
  generate the whole array and slice it, while tensor's program holds at most 1.25x the shard
  per device (output and temporaries), for normal and uniform, float32 and bfloat16 (whose
  uniform jax draws as 8-bit words). Column layouts, which are not one range of the array, get
  the same values (with the flag off drawn in rows and moved)."""
  from dtenjax._src.planning import placement as placement_lib
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
  shape, p = (512, 256), Placement(P("x", None), mesh=mesh)
  before = jax.config.jax_threefry_partitionable
  jax.config.update("jax_threefry_partitionable", partitionable)
  try:
    key = jax.random.key(5)
    if not partitionable:     # what tensor avoids (asserted below): the users' program's memory
      plain = jax.jit(lambda k: jax.random.normal(k, shape), out_shardings=p.sharding(shape))
      plain_c = plain.lower(key).compile(USERS_PROGRAM)     # read, never run
      plain_temp = plain_c.memory_analysis().temp_size_in_bytes
    for init, dtype in (("normal", jnp.float32), ("uniform", jnp.bfloat16)):
      t = tensor(shape, dtype, p, init=init, key=key)
      want = getattr(jax.random, init)(key, shape, dtype)       # under the user's flag
      np.testing.assert_array_equal(np.asarray(t, np.float32), np.asarray(want, np.float32))
      assert t.sharding == p.sharding(shape, dtype)
      prog = placement_lib._chunked_program(init, shape, jnp.dtype(dtype).name,
                                            p.sharding(shape, dtype), partitionable)
      # its memory read from a compile of its own (never run): LLVM unoptimised, the same buffers
      mem = prog.lower(jax.random.key_data(key)).compile(USERS_PROGRAM).memory_analysis()
      shard_bytes = 512 * 256 * jnp.dtype(dtype).itemsize // 8
      assert mem.output_size_in_bytes == shard_bytes
      assert mem.output_size_in_bytes + mem.temp_size_in_bytes <= 1.25 * shard_bytes, mem
    odd = (9, 24)                   # an odd word count: the legacy draw pads its counters
    for spec in (P(None, "x"), P()):
      q = Placement(spec, mesh=mesh)
      for init, dtype in (("normal", jnp.float32), ("normal", jnp.bfloat16)):
        t = tensor(odd, dtype, q, init=init, key=key)
        np.testing.assert_array_equal(np.asarray(t, np.float32),
                                      np.asarray(getattr(jax.random, init)(key, odd, dtype),
                                                 np.float32))
        assert t.sharding == q.sharding(odd, dtype)
  finally:
    jax.config.update("jax_threefry_partitionable", before)
  if not partitionable:
    assert plain_temp >= 8 * 512 * 256 * 4 // 8      # what tensor avoids: the whole array


def test_tensor_on_other_layouts_and_keys_gives_jax_random_values(mesh24):
  """Layouts that are not one range of the array (columns sharded), raw uint32 keys and
  callables take the one-jit path, with the same values as jax.random."""
  key = jax.random.key(9)
  for p in (Placement(P(None, "y"), mesh=mesh24), Placement("2d", mesh=mesh24),
            Placement("replicate", mesh=mesh24)):
    t = tensor((8, 16), jnp.float32, p, init="normal", key=key)
    np.testing.assert_array_equal(t, jax.random.normal(key, (8, 16)))
  raw = jax.random.PRNGKey(4)
  np.testing.assert_array_equal(tensor((8, 16), jnp.float32, Placement("row", mesh=mesh24),
                                       init="uniform", key=raw),
                                jax.random.uniform(raw, (8, 16)))


def test_shard_onto_a_mesh_lets_arrays_of_two_meshes_meet_in_one_jit():
  """Placement(mesh=(2, 4)) outside jax.set_mesh makes dtenjax's own mesh (Auto axes); arrays on
  jax.make_mesh's (Explicit) cannot meet them in one jit. shard(tree, mesh) puts a tree on the
  other mesh with the specs it has (boxes and unplaced leaves included)."""
  a = shard({"w": jnp.ones((8, 16)), "n": 3},
            Placement(P("data", "model"), mesh=(2, 4), axis_names=("data", "model")))
  m = jax.make_mesh((2, 4), ("data", "model"))
  b = jax.device_put(jnp.ones((8, 16)), NamedSharding(m, P("data", "model")))
  add = jax.jit(lambda u, v: u + v)
  with pytest.raises(ValueError, match="Mesh for all inputs should be equal"):
    add(a["w"], b)
  moved = shard(a, m)
  assert moved["n"] == 3 and moved["w"].sharding == NamedSharding(m, P("data", "model"))
  np.testing.assert_array_equal(add(moved["w"], b), 2 * np.ones((8, 16)))
  with pytest.raises(errors.PlacementError, match=r"mesh axes \['data'\].*check the spelling"):
    shard(moved, jax.make_mesh((8,), ("x",)))


def test_auto_on_jax_make_mesh_places_so_unchanged_steps_type_check():
  """jax.make_mesh gives Explicit axes, where JAX types every product: a weight sharded on its
  last dimension ("col", "2d", or a bias sharded like one) makes the next `@` raise
  ShardingTypeError. Placement("auto") there picks among the layouts that type-check (row for
  matrices, replicated vectors) and says why, so the plain MLP step -- forward, grad, an optax
  update under jax.jit -- runs unchanged with the values of the same step on unplaced arrays;
  on the same devices with Auto axes the planner's first choice (here Megatron's column/row
  pair) stays."""
  ex = jax.make_mesh((2, 4), ("data", "model"))
  auto = jax.sharding.Mesh(ex.devices, ex.axis_names)             # Auto axes, same devices
  # drawn on the host: eager jax.random.normal compiled a program per shape
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.standard_normal((1024, 4096), np.float32) * 0.02),
            "b": jnp.zeros((4096,)),
            "v": jnp.asarray(rng.standard_normal((4096, 1024), np.float32) * 0.02)}
  x = jnp.asarray(rng.standard_normal((16, 1024), np.float32))
  topology = Topology.fixture("pcie_8")          # its plan for w is a column layout, v rows
  on_auto = Placement("auto", mesh=auto, topology=topology)

  def last_dim(spec, ndim):
    return (tuple(spec) + (None,) * ndim)[ndim - 1]
  sharded_last = [k for k, p in params.items() if last_dim(on_auto.spec(p.shape), p.ndim)]
  assert sharded_last, "the fixture no longer makes the planner pick a column layout"

  def loss(p, x):
    return jnp.mean(((jax.nn.relu(x @ p["w"] + p["b"])) @ p["v"]) ** 2)
  opt = optax.adam(1e-3)

  def step(p, s, x):
    l, g = jax.value_and_grad(loss)(p, x)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, l

  want = jax.jit(step)(params, opt.init(params), x)
  with jax.set_mesh(ex):
    placement = Placement("auto", topology=topology)
    placed = shard(params, placement)
    for name, a in placed.items():
      assert last_dim(a.sharding.spec, a.ndim) is None, (name, a.sharding.spec)
    for name in sharded_last:
      plan = placement.plan(params[name].shape)
      assert plan.strategy in ("row", "replicate") and "Explicit mesh axes" in plan.reason
    xs = jax.device_put(x, NamedSharding(ex, P("data")))
    got = jax.jit(step)(placed, opt.init(placed), xs)
    # what it avoids: the Auto mesh's first choices, laid on the Explicit axes, fail in JAX
    untyped = {k: jax.device_put(p, NamedSharding(ex, on_auto.spec(p.shape)))
               for k, p in params.items()}
    with pytest.raises(Exception, match="Contracting dimensions are sharded"):
      jax.jit(loss)(untyped, xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)   # adam: ~lr


@pytest.mark.parametrize("spec", [P("data"), P(None, "model")])
def test_tensor_placed_on_its_own_mesh_inside_another_context_mesh(spec):
  # a placement that names mesh A, made while jax.set_mesh(B) is active (a user's habit: one
  # mesh for the model, another context): the array is on A with jax.random's values (JAX alone
  # refuses the program over A inside B's context)
  a = jax.make_mesh((2, 4), ("data", "model"))
  b = jax.make_mesh((8,), ("x",))
  key = jax.random.key(3)
  with jax.set_mesh(b):
    t = tensor((64, 32), jnp.float32, placement=Placement(spec, mesh=a), init="normal",
               key=key)
  assert t.sharding.mesh == a and t.sharding.spec == spec
  np.testing.assert_array_equal(np.asarray(t), np.asarray(jax.random.normal(key, (64, 32))))
