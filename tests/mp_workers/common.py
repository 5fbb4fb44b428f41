"""Shared set-up of worker processes: jax.distributed on the local coordinator, result writing."""

from __future__ import annotations

import json
import os


def init():
  import jax  # pylint: disable=g-import-not-at-top
  jax.distributed.initialize(
      coordinator_address=os.environ["DTENJAX_TEST_COORDINATOR"],
      num_processes=int(os.environ["DTENJAX_TEST_NPROCS"]),
      process_id=int(os.environ["DTENJAX_TEST_RANK"]),
      initialization_timeout=60)
  return jax.process_index(), jax.process_count()


def write(result: dict) -> None:
  rank = int(os.environ["DTENJAX_TEST_RANK"])
  path = os.path.join(os.environ["DTENJAX_TEST_OUT"], f"rank{rank}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(path + ".tmp", path)


def finish(result: dict, code: int = 0, *, barrier_s: float = 0) -> None:
  """Writes the result and exits at once (a jax.distributed shutdown barrier would wait for peers
  that a fault-injection test killed). With ``barrier_s``, first waits up to that long for the
  other processes, so process 0 (which hosts the coordination service, whose exit terminates the
  others) does not leave while a peer is still finishing."""
  write(result)
  if barrier_s > 0:
    from dtenjax._src import kvstore  # pylint: disable=g-import-not-at-top
    try:
      kvstore.default().barrier("test-finish", timeout_s=barrier_s)
    except Exception:  # pylint: disable=broad-except
      pass
  os._exit(code)
