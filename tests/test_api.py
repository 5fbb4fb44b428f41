"""Pins the public surface: adding or removing a public name must be a deliberate change."""

import importlib
import pathlib
import sys

import dtenjax

PUBLIC = {
    # errors
    "DtenjaxError", "ConfigurationError", "TopologyError", "MeshError", "PlacementError",
    "CollectiveError", "ExtensionUnavailableError", "TransportError", "CollectiveTimeoutError",
    "QuotaExceededError", "NativeError", "DtenjaxWarning",
    # topology, mesh, placement, planner
    "Topology", "LinkSpec", "make_mesh", "mesh_map", "pmap", "use_mesh", "current_mesh",
    "pin_nccl", "topology_mesh",
    "Placement", "shard", "tensor", "ArrayPlan", "Workload", "plan", "StepPlan",
    # collectives and passes
    "all_reduce", "reduce_scatter", "all_gather", "plan_all_reduce", "AlgorithmChoice",
    "fuse_collectives", "substitute_psum", "memory_plan", "MemoryPlan", "reproducible_step",
    # introspection, graphs, scheduler
    "explain", "Explanation", "jit", "CudaGraphPolicy", "graph_report", "GraphScheduler",
    "PreemptionPolicy", "preemption_decision", "QueueFullError", "SchedulerClosedError",
    "SchedulerTimeoutError",
    # submodules and build
    "compression", "testing", "build_info",
    # checkpoints
    "checkpoint", "CheckpointError",
    # elastic jobs
    "elastic", "ProcessLostError",
    # pipeline parallelism
    "pipeline", "Pipeline", "Schedule", "GPipe", "OneFOneB", "Interleaved", "pipeline_cost",
    "PipelineCost", "pipeline_transport", "PipelineTransport", "PipelinePlan", "HostPipeline",
}


def test_public_surface_is_pinned():
  assert set(dtenjax.__all__) == PUBLIC
  for name in PUBLIC:
    assert getattr(dtenjax, name) is not None, name


def test_the_lazy_names_are_the_type_checkers_names():
  """``dtenjax/__init__.py`` loads each public name on first use from ``_EXPORTS``; type
  checkers and readers see the ``if TYPE_CHECKING:`` imports. Both must say the same."""
  import ast
  tree = ast.parse((pathlib.Path(dtenjax.__file__)).read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If)
               and getattr(n.test, "id", None) == "TYPE_CHECKING")
  static = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom) and len(node.names) == 1, ast.dump(node)
    alias = node.names[0]
    assert alias.asname, f"{alias.name}: re-export as 'import X as X' (one name per line)"
    static[alias.asname] = (f"{node.module}.{alias.name}" if node.module == "dtenjax"
                            else f"{node.module}:{alias.name}")
  assert static == dtenjax._EXPORTS
  assert set(dtenjax.__all__) == set(static)
  for name, target in static.items():       # each target names what it claims
    module, _, attribute = target.partition(":")
    value = importlib.import_module(module)
    assert getattr(dtenjax, name) is (getattr(value, attribute) if attribute else value), name


def test_submodules():
  from dtenjax import testing
  assert callable(dtenjax.compression.topk_ef)
  assert callable(testing.assert_bitwise_equal)
  assert dtenjax.testing is testing          # README: `import dtenjax; dtenjax.testing`
  assert callable(dtenjax.elastic.launch) and callable(dtenjax.checkpoint.CheckpointManager)


def test_plan_is_a_deprecated_alias_of_array_plan():
  """``dtenjax.plan`` returns a whole-step ``StepPlan``; the per-array result is ``ArrayPlan``.
  The old name still resolves for one release and says what to use."""
  import warnings
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = dtenjax.Plan
  assert old is dtenjax.ArrayPlan
  assert [w.category for w in caught] == [DeprecationWarning], caught
  assert "dtenjax.ArrayPlan" in str(caught[0].message)
  assert "Plan" not in dtenjax.__all__
  placement = dtenjax.Placement(strategy="auto", mesh=dtenjax.topology_mesh((8,), ("data",)))
  assert isinstance(placement.plan((64, 64)), dtenjax.ArrayPlan)
  try:
    dtenjax.NoSuchName
  except AttributeError as e:
    assert "NoSuchName" in str(e)
  else:
    raise AssertionError("an unknown attribute resolved")


def test_the_scheduler_errors_docs_scheduler_md_names_are_importable_from_dtenjax():
  import re
  doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "scheduler.md").read_text()
  named = set(re.findall(r"`(\w+Error)`", doc))
  assert {"QueueFullError", "SchedulerClosedError", "SchedulerTimeoutError"} <= named, named
  for name in named:
    cls = getattr(dtenjax, name)
    assert issubclass(cls, dtenjax.DtenjaxError), name
  assert issubclass(dtenjax.SchedulerTimeoutError, TimeoutError)


# What users copy (examples/) imports only public names, and so do the benches: what a benchmark
# drives besides the public API is named in dtenjax.testing (its submodules demo, costmodel,
# planning, report, transport, xla).


def _private_imports(path: pathlib.Path) -> set[str]:
  import ast
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("dtenjax._src")}
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dtenjax._src"):
      found.add(node.module)
  return found


def test_examples_and_benches_import_only_public_names():
  root = pathlib.Path(__file__).resolve().parents[1]
  offenders = [f"{path.relative_to(root).as_posix()}: {module}"
               for path in sorted((root / "examples").glob("*.py")) + sorted((root / "bench").glob("*.py"))
               for module in sorted(_private_imports(path))]
  assert not offenders, (
      "examples and benches use dtenjax's public names (dtenjax, dtenjax.compression, "
      f"dtenjax.checkpoint, dtenjax.testing); these import dtenjax._src: {offenders}")



# The names benches use besides the public API, each called through its public path.

def test_compression_num_selected_is_k_of_a_density():
  from dtenjax import compression
  assert compression.num_selected(1000, 0.01) == 10      # ceil(0.01 * 1000)
  assert compression.num_selected(1001, 0.01) == 11      # rounds up
  assert compression.num_selected(5, 1e-9) == 1          # at least one
  assert compression.num_selected(5, 1.0) == 5 and compression.num_selected(0, 0.5) == 0


def test_testing_report_prints_as_the_command_line_does():
  import argparse

  import pytest

  from dtenjax.testing import report
  assert report.format_rate(2.5e6, 1.0) == "2.50 MB/s"
  assert report.format_rate(3e9, 2.0) == "1.50 GB/s" and report.format_rate(1, 0) == "- B/s"
  parse = report.whole_number(1)
  assert parse("3") == 3
  for text, message in (("0", "0 is less than 1"), ("x", "'x' is not a whole number")):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
      parse(text)
  lines = report.render_table(["name", "GB/s"], [["ring", "1.25"], ["xla", None]],
                              title="t").splitlines()
  assert lines[0] == "t" and lines[1].split() == ["name", "GB/s"]
  assert lines[2].split() == ["ring", "1.25"] and lines[3].split() == ["xla", "-"]
  assert lines[2].endswith("1.25")                        # numbers right-aligned by default


def test_testing_costmodel_prices_records_on_a_hand_built_topology():
  from dtenjax.testing import costmodel
  assert {"xla", "ring"} <= set(costmodel.ALGORITHM_FAMILIES)
  devices = [costmodel.DeviceInfo(id=i, platform="gpu", kind="NVIDIA H200", memory_bytes=0,
                                  process_index=0, host="h", local_index=i) for i in range(8)]
  topo = costmodel.uniform_topology("u8", devices, intra="nvlink")
  assert topo.num_devices == 8 and topo.link_class(0, 7) == "nvlink"
  ring = costmodel.algorithm("ring").cost
  t = {n: costmodel.collective_time("all_reduce", n, list(range(8)), topo, ring)
       for n in (1 << 20, 1 << 26)}
  assert 0 < t[1 << 20] < t[1 << 26]
  # the model behind dtenjax.plan_all_reduce's times, record by record
  choice = dtenjax.plan_all_reduce(1 << 26, list(range(8)), topo)
  assert choice.times["ring"] == t[1 << 26]
  assert choice.times["xla"] == costmodel.collective_time(
      "all_reduce", 1 << 26, list(range(8)), topo, costmodel.algorithm("xla").cost)


def test_testing_transport_reaches_the_native_transport():
  import pytest

  from dtenjax.testing import transport
  store = transport.key_value_store()           # the in-memory store without jax.distributed
  store.set(store.key("t", 0), "v", overwrite=True)
  assert store.get(store.key("t", 0), timeout_s=1) == "v"
  if not dtenjax.build_info()["built"]:
    with pytest.raises(dtenjax.ExtensionUnavailableError):
      transport.transport()
    return
  assert "collectives" in transport.counters()
  assert hasattr(transport.transport(), "hmac_sha256")
  try:
    assert transport.ensure_crypto()
  except dtenjax.ExtensionUnavailableError as e:
    assert "libcrypto" in str(e)


def test_testing_xla_names_what_benches_compile_against():
  import jax
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from dtenjax.testing import xla
  assert set(xla.GPU_PINS) == {"ops", "autotune"}
  assert xla.GPU_PINS["autotune"][0] == {"xla_gpu_autotune_level": 0}
  assert xla.OPT_PROFILING == "xla_enable_command_buffers_during_profiling"
  assert xla.accepted_option_keys() <= {xla.OPT_PROFILING, "xla_gpu_enable_command_buffer",
                                        "xla_gpu_graph_min_graph_size"}
  built = {tuple(t) for t in dtenjax.build_info()["targets"]}
  assert xla.has_ffi_target(xla.TOPK_TARGET, "cpu") == ((xla.TOPK_TARGET, "cpu") in built)

  mesh = Mesh(np.array(jax.devices()[:8]), ("p",))
  x = jax.ShapeDtypeStruct((8 * 1024,), np.float32)

  def ring_hlo():              # a fresh function each time: jit's trace cache would answer
    return jax.jit(jax.shard_map(lambda x: dtenjax.all_reduce(x, "p", algorithm="ring"),
                                 mesh=mesh, in_specs=P("p"), out_specs=P("p"),
                                 check_vma=False)).lower(x).as_text()
  with xla.jnp_steps():
    before = ring_hlo()
  after = ring_hlo()
  assert "dtenjax_cpu_ring_step" in after and "dtenjax_cpu_ring_step" not in before

  def body(i, x):
    return x + jax.lax.psum(x, "p")
  looped = jax.jit(jax.shard_map(lambda x: jax.lax.fori_loop(0, 5, body, x), mesh=mesh,
                                 in_specs=P("p"), out_specs=P("p")))
  compiled = looped.lower(x).compile()
  repeats = xla.loop_repeats(compiled)
  found = [repeats(c.computation) for c in dtenjax.explain(compiled).collectives]
  assert found and set(found) == {5}, found


def test_testing_demo_is_the_demo_commands_model(monkeypatch):
  import jax
  import numpy as np
  import pytest

  from dtenjax.testing import demo
  assert demo.MICRO_BATCHES == 8 and demo.mesh_shape_for(8)[0] * demo.mesh_shape_for(8)[1] == 8
  # traced, not compiled: XLA:CPU takes 2 s of CPU over the normal sampler's program
  shapes = jax.eval_shape(lambda k: demo.init_params(k, (64, 16, 10)), jax.random.key(0))
  assert {k: v.shape for k, v in shapes.items()} == {"w0": (64, 16), "b0": (16,),
                                                     "w1": (16, 10), "b1": (10,)}
  params = {k: np.full(v.shape, 0.01, v.dtype) for k, v in shapes.items()}
  out = jax.jit(demo.forward)(params, np.zeros((3, 64), np.float32))
  assert out.shape == (3, 10)
  monkeypatch.setitem(sys.modules, "sklearn.datasets", None)   # importing scikit-learn: 1 s
  with pytest.raises(dtenjax.ConfigurationError, match="pip install 'dtenjax\\[demo\\]'"):
    demo.load_digits(0)
  rng = np.random.default_rng(0)
  xb = rng.random((demo.MICRO_BATCHES, 2, 64), np.float32)
  yb = rng.integers(0, 10, (demo.MICRO_BATCHES, 2)).astype(np.int32)
  digests = demo.microbatch_invariance(params, xb, yb, counts=(8,))
  assert list(digests) == [8] and len(digests[8]) == 16
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(8, 1), ("data", "model"))
  opt, step = demo.make_step(1e-3, mesh)
  new, _, loss = jax.eval_shape(step, params, opt.init(params), xb, yb)   # traced, not compiled
  assert loss.shape == () and jax.tree.structure(new) == jax.tree.structure(params)


def test_testing_planning_times_and_clears_what_the_planner_benches_drive():
  from dtenjax.testing import planning
  assert tuple(planning.RECIPES) == ("DP", "FSDP", "TP", "FSDP x TP")
  ticks = iter(range(1000))
  calls = {"a": lambda: None, "b": lambda: None}
  samples = planning.time_calls(calls, rounds=3, timer=lambda: float(next(ticks)))
  assert set(samples) == {"a", "b"} and all(len(v) == 3 for v in samples.values())
  # the wins part's spread of per-round ratios, and the clause it checks plans against
  assert abs(planning.ratio_spread([1.0, 1.2, 1.3, 1.6, 2.0]) - (1.6 - 1.2) / 2) < 1e-12
  assert (planning.CLAUSE_TIME_SLACK, planning.CLAUSE_MEMORY_SLACK) == (0.05, 0.10)
  dtenjax.Placement("auto", mesh=(2, 4)).sharding((64, 32))
  assert planning.distinct_plans() >= 1
  planning.clear_planner_caches()
  assert planning.distinct_plans() == 0
  node = planning.NumaNode("h0", 0, "0-3")
  assert (node.host, node.cpus) == ("h0", "0-3")
