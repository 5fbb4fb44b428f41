"""Checkpoints of pytrees of sharded jax.Arrays, in orbax-checkpoint's layout::

    import dtenjax.checkpoint as ckpt
    ckpt.save("ckpt/step_10", {"params": params, "opt": opt_state, "step": 10})
    state = ckpt.restore("ckpt/step_10", target)          # onto target's shardings
    with ckpt.Checkpointer() as c:                          # asynchronous saves
      c.save("ckpt/step_20", state)                         # returns once shards are on the host

Every process writes only the shards it owns, in threads, into a temporary directory that one
rename commits; every chunk carries block digests that a restore checks; a restore reads only
the byte ranges each device needs, onto any mesh. orbax.checkpoint restores what dtenjax saves,
and dtenjax restores what orbax saves (through tensorstore). See docs/checkpoint.md.
"""

from dtenjax._src.checkpoint.io import describe as io_info
from dtenjax._src.checkpoint.manager import CheckpointManager as CheckpointManager
from dtenjax._src.checkpoint.restore import RestoreReport as RestoreReport
from dtenjax._src.checkpoint.restore import leaves as leaves
from dtenjax._src.checkpoint.restore import restore as restore
from dtenjax._src.checkpoint.save import Checkpointer as Checkpointer
from dtenjax._src.checkpoint.save import PendingSave as PendingSave
from dtenjax._src.checkpoint.save import SaveReport as SaveReport
from dtenjax._src.checkpoint.save import save as save
from dtenjax._src.checkpoint.storage import LocalStorage as LocalStorage
from dtenjax._src.checkpoint.storage import Storage as Storage

__all__ = [
    "CheckpointManager",
    "Checkpointer",
    "LocalStorage",
    "PendingSave",
    "RestoreReport",
    "SaveReport",
    "Storage",
    "io_info",
    "leaves",
    "restore",
    "save",
]
