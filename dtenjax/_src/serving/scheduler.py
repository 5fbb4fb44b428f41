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

Reliability: every future resolves. A step that raises fails its own future and the dispatcher
goes on; if the dispatcher thread itself fails (a clock or metrics callback raising, an
interrupt), the batch in flight and every queued batch are failed with SchedulerClosedError
(its ``__cause__`` is the failure) and new work is refused. The dispatcher thread holds only the
scheduler's internals, never the GraphScheduler: a scheduler dropped without ``shutdown()`` is
garbage-collected, a finalizer closes it, and its thread runs the accepted batches and exits.
"""

from __future__ import annotations

import collections
import collections.abc
import concurrent.futures
import dataclasses
import heapq
import itertools
import math
import numbers
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import config
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


# The longest wait Python's locks accept (threading.TIMEOUT_MAX); every timeout is at most this.
MAX_WAIT_S = threading.TIMEOUT_MAX
# A deadline further than this from the clock's now is taken for a value of another clock.
_DEADLINE_SPAN_S = 365 * 24 * 3600.0


def _number_problem(name: str, value: Any, lo: float, hi: float = math.inf, *,
                    lo_open: bool = False, integer: bool = False, unit: str = "") -> str | None:
  """Why ``value`` is not a finite number (an int when ``integer``) in the range, or None."""
  kind = "an integer" if integer else "a finite number"
  wanted = numbers.Integral if integer else numbers.Real
  if isinstance(value, bool) or not isinstance(value, wanted):
    return f"{name}={value!r} must be {kind}{unit} (got {type(value).__name__})"
  v = float(value)
  if math.isnan(v) or math.isinf(v) or (v <= lo if lo_open else v < lo) or v > hi:
    low = f"> {lo:g}" if lo_open else f">= {lo:g}"
    high = f" and <= {hi:g}" if math.isfinite(hi) else ""
    return f"{name}={value!r} must be {kind}{unit} {low}{high}"
  return None


def _check_number(name: str, value: Any, lo: float, hi: float = math.inf, **kw) -> float:
  problem = _number_problem(name, value, lo, hi, **kw)
  if problem:
    raise errors.ConfigurationError(problem + ".")
  return float(value)


def _check_timeout(name: str, value: Any) -> float:
  """A wait's timeout: finite seconds in [0, MAX_WAIT_S] (no busy wait on NaN, no endless wait)."""
  return _check_number(name, value, 0.0, MAX_WAIT_S, unit=" of seconds")


def _read_clock(clock: Callable[[], float]) -> float:
  """One reading of the scheduler's clock, which must be finite seconds (like time.monotonic)."""
  t = clock()
  if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(float(t)):
    raise errors.ConfigurationError(
        f"the scheduler's clock returned {t!r} ({type(t).__name__}); a clock must return the "
        "current time in seconds as a finite float, like time.monotonic (the default).")
  return float(t)


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
    problems = [_number_problem("backlog_batches", self.backlog_batches, 1, integer=True),
                _number_problem("backlog_release", self.backlog_release, 0.0, 1.0),
                _number_problem("p95_release", self.p95_release, 0.0, 1.0),
                _number_problem("p95_seconds", self.p95_seconds, 0.0, MAX_WAIT_S, lo_open=True)]
    if not isinstance(self.enabled, bool):
      problems.append(f"enabled={self.enabled!r} must be True or False")
    problems = [p for p in problems if p]
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid PreemptionPolicy:", problems))


def preemption_decision(policy: PreemptionPolicy, low_latency_backlog: int,
                        low_latency_p95: float | None) -> float:
  """Fraction of the main queue's capacity released to the low-latency queue (pure).

  ``low_latency_backlog``: batches waiting in the low-latency queue; ``low_latency_p95``: its
  recent P95 latency in seconds (None before any batch finished). The largest release among the
  triggered rules; 0 when none triggers or the policy is off.
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


_ARRAY_LEAVES = (np.ndarray, np.generic, jax.Array, jax.ShapeDtypeStruct, bool, int, float,
                 complex)


def _check_leaves(tree: Any, what: str) -> None:
  """Every leaf must be an array, a scalar or a ShapeDtypeStruct: a generator, bytes, str or
  other object is refused naming its path (numpy would otherwise take it as a 0-d object)."""
  is_iterator = lambda x: isinstance(x, collections.abc.Iterator)  # a leaf, not a node to walk
  bad = [f"{jax.tree_util.keystr(path) or what}: {type(leaf).__name__}"
         for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_iterator)[0]
         if not isinstance(leaf, _ARRAY_LEAVES)]
  if bad:
    raise errors.ConfigurationError(errors.join_problems(
        f"{what} leaves must be arrays (numpy or jax), numbers or jax.ShapeDtypeStruct; pass "
        "np.asarray(...) of the data (a generator or iterator must be materialised first):", bad))


def _dtype_of(leaf: Any) -> np.dtype:
  """``leaf``'s dtype: its own ``.dtype`` where it has one (``np.result_type`` of a jax.Array is
  deprecated by jax, a warning on every batch and an error to come), else numpy's reading."""
  dtype = getattr(leaf, "dtype", None)
  return np.dtype(dtype) if dtype is not None else np.result_type(leaf)


def _leaf_problem(path: str, leaf: Any) -> str | None:
  """Why a batch_spec leaf cannot be a batch's array (None if it can): a numeric or bool dtype,
  and a shape of non-negative integer sizes."""
  try:
    dtype, shape = _dtype_of(leaf), tuple(np.shape(leaf))
  except (TypeError, ValueError) as e:
    return f"{path}: {type(leaf).__name__} has no array dtype and shape ({e})"
  if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
    return (f"{path}: dtype {dtype} is not numeric or bool (a jitted step takes numeric arrays; "
            "encode strings or objects as numbers first)")
  if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in shape):
    return f"{path}: shape {shape} must be non-negative integer sizes"
  return None


def _spec_of(tree: Any) -> Any:
  _check_leaves(tree, "batch_spec")
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not leaves:
    raise errors.ConfigurationError(
        f"batch_spec={tree!r} holds no array: pass one batch's shape and dtype, e.g. "
        "batch_spec=jax.ShapeDtypeStruct((32, 128), jnp.float32), or an example batch (any "
        "pytree of arrays).")
  problems = [_leaf_problem(jax.tree_util.keystr(path) or "batch_spec", leaf)
              for path, leaf in leaves]
  problems = [p for p in problems if p]
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        "batch_spec leaves must be numeric or bool arrays of non-negative sizes:", problems))
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x),
                                                     sharding=_sharding_of(x)), tree)


def _sharding_of(leaf: Any) -> jax.sharding.Sharding | None:
  """The layout a batch_spec leaf asks for: a jax.Array's or a ShapeDtypeStruct's sharding (a
  batch laid out over a mesh, as a data-parallel step takes it), else None (jit's default).
  One over an abstract mesh (``jax.eval_shape`` of a batch on Explicit axes) names no devices:
  it is laid on the ``jax.set_mesh`` mesh with its axes, else left to jit's default."""
  sharding = getattr(leaf, "sharding", None) if isinstance(
      leaf, (jax.Array, jax.ShapeDtypeStruct)) else None
  if not isinstance(sharding, jax.sharding.Sharding):
    return None
  mesh = getattr(sharding, "mesh", None)
  if isinstance(mesh, jax.sharding.AbstractMesh):
    try:
      context = jax.sharding.get_mesh()
    except ValueError:            # inside a trace: no concrete mesh to read
      context = None
    if (isinstance(context, jax.sharding.Mesh) and not context.empty
        and context.abstract_mesh == mesh):
      return jax.sharding.NamedSharding(context, sharding.spec, memory_kind=sharding.memory_kind)
    return None
  return sharding


def _compile(step: Any, spec: Any) -> Any:
  """The step compiled for one batch of ``spec``; a step that cannot take such a batch (it
  raises while tracing or compiling) is a ConfigurationError naming step_fn and batch_spec."""
  try:
    return step.lower(spec).compile()
  except errors.DtenjaxError:
    raise
  except Exception as e:  # the user's step: any error it raises
    shapes = jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", spec)
    raise errors.ConfigurationError(
        f"step_fn could not be compiled for one batch of batch_spec {shapes}: "
        f"{type(e).__name__}: {str(e).strip()[:2000].rstrip('.')}. step_fn must take one argument shaped "
        "like batch_spec (the batch the scheduler passes); fix batch_spec or step_fn.") from e


def check_batch(spec: Any, batch: Any, shardings: Any = None) -> None:
  """Raises ConfigurationError listing every leaf of ``batch`` that does not match ``spec``,
  and every jax.Array leaf committed to another layout than ``shardings`` (the compiled step's
  input shardings, a tree like ``spec``), which the compiled step would refuse."""
  _check_leaves(batch, "batch")
  spec_leaves, spec_tree = jax.tree.flatten(spec)
  leaves, tree = jax.tree.flatten(batch)
  if tree != spec_tree:
    raise errors.ConfigurationError(
        f"batch structure {tree} does not match the step's batch_spec structure {spec_tree}; "
        f"inject batches built like the batch_spec given to GraphScheduler.")
  problems = []
  paths = [jax.tree_util.keystr(p) or "batch" for p, _ in
           jax.tree_util.tree_flatten_with_path(spec)[0]]
  layouts = (jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
             if shardings is not None else [None] * len(spec_leaves))
  for path, want, got, layout in zip(paths, spec_leaves, leaves, layouts):
    shape, dtype = tuple(np.shape(got)), _dtype_of(got)
    if shape != tuple(want.shape) or dtype != want.dtype:
      problems.append(f"{path}: got {dtype}{list(shape)}, the step takes "
                      f"{want.dtype}{list(want.shape)}")
    elif (layout is not None and isinstance(got, jax.Array) and getattr(got, "committed", False)
          and not got.sharding.is_equivalent_to(layout, len(shape))):
      problems.append(f"{path}: laid out as {got.sharding}, the step was compiled for {layout}; "
                      "give batch_spec that layout (an example batch, or jax.ShapeDtypeStruct("
                      "shape, dtype, sharding=...)) or jax.device_put the batch onto it")
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        "batch does not fit the compiled step (reshape/cast it, or pad to the batch_spec):",
        problems))


def _run_step(compiled: Any, batch: Any) -> Any:
  """Runs the compiled step on one batch and waits for the result (the dispatcher's one call)."""
  return jax.block_until_ready(compiled(batch))


class _Dispatcher:
  """The queues, metrics and dispatcher thread of one GraphScheduler.

  The thread holds this object, never the GraphScheduler, so a scheduler dropped without
  ``shutdown()`` is collected; its finalizer closes this dispatcher, which runs the accepted
  batches and then ends the thread.
  """

  def __init__(self, compiled: Any, batch_spec: Any, *, latency_sla: float,
               preemption: PreemptionPolicy, low_latency_share: float, max_queue: int,
               latency_window: int, poll_interval: float, clock: Callable[[], float],
               prom: _PromMetrics | None):
    self.compiled = compiled
    self.batch_spec = batch_spec
    self.latency_sla = latency_sla
    self.preemption = preemption
    self.low_latency_share = low_latency_share
    self.max_queue = max_queue
    self.poll_interval = poll_interval
    self.clock = clock
    self.prom = prom
    self.steps_run = 0
    self.cv = threading.Condition()
    self.main: collections.deque[_Item] = collections.deque()
    self.low: list[tuple[float, int, _Item]] = []   # heap by deadline
    self.seq = itertools.count()
    self.closing = False
    self.close_prom_on_exit = False  # shutdown() from the dispatcher thread leaves it to run()
    self.closed_by = ""              # why work is refused: "shutdown", "collected", a failure
    self.failure: BaseException | None = None
    self.in_flight: _Item | None = None
    self.credit = 0.0
    self.released = 0.0
    self.latencies = {q: collections.deque(maxlen=latency_window) for q in QUEUES}
    self.counts = {q: collections.Counter() for q in QUEUES}
    self.preemption_episodes = 0
    self.low_p95: float | None = None   # refreshed when a low-latency batch finishes
    self.thread = threading.Thread(target=self.run, name="dtenjax-graph-scheduler", daemon=True)

  # ---- injection --------------------------------------------------------------------------

  def enqueue(self, batch: Any, queue: str, deadline: float | None,
              timeout: float) -> concurrent.futures.Future:
    check_batch(self.batch_spec, batch, self.compiled.input_shardings[0][0])
    item = _Item(batch, concurrent.futures.Future(), queue, _read_clock(self.clock), deadline)
    end = time.monotonic() + timeout
    with self.cv:
      while True:
        if self.closing:
          raise SchedulerClosedError(
              f"the scheduler is {self.closed_by or 'shut down'}; a {queue} batch was refused. "
              f"Create a new GraphScheduler to run more work.")
        depth = len(self.main) if queue == MAIN else len(self.low)
        if depth < self.max_queue:
          break
        if threading.current_thread() is self.thread:
          # A done-callback (they run on the dispatcher thread) cannot wait for room: only this
          # thread makes room, so waiting would stall every batch for the whole timeout.
          raise QueueFullError(
              f"the {queue} queue is full (max_queue={self.max_queue}) and this {queue} batch "
              "was offered from the scheduler's dispatcher thread (a future's done-callback), "
              "which cannot wait for room: only it makes room. Submit from another thread, or "
              "raise max_queue.")
        left = end - time.monotonic()
        if left <= 0:
          raise QueueFullError(
              f"the {queue} queue held max_queue={self.max_queue} batches for {timeout} s; "
              f"raise max_queue, pass a longer timeout, or inject more slowly.")
        self.cv.wait(left)
      if queue == MAIN:
        self.main.append(item)
      else:
        heapq.heappush(self.low, (deadline, next(self.seq), item))
      self.cv.notify_all()
    return item.future

  # ---- dispatch ---------------------------------------------------------------------------

  def next_item(self) -> _Item | None:
    """Chooses the next batch under the lock, or None after waiting poll_interval."""
    with self.cv:
      if not self.main and not self.low:
        self.cv.wait(self.poll_interval)
        if not self.main and not self.low:
          return None
      released = preemption_decision(self.preemption, len(self.low), self.low_p95)
      if released > 0 and self.released == 0:
        self.preemption_episodes += 1
      self.released = released
      share = low_latency_slot_share(self.low_latency_share, released)
      base_credit = min(self.credit + self.low_latency_share, 1.0 + self.low_latency_share)
      queue, self.credit = pick_queue(self.credit, share, bool(self.low), bool(self.main))
      if queue == LOW_LATENCY:
        item = self.in_flight = heapq.heappop(self.low)[2]   # the dispatcher owns it from here
        if released > 0 and self.main and base_credit < 1.0:
          # This slot belonged to the main queue and was released to the low-latency queue.
          self.counts[MAIN]["preemptions"] += 1
          self.counts[LOW_LATENCY]["preemptions"] += 1
          if self.prom:
            self.prom.preemptions.labels(MAIN).inc()
            self.prom.preemptions.labels(LOW_LATENCY).inc()
      else:
        item = self.in_flight = self.main.popleft()
      self.cv.notify_all()       # room for blocked injectors
      return item

  def run(self) -> None:
    try:
      self.dispatch_loop()
    except BaseException as e:
      # A failure on this thread must not leave a caller waiting: resolve the batch in flight and
      # every queued one with the failure, refuse new work, and say so in the log.
      self.fail_all(e)
      config.logger.error("dtenjax GraphScheduler: the dispatcher thread stopped (%s: %s); "
                          "every pending batch was failed with SchedulerClosedError.",
                          type(e).__name__, e, exc_info=e)
    finally:
      if self.prom and (self.closed_by == COLLECTED or self.close_prom_on_exit):
        self.prom.close()

  def fail_all(self, e: BaseException) -> None:
    with self.cv:
      self.failure = e
      self.closing = True
      self.closed_by = f"stopped: its dispatcher thread failed ({type(e).__name__}: {e})"
      pending = ([self.in_flight] if self.in_flight is not None else []) + list(self.main) + [
          entry[2] for entry in self.low]
      self.in_flight = None
      self.main.clear()
      self.low.clear()
      self.cv.notify_all()
    for item in pending:
      if item.future.done():
        continue
      err = SchedulerClosedError(
          f"the dispatcher thread stopped ({type(e).__name__}: {e}); this {item.queue} batch "
          f"did not complete. Create a new GraphScheduler to run more work.")
      err.__cause__ = e
      if item.future.running() or item.future.set_running_or_notify_cancel():
        item.future.set_exception(err)

  def dispatch_loop(self) -> None:
    while True:
      item = self.next_item()
      if item is None:
        with self.cv:
          if self.closing and not self.main and not self.low:
            return
        continue
      if not item.future.set_running_or_notify_cancel():
        with self.cv:
          self.in_flight = None
        continue
      try:
        out = _run_step(self.compiled, item.batch)
      except Exception as e:
        self.finish(item, error=e)
      else:
        self.finish(item, result=out)

  def finish(self, item: _Item, result: Any = None, error: BaseException | None = None) -> None:
    try:
      with self.cv:
        self.steps_run += 1
        done = _read_clock(self.clock)
        latency = done - item.injected
        missed = item.deadline is not None and done > item.deadline
        counts = self.counts[item.queue]
        counts["failed" if error else "completed"] += 1
        counts["deadline_misses"] += int(missed)
        self.latencies[item.queue].append(latency)
        stats = (percentiles(self.latencies[item.queue])
                 if self.prom or item.queue == LOW_LATENCY else None)
        if item.queue == LOW_LATENCY:
          self.low_p95 = stats["p95"]
      if self.prom:
        self.prom.observe(item.queue, latency, missed, error is not None, stats,
                          len(self.main), len(self.low), self.released)
    finally:
      # The batch ran: its caller gets the outcome even if the bookkeeping above failed.
      with self.cv:
        self.in_flight = None
      if error is not None:
        item.future.set_exception(error)
      else:
        item.future.set_result(result)

  # ---- metrics and lifecycle --------------------------------------------------------------

  def metrics(self) -> dict[str, QueueStats]:
    with self.cv:
      out = {}
      for q in QUEUES:
        c = self.counts[q]
        p = percentiles(self.latencies[q])
        depth = len(self.main) if q == MAIN else len(self.low)
        out[q] = QueueStats(c["completed"], c["failed"], c["deadline_misses"], c["preemptions"],
                            depth, p["p50"], p["p95"], p["p99"])
      return out

  def close(self, why: str) -> None:
    with self.cv:
      if not self.closing:
        self.closing = True
        self.closed_by = why
      self.cv.notify_all()


COLLECTED = "garbage-collected without shutdown()"


def _collected(dispatcher: _Dispatcher) -> None:
  """weakref.finalize callback of a GraphScheduler dropped without shutdown()."""
  dispatcher.close(COLLECTED)


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
      and the P95 rule use it. Tests pass a virtual clock that counts steps run. It is read once
      here and on every injection, and a reading that is not a finite number raises
      ConfigurationError there; one on the dispatcher thread stops it like any failure there.

  Every future resolves: with the step's output, the step's exception, or (if the dispatcher
  thread itself fails) a SchedulerClosedError naming the failure. A scheduler dropped without
  :meth:`shutdown` runs its accepted batches and then its thread exits (a finalizer closes it).
  """

  def __init__(self, step_fn: Callable[[Any], Any], *, batch_spec: Any,
               latency_sla: float = 0.120, preemption: PreemptionPolicy | None = None,
               low_latency_share: float = 0.125, max_queue: int = 1024,
               cuda_graphs: str | graphs.CudaGraphPolicy = "auto",
               metrics_port: int | None = None, latency_window: int = 2048,
               poll_interval: float = 0.05, clock: Callable[[], float] = time.monotonic):
    problems = [
        _number_problem("latency_sla", latency_sla, 0.0, MAX_WAIT_S, lo_open=True,
                        unit=" of seconds"),
        _number_problem("low_latency_share", low_latency_share, 0.0, 1.0, lo_open=True),
        _number_problem("max_queue", max_queue, 1, integer=True),
        _number_problem("latency_window", latency_window, 1, integer=True),
        _number_problem("poll_interval", poll_interval, 0.0, MAX_WAIT_S, lo_open=True,
                        unit=" of seconds")]
    if isinstance(low_latency_share, numbers.Real) and low_latency_share == 1.0:
      problems.append("low_latency_share=1.0 must be < 1 (the main queue needs a share)")
    if metrics_port is not None and _number_problem("metrics_port", metrics_port, 0, 65535,
                                                    integer=True):
      problems.append(f"metrics_port={metrics_port!r} must be None or an integer port in "
                      "[0, 65535] (0 picks a free one)")
    if preemption is not None and not isinstance(preemption, PreemptionPolicy):
      problems.append(f"preemption={preemption!r} must be a PreemptionPolicy or None")
    if not callable(step_fn):
      problems.append(f"step_fn={step_fn!r} must be callable")
    if not callable(clock):
      problems.append(f"clock={clock!r} must be callable (like time.monotonic)")
    else:
      try:
        _read_clock(clock)
      except errors.ConfigurationError as e:
        problems.append(str(e).rstrip("."))
    problems = [p for p in problems if p]
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid GraphScheduler:", problems))
    self.latency_sla = float(latency_sla)
    self.preemption = preemption or PreemptionPolicy()
    self.low_latency_share = float(low_latency_share)
    self.max_queue = max_queue
    self.poll_interval = float(poll_interval)
    self.batch_spec = _spec_of(batch_spec)
    self.step = graphs.jit(step_fn, cuda_graphs)
    compiled = _compile(self.step, self.batch_spec)
    prom = _PromMetrics(metrics_port) if metrics_port is not None else None
    self._d = _Dispatcher(
        compiled, self.batch_spec, latency_sla=self.latency_sla, preemption=self.preemption,
        low_latency_share=self.low_latency_share, max_queue=max_queue,
        latency_window=latency_window, poll_interval=self.poll_interval, clock=clock, prom=prom)
    self._finalizer = weakref.finalize(self, _collected, self._d)
    self._d.thread.start()

  def submit(self, batch: Any, *, timeout: float = 0.0) -> concurrent.futures.Future:
    """Queues a regular batch on the main queue. Waits up to ``timeout`` s for room."""
    return self._d.enqueue(batch, MAIN, None, _check_timeout("timeout", timeout))

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
    timeout = _check_timeout("timeout", timeout)
    now = _read_clock(self._d.clock)
    if deadline is None:
      deadline = now + self.latency_sla
    else:
      _check_number("deadline", deadline, -math.inf)
      if abs(deadline - now) > _DEADLINE_SPAN_S:
        raise errors.ConfigurationError(
            f"deadline={deadline!r} is {deadline - now:+.3g} s from the scheduler clock's now "
            f"({now:.6g}): it is a value of another clock (time.time()?). Pass "
            "time.monotonic() + seconds (the scheduler's clock), or None for now + latency_sla.")
    return self._d.enqueue(batch, LOW_LATENCY, float(deadline), timeout)

  def metrics(self) -> dict[str, QueueStats]:
    """Per-queue statistics now: {'main': QueueStats, 'low_latency': QueueStats}."""
    return self._d.metrics()

  @property
  def steps_run(self) -> int:
    """How many batches the dispatcher has finished (successfully or not)."""
    return self._d.steps_run

  @property
  def preemption_episodes(self) -> int:
    """How many times the policy went from releasing nothing to releasing capacity."""
    return self._d.preemption_episodes

  @property
  def metrics_address(self) -> tuple[str, int] | None:
    """(host, port) of the prometheus endpoint, or None."""
    return self._d.prom.address if self._d.prom else None

  @property
  def failure(self) -> BaseException | None:
    """The exception that stopped the dispatcher thread, or None while it is healthy."""
    return self._d.failure

  def shutdown(self, timeout: float = 60.0) -> None:
    """Stops accepting work, runs every accepted batch, and stops the dispatcher.

    Raises SchedulerTimeoutError if the accepted work does not finish within ``timeout`` s (the
    dispatcher keeps draining in the background; call shutdown again to keep waiting), and
    SchedulerClosedError if the dispatcher thread had failed (its pending batches were failed).
    """
    timeout = _check_timeout("timeout", timeout)
    self._d.close("shut down")
    if threading.current_thread() is self._d.thread:
      # From a done-callback: this thread is the dispatcher, which cannot wait for itself. Work
      # is refused from now on; the dispatcher runs what was accepted once the callback returns,
      # then exits (and closes the metrics endpoint).
      self._finalizer.detach()
      self._d.close_prom_on_exit = True
      return
    self._d.thread.join(timeout)
    if self._d.thread.is_alive():
      with self._d.cv:
        left = len(self._d.main) + len(self._d.low)
      raise SchedulerTimeoutError(
          f"shutdown waited {timeout} s for accepted batches to run; {left} are still queued "
          f"(plus one running). Call shutdown(timeout=...) again with a longer timeout.")
    self._finalizer.detach()
    if self._d.prom:
      self._d.prom.close()
    if self._d.failure is not None:
      e = self._d.failure
      raise SchedulerClosedError(
          f"the dispatcher thread had failed ({type(e).__name__}: {e}); the batches pending "
          f"then were failed with SchedulerClosedError.") from e

  def __enter__(self) -> GraphScheduler:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    if exc_type is None:
      self.shutdown()
      return
    try:        # an exception is already on its way: do not mask it with a shutdown error
      self.shutdown()
    except errors.DtenjaxError as e:
      config.logger.warning("dtenjax GraphScheduler: shutdown during an exception: %s", e)


class _PromMetrics:
  """prometheus_client metrics in a private registry, served on 127.0.0.1."""

  def __init__(self, port: int):
    try:
      import prometheus_client as pc
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
