"""The values a step materialises and how long each lives: a walk of the step's top-level
jaxpr in order (a loop body's peak counted while the loop runs) that leaves out the values XLA
fuses into their consumers, keeps the ones it does not duplicate (expensive ops read by several,
inputs of reductions over leading dimensions, convolutions' transposed copies), and records the
gradients. The solver simulates XLA's buffer assignment over this timeline with each layout's
sizes (:func:`dtenjax._src.planning.solver.simulate_memory`); its peak of batch-derived values is
the step's activation bytes (the broadcast operands of XLA:CPU's reducing fusions, which
depend on the layout, are in the timeline only). What only XLA:CPU keeps is marked
(``Live.cheap_on_gpu``: XLA:GPU recomputes it in its users' fusions), with the later last use
on XLA:GPU of the values it is recomputed from (``Live.gpu_end``): the solver prices the
backend the plan is for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import jaxlib
import numpy as np

from dtenjax._src import jaxapi
from dtenjax._src.planning import heapslot
from dtenjax._src.planning.jaxpr_reader import CALLS
from dtenjax._src.planning.jaxpr_reader import CUSTOM_DERIVATIVE_CALLS
from dtenjax._src.planning.jaxpr_reader import ELEMENTWISE
from dtenjax._src.planning.jaxpr_reader import REDUCTIONS
from dtenjax._src.planning.jaxpr_reader import is_quantized_dtype
from dtenjax._src.planning.jaxpr_reader import is_var
from dtenjax._src.planning.jaxpr_reader import nbytes
from dtenjax._src.planning.jaxpr_reader import followed_operand
from dtenjax._src.planning.jaxpr_reader import grouped_by_features
from dtenjax._src.planning.jaxpr_reader import scalar_fills
from dtenjax._src.planning.jaxpr_reader import sub_jaxprs

# Values XLA computes inside the fusion of their consumer (recomputed there, never materialised)
# when every consumer is such an op: elementwise ops and cheap data movement; reductions take
# fused producers as their input (XLA's input fusions) but are fusion roots themselves.
_FUSIBLE = ELEMENTWISE | frozenset(
    "broadcast_in_dim slice pad reshape squeeze expand_dims concatenate iota rev select_n "
    "convert_element_type".split())
# XLA:CPU gives an op to YNNPACK only where it or an operand has this many elements
# (IsInstructionPreferredByYnn's kMinElements)
YNN_MIN_ELEMENTS = 4096
_PRODUCTS = frozenset(("dot_general", "conv_general_dilated"))
# jax.checkpoint's calls (jax 0.10's ``remat2``)
_REMATS = frozenset(("checkpoint", "remat", "remat2"))
# ops that only change a value's shape or type (a broadcast's size-1 dimensions)
_RESHAPES = frozenset("broadcast_in_dim reshape squeeze expand_dims convert_element_type".split())
_FUSED_INTO_CONSUMERS = _FUSIBLE | frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
# Elementwise primitives XLA counts as expensive (HloInstruction::IsExpensive): it does not
# duplicate them into several consumers' fusions.
_EXPENSIVE = frozenset("""
acos acosh asin asinh atan atan2 atanh cbrt cos cosh div erf erf_inv erfc exp exp2 expm1 log log1p
logistic pow rsqrt sin sinh sqrt tan tanh
""".split())


@dataclasses.dataclass(frozen=True)
class Live:
  """A value the step materialises at its top level (or the peak of a loop body's values while
  the loop runs), live from equation ``start`` to its last use ``end``: what XLA's buffer
  assignment places, in a temporary buffer or in an output's buffer before the output is
  written (:func:`dtenjax._src.planning.solver.simulate_memory`)."""
  start: int
  end: int
  nbytes: int                          # global
  grad: tuple[int, ...] | None = None  # a state leaf's shape: a gradient (sized by its layout)
  owners: tuple[tuple[int, int], ...] = ()   # (leaf, free dim) cones that shard it (pairs)
  # one of the values live at the peak of the body of the call at ``start`` (a loop's, whose
  # values are placed together, as one block, while it runs)
  body: bool = False
  # a transposed copy of a product's operand that XLA:CPU's kernels make (:func:`_dot_copies`,
  # :func:`_conv_copies`), or a pad's second buffer beside such a copy (:func:`_pad_buffers`);
  # a GPU's libraries read transposed operands in place
  copy: bool = False
  # kept only because XLA:CPU does not duplicate its op (f32 exp, division, square roots) into
  # several users' fusions; XLA:GPU recomputes them in each (:func:`_cheap_on_gpu`); or kept
  # beside a cheap unary XLA:CPU duplicates (:func:`_recomputed_unaries`)
  cheap_on_gpu: bool = False
  # its last use on XLA:GPU where that differs from XLA:CPU's: later where a value XLA:GPU's
  # fusions recompute reads this one (:func:`_gpu_ends`), earlier where only XLA:CPU keeps it
  # beside a cheap unary it duplicates (:func:`_recomputed_unaries`); None where they agree
  gpu_end: int | None = None
  # a product's result that only a transpose reads: XLA:CPU writes the product in the
  # transpose's layout, one buffer (:func:`_folded_transposes`); priced on the CPU as that one
  folded: bool = False
  # a broadcast operand buffer of XLA:CPU's reducing fusion (:func:`_expanded_operands`): the
  # global elements of that fusion's reduced result, or of the product a column statistic's
  # reduction sums (:func:`_column_statistics`; 0 for every other value), and the state leaf it
  # broadcasts (None: a value the step computes)
  expands: int = 0
  expands_leaf: int | None = None
  # a layer norm's ``rsqrt * scale`` (:func:`_unary_source`): the scale's leaf, whose gather
  # per use (FSDP) fuses the product into each reader; kept where the scale is not gathered
  scaled_by: int | None = None
  # a product's result: its (batch, rows, columns, contraction) elements (global), which
  # XLA:GPU may compute split over its contraction (``solver.split_k``), and the equation
  # whose fusion sums the split parts (:func:`_gemms`)
  gemm: tuple[int, int, int, int] | None = None
  gemm_sum_at: int = 0
  # one of a call's body values at its peak that is the call's own result, which the timeline
  # also holds as the call's output from the same equation: one buffer on XLA:GPU (llama-1b's
  # take_along_axis backward, a jit whose scatter-add writes its f32 logits-sized result in
  # place: one 1 GiB buffer in XLA:GPU's FSDP x TP step, two in the model); priced there once
  call_result: bool = False
  # its first equation on XLA:GPU where that differs from XLA:CPU's: a weight gradient XLA:CPU
  # makes after the input gradient's product (:func:`_input_gradient_first`) is made at its own
  # equation on XLA:GPU (the later start moved its compiled rows of
  # tests/data/xla_gpu_mock8.json further under: moe FSDP -2.3 % -> -6.4 %); None where they agree
  gpu_start: int | None = None
  # a value of a state leaf's shape (``grad``) that the optimizer's update computes from a
  # weight's gradient (:func:`_update_values`): XLA's partitioner reduces the gradient before
  # it and runs the update on the leaf's shard, so it is sized as the leaf's shard, not as the
  # whole gradient, and lives until its last use
  update: bool = False
  # not a value: the fourth heap slot XLA:CPU may give a sliced loss's vocabulary chain, one
  # buffer of the slice's size beside the pad's (heapslot.Slot: what decides it per layout);
  # the solver prices it on the CPU only, where heapslot.holds_a_fourth says so
  slot: heapslot.Slot | None = None
  # a grouped convolution's input gathered over the batch axes, or its result computed for the
  # whole batch before XLA slices it to the device's rows (:func:`_grouped_whole`): ``nbytes``
  # a device, not split over the batch
  whole: bool = False
  # XLA:CPU's copy of a kernel's gradient that a convolution makes in another layout: the
  # shape of the gradient it copies. The kernel's gradient contracts the batch, its convolution
  # written with the kernel's input features as its batch dimension ([in, window..., out] for
  # an HWIO kernel) and transposed into the kernel's layout; the combined all-reduce of the
  # gradients reads the copy, which lives until it (XLA:CPU's buffer assignment on 8 CPU
  # devices, `data` 8, three 3 x 3 convolutions: f32[32,3,3,32] made in an output's buffer and
  # its f32[3,3,32,32] copy in the temporary buffer until the all-reduce; sized before as an
  # activation, split over the batch, at the convolution alone, the memory was -10.2 %)
  turned_gradient: tuple[int, ...] | None = None

  def made_on_cpu(self, batch_div: float, gathered_per_use: Collection[int]) -> bool:
    """Whether XLA:CPU makes this value where the batch is split ``batch_div`` ways: a reducing
    fusion's broadcast operand only where its reduced result has YNN_MIN_ELEMENTS per device,
    and not of a weight sharded over a batch axis (``gathered_per_use``: XLA's partitioner
    all-gathers it for each reader, and each broadcast of a gather, read once, is fused); a
    layer norm's ``rsqrt * scale`` likewise not where its scale is (``scaled_by``)."""
    return self.scaled_by not in gathered_per_use and (
        not self.expands or (self.expands / batch_div >= YNN_MIN_ELEMENTS and
                             self.expands_leaf not in gathered_per_use))


@dataclasses.dataclass(frozen=True, eq=False)
class _Copy:
  """The transposed copy of the value ``of`` (each copy a value of its own)."""
  of: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Dense:
  """A depthwise kernel's gradient made dense, or its masked copy (:func:`_depthwise_dense`)."""
  of: Any
  second: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class _Whole:
  """The value ``of`` for the whole batch on every device (:func:`_grouped_whole`)."""
  of: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Expanded:
  """The value ``of`` broadcast to the shape of a reducing fusion that reads it, one buffer
  (:func:`_expanded_operands`)."""
  of: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Slot:
  """The heap slot beside the vocabulary chain whose sliced value is ``of`` (heapslot)."""
  of: Any


@dataclasses.dataclass(frozen=True, eq=False)
class _Again:
  """One more buffer of the value ``of``, computed again for another product that reads it
  (:func:`_pad_buffers`)."""
  of: Any


def cone_shares(cones: Mapping[Any, Any], amount: Mapping[Any, float],
                total: float) -> dict[Any, float]:
  """Each cone's share of ``total``: the ``amount`` of the values in it, a value in several cones
  split evenly among them. A cone is a set of values, iterated in an order that changes from one
  process to the next: the sum is exactly rounded (``math.fsum``), so the share is the same in
  every process (a last-bit difference moved the lean solve's answer, and the plan with it)."""
  owners: dict[Any, int] = {}
  for cone in cones.values():
    for v in cone:
      if v in amount:
        owners[v] = owners.get(v, 0) + 1
  total = total or 1.0
  return {key: math.fsum(amount[v] / owners[v] for v in cone if v in owners) / total
          for key, cone in cones.items()}


def activations(jaxpr, leaves: Sequence[Any], cones: Mapping[tuple[int, int], set[Any]],
                batch_carried: Collection[Any] = frozenset(),
                split: Mapping[tuple[int, int], set[Any]] | None = None
                ) -> tuple[int, dict[tuple[int, int], float], tuple[Live, ...]]:
  """The peak bytes of live batch-derived values (global), the share of them each paired
  ``(leaf, free dim)`` shards (its cone, :func:`dtenjax._src.planning.pairs.find_pairs`; a value
  in several cones is split among them) and the step's timeline of materialised values.
  ``leaves`` are the step's stepgraph.Leaf records, in the order of ``jaxpr``'s inputs;
  ``batch_carried`` the values of ``jaxpr``'s top level that carry a batch dimension
  (jaxpr_reader.Reader.batch): activations, never a gradient, whatever their shape. ``split``
  (pairs.loop_split_outputs) names more owners of the values it holds, with no share of the
  activations (a loop's residuals split as its carry, which no pair shards)."""
  state_shapes = _state_shapes(leaves)
  batch_vars = {v for lf, v in zip(leaves, jaxpr.invars) if lf.is_batch}
  counted: dict[Any, int] = {}
  lives: list[tuple[Any, int, int, int, tuple[int, ...] | None, bool]] = []
  gpu_fused: set[Any] = set()
  gpu_ends: dict[Any, int] = {}
  expanded_rows: dict[Any, tuple[int, int | None]] = {}
  call_results: set[Any] = set()
  gpu_starts: dict[Any, int] = {}
  scaled: dict[Any, int] = {}
  turned_results: set[Any] = set()      # kernels' gradients convolutions make transposed
  act = _peak(jaxpr, batch_vars, state_shapes, counted, lives, gpu_fused=gpu_fused,
              gpu_ends=gpu_ends, expanded_rows=expanded_rows, call_results=call_results,
              gpu_starts=gpu_starts, scaled=scaled, batch_carried=frozenset(batch_carried),
              turned_results=turned_results)
  slots = _heap_slots(jaxpr, state_shapes, lives)
  updates = _update_values(jaxpr, state_shapes, frozenset(batch_carried))
  folded = _folded_transposes(jaxpr)
  gemms = _gemms(jaxpr)
  act_share = cone_shares(cones, counted, sum(counted.values()))
  cone_keys: dict[Any, list[tuple[int, int]]] = {}
  for key, cone in sorted({**(split or {}), **cones}.items()):
    for v in cone:
      cone_keys.setdefault(v, []).append(key)
  def owners(v):
    v = v.of if isinstance(v, (_Copy, _Again, _Slot)) else v
    return tuple(cone_keys.get(v, ())) if v is not None else ()
  def live(v, start, end, nb, grad, body) -> Live:
    expands, expands_leaf = expanded_rows.get(v, (0, None))
    gemm, gemm_sum_at = gemms.get(v, (None, 0))
    return Live(start, end, nb, grad, owners(v), body,
                copy=isinstance(v, (_Copy, _Again, _Dense)), cheap_on_gpu=v in gpu_fused,
                gpu_end=gpu_ends.get(v) if gpu_ends.get(v, end) != end else None,
                folded=v in folded, expands=expands, expands_leaf=expands_leaf, gemm=gemm,
                gemm_sum_at=gemm_sum_at, call_result=body and v in call_results,
                gpu_start=gpu_starts.get(v), slot=slots.get(v), scaled_by=scaled.get(v),
                update=grad is not None and v in updates, whole=isinstance(v, (_Whole, _Dense)),
                turned_gradient=turned.get(v))
  turned = {entry[0]: tuple(entry[0].of.aval.shape) for entry in lives
            if isinstance(entry[0], _Copy) and entry[0].of in turned_results}
  timeline = tuple(live(*entry) for entry in lives)
  return int(act), act_share, timeline


def _state_shapes(leaves: Sequence[Any]) -> set[tuple[int, ...]]:
  """The shapes of the state leaves of two or more dimensions (the weights and their moments)."""
  return {lf.shape for lf in leaves if not lf.is_batch and len(lf.shape) >= 2}


def _of_state_shape(v, state_shapes: set) -> bool:
  """Whether ``v`` has a state leaf's shape, or its transpose's (a weight's gradient may be
  made either way round)."""
  shape = tuple(getattr(v.aval, "shape", ()))
  return shape in state_shapes or tuple(reversed(shape)) in state_shapes


def _read_by_products(jaxpr) -> set[Any]:
  """The values a product (a dot or a convolution) of ``jaxpr``'s top level reads."""
  return {v for eqn in jaxpr.eqns if eqn.primitive.name in _PRODUCTS
          for v in eqn.invars if is_var(v)}


def _update_values(jaxpr, state_shapes: set, batch_carried: frozenset = frozenset()) -> set[Any]:
  """The values of a state leaf's shape that the optimizer's update computes from the weights'
  gradients (:func:`_from_gradients`): an elementwise op's or a ``lax.cond``'s
  (``optax.apply_if_finite``'s branch) results, that no product reads, and that are not the
  gradient's own making (a transpose, the sum of a shared weight's gradients). XLA's
  partitioner all-reduces (or reduce-scatters) a gradient where its product makes it and
  propagates the leaf's sharding into the update's elementwise work, so these are the leaf's
  shard on every device: the updates apply_if_finite's branch returns are ``[16, 512]`` f32
  slices of w1's ``[128, 512]`` on an FSDP 8 step in XLA:CPU's compile, where the model sized
  them whole (its gradient term was 1 MiB, XLA's temporaries 1.0 MiB in all). A product's
  result transposed, cast or scaled by scalars not computed from the gradients is the gradient
  of a weight cast or scaled in the forward (``x @ (0.5 * w)``'s ``0.5 * g``; of a weight cast
  to bf16 and scaled there, ``g`` cast, scaled and cast back), not the update: XLA reduces it
  whole (an MLP with both weights scaled, under ``apply_if_finite(adamw)`` on FSDP 8, whose
  branch reads the scaled gradients: XLA:CPU's temporaries are the unscaled step's, 1.00 MiB;
  sized as shards they were 0.75). Clipping's ``g * (c / norm)`` is the update's: its scale is."""
  read_by_products = _read_by_products(jaxpr)
  from_grads = _from_gradients(jaxpr, state_shapes, read_by_products, batch_carried)
  made = {o for eqn in jaxpr.eqns if eqn.primitive.name in _PRODUCTS for o in eqn.outvars}
  fills = scalar_fills(jaxpr)
  out: set[Any] = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("transpose", "reshape", "convert_element_type") and eqn.invars[0] in made:
      made.update(eqn.outvars)
      continue
    scaled = followed_operand(eqn, fills)
    if scaled is not None and scaled in made and not any(
        is_var(v) and v in from_grads for v in eqn.invars if v is not scaled):
      made.update(eqn.outvars)   # the gradient of a weight scaled in the forward: 0.5 * g
      continue
    if ((name == "cond" or (name in ELEMENTWISE and name != "add_any")) and
        any(is_var(v) and v in from_grads for v in eqn.invars)):
      out.update(o for o in eqn.outvars if _of_state_shape(o, state_shapes))
  return out - read_by_products


def _from_gradients(jaxpr, state_shapes: set, read_by_products: set[Any],
                    batch_carried: frozenset = frozenset()) -> set[Any]:
  """The values ``jaxpr`` computes from a weight's gradient (a product's result of a state
  leaf's shape that no product reads, ``read_by_products``, and that carries no batch
  dimension, ``batch_carried``: a square MLP's ``x @ w1`` is an activation), through any ops
  but products."""
  from_grads: set[Any] = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _PRODUCTS:
      from_grads.update(o for o in eqn.outvars
                        if o not in read_by_products and o not in batch_carried and
                        _of_state_shape(o, state_shapes))
    elif any(is_var(v) and v in from_grads for v in eqn.invars):
      from_grads.update(eqn.outvars)
  return from_grads


def update_reduces(jaxpr, leaves: Sequence[Any], batch_carried: Collection[Any] = frozenset()
                   ) -> bool:
  """Whether the optimizer's update sums a value it computes from the weights' gradients
  (``clip_by_global_norm``'s norm, adafactor's factored means). On a layout that shards the
  weights over a batch axis the update runs on each leaf's shard, so each such sum is an
  all-reduce that reads a reduced gradient: XLA's combiner joins no all-reduce with one it
  depends on, so it reduces the gradients one at a time, each joined with the sum of the one
  before (XLA:CPU's compiles of optax_chain and adafactor in tests/test_plan_user_steps.py: two
  gradient all-reduces, each of one gradient and a scalar), not in one combined all-reduce after
  the backward (solver._combined_reduction). A reduction of another kind is all-reduced apart
  from the sums (apply_if_finite's ``reduce_and`` of ``is_finite``: XLA combines the gradients'
  sums into one all-reduce there). A trained scale's gradient is no such sum: ``sum(g * wq)``
  reads the dequantized weight's gradient and its integer (or float8) conversion, in the
  backward before any reduction (two int8 weights sharing a trained scale on `data` 8: one
  combined all-reduce of both dequantized gradients and w2's, XLA:CPU's compile)."""
  from_grads = _from_gradients(jaxpr, _state_shapes(leaves), _read_by_products(jaxpr),
                               frozenset(batch_carried))
  invars = set(jaxpr.invars)
  conversions = {eqn.outvars[0] for eqn in jaxpr.eqns
                 if eqn.primitive.name == "convert_element_type" and eqn.invars[0] in invars
                 and is_quantized_dtype(eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype)}
  scale_grads: set[Any] = set()
  for eqn in jaxpr.eqns:
    ins = [v for v in eqn.invars if is_var(v)]
    if ((eqn.primitive.name == "mul" and any(v in conversions for v in ins)) or
        (eqn.primitive.name in ("reduce_sum", "reshape") and ins and ins[0] in scale_grads)):
      scale_grads.update(eqn.outvars)
  return any(eqn.primitive.name == "reduce_sum" and
             any(is_var(v) and v in from_grads and v not in scale_grads for v in eqn.invars)
             for eqn in jaxpr.eqns)


def gradient_parts(jaxpr, leaves: Sequence[Any]) -> dict[tuple[int, ...], int]:
  """A state leaf's shape -> how many products of ``jaxpr``'s top level make its gradient, where
  more than one: a weight read twice (``x @ w``, later ``h @ w.T``) has a gradient product per
  read, summed (``add_any``, through transposes, reshapes and casts) into its gradient. A weight
  gradient's product reads no weight (:func:`_weight_values`: the forward's and the input
  gradients' products do) and no product reads its result. XLA:CPU reduces each part into a
  buffer of its own (in one all-reduce where the update reduces the gradients one at a time,
  :func:`update_reduces`; among the others' in the combined one elsewhere) and sums them in the
  update (solver._combined_reduction, :func:`_parts_read_late`). Leaves of one shape share its
  largest count."""
  state_shapes = _state_shapes(leaves)
  weights = _weight_values(jaxpr, leaves)
  read_by_products = _read_by_products(jaxpr)
  parts: dict[Any, int] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [v for v in eqn.invars if is_var(v)]
    if name in _PRODUCTS:
      if not any(v in weights for v in ins):
        parts.update((o, 1) for o in eqn.outvars
                     if o not in read_by_products and _of_state_shape(o, state_shapes))
    elif (name in _RESHAPES or name == "transpose") and len(ins) == 1 and ins[0] in parts:
      parts[eqn.outvars[0]] = parts[ins[0]]
    elif name == "add_any" and ins and all(v in parts for v in ins):
      parts[eqn.outvars[0]] = sum(parts[v] for v in ins)
    elif (name == "broadcast_in_dim" and not ins and _of_state_shape(eqn.outvars[0], state_shapes)
          and _is_zero(eqn.invars[0])):
      # the zeros a written-out loop's gradient is accumulated into (jaxpr_reader.unroll_loops:
      # a backward scan's carried gradient starts at them): no product
      parts[eqn.outvars[0]] = 0
  out: dict[tuple[int, ...], int] = {}
  for v, n in parts.items():
    shape = tuple(v.aval.shape)
    if n > 1 and shape in state_shapes:
      out[shape] = max(out.get(shape, 1), n)
  return out


def _is_zero(v) -> bool:
  """Whether ``v`` is the literal zero (a broadcast's fill)."""
  return not is_var(v) and getattr(v, "val", None) is not None and not (v.val != 0)


def _weight_values(jaxpr, leaves: Sequence[Any]) -> set[Any]:
  """The state leaves of ``jaxpr``'s top level and the values made from one alone: by reshapes,
  transposes and casts, or an elementwise op whose other operands are scalars (``0.5 * w``). A
  product that reads one is the forward's or an input gradient's, never a weight's gradient."""
  weights = {v for lf, v in zip(leaves, jaxpr.invars) if not lf.is_batch}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [v for v in eqn.invars if is_var(v) and getattr(v.aval, "shape", ()) != ()]
    if (len(ins) == 1 and ins[0] in weights and
        (name in _RESHAPES or name == "transpose" or name in ELEMENTWISE)):
      weights.update(eqn.outvars)
  return weights


def weight_reads(jaxpr, leaves: Sequence[Any]) -> dict[int, tuple[tuple[int, bool], ...]]:
  """State leaf index -> the equations of ``jaxpr``'s top level that read it, or a value made
  from it by reshapes, transposes, casts and scalings (``0.5 * w``, ``-w``:
  jaxpr_reader.followed_operand, which plan.jit gathers where a product reads it: gather.py;
  where a layout gathers it, the readers of its gathered copy), each with whether it is a
  product (solver._combined_reduction). An elementwise op or a reduction that reads the weight
  itself, not on its way to a product (the gradient of a scalar that scales it, ``sum(g * w)``),
  reads its own shard (plan.jit gathers for products only): no reader of the gathered copy.
  (``x @ (w1 * s)`` of a scalar parameter ``s`` held w1's copy past the forward in the model,
  where XLA frees it: +256 KiB, +17.8 % on an MLP's FSDP 8 step under apply_if_finite.)
  A ``jax.checkpoint`` call whose body reads the weight by products alone (the backward's call,
  which recomputes ``x @ w1`` and makes w1's gradient) is a product's read
  (:func:`_read_by_products_only`): XLA inlines its body, where the copy's last read is the
  rematerialized product."""
  made_from: dict[Any, int] = {v: lf.index for lf, v in zip(leaves, jaxpr.invars)
                               if not lf.is_batch}
  reads: dict[int, list[tuple[int, bool]]] = {}
  fills = scalar_fills(jaxpr)
  for i, eqn in enumerate(jaxpr.eqns):
    name = eqn.primitive.name
    for v in eqn.invars:
      if is_var(v) and v in made_from:
        k = made_from[v]
        if ((name in ELEMENTWISE or name in REDUCTIONS) and
            followed_operand(eqn, fills) is not v):
          continue                    # reads the weight's shard
        product = name in _PRODUCTS or (name in _REMATS and _read_by_products_only(eqn, v))
        if not reads.get(k) or reads[k][-1][0] != i:
          reads.setdefault(k, []).append((i, product))
        if (eqn.primitive.name in _RESHAPES or eqn.primitive.name == "transpose" or
            followed_operand(eqn, fills) is v):
          made_from.update((o, k) for o in eqn.outvars)
  return {k: tuple(v) for k, v in reads.items()}


def _read_by_products_only(eqn, v) -> bool:
  """Whether a call's body reads its operand ``v`` (every operand that is ``v``) only as a
  product's operand."""
  sub = eqn.params.get("jaxpr")
  body = getattr(sub, "jaxpr", sub)
  if body is None or len(body.invars) != len(eqn.invars):
    return False
  inner = {b for a, b in zip(eqn.invars, body.invars) if a is v}
  readers = [e for e in body.eqns if any(is_var(u) and u in inner for u in e.invars)]
  return (bool(readers) and all(e.primitive.name in _PRODUCTS for e in readers)
          and not any(is_var(u) and u in inner for u in body.outvars))


def _heap_slots(jaxpr, state_shapes: set, lives: list) -> dict[Any, heapslot.Slot]:
  """Appends to ``lives`` a slot entry per vocabulary chain of ``jaxpr`` (heapslot.find) whose
  pad the timeline holds: the sliced value's bytes, live with the pad's buffer; returns each
  entry's value -> its heapslot.Slot (the timeline's indices of the chain's products)."""
  index = {id(entry[0]): k for k, entry in enumerate(lives) if not entry[5]}
  out: dict[Any, heapslot.Slot] = {}
  for chain in heapslot.find(jaxpr, state_shapes):
    pad = index.get(id(chain.padded))
    if pad is None:
      continue
    v = _Slot(chain.sliced)
    _, start, end, *_ = lives[pad]
    out[v] = heapslot.Slot(pad, index.get(id(chain.input_grad)),
                           index.get(id(chain.weight_grad)), chain.weight_leaf,
                           chain.frees_operand)
    lives.append((v, start, end, nbytes(chain.sliced.aval), None, False))
  return out


def _peak(jaxpr, batch_vars: set, excluded_shapes: set,
          counted: dict[Any, int] | None = None,
          timeline: list[tuple[Any, int, int, int, tuple[int, ...] | None, bool]] | None = None,
          at_peak: list[tuple[Any, int]] | None = None, sliced: frozenset = frozenset(),
          gpu_fused: set | None = None, gpu_ends: dict[Any, int] | None = None,
          expanded_rows: dict[Any, tuple[int, int | None]] | None = None,
          call_results: set | None = None,
          gpu_starts: dict[Any, int] | None = None,
          scaled: dict[Any, int] | None = None,
          batch_carried: frozenset = frozenset(),
          loop_parts: list[tuple[Any, int, tuple[int, ...]]] | None = None,
          shared_results: bool = False, turned_results: set | None = None) -> int:
  """Peak bytes of live batch-derived values over ``jaxpr``'s equations in order (bodies of
  calls add their own peak while they run); ``counted`` collects the values it counts and
  ``timeline`` (value or None, start, end, bytes, state shape or None, in a body's peak) every
  materialised
  batch-derived value, the gradients (values of a state leaf's shape) included, and the values
  live at each body's peak as values of one equation (so that a layout sizes each of them); the
  step's own outputs are not in it. ``at_peak`` receives the (value, bytes) live at the peak.
  A loop's stacked output repeated in its body counts once, live until its copies' last use
  (:func:`_duplicates`). ``sliced`` are the inputs of a ``lax.scan`` body that are one layer's
  slice of a stacked operand: XLA copies such a slice out of its stack when a product reads it
  (its ``dynamic-slice`` is not fused into the dot kernel's operand), at the body's start (its
  scheduler puts the slices first), live until the slice's last use in the body. ``gpu_fused``
  receives the values kept only because XLA:CPU counts their op expensive where XLA:GPU does
  not (:func:`_cheap_on_gpu`, :func:`_cheap_call_on_gpu`) or only XLA:CPU keeps
  (:func:`_recomputed_unaries`), and ``gpu_ends`` the last uses XLA:GPU's fusion moves (later for
  the values its recomputations read, :func:`_gpu_ends`), ``gpu_starts`` the first equations of
  the weight gradients XLA:CPU makes later, ``scaled`` a layer norm's ``rsqrt * scale`` ->
  its scale's input index (:func:`_unary_source`). ``expanded_rows`` receives the
  buffers XLA:CPU's reducing fusions make of broadcast operands (:func:`_expanded_operands`;
  their reduced result's elements and the input leaf they broadcast), which are put in the
  timeline only: whether XLA makes them depends on the layout. ``call_results`` receives the
  values at the peak of a call's body (not a loop's) that are the call's own results. A value of
  a state leaf's shape is a gradient (sized by its layout) unless it carries a batch dimension
  (``batch_carried``): an activation that has a weight's shape (a square MLP's ``x @ w1``, a
  loss residual of a weight's transposed shape) is split over the batch as any other. The
  lifetimes counted here are XLA:CPU's. ``loop_parts`` receives, for a loop's body, the
  products of a state leaf's shape it makes (value, bytes, shape): the gradient part of a weight
  read in the loop, which the body adds into the carried gradient after it is made (and reduced,
  over the batch axes), so that the part lives beside the carry while the loop runs."""
  canon = _duplicates(jaxpr)

  def same(v):
    return canon.get(v, v)

  tainted = set(batch_vars)
  last_use: dict[Any, int] = {}
  feeds_fusion_boundary: set[Any] = set()
  users: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    boundary = eqn.primitive.name not in _FUSED_INTO_CONSUMERS or _keeps_minor(eqn)
    for v in eqn.invars:
      if is_var(v):
        v = same(v)
        last_use[v] = i
        users[v] = users.get(v, 0) + 1
        if boundary:
          feeds_fusion_boundary.add(v)
  # values an elementwise chain carries into a reduction over leading dimensions (which XLA:CPU
  # does not fuse its producers into): a producer there that also has other users is computed
  # once and kept, not duplicated into each user's fusion, unless it is a cheap op XLA
  # recomputes from what it reads (a layer norm's x - mean: _unary_source)
  into_major: set[Any] = set()
  for eqn in reversed(jaxpr.eqns):
    if _keeps_minor(eqn) or (eqn.primitive.name in _FUSIBLE and
                             any(same(o) in into_major for o in eqn.outvars)):
      into_major.update(same(v) for v in eqn.invars if is_var(v))
  producers = {same(o): eqn for eqn in jaxpr.eqns for o in eqn.outvars}
  for v in into_major:
    if users.get(v, 0) >= 2:
      src, walked = _unary_source(v, producers, same)
      if src is None:           # rsqrt * scale, kept where the scale is not gathered per use
        feeds_fusion_boundary.add(v)
        leaf = _weight_leaf(v, producers, jaxpr.invars)
        if scaled is not None and leaf is not None:
          scaled[v] = leaf
        continue
      feeds_fusion_boundary.add(src)
      for w in walked:          # recomputed from ``src`` by each of its readers
        last_use[src] = max(last_use.get(src, -1), last_use.get(w, -1))
  # XLA duplicates a producer into each of its users' fusions only when it is cheap: the result
  # of an expensive elementwise op (tanh, exp, a division, ...) read by several is computed once
  # and kept (softmax's exponentials too: XLA:CPU materialises them for the sum, the division
  # and the backward, which reads them). XLA:GPU counts f32 exp, division and square roots
  # cheap and recomputes them in each user's fusion (:func:`_cheap_on_gpu`).
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _EXPENSIVE:
      for o in eqn.outvars:
        if users.get(o, 0) >= 2 and o not in feeds_fusion_boundary:
          feeds_fusion_boundary.add(o)
          if gpu_fused is not None and _cheap_on_gpu(eqn):
            gpu_fused.add(o)
  # small values XLA:CPU broadcasts into a buffer of their own for its reducing fusions
  expanded = (_expanded_operands(jaxpr, same, feeds_fusion_boundary)
              if expanded_rows is not None else [])
  if gpu_fused is not None:
    gpu_fused.update(e for e, *_ in expanded)
    gpu_fused.update(_kept_on_cpu_only(jaxpr, same, users, feeds_fusion_boundary))
    if gpu_ends is not None:
      gpu_ends.update(_gpu_ends(jaxpr, same, last_use, feeds_fusion_boundary, gpu_fused))
  # XLA:GPU's last uses: XLA:CPU's before it keeps cheap unaries' operands, moved later for the
  # values XLA:GPU's recomputing fusions read
  gpu_last, gpu_kept = dict(last_use), set(feeds_fusion_boundary)
  for v, e in (gpu_ends or {}).items():
    gpu_last[v] = max(gpu_last.get(v, e), e)
  _recomputed_unaries(jaxpr, same, last_use, feeds_fusion_boundary)
  runs_until = _input_gradient_first(jaxpr, excluded_shapes, same, last_use, batch_carried)
  _input_gradient_first(jaxpr, excluded_shapes, same, gpu_last, batch_carried)
  outvars = {same(v) for v in jaxpr.outvars if is_var(v)}
  _tanh_read_late(jaxpr, same, last_use, feeds_fusion_boundary, outvars)
  _scaled_read_late(jaxpr, same, last_use, feeds_fusion_boundary, outvars, excluded_shapes,
                    batch_carried)
  _parts_read_late(jaxpr, same, last_use, feeds_fusion_boundary, outvars, excluded_shapes,
                   batch_carried)
  for v in outvars:
    last_use[v] = gpu_last[v] = len(jaxpr.eqns)
  fills = scalar_fills(jaxpr)
  live = 0
  peak = 0
  ends: dict[int, list[Any]] = {}
  live_set: dict[Any, int] = {}
  after: dict[Any, int] = {}         # a weight gradient (or its transpose) -> when it is made
  # a scan body's sliced batch-derived inputs that a product reads: copied out of their stacks
  # when the body starts (XLA schedules these slices first) and live until their last use
  readers: dict[Any, int] = {}       # value -> the products that read it
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      for v in set(eqn.invars[:2]):
        if is_var(v):
          readers[same(v)] = readers.get(same(v), 0) + 1
  read = set(readers)
  if timeline is not None and expanded_rows is not None:
    # priced per layout by the solver (Live.expands), outside the layout-free peak here
    leaf_of = {v: k for k, v in enumerate(jaxpr.invars)}
    for v, start, end, nb, rows in expanded:
      timeline.append((v, start, end, nb, None, False))
      expanded_rows[v] = (rows, leaf_of.get(v.of))
  for v in jaxpr.invars:
    if v not in sliced or v not in tainted or v not in read:
      continue
    nb = nbytes(v.aval)
    if timeline is not None:
      timeline.append((v, 0, last_use[v], nb, None, False))
    live += nb
    live_set[v] = nb
    ends.setdefault(last_use[v], []).append(v)
    if counted is not None:
      counted[v] = nb
  for i, eqn in enumerate(jaxpr.eqns):
    if any(is_var(v) and v in tainted for v in eqn.invars):
      inner, inner_set = 0, []
      for sub, _ in sub_jaxprs(eqn):
        n_outer = len(eqn.invars) - (1 if eqn.primitive.name == "cond" else 0)
        sub_batch = {sv for sv, ov in zip(sub.invars, list(eqn.invars)[-n_outer:])
                     if is_var(ov) and ov in tainted}
        sub_set: list[tuple[Any, int]] = []
        xs = (frozenset(sub.invars[sum(jaxapi.scan_counts(eqn)):])
              if eqn.primitive.name == "scan" else frozenset())
        parts: list[tuple[Any, int, tuple[int, ...]]] | None = (
            [] if eqn.primitive.name in ("scan", "while") else None)
        # a conditional's results, and a jax.checkpoint call's (JAX lowers its body inline,
        # mlir.jaxpr_subcomp: the body's result is the call's output, one buffer), are counted
        # as the equation's outputs, not again in the body (a checkpointed second layer at
        # batch 4096 on `fsdp` 8: its input gradient twice, 1 MiB a device over XLA's)
        sub_peak = _peak(sub, sub_batch, excluded_shapes, at_peak=sub_set, sliced=xs,
                         batch_carried=batch_carried, loop_parts=parts,
                         shared_results=(eqn.primitive.name == "cond"
                                         or eqn.primitive.name in _REMATS))
        if parts and timeline is not None:
          # a weight's gradient part made in a loop's body: XLA:CPU writes the part (and its
          # reduction) into buffers of their own while the carried gradient it is added into
          # lives through the loop (the carry is the loop's output, in the timeline above)
          timeline.extend((v, i, i, nb, shape, True) for v, nb, shape in parts)
        if sub_peak > inner:
          inner, inner_set = sub_peak, sub_set
          if call_results is not None and eqn.primitive.name not in ("scan", "while", "cond"):
            outs = {o for o in sub.outvars if is_var(o)}
            call_results.update(v for v, _ in sub_set if v in outs)
      # the transposed copies of a product's operands, each sharded as the value it copies
      copies = (_conv_copies(eqn, tainted) if eqn.primitive.name == "conv_general_dilated" else
                _widened_dot(eqn, tainted, _dot_copies(eqn, tainted))
                if eqn.primitive.name == "dot_general" else [])
      if (eqn.primitive.name == "conv_general_dilated" and timeline is not None and
          turned_results is not None and _of_state_shape(eqn.outvars[0], excluded_shapes)):
        # a kernel's gradient (its result holds no batch) made in another layout: its
        # transposed copy is what the combined all-reduce reads (Live.turned_gradient)
        held = [(v, nb) for v, nb in copies if isinstance(v, _Copy) and v.of is eqn.outvars[0]]
        copies = [c for c in copies if c not in held]
        for v, nb in held:
          turned_results.add(eqn.outvars[0])
          timeline.append((v, i, i, nb, None, False))
      if copies and i in runs_until:     # made before the input gradient's product runs
        for v, nb in copies:             # and read by the weight gradient's, after it
          live += nb
          live_set[v] = nb
          ends.setdefault(runs_until[i] + 1, []).append(v)
          if timeline is not None:
            timeline.append((v, i, runs_until[i] + 1, nb, None, False))
      elif copies:
        inner += sum(nb for _, nb in copies)
        inner_set = inner_set + copies
      if eqn.primitive.name == "conv_general_dilated":
        whole = _grouped_whole(eqn, tainted)
        inner += sum(nb for _, nb in whole)
        inner_set = inner_set + whole
      if timeline is not None:
        timeline.extend((v, i, i, nb, None, True) for v, nb in inner_set if nb)
        if eqn.primitive.name == "conv_general_dilated" and (dense := _depthwise_dense(eqn)):
          # the dense product beside its operands' copies, then beside its masked copy, which
          # the operands' copies, dead by then, leave room for
          (first, nb), (second, _) = dense
          timeline.append((first, i, i + 1, nb, None, False))
          timeline.append((second, i + 1, i + 1, nb, None, True))
      for o in eqn.outvars:
        if i in runs_until:
          after[o] = runs_until[i] + 1
        elif eqn.primitive.name == "transpose" and eqn.invars[0] in after:
          after[o] = after[eqn.invars[0]]
      for o, computed in zip(eqn.outvars, _from_batch(eqn, tainted, excluded_shapes)):
        if not computed:
          continue
        tainted.add(o)
        if o in canon:                # computed once, as the value it repeats
          continue
        shape = tuple(o.aval.shape)
        nb = nbytes(o.aval)
        end = last_use.get(o)
        if end is None or nb == 0:
          continue
        # XLA fuses chains of elementwise ops into their consumers (recomputing them in the
        # backward's fusions): such a value is materialised only when a non-elementwise op
        # reads it
        if ((eqn.primitive.name in _FUSIBLE or _inlined_select(eqn, o, excluded_shapes,
                                                                batch_carried, fills)) and
            o not in feeds_fusion_boundary):
          continue
        state = (shape in excluded_shapes or tuple(reversed(shape)) in excluded_shapes) and (
            o not in batch_carried)
        if timeline is not None and o not in outvars:
          # a weight's gradient is made after the input gradient's product (XLA's order), and
          # so is a transpose of it (the two are one buffer on XLA:CPU, _folded_transposes)
          start = after.get(o, i) if state else i
          timeline.append((o, start, max(end, start), nb, shape if state else None, False))
          if start != i and gpu_starts is not None:
            gpu_starts[o] = i
          if gpu_fused is not None and eqn.primitive.name in _FUSIBLE and o not in gpu_kept:
            gpu_fused.add(o)          # kept by XLA:CPU only (_recomputed_unaries)
          if gpu_ends is not None and gpu_last.get(o, end) != end:
            gpu_ends[o] = gpu_last[o]
        if state:
          if loop_parts is not None and eqn.primitive.name in _PRODUCTS:
            loop_parts.append((o, nb, shape))
          continue
        if shared_results and o in outvars:
          continue
        for w in [o] + [_Again(o) for _ in range(_pad_buffers(eqn, readers.get(o, 0)) - 1)]:
          if w is not o and timeline is not None:
            timeline.append((w, i, end, nb, None, False))
          live += nb
          live_set[w] = nb
          ends.setdefault(end, []).append(w)
          if counted is not None:
            counted[w] = nb
      if live + inner > peak:
        peak = live + inner
        if at_peak is not None:
          at_peak[:] = list(live_set.items()) + inner_set
    for v in ends.pop(i, ()):
      live -= live_set.pop(v)
  return peak


def _scaled_read_late(jaxpr, same, last_use: dict[Any, int], materialised: set, outvars: set,
                      state_shapes: set, batch_carried: frozenset = frozenset()) -> None:
  """A value of a state leaf's shape scaled by scalars or negated (the gradient of a weight so
  changed in the forward, ``x @ (0.5 * w)``: ``0.5 * g``; ``x @ -w``: ``-g``,
  jaxpr_reader.followed_operand) where XLA fuses the scaling into its readers (the optimizer's
  update): the value is live until they run, as the unscaled gradient of ``x @ w`` is. In
  XLA:CPU's compile of an MLP's step with both weights scaled (or both negated), on FSDP 8, the
  gradients are all-reduced as products make them and the scaling is in the update's fusions;
  the model ended them at the scaling, 256 KiB under the compile (-17.9 % negated). An
  activation that has a weight's shape (``batch_carried``: gelu's ``0.5 * x`` of a square
  layer's ``x @ w1``) is no gradient: read late, it held the step's peak longer at the one batch
  size whose rows equal the weight's (review19d's cond step under jax 0.11)."""
  fills = scalar_fills(jaxpr)
  for eqn in reversed(jaxpr.eqns):
    v = followed_operand(eqn, fills)    # a cast too (``w.astype(bf16) * s``'s gradient cast back)
    if (v is None or eqn.primitive.name in _EXPENSIVE or not _of_state_shape(v, state_shapes)
        or v in batch_carried):
      continue
    o = same(eqn.outvars[0])
    if o in materialised and o not in outvars:
      continue
    end = last_use.get(o, -1)
    if last_use.get(same(v), -1) < end:
      last_use[same(v)] = end


def _inlined_select(eqn, o, state_shapes: set, batch_carried: frozenset,
                    fills: frozenset = frozenset()) -> bool:
  """A gradient ``o`` a call makes by one elementwise op of its operand (jnp.where's ``_where``
  of a scalar predicate: jaxpr_reader.followed_operand), which XLA inlines and fuses into the
  gradient's readers (the update) as the op itself. ``jnp.where(flag, w1, 0)``'s gradient,
  selected so, was a value of its own in the model, where XLA selects in the update's fusions:
  +256 KiB on an MLP on FSDP 8. (An activation's call, jax.nn.relu's, is kept materialised:
  made so, the small convnet's FSDP row moved from within 10 % to -12 %.)"""
  return (eqn.primitive.name in CALLS and _of_state_shape(o, state_shapes) and
          o not in batch_carried and followed_operand(eqn, fills) is not None)


def _parts_read_late(jaxpr, same, last_use: dict[Any, int], materialised: set, outvars: set,
                     state_shapes: set, batch_carried: frozenset) -> None:
  """The parts of a weight's gradient (a weight read by two products has a gradient product
  per read, :func:`gradient_parts`) summed by an ``add_any`` that XLA fuses into its readers
  (the optimizer's update): each part is live until they run. XLA's partitioner all-reduces
  each part where its product makes it and adds the reduced parts in the update's fusions
  (XLA:CPU's compile of an MLP whose weights two products each read, adamw on FSDP 8: one
  all-reduce of the four parts, each added to its pair in the update); the model ended the
  parts at their sum, 1 MiB under the compile's 2.0 MiB of temporaries (-41.6 %)."""
  for eqn in reversed(jaxpr.eqns):
    if eqn.primitive.name != "add_any":
      continue
    o = same(eqn.outvars[0])
    if (o in materialised and o not in outvars or o in batch_carried or
        not _of_state_shape(o, state_shapes)):
      continue
    end = last_use.get(o, -1)
    for v in eqn.invars:
      if is_var(v) and last_use.get(same(v), -1) < end:
        last_use[same(v)] = end


def _tanh_read_late(jaxpr, same, last_use: dict[Any, int], materialised: set,
                    outvars: set) -> None:
  """jax 0.11 differentiates ``tanh`` through ``one_minus_square(y)`` (``1 - y**2``), where jax
  0.10 spelled it out and the backward read ``y`` itself. XLA fuses it into the backward's
  consumer, which computes it from ``y``: the tanh's result is live until then, as under jax
  0.10. (Other fused chains are left as they were: extending every fused value's operands, tried,
  moved jax 0.10's tensor-parallel and convnet rows by 6-25 %: convnet TP 69 -> 86 MiB, XLA 75.)"""
  for eqn in reversed(jaxpr.eqns):
    if eqn.primitive.name != "one_minus_square":
      continue
    outs = [same(o) for o in eqn.outvars]
    if any(o in materialised or o in outvars for o in outs):
      continue
    end = max((last_use.get(o, -1) for o in outs), default=-1)
    for v in eqn.invars:
      if is_var(v) and last_use.get(same(v), -1) < end:
        last_use[same(v)] = end


def _pad_buffers(eqn, products: int) -> int:
  """The buffers XLA:CPU keeps of a ``pad``'s result that ``products`` products read: one each.
  The backward of a slice (``logits[:, :-1]``) is a pad that the weight's and the input's
  gradient products both read; the pad is cheap, so XLA:CPU fuses a copy of it into the input
  gradient's operand (a bitcast to rows x vocabulary), while the transposed copy of the weight
  gradient's operand reads a buffer of its own: three buffers of the logits' size at the step's
  peak (the buffer assignment's ``pad_bitcast_fusion``, ``wrapped_pad`` and the copy), where the
  model kept two. The extra buffers are priced on the CPU only (``Live.copy``): a GPU's gemm
  reads the pad's one buffer transposed in place."""
  return max(1, products) if eqn.primitive.name == "pad" else 1


def _recomputed_unaries(jaxpr, same, last_use: dict[Any, int], materialised: set) -> None:
  """XLA:CPU's fusion duplicates a cheap elementwise op with one full-size operand (the others
  broadcasts or scalars: ``InstructionFusion``'s ``EffectivelyAtMostUnary``) into every
  consumer that fuses it, and materialises it only for the consumers that cannot (a product):
  the backward's ``2 h / n`` of a mean square is computed again from ``h`` in each elementwise
  consumer. Such a value lives until its last unfusing reader, and its operand (through
  producers fused into it) until its last fusing one; an operand with several full operands of
  its own is not duplicated but kept (``h``, a residual sum). Updates ``last_use`` and
  ``materialised`` in place. XLA:GPU's priority fusion fuses a producer into all of its
  consumers or none, so this is priced on the CPU only (``Live.gpu_end``, ``cheap_on_gpu``)."""
  producer = {o: eqn for eqn in jaxpr.eqns for o in eqn.outvars}
  fusing: dict[Any, list[int]] = {}
  unfusing: dict[Any, list[int]] = {}
  for j, user in enumerate(jaxpr.eqns):
    fuses = user.primitive.name in _FUSED_INTO_CONSUMERS and not _keeps_minor(user)
    for v in {same(v) for v in user.invars if is_var(v)}:
      (fusing if fuses else unfusing).setdefault(v, []).append(j)

  def full_operands(e, rank: int) -> list[Any]:
    return _full_operands(e, rank, producer)

  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name not in ELEMENTWISE or name in _EXPENSIVE or len(eqn.outvars) != 1:
      continue
    o = same(eqn.outvars[0])
    if o not in materialised:
      continue
    rank = _true_rank(o)
    full = full_operands(eqn, rank)
    if len(full) != 1:
      continue
    late, early = max(fusing.get(o, [-1])), max(unfusing.get(o, [-1]))
    if early < 0 or late <= early:
      continue
    last_use[o] = early
    v = full[0]
    while True:          # the operand, through producers XLA fuses into this op
      v = same(v)
      last_use[v] = max(last_use.get(v, -1), late)
      up = producer.get(v)
      if v in materialised or up is None or up.primitive.name not in _FUSIBLE:
        break
      ups = full_operands(up, rank)
      if len(ups) != 1:      # several full operands: computed once, kept (not duplicated)
        materialised.add(v)
        break
      v = ups[0]


def _full_operands(eqn, rank: int, producer: Mapping[Any, Any]) -> list[Any]:
  """``eqn``'s operands of at least ``rank`` true dimensions that are not broadcasts."""
  return [v for v in eqn.invars if is_var(v) and _true_rank(v) >= rank and
          (producer[v].primitive.name if v in producer else None) not in
          ("broadcast_in_dim", "iota")]


def _unary_source(v, producer: Mapping[Any, Any], same) -> tuple[Any, list[Any]]:
  """The value XLA:CPU keeps for ``v``, a value an elementwise chain carries into a reduction
  over leading dimensions (None: none), and the values walked to reach it. XLA duplicates cheap
  ops into the loop fusion before the reduction and into their other users, and keeps what they
  read, live until the walked values' last reader: an op of one value and scalars (GELU's
  ``0.5 * (1 + tanh)``: the tanh is kept), a layer norm's centred input ``x - mean`` (the mean a
  per-row statistic, size 1 in the minor dimension: its buffer assignment keeps the residual
  sum and the mean) and its ``rsqrt * scale`` (a per-row statistic times a per-column weight:
  None, which the caller keeps where the scale is not gathered per use, ``Live.scaled_by``).
  Read from XLA:CPU's buffer assignments of the small GPT-2 under FSDP x TP and TP
  (docs/benchmarks.md, fifteenth round). An RMS norm's ``x * rsqrt`` and a batch norm's
  centred value (per-column statistics, reduced again by the forward's variance) are kept:
  recomputed, the first put eight rows of the bench's RMS-norm families 10-14 % under XLA:CPU's
  compile, the second convnet's 31-49 %."""
  walked = []
  while True:
    eqn = producer.get(v)
    if eqn is None or len(eqn.outvars) != 1:
      return v, walked
    operands = [w for w in eqn.invars if is_var(w)]
    if (eqn.primitive.name in ELEMENTWISE and eqn.primitive.name not in _EXPENSIVE and
        len(operands) == 1):       # of one value and scalars (GELU's 0.5 * (1 + tanh))
      walked.append(v)
      v = same(operands[0])
      continue
    break
  if eqn.primitive.name not in ("sub", "mul"):
    return v, walked
  full = _full_operands(eqn, _true_rank(v), producer)
  small = [w for w in operands if w not in full]
  if eqn.primitive.name == "sub" and len(full) == 1 and eqn.invars[1] in small and (
      _per_row(eqn.invars[1], producer)):
    return same(full[0]), walked + [v]
  if eqn.primitive.name == "mul" and not full and any(_per_row(w, producer) for w in small):
    return None, walked + [v]
  return v, walked


def _weight_leaf(v, producer: Mapping[Any, Any], invars) -> int | None:
  """The input (its index in ``invars``) of ``v``'s operands that ``v``'s op reads through
  reshapes and broadcasts only: a norm's scale."""
  for w in producer[v].invars:
    while is_var(w) and w in producer and producer[w].primitive.name in _RESHAPES:
      w = producer[w].invars[0]
    if is_var(w) and w in invars:
      return list(invars).index(w)
  return None


def _per_row(v, producer: Mapping[Any, Any]) -> bool:
  """``v`` is a per-row statistic: size 1 in the minor dimension, or broadcast from one."""
  eqn = producer.get(v)
  if eqn is not None and eqn.primitive.name == "broadcast_in_dim":
    v = eqn.invars[0]
  shape = getattr(v.aval, "shape", ())
  return len(shape) >= 2 and shape[-1] == 1 or (
      eqn is not None and eqn.primitive.name == "broadcast_in_dim" and
      len(eqn.outvars[0].aval.shape) - 1 not in tuple(eqn.params["broadcast_dimensions"]))


def _expanded_operands(jaxpr, same, materialised: set
                       ) -> list[tuple[Any, int, int, int, int]]:
  """The buffers (value, start, end, bytes, rows) XLA:CPU makes of small values broadcast into
  its reducing fusions. A norm's backward is an elementwise region that sums ``dy * x`` over
  the features (a reduction over the minor dimension) and computes the input's gradient from
  that sum. XLA:CPU gives such a region to YNNPACK (``ynn_fusion``, kCustom) through its small
  per-row ops only where they have YNN_MIN_ELEMENTS elements (``IsInstructionPreferredByYnn``:
  ``rows``, the reduced result's elements, global here); the fusion then takes an operand it
  broadcasts from a value made outside it (the norm's weight, its ``rsqrt`` statistic, both
  read with size-1 dimensions) as a buffer of the region's shape, where a loop fusion reads the
  small value. One buffer per value and shape (its CSE, which also makes the forward a
  reader: a broadcast that only the fusion reads is fused into it), made with the value (a
  weight's at the step's start) and live until the last such fusion: two ``[batch, seq, d]``
  buffers per RMS norm kept from the forward to the backward. A value the region computes itself (softmax's
  maximum) is broadcast inside it. A sum over leading dimensions of a per-row statistic's
  product (flax's ``LayerNorm``, :func:`_column_statistics`) makes the statistic's buffer too.
  XLA:GPU fuses broadcasts into every consumer: the caller marks these ``cheap_on_gpu``."""
  producer = {same(o): (i, eqn) for i, eqn in enumerate(jaxpr.eqns) for o in eqn.outvars}
  parent = list(range(len(jaxpr.eqns)))

  def find(i: int) -> int:
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  def fused(v) -> bool:        # computed inside the fusion of the op that reads it
    v = same(v)
    return v in producer and v not in materialised and (
        producer[v][1].primitive.name in _FUSED_INTO_CONSUMERS)

  reducing: dict[int, int] = {}     # a minor reduction -> its result's elements
  for j, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name not in _FUSED_INTO_CONSUMERS:
      continue
    for v in eqn.invars:
      if is_var(v) and fused(v):
        parent[find(producer[same(v)][0])] = find(j)
    axes = eqn.params.get("axes")
    if eqn.primitive.name.startswith("reduce_") and axes is not None and (
        _true_rank(eqn.invars[0]) >= 2 and len(eqn.invars[0].aval.shape) - 1 in tuple(axes)):
      reducing[j] = math.prod(eqn.outvars[0].aval.shape)
  regions: dict[int, int] = {}
  for j, rows in reducing.items():
    regions[find(j)] = min(rows, regions.get(find(j), rows))
  found: dict[tuple[Any, tuple[int, ...]], list[Any]] = {}

  def note(v, out, j: int, rows: int) -> None:
    """Records the buffer of ``v`` broadcast to ``out``'s shape for the fusion at ``j``."""
    src = same(v)
    while fused(src) and producer[src][1].primitive.name in _RESHAPES:
      src = same(producer[src][1].invars[0])
    if fused(src) or not is_var(src):
      return                   # computed inside the region: broadcast there
    shape = tuple(out.aval.shape)
    start = producer[src][0] + 1 if src in producer else 0
    entry = found.setdefault((src, shape), [_Expanded(src), start, j, math.prod(shape) *
                                            out.aval.dtype.itemsize, rows])
    entry[2] = max(entry[2], j)
    entry[4] = min(entry[4], rows)

  for j, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name not in ELEMENTWISE or find(j) not in regions:
      continue
    shape = tuple(eqn.outvars[0].aval.shape)
    if str(eqn.outvars[0].aval.dtype) not in ("float32", "bfloat16"):
      continue
    for v in eqn.invars:
      if is_var(v) and _true_rank(v) >= 1 and math.prod(v.aval.shape) < math.prod(shape):
        note(v, eqn.outvars[0], j, regions[find(j)])
  for j, v, out in _column_statistics(jaxpr, same, producer):
    note(v, out, j, math.prod(out.aval.shape))
  return [tuple(e) for e in found.values()]


def _column_statistics(jaxpr, same, producer: Mapping[Any, tuple[int, Any]]
                       ) -> list[tuple[int, Any, Any]]:
  """(reduction, statistic, product) of each sum over leading dimensions of a product of a
  per-row statistic (size 1 in the minor dimension: a layer norm's ``rsqrt``) and a full value:
  the scale's gradient of flax's ``LayerNorm``, ``sum(rsqrt * (x - mean) * dy)`` over the
  tokens. XLA:CPU fuses the product into that reduction's YNNPACK fusion (kCustom), which
  takes the statistic broadcast to the product's shape as a buffer of its own, kept from the
  forward (XLA's CSE: the forward's ``rsqrt * scale`` reads the same broadcast), at any
  number of rows: the reduction's operand, not its per-row ops, is what
  ``IsInstructionPreferredByYnn`` counts (a one-device compile of a norm's gradient makes it at
  512 to 8192 rows)."""
  out = []
  for j, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "reduce_sum" or not _keeps_minor(eqn) or not is_var(eqn.invars[0]):
      continue
    prod = producer.get(same(eqn.invars[0]))
    if prod is None or prod[1].primitive.name != "mul":
      continue
    product = prod[1].outvars[0]
    for v in prod[1].invars:
      if (is_var(v) and _true_rank(v) >= 1 and v.aval.shape[-1] == 1 and
          product.aval.shape[-1] > 1 and str(product.aval.dtype) in ("float32", "bfloat16")):
        out.append((j, v, product))
  return out


def _folded_transposes(jaxpr) -> set[Any]:
  """The products' results that only a ``transpose`` reads (a weight's gradient ``dy^T @ x``
  written as ``(x^T @ dy)^T``): XLA:CPU's algebraic simplifier folds the transpose into the
  product's operands, so the two are one buffer, where the timeline has two values live
  together at the transpose (2 GiB too many at the 8B step's unembedding gradient). Likewise a
  transpose's result that only a transpose reads: the simplifier merges the two into one (a tied
  embedding's gradient from ``x @ table.T`` is the product, transposed for ``table.T``'s
  cotangent and back for the table's; XLA writes the product once, in the table's layout)."""
  users: dict[Any, list[Any]] = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if is_var(v):
        users.setdefault(v, []).append(eqn)
  outs = {v for v in jaxpr.outvars if is_var(v)}
  return {eqn.outvars[0] for eqn in jaxpr.eqns
          if eqn.primitive.name in ("dot_general", "transpose") and eqn.outvars[0] not in outs
          and [u.primitive.name for u in users.get(eqn.outvars[0], ())] == ["transpose"]}


def _gemms(jaxpr) -> dict[Any, tuple[tuple[int, int, int, int], int]]:
  """The products' results (``dot_general``): their (batch, rows, columns, contraction) element
  counts and the equation where XLA:GPU sums a split product's parts
  (``solver.split_k``): the product's own where another product reads the result in place
  (:func:`_in_kernel_order`) or a convolution reads it, since the sum is then a fusion of its
  own (the vocabulary's input gradient in moe's FSDP step: the split buffer dies at once);
  otherwise its last direct reader, whose fusion the sum joins (an MoE expert's output
  projection, which the combining products read transposed: summed again in the forward's
  and in the backward's transposing fusions, the split buffer live in between; an attention
  output's projection: summed in the residual's add). Products of one operand (the same
  value, on the same side, with the same dimension numbers) with others are counted as the
  one product XLA's ``DotMerger`` makes of them, their other operands concatenated (an
  attention's query, key and value projections of one input: one [tokens, 3 x width] product
  in XLA:GPU's buffer assignment of moe's FSDP step, not split; XLA merges products of at
  most 16 MiB of operands and result, neither depending on the other: neither condition is
  checked here, products that large have too many result tiles to be split, and a weight that
  dependent layers share is counted merged, which only makes a split less likely)."""
  read_in_place: set[Any] = set()
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if is_var(v):
        last[v] = i
    if eqn.primitive.name == "conv_general_dilated":
      read_in_place.update(v for v in eqn.invars[:2] if is_var(v))
    elif eqn.primitive.name == "dot_general":
      read_in_place.update(v for k, v in enumerate(eqn.invars[:2])
                           if is_var(v) and _in_kernel_order(eqn, k))
  dims: dict[Any, list[int]] = {}
  merged: dict[tuple, list[Any]] = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "dot_general":
      continue
    dn = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dn
    lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars[:2])
    batch = math.prod(lhs[d] for d in lb)
    contraction = math.prod(lhs[d] for d in lc)
    o = eqn.outvars[0]
    dims[o] = [batch, math.prod(lhs) // max(1, batch * contraction),
               math.prod(rhs) // max(1, batch * contraction), contraction]
    # XLA's DotMerger: products of one operand with others made alike are one product
    for side, (var, kept) in enumerate(((eqn.invars[0], (rb, rc)), (eqn.invars[1], (lb, lc)))):
      if is_var(var):
        other = eqn.invars[1 - side].aval.shape
        key = (var, side, str(dn), tuple(tuple(other[d] for d in ds) for ds in kept))
        merged.setdefault(key, []).append(o)
  done: set[Any] = set()
  for (_, side, _, _), outs in sorted(merged.items(), key=lambda kv: -len(kv[1])):
    outs = [o for o in outs if o not in done]
    if len(outs) < 2:
      continue
    done.update(outs)
    total = sum(dims[o][2 - side] for o in outs)    # the concatenated operand's columns/rows
    for o in outs:
      dims[o][2 - side] = total
  return {o: (tuple(dims[o]), i if o in read_in_place else last.get(o, i))
          for i, eqn in enumerate(jaxpr.eqns) for o in eqn.outvars if o in dims}


def _true_rank(v) -> int:
  return sum(1 for d in getattr(v.aval, "shape", ()) if d != 1)


def _input_gradient_first(jaxpr, state_shapes: set, same, last_use: dict[Any, int],
                          batch_carried: frozenset = frozenset()) -> dict[int, int]:
  """The backward of ``y = x @ W`` is two products that read the cotangent ``dy``: the weight's
  gradient (``dy^T @ x``, of the weight's shape) and the input's (``dy @ W^T``); differentiation
  writes the weight's first, XLA's scheduler runs the input's first. The weight gradient's
  operands (``x``, the forward's residual) and their transposed copies stay live until the input
  gradient's product, whose result is then live beside them; the weight gradient's result is
  made after it (:func:`_peak` starts it there). Returns the weight gradient's equation -> the
  input gradient's."""
  runs_until: dict[int, int] = {}
  readers: dict[Any, list[tuple[int, Any]]] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name == "dot_general":
      for v in eqn.invars[:2]:
        if is_var(v):
          readers.setdefault(same(v), []).append((i, eqn))
  for uses in readers.values():
    for i, eqn in uses:
      if (not _of_state_shape(eqn.outvars[0], state_shapes) or
          eqn.outvars[0] in batch_carried):
        continue                       # not a weight's gradient
      shape = tuple(eqn.outvars[0].aval.shape)
      later = [j for j, e in uses if j > i and tuple(e.outvars[0].aval.shape) != shape]
      if later:
        runs_until[i] = later[0]
        for v in eqn.invars[:2]:
          if is_var(v) and last_use.get(same(v), -1) < later[0]:
            last_use[same(v)] = later[0]
  return runs_until


def _duplicates(jaxpr) -> dict[Any, Any]:
  """value -> the earlier value it equals: a ``lax.scan``'s stacked outputs computed alike in its
  body (differentiation saves some twice: a norm's residuals for each product that reads it)
  are one buffer, because XLA's common-subexpression elimination makes them one value of the
  loop body and its while-loop simplifier merges the repeated elements of the loop's tuple.
  Equations computed alike from the same values are one value too (the same CSE: a norm
  called twice on one input, for the attention's queries and its keys, is computed once)."""
  canon: dict[Any, Any] = {}
  keys = _value_keys(jaxpr, [("in", k) for k in range(len(jaxpr.invars))])
  first: dict[Any, Any] = {}
  for eqn in jaxpr.eqns:
    for o in eqn.outvars:
      k = keys.get(o)
      if k is not None and first.setdefault(k, o) is not o:
        canon[o] = first[k]
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      body = eqn.params["jaxpr"].jaxpr
      inner = _value_keys(body, [("in", k) for k in range(len(body.invars))])
      stacked: dict[Any, Any] = {}
      n_carry = jaxapi.scan_counts(eqn)[1]
      for bo, o in zip(body.outvars[n_carry:], eqn.outvars[n_carry:]):
        k = inner.get(bo) if is_var(bo) else None
        if k is not None and stacked.setdefault(k, o) is not o:
          canon.setdefault(o, stacked[k])
  return canon


def _value_keys(jaxpr, in_keys) -> dict[Any, Any]:
  """A key per value of ``jaxpr``, equal for values computed alike from the same inputs (the
  primitive, its parameters and its operands' keys; a body by identity); None for an equation
  with effects."""
  intern: dict[Any, int] = {}
  keys: dict[Any, Any] = dict(zip(jaxpr.invars, in_keys))
  for eqn in jaxpr.eqns:
    if eqn.effects:
      continue
    ins = []
    for v in eqn.invars:
      if is_var(v):
        k = keys.get(v)
        if k is None:
          break
        ins.append(k)
      else:
        ins.append(("literal", str(v.aval), _literal_bits(v.val)))
    else:
      try:
        base = (eqn.primitive.name, _params_key(eqn.params), tuple(ins))
        n = intern.setdefault(base, len(intern))
      except TypeError:             # a parameter that cannot be compared
        continue
      for j, o in enumerate(eqn.outvars):
        keys[o] = (n, j)
  return keys


def _literal_bits(val) -> Any:
  """A literal operand's value as its bytes (its aval, beside it in the key, gives the dtype and
  shape): equal for the constants XLA's common-subexpression elimination takes as one. Not its
  ``repr``: a literal is a 0-d ``TypedNdArray`` in jax 0.10, whose repr goes through numpy's
  array printing (75 us against 1 us for the bytes, thousands of literals a plan)."""
  try:
    return np.asarray(val).tobytes()
  except Exception:              # a value numpy cannot hold (an extended dtype's): as printed
    return repr(val)


def _params_key(params) -> tuple:
  def key(p):
    if hasattr(p, "eqns") or hasattr(p, "jaxpr"):      # a body (Jaxpr, ClosedJaxpr)
      return ("body", id(p))
    if isinstance(p, (tuple, list)):
      return tuple(key(x) for x in p)
    if isinstance(p, dict):
      return tuple(sorted((k, key(v)) for k, v in p.items()))
    hash(p)
    return p
  return tuple(sorted((k, key(v)) for k, v in params.items()))


def _from_batch(eqn, tainted: set, state_shapes: Collection = frozenset()) -> list[bool]:
  """Which of ``eqn``'s outputs are computed from the batch (``tainted``). A call's (``jit``,
  ``jax.checkpoint``, a custom derivative) are followed into its body: under differentiation a
  call also returns residuals that are not, such as ``jnp.where``'s broadcast mask and its zeros,
  which XLA fuses into their consumers as broadcasts of constants and never materialises. A
  loop's outputs all are (its carry mixes them). A ``lax.cond``'s are followed into the branch
  the step is priced on (:func:`sub_jaxprs`): a result of a state leaf's shape (``state_shapes``)
  that branch fills with a constant (the zero gradient of a weight only another branch reads)
  or hands through (the forward's residual weight) is none of the step's buffers (XLA:CPU's
  compile of gated_head in tests/test_plan_user_steps.py on FSDP 8: the zero is a broadcast
  into the branch's shard, the weight is not among the conditional's results). Any other result
  another branch computes from the batch is: XLA's conditional holds every branch's results, so
  the other branch's residual activations, zeros in the priced branch, take their buffers
  (tiled_vs_weights on `data` 8: five [256, 4096] residuals of the tile's branch, 2.5 MiB a
  device, beside the weights' branch that runs)."""
  subs = sub_jaxprs(eqn)
  name = eqn.primitive.name
  if name in ("scan", "while") or len(subs) != 1:
    return [True] * len(eqn.outvars)
  if name == "cond":
    flags = [_branch_from_batch(eqn, b.jaxpr, tainted, state_shapes) for b in eqn.params["branches"]]
    priced = flags[[b.jaxpr for b in eqn.params["branches"]].index(subs[0][0])]
    return [p or (any(f) and tuple(o.aval.shape) not in state_shapes)
            for p, f, o in zip(priced, zip(*flags), eqn.outvars)]
  return _branch_from_batch(eqn, subs[0][0], tainted, state_shapes)


def _branch_from_batch(eqn, sub, tainted: set, state_shapes: Collection) -> list[bool]:
  """:func:`_from_batch` of ``eqn`` run as its body ``sub``."""
  name = eqn.primitive.name
  outer = list(eqn.invars)[1:] if name == "cond" else list(eqn.invars)
  if len(sub.invars) != len(outer) or len(sub.outvars) != len(eqn.outvars):
    return [True] * len(eqn.outvars)
  inner = {sv for sv, ov in zip(sub.invars, outer) if is_var(ov) and ov in tainted}
  for e in sub.eqns:
    if any(is_var(v) and v in inner for v in e.invars):
      inner.update(o for o, t in zip(e.outvars, _from_batch(e, inner, state_shapes)) if t)
  return [is_var(o) and o in inner for o in sub.outvars]


def _cheap_on_gpu(eqn) -> bool:
  """An op XLA:CPU counts expensive (never duplicated into several users' fusions) and XLA:GPU
  does not: exp, division, square root and reciprocal square root of f32 or f16 values, which
  its fusion recomputes in each user (``GpuInstructionFusion::IsExpensive``), the logistic
  function, which XLA:GPU rewrites into an exp and a division before fusing
  (``LogisticExpander``: its optimised HLO has no logistic), and tanh: XLA:GPU's buffer
  assignment of moe's FSDP step keeps no tanh result, its forward's and its backward's fusions
  each compute the GELU's tanh again from the product's output (two tanh per layer in the
  optimised HLO), where jax 0.10's jaxpr reads the tanh in both."""
  return (eqn.primitive.name in ("exp", "div", "sqrt", "rsqrt", "logistic", "tanh") and
          all(str(o.aval.dtype) in ("float32", "float16") for o in eqn.outvars))


def _cheap_call_on_gpu(eqn) -> bool:
  """A call (``jit``) whose body only has ops XLA:GPU fuses into their users and recomputes
  there (cheap elementwise ops, data movement, calls of the same kind): XLA inlines it, so on
  XLA:GPU its results are recomputed in each user's fusion, never materialised."""
  return eqn.primitive.name in CALLS and _cheap_body_on_gpu(eqn)


def _cheap_body_on_gpu(eqn) -> bool:
  """Whether the one body of a call has only ops XLA:GPU fuses and recomputes in their users."""
  subs = sub_jaxprs(eqn)
  return len(subs) == 1 and all(
      (e.primitive.name in _FUSIBLE and e.primitive.name not in _EXPENSIVE) or
      _cheap_on_gpu(e) or _cheap_call_on_gpu(e) for e in subs[0][0].eqns)


def _fuses_its_inputs_on_gpu(eqn) -> bool:
  """A custom-derivative call of cheap elementwise ops (``jax.nn.relu``: a ``custom_jvp_call``
  of a max): XLA inlines its primal body and XLA:GPU fuses the producers of its input into it,
  so its input is not kept for it (convnet's pre-activation sums ``bn(y) + x``: XLA:GPU's buffer
  assignment of its FSDP step has none; the backward's fusions recompute the relu's mask from
  the convolution's output, the statistics and the residual)."""
  return eqn.primitive.name in CUSTOM_DERIVATIVE_CALLS and _cheap_body_on_gpu(eqn)


def _kept_on_cpu_only(jaxpr, same, users: dict[Any, int], kept: set[Any]) -> set[Any]:
  """The values of ``kept`` (materialised on XLA:CPU) that XLA:GPU recomputes in each user's
  fusion instead: a call of cheap elementwise ops (``jax.nn.silu``'s jit: a logistic and
  products), which XLA inlines; and an elementwise result kept only because a reduction over
  leading dimensions reads it (an RMS norm's normalised input, read again by the norm weight's
  gradient), since XLA:GPU fuses producers into such (column) reductions too."""
  hard: set[Any] = set()             # read by an op no producer is fused into, on any backend
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in _FUSED_INTO_CONSUMERS and not _fuses_its_inputs_on_gpu(eqn):
      hard.update(same(v) for v in eqn.invars if is_var(v))
  out: set[Any] = set()
  for eqn in jaxpr.eqns:
    if _cheap_call_on_gpu(eqn):
      out.update(eqn.outvars)
    elif eqn.primitive.name in _FUSIBLE:
      expensive = (eqn.primitive.name in _EXPENSIVE and not _cheap_on_gpu(eqn))
      out.update(o for o in eqn.outvars if o in kept and o not in hard and
                 not (expensive and users.get(o, 0) >= 2))
  return out


def _gpu_ends(jaxpr, same, last_use: dict[Any, int], materialised: set[Any],
              gpu_fused: set[Any]) -> dict[Any, int]:
  """value -> its last use on XLA:GPU, for the values XLA:GPU's fusions read to recompute a
  value it does not keep (``gpu_fused``): the backward's fusion that reads the softmax's
  exponentials recomputes them from the attention scores, so the scores' buffer lives until
  then (XLA:GPU's buffer assignment of the unrolled decoder: the scores' product output live
  from the forward to the backward's softmax fusion)."""
  sources: dict[Any, set[Any]] = {}     # a value XLA:GPU recomputes -> the kept values it reads
  for eqn in jaxpr.eqns:
    fused = eqn.primitive.name in _FUSIBLE or _cheap_call_on_gpu(eqn)
    for o in eqn.outvars:
      o = same(o)
      if not fused or (o in materialised and o not in gpu_fused):
        continue
      srcs: set[Any] = set()
      for v in eqn.invars:
        if is_var(v):
          v = same(v)
          srcs |= sources.get(v, {v})
      sources[o] = srcs
  ends: dict[Any, int] = {}
  for o in gpu_fused:
    for v in sources.get(same(o), ()):
      if v is not same(o) and last_use.get(o, -1) > last_use.get(v, -1):
        ends[v] = max(ends.get(v, -1), last_use[o])
  return ends


def _keeps_minor(eqn) -> bool:
  """A reduction over leading dimensions only (batch norm's statistics, a bias's gradient):
  XLA:CPU fuses elementwise producers into reductions over the minor (last) dimension, not
  into these, so their input is materialised."""
  axes = eqn.params.get("axes")
  if not eqn.primitive.name.startswith("reduce_") or axes is None or not eqn.invars:
    return False
  ndim = len(getattr(eqn.invars[0].aval, "shape", ()))
  return ndim > 1 and (ndim - 1) not in tuple(axes)


def _dot_copies(eqn, tainted: set) -> list[tuple[Any, int]]:
  """The batch-derived operands (value, bytes) of a product that XLA:CPU's dot kernels cannot
  read in place (:func:`_in_kernel_order`) and copy into a transposed buffer while the
  product runs. The weights' gradients are of this kind: ``dy^T @ x`` contracts the tokens,
  the leading dimensions of its left operand."""
  return [(_Copy(v), nbytes(v.aval)) for k, v in enumerate(eqn.invars[:2])
          if is_var(v) and v in tainted and not _in_kernel_order(eqn, k)]


_JAXLIB = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])


def _widened_dot(eqn, tainted: set, copies: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
  """``copies`` (:func:`_dot_copies`) with what XLA:CPU makes for a product of 16-bit floats it
  computes in float32 (float16; bfloat16 under jaxlib 0.10): each batch-derived operand
  converted to a float32 copy (in the kernel's order: it replaces the operand's transposed
  copy) and the float32 result, converted to the product's dtype after (one more result's bytes
  beside the 16-bit one). A bfloat16 MLP at batch 1024 on `fsdp` 8, jax 0.10: `f32[128,512]`
  twice and `f32[128,128]` twice at the peak of XLA:CPU's temp beside the bfloat16 residuals
  (the model sized them at bfloat16: -22.1 %). Not jaxlib 0.11's bfloat16 products, which its
  XLA:CPU computes in bfloat16, except a weight's gradient (a result of a state leaf's shape,
  contracting the tokens), whose operands it converts the same way (the same step under 0.11:
  -24.9 %, -19.6 % with those copies and no more; not made). XLA:CPU only (``Live.copy``)."""
  out = eqn.outvars[0]
  dtype = str(out.aval.dtype)
  if not (dtype == "float16" or dtype == "bfloat16" and _JAXLIB < (0, 11)):
    return copies
  widened = [(_Copy(v), 4 * nbytes(v.aval) // 2) for v in dict.fromkeys(eqn.invars[:2])
             if is_var(v) and v in tainted and str(v.aval.dtype) == dtype]
  kept = [(c, nb) for c, nb in copies if not any(w.of is c.of for w, _ in widened)]
  return kept + widened + [(_Copy(out), nbytes(out.aval))]


def _in_kernel_order(eqn, k: int) -> bool:
  """Whether the product ``eqn`` reads its operand ``k`` (0: left, 1: right) in place: a dot
  kernel takes ``[batch..., rows, contracted] x [batch..., contracted, cols]`` (the right
  operand may also come as ``[batch..., cols, contracted]``); an operand whose dimensions are
  in another order is transposed first."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  var, contract, batch = ((eqn.invars[0], lc, lb), (eqn.invars[1], rc, rb))[k]
  ndim = len(var.aval.shape)
  contract, batch = tuple(contract), tuple(batch)
  free = tuple(d for d in range(ndim) if d not in contract and d not in batch)
  orders = ([batch + free + contract] if k == 0 else
            [batch + contract + free, batch + free + contract])
  return tuple(range(ndim)) in orders


def _depthwise_dense(eqn) -> list[tuple[Any, int]]:
  """A depthwise kernel's gradient (a convolution of ``batch_group_count`` equal to its output
  features: one group a feature) as XLA:CPU makes it: its convolution-group-converter writes a
  dense convolution of every pair of features ([features, window..., features], the
  gradient's bytes times its features) and a masked copy of that keeping the pairs of one
  group, which it then sums into the gradient; both buffers live at once, whole on every
  device (XLA:CPU's buffer assignment, `data` 8, a [3, 3, 1, C] kernel over x (16, 8, 8, C):
  f32[C,3,3,C] and f32[3,3,C,C] side by side, 73,728 bytes of temp at C = 32 and 294,912 at
  64). A grouped one of several features a group is converted without them. XLA:CPU only
  (``Live.copy``): not seen compiled for the GPU."""
  groups = eqn.params.get("batch_group_count", 1)
  out = eqn.outvars[0]
  dn = eqn.params["dimension_numbers"]
  if groups <= 1 or out.aval.shape[dn.out_spec[1]] != groups:
    return []
  nb = nbytes(out.aval) * groups
  return [(_Dense(out), nb), (_Dense(out, True), nb)]


def _grouped_whole(eqn, tainted: set) -> list[tuple[Any, int]]:
  """A grouped convolution's (:func:`~dtenjax._src.planning.jaxpr_reader.grouped_by_features`:
  not a depthwise one, which XLA partitions over the batch in place) batch-derived input
  gathered whole
  and its whole result (value, bytes for the whole batch): XLA's SPMD partitioner splits a
  grouped convolution only along its feature groups, so where the batch axes split its input
  it all-gathers the input over them and computes the whole batch's convolution on every
  device, then slices the result to the device's rows. Both buffers are live while the
  convolution runs (XLA:CPU's buffer assignment on 8 CPU devices, jax 0.10.2, `data` 8: the
  all-gather's f32[16,8,8,32] and the convolution's, side by side in the temporary buffer, for
  the forward's convolution and again for the input gradient's). The kernel's gradient
  contracts the batch (``batch_group_count``, feature_group_count 1): made on the device's
  rows."""
  lhs, out = eqn.invars[0], eqn.outvars[0]
  if not grouped_by_features(eqn) or not is_var(lhs) or lhs not in tainted:
    return []
  return [(_Whole(lhs), nbytes(lhs.aval)), (_Whole(out), nbytes(out.aval))]


def _conv_copies(eqn, tainted: set) -> list[tuple[Any, int]]:
  """The batch-derived operands and result of a convolution (value, bytes) whose dimensions are not in
  the order the backend's convolution kernels take (batch, spatial..., feature; a kernel's
  spatial..., input, output): XLA transposes them into a copy while the convolution runs. The
  gradients' convolutions are of this kind (the kernel gradient contracts the batch)."""
  dn = eqn.params["dimension_numbers"]
  n = len(eqn.outvars[0].aval.shape)
  spatial = tuple(range(1, n - 1))
  extra = []
  lhs, rhs, out = eqn.invars[0], eqn.invars[1], eqn.outvars[0]
  if is_var(lhs) and lhs in tainted and tuple(dn.lhs_spec) != (0, n - 1, *spatial):
    extra.append((_Copy(lhs), nbytes(lhs.aval)))
  if is_var(rhs) and rhs in tainted and tuple(dn.rhs_spec) != (n - 1, n - 2, *range(n - 2)):
    extra.append((_Copy(rhs), nbytes(rhs.aval)))
  if tuple(dn.out_spec) != (0, n - 1, *spatial):
    extra.append((_Copy(out), nbytes(out.aval)))
  return extra
