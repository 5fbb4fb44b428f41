"""Top-k error-feedback gradient compression inside the all-reduce (Deep Gradient Compression).

Each device keeps a residual ``v`` per gradient leaf. A step (Lin et al., ICLR 2018, with the
error feedback of Stich et al. 2018 / Karimireddy et al. 2019):

1. local gradient clipping (optional): ``g *= min(1, clip_norm / sqrt(P) / ||g||)``, the global
   norm of this device's gradient tree, threshold scaled by ``P**-0.5`` as DGC does;
2. momentum correction (``momentum > 0``): ``u = m * u + g`` and ``v += u``; otherwise ``v += g``;
3. per leaf, the ``k = ceil(ratio * n)`` largest ``|v|`` (:mod:`dtenjax._src.compression.topk`) are sent as
   fixed-size (int32 index, value) pairs: ``lax.all_gather`` then a scatter-add in rank order
   (deterministic: every device adds the same values in the same order), divided by ``P``.
   When sparsity stops paying (``k/n >= 1/P`` for float32: the all-gather would move as many bytes
   as a ring all-reduce) the leaf goes dense through ``lax.psum`` and its whole ``v`` is sent;
4. sent entries leave ``v`` (error feedback: what was not sent stays for the next step) and,
   with momentum factor masking, are zeroed in ``u`` too;
5. a sparsity warm-up (``warmup_steps > 0``) starts at ``warmup_start_ratio`` and shrinks the
   density geometrically over ``warmup_stages`` stages to ``ratio`` (DGC: 25%, 6.25%, ... 0.1%).

``error_feedback=False`` drops what was not sent (the ablation). The update returned is the mean
over devices of what was sent, so chain it with a plain optimizer: ``optax.chain(topk_ef(...),
optax.sgd(lr))`` (with ``momentum`` here, not in the optimizer: that is DGC's momentum
correction).

Use :func:`topk_ef` with ``axis_name`` inside ``jax.shard_map`` (data parallel: the state holds
each device's own residual, so give it ``P(axis)`` specs, :func:`state_specs`), or without
``axis_name`` as a local compressor under plain ``jit`` (no communication; the state has the
params' shapes and sharding). :func:`compression_plan` is the per-leaf decision as data.

The gradients must be each device's own. Under ``jax.shard_map`` with its default
``check_vma=True``, parameters passed with ``in_specs=P()`` are invariant across devices and
``jax.grad`` with respect to them returns the gradient already summed over the axis: the compiled
step then holds a dense all-reduce of every weight before compression. Take the gradient with
respect to per-device parameters instead, ``jax.grad(loss)(pvary(params, axis), batch)``
(:func:`pvary` is ``jax.lax.pcast(..., to="varying")`` over a pytree); :func:`topk_ef` refuses
gradients whose type says they are already reduced over its axis (``check_vma=False`` carries no
such types: there gradients are local, as under ``pmap``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src import tables
from dtenjax._src.collectives import all_reduce as collectives
from dtenjax._src.compression import topk

PyTree = Any
_INDEX_BYTES = 4


class TopKEFState(NamedTuple):
  """State of :func:`topk_ef`: step count, per-leaf residuals, per-leaf momentum (or None)."""
  count: jax.Array
  residual: PyTree
  momentum: PyTree | None


@dataclasses.dataclass(frozen=True)
class TopKConfig:
  """Configuration of top-k error-feedback compression (validated at construction).

  Attributes:
    ratio: density, the fraction of each leaf sent per step (0 < ratio <= 1); 0.001 is DGC's 99.9%.
    axis_name: the shard_map / mesh_map axis to reduce over; None compresses locally only.
    error_feedback: keep what was not sent in the residual (False: drop it; the ablation).
    momentum: DGC momentum correction factor (0 disables; then chain a momentum optimizer
      after the transform only if you accept that momentum acts on the sparse update).
    momentum_masking: zero the momentum of entries that were sent (DGC's momentum factor masking).
    clip_norm: local gradient clipping threshold (global norm over the device's tree, scaled by
      P**-0.5); None disables.
    warmup_steps: length of the sparsity warm-up; 0 disables.
    warmup_start_ratio: density at step 0 of the warm-up.
    warmup_stages: number of geometric stages of the warm-up.
    selection: "sampled" (DGC sampled threshold + packing) or "exact" (lax.top_k).
    sample_ratio: fraction of each leaf sampled to find the threshold (0.001 to 0.01 in DGC).
    fallback_bounds: (lo, hi): recompute exactly when the sampled cut keeps fewer than lo * k or
      more than hi * k entries.
    pack: "auto" (native kernel when built for the backend, else cumsum), "ffi" or "cumsum".
  """
  ratio: float = 0.01
  axis_name: Any = None
  error_feedback: bool = True
  momentum: float = 0.0
  momentum_masking: bool = True
  clip_norm: float | None = None
  warmup_steps: int = 0
  warmup_start_ratio: float = 0.25
  warmup_stages: int = 4
  selection: str = "sampled"
  sample_ratio: float = 0.01
  fallback_bounds: tuple[float, float] = (0.5, 1.5)
  pack: str = "auto"

  def __post_init__(self):
    problems = []
    if not (isinstance(self.ratio, (int, float)) and 0.0 < self.ratio <= 1.0):
      problems.append(f"ratio={self.ratio!r} is outside (0, 1]; pass the fraction of entries to "
                      "send, e.g. ratio=0.01 for 1% (99% sparsity)")
    if not 0.0 <= self.momentum < 1.0:
      problems.append(f"momentum={self.momentum!r} is outside [0, 1); use e.g. 0.9, or 0 to "
                      "disable momentum correction")
    if self.clip_norm is not None and not self.clip_norm > 0:
      problems.append(f"clip_norm={self.clip_norm!r} must be positive or None")
    if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
      problems.append(f"warmup_steps={self.warmup_steps!r} must be an int >= 0")
    if not 0.0 < self.warmup_start_ratio <= 1.0:
      problems.append(f"warmup_start_ratio={self.warmup_start_ratio!r} is outside (0, 1]")
    if not (isinstance(self.warmup_stages, int) and self.warmup_stages >= 1):
      problems.append(f"warmup_stages={self.warmup_stages!r} must be an int >= 1")
    if self.selection not in topk.SELECTIONS:
      problems.append(f"selection={self.selection!r} is not one of {topk.SELECTIONS}")
    if not 0.0 < self.sample_ratio <= 1.0:
      problems.append(f"sample_ratio={self.sample_ratio!r} is outside (0, 1]; DGC uses 0.001-0.01")
    lo, hi = self.fallback_bounds
    if not 0.0 <= lo <= 1.0 <= hi:
      problems.append(f"fallback_bounds={self.fallback_bounds!r} must satisfy 0 <= lo <= 1 <= hi")
    if self.pack not in topk.PACK_METHODS:
      problems.append(f"pack={self.pack!r} is not one of {topk.PACK_METHODS}")
    if problems:
      raise errors.ConfigurationError(
          errors.join_problems("invalid top-k compression configuration:", problems))

  def stage_ratios(self) -> tuple[float, ...]:
    """Density of each warm-up stage, then ``ratio`` (one entry when there is no warm-up)."""
    if self.warmup_steps == 0 or self.warmup_start_ratio <= self.ratio:
      return (float(self.ratio),)
    s, r, n = self.warmup_start_ratio, self.ratio, self.warmup_stages
    return tuple(s * (r / s) ** (i / n) for i in range(n)) + (float(r),)

  def stage(self, step):
    """Index into :meth:`stage_ratios` for ``step`` (works on ints and traced int32)."""
    last = len(self.stage_ratios()) - 1
    if last == 0:
      return 0 * step
    return jnp.minimum(step * self.warmup_stages // self.warmup_steps, last)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  """What one gradient leaf does in a compressed all-reduce.

  ``bytes_sent`` is what each device puts on the wire per step: ``(P - 1) * k * (4 + itemsize)``
  for the sparse all-gather, ``2 (P - 1) / P * n * itemsize`` for a ring all-reduce.
  ``dense_bytes`` is the latter, for comparison.
  """
  path: str
  shape: tuple[int, ...]
  dtype: str
  n: int
  k: int
  mode: str           # "sparse" or "dense"
  bytes_sent: float
  dense_bytes: float


@dataclasses.dataclass(frozen=True)
class CompressionPlan:
  """Per-leaf plan of a compressed all-reduce over ``num_devices`` at density ``ratio``."""
  num_devices: int
  ratio: float
  leaves: tuple[LeafPlan, ...]

  @property
  def bytes_sent(self) -> float:
    return float(sum(l.bytes_sent for l in self.leaves))

  @property
  def dense_bytes(self) -> float:
    return float(sum(l.dense_bytes for l in self.leaves))

  @property
  def compression(self) -> float:
    """dense bytes / bytes sent (inf when nothing is sent)."""
    return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf

  def table(self) -> str:
    """One row per leaf (``k`` of its ``n`` values sent, the bytes each device sends and the
    dense all-reduce's), then the total and the compression."""
    rows = [(l.path, l.n, l.k, l.mode, f"{l.bytes_sent:.0f}", f"{l.dense_bytes:.0f}")
            for l in self.leaves]
    rows.append(("total", "", "", "", f"{self.bytes_sent:.0f}", f"{self.dense_bytes:.0f}"))
    return (tables.render(["leaf", "n", "k", "mode", "bytes/dev", "dense"], rows)
            + f"\ncompression: {self.compression:.1f}x fewer bytes than the dense all-reduce")


def _leaf_plan(path: str, shape, dtype, ratio: float, num_devices: int) -> LeafPlan:
  n = int(math.prod(shape))
  k = topk.num_selected(n, ratio)
  item = jnp.dtype(dtype).itemsize
  p = num_devices
  dense = 2.0 * (p - 1) / p * n * item
  sparse = float((p - 1) * k * (_INDEX_BYTES + item))
  mode = "sparse" if (p == 1 and k < n) or (p > 1 and sparse < dense) else "dense"
  return LeafPlan(path, tuple(int(d) for d in shape), jnp.dtype(dtype).name, n, k, mode,
                  sparse if mode == "sparse" else dense, dense)


def compression_plan(tree: PyTree, num_devices: int, *, ratio: float | None = None,
                     config: TopKConfig | None = None, step: int | None = None
                     ) -> CompressionPlan:
  """The per-leaf plan (path, n, k, sparse|dense, bytes) for gradients shaped like ``tree``.

  ``tree`` holds arrays or ``jax.ShapeDtypeStruct``s. The density is ``ratio``, or the one that
  ``config`` uses at ``step`` (its warm-up stage), or ``config.ratio``.
  """
  if config is None:
    config = TopKConfig(ratio=0.01 if ratio is None else ratio)
  elif ratio is not None:
    config = dataclasses.replace(config, ratio=ratio)
  if not (isinstance(num_devices, int) and num_devices >= 1):
    raise errors.ConfigurationError(f"num_devices={num_devices!r} must be an int >= 1")
  r = config.stage_ratios()[int(config.stage(step))] if step is not None else config.ratio
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  return CompressionPlan(num_devices, float(r), tuple(
      _leaf_plan(jax.tree_util.keystr(p), jnp.shape(x), x.dtype, r, num_devices)
      for p, x in leaves))


def state_specs(opt_state: PyTree, axis_name) -> PyTree:
  """PartitionSpecs for an optimizer state holding :class:`TopKEFState`s, for ``shard_map``.

  Works on a bare :class:`TopKEFState` or on any optax state that contains one (e.g. the state of
  ``optax.chain(topk_ef(...), optax.sgd(lr))``). Residual and momentum differ per device: their
  leaves are laid end to end along dimension 0 (``P(axis_name)``; a scalar parameter's are kept
  as one-element vectors, see :func:`init_state`). Every other leaf (step counts, the chained
  optimizer's state) is replicated, ``P()``.
  """
  per_dev = lambda t: jax.tree.map(
      lambda x: PartitionSpec(axis_name) if jnp.ndim(x) >= 1 else PartitionSpec(), t)

  def spec(node):
    if isinstance(node, TopKEFState):
      return TopKEFState(PartitionSpec(), per_dev(node.residual),
                         None if node.momentum is None else per_dev(node.momentum))
    return PartitionSpec()

  return jax.tree.map(spec, opt_state, is_leaf=lambda x: isinstance(x, TopKEFState))


# --- varying types ---------------------------------------------------------------------------

def _bound(axis_name) -> bool:
  try:
    jax.lax.axis_index(axis_name)
    return True
  except NameError:
    return False


def _types_tracked(axis_name) -> bool:
  """Whether JAX tracks varying types over ``axis_name`` here (``jax.shard_map(check_vma=True)``;
  not under check_vma=False, pmap or vmap)."""
  return jaxapi.vma_checked() and set(jaxapi.axis_tuple(axis_name)) <= jaxapi.manual_axes()


def pvary(tree: PyTree, axis_name) -> PyTree:
  """``tree`` typed as varying over ``axis_name``: ``jax.lax.pcast(x, axis_name, to="varying")``
  per leaf (what older jax called ``jax.lax.pvary``), leaves already varying left as they are.

  Use it on replicated parameters inside ``jax.shard_map`` before ``jax.grad``, so that each
  device gets its own gradient (no all-reduce) for :func:`topk_ef` to compress:
  ``g = jax.grad(loss)(pvary(params, "data"), batch)``. No-op where types are not tracked
  (``check_vma=False``, pmap)."""
  axes = jaxapi.axis_tuple(axis_name)
  return jax.tree.map(lambda x: jaxapi.to_varying(x, axes), tree)


# --- checks at the Python boundary ---------------------------------------------------------

def _check_tree(grads: PyTree, state: TopKEFState, config: TopKConfig) -> None:
  problems = []
  g_paths = jax.tree_util.tree_leaves_with_path(grads)
  for p, g in g_paths:
    if jnp.dtype(g.dtype) not in topk.SUPPORTED_DTYPES:
      problems.append(f"gradient {jax.tree_util.keystr(p)} has dtype {jnp.dtype(g.dtype).name}; "
                      f"supported: {', '.join(d.name for d in topk.SUPPORTED_DTYPES)} (cast it)")
  if problems:
    raise errors.CollectiveError(errors.join_problems(
        "top-k compression cannot handle these gradients:", problems))
  axis = config.axis_name
  if axis is not None:
    if not _bound(axis):
      raise errors.CollectiveError(
          f"topk_ef(axis_name={axis!r}) runs outside any jax.shard_map / mesh_map over that "
          "axis: call tx.update inside the shard_map of the data-parallel step, or use "
          "axis_name=None to compress locally.")
    if _types_tracked(axis):
      reduced = [jax.tree_util.keystr(p) for p, g in g_paths
                 if not set(jaxapi.axis_tuple(axis)) <= jaxapi.vma(g)]
      if reduced:
        raise errors.CollectiveError(
            f"top-k compression over {axis!r} got gradients that are already reduced over "
            f"it: {', '.join(reduced)} (their type does not vary over {axis!r}: "
            "jax.typeof(g).manual_axis_type.varying lacks it). Under jax.shard_map with "
            "check_vma=True, jax.grad of a replicated (in_specs=P()) parameter sums the "
            "gradient over the axis with a dense all-reduce before topk_ef sees it, so "
            "compressing it saves nothing. Differentiate with respect to per-device "
            f"parameters: g = jax.grad(loss)(dtenjax.compression.pvary(params, {axis!r}), "
            f"...) (jax.lax.pcast(params, {axis!r}, to='varying')).")
  if not isinstance(state, TopKEFState):
    raise errors.ConfigurationError(
        f"state is a {type(state).__name__}, not a TopKEFState; create it with "
        "topk_ef(...).init(params) (inside the same shard_map when compressing over an axis).")
  g_struct = jax.tree.structure(grads)
  parts = [("residual", state.residual)]
  if config.momentum > 0:
    if state.momentum is None:
      problems.append("state.momentum is None but momentum > 0: re-create the state with init()")
    else:
      parts.append(("momentum", state.momentum))
  for name, t in parts:
    s_struct = jax.tree.structure(t)
    if s_struct != g_struct:
      problems.append(f"state.{name} has tree structure {s_struct}, the gradients {g_struct}")
      continue
    for (p, g), s in zip(g_paths, jax.tree.leaves(t)):
      if jnp.shape(g) != jnp.shape(s) and not (jnp.ndim(g) == 0 and jnp.shape(s) == (1,)):
        problems.append(f"state.{name}{jax.tree_util.keystr(p)} has shape {jnp.shape(s)}, the "
                        f"gradient {jnp.shape(g)}")
  if problems:
    raise errors.ConfigurationError(errors.join_problems(
        "top-k compression state does not match the gradients (create the state with "
        "init(params) from params shaped like these gradients):", problems))


# --- the exchange ---------------------------------------------------------------------------

def _axis_size(axis_name) -> int:
  return 1 if axis_name is None else int(jax.lax.axis_size(axis_name))


def _exchange(v, ratio: float, config: TopKConfig, num_devices: int):
  """(mean of what all devices send, what stays, mask of what this device sent) for one leaf."""
  shape, n = v.shape, v.size
  plan = _leaf_plan("", shape, v.dtype, ratio, num_devices)
  flat = v.reshape(-1)
  axis = config.axis_name
  if plan.mode == "dense":
    # through the collectives layer: its deterministic algorithms and its typing
    out = flat if axis is None else collectives.all_reduce(flat, axis, op="mean")
    stay = topk.match_vma(jnp.zeros_like(flat), flat)
    mask = topk.match_vma(jnp.ones((n,), jnp.bool_), flat)
    return out.astype(v.dtype).reshape(shape), stay.reshape(shape), mask.reshape(shape)
  idx, val, _ = topk.select(flat, plan.k, selection=config.selection,
                            sample_ratio=config.sample_ratio, bounds=config.fallback_bounds,
                            pack=config.pack)
  sent = jnp.zeros_like(flat).at[idx].set(val, mode="drop")
  mask = jnp.zeros((n,), jnp.bool_).at[idx].set(True, mode="drop")
  stay = jnp.where(mask, jnp.zeros_like(flat), flat)
  if axis is None:
    out = sent
  else:
    axes = jaxapi.axis_tuple(axis)
    all_idx = jaxapi.all_gather_invariant(idx, axes)       # [P, k], the same everywhere
    all_val = jaxapi.all_gather_invariant(val, axes).astype(jnp.float32)
    acc = jnp.zeros((n,), jnp.float32)
    for r in range(num_devices):                      # fixed rank order: identical bits everywhere
      acc = acc.at[all_idx[r]].add(all_val[r], mode="drop", unique_indices=True)
    out = (acc / num_devices).astype(v.dtype)
  return out.reshape(shape), stay.reshape(shape), mask.reshape(shape)


def _global_norm(tree) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def compressed_all_reduce(grads: PyTree, state: TopKEFState, axis_name=None, *,
                          config: TopKConfig | None = None, **options
                          ) -> tuple[PyTree, TopKEFState]:
  """Mean over ``axis_name`` of top-k error-feedback compressed ``grads``.

  Call inside ``jax.shard_map`` / ``mesh_map`` with the device-local gradients and state.
  ``options`` are :class:`TopKConfig` fields (e.g. ``ratio=0.001, momentum=0.9``), or pass
  ``config``. Returns ``(mean_update, new_state)``.
  """
  if config is None:
    config = TopKConfig(axis_name=axis_name, **options)
  else:
    config = dataclasses.replace(config, axis_name=axis_name, **options)
  _check_tree(grads, state, config)
  p = _axis_size(config.axis_name)
  g = grads
  if config.clip_norm is not None:
    limit = config.clip_norm / math.sqrt(p)
    scale = jnp.minimum(1.0, limit / jnp.maximum(_global_norm(g), 1e-30))
    g = jax.tree.map(lambda x: (x * scale).astype(x.dtype), g)
  u = None
  if config.momentum > 0:
    u = jax.tree.map(lambda m, x: (config.momentum * m.reshape(x.shape) + x).astype(x.dtype),
                     state.momentum, g)
    g = u
  v = (jax.tree.map(lambda r, x: r.reshape(x.shape) + x, state.residual, g)
       if config.error_feedback else g)

  leaves, treedef = jax.tree.flatten(v)

  def branch(ratio):
    def run(leaves):
      res = [_exchange(x, ratio, config, p) for x in leaves]
      return tuple(zip(*res)) if res else ((), (), ())
    return run

  ratios = config.stage_ratios()
  if len(ratios) == 1:
    outs, stays, masks = branch(ratios[0])(leaves)
  else:
    outs, stays, masks = jax.lax.switch(config.stage(state.count), [branch(r) for r in ratios],
                                        leaves)
  out = jax.tree.unflatten(treedef, list(outs))
  if config.error_feedback:
    residual = jax.tree.unflatten(treedef, list(stays))
  else:
    residual = state.residual
  if u is not None and config.momentum_masking:
    mask_tree = jax.tree.unflatten(treedef, list(masks))
    # A leaf that went dense sent everything; masking it would turn momentum off, so it keeps u.
    dense = [m.all() for m in masks]
    u = jax.tree.unflatten(treedef, [
        jnp.where(jnp.logical_and(mk, jnp.logical_not(d)), jnp.zeros_like(x), x)
        for x, mk, d in zip(jax.tree.leaves(u), jax.tree.leaves(mask_tree), dense)])
  as_state = lambda new, old: jax.tree.map(lambda n, o: n.reshape(jnp.shape(o)), new, old)
  new_state = TopKEFState(state.count + 1, as_state(residual, state.residual),
                          as_state(u, state.momentum) if config.momentum > 0 else None)
  return out, new_state


def _zeros_of(x) -> jax.Array:
  """The zero residual of one parameter: its shape, dtype and sharding; a scalar's is a
  one-element vector, so that :func:`state_specs` can lay every device's own end to end."""
  return jnp.zeros_like(x) if jnp.ndim(x) else jnp.zeros((1,), jnp.result_type(x))


def init_state(params: PyTree, config: TopKConfig) -> TopKEFState:
  """Zero residuals (and momentum) shaped, typed and sharded like ``params`` (a scalar's as a
  one-element vector); inside a shard_map over ``config.axis_name`` they are typed as varying
  over it (each device has its own)."""
  axis = config.axis_name
  per_device = axis is not None and _bound(axis)
  zeros = lambda t: (pvary(jax.tree.map(_zeros_of, t), axis) if per_device
                     else jax.tree.map(_zeros_of, t))
  return TopKEFState(jnp.zeros((), jnp.int32), zeros(params),
                     zeros(params) if config.momentum > 0 else None)


class TopKTransform(NamedTuple):
  """An (init, update) pair; an ``optax.GradientTransformation`` in all but name."""
  init: Callable[[PyTree], TopKEFState]
  update: Callable[..., tuple[PyTree, TopKEFState]]


def topk_ef(ratio: float = 0.01, *, axis_name: Any = None, error_feedback: bool = True,
            momentum: float = 0.0, momentum_masking: bool = True, clip_norm: float | None = None,
            warmup_steps: int = 0, warmup_start_ratio: float = 0.25, warmup_stages: int = 4,
            selection: str = "sampled", sample_ratio: float = 0.01,
            fallback_bounds: tuple[float, float] = (0.5, 1.5), pack: str = "auto"):
  """Top-k error-feedback compression (DGC) as an optax-style gradient transformation.

  Every argument is the :class:`TopKConfig` field of the same name (which validates them, listing
  every problem at once).

  Args:
    ratio: fraction of each gradient leaf sent per step, in (0, 1]; 0.001 is DGC's 99.9%.
    axis_name: shard_map axis to all-reduce over (None: compress locally, no communication).
    error_feedback: keep what was not sent in the residual (False: drop it; the ablation).
    momentum: DGC momentum correction factor, in [0, 1) (0 disables).
    momentum_masking: zero the momentum of entries that were sent (DGC's momentum factor masking).
    clip_norm: local gradient clipping threshold; None disables.
    warmup_steps: length of the sparsity warm-up; 0 disables.
    warmup_start_ratio: density at step 0 of the warm-up.
    warmup_stages: number of geometric stages of the warm-up.
    selection: "sampled" (DGC sampled threshold + packing) or "exact" (lax.top_k).
    sample_ratio: fraction of each leaf sampled to find the threshold.
    fallback_bounds: (lo, hi): recompute exactly when the sampled cut keeps fewer than lo * k or
      more than hi * k entries.
    pack: "auto" (native kernel when built for the backend, else cumsum), "ffi" or "cumsum".

  Returns:
    ``optax.GradientTransformation(init, update)`` when optax is installed, else a NamedTuple
    with the same two fields. ``update(grads, state, params=None)`` returns the mean over the
    axis of the sparse updates and the new :class:`TopKEFState`.
  """
  config = TopKConfig(ratio=ratio, axis_name=axis_name, error_feedback=error_feedback,
                      momentum=momentum, momentum_masking=momentum_masking, clip_norm=clip_norm,
                      warmup_steps=warmup_steps, warmup_start_ratio=warmup_start_ratio,
                      warmup_stages=warmup_stages, selection=selection,
                      sample_ratio=sample_ratio, fallback_bounds=fallback_bounds, pack=pack)

  def init_fn(params):
    return init_state(params, config)

  def update_fn(updates, state, params=None):
    del params
    return compressed_all_reduce(updates, state, config.axis_name, config=config)

  try:
    import optax
  except ImportError:
    return TopKTransform(init_fn, update_fn)
  return optax.GradientTransformation(init_fn, update_fn)
