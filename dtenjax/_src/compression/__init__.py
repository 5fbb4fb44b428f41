"""Layer 6: top-k error-feedback gradient compression (optax-style) and its selection kernels.

Depends on ``collectives`` (the dense path is ``dtenjax.all_reduce``) and the layers below.
"""
