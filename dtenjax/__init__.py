"""dtenjax: deterministic, topology-aware distributed arrays and collectives for JAX."""

__version__ = "0.1.0"

from dtenjax._src.errors import CollectiveError as CollectiveError
from dtenjax._src.errors import CollectiveTimeoutError as CollectiveTimeoutError
from dtenjax._src.errors import ConfigurationError as ConfigurationError
from dtenjax._src.errors import DtenjaxError as DtenjaxError
from dtenjax._src.errors import ExtensionUnavailableError as ExtensionUnavailableError
from dtenjax._src.errors import MeshError as MeshError
from dtenjax._src.errors import PlacementError as PlacementError
from dtenjax._src.errors import QuotaExceededError as QuotaExceededError
from dtenjax._src.errors import TopologyError as TopologyError
from dtenjax._src.errors import TransportError as TransportError
from dtenjax._src.ffi import build_info as build_info
from dtenjax._src.mesh import current_mesh as current_mesh
from dtenjax._src.mesh import make_mesh as make_mesh
from dtenjax._src.mesh import mesh_map as mesh_map
from dtenjax._src.mesh import pmap as pmap
from dtenjax._src.mesh import use_mesh as use_mesh
from dtenjax._src.placement import Placement as Placement
from dtenjax._src.placement import shard as shard
from dtenjax._src.placement import tensor as tensor
from dtenjax._src.planner import Plan as Plan
from dtenjax._src.planner import Workload as Workload
from dtenjax._src.topology import LinkSpec as LinkSpec
from dtenjax._src.topology import Topology as Topology

__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "DtenjaxError",
    "ExtensionUnavailableError",
    "MeshError",
    "PlacementError",
    "QuotaExceededError",
    "TopologyError",
    "TransportError",
    "LinkSpec",
    "Placement",
    "Plan",
    "Topology",
    "Workload",
    "build_info",
    "current_mesh",
    "make_mesh",
    "mesh_map",
    "pmap",
    "shard",
    "tensor",
    "use_mesh",
]
