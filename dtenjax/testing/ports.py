"""Loopback ports for a local ``jax.distributed`` coordinator (multi-process tests and benches)."""

from __future__ import annotations

import random
import socket


def _ephemeral_ports() -> tuple[int, int]:
  try:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
      lo, hi = (int(v) for v in f.read().split())
    return lo, hi
  except (OSError, ValueError):
    return 32768, 60999        # Linux's default range


def free_port() -> int:
  """A free loopback port for the coordinator, outside the kernel's ephemeral range.

  A port the kernel hands out for ``bind(0)`` is released before the coordinator binds it, and
  any connection made meanwhile (the transport tests in the other pytest-xdist worker connect
  a lot) may take it as its local port. Ports below the ephemeral range are only ever taken by
  an explicit bind.
  """
  lo, _ = _ephemeral_ports()
  rng = random.Random()
  for _ in range(200):
    port = rng.randrange(10000, max(10001, lo))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind(("127.0.0.1", port))
      except OSError:
        continue
      return port
  raise RuntimeError(f"no free loopback port in 10000..{lo - 1} after 200 tries")
