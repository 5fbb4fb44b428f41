"""Tests of dtenjax._src.planning.explain against the compiled HLO of real steps.

Every expected value (which collectives, bytes per participant, device groups) is worked out
from what the test builds: parameter shapes, per-device shard shapes, the mesh's device array.
Each step is also read twice, through XLA's structured module (proto) and through the printed
text, and the two readers must agree.
"""

import collections
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src import hlo
from dtenjax._src.planning import explain as ex
from dtenjax._src.topology.model import Topology
from tests import compile_only


def _ids(mesh):
  return np.vectorize(lambda d: d.id)(mesh.devices)


def _rows(ids2d):
  """Groups of a reduction over the minor mesh axis: one group per row."""
  return tuple(tuple(int(v) for v in row) for row in ids2d)


def _cols(ids2d):
  return _rows(np.asarray(ids2d).T)


def _compiled(f, *args):
  """A step compiled only to be read: LLVM unoptimised (tests/compile_only.py), the same HLO."""
  return f.lower(*args).compile(compile_only.LLVM_O0)


def _modules_agree(proto, text):
  """Every instruction of every computation reads the same from the proto and the text."""
  assert proto.entry == text.entry and set(proto.computations) == set(text.computations)
  key = lambda i: (i.name, i.opcode, i.shape, i.operands, i.operand_shapes, tuple(sorted(i.called)),
                   i.fusion_kind, i.custom_call_target, i.channel_id, i.use_global_device_ids,
                   i.replica_groups or (), i.source_target_pairs, i.op_name)
  for name, comp in proto.computations.items():
    assert [key(i) for i in comp.instructions] == [
        key(i) for i in text.computations[name].instructions], name
    assert comp.is_fusion == text.computations[name].is_fusion, name


def _readers_agree(compiled):
  """The proto and the text reader see the same module, and so the same collectives."""
  proto = hlo.read_compiled(compiled, prefer="proto")
  text = hlo.read_compiled(compiled, prefer="text")
  assert proto.source == "proto" and text.source == "text"
  _modules_agree(proto, text)
  key = lambda c: (c.kind, c.name, c.nbytes, c.replica_groups, c.source_target_pairs,
                   c.operand_shapes, c.group_form)
  assert [key(c) for c in proto.collectives()] == [key(c) for c in text.collectives()]
  return proto


def _by_kind(e):
  out = collections.defaultdict(list)
  for c in e.collectives:
    out[c.kind].append(c)
  return out


# ---- real steps ------------------------------------------------------------------------------

PARAM_SHAPES = {"w0": (16, 32), "b0": (32,), "w1": (32, 32), "b1": (32,), "w2": (32, 8),
                "b2": (8,), "scale": ()}


def _mlp_loss(p, x):
  h = jnp.tanh(x @ p["w0"] + p["b0"])
  h = jnp.tanh(h @ p["w1"] + p["b1"])
  return jnp.sum(jnp.tanh(h @ p["w2"] + p["b2"]) * p["scale"])


def test_data_parallel_gradients_every_operand_of_the_combined_all_reduce(cpu_devices):
  # Devices in reverse order: logical ids must be mapped through the device assignment.
  mesh = Mesh(np.array(cpu_devices[::-1]), ("data",))
  params = {k: jnp.ones(s, jnp.float32) for k, s in PARAM_SHAPES.items()}
  g = jax.jit(jax.grad(_mlp_loss),
              in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
              out_shardings=NamedSharding(mesh, P()))
  x = jnp.ones((64, 16), jnp.float32)
  compiled = _compiled(g, params, x)
  _readers_agree(compiled)
  e = ex.explain(compiled)
  assert e.source == "proto"
  kinds = _by_kind(e)
  assert set(kinds) == {"all_reduce"}, e.table()
  # Every gradient is summed over all 8 devices, in the mesh's device order.
  param_bytes = sum(4 * math.prod(s) for s in PARAM_SHAPES.values())
  assert sum(c.nbytes for c in kinds["all_reduce"]) == param_bytes
  # One operand per gradient (XLA may transpose a matrix: compare element counts).
  sizes = sorted(math.prod(s.dims) for c in kinds["all_reduce"] for s in c.operand_shapes)
  assert sizes == sorted(math.prod(s) for s in PARAM_SHAPES.values())
  want = (tuple(d.id for d in cpu_devices[::-1]),)
  assert all(c.groups == want for c in kinds["all_reduce"])
  # XLA combines the 7 gradients into one all-reduce: 6+ operands print "/*index=5*/".
  assert max(c.num_operands for c in kinds["all_reduce"]) >= 6
  assert "/*index=5*/" in compiled.as_text()
  assert all(c.predicted_s > 0 for c in e.collectives)


def test_megatron_mlp_on_a_2d_mesh_groups_per_axis(cpu_devices):
  # Column-parallel w0, row-parallel w1, batch over "data": the forward partial sums are reduced
  # over "model" (rows of the mesh), the gradients over "data" (its columns).
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), ("data", "model"))
  ids = _ids(mesh)
  spec = {"w0": P(None, "model"), "b0": P("model"), "w1": P("model", None)}
  shapes = {"w0": (16, 64), "b0": (64,), "w1": (64, 8)}
  p = {k: jax.device_put(jnp.ones(s), NamedSharding(mesh, spec[k])) for k, s in shapes.items()}
  x = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("data")))

  def loss(p, x):
    h = jax.nn.relu(x @ p["w0"] + p["b0"])
    return jnp.mean((h @ p["w1"]) ** 2)
  compiled = _compiled(jax.jit(jax.grad(loss)), p, x)
  module = _readers_agree(compiled)
  e = ex.explain(compiled)
  ars = _by_kind(e)["all_reduce"]
  by_groups = {c.groups: c for c in ars}
  assert set(by_groups) == {_rows(ids), _cols(ids)}, e.table()
  # Over "model": the partial output h @ w1 of the local batch, [32/2, 8] floats.
  assert by_groups[_rows(ids)].nbytes == (32 // 2) * 8 * 4
  # Over "data": the local shards of the three gradients, 16 x 64/4, 64/4 and 64/4 x 8.
  assert by_groups[_cols(ids)].nbytes == (16 * 16 + 16 + 16 * 8) * 4
  assert sorted(math.prod(s.dims) for s in by_groups[_cols(ids)].operand_shapes) == [
      16, 16 * 8, 16 * 16]
  # jax 0.10.2 prints one of these groups in XLA's mesh-axes form; whichever form XLA chose, the
  # groups above are the mesh's rows and columns.
  assert {c.group_form for c in module.collectives()} <= {"list", "iota", "mesh"}


def test_every_collective_primitive_on_a_permuted_2d_mesh(cpu_devices):
  order = [3, 1, 0, 2, 7, 5, 4, 6]
  mesh = Mesh(np.array(cpu_devices)[order].reshape(2, 4), ("x", "y"))
  ids = _ids(mesh)
  ring = [(i, (i + 1) % 4) for i in range(4)]

  def body(a):
    return (jax.lax.psum(a, "y"), jax.lax.psum(a, "x"), jax.lax.psum(a, ("x", "y")),
            jax.lax.all_gather(a, "x", tiled=True),
            jax.lax.psum_scatter(a, "y", scatter_dimension=0, tiled=True),
            jax.lax.all_to_all(a, "y", 0, 0, tiled=True), jax.lax.ppermute(a, "y", ring))
  xy = P("x", "y")
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=xy,
                            out_specs=(xy, xy, xy, P(None, "y"), xy, xy, xy), check_vma=False))
  x = jnp.arange(8 * 32, dtype=jnp.float32).reshape(8, 32)
  compiled = _compiled(f, x)
  _readers_agree(compiled)
  e = ex.explain(compiled)
  local = (8 // 2) * (32 // 4) * 4          # bytes of one device's block
  kinds = _by_kind(e)
  everyone = (tuple(int(v) for v in ids.reshape(-1)),)
  assert sorted((c.groups, c.nbytes) for c in kinds["all_reduce"]) == sorted(
      [(_rows(ids), local), (_cols(ids), local), (everyone, local)])
  [ag] = kinds["all_gather"]
  assert ag.groups == _cols(ids) and ag.nbytes == 2 * local       # gathered over x (2)
  [rs] = kinds["reduce_scatter"]
  assert rs.groups == _rows(ids) and rs.nbytes == local
  [a2a] = kinds["all_to_all"]
  assert a2a.groups == _rows(ids) and a2a.nbytes == local
  [pp] = kinds["ppermute"]
  assert sorted(pp.groups) == sorted((int(ids[r, s]), int(ids[r, t]))
                                     for r in range(2) for s, t in ring)
  assert pp.nbytes == local
  assert e.count() == 7
  assert "3->1" in e.table()


def test_dtenjax_two_shot_all_to_all_with_eight_operands_is_listed(cpu_devices):
  mesh = Mesh(np.array(cpu_devices), ("d",))
  f = jax.jit(jax.shard_map(lambda a: dtenjax.all_reduce(a, "d", algorithm="two_shot"),
                            mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
  x = jnp.arange(8 * 64, dtype=jnp.float32).reshape(8, 64)
  compiled = _compiled(f, x)
  _readers_agree(compiled)
  e = ex.explain(compiled)
  kinds = _by_kind(e)
  everyone = (tuple(d.id for d in cpu_devices),)
  [a2a] = kinds["all_to_all"]
  # Each device's [1, 64] row is cut into 8 chunks, one per peer: 8 operands of 8 floats.
  assert a2a.num_operands == 8 and a2a.nbytes == 64 * 4 and a2a.groups == everyone
  [ag] = kinds["all_gather"]
  assert ag.nbytes == 64 * 4 and ag.groups == everyone       # 8 owned chunks of 8 floats


def test_flax_optax_gpt_step(cpu_devices):
  nn = pytest.importorskip("flax.linen")
  optax = pytest.importorskip("optax")
  vocab, width, heads, seq = 64, 32, 4, 16

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
      x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(h, h, mask=mask)
      h = nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))
      return x + h

  class GPT(nn.Module):
    @nn.compact
    def __call__(self, tok):
      x = nn.Embed(vocab, width)(tok)
      x = x + self.param("pos", nn.initializers.normal(0.02), (seq, width))
      for _ in range(2):
        x = Block()(x)
      return nn.Dense(vocab)(nn.LayerNorm()(x))

  model = GPT()
  tok = jnp.zeros((16, seq), jnp.int32)
  # The step is compiled, never run: its parameters' and optimizer state's shapes are all it
  # needs (an eager flax init compiled each of its ops one by one, most of this test's time).
  params = jax.eval_shape(model.init, jax.random.key(0), tok)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  state = jax.eval_shape(opt.init, params)

  def step(params, state, tok):
    def loss_fn(p):
      logits = model.apply(p, tok)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  mesh = Mesh(np.array(cpu_devices), ("data",))
  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  j = jax.jit(step, in_shardings=(rep, rep, batch), out_shardings=(rep, rep, rep))
  compiled = _compiled(j, params, state, tok)
  _readers_agree(compiled)
  e = ex.explain(compiled)
  leaves = jax.tree.leaves(params)
  kinds = _by_kind(e)
  assert set(kinds) == {"all_reduce"}, e.table()
  # Data parallel: every gradient once, plus the f32 loss, summed over all 8 devices.
  assert sum(c.nbytes for c in kinds["all_reduce"]) == sum(
      np.prod(l.shape) * l.dtype.itemsize for l in leaves) + 4
  assert sum(c.num_operands for c in kinds["all_reduce"]) == len(leaves) + 1
  everyone = (tuple(d.id for d in cpu_devices),)
  assert all(c.groups == everyone for c in kinds["all_reduce"])


def test_collectives_inside_a_loop_body_are_listed(cpu_devices):
  mesh = Mesh(np.array(cpu_devices), ("d",))

  def body(a):
    return jax.lax.fori_loop(0, 3, lambda i, c: jax.lax.psum(c, "d") * 0.5, a)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                            check_vma=False))
  compiled = _compiled(f, jnp.ones((8, 10), jnp.float32))
  _readers_agree(compiled)
  e = ex.explain(compiled)
  [ar] = e.collectives
  assert ar.kind == "all_reduce" and ar.nbytes == 10 * 4
  assert ar.computation != hlo.read_compiled(compiled).entry     # it sits in the loop body


def test_single_device_program_has_no_collectives():
  out = dtenjax.explain(lambda a: a * 2 + 1, jnp.ones(16))
  assert out.count() == 0 and "(no collectives)" in out.table()
  assert out.memory["argument"] == 16 * 4


def test_prediction_uses_the_given_topology(cpu_devices):
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), ("x", "y"))
  f = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(mesh, P(("x", "y"))))
  x = jnp.ones((8, 1024))
  slow = Topology.current().with_links({"shared_memory": dtenjax.LinkSpec(0.001, 1000.0)})
  fast = ex.explain(f, x)
  slow_out = ex.explain(f, x, topology=slow)
  assert slow_out.count() == fast.count() > 0
  assert slow_out.total_predicted_s > 100 * fast.total_predicted_s


def test_table_shows_every_row_with_its_groups(cpu_devices):
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), ("x", "y"))
  f = jax.jit(jax.shard_map(lambda a: (jax.lax.psum(a, "x"), jax.lax.psum(a, "y")), mesh=mesh,
                            in_specs=P("x", "y"), out_specs=(P("x", "y"), P("x", "y")),
                            check_vma=False))
  text = ex.explain(f, jnp.ones((8, 8))).table()
  assert "{0,4},{1,5},{2,6},{3,7}" in text and "{0,1,2,3},{4,5,6,7}" in text
  assert "2 collectives" in text and "HLO read from proto" in text


# ---- the reader on the printed forms XLA uses ------------------------------------------------

def test_text_reader_takes_tuple_shapes_with_index_comments_and_mesh_groups():
  text = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[4], p1: f32[4], p2: f32[4], p3: f32[4], p4: f32[4], p5: bf16[2,3]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %p2 = f32[4]{0} parameter(2)
  %p3 = f32[4]{0} parameter(3)
  %p4 = f32[4]{0} parameter(4)
  %p5 = bf16[2,3]{1,0} parameter(5)
  %ar = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/bf16[2,3]{1,0}) all-reduce(%p0, %p1, %p2, %p3, %p4, /*index=5*/%p5), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %ag = f32[8]{0} all-gather(%p0), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %g = f32[4]{0} get-tuple-element(%ar), index=0
}
"""
  m = hlo.parse_text(text)
  ar, ag = m.collectives()
  assert ar.kind == "all_reduce" and len(ar.operand_shapes) == 6
  assert ar.nbytes == 5 * 4 * 4 + 6 * 2
  assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and ar.group_form == "mesh"
  assert ag.replica_groups == ((0, 4), (1, 5), (2, 6), (3, 7)) and ag.group_form == "iota"
  assert ag.nbytes == 4 * 4 * 2
  assert m.num_partitions == 8


def test_text_reader_refuses_a_line_it_cannot_read():
  text = """HloModule m

ENTRY %main (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  ROOT %ar = f32[4]{0} all-reduce(%p0), replica_groups=ring(0,1)
}
"""
  with pytest.raises(hlo.HloReadError, match="ring"):
    hlo.parse_text(text)


def test_mesh_axes_groups_with_device_ids_and_sub_axes():
  # mesh a=2, b=4 with devices laid out [[4,5,6,7],[0,1,2,3]].
  dev = [4, 5, 6, 7, 0, 1, 2, 3]
  assert hlo.mesh_axes_groups([2, 4], dev, [(1, None)]) == ((4, 5, 6, 7), (0, 1, 2, 3))
  assert hlo.mesh_axes_groups([2, 4], dev, [(0, None)]) == ((4, 0), (5, 1), (6, 2), (7, 3))
  # Both axes, listed b then a: the listed order is the order of the group's dimensions, major
  # first, so a (listed last) varies fastest.
  assert hlo.mesh_axes_groups([2, 4], (), [(1, None), (0, None)]) == (
      (0, 4, 1, 5, 2, 6, 3, 7),)
  # Sub-axis "(pre)size": b (4) = [pre=2 major, size=2 minor]; b:(2)2 is b's low bit, so a group
  # holds b in {0,1} or {2,3}.
  assert hlo.mesh_axes_groups([2, 4], (), [(1, (2, 2))]) == ((0, 1), (2, 3), (4, 5), (6, 7))
  # b:(1)2 is b's high bit: b in {0,2} or {1,3}.
  assert hlo.mesh_axes_groups([2, 4], (), [(1, (1, 2))]) == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_iota_groups():
  assert hlo.iota_groups(4, 2, [2, 4], [1, 0]) == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert hlo.iota_groups(2, 4, [8]) == ((0, 1, 2, 3), (4, 5, 6, 7))
  with pytest.raises(hlo.HloReadError, match="do not fill"):
    hlo.iota_groups(3, 2, [8])


def test_device_groups_follow_xla_collective_modes():
  a = hlo.Instruction("a", "all-reduce", hlo.Shape("f32", (4,)), "main",
                      replica_groups=((0, 1),), channel_id=1)
  m = hlo.Module("m", "main", {}, "text", ((10, 11), (12, 13)), 2, 2)
  # channel id, no global ids: groups list partitions, one set per replica.
  assert m.device_groups(a) == ((10, 11), (12, 13))
  # no channel id: groups list replicas, one set per partition.
  b = hlo.Instruction("b", "all-reduce", hlo.Shape("f32", (4,)), "main", replica_groups=((0, 1),))
  assert m.device_groups(b) == ((10, 12), (11, 13))
  # flattened ids: replica * num_partitions + partition.
  c = hlo.Instruction("c", "all-reduce", hlo.Shape("f32", (4,)), "main",
                      replica_groups=((0, 3), (1, 2)), channel_id=1, use_global_device_ids=True)
  assert m.device_groups(c) == ((10, 13), (11, 12))


def test_reader_pairs_async_starts_with_their_dones_and_reports_roles():
  text = """HloModule m, is_scheduled=true, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%async_rs (q: f32[8]) -> f32[2] {
  %q = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(%q), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add
}

%fused_neg (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%x)
}

ENTRY %main (p0: f32[8]) -> (f32[8], f32[2]) {
  %p0 = f32[8]{0} parameter(0)
  %ar-start = f32[8]{0} all-reduce-start(%p0), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %rs-start = ((f32[8]{0}), f32[2]{0}) async-start(%p0), calls=%async_rs
  %f = f32[8]{0} fusion(%p0), kind=kLoop, calls=%fused_neg
  %ar-done = f32[8]{0} all-reduce-done(%ar-start)
  %rs-done = f32[2]{0} async-done(%rs-start)
  ROOT %t = (f32[8]{0}, f32[2]{0}) tuple(%ar-done, %rs-done)
}
"""
  m = hlo.parse_text(text)
  ar, rs = m.collectives()
  assert (ar.kind, ar.name, ar.done, ar.nbytes) == ("all_reduce", "ar-start", "ar-done", 32)
  assert ar.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7)) and ar.is_async
  # The reduce-scatter inside the async computation is reported once, at its start.
  assert (rs.kind, rs.name, rs.done, rs.nbytes) == ("reduce_scatter", "rs-start", "rs-done", 32)
  assert rs.computation == "main" and rs.channel_id == 3
  roles = m.roles()
  assert roles["async_rs"] == ("async", "rs-start")
  assert roles["fused_neg"] == ("fusion", "f") and m.computations["fused_neg"].is_fusion
  assert roles["add"][0] in ("all-reduce-start", "reduce-scatter")
  assert m.fusion_of() == {"fused_neg": "f"}


def test_reader_reads_fusion_membership_of_a_real_step():
  f = jax.jit(lambda x: jnp.tanh(x) * 2 + 1)
  compiled = f.lower(jnp.ones((64,), jnp.float32)).compile()
  proto, text = (hlo.read_compiled(compiled, prefer=p) for p in ("proto", "text"))
  assert proto.fusion_of() == text.fusion_of() and proto.fusion_of()
  for comp, fusion in proto.fusion_of().items():
    assert proto.computations[comp].is_fusion
    entry_names = {i.name for i in proto.computations[proto.entry].instructions}
    assert fusion in entry_names


# ---- on a GPU: XLA:GPU's HLO (cuBLAS calls, async collectives) through both readers -----------

@pytest.mark.gpu
def test_gpu_step_reads_the_same_through_proto_and_text():
  gpus = jax.devices("gpu")
  x = jax.device_put(jnp.ones((64, 16), jnp.float32), gpus[0])
  params = {k: jax.device_put(jnp.ones(s, jnp.float32), gpus[0]) for k, s in PARAM_SHAPES.items()}
  compiled = jax.jit(jax.grad(_mlp_loss)).lower(params, x).compile()
  module = _readers_agree(compiled)
  assert module.source == "proto"
  # (XLA:GPU on jax 0.11.2 emits the gemms of this step as fusions, not cuBLAS custom-calls.)
  assert any(i.opcode == "fusion" for i in module.instructions())


@pytest.mark.gpu
def test_gpu_data_parallel_gradients_on_every_gpu():
  gpus = jax.devices("gpu")
  if len(gpus) < 2:
    pytest.skip(f"needs 2 or more GPUs for a collective; {len(gpus)} visible")
  mesh = Mesh(np.array(gpus), ("data",))
  params = {k: jnp.ones(s, jnp.float32) for k, s in PARAM_SHAPES.items()}
  g = jax.jit(jax.grad(_mlp_loss),
              in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))),
              out_shardings=NamedSharding(mesh, P()))
  compiled = g.lower(params, jnp.ones((16 * len(gpus), 16), jnp.float32)).compile()
  _readers_agree(compiled)
  e = ex.explain(compiled)
  ars = _by_kind(e)["all_reduce"]
  assert sum(c.nbytes for c in ars) == sum(4 * math.prod(s) for s in PARAM_SHAPES.values())
  assert all(c.groups == (tuple(d.id for d in gpus),) for c in ars), e.table()


def test_only_collectives_are_listed_not_local_kernels(cpu_devices):
  """A top-k compressed step runs the local pack kernel (a dtenjax custom call) and all-gathers:
  explain lists the collectives only."""
  from dtenjax import compression
  mesh = Mesh(np.array(cpu_devices), ("d",))
  g = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4096)), jnp.float32)

  def body(gl):
    config = compression.TopKConfig(ratio=0.01, axis_name="d", pack="ffi")
    state = compression.init_state(gl[0], config)
    out, _ = compression.compressed_all_reduce(gl[0], state, "d", config=config)
    return out[None]
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
  # At XLA's defaults: dtenjax.explain(f, g) below compiles the same program (a cache hit).
  module = hlo.read_compiled(f.lower(g).compile())
  targets = {i.custom_call_target for i in module.instructions() if i.opcode == "custom-call"}
  assert "dtenjax_topk_pack" in targets                     # the local kernel is in the program
  e = dtenjax.explain(f, g)
  kinds = [c.kind for c in e.collectives]
  assert kinds and all(not k.startswith("custom:") for k in kinds), kinds
  assert kinds == ["all_gather", "all_gather"], kinds       # indices and values


def test_collective_targets_name_the_collective_custom_calls():
  from dtenjax._src.compression import topk
  from dtenjax._src.gpu import p2p
  from dtenjax._src.net import hostcoll
  assert set(hlo.COLLECTIVE_TARGETS) == {p2p.TARGET, hostcoll.TARGET}
  assert topk.TARGET not in hlo.COLLECTIVE_TARGETS
