"""Layer 5: the public collectives, their algorithms and registry, the fixed-point arithmetic of the
reproducible sum, and the jaxpr passes (``passes/``).

Depends on ``planning``, ``topology``, the backends (``gpu``, ``net``) and the base modules.
"""
