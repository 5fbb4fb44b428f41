"""Top-k error-feedback gradient compression (Deep Gradient Compression) for JAX::

    tx = optax.chain(dtenjax.compression.topk_ef(0.001, axis_name="data", momentum=0.9),
                     optax.sgd(0.1))
    # inside jax.shard_map: per-device gradients, so that what crosses devices is compressed
    grads = jax.grad(loss)(dtenjax.compression.pvary(params, "data"), batch)

See docs/compression.md.
"""

from dtenjax._src.compression.error_feedback import CompressionPlan as CompressionPlan
from dtenjax._src.compression.error_feedback import LeafPlan as LeafPlan
from dtenjax._src.compression.error_feedback import TopKConfig as TopKConfig
from dtenjax._src.compression.error_feedback import TopKEFState as TopKEFState
from dtenjax._src.compression.error_feedback import compressed_all_reduce as compressed_all_reduce
from dtenjax._src.compression.error_feedback import compression_plan as compression_plan
from dtenjax._src.compression.error_feedback import init_state as init_state
from dtenjax._src.compression.error_feedback import pvary as pvary
from dtenjax._src.compression.error_feedback import state_specs as state_specs
from dtenjax._src.compression.error_feedback import topk_ef as topk_ef
from dtenjax._src.compression.topk import exact_topk as exact_topk
from dtenjax._src.compression.topk import num_selected as num_selected
from dtenjax._src.compression.topk import pack as pack
from dtenjax._src.compression.topk import sample_threshold as sample_threshold
from dtenjax._src.compression.topk import select as select

__all__ = [
    "CompressionPlan",
    "LeafPlan",
    "TopKConfig",
    "TopKEFState",
    "compressed_all_reduce",
    "compression_plan",
    "exact_topk",
    "init_state",
    "num_selected",
    "pack",
    "pvary",
    "sample_threshold",
    "select",
    "state_specs",
    "topk_ef",
]
