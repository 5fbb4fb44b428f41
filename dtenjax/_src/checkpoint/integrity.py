"""Digests of chunk files, one per block, so that a restore reading part of a chunk checks what
it read.

A chunk file is cut into blocks of ``block_bytes`` (the last one shorter); each block gets a
64-bit digest. The algorithm is xxHash's XXH3-64 (the ``xxhash`` package, in the ``checkpoint``
extra) and falls back to BLAKE2b-64 from the standard library when xxhash is absent; the
checkpoint records which one wrote it, and a restore checks with that one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

BLOCK_BYTES = 4 << 20
ALGORITHMS = ("xxh3_64", "blake2b_64")


def _xxh3() -> Callable[[memoryview], str] | None:
  try:
    import xxhash
  except ImportError:
    return None
  return lambda b: xxhash.xxh3_64_hexdigest(b)


def _blake2b(b: memoryview) -> str:
  return hashlib.blake2b(b, digest_size=8).hexdigest()


def default_algorithm() -> str:
  return "xxh3_64" if _xxh3() is not None else "blake2b_64"


def hasher(algorithm: str) -> Callable[[memoryview], str]:
  """The digest function of ``algorithm`` (an error naming the package when it is missing)."""
  from dtenjax._src import errors
  if algorithm == "xxh3_64":
    f = _xxh3()
    if f is None:
      raise errors.ConfigurationError(
          "this checkpoint's digests are XXH3-64, and the xxhash package is not installed: "
          "pip install 'dtenjax[checkpoint]' (or pass verify=False to skip the check)")
    return f
  if algorithm == "blake2b_64":
    return _blake2b
  raise errors.ConfigurationError(
      f"digest algorithm {algorithm!r} is unknown; known: {', '.join(ALGORITHMS)}")


def block_digests(data: memoryview, block_bytes: int, algorithm: str) -> list[str]:
  h = hasher(algorithm)
  n = len(data)
  return [h(data[o:o + block_bytes]) for o in range(0, n, block_bytes)] or [h(data[:0])]
