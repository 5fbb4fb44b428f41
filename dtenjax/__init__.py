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
    "build_info",
]
