"""The test suite's emulated RDMA device (fakeverbs.cc) and its contract checks (contract.cc).

:func:`build` compiles both with the C++ compiler the native extension was built with (``CXX``,
else ``c++``) against the system's ``<infiniband/verbs.h>`` into ``build/fakeverbs/<hash>/``,
once per source version. It is built by the tests themselves (``bash scripts/test.sh``), never
installed; a failed build raises :class:`BuildError`, so every test that needs the device fails
with the compiler's output (it never skips).

The verbs provider loads the library through ``DTENJAX_IBVERBS_LIBRARY`` in place of
``libibverbs.so.1``; :class:`Fake` reads the device's counters and arms its faults through ctypes
(the same file, so the same loaded copy as the provider's).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import shutil
import subprocess
import uuid

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LIBRARY_NAME = "libdtenjax_fakeverbs.so"
# No -g: debug information was a quarter of the build (7.0 -> 5.1 s of CPU, once per fresh
# clone); add it here to debug the device under gdb.
FLAGS = ["-std=c++17", "-O2", "-Wall", "-Wno-unused-parameter", "-Wno-missing-field-initializers"]
FAULTS = ("qp_error", "revoke_mr", "rnr", "cq_overrun", "wc_error", "exit", "late_cqe", "late_ack",
          "lost_ack")


class BuildError(RuntimeError):
  """The emulated device did not compile (the message holds the command and its output)."""


def _compiler() -> str:
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  raise BuildError("no C++ compiler found (set CXX); the emulated RDMA device is built from "
                   f"{HERE / 'fakeverbs.cc'} by the test suite")


def _run(cmd: list[str]) -> None:
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  if proc.returncode != 0:
    raise BuildError("building the emulated RDMA device failed:\n  " + " ".join(cmd) + "\n" +
                     proc.stdout + proc.stderr)


@functools.cache
def build() -> dict[str, str]:
  """{"library": path of the .so, "contract": path of the contract-check program}."""
  cxx = _compiler()
  h = hashlib.sha256(" ".join([cxx] + FLAGS).encode())
  for name in ("fakeverbs.cc", "contract.cc"):
    h.update((HERE / name).read_bytes())
  out = ROOT / "build" / "fakeverbs" / h.hexdigest()[:16]
  lib, exe = out / LIBRARY_NAME, out / "contract"
  if not (lib.exists() and exe.exists()):
    out.mkdir(parents=True, exist_ok=True)
    tmp = f".tmp-{uuid.uuid4().hex}"
    _run([cxx, *FLAGS, "-fPIC", "-shared", str(HERE / "fakeverbs.cc"), "-o", str(lib) + tmp,
          "-lpthread"])
    os.replace(str(lib) + tmp, lib)
    _run([cxx, *FLAGS, str(HERE / "contract.cc"), "-o", str(exe) + tmp, "-L", str(out),
          f"-l:{LIBRARY_NAME}", f"-Wl,-rpath,{out}", "-lpthread"])
    os.replace(str(exe) + tmp, exe)
  return {"library": str(lib), "contract": str(exe)}


def fabric_name(tag: str = "") -> str:
  """A fabric no other test (or test run) shares."""
  return f"{tag or 't'}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def env(fabric: str, **extra: str) -> dict[str, str]:
  """Environment that makes a process use the emulated device on ``fabric`` for its transport."""
  e = {"DTENJAX_IBVERBS_LIBRARY": build()["library"], "FAKEVERBS_FABRIC": fabric,
       "DTENJAX_TRANSPORT": "verbs"}
  e.update(extra)
  return e


class Fake:
  """The emulated device's own interface (counters, fault injection) through ctypes."""

  def __init__(self, path: str | None = None):
    self.path = path or os.environ.get("DTENJAX_IBVERBS_LIBRARY") or build()["library"]
    self.lib = ctypes.CDLL(self.path)
    self.lib.fakeverbs_counter_name.restype = ctypes.c_char_p
    self.lib.fakeverbs_arm.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    n = self.lib.fakeverbs_num_counters()
    self.names = [self.lib.fakeverbs_counter_name(i).decode() for i in range(n)]

  def counters(self) -> dict[str, int]:
    buf = (ctypes.c_int64 * len(self.names))()
    self.lib.fakeverbs_counters(buf, len(self.names))
    return dict(zip(self.names, (int(v) for v in buf)))

  def live(self) -> dict[str, int]:
    """Objects alive now: contexts, pds, mrs, cqs, qps, channels."""
    c = self.counters()
    return {k: c[k] for k in ("contexts", "pds", "mrs", "cqs", "qps", "channels")}

  def arm(self, kind: str, after: int) -> None:
    """Fires ``kind`` (see FAULTS) after ``after`` more RDMA WRITE messages reach this process;
    ``"none"`` disarms."""
    if self.lib.fakeverbs_arm(kind.encode(), int(after)) != 0:
      raise ValueError(f"unknown fault {kind!r}; one of {FAULTS}")

  def last_violation(self) -> str:
    buf = ctypes.create_string_buffer(512)
    self.lib.fakeverbs_last_violation(buf, len(buf))
    return buf.value.decode()


def open_fds() -> int:
  """File descriptors open in this process."""
  return len(os.listdir("/proc/self/fd"))


def open_files() -> set[tuple[str, str]]:
  """This process's open descriptors as (number, what it points at)."""
  files = set()
  for fd in os.listdir("/proc/self/fd"):
    try:
      files.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    except FileNotFoundError:   # the listing's own descriptor, closed already
      pass
  return files


def opened_since(before: set[tuple[str, str]]) -> set[tuple[str, str]]:
  """Descriptors open now that were not open in ``before``: what a leak leaves.

  Unlike a count, this is not fooled by files that something else in the process (another
  test's garbage, a pytest-xdist worker's channel) closes in between.
  """
  return open_files() - before
