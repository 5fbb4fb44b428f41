"""dtenjax: deterministic, topology-aware distributed arrays and collectives for JAX.

The public names load on first use (PEP 562, as scipy's and jax's own submodules do):
``import dtenjax`` imports no jax, so ``dtenjax --version`` and every ``--help`` answer at once,
while ``dtenjax.shard``, ``from dtenjax import shard``, ``dir(dtenjax)``, ``help(dtenjax)`` and
the API reference see every name as before. Type checkers read the ``TYPE_CHECKING`` imports below.
"""

from typing import TYPE_CHECKING

__version__ = "0.1.0"

from dtenjax._src.gpu import environment as _environment

_environment.pin_if_asked()   # only with DTENJAX_PIN_NCCL=1: importing changes no environment

if TYPE_CHECKING:   # the same names as _EXPORTS (tests/test_api.py keeps the two equal)
  from dtenjax import checkpoint as checkpoint
  from dtenjax import compression as compression
  from dtenjax import elastic as elastic
  from dtenjax import testing as testing
  from dtenjax._src.collectives.all_gather import all_gather as all_gather
  from dtenjax._src.collectives.all_reduce import all_reduce as all_reduce
  from dtenjax._src.collectives.plan_all_reduce import AlgorithmChoice as AlgorithmChoice
  from dtenjax._src.collectives.plan_all_reduce import plan_all_reduce as plan_all_reduce
  from dtenjax._src.collectives.reduce_scatter import reduce_scatter as reduce_scatter
  from dtenjax._src.errors import CheckpointError as CheckpointError
  from dtenjax._src.errors import CollectiveError as CollectiveError
  from dtenjax._src.errors import CollectiveTimeoutError as CollectiveTimeoutError
  from dtenjax._src.errors import ConfigurationError as ConfigurationError
  from dtenjax._src.errors import DtenjaxError as DtenjaxError
  from dtenjax._src.errors import DtenjaxWarning as DtenjaxWarning
  from dtenjax._src.errors import ExtensionUnavailableError as ExtensionUnavailableError
  from dtenjax._src.errors import MeshError as MeshError
  from dtenjax._src.errors import NativeError as NativeError
  from dtenjax._src.errors import PlacementError as PlacementError
  from dtenjax._src.errors import ProcessLostError as ProcessLostError
  from dtenjax._src.errors import QuotaExceededError as QuotaExceededError
  from dtenjax._src.errors import TopologyError as TopologyError
  from dtenjax._src.errors import TransportError as TransportError
  from dtenjax._src.planning.explain import Explanation as Explanation
  from dtenjax._src.planning.explain import explain as explain
  from dtenjax._src.ffi import build_info as build_info
  from dtenjax._src.gpu.graphs import CudaGraphPolicy as CudaGraphPolicy
  from dtenjax._src.gpu.graphs import graph_report as graph_report
  from dtenjax._src.gpu.environment import pin as pin_nccl
  from dtenjax._src.gpu.graphs import jit as jit
  from dtenjax._src.planning.mesh import current_mesh as current_mesh
  from dtenjax._src.planning.mesh import deprecated_make_mesh as make_mesh
  from dtenjax._src.planning.mesh import mesh_map as mesh_map
  from dtenjax._src.planning.mesh import pmap as pmap
  from dtenjax._src.planning.mesh import topology_mesh as topology_mesh
  from dtenjax._src.planning.mesh import use_mesh as use_mesh
  from dtenjax._src.collectives.passes.fusion import fuse_collectives as fuse_collectives
  from dtenjax._src.collectives.passes.memory import MemoryPlan as MemoryPlan
  from dtenjax._src.collectives.passes.memory import memory_plan as memory_plan
  from dtenjax._src.collectives.passes.substitute import substitute_psum as substitute_psum
  from dtenjax._src.pipeline.host import HostPipeline as HostPipeline
  from dtenjax._src.pipeline.run import Pipeline as Pipeline
  from dtenjax._src.pipeline.run import pipeline as pipeline
  from dtenjax._src.pipeline.run import pipeline_cost as pipeline_cost
  from dtenjax._src.pipeline.schedule import GPipe as GPipe
  from dtenjax._src.pipeline.schedule import Interleaved as Interleaved
  from dtenjax._src.pipeline.schedule import OneFOneB as OneFOneB
  from dtenjax._src.pipeline.schedule import PipelineCost as PipelineCost
  from dtenjax._src.pipeline.schedule import Schedule as Schedule
  from dtenjax._src.pipeline.transport import TransportChoice as PipelineTransport
  from dtenjax._src.pipeline.transport import choose as pipeline_transport
  from dtenjax._src.planning.placement import Placement as Placement
  from dtenjax._src.planning.placement import shard as shard
  from dtenjax._src.planning.placement import tensor as tensor
  from dtenjax._src.planning.planner import ArrayPlan as ArrayPlan
  from dtenjax._src.planning.planner import Workload as Workload
  from dtenjax._src.planning.reproducible import reproducible_step as reproducible_step
  from dtenjax._src.planning.result import PipelinePlan as PipelinePlan
  from dtenjax._src.planning.step import StepPlan as StepPlan
  from dtenjax._src.planning.step import plan as plan
  from dtenjax._src.serving.scheduler import GraphScheduler as GraphScheduler
  from dtenjax._src.serving.scheduler import PreemptionPolicy as PreemptionPolicy
  from dtenjax._src.serving.scheduler import QueueFullError as QueueFullError
  from dtenjax._src.serving.scheduler import SchedulerClosedError as SchedulerClosedError
  from dtenjax._src.serving.scheduler import SchedulerTimeoutError as SchedulerTimeoutError
  from dtenjax._src.serving.scheduler import preemption_decision as preemption_decision
  from dtenjax._src.topology.model import LinkSpec as LinkSpec
  from dtenjax._src.topology.model import Topology as Topology

# Public name -> where it lives: "package.module:attribute", or a public submodule's own name.
_EXPORTS = {
    "checkpoint": "dtenjax.checkpoint",
    "compression": "dtenjax.compression",
    "elastic": "dtenjax.elastic",
    "testing": "dtenjax.testing",
    "AlgorithmChoice": "dtenjax._src.collectives.plan_all_reduce:AlgorithmChoice",
    "all_gather": "dtenjax._src.collectives.all_gather:all_gather",
    "all_reduce": "dtenjax._src.collectives.all_reduce:all_reduce",
    "plan_all_reduce": "dtenjax._src.collectives.plan_all_reduce:plan_all_reduce",
    "reduce_scatter": "dtenjax._src.collectives.reduce_scatter:reduce_scatter",
    "CheckpointError": "dtenjax._src.errors:CheckpointError",
    "CollectiveError": "dtenjax._src.errors:CollectiveError",
    "CollectiveTimeoutError": "dtenjax._src.errors:CollectiveTimeoutError",
    "ConfigurationError": "dtenjax._src.errors:ConfigurationError",
    "DtenjaxError": "dtenjax._src.errors:DtenjaxError",
    "DtenjaxWarning": "dtenjax._src.errors:DtenjaxWarning",
    "ExtensionUnavailableError": "dtenjax._src.errors:ExtensionUnavailableError",
    "MeshError": "dtenjax._src.errors:MeshError",
    "NativeError": "dtenjax._src.errors:NativeError",
    "PlacementError": "dtenjax._src.errors:PlacementError",
    "ProcessLostError": "dtenjax._src.errors:ProcessLostError",
    "QuotaExceededError": "dtenjax._src.errors:QuotaExceededError",
    "TopologyError": "dtenjax._src.errors:TopologyError",
    "TransportError": "dtenjax._src.errors:TransportError",
    "Explanation": "dtenjax._src.planning.explain:Explanation",
    "explain": "dtenjax._src.planning.explain:explain",
    "build_info": "dtenjax._src.ffi:build_info",
    "CudaGraphPolicy": "dtenjax._src.gpu.graphs:CudaGraphPolicy",
    "graph_report": "dtenjax._src.gpu.graphs:graph_report",
    "pin_nccl": "dtenjax._src.gpu.environment:pin",
    "jit": "dtenjax._src.gpu.graphs:jit",
    "current_mesh": "dtenjax._src.planning.mesh:current_mesh",
    "make_mesh": "dtenjax._src.planning.mesh:deprecated_make_mesh",
    "mesh_map": "dtenjax._src.planning.mesh:mesh_map",
    "pmap": "dtenjax._src.planning.mesh:pmap",
    "topology_mesh": "dtenjax._src.planning.mesh:topology_mesh",
    "use_mesh": "dtenjax._src.planning.mesh:use_mesh",
    "fuse_collectives": "dtenjax._src.collectives.passes.fusion:fuse_collectives",
    "MemoryPlan": "dtenjax._src.collectives.passes.memory:MemoryPlan",
    "memory_plan": "dtenjax._src.collectives.passes.memory:memory_plan",
    "substitute_psum": "dtenjax._src.collectives.passes.substitute:substitute_psum",
    "HostPipeline": "dtenjax._src.pipeline.host:HostPipeline",
    "Pipeline": "dtenjax._src.pipeline.run:Pipeline",
    "pipeline": "dtenjax._src.pipeline.run:pipeline",
    "pipeline_cost": "dtenjax._src.pipeline.run:pipeline_cost",
    "GPipe": "dtenjax._src.pipeline.schedule:GPipe",
    "Interleaved": "dtenjax._src.pipeline.schedule:Interleaved",
    "OneFOneB": "dtenjax._src.pipeline.schedule:OneFOneB",
    "PipelineCost": "dtenjax._src.pipeline.schedule:PipelineCost",
    "Schedule": "dtenjax._src.pipeline.schedule:Schedule",
    "PipelineTransport": "dtenjax._src.pipeline.transport:TransportChoice",
    "pipeline_transport": "dtenjax._src.pipeline.transport:choose",
    "Placement": "dtenjax._src.planning.placement:Placement",
    "shard": "dtenjax._src.planning.placement:shard",
    "tensor": "dtenjax._src.planning.placement:tensor",
    "ArrayPlan": "dtenjax._src.planning.planner:ArrayPlan",
    "Workload": "dtenjax._src.planning.planner:Workload",
    "reproducible_step": "dtenjax._src.planning.reproducible:reproducible_step",
    "PipelinePlan": "dtenjax._src.planning.result:PipelinePlan",
    "StepPlan": "dtenjax._src.planning.step:StepPlan",
    "plan": "dtenjax._src.planning.step:plan",
    "GraphScheduler": "dtenjax._src.serving.scheduler:GraphScheduler",
    "PreemptionPolicy": "dtenjax._src.serving.scheduler:PreemptionPolicy",
    "QueueFullError": "dtenjax._src.serving.scheduler:QueueFullError",
    "SchedulerClosedError": "dtenjax._src.serving.scheduler:SchedulerClosedError",
    "SchedulerTimeoutError": "dtenjax._src.serving.scheduler:SchedulerTimeoutError",
    "preemption_decision": "dtenjax._src.serving.scheduler:preemption_decision",
    "LinkSpec": "dtenjax._src.topology.model:LinkSpec",
    "Topology": "dtenjax._src.topology.model:Topology",
}

__all__ = [
    "AlgorithmChoice",
    "ArrayPlan",
    "CheckpointError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "CudaGraphPolicy",
    "DtenjaxError",
    "DtenjaxWarning",
    "Explanation",
    "ExtensionUnavailableError",
    "GPipe",
    "GraphScheduler",
    "HostPipeline",
    "Interleaved",
    "LinkSpec",
    "MemoryPlan",
    "MeshError",
    "NativeError",
    "OneFOneB",
    "Pipeline",
    "PipelineCost",
    "PipelinePlan",
    "PipelineTransport",
    "Placement",
    "PlacementError",
    "PreemptionPolicy",
    "ProcessLostError",
    "QueueFullError",
    "QuotaExceededError",
    "Schedule",
    "SchedulerClosedError",
    "SchedulerTimeoutError",
    "StepPlan",
    "Topology",
    "TopologyError",
    "TransportError",
    "Workload",
    "all_gather",
    "all_reduce",
    "build_info",
    "checkpoint",
    "compression",
    "current_mesh",
    "elastic",
    "explain",
    "fuse_collectives",
    "graph_report",
    "jit",
    "make_mesh",
    "memory_plan",
    "mesh_map",
    "plan",
    "plan_all_reduce",
    "pin_nccl",
    "pipeline",
    "pipeline_cost",
    "pipeline_transport",
    "pmap",
    "preemption_decision",
    "reduce_scatter",
    "reproducible_step",
    "shard",
    "substitute_psum",
    "tensor",
    "testing",
    "topology_mesh",
    "use_mesh",
]


# Deprecated names: each still works for this release and warns once per use, saying what to use.
_DEPRECATED = {
    "Plan": ("ArrayPlan", "dtenjax.Plan is deprecated: the per-array planner's result is now "
             "dtenjax.ArrayPlan (dtenjax.plan returns the whole-step dtenjax.StepPlan, not a "
             "Plan); use dtenjax.ArrayPlan."),
}


# Runtime only: type checkers see the TYPE_CHECKING imports, and a misspelt name stays an error
# for them (a module __getattr__ would make every attribute look defined).
if not TYPE_CHECKING:
  def __getattr__(name: str):
    target = _EXPORTS.get(name)
    if target is not None:
      import importlib
      module_name, _, attribute = target.partition(":")
      value = importlib.import_module(module_name)
      if attribute:
        value = getattr(value, attribute)
      globals()[name] = value          # loaded once: later lookups do not come here
      return value
    if name in _DEPRECATED:
      import warnings
      new, message = _DEPRECATED[name]
      warnings.warn(message, DeprecationWarning, stacklevel=2)
      return __getattr__(new)
    raise AttributeError(f"module 'dtenjax' has no attribute {name!r}")

  def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
