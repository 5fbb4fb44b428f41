"""FSDP as users write it: every sharded weight gathered where a product reads it.

A plan lays an FSDP parameter out sharded over ``fsdp`` (and the batch over the same axis); the
products need the weight whole along ``fsdp``. Users of MaxText or FSDP2 gather a weight inside the
layer that uses it: a weight stacked for ``lax.scan`` is gathered one layer at a time inside the
loop body, so only one layer's gathered weights are alive, and its gradient is reduce-scattered
layer by layer. A constraint applied to the whole stacked weight before the step would instead
gather every layer at once (the memory of an unsharded model).

:func:`gather_for_compute` does what such a user writes, without touching their code. It traces the
step to a jaxpr once (the forward and the backward pass are both in it: a training step calls
``jax.grad`` itself) and evaluates it again, equation by equation, inside ``jax.jit``. Where a
product (``dot_general``, a convolution, a ``gather`` such as an embedding lookup) reads a planned
weight -- directly or through casts, transposes and reshapes -- the weight first goes through
``with_sharding_constraint`` to its compute layout. A weight that enters a ``lax.scan`` as a
scanned-over operand is followed into the loop body as one layer's slice, with the stacked
dimension dropped from its layout, so the constraint (and XLA's all-gather) runs once per layer
inside the loop; the backward loop, which reads the same weights, gets its own per-layer gathers.
A ``lax.cond``'s branches are evaluated the same way, each with its weights gathered at its
products (a head read in one branch only is gathered there, not moved to by the activations).
Nothing else changes: elementwise optimizer updates still read the sharded weight, every other
equation is bound as it was traced (a ``jax.shard_map``'s results then pinned to the plan's
layout of the batch: ``rows``), and a sharding constraint changes no value (XLA may sum a
product's partial results in another order for another layout: float rounding, nothing more).

This is FSDP2's default (``reshard_after_forward=True``): a layer's weights are gathered for the
forward pass and again for the backward pass, so gathered weights never outlive their layer; two
all-gathers and one gradient reduction per layer and step.

Where a weight is larger than the cotangent its gradient's product reads (a small model at a
small batch), reducing the whole gradient costs more memory than moving the activations: XLA:CPU
reduces every whole gradient in one combined all-reduce after the backward, each beside a new
buffer. There the gradient is made on the weight's shard (:func:`shard_gradients`): the forward's
residual moved from the batch's rows into the features the weight is split on (an all-to-all),
the cotangent gathered over the batch, nothing reduced -- the program XLA's partitioner makes by
itself for a plain FSDP ``jax.jit`` of such a step. The planner prices it
(``pricing.gradient_on_shard``). So it is in a ``lax.cond``'s backward branch, from the residual
the forward's conditional hands out (:func:`_follow_branches`), as XLA's partitioner does for the
plain FSDP jit on a Mesh of automatic axes; a weight whose cotangent there is the larger is
gathered again in the backward's branch instead (:meth:`_Evaluator._cond`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jaxlib
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import jaxapi
from dtenjax._src.planning import routing
from dtenjax._src.planning.jaxpr_reader import blocks_nest
from dtenjax._src.planning.jaxpr_reader import call_shard_maps
from dtenjax._src.planning.jaxpr_reader import followed_operand
from dtenjax._src.planning.jaxpr_reader import manual_blocks
from dtenjax._src.planning.jaxpr_reader import nbytes
from dtenjax._src.planning.jaxpr_reader import scalar_fills
from dtenjax._src.planning.jaxpr_reader import spec_axes

# Equations whose operands the products need whole (gather: only its operand, not the indices).
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})
_GATHERS = frozenset({"gather", "dynamic_slice"})
# Single-operand equations that only change a value's dtype or layout: a weight read by one of
# them on its way to a product is followed through (the layout moves along with a transpose).
_SAME_LAYOUT = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision"})
_STRUCTURAL = _SAME_LAYOUT | frozenset({"transpose", "reshape", "broadcast_in_dim", "squeeze",
                                        "expand_dims", "rev", "slice"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_REMATS = frozenset({"checkpoint", "remat", "remat2"})
# The dtypes of the gradient products made on the weight's shard (shard_gradients). A bfloat16
# product XLA:CPU computes in float32 (jax 0.10; 0.11 in bfloat16), its gradient on the shard by
# a float32 product either way, from the cotangent gathered in float32 (calls.wire_bytes), as
# the plain FSDP jit's partitioned program does (a bfloat16 MLP on `fsdp` 8: w1's gradient
# f32[512,16] from the all-to-all'd input and the cotangent all-gathered, f32[64,512])
_ON_SHARD_DTYPES = frozenset({"float32", "bfloat16"})
# where a weight a backward jax.checkpoint call reads by its products is gathered before the
# call's optimization barrier (once, its copy held from the forward): jaxlib 0.10's XLA:CPU
# expands the barrier before it schedules and puts a parameter's gather first, so a gather in
# the call lived from the step's start (_Evaluator._eqn_with_tracked); 0.11's gathers it where
# the call runs
GATHER_BEFORE_BARRIER = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) < (0, 11)


def gather_for_compute(step: Callable, mesh, compute_specs: tuple[Any, ...],
                       sequence=None, shard_specs: tuple[Any, ...] | None = None,
                       rows: tuple[str, ...] = (), pin_all: bool = False,
                       features: Sequence[tuple] = (),
                       batch_axes: tuple[str, ...] = (),
                       on_shard: frozenset = frozenset()) -> Callable:
  """``step`` with each weight that ``compute_specs`` names gathered to that layout where a
  product uses it (one layer at a time inside ``lax.scan``; see the module docstring).

  ``compute_specs`` has one entry per positional argument of ``step``: None, or a pytree of the
  argument's structure holding a ``PartitionSpec`` (the layout the products need, for the whole
  weight) for each weight to gather and None for every other leaf. The result is meant to be
  wrapped by ``jax.jit``; called outside it, it runs the same equations eagerly.

  ``sequence`` (a :class:`~dtenjax._src.planning.sequence.Application`, or None) also constrains
  each attention's keys and values to their gathered layout, and its queries to the sharded one,
  where the forward pass makes them (inside the loop body of scanned layers).

  ``shard_specs`` (the plan's specs, one tree per argument, or None) are the weights' own
  layouts: a scaled weight that something besides its products reads is made in its weight's
  (the loss's ``sum((0.5 * w) ** 2)``; a loop handing ``0.5 * w`` out to the backward loop, which
  then gathers it again as it does an unscaled weight).

  ``rows`` (the mesh axes the plan splits the batch's dimension 0 over) pins a result of a
  ``jax.shard_map`` the evaluation binds (at the top level, or in a call or loop it enters)
  whose out_specs split only its dimension 0 to that layout where :func:`pins_manual` says the
  pin keeps XLA from a worse program; ``pin_all`` pins every such result (shmap18's pin, kept
  to measure the rule against).

  ``features`` (StepPlan.manual_features) pins the operands and results of the named
  shard_maps (at the top level or in calls: jaxpr_reader.call_shard_maps), values a tensor pair
  splits on their features, to the plan's layout of them (that dimension over 'tensor', the rows
  over the plan's batch axes), so that XLA all-to-alls them at the boundary instead of gathering
  the pair's weights whole and running its products on the user's rows
  (stepgraph.FeatureShardMap).

  ``on_shard`` (StepPlan.gradients_on_shard: indices among the step's leaves) names the weights
  whose gradient is made on their shard (:func:`shard_gradients`), each split on one dimension
  over ``batch_axes`` (the plan's axes of the batch's dimension 0)."""

  def planned(*args):
    flat, tree = jax.tree.flatten(args)
    def per_leaf(trees) -> list[P | None]:
      out: list[P | None] = []
      trees = tuple(trees or ())
      for a, c in zip(args, trees + (None,) * (len(args) - len(trees))):
        n = len(jax.tree.leaves(a))
        if c is None:
          out += [None] * n
        else:
          cs = jax.tree.leaves(c, is_leaf=lambda s: s is None or isinstance(s, P))
          out += list(cs) if len(cs) == n else [None] * n
      return out

    specs = per_leaf(compute_specs)
    unchanged = not any(s is not None for s in specs) and sequence is None
    if unchanged and not rows and not features:
      return step(*args)
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    closed, out_shape = jax.make_jaxpr(
        lambda *leaves: step(*jax.tree.unflatten(tree, leaves)), return_shape=True)(*abstract)
    if (unchanged and not features
        and not any(e.primitive.name == "shard_map" for e in closed.jaxpr.eqns)):
      return step(*args)
    tracked = {v: s for v, s in zip(closed.jaxpr.invars, specs) if s is not None}
    ev = _Evaluator(mesh)
    ev.rows = tuple(rows)
    ev.pin_all = pin_all
    ev.shards = {v: s for v, s, c in zip(closed.jaxpr.invars, per_leaf(shard_specs), specs)
                 if s is not None and c is not None}
    ev.shard_grads, held = _shard_gradient_eqns(closed.jaxpr, ev.shards, tracked,
                                                tuple(batch_axes), on_shard)
    if sequence is not None:
      ev.attend, ev.enter = sequence.constraints(closed.jaxpr, args)
    if features:
      # the named shard_maps, and the calls around them entered to reach them
      found = call_shard_maps(closed.jaxpr)
      for order, *pin in features:
        if order < len(found):
          eqn, calls = found[order]
          ev.features[id(eqn)] = pin
          ev.enter = ev.enter | frozenset(id(c) for c in calls)
    ev.enter = ev.enter | held          # the checkpoint calls that make a gradient on the shard
    outs = ev.run(closed.jaxpr, closed.consts, flat, tracked)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  planned.__name__ = getattr(step, "__name__", "step")
  planned.__wrapped__ = step
  return planned


def _shard_gradient_eqns(jaxpr, shards: Mapping[Any, P], tracked: Mapping[Any, P],
                         rows: tuple[str, ...], on_shard: frozenset
                         ) -> tuple[dict[int, tuple[ShardGradient, Any, Any, Any]], frozenset]:
  """id of a gradient product (top-level, or in a jax.checkpoint call) of a weight gathered
  whole for its product and split
  on one dimension over axes that all split the batch (``rows``: FSDP's layout) -> (how
  :func:`shard_gradients` makes it, the weight's spec entry, the batch's, the batch's other
  axes'); none where the plan makes no gradient on its shard (``on_shard``). With it the ids
  of the jax.checkpoint calls that hold such products (the evaluator enters them)."""
  out: dict[int, tuple[ShardGradient, Any, Any, Any]] = {}
  wheres: list = []
  if not on_shard:
    return out, frozenset()
  found = shard_gradients(jaxpr)
  for k, v in enumerate(jaxpr.invars):
    spec, whole = shards.get(v), tracked.get(v)
    if spec is None or whole is None or any(e is not None for e in whole):
      continue
    split = [(d, e) for d, e in enumerate(spec) if e is not None]
    if len(split) != 1 or not set(spec_axes(split[0][1])) <= set(rows):
      continue
    rest = [a for a in rows if a not in spec_axes(split[0][1])]
    for n, how in found.get((k, split[0][0]), ()):
      out[id(_eqn_at(jaxpr, n))] = (dataclasses.replace(how, moves=k in on_shard), split[0][1],
                                    _entry(rows), _entry(rest))
      if k in on_shard:
        wheres.append(n)
  return out, _remats_holding(jaxpr, wheres)


def _eqn_at(jaxpr, where):
  """The equation :func:`shard_gradients` names by ``where``: its index in ``jaxpr``, or the
  path of indices through the jax.checkpoint calls (an index) and lax.cond branches (``(index,
  branch)``) that hold it."""
  for n in () if isinstance(where, int) else where[:-1]:
    jaxpr = _step_into(jaxpr, n)
  return jaxpr.eqns[where if isinstance(where, int) else where[-1]]


def _step_into(jaxpr, n):
  """The jaxpr a path's step ``n`` enters: a call's body (an equation's index), or a
  ``lax.cond``'s branch (``(index, branch)``)."""
  if isinstance(n, tuple):
    return jaxpr.eqns[n[0]].params["branches"][n[1]].jaxpr
  return _sub_jaxpr(jaxpr.eqns[n])[0]


def _remats_holding(jaxpr, wheres) -> frozenset:
  """ids of the jax.checkpoint calls and conds that hold the equations at ``wheres`` (paths of
  :func:`shard_gradients`): the evaluator enters them to make those gradients on the shard."""
  out = set()
  for where in wheres:
    if isinstance(where, int):
      continue
    inner = jaxpr
    for n in where[:-1]:
      out.add(id(inner.eqns[n[0] if isinstance(n, tuple) else n]))
      inner = _step_into(inner, n)
  return frozenset(out)


def _barrier(vals: list, prevent_cse) -> list:
  """``vals`` with those that ``prevent_cse`` (a bool, or one per value: remat's parameter) names
  through one ``lax.optimization_barrier``, as JAX's lowering of a differentiated
  jax.checkpoint call puts them (ad_checkpoint._remat_lowering)."""
  flags = (prevent_cse,) * len(vals) if isinstance(prevent_cse, bool) else tuple(prevent_cse)
  idx = [i for i, f in enumerate(flags) if f]
  if not idx:
    return vals
  out = list(vals)
  got = jax.lax.optimization_barrier([vals[i] for i in idx])
  for i, v in zip(idx, got):
    out[i] = v
  return out


def _read_by_products_only(jaxpr, v) -> bool:
  """Whether every read of ``v`` in ``jaxpr`` is an operand of a product, directly, through
  single-operand layout changes or in a nested jax.checkpoint call's body (not a loop's, a
  cond's or another call's operand, nor an output)."""
  if v in jaxpr.outvars:
    return False
  for eqn in jaxpr.eqns:
    if not any(x is v for x in eqn.invars):
      continue
    name = eqn.primitive.name
    if name in _PRODUCTS:
      continue
    if name in _REMATS:
      # a nested jax.checkpoint call's body that reads it by products alone: XLA inlines it,
      # and the weight is gathered before the outer call's barrier (jaxlib 0.10), not again
      # inside it (nested checkpoints on both layers of an MLP, `fsdp` 8: 1.15 MiB against the
      # plain FSDP jit's 0.92, one more gathered weight, 256 KiB; now 0.90)
      sub = _sub_jaxpr(eqn)
      if (sub is not None and len(sub[0].invars) == len(eqn.invars) and
          all(_read_by_products_only(sub[0], b) for a, b in zip(eqn.invars, sub[0].invars)
              if a is v)):
        continue
    if name in _STRUCTURAL and eqn.invars[0] is v and len(eqn.outvars) == 1:
      if _read_by_products_only(jaxpr, eqn.outvars[0]):
        continue
    return False
  return True


def _entry(axes):
  """A PartitionSpec entry of mesh axes (None, one name, or a tuple of them)."""
  axes = tuple(axes)
  return None if not axes else axes[0] if len(axes) == 1 else axes


def _read(env, v):
  return v.val if isinstance(v, jcore.Literal) else env[v]


def _sub_jaxpr(eqn) -> tuple[Any, tuple] | None:
  """The (jaxpr, consts) an equation calls with its own operands, one to one; None otherwise."""
  name, params = eqn.primitive.name, eqn.params
  if name in _CALLS:
    closed = params.get("jaxpr", params.get("call_jaxpr"))
  elif name == "scan":
    closed = params["jaxpr"]
  elif name in _REMATS:
    closed = params.get("jaxpr")
  else:
    return None
  if closed is None:
    return None
  if isinstance(closed, jcore.ClosedJaxpr):
    return closed.jaxpr, tuple(closed.consts)
  return closed, ()


_FEEDS_MEMO: dict[int, tuple[Any, frozenset]] = {}


def _feeds_products(jaxpr) -> frozenset:
  """The variables of ``jaxpr`` whose value reaches an operand of a product, directly, through
  single-operand layout changes, or through the jaxprs it calls."""
  hit = _FEEDS_MEMO.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  feeds: set = set()
  fills = scalar_fills(jaxpr)
  for eqn in reversed(jaxpr.eqns):
    name = eqn.primitive.name
    if name in _PRODUCTS:
      feeds.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    elif name in _GATHERS:
      if not isinstance(eqn.invars[0], jcore.Literal):
        feeds.add(eqn.invars[0])
    elif name in _STRUCTURAL:
      if any(o in feeds for o in eqn.outvars) and not isinstance(eqn.invars[0], jcore.Literal):
        feeds.add(eqn.invars[0])
    elif (scaled := followed_operand(eqn, fills)) is not None:
      if any(o in feeds for o in eqn.outvars):
        feeds.add(scaled)
    elif name == "cond":     # a branch's operands follow the index
      for branch in eqn.params["branches"]:
        inner = _feeds_products(branch.jaxpr)
        feeds.update(o for o, i in zip(eqn.invars[1:], branch.jaxpr.invars)
                     if i in inner and not isinstance(o, jcore.Literal))
    else:
      sub = _sub_jaxpr(eqn)
      if sub is not None and len(sub[0].invars) == len(eqn.invars):
        inner = _feeds_products(sub[0])
        feeds.update(o for o, i in zip(eqn.invars, sub[0].invars)
                     if i in inner and not isinstance(o, jcore.Literal))
  out = frozenset(feeds)
  _FEEDS_MEMO[id(jaxpr)] = (jaxpr, out)
  return out


def _read_apart(jaxpr) -> frozenset:
  """The variables of ``jaxpr`` that an equation other than a product reads, or that it returns
  (a weight scaled on its way to a product and read there too: ``sum((0.5 * w) ** 2)``)."""
  out = {v for v in jaxpr.outvars if not isinstance(v, jcore.Literal)}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _PRODUCTS:
      out.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
  return frozenset(out)


def _drop_leading(spec: P) -> P | None:
  """The layout of one layer of a stacked weight laid out as ``spec`` (None when the stacked
  dimension itself is sharded: a layer's slice then lives on some devices only)."""
  entries = tuple(spec)
  if entries and entries[0] is not None:
    return None
  return P(*entries[1:])


def pins_manual(user: tuple[int, ...], n_user: int, sizes: Mapping[str, int],
                rows: tuple[str, ...]) -> bool:
  """Whether plan.jit pins a jax.shard_map's result, whose dimension 0 the user's out_specs split
  into ``n_user`` blocks (``user``: the block each device holds), to the plan's layout of the
  batch (``rows`` of a mesh of ``sizes``, its axes in order): where the user's blocks are
  coarser than the plan's, or lie on other devices, left free XLA's partitioner gathered the
  centred batch or the products' activations whole (compiled memory as the pinned program's or
  up to 190 % above it on 8 CPU devices, batches of 64 to 8192: `data` 8, `data` 4 x `tensor`
  2, `data` 2 x `tensor` 4, `data` 2 x `fsdp` 2 x `tensor` 2, `fsdp` 2 x `tensor` 4; 14 % below
  on `fsdp` 4 x `tensor` 2 at 64). Where they are as fine or finer and nested, the pin only adds
  the all-gather of the result over the plan's axes that split no batch, and XLA's free program
  held as much memory or less (up to 21 % less at a batch of 32768: it ran the step
  data-parallel over every device; 9 % more on `data` 4 x `tensor` 2 at 1024), so it is left
  free (docs/benchmarks.md, shmap18b)."""
  n_plan = math.prod(sizes[a] for a in rows)
  if n_plan == 1:
    return False
  return n_user < n_plan or not blocks_nest(user, n_user, manual_blocks(dict(sizes), rows),
                                            n_plan)


@dataclasses.dataclass(frozen=True)
class ShardGradient:
  """A weight's gradient product that :func:`shard_gradients` computes on the weight's shard:
  operand ``split`` (0 or 1, the forward's residual) is split over the weight's axes along its
  free dimension ``dim`` (an all-to-all of the batch's rows into features), the other (the
  cotangent) gathered whole over the batch, and the product's result is the gradient's shard
  (its dimension of operand ``split`` over the weight's axes)."""
  split: int
  dim: int
  gathered: int        # bytes of the operand gathered whole
  moved: int           # bytes of the operand split by features (all of it, every device's)
  moves: bool          # moves_activations: else the whole gradient is made and reduced
  dtype: str           # the operands' dtype (the cotangent's)


def shard_gradients(jaxpr) -> dict[tuple[int, int], tuple[tuple[Any, ShardGradient], ...]]:
  """(index of a rank-2 float32 or bfloat16 weight among ``jaxpr``'s invars, its dimension the
  layout splits over the batch axes) -> a part per product that makes its gradient: (the index
  of the equation, or the path to it through jax.checkpoint calls and cond branches:
  :func:`_eqn_at`, how), for each weight that products read directly (``x @ w``, and again ``y @
  w``; at the top level, in a jax.checkpoint call, or in a lax.cond's branch, whose residual the
  forward's conditional hands to the backward's: :func:`_follow_branches`) and whose gradient's
  parts are each one product of that dtype (``_ON_SHARD_DTYPES``) of a forward product's other
  operand (its residual ``x``) and a cotangent, contracting everything but one dimension of each
  (the batch's rows). Every part's
  ``how.moves`` where computing each part's shard from the activations gathers fewer bytes than
  the weight has
  (:func:`moves_activations`, every part's; none where one part's gather is not the smaller):
  XLA's partitioner decides so, part by part, for the plain FSDP step of a weight read by two
  products (two_views on `fsdp` 8, docs/benchmarks.md fsdp20: at batch 256 w2's parts gather 128
  KiB of cotangent each, 256 summed, against its 256 KiB, and each is made on w2's shard; w1's 512
  KiB each, reduced whole). A weight one of whose gradient's products is not followed (float16,
  float8) is left out. A bfloat16 weight's: the plain FSDP jit's partitioned program makes w1's
  gradient of a bfloat16 MLP on `fsdp` 8 at batch 64 on its shard so (a float32 product of the
  all-to-all'd input and the all-gathered cotangent), docs/benchmarks.md bf16_22.

  Left to reduce the whole gradient, plan.jit's FSDP step holds every whole gradient at once
  in XLA:CPU's combined all-reduce, and a new buffer of each beside it: four weights' worth on
  a two-layer MLP (1.40 MiB a device on `fsdp` 8 at batch 64, where the plain jax.jit step,
  which XLA partitions so by itself, compiles to 0.92; bench/fsdp_small_batch.py)."""
  index = {v: i for i, v in enumerate(jaxpr.invars)}
  out: dict[tuple[int, int], list[tuple[Any, ShardGradient]]] = {}
  seen: dict[int, set[Any]] = {}       # weight -> the products that make its gradient
  _follow_gradients(jaxpr, index, {}, (), [v.aval for v in jaxpr.invars], out, seen, {}, {})
  # a weight whose gradient products are not all followed keeps its reduction
  found = {}
  for key, parts in out.items():
    if len(parts) == len(seen[key[0]]):
      moves = all(moves_activations(how.gathered, nbytes(jaxpr.invars[key[0]].aval))
                  for _, how in parts)
      found[key] = tuple((n, dataclasses.replace(how, moves=moves)) for n, how in parts)
  return found


def _follow_gradients(jaxpr, index: Mapping[Any, int], forward_in: Mapping[Any, list],
                      path: tuple[int, ...], avals: Sequence[Any], out: dict,
                      seen: dict, keyed: dict | None = None,
                      keys_in: Mapping[Any, Any] | None = None) -> dict:
  """:func:`shard_gradients`' walk of ``jaxpr`` (the step's, or a jax.checkpoint call's body at
  ``path``, the equations' indices that lead to it): ``index`` maps its variables that are a
  weight (the step's invars, or a call's invars that the caller's weight enters) to the
  weight's leaf, ``forward_in`` its invars that are a forward product's residual (the caller's
  residual handed into the call) to their weights; ``avals`` are the step's invars'. A gradient
  product found at the top level is named by its equation's index, one inside a call by the
  path of indices to it.

  The walk enters the calls of jax.checkpoint (``checkpoint``, ``remat``, jax 0.10's
  ``remat2``): the backward's call recomputes the layer and makes its weights' gradients in its
  body (a checkpointed second layer, ``h @ w2`` in the call: w2's forward read and its gradient
  product both there), or, under a policy that saves the products (``dots_saveable``), makes
  the gradient there from the residual the top-level forward product read (``x`` of ``x @ w1``
  handed into the call). XLA's partitioner inlines the call and makes such a gradient on the
  weight's shard as it does a top-level one, for the plain FSDP step.

  A backward call recomputes the forward from its operands, so its residual is often not a
  value handed in but one it makes again: ``keyed`` (shared by the walk through
  jax.checkpoint calls; a cond's branch starts its own) maps a value's key (:func:`_value_keys`: the
  same primitive, parameters and operands, through the calls' bodies) to the forward entries of
  every residual of that value found so far, at any depth; ``keys_in`` are the keys of
  ``jaxpr``'s invars (its operands' in the caller). A value of ``jaxpr`` of a key already
  there is that residual: a block under one jax.checkpoint, whose backward call recomputes
  ``h`` of ``h @ w2`` from the call's operands; or one checkpointed function applied twice
  inside an outer checkpoint under policies, whose second forward call reads the first's
  result, recomputed by the backward's outer call from the product the outer policy saved, and
  whose own ``h`` is made inside the forward call and recomputed in the backward's nested call
  (left unfollowed, the MLP so, `fsdp` 8, batch 64, adamw, compiled to 2.40 MiB a device
  against the plain FSDP jit's 0.96: every part of both weights' gradients reduced whole)."""
  # residual -> (weight, w dim, x dim, the branches of the conds it was made in: _follow_branches)
  forward: dict[Any, list[tuple[int, int, int, tuple]]] = {}
  keys = (_value_keys(jaxpr, keys_in or {}, keyed.setdefault(_INTERNED, {}))
          if keyed is not None else {})

  def add(v, entry) -> None:
    if entry not in forward.setdefault(v, []):
      forward[v].append(entry)
      if keyed is not None and not entry[3]:
        had = keyed.setdefault(_key(keys, v), [])
        if entry not in had:
          had.append(entry)

  for v, f in forward_in.items():
    for entry in f:
      add(v, entry)
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "dot_general":
      continue
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    for w in (0, 1):
      wv, xv = eqn.invars[w], eqn.invars[1 - w]
      if isinstance(wv, jcore.Literal) or wv not in index:
        continue
      wc, xc = (lc, rc) if w == 0 else (rc, lc)
      if len(wv.aval.shape) == 2 and len(wc) == 1 and not lb and not isinstance(xv, jcore.Literal):
        # once: a call's recomputed product of a residual handed in (``x @ w1`` in a block
        # under one jax.checkpoint) is the forward's read again, not another part
        add(xv, (index[wv], wc[0], xc[0], ()))
  if keyed:
    # this jaxpr's values that are a residual made (or recomputed) before it
    for v, k in keys.items():
      for entry in keyed.get(k, ()):
        add(v, entry)
  for n, eqn in enumerate(jaxpr.eqns):
    where = (*path, n) if path else n
    if eqn.primitive.name in _REMATS:
      sub = _sub_jaxpr(eqn)
      if sub is not None and len(sub[0].invars) == len(eqn.invars):
        inner = sub[0]
        pairs = [(o, i) for o, i in zip(eqn.invars, inner.invars)
                 if not isinstance(o, jcore.Literal)]
        handed = {i: forward[o] for o, i in pairs if o in forward}
        # the call's recomputations of the forward's residuals (``gelu(x @ w1)`` of ``h @ w2``
        # in a whole block under jax.checkpoint: the forward's product of it is outside the
        # backward's call, which recomputes ``h`` and makes w2's gradient from it) are found
        # in it by their keys (``keyed``)
        made = _follow_gradients(inner, {i: index[o] for o, i in pairs if o in index},
                                 handed, (*path, n), avals, out, seen, keyed,
                                 {i: _key(keys, o) for o, i in pairs} if keyed is not None
                                 else None)
        # a forward product inside a call that is not differentiated (the forward's call of an
        # inner checkpoint under another one's policy: ``x @ w`` in the inner call, its
        # gradient made from ``x`` in a later backward call the caller's ``x`` is handed to):
        # the caller's operand is that product's residual too
        # (left unfollowed, every such weight's whole gradient was reduced and held: three
        # tanh layers, d 256, batch 64, each so, adamw on `fsdp` 8, 2.10 MiB a device on jax
        # 0.11.2 against the plain FSDP jit's 1.33, which inlines both calls; now 1.35)
        if not eqn.params.get("differentiated"):
          for o, i in pairs:
            for entry in made.get(i, ()):
              add(o, entry)
      continue
    if eqn.primitive.name == "cond":
      _follow_branches(eqn, n, index, forward, path, avals, out, seen)
      continue
    if eqn.primitive.name != "dot_general":
      continue
    ops = eqn.invars
    if any(isinstance(v, jcore.Literal) for v in ops):
      continue
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    free = [[d for d in range(len(v.aval.shape)) if d not in c] for v, c in zip(ops, (lc, rc))]
    if lb or rb or any(len(f) != 1 for f in free):
      continue
    for a in (0, 1):
      x, g = ops[a], ops[1 - a]
      if g in index:           # a product of two of the step's arguments: no cotangent
        continue
      for k, wdim, xdim, branches in forward.get(x, ()):
        w = avals[k]
        if branches:           # made in another cond's branch: read in its backward's alone
          continue
        other = 1 - wdim
        if (free[a][0] != xdim or x.aval.shape[xdim] != w.shape[wdim]
            or g.aval.shape[free[1 - a][0]] != w.shape[other]):
          continue
        seen.setdefault(k, set()).add(where)
        if any(str(v.dtype) not in _ON_SHARD_DTYPES for v in (w, x.aval, g.aval)):
          # a product of other narrower floats (float16, float8): not measured moved
          continue
        # the weight split on the dimension its product contracts with the residual's features
        # (FSDP's dimension 0 of ``x @ w``): the residual's rows moved into those features, the
        # cotangent gathered. Not the other (the cotangent's features moved, the residual
        # gathered): on the first layer of float_hyperparameter's MLP in
        # tests/test_plan_user_steps.py, split so, XLA:CPU held a weight's worth more temp than
        # that program has (0.75 MiB against 0.50)
        out.setdefault((k, wdim), []).append(
            (where, ShardGradient(a, xdim, nbytes(g.aval), nbytes(x.aval), False,
                                  str(g.aval.dtype))))
  return forward


def _key(keys: Mapping[Any, Any], v):
  """``v``'s key among ``keys`` (:func:`_value_keys`): a literal by its value, a variable made
  by none of the keyed equations by itself."""
  if isinstance(v, jcore.Literal):
    return ("literal", str(v.aval), repr(v.val))
  return keys.get(v, ("var", id(v)))


# ``keyed``'s slot for :func:`_value_keys`' table of keys (never a value's key)
_INTERNED = object()


def _value_keys(jaxpr, keys_in: Mapping[Any, Any], interned: dict) -> dict:
  """A key for each value ``jaxpr`` makes, equal where two values are the same: made by the same
  primitive, with the same parameters, of operands of the same keys (``keys_in`` its invars').
  JAX's backward call of jax.checkpoint recomputes the forward from the call's operands, so a
  residual it recomputes has the forward's value's key. A jax.checkpoint call's results are
  keyed as its body makes them of the call's operands (the forward's call of a checkpointed
  function under another checkpoint's policy saves ``z = x @ w`` and hands out ``tanh(z +
  b)``, which the backward's outer call recomputes from the saved ``z``); other equations that
  call jaxprs (loops, conds, other calls) make values keyed by themselves. A key is a number:
  ``interned`` (one table per walk) numbers each (primitive, parameters, operands' keys) once,
  so a key stays small however deep the chain of values behind it (nested tuples cost time
  exponential in the depth to hash: a weight shared across many layers)."""
  keys = dict(keys_in)
  for eqn in jaxpr.eqns:
    sub = _sub_jaxpr(eqn)
    if eqn.primitive.name in _REMATS and sub is not None and len(sub[0].invars) == len(
        eqn.invars):
      inside = _value_keys(sub[0], {i: _key(keys, o) for o, i in zip(eqn.invars, sub[0].invars)},
                           interned)
      for o, i in zip(eqn.outvars, sub[0].outvars):
        if not isinstance(o, jcore.DropVar):
          keys[o] = _key(inside, i)
      continue
    if sub is not None or eqn.primitive.name in ("scan", "cond", "while"):
      continue
    try:
      params = tuple(sorted((k, v) for k, v in eqn.params.items()))
      hash(params)
    except TypeError:
      continue
    ops = tuple(_key(keys, v) for v in eqn.invars)
    for j, o in enumerate(eqn.outvars):
      if not isinstance(o, jcore.DropVar):
        keys[o] = interned.setdefault((eqn.primitive.name, params, ops, j), len(interned))
  return keys


def _follow_branches(eqn, n: int, index: Mapping[Any, int], forward: dict,
                     path: tuple, avals: Sequence[Any], out: dict, seen: dict) -> None:
  """:func:`_follow_gradients` into each branch of a ``lax.cond`` (step ``(n, branch)`` of the
  path). A forward product in a branch reads a weight the cond's operand carries; its residual
  (``h`` of ``h @ w2``, made in the branch, or ``x`` of ``x @ w1``, an operand) leaves the
  forward's conditional as one of its results, which jax's partial evaluation hands to the
  backward's conditional, whose branch makes the gradient from it (``h.T @ dy``). Such a result,
  and such an operand, are followed out into ``forward`` for the conditionals after it, marked
  with the branch: the backward's conditional runs the branch of the same index (jax's
  transpose of a cond keeps the branches' order), and its product in another branch is another
  weight's gradient (gated_head: ``x`` the residual of ``x @ w1`` in one branch and of ``x @
  head`` in the other)."""
  ops = eqn.invars[1:]
  for j, branch in enumerate(eqn.params["branches"]):
    inner = branch.jaxpr
    pairs = [(o, i) for o, i in zip(ops, inner.invars) if not isinstance(o, jcore.Literal)]
    entering = {i: [(*f[:3], f[3][1:]) for f in forward.get(o, ()) if not f[3] or f[3][0] == j]
                for o, i in pairs}
    found = _follow_gradients(inner, {i: index[o] for o, i in pairs if o in index},
                              {i: f for i, f in entering.items() if f},
                              (*path, (n, j)), avals, out, seen, {}, {})
    handed = [(o, i) for o, i in zip(eqn.outvars, inner.outvars)
              if not isinstance(o, jcore.DropVar) and not isinstance(i, jcore.Literal)]
    for o, i in pairs + handed:
      for f in found.get(i, ()):
        f = (*f[:3], (j, *f[3]))
        if f not in forward.setdefault(o, []):
          forward[o].append(f)


def moves_activations(gathered: int, weight: int) -> bool:
  """Whether a weight's gradient is computed on its shard from the activations gathered over
  the batch (``gathered`` bytes, whole) rather than made whole and reduced (the whole
  gradient, ``weight`` bytes, and XLA:CPU's reduced copy of it, live together with every other
  gradient's at the combined all-reduce): where the gathered operand is the smaller. XLA's own
  partitioner makes this choice for the plain FSDP step of a small MLP at batches below its
  widths (bench/fsdp_small_batch.py, docs/benchmarks.md fsdp19)."""
  return gathered < weight


class _Evaluator:
  """Evaluates a jaxpr with the planned weights gathered at their products."""

  def __init__(self, mesh):
    self.mesh = mesh
    self.out_routes: list = []         # the routes of the last run's outputs (routing.py)
    self.attend: dict = {}             # attention operand -> its layout (planning/sequence.py)
    self.enter: frozenset = frozenset()   # ids of loops and calls whose bodies hold one
    self.out_tracked: list = []        # the gathered layouts of the last run's outputs
    # a tracked weight (or a value made from it in a loop body: one layer, scaled) -> its own
    # layout, where known (gather_for_compute's shard_specs)
    self.shards: dict = {}
    self.rows: tuple[str, ...] = ()    # the plan's batch axes over dimension 0 (_pin_manual)
    self.pin_all = False               # every shard_map result pinned, not only pins_manual's
    # the id of a shard_map equation -> (its first pinned operand's shape, the operands and
    # results to pin, the dimension over 'tensor', the rows' axes): StepPlan.manual_features
    self.features: dict = {}
    # the id of a gradient product of an FSDP weight -> (ShardGradient, the weight's spec
    # entry, the batch's, the batch's other axes'): _shard_gradient_eqns
    self.shard_grads: dict = {}

  def constrain(self, x, spec: P):
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

  def run(self, jaxpr, consts, args, tracked: Mapping[Any, P], routes_in=None) -> list:
    env: dict = {}
    # value -> {dimension: mesh axes}: tokens routed to a weight's shards (routing.py)
    routes: dict = {v: r for v, r in zip(jaxpr.invars, routes_in or ()) if r}
    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    for v, x in zip(jaxpr.invars, args):
      env[v] = self.constrain(x, self.attend[v]) if v in self.attend else x
    tracked = dict(tracked)
    feeds = _feeds_products(jaxpr)
    apart = _read_apart(jaxpr)
    fills = scalar_fills(jaxpr)
    gathered: dict = {}                # tracked var -> its gathered value in this scope

    def gathered_value(v):
      if v not in gathered:
        gathered[v] = self.constrain(env[v], tracked[v])
      return gathered[v]

    for eqn in jaxpr.eqns:
      vals = [_read(env, v) for v in eqn.invars]
      pin = self._feature_pin(eqn) if self.features else None
      if pin is not None:
        vals = [self._features_split(x, pin[2], pin[3]) if i in pin[0] else x
                for i, x in enumerate(vals)]
      hits = [i for i, v in enumerate(eqn.invars)
              if not isinstance(v, jcore.Literal) and v in tracked]
      routed = routes and any(not isinstance(v, jcore.Literal) and v in routes
                              for v in eqn.invars)
      outs = None
      if hits or routed or id(eqn) in self.enter:
        outs = self._eqn_with_tracked(eqn, vals, hits, tracked, feeds, gathered_value, routes,
                                       env, apart, fills)
      moved = self.shard_grads.get(id(eqn)) if outs is None else None
      if moved is not None:
        outs = self._gradient_on_shard(eqn, vals, *moved)
      if outs is None:
        outs = jaxapi.bind(eqn, vals)
        if routed:
          routing.follow(eqn, routes)
      if self.rows and eqn.primitive.name == "shard_map":
        outs = self._pin_manual(eqn, outs)
      if pin is not None:
        outs = [self._features_split(x, pin[2], pin[3]) if i in pin[1] else x
                for i, x in enumerate(outs)]
      for v, x in zip(eqn.outvars, outs):
        if not isinstance(v, jcore.DropVar):
          env[v] = self.constrain(x, self.attend[v]) if v in self.attend else x
    self.out_routes = [routes.get(v) if not isinstance(v, jcore.Literal) else None
                       for v in jaxpr.outvars]
    self.out_tracked = [tracked.get(v) if not isinstance(v, jcore.Literal) else None
                        for v in jaxpr.outvars]
    return [_read(env, v) for v in jaxpr.outvars]

  def _gradient_on_shard(self, eqn, vals, how: ShardGradient, entry, rows, rest) -> list:
    """A weight's gradient product (:func:`shard_gradients`) computed on the weight's shard:
    the operand that carries the weight's split dimension split so over its features, the other
    gathered whole over the batch, the result the gradient's shard (no whole gradient, no
    reduction); over the batch's other axes (``rest``: HSDP's) the rows stay split."""
    # the operands first on the batch's rows, where the step made them: left free, XLA carries a
    # moved operand's layout back into the forward (the hidden activations made split by
    # features, the input gathered for it) or a gathered cotangent on into the next product (a
    # gradient the plan reduces computed on its shard as well)
    contracted = eqn.params["dimension_numbers"][0]
    vals = [self.constrain(x, P(rows)) if 0 in contracted[i] else x
            for i, x in enumerate(vals)]
    if not how.moves:
      return jaxapi.bind(eqn, vals)
    for i, x in enumerate(vals):
      entries = [None] * x.ndim
      if 0 in contracted[i]:
        entries[0] = rest
      if i == how.split:
        entries[how.dim] = entry
      vals[i] = self.constrain(x, P(*entries))
    out = [None, None]
    out[how.split] = entry
    return [self.constrain(jaxapi.bind(eqn, vals)[0], P(*out))]

  def _feature_pin(self, eqn):
    """(operands, results, dimension, row axes) of a shard_map equation :attr:`features` pins:
    its values' features over 'tensor'. None where it is not named, or is not the planned step's
    (the first operand's shape differs)."""
    pin = self.features.get(id(eqn))
    if pin is None:
      return None
    shape, ins, outs, dim, rows = pin
    if not ins or tuple(eqn.invars[ins[0]].aval.shape) != tuple(shape):
      return None
    return ins, outs, dim, rows

  def _features_split(self, x, dim: int, rows: tuple[str, ...]):
    """``x`` laid out with dimension ``dim`` over 'tensor' and its rows over ``rows`` (the
    plan's batch axes; :meth:`_feature_pin`)."""
    entries = [None] * x.ndim
    entries[0] = (rows[0] if len(rows) == 1 else tuple(rows)) if rows else None
    entries[dim] = "tensor"
    return self.constrain(x, P(*entries))

  def _pin_manual(self, eqn, outs) -> list:
    """A jax.shard_map's results its out_specs split on dimension 0 only, in the plan's layout of
    the batch (:attr:`rows` over dimension 0) where that divides them and :func:`pins_manual`
    (or :attr:`pin_all`) asks for the pin."""
    split = math.prod(self.mesh.shape[a] for a in self.rows)
    user = dict(getattr(eqn.params.get("mesh"), "shape", {}) or {})
    pinned = []
    for x, spec in zip(outs, eqn.params.get("out_specs", ())):
      rest = tuple(spec)[1:]
      if (len(spec) and spec[0] is not None and all(e is None for e in rest)
          and x.shape[0] % split == 0):
        axes = spec_axes(spec[0])
        if self.pin_all or pins_manual(manual_blocks(user, axes),
                                       math.prod(user.get(a, 1) for a in axes),
                                       dict(self.mesh.shape), self.rows):
          x = self.constrain(x, P(self.rows))
      pinned.append(x)
    return pinned

  def _eqn_with_tracked(self, eqn, vals, hits, tracked, feeds, gathered_value, routes, env,
                        apart=frozenset(), fills=frozenset()):
    """Evaluates an equation that reads planned weights or routed tokens; None: bind it
    unchanged."""
    name = eqn.primitive.name
    if name in _PRODUCTS or name in _GATHERS:
      operands = hits if name in _PRODUCTS else [i for i in hits if i == 0]
      for i in operands:
        vals[i] = gathered_value(eqn.invars[i])
      if name == "dot_general":
        return routing.product(eqn, vals, tracked, routes, env, self.constrain,
                               jaxapi.bind)
      if not operands:
        return None                    # a gather's indices
      return jaxapi.bind(eqn, vals)
    if name in _STRUCTURAL and hits:
      v = eqn.invars[0]
      if not any(o in feeds for o in eqn.outvars):
        return None                    # e.g. the optimizer's cast: stays sharded
      out = eqn.outvars[0]
      if name in _SAME_LAYOUT:
        tracked[out] = tracked[v]      # follow the weight through the cast
        return None
      if name == "transpose":
        entries = tuple(tracked[v]) + (None,) * (len(eqn.invars[0].aval.shape) - len(tracked[v]))
        tracked[out] = P(*(entries[d] for d in eqn.params["permutation"]))
        return None
      vals[0] = gathered_value(v)      # other layout changes: gather first
      return jaxapi.bind(eqn, vals)
    scaled = followed_operand(eqn, fills)
    if scaled is not None and scaled in tracked:
      # a weight scaled by scalars on its way to a product (jaxpr_reader.followed_operand), or
      # negated, squared (``-w``, ``w ** 2``): computed on its shard and gathered at the
      # product. Left sharded, XLA's partitioner moved the activations instead (``x @ (0.5 *
      # w1)`` on FSDP 8: the batch all-gathered; ``x @ -w1`` the same: all-gather +60 %)
      if not any(o in feeds for o in eqn.outvars):
        return None
      tracked[eqn.outvars[0]] = tracked[scaled]
      if scaled not in self.shards:
        return None
      self.shards[eqn.outvars[0]] = self.shards[scaled]
      if eqn.outvars[0] not in apart:
        return None
      # read apart from the products too: pinned to the weight's own layout. The gather's
      # constraint otherwise reaches back to the scaled value itself, and XLA scales the
      # gathered copy, which the other readers (``sum((0.5 * w) ** 2)`` and its gradient in the
      # loss) then read, alive until the update (+256 KiB on an MLP on FSDP 8, where the plan,
      # as the unscaled step, frees it). Only then: under jax.checkpoint, pinned, the recompute
      # gathers the weight again where XLA otherwise keeps one gathered copy, as priced
      return [self.constrain(jaxapi.bind(eqn, vals)[0], self.shards[scaled])]
    if name == "scan":
      return self._scan(eqn, vals, tracked, routes)
    if name == "cond":
      return self._cond(eqn, vals, tracked)
    sub = _sub_jaxpr(eqn)
    if sub is None or len(sub[0].invars) != len(eqn.invars):
      return None
    inner_jaxpr, inner_consts = sub
    inner = {iv: tracked[ov] for iv, ov in zip(inner_jaxpr.invars, eqn.invars)
             if not isinstance(ov, jcore.Literal) and ov in tracked}
    routes_in = [routes.get(ov) if not isinstance(ov, jcore.Literal) else None
                 for ov in eqn.invars]
    if any(e.primitive.name == "cond" for e in inner_jaxpr.eqns):
      # a cond in a call (jax.checkpoint's rematerialized forward and the backward's cond)
      # pins a residual its branches hand out as a weight to the weight's own layout (_cond)
      for iv, ov in zip(inner_jaxpr.invars, eqn.invars):
        if not isinstance(ov, jcore.Literal) and ov in self.shards:
          self.shards.setdefault(iv, self.shards[ov])
    if name in _CALLS:
      outs = self.run(inner_jaxpr, inner_consts, vals, inner, routes_in)
    elif name in _REMATS:
      fn = lambda *a: self.run(inner_jaxpr, inner_consts, a, inner, routes_in)
      if eqn.params.get("differentiated"):
        # the backward's call: JAX's lowering puts an optimization barrier on its operands (a
        # call bound by jax.checkpoint below is not differentiated and lowers without one), so
        # XLA recomputes the layer there instead of reading the forward's values (CSE). A weight
        # the call reads by its products alone is gathered before the barrier, as the forward
        # gathers it: XLA:CPU expands the barrier before it schedules (cse_barrier_expander)
        # and its scheduler puts a gather of a parameter first, so a second gather in the call
        # held two gathered copies from the step's start (remat_second at batch 64 on `fsdp` 8:
        # 1.15 MiB against the plain jit's 0.92); one gather, its copy held to the backward, is
        # what plan.jit's program had before and the plan prices. jaxlib 0.11's XLA:CPU
        # schedules the call's own gather where the call runs: there the weight is gathered in
        # the call, behind the barrier, as the plain FSDP jit gathers it (four checkpointed
        # layers on `fsdp` 8: 1.19 MiB gathered before, 1.00 inside, the plain jit's 1.00), and
        # priced gathered again (pricing.regathered)
        for i, (ov, iv) in enumerate(zip(eqn.invars, inner_jaxpr.invars)):
          if (GATHER_BEFORE_BARRIER and not isinstance(ov, jcore.Literal) and ov in tracked
              and iv in inner and _read_by_products_only(inner_jaxpr, iv)):
            vals[i] = gathered_value(ov)
        vals = _barrier(vals, eqn.params.get("prevent_cse", True))
      outs = list(jax.checkpoint(fn, prevent_cse=eqn.params.get("prevent_cse", True),
                                 policy=eqn.params.get("policy"))(*vals))
    else:
      return None
    for ov, r in zip(eqn.outvars, self.out_routes):
      if r:
        routes[ov] = r
    return outs

  def _scan(self, eqn, vals, tracked, routes=None):
    p = eqn.params
    nc, nk = jaxapi.scan_counts(eqn)
    body = p["jaxpr"]
    inner: dict = {}
    for k, (ov, iv) in enumerate(zip(eqn.invars, body.jaxpr.invars)):
      if isinstance(ov, jcore.Literal) or ov not in tracked:
        continue
      if k < nc:
        inner[iv] = tracked[ov]
      elif k >= nc + nk:
        layer = _drop_leading(tracked[ov])
        if layer is not None:
          inner[iv] = layer
          shard = _drop_leading(self.shards[ov]) if ov in self.shards else None
          if shard is not None:
            self.shards[iv] = shard
    if not inner and id(eqn) not in self.enter:
      return None
    consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
    # routed tokens cross the loop's boundary (routing.py): a stacked operand's routes lose the
    # loop dimension inside, a stacked output's gain it outside
    routes = {} if routes is None else routes
    routes_in = [_shift(routes.get(ov), -1) if k >= nc + nk else
                 (routes.get(ov) if k < nc else None) if not isinstance(ov, jcore.Literal)
                 else None for k, ov in enumerate(eqn.invars)]
    out_routes: list = []

    out_tracked: list = []
    handed = [k for k, iv in enumerate(body.jaxpr.outvars) if k >= nk and
              not isinstance(iv, jcore.Literal) and iv not in body.jaxpr.invars]

    def step(c, x):
      outs = self.run(body.jaxpr, body.consts, [*consts, *c, *x], inner, routes_in)
      out_routes[:] = self.out_routes
      out_tracked[:] = self.out_tracked
      return outs[:nk], outs[nk:]

    carry_out, ys = jax.lax.scan(step, list(carry), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
    for ov, r in zip(eqn.outvars[nk:], out_routes[nk:]):
      if r and not isinstance(ov, jcore.DropVar):
        routes[ov] = _shift(r, 1)
    # A loop that hands one layer's weight out as a residual (for the backward loop) hands out
    # the stacked weight again: follow it there too.
    for ov, iv in zip(eqn.outvars[nk:], body.jaxpr.outvars[nk:]):
      if not isinstance(iv, jcore.Literal) and iv in inner and not isinstance(ov, jcore.DropVar):
        k = body.jaxpr.invars.index(iv)
        if k >= nc + nk:
          tracked[ov] = tracked[eqn.invars[k]]
    # ... and one that hands out a layer's weight scaled (``0.5 * w``'s residual, which the
    # backward loop's product reads; made in the layer's own layout, as the body returns it:
    # _eqn_with_tracked) hands out the stacked scaled weight, gathered again where the
    # backward's product reads it (stacked layers scaled on FSDP 8: XLA otherwise handed out
    # the forward's gathered copies, half the all-gathers the plan priced)
    for k in handed:
      ov, iv, spec = eqn.outvars[k], body.jaxpr.outvars[k], out_tracked[k]
      if spec is not None and iv in self.shards and not isinstance(ov, jcore.DropVar):
        tracked[ov] = P(None, *spec)
        self.shards[ov] = P(None, *self.shards[iv])
    return [*carry_out, *ys]

  def _cond(self, eqn, vals, tracked):
    """A ``lax.cond`` (or ``lax.switch``) whose branches read planned weights in products: each
    branch evaluated with them gathered at its products, as a loop body is. Bound as traced,
    XLA's partitioner kept a weight read in one branch sharded and moved the activations to it
    (an all-to-all of the batch, the gathered copy kept through the step)."""
    branches = eqn.params["branches"]
    operands = eqn.invars[1:]
    inners = [{iv: tracked[ov] for iv, ov in zip(b.jaxpr.invars, operands)
               if not isinstance(ov, jcore.Literal) and ov in tracked} for b in branches]
    if (not any(set(inner) & _feeds_products(b.jaxpr) for b, inner in zip(branches, inners))
        and id(eqn) not in self.enter):
      return None
    for b in branches:
      for iv, ov in zip(b.jaxpr.invars, operands):
        if not isinstance(ov, jcore.Literal) and ov in self.shards:
          self.shards[iv] = self.shards[ov]

    handed: list = [None] * len(branches)   # per branch: its outputs' weights (_handed)

    def branch(j, b, inner):
      def run(*a):
        outs = self.run(b.jaxpr, b.consts, a, inner)
        handed[j] = self._handed(b.jaxpr, operands, tracked)
        return outs
      return run
    outs = jax.lax.switch(vals[0], [branch(j, b, inner)
                                    for j, (b, inner) in enumerate(zip(branches, inners))],
                          *vals[1:])
    # A weight the branches hand out (the forward's residual, which the backward's branches read
    # in their products): followed out, gathered again there. A branch that does not read the
    # weight hands out zeros of its shape in its place (jax's partial evaluation of a cond:
    # nested_conds' tanh branch, short_wide_branch's narrow one); the residual is still the
    # weight wherever a product reads it. Left untracked, plan.jit's backward branch read it
    # sharded and XLA's partitioner moved the activations to it (all-to-alls, the cotangent
    # gathered over the batch, the first weight's gradient all-reduced whole), where the plain
    # FSDP jit gathers the weight again as the plan prices it. Such a residual is pinned to the
    # weight's own layout: the zeros have none, and the backward's gather otherwise reached back
    # through the conditional (XLA gathered the residual between the two conds, its copy alive
    # through the backward's: +0.48 MiB of temp on nested_conds at batch 256)
    outs = list(outs)
    for k, ov in enumerate(eqn.outvars):
      if isinstance(ov, jcore.DropVar):
        continue
      came = {h[k] for h in handed if h is not None and h[k] != "fill"}
      if len(came) == 1 and (src := came.pop()) is not None:
        tracked[ov] = src[0]
        if src[1] is not None:
          self.shards[ov] = src[1]
          if any(h is not None and h[k] == "fill" for h in handed):
            outs[k] = self.constrain(outs[k], src[1])
    return outs

  def _handed(self, jaxpr, operands, tracked) -> list:
    """What each output of a branch just run (:meth:`run`) hands out: (the weight's gathered
    layout, its own layout or None) for a tracked weight, as it came in or as an inner cond
    handed it; "fill" for a value one scalar fills (a zero residual of a branch that does not
    read the weight); None otherwise."""
    fills = scalar_fills(jaxpr)
    out = []
    for k, v in enumerate(jaxpr.outvars):
      if isinstance(v, jcore.Literal) or v in fills:
        out.append("fill")
      elif v in jaxpr.invars:
        src = operands[jaxpr.invars.index(v)]
        out.append((tracked[src], self.shards.get(src)) if not isinstance(src, jcore.Literal)
                   and src in tracked else None)
      elif self.out_tracked[k] is not None:
        out.append((self.out_tracked[k], self.shards.get(v)))
      else:
        out.append(None)
    return out


def _shift(route, by: int):
  """A route ({dimension: mesh axes}) with its dimensions moved by ``by`` (a loop's stacked
  dimension added or removed); None when it routed the loop dimension itself."""
  if not route or any(d + by < 0 for d in route):
    return None
  return {d + by: a for d, a in route.items()}
