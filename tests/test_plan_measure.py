"""dtenjax.plan(..., measure=True): the model's choice and the recipes that fit are compiled and
run on the devices, and the fastest is kept (dtenjax/_src/planning/measure.py)."""

import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import measure

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _step_models as models


def test_the_kept_layout_is_a_candidate_measured_and_its_compiled_memory_is_xlas():
  """The compile path on a real tiny model: every candidate compiled and timed, the plan
  returned is the kept one, and its compiled memory is what XLA's memory_analysis() gives for
  the program plan.jit compiles (computed here independently)."""
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  # Concrete arguments, which each candidate's timing places in its layout with device_put: from
  # abstract ones it compiles a jitted draw per leaf and layout (16 of this test's 21 programs,
  # about half its CPU); that path is test_abstract_arguments_are_made_in_their_layout's.
  rng = np.random.default_rng(0)
  args = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
                      if jnp.issubdtype(s.dtype, jnp.floating) else np.zeros(s.shape, s.dtype),
                      abstract)
  model_only = dtenjax.plan(step, *args)
  got = dtenjax.plan(step, *args, measure=2)
  names = [m.name for m in got.measured]
  assert "model's choice" in names and len(set(names)) == len(names)
  assert all(np.isfinite(m.seconds) and m.seconds > 0 for m in got.measured)
  assert [m.seconds for m in got.measured] == sorted(m.seconds for m in got.measured)
  kept = [m for m in got.measured if m.note.startswith("kept")]
  assert len(kept) == 1
  kept = kept[0]
  island = min(len(i) for i in dtenjax.Topology.current().fast_islands())
  layouts = {measure.layout_name(r, m): (r, m) for r, m in measure.user_layouts(8, island)}
  assert {n for n in names if not n.startswith("model's runner-up")} - {"model's choice"} <= \
      set(layouts)
  if kept.name == "model's choice":
    assert measure.same_layout(got, model_only)
  elif kept.name in layouts:
    expected = dtenjax.plan(step, *args, recipe=layouts[kept.name][0],
                            mesh=layouts[kept.name][1])
    assert measure.same_layout(got, expected)
  assert any("measured on" in n and f"kept {kept.name}" in n for n in got.notes)
  # its compiled memory: arguments + outputs not aliased + temporaries of plan.jit's program
  shapes = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a) for a in args]
  stats = got.jit(step).lower(*shapes).compile().memory_analysis()
  assert kept.memory_bytes == (stats.argument_size_in_bytes + stats.output_size_in_bytes -
                               stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  # the measured plan still runs as a plan
  out = got.jit(step)(*measure.placed_arguments(args, got.shardings()))
  assert np.isfinite(float(out[2]))


def test_abstract_arguments_are_made_in_their_layout():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "fsdp"))
  args = ({"w": jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)},
          jax.ShapeDtypeStruct((8, 4), jnp.int32),
          jax.ShapeDtypeStruct((4,), jax.random.key(0).dtype))
  shardings = ({"w": NamedSharding(mesh, P("fsdp"))}, NamedSharding(mesh, P("data")),
               NamedSharding(mesh, P()))
  w, tokens, keys = measure.placed_arguments(args, shardings)
  assert w["w"].dtype == jnp.bfloat16 and w["w"].sharding == shardings[0]["w"]
  assert float(jnp.std(w["w"].astype(jnp.float32))) > 0      # not zeros: real arithmetic
  assert tokens.dtype == jnp.int32 and tokens.sharding == shardings[1]
  assert keys.shape == (4,) and jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
  # a second call (the timing's second pass, or another candidate with these layouts) reuses
  # the programs that made the leaves: no compile per leaf and call
  hits = measure._maker.cache_info().hits
  again = measure.placed_arguments(args, shardings)
  assert measure._maker.cache_info().hits == hits + 3
  np.testing.assert_array_equal(np.asarray(again[0]["w"], np.float32),
                                np.asarray(w["w"], np.float32))
  concrete = measure.placed_arguments((jnp.arange(8.0),), (NamedSharding(mesh, P("data")),))
  np.testing.assert_array_equal(np.asarray(concrete[0]), np.arange(8.0))


def test_a_measure_of_fewer_than_two_runs_is_refused():
  step, args = models.mlp_step(d=64, f=256, layers=1, batch=16, seq=8)
  with pytest.raises(dtenjax.PlacementError, match="measure=1"):
    dtenjax.plan(step, *args, measure=1)


def _fake_measured_plan(monkeypatch, seconds, memory, **plan_kwargs):
  """plan(measure=3) of a small MLP with each candidate's step (not run) advancing a fake clock
  by ``seconds(plan, name_hint)`` and compiled at ``memory(plan)`` bytes."""
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  args = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract)
  now = [0.0]

  def fake_compile(fn, p, xs):
    del fn, xs
    t = seconds(p)

    def run(*xs):
      now[0] += t
      return xs
    return run, memory(p)
  monkeypatch.setattr(measure, "compile_plan", fake_compile)
  monkeypatch.setattr(measure, "time_plans",
                      functools.partial(measure.time_plans, timer=lambda: now[0]))
  return step, args, dtenjax.plan(step, *args, measure=3, **plan_kwargs)


def _shape(p) -> dict[str, int]:
  return {a: n for a, n in zip(p.axis_names, p.mesh_shape) if n > 1}


def test_the_runner_ups_are_the_cheapest_other_meshes_within_the_margin():
  # (price, plan) of the other meshes against a choice priced 1.0 s: 8 % (RUNNER_UP_MARGIN)
  # admits 1.01, 1.05, 1.07 and 1.079, cheapest first
  priced = [(1.05, "a"), (1.2, "b"), (1.01, "c"), (1.079, "d"), (1.07, "e"), (1.081, "f")]
  assert measure.RUNNER_UP_MARGIN == 0.08
  assert measure.runner_ups(priced, 1.0) == ["c", "a", "e", "d"]
  assert measure.runner_ups([(1.2, "b")], 1.0) == []


def test_the_model_runner_ups_are_compiled_and_timed(monkeypatch):
  """With every mesh within the margin, plan(measure=...) times the model's best plan of the
  next cheapest meshes (at most RUNNER_UPS, each a layout no other candidate has), and keeps one
  when it runs fastest: the best plan of its mesh, as planning on that mesh alone gives it."""
  monkeypatch.setattr(measure, "RUNNER_UP_MARGIN", 1e6)
  step, args, got = _fake_measured_plan(
      monkeypatch, lambda p: 1.0, lambda p: 1.0)
  runner = [m for m in got.measured if m.name.startswith("model's runner-up")]
  assert 1 <= len(runner) <= measure.RUNNER_UPS
  chosen = dtenjax.plan(step, *args)
  # each runner-up is the plan of a mesh other than the choice's, and a layout no other
  # candidate has (the names say which mesh)
  meshes = [m.name[len("model's runner-up ("):-1] for m in runner]
  assert measure.mesh_name(_shape(chosen)) not in meshes and len(set(meshes)) == len(meshes)
  # now make the first runner-up fastest: it is kept, and it is its mesh's plan
  target = meshes[0]
  step, args, got = _fake_measured_plan(
      monkeypatch, lambda p: 0.5 if measure.mesh_name(_shape(p)) == target else 1.0,
      lambda p: 1.0)
  kept = [m for m in got.measured if m.note.startswith("kept")]
  assert [m.name for m in kept] == [f"model's runner-up ({target})"]
  assert measure.mesh_name(_shape(got)) == target
  on_its_mesh = dtenjax.plan(step, *args, mesh=dict(zip(got.axis_names, got.mesh_shape)))
  assert measure.mesh_name(_shape(on_its_mesh)) == target and got.cost.total_s <= \
      on_its_mesh.cost.total_s * (1 + 1e-9)
  # without the margin, no runner-up is timed
  monkeypatch.setattr(measure, "RUNNER_UP_MARGIN", 0.0)
  _, _, got = _fake_measured_plan(monkeypatch, lambda p: 1.0, lambda p: 1.0)
  assert not [m for m in got.measured if m.name.startswith("model's runner-up")]


def test_a_candidate_over_the_budget_by_its_compile_is_never_kept(monkeypatch):
  """The model's choice runs fastest but its compile exceeds the budget: another candidate is
  kept and the report says why the choice was not."""
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  chosen = dtenjax.plan(step, *abstract, memory_budget=2**40)
  budget = 2**40
  _, _, got = _fake_measured_plan(
      monkeypatch, lambda p: 0.1 if measure.same_layout(p, chosen) else 1.0,
      lambda p: 2.0 * budget if measure.same_layout(p, chosen) else 0.5 * budget,
      memory_budget=budget)
  by = {m.name: m for m in got.measured}
  assert got.measured[0].name == "model's choice"              # fastest, and not kept
  assert by["model's choice"].note.startswith("not kept") and "over the budget" in \
      by["model's choice"].note
  assert not measure.same_layout(got, chosen)
  # every candidate over the budget: refused, naming the least
  with pytest.raises(dtenjax.PlacementError, match="every candidate compiles over the budget"):
    _fake_measured_plan(monkeypatch, lambda p: 1.0, lambda p: 2.0 * budget,
                        memory_budget=budget)


def test_choose_keeps_the_choice_or_the_least_memory_within_the_noise_and_the_fastest_beyond():
  mib = 2**20
  a = [1.0] * 5
  # ratios to a: b 0.97..1.10, median 1.02, spread (1.06 - 1.00) / 2 = 0.03: within the noise;
  # c 1.06..1.10, median 1.08, spread 0.01: slower; d median 1.07 with a spread of 0.30, capped
  # at TIME_SLACK (0.05): slower, though it has the least memory
  samples = {"a": a, "b": [0.97, 1.00, 1.02, 1.06, 1.10], "c": [1.06, 1.07, 1.08, 1.09, 1.10],
             "d": [0.5, 0.8, 1.07, 1.4, 1.5]}
  memory = {"a": 100 * mib, "b": 50 * mib, "c": 10 * mib, "d": 1 * mib}
  kept, records = measure.choose(samples, memory, 0.0)
  assert kept == "b"
  by = {r.name: r for r in records}
  assert by["b"].note.startswith("kept") and "less memory" in by["b"].note
  assert by["a"].note == "the fastest; b is within its noise, less memory"
  assert by["c"].note == "slower"
  assert by["d"].note == "slower"
  assert by["b"].vs_fastest == pytest.approx(1.02) and by["b"].spread == pytest.approx(0.03)
  assert by["b"].memory_bytes == 50 * mib and by["b"].seconds == pytest.approx(1.02)
  # the model's choice, when within the noise, is kept over a candidate of less memory: the rounds
  # could not tell them apart, and the model ranked it first
  kept, records = measure.choose(samples, memory, 0.0, prior="a")
  by = {r.name: r for r in records}
  assert kept == "a" and by["a"].note == "kept: the fastest"
  assert by["b"].note == "within the noise of a, not kept"
  kept, records = measure.choose(samples, memory, 0.0, prior="b")
  assert kept == "b" and {r.name: r for r in records}["b"].note == (
      "kept: within the noise of a, the model's choice")
  # a choice beyond the noise is not kept for being the choice: 'c' is slower
  kept, _ = measure.choose(samples, memory, 0.0, prior="c")
  assert kept == "b"
  # beyond the noise time decides, whatever the memory within the budget: 'x' (0.5x DP's time,
  # 1.5x its memory) is kept, not the smaller 'y' nor DP
  samples = {"x": [0.5] * 3, "y": [0.8] * 3, "DP": [1.0] * 3, "FSDP": [2.0] * 3}
  memory = {"x": 300 * mib, "y": 210 * mib, "DP": 200 * mib, "FSDP": 20 * mib}
  kept, records = measure.choose(samples, memory, 0.0)
  by = {r.name: r for r in records}
  assert kept == "x" and by["x"].note == "kept: the fastest" and by["y"].note == "slower"
  # under a budget of 250 MiB 'x' is over it by its compile, and 'y' is the fastest that fits
  kept, records = measure.choose(samples, memory, 250 * mib)
  assert kept == "y" and "over the budget" in {r.name: r for r in records}["x"].note
  # a budget only FSDP fits
  kept, _ = measure.choose(samples, memory, 100 * mib)
  assert kept == "FSDP"
  # nothing fits: refused, naming the least
  with pytest.raises(dtenjax.PlacementError, match="FSDP at 20.0 MiB"):
    measure.choose(samples, memory, 10 * mib)


def test_the_report_gives_every_candidates_time_and_compiled_memory(monkeypatch):
  mib = 2**20
  step, args, got = _fake_measured_plan(
      monkeypatch, lambda p: 0.002 * (1 + sum(p.mesh_shape)), lambda p: 3 * mib * p.mesh_shape[0])
  chosen = dtenjax.plan(step, *args)
  choice = {m.name: m for m in got.measured}["model's choice"]
  assert choice.seconds == pytest.approx(0.002 * (1 + sum(chosen.mesh_shape)))
  assert choice.memory_bytes == 3 * mib * chosen.mesh_shape[0]
  lines = got.table().splitlines()
  at = next(k for k, line in enumerate(lines) if line.startswith("measured "))
  assert lines[at].split()[1:6] == ["ms", "/fastest", "spread", "compiled", "MiB"]
  rows = lines[at + 1:at + 1 + len(got.measured)]          # one row per candidate, in order
  for m, line in zip(got.measured, rows):
    assert line.startswith(m.name + " ")
    assert f"{m.seconds * 1e3:.2f}" in line and f"{m.memory_bytes / mib:.1f}" in line
    assert m.note in line


def test_a_user_layout_the_model_prices_just_over_the_budget_is_compiled_and_may_be_kept(
    monkeypatch):
  """A budget 1/1.1 of FSDP's priced memory: the model says FSDP does not fit, but its price is
  within the memory model's error (MODEL_MEMORY_ERROR, 15 %), so it is compiled; its compile
  (here half the budget) fits while every other candidate's (twice the budget) does not, so
  FSDP is kept instead of a refusal."""
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  fsdp = dtenjax.plan(step, *abstract, recipe="FSDP")
  budget = fsdp.cost.memory["total"] / 1.1
  assert not dtenjax.plan(step, *abstract, recipe="FSDP", memory_budget=budget).cost.fits
  _, _, got = _fake_measured_plan(
      monkeypatch, lambda p: 1.0,
      lambda p: 0.5 * budget if measure.same_layout(p, fsdp) else 2.0 * budget,
      memory_budget=budget)
  assert measure.same_layout(got, fsdp)
  assert {m.name: m.note for m in got.measured}["FSDP"].startswith("kept")


def test_plans_on_different_meshes_that_place_everything_alike_are_one_layout():
  """DP laid out on an fsdp 8 mesh (no weight over fsdp, the batch over it) is DP's layout on
  data 8: measure=True times it once. FSDP on fsdp 8 is not."""
  step, abstract = models.mlp_step(d=64, f=256, layers=2, batch=16, seq=8)
  dp = dtenjax.plan(step, *abstract, recipe="DP")
  dp_on_fsdp = dtenjax.plan(step, *abstract, recipe="DP", mesh={"fsdp": 8})
  fsdp = dtenjax.plan(step, *abstract, recipe="FSDP", mesh={"fsdp": 8})
  assert dp_on_fsdp.mesh_shape != dp.mesh_shape
  assert measure.same_layout(dp_on_fsdp, dp) and measure.same_layout(dp, dp_on_fsdp)
  assert not measure.same_layout(fsdp, dp) and not measure.same_layout(fsdp, dp_on_fsdp)
  # the two run the same program: the same bits from the same arguments
  rng = np.random.default_rng(0)
  args = jax.tree.map(lambda s: (0.02 * rng.standard_normal(s.shape)).astype(s.dtype)
                      if jnp.issubdtype(s.dtype, jnp.floating) else np.zeros(s.shape, s.dtype),
                      abstract)
  outs = [p.jit(step)(*measure.placed_arguments(args, p.shardings())) for p in (dp, dp_on_fsdp)]
  for x, y in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_donating_plan_is_timed_on_a_program_that_keeps_its_arguments():
  """plan(donate=True, measure=...): the timed turns call one program again on the same placed
  arrays, so it must not donate them (plan.jit of such a plan donates the state by default, and
  a compiled program called on a donated buffer crashed the process on XLA:CPU), while the memory
  kept is the donated program's, as jax.jit with the state donated compiles it."""
  def step(p, x):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"]) ** 2))(p)
    return {"w": p["w"] - 0.1 * g["w"]}

  args = ({"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)},
          jax.ShapeDtypeStruct((32, 64), jnp.float32))
  plan = dtenjax.plan(step, *args, mesh={"data": 8}, donate=True)
  samples, memory, _ = measure.time_plans(step, {"plan": plan}, args, rounds=2)
  assert len(samples["plan"]) == 2 and all(s > 0 for s in samples["plan"])
  stats = jax.jit(step, in_shardings=plan.shardings(), out_shardings=plan.out_shardings(),
                  donate_argnums=(0,)).lower(*args).compile().memory_analysis()
  assert stats.alias_size_in_bytes > 0
  assert memory["plan"] == (stats.argument_size_in_bytes + stats.output_size_in_bytes -
                            stats.alias_size_in_bytes + stats.temp_size_in_bytes)
