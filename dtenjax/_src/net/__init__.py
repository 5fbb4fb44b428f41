"""Backends across processes and hosts: transports (TCP, RDMA verbs), host collectives, the
coordination key-value store, buffer pool, tenancy quotas, RDMA discovery and the runtime agent.

Depends only on the base modules (errors, config, ffi).
"""
