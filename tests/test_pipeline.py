"""dtenjax.pipeline: schedules' timetables (checked against the rules of a pipeline, written here
from their definitions), the predicted bubble and held inputs, bad input, the pipelined loss and
gradients against a gradient-accumulation loop (float tolerance in this process; bit for bit in a
fresh process with ``--xla_cpu_max_isa=AVX``, tests/pipeline_bits.py), and the stage transport
choice."""

from __future__ import annotations

import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.pipeline import schedule as sched
from dtenjax.testing import pipeline_model as pm
from procs import run_at_once
from tests import compile_only, helpers
from tests.mp_workers import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCHEDULES = [dtenjax.GPipe(), dtenjax.OneFOneB(), dtenjax.Interleaved(virtual=2)]


def _events(table, stages, virtual):
  """``{("F"|"B", chunk, m): tick}`` read from a timetable; asserts one event per key."""
  out = {}
  for t in range(table.ticks):
    for d in range(stages):
      for kind, k, c, m in (("F", table.f_kind, table.f_chunk, table.f_micro),
                            ("B", table.b_kind, table.b_chunk, table.b_micro)):
        if k[t, d]:
          key = (kind, int(c[t, d]) * stages + d, int(m[t, d]))
          assert key not in out, f"{key} runs twice"
          out[key] = t
  return out


@pytest.mark.parametrize("schedule", SCHEDULES, ids=repr)
def test_timetables_obey_the_pipeline_rules(schedule):
  """Every chunk runs every micro-batch forward and backward exactly once; a forward follows the
  previous chunk's (a tick later at least: the message takes a tick), a backward follows the next
  chunk's backward and its own forward; a chunk takes micro-batches in order; every message is
  announced to its receiver at the next tick."""
  for p in (1, 2, 4, 8):
    for m in (4, 8, 16):
      if schedule.check(p, m):
        continue
      v = schedule.virtual
      chunks = p * v
      for backward in (True, False):
        table = sched.timetable(schedule, p, m, backward)
        ev = _events(table, p, v)
        kinds = ("F", "B") if backward else ("F",)
        assert set(ev) == {(k, c, i) for k in kinds for c in range(chunks) for i in range(m)}
        for c in range(chunks):
          for i in range(m):
            if c:
              assert ev["F", c, i] > ev["F", c - 1, i]
            if i:
              assert ev["F", c, i] > ev["F", c, i - 1]
            if backward:
              if c < chunks - 1:
                assert ev["B", c, i] > ev["B", c + 1, i] and ev["B", c, i] > ev["F", c, i]
              else:
                assert ev["B", c, i] >= ev["F", c, i]
              if i:
                assert ev["B", c, i] > ev["B", c, i - 1]
        for (kind, c, i), t in ev.items():
          if kind == "F" and c < chunks - 1:
            r = (c + 1) % p
            assert table.recv_f[t + 1, r] and table.recv_f_micro[t + 1, r] == i
            assert table.recv_f_chunk[t + 1, r] == (c + 1) // p
          if kind == "B" and c > 0:
            r = (c - 1) % p
            assert table.recv_b[t + 1, r] and table.recv_b_micro[t + 1, r] == i


def test_one_f_one_b_bounds_held_inputs_by_stages_gpipe_by_microbatches():
  for p in (2, 4, 8):
    for m in (4, 8, 16, 32):
      one = dtenjax.pipeline_cost(p, m, dtenjax.OneFOneB())
      gpipe = dtenjax.pipeline_cost(p, m, dtenjax.GPipe())
      assert one.live_inputs <= min(2 * p - 1, m)
      assert gpipe.live_inputs == m
  assert dtenjax.pipeline_cost(4, 8, dtenjax.OneFOneB(), input_bytes=1024).activation_bytes == (
      dtenjax.pipeline_cost(4, 8, dtenjax.OneFOneB()).live_inputs * 1024)


def test_predicted_bubble_follows_the_theory():
  """The predicted bubble of GPipe and 1F1B stays at or below (p-1)/(m+p-1) (the last stage's
  forward is free: its backward recomputes it) and falls as micro-batches grow; interleaving cuts
  it. One case by hand: GPipe, 2 stages, 4 micro-batches, forward 1 and backward 3: four forward
  ticks (1 each), then five ticks holding a backward (3 each): 19 units for 16 of work."""
  c = dtenjax.pipeline_cost(2, 4, dtenjax.GPipe(), forward=1, backward=3)
  assert (c.ticks, c.time, c.busy) == (9, 19, 16)
  assert c.bubble == pytest.approx(3 / 19)
  for p in (2, 4, 8):
    prev = {}
    for m in (8, 16, 32):
      theory = (p - 1) / (m + p - 1)
      for s in (dtenjax.GPipe(), dtenjax.OneFOneB()):
        c = dtenjax.pipeline_cost(p, m, s)
        assert c.theory_bubble == pytest.approx(theory)
        assert 0 < c.bubble <= theory + 1e-9, (s, p, m, c.bubble, theory)
        assert c.bubble < prev.get(s, 1.0)
        prev[s] = c.bubble
      inter = dtenjax.pipeline_cost(p, m, dtenjax.Interleaved(virtual=2))
      assert inter.bubble < dtenjax.pipeline_cost(p, m, dtenjax.OneFOneB()).bubble
      assert inter.theory_bubble == pytest.approx((p - 1) / (2 * m + p - 1))


def test_schedules_print_themselves_and_the_report_names_them():
  assert repr(dtenjax.Interleaved(virtual=3)) == "Interleaved(virtual=3)"
  assert repr(dtenjax.OneFOneB()) == "OneFOneB()"
  pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=4, microbatches=8,
                          schedule=dtenjax.Interleaved(virtual=2))
  text = pipe.report()
  assert "Interleaved(virtual=2)" in text and "bubble" in text
  row = text.splitlines()[-1].split()
  assert row[0] == "Interleaved(virtual=2)" and row[-3] == f"{pipe.cost().bubble:.3f}"


def test_bad_numbers_name_the_value_and_the_fix():
  with pytest.raises(dtenjax.ConfigurationError, match=r"15 layers do not split into 4 stages"):
    dtenjax.pipeline(pm.body, pm.loss_fn, stages=4, microbatches=8).to_stages(
        {"w": jnp.zeros((15, 2))})
  with pytest.raises(dtenjax.ConfigurationError, match=r"multiple of stages \(4\).*8 micro"):
    dtenjax.pipeline(pm.body, pm.loss_fn, stages=4, microbatches=6,
                     schedule=dtenjax.Interleaved(virtual=2))
  with pytest.raises(dtenjax.ConfigurationError, match=r"virtual=0"):
    dtenjax.Interleaved(virtual=0)
  with pytest.raises(dtenjax.ConfigurationError, match=r"schedule='1f1b' is not a schedule"):
    dtenjax.pipeline(pm.body, pm.loss_fn, stages=2, microbatches=4, schedule="1f1b")
  with pytest.raises(dtenjax.ConfigurationError, match=r"stages=0"):
    dtenjax.pipeline(pm.body, pm.loss_fn, stages=0, microbatches=4)


def _small():
  params = pm.init(layers=4, d=16, ffn=32)
  toks = pm.tokens(16, d=16)
  return params, toks


def _call(pipe, mesh, params, toks, specs=None):
  specs = specs or pm.param_specs(params, "stage" if "stage" in mesh.axis_names else None)

  def f(p, t):
    return pipe(p["layers"], p["head"], pm.embed(p["embed"], t[:, :-1]), t[:, 1:])
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs, P()), out_specs=P()))(params, toks)


def test_bad_calls_name_the_value_and_the_fix():
  params, toks = _small()
  data_only = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=2, microbatches=4)
  with pytest.raises(dtenjax.MeshError, match=r"axis 'stage' is not a mesh axis.*\['data'\]"):
    _call(pipe, data_only, params, toks)
  mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with pytest.raises(dtenjax.ConfigurationError, match=r"microbatches=5 does not divide the batch "
                     r"of 16 rows: use one of \[1, 2, 4, 8, 16\]"):
    _call(dtenjax.pipeline(pm.body, pm.loss_fn, stages=2, microbatches=5), mesh, params, toks)
  with pytest.raises(dtenjax.ConfigurationError, match=r"'stage' has 2 devices but stages=4"):
    _call(dtenjax.pipeline(pm.body, pm.loss_fn, stages=4, microbatches=4), mesh, params, toks)
  specs = pm.param_specs(params, "stage")
  unchecked = jax.shard_map(lambda p, t: pipe(p["layers"], p["head"], pm.embed(p["embed"], t[:, :-1]),
                                              t[:, 1:]),
                            mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
  with pytest.raises(dtenjax.ConfigurationError, match=r"check_vma=False.*default check_vma=True"):
    jax.jit(unchecked).lower(params, toks)


@functools.partial(jax.jit, static_argnums=2)
def _reference(params, toks, microbatches):
  """value_and_grad of the mean micro-batch loss, accumulated in micro-batch order (no pipeline).
  The micro-batches are a lax.scan (one copy of the step's forward and backward to compile; the
  Python loop unrolled four, about three quarters of this test's compile)."""
  x = pm.embed(params["embed"], toks[:, :-1])
  xs = x.reshape(microbatches, -1, *x.shape[1:])
  ts = toks[:, 1:].reshape(microbatches, -1, toks.shape[1] - 1)

  def loss(layers, head, xm, tm):
    return pm.loss_fn(head, lax.scan(pm.body, xm, layers)[0], tm)

  def accumulate(carry, m):
    total, grads = carry
    value, g = jax.value_and_grad(loss, argnums=(0, 1))(params["layers"], params["head"], *m)
    return (total + value, jax.tree.map(jnp.add, grads, g)), None
  zeros = jax.tree.map(jnp.zeros_like, (params["layers"], params["head"]))
  (total, grads), _ = lax.scan(accumulate, (jnp.float32(0), zeros), (xs, ts))
  return total / microbatches, jax.tree.map(lambda a: a / microbatches, grads)


def test_loss_and_gradients_match_the_accumulation_loop_within_float_tolerance():
  """In this process (XLA's default flags: FMA contraction wherever XLA fuses), under jax.jit,
  jax.value_and_grad and plain jax.shard_map: 1F1B over 4 stages x 2 data shards, each shard its
  own half of the batch, within 1e-5 relative of the loop (gradients 1e-4); the
  undifferentiated call (forwards only) gives value_and_grad's loss to within 1e-6."""
  params, toks = _small()
  mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  pipe = dtenjax.pipeline(pm.body, pm.loss_fn, stages=4, microbatches=4)
  specs = pm.param_specs(params, "stage")

  def f(p, t):
    def loss(p):
      return pipe(p["layers"], p["head"], pm.embed(p["embed"], t[:, :-1]), t[:, 1:])
    p = dtenjax.compression.pvary(p, "data")
    value, grads = jax.value_and_grad(loss)(p)
    stack = lambda a: a[None]
    return stack(loss(p)), stack(value), jax.tree.map(stack, {k: grads[k] for k in ("layers", "head")})

  out_specs = (P("data"), P("data"), {"layers": jax.tree.map(lambda _: P("data", "stage"),
                                                             params["layers"]),
                                      "head": jax.tree.map(lambda _: P("data"), params["head"])})
  with jax.set_mesh(mesh):
    plain, value, grads = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs, P("data")),
                                                out_specs=out_specs))(params, toks)
  # on the host: each eager slice of a device array below was a program compiled of its own
  plain, value, grads, toks = jax.device_get((plain, value, grads, toks))
  np.testing.assert_allclose(plain, value, rtol=1e-6)      # another program: FMA may differ
  for shard in range(2):
    ref_value, ref_grads = _reference(params, toks[shard * 8:(shard + 1) * 8], 4)
    np.testing.assert_allclose(value[shard], ref_value, rtol=1e-5)
    got = jax.tree.map(lambda a: a[shard], grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(dict(zip(("layers", "head"), ref_grads)))):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# In this process's fixture: 4 and 8 stages, each with 2 data shards (16 simulated devices), so
# that one unpipelined step with 2 data shards is the reference of both and of the multi-process
# test below (each pipelined or unpipelined step was about 6 s of XLA:CPU compile on the 2-core
# machine whatever the model's size: some 500 fused kernels, each compiled by LLVM on its own;
# _PROCESS_XLA leaves LLVM unoptimised: both tests 33.5 -> 19.7 s of CPU, 51 -> 15 s wall).
# 24 layers, not the model's 16: 3 stages (the processes below), 4 x 2 chunks (interleaved) and 8
# stages all divide them; the layers are a lax.scan, so the compile does not grow with them.
BITS_CONFIGS = ("4x2:interleaved", "8x2:1f1b")
LAYERS = ["--layers", "24"]
# The processes' XLA: AVX without FMA (so that no product is contracted into its sum in one
# program and not in the other), LLVM unoptimised and the suite's fusion emitters (its LLVM IR
# emitters, helpers.xla_flags; nothing where the run keeps XLA's): the digests are compared within
# the run, never stored, and each process's compile of ~500 fused kernels is what the tests cost.
# With these flags the fixture's digests are those of XLA's default emitters at level 0 (one
# `a80c66d7...` for all three programs both ways, 2026-12-07), for 8.4 -> 4.9 s of the fixture's
# CPU (docs/testing.md, twenty-first round).
_PROCESS_XLA = helpers.xla_flags("--xla_cpu_max_isa=AVX", compile_only.LLVM_O0_FLAGS)


# Session-scoped, not module-scoped: each xdist worker runs its `slow` tests first
# (tests/conftest.py), which puts the 4-process test below far ahead of the fixture's own test; a
# module fixture was torn down between them and its process run twice (about 20 s of CPU).
@pytest.fixture(scope="session")
def bits():
  """tests/pipeline_bits.py in a process of its own (forked from the session's servers) with
  --xla_cpu_max_isa=AVX: per configuration the digests of the pipelined and the unpipelined
  step."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=16 " + _PROCESS_XLA,
             JAX_PLATFORMS="cpu", PYTHONPATH=launch.pythonpath())
  out = run_at_once({"bits": ([str(ROOT / "tests" / "pipeline_bits.py"), *LAYERS, *BITS_CONFIGS],
                              env)},
                    600, launch.fork_servers([env]))["bits"]
  return {r["config"]: r for r in map(json.loads, filter(None, out.splitlines()))}


@pytest.mark.multiprocess
def test_pipelined_step_has_the_unpipelined_steps_bits(bits):
  """One adamw step of the small Llama with data-parallel gradients through the reproducible sum:
  pipelined over 4 stages x 2 data shards (interleaved) and 8 stages x 2 data shards (1F1B),
  and unpipelined with the same micro-batches, give the same loss and parameters, bit for bit.
  (3 stages with GPipe: the test below, across 3 processes. The whole 3 x 3 matrix, and
  jax.checkpoint around the layer: docs/pipeline.md.)"""
  assert sorted(bits) == sorted(BITS_CONFIGS)
  assert len({r["reference"] for r in bits.values()}) == 1       # one reference for both
  for r in bits.values():
    assert r["pipelined"] == r["reference"], r


# The processes' configuration: 3 stages (GPipe) across 3 processes, the fewest that make a ring
# in which each process sends to one and receives from another (a fourth process was a fourth
# compile of the same step, about 7 s of CPU). (1F1B across 2 of them, a second pipelined step
# of about 7 s of compile in each, is the same fact -- the stage axis's collective-permute
# between processes -- for another schedule; 1F1B's bits are checked in the fixture's process,
# 8 x 2.)
PROCESS_CONFIGS = {"3:gpipe": 3}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_stages_in_separate_processes_give_the_same_bits(bits, tmp_path):
  """The same step with its stage axis across 3 processes (GPipe; jax.distributed on 127.0.0.1,
  2 CPU devices each: 2 data shards per stage, XLA's collective-permute over gloo, a ring of
  more than two processes, so each sends to one and receives from another) has the bits of the
  unpipelined step with 2 data shards in one process (the fixture's reference); every process
  says which path its stages took and why."""
  nprocs = max(PROCESS_CONFIGS.values())
  codes, results, logs = launch.launch(
      "tests.mp_workers.pipeline_worker", nprocs, str(tmp_path), devices_per_proc=2,
      timeout_s=420, args=[*LAYERS, *PROCESS_CONFIGS],
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2 " + _PROCESS_XLA})
  assert codes == [0] * nprocs, [log[-2000:] for log in logs]
  want = bits["4x2:interleaved"]["reference"]
  for r in results:
    assert sorted(r["runs"]) == sorted(c for c, n in PROCESS_CONFIGS.items() if r["rank"] < n), r
    for config, run in r["runs"].items():
      assert run["digest"] == want, (config, r)
      assert (run["path"], run["processes"]) == ("xla", PROCESS_CONFIGS[config]), (config, r)
      assert "gloo" in run["reason"], (config, r)


def test_transport_choice_says_which_path_and_why():
  mesh = jax.make_mesh((4, 2), ("stage", "data"))
  choice = dtenjax.pipeline_transport(mesh)
  assert choice.path == "xla" and choice.processes == 1 and "one process" in choice.reason
  assert "xla" in choice.table()
  with pytest.raises(dtenjax.MeshError, match="no axis 'stage'"):
    dtenjax.pipeline_transport(jax.make_mesh((8,), ("data",)))
  from dtenjax._src.pipeline import transport
  assert transport.decide(4, "gpu", None).path == "xla"
  assert "NCCL" in transport.decide(4, "gpu", None).reason
  assert transport.decide(2, "cpu", "gloo").path == "xla"
  refused = transport.decide(2, "cpu", "none")
  assert refused.path == "none" and "'gloo'" in refused.reason and "'none'" in refused.reason


def test_fsdp_on_the_data_axis_gathers_per_layer_inside_the_stage():
  """FSDP on the other axis: a layer weight also split over "data" and gathered one layer at a
  time inside the layer body (lax.all_gather, whose transpose reduce-scatters its gradient); the
  gradients summed over the data shards match the accumulation loop's, per shard, summed."""
  layers, d, vocab, seq = 4, 8, 16, 4
  rng = np.random.default_rng(0)
  normal = lambda *s: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)
  params = {"embed": normal(vocab, d), "head": {"unembed": normal(d, vocab)},
            "layers": {"w1": normal(layers, d, d), "w2": normal(layers, d, d)}}
  toks = jnp.asarray(rng.integers(0, vocab, (16, seq + 1)), jnp.int32)

  def plain(h, w):
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None

  def sharded(h, w):
    return plain(h, {**w, "w1": lax.all_gather(w["w1"], "data", axis=1, tiled=True)})

  def loss_fn(head, h, t):
    return optax.softmax_cross_entropy_with_integer_labels(h @ head["unembed"], t).mean()

  mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  pipe = dtenjax.pipeline(sharded, loss_fn, stages=2, microbatches=2)
  specs = {"embed": P(), "head": {"unembed": P()},
           "layers": {"w1": P("stage", None, "data"), "w2": P("stage")}}

  def f(p, t):
    def loss(p):
      return pipe(p["layers"], p["head"], jnp.take(p["embed"], t[:, :-1], axis=0), t[:, 1:])
    return jax.grad(loss)(p)["layers"]           # summed over data: w1 reduce-scattered, w2 psum

  # Both programs run for values compared within a tolerance: LLVM unoptimised (the same HLO
  # computes the same values; tests/compile_only.py)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs, P("data")),
                                out_specs=specs["layers"]),
                  compiler_options=compile_only.LLVM_O0)(params, toks)

  @functools.partial(jax.jit, compiler_options=compile_only.LLVM_O0)
  def shard_grads(p, t):
    x = jnp.take(p["embed"], t[:, :-1], axis=0).reshape(2, -1, seq, d)
    ts = t[:, 1:].reshape(2, -1, seq)
    loss = lambda w: (loss_fn(p["head"], lax.scan(plain, x[0], w)[0], ts[0]) +
                      loss_fn(p["head"], lax.scan(plain, x[1], w)[0], ts[1])) / 2
    return jax.grad(loss)(p["layers"])
  # the shards' slices and the sum on the host (eagerly on devices each was a program of its own)
  toks = np.asarray(toks)
  want = jax.tree.map(lambda *g: sum(g), *[jax.device_get(shard_grads(params, toks[4 * s:4 * s + 4]))
                                           for s in range(4)])
  for k in ("w1", "w2"):
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
