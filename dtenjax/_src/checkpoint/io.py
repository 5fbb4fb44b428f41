"""File I/O of chunk files: KvikIO when installed, POSIX otherwise, and which one ran.

Two backends, one interface (``write_file(path, data)``: the whole file, then fsync;
``read_range(path, offset, out)``: ``len(out)`` bytes from ``offset``; ``size(path)``):

* ``posix``: ``os.pwrite``/``os.preadv`` on file descriptors (they release the GIL, so the save's
  and restore's threads overlap);
* ``kvikio``: ``kvikio.CuFile`` (the ``gds`` extra, ``kvikio-cu12``). KvikIO uses cuFile, and with
  the nvidia-fs driver GPUDirect Storage, unless it runs in its compatibility mode
  (``KVIKIO_COMPAT_MODE``, or no libcufile, no /run/udev), where it does POSIX I/O from its own
  threads. :func:`describe` says which: ``kvikio-gds`` or ``kvikio-compat``.

``DTENJAX_CHECKPOINT_IO`` (``auto``, ``posix``, ``kvikio``) or the ``io=`` argument chooses;
``auto`` takes KvikIO when it imports. Buffers are host memory here: the digests of
dtenjax/_src/checkpoint/integrity.py are computed on the host, so a save copies each shard off
the device once in any case (docs/checkpoint.md says what that means for GDS).
"""

from __future__ import annotations

import operator
import os
from typing import Any

from dtenjax._src import config, errors

CHOICES = ("auto", "posix", "kvikio")


def _kvikio() -> tuple[Any | None, str]:
  """KvikIO, or None and why not: not installed, or installed and failing to import (then its
  own error, e.g. a CUDA library it cannot load, which installing it again would not mend)."""
  try:
    import kvikio
  except Exception as e:
    if isinstance(e, ModuleNotFoundError) and e.name == "kvikio":
      return None, "kvikio is not installed (pip install 'dtenjax[gds]', kvikio-cu12)"
    return None, f"kvikio is installed and does not import ({type(e).__name__}: {e})"
  return kvikio, ""


def _kvikio_compat(kvikio: Any) -> bool:
  """Whether KvikIO is in its POSIX compatibility mode (older releases: a bool getter)."""
  defaults = kvikio.defaults
  mode = None
  if hasattr(defaults, "get"):
    try:
      mode = defaults.get("compat_mode")
    except Exception:
      mode = None
  if mode is None and hasattr(defaults, "compat_mode"):
    mode = defaults.compat_mode()
  if isinstance(mode, bool):
    return mode
  name = str(getattr(mode, "name", mode)).upper()
  if name.endswith("AUTO") and hasattr(defaults, "is_compat_mode_preferred"):
    return bool(defaults.is_compat_mode_preferred())
  return not name.endswith("OFF")


class PosixIO:
  name = "posix"

  def write_file(self, path: str, data: memoryview) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      done = 0
      while done < len(data):
        done += os.pwrite(fd, data[done:], done)
      os.fsync(fd)
    finally:
      os.close(fd)
    return done

  def read_range(self, path: str, offset: int, out: memoryview) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
      done = 0
      while done < len(out):
        n = os.preadv(fd, [out[done:]], offset + done)
        if n == 0:
          break
        done += n
    finally:
      os.close(fd)
    return done

  def size(self, path: str) -> int:
    return os.stat(path).st_size


class KvikIO(PosixIO):
  """KvikIO's CuFile for the data; fsync and sizes through the file system."""

  def __init__(self, kvikio: Any):
    self.kvikio = kvikio
    self.name = "kvikio-compat" if _kvikio_compat(kvikio) else "kvikio-gds"

  def write_file(self, path: str, data: memoryview) -> int:
    f = self.kvikio.CuFile(path, "w")
    try:
      n = int(f.pwrite(data, len(data), 0).get()) if len(data) else 0
    finally:
      f.close()
    fd = os.open(path, os.O_RDONLY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)
    return n

  def read_range(self, path: str, offset: int, out: memoryview) -> int:
    if not len(out):
      return 0
    f = self.kvikio.CuFile(path, "r")
    try:
      return int(f.pread(out, len(out), offset).get())
    finally:
      f.close()


def backend(choice: str | None = None) -> PosixIO:
  """The I/O backend for ``choice`` (default: ``DTENJAX_CHECKPOINT_IO``)."""
  choice = (choice or config.get_str("DTENJAX_CHECKPOINT_IO") or "auto").lower()
  if choice not in CHOICES:
    raise errors.ConfigurationError(
        f"checkpoint I/O {choice!r} is unknown; use one of {', '.join(CHOICES)} (argument io= "
        "or DTENJAX_CHECKPOINT_IO)")
  kvikio, why = _kvikio() if choice in ("auto", "kvikio") else (None, "")
  if choice == "kvikio" and kvikio is None:
    raise errors.ConfigurationError(
        f"checkpoint I/O 'kvikio' was asked for, and kvikio does not import here: {why}; or use "
        "io='posix'")
  return KvikIO(kvikio) if kvikio is not None else PosixIO()


def describe() -> dict[str, Any]:
  """Which I/O path a checkpoint would take here, and why (``dtenjax info`` prints it)."""
  choice = (config.get_str("DTENJAX_CHECKPOINT_IO") or "auto").lower()
  kvikio, why_not = _kvikio()
  version = getattr(kvikio, "__version__", None) if kvikio is not None else None
  try:
    path = backend(choice).name
  except errors.ConfigurationError as e:
    return {"path": None, "choice": choice, "kvikio": version, "why": str(e)}
  why = {"posix": why_not or "DTENJAX_CHECKPOINT_IO=posix",
         "kvikio-gds": "KvikIO through cuFile (GPUDirect Storage where nvidia-fs is loaded)",
         "kvikio-compat": "KvikIO in its POSIX compatibility mode (no cuFile/GDS here)"}[path]
  return {"path": path, "choice": choice, "kvikio": version, "why": why}


def rate(nbytes: float, seconds: float) -> str:
  """``nbytes / seconds`` in the unit that shows it: GB/s, MB/s, kB/s or B/s (a 1 MB save is
  "12.3 MB/s", not "0.01 GB/s")."""
  if not seconds:
    return "- B/s"
  r = nbytes / seconds
  for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
    if r >= scale:
      return f"{r / scale:.2f} {unit}"
  return f"{r:.0f} B/s"


def size(nbytes: float) -> str:
  """Bytes in the unit that shows them (GB, MB, kB, B)."""
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if nbytes >= scale:
      return f"{nbytes / scale:.2f} {unit}"
  return f"{nbytes:.0f} B"


def check_threads(threads) -> int | None:
  """``threads=`` of a save or a restore, as an int: None (twice the cores, at most 16) or an
  integer >= 1 (Python's or numpy's, as ``operator.index`` reads it)."""
  if threads is None:
    return None
  if not isinstance(threads, bool):
    try:
      value = operator.index(threads)
    except TypeError:
      value = 0
    if value >= 1:
      return value
  raise errors.ConfigurationError(
      f"threads={threads!r} must be None (twice the cores, at most 16) or an int >= 1: the "
      "threads that write or read the chunks")
