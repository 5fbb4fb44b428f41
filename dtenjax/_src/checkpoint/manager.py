"""A checkpoint manager in orbax's habit: one directory per step, save every N steps, keep the
last K, find the latest complete step, asynchronous saves that overlap the next steps.

    mngr = CheckpointManager("ckpt", save_interval_steps=100, max_to_keep=3)
    for step in range(start, steps):
      state = train_step(state)
      mngr.save(step, state)            # a no-op unless should_save(step); returns once the
    mngr.wait_until_finished()          # shards are in host memory
    state = mngr.restore(mngr.latest_step(), target)

Step ``s`` lives in ``DIRECTORY/<s>`` (``DIRECTORY/<prefix>_<s>`` with ``step_prefix``), written
by :class:`dtenjax.checkpoint.Checkpointer`, which commits a save with one rename of its temporary
directory. A directory named as a step is therefore complete; a save killed before its commit
leaves only ``.<s>.dtenjax-tmp-<random>``, which :meth:`all_steps` ignores and the next save of that step
removes. Old steps are deleted (by process 0, on the shared file system) only after a newer one
has committed, so a crash at any moment leaves the latest complete step readable.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import threading
import time
from typing import Any

import jax

from dtenjax._src import errors
from dtenjax._src.checkpoint import integrity, save as cksave

COMPLETE_MARKER = "_CHECKPOINT_METADATA"   # written by dtenjax and by orbax before the commit


def _step(step: Any) -> int:
  """A step number as an int: Python's, numpy's or a jax integer scalar (the counter a jitted
  training loop keeps); anything else is a ConfigurationError."""
  if not isinstance(step, bool):
    try:
      value = operator.index(step)
    except TypeError:
      value = None
    if value is not None and value >= 0:
      return value
  hint = f" (int({step!r}) if it is a number)" if isinstance(step, str) else ""
  raise errors.ConfigurationError(f"step={step!r} must be an int >= 0{hint}")


class CheckpointManager:
  """Saves every ``save_interval_steps`` steps into ``directory``, keeps the newest
  ``max_to_keep`` (None: all), saves asynchronously unless ``enable_async_checkpointing=False``.

  Every process of a multi-process job must call :meth:`save` with the same steps and trees (the
  saves meet in the coordination store), and ``directory`` must be one shared file system.
  """

  def __init__(self, directory: str | os.PathLike, *, save_interval_steps: int = 1,
               max_to_keep: int | None = None, enable_async_checkpointing: bool = True,
               step_prefix: str | None = None, io: str | None = None,
               threads: int | None = None, timeout_s: float = cksave.DEFAULT_TIMEOUT_S,
               block_bytes: int = integrity.BLOCK_BYTES):
    problems = []
    if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
      problems.append(f"save_interval_steps={save_interval_steps!r} must be an int >= 1")
    if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
      problems.append(f"max_to_keep={max_to_keep!r} must be None (keep all) or an int >= 1")
    if step_prefix is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", step_prefix):
      problems.append(f"step_prefix={step_prefix!r} must be a plain name (letters, digits, "
                      "'.', '_', '-'), e.g. 'step'")
    if problems:
      raise errors.ConfigurationError(errors.join_problems(
          "CheckpointManager cannot be made:", problems))
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_interval_steps = save_interval_steps
    self.max_to_keep = max_to_keep
    self.enable_async = bool(enable_async_checkpointing)
    self.step_prefix = step_prefix
    self._ckpt = cksave.Checkpointer(io=io, threads=threads, timeout_s=timeout_s,
                                     block_bytes=block_bytes)
    self._pattern = re.compile(
        (re.escape(step_prefix) + "_" if step_prefix else "") + r"(\d+)")
    self._cleanup: threading.Thread | None = None
    self._cleanup_error: BaseException | None = None
    self.last_report: cksave.SaveReport | None = None

  # --- where steps live ----------------------------------------------------------------------

  def step_path(self, step: int) -> str:
    """The directory of ``step`` (whether or not it exists)."""
    name = f"{self.step_prefix}_{step}" if self.step_prefix else str(step)
    return os.path.join(self.directory, name)

  def all_steps(self) -> list[int]:
    """The complete (committed) steps in ``directory``, ascending."""
    try:
      names = os.listdir(self.directory)
    except FileNotFoundError:
      return []
    steps = []
    for name in names:
      m = self._pattern.fullmatch(name)
      if m and os.path.exists(os.path.join(self.directory, name, COMPLETE_MARKER)):
        steps.append(int(m.group(1)))
    return sorted(steps)

  def latest_step(self) -> int | None:
    """The newest complete step, None when there is none."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    """Whether :meth:`save` of ``step`` writes: a multiple of ``save_interval_steps`` that is
    newer than the latest complete step."""
    latest = self.latest_step()
    return step % self.save_interval_steps == 0 and (latest is None or step > latest)

  # --- saving ---------------------------------------------------------------------------------

  def save(self, step: int, tree: Any, *, force: bool = False) -> bool:
    """Saves ``tree`` as ``step`` if :meth:`should_save` (or ``force``); True when it did.

    Returns once the shards are in host memory (asynchronous) or committed (synchronous); the
    previous save in flight is joined first. Steps beyond ``max_to_keep`` are deleted after the
    new one has committed.
    """
    step = _step(step)
    if not force and not self.should_save(step):
      return False
    self.wait_until_finished()
    path = self.step_path(step)
    pending = self._ckpt.save(path, tree, overwrite=force and os.path.lexists(path))
    self._cleanup_error = None

    def finish():
      try:
        self.last_report = pending.wait(None)
        self._delete_old()
      except BaseException as e:
        self._cleanup_error = e
    self._cleanup = threading.Thread(target=finish, name="dtenjax-checkpoint-manager",
                                     daemon=True)
    self._cleanup.start()
    if not self.enable_async:
      self.wait_until_finished()
    return True

  def _delete_old(self) -> None:
    if self.max_to_keep is None or jax.process_index() != 0:
      return
    for step in self.all_steps()[:-self.max_to_keep]:
      shutil.rmtree(self.step_path(step), ignore_errors=True)

  def wait_until_finished(self, timeout_s: float | None = None) -> None:
    """Joins the save in flight and its clean-up, both within ``timeout_s`` (default: the
    checkpointer's); raises what failed in the background."""
    t = self._ckpt.timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + t
    try:
      self._ckpt.wait(t)           # raises the save's own failure, or that it ran out of time
    finally:
      cleanup = self._cleanup
      if cleanup is not None:      # what is left of the same wait: never t again after a t
        cleanup.join(max(0.0, deadline - time.monotonic()))
        if not cleanup.is_alive():   # one still running is joined again by the next wait
          self._cleanup = None
      err, self._cleanup_error = self._cleanup_error, None
    if cleanup is not None and cleanup.is_alive():
      raise errors.CheckpointError(
          f"deleting the steps beyond max_to_keep={self.max_to_keep} in {self.directory} "
          f"did not finish within {t:g} s")
    if err is not None:
      raise err

  # --- restoring ------------------------------------------------------------------------------

  def restore(self, step: int | None = None, target: Any = None, **kwargs) -> Any:
    """The tree saved at ``step`` (default: the latest complete step), onto ``target``'s
    shardings or ``shardings=`` (any mesh); the other keywords are
    :func:`dtenjax.checkpoint.restore`'s."""
    self.wait_until_finished()
    if step is not None:
      step = _step(step)
    if step is None:
      step = self.latest_step()
      if step is None:
        raise errors.CheckpointError(
            f"{self.directory} holds no complete checkpoint to restore (all_steps() is empty); "
            "train from scratch or point the manager at the directory the saves went to")
    elif step not in self.all_steps():
      raise errors.CheckpointError(
          f"step {step} has no complete checkpoint in {self.directory}; the complete steps are "
          f"{self.all_steps()}")
    return self._ckpt.restore(self.step_path(step), target, **kwargs)

  def delete(self, step: int) -> None:
    """Deletes the checkpoint of ``step`` (process 0 deletes; every process may call it)."""
    step = _step(step)
    self.wait_until_finished()
    if step not in self.all_steps():
      raise errors.CheckpointError(
          f"step {step} has no checkpoint in {self.directory} to delete; the complete steps "
          f"are {self.all_steps()}")
    if jax.process_index() == 0:
      shutil.rmtree(self.step_path(step))

  def close(self) -> None:
    self.wait_until_finished()

  def __enter__(self) -> "CheckpointManager":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
