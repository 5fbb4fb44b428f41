"""The elastic launcher: starts N workers under jax.distributed on loopback, watches them, and when
processes are lost restarts the survivors as a smaller job that continues from the newest state.

One *generation* is one jax.distributed job: a fresh coordinator (process 0 of the generation, on
127.0.0.1 and a free port) and ranks ``0..world-1``. The launcher watches the processes (an exit
it sees within one poll) and the workers watch each other (heartbeats, :mod:`.heartbeat`: a
stopped or cut-off process, which no exit shows). On a loss:

1. *detect*: a worker died of a signal, or a survivor's watchdog named it (``lost.*.json``);
2. *stop*: every other worker of the generation is killed (their state is in the tiers);
3. *choose*: the newest complete step of the in-memory tier without the lost processes
   (:func:`.memory.complete_steps`), else the newest persistent checkpoint, else the step the
   generation itself restored from;
4. *restart*: ``world - len(lost)`` workers (at least ``min_nprocs``), generation + 1, told what
   to restore. The script builds its mesh from the devices it sees, so it plans for the smaller
   job itself.

Like TorchElastic, a worker that fails with an error of its own (an exception, exit status other
than 0 and the survivors' 75) restarts the job at the same size, at most ``max_restarts`` times in
all. Nothing here is a cluster manager: processes are local children, state lives in host
memory, the checkpoint directory and the coordination service.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import numpy as np

from dtenjax._src import errors
from dtenjax._src.elastic import memory, worker


@dataclasses.dataclass
class Generation:
  """One jax.distributed job of the run."""
  index: int
  world: int
  started: float                     # time.time()
  restore: dict | None
  ended: float = 0.0
  codes: list[int | None] = dataclasses.field(default_factory=list)
  lost: list[int] = dataclasses.field(default_factory=list)
  detected: float | None = None      # when the launcher knew of the loss
  reports: list[dict] = dataclasses.field(default_factory=list)   # the survivors' errors
  grown_at: int | None = None        # stopped to grow at this complete snapshot step


@dataclasses.dataclass
class LaunchResult:
  """What happened: the generations in order, the run directory (events, logs), the exit
  status of the job (0: the last generation finished)."""
  generations: list[Generation]
  run_dir: str
  code: int

  def events(self) -> list[dict]:
    path = os.path.join(self.run_dir, "events.jsonl")
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return [json.loads(line) for line in f if line.strip()]

  def log(self, generation: int, rank: int) -> str:
    with open(os.path.join(self.run_dir, f"g{generation}.r{rank}.log")) as f:
      return f.read()

  def summary(self) -> str:
    lines = []
    for g in self.generations:
      src = (f"from {g.restore['source']} step {g.restore['step']}" if g.restore
             else "from the start")
      end = (f"lost {g.lost}" if g.lost else
             f"stopped to grow at step {g.grown_at}" if g.grown_at is not None else
             "finished" if all(c == 0 for c in g.codes) else f"exit codes {g.codes}")
      lines.append(f"generation {g.index}: {g.world} processes {src}; {end}")
    return "\n".join(lines)


def _free_port() -> int:
  from dtenjax.testing.ports import free_port
  return free_port()


def _start(argv: Sequence[str], env: dict[str, str], log_path: str) -> subprocess.Popen:
  """``python argv...``, its output in ``log_path``. The launcher needs of a worker only what it
  polls, signals and waits for, so a test may replace this (tests/test_elastic_launch.py forks
  the workers from a process that has imported jax)."""
  with open(log_path, "w") as log:
    return subprocess.Popen([sys.executable, *argv], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def _kill(procs: Sequence[subprocess.Popen]) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        p.send_signal(signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in procs:
    try:
      p.wait(timeout=10)
    except subprocess.TimeoutExpired:
      pass


def _latest_checkpoint(checkpoint_dir: str | None) -> int | None:
  if not checkpoint_dir:
    return None
  from dtenjax._src.checkpoint import manager
  return manager.CheckpointManager(checkpoint_dir).latest_step()


def memory_dir(memory_root: str, run_dir: str) -> str:
  """The in-memory tier's directory of the run at ``run_dir``, under ``memory_root``: named after
  the run directory and a digest of its absolute path, so that two jobs on one host whose run
  directories share a last name (``.../a/run``, ``.../b/run``) never share, and remove, each
  other's records."""
  path = os.path.abspath(run_dir).rstrip("/")
  digest = hashlib.sha1(path.encode()).hexdigest()[:12]
  return os.path.join(memory_root, f"{os.path.basename(path)}-{digest}")


def choose_restore(memory_root: str, world: int, lost: Sequence[int],
                   checkpoint_dir: str | None, previous: dict | None) -> dict | None:
  """Where the next generation continues from: the newest step among the in-memory tier (of
  the generation that lost ``lost``), the persistent checkpoints and ``previous`` (what that
  generation itself restored from); the in-memory tier wins a tie."""
  options = []
  steps = memory.complete_steps(memory_root, world, lost)
  if steps:
    options.append((steps[-1], 2, {"source": "memory", "root": memory_root, "world": world,
                                   "lost": sorted(lost), "step": steps[-1]}))
  ck = _latest_checkpoint(checkpoint_dir)
  if ck is not None:
    options.append((ck, 1, {"source": "checkpoint", "step": ck}))
  if previous:
    options.append((previous["step"], 0, previous))
  return max(options, key=lambda o: o[:2])[2] if options else None


def _whole(value, low: int) -> bool:
  """An int >= ``low``: Python's or numpy's (a count read through numpy), never a bool."""
  return (isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
          and value >= low)


def _number(value) -> bool:
  return (isinstance(value, (int, float, np.integer, np.floating))
          and not isinstance(value, (bool, np.bool_)) and math.isfinite(value))


def launch(argv: Sequence[str], nprocs: int, *, min_nprocs: int | None = None,
           max_restarts: int = 3, env: dict[str, str] | None = None,
           run_dir: str | None = None, snapshot_every: int = 1,
           checkpoint_dir: str | None = None, checkpoint_every: int = 100,
           heartbeat_timeout_s: float = 10.0, timeout_s: float = 3600.0,
           memory_root: str | None = None, capacity=None,
           quiet: bool = False) -> LaunchResult:
  """Runs ``python argv...`` as an elastic job of ``nprocs`` processes (see the module doc).

  ``min_nprocs``: the smallest job to continue with (default ``nprocs``: no shrinking).
  ``env``: variables added to the workers' environment. ``run_dir``: where the workers' logs
  (``g<generation>.r<rank>.log``) and the events go (default: a new temporary directory).
  ``quiet``: no progress lines on stderr.
  ``snapshot_every``: steps between in-memory snapshots (0: none); ``checkpoint_dir`` and
  ``checkpoint_every``: the persistent tier (a :class:`dtenjax.checkpoint.CheckpointManager`).
  ``heartbeat_timeout_s``: how long a silent worker is waited for. ``timeout_s`` bounds the
  whole run. ``memory_root``: where the in-memory tier keeps its records (a RAM file system;
  default ``/dev/shm``), in a directory of this run that is removed at the end.
  ``capacity``: a callable giving how many processes could run now (None: never grow); when a
  shrunk job has room to grow, the launcher waits for the next complete in-memory snapshot (a
  checkpoint boundary), stops the generation and restarts it larger from that step. Raises
  :class:`dtenjax.ProcessLostError` when fewer than ``min_nprocs`` remain or more than
  ``max_restarts`` restarts were needed; returns the :class:`LaunchResult` otherwise.
  """
  min_nprocs = nprocs if min_nprocs is None else min_nprocs
  problems = []
  if not _whole(nprocs, 1):
    problems.append(f"nprocs={nprocs!r} must be an int >= 1")
  elif not _whole(min_nprocs, 1) or min_nprocs > nprocs:
    problems.append(f"min_nprocs={min_nprocs!r} must be an int in [1, nprocs={nprocs}]")
  if isinstance(argv, (str, bytes)):
    problems.append(f"argv={argv!r} is one string: pass the script and its arguments as a "
                    f"list, e.g. {argv.split() if isinstance(argv, str) else [argv]!r}")
  elif not argv:
    problems.append("argv is empty: pass the script and its arguments, e.g. ['train.py']")
  # As the CLI's options (dtenjax launch --help): a NaN timeout would never end a hung job.
  for name, value, low in (("heartbeat_timeout_s", heartbeat_timeout_s, 0.2),
                           ("timeout_s", timeout_s, 0.0)):
    if not _number(value) or not value > low:
      problems.append(f"{name}={value!r} must be a number of seconds > {low:g}")
  if not _whole(snapshot_every, 0):
    problems.append(f"snapshot_every={snapshot_every!r} must be an int >= 0 (0: no snapshots)")
  if not _whole(checkpoint_every, 1):
    problems.append(f"checkpoint_every={checkpoint_every!r} must be an int >= 1")
  if not _whole(max_restarts, 0):
    problems.append(f"max_restarts={max_restarts!r} must be an int >= 0")
  if capacity is not None and not callable(capacity):
    problems.append(f"capacity={capacity!r} must be a callable giving how many processes could "
                    "run now, or None")
  if problems:
    raise errors.ConfigurationError(errors.join_problems("dtenjax launch cannot start:",
                                                         problems))
  nprocs, min_nprocs, snapshot_every = int(nprocs), int(min_nprocs), int(snapshot_every)
  checkpoint_every, max_restarts = int(checkpoint_every), int(max_restarts)
  timeout_s, heartbeat_timeout_s = float(timeout_s), float(heartbeat_timeout_s)
  run_dir = os.path.abspath(run_dir or tempfile.mkdtemp(prefix="dtenjax-launch-"))
  os.makedirs(run_dir, exist_ok=True)
  memory_base = memory_dir(memory_root or memory.default_root(), run_dir)   # removed at the end
  deadline = time.monotonic() + timeout_s
  generations: list[Generation] = []
  world, restore, restarts = nprocs, None, 0
  say = (lambda msg: None) if quiet else (lambda msg: print(f"dtenjax launch: {msg}",
                                                            file=sys.stderr, flush=True))
  try:
    while True:
      g = Generation(len(generations), world, time.time(), restore)
      generations.append(g)
      mem_root = os.path.join(memory_base, f"gen{g.index}")
      port = _free_port()
      procs = []
      for r in range(world):
        e = dict(os.environ)
        e.update(env or {})
        e.update({worker.ENV + k: str(v) for k, v in {
            "RUN_DIR": run_dir, "RANK": r, "WORLD": world, "GENERATION": g.index,
            "COORDINATOR": f"127.0.0.1:{port}", "HEARTBEAT_TIMEOUT": heartbeat_timeout_s,
            "SNAPSHOT_EVERY": snapshot_every, "MEMORY": mem_root,
            "CHECKPOINT_DIR": checkpoint_dir or "", "CHECKPOINT_EVERY": checkpoint_every,
            "RESTORE": json.dumps(restore) if restore else ""}.items()})
        e.setdefault("DTENJAX_BIND_ADDRESS", "127.0.0.1")
        procs.append(_start(argv, e, os.path.join(run_dir, f"g{g.index}.r{r}.log")))
      worker.event(run_dir, "generation", generation=g.index, world=world,
                   restore=restore)
      say(f"generation {g.index}: {world} processes"
          + (f", continuing from {restore['source']} step {restore['step']}" if restore else ""))
      grow = None
      if capacity is not None and world < nprocs and snapshot_every:
        grow = lambda w=world: min(nprocs, int(capacity())) > w
      failed = _watch(g, procs, run_dir, deadline, heartbeat_timeout_s, grow=grow,
                      mem_root=mem_root)
      g.ended = time.time()
      if g.grown_at is not None:
        new_world = min(nprocs, int(capacity()))
        restore = {"source": "memory", "root": mem_root, "world": world, "lost": [],
                   "step": g.grown_at}
        worker.event(run_dir, "grow", generation=g.index, world=new_world, step=g.grown_at)
        say(f"generation {g.index}: capacity for {new_world} processes; growing at step "
            f"{g.grown_at}")
        world = new_world
        continue
      if not failed:
        say(f"generation {g.index} finished")
        return LaunchResult(generations, run_dir, 0)
      worker.event(run_dir, "detected", generation=g.index, lost=g.lost, t_detect=g.detected)
      if g.lost:
        say(f"generation {g.index} lost rank{'s' if len(g.lost) > 1 else ''} "
            f"{', '.join(map(str, g.lost))}"
            + (f": {g.reports[0]['message']}" if g.reports else f" (exit codes {g.codes})"))
        # the lost processes' own host memory is gone with them (a lost host): only their
        # replicas on the survivors count
        for r in g.lost:
          shutil.rmtree(memory.holder(mem_root, r), ignore_errors=True)
      restarts += 1
      new_world = world - len(g.lost)
      if restarts > max_restarts or new_world < min_nprocs:
        why = (f"{new_world} processes would remain, fewer than min_nprocs={min_nprocs}"
               if new_world < min_nprocs else f"max_restarts={max_restarts} restarts were used")
        raise errors.ProcessLostError(
            f"the elastic job stops at generation {g.index}: {why} (lost ranks {g.lost}, exit "
            f"codes {g.codes}; logs in {run_dir})", g.lost)
      restore = choose_restore(mem_root, world, g.lost, checkpoint_dir, restore)
      world = new_world
  finally:
    shutil.rmtree(memory_base, ignore_errors=True)


def _watch(g: Generation, procs: list[subprocess.Popen], run_dir: str, deadline: float,
           heartbeat_timeout_s: float, *,
           grow=None, mem_root: str | None = None) -> bool:
  """Waits for the generation to end; True when it failed (g.lost, g.codes filled in). With
  ``grow`` (a callable: is there room for more processes?), a generation that has room is
  stopped at the first snapshot step completed after the room appeared (g.grown_at)."""
  grow_after: int | None = None      # the newest complete step when room appeared
  try:
    while True:
      codes = [p.poll() for p in procs]
      reports = worker.reports(run_dir, g.index)
      if all(c == 0 for c in codes):
        g.codes = codes
        return False
      bad = [r for r, c in enumerate(codes) if c is not None and c != 0]
      if bad or reports:
        g.detected = time.time()
        # lost: the processes dead of a signal when the failure was first seen. JAX aborts
        # (SIGABRT) the survivors of a dead coordinator within a second: where another signal
        # killed a process, a SIGABRT beside it is that collateral, not a second loss.
        signalled = {r: c for r, c in enumerate(codes) if c is not None and c < 0}
        if any(c != -signal.SIGABRT for c in signalled.values()):
          signalled = {r: c for r, c in signalled.items() if c != -signal.SIGABRT}
        # let the other survivors' reports land: 0.2 s after an exit; after a loss that only a
        # survivor's watchdog saw (a stopped or cut-off process), until every process has
        # exited, reported or been named, for at most one heartbeat timeout (each survivor sees
        # the silent peer within about one beat of the first, later on a loaded host)
        wait_until = time.monotonic() + (0.2 if signalled or not reports else heartbeat_timeout_s)
        while True:
          time.sleep(0.05)
          codes = [p.poll() for p in procs]
          reports = worker.reports(run_dir, g.index)
          named = {r for rep in reports.values() for r in rep["lost"]}
          if time.monotonic() >= wait_until or (not signalled and all(
              c is not None or r in reports or r in named for r, c in enumerate(codes))):
            break
        g.reports = [reports[r] for r in sorted(reports)]
        g.lost = sorted(named | set(signalled))
        _kill(procs)
        g.codes = [p.returncode for p in procs]
        for r in g.lost:            # a lost process that was still there was stopped: killed
          if codes[r] is None:
            g.codes[r] = None
        return True
      if grow is not None and mem_root is not None:
        steps = memory.complete_steps(mem_root, g.world)
        if grow_after is None and grow():
          grow_after = steps[-1] if steps else -1
        elif grow_after is not None and steps and steps[-1] > grow_after:
          g.grown_at = steps[-1]
          _kill(procs)
          g.codes = [p.returncode for p in procs]
          return False
      if time.monotonic() > deadline:
        g.detected = time.time()
        _kill(procs)
        g.codes = [p.returncode for p in procs]
        raise errors.CollectiveTimeoutError(
            f"the elastic job ran past its timeout at generation {g.index} (exit codes "
            f"{g.codes}; logs in {run_dir}); its processes were killed. Pass a longer timeout_s "
            "(dtenjax launch --timeout S) if the job needs more time")
      time.sleep(0.05)
  except BaseException:
    _kill(procs)
    raise


def qualification(argv: Sequence[str], env: dict[str, str] | None = None) -> list[tuple[bool, str]]:
  """What can be checked before the start about whether a run that loses processes continues with
  the uninterrupted run's bits (docs/elastic.md lists the rest): ``[(ok, finding), ...]``."""
  from dtenjax._src.planning import reproducible
  e = {**os.environ, **(env or {})}
  platforms = e.get("JAX_PLATFORMS", "").lower()
  gpu = "cuda" in platforms or "gpu" in platforms or (
      not platforms and os.path.exists("/dev/nvidia0"))
  out = []
  missing = reproducible.missing_process_flags("gpu" if gpu else "cpu", environ=e,
                                               num_devices=2)
  out.append((not missing, "process settings for reproducible steps: " + (
      f"missing {' '.join(missing)}" + (" (pass --reproducible)" if not gpu else "")
      if missing else "present")))
  try:
    with open(argv[0], encoding="utf-8") as f:
      source = f.read()
  except (OSError, IndexError):
    source = None
  if source is not None:
    for needle, what in (("elastic.init(", "joins the elastic job (dtenjax.elastic.init)"),
                         ("step_done(", "snapshots its state (ctx.step_done)"),
                         ("reproducible_step(", "compiles its step with dtenjax.reproducible_step"),
                         ("reproducible=True", "reduces with reproducible=True")):
      found = needle in source
      out.append((found, f"the script {what}: " + ("yes" if found else "not found")))
  return out
