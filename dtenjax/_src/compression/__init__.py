"""Top-k error-feedback gradient compression (optax-style) and its selection kernels.
"""
