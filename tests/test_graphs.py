"""Tests of dtenjax.jit's CUDA-graph policies (dtenjax/_src/gpu/graph*.py).

What XLA put in a command buffer can only be observed on a GPU: on jax 0.10.2/0.11 XLA forms
command buffers after HLO (from thunks), so the compiled HLO shows none, and a CPU has none. The
CPU tests check what can be checked without a GPU: that ``auto`` hands XLA nothing (the jax.jit
executable, not a recompile) unless its documented rule fires; the prediction's launch counts
on hand-written modules against counts worked out by hand from XLA's CommandBufferConversionPass
rules (runs, min_graph_size, a while counting as one thunk, host-driven loop bodies); the
measured choice's selection rule and cache; the profiler reading on a real CPU trace. The
gpu-marked tests OBSERVE what the GPU launched and compare it with the prediction.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src.gpu import graph_measure
from dtenjax._src.gpu import graph_policy as gp
from dtenjax._src.gpu import graph_prediction as pred
from dtenjax._src.gpu import graphs
from dtenjax.testing import native as native_testing
from tests.compile_only import USERS_PROGRAM


class _Compiles:
  """Counts XLA backend compiles through jax.monitoring (the public event listener)."""

  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event, duration, **_):
    del duration
    self.n += "backend_compile" in event


COMPILES = _Compiles()


def test_modes_and_options():
  assert graphs.CudaGraphPolicy.from_mode("off").compiler_options() == {
      "xla_gpu_enable_command_buffer": ""}
  for mode in ("xla", "auto", "measure"):        # nothing passed: the jax.jit executable
    p = graphs.CudaGraphPolicy.from_mode(mode)
    assert p.compiler_options() == {} and p.is_xla_default
  full = graphs.CudaGraphPolicy.from_mode("all")
  assert set(full.commands) == set(graphs.ALL_COMMANDS) and full.min_graph_size == 1
  plus = gp.CudaGraphPolicy.xla_default_plus("auto", ("WHILE",), 3)
  opts = plus.compiler_options()
  assert set(opts["xla_gpu_enable_command_buffer"].split(",")) == set(
      graphs.XLA_DEFAULT_COMMANDS) | {"WHILE"}
  assert opts["xla_gpu_graph_min_graph_size"] == 3
  assert plus.describe() == "XLA's defaults +WHILE, min_graph_size=3"


def test_bad_policies_are_rejected_with_all_problems():
  with pytest.raises(errors.ConfigurationError, match="sometimes"):
    graphs.CudaGraphPolicy.from_mode("sometimes")
  with pytest.raises(errors.ConfigurationError) as e:
    graphs.CudaGraphPolicy(commands=("FUSION", "MEMCPY"), min_graph_size=0)
  assert "MEMCPY" in str(e.value) and "min_graph_size=0" in str(e.value)
  with pytest.raises(errors.ConfigurationError, match="xla_gpu_enable_command_buffer"):
    graphs.jit(lambda x: x, compiler_options={"xla_gpu_enable_command_buffer": ""})
  with pytest.raises(errors.ConfigurationError, match="only read with cuda_graphs='measure'"):
    graphs.jit(lambda x: x, "auto", measure={"steps": 2})


@pytest.mark.parametrize("policy", [graphs.CudaGraphPolicy.from_mode(m) for m in ("off", "all")]
                         + [gp.CudaGraphPolicy.xla_default_plus("auto", ("WHILE",), 2)])
def test_policy_options_compile_with_this_jaxlib(policy):
  # The keys and values must be accepted by this jaxlib; on CPU XLA ignores them.
  f = jax.jit(lambda x: jnp.sin(x) * 2, compiler_options=policy.compiler_options())
  np.testing.assert_allclose(f(jnp.arange(4.0)), np.sin(np.arange(4.0)) * 2, rtol=1e-6)
  assert gp.OPT_PROFILING in gp.accepted_option_keys()


def test_jit_on_cpu_is_plain_jit_and_keeps_jit_kwargs():
  def f(x, n):
    return x * n
  g = graphs.jit(f, "all", static_argnums=1, backend="cpu")
  assert g.platform == "cpu" and g.compiler_options == {}
  assert g.policy.mode == "all" and "do not apply on cpu" in g.decision.reason
  np.testing.assert_array_equal(g(jnp.arange(3), 4), np.arange(3) * 4)
  assert "dtenjax.jit" in repr(g)


# ---- auto: exactly jax.jit unless a loop can run on the device ------------------------------

def _resnet_step():
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
  import resnet50_train as rn
  stages = (1, 1)
  # abstract: the step is lowered and compiled, never run (an eager init was a compile per draw)
  params = jax.eval_shape(lambda: rn.init_resnet(0, stages, 4, 10))
  images = jax.ShapeDtypeStruct((2, 32, 32, 3), rn.DT)
  labels = jax.ShapeDtypeStruct((2,), jnp.int32)
  return rn.make_train_step(rn.block_strides(stages)), (params, params, images, labels)


def test_auto_without_a_device_loop_is_the_jax_jit_executable():
  """A ResNet step (convolutions cut it into short runs, the case where the previous auto lost):
  auto passes XLA nothing, so it reuses the very executable jax.jit compiled. Compiled with
  XLA:CPU's default emitters (the suite's legacy ones expand the backward pass's scatters into
  loops, which auto would then record): the step users get has no loop. Never run, only read:
  LLVM unoptimised (tests/compile_only.py), the user's options that auto must pass on as they are."""
  step, args = _resnet_step()
  baseline = jax.jit(step, compiler_options=USERS_PROGRAM).lower(*args).compile()
  before = COMPILES.n
  g = graphs.jit(step, "auto", backend="gpu",       # GPU rules, compiled on this CPU
                 compiler_options=USERS_PROGRAM)
  compiled = g.lower(*args).compile()
  assert COMPILES.n == before, "auto compiled a new executable"
  assert g.decision.policy.is_xla_default and g.compiler_options == USERS_PROGRAM
  assert "no loop" in g.decision.reason
  assert compiled.as_text() == baseline.as_text()
  # The short runs the previous auto (min_graph_size 2) captured are there: auto leaves them.
  v1 = gp.CudaGraphPolicy.xla_default_plus("v1", ("WHILE",), 2)
  module = hlo.read_compiled(baseline)
  assert pred.report_from_module(module, v1, "gpu").num_graphs > \
      pred.report_from_module(module, g.decision.policy, "gpu").num_graphs


def _loop(x, y):
  def body(i, c):
    return 0.5 * (jnp.cos(c) + 1e-3 * i.astype(c.dtype)) + y
  return jax.lax.fori_loop(0, 100, body, jnp.sin(x)) * 2.0


def test_auto_records_a_loop_whose_body_is_recordable_and_changes_nothing_else():
  x = jnp.ones((64,), jnp.float32)
  g = graphs.jit(_loop, "auto", backend="gpu")
  np.testing.assert_allclose(g(x, x), jax.jit(_loop)(x, x), rtol=0)
  policy = g.decision.policy
  assert "WHILE" in policy.commands and policy.explicit
  assert "100 iterations" in g.decision.reason
  assert "WHILE" in g.compiler_options["xla_gpu_enable_command_buffer"]
  compiled = jax.jit(_loop).lower(x, x).compile()
  module = hlo.read_compiled(compiled)
  trips = hlo.trip_counts_from_text(compiled.as_text())
  assert list(trips.values()) == [100]
  default = pred.plan(module, gp.CudaGraphPolicy.from_mode("xla"), trips)
  chosen = pred.plan(module, policy, trips)
  loop_name = next(iter(trips))
  # the loop is inside a graph now; every run without it is launched exactly as before
  assert any(loop_name in (o.name for o in ops) and cap for _, ops, cap in chosen.runs)
  before = {tuple(o.name for o in ops): cap for _, ops, cap in default.runs}
  for _, ops, cap in chosen.runs:
    names = tuple(o.name for o in ops)
    if loop_name not in names and names in before:
      assert cap == before[names], names
  r_default = pred.report_from_module(module, gp.CudaGraphPolicy.from_mode("xla"), "gpu", trips)
  r_auto = pred.report_from_module(module, policy, "gpu", trips)
  assert r_auto.launches() < r_default.launches()


def test_auto_keeps_the_processs_own_xla_flags(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION "
                     "--xla_force_host_platform_device_count=8")
  x = jnp.ones((8,), jnp.float32)
  g = graphs.jit(_loop, "auto", backend="gpu")
  g(x, x)
  assert g.decision.policy.is_xla_default and "XLA_FLAGS" in g.decision.reason


# ---- the prediction, on modules whose launches are worked out by hand -------------------------

def _module(entry, trip=10, body_len=4):
  """GPU-like HLO: entry ops 'f' (fusion), 'c' (cuDNN convolution), 'w' (a while whose body has
  ``body_len`` fusions, trip count ``trip`` or unknown), then a final copy."""
  lines = ["HloModule m, is_scheduled=true", "",
           "%fc (p: f32[8]) -> f32[8] {", "  %p = f32[8]{0} parameter(0)",
           "  ROOT %s = f32[8]{0} sine(%p)", "}", "",
           "%body (bt: (s32[], f32[8])) -> (s32[], f32[8]) {",
           "  %bt = (s32[], f32[8]{0}) parameter(0)",
           "  %bi = s32[] get-tuple-element(%bt), index=0",
           "  %bx = f32[8]{0} get-tuple-element(%bt), index=1"]
  prev = "%bx"
  for i in range(body_len - 1):
    lines.append(f"  %bf{i} = f32[8]{{0}} fusion({prev}), kind=kLoop, calls=%fc")
    prev = f"%bf{i}"
  lines += ["  %bn = s32[] fusion(%bi), kind=kLoop, calls=%fc",
            f"  ROOT %br = (s32[], f32[8]{{0}}) tuple(%bn, {prev})", "}", "",
            "%cond (ct: (s32[], f32[8])) -> pred[] {", "  %ct = (s32[], f32[8]{0}) parameter(0)",
            "  %ci = s32[] get-tuple-element(%ct), index=0",
            "  ROOT %cl = pred[] fusion(%ci), kind=kLoop, calls=%fc", "}", "",
            "ENTRY %main (x: f32[8]) -> f32[8] {", "  %x = f32[8]{0} parameter(0)"]
  prev = "%x"
  for i, k in enumerate(entry):
    if k == "f":
      lines.append(f"  %f{i} = f32[8]{{0}} fusion({prev}), kind=kLoop, calls=%fc")
      prev = f"%f{i}"
    elif k == "c":
      lines += [f"  %c{i} = (f32[8]{{0}}, u8[0]{{0}}) custom-call({prev}), "
                f"custom_call_target=\"__cudnn$convForward\"",
                f"  %g{i} = f32[8]{{0}} get-tuple-element(%c{i}), index=0"]
      prev = f"%g{i}"
    else:
      bc = f', backend_config={{"known_trip_count":{{"n":"{trip}"}}}}' if trip else ""
      lines += [f"  %z{i} = s32[] constant(0)", f"  %t{i} = (s32[], f32[8]{{0}}) tuple(%z{i}, {prev})",
                f"  %w{i} = (s32[], f32[8]{{0}}) while(%t{i}), condition=%cond, body=%body{bc}",
                f"  %e{i} = f32[8]{{0}} get-tuple-element(%w{i}), index=1"]
      prev = f"%e{i}"
  lines += [f"  ROOT %out = f32[8]{{0}} copy({prev})", "}"]
  return "\n".join(lines)


DEFAULT = gp.CudaGraphPolicy.from_mode("xla")
MIN2 = gp.CudaGraphPolicy.xla_default_plus("t", (), 2)
WHILE2 = gp.CudaGraphPolicy.xla_default_plus("t", ("WHILE",), 2)


@pytest.mark.parametrize("policy,graph_launches,ops_outside", [
    # entry [f0] | while (10 x body of 4) | [copy]: XLA's defaults launch the body's 4 thunks
    # one by one every iteration (a run of 4 < 5), plus f0 and the copy: 0 graphs, 42 ops.
    (DEFAULT, 0, 42),
    # min 2: the body (4 >= 2) becomes a graph the host launches 10 times; f0 and copy alone.
    (MIN2, 10, 2),
    # WHILE: the loop is one thunk of the run [f0, while, copy] (3 >= 2): one graph launch.
    (WHILE2, 1, 0),
    # off: every thunk by itself; with a known trip count the condition is not evaluated.
    (gp.CudaGraphPolicy.from_mode("off"), 0, 42),
])
def test_predicted_launches_per_step_follow_xlas_conversion_rules(policy, graph_launches,
                                                                  ops_outside):
  r = pred.report_from_hlo(_module("fw"), policy, "gpu")
  assert (r.graph_launches_per_step(), r.ops_outside_per_step()) == (graph_launches, ops_outside)
  assert r.is_prediction and "PREDICTED" in r.render()


def test_a_run_of_exactly_min_graph_size_thunks_is_a_graph():
  # the loop body: 5 thunks = XLA's minimum -> a graph the host launches every iteration
  r = pred.report_from_hlo(_module("fw", body_len=5), DEFAULT, "gpu")
  assert (r.graph_launches_per_step(), r.ops_outside_per_step()) == (10, 2)


def test_unknown_trip_counts_make_the_per_step_prediction_unknown():
  r = pred.report_from_hlo(_module("fw", trip=None), DEFAULT, "gpu")
  assert r.launches() is None and "?" in r.render()
  assert pred.report_from_hlo(_module("fw", trip=None), WHILE2, "gpu").launches() == 1


def test_convolutions_split_graphs_and_a_while_counts_as_one_thunk():
  # [f0 f1] conv [f3 while f5] conv [f7 f8 f9 f10 copy]: with WHILE the loop's run has 3 thunks
  r = pred.report_from_hlo(_module("ffcfwfcffff"), gp.CudaGraphPolicy.xla_default_plus(
      "t", ("WHILE",), 3), "gpu")
  assert [len(s.ops) for s in r.segments if s.captured] == [3, 5]
  assert sorted(s.what for s in r.splitters) == ["__cudnn$convForward"] * 2


@pytest.mark.parametrize("entry,expected", [
    # the loop's run needs size 3; the other short run [f0 f1] has 2 < 3: nothing else changes
    ("ffcfwfcffff", 3),
    # ... but [f7 f8 copy] (3 thunks) would become a graph too: auto cannot show a win
    ("ffcfwfcff", None),
    # the loop's run has 5 thunks already: WHILE with XLA's own minimum size
    ("ffwff", 5),
    ("ffcff", None),                     # no loop at all
])
def test_auto_rule(entry, expected):
  text = _module(entry)
  policy, reason = pred.decide_auto(hlo.parse_text(text), hlo.trip_counts_from_text(text))
  if expected is None:
    assert policy.is_xla_default and policy.compiler_options() == {}, reason
  else:
    assert "WHILE" in policy.commands and policy.min_graph_size == expected, reason


@pytest.mark.parametrize("body_len,trip,on_device", [
    (5, 10, False),    # XLA's defaults launch the body as one graph per iteration: left alone
    (4, 10, True),     # a body of 4 runs op by op under the defaults: WHILE records it
    (5, None, True),   # unknown trip count: the host reads the condition back every iteration
])
def test_auto_leaves_a_loop_already_launched_as_one_graph_per_iteration(body_len, trip,
                                                                          on_device):
  # measured on an H200: a decode loop whose body is one graph per iteration under XLA's
  # defaults ran 0.985x as a device loop (docs/benchmarks.md)
  text = _module("ffwff", body_len=body_len, trip=trip)
  policy, reason = pred.decide_auto(hlo.parse_text(text), hlo.trip_counts_from_text(text))
  assert ("WHILE" in policy.commands) == on_device, reason
  if not on_device:
    assert policy.compiler_options() == {} and "one graph per iteration" in reason


def test_graph_report_on_cpu_is_labelled_a_prediction_over_the_real_schedule():
  def step(x):
    y = jnp.tanh(x) * 3.0
    y = jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype),
                          y)
    return jnp.exp(y).sum()
  x = jnp.ones((16,), jnp.float32)
  r = graphs.graph_report(graphs.jit(step, "all"), x)
  assert not r.applies and r.platform == "cpu" and r.is_prediction
  assert "do not apply on cpu" in r.render()
  module = hlo.read_compiled(jax.jit(step).lower(x).compile())
  entry = {i.name: i for i in module.computations[module.entry].instructions}
  placed = [n for s in r.segments for n in s.ops] + [s.op for s in r.splitters]
  assert placed and len(placed) == len(set(placed)) and set(placed) <= set(entry)
  assert any("callback" in entry[s.op].custom_call_target for s in r.splitters)
  with pytest.raises(errors.ConfigurationError, match="int"):
    graphs.graph_report(3)
  with pytest.raises(errors.ConfigurationError, match="needs a dtenjax.jit"):
    graphs.graph_report(jax.jit(step), x, cuda_graphs="measure")


# ---- measure ---------------------------------------------------------------------------------

def test_choose_keeps_xla_defaults_unless_a_candidate_wins_clearly():
  base = [1.00, 1.01, 0.99, 1.00, 1.02]
  assert graph_measure.choose({"xla": base, "while": [0.97] * 5})[0] == "xla"   # < 5 % margin
  assert graph_measure.choose({"xla": base, "while": [0.80] * 5})[0] == "while"
  noisy = [0.80, 0.80, 0.80, 1.10, 1.10]                       # median wins, 3 of 5 repeats
  assert graph_measure.choose({"xla": base, "while": noisy})[0] == "xla"
  with pytest.raises(errors.ConfigurationError, match="no 'xla' timings"):
    graph_measure.choose({"while": [1.0]})


def test_measure_compiles_the_candidates_and_caches_by_fingerprint(tmp_path):
  x = jnp.ones((64,), jnp.float32)
  cache = str(tmp_path / "graphs.json")
  g = graphs.jit(_loop, "measure", backend="gpu",
                 measure={"steps": 2, "repeats": 2, "cache_path": cache})
  np.testing.assert_allclose(g(x, x), jax.jit(_loop)(x, x), rtol=0)
  m = g.decision.measured
  assert not m.cached and m.cost_s > 0
  assert set(m.seconds) == {"xla"} | set(m.candidates) - {"xla"}
  assert "while" in m.candidates or "auto" in m.candidates      # the loop is why it measures
  assert g.decision.policy in [graphs.CudaGraphPolicy.from_mode("measure")] + [
      graph_measure.candidates(*_module_and_trips(_loop, x, x))[k] for k in m.seconds
      if k != "xla"]
  again = graphs.jit(_loop, "measure", backend="gpu", measure={"steps": 2, "repeats": 2})
  again(x, x)
  assert again.decision.measured.cached and again.decision.measured.cost_s == 0
  graph_measure._CACHE.clear()            # a fresh process: the decision comes from the file
  stored = json.loads(open(cache).read())
  assert list(stored) == [m.fingerprint]
  third = graphs.jit(_loop, "measure", backend="gpu", measure={"cache_path": cache})
  third(x, x)
  assert third.decision.measured.cached and third.decision.policy == g.decision.policy


def _module_and_trips(fn, *args):
  c = jax.jit(fn).lower(*args).compile()
  return hlo.read_compiled(c), hlo.trip_counts_from_text(c.as_text())


def test_measure_has_nothing_to_time_when_no_policy_launches_differently():
  f = lambda a: jnp.sin(a) * 2 + 1                          # one fusion: every policy agrees
  module, trips = _module_and_trips(f, jnp.ones(8))
  assert graph_measure.candidates(module, trips) == {}
  g = graphs.jit(f, "measure", backend="gpu")
  g(jnp.ones(8))
  assert g.decision.policy.is_xla_default and "nothing to measure" in g.decision.reason


# ---- observation -----------------------------------------------------------------------------

def test_observe_launches_on_cpu_reads_the_real_trace():
  x = jnp.ones((16,), jnp.float32)
  g = graphs.jit(lambda a: jnp.sin(a) * 2, "auto")
  obs = graphs.observe_launches(g, x, steps=3)
  assert obs.platform == "cpu" and not obs.applies and not obs.graphs_used
  assert obs.executions == 3, obs          # the trace holds exactly the traced runs
  assert obs.profiling_graphs is False     # CPU: no twin with graphs under the profiler
  with pytest.raises(errors.ConfigurationError, match="steps=0"):
    graphs.observe_launches(jnp.sin, x, steps=0)
  with pytest.raises(errors.ConfigurationError, match="before the first call"):
    graphs.jit(jnp.sin, "auto", backend="gpu").profiling_twin()


class _Event:
  def __init__(self, name, stats=()):
    self.name, self.stats = name, list(stats)


class _Line:
  def __init__(self, name, events):
    self.name, self.events = name, events


class _Plane:
  def __init__(self, name, lines):
    self.name, self.lines = name, lines


class _Profile:
  def __init__(self, planes):
    self.planes = planes


def test_read_launches_counts_a_gpu_trace_layout():
  """The counting rules on the layout jax.profiler.ProfileData has on a GPU (planes, lines,
  events with (name, value) stats); the attribute names are checked against a real trace."""
  import pathlib
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    jax.profiler.start_trace(tmp)
    jnp.ones(4).block_until_ready()
    jax.profiler.stop_trace()
    real = jax.profiler.ProfileData.from_file(str(next(pathlib.Path(tmp).rglob("*.xplane.pb"))))
  seen = [(p, l, e) for p in real.planes for l in p.lines for e in l.events]
  assert seen, "a real trace has events"
  for plane, line, ev in seen:
    assert isinstance(plane.name, str) and isinstance(line.name, str) and isinstance(ev.name, str)
    assert all(len(stat) == 2 for stat in ev.stats)          # (name, value) pairs
  host = _Plane("/host:CPU", [_Line("python", [
      _Event("PjRtStreamExecutorLoadedExecutable::ExecuteHelper"),
      _Event("cuGraphLaunch (CudaGraph:3)"), _Event("cuGraphLaunch (CudaGraph:4)"),
      _Event("cuLaunchKernel")])])
  dev = _Plane("/device:GPU:0", [_Line("Stream #13(compute)", [
      _Event("loop_sin_fusion", [("cuda_graph_id", 3)]),
      _Event("loop_cos_fusion", [("cuda_graph_id", 4)]),
      _Event("ScaleAddKernel", [("correlation_id", 9)]),
      _Event("MemcpyDtoD", [("cuda_graph_id", 0)]), _Event("CudaGraphExec:3")])])
  obs = graphs.read_launches(_Profile([host, dev]), "gpu", steps=1)
  assert (obs.graph_launches, obs.graph_executions, obs.kernels_in_graphs, obs.kernels_outside,
          obs.executions) == (2, 1, 2, 1, 1)
  assert obs.kernel_names_outside == {"ScaleAddKernel": 1}
  assert graphs.per_step_summary(obs)["graph_launches_per_step"] == 2


# ---- on a GPU: observe what was launched ------------------------------------------------------

def _probe_chain(layers: int):
  target = native_testing.require("dtenjax_graph_probe_scale_add", "CUDA")

  def step(x, y):
    for i in range(layers):
      x = jnp.sin(x) * (1.0 + 1e-3 * i)            # one fusion ...
      x = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          x, y, scale=np.float32(0.5))              # ... then the dtenjax kernel
    return x
  return step


def _probe_loop(iterations: int):
  target = native_testing.require("dtenjax_graph_probe_scale_add", "CUDA")

  def step(x, y):
    def body(i, c):
      c = jnp.cos(c) + 1e-3 * i.astype(c.dtype)
      return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(c.shape, c.dtype))(
          c, y, scale=np.float32(0.5))
    return jax.lax.fori_loop(0, iterations, body, x)
  return step


def _xy():
  x = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
  return x, jnp.ones_like(x)


def _scale_add_outside(obs) -> float:
  return obs.per_step(sum(n for k, n in obs.kernel_names_outside.items() if "ScaleAdd" in k))


@pytest.mark.gpu
def test_gpu_graphs_off_launches_every_kernel_and_auto_replays_one_graph():
  layers = 8
  step = _probe_chain(layers)
  x, y = _xy()
  off = graphs.observe_launches(graphs.jit(step, "off"), x, y, steps=10)
  auto = graphs.observe_launches(graphs.jit(step, "auto"), x, y, steps=10)
  print("off:", off.to_dict(), "\nauto:", auto.to_dict())
  assert off.applies and not off.graphs_used, off.to_dict()
  assert auto.profiling_graphs, "the observed twin should keep its graphs under the profiler"
  # With graphs off every dtenjax kernel is its own launch: layers per step, named ScaleAdd.
  assert _scale_add_outside(off) == layers, off.kernel_names_outside
  assert off.per_step(off.kernels_outside) >= 2 * layers
  # auto (= XLA's defaults here): a graph is replayed, and the dtenjax call runs inside it.
  assert auto.graphs_used, auto.to_dict()
  assert _scale_add_outside(auto) == 0, auto.kernel_names_outside
  assert auto.per_step(auto.kernels_outside) < off.per_step(off.kernels_outside) / 2


@pytest.mark.gpu
def test_gpu_while_loop_replays_on_device_only_when_the_policy_records_while():
  iterations = 100        # as in bench/cuda_graphs.py's loop case
  step = _probe_loop(iterations)
  x, y = _xy()
  xla = graphs.observe_launches(graphs.jit(step, "xla"), x, y, steps=3)
  g = graphs.jit(step, "auto")
  auto = graphs.observe_launches(g, x, y, steps=3)
  print("xla:", xla.to_dict(), "\nauto:", auto.to_dict(), "\n", g.decision)
  assert "WHILE" in g.decision.policy.commands, g.decision
  # XLA's defaults leave WHILE out: the body's kernels are launched from the host each iteration
  # (the body is too short to be a graph).
  assert _scale_add_outside(xla) == iterations, xla.kernel_names_outside
  # auto records WHILE: the loop runs as graph nodes. Observed on an H200 (jax 0.11.2, previous
  # auto): one of the 100 iterations' kernels per step still launched on its own.
  assert auto.graphs_used and _scale_add_outside(auto) <= 1, auto.to_dict()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["off", "xla", "auto"])
@pytest.mark.parametrize("kind", ["chain", "loop"])
def test_gpu_predicted_graph_launches_match_the_profiler(mode, kind):
  step = _probe_chain(8) if kind == "chain" else _probe_loop(20)
  x, y = _xy()
  f = graphs.jit(step, mode)
  predicted = graphs.graph_report(f, x, y)
  observed = graphs.observe_launches(f, x, y, steps=5)
  print(mode, kind, predicted.to_dict()["graph_launches_per_step"],
        predicted.ops_outside_per_step(), observed.to_dict())
  assert predicted.applies
  launches = observed.per_step(max(observed.graph_launches, observed.graph_executions))
  assert predicted.graph_launches_per_step() == launches, (predicted.render(), observed)


@pytest.mark.gpu
def test_gpu_auto_reuses_the_jax_jit_executable_of_a_step_without_device_loops():
  step, args = _resnet_step()
  jax.jit(step).lower(*args).compile()
  before = COMPILES.n
  g = graphs.jit(step, "auto")
  g.lower(*args).compile()
  assert COMPILES.n == before and g.decision.policy.is_xla_default, g.decision
