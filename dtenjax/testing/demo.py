"""The MLP workload of ``python -m dtenjax demo`` (digits, data-parallel step), for benchmarks.

Benchmarks that train or time the demo's model (bench/compression_convergence.py,
bench/reproducible.py's workloads) import it from here, so they run the same model, data split
and step as the command. The training code itself is the demo's (``dtenjax demo --help``); this
module only names it for benchmarks and tests: it is not part of the library's API. Needs the
``demo`` extra (scikit-learn's digits, optax).
"""

from dtenjax._src.cli.demo import MICRO_BATCHES as MICRO_BATCHES
from dtenjax._src.cli.demo import forward as forward
from dtenjax._src.cli.demo import init_params as init_params
from dtenjax._src.cli.demo import load_digits as load_digits
from dtenjax._src.cli.demo import make_step as make_step
from dtenjax._src.cli.demo import mesh_shape_for as mesh_shape_for
from dtenjax._src.cli.demo import microbatch_invariance as microbatch_invariance

__all__ = ["MICRO_BATCHES", "forward", "init_params", "load_digits", "make_step",
           "mesh_shape_for", "microbatch_invariance"]
