"""A pipeline whose stages are separate programs in separate processes, joined by the host transport.

MPMD, as NVIDIA's JaxPP runs pipelines: each process owns one stage (one device per process) and
runs its chunks' forward and backward as jitted programs of its own (``jax.vjp`` of the stage's
``lax.scan`` over its layers); a Python loop walks the same timetable as the SPMD pipeline
(:func:`dtenjax._src.pipeline.schedule.timetable`: GPipe, 1F1B, interleaved) and, after each
tick, exchanges the tick's activations (to the next stage) and cotangents (to the previous one)
with its neighbours over :class:`dtenjax._src.net.pair.PairLink` (TCP, or RDMA verbs where the
provider table picks them). Nothing here is one program in lockstep: a stage waits only for the
messages it needs, so a tick in which a stage neither sends nor receives costs it nothing.

Why a loop of its own: a custom call that waits for a peer cannot sit inside XLA's lockstep loop
(on the simulated CPU devices of one process the devices' threads starve; docs/architecture.md,
"Measured constraints"), while a Python loop between jitted programs can wait on a socket.

What is bit-identical: every micro-batch goes through the same layer bodies (each stage a
``lax.scan`` over its layers, as the unpipelined loop's ``lax.scan`` over all of them), the
gradients of each chunk are summed in micro-batch order from zeros and divided by the number of
micro-batches, the loss likewise, the messages travel as their exact bytes. So the loss and the
gradients are those of the unpipelined gradient-accumulation loop (``tests/test_pipeline_host.py``
checks them against plain JAX in two processes, on CPU with ``--xla_cpu_max_isa=AVX`` as the SPMD
pipeline's bits are checked).

Links are made (and, per tick, exchanged over) in one global order of the stage pairs, so their
blocking handshakes and exchanges never wait in a circle. Every wait ends within the transport's
timeout (``timeout_s``, default ``DTENJAX_COLLECTIVE_TIMEOUT``) with an error naming the peer
stage, the micro-batches and the tick it waited for.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import errors
from dtenjax._src.net import pair
from dtenjax._src.pipeline import run
from dtenjax._src.pipeline import schedule as sched
from dtenjax._src.pipeline import transport

PyTree = Any
_F_SEND = (sched.F_FIRST, sched.F_MID)    # forwards whose output goes to the next stage
_B_SEND = (sched.B_MID, sched.B_LAST)     # backwards whose input cotangent goes to the previous one
_LOSS_TAG = 1 << 31                       # the tag of the exchange that hands the loss down


def _message_plan(table: sched.Timetable, stages: int) -> dict:
  """Per tick and per link ``(lo, hi)``: the messages it carries, in slot order, as
  ``(kind, sender stage, receiver stage)``; the same on every stage (computed from the table)."""
  p, plan = stages, {}
  for t in range(table.ticks):
    for a in range(p):
      if table.f_kind[t, a] in _F_SEND:
        plan.setdefault(t, {}).setdefault(tuple(sorted((a, (a + 1) % p))), []).append(
            ("F", a, (a + 1) % p))
      if table.b_kind[t, a] in _B_SEND:
        plan.setdefault(t, {}).setdefault(tuple(sorted((a, (a - 1) % p))), []).append(
            ("B", a, (a - 1) % p))
  return plan


class HostPipeline:
  """One stage of a pipeline run as separate programs over dtenjax's host transport.

  Every process calls ``HostPipeline(pipe)`` (collectively: it connects to its neighbour stages,
  blocking until they have too) and then, for each step, ``value_and_grad(layers, head, x,
  targets)`` with this stage's share of the weights, like the SPMD pipeline's arguments:

  * ``layers``: this stage's share of ``pipe.to_stages(stacked)`` (its chunks; leading dimension
    ``layers / stages``);
  * ``head``: the loss's parameters (used on the last stage only; pass them everywhere or
    ``None`` elsewhere);
  * ``x``: the first layer's input for the whole batch on the first stage; elsewhere ``x`` or a
    ``jax.ShapeDtypeStruct`` of it (a stage needs only the activation's shape and dtype);
  * ``targets``: handed to ``loss_fn`` per micro-batch on the last stage (``None`` elsewhere).

  Returns ``(loss, (dlayers, dhead, dx))``: the mean loss on every stage; ``dlayers`` this stage's
  gradients (shaped as ``layers``); ``dhead`` on the last stage and ``dx`` (the gradient of ``x``)
  on the first, ``None`` elsewhere. :meth:`loss` runs the forwards only. The links belong to
  the thread that made them: call from that thread. ``stage`` defaults to
  ``jax.process_index()`` (then the job needs one process per stage); ``timeout_s`` bounds every
  wait (default ``DTENJAX_COLLECTIVE_TIMEOUT``); ``name`` tells apart pipelines of one job;
  ``provider`` forces ``"tcp"`` or ``"verbs"`` (default: the provider table's choice,
  ``DTENJAX_TRANSPORT``); ``store`` is the coordination store the endpoints travel through
  (default: jax.distributed's). ``transport`` is the choice made, with the paths not taken.
  """

  def __init__(self, pipe, *, stage: int | None = None, timeout_s: float | None = None,
               name: str = "pipeline", store=None, provider: str | None = None):
    if not isinstance(pipe, run.Pipeline):
      raise errors.ConfigurationError(
          f"HostPipeline(pipe={pipe!r}): pass the value dtenjax.pipeline(body, loss_fn, "
          "stages=..., microbatches=..., schedule=...) returns")
    p = pipe.stages
    if p == 1:
      raise errors.ConfigurationError(
          "HostPipeline: a pipeline of one stage has no neighbour to send to: call its loss "
          "under jax.grad directly, or make the pipeline with stages >= 2")
    if stage is None:
      if jax.process_count() != p:
        raise errors.ConfigurationError(
            f"HostPipeline: the job has {jax.process_count()} processes but the pipeline "
            f"{p} stages; run one process per stage (jax.distributed.initialize(num_processes="
            f"{p}, ...)) or pass stage= explicitly")
      stage = jax.process_index()
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < p:
      raise errors.ConfigurationError(
          f"HostPipeline: stage={stage!r} must be an int in [0, {p}) (the pipeline has {p} "
          "stages)")
    if not isinstance(name, str) or not name:
      raise errors.ConfigurationError(f"HostPipeline: name={name!r} must be a non-empty str")
    self.pipe, self.stage, self.name = pipe, stage, name
    self.transport = transport.host_choice(p, jax.local_devices()[0].platform, provider)
    self._programs = _programs(pipe.body, pipe.loss_fn)
    context = f"{pipe.schedule!r} stages={p} microbatches={pipe.microbatches}"
    # Every link any tick of either table uses, made in one global order (no waits in a circle).
    needed = set()
    for backward in (True, False):
      for per_tick in _message_plan(sched.timetable(pipe.schedule, p, pipe.microbatches,
                                                    backward), p).values():
        needed.update(per_tick)
    needed.update((d, d + 1) for d in range(p - 1))     # the chain that hands the loss down
    self.links: dict[tuple[int, int], pair.PairLink] = {}
    try:
      for lo, hi in sorted(needed):
        if stage in (lo, hi):
          self.links[lo, hi] = pair.connect(
              name, stage, hi if stage == lo else lo, store=store, timeout_s=timeout_s,
              provider=provider, context=context)
    except BaseException:
      self.close()
      raise

  def __repr__(self) -> str:
    return (f"HostPipeline(stage {self.stage} of {self.pipe.stages}, {self.pipe.schedule!r}, "
            f"{self.pipe.microbatches} micro-batches, links {sorted(self.links)})")

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def close(self) -> None:
    """Closes this stage's links (a neighbour still waiting on one gets an error). A step that
    fails closes them too: make a new HostPipeline to go on."""
    for link in getattr(self, "links", {}).values():
      link.close()

  def value_and_grad(self, layers: PyTree, head: PyTree, x, targets: PyTree):
    """One training step's loss and gradients (see the class docstring)."""
    return self._guarded(layers, head, x, targets, backward=True)

  def loss(self, layers: PyTree, head: PyTree, x, targets: PyTree):
    """The mean loss over the micro-batches, running the forwards only."""
    return self._guarded(layers, head, x, targets, backward=False)[0]

  def _guarded(self, *args, backward):
    self._check(*args[:1], *args[2:])
    try:
      return self._run(*args, backward=backward)
    except BaseException:
      # A failed step leaves the links mid-exchange: close them, so that the neighbours waiting
      # on this stage fail at once (and theirs in turn) instead of at their timeouts.
      self.close()
      raise

  # --- the tick loop ------------------------------------------------------------------------------

  def _check(self, layers, x, targets):
    pipe, d = self.pipe, self.stage
    problems = []
    leaves = jax.tree.leaves(layers)
    local = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if not leaves or len(local) != 1 or None in local:
      problems.append(f"layers must be stacked arrays sharing one leading dimension, got "
                      f"{sorted(local, key=str)}")
    elif next(iter(local)) % pipe.schedule.virtual:
      problems.append(f"this stage holds {next(iter(local))} layers, which do not split into "
                      f"{pipe.schedule.virtual} virtual chunks: pick a schedule whose virtual "
                      "count divides each stage's layers")
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or not np.shape(x):
      problems.append(f"x must be an array (or, off the first stage, a jax.ShapeDtypeStruct) "
                      f"with the batch as leading dimension, got {type(x).__name__}")
    elif d == 0 and isinstance(x, jax.ShapeDtypeStruct):
      problems.append("x is a ShapeDtypeStruct on the first stage, which needs the input itself")
    else:
      batch = x.shape[0]
      if batch % pipe.microbatches:
        divisors = [n for n in range(1, batch + 1) if batch % n == 0]
        problems.append(f"microbatches={pipe.microbatches} does not divide the batch of {batch} "
                        f"rows: use one of {divisors}")
      elif d == pipe.stages - 1:
        for t in jax.tree.leaves(targets):
          if not np.ndim(t) or np.shape(t)[0] != batch:
            problems.append(f"every targets leaf needs the batch ({batch}) as leading "
                            f"dimension, got shape {np.shape(t)}")
            break
        if targets is None:
          problems.append("the last stage needs targets (it computes the loss)")
    if problems:
      raise errors.ConfigurationError(f"HostPipeline (stage {d}): " + "; ".join(problems))

  def _run(self, layers, head, x, targets, *, backward: bool):
    pipe, d, p = self.pipe, self.stage, self.pipe.stages
    v, mbs = pipe.schedule.virtual, pipe.microbatches
    prog = self._programs
    table = sched.timetable(pipe.schedule, p, mbs, backward)
    plan = _message_plan(table, p)
    chunks = [jax.tree.map(lambda a, i=i: a.reshape(v, a.shape[0] // v, *a.shape[1:])[i], layers)
              for i in range(v)]
    mb_shape = (x.shape[0] // mbs, *x.shape[1:])
    dtype = np.dtype(x.dtype)
    first, last = d == 0, d == p - 1
    xs = jnp.reshape(x, (mbs, *mb_shape)) if first else None
    split = lambda t: jax.tree.map(lambda a: jnp.reshape(a, (mbs, a.shape[0] // mbs,
                                                              *a.shape[1:])), t)
    ts = split(targets) if last else None
    acts: dict[tuple[int, int], Any] = {}      # (chunk, micro-batch) -> its input
    cts: dict[tuple[int, int], Any] = {}       # (chunk, micro-batch) -> its output's cotangent
    loss = jnp.zeros((), jnp.float32)
    grads = [jax.tree.map(run._zero_cotangent, c) for c in chunks] if backward else None
    dhead = jax.tree.map(run._zero_cotangent, head) if backward and last else None
    dxs = [None] * mbs
    pick = lambda tree, m: jax.tree.map(lambda a: a[m], tree)

    for t in range(table.ticks):
      out = {}
      kind, vc, m = int(table.f_kind[t, d]), int(table.f_chunk[t, d]), int(table.f_micro[t, d])
      if kind != sched.IDLE:
        h = xs[m] if first and vc == 0 else acts.pop((vc, m))
        if kind in _F_SEND:
          out["F"] = prog["forward"](chunks[vc], h)
        if backward:
          acts[vc, m] = h                       # kept for the backward's recomputation
        elif kind in (sched.F_LAST, sched.F_ONLY):
          loss = prog["add"](loss, prog["loss"](chunks[vc], head, h, pick(ts, m)))
      kind, vc, m = int(table.b_kind[t, d]), int(table.b_chunk[t, d]), int(table.b_micro[t, d])
      if backward and kind != sched.IDLE:
        h = acts.pop((vc, m))
        if kind in (sched.B_LAST, sched.B_ONLY):
          value, dp, dhd, dh = prog["backward_loss"](chunks[vc], head, h, pick(ts, m))
          loss = prog["add"](loss, value)
          dhead = prog["add"](dhead, dhd)
        else:
          dp, dh = prog["backward"](chunks[vc], h, cts.pop((vc, m)))
        grads[vc] = prog["add"](grads[vc], dp)
        if kind in _B_SEND:
          out["B"] = dh
        else:
          dxs[m] = dh
      self._exchange(t, table, plan.get(t, {}), out, acts, cts, mb_shape, dtype)

    loss = self._hand_down_loss(prog["scale"](loss, mbs))
    if not backward:
      return loss, None
    dlayers = jax.tree.map(lambda a, *g: run._zero_cotangent(a) if _is_float0(g[0]) else
                           jnp.reshape(jnp.stack(g), a.shape), layers,
                           *[prog["scale"](g, mbs) for g in grads])
    dx = prog["scale"](jnp.stack(dxs), mbs).reshape(x.shape) if first else None
    return loss, (dlayers, prog["scale"](dhead, mbs) if last else None, dx)

  def _exchange(self, t, table, per_link, out, acts, cts, mb_shape, dtype):
    """After tick ``t``: every link this stage has that carries messages in this tick, in the
    global order of links; received activations and cotangents go to their chunk's buffers."""
    p, d = self.pipe.stages, self.stage
    for key in sorted(per_link):
      if d not in key:
        continue
      link, msgs = self.links[key], per_link[key]
      slots = [pair.Slot(0 if s == key[0] else 1, mb_shape, dtype) for _, s, _ in msgs]
      mine = [np.asarray(out[k]) for k, s, _ in msgs if s == d]

      def describe(k, s, r):
        chunk = int(table.f_chunk[t, s] if k == "F" else table.b_chunk[t, s]) * p + s
        micro = int(table.f_micro[t, s] if k == "F" else table.b_micro[t, s])
        what = "activation" if k == "F" else "cotangent"
        return f"{what} of micro-batch {micro} from stage {s} (chunk {chunk}) to stage {r}"

      what = (f"stage {d} at tick {t} of {table.ticks}: " +
              "; ".join(describe(*msg) for msg in msgs))
      got = iter(link.exchange(slots, mine, tag=t, what=what))
      for k, s, r in msgs:
        if r != d:
          continue
        arrived = next(got)
        if k == "F":
          c = int(table.f_chunk[t, s]) * p + s + 1
          acts[c // p, int(table.f_micro[t, s])] = arrived
        else:
          c = int(table.b_chunk[t, s]) * p + s - 1
          cts[c // p, int(table.b_micro[t, s])] = arrived

  def _hand_down_loss(self, loss):
    """The last stage's loss to every stage, down the chain of links (highest pair first)."""
    p, d = self.pipe.stages, self.stage
    value = np.asarray(loss, np.float32).reshape(())
    slot = [pair.Slot(1, (), np.float32)]
    if d < p - 1:
      what = f"stage {d}: the step's loss from stage {d + 1} after the last tick"
      (value,) = self.links[d, d + 1].exchange(slot, [], tag=_LOSS_TAG, what=what)
    if d > 0:
      what = f"stage {d}: stage {d - 1} taking the step's loss after the last tick"
      self.links[d - 1, d].exchange(slot, [value], tag=_LOSS_TAG, what=what)
    return jnp.asarray(value)


@functools.lru_cache(maxsize=32)
def _programs(body, loss_fn) -> dict:
  """The jitted programs of one stage: a chunk's forward, its backward (recomputing the forward
  from the chunk's input, as the SPMD pipeline does), the last chunk's backward with the loss,
  the loss alone, and the accumulation arithmetic; shared by the pipelines of one model (and
  compiled once per shape)."""
  def stage(params, h):
    return lax.scan(functools.partial(run._checked_body, body), h, params)[0]

  def backward(params, h, ct):
    return jax.vjp(stage, params, h)[1](ct)

  def backward_loss(params, head, h, targets):
    value, pull = jax.vjp(lambda a, b, c: run._checked_loss(loss_fn(b, stage(a, c), targets)),
                          params, head, h)
    dp, dhead, dh = pull(jnp.ones_like(value))
    return value.astype(jnp.float32), dp, dhead, dh

  def loss(params, head, h, targets):
    return run._checked_loss(loss_fn(head, stage(params, h), targets)).astype(jnp.float32)

  add = jax.jit(lambda a, b: jax.tree.map(jnp.add, a, b))
  scale = jax.jit(lambda a, n: jax.tree.map(lambda g: g / n, a), static_argnums=1)
  return {"forward": jax.jit(stage), "backward": jax.jit(backward),
          "backward_loss": jax.jit(backward_loss), "loss": jax.jit(loss),
          "add": lambda a, b: _past_float0(lambda u, w: add(u, w[0]), a, b),
          "scale": lambda a, n: _past_float0(lambda u, _: scale(u, n), a, a)}


def _is_float0(a) -> bool:
  return getattr(a, "dtype", None) == jax.dtypes.float0


def _past_float0(fn, a, b):
  """``fn(leaves of a, [leaves of b])`` on the leaves whose ``b`` is not float0 (the cotangent
  of an integer leaf, which takes no arithmetic); the others keep ``a``'s."""
  la, tree = jax.tree.flatten(a)
  lb = jax.tree.leaves(b)
  keep = [i for i, x in enumerate(lb) if not _is_float0(x)]
  out = list(la)
  for i, y in zip(keep, fn([la[i] for i in keep], [[lb[i] for i in keep]])):
    out[i] = y
  return jax.tree.unflatten(tree, out)
