"""Worker of tests/test_procs_forks.py: writes its rank, its string hash of "dtenjax" (the process's
hash seed) and its pid; needs no jax.distributed."""

import os

from tests.mp_workers import common

if __name__ == "__main__":
  common.write({"rank": int(os.environ["DTENJAX_TEST_RANK"]), "hash": hash("dtenjax"),
                "pid": os.getpid()})
