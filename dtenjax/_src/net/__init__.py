"""Layer 1: backends across processes and hosts: transports (TCP, RDMA verbs), host collectives,
the coordination key-value store, buffer pool, tenancy quotas, RDMA discovery, the runtime agent,
and the range checks of values handed to native code (checks).

Depends only on the base modules (errors, config, ffi, jaxapi).
"""
