"""Layer 6: the latency-bound micro-batch scheduler over compiled steps.

Depends on ``gpu`` (CUDA-graph policies) and the base modules.
"""
