"""The worker's side of an elastic job: :func:`init` joins the job the launcher started (or runs
alone when there is none) and returns a :class:`Context` that restores the state, snapshots it
every few steps and finishes the job.

    ctx = dtenjax.elastic.init()               # jax.distributed, heartbeats, the in-memory tier
    mesh = jax.make_mesh((jax.device_count(),), ("data",))   # whatever is left this time
    state, step = ctx.restore(initial_state)   # memory tier, else checkpoint, else as given
    while step < steps:
      state = train_step(state, batch(step))   # the batch depends only on the global step
      step += 1
      ctx.step_done(step, state)               # snapshot / checkpoint when due
    ctx.finish()

The launcher passes everything through ``DTENJAX_ELASTIC_*`` environment variables (the
coordinator, the rank and world, the generation, where the tiers are, what to restore).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

from dtenjax._src import errors
from dtenjax._src.elastic import heartbeat, memory

EXIT_PEER_LOST = 75          # a survivor that saw a peer lost (EX_TEMPFAIL)
ENV = "DTENJAX_ELASTIC_"


def _env(name: str, default: str | None = None) -> str | None:
  return os.environ.get(ENV + name, default)


def event(run_dir: str | None, kind: str, **fields) -> None:
  """Appends one JSON line to the run's event log (the launcher's timeline)."""
  if not run_dir:
    return
  line = json.dumps({"t": time.time(), "event": kind, **fields}) + "\n"
  fd = os.open(os.path.join(run_dir, "events.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
               0o644)
  try:
    os.write(fd, line.encode())       # one write of a short line: appended whole
  finally:
    os.close(fd)


@dataclasses.dataclass
class Context:
  """One worker's view of the elastic job (see :func:`init`)."""
  rank: int
  world: int
  generation: int
  run_dir: str | None
  snapshot_every: int
  tier: memory.MemoryTier | None
  manager: Any                      # dtenjax.checkpoint.CheckpointManager or None
  restore_from: dict | None
  watchdog: heartbeat.Watchdog | None
  restored_from: str = "initial"
  _first_step_logged: bool = False

  @property
  def elastic(self) -> bool:
    """Whether a launcher started this process (False: a plain single run)."""
    return self.run_dir is not None

  def mark(self, what: str, **fields) -> None:
    """Records a point of this worker's timeline (e.g. ``ctx.mark("planned")``); the launcher's
    report splits the time from a failure to the first step on these."""
    event(self.run_dir, what, rank=self.rank, generation=self.generation, **fields)

  def restore(self, target: Any) -> tuple[Any, int]:
    """``(state, step)``: the state the launcher says to continue from, laid out like
    ``target`` (the initial state on this generation's mesh), or ``(target, 0)`` on a first
    start. The step is returned beside the state (the state need not hold it)."""
    src = self.restore_from
    t0 = time.perf_counter()
    if not src:
      state, step = target, 0
    elif src["source"] == "memory":
      state = memory.restore(src["root"], src["world"], src["lost"], src["step"], target)
      step = src["step"]
    elif src["source"] == "checkpoint":
      if self.manager is None:
        raise errors.ConfigurationError(
            "the launcher asked to restore a persistent checkpoint but this job has no "
            "checkpoint directory (launch(..., checkpoint_dir=...))")
      state = self.manager.restore(src["step"], target)
      step = src["step"]
    else:
      raise errors.ConfigurationError(f"unknown restore source {src!r}")
    self.restored_from = src["source"] if src else "initial"
    self.mark("restored", source=self.restored_from, step=step,
              seconds=time.perf_counter() - t0)
    return state, step

  def step_done(self, step: int, state: Any) -> None:
    """Call after every step with the number of steps done and the state: publishes progress
    with the heartbeat, snapshots to host memory every ``snapshot_every`` steps and saves a
    persistent checkpoint when its manager says so."""
    if not self._first_step_logged:
      self._first_step_logged = True
      self.mark("first_step", step=step)
    if self.watchdog is not None:
      self.watchdog.step = step
    if self.tier is not None and self.snapshot_every and step % self.snapshot_every == 0:
      self.tier.snapshot(step, state)
    if self.manager is not None:
      self.manager.save(step, state)

  def finish(self, code: int = 0, timeout_s: float = 60.0) -> None:
    """Joins the saves in flight and leaves the job; process 0 (the coordination service's
    host) leaves last. Does not return when a launcher started the process."""
    if self.tier is not None:
      self.tier.wait()
    if self.manager is not None:
      self.manager.wait_until_finished()
    self.mark("finished")
    if not self.elastic:
      return
    from dtenjax._src.net import kvstore
    store = kvstore.default()
    if self.world > 1:
      store.barrier(f"elastic-finish-{self.generation}", timeout_s=timeout_s)
      if self.watchdog is not None:
        self.watchdog.stop()
      store.increment(f"dtenjax/elastic/done-{self.generation}", 1)
      if self.rank == 0:
        deadline = time.monotonic() + timeout_s
        while (time.monotonic() < deadline and
               store.increment(f"dtenjax/elastic/done-{self.generation}", 0) < self.world):
          time.sleep(0.02)
        time.sleep(0.3)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_path(run_dir: str, generation: int, rank: int) -> str:
  """Where a survivor of ``generation`` writes the loss it saw (read by the launcher)."""
  return os.path.join(run_dir, f"lost.g{generation}.r{rank}.json")


def reports(run_dir: str, generation: int) -> dict[int, dict]:
  """The survivors' loss reports of ``generation`` so far, by rank."""
  out = {}
  prefix = f"lost.g{generation}.r"
  for name in sorted(os.listdir(run_dir)):
    if name.startswith(prefix) and name.endswith(".json"):
      with open(os.path.join(run_dir, name)) as f:
        report = json.load(f)
      out[int(report["rank"])] = report
  return out


def _lost(run_dir: str, rank: int, world: int, generation: int, timeout_s: float):
  def on_lost(err: errors.ProcessLostError) -> None:
    report = {"t": time.time(), "rank": rank, "generation": generation, "lost": list(err.lost),
              "message": str(err)}
    path = report_path(run_dir, generation, rank)
    with open(path + ".tmp", "w") as f:
      json.dump(report, f)
    os.replace(path + ".tmp", path)
    print(f"dtenjax.elastic: {err}", file=sys.stderr, flush=True)
    if rank == 0 and 0 not in err.lost:
      # process 0 hosts the coordination service: leaving at once would take the store from
      # the other survivors, which are about to see the same loss, and they would name rank 0
      # (and JAX would abort them). It stays until every other survivor has reported, at most
      # one heartbeat timeout (a survivor sees the same silent peer within about one beat)
      others = set(range(1, world)) - set(err.lost)
      deadline = time.monotonic() + timeout_s
      while time.monotonic() < deadline and not others <= set(reports(run_dir, generation)):
        time.sleep(0.02)
    os._exit(EXIT_PEER_LOST)
  return on_lost


def init(*, heartbeat_interval_s: float | None = None) -> Context:
  """Joins the elastic job this process was started in: ``jax.distributed.initialize`` on the
  launcher's coordinator, heartbeats, the in-memory tier and the checkpoint manager. Without a
  launcher (``DTENJAX_ELASTIC_RUN_DIR`` unset) it is a single process and nothing is started.
  ``heartbeat_interval_s``: seconds between heartbeats (default: the launcher's heartbeat
  timeout / 20, at most 0.1)."""
  run_dir = _env("RUN_DIR")
  if not run_dir:
    return Context(0, 1, 0, None, 0, None, None, None, None)
  import jax
  rank, world = int(_env("RANK")), int(_env("WORLD"))
  generation = int(_env("GENERATION", "0"))
  timeout_s = float(_env("HEARTBEAT_TIMEOUT", "10"))
  event(run_dir, "started", rank=rank, generation=generation)
  if world > 1:
    # jax's own heartbeat gives up well after ours, so that our watchdog names the lost rank
    # before the coordination service aborts the survivors
    jax.distributed.initialize(coordinator_address=_env("COORDINATOR"), num_processes=world,
                               process_id=rank, initialization_timeout=int(timeout_s * 6 + 30),
                               heartbeat_timeout_seconds=int(max(30, timeout_s * 4)))
  event(run_dir, "initialized", rank=rank, generation=generation)
  from dtenjax._src.net import kvstore
  client = kvstore.coordination_client() if world > 1 else None
  store = kvstore.KVStore(client) if client is not None else None
  watchdog = None
  if world > 1:
    watchdog = heartbeat.Watchdog(
        rank, world, _lost(run_dir, rank, world, generation, timeout_s), store=store,
        namespace=f"dtenjax/elastic/hb-{generation}",
        interval_s=heartbeat_interval_s or min(0.1, timeout_s / 20), timeout_s=timeout_s).start()
  every = int(_env("SNAPSHOT_EVERY", "0"))
  tier = None
  if every and _env("MEMORY"):
    tier = memory.MemoryTier(_env("MEMORY"), rank, world, store=store,
                             namespace=f"dtenjax/elastic/mem-{generation}",
                             timeout_s=max(10.0, timeout_s * 2))
  manager = None
  if _env("CHECKPOINT_DIR"):
    from dtenjax._src.checkpoint import manager as ckmanager
    manager = ckmanager.CheckpointManager(
        _env("CHECKPOINT_DIR"), save_interval_steps=int(_env("CHECKPOINT_EVERY", "100")),
        max_to_keep=2, timeout_s=max(30.0, timeout_s * 3))
  restore_from = json.loads(_env("RESTORE")) if _env("RESTORE") else None
  return Context(rank, world, generation, run_dir, every, tier, manager, restore_from, watchdog)
