"""A plan for GPUs priced as XLA's GPU compiler compiles it. XLA:GPU cannot compile here: the
expected values are its numbers, recorded on the GPU machine for the bench's families
(tests/data/xla_gpu_mock8.json says which command, commit, jax and GPU), and the predictions are
made on CPU for the ``h200_8`` fixture, as ``bench/step_planner.py --parts gpu`` makes them. What
XLA:GPU does that XLA:CPU does not (read from its buffer assignment of the unrolled decoder):
it inlines ``jax.nn.silu``'s jit and recomputes the logistic in each user's fusion, fuses an RMS
norm's normalised input into the column reduction of the norm weight's gradient instead of
keeping it, and keeps the attention scores for the backward's softmax fusion, which recomputes
the exponentials from them. From its buffer assignment of moe's FSDP step: it recomputes a
GELU's tanh in the forward's and the backward's fusions, merges the products of one input
(an attention's query, key and value projections) into one, and splits the contraction of a
product with few result tiles (an expert's output projection, the vocabulary's input gradient)
into parts it sums afterwards, their buffer several times the result's."""

import dataclasses
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import dtenjax
from dtenjax.testing import planning
from dtenjax._src import jaxapi
from dtenjax._src.planning import solver
from dtenjax._src.planning import stepgraph
from tests import compile_only
from tests import helpers

pytestmark = helpers.one_worker(__name__)    # its cached GPU plans, made once

_READS: dict = {}      # the module's step reads, shared by its tests (helpers.shared_step_reads)


@pytest.fixture(autouse=True)
def _shared_reads(request):
  """Each step the module's tests plan is read once: its functools.cache'd steps are planned by
  several tests, under several recipes and topologies. Not in a test that monkeypatches (the
  reader or its rules, read again under the patch)."""
  if "monkeypatch" in request.fixturenames:
    yield
    return
  with helpers.shared_step_reads(_READS):
    yield


_ROOT = pathlib.Path(__file__).resolve().parent.parent
_DATA = json.loads((_ROOT / "tests" / "data" / "xla_gpu_mock8.json").read_text())
_MIB = 2**20


def _families():
  sys.path.insert(0, str(_ROOT / "bench"))
  import _families
  return _families


@functools.cache
def _gpu_step(family: str):
  """(step, args) of a family at batch 64, llama-1b as bench/step_planner.py's gpu_rows makes it:
  one step object per family, so that jax's trace cache serves the planner's read of it for
  every recipe (a new closure per recipe was traced again)."""
  if family == "llama-1b":
    sys.path.insert(0, str(_ROOT / "bench"))
    import _step_models
    return _step_models.llama_step("1b", batch=8, seq=2048, remat=True, dtype=jnp.bfloat16)
  return _families().FAMILIES[family](batch=64).make()


@functools.cache
def _gpu_plan(family: str, recipe: str):
  """The plan bench/step_planner.py's gpu part compiles on the GPU machine (recipe "plan": the
  planner's choice); planned once per family and recipe (the collectives test reads the memory
  test's plans)."""
  step, args = _gpu_step(family)
  # the recorded compiles are of the plan the model prices fastest: the lean rule (step._leanest)
  # came after them, and picks another layout for llama-1b
  with planning.fastest_priced():
    plan = dtenjax.plan(step, *args, topology=dtenjax.Topology.fixture("h200_8"),
                        recipe=None if recipe == "plan" else recipe, memory_budget=1 << 50)
  return step, args, plan


def _row_id(row):
  return f"{row['family']}-{row['recipe'].replace(' ', '')}"


@pytest.mark.parametrize("row", _DATA["rows"], ids=_row_id)
def test_gpu_memory_is_within_10_percent_of_xla_gpu(row):
  # Before these GPU rules the unrolled families were over: llama_loop DP +15.6 %, FSDP +22 %,
  # FSDP x TP +37 %; encdec FSDP +14 %, FSDP x TP +18 %; shared DP +21 % (the silu's three
  # results and the norms' normalised inputs priced as kept, the scores not).
  _, _, plan = _gpu_plan(row["family"], row["recipe"])
  # the recorded numbers are of this layout's mesh
  assert "x".join(map(str, plan.mesh_shape)) == row["mesh"]
  predicted = plan.cost.memory["total"] / _MIB
  assert abs(predicted - row["mem_mib"]) <= 0.10 * row["mem_mib"], (predicted, row)


@pytest.mark.parametrize("row", _DATA["rows"], ids=_row_id)
def test_a_plan_for_gpus_prices_the_collectives_xla_gpu_runs(row):
  # plan.jit gathers a table read by lookups over fsdp like any FSDP weight, and XLA:GPU looks up
  # the gathered table: an all-gather of the table, no all-reduce of the looked-up rows (priced
  # before as 8 MiB of all-reduce the GPU compile did not have, the table's all-gather missing).
  # Under FSDP x TP the weights outside loops that tensor does not shard (the table, the
  # unembedding, convnet's kernels) are reduced as shards over the fsdp pairs, then permuted
  # to their owners: priced before as reduce-scatters of the whole gradients (8-8.5 MiB where
  # XLA:GPU reduce-scatters 4-4.5 and all-reduces 2 MiB more; convnet: 1.1 MiB of
  # reduce-scatter, XLA:GPU 0.6 of all-reduce). The pieces of a table and of convolutions are
  # permuted with the unembedding's (a combined permute: llama_loop 2 MiB, where its first
  # operand's 1 MiB was counted and the unembedding's priced), a table's as its tokens' rows and
  # ids where smaller (llama-1b FSDP x TP: 94.5 MiB, 62.5 priced); a checkpointed layer's
  # row-parallel output is all-reduced again where the backward recomputes it (llama-1b FSDP x
  # TP: 3645 MiB, 2941 priced); a vocabulary-sharded table under fsdp alone gathers its lookup's
  # cotangent rows and ids and reduce-scatters no table gradient (llama-1b's plan, fsdp 8:
  # reduce-scatter 301 MiB, 426 priced)
  _, _, plan = _gpu_plan(row["family"], row["recipe"])
  predicted: dict[str, float] = {}
  for key, nb in plan.cost.collective_bytes.items():
    kind = key.split("[")[0]
    predicted[kind] = predicted.get(kind, 0.0) + nb / _MIB
  total = sum(row["kinds_mib"].values())
  for kind in set(predicted) | set(row["kinds_mib"]):
    want = row["kinds_mib"].get(kind, 0.0)
    got = predicted.get(kind, 0.0)
    # a kind of a few bytes on both sides (the optimizer's step count, the norms' reduce-scatter
    # beside convnet's pieces) is not counted, as Check.misses counts none under 1 % of the step
    if max(got, want) <= 0.01 * total:
      continue
    assert abs(got - want) <= 0.10 * want, (kind, predicted, row)


@functools.cache     # one step object for the tests that read it (_gpu_step)
def _small_llama_loop():
  fam = _families().FAMILIES["llama_loop"](vocab=512, d=128, heads=4, ffn=256, layers=2,
                                           batch=16, seq=256)
  return fam.make()


def test_xla_gpus_recomputed_values_are_marked_and_what_they_read_lives_on():
  # XLA:GPU's buffer assignment of llama_loop's DP step keeps per layer the scores' product
  # output (from the forward to the backward's softmax fusion, which recomputes the exponentials
  # from it), the probabilities, the gate and up products and silu(gate) * up; nothing of
  # silu's jit (its fusion recomputes exp and the division from the gate product) and no
  # normalised input of an RMS norm (recomputed from the residual and the norm's statistics).
  step, args = _small_llama_loop()
  graph = stepgraph.read_step(step, args, (2,))
  batch, seq, heads, d, ffn, layers = 16, 256, 4, 128, 256, 2
  scores = batch * heads * seq * seq * 4
  hidden = batch * seq * ffn * 4
  marked = [v for v in graph.timeline if v.cheap_on_gpu]
  # silu's jit: its three results (silu, the logistic, its derivative) per layer, and its
  # backward's (a jit of products): nothing of [batch, seq, ffn] else is marked
  assert sum(v.nbytes == hidden for v in marked) == 4 * layers, marked
  # the three norms' normalised inputs per layer (attention's two and the MLP's) and the final
  # norm's: [batch, seq, d] values XLA:CPU keeps for the norm weights' gradients
  width = batch * seq * d * 4
  assert sum(v.nbytes == width for v in marked) >= 3 * layers + 1, marked
  # each layer's scores, made in the forward (before the first gradient), live on XLA:GPU
  # until the backward's softmax fusion; on XLA:CPU they end in the forward's softmax
  backward = min(v.start for v in graph.timeline if v.grad is not None)
  kept = [v for v in graph.timeline if v.nbytes == scores and v.start < backward and
          v.end < backward < (v.gpu_end or 0)]
  assert len(kept) == layers, kept


@functools.cache     # one step object for the tests that read it (_gpu_step)
def _small_convnet():
  return _families().FAMILIES["convnet"](channels=(8, 16), blocks=2, batch=8, image=8).make()


def test_xla_gpu_fuses_a_relus_input_into_it():
  # XLA:GPU's buffer assignment of convnet's FSDP step keeps per block the convolution's output
  # and the relu's (the next convolution reads it), not the pre-activation sum bn(y) + x that
  # jax.nn.relu (a custom_jvp call of a max) reads: its fusion recomputes the sum, and the
  # backward's fusions recompute the relu's mask from the convolution's output, the statistics
  # and the residual. Those sums are marked (XLA:CPU's rows keep them); the relus' outputs are
  # not. Before, the sums were priced as kept: convnet's FSDP plan +24 %, FSDP x TP +35 %.
  step, args = _small_convnet()
  graph = stepgraph.read_step(step, args, (2,))
  eqns = jax.make_jaxpr(step)(*args).jaxpr.eqns
  made_by = {o: i for i, e in enumerate(eqns) for o in e.outvars}
  relus = [i for i, e in enumerate(eqns) if e.primitive.name == "custom_jvp_call"]
  sums = [made_by[eqns[i].invars[0]] for i in relus
          if eqns[made_by.get(eqns[i].invars[0], i)].primitive.name == "add"]
  assert len(sums) == 4, sums             # one per block (the stem's relu reads its convolution)
  marked = {v.start for v in graph.timeline if v.cheap_on_gpu}
  kept = {v.start for v in graph.timeline if not v.cheap_on_gpu and not v.copy}
  assert set(sums) <= marked, (sums, marked)
  assert set(relus) <= kept and not set(relus) & marked, (relus, marked)


@pytest.mark.parametrize("make", [_small_llama_loop, _small_convnet], ids=["llama_loop", "convnet"])
def test_the_gpu_rules_leave_cpu_predictions_unchanged(monkeypatch, make):
  # a plan for this machine's CPUs prices the same memory and bytes with the GPU marks removed
  # from the timeline; a plan for GPUs does not (the marks are what it prices)
  step, args = make()
  read_step = stepgraph.read_step

  def unmarked(*a):
    g = read_step(*a)
    return dataclasses.replace(g, timeline=tuple(
        dataclasses.replace(v, cheap_on_gpu=False, gpu_end=None) for v in g.timeline))
  got = {}
  for fixture in (None, "h200_8"):
    topology = dtenjax.Topology.fixture(fixture) if fixture else None
    for read in (read_step, unmarked):
      monkeypatch.setattr(stepgraph, "read_step", read)
      for recipe in ("DP", "FSDP x TP"):
        plan = dtenjax.plan(step, *args, recipe=recipe, topology=topology)
        got[fixture, read is unmarked, recipe] = (plan.cost.memory, plan.cost.collective_bytes)
      monkeypatch.undo()
  for recipe in ("DP", "FSDP x TP"):
    assert got[None, False, recipe] == got[None, True, recipe]
    assert got["h200_8", False, recipe][0]["total"] < got["h200_8", True, recipe][0]["total"]


@pytest.mark.parametrize("row", _DATA["split_k"], ids=lambda r: "x".join(map(str, r)))
def test_xla_gpu_splits_the_contraction_of_a_product_as_recorded(row):
  # the parts XLA:GPU split each product's contraction into, per device, read from the
  # round-2 dumps' product fusions (tests/data/xla_gpu_mock8.json: split_k); the two shapes
  # the rule misses (a 256-long contraction of 8 columns: the routers') are listed there
  *dims, parts = row
  assert solver.split_k(*dims) == parts


def test_moe_fsdp_for_gpus_prices_xla_gpus_split_products_and_recomputed_tanh():
  # XLA:GPU's buffer assignment of moe's FSDP step (h100_round2_moe): the peak (its 57.6 MiB
  # temp buffer) is at the vocabulary's input gradient, split into 8 parts (4 MiB beside the
  # 0.5 MiB result), with each layer's expert output projection split into 4 (4 MiB each, live
  # from the forward to the backward's transposing fusion that sums them again), no tanh
  # result kept (recomputed in the forward's and the backward's fusions) and the attention's
  # three projections merged into one unsplit product. Before: 66.0 MiB predicted under jax
  # 0.11 (-11 %), 69.0 under jax 0.10 (-7 %, its two tanh results priced as kept, 4 MiB at a
  # later peak); what is still not priced is the logits' 4 MiB, kept for the loss's fusion
  # that XLA:GPU schedules after the vocabulary's gradient.
  step, args, plan = _gpu_plan("moe", "FSDP")
  xla = 77754850 / _MIB
  predicted = plan.cost.memory["total"] / _MIB
  assert abs(predicted - xla) <= 0.05 * xla, (predicted, plan.cost.memory)
  graph = stepgraph.read_step(step, args, (2,))
  eqns = jaxapi.inline_calls(jax.make_jaxpr(step)(*args)).jaxpr.eqns
  tanhs = [v for v in graph.timeline if eqns[v.start].primitive.name == "tanh"]
  assert tanhs and all(v.cheap_on_gpu for v in tanhs), tanhs


@functools.cache
def _llama_1b_fsdp_x_tp_gpu():
  """bench/step_planner.py's gpu part's Llama 1B (batch 8, bf16) under FSDP x TP (`fsdp` 2 x
  `tensor` 4) for a host of 8 GPUs: the step, its arguments and the plan."""
  import jax.numpy as jnp
  _families()
  import _step_models
  step, args = _step_models.llama_step("1b", batch=8, seq=2048, remat=True, dtype=jnp.bfloat16)
  plan = dtenjax.plan(step, *args, topology=dtenjax.Topology.fixture("h200_8"),
                      recipe="FSDP x TP", memory_budget=1 << 50)
  return step, args, plan


def test_llama_1b_fsdp_x_tp_for_gpus_all_reduces_the_recomputed_row_parallel_output():
  # The layers are a lax.scan of jax.checkpoint bodies: the backward recomputes the attention's
  # output projection (row-parallel over 'tensor'), whose partial sums XLA:GPU all-reduces a
  # second time, [4, 2048, 2048] bf16 (32 MiB) per layer, 22 layers; the MLP's down projection is
  # not recomputed (the backward does not read its output). XLA:GPU's compile of this plan
  # (bench/results/2026-12-06_step_planner_gpu_mock8_h100_eleventh_a.log, jax 0.11.2, one H100
  # mocking 8): all-reduce 3645.0 MiB per device; 2941.0 predicted before (19 % under).
  _, _, plan = _llama_1b_fsdp_x_tp_gpu()
  predicted = sum(v for k, v in plan.cost.collective_bytes.items()
                  if k.startswith("all_reduce[")) / _MIB
  assert predicted == pytest.approx(3645.0, rel=0.005)


def test_llama_1b_fsdp_x_tp_for_gpus_counts_a_calls_in_place_result_once():
  # XLA:GPU's buffer assignment of llama-1b's FSDP x TP step (h100_round2, module_217552:
  # memory-usage report 4716631938 B) peaks at the loss's backward: the take_along_axis
  # gradient (a jit whose scatter-add writes into zeros) is one f32 [4, 2047, 32000] buffer per
  # device, its multiply and its scatter at the same offset (1048064000 B at 1393594368). The
  # model counted that call's result twice (the body's peak value and the call's output), 1 GiB
  # too many: 5003.1 MiB predicted, +11.2 %.
  step, args, plan = _llama_1b_fsdp_x_tp_gpu()
  xla = 4716631938 / _MIB
  predicted = plan.cost.memory["total"] / _MIB
  assert abs(predicted - xla) <= 0.10 * xla, (predicted, plan.cost.memory)
  graph = stepgraph.read_step(step, args, (len(args) - 1,))
  results = [v for v in graph.timeline if v.call_result]
  outputs = {(v.start, v.nbytes) for v in graph.timeline if not v.body}
  assert results and all((v.start, v.nbytes) in outputs for v in results), results


def _tensor_all_reduce(plan, step, args) -> tuple[float, float]:
  """(compiled on this host's CPUs, priced for the GPU fixture) bytes per step of the
  all-reduces over 'tensor' of an fsdp 2 x tensor 4 plan: the compiled ones over the groups of
  devices that share an fsdp index, loop trips counted. Compiled as
  tests/test_step_planner_memory.py's check of the same plan compiles it (the run's compile cache
  then holds one program for both files)."""
  from dtenjax._src.planning.check import loop_repeats
  compiled = plan.jit(step).lower(*args).compile(compile_only.USERS_PROGRAM)
  repeats = loop_repeats(compiled)
  tensor_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}
  got = sum(c.nbytes * repeats(c.computation) for c in dtenjax.explain(compiled).collectives
            if c.kind == "all_reduce" and {tuple(sorted(g)) for g in c.groups} == tensor_groups)
  gpu = dtenjax.plan(step, *args, recipe="FSDP x TP", topology=dtenjax.Topology.fixture("h200_8"))
  assert gpu.mesh_shape == plan.mesh_shape == (1, 1, 2, 1, 1, 4)
  return got, gpu.cost.collective_bytes["all_reduce[tensor]"]


def test_a_checkpointed_row_parallel_output_is_all_reduced_again_on_gpus():
  # jax.checkpoint's backward recomputes a layer's forward up to what its gradients read: the
  # attention's row-parallel output (the MLP's input reads it) is all-reduced again in the
  # backward's loop, the MLP's (the layer's output, which no gradient reads) is not: JAX drops
  # that product. XLA:GPU's llama-1b FSDP x TP step (module_217552): 2 all-reduces of
  # [4,2048,2048] per layer in the forward loop, 3 in the backward's. XLA:CPU partitions the
  # step alike: the checkpointed Llama's compiled all-reduces over 'tensor' exceed the
  # unchecked one's by one [batch / fsdp, seq, d] per layer, which the GPU plan prices (before:
  # the same for both). The "small" Llama (4 layers, d 256) whose CPU plan
  # test_step_planner_memory.py checks against the same two programs.
  sys.path.insert(0, str(_ROOT / "bench"))
  import _step_models
  compiled, priced = {}, {}
  for remat in (False, True):
    step, args = _step_models.llama_step("small", batch=8, seq=64, remat=remat,
                                         dtype=jnp.float32)
    plan = dtenjax.plan(step, *args, recipe="FSDP x TP")
    compiled[remat], priced[remat] = _tensor_all_reduce(plan, step, args)
  layers, per_layer = 4, 8 // 2 * 64 * 256 * 4
  assert compiled[True] - compiled[False] == layers * per_layer, compiled
  assert priced[True] - priced[False] == pytest.approx(layers * per_layer), priced


_LLAMA_1B = json.loads((_ROOT / "tests" / "data" / "xla_gpu_llama1b_fsdp.json").read_text())


@functools.cache
def _llama_1b_f32(devices: int):
  """tests/data/xla_gpu_llama1b_fsdp.json's step: Llama 1B in float32, one sequence per device."""
  sys.path.insert(0, str(_ROOT / "bench"))
  import _step_models
  return _step_models.llama_step("1b", batch=devices, seq=2048, remat=True, dtype=jnp.float32)


def _llama_1b_plan(row):
  step, args = _llama_1b_f32(row["devices"])
  return dtenjax.plan(step, *args, topology=dtenjax.Topology.fixture(row["fixture"]),
                      recipe=row["recipe"], memory_budget=1 << 50)


@pytest.mark.parametrize("row", _LLAMA_1B["rows"],
                         ids=lambda r: f"{r['devices']}-{r['recipe'].replace(' ', '')}")
def test_llama_1b_on_8_to_32_gpus_is_within_10_percent_of_xla_gpu(row):
  # Before the whole table's zeros were priced (solver._zeros_before_the_loop) the FSDP rows
  # went further under as the devices grew: 8 -1.5 %, 16 -9.0 %, 32 -13.5 %
  plan = _llama_1b_plan(row)
  assert "x".join(map(str, plan.mesh_shape)) == row["mesh"]
  predicted = plan.cost.memory["total"] / _MIB
  assert abs(predicted - row["mem_mib"]) <= 0.10 * row["mem_mib"], (predicted, row)


@pytest.mark.parametrize("row", [r for r in _LLAMA_1B["rows"] if "temp_mib" in r],
                         ids=lambda r: f"{r['devices']}-{r['recipe'].replace(' ', '')}")
def test_xla_gpu_holds_a_whole_tables_zeros_through_the_backward_loop(monkeypatch, row):
  # XLA:GPU's buffer assignment of Llama 1B's FSDP step on 32 mocked GPUs: its temp (3096.0
  # MiB) is the peak of its live values, in the backward loop's attention, where the 8-GPU
  # step's (2690.4) is too; 250 MiB of the difference is the embedding's gradient, a scatter
  # into zeros of the whole f32[32000,2048] table (the partitioner's "index passthrough": the
  # tokens' rows gathered over 32 devices, 512 MiB, exceed the table), scheduled before the
  # backward loop and live through it. On 8 the rows gathered (128 MiB) are fewer bytes than
  # the table: the scatter writes the shard, in the table's output buffer, not the temp.
  table = 32000 * 2048 * 4
  temp = {}
  for rule in (True, False):
    if not rule:
      monkeypatch.setattr(solver, "_zeros_before_the_loop", lambda graph, tables: {})
    mem = _llama_1b_plan(row).cost.memory
    temp[rule] = mem["grads"] + mem["activations"] + mem["gathered"]
  assert temp[True] - temp[False] == (table if row["devices"] == 32 else 0), temp
  assert abs(temp[True] / _MIB - row["temp_mib"]) <= 0.10 * row["temp_mib"], (temp, row)


def test_only_a_backward_loop_over_scanned_layers_holds_the_table_zeros():
  # the rule moves the table's gradient to the backward's while loop (the last scan of Llama
  # 1B's jaxpr, the scanned layers' transpose); llama_loop unrolls its layers, and its call
  # bodies (silu's jit, the loss's) are no loop: its table gradient stays where it is made
  step, args = _llama_1b_f32(32)
  graph = stepgraph.read_step(step, args, (len(args) - 1,))
  eqns = jaxapi.inline_calls(jax.make_jaxpr(step)(*args)).jaxpr.eqns
  scans = [i for i, e in enumerate(eqns) if e.primitive.name == "scan"]
  assert len(scans) == 2, scans                     # the forward's and the backward's
  table = (32000, 2048)
  assert list(solver._zeros_before_the_loop(graph, {table}).values()) == [scans[-1]]
  step, args = _small_llama_loop()
  graph = stepgraph.read_step(step, args, (2,))
  table = next(graph.leaves[i].shape for i in graph.lookups)
  assert any(v.grad == table for v in graph.timeline) and any(v.body for v in graph.timeline)
  assert solver._zeros_before_the_loop(graph, {table}) == {}
