"""Pipeline schedules as values, the timetable each one runs, and what it costs.

A pipeline of ``stages`` devices along a mesh axis runs the layers of a model split into
``stages * virtual`` contiguous *chunks*; chunk ``c`` lives on device ``c % stages`` (so with
``virtual > 1`` each device holds several chunks, round robin, as in Megatron's interleaved and
MaxText's circular pipelines). The batch is split into ``microbatches``. Every micro-batch ``m``
goes forward through the chunks in order (``F(c, m)``) and its cotangent goes back (``B(c, m)``).

A schedule is the order in which each device runs its ``F`` and ``B`` actions:

* :class:`GPipe` -- every forward, then every backward (each in micro-batch order). A device holds
  the inputs of all its micro-batches at once.
* :class:`OneFOneB` -- ``2 (stages - 1 - d)`` forwards to fill the pipe (a message takes a tick
  to the neighbour, so the first backward returns after a round trip), then one forward and one
  backward per tick: device ``d`` holds at most ``2 (stages - d) - 1`` micro-batch inputs,
  whatever the number of micro-batches.
* :class:`Interleaved` -- 1F1B over ``virtual`` chunks per device (Megatron's interleaved
  schedule): the bubble shrinks by ``virtual``; it needs ``microbatches % stages == 0``.

:func:`timetable` turns a schedule into the static table the pipelined step runs: per device per
*tick* at most one forward and then one backward, taken in the schedule's order as soon as their
inputs have arrived (one tick after the neighbour produced them; the last chunk's backward may
follow its own forward in the same tick, since that forward only keeps its input). Every device
runs in lockstep (one SPMD program), so a tick lasts as long as its slowest device's work.
:func:`predict` prices that table -- bubble fraction, time in units of a forward, and the peak
number of micro-batch inputs each device holds -- as a pure function of the numbers, so a planner
can weigh schedules without compiling anything.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import NamedTuple

import numpy as np

from dtenjax._src import errors

# Action codes of the timetable (the pipelined step dispatches on them with lax.switch). Each
# tick a device runs at most one forward (F_*) and then at most one backward (B_*).
IDLE = 0
F_MID = 1      # a middle chunk: input received from the left, output sent right
F_FIRST = 2    # the first chunk: the input is the micro-batch itself
F_LAST = 3     # the last chunk: only keeps its input (its backward recomputes it with the loss)
F_ONLY = 4     # a single chunk: first and last
B_MID = 1
B_FIRST = 2    # the first chunk: the input's cotangent is a result
B_LAST = 3     # the last chunk: the loss seeds the cotangent
B_ONLY = 4
CODES = 5


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The order in which pipeline stages run forwards and backwards (see the module docstring).

  Use :class:`GPipe`, :class:`OneFOneB` or :class:`Interleaved`.
  """

  @property
  def virtual(self) -> int:
    """Chunks (virtual stages) per device."""
    return 1

  def orders(self, stages: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Per device, its actions in order: ``("F" or "B", virtual chunk v, micro-batch m)``."""
    raise NotImplementedError

  def theory_bubble(self, stages: int, microbatches: int) -> float:
    """The textbook bubble fraction: ``(p - 1) / (v m + p - 1)``."""
    p, m, v = stages, microbatches, self.virtual
    return (p - 1) / (v * m + p - 1)

  def check(self, stages: int, microbatches: int) -> list[str]:
    """What is wrong with running this schedule on these numbers (empty: nothing)."""
    return []


@dataclasses.dataclass(frozen=True)
class GPipe(Schedule):
  """All forwards, then all backwards: 1F1B's bubble, an input held for every micro-batch."""

  def orders(self, stages, microbatches):
    return [[("F", 0, m) for m in range(microbatches)] + [("B", 0, m) for m in range(microbatches)]
            for _ in range(stages)]


@dataclasses.dataclass(frozen=True)
class OneFOneB(Schedule):
  """One forward, one backward (PipeDream-flush): fewer than ``2 stages`` inputs held."""

  def orders(self, stages, microbatches):
    out = []
    for d in range(stages):
      warm = min(2 * (stages - 1 - d), microbatches)
      order = [("F", 0, m) for m in range(warm)]
      for i in range(microbatches - warm):
        order += [("F", 0, warm + i), ("B", 0, i)]
      order += [("B", 0, m) for m in range(microbatches - warm, microbatches)]
      out.append(order)
    return out


@dataclasses.dataclass(frozen=True)
class Interleaved(Schedule):
  """Interleaved 1F1B over ``virtual`` chunks per device (layers assigned round robin)."""
  virtual_stages: int = 2

  def __init__(self, virtual: int = 2):
    if not isinstance(virtual, (int, np.integer)) or isinstance(virtual, bool) or virtual < 1:
      raise errors.ConfigurationError(
          f"Interleaved(virtual={virtual!r}): virtual is the number of chunks per device, an int "
          ">= 1 (2 halves the bubble of OneFOneB)")
    object.__setattr__(self, "virtual_stages", int(virtual))

  def __repr__(self):
    return f"Interleaved(virtual={self.virtual_stages})"

  @property
  def virtual(self) -> int:
    return self.virtual_stages

  def check(self, stages, microbatches):
    if stages > 1 and microbatches % stages:
      return [f"Interleaved needs microbatches ({microbatches}) to be a multiple of stages "
              f"({stages}): use {-(-microbatches // stages) * stages} micro-batches, or OneFOneB()"]
    return []

  def orders(self, stages, microbatches):
    p, v, total = stages, self.virtual_stages, microbatches * self.virtual_stages

    def unit(k, forward):        # Megatron's order: groups of p micro-batches per chunk
      chunk = (k % (p * v)) // p
      m = (k // (p * v)) * p + k % p
      return ("F" if forward else "B", chunk if forward else v - 1 - chunk, m)

    out = []
    for d in range(p):
      warm = min((p - 1 - d) * 2 + (v - 1) * p, total)
      order = [unit(k, True) for k in range(warm)]
      for i in range(total - warm):
        order += [unit(warm + i, True), unit(i, False)]
      order += [unit(k, False) for k in range(total - warm, total)]
      out.append(order)
    return out


class Timetable(NamedTuple):
  """The static table a pipelined step runs (int32 arrays of shape ``[ticks, stages]``).

  Per tick and device: the forward it runs (``f_kind`` a code above, ``f_chunk`` its virtual
  chunk, ``f_micro`` its micro-batch) and then the backward (``b_*`` likewise); at the start of
  the tick, whether an activation arrives from the left (``recv_f``) or a cotangent from the
  right (``recv_b``), and for which virtual chunk and micro-batch. A micro-batch's input is kept
  in slot ``m % activation_slots`` of its chunk's buffer and its output cotangent in slot
  ``m % cotangent_slots``: the sizes are the most micro-batches live at once in one chunk.
  """
  f_kind: np.ndarray
  f_chunk: np.ndarray
  f_micro: np.ndarray
  b_kind: np.ndarray
  b_chunk: np.ndarray
  b_micro: np.ndarray
  recv_f: np.ndarray
  recv_f_chunk: np.ndarray
  recv_f_micro: np.ndarray
  recv_b: np.ndarray
  recv_b_chunk: np.ndarray
  recv_b_micro: np.ndarray
  activation_slots: int
  cotangent_slots: int
  live_inputs: tuple      # per device: the most micro-batch inputs it held at once (all chunks)

  @property
  def ticks(self) -> int:
    return int(self.f_kind.shape[0])


def check(schedule, stages, microbatches, layers=None, batch=None) -> None:
  """Raises ConfigurationError listing every number that does not fit the schedule."""
  problems = []
  if not isinstance(schedule, Schedule):
    problems.append(f"schedule={schedule!r} is not a schedule: pass GPipe(), OneFOneB() or "
                    "Interleaved(virtual=2)")
  for name, value in (("stages", stages), ("microbatches", microbatches)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      problems.append(f"{name}={value!r} must be an int >= 1")
  if problems:
    raise errors.ConfigurationError("; ".join(problems))
  problems += schedule.check(stages, microbatches)
  chunks = stages * schedule.virtual
  if layers is not None and layers % chunks:
    near = [n for n in range(1, layers + 1) if layers % (n * schedule.virtual) == 0]
    problems.append(
        f"{layers} layers do not split into {stages} stages x {schedule.virtual} virtual chunks "
        f"({chunks} equal chunks): use stages in {near}, or a layer count divisible by {chunks}")
  if batch is not None and batch % microbatches:
    divisors = [n for n in range(1, batch + 1) if batch % n == 0]
    problems.append(f"microbatches={microbatches} does not divide the batch of {batch} rows: use "
                    f"one of {divisors}, or pad the batch to a multiple of {microbatches}")
  if problems:
    raise errors.ConfigurationError("pipeline: " + "; ".join(problems))


@functools.lru_cache(maxsize=256)
def timetable(schedule: Schedule, stages: int, microbatches: int, backward: bool = True
              ) -> Timetable:
  """The lockstep table of ``schedule`` (``backward=False``: its forwards only, for a loss that
  is not differentiated)."""
  check(schedule, stages, microbatches)
  p, v, mb = stages, schedule.virtual, microbatches
  chunks = p * v
  orders = schedule.orders(p, mb)
  if not backward:
    orders = [[a for a in o if a[0] == "F"] for o in orders]
  pos = [0] * p
  done: dict[tuple[str, int, int], int] = {}      # (F/B, chunk, m) -> tick it ran
  rows = []
  t = 0

  def ready(a, d):
    kind, vv, m = a
    c = vv * p + d
    if kind == "F":
      return c == 0 or done.get(("F", c - 1, m), t) < t
    if c == chunks - 1:     # the last chunk's forward only keeps its input: same tick is fine
      return done.get(("F", c, m), t + 1) <= t
    return done.get(("F", c, m), t) < t and done.get(("B", c + 1, m), t) < t

  while any(pos[d] < len(orders[d]) for d in range(p)):
    row = []
    for d in range(p):                 # the next action, and the one after it if of the other kind
      taken = []
      for a in orders[d][pos[d]:pos[d] + 2]:
        if ready(a, d) and all(a[0] != b[0] for b in taken):
          taken.append(a)
          done[(a[0], a[1] * p + d, a[2])] = t
        else:
          break
      row.append(taken)
      pos[d] += len(taken)
    if not any(row):
      raise errors.ConfigurationError(f"{schedule!r} deadlocks on {p} stages x {mb} micro-batches")
    rows.append(row)
    t += 1
  ticks = len(rows)

  # Live spans of each chunk's buffered inputs and output cotangents, in ticks [arrive, free].
  def arrive_f(c, m):
    return done[("F", c, m)] if c == 0 else done[("F", c - 1, m)] + 1

  def free_f(c, m):
    return done[("B", c, m)] if backward else done[("F", c, m)]

  def most_live(spans) -> int:         # most of the spans [a, f] covering one tick of the table
    edges = [0] * (ticks + 1)
    for a, f in spans:
      a, f = max(a, 0), min(f, ticks - 1)
      if a <= f:
        edges[a] += 1
        edges[f + 1] -= 1
    return max(itertools.accumulate(edges[:ticks]))

  def window(arrive, free, c):        # most micro-batches live at once in one chunk's buffer
    return most_live((arrive(c, m), free(c, m)) for m in range(mb))

  act_slots = max(window(arrive_f, free_f, c) for c in range(chunks))
  live = [most_live((arrive_f(vv * p + d, m), free_f(vv * p + d, m))
                    for vv in range(v) for m in range(mb)) for d in range(p)]
  ct_slots = 1
  if backward and chunks > 1:
    ct_slots = max(window(lambda c, m: done[("B", c + 1, m)] + 1, lambda c, m: done[("B", c, m)], c)
                   for c in range(chunks - 1))

  arr = {k: np.zeros((ticks, p), np.int32) for k in Timetable._fields[:12]}
  for tt, row in enumerate(rows):
    for d, taken in enumerate(row):
      for kind, vv, m in taken:
        c = vv * p + d
        first, last = c == 0, c == chunks - 1
        code = F_ONLY if first and last else F_FIRST if first else F_LAST if last else F_MID
        x = kind.lower()
        arr[f"{x}_kind"][tt, d], arr[f"{x}_chunk"][tt, d], arr[f"{x}_micro"][tt, d] = code, vv, m
        if tt + 1 < ticks and kind == "F" and not last:
          r = (d + 1) % p
          arr["recv_f"][tt + 1, r], arr["recv_f_chunk"][tt + 1, r] = 1, (c + 1) // p
          arr["recv_f_micro"][tt + 1, r] = m
        if tt + 1 < ticks and kind == "B" and not first:
          r = (d - 1) % p
          arr["recv_b"][tt + 1, r], arr["recv_b_chunk"][tt + 1, r] = 1, (c - 1) // p
          arr["recv_b_micro"][tt + 1, r] = m
  return Timetable(**arr, activation_slots=act_slots, cotangent_slots=ct_slots,
                   live_inputs=tuple(live))


class PipelineCost(NamedTuple):
  """What :func:`predict` says a schedule costs (pure numbers; see its docstring)."""
  schedule: Schedule
  stages: int
  microbatches: int
  ticks: int
  time: float                  # lockstep time, in units of one forward of a whole stage
  busy: float                  # a device's own work in the same units: m (forward + backward)
  bubble: float                # 1 - busy / time
  theory_bubble: float         # (p - 1) / (v m + p - 1)
  live_inputs: int             # most micro-batch inputs one device holds at once
  activation_bytes: float      # live_inputs x bytes of one micro-batch's stage input

  def row(self) -> list:
    return [repr(self.schedule), self.stages, self.microbatches, self.ticks,
            f"{self.bubble:.3f}", f"{self.theory_bubble:.3f}", self.live_inputs]


def predict(schedule: Schedule, stages: int, microbatches: int, *, forward: float = 1.0,
            backward: float = 3.0, input_bytes: float = 0.0) -> PipelineCost:
  """Prices ``schedule`` on ``stages`` x ``microbatches`` without compiling anything.

  ``forward`` and ``backward`` are the times of one micro-batch through one *whole stage* (all
  its layers; a chunk takes ``1 / virtual`` of it). The default ``backward=3`` is the pipelined
  step's: its backward recomputes the stage's forward from the saved input (1) and then runs the
  backward proper (about 2). Every tick lasts as long as the slowest action of any device (one
  SPMD program in lockstep); in a tick a device runs a forward and a backward, so 1F1B's steady
  state keeps every device busy. ``input_bytes`` (one micro-batch's activation at a stage
  boundary) turns the peak count of held inputs into bytes; the step also holds one chunk's
  residuals while it runs a backward.
  """
  # Checked here, not only in timetable: its cache would answer stages=4.0 with the table of 4.
  check(schedule, stages, microbatches)
  problems = []
  for name, value in (("forward", forward), ("backward", backward), ("input_bytes", input_bytes)):
    if (not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool)
        or not math.isfinite(value) or value < 0):
      problems.append(f"{name}={value!r} must be a finite number >= 0")
  if not problems and forward + backward <= 0:
    problems.append(f"forward={forward!r} and backward={backward!r}: one must be > 0")
  if problems:
    raise errors.ConfigurationError("pipeline_cost: " + "; ".join(problems))
  table = timetable(schedule, stages, microbatches)
  v = schedule.virtual
  f_cost = np.array([0, 1, 1, 0, 0]) * (forward / v)      # F_LAST only keeps its input
  b_cost = np.array([0, 1, 1, 1, 1]) * (backward / v)
  work = f_cost[table.f_kind] + b_cost[table.b_kind]
  time = float(work.max(axis=1).sum())
  # The busiest device's own work: m (forward + backward) wherever a stage runs forwards of its
  # own, less on a single stage, whose forwards all belong to the last chunk (its backward
  # recomputes them), so its bubble is 0, never negative.
  busy = float(work.sum(axis=0).max())
  live = max(table.live_inputs)
  return PipelineCost(schedule, stages, microbatches, table.ticks, time, busy, 1 - busy / time,
                      schedule.theory_bubble(stages, microbatches), live, live * input_bytes)
