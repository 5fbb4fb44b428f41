"""Layer 1: backends across processes and hosts: the host transport (TCP, RDMA verbs), host
collectives (hostcoll), the coordination key-value store (kvstore), buffer pool, tenancy quotas,
RDMA discovery (rdma), the runtime agent, and the range checks of values handed to native code
(checks).

The host transport is five modules, one concept each, each importing only those named before it:
native (the extension's transport module, the frames' codes, counters, libcrypto), credentials
(job id and secret), providers (the provider table and which one runs here), callsite (a
collective's call stack and tag), transport (communicators: settings, the ring, its bootstrap);
pair (point-to-point links between two processes: a ring of two used as an exact exchange).

Depends only on the base modules (errors, config, ffi, jaxapi).
"""
