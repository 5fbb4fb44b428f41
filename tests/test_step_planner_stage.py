"""The planner's ``stage`` role: where pipeline stages pay by the cost model (slow inter-host links,
a 70B-shaped step on the design's 32 x A100 RoCE cluster) the plan has them and says why with the
numbers; faster links remove them; a step without a scanned stack, or with fewer layers than
stages, never gets them; and the plan is usable: its stages, micro-batches, schedule, mesh and
specs run ``dtenjax.pipeline`` on 8 CPU devices to the unpipelined step's loss. Planning only,
except the last test (one small pipelined step)."""

import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax import LinkSpec
from tests import compile_only

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _step_models as models


def _inter_host(topo, factor):
  """``topo`` with its inter-host (InfiniBand) links ``factor`` times slower: bandwidth divided,
  latency multiplied (factor < 1: faster)."""
  ib = topo.spec("infiniband")
  return topo.with_links({"infiniband": LinkSpec(ib.bandwidth_gbps / factor,
                                                 ib.latency_us * factor)}, measured=False)


def _stage_specs(plan):
  return {lp.path: lp.spec for lp in plan.leaves
          if "layers" in lp.path and lp.path.startswith("[0]")}


def test_roce_cluster_plans_a_pipeline_for_70b_and_says_why():
  step, args = models.decoder_70b(batch=16)
  plan = dtenjax.plan(step, *args, topology=dtenjax.Topology.fixture("roce_a100_4x8"))
  pipe = plan.pipeline
  assert pipe is not None, plan.table()
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  assert sizes["stage"] == pipe.stages > 1 and pipe.layers == 80 and 80 % pipe.stages == 0
  assert {a.name: a.span for a in plan.axes}["stage"] == "across hosts"
  assert pipe.link == "roce"
  # every leaf of the stack has its layer dimension over 'stage', nothing else does
  for path, spec in _stage_specs(plan).items():
    assert spec[0] == "stage" or (isinstance(spec[0], tuple) and "stage" in spec[0]), path
  assert all("stage" not in str(lp.spec) for lp in plan.leaves if "layers" not in lp.path)
  # the state per device is the stack's over the stages (and fsdp, tensor)
  layers = sum(np.prod(lp.shape) * 2 for lp in plan.leaves
               if lp.path.startswith("[0]['layers']"))
  assert plan.cost.memory["params"] < layers / pipe.stages
  # why, with the numbers: the chosen time against the best plan without stages
  table = plan.table()
  flat = next(r for r in plan.recipes if r.name == "no stages")
  assert flat.cost.total_s > plan.cost.total_s
  m = re.search(r"pipeline chosen: (\d+) stages price the step at ([\d.]+) ms against ([\d.]+) ms",
                table)
  assert m, table
  assert int(m[1]) == pipe.stages
  assert float(m[2]) == pytest.approx(plan.cost.total_s * 1e3, abs=1e-3)
  assert float(m[3]) == pytest.approx(flat.cost.total_s * 1e3, abs=1e-3)
  assert f"{pipe.microbatches} micro-batches, {pipe.schedule!r}" in table
  assert "communication over stage" in table
  # plan.jit does not run something else: it names dtenjax.pipeline and the values to pass
  with pytest.raises(dtenjax.PlacementError,
                     match=rf"dtenjax.pipeline\(body, loss_fn, stages={pipe.stages}, "
                     rf"microbatches={pipe.microbatches}"):
    plan.jit(step)


def test_the_pipeline_is_priced_per_schedule_from_pipeline_cost():
  """Each schedule tried carries dtenjax.pipeline_cost's numbers for its stages and micro-batches;
  1F1B holds at most 2 stages - 1 inputs, GPipe one per micro-batch. The 70B step's layer is
  under jax.checkpoint, so a stage's backward is 4 of its forwards (the pipeline's recomputed
  forward, then the layer's own backward with its recomputation). No budget: on the A100s'
  80 GiB this mesh's least memory is 72.8 GiB by the model, over the 72 GiB it leaves, and the
  planner refuses it (it returned a layout of 78.6 GiB, flagged as not fitting)."""
  step, args = models.decoder_70b(batch=64)
  topo = dtenjax.Topology.fixture("roce_a100_4x8")
  plan = dtenjax.plan(step, *args, topology=topo, mesh={"stage": 4, "fsdp": 8},
                      memory_budget=1 << 50)
  pipe = plan.pipeline
  rows = [line for line in plan.notes if re.match(r"\s+[* ](GPipe|OneFOneB|Interleaved)", line)]
  assert len(rows) == 6, plan.notes          # 8 rows per pipeline: 4 and 8 micro-batches
  for line in rows:
    name, micro, bubble, ticks = re.match(r"\s+[* ](\S+)\s+(\d+)\s+([\d.]+)\s+(\d+)", line).groups()
    schedule = {"GPipe()": dtenjax.GPipe(), "OneFOneB()": dtenjax.OneFOneB()}.get(
        name, dtenjax.Interleaved(virtual=2))
    ref = dtenjax.pipeline_cost(4, int(micro), schedule, forward=1.0, backward=4.0)
    assert (float(bubble), int(ticks)) == (pytest.approx(ref.bubble, abs=1e-3), ref.ticks), line
  assert pipe.inputs_held == dtenjax.pipeline_cost(4, pipe.microbatches, pipe.schedule).live_inputs
  one = dtenjax.pipeline_cost(4, 8, dtenjax.OneFOneB())
  gpipe = dtenjax.pipeline_cost(4, 8, dtenjax.GPipe())
  assert one.live_inputs < 2 * 4 and gpipe.live_inputs == 8


def test_slow_inter_host_links_get_stages_and_the_fixtures_links_do_not():
  """8B on h100_256 (h100_1024 plans alike, docs/planner.md; one cluster keeps the test short)."""
  topo = dtenjax.Topology.fixture("h100_256")
  step, args = models.llama_step("8b", batch=topo.num_devices, seq=2048, remat=True,
                                 dtype=jnp.bfloat16)
  fast = dtenjax.plan(step, *args, topology=topo)
  assert fast.pipeline is None and dict(zip(fast.axis_names, fast.mesh_shape))["stage"] == 1
  note = next(n for n in fast.notes if n.startswith("no pipeline"))
  assert note.startswith("no pipeline: the best with stages (") and "slower than the plan's" in note
  best = next((r for r in fast.recipes if r.name == "pipeline"), None)
  if best is not None:        # priced in full (else bounded below by its pipeline alone)
    assert f"{best.cost.total_s * 1e3:.3f} ms, slower than the plan's" in note
    assert best.cost.total_s > fast.cost.total_s
  slow = dtenjax.plan(step, *args, topology=_inter_host(topo, 4.0))
  assert slow.pipeline is not None and slow.pipeline.stages > 1, slow.table()
  assert slow.pipeline.link == "infiniband"
  flat = next(r for r in slow.recipes if r.name == "no stages")
  assert slow.cost.total_s < flat.cost.total_s


def test_a_faster_link_removes_the_70b_stages():
  topo = dtenjax.Topology.fixture("h100_64")
  step, args = models.decoder_70b(batch=topo.num_devices)
  slow = dtenjax.plan(step, *args, topology=_inter_host(topo, 4.0))
  fast = dtenjax.plan(step, *args, topology=_inter_host(topo, 0.5))
  assert slow.pipeline is not None, slow.table()
  assert fast.pipeline is None, fast.table()


def test_no_stages_without_a_scanned_stack():
  """Layers written as a Python loop (no lax.scan over stacked weights) cannot be split by
  dtenjax.pipeline: never staged, even on a slow cluster, and a mesh with stages is refused."""
  step, args = models.mlp_step(d=1024, f=4096, layers=8, batch=256, seq=128)
  topo = _inter_host(dtenjax.Topology.fixture("h100_64"), 20.0)
  plan = dtenjax.plan(step, *args, topology=topo)
  assert plan.pipeline is None
  assert any("no lax.scan over stacked layers" in n for n in plan.notes), plan.notes
  with pytest.raises(dtenjax.PlacementError, match="no lax.scan over stacked layers"):
    dtenjax.plan(step, *args, topology=topo, mesh={"stage": 2, "data": 32})


def test_never_more_stages_than_layers():
  step, args = models.llama_step("tiny", batch=256, seq=128)        # 2 scanned layers
  topo = _inter_host(dtenjax.Topology.fixture("h100_64"), 20.0)
  plan = dtenjax.plan(step, *args, topology=topo)
  assert dict(zip(plan.axis_names, plan.mesh_shape))["stage"] <= 2
  with pytest.raises(dtenjax.PlacementError, match=r"2 layers, which do not split into 4 .*\[1, 2\]"):
    dtenjax.plan(step, *args, topology=topo, mesh={"stage": 4, "data": 16})


# --- the planned pipeline runs ------------------------------------------------------------------

LAYERS, D, VOCAB, SEQ, BATCH = 4, 8, 16, 4, 16


def _body(h, w):
  return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None


def _loss_fn(head, h, targets):
  logits = h @ head["unembed"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _loss(p, tokens):
  x = jnp.take(p["embed"], tokens[:, :-1], axis=0)
  h, _ = jax.lax.scan(_body, x, p["layers"])
  return _loss_fn(p["head"], h, tokens[:, 1:])


TX = optax.sgd(0.1)


def _step(params, opt_state, tokens):
  value, grads = jax.value_and_grad(_loss)(params, tokens)
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, value


def test_the_planned_pipeline_runs_to_the_unpipelined_loss():
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)
  params = {"embed": normal(VOCAB, D), "head": {"unembed": normal(D, VOCAB)},
            "layers": {"w1": normal(LAYERS, D, D), "w2": normal(LAYERS, D, D)}}
  opt_state = TX.init(params)
  tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
  plan = dtenjax.plan(_step, params, opt_state, tokens, mesh={"stage": 2, "data": 4})
  pipe_plan = plan.pipeline
  assert pipe_plan is not None and pipe_plan.stages == 2 and pipe_plan.layers == LAYERS
  assert (BATCH // 4) % pipe_plan.microbatches == 0
  specs = plan.specs
  assert specs[0]["layers"] == {"w1": P("stage"), "w2": P("stage")}
  assert specs[2] == P("data")
  with pytest.raises(dtenjax.PlacementError, match="dtenjax.pipeline"):
    plan.jit(_step)

  pipe = pipe_plan.make(_body, _loss_fn)
  data = plan.mesh_shape[plan.axis_names.index("data")]

  def step(params, opt_state, tokens):        # per device: its stage's layers, its data shard
    def loss(p):
      x = jnp.take(p["embed"], tokens[:, :-1], axis=0)
      return pipe(p["layers"], p["head"], x, tokens[:, 1:])
    value, grads = jax.value_and_grad(loss)(dtenjax.compression.pvary(params, "data"))

    grads = jax.tree.map(lambda g: jax.lax.psum(g, "data") / data, grads)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, jax.lax.psum(value, "data") / data

  # Both programs compiled with LLVM unoptimised (tests/compile_only.py; 0.8 s of CPU less): the
  # claim is their values within the tolerances below, and the same HLO at either level differs
  # by float rounding only (the reference's outputs: 6e-8 at most).
  mesh = plan.mesh()
  train = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=plan.out_specs),
                  compiler_options=compile_only.LLVM_O0)
  staged = {**params, "layers": pipe.to_stages(params["layers"])}
  with jax.set_mesh(mesh):
    new, _, value = train(staged, TX.init(staged), tokens)
  reference = jax.jit(_step, compiler_options=compile_only.LLVM_O0)
  want_params, _, want = reference(params, opt_state, tokens)
  np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(pipe.from_stages(new["layers"])["w1"]),
                             np.asarray(want_params["layers"]["w1"]), rtol=1e-4, atol=1e-6)
