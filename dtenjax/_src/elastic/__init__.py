"""Layer 6: elastic jobs (docs/elastic.md): ``heartbeat`` detects lost processes through the
coordination store, ``memory`` is the in-memory tier (snapshots in host memory with ring
replicas), ``worker`` is a worker's side of the job (init, restore, step_done, finish) and
``launcher`` starts, watches and restarts the workers as smaller jobs. Only jax, numpy, net's
coordination store and the checkpoint manager are needed.
"""
