"""The planner's expert and sequence roles (dtenjax/_src/planning/roles/expert.py, sequence.py):
chosen where they pay and not where they do not, applied by plan.jit so that XLA compiles the
collectives they are priced with, the memory they save, and the values of the step itself.

The yardsticks are what a user writes without dtenjax, compiled by plain jax.jit: expert
parallelism by hand (expert weights sharded over 'expert', the dispatched tokens constrained to
their experts and back, as GShard and MaxText do), and the replicated (DP) layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import candidates
from dtenjax._src.planning import explain as explain_lib
from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.check import loop_repeats
from dtenjax._src.planning.roles import expert as expert_role
from tests import compile_only
from tests import helpers

pytestmark = helpers.one_worker(__name__)    # its planned expert step, made once

U = P.UNCONSTRAINED
_TX = optax.adamw(1e-3)


def _moe_layer(p, x, *, cap, hook):
  """One mixture-of-experts layer (top-1 routing with a capacity, GShard's dispatch and combine)
  between two dense kernels; ``hook(name, value)`` is where a user constrains the tokens."""
  experts = p["e_in"].shape[-3]
  x = jnp.einsum("bsd,dk->bsk", x, p["w_in"])       # the tokens depend on the state
  gates = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, p["router"]), -1)
  onehot = jax.nn.one_hot(jnp.argmax(gates, -1), experts, dtype=x.dtype)
  pos = jnp.cumsum(onehot, axis=1) * onehot - 1.0
  dispatch = jax.nn.one_hot(jnp.where((pos < cap) & (pos >= 0), pos, -1).astype(jnp.int32), cap,
                            dtype=x.dtype)
  combine = dispatch * jnp.sum(gates * onehot, -1)[..., None, None]
  xin = hook("dispatch", jnp.einsum("bsec,bsd->ebcd", dispatch, x))
  hid = jax.nn.gelu(jnp.einsum("ebcd,edf->ebcf", xin, p["e_in"]))
  out = hook("combine", jnp.einsum("ebcf,efd->ebcd", hid, p["e_out"]))
  y = x + jnp.einsum("bsec,ebcd->bsd", combine, out)
  return jnp.einsum("bsd,dk->bsk", y, p["w"])


def _moe_loss(p, x, *, cap, hook):
  return jnp.mean(_moe_layer(p, x, cap=cap, hook=hook) ** 2)


def _scanned_loss(p, x, *, cap, hook):
  """Layers stacked for lax.scan, as MaxText runs them."""
  def body(h, q):
    return h + _moe_layer(q, h, cap=cap, hook=hook), None
  return jnp.mean(jax.lax.scan(body, x, p)[0] ** 2)


def _no_hook(name, v):
  del name
  return v


def moe(*, experts=8, d=64, ffn=128, batch=16, seq=16, hook=_no_hook, layers=None):
  s = lambda *shape: jax.ShapeDtypeStruct((() if layers is None else (layers,)) + shape,
                                          jnp.float32)
  params = {"router": s(d, experts), "e_in": s(experts, d, ffn), "e_out": s(experts, ffn, d),
            "w": s(d, d), "w_in": s(d, d)}
  loss = functools.partial(_moe_loss if layers is None else _scanned_loss,
                           cap=max(1, 2 * seq // experts), hook=hook)

  def step(params, opt_state, x):
    value, grads = jax.value_and_grad(loss)(params, x)
    updates, opt_state = _TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step, (params, jax.eval_shape(_TX.init, params),
                jax.ShapeDtypeStruct((batch, seq, d), jnp.float32))


def _kind_bytes(compiled) -> dict[str, float]:
  """Collective bytes per kind and step, as plan.check counts them (loop bodies per trip)."""
  repeats = loop_repeats(compiled)
  out: dict[str, float] = {}
  for c in explain_lib.explain(compiled).collectives:
    out[c.kind] = out.get(c.kind, 0.0) + c.nbytes * repeats(c.computation)
  return out


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def _named(mesh, tree):
  return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))


def _by_hand(mesh, routed: bool):
  """A user's layout in plain jax.jit: expert weights (and their moments) sharded over 'expert'
  with the tokens routed to them and back (``routed``), or everything replicated (DP); the batch
  over every axis."""
  def hook(name, v):
    if not routed:
      return v
    there, home = P("expert", U, U, U), P(None, U, U, U)
    first, second = (home, there) if name == "dispatch" else (there, home)
    v = jax.lax.with_sharding_constraint(v, NamedSharding(mesh, first))
    return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, second))
  step, args = moe(hook=hook)
  params, opt, _ = args
  pspec = {k: P("expert") if routed and k.startswith("e_") else P() for k in params}
  ospec = jax.tree_util.tree_map_with_path(       # the moments laid out as their parameters
      lambda kp, _: P("expert") if routed and "'e_" in jax.tree_util.keystr(kp) else P(), opt)
  batch = P(tuple(mesh.axis_names))
  ins = (_named(mesh, pspec), _named(mesh, ospec), NamedSharding(mesh, batch))
  fn = jax.jit(step, in_shardings=ins,
               out_shardings=(ins[0], ins[1], NamedSharding(mesh, P())))
  return fn, args


@pytest.fixture(scope="module")
def expert_plan():
  """The tiny MoE planned on data 2 x expert 4 (the planner's own layout: its experts over
  'expert', which the tests below check), compiled as plan.jit runs it, beside a user's expert
  parallelism and DP on the same mesh, compiled by plain jax.jit."""
  step, args = moe()
  plan = dtenjax.plan(step, *args, mesh={"data": 2, "expert": 4})
  compiled = plan.jit(step).lower(*args).compile(compile_only.LLVM_O0)   # run for values too
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))
  hand = {name: fn.lower(*a).compile(compile_only.LLVM_O0) for name, (fn, a) in
          {"EP": _by_hand(mesh, True), "DP": _by_hand(mesh, False)}.items()}
  return step, args, plan, compiled, hand


# --- expert ---------------------------------------------------------------------------------------

def test_the_expert_dimension_is_the_one_the_dispatch_product_batches_over():
  step, args = moe()
  graph = stepgraph.read_step(step, args, (2,))
  dims = {graph.leaves[i].path: d for i, d in expert_role.experts_of(graph).items()}
  assert dims == {"[0]['e_in']": (0,), "[0]['e_out']": (0,)}

  # stacked for lax.scan over layers: the layer dimension is sliced off, the expert one is next
  def scanned(p, x):
    def body(h, q):
      return h + jnp.einsum("ebd,edf->ebf", jnp.broadcast_to(h, (4, *h.shape)), q).sum(0), None
    return jnp.sum(jax.lax.scan(body, x, p)[0] ** 2)
  graph = stepgraph.read_step(jax.grad(scanned), (jax.ShapeDtypeStruct((3, 4, 8, 8), jnp.float32),
                                                  jax.ShapeDtypeStruct((16, 8), jnp.float32)),
                              (1,))
  assert expert_role.experts_of(graph) == {0: (1,)}


def test_a_step_without_experts_gets_no_expert_axis():
  def loss(p, x):
    return jnp.mean((x @ p["w1"] @ p["w2"]) ** 2)
  args = ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
           "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
          jax.ShapeDtypeStruct((32, 64), jnp.float32))
  graph = stepgraph.read_step(jax.grad(loss), args, (1,))
  topo = dtenjax.Topology.fixture("h200_8")
  shapes = candidates.mesh_shapes(8, topo, topo.device_ids, graph)
  at = candidates.AXES.index("expert")
  assert shapes and all(s[at] == 1 for s in shapes)
  step, margs = moe()
  with_experts = candidates.mesh_shapes(8, topo, topo.device_ids,
                                        stepgraph.read_step(step, margs, (2,)))
  assert {s[at] for s in with_experts} == {1, 2, 4, 8}


def test_expert_parallelism_is_chosen_where_it_pays_and_not_where_it_does_not():
  topo = dtenjax.Topology.fixture("h200_8")
  # large experts: replicated, they cost their gradients' all-reduce and 8 copies of their
  # optimizer update; tensor-parallel, an all-reduce of every expert's output tokens per pass;
  # routed, four all-to-alls of one device's share of the tokens
  step, args = moe(experts=8, d=512, ffn=2048, batch=64, seq=128)
  plan = dtenjax.plan(step, *args, topology=topo)
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  assert sizes["expert"] > 1, plan
  specs = {lp.path: lp.spec for lp in plan.leaves}
  assert "expert" in str(specs["[0]['e_in']"]) and "expert" in str(specs["[0]['e_out']"])
  assert plan.cost.collective_bytes.get("all_to_all[expert]", 0) > 0
  # small experts and many tokens: the all-to-alls of the tokens cost more than the weights save
  step, args = moe(experts=8, d=64, ffn=64, batch=64, seq=256)
  plan = dtenjax.plan(step, *args, topology=topo)
  assert dict(zip(plan.axis_names, plan.mesh_shape))["expert"] == 1, plan


def test_on_cpu_the_expert_mesh_routes_the_tokens_rather_than_replicating_the_experts():
  # measured on the 8-device CPU VM (loaded, medians of 28 interleaved steps of this tiny MoE
  # on data 2 x expert 4, compiled by plain jax.jit): expert parallelism by hand 5.9 ms, the
  # experts replicated (DP) 11.8 ms. The CPU priors had priced each all-to-all with a 3 ms
  # meeting of the devices, far more than the compute between them, and chose replicated
  # experts; a collective's meeting costs at most the compute the devices do between two.
  step, args = moe()
  plan = dtenjax.plan(step, *args, mesh={"data": 2, "expert": 4})
  specs = {lp.path: lp.spec for lp in plan.leaves}
  assert specs["[0]['e_in']"] == P("expert") and specs["[0]['e_out']"] == P("expert"), plan
  dp = dtenjax.plan(step, *args, mesh={"data": 2, "expert": 4}, pinned=(
      jax.tree.map(lambda _: P(), args[0]), jax.tree.map(lambda _: P(), args[1]), None))
  assert plan.cost.total_s < dp.cost.total_s


def test_plan_jit_routes_the_tokens_with_the_all_to_alls_it_priced(expert_plan):
  step, args, plan, compiled, hand = expert_plan
  del step, args
  specs = {lp.path: lp.spec for lp in plan.leaves}
  assert specs["[0]['e_in']"] == P("expert") and specs["[0]['e_out']"] == P("expert")
  got = _kind_bytes(compiled)
  by_hand = _kind_bytes(hand["EP"])
  # the same all-to-alls as the user's expert parallelism: four per layer (dispatch, combine and
  # their gradients), each one device's share of experts x batch x capacity x features
  assert got["all_to_all"] == by_hand["all_to_all"] > 0
  assert got.get("all_gather", 0) == 0          # no expert weight is gathered
  assert plan.cost.collective_bytes["all_to_all[expert]"] == pytest.approx(got["all_to_all"])
  assert sum(got.values()) <= sum(by_hand.values())


def test_expert_weights_memory_drops_as_priced(expert_plan):
  step, args, plan, compiled, hand = expert_plan
  dp = dtenjax.plan(step, *args, mesh={"data": 2, "expert": 4}, pinned=(
      jax.tree.map(lambda _: P(), args[0]), jax.tree.map(lambda _: P(), args[1]), None))
  # compiled: plan.jit within 10 % of the user's expert parallelism, below replicated experts
  assert _memory(compiled) <= 1.1 * _memory(hand["EP"])
  saved = _memory(hand["DP"]) - _memory(compiled)
  assert saved > 0
  # the state the expert axis shards (parameters, moments, new state) is what the price says
  state = lambda c: c.memory["params"] + c.memory["opt_state"] + c.memory["outputs"]
  m = hand["DP"].memory_analysis()
  e = compiled.memory_analysis()
  compiled_state_saving = (m.argument_size_in_bytes + m.output_size_in_bytes
                           - e.argument_size_in_bytes - e.output_size_in_bytes)
  assert state(dp.cost) - state(plan.cost) == pytest.approx(compiled_state_saving, rel=0.02)
  # and the whole: the activations split over 'expert' too (it splits the batch), an expert
  # weight's gradient complete on its shard (was 2.2x the compiled on the moe family)
  assert plan.cost.memory["total"] == pytest.approx(_memory(compiled), rel=0.10)


def test_plan_jit_with_experts_gives_the_values_of_plain_jit(expert_plan):
  step, args, plan, compiled, _ = expert_plan
  # drawn on the host (a jitted program of six threefry draws was a compile of its own)
  rng = np.random.default_rng(0)
  normal = lambda a, scale: np.asarray(scale * rng.standard_normal(a.shape), a.dtype)
  params = {k: normal(a, 0.1) for k, a in sorted(args[0].items())}
  opt, x = jax.jit(_TX.init)(params), normal(args[2], 1.0)
  want = jax.jit(step, compiler_options=compile_only.LLVM_O0)(params, opt, x)
  got = compiled(*plan.shard(params, opt, x))          # plan.jit's program, compiled above
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=2e-5, atol=2e-6), want, got)


def test_routed_tokens_cross_the_scan_over_layers():
  """Layers stacked for lax.scan: the forward loop's routed tokens are the backward loop's
  residuals; routed across the loops' boundaries, nothing is gathered. The backward sends the
  combine's residual home once more than priced (five all-to-alls per layer, four priced)."""
  step, args = moe(layers=3)
  plan = dtenjax.plan(step, *args, mesh={"data": 2, "expert": 4})
  assert {lp.path: lp.spec for lp in plan.leaves}["[0]['e_in']"] == P(None, "expert")
  got = _kind_bytes(plan.jit(step).lower(*args).compile(compile_only.LLVM_O0))
  assert got.get("all_gather", 0) == 0, got
  priced = plan.cost.collective_bytes["all_to_all[expert]"]
  assert priced <= got["all_to_all"] <= 1.25 * priced
