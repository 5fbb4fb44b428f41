"""Layer 1: GPU backends: the NVLink peer-to-peer all-reduce kernels' Python side and CUDA-graph
policies.

Depends only on the base modules (errors, config, ffi, hlo, jaxapi).
"""
