"""A micro-batch scheduler for jitted steps with a latency SLA (seed section 2.3).

Two queues feed one dispatcher thread that runs a compiled step (through :func:`dtenjax.jit`, so
it replays as CUDA graphs on a GPU):

* the **main queue** (FIFO) carries regular work, submitted with :meth:`GraphScheduler.submit`;
* the **low-latency queue** (earliest deadline first) carries SLA-bound micro-batches injected with
  :meth:`GraphScheduler.inject_micro_batch`, each bound to a deadline (default: now + SLA).

Dispatch capacity is shared by weighted round robin. The low-latency queue owns
``low_latency_share`` of the slots; a preemption policy releases part of the main queue's capacity
to it when it falls behind. The seed's defaults: a low-latency backlog of >= 3 batches releases 25%
of the main queue's capacity, a low-latency P95 above 110 ms releases 40% (the larger applies). The
decision is the pure function :func:`preemption_decision`, re-evaluated before every dispatch.

Each batch gets a ``concurrent.futures.Future`` holding the step's output. Per-queue metrics
(P50/P95/P99 latency from injection to completion, deadline misses, preemptions, completions,
depth) are available as :meth:`GraphScheduler.metrics` and, optionally, through prometheus_client
on 127.0.0.1 with a private registry per scheduler. :meth:`GraphScheduler.shutdown` stops accepting
work and runs every accepted batch before the dispatcher exits. Every wait has a timeout.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src.gpu import graphs

MAIN = "main"
LOW_LATENCY = "low_latency"
QUEUES = (MAIN, LOW_LATENCY)


class SchedulerClosedError(errors.DtenjaxError, RuntimeError):
  """Work was offered to a scheduler that is shutting down or shut down."""


class QueueFullError(errors.DtenjaxError, RuntimeError):
  """A queue stayed at its capacity for longer than the injection timeout."""


class SchedulerTimeoutError(errors.DtenjaxError, TimeoutError):
  """A wait on the scheduler (shutdown, drain) ran past its timeout."""


@dataclasses.dataclass(frozen=True)
class PreemptionPolicy:
  """When and how much main-queue capacity goes to the low-latency queue (seed defaults).

  Attributes:
    backlog_batches: a low-latency backlog of at least this many batches triggers...
    backlog_release: ...releasing this fraction of the main queue's capacity.
    p95_seconds: a low-latency P95 latency above this triggers...
    p95_release: ...releasing this fraction.
    enabled: False never releases anything (the low-latency queue keeps its base share only).
  """
  backlog_batches: int = 3
  backlog_release: float = 0.25
  p95_seconds: float = 0.110
  p95_release: float = 0.40
  enabled: bool = True

  def __post_init__(self):
    problems = []
    if not isinstance(self.backlog_batches, int) or self.backlog_batches < 1:
      problems.append(f"backlog_batches={self.backlog_batches!r} must be an integer >= 1")
    for name in ("backlog_release", "p95_release"):
      v = getattr(self, name)
      if not 0.0 <= v <= 1.0:
        problems.append(f"{name}={v!r} must be a fraction in [0, 1]")
    if not self.p95_seconds > 0:
      problems.append(f"p95_seconds={self.p95_seconds!r} must be > 0")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid PreemptionPolicy:", problems))


def preemption_decision(policy: PreemptionPolicy, low_latency_backlog: int,
                        low_latency_p95: float | None) -> float:
  """Fraction of the main queue's capacity released to the low-latency queue (pure).

  The largest release among the triggered rules; 0 when none triggers or the policy is off.
  """
  if not policy.enabled:
    return 0.0
  release = 0.0
  if low_latency_backlog >= policy.backlog_batches:
    release = max(release, policy.backlog_release)
  if low_latency_p95 is not None and low_latency_p95 > policy.p95_seconds:
    release = max(release, policy.p95_release)
  return release


def low_latency_slot_share(base_share: float, released: float) -> float:
  """Share of dispatch slots the low-latency queue owns after ``released`` of main's (pure)."""
  return base_share + released * (1.0 - base_share)


def pick_queue(credit: float, share: float, low_ready: bool, main_ready: bool
               ) -> tuple[str | None, float]:
  """Weighted round robin between the queues (pure). Returns (queue or None, new credit).

  The low-latency queue earns ``share`` credit per slot and spends 1 per batch; credit is capped
  so that an idle period does not buy a burst. A queue with nothing ready yields its slot.
  """
  credit = min(credit + share, 1.0 + share)
  if low_ready and (credit >= 1.0 or not main_ready):
    return LOW_LATENCY, max(credit - 1.0, 0.0)
  if main_ready:
    return MAIN, credit
  return None, credit


def percentiles(values, qs=(50, 95, 99)) -> dict[str, float | None]:
  """{'p50': ..., 'p95': ..., 'p99': ...} of ``values`` (None when empty)."""
  if not len(values):
    return {f"p{q}": None for q in qs}
  arr = np.asarray(values, dtype=np.float64)
  return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


class QueueStats(NamedTuple):
  completed: int
  failed: int
  deadline_misses: int
  preemptions: int
  depth: int
  p50: float | None
  p95: float | None
  p99: float | None


@dataclasses.dataclass
class _Item:
  batch: Any
  future: concurrent.futures.Future
  queue: str
  injected: float
  deadline: float | None


def _spec_of(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.result_type(x)), tree)


def check_batch(spec: Any, batch: Any) -> None:
  """Raises ConfigurationError listing every leaf of ``batch`` that does not match ``spec``."""
  spec_leaves, spec_tree = jax.tree.flatten(spec)
  leaves, tree = jax.tree.flatten(batch)
  if tree != spec_tree:
    raise errors.ConfigurationError(
        f"batch structure {tree} does not match the step's batch_spec structure {spec_tree}; "
        f"inject batches built like the batch_spec given to GraphScheduler.")
  problems = []
  paths = [jax.tree_util.keystr(p) or "batch" for p, _ in
           jax.tree_util.tree_flatten_with_path(spec)[0]]
  for path, want, got in zip(paths, spec_leaves, leaves):
    shape, dtype = tuple(np.shape(got)), np.result_type(got)
    if shape != tuple(want.shape) or dtype != want.dtype:
      problems.append(f"{path}: got {dtype}{list(shape)}, the step takes "
                      f"{want.dtype}{list(want.shape)}")
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        "batch does not fit the compiled step (reshape/cast it, or pad to the batch_spec):",
        problems))


class GraphScheduler:
  """Runs a jitted step over micro-batches from a main and a low-latency queue under an SLA.

  Args:
    step_fn: ``step_fn(batch) -> output``; compiled with :func:`dtenjax.jit`.
    batch_spec: a pytree of arrays or ShapeDtypeStructs: what every batch must look like.
    latency_sla: seconds; default deadline of an injected micro-batch (seed: 0.120).
    preemption: a PreemptionPolicy (seed defaults) or None for the defaults.
    low_latency_share: slots the low-latency queue owns before any preemption (default 1/8).
    max_queue: capacity of each queue.
    cuda_graphs: CUDA-graph mode for the step (see dtenjax.jit).
    metrics_port: None (no HTTP endpoint) or a port (0 picks a free one) served on 127.0.0.1.
    latency_window: how many recent latencies per queue the percentiles cover.
    poll_interval: seconds the dispatcher sleeps at most between checks for work.
    clock: returns the current time in seconds (default ``time.monotonic``); latencies, deadlines
      and the P95 rule use it. Tests pass a virtual clock that counts steps run.
  """

  def __init__(self, step_fn: Callable[[Any], Any], *, batch_spec: Any,
               latency_sla: float = 0.120, preemption: PreemptionPolicy | None = None,
               low_latency_share: float = 0.125, max_queue: int = 1024,
               cuda_graphs: str | graphs.CudaGraphPolicy = "auto",
               metrics_port: int | None = None, latency_window: int = 2048,
               poll_interval: float = 0.05, clock: Callable[[], float] = time.monotonic):
    problems = []
    if not latency_sla > 0:
      problems.append(f"latency_sla={latency_sla!r} must be > 0 seconds")
    if not 0.0 < low_latency_share < 1.0:
      problems.append(f"low_latency_share={low_latency_share!r} must be in (0, 1)")
    if not isinstance(max_queue, int) or max_queue < 1:
      problems.append(f"max_queue={max_queue!r} must be an integer >= 1")
    if not isinstance(latency_window, int) or latency_window < 1:
      problems.append(f"latency_window={latency_window!r} must be an integer >= 1")
    if not poll_interval > 0:
      problems.append(f"poll_interval={poll_interval!r} must be > 0")
    if metrics_port is not None and not (isinstance(metrics_port, int)
                                         and 0 <= metrics_port < 65536):
      problems.append(f"metrics_port={metrics_port!r} must be None or a port in [0, 65535]")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid GraphScheduler:", problems))
    self.latency_sla = float(latency_sla)
    self.preemption = preemption or PreemptionPolicy()
    self.low_latency_share = float(low_latency_share)
    self.max_queue = max_queue
    self.poll_interval = float(poll_interval)
    self._clock = clock
    self._steps_run = 0
    self.batch_spec = _spec_of(batch_spec)
    self.step = graphs.jit(step_fn, cuda_graphs)
    self._compiled = self.step.lower(self.batch_spec).compile()

    self._cv = threading.Condition()
    self._main: collections.deque[_Item] = collections.deque()
    self._low: list[tuple[float, int, _Item]] = []   # heap by deadline
    self._seq = itertools.count()
    self._closing = False
    self._credit = 0.0
    self._released = 0.0
    self._latencies = {q: collections.deque(maxlen=latency_window) for q in QUEUES}
    self._counts = {q: collections.Counter() for q in QUEUES}
    self._preemption_episodes = 0
    self._low_p95: float | None = None   # refreshed when a low-latency batch finishes
    self._prom = _PromMetrics(metrics_port) if metrics_port is not None else None
    self._thread = threading.Thread(target=self._run, name="dtenjax-graph-scheduler",
                                    daemon=True)
    self._thread.start()

  # ---- injection --------------------------------------------------------------------------

  def _enqueue(self, batch: Any, queue: str, deadline: float | None,
               timeout: float) -> concurrent.futures.Future:
    check_batch(self.batch_spec, batch)
    item = _Item(batch, concurrent.futures.Future(), queue, self._clock(), deadline)
    end = time.monotonic() + timeout
    with self._cv:
      while True:
        if self._closing:
          raise SchedulerClosedError(
              f"the scheduler is shut down; a {queue} batch was refused. Create a new "
              f"GraphScheduler to run more work.")
        depth = len(self._main) if queue == MAIN else len(self._low)
        if depth < self.max_queue:
          break
        left = end - time.monotonic()
        if left <= 0:
          raise QueueFullError(
              f"the {queue} queue held max_queue={self.max_queue} batches for {timeout} s; "
              f"raise max_queue, pass a longer timeout, or inject more slowly.")
        self._cv.wait(left)
      if queue == MAIN:
        self._main.append(item)
      else:
        heapq.heappush(self._low, (deadline, next(self._seq), item))
      self._cv.notify_all()
    return item.future

  def submit(self, batch: Any, *, timeout: float = 0.0) -> concurrent.futures.Future:
    """Queues a regular batch on the main queue. Waits up to ``timeout`` s for room."""
    return self._enqueue(batch, MAIN, None, timeout)

  def inject_micro_batch(self, batch: Any, deadline: float | None = None, *,
                         timeout: float = 0.0) -> concurrent.futures.Future:
    """Injects an SLA-bound micro-batch into the low-latency queue.

    Args:
      batch: must match ``batch_spec`` (checked now; a mismatch raises ConfigurationError).
      deadline: absolute time on the scheduler's clock (``time.monotonic()`` by default);
        default now + ``latency_sla``.
      timeout: seconds to wait for room when the queue is full, then QueueFullError.
    Returns:
      A Future with the step's output.
    """
    now = self._clock()
    if deadline is None:
      deadline = now + self.latency_sla
    elif not deadline > now - 3600 * 24 * 365:
      raise errors.ConfigurationError(
          f"deadline={deadline!r} is not a time.monotonic() value; pass time.monotonic() + "
          f"seconds, or None for now + latency_sla.")
    return self._enqueue(batch, LOW_LATENCY, float(deadline), timeout)

  # ---- dispatch ---------------------------------------------------------------------------

  def _next_item(self) -> _Item | None:
    """Chooses the next batch under the lock, or None after waiting poll_interval."""
    with self._cv:
      if not self._main and not self._low:
        self._cv.wait(self.poll_interval)
        if not self._main and not self._low:
          return None
      released = preemption_decision(self.preemption, len(self._low), self._low_p95)
      if released > 0 and self._released == 0:
        self._preemption_episodes += 1
      self._released = released
      share = low_latency_slot_share(self.low_latency_share, released)
      base_credit = min(self._credit + self.low_latency_share, 1.0 + self.low_latency_share)
      queue, self._credit = pick_queue(self._credit, share, bool(self._low), bool(self._main))
      if queue == LOW_LATENCY:
        item = heapq.heappop(self._low)[2]
        if released > 0 and self._main and base_credit < 1.0:
          # This slot belonged to the main queue and was released to the low-latency queue.
          self._counts[MAIN]["preemptions"] += 1
          self._counts[LOW_LATENCY]["preemptions"] += 1
          if self._prom:
            self._prom.preemptions.labels(MAIN).inc()
            self._prom.preemptions.labels(LOW_LATENCY).inc()
      else:
        item = self._main.popleft()
      self._cv.notify_all()   # room for blocked injectors
      return item

  def _run(self) -> None:
    try:
      self._dispatch_loop()
    except BaseException as e:  # pylint: disable=broad-except
      # A bug in the dispatcher must not leave callers waiting: fail what is queued, refuse more.
      with self._cv:
        self._closing = True
        pending = list(self._main) + [entry[2] for entry in self._low]
        self._main.clear()
        self._low.clear()
      for item in pending:
        if item.future.set_running_or_notify_cancel():
          item.future.set_exception(SchedulerClosedError(
              f"the dispatcher thread stopped ({type(e).__name__}: {e}); this batch did not run"))
      raise

  def _dispatch_loop(self) -> None:
    while True:
      item = self._next_item()
      if item is None:
        with self._cv:
          if self._closing and not self._main and not self._low:
            return
        continue
      if not item.future.set_running_or_notify_cancel():
        continue
      try:
        out = jax.block_until_ready(self._compiled(item.batch))
      except Exception as e:  # pylint: disable=broad-except
        self._finish(item, error=e)
      else:
        self._finish(item, result=out)

  def _finish(self, item: _Item, result: Any = None, error: BaseException | None = None) -> None:
    with self._cv:
      self._steps_run += 1
      done = self._clock()
      latency = done - item.injected
      missed = item.deadline is not None and done > item.deadline
      counts = self._counts[item.queue]
      counts["failed" if error else "completed"] += 1
      counts["deadline_misses"] += int(missed)
      self._latencies[item.queue].append(latency)
      stats = (percentiles(self._latencies[item.queue])
               if self._prom or item.queue == LOW_LATENCY else None)
      if item.queue == LOW_LATENCY:
        self._low_p95 = stats["p95"]
    if self._prom:
      self._prom.observe(item.queue, latency, missed, error is not None, stats,
                         len(self._main), len(self._low), self._released)
    if error is not None:
      item.future.set_exception(error)
    else:
      item.future.set_result(result)

  # ---- metrics and lifecycle --------------------------------------------------------------

  def metrics(self) -> dict[str, QueueStats]:
    """Per-queue statistics now: {'main': QueueStats, 'low_latency': QueueStats}."""
    with self._cv:
      out = {}
      for q in QUEUES:
        c = self._counts[q]
        p = percentiles(self._latencies[q])
        depth = len(self._main) if q == MAIN else len(self._low)
        out[q] = QueueStats(c["completed"], c["failed"], c["deadline_misses"], c["preemptions"],
                            depth, p["p50"], p["p95"], p["p99"])
      return out

  @property
  def steps_run(self) -> int:
    """How many batches the dispatcher has finished (successfully or not)."""
    return self._steps_run

  @property
  def preemption_episodes(self) -> int:
    """How many times the policy went from releasing nothing to releasing capacity."""
    return self._preemption_episodes

  @property
  def metrics_address(self) -> tuple[str, int] | None:
    """(host, port) of the prometheus endpoint, or None."""
    return self._prom.address if self._prom else None

  def shutdown(self, timeout: float = 60.0) -> None:
    """Stops accepting work, runs every accepted batch, and stops the dispatcher.

    Raises SchedulerTimeoutError if the accepted work does not finish within ``timeout`` s (the
    dispatcher keeps draining in the background; call shutdown again to keep waiting).
    """
    with self._cv:
      self._closing = True
      self._cv.notify_all()
    self._thread.join(timeout)
    if self._thread.is_alive():
      with self._cv:
        left = len(self._main) + len(self._low)
      raise SchedulerTimeoutError(
          f"shutdown waited {timeout} s for accepted batches to run; {left} are still queued "
          f"(plus one running). Call shutdown(timeout=...) again with a longer timeout.")
    if self._prom:
      self._prom.close()

  def __enter__(self) -> GraphScheduler:
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()


class _PromMetrics:
  """prometheus_client metrics in a private registry, served on 127.0.0.1."""

  def __init__(self, port: int):
    try:
      import prometheus_client as pc  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise errors.ConfigurationError(
          f"metrics_port={port} needs prometheus_client ({e}); `pip install prometheus_client` "
          f"or pass metrics_port=None and read GraphScheduler.metrics().") from None
    self.registry = pc.CollectorRegistry()
    r = self.registry
    self.latency = pc.Gauge("dtenjax_sched_latency_seconds",
                            "injection-to-completion latency quantile over the recent window",
                            ["queue", "quantile"], registry=r)
    self.latency_hist = pc.Histogram(
        "dtenjax_sched_batch_latency_seconds", "injection-to-completion latency", ["queue"],
        buckets=(.005, .01, .025, .05, .075, .1, .11, .12, .15, .2, .3, .5, 1, 2.5, 5),
        registry=r)
    self.misses = pc.Counter("dtenjax_sched_deadline_misses", "batches done after their deadline",
                             ["queue"], registry=r)
    self.preemptions = pc.Counter("dtenjax_sched_preemptions",
                                  "main-queue slots released to the low-latency queue",
                                  ["queue"], registry=r)
    self.completed = pc.Counter("dtenjax_sched_batches", "batches run", ["queue", "status"],
                                registry=r)
    self.depth = pc.Gauge("dtenjax_sched_queue_depth", "batches waiting", ["queue"], registry=r)
    self.released = pc.Gauge("dtenjax_sched_released_fraction",
                             "fraction of main-queue capacity released now", registry=r)
    for q in QUEUES:
      self.misses.labels(q)
      self.preemptions.labels(q)
    self.server, self.thread = pc.start_http_server(port, addr="127.0.0.1", registry=r)
    self.address = ("127.0.0.1", self.server.server_port)

  def observe(self, queue, latency, missed, failed, stats, main_depth, low_depth, released):
    self.latency_hist.labels(queue).observe(latency)
    for q in (50, 95, 99):
      if stats[f"p{q}"] is not None:
        self.latency.labels(queue, f"0.{q}").set(stats[f"p{q}"])
    if missed:
      self.misses.labels(queue).inc()
    self.completed.labels(queue, "error" if failed else "ok").inc()
    self.depth.labels(MAIN).set(main_depth)
    self.depth.labels(LOW_LATENCY).set(low_depth)
    self.released.set(released)

  def close(self):
    self.server.shutdown()
    self.server.server_close()
    self.thread.join(5.0)
