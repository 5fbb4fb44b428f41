"""Layer 5: checkpoints of pytrees of sharded jax.Arrays (docs/checkpoint.md).

``layout`` names the leaves and writes the files orbax-checkpoint writes (its PyTree layout
without OCDBT: one zarr v2 array per leaf, one raw chunk per saved shard), ``integrity`` the
per-block digests, ``io`` the file I/O (KvikIO when installed, POSIX otherwise), ``storage``
where checkpoints live (the ``Storage`` interface that owns the temporary-directory commit, and
its POSIX ``LocalStorage``), ``metadata`` the defensive parsing of every metadata file (a
checkpoint is untrusted input), ``save`` the atomic, threaded, optionally asynchronous save,
``restore`` the resharding restore and ``orbax_read`` the reading of checkpoints orbax
wrote. Only jax, numpy, the coordination store (net) and placements (planning) are needed;
orbax-checkpoint, tensorstore, xxhash and kvikio are optional and imported where used.
"""
