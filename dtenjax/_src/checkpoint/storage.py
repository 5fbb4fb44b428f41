"""Where checkpoints live: one interface that owns the temporary-directory commit and every path
a checkpoint names.

A save through a :class:`Storage` is::

    with storage.lock(path, timeout_s):         # one save of `path` at a time (process 0)
      tmp = storage.begin(path)                 # a fresh, unique temporary directory
      storage.makedirs(tmp, "leaf")             # any process, once process 0 made tmp
      storage.write(tmp, "leaf/0.0", data)      # the whole file, durable when it returns
      storage.sync_dirs(tmp, ["leaf", ""])      # directory entries durable ("" is tmp itself)
      storage.commit(tmp, path, overwrite=...)  # the checkpoint appears whole, or not at all
    # on any failure: storage.abort(tmp)

and a restore reads through :meth:`Storage.open_checkpoint` (which finds the checkpoint, also
the one an overwrite interrupted between its two renames) and then ``size``/``read_range``/
``read_bytes`` of paths *relative to the checkpoint*; :meth:`Storage.resolve` refuses any that
leaves it (``..``, absolute paths, symlinks pointing out). ``identity(path)`` changes when a
commit replaces ``path``, so that a restore racing an overwrite reads again rather than mixing
two checkpoints. A second tier (host memory, a peer) implements the same methods.

:class:`LocalStorage` is the POSIX file system: ``.NAME.dtenjax-tmp-<token>`` next to the target,
renamed to ``NAME`` at the commit; an overwrite renames the old checkpoint to
``.NAME.dtenjax-old`` first and deletes it after. A kill between those two renames leaves the old
checkpoint there, and :meth:`open_checkpoint` (so ``restore``) reads it, the next save of ``NAME``
puts it back before it begins. Saves of one path are serialized by an advisory lock
(``flock``) on ``.NAME.dtenjax-lock``, which the kernel releases when a process dies, so a
killed save never blocks the next. Every ``OSError`` becomes one :class:`CheckpointError`
naming the file, and for a full disk the bytes needed and free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import secrets
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

from dtenjax._src import errors
from dtenjax._src.checkpoint import io as ckio

LOCK_POLL_S = 0.02
COMMIT_WAIT_S = 5.0     # how long a restore waits for a commit between its two renames


@runtime_checkable
class Storage(Protocol):
  """The operations save and restore need from where checkpoints live (see the module doc)."""
  name: str

  def lock(self, path: str, timeout_s: float) -> contextlib.AbstractContextManager[None]: ...
  def begin(self, path: str, *, needed_bytes: int = 0) -> str: ...
  def makedirs(self, tmp: str, rel: str) -> None: ...
  def write(self, tmp: str, rel: str, data: memoryview, *, needed_bytes: int = 0) -> int: ...
  def sync_dirs(self, tmp: str, rels: Sequence[str]) -> None: ...
  def commit(self, tmp: str, path: str, *, overwrite: bool) -> None: ...
  def abort(self, tmp: str) -> None: ...
  def committed(self, path: str) -> bool: ...
  def identity(self, path: str) -> object: ...
  def open_checkpoint(self, path: str) -> tuple[str, str | None]: ...
  def check_links(self, root: str) -> None: ...
  def resolve(self, root: str, rel: str) -> str: ...
  def exists(self, root: str, rel: str) -> bool: ...
  def size(self, root: str, rel: str) -> int: ...
  def read_range(self, root: str, rel: str, offset: int, out: memoryview) -> int: ...
  def read_bytes(self, root: str, rel: str, limit: int) -> bytes: ...


def tmp_prefix(path: str) -> str:
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.dtenjax-tmp")


def old_path(path: str) -> str:
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.dtenjax-old")


def lock_path(path: str) -> str:
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.dtenjax-lock")


def leftovers(path: str) -> list[str]:
  """Temporary directories that saves of ``path`` left (killed before their commit)."""
  return sorted(glob.glob(glob.escape(tmp_prefix(path)) + "-*"))


def _existing_ancestor(path: str) -> str:
  while path and not os.path.exists(path):
    parent = os.path.dirname(path)
    if parent == path:
      break
    path = parent
  return path or "."


def free_bytes(path: str) -> int | None:
  try:
    return shutil.disk_usage(_existing_ancestor(path)).free
  except OSError:
    return None


def os_error(e: OSError, path: str, doing: str, *, needed_bytes: int = 0,
             cleaned: str | None = None) -> errors.CheckpointError:
  """One CheckpointError for a file-system error: the file, what failed, and what to do."""
  code = e.errno
  what = os.strerror(code) if code else str(e)
  msg = f"{doing} {path} failed: {what}"
  if code in (errno.ENOSPC, errno.EDQUOT):
    free = free_bytes(path)
    msg += (f"; this save needs {needed_bytes} bytes, the file system has "
            f"{'an unknown number of' if free is None else free} bytes free: free space or "
            "save to another file system")
  elif code == errno.EFBIG:
    msg += (f"; a file-size limit (ulimit -f, RLIMIT_FSIZE) or the file system's maximum file "
            f"size stops it (this save needs {needed_bytes} bytes): raise the limit or save "
            "elsewhere")
  elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
    msg += "; the directory is not writable here: save to a writable directory"
  elif code in (errno.ENOTDIR, errno.EEXIST):
    msg += "; a part of the path is a file, not a directory: choose another path"
  if cleaned:
    msg += f" (the save's temporary directory {cleaned} was removed; nothing was committed)"
  err = errors.CheckpointError(msg)
  err.errno = code  # type: ignore[attr-defined]
  return err


def check_component(name: str, what: str, source: str) -> str:
  """``name`` as one path component of a checkpoint (a leaf directory, a chunk file)."""
  if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
      or "\\" in name or "\0" in name):
    raise errors.CheckpointError(
        f"{source}: {what} {name!r} is not a plain name inside the checkpoint (empty, '.', '..' "
        "or containing a path separator); the checkpoint is malformed or hostile: do not use "
        "it, or rewrite that entry")
  return name


class LocalStorage:
  """Checkpoints on a POSIX file system (local disk, NFS, Lustre ...), chunk data through an
  :mod:`io` backend (POSIX or KvikIO)."""

  def __init__(self, backend: ckio.PosixIO | None = None):
    self.backend = backend or ckio.PosixIO()
    self.name = self.backend.name

  # --- saving ------------------------------------------------------------------------------------

  @contextlib.contextmanager
  def lock(self, path: str, timeout_s: float) -> Iterator[None]:
    """Holds the save lock of ``path``; waits up to ``timeout_s`` for another save of it."""
    parent = os.path.dirname(path)
    try:
      os.makedirs(parent, exist_ok=True)
    except OSError as e:
      raise os_error(e, parent, "creating the checkpoint's parent directory") from None
    lp = lock_path(path)
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        fd = os.open(lp, os.O_RDWR | os.O_CREAT, 0o644)
      except OSError as e:
        raise os_error(e, lp, "creating the save lock") from None
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        os.close(fd)
        if time.monotonic() > deadline:
          raise errors.CheckpointError(
              f"another save of {path} held its lock {lp} for {timeout_s:g} s; two saves of one "
              "path run one after the other: wait for the other (Checkpointer.wait()), save to "
              "another path, or raise timeout_s") from None
        time.sleep(LOCK_POLL_S)
        continue
      try:
        same = os.fstat(fd).st_ino == os.stat(lp).st_ino   # not a lock file a holder unlinked
      except FileNotFoundError:
        same = False
      if same:
        break
      os.close(fd)
    try:
      yield
    finally:
      with contextlib.suppress(OSError):
        os.unlink(lp)
      os.close(fd)

  def begin(self, path: str, *, needed_bytes: int = 0) -> str:
    """(Under the lock.) Puts back an old checkpoint an interrupted overwrite left, removes
    what killed saves left, and creates this save's own temporary directory."""
    old = old_path(path)
    try:
      if os.path.lexists(old):
        if os.path.lexists(path):
          shutil.rmtree(old)            # killed after the commit's second rename
        else:
          os.rename(old, path)          # killed between the two renames: the old one is back
      for left in leftovers(path):
        shutil.rmtree(left, ignore_errors=True)
      tmp = f"{tmp_prefix(path)}-{secrets.token_hex(6)}"
      os.makedirs(tmp)
    except OSError as e:
      raise os_error(e, getattr(e, "filename", None) or path, "preparing the save of",
                     needed_bytes=needed_bytes) from None
    return tmp

  def makedirs(self, tmp: str, rel: str) -> None:
    p = os.path.join(tmp, rel)
    try:
      os.makedirs(p, exist_ok=True)
    except OSError as e:
      raise os_error(e, p, "creating") from None

  def write(self, tmp: str, rel: str, data: memoryview, *, needed_bytes: int = 0) -> int:
    p = os.path.join(tmp, rel)
    try:
      return self.backend.write_file(p, data)
    except OSError as e:
      raise os_error(e, p, f"writing {len(data)} bytes to", needed_bytes=needed_bytes) from None

  def sync_dirs(self, tmp: str, rels: Sequence[str]) -> None:
    for rel in rels:
      p = os.path.join(tmp, rel) if rel else tmp
      try:
        _fsync_dir(p)
      except OSError as e:
        raise os_error(e, p, "syncing the directory") from None

  def commit(self, tmp: str, path: str, *, overwrite: bool) -> None:
    """(Under the lock, after ``sync_dirs`` made ``tmp``'s files and directories durable,
    ``tmp`` itself included.) Renames ``tmp`` to ``path``; an existing ``path`` is renamed away
    first (``overwrite``) and deleted after."""
    old = old_path(path)
    try:
      if os.path.lexists(path):
        if not overwrite:
          raise errors.CheckpointError(
              f"{path} appeared while it was being saved (another program wrote it); nothing "
              "was replaced: save again with overwrite=True or to another path")
        if os.path.lexists(old):
          shutil.rmtree(old)
        os.rename(path, old)
      os.rename(tmp, path)
      _fsync_dir(os.path.dirname(path))
      if os.path.lexists(old):
        shutil.rmtree(old)
    except OSError as e:
      raise os_error(e, getattr(e, "filename", None) or path, "committing") from None

  def abort(self, tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)

  def committed(self, path: str) -> bool:
    """Whether a checkpoint (or anything) is at ``path``."""
    return os.path.lexists(path)

  def identity(self, path: str) -> object:
    """What changes when a commit replaces ``path`` (its directory's device and inode; None
    when absent): a restore that sees it change reads again."""
    try:
      st = os.stat(path)
    except OSError:
      return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)

  # --- reading -----------------------------------------------------------------------------------

  def open_checkpoint(self, path: str) -> tuple[str, str | None]:
    """``(directory to read, warning or None)``: ``path``, or the previous checkpoint that an
    overwrite killed between its two renames left at ``.NAME.dtenjax-old``."""
    if os.path.isdir(path):
      return path, None
    old = old_path(path)
    saving = self.saving(path)
    if saving and os.path.isdir(old):     # a commit between its two renames: wait for it
      deadline = time.monotonic() + COMMIT_WAIT_S
      while not os.path.isdir(path) and time.monotonic() < deadline:
        time.sleep(LOCK_POLL_S / 4)
      if os.path.isdir(path):
        return path, None
    if not os.path.lexists(path) and os.path.isdir(old):
      return old, (f"{path} is missing and {old} holds the checkpoint an overwrite of it "
                   "replaced when it was interrupted between its two renames; restoring that "
                   "one (the next save of this path puts it back first)")
    left = leftovers(path)
    if left and saving:
      raise errors.CheckpointError(
          f"no checkpoint at {path} yet: its first save is in progress ({left[0]}); wait for "
          "it (Checkpointer.wait()) or restore an earlier checkpoint")
    if left:
      raise errors.CheckpointError(
          f"no checkpoint at {path}: its save did not commit (an interrupted save left "
          f"{left[0]}); restore an earlier checkpoint")
    if os.path.exists(path):
      raise errors.CheckpointError(f"{path} is a file, not a checkpoint directory")
    raise errors.CheckpointError(f"no checkpoint at {path} (no such directory)")

  def saving(self, path: str) -> bool:
    """Whether a save of ``path`` holds its lock now (on this host's view of the lock)."""
    try:
      fd = os.open(lock_path(path), os.O_RDONLY)
    except OSError:
      return False
    try:
      fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
      return True
    except OSError:
      return False
    finally:
      os.close(fd)        # also releases the shared lock when it was taken
    return False

  def resolve(self, root: str, rel: str) -> str:
    """The real path of ``rel`` inside the checkpoint ``root``; refused if it leaves ``root``."""
    if os.path.isabs(rel) or "\0" in rel or ".." in rel.split("/"):
      raise errors.CheckpointError(
          f"the checkpoint {root} names {rel!r}, a path outside it; the checkpoint is hostile "
          "or malformed: do not use it")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if real != real_root and not real.startswith(real_root + os.sep):
      raise errors.CheckpointError(
          f"{os.path.join(root, rel)} is a symbolic link to {real}, outside the checkpoint "
          f"{root}; a checkpoint's files must all lie inside it: copy the real files in "
          "(cp -L) if you trust them")
    return real

  def check_links(self, root: str) -> None:
    """Refuses a checkpoint with any symbolic link that leads outside it (one directory scan;
    links are not followed into other directories)."""
    todo = [root]
    while todo:
      d = todo.pop()
      try:
        entries = list(os.scandir(d))
      except OSError as e:
        raise os_error(e, d, "listing") from None
      for entry in entries:
        if entry.is_symlink():
          self.resolve(root, os.path.relpath(entry.path, root))
        elif entry.is_dir(follow_symlinks=False):
          todo.append(entry.path)

  def exists(self, root: str, rel: str) -> bool:
    return os.path.lexists(os.path.join(root, rel))

  def size(self, root: str, rel: str) -> int:
    real = self.resolve(root, rel)
    try:
      return self.backend.size(real)
    except OSError as e:
      raise os_error(e, os.path.join(root, rel), "reading the size of") from None

  def read_range(self, root: str, rel: str, offset: int, out: memoryview) -> int:
    real = self.resolve(root, rel)
    try:
      return self.backend.read_range(real, offset, out)
    except OSError as e:
      raise os_error(e, os.path.join(root, rel), "reading") from None

  def read_bytes(self, root: str, rel: str, limit: int) -> bytes:
    """The whole (small) file; refused above ``limit`` bytes (metadata files are bounded)."""
    real = self.resolve(root, rel)
    try:
      with open(real, "rb") as f:
        data = f.read(limit + 1)
    except OSError as e:
      raise os_error(e, os.path.join(root, rel), "reading") from None
    if len(data) > limit:
      raise errors.CheckpointError(
          f"{os.path.join(root, rel)} is over {limit} bytes, more than any metadata file "
          "dtenjax or orbax writes; the checkpoint is malformed")
    return data


def _fsync_dir(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
