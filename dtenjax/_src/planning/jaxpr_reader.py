"""One walk of a training step's jaxpr (:class:`Reader`), into ``jit``, ``scan``, ``remat`` and
custom-derivative bodies: where each value comes from (which state leaf, which of its dimensions),
the first product that reads each weight (:class:`WeightUse`), the ties between state leaves, the
flops of every product and the table lookups. :func:`dtenjax._src.planning.stepgraph.read_step`
runs it and hands its findings to the pairs (:mod:`~dtenjax._src.planning.pairs`), the stacks
(:mod:`~dtenjax._src.planning.stacks`) and the values' liveness
(:mod:`~dtenjax._src.planning.liveness`).
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import dataclasses
import itertools
import math
from collections.abc import Container, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from dtenjax._src import jaxapi
from dtenjax._src.pricing import calls

# Primitives whose output dimension i is the input's dimension i (operands broadcast as scalars
# or of the same shape): the sharded dimension of a pair survives them. ``one_minus_square``
# (``1 - x**2``, lowered to an add, a subtract and a multiply) is jax 0.11's: tanh's derivative,
# ``sub(1, square(y))`` under jax 0.10.
ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
copy copy_p cos cosh div erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite log
log1p logistic max min mul ne eq ge gt le lt neg nextafter not one_minus_square or pow real
reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor pvary
stop_gradient optimization_barrier sharding_constraint
""".split())
# Reductions over a value's dimensions: with ELEMENTWISE, the work beside the products (norms,
# softmax, the loss) that runs on every token a device holds (Reader.token_bytes)
REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax",
                        "argmin", "cumsum", "cumlogsumexp", "cummax"))
# Calls XLA inlines: jax.jit inside the step, jax.nn's activations
CALLS = frozenset(("jit", "pjit", "closed_call", "core_call"))
# Calls of a function with a custom derivative (their primal body is what XLA compiles)
CUSTOM_DERIVATIVE_CALLS = frozenset(("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"))
# Primitives that only rename a value of the same shape (a state leaf keeps its identity).
ALIASES = frozenset(("convert_element_type", "copy", "copy_p", "pvary", "sharding_constraint",
                     "reduce_precision"))
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives whose output has the shape and dimensions of their first operand (or of every
# operand): a dimension that carries the batch keeps carrying it
_SAME_DIMS = frozenset(("cumsum", "cumlogsumexp", "cummax", "cummin", "cumprod", "sort", "rev",
                        "pad", "slice", "dynamic_slice", "dynamic_update_slice",
                        "reduce_window_sum", "reduce_window_max", "reduce_window_min",
                        "select_and_scatter_add", "select_and_gather_add"))
# jax.checkpoint's primitive (its name differs between JAX versions)
_REMAT = frozenset(("checkpoint", "remat", "remat2"))
# The reduction a primitive that reduces over the batch is all-reduced with, where not a sum (a
# product's contraction, reduce_sum): XLA's combiner joins only all-reduces of one reduction
_REDUCED_WITH = {"reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod",
                 "argmax": "argmax", "argmin": "argmin", "pmax": "max", "pmin": "min"}
# Reductions to an index over the batch: XLA all-gathers each device's partial (the extreme value
# and its index) over the batch axes and reduces the gathered pairs on every device
_GATHERED = frozenset(("argmax", "argmin"))


def itemsize(dtype) -> int:
  """Bytes per element; a PRNG key array's (key<fry>) is that of its key data."""
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    return int(getattr(dtype, "itemsize", 0) or 0)


@dataclasses.dataclass(frozen=True)
class WeightUse:
  """The first product that reads a state leaf, in the leaf's own dimensions."""
  leaf: int
  contracted: tuple[int, ...]
  free: tuple[int, ...]
  stacked: tuple[int, ...]
  tokens: int                     # the partner's free x batch elements per product (global)
  act_itemsize: int               # bytes per element of the partner (the activation)
  repeats: int                    # how often the product runs per step (scan lengths)
  primitive: str
  flops: float = 0.0              # of the products that read it, and of its gradient's
  input_grad: bool = True         # the partner depends on the state, so its gradient is needed
  layers: int = 1                 # slices the product reads one at a time (a scan over a stack)
  grad_parts: int = 1             # gradient products per step (a weight shared across layers)
  remat: bool = False             # read inside jax.checkpoint (the backward recomputes it)
  # read inside a lax.cond's branch: the backward's cond is another conditional, so a weight the
  # input gradient reads there is gathered again for it (pricing.regathered)
  branched: bool = False
  # products per step, loop trips not counted, that contract the dimensions the first one does:
  # the forward's, each use's of a weight shared across layers, and jax.checkpoint's recomputed
  # ones the backward reads (pairs.forward_reads); 0: not counted (a convolution)
  forward_reads: int = 0
  # weights whose first products read the same activation as this one (itself included): their
  # input gradients are added before any reduction (XLA reassociates all-reduce(a) +
  # all-reduce(b) into all-reduce(a + b)), so column-parallel siblings share one all-reduce
  siblings: int = 1
  # the partner (the activation) is bfloat16 (or a float8): XLA:CPU all-reduces, all-gathers
  # and exchanges it in float32 (float16), twice its bytes (float16 stays float16)
  act_bfloat16: bool = False
  # of grad_parts, the uses inside a loop's body (a lax.fori_loop or scan applying the weight
  # whole in every iteration), and their gradient parts per step: each such use's trip count
  # (stepgraph._loop_parts; a weight read in a loop and outside it has both kinds of part)
  loop_uses: int = 0
  loop_parts: int = 0
  # of the gradient bytes XLA:CPU all-reduces together in each iteration of the loop body whose
  # weights' parts it reduces there (stepgraph._loop_shares), this weight's: that body's weights
  # are joined in one all-reduce per iteration, a collective of its own (pricing.Pricer.looped)
  loop_share: float = 1.0
  # the dtype the product reads the weight in (a cast of the leaf: mixed precision's float16 or
  # bfloat16 copy of a float32 weight), which its gradient's product makes the gradient in:
  # XLA reduces it in that dtype and converts it to the leaf's after (pricing.gradient_dtype)
  read_dtype: str = ""
  # the layers of a scanned stack one iteration of its loop's body reads: the scan's ``unroll``
  # (a partly unrolled scan, ``lax.scan(..., unroll=2)`` over 4 layers: 2; XLA writes the body
  # out that many times, stacks.py's callers hold that many layers' buffers)
  unroll: int = 1
  # the product's other operand is the carry of the loop whose body reads the weight (``h @ w``
  # in ``fori_loop(..., lambda i, h: tanh(h @ w), x)``): the loop stacks the carry as its
  # residual, laid out as the carry is (roles/tensor.py: a column-parallel weight's input
  # gathered again in the backward)
  carried_input: bool = False
  # the product's output, through elementwise ops of its shape, is the loop's carry out of the
  # body (``tanh(h @ w)``'s, and the last product's of a body of several): the next
  # iteration's input, which a column-parallel product leaves split over 'tensor'
  # (roles/tensor.py: gathered for the next iteration's product and again in the backward)
  carried_output: bool = False
  # of carried_input: the carry's value into the loop's first iteration is computed from no
  # state leaf (the batch, ``lax.scan(body, batch["x"], stack)``), so the input gradient of the
  # first layer's product is dead (the backward's last iteration; Reader._carry_in_free)
  carry_in_free: bool = False
  # elements a token of the input's gradient holds, where that is not the product of the
  # contracted dimensions (0): a convolution's kernel contracts its window (3 x 3) beside its
  # input features, but JAX's input gradient (a convolution of the output's gradient with the
  # reversed kernel) has the input's shape, its features a token (input_width)
  input_width: int = 0
  # the output's tokens where they are not the input's (0: ``tokens``): a convolution's output
  # has a token per window position, batch x the output's spatial extent, which a stride or
  # "VALID" padding makes fewer than the input's pixels (a 3 x 3 window of stride 2 over 8 x 8
  # pixels, padded "SAME": 4 x 4 outputs). What a column-parallel product gathers and a
  # row-parallel one all-reduces is its output, sized so (output_tokens)
  output_tokens: int = 0
  # the convolution's ``feature_group_count`` (1: a dense product, an ungrouped convolution):
  # XLA partitions a grouped kernel over 'tensor' only where 'tensor' divides it (roles/tensor.py)
  groups: int = 1
  # read in a loop's body that a jax.checkpoint call holds (a checkpoint around the loop, not
  # inside its body): the backward's call recomputes the forward's loop, a loop of its own,
  # before the backward's loop, and each of the three gathers a scanned stack's layer
  # (Reader.remat_loop_read, pricing.gathers_a_pass)
  recomputed_loop: bool = False


def grouped_by_features(eqn) -> bool:
  """Whether the convolution ``eqn`` is grouped (``feature_group_count`` > 1) with more than
  one input feature a group. A depthwise convolution (one input feature a group: the kernel's
  input features 1) XLA partitions over a split batch in place, with no collective (32
  features in 32 groups on `data` 8: no all-gather compiled, where 2 to 16 groups gather)."""
  if eqn.params.get("feature_group_count", 1) <= 1:
    return False
  dn = eqn.params["dimension_numbers"]
  return eqn.invars[1].aval.shape[dn.rhs_spec[1]] > 1


def convolution_groups(jaxpr) -> tuple[int, ...]:
  """The group counts (``feature_group_count`` or ``batch_group_count`` above 1) of the grouped
  convolutions in ``jaxpr``, every body and branch walked, each once, in ascending order. A
  grouped convolution's kernel gradient is a convolution of ``batch_group_count`` = groups whose
  input's batch dimension is the layer's input features: XLA's SPMD partitioner
  (xla/service/spmd/convolution_handler.cc) partitions it over a split of those features only
  where each shard holds whole groups. PartitionConvolutionWithBatchGroupCount takes only a
  depthwise one whose groups the partition count divides; otherwise CreateShardedConvConvolution
  keeps the output's batch (the features a group, ``C / groups``) and CHECK-fails, aborting the
  process, where the shard's ``C / k`` is not a multiple of it (``new_input_batch_size %
  new_output_batch_size``: 4 vs. 0 for 32 features in 4 groups split 8 ways), that is where
  ``k`` does not divide the groups (roles/tensor.py, step._ungrouped)."""
  out: set[int] = set()

  def walk(j) -> None:
    for eqn in j.eqns:
      if eqn.primitive.name == "conv_general_dilated":
        g = max(int(eqn.params.get("feature_group_count", 1)),
                int(eqn.params.get("batch_group_count", 1)))
        if g > 1:
          out.add(g)
      for v in eqn.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)
  walk(jaxpr)
  return tuple(sorted(out))


def output_tokens(use: WeightUse) -> int:
  """The tokens of ``use``'s output (what a column-parallel product gathers over 'tensor' and a
  row-parallel one all-reduces, each a token of the free dimensions' elements): the input's
  :attr:`WeightUse.tokens`, or a convolution's output positions
  (:attr:`WeightUse.output_tokens`)."""
  return use.output_tokens or use.tokens


def input_width(use: WeightUse, shape) -> int:
  """The elements per token of ``use``'s input (and its gradient, what a column-parallel product
  all-reduces over 'tensor'): the product of the weight's contracted dimensions of ``shape``,
  or a convolution's input features (:attr:`WeightUse.input_width`)."""
  return use.input_width or math.prod(shape[k] for k in use.contracted)


@dataclasses.dataclass(frozen=True)
class Meeting:
  """Reductions over the batch's dimension 0 whose result later work on the batch's values
  reads (batch norm's statistics in the forward, their cotangents' sums in the backward): where
  the batch axes split the batch, XLA all-reduces them over those axes and every device waits
  there for the others. Reductions one after another on the same values (a variance after its
  mean) are separate meetings; independent ones that follow one another XLA combines into one
  (:meth:`Reader.meetings`)."""
  order: int                      # the walk's position of its first reduction (Reader.eqn_count)
  nbytes: int                     # bytes all-reduced per step, all its reductions together
  count: int                      # all-reduces per step (loop trips counted)
  payer: int | None               # the weight read by the last product before it (its price)
  # the flops of the products since the previous meeting (the step's start for the first; global,
  # per step): what spreads the devices' arrivals here
  since: float = 0.0
  # jaxlib 0.10's XLA:CPU joins its all-reduce to the one before it (jax.checkpoint's
  # recomputed statistics outside a loop: Reader.meetings): its bytes move there, it adds no
  # meeting of its own
  joins_on_cpu: bool = False
  # an index reduction (argmax, argmin): ``nbytes`` are each device's partials, the extreme
  # values and their indices, which XLA all-gathers over the batch axes (not an all-reduce)
  gathered: bool = False
  # the column-parallel (weight leaf, free dimension) whose pair's cone holds the values an
  # index reduction reduces (the hidden units of an MLP): its partials are split with them
  cone: tuple[int, int] | None = None
  # of ``nbytes``, the bytes of bfloat16 values, which XLA:CPU all-reduces (all-gathers) in
  # float32: on CPU devices ``nbytes + wide`` move (a norm's statistics are mostly float32 in a
  # bfloat16 model: jnp.mean sums in float32)
  wide: int = 0
  # a grouped convolution's input (Reader.grouped_gathers): ``nbytes`` are the whole batch's
  # value, which XLA all-gathers over the batch axes (not each device's partials)
  whole: bool = False
  # a grouped convolution's flops per step (``whole``): every device computes the whole batch's
  flops: float = 0.0


class _UnionFind:
  def __init__(self):
    self.parent: dict[int, int] = {}

  def find(self, a: int) -> int:
    self.parent.setdefault(a, a)
    while self.parent[a] != a:
      self.parent[a] = self.parent[self.parent[a]]
      a = self.parent[a]
    return a

  def union(self, a: int, b: int) -> None:
    ra, rb = self.find(a), self.find(b)
    if ra != rb:
      self.parent[max(ra, rb)] = min(ra, rb)


def is_var(v) -> bool:
  return not isinstance(v, jcore.Literal)


def packed_bytes(elements: int, dtype) -> int:
  """Bytes of ``elements`` of ``dtype`` in XLA's buffers: a 4-bit type (int4, uint4,
  float4_e2m1fn) packs two elements to a byte, where numpy's itemsize of ml_dtypes' says one."""
  size = itemsize(dtype)
  if size == 1:
    try:
      info = jax.numpy.iinfo if jax.numpy.issubdtype(dtype, jax.numpy.integer) else jax.numpy.finfo
      bits = info(dtype).bits
    except (TypeError, ValueError):     # bool, a PRNG key's
      bits = 8
    if bits < 8:
      return -(-elements * bits // 8)
  return elements * size


def nbytes(aval) -> int:
  shape = getattr(aval, "shape", ())
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return 0
  return packed_bytes(math.prod(shape), dtype)


def scaled_operand(eqn):
  """The one operand of an elementwise equation whose other operands are scalars (``0.5 * w``,
  ``w * s`` of a scalar ``s``), of the result's shape; None for any other equation. A weight
  scaled so on its way to a product keeps its identity: the product reads the weight, sharded
  and gathered as the weight is (gather.py gathers the scaled value where the product reads it)."""
  if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1 or len(eqn.invars) < 2:
    return None
  full = [v for v in eqn.invars if tuple(getattr(v.aval, "shape", ())) != ()]
  if len(full) != 1 or not is_var(full[0]):
    return None
  return full[0] if tuple(full[0].aval.shape) == tuple(eqn.outvars[0].aval.shape) else None


# the values XLA:CPU's collectives move at twice their bytes (bfloat16 in float32, float8 in
# float16: calls.wire_bytes): the pricing's one test
_doubled = calls.doubled_on_cpu


def wide_bytes(aval) -> int:
  """The bytes of ``aval`` that XLA:CPU's collectives add to its :func:`nbytes` by moving a
  bfloat16 value in float32 (a float8 one in float16): its own bytes where it is one, else 0."""
  return nbytes(aval) if _doubled(getattr(aval, "dtype", None)) else 0


# One-operand elementwise equations a weight is not followed through: stop_gradient ends its
# identity (a table read under it is priced apart: stopped_reads)
_NOT_FOLLOWED = frozenset({"stop_gradient", "optimization_barrier"})


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axes one entry of a PartitionSpec splits its dimension over, major first."""
  return () if entry is None else tuple(entry) if isinstance(entry, tuple) else (entry,)


def manual_blocks(sizes: dict[str, int], axes: Sequence[str]) -> tuple[int, ...]:
  """The block of a dimension split over ``axes`` of a mesh of ``sizes`` (its axes in order) that
  each device holds, in the mesh's device order (the order a jit's device assignment has)."""
  blocks = []
  for flat in range(math.prod(sizes.values())):
    coords, rest = {}, flat
    for a, n in reversed(list(sizes.items())):
      coords[a], rest = rest % n, rest // n
    block = 0
    for a in axes:
      block = block * sizes.get(a, 1) + coords.get(a, 0)
    blocks.append(block)
  return tuple(blocks)


# the calls whose bodies run once where they are called, their operands one to one
CALL_PRIMITIVES = frozenset(("jit", "pjit", "closed_call", "core_call"))


def call_shard_maps(jaxpr) -> list[tuple[Any, tuple[Any, ...]]]:
  """The jax.shard_maps ``jaxpr`` runs at its top level or in the calls it makes
  (:data:`CALL_PRIMITIVES`, nested: a user's jitted loss; not in loops or branches), in order,
  each with the call equations around it, outermost first. The order is the same whether jax
  inlined a call or kept it (jax 0.11 keeps more: jaxapi.inline_calls), so that the planned
  step's and plan.jit's trace name a shard_map alike."""
  found: list[tuple[Any, tuple[Any, ...]]] = []

  def walk(j, path: tuple[Any, ...]) -> None:
    for eqn in j.eqns:
      name = eqn.primitive.name
      if name == "shard_map":
        found.append((eqn, path))
      elif name in CALL_PRIMITIVES:
        body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if body is not None:
          walk(getattr(body, "jaxpr", body), path + (eqn,))

  walk(jaxpr, ())
  return found


def shard_map_meshes(jaxpr) -> dict[tuple[int, ...], tuple[tuple[str, int], ...]]:
  """The concrete meshes the jax.shard_maps of ``jaxpr`` run over, in calls, loops and every
  branch too: their devices' ids in the mesh's order -> the mesh's (axis, size) pairs. jax.jit
  runs a shard_map only over its arguments' devices in their order."""
  found: dict[tuple[int, ...], tuple[tuple[str, int], ...]] = {}

  def walk(j) -> None:
    for eqn in j.eqns:
      mesh = eqn.params.get("mesh")
      if eqn.primitive.name == "shard_map" and isinstance(mesh, jax.sharding.Mesh):
        found.setdefault(tuple(int(d.id) for d in mesh.devices.flat),
                         tuple(dict(mesh.shape).items()))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            walk(getattr(sub, "jaxpr", sub))

  walk(getattr(jaxpr, "jaxpr", jaxpr))
  return found


def blocks_nest(user: Sequence[int], n_user: int, plan: Sequence[int], n_plan: int) -> bool:
  """Whether on every device the block of rows the user's layout gives it (``user``, one of
  ``n_user``) and the plan's (one of ``n_plan``) lie one within the other, both over the same
  devices in the same order (jax.jit refuses a shard_map over devices in another order)."""
  if len(user) != len(plan):
    return True           # not the plan's devices: nothing to compare (jax.jit refuses it)
  return all((u * n_plan >= p * n_user and (u + 1) * n_plan <= (p + 1) * n_user) or
             (p * n_user >= u * n_plan and (p + 1) * n_user <= (u + 1) * n_plan)
             for u, p in zip(user, plan))


def followed_operand(eqn, fills: Container = frozenset()):
  """The operand of an elementwise equation of one full operand, of the result's shape, and
  scalars (``0.5 * w``: :func:`scaled_operand`) or nothing else (``-w``, ``w ** 2``): a weight
  so changed on its way to a product keeps its identity, as a scaled one does (gather.py
  computes it on the weight's shard and gathers it at the product). So does one selected by a
  scalar predicate against values filled with a scalar (``fills``, :func:`scalar_fills`):
  ``jnp.where(flag, w, 0)`` is ``select_n`` of the broadcast zero and ``w``, a masked weight,
  whose gradient is the gradient selected so; and one selected by, or combined with, the step's
  constants (``jnp.where(keep, w, 0)``, ``w * keep`` of a pruning mask it closes over). None for
  any other equation."""
  if (eqn.primitive.name in ELEMENTWISE and eqn.primitive.name not in _NOT_FOLLOWED and
      len(eqn.invars) == 1 and len(eqn.outvars) == 1 and is_var(eqn.invars[0]) and
      tuple(getattr(eqn.invars[0].aval, "shape", ())) == tuple(eqn.outvars[0].aval.shape)):
    return eqn.invars[0]
  if eqn.primitive.name == "select_n":
    pred, *cases = eqn.invars
    kept = [v for v in cases if not (is_var(v) and v in fills)]
    if ((tuple(getattr(pred.aval, "shape", ())) == () or is_var(pred) and pred in fills) and
        len(kept) == 1 and is_var(kept[0]) and
        tuple(kept[0].aval.shape) == tuple(eqn.outvars[0].aval.shape)):
      return kept[0]
    return None
  if eqn.primitive.name in CALLS and len(eqn.outvars) >= 1:
    return _followed_through_call(eqn, fills)
  if eqn.primitive.name in ELEMENTWISE and len(eqn.outvars) == 1 and len(eqn.invars) >= 2:
    # a weight masked by a constant of its shape (``w * mask``) keeps its identity as a scaled
    # one does
    kept = [v for v in eqn.invars if tuple(getattr(v.aval, "shape", ())) != () and
            not (is_var(v) and v in fills)]
    if (len(kept) == 1 and is_var(kept[0]) and
        tuple(kept[0].aval.shape) == tuple(eqn.outvars[0].aval.shape)):
      return kept[0]
    return None
  return scaled_operand(eqn)


_CALL_MEMO: dict[tuple[int, tuple[int, ...]], tuple[Any, int | None]] = {}


def _followed_through_call(eqn, fills: Container = frozenset()):
  """The operand a call hands out as its first result through followed equations only
  (jnp.where's ``_where`` call: ``select_n`` of a scalar predicate, the broadcast zero and
  ``w``), its other results filled with scalars (the zero the backward reads); None otherwise.
  XLA inlines the call: the weight is followed through it as through the select itself. An
  operand the caller fills (``fills``) is a fill in the body too: inside a ``lax.scan`` body
  jax hoists ``jnp.where(s, w, 0)``'s zero out of the loop, and ``_where`` receives it."""
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  body = getattr(closed, "jaxpr", closed)
  if body is None or len(body.invars) != len(eqn.invars):
    return None
  filled = tuple(k for k, v in enumerate(eqn.invars) if is_var(v) and v in fills)
  hit = _CALL_MEMO.get((id(body), filled))
  if hit is None or hit[0] is not body:
    hit = (body, _followed_input(body, frozenset(body.invars[k] for k in filled)))
    _CALL_MEMO[(id(body), filled)] = hit
  k = hit[1]
  return None if k is None or not is_var(eqn.invars[k]) else eqn.invars[k]


def _followed_input(body, filled: frozenset = frozenset()) -> int | None:
  """The index of ``body``'s input its first result is made from by followed equations
  (:func:`followed_operand`), where its other results are scalar fills (made in the body, or
  the inputs ``filled``); None otherwise."""
  fills = scalar_fills(body) | filled
  if any(not is_var(v) or v not in fills for v in body.outvars[1:]):
    return None
  producer = {o: e for e in body.eqns for o in e.outvars}
  v = body.outvars[0]
  while is_var(v) and v in producer:
    v = followed_operand(producer[v], fills)
    if v is None:
      return None
  if not is_var(v) or v not in body.invars:
    return None
  return list(body.invars).index(v)


_FILLED_MEMO: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _filled_results(eqn) -> tuple[int, ...]:
  """The results of a call of scalars only that its body fills with one scalar (the zero
  jax hoists out of a scanned layer's ``jnp.where(s, w, 0)`` is a call of ``0.0``)."""
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  body = getattr(closed, "jaxpr", closed)
  if body is None or any(tuple(getattr(v.aval, "shape", ())) != () for v in eqn.invars):
    return ()
  hit = _FILLED_MEMO.get(id(body))
  if hit is None or hit[0] is not body:
    inner = scalar_fills(body)
    hit = (body, tuple(k for k, v in enumerate(body.outvars) if is_var(v) and v in inner))
    _FILLED_MEMO[id(body)] = hit
  return hit[1]


# a scan body -> (the body, its constants the scan binds to values filled with one scalar)
_BOUND_FILLS: dict[int, tuple[Any, frozenset]] = {}


def dequantization_scales(jaxpr) -> set:
  """The scales of ``jaxpr``'s top-level dequantizations: the smaller operand (a per-channel
  scale, ``f32[1,256]`` beside ``f32[512,256]``) of a ``mul`` by, or the divisor of a ``div`` of,
  the float conversion of an integer value (``wq.astype(jnp.float32) * scale`` of an int8
  weight). The dequantized value is the integer weight as its product reads it: JAX gives the
  integer leaf no gradient (float0), and the product's float gradient is what XLA reduces over
  the batch (``f32[512,256]`` all-reduced for an int8 ``[512, 256]`` weight, compiled on 8 CPU
  devices), so the reader's walk (:meth:`Reader.walk`) keeps the weight through its scale as
  :func:`followed_operand` does through a scalar's."""
  return {scale for _, scale in _dequantizations(jaxpr)}


def dequantized_leaves(jaxpr) -> dict[int, frozenset]:
  """The index among ``jaxpr``'s invars of each integer leaf a top-level dequantization reads
  (:func:`dequantization_scales`) -> its scales' values, each the index of the invar it is or
  None where the step computes it. The dequantized weight's float gradient is what a trained
  scale's gradient needs (``sum(d(w) * wq)``); where no scale is trained, JAX makes none
  (StepGraph.integer_gradient_free)."""
  index = {v: i for i, v in enumerate(jaxpr.invars)}
  out: dict[int, set] = {}
  for source, scale in _dequantizations(jaxpr):
    if source in index:
      out.setdefault(index[source], set()).add(index.get(scale))
  return {k: frozenset(v) for k, v in out.items()}


def untrained_dequantizations(jaxpr) -> frozenset[int]:
  """The indices among ``jaxpr``'s invars of the integer leaves every top-level dequantization of
  which (:func:`dequantization_scales`) reads a float conversion nothing else reads: a trained
  scale's gradient reads it again (``sum(d(w) * wq)``, the transpose of the product by the
  scale), so where none does JAX makes no float gradient of the dequantized weight (a frozen
  quantized layer whose scale the step passes in and does not return)."""
  index = {v: i for i, v in enumerate(jaxpr.invars)}
  readers: dict[Any, int] = {}
  for eqn in jaxpr.eqns:
    for v in eqn.invars:
      if is_var(v):
        readers[v] = readers.get(v, 0) + 1
  for v in jaxpr.outvars:
    if is_var(v):
      readers[v] = readers.get(v, 0) + 1
  converted: dict[int, set] = {}
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "convert_element_type" and is_var(eqn.invars[0])
        and eqn.invars[0] in index):
      converted.setdefault(index[eqn.invars[0]], set()).add(eqn.outvars[0])
  found = {index[source] for source, _ in _dequantizations(jaxpr) if source in index}
  return frozenset(k for k in found if all(readers.get(c, 0) <= 1 for c in converted[k]))


def is_quantized_dtype(stored, read) -> bool:
  """Whether values stored as ``stored`` and converted to the float ``read`` are a quantized
  weight's: an integer (int8, int4, uint8), or a float of fewer bits than 16 widened
  (float8_e4m3fn or float8_e5m2 read as bfloat16 or float32, float4_e2m1fn): scaled after the
  conversion, both are dequantized, and XLA converts and scales the stored shard into a float
  copy of ``read`` that the product reads (and gathers where a batch axis shards it), as for
  int8 (tests/test_plan_quantized.py). A 16-bit float cast up is no dequantization."""
  if jax.dtypes.issubdtype(stored, np.integer):
    return True
  return (jax.dtypes.issubdtype(stored, np.floating) and
          itemsize(stored) == 1 and itemsize(read) > 1)


def _dequantizations(jaxpr) -> list[tuple[Any, Any]]:
  """(the integer value converted, the scale) of each of ``jaxpr``'s top-level dequantizations
  (:func:`dequantization_scales`), in order."""
  ints = {eqn.outvars[0]: eqn.invars[0] for eqn in jaxpr.eqns
          if eqn.primitive.name == "convert_element_type" and is_var(eqn.invars[0]) and
          jax.dtypes.issubdtype(eqn.outvars[0].aval.dtype, np.floating) and
          is_quantized_dtype(eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype)}
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name not in ("mul", "div") or len(eqn.invars) != 2 or not ints:
      continue
    size = math.prod(getattr(eqn.outvars[0].aval, "shape", ()))
    converted = eqn.invars if eqn.primitive.name == "mul" else eqn.invars[:1]
    for k, v in enumerate(converted):
      other = eqn.invars[1 - k]
      if (is_var(v) and v in ints and is_var(other) and other not in ints and
          math.prod(getattr(other.aval, "shape", ())) < size):
        found.append((ints[v], other))
  return found


def scalar_fills(jaxpr) -> frozenset:
  """The values of ``jaxpr``'s top level that a ``broadcast_in_dim`` fills with one scalar
  (``jnp.where(flag, w, 0)``'s zero), and its constants (a mask the step closes over) and the
  values elementwise ops make of them alone: they carry no leaf's values
  (:func:`followed_operand`).
  In a ``lax.scan`` body, its constants bound to such values too: jax hoists the zero of
  ``jnp.where(s, w, 0)`` in a scanned layer out of the loop (a scan constant), so the body
  sees no broadcast. A scan's body is read after its caller (the walks go down), which binds
  them here; a body two scans share keeps the constants both bind."""
  fills = {eqn.outvars[0] for eqn in jaxpr.eqns
           if eqn.primitive.name == "broadcast_in_dim" and
           tuple(getattr(eqn.invars[0].aval, "shape", ())) == ()}
  # the step's constants (a pruning mask it closes over) and what elementwise ops make of them
  fills.update(jaxpr.constvars)
  for eqn in jaxpr.eqns:
    if ((eqn.primitive.name in ELEMENTWISE or eqn.primitive.name == "broadcast_in_dim") and
        any(is_var(v) for v in eqn.invars) and
        all(not is_var(v) or v in fills for v in eqn.invars)):
      fills.update(eqn.outvars)
  bound = _BOUND_FILLS.get(id(jaxpr))
  if bound is not None and bound[0] is jaxpr:
    fills |= bound[1]
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in CALLS:
      fills.update(eqn.outvars[k] for k in _filled_results(eqn))
    if eqn.primitive.name != "scan":
      continue
    body = eqn.params["jaxpr"].jaxpr
    nc, _ = jaxapi.scan_counts(eqn)
    inner = frozenset(iv for ov, iv in zip(eqn.invars[:nc], body.invars[:nc])
                      if is_var(ov) and ov in fills)
    seen = _BOUND_FILLS.get(id(body))
    if seen is not None and seen[0] is body:
      inner &= seen[1]
    _BOUND_FILLS[id(body)] = (body, inner)
  return frozenset(fills)


def _scan_frame(frames, v):
  """(the scan equation, its body, its consts and carries counts) of the innermost frame of
  ``frames`` where that is a ``lax.scan`` (a ``fori_loop`` of static bounds is one) and ``v`` a
  variable; None otherwise."""
  if not frames or not is_var(v) or frames[-1][0].primitive.name != "scan":
    return None
  eqn, sub = frames[-1]
  return (eqn, sub, *jaxapi.scan_counts(eqn))


def _carried(frames, v) -> bool:
  """Whether ``v`` is a carry of the innermost ``lax.scan`` body of ``frames``."""
  scan = _scan_frame(frames, v)
  if scan is None:
    return False
  _, sub, n_consts, n_carry = scan
  return any(v is c for c in sub.invars[n_consts:n_consts + n_carry])


def _reaches_carry(frames, v) -> bool:
  """Whether ``v``, or a value elementwise ops of its shape make from it, is a carry the
  innermost ``lax.scan`` body of ``frames`` hands its next iteration (one of its first
  outputs)."""
  scan = _scan_frame(frames, v)
  if scan is None:
    return False
  _, sub, _, n_carry = scan
  carries = {id(o) for o in sub.outvars[:n_carry] if is_var(o)}
  shape = tuple(v.aval.shape)
  reached = {id(v)}
  for e in sub.eqns:
    if (e.primitive.name in ELEMENTWISE and any(is_var(x) and id(x) in reached for x in e.invars)
        and e.outvars and tuple(e.outvars[0].aval.shape) == shape):
      reached.update(id(o) for o in e.outvars)
  return bool(reached & carries)


def _loop_in_remat(frames) -> bool:
  """Whether ``frames`` (outermost first) enter a loop (``scan``, ``while``) inside a
  jax.checkpoint call: the call holds the loop, whose forward the backward's call runs again."""
  names = [e.primitive.name for e, _ in frames]
  first = next((k for k, n in enumerate(names) if n in _REMAT), None)
  return first is not None and any(n in ("scan", "while") for n in names[first + 1:])


def _scan_unroll(frames) -> int:
  """The ``unroll`` of the innermost ``lax.scan`` of ``frames`` (1 outside any, or where the
  scan is written out whole, :func:`_unrolled`)."""
  eqn = next((e for e, _ in reversed(frames) if e.primitive.name == "scan"), None)
  if eqn is None:
    return 1
  unroll = eqn.params.get("unroll", 1)
  length = int(eqn.params["length"])
  return 1 if unroll is True or not unroll else max(1, min(int(unroll), length))


def _unrolled(eqn) -> bool:
  """Whether ``eqn`` is a ``lax.scan`` XLA unrolls whole: ``unroll`` covers its length
  (``lax.fori_loop(..., unroll=True)`` and ``scan(..., unroll=True)`` trace ``unroll=length``)."""
  if eqn.primitive.name != "scan":
    return False
  length, unroll = int(eqn.params["length"]), eqn.params.get("unroll", 1)
  # jax 0.11 leaves out of the equation the outputs that only forward an input: written out,
  # the outputs would not line up with the body's; such a scan is read as a loop
  whole = len(eqn.outvars) == len(eqn.params["jaxpr"].jaxpr.outvars)
  return whole and length > 1 and (unroll is True or int(unroll) >= length)


class _Stacked(list):
  """A fully unrolled scan's stacked output, kept as its rows: a later unrolled scan reads a row
  each iteration (the forward's residuals in the backward's scan) without a stacked copy that
  XLA's unrolled program never makes; stacked only where something else reads it."""


def unroll_loops(closed):
  """``closed`` (a ClosedJaxpr) with its top level's fully unrolled scans (:func:`_unrolled`)
  written out as their bodies, once per iteration, traced again: the program XLA:CPU compiles
  for them. XLA unrolls such a loop, and its buffers are the Python loop's: the weight's
  gradient parts reduced together after the backward, not one per iteration inside a loop body
  (a fori_loop(unroll=True) of ``tanh(h @ w)`` then ``h @ v`` on `data` 8: temp 0.38 MiB
  compiled, 0.18 priced as a loop). ``closed`` itself when it has none."""
  if not any(_unrolled(e) for e in closed.jaxpr.eqns):
    return closed
  import jax.numpy as jnp

  def value(x):
    return jnp.stack(x) if isinstance(x, _Stacked) else x

  def evaluate(eqn, vals):
    return scan(eqn, vals) if _unrolled(eqn) else jaxapi.bind(eqn, [value(x) for x in vals])

  def values(outs):
    return [value(x) for x in outs]

  def scan(eqn, vals):
    p = eqn.params
    (consts, n_carry), length = jaxapi.scan_counts(eqn), int(p["length"])
    body = p["jaxpr"]
    fixed = [value(x) for x in vals[:consts]]
    carry = [value(x) for x in vals[consts:consts + n_carry]]
    xs = vals[consts + n_carry:]
    rows: list[list[Any]] = [[None] * length for _ in eqn.outvars[n_carry:]]
    for i in (reversed(range(length)) if p["reverse"] else range(length)):
      outs = values(jaxapi.interpret(body.jaxpr, body.consts, [*fixed, *carry,
                                                               *[x[i] for x in xs]], evaluate))
      carry = outs[:n_carry]
      for r, y in zip(rows, outs[n_carry:]):
        r[i] = y
    return carry + [_Stacked(r) for r in rows]

  return jaxapi.retrace(closed, evaluate, values)


def sub_jaxprs(eqn):
  """(jaxpr, repeats) of an equation's bodies that run per step."""
  name = eqn.primitive.name
  out = []
  for key in _SUBJAXPR_PARAMS:
    j = eqn.params.get(key)
    if j is not None:
      out.append((getattr(j, "jaxpr", j), int(eqn.params.get("length", 1)) if name == "scan"
                  else 1))
  if name == "while":
    out.append((eqn.params["body_jaxpr"].jaxpr, 1))
  if name == "cond":
    out.append((priced_branch(eqn), 1))
  return out


# lax.cond equations whose priced branch the Reader chose on the weights each branch's products
# read (Reader._choose_branch), before anything walks their bodies: id -> (eqn, branch), for the
# read of one step (chosen_branches). Every later reader of the same jaxpr (pairs, liveness, the
# step graph) takes the same branch. A context variable, not a module's dict: a second plan made
# while one is read (another thread's, or a step read inside a read) had cleared a shared dict,
# and the first step's liveness priced its conds on the fallback branch (tiled_vs_weights'
# activations 44.8 -> 49.7 MB in tests/test_plan_user_steps.py)
_CHOSEN: contextvars.ContextVar[dict[int, tuple[Any, Any]] | None] = contextvars.ContextVar(
    "dtenjax_chosen_branches", default=None)


@contextlib.contextmanager
def chosen_branches():
  """The scope of one step's read (:func:`dtenjax._src.planning.stepgraph.read_step`): the
  branches its :class:`Reader` chooses are the ones :func:`priced_branch` returns inside it, in
  this thread and for this read only; they are dropped as it ends, so no step's jaxpr stays alive
  and no recycled ``id`` finds another read's equation."""
  token = _CHOSEN.set({})
  try:
    yield
  finally:
    _CHOSEN.reset(token)


def priced_branch(eqn):
  """The branch of a ``lax.cond`` the step is priced on. Where the step's reader has seen the
  cond, the one whose products read the most bytes of weights (:meth:`Reader._choose_branch`);
  else, and among those, the one whose values take the most
  memory at once (:func:`_made_peak`), of those the one of most equations. XLA runs one branch
  per step, but the buffers of its conditional must fit whichever runs, so the planner prices the
  worst case a user must fit: the branch of larger peak, its work and its collectives too (a
  short branch through a wide hidden layer beside a long chain of narrow elementwise ops: the
  branch of most equations was the narrow one, and neither wide weight's gradient reduction was
  priced: short_wide_branch in tests/test_plan_user_steps.py).
  Where the peaks tie the branch of most equations is the work the step does when it does it:
  ``lax.cond(ok, update, skip)`` puts the skip first (optax.apply_if_finite's reject_update,
  whose inner state passes through untouched, would leave the moments untied from their
  parameters; it makes no value, so its peak is the smaller anyway)."""
  chosen = (_CHOSEN.get() or {}).get(id(eqn))
  if chosen is not None and chosen[0] is eqn:
    return chosen[1]
  branches = [b.jaxpr for b in eqn.params["branches"]]
  return max(branches, key=lambda j: (_made_peak(j), len(j.eqns)))


def _weight_bytes_read(jaxpr, weights: set) -> int:
  """The bytes of the values in ``weights`` (a body's inputs that are weights) that ``jaxpr``'s
  products read, each counted once, through casts, transposes, scalings and the bodies of the
  calls, loops and conds it runs (every branch: a nested cond's weights are its branch's)."""
  return sum(nbytes(v.aval) for v in _weights_read(jaxpr, weights))


def _weights_read(jaxpr, weights: set) -> set:
  """The values of ``weights`` that :func:`_weight_bytes_read` finds read by products."""
  marked = {v: v for v in weights}    # a value that is a weight -> the input it comes from
  read: set = set()
  for e in jaxpr.eqns:
    srcs = [marked.get(v) if is_var(v) else None for v in e.invars]
    if not any(s is not None for s in srcs):
      continue
    name = e.primitive.name
    if name in ("dot_general", "conv_general_dilated"):
      read.update(s for s in srcs if s is not None)
    elif name in ALIASES or name == "transpose" or followed_operand(e) is not None:
      marked[e.outvars[0]] = next(s for s in srcs if s is not None)
    bodies = ([b.jaxpr for b in e.params["branches"]] if name == "cond"
              else [sub for sub, _ in sub_jaxprs(e)])
    outer = list(e.invars)[1:] if name == "cond" else list(e.invars)
    if name == "while":
      outer = outer[e.params["cond_nconsts"]:]
    for body in bodies:
      inner = {i: s for i, s in zip(body.invars, srcs[len(e.invars) - len(outer):])
               if s is not None}
      read.update(inner[i] for i in _weights_read(body, set(inner)))
  return read


def _made_peak(jaxpr) -> int:
  """The most bytes of the values ``jaxpr``'s equations make that are live at once (each from
  its equation to its last reader or the end), a body's own peak added where it runs. A
  broadcast of a scalar (a branch's zero for a residual another branch makes) is not counted:
  every branch hands out the same results, and what sets one branch's peak above another's is
  the values it computes."""
  last: dict[Any, int] = {}
  for i, e in enumerate(jaxpr.eqns):
    last.update((v, i) for v in e.invars if is_var(v))
  last.update((v, len(jaxpr.eqns)) for v in jaxpr.outvars if is_var(v))
  ends: dict[int, list[int]] = {}
  live = peak = 0
  for i, e in enumerate(jaxpr.eqns):
    inner = max((_made_peak(sub) for sub, _ in sub_jaxprs(e)), default=0)
    free = e.primitive.name == "broadcast_in_dim" and not getattr(e.invars[0].aval, "shape", ())
    made = [nbytes(o.aval) for o in e.outvars] if not free else []
    peak = max(peak, live + inner + sum(made))
    for o, nb in zip(e.outvars, made):
      if last.get(o, i) > i:          # read later (an unread value dies where it is made)
        live += nb
        ends.setdefault(last[o], []).append(nb)
    live -= sum(ends.pop(i, ()))
  return peak


class Reader:
  """One walk of the jaxpr: origins of values (which leaf, which of its dimensions), the first
  product of each leaf, the ties, flops and, at the top level, liveness."""

  def __init__(self, leaves: Sequence[Any]):   # stepgraph.Leaf records
    self.leaves = leaves
    # the branches this reader chooses are kept for the read's scope (chosen_branches); outside
    # one they had nowhere to go and liveness had priced another branch than the walk
    self.chosen = _CHOSEN.get()
    if self.chosen is None:
      raise RuntimeError("jaxpr_reader.Reader reads a step inside jaxpr_reader.chosen_branches() "
                         "(stepgraph.read_step)")
    self.weights: dict[int, WeightUse] = {}
    self.partner: dict[int, Any] = {}     # weight leaf -> the activation its first product reads
    self.first_out: dict[int, tuple[Any, int, tuple[int | None, ...], tuple]] = {}
    # weight leaf -> every dot_general that reads it, as first_out (the forward recomputed in
    # the backward under jax.checkpoint, the other depths of a weight shared across layers)
    self.reads: dict[int, list[tuple[Any, int, tuple[int | None, ...], tuple]]] = {}
    self.leaf_flops: dict[int, float] = {}
    self.shape_flops: dict[tuple[int, ...], float] = {}   # products whose result has this shape
    self.leaf_reads: dict[int, int] = {}      # leaf -> products that read it (in the jaxpr)
    # leaf -> those of its products whose other operand no state leaf made (the batch's input,
    # ``x @ w``): no input gradient's product reads the leaf again for them
    self.free_reads: dict[int, int] = {}
    # leaf -> (its products inside a loop's body, and those times their trip counts)
    self.loop_reads: dict[int, tuple[int, int]] = {}
    # leaf -> the innermost loop (scan or while equation) its first product inside a loop's body
    # runs in: the weights a body reads whole are reduced together there (stepgraph._loop_shares)
    self.loop_of: dict[int, Any] = {}
    self.ties = _UnionFind()
    self.flops = 0.0
    self.products = 0                         # products run per step (loop trips counted)
    # bytes read and written per step (loop trips counted) by the elementwise equations and
    # reductions whose result is not of a state leaf's shape: the work beside the products that
    # grows with the tokens (norms, residuals, activations, softmax, the loss); the optimizer's
    # update, of the state's shapes, is priced on its own
    self.token_bytes = 0.0
    self.token_of: dict[Any, float] = {}      # an equation's result -> its share of token_bytes
    self._state_shapes = {tuple(lf.shape) for lf in leaves if not lf.is_batch}
    self._state_shapes |= {s[1:] for s in self._state_shapes if s}     # a scanned stack's layer
    self.gathered: set[int] = set()
    # leaf -> (its dimensions a gather indexes, bytes the gathers read out of it per step, the
    # bytes of each gather's rows: XLA partitions each one's gradient on its own)
    self.lookups: dict[int, tuple[tuple[int, ...], int, tuple[int, ...]]] = {}
    # looked-up leaf -> the dtype its first lookup's rows come out in (a cast of the table's)
    self.lookup_dtypes: dict[int, str] = {}
    self.eqn_count = 0
    # value -> list of (equation, position) that read it, over every jaxpr walked
    self.uses: dict[Any, list[tuple[Any, int]]] = {}
    # value -> the equation that makes it, over every jaxpr walked
    self.producer: dict[Any, Any] = {}
    # a body's outvar -> (the outer value it becomes, the dimension shift of a scan's stack)
    self.outer_of_outvar: dict[Any, tuple[Any, int]] = {}
    self.origin_all: dict[Any, tuple[int, tuple[int | None, ...]]] = {}
    self.state_derived: set[Any] = set()     # values computed from any state leaf
    self.eqn_flops: dict[int, float] = {}     # id(product equation) -> flops per step
    self.remat_depth = 0                      # > 0 inside a jax.checkpoint body
    self.remat_read: set[int] = set()         # leaves a product reads inside a checkpoint body
    # leaves a product reads in a loop's body inside a checkpoint body (_loop_in_remat)
    self.remat_loop_read: set[int] = set()
    # the scans walked, in order: (equation, body, the origin of each scanned operand)
    self.scans: list[tuple[Any, Any, tuple]] = []
    # the calls the walk is inside, outermost first: (equation, body). JAX shares one body
    # between calls of the same jitted function (jnp.einsum's), so a body's values stand for a
    # different call's values at each call site: the frames say which.
    self.frames: tuple[tuple[Any, Any], ...] = ()
    # value -> its dimensions that carry the batch's dimension 0 (from the batch leaves, through
    # the primitives the families use: _batch_out); the number of batch reductions it depends on
    # (one after another); the batch reductions a value without the batch was computed from
    self.batch: dict[Any, frozenset[int]] = {}
    self.depth: dict[Any, int] = {}
    self.stat: dict[Any, frozenset[int]] = {}
    # the reductions over the batch: (walk position, depth, bytes per step, trips per step, the
    # computation XLA compiles it in: the innermost loop or branch body around it, else None,
    # the innermost jax.checkpoint body around it, else None, the reduction it is all-reduced
    # with: _REDUCED_WITH), and those whose result later work on the batch's values reads (a
    # meeting's reductions)
    self.batch_reductions: list[tuple[int, int, int, int, Any, Any, str, int]] = []
    self.met: set[int] = set()
    self.contractions: set[int] = set()     # batch_reductions that are dot_generals
    self.index_operands: dict[int, Any] = {}   # index batch_reductions -> the values reduced
    # the grouped convolutions (feature_group_count > 1) whose input holds the batch's dimension 0
    # as its batch: (walk position, bytes of the whole input per step, its bfloat16 bytes, trips,
    # its flops per step)
    self.grouped: list[tuple[int, int, int, int, float]] = []
    # the results of the jax.shard_maps walked that their out_specs shard over the user's mesh:
    # (walk position, bytes of the whole value, its bfloat16 bytes, the devices its dimension 0
    # is split over, the devices it is split over in all, the block of dimension 0 each device
    # holds, in the mesh's device order: manual_blocks); and their operands that hold the
    # batch's dimension 0 as theirs: (walk position, bytes, bfloat16 bytes, the devices the
    # in_specs split dimension 0 over, the blocks)
    self.manual: list[tuple[int, int, int, int, int, tuple[int, ...]]] = []
    self.manual_in: list[tuple[int, int, int, int, tuple[int, ...]]] = []
    # the shard_map equation and the value of each entry of manual and of manual_in (the step
    # graph names those a tensor pair splits on their features: stepgraph.FeatureShardMap)
    self.manual_eqns: list[Any] = []
    self.manual_in_eqns: list[Any] = []
    # the products in walk order: (walk position, flops per step, the weights they read)
    self.product_events: list[tuple[int, float, tuple[int, ...]]] = []
    self.first_order: dict[int, int] = {}     # weight leaf -> the walk position of its first product
    # the scans' bodies: the walk positions of the scan and of its body's last equation, and the
    # body's trips per step (since_meeting)
    self.loop_bodies: list[tuple[int, int, int]] = []
    self._orders: list[int] = []              # the products' walk positions and their flops'
    # > 0 inside a lax.cond branch other than the one sub_jaxprs walks (_aside): its products
    # say which weights the step reads and how, nothing of the step's work or batch
    self.aside = 0
    self.cond_weights: set = set()     # a cond's results that are weights it took (_choose_branch)
    self._prefix: list[float] = []            # running sums (_flops_between)

  # origin: var -> (leaf index, dims) where dims[k] is the leaf dimension of the var's dim k
  def walk(self, jaxpr, origin: dict, tie: dict, repeats: int) -> None:
    live = None
    # an integer weight keeps its identity through its dequantization's scale here (its product
    # reads it as the float it is dequantized into), not in plan.jit's gathers (gather.py), which
    # gather the scale vector itself before the product: left to it, a sharded scale's broadcast
    # were gathered beside the weight (f32[512,256] of a 256-vector on `fsdp` 8)
    fills = scalar_fills(jaxpr) | dequantization_scales(jaxpr)
    for eqn in jaxpr.eqns:
      self.eqn_count += 1
      for pos, v in enumerate(eqn.invars):
        if is_var(v):
          self.uses.setdefault(v, []).append((eqn, pos))
      self.producer.update((o, eqn) for o in eqn.outvars)
      name = eqn.primitive.name
      ins = [origin.get(v) if is_var(v) else None for v in eqn.invars]
      if name == "cond" and not self.aside:
        self._choose_branch(eqn, ins)
      for v, org in zip(eqn.invars, ins):
        if org is not None:
          self.origin_all[v] = org
      if any(is_var(v) and (v in self.state_derived or v in origin) for v in eqn.invars):
        self.state_derived.update(eqn.outvars)
      if name in ("dot_general", "conv_general_dilated"):
        self._product(eqn, ins, repeats)
        if name == "conv_general_dilated" and not self.aside:
          self._grouped_input(eqn, repeats)
      elif self.aside:
        pass                     # the work and the lookups are the priced branch's
      elif name in ELEMENTWISE or name in REDUCTIONS:
        self._token_work(eqn, repeats)
      elif name == "gather" and ins and ins[0] is not None:
        self.gathered.add(ins[0][0])
        leaf, dims = ins[0]
        indexed = tuple(sorted(dims[d] for d in eqn.params["dimension_numbers"].start_index_map
                               if d < len(dims) and dims[d] is not None))
        seen = self.lookups.get(leaf, ((), 0, ()))
        rows = nbytes(eqn.outvars[0].aval)
        self.lookups[leaf] = (indexed or seen[0], seen[1] + rows * repeats,
                              seen[2] + (rows,) * repeats)
        self.lookup_dtypes.setdefault(leaf, np.dtype(eqn.outvars[0].aval.dtype).name)
      if name in ALIASES and ins[0] is not None:
        origin[eqn.outvars[0]] = ins[0]
      elif (kept := followed_operand(eqn, fills)) is not None:
        org = ins[list(eqn.invars).index(kept)]
        if org is not None:          # a weight scaled by scalars (``0.5 * w``): still the weight
          origin[eqn.outvars[0]] = org
      elif name == "transpose" and ins[0] is not None:
        perm = eqn.params["permutation"]
        origin[eqn.outvars[0]] = (ins[0][0], tuple(ins[0][1][p] for p in perm))
      if self.aside:
        self._enter_all(eqn, origin, repeats)
        continue
      self._tie(eqn, tie)
      if not sub_jaxprs(eqn):
        self._track_batch(eqn, repeats)
      if name == "cond":
        self._aside(eqn, origin, repeats)
      if name in ("while", "cond"):
        # a loop's or a branch's predicate read from the batch: every device must go the same
        # way (unless XLA removes the loop or branch, whose results nothing reads)
        live = _needed(jaxpr)[0] if live is None else live
        if id(eqn) in live and name == "while":
          self._condition(eqn, origin, repeats)
        elif id(eqn) in live and is_var(eqn.invars[0]):
          self._meet(eqn.invars[0])
      remat = name in _REMAT
      self.remat_depth += remat
      for sub, length in sub_jaxprs(eqn):
        self._enter(eqn, sub, origin, tie, repeats * length)
      self.remat_depth -= remat
      if name == "while" and id(eqn) in live:
        self._carried_condition(eqn)

  def _choose_branch(self, eqn, ins) -> None:
    """Fixes the branch of a ``lax.cond`` the step is priced on (:func:`priced_branch`): the one
    whose products read the most bytes of weights, then the one of larger made peak, then of most
    equations. What XLA compiles does not depend on the branch that runs: its conditional holds
    the buffers of the branch larger on a device, and check counts the branch of most collective
    bytes. The bytes a branch makes in the jaxpr are the whole batch's; on a device the values
    that carry the batch split over its axes while a weight's gradient (DP) or gathered copy
    (FSDP) stays whole, so the weights a branch reads are what its memory and its collectives
    per device grow with. review19a's tiled_vs_weights (tests/test_plan_user_steps.py): a
    [256, 4096] tile of ``x @ w3`` beside ``gelu(x @ w1) @ w2`` (h 2048); the tile's branch makes
    more bytes, the weights' branch holds more on each of 8 devices and all-reduces (DP) or
    gathers (FSDP) w1 and w2, 2 MiB a pass, where the larger-bytes rule priced 0.06. A branch's
    weights are its cond's operands that come from a parameter leaf (``ins``, the origins), or
    that an earlier cond's branch handed out as it took them (the forward's cond returns w2 as a
    residual for the backward's, where w2's product reads it)."""
    operands = list(eqn.invars)[1:]
    branches = [b.jaxpr for b in eqn.params["branches"]]
    def weights(branch):
      return {i for o, i, org in zip(operands, branch.invars, ins[1:])
              if is_var(o) and ((org is not None and not self.leaves[org[0]].is_batch) or
                                o in self.cond_weights)}
    for j in branches:
      passed = weights(j)
      self.cond_weights.update(o for v, o in zip(j.outvars, eqn.outvars)
                               if is_var(v) and v in passed)
    best = max(branches, key=lambda j: (_weight_bytes_read(j, weights(j)), _made_peak(j),
                                        len(j.eqns)))
    self.chosen[id(eqn)] = (eqn, best)

  def _aside(self, eqn, origin: dict, repeats: int) -> None:
    """Walks the branches of a ``lax.cond`` that :func:`sub_jaxprs` leaves out, for the weights
    their products read: a weight read in one branch only (``lax.cond(gate, lambda: loss(w1),
    lambda: loss(head))``) is a weight the step reads, with the layout that product needs. The
    branch the step's work is priced on stays :func:`priced_branch`'s, and it is walked after
    these, so its ties and batch dimensions are the cond's results' (optax.apply_if_finite's
    skip branch, whose state passes through untouched, would untie the moments); the walk
    positions are the cond's own (the branches run at the same point of the step)."""
    main = sub_jaxprs(eqn)[0][0]
    count = self.eqn_count
    self.aside += 1
    for branch in eqn.params["branches"]:
      if branch.jaxpr is not main:
        self._enter(eqn, branch.jaxpr, origin, {}, repeats)
    self.aside -= 1
    self.eqn_count = count

  def aside_only(self) -> frozenset[int]:
    """The weights only the branches :meth:`_aside` walks read in products: in the branch the
    step is priced on, their gradient is a constant zero and nothing gathers them."""
    return frozenset(leaf for leaf in self.weights if leaf not in self.leaf_reads)

  def _enter_all(self, eqn, origin: dict, repeats: int) -> None:
    """Inside a branch :meth:`_aside` walks: every body an equation runs, for their products."""
    name = eqn.primitive.name
    bodies = [(b.jaxpr, 1) for b in eqn.params["branches"]] if name == "cond" else sub_jaxprs(eqn)
    for sub, length in bodies:
      self._enter(eqn, sub, origin, {}, repeats * length)

  def _enter(self, eqn, sub, origin, tie, repeats):
    name = eqn.primitive.name
    outer = list(eqn.invars)
    if name == "cond":
      outer = outer[1:]
    elif name == "while":     # its operands: the cond's constants, then the body's and the carry
      outer = outer[eqn.params["cond_nconsts"]:]
    inner_origin, inner_tie = {}, {}
    n_consts, n_carry = jaxapi.scan_counts(eqn) if name == "scan" else (0, 0)
    if name == "scan" and any(is_var(o) and (o in self.state_derived or o in origin)
                              for o in outer):
      # the carry of the second iteration on was computed from the state the body reads
      self.state_derived.update(sub.invars[n_consts:n_consts + n_carry])
    if name == "scan" and not self.aside:
      # the state leaves a scan slices (stacks.read makes the scanned stacks of them)
      self.scans.append((eqn, sub, tuple(origin.get(o) if is_var(o) else None
                                         for o in outer[n_consts + n_carry:])))
    for k, (o, i) in enumerate(zip(outer, sub.invars)):
      if not is_var(o):
        continue
      if o in self.state_derived or o in origin:
        self.state_derived.add(i)
      org = origin.get(o)
      if org is not None:
        if name == "scan" and k >= n_consts + n_carry:
          inner_origin[i] = (org[0], org[1][1:])          # one layer of a stacked leaf
        else:
          inner_origin[i] = org
      if o in tie and name != "scan":
        inner_tie[i] = tie[o]
      sliced = name == "scan" and k >= n_consts + n_carry     # one slice of a scanned operand
      if not self.aside:
        self._carry_batch(o, i, -1 if sliced else 0)
    if name == "shard_map" and not self.aside:
      self._manual(eqn, repeats)
    saved, start = self.frames, self.eqn_count
    self.frames = saved + ((eqn, sub),)
    self.walk(sub, inner_origin, inner_tie, repeats)
    self.frames = saved
    if self.aside:
      return
    if name == "scan":
      self.loop_bodies.append((start, self.eqn_count, repeats))
    if name in ("scan", "while"):
      self._carried_stats(eqn, sub)
    for k, (i, o) in enumerate(zip(sub.outvars, eqn.outvars)):
      if is_var(i):
        # a scan's stacked outputs (after the carry) gain the leading length dimension
        self.outer_of_outvar[i] = (o, 1 if name == "scan" and k >= n_carry else 0)
        # a tie made inside a call carries on after it: an optimizer update split over nested
        # jits (jax 0.11's optax update has two more than 0.10's) ties the parameter to its moments
        if name != "scan" and i in inner_tie and is_var(o):
          tie[o] = inner_tie[i]
        self._carry_batch(i, o, self.outer_of_outvar[i][1])

  def _manual(self, eqn, repeats: int) -> None:
    """Records the results of a jax.shard_map that its out_specs shard over the user's mesh, and
    its operands that hold the batch (split over the user's mesh as its in_specs say), their
    bytes those of the ``repeats`` times a step runs it (inside ``lax.scan`` over the layers,
    XLA reshards the carry at the boundary in every iteration, forward and backward)."""
    mesh = eqn.params.get("mesh")
    sizes = dict(getattr(mesh, "shape", {}) or {})

    def split(entry) -> int:
      return math.prod(sizes.get(a, 1) for a in spec_axes(entry))

    for o, spec in zip(eqn.outvars, eqn.params.get("out_specs", ())):
      whole = math.prod(split(e) for e in spec)
      if whole > 1:
        first = spec[0] if len(spec) else None
        self.manual.append((self.eqn_count, repeats * nbytes(o.aval),
                            repeats * wide_bytes(o.aval), split(first),
                            whole, manual_blocks(sizes, spec_axes(first))))
        self.manual_eqns.append((eqn, o))
    for v, spec in zip(eqn.invars, eqn.params.get("in_specs", ())):
      if is_var(v) and 0 in self.batch.get(v, ()):
        first = spec[0] if len(spec) else None
        self.manual_in.append((self.eqn_count, repeats * nbytes(v.aval),
                               repeats * wide_bytes(v.aval), split(first),
                               manual_blocks(sizes, spec_axes(first))))
        self.manual_in_eqns.append((eqn, v))

  def manual_outputs(self) -> list[tuple[int, int | None, int, int, int, tuple[int, ...]]]:
    """(bytes, payer, wide, rows, split, blocks) of each result a jax.shard_map's out_specs shard
    over the user's mesh: the whole value's bytes, the weight whose price holds what moving it
    costs (as a meeting's: :meth:`_payer`), the bytes XLA:CPU adds moving it
    (:func:`wide_bytes`), the devices its dimension 0 is split over, those it is split over in
    all, and the block of dimension 0 each device holds (:func:`manual_blocks`)."""
    return [(nb, self._payer(order), wide, rows, whole, blocks)
            for order, nb, wide, rows, whole, blocks in self.manual]

  def manual_operands(self) -> list[tuple[int, int | None, int, int, tuple[int, ...]]]:
    """(bytes, payer, wide, rows, blocks) of each operand of a jax.shard_map that holds the
    batch's dimension 0 as its own: its bytes, the weight whose price holds moving it, its
    bfloat16 bytes, the devices the in_specs split its dimension 0 over (1: replicated) and the
    block each device holds."""
    return [(nb, self._payer(order), wide, rows, blocks)
            for order, nb, wide, rows, blocks in self.manual_in]

  def _token_work(self, eqn, repeats: int) -> None:
    """Adds an elementwise equation's or a reduction's bytes to :attr:`token_bytes` unless its
    result has a state leaf's shape (the optimizer's update, a weight's cast) or is a scalar."""
    out = eqn.outvars[0].aval
    shape = tuple(getattr(out, "shape", ()))
    if not shape or shape in self._state_shapes:
      return
    moved = repeats * (nbytes(out) + sum(nbytes(v.aval) for v in eqn.invars if is_var(v)))
    self.token_bytes += moved
    self.token_of[eqn.outvars[0]] = self.token_of.get(eqn.outvars[0], 0.0) + moved

  def _tie(self, eqn, tie) -> None:
    """Elementwise ops over operands of one shape tie the state leaves they carry."""
    if eqn.primitive.name not in ELEMENTWISE or not eqn.outvars:
      return
    shape = tuple(eqn.outvars[0].aval.shape)
    reps = [tie[v] for v in eqn.invars if is_var(v) and v in tie
            and tuple(v.aval.shape) == shape]
    if not reps:
      return
    for r in reps[1:]:
      self.ties.union(reps[0], r)
    for o in eqn.outvars:
      tie[o] = reps[0]

  def _grouped_input(self, eqn, repeats: int) -> None:
    """Records a grouped convolution of more than one input feature a group
    (:func:`grouped_by_features`: a grouped layer's forward, and its input's gradient, which JAX
    makes as a grouped convolution of the output's gradient with the reversed kernel) whose
    input carries the batch's dimension 0 as the convolution's batch. XLA's SPMD partitioner
    splits such a convolution only along its feature groups: with the batch split it
    all-gathers the input whole over the batch axes, runs the whole batch's convolution on
    every device and slices the result to the device's rows (the compiled HLO on 8 CPU devices,
    jax 0.10.2, plain ``jax.jit`` with the batch over `data` 8 and the kernel replicated, 32
    features in 2, 4, 8 or 16 groups: f32[16,8,8,32] all-gathered for the forward's convolution
    and again for the input gradient's, each beside a whole f32[16,8,8,32] result). The
    kernel's gradient (a ``batch_group_count`` convolution contracting the batch) is made on
    the device's rows and reduced as any weight's."""
    lhs, dn = eqn.invars[0], eqn.params["dimension_numbers"]
    if not grouped_by_features(eqn) or not is_var(lhs):
      return
    if dn.lhs_spec[0] not in self.batch.get(lhs, frozenset()):
      return
    self.grouped.append((self.eqn_count, repeats * nbytes(lhs.aval),
                         repeats * wide_bytes(lhs.aval), repeats,
                         self.eqn_flops.get(id(eqn), 0.0)))

  def grouped_gathers(self) -> list[Meeting]:
    """The all-gathers over the batch axes of the grouped convolutions' inputs
    (:meth:`_grouped_input`), each a Meeting (``whole``): every device waits there for the
    others' rows, paid by the weight whose product comes last before it."""
    return [Meeting(order, nb, count, self._payer(order), whole=True, wide=wide, flops=flops)
            for order, nb, wide, count, flops in self.grouped]

  def _product(self, eqn, ins, repeats) -> None:
    name = eqn.primitive.name
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    if name == "dot_general":
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      lfree = [d for d in range(len(lhs.shape)) if d not in lc and d not in lb]
      rfree = [d for d in range(len(rhs.shape)) if d not in rc and d not in rb]
      contract = math.prod(lhs.shape[d] for d in lc)
      batch = math.prod(lhs.shape[d] for d in lb)
      flops = 2.0 * repeats * batch * contract * math.prod(
          lhs.shape[d] for d in lfree) * math.prod(rhs.shape[d] for d in rfree)
      sides = ((0, lc, lb, lfree, rhs, rfree), (1, rc, rb, rfree, lhs, lfree))
      width = 0                          # the contracted dimensions' product
      positions = 0                      # the output's tokens are the input's
    else:   # conv_general_dilated: rhs is the kernel
      dn = eqn.params["dimension_numbers"]
      rspec = dn.rhs_spec            # (out feature, in feature, spatial...)
      out = eqn.outvars[0].aval
      kernel = math.prod(rhs.shape) // rhs.shape[rspec[0]]
      flops = 2.0 * repeats * math.prod(out.shape) * kernel
      lspec = dn.lhs_spec
      sides = ((1, tuple(rspec[1:]), (), (rspec[0],), lhs, (lspec[0], *lspec[2:])),)
      width = lhs.shape[lspec[1]]        # the input's features (all groups'), not the window
      ospec = dn.out_spec
      positions = math.prod(out.shape[d] for d in (ospec[0], *ospec[2:]))
    if not self.aside:     # a branch walked aside: the weights it reads, not the work
      self.flops += flops
      self.products += repeats
      self.eqn_flops[id(eqn)] = flops
      read = tuple(ins[side][0] for side, *_ in sides
                   if ins[side] is not None and not self.leaves[ins[side][0]].is_batch)
      self.product_events.append((self.eqn_count, flops, read))
      out_shape = tuple(eqn.outvars[0].aval.shape)
      self.shape_flops[out_shape] = self.shape_flops.get(out_shape, 0.0) + flops
    for side, contracted, batched, free, partner, pfree in sides:
      org = ins[side]
      if org is None:
        continue
      leaf, dims = org
      if not self.aside:
        self.leaf_flops[leaf] = self.leaf_flops.get(leaf, 0.0) + flops
        self.leaf_reads[leaf] = self.leaf_reads.get(leaf, 0) + 1
        other = eqn.invars[1 - side]
        if not (is_var(other) and other in self.state_derived):
          self.free_reads[leaf] = self.free_reads.get(leaf, 0) + 1
        if repeats > 1:
          seen, trips = self.loop_reads.get(leaf, (0, 0))
          self.loop_reads[leaf] = (seen + 1, trips + repeats)
          self.loop_of.setdefault(leaf, next((e for e, _ in reversed(self.frames)
                                              if e.primitive.name in ("scan", "while")), None))
        if self.remat_depth:
          self.remat_read.add(leaf)
          if _loop_in_remat(self.frames):
            self.remat_loop_read.add(leaf)
      if self.leaves[leaf].is_batch:
        continue
      if name == "dot_general":
        self.reads.setdefault(leaf, []).append((eqn, side, dims, self.frames))
      if leaf in self.weights:
        continue
      self.weights[leaf] = WeightUse(
          leaf=leaf,
          contracted=tuple(sorted(dims[d] for d in contracted if dims[d] is not None)),
          free=tuple(sorted(dims[d] for d in free if dims[d] is not None)),
          stacked=tuple(sorted({d for d in range(len(self.leaves[leaf].shape))} -
                               {dims[d] for d in (*contracted, *free) if dims[d] is not None})),
          # the product's batch dimensions count too: every expert's tokens of a batched product
          tokens=int(math.prod(partner.shape[d] for d in pfree) *
                     math.prod(eqn.invars[side].aval.shape[d] for d in batched)),
          act_itemsize=itemsize(partner.dtype), act_bfloat16=_doubled(partner.dtype),
          read_dtype=np.dtype(eqn.invars[side].aval.dtype).name,
          repeats=repeats, primitive=name,
          groups=int(eqn.params.get("feature_group_count", 1)) if name != "dot_general" else 1,
          layers=math.prod(s for k, s in enumerate(self.leaves[leaf].shape) if k not in dims),
          unroll=_scan_unroll(self.frames),
          carried_input=_carried(self.frames, eqn.invars[1 - side]),
          carried_output=_reaches_carry(self.frames, eqn.outvars[0]),
          carry_in_free=self._carry_in_free(eqn.invars[1 - side]),
          input_grad=is_var(eqn.invars[1 - side]) and eqn.invars[1 - side] in self.state_derived,
          branched=any(e.primitive.name == "cond" for e, _ in self.frames),
          input_width=width,
          output_tokens=(positions if positions != math.prod(partner.shape[d] for d in pfree)
                         else 0))
      self.first_out[leaf] = (eqn, side, dims, self.frames)
      self.first_order[leaf] = self.eqn_count
      if is_var(eqn.invars[1 - side]):
        self.partner[leaf] = eqn.invars[1 - side]

  # --- where the devices meet: reductions over the batch that later work on the batch reads ---

  def _carry_batch(self, src, dst, shift: int) -> None:
    """What ``src`` holds of the batch, carried to ``dst`` (a body's operand or result; ``shift``
    -1 for a scan's slice of a stacked operand, +1 for a scan's stacked result)."""
    moved = frozenset(d + shift for d in self.batch.get(src, ()) if d + shift >= 0)
    self._hold(dst, moved, self.depth.get(src, 0), self.stat.get(src, frozenset()))

  def _hold(self, v, dims: frozenset[int], depth: int, stats: frozenset[int]) -> None:
    """Sets what ``v`` holds of the batch, replacing what it held: JAX shares one body between
    the calls of a jitted function, so a body's value stands for another call's value at each
    call site, and what the last call left must not carry over (a dimension past ``v``'s rank,
    which no rule should give, is dropped)."""
    rank = len(getattr(getattr(v, "aval", None), "shape", ()))
    for table, value in ((self.batch, frozenset(d for d in dims if d < rank)),
                         (self.depth, depth), (self.stat, stats)):
      if value:
        table[v] = value
      else:
        table.pop(v, None)

  def _carry_in_free(self, v) -> bool:
    """Whether ``v`` is a carry of the innermost ``lax.scan`` body of the walk's frames whose
    operand into the scan (the first iteration's value) no state leaf computes."""
    scan = _scan_frame(self.frames, v)
    if scan is None:
      return False
    eqn, sub, n_consts, n_carry = scan
    k = next((k for k, c in enumerate(sub.invars[n_consts:n_consts + n_carry]) if v is c), None)
    if k is None:
      return False
    o = eqn.invars[n_consts + k]
    return not is_var(o) or (o not in self.state_derived and o not in self.origin_all)

  def _meet(self, v) -> None:
    """The batch reductions ``v`` was computed from decide which way the step goes (a loop's or
    a branch's predicate): every device must go the same way, so XLA all-reduces them. But a
    contraction over the batch: that is a weight's gradient, which the gradient's own all-reduce
    brings to every device already (``optax.apply_if_finite`` tests the gradients: XLA compiles
    no all-reduce for the test beyond the gradients')."""
    self.met |= self.stat.get(v, frozenset()) - self.contractions

  def _condition(self, eqn, origin: dict, repeats: int) -> None:
    """Walks a ``lax.while_loop``'s condition (its operands: the condition's constants, then the
    carry): a reduction over the batch its predicate reads (a convergence test on a statistic of
    the batch) is a meeting, which XLA all-reduces inside the condition's computation. Counted
    once: the trips of such a loop are not known when it compiles (``plan.check`` counts its
    collectives once too)."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    inner = {}
    for o, i in zip([*eqn.invars[:nc], *eqn.invars[nc + nb:]], cond.invars):
      if not is_var(o):
        continue
      if o in self.state_derived or o in origin:
        self.state_derived.add(i)
      if origin.get(o) is not None:
        inner[i] = origin[o]
      self._carry_batch(o, i, 0)
    saved = self.frames
    self.frames = saved + ((eqn, cond),)
    self.walk(cond, inner, {}, repeats)
    self.frames = saved
    for v in cond.outvars:
      if is_var(v):
        self._meet(v)

  def _carried_stats(self, eqn, sub) -> None:
    """After a loop's body is walked: a statistic of the batch a trip computes and carries to the
    next trip, whose work on the batch's values reads it (a running correction), is a meeting
    inside the body (the walk carried in the first trip's value, which holds none)."""
    if eqn.primitive.name == "scan":
      first, n = jaxapi.scan_counts(eqn)
    else:
      first, n = eqn.params["body_nconsts"], len(sub.outvars)
    for i, o in zip(sub.invars[first:first + n], sub.outvars[:n]):
      stats = self.stat.get(o, frozenset()) if is_var(o) else frozenset()
      if not stats <= self.met and self._meets_batch(sub, i):
        self.met |= stats

  def _meets_batch(self, jaxpr, v) -> bool:
    """Whether an equation of ``jaxpr`` that reads ``v``, or a value computed from it, reads or
    makes a value that carries the batch (as walked: :attr:`batch`)."""
    derived = {v}
    for eqn in jaxpr.eqns:
      if any(is_var(x) and x in derived for x in eqn.invars):
        if any(self.batch.get(x) for x in (*eqn.invars, *eqn.outvars) if is_var(x)):
          return True
        derived.update(eqn.outvars)
    return False

  def _carried_condition(self, eqn) -> None:
    """After a ``lax.while_loop``'s body is walked: a reduction over the batch a trip computes
    and carries to the condition (the error a trip leaves, tested for convergence) decides
    whether the next trip runs, so XLA all-reduces it inside the body."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    _, read = _needed(cond)
    carry = cond.invars[eqn.params["cond_nconsts"]:]
    for i, o in zip(carry, eqn.params["body_jaxpr"].jaxpr.outvars):
      if i in read and is_var(o):
        self._meet(o)

  def _track_batch(self, eqn, repeats: int) -> None:
    """Carries the batch's dimensions, the reductions' depth and their results through one
    equation (not a call: its body is walked); records a reduction over the batch, and marks the
    reductions whose results meet the batch's values here as meetings."""
    vars_in = [v for v in eqn.invars if is_var(v)]
    ins = [self.batch.get(v, frozenset()) if is_var(v) else frozenset() for v in eqn.invars]
    depth = max((self.depth.get(v, 0) for v in vars_in), default=0)
    stats = frozenset().union(*(self.stat.get(v, frozenset()) for v in vars_in))
    outs, reduced = _batch_out(eqn, ins) if any(ins) else ([frozenset()] * len(eqn.outvars),
                                                          False)
    if reduced and not any(outs):
      depth += 1
      body = next(((id(e), id(sub)) for e, sub in reversed(self.frames)
                   if e.primitive.name in ("scan", "while", "cond")), None)
      remat = next((id(e) for e, _ in reversed(self.frames) if e.primitive.name in _REMAT), None)
      how = _REDUCED_WITH.get(eqn.primitive.name, "sum")
      moved = sum(nbytes(o.aval) for o in eqn.outvars)
      # of them, the bfloat16 values' (XLA:CPU moves them in float32: Meeting.wide)
      wide = sum(wide_bytes(o.aval) for o in eqn.outvars)
      if how in _GATHERED:     # the extreme values travel beside their indices
        values = sum(math.prod(o.aval.shape) for o in eqn.outvars) * itemsize(
            eqn.invars[0].aval.dtype)
        moved += values
        wide += values if _doubled(eqn.invars[0].aval.dtype) else 0
      self.batch_reductions.append((self.eqn_count, depth, repeats * moved, repeats, body, remat,
                                    how, repeats * wide))
      if how in _GATHERED:
        self.index_operands[len(self.batch_reductions) - 1] = eqn.invars[0]
      stats = frozenset((len(self.batch_reductions) - 1,))
      if eqn.primitive.name == "dot_general":
        self.contractions |= stats
    elif stats and (any(ins) or any(outs)):
      self.met |= stats        # a statistic meets the batch's values: its reductions all-reduce
      stats = frozenset()
    for o, dims in zip(eqn.outvars, outs):
      self._hold(o, dims, depth, stats)

  def meetings(self) -> list[Meeting]:
    """The meetings of the step, in walk order, each paid by the weight whose product comes last
    before it (else the first after it). XLA's combiner joins all-reduces that follow one another
    in its order (the walk's) and do not read one another's results, inside one computation (a
    loop's or a branch's body, or the step outside them), of one reduction (sums with sums, a
    max with maxes): a met reduction joins the meeting before it where both lie in the same
    computation and reduce alike and it is no deeper than any reduction of that meeting (so
    reads none of their results), else it begins one. The independent statistics of one norm
    are one meeting.

    jax.checkpoint's backward recomputes its body's forward behind an optimization barrier over
    the body's operands, the cotangent among them: on XLA:GPU, which keeps the barrier until
    after its combiner, and on jaxlib 0.11's XLA:CPU, which keeps the recomputed products, a
    reduction inside the body joins only a meeting inside it. jaxlib 0.10's XLA:CPU expands the
    barrier first and computes the recomputed products once with the forward's, so outside a
    loop the recomputed norm's first statistics depend on no all-reduce since the forward's
    product and join the all-reduce before them (``Meeting.joins_on_cpu``): on a step of two
    checkpointed conv/norm blocks it compiles 10 all-reduces of the 12 meetings, these 10
    (jaxlib 0.11's: the 12)."""

    def grouped(cpu: bool) -> list[list[tuple]]:
      groups: list[list[tuple]] = []
      for k in sorted(self.met):
        r = self.batch_reductions[k]
        last = groups[-1] if groups else []
        if (last and last[0][4] == r[4] and last[0][6] == r[6] and
            r[1] <= min(x[1] for x in last) and
            (cpu or r[5] is None or all(x[5] == r[5] for x in last))):
          last.append(r)
        else:
          groups.append([r])
      return groups
    cpu_starts = {g[0][0] for g in grouped(cpu=True)}
    out = []
    for found in grouped(cpu=False):
      out.append(Meeting(found[0][0], sum(r[2] for r in found), max(r[3] for r in found),
                         self._payer(found[0][0]),
                         joins_on_cpu=bool(out) and found[0][0] not in cpu_starts,
                         gathered=found[0][6] in _GATHERED, wide=sum(r[7] for r in found)))
    return [dataclasses.replace(mt, since=self._flops_between(out[k - 1].order if k else -1,
                                                              mt.order))
            for k, mt in enumerate(out)]

  def index_gathers(self, cones: dict[tuple[int, int], set[Any]]) -> list[Meeting]:
    """The index reductions over the batch (argmax, argmin) whose results no later work on the
    batch reads (a metric the step returns: the example each feature peaks at): no meeting, but
    XLA all-gathers their partials over the batch axes all the same. Each as a Meeting
    (``gathered``), paid by the weight whose pair's cone (``cones``: pairs.find_pairs) holds the
    values reduced, else as a meeting is."""
    out = []
    for k, r in enumerate(self.batch_reductions):
      if k in self.met or r[6] not in _GATHERED:
        continue
      cone = next((key for key in sorted(cones) if self.index_operands[k] in cones[key]), None)
      out.append(Meeting(r[0], r[2], r[3], cone[0] if cone else self._payer(r[0]),
                         gathered=True, cone=cone, wide=r[7]))
    return out

  def _payer(self, order: int) -> int | None:
    """The weight read by the last product before walk position ``order`` (else by the first
    after it): the group whose price holds a collective of the whole step there."""
    orders, _ = self._products_summed()
    after = bisect.bisect_left(orders, order)
    return next((e[2][0] for e in reversed(self.product_events[:after]) if e[2]),
                next((e[2][0] for e in self.product_events[after:] if e[2]), None))

  def _products_summed(self) -> tuple[list[int], list[float]]:
    """The products' walk positions and the running sums of their flops, once the walk is over."""
    if len(self._prefix) != len(self.product_events) + 1:
      self._orders = [e[0] for e in self.product_events]
      self._prefix = [0.0, *itertools.accumulate(e[1] for e in self.product_events)]
    return self._orders, self._prefix

  def _flops_between(self, start: int, end: int) -> float:
    """The flops of the products strictly between walk positions ``start`` and ``end``."""
    orders, prefix = self._products_summed()
    lo, hi = bisect.bisect_right(orders, start), bisect.bisect_left(orders, end)
    return max(0.0, prefix[hi] - prefix[lo])

  def since_meeting(self, meetings: Sequence[Meeting]) -> dict[int, float]:
    """Weight leaf -> the flops of the products between the last meeting before its first
    product and that product (per step, global): the compute its devices did since they last
    met, where a meeting comes before it (else absent). A layer of a scanned stack (gathered once
    a trip, inside the body) where the body meets: per trip, since the body's last meeting
    before its product, or where the body meets only after it, since the previous trip's last
    meeting (a conv/norm layer's: its gather follows the previous layer's norm)."""
    at = [mt.order for mt in meetings]           # walk order
    out = {}
    for leaf, first in self.first_order.items():
      body = min((b for b in self.loop_bodies if b[0] < first <= b[1]),
                 key=lambda b: b[1] - b[0], default=None)
      if body is not None and self.weights[leaf].layers > 1:
        inside = [o for o in at if body[0] < o <= body[1]]
        if inside:
          before = [o for o in inside if o < first]
          flops = (self._flops_between(before[-1], first) if before else
                   self._flops_between(inside[-1], body[1] + 1) +
                   self._flops_between(body[0], first))
          out[leaf] = flops / body[2]
        continue
      k = bisect.bisect_left(at, first)
      if k:
        out[leaf] = self._flops_between(at[k - 1], first)
    return out


def _needed(jaxpr) -> tuple[set[int], set]:
  """The ids of the equations of ``jaxpr`` that its results or an effect need (XLA removes the
  others; a body's results are all taken as needed), and the variables they read (its operands
  among them)."""
  need = {v for v in jaxpr.outvars if is_var(v)}
  out = set()
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(o in need for o in eqn.outvars):
      out.add(id(eqn))
      need.update(v for v in eqn.invars if is_var(v))
  return out, need


def needed_equations(jaxpr) -> set[int]:
  """The ids of ``jaxpr``'s equations that its results or an effect need: XLA removes the others
  (a gradient the step computes and drops)."""
  return _needed(jaxpr)[0]


def needed_vars(jaxpr) -> set:
  """The variables of ``jaxpr`` that the equations its results or effects need read, its results
  among them: an operand outside it is one that ``jax.jit`` leaves out of the program."""
  return _needed(jaxpr)[1]


def _batch_dependence(jaxpr, leaves: Sequence[Any], stopped: bool = False
                      ) -> tuple[dict[Any, int], int, int]:
  """Each value of ``jaxpr`` -> a mask of what it is computed from (bit ``leaf.index`` for a
  state leaf, the bit ``len(leaves)`` for any batch leaf); the mask of the state leaves some
  equation reads beside a value computed from the batch; the batch's bit. An equation with
  bodies (a loop, a branch) is taken whole: every result computed from every operand. With
  ``stopped``, ``lax.stop_gradient`` ends the state leaves' part of a value (no gradient flows
  back to them through it) and keeps the batch's."""
  dep: dict[Any, int] = {}
  batch = 1 << len(leaves)
  for leaf, v in zip(leaves, jaxpr.invars):
    dep[v] = batch if leaf.is_batch else 1 << leaf.index
  met = 0
  for eqn in jaxpr.eqns:
    mask = 0
    for v in eqn.invars:
      if is_var(v):
        mask |= dep.get(v, 0)
    if stopped and eqn.primitive.name == "stop_gradient":
      mask &= batch
    if mask & batch:
      met |= mask
    for o in eqn.outvars:
      dep[o] = mask
  return dep, met, batch


def batch_free(jaxpr, leaves: Sequence[Any]) -> frozenset[int]:
  """The state leaves no equation of ``jaxpr`` reads beside a value computed from the batch: a
  parameter the loss never reads (its gradient a constant zero, its update computed from its own
  shard) meets no batch-split value, so XLA neither reduces its gradient over the batch axes nor
  gathers it (a leaf met inside a loop or branch may be counted met, never the other way)."""
  _, met, _ = _batch_dependence(jaxpr, leaves)
  return frozenset(leaf.index for leaf in leaves
                   if not leaf.is_batch and not met >> leaf.index & 1)


def gradient_free(jaxpr, leaves: Sequence[Any]) -> frozenset[int]:
  """The state leaves no equation of ``jaxpr`` reads beside a value computed from the batch but
  through ``lax.stop_gradient`` (:func:`batch_free` and a parameter read by the loss only under
  stop_gradient): their gradient is a constant zero, though XLA may still gather them for the
  forward's products (stopped_reads)."""
  _, met, _ = _batch_dependence(jaxpr, leaves, stopped=True)
  return frozenset(leaf.index for leaf in leaves
                   if not leaf.is_batch and not met >> leaf.index & 1)


def batch_outputs(jaxpr, leaves: Sequence[Any]) -> frozenset[int]:
  """The positions of ``jaxpr``'s results computed from the batch (a parameter's new value, of
  one it trains; not of one it freezes, whose new value is the old one plus a constant)."""
  dep, _, batch = _batch_dependence(jaxpr, leaves)
  return frozenset(k for k, v in enumerate(jaxpr.outvars)
                   if is_var(v) and dep.get(v, 0) & batch)


# What a weight passes through, unchanged but for its layout, on its way to a product
_TO_PRODUCT = ALIASES | frozenset(("transpose", "reshape"))


def _state_sources(jaxpr, leaves: Sequence[Any]) -> dict[Any, tuple[int, bool]]:
  """``jaxpr``'s invars that are a state leaf (not the batch) -> (the leaf's index, read through
  ``lax.stop_gradient`` yet): where the stop_gradient walks below start."""
  return {v: (leaf.index, False) for leaf, v in zip(leaves, jaxpr.invars) if not leaf.is_batch}


def stopped_reads(jaxpr, leaves: Sequence[Any]) -> dict[int, int]:
  """The state leaves a product of ``jaxpr``'s top level reads through ``lax.stop_gradient`` (a
  tied embedding's output projection under stop_gradient) -> the bytes of the smallest other
  operand of such a product (the forward's activations, not the backward's logits' cotangent).
  The walk's weights do not see these reads (stop_gradient ends a leaf's identity: no gradient of
  the leaf flows from them), but XLA reads the leaf there all the same."""
  src = _state_sources(jaxpr, leaves)
  out: dict[int, int] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [src.get(v) if is_var(v) else None for v in eqn.invars]
    if name == "dot_general" and len(ins) == 2:
      for k, x in enumerate(ins):
        if x is not None and x[1]:
          other = nbytes(eqn.invars[1 - k].aval)
          out[x[0]] = min(out.get(x[0], other), other)
    elif (name in _TO_PRODUCT or name == "stop_gradient") and ins and ins[0] is not None:
      src[eqn.outvars[0]] = (ins[0][0], ins[0][1] or name == "stop_gradient")
  return out


def stopped_loop_reads(jaxpr, leaves: Sequence[Any]) -> dict[int, tuple[int, ...]]:
  """The loops of ``jaxpr``'s top level (a ``lax.scan``, a ``fori_loop``, a ``while_loop``;
  their index in ``jaxpr.eqns``, or the index of the call, a nested ``jax.jit``, that runs them)
  whose bodies read state leaves, loop constants, in products through ``lax.stop_gradient``,
  taken before the loop or in its body, and nowhere without it -> those leaves. A forward-only
  perturbation (``fori_loop(0, n, lambda i, x: x + 0.01 * tanh(mlp(stop_gradient(params),
  x)))`` before the step's gradient) reads the weights so: the walk's weights do not see these
  reads (:func:`stopped_reads`: no gradient flows from them), but XLA:CPU gathers each sharded
  weight before the while, a loop invariant it hoists out of the body and passes in as an
  operand, held to the loop's end and not shared with the step's own gathers of it (compiled
  on `fsdp` 8: ``all-gather.6`` and ``.2`` of w1 f32[128,512], ``.7`` and ``.3`` of w2, the
  four live together at the loop; the same with the stop_gradient in the body or the loop in
  a nested ``jax.jit``, review27)."""
  src = _state_sources(jaxpr, leaves)
  out: dict[int, set[int]] = {}
  _stopped_loops_in(jaxpr, src, out, None)
  return {k: tuple(sorted(v)) for k, v in sorted(out.items())}


def _stopped_loops_in(jaxpr, src: dict[Any, tuple[int, bool]], out: dict[int, set[int]],
                      at: int | None) -> None:
  """:func:`stopped_loop_reads` over ``jaxpr``'s equations, ``src`` its variables' leaves (and
  whether through stop_gradient); ``at`` the top-level call's index where ``jaxpr`` is its body."""
  for k, eqn in enumerate(jaxpr.eqns):
    where = k if at is None else at
    name = eqn.primitive.name
    ins = [src.get(v) if is_var(v) else None for v in eqn.invars]
    if name in ("scan", "while"):
      # the loop's constants only (a scan's first operands, a while body's): the invariants XLA
      # hoists; a stack the scan slices is gathered a layer at a time in the body
      if name == "while":
        n = eqn.params["body_nconsts"]
        outer = list(eqn.invars)[eqn.params["cond_nconsts"]:][:n]
      else:
        outer = list(eqn.invars)[:jaxapi.scan_counts(eqn)[0]]
      body = (eqn.params["body_jaxpr"] if name == "while" else eqn.params["jaxpr"]).jaxpr
      marked = {i: src[o] for o, i in zip(outer, body.invars) if is_var(o) and o in src}
      read = _product_reads(body, marked) if marked else set()
      if read:
        out.setdefault(where, set()).update(read)
    elif (name in _TO_PRODUCT or name == "stop_gradient") and ins and ins[0] is not None:
      src[eqn.outvars[0]] = (ins[0][0], ins[0][1] or name == "stop_gradient")
    elif name != "cond" and any(x is not None for x in ins):
      # a call (a nested jax.jit, a custom_jvp function) runs its body once, its operands its
      # body's variables in order
      for sub, _ in sub_jaxprs(eqn):
        if len(sub.invars) == len(eqn.invars):
          inner = {i: src[o] for o, i in zip(eqn.invars, sub.invars) if is_var(o) and o in src}
          _stopped_loops_in(sub, inner, out, where)


def stopped_scan_slices(jaxpr, leaves: Sequence[Any]) -> dict[int, int]:
  """The state leaves a ``lax.scan`` of ``jaxpr``'s top level slices (a stack it scans over)
  and reads in products in its body through ``lax.stop_gradient``, taken before the loop or on
  the slice in the body (``tanh(h @ stop_gradient(w))``: the same gathers, review27), and
  nowhere without it -> how many such scans. XLA gathers one layer of such an FSDP stack in
  each iteration, inside the body, as it gathers a trained stack's layers in the forward's loop
  (compiled on `fsdp` 8: a [4, 128, 128] stack scanned once under stop_gradient and once
  trained, 4 all-gathers of f32[1,128,128] more than the trained scan's 8). The walk does not
  see these reads (:func:`stopped_reads`)."""
  src = _state_sources(jaxpr, leaves)
  out: dict[int, int] = {}
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [src.get(v) if is_var(v) else None for v in eqn.invars]
    if name == "scan":
      n_consts, n_carry = jaxapi.scan_counts(eqn)
      body = eqn.params["jaxpr"].jaxpr
      start = n_consts + n_carry
      marked = {i: src[o] for o, i in zip(eqn.invars[start:], body.invars[start:])
                if is_var(o) and o in src}
      for leaf in (_product_reads(body, marked) if marked else ()):
        out[leaf] = out.get(leaf, 0) + 1
      # the slices a body stops in it and stacks out as residuals (the carry's gradient needs
      # them: ``tanh(h @ stop_gradient(w))`` where h has one) are the stack's again, sliced by
      # the backward's scan, whose body XLA gathers them in too (review27)
      inner = _marked_through(body, marked) if marked else {}
      for o, v in zip(eqn.outvars[n_carry:], body.outvars[n_carry:]):
        if is_var(v) and inner.get(v, (0, False))[1]:
          src[o] = inner[v]
    elif (name in _TO_PRODUCT or name == "stop_gradient") and ins and ins[0] is not None:
      src[eqn.outvars[0]] = (ins[0][0], ins[0][1] or name == "stop_gradient")
  return out


def _marked_through(jaxpr, marked: dict[Any, tuple[int, bool]]) -> dict[Any, tuple[int, bool]]:
  """``marked`` (a variable of ``jaxpr`` -> its leaf, and whether it passed stop_gradient) and
  the variables of ``jaxpr``'s top level :data:`_TO_PRODUCT` and stop_gradient make of them."""
  marked = dict(marked)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    first = eqn.invars[0] if eqn.invars else None
    if ((name in _TO_PRODUCT or name == "stop_gradient") and first is not None and is_var(first)
        and first in marked):
      marked[eqn.outvars[0]] = (marked[first][0], marked[first][1] or name == "stop_gradient")
  return marked


def _product_reads(jaxpr, marked: dict[Any, tuple[int, bool]]) -> set[int]:
  """The leaves of ``marked`` (a variable of ``jaxpr`` -> its leaf, and whether it passed
  ``lax.stop_gradient``) that a product reads through stop_gradient (taken before ``jaxpr`` or
  in it) and no product reads without it, through :data:`_TO_PRODUCT` and into the calls, loops
  and branches ``jaxpr`` runs (their operands matched to their bodies' variables in order). A
  leaf also read without stop_gradient is the walk's read (its gather there is priced)."""
  stopped, plain = _product_reads_both(jaxpr, marked)
  return stopped - plain


def _product_reads_both(jaxpr, marked: dict[Any, tuple[int, bool]]) -> tuple[set[int], set[int]]:
  """:func:`_product_reads`' two sets: the leaves products read through stop_gradient, and
  those they read without it."""
  marked = dict(marked)
  stopped: set[int] = set()
  plain: set[int] = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    ins = [marked.get(v) if is_var(v) else None for v in eqn.invars]
    if name in ("dot_general", "conv_general_dilated"):
      for x in ins:
        if x is not None:
          (stopped if x[1] else plain).add(x[0])
    elif (name in _TO_PRODUCT or name == "stop_gradient") and ins and ins[0] is not None:
      marked[eqn.outvars[0]] = (ins[0][0], ins[0][1] or name == "stop_gradient")
    elif any(x is not None for x in ins):
      outer = list(eqn.invars)
      if name == "while":
        outer = outer[eqn.params["cond_nconsts"]:]
      elif name == "cond":
        outer = outer[1:]
      bodies = ([b.jaxpr for b in eqn.params["branches"]] if name == "cond"
                else [sub for sub, _ in sub_jaxprs(eqn)])
      for sub in bodies:
        inner = {i: marked[o] for o, i in zip(outer, sub.invars) if is_var(o) and o in marked}
        if inner:
          s, p = _product_reads_both(sub, inner)
          stopped |= s
          plain |= p
  return stopped, plain


def _batch_out(eqn, ins: Sequence[frozenset[int]]) -> tuple[list[frozenset[int]], bool]:
  """The dimensions of each result of ``eqn`` that carry the batch, given its operands' (``ins``),
  and whether it reduces a dimension that carries the batch (a sum over the batch, a product
  contracting it). A primitive not followed here carries nothing (a meeting after it is missed,
  never one invented)."""
  name = eqn.primitive.name
  shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
  out = tuple(getattr(eqn.outvars[0].aval, "shape", ())) if eqn.outvars else ()
  n = len(eqn.outvars)
  none = [frozenset()] * n
  p = eqn.params
  if name in ELEMENTWISE or name in _SAME_DIMS:
    def kept(b, s, o):
      return frozenset(d for d in b if len(s) == len(o) and s[d] == o[d])
    if n > 1 and len(ins) == n:       # a result per operand (optimization_barrier, sort)
      return [kept(b, s, tuple(o.aval.shape)) for b, s, o in zip(ins, shapes, eqn.outvars)], False
    return [frozenset().union(*(kept(b, s, out) for b, s in zip(ins, shapes)))] * n, False
  b = ins[0]
  if name == "broadcast_in_dim":
    return [frozenset(p["broadcast_dimensions"][d] for d in b)], False
  if name == "transpose":
    return [frozenset(k for k, d in enumerate(p["permutation"]) if d in b)], False
  if name == "squeeze":
    kept = [d for d in range(len(shapes[0])) if d not in p["dimensions"]]
    return [frozenset(kept.index(d) for d in b if d in kept)], False
  if name == "reshape":
    dims = set()
    for d in b:
      before = math.prod(shapes[0][:d])
      for j in range(len(out)):
        if math.prod(out[:j]) == before and out[j] > 1:
          dims.add(j)
          break
    return [frozenset(dims)], False
  if name == "concatenate":
    return [frozenset(d for x in ins for d in x if d != p["dimension"])], False
  if name == "split":
    return [frozenset(d for d in b if d != p["axis"])] * n, False
  if name in REDUCTIONS and "axes" in p:
    kept = [d for d in range(len(shapes[0])) if d not in p["axes"]]
    return [frozenset(kept.index(d) for d in b if d in kept)] * n, any(d in p["axes"] for d in b)
  if name in ("psum", "pmax", "pmin") and any(isinstance(a, int) for a in p.get("axes", ())):
    # jax.vmap's collectives over its own axis (lax.pmean over a vmap axis of the batch: a pmap
    # habit) are reductions over that positional dimension, a result per operand
    axes = [a for a in p["axes"] if isinstance(a, int)]
    kept = [[d for d in range(len(s)) if d not in axes] for s in shapes]
    return ([frozenset(k.index(d) for d in x if d in k) for x, k in zip(ins, kept)],
            any(d in axes for x in ins for d in x))
  if name == "dot_general":
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    lfree = [d for d in range(len(shapes[0])) if d not in lc and d not in lb]
    rfree = [d for d in range(len(shapes[1])) if d not in rc and d not in rb]
    dims = ({lb.index(d) for d in ins[0] if d in lb} | {rb.index(d) for d in ins[1] if d in rb} |
            {len(lb) + lfree.index(d) for d in ins[0] if d in lfree} |
            {len(lb) + len(lfree) + rfree.index(d) for d in ins[1] if d in rfree})
    return [frozenset(dims)], any(d in lc for d in ins[0]) or any(d in rc for d in ins[1])
  if name == "conv_general_dilated":
    dn = p["dimension_numbers"]
    dims = ({dn.out_spec[0]} if dn.lhs_spec[0] in ins[0] else set()) | (
        {dn.out_spec[1]} if dn.rhs_spec[0] in ins[1] else set())
    return [frozenset(dims)], dn.lhs_spec[1] in ins[0] or dn.rhs_spec[1] in ins[1]
  if name == "gather":
    dn = p["dimension_numbers"]
    offset = list(dn.offset_dims)
    rest = [d for d in range(len(out)) if d not in offset]
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    windows = [d for d in range(len(shapes[0])) if d not in dn.collapsed_slice_dims and
               d not in obatch]
    index_dims = list(range(len(shapes[1]) - 1))     # the indices' last is the index vector
    if len(rest) != len(index_dims) or len(offset) != len(windows):
      return none, False
    dims = {offset[windows.index(d)] for d in ins[0] if d in windows}
    dims |= {rest[index_dims.index(ibatch[obatch.index(d)])] for d in ins[0] if d in obatch}
    dims |= {rest[index_dims.index(d)] for d in ins[1] if d in index_dims}
    return [frozenset(dims)], False
  if name.startswith("scatter"):
    # the operand's dimensions stay; the updates' rows added into it lose theirs (an embedding
    # table's gradient), but a batching dimension the indices and updates share with the operand
    # keeps it (take_along_axis's gradient)
    dn = p["dimension_numbers"]
    obatch = tuple(getattr(dn, "operand_batching_dims", ()))
    ibatch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    scattered = [d for d in range(len(shapes[2])) if d not in dn.update_window_dims]
    if len(scattered) != len(shapes[1]) - 1:         # one a dimension of the indices but the last
      return none, False
    if any(d not in ibatch for d in ins[1]) and not ins[0]:
      # rows addressed by the batch itself (``logp[jnp.arange(B), y]``'s gradient writes each
      # example's row): which result dimension then carries the batch is not followed
      return none, False
    dims = set(ins[0]) | {obatch[ibatch.index(d)] for d in ins[1] if d in ibatch}
    for d in ins[2]:
      if d in scattered and scattered.index(d) in ibatch:
        dims.add(obatch[ibatch.index(scattered.index(d))])
    lost = any(d in scattered for d in ins[2]) and not dims
    return [frozenset(dims)] * n, lost
  return none, False
