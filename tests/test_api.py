"""Pins the public surface: adding or removing a public name must be a deliberate change."""

import dtenjax

PUBLIC = {
    # errors
    "DtenjaxError", "ConfigurationError", "TopologyError", "MeshError", "PlacementError",
    "CollectiveError", "ExtensionUnavailableError", "TransportError", "CollectiveTimeoutError",
    "QuotaExceededError", "NativeError", "DtenjaxWarning",
    # topology, mesh, placement, planner
    "Topology", "LinkSpec", "make_mesh", "mesh_map", "pmap", "use_mesh", "current_mesh",
    "pin_nccl", "topology_mesh",
    "Placement", "shard", "tensor", "Plan", "Workload", "plan", "StepPlan",
    # collectives and passes
    "all_reduce", "reduce_scatter", "all_gather", "plan_all_reduce", "AlgorithmChoice",
    "fuse_collectives", "substitute_psum", "memory_plan", "MemoryPlan", "reproducible_step",
    # introspection, graphs, scheduler
    "explain", "Explanation", "jit", "CudaGraphPolicy", "graph_report", "GraphScheduler",
    "PreemptionPolicy", "preemption_decision",
    # submodules and build
    "compression", "testing", "build_info",
    # checkpoints
    "checkpoint", "CheckpointError",
    # pipeline parallelism
    "pipeline", "Pipeline", "Schedule", "GPipe", "OneFOneB", "Interleaved", "pipeline_cost",
    "PipelineCost", "pipeline_transport", "PipelineTransport",
}


def test_public_surface_is_pinned():
  assert set(dtenjax.__all__) == PUBLIC
  for name in PUBLIC:
    assert getattr(dtenjax, name) is not None, name


def test_submodules():
  from dtenjax import testing  # noqa: F401
  assert callable(dtenjax.compression.topk_ef)
  assert callable(testing.assert_bitwise_equal)
  assert dtenjax.testing is testing          # README: `import dtenjax; dtenjax.testing`
