"""``stage``: pipeline parallelism over whole hosts. The layers of the step's scanned stack are
split into contiguous stages, one per position on the axis; the batch is replicated over it and
split into micro-batches that flow through the stages (:func:`dtenjax.pipeline`).

What it costs, per mesh (:func:`choose`, for each schedule and number of micro-batches):

* compute: the stack's products run ``1 / stages`` of the layers per device, stretched by the
  schedule's lockstep time (bubble) and by the forward every backward recomputes, both read from
  :func:`dtenjax.pipeline_cost` (``schedule.predict``), not from a second formula;
* communication: every tick sends one micro-batch's activation at the stage boundary to the next
  stage and its cotangent back (a collective-permute each), over the link the stage axis spans;
  blocking, since the next tick needs them;
* memory: the state of ``1 / stages`` of the layers; the micro-batch inputs the schedule holds
  (1F1B bounded by the stages, GPipe by the micro-batches) plus one chunk's residuals for one
  micro-batch and the stage's input and its gradient for the whole batch.

Only layer counts that split evenly are offered (``dtenjax.pipeline`` runs equal chunks): stage
counts that do not divide the stack's length are not tried, and the report says so.
"""

from __future__ import annotations

import dataclasses
import math

from dtenjax._src import tables
from dtenjax._src.pipeline import schedule as sched
from dtenjax._src.pricing import costmodel
from dtenjax._src.planning.roles.base import LeafContext
from dtenjax._src.planning.roles.base import MeshContext
from dtenjax._src.planning.roles.base import Option
from dtenjax._src.planning.roles.base import Role

AXIS = "stage"
SCHEDULES = (sched.OneFOneB(), sched.GPipe(), sched.Interleaved(2))
MAX_STAGES = 8           # timetables beyond this take too long to price in a plan's 2 s
MAX_MICRO_PER_STAGE = 4  # micro-batches tried: stages x 1, 2, 4 (and fewer when the batch is small)


def options(ctx: LeafContext, taken: frozenset[int]) -> list[Option]:
  """The stacked (layer) dimension of a leaf of the step's scanned stack, when it divides."""
  d = ctx.stacked
  if d is None or d in taken or ctx.shape[d] % ctx.size:
    return []
  n = ctx.shape[d]
  return [Option(d, "stage", f"pipeline: its {n} layers in {ctx.size} contiguous stages of "
                 f"{n // ctx.size} over 'stage'")]


def sizes(ctx: MeshContext) -> list[int]:
  """1, and stage counts dividing the stack's layers where each stage is one whole host (the
  axes inside it, fsdp x tensor, fill a host), so stages meet across the inter-host links."""
  out = [1]
  if ctx.layers > 1 and ctx.inner == ctx.per_host and ctx.n > ctx.per_host:
    out += [s for s in range(2, min(ctx.layers, MAX_STAGES) + 1)
            if ctx.layers % s == 0 and ctx.rest % s == 0]
  return out


def price(ctx) -> None:
  """A stacked leaf over 'stage': its products take the mesh's pipeline factor (bubble and the
  recomputed forward on ``1 / stages`` of the layers). Its gradient is complete only when the
  pipeline's loop ends (accumulated over the micro-batches), so its reduction over the batch axes
  is blocking, not hidden behind the backward; an FSDP weight is gathered in every forward and
  every backward a stage runs, once per micro-batch (the plain step: once per pass); one
  layer's gathered weight is its stage shard divided by the stage's layers."""
  pipe = ctx.m.pipeline
  if pipe is None:
    return
  pr = ctx.price
  pr.compute_scale = pipe.compute_scale
  pr.gathered_peak *= pipe.stages
  zero = [a for a in ("data", "fsdp") if a in ctx.used and ctx.m.size[a] > 1]
  if zero and not ctx.vocab_axes:
    key = "+".join(zero)
    times = 2 if ctx.use is not None and (ctx.use.remat or ctx.use.layers > 1) else 1
    gather = times * ctx.pricer("all_gather", ctx.grad, zero, ctx.dtype)
    sync = pr.overlappable.get(key, 0.0) - gather
    pr.overlappable[key] = gather * pipe.microbatches
    pr.blocking[key] = pr.blocking.get(key, 0.0) + sync
    kind = f"all_gather[{key}]"
    pr.bytes[kind] = pr.bytes.get(kind, 0.0) * pipe.microbatches
  for key in [k for k in pr.overlappable if not zero or k != "+".join(zero)]:
    pr.blocking[key] = pr.blocking.get(key, 0.0) + pr.overlappable.pop(key)


ROLE = Role(
    name=AXIS,
    splits_batch=False,
    shards="the layer dimension of every leaf of the step's scanned stack (contiguous stages)",
    collectives="per tick of the schedule, one micro-batch's activation to the next stage and its "
    "cotangent back (collective-permute), blocking",
    memory="the stack's state / stages; the micro-batch inputs the schedule holds",
    applied="not by plan.jit: the step is written with dtenjax.pipeline over the 'stage' axis "
    "(plan.pipeline gives stages, micro-batches and schedule)",
    options=options,
    price=price,
    sizes=sizes,
    mandatory=True,
)


# --- the pipeline of one mesh ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Candidate:
  """One schedule and number of micro-batches on a mesh, priced."""
  schedule: sched.Schedule
  microbatches: int
  cost: sched.PipelineCost     # dtenjax.pipeline_cost's numbers (bubble, ticks, inputs held)
  compute_s: float             # the stack's compute per step per device, lockstep
  send_s: float                # activation and cotangent sends per step, blocking
  activation_bytes: float      # per device, see the module docstring
  fits: bool

  @property
  def total_s(self) -> float:
    return self.compute_s + self.send_s


@dataclasses.dataclass(frozen=True)
class Choice:
  """The pipeline a mesh with a 'stage' axis runs: the candidate kept and all those priced."""
  stages: int
  layers: int
  chosen: Candidate
  tried: tuple[Candidate, ...]
  compute_scale: float         # on the stack's products' time (see price)
  send_bytes: float            # one message: one micro-batch's activation, per device
  link: str                    # the link class between neighbouring stages
  plain_compute_s: float       # the stack's compute per device unpipelined, same mesh

  @property
  def microbatches(self) -> int:
    return self.chosen.microbatches

  @property
  def schedule(self) -> sched.Schedule:
    return self.chosen.schedule


def _batch_rows(graph, bdiv: int) -> int:
  rows = [lf.shape[0] for lf in graph.leaves if lf.is_batch and lf.shape and
          lf.shape[0] % bdiv == 0 and "key" not in lf.dtype]
  return max(rows, default=0) // bdiv


def choose(graph, m, budget: float) -> Choice | None:
  """The schedule and micro-batches of the pipeline on mesh ``m`` (a CandidateMesh with a
  'stage' axis), or None when it cannot run one (no scanned stack, layers that do not split, a
  batch smaller than one row per micro-batch)."""
  p = m.size[AXIS]
  stack = graph.stack()
  if p <= 1 or stack is None:
    return None
  layers, leaves, carry = stack
  if layers % p:
    return None
  bdiv = math.prod(m.size[a] for a in ("data", "fsdp") if a in m.size)
  rows = _batch_rows(graph, bdiv)
  if rows < 1:
    return None
  t = m.size.get("tensor", 1)
  stacked = [graph.weights[i] for i in leaves if i in graph.weights]
  # the stack's products per device without stages (tensor parallelism splitting them), with
  # the products no weight reads (attention's scores) counted as the stack's
  rest = max(0.0, graph.flops - sum(u.flops for u in graph.weights.values()) -
             sum(graph.carried.values()))
  plain = (sum(u.flops for u in stacked) / t + rest) / bdiv / m.peak_flops
  # one layer's forward and backward in units of its forward, in the unpipelined step: forward
  # 1 + backward 2, plus 1 where jax.checkpoint recomputes the forward. The pipeline's backward
  # recomputes the stage's forward from its saved input and then runs the step's own backward:
  # ``units`` of a forward, after a forward of 1 (predict's defaults, 1 and 3, are a layer
  # without jax.checkpoint)
  units = 4.0 if any(u.remat for u in stacked) else 3.0
  group = m.group((AXIS,))
  link = m.topology.slowest_link(group)[0]
  state = sum(lf.nbytes for lf in graph.leaves if not lf.is_batch) / (
      p * m.size.get("fsdp", 1) * t)
  allowance = budget - 2 * state if budget else math.inf
  micro = sorted({k for k in (p, 2 * p, 4 * p) if rows % k == 0 and k <= MAX_MICRO_PER_STAGE * p}
                 | ({rows} if rows < p else set()))
  tried = []
  for mb in micro:
    msg = carry / bdiv / mb
    msg_s = costmodel.collective_time("ppermute", int(msg), group, m.topology)
    for s in SCHEDULES:
      if s.check(p, mb) or layers % (p * s.virtual):
        continue
      c = sched.predict(s, p, mb, forward=1.0, backward=units, input_bytes=msg)
      compute = c.time * plain / (units * p * mb)
      act = c.activation_bytes + graph.activation_bytes / bdiv / (p * mb) + 2 * carry / bdiv
      tried.append(Candidate(s, mb, c, compute, 2 * c.ticks * msg_s, act, act <= allowance))
  if not tried:
    return None
  fitting = [c for c in tried if c.fits] or sorted(tried, key=lambda c: c.activation_bytes)[:1]
  best = min(fitting, key=lambda c: (round(c.total_s, 12), c.activation_bytes))
  return Choice(p, layers, best, tuple(tried), best.compute_s / plain if plain else 1.0,
                carry / bdiv / best.microbatches, link, plain)


def lower_bound(pipe: Choice) -> float:
  """Seconds a step on the pipeline's mesh takes at least: the stack's compute (with tensor
  parallelism splitting all of it) and the sends; the rest of the step only adds."""
  return pipe.chosen.compute_s + pipe.chosen.send_s


def adjust(prob, graph) -> None:
  """The pipeline's terms of a problem on a mesh with stages (``prob.m.pipeline``): the stack's
  leaves laid out over 'stage' only, the products no weight reads stretched like the stack's,
  the sends as fixed blocking time, the activations as the schedule holds them."""
  pipe = prob.m.pipeline
  if pipe is None:
    return
  stack = graph.stack()
  leaves = stack[1] if stack is not None else {}
  for gi, g in enumerate(prob.groups):
    want = g[0] in leaves
    keep = [ci for ci, lay in enumerate(prob.cands[gi]) if (AXIS in lay.used()) == want]
    prob.cands[gi] = [prob.cands[gi][ci] for ci in keep]
    prob.prices[gi] = [prob.prices[gi][ci] for ci in keep]
  rest_scale = pipe.compute_scale
  prob.compute_s *= rest_scale
  prob.fixed_blocking[AXIS] = pipe.chosen.send_s
  prob.fixed_memory["activations"] = pipe.chosen.activation_bytes


def summary(pipe: Choice) -> list[str]:
  """The report's lines on a pipeline (see StepPlan.table)."""
  c = pipe.chosen
  lines = [f"pipeline: {pipe.layers} layers in {pipe.stages} stages of "
           f"{pipe.layers // pipe.stages} over 'stage' ({pipe.link}), {c.microbatches} "
           f"micro-batches, {c.schedule!r}: bubble {c.cost.bubble:.3f}, {c.cost.ticks} ticks, "
           f"{c.cost.live_inputs} inputs held; the stack's compute per device "
           f"{c.compute_s * 1e3:.3f} ms (every layer on one device for the same batch: "
           f"{pipe.plain_compute_s * 1e3:.3f} ms); sends "
           f"{2 * c.cost.ticks} x {pipe.send_bytes / 2**20:.3f} MiB = {c.send_s * 1e3:.3f} ms"]
  rows = [[("*" if k is c else " ") + repr(k.schedule), k.microbatches, f"{k.cost.bubble:.3f}",
           k.cost.ticks, f"{k.compute_s * 1e3:.3f}", f"{k.send_s * 1e3:.3f}",
           f"{k.activation_bytes / 2**30:.3f}" + ("" if k.fits else "  does not fit")]
          for k in pipe.tried]
  table = tables.render(["schedule", "micro", "bubble", "ticks", "compute ms", "sends ms",
                         "act GiB"], rows)
  lines += ["  " + line for line in table.splitlines()]
  return lines
