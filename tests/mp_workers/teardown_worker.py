"""A process that tears down with host collectives in flight (issue 35 item 3); exits 0 when the
teardown is clean. ``python -m tests.mp_workers.teardown_worker MODE``:

* ``close``: rank 0 of an in-process ring of 2 runs an all_reduce on a thread (rank 1 never
  joins); the main thread closes both communicators and prints what the waiter got.
* ``close-and-exit``: the same, and the process exits at once, while the waiter wakes up.
* ``exit``: the same, but the main thread just returns: interpreter exit (atexit) must interrupt
  the waiter, which gets its error, and the process still exits 0 (it used to die with
  "terminate called without an active exception", signal 6).
"""

import sys
import threading
import time

import numpy as np

from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import transport


def main(mode: str) -> None:
  creds = credentials.JobCredentials(0x7EA, b"teardown worker secret 012345678")
  comms = [transport.create_local_comm(r, 2, creds, timeout_s=30) for r in range(2)]
  ts = [threading.Thread(target=transport.connect, args=(comms[r], comms[1 - r].endpoint))
        for r in range(2)]
  for t in ts:
    t.start()
  for t in ts:
    t.join(30)
  box = {}

  def waiter():
    try:
      comms[0].all_reduce(np.ones(1 << 16, np.float32), site=(7, "teardown"), stream="waiter")
    except BaseException as e:  # noqa: BLE001 - reported on stdout
      box["error"] = e
      print(f"waiter: {type(e).__name__}: {e}", flush=True)
  t = threading.Thread(target=waiter, daemon=True)
  t.start()
  end = time.monotonic() + 30
  while native.counters()["ops_in_flight"] < 1:   # the collective is running (gauge)
    assert time.monotonic() < end, "the collective never started"
    time.sleep(0.001)
  if mode == "close-and-exit":   # close, and exit while the waiter is still waking up
    for c in comms:
      c.close()
    return
  if mode == "close":
    t0 = time.monotonic()
    for c in comms:
      c.close()
    t.join(5)
    print(f"closed in {time.monotonic() - t0:.3f} s; waiter alive: {t.is_alive()}", flush=True)
    assert not t.is_alive()
  # mode "exit": return with the collective in flight


if __name__ == "__main__":
  main(sys.argv[1])
