"""The pipelined loss: a scanned stack of layers run as a pipeline over a ``stage`` mesh axis.

One SPMD program (as MaxText's pipeline): inside ``jax.shard_map`` over a mesh with a ``stage``
axis, device ``d`` of that axis holds the layers of its chunks (``Pipeline.to_stages`` orders a
stacked ``[layers, ...]`` weight so that ``P("stage")`` on its leading dimension gives each device
its chunks). A ``lax.scan`` over the schedule's ticks (:func:`schedule.timetable`) runs, per tick
and device, at most one forward and one backward of a chunk on a micro-batch; activations go to
the next device and cotangents to the previous one with ``lax.ppermute``. Gradients are
accumulated per device in micro-batch order.

Differentiation: the pipelined loss is a ``jax.custom_vjp``. Under ``jax.grad`` its forward rule
runs the whole schedule (forwards and backwards interleaved: that is what bounds 1F1B's memory)
and keeps the gradients; the backward rule scales them by the incoming cotangent (exact for the
usual ``1.0``). Undifferentiated, it runs the forwards only. A backward recomputes its chunk's
forward from the chunk's saved input (``jax.vjp`` there), so a device holds one micro-batch input
per live micro-batch and one chunk's residuals at a time.

What is bit-identical: the loss ``sum_m loss_m / M`` and the gradients ``(sum_m grad_m) / M``,
both summed in micro-batch order, are what a gradient-accumulation loop over the same
micro-batches computes with ``lax.scan`` over the same layers; each micro-batch's computation is
the same chain of layer bodies. ``tests/test_pipeline.py`` checks the bits on 2, 4 and 8 stages
for every schedule (with ``--xla_cpu_max_isa=AVX``, as ``reproducible_step`` asks).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src import tables
from dtenjax._src.pipeline import schedule as sched
from dtenjax._src.pipeline import transport

PyTree = Any


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """A pipelined loss over a mesh axis; make it with :func:`dtenjax.pipeline`.

  Call it inside ``jax.shard_map`` (manual over ``axis``) as
  ``loss = pipe(layers, head, x, targets)``:

  * ``layers``: this device's share of the stacked layer weights (leading dimension
    ``layers / stages``), as ``P(axis)`` on the leading dimension of ``pipe.to_stages(stacked)``
    gives it;
  * ``head``: the loss's own parameters (a pytree; may be empty), the same on every stage;
  * ``x``: the batch's input to the first layer ``[batch, ...]``; ``targets``: a pytree whose
    leaves have the batch as their leading dimension, handed to ``loss_fn`` per micro-batch.

  Returns the mean of ``loss_fn`` over the micro-batches, the same on every stage; ``jax.grad``
  gives the gradients of ``layers``, ``head`` and ``x``.
  """
  body: Callable
  loss_fn: Callable
  stages: int
  microbatches: int
  schedule: sched.Schedule
  axis: str = "stage"

  def __post_init__(self):
    sched.check(self.schedule, self.stages, self.microbatches)
    if not callable(self.body) or not callable(self.loss_fn):
      raise errors.ConfigurationError(
          f"pipeline(body={self.body!r}, loss_fn={self.loss_fn!r}): both must be callables, "
          "body(h, layer) -> (h, _) as for lax.scan and loss_fn(head, h, targets) -> scalar")
    if not isinstance(self.axis, str):
      raise errors.ConfigurationError(
          f"axis={self.axis!r} must be one mesh axis name, e.g. 'stage'")

  @property
  def chunks(self) -> int:
    return self.stages * self.schedule.virtual

  # --- layout -------------------------------------------------------------------------------------

  def to_stages(self, stacked: PyTree) -> PyTree:
    """Stacked layer weights ``[layers, ...]`` (layer order) reordered so that splitting the
    leading dimension evenly over the ``stage`` axis gives device ``d`` its chunks
    ``d, d + stages, ...`` in order. The identity unless the schedule is interleaved."""
    n = self._layers(stacked, "to_stages")
    v, p = self.schedule.virtual, self.stages
    if v == 1:      # nothing moves (and no reshape, which Explicit mesh axes would refuse)
      return stacked
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, p, n // (v * p), *a.shape[1:]), 0, 1)
                        .reshape(a.shape), stacked)

  def from_stages(self, staged: PyTree) -> PyTree:
    """The inverse of :meth:`to_stages`: back to layer order (for gradients, checkpoints)."""
    n = self._layers(staged, "from_stages")
    v, p = self.schedule.virtual, self.stages
    if v == 1:
      return staged
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(p, v, n // (v * p), *a.shape[1:]), 0, 1)
                        .reshape(a.shape), staged)

  def _layers(self, stacked, what) -> int:
    leaves = jax.tree.leaves(stacked)
    sizes = sorted({np.shape(a)[0] if np.ndim(a) else None for a in leaves}, key=str)
    if not leaves or len(sizes) != 1 or sizes[0] is None:
      raise errors.ConfigurationError(
          f"{what}: the stacked layers must be a non-empty pytree of arrays sharing one leading "
          f"(layer) dimension, got leading dimensions {sizes}")
    sched.check(self.schedule, self.stages, self.microbatches, layers=sizes[0])
    return sizes[0]

  # --- prices and report -------------------------------------------------------------------------

  def cost(self, *, forward: float = 1.0, backward: float = 3.0, input_bytes: float = 0.0
           ) -> sched.PipelineCost:
    """:func:`dtenjax.pipeline_cost` for this pipeline's numbers."""
    return sched.predict(self.schedule, self.stages, self.microbatches, forward=forward,
                         backward=backward, input_bytes=input_bytes)

  def report(self) -> str:
    """The schedule, its timetable's size and its predicted bubble and held inputs."""
    c, t = self.cost(), sched.timetable(self.schedule, self.stages, self.microbatches)
    return tables.render(
        ["schedule", "stages", "microbatches", "ticks", "bubble", "theory", "inputs held"],
        [c.row()], title=f"pipeline over axis {self.axis!r}: {self.chunks} chunks, "
        f"buffers of {t.activation_slots} inputs and {t.cotangent_slots} cotangents per chunk")

  def __str__(self):
    return self.report()

  # --- the call ----------------------------------------------------------------------------------

  def __call__(self, layers: PyTree, head: PyTree, x, targets: PyTree):
    self._check_call(layers, x, targets)

    @jax.custom_vjp
    def loss(layers, head, x, targets):
      return _execute(self, layers, head, x, targets, backward=False)[0]

    def fwd(layers, head, x, targets):
      value, grads = _execute(self, layers, head, x, targets, backward=True)
      return value, grads

    def bwd(grads, g):
      dlayers, dhead, dx = grads
      scale = lambda t: jax.tree.map(lambda a: (a * g.astype(a.dtype)).astype(a.dtype), t)
      return (_like(scale(dlayers), layers), _like(scale(dhead), head), _like(scale(dx), x),
              jax.tree.map(_zero_cotangent, targets))

    loss.defvjp(fwd, bwd)
    return loss(layers, head, x, targets)

  def _check_call(self, layers, x, targets):
    sizes = jaxapi.bound_axis_sizes()
    problems = []
    if self.axis not in sizes:
      raise errors.MeshError(
          f"pipeline: axis {self.axis!r} is not a mesh axis of the enclosing jax.shard_map "
          f"(axes here: {sorted(sizes) or 'none'}): call the pipeline inside jax.shard_map over a "
          f"mesh with a {self.axis!r} axis of size {self.stages}, e.g. "
          f"jax.make_mesh(({self.stages}, n), ({self.axis!r}, 'data')), or pass axis= the name "
          "of your stage axis")
    if not jaxapi.vma_checked():
      raise errors.ConfigurationError(
          "pipeline: the enclosing jax.shard_map has check_vma=False; the pipeline relies on its "
          "types to sum the gradients of stage-replicated inputs (head, x) over the stage axis: "
          "use jax.shard_map's default check_vma=True")
    if sizes[self.axis] != self.stages:
      problems.append(f"the mesh axis {self.axis!r} has {sizes[self.axis]} devices but "
                      f"stages={self.stages}: make them equal")
    leaves = jax.tree.leaves(layers)
    local = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if not leaves or len(local) != 1 or None in local:
      problems.append(f"layers must be stacked arrays sharing one leading dimension, got {local}")
    elif next(iter(local)) % self.schedule.virtual:
      n = next(iter(local))
      problems.append(
          f"this device holds {n} layers, which do not split into {self.schedule.virtual} virtual "
          f"chunks: the model's {n * self.stages} layers must split into {self.chunks} equal "
          "chunks (pick stages/virtual dividing the layer count)")
    batch = np.shape(x)[0] if np.ndim(x) else None
    for t in jax.tree.leaves(targets):
      if not np.ndim(t) or np.shape(t)[0] != batch:
        problems.append(f"every targets leaf needs the batch ({batch}) as leading dimension, "
                        f"got shape {np.shape(t)}")
        break
    mesh = jaxapi.concrete_mesh()
    if mesh is not None and self.axis in mesh.axis_names:
      choice = transport.choose(mesh, self.axis)
      if choice.path == "host":
        problems.append(f"{choice.reason}. The host path runs each stage as programs of its own, "
                        "not inside jax.shard_map: call dtenjax.HostPipeline(pipe) in each "
                        "process (one device per stage) instead")
      elif choice.path == "none":
        problems.append(choice.reason)
    if problems:
      raise errors.ConfigurationError("pipeline: " + "; ".join(problems))
    sched.check(self.schedule, self.stages, self.microbatches, batch=batch)


def pipeline(body: Callable, loss_fn: Callable, *, stages: int, microbatches: int,
             schedule: sched.Schedule = sched.OneFOneB(), axis: str = "stage") -> Pipeline:
  """A pipelined loss over the mesh axis ``axis`` (see :class:`Pipeline` for the call).

  Args:
    body: one layer, as ``lax.scan`` takes it: ``body(h, layer_params) -> (h, _)``; ``h`` keeps
      its shape and dtype (it is what stages send each other).
    loss_fn: ``loss_fn(head, h, targets) -> scalar``: the loss of one micro-batch from the last
      layer's output (the final norm, unembedding and cross-entropy, say).
    stages: the size of the ``axis`` mesh axis.
    microbatches: how many micro-batches the (per-device) batch is split into; it must divide it.
    schedule: ``OneFOneB()`` (the default), ``GPipe()`` or ``Interleaved(virtual=2)``.
    axis: the mesh axis the stages lie along.
  """
  return Pipeline(body, loss_fn, stages, microbatches, schedule, axis)


def pipeline_cost(stages: int, microbatches: int, schedule: sched.Schedule = sched.OneFOneB(), *,
                  forward: float = 1.0, backward: float = 3.0, input_bytes: float = 0.0
                  ) -> sched.PipelineCost:
  """Predicted bubble fraction, lockstep time and held micro-batch inputs of a schedule: a pure
  function of the numbers (no devices, no compilation), for planners. See
  :func:`dtenjax._src.pipeline.schedule.predict`."""
  return sched.predict(schedule, stages, microbatches, forward=forward, backward=backward,
                       input_bytes=input_bytes)


# --- the executor -------------------------------------------------------------------------------

def _zero_cotangent(t):
  if jnp.issubdtype(jnp.result_type(t), jnp.inexact):
    return jnp.zeros_like(t)
  return np.zeros(np.shape(t), jax.dtypes.float0)


def _like(ct, primal):
  """``ct`` typed as ``primal`` needs: summed over the manual axes it varies over and ``primal``
  does not (what JAX's own transpose of the implicit cast does), cast to varying where
  ``primal`` varies and ``ct`` does not. An integer leaf (a layer index, a flag) gets jax's
  float0 zero."""
  def one(c, p):
    if not jnp.issubdtype(jnp.result_type(p), jnp.inexact):
      return _zero_cotangent(p)
    extra = tuple(sorted(jaxapi.vma(c) - jaxapi.vma(p)))
    if extra:
      c = lax.psum(c, extra)
    return jaxapi.to_varying(c, tuple(sorted(jaxapi.vma(p))))
  return jax.tree.map(one, ct, primal)


def _checked_body(body, h, layer):
  """``body(h, layer)`` held to what the stages send each other: a pair whose first entry keeps
  ``h``'s shape and dtype (else lax.scan's carry error, or one of the pipeline's own branches,
  would say it in terms of the schedule's internals)."""
  out = body(h, layer)
  if not isinstance(out, (tuple, list)) or len(out) != 2:
    raise errors.ConfigurationError(
        f"pipeline: body(h, layer) returned {_describe(out)}; it must return a pair (h, y) as "
        "lax.scan's body does: return (h, None) when there is nothing to stack")
  if not hasattr(out[0], "shape") or (jnp.shape(out[0]), jnp.result_type(out[0])) != (
      h.shape, h.dtype):
    raise errors.ConfigurationError(
        f"pipeline: body(h, layer) turned h {h.dtype}{list(h.shape)} into {_describe(out[0])}; "
        "the activation the stages send each other must keep its shape and dtype (cast inside "
        "the layer and back, or make the first layer's input x that shape and dtype)")
  return out


def _checked_loss(value):
  if jnp.shape(value) != () or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
    raise errors.ConfigurationError(
        f"pipeline: loss_fn(head, h, targets) returned {_describe(value)}; it must return the "
        "micro-batch's loss as a floating scalar (take .mean() or .sum() of a per-example loss)")
  return value


def _describe(v) -> str:
  if hasattr(v, "shape") and hasattr(v, "dtype"):
    return f"{jnp.result_type(v)}{list(jnp.shape(v))}"
  return f"a {type(v).__name__}"


def _execute(pipe: Pipeline, layers, head, x, targets, *, backward: bool):
  """Runs the timetable; returns ``(loss, (dlayers, dhead, dx))`` (gradients only if
  ``backward``), every result already divided by the number of micro-batches."""
  p, v, mbs, axis = pipe.stages, pipe.schedule.virtual, pipe.microbatches, pipe.axis
  table = sched.timetable(pipe.schedule, p, mbs, backward)
  ka, kc = table.activation_slots, table.cotangent_slots
  d = lax.axis_index(axis)
  leaves = jax.tree.leaves((layers, head, x, targets))
  axes = tuple(sorted(set().union(*(jaxapi.vma(a) for a in leaves), {axis})))
  vary = lambda t: jax.tree.map(lambda a: jaxapi.to_varying(a, axes), t)

  # Every operand typed varying over all axes before the loop: a value used inside a branch
  # that is invariant over an axis would be cast there, and the transpose of that cast is a psum
  # inside a branch only some devices take (a deadlock).
  chunks = vary(jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), layers))
  split = lambda a: a.reshape(mbs, a.shape[0] // mbs, *a.shape[1:])
  xs, ts, head = vary(split(x)), vary(jax.tree.map(split, targets)), vary(head)
  mb_shape, dtype = xs.shape[1:], xs.dtype

  def stage(params, h):
    return lax.scan(functools.partial(_checked_body, pipe.body), h, params)[0]

  def last(params, hd, h, t):
    return _checked_loss(pipe.loss_fn(hd, stage(params, h), t))

  pick = lambda tree, i: jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, False), tree)

  def put(buf, i, j, value):
    return lax.dynamic_update_index_in_dim(
        buf, lax.dynamic_update_index_in_dim(buf[i], value, j, 0), i, 0)

  # The cotangent of an integer leaf is jax's float0, which takes no arithmetic: its
  # accumulator stays as it is (the backward rule hands float0 back for it).
  def add(acc, i, g):
    return jax.tree.map(lambda a, b: a if b.dtype == jax.dtypes.float0 else
                        lax.dynamic_update_index_in_dim(
                            a, lax.dynamic_index_in_dim(a, i, 0, False) + b, i, 0), acc, g)

  zeros_msg = jnp.zeros(mb_shape, dtype)
  state = dict(
      act=jnp.zeros((v, ka, *mb_shape), dtype), ct=jnp.zeros((v, kc, *mb_shape), dtype),
      loss=jnp.zeros((), jnp.float32), send_f=zeros_msg, send_b=zeros_msg, recv_f=zeros_msg,
      recv_b=zeros_msg)
  if backward:
    state.update(grads=jax.tree.map(jnp.zeros_like, chunks),
                 head=jax.tree.map(jnp.zeros_like, head), dx=jnp.zeros_like(xs))
  state = vary(state)

  # Forward actions. In training the last chunk's forward only keeps its input (received at the
  # tick's start); its backward recomputes it with the loss. One branch per kind of work, the
  # first chunk's input chosen by a select, so the program holds two copies of the stage's
  # forward and two of its backward.
  def idle(s, vc, m, first):
    return s

  def h_in(s, vc, m, first):
    return jnp.where(first, xs[m], s["act"][vc, m % ka])

  def forward(s, vc, m, first):
    return {**s, "send_f": vary(stage(pick(chunks, vc), h_in(s, vc, m, first)))}

  def forward_loss(s, vc, m, first):
    if backward:
      return s
    value = last(pick(chunks, vc), head, h_in(s, vc, m, first), pick(ts, m)).astype(jnp.float32)
    return {**s, "loss": vary(s["loss"] + value)}

  # Backward actions: recompute the chunk's forward from its input and pull the cotangent back.
  def send_back(s, vc, m, first, dp, dh):
    s = {**s, "grads": vary(add(s["grads"], vc, dp))}
    old = lax.dynamic_index_in_dim(s["dx"], m, 0, False)
    dx = lax.dynamic_update_index_in_dim(s["dx"], jnp.where(first, dh, old), m, 0)
    return {**s, "dx": vary(dx), "send_b": vary(dh)}

  def backward_inner(s, vc, m, first):
    _, pull = jax.vjp(stage, pick(chunks, vc), h_in(s, vc, m, first))
    dp, dh = pull(s["ct"][vc, m % kc])
    return send_back(s, vc, m, first, dp, dh)

  def backward_loss(s, vc, m, first):
    value, pull = jax.vjp(last, pick(chunks, vc), head, h_in(s, vc, m, first), pick(ts, m))
    dp, dhead, dh, _ = pull(jnp.ones_like(value))
    s = {**s, "head": vary(jax.tree.map(
        lambda a, b: a if b.dtype == jax.dtypes.float0 else a + b, s["head"], dhead)),
         "loss": vary(s["loss"] + value.astype(jnp.float32))}
    return send_back(s, vc, m, first, dp, dh)

  # Codes (schedule.F_*/B_*) -> branch: mid and first share one, last and only share one.
  f_index = jnp.asarray([0, 1, 1, 2, 2], jnp.int32)
  b_index = jnp.asarray([0, 1, 1, 2, 2], jnp.int32)
  f_branches = [idle, forward, forward_loss]
  b_branches = [idle, backward_inner, backward_loss]
  rows = {k: jnp.asarray(getattr(table, k)) for k in sched.Timetable._fields[:12]}
  right = [(i, (i + 1) % p) for i in range(p)]
  left = [(i, (i - 1) % p) for i in range(p)]

  def tick(s, row):
    r = {k: lax.dynamic_index_in_dim(a, d, 0, False) for k, a in row.items()}
    # What arrived at the end of the last tick goes into its chunk's buffer.
    vc, slot = r["recv_f_chunk"], r["recv_f_micro"] % ka
    s = {**s, "act": put(s["act"], vc, slot, jnp.where(r["recv_f"] > 0, s["recv_f"],
                                                          s["act"][vc, slot]))}
    if backward:
      vc, slot = r["recv_b_chunk"], r["recv_b_micro"] % kc
      s = {**s, "ct": put(s["ct"], vc, slot, jnp.where(r["recv_b"] > 0, s["recv_b"],
                                                          s["ct"][vc, slot]))}
    first = (d == 0) & (r["f_chunk"] == 0)
    s = lax.switch(f_index[r["f_kind"]], f_branches, s, r["f_chunk"], r["f_micro"], first)
    if backward:
      first = (d == 0) & (r["b_chunk"] == 0)
      s = lax.switch(b_index[r["b_kind"]], b_branches, s, r["b_chunk"], r["b_micro"], first)
    s = {**s, "recv_f": lax.ppermute(s["send_f"], axis, right)}
    if backward:
      s = {**s, "recv_b": lax.ppermute(s["send_b"], axis, left)}
    return s, None

  state, _ = lax.scan(tick, state, rows)
  on_last = d == p - 1
  scale = lambda a: a / jnp.asarray(mbs, a.dtype)
  value = lax.psum(jnp.where(on_last, scale(state["loss"]), 0.0), axis)
  if not backward:
    return value, None
  dlayers = jax.tree.map(lambda g, a: scale(g).reshape(a.shape), state["grads"], layers)
  dhead = jax.tree.map(scale, state["head"])                    # zero but on the last stage
  dx = scale(state["dx"]).reshape(x.shape)                       # zero but on the first stage
  return value, (dlayers, dhead, dx)
