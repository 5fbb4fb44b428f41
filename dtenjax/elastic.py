"""Elastic jobs: a job that loses a process continues on the ones left, from the newest state in
host memory, with the same bits (docs/elastic.md).

    import dtenjax.elastic
    result = dtenjax.elastic.launch(["train.py"], nprocs=4, min_nprocs=2)   # or: dtenjax launch

    # train.py
    ctx = dtenjax.elastic.init()              # jax.distributed, heartbeats, the in-memory tier
    state, step = ctx.restore(initial_state)  # from peers' memory, a checkpoint, or as given
    ...
    ctx.step_done(step, state)                # snapshots every few steps
    ctx.finish()
"""

from dtenjax._src.elastic.heartbeat import Watchdog as Watchdog
from dtenjax._src.elastic.launcher import Generation as Generation
from dtenjax._src.elastic.launcher import LaunchResult as LaunchResult
from dtenjax._src.elastic.launcher import launch as launch
from dtenjax._src.elastic.memory import MemoryTier as MemoryTier
from dtenjax._src.elastic.memory import complete_steps as complete_steps
from dtenjax._src.elastic.worker import EXIT_PEER_LOST as EXIT_PEER_LOST
from dtenjax._src.elastic.worker import Context as Context
from dtenjax._src.elastic.worker import init as init
from dtenjax._src.net.kvstore import KVStore as KVStore

__all__ = [
    "Context",
    "EXIT_PEER_LOST",
    "Generation",
    "KVStore",
    "LaunchResult",
    "MemoryTier",
    "Watchdog",
    "complete_steps",
    "init",
    "launch",
]
