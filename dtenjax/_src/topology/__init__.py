"""Layer 2: the hardware a job runs on (model, detection, probing, the link-matrix report).

Depends on the base modules and on ``net`` (the coordination store, RDMA discovery).
"""
