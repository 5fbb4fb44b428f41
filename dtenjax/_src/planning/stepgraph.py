"""What a training step does with its arrays, read from its jaxpr: the facts the step planner
(:mod:`dtenjax._src.planning.step`) prices. :func:`read_step` traces ``fn(*args)`` with abstract
values (nothing runs, nothing is allocated) and assembles a :class:`StepGraph` from four readings:

* **weights, ties, flops** (:mod:`~dtenjax._src.planning.jaxpr_reader`) -- one walk of the jaxpr,
  into ``jit``, ``scan``, ``remat`` and custom-derivative bodies. The first ``dot_general`` (or
  convolution) that reads a state leaf gives its dimensions a role: *contracted* (summed over, the
  input features of ``Y = X @ W``), *free* (kept in the product, the output features or heads) or
  *stacked* (a ``scan`` over stacked layers, or a batch dimension of the product). This is what
  tells ``(features, heads, head_dim)`` from ``(heads, head_dim, features)`` without guessing;
  the partner's free dimensions are the tokens. State leaves that meet in elementwise ops of one
  shape (a parameter, its gradient's moments in the optimizer state, its update) are *tied*: laid
  out alike, so the optimizer state is read from the step, not assumed.
* **pairs** (:mod:`~dtenjax._src.planning.pairs`) -- the column-parallel / row-parallel pairs of
  Megatron-style tensor parallelism, whose activation between them stays sharded.
* **liveness** (:mod:`~dtenjax._src.planning.liveness`) -- the values the step materialises, from
  their first to their last use: the timeline the memory simulation runs over, and the peak of
  the batch-derived ones (values a ``jax.checkpoint`` recomputes are not live in between, so
  rematerialisation lowers it).
* **stacks** (:mod:`~dtenjax._src.planning.stacks`) -- the state leaves ``lax.scan`` slices one
  layer at a time, by scan length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.planning import gather
from dtenjax._src.planning import jaxpr_reader
from dtenjax._src.planning import liveness
from dtenjax._src.planning import pairs as pairs_mod
from dtenjax._src.planning import stacks
from dtenjax._src.planning.jaxpr_reader import Meeting
from dtenjax._src.planning.jaxpr_reader import WeightUse
from dtenjax._src.planning.liveness import Live
from dtenjax._src.planning.pairs import Pair
from dtenjax._src.planning import sequence as sequence_lib

__all__ = ["Leaf", "Live", "Meeting", "Pair", "StepGraph", "WeightUse", "read_step"]


@dataclasses.dataclass(frozen=True)
class FeatureShardMap:
  """A jax.shard_map of the step (at its top level or in a call) over the user's mesh whose
  operands a tensor pair's cone holds (the hidden activations between a column- and a
  row-parallel product), its in_specs and out_specs splitting their rows. Left free under a plan
  that splits the pair over 'tensor', XLA's partitioner gathered both weights whole and ran the
  products on the user's rows (1231 KiB a device on 8 CPU devices where the plan, pricing the
  result gathered, said 465); with the values pinned to the plan's layout at the boundary
  (``pinned``: plan.jit does, gather.gather_for_compute's ``features``) XLA all-to-alls each of
  them between the plan's split of their features and the user's of their rows (488 KiB;
  docs/benchmarks.md, shmap18c)."""
  order: int                       # its place in jaxpr_reader.call_shard_maps' order
  cone: tuple[int, int]            # the pair's (column-parallel leaf, free dimension)
  dim: int                         # the dimension of its values the pair splits
  ins: tuple[int, ...]             # its operands the cone holds
  outs: tuple[int, ...]            # its results the cone holds
  rows: int                        # the user's blocks of their rows (the specs' split)
  nbytes: int                      # the bytes of those operands and results, whole
  wide: int                        # of them, bfloat16 bytes (jaxpr_reader.wide_bytes)
  shape: tuple[int, ...] = ()      # the first of those operands' (plan.jit finds it by it)
  blocks: tuple[int, ...] = ()     # the user's block of rows on each device, in order

  def pinned(self, sizes, tp: tuple[str, int] | None, rows: Sequence[str]) -> bool:
    """Whether a plan on a mesh of ``sizes`` (axis -> size, 'tensor' the minor axis) that
    splits the batch's rows over ``rows`` and whose column-parallel leaf is laid out as ``tp``
    (pricing.Price.tp) pins the values: where it splits their features over 'tensor' and their
    rows over nothing else than ``rows``, and the user's mesh splits the rows into a block a
    device, in the plan's device order. Each device's block of the user's then lies in its block
    of the plan's rows, and each value is one all-to-all over 'tensor'. Elsewhere (the user's
    blocks coarser: XLA gathers the operands whole, memory the plan does not hold) they are
    left free and priced as the batch's values (pricing.price_layout)."""
    devices = math.prod(sizes.values())
    return (tp == ("col", self.cone[1]) and sizes["tensor"] > 1
            and all(a == "tensor" or a in rows for a, n in sizes.items() if n > 1)
            and self.rows == devices and self.blocks == tuple(range(devices)))


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array argument of the step."""
  index: int                      # position among all flattened argument leaves
  argnum: int
  path: str                       # e.g. "[0]['params']['Dense_0']['kernel']"
  shape: tuple[int, ...]
  dtype: str
  is_batch: bool
  itemsize: int = 4

  @property
  def nbytes(self) -> int:
    if self.itemsize == 1:      # a 4-bit type packs two elements to a byte
      return jaxpr_reader.packed_bytes(math.prod(self.shape), self.dtype)
    return math.prod(self.shape) * self.itemsize

  @property
  def is_key(self) -> bool:
    """A PRNG key (jax.random.key's key<fry>): no gradient to synchronise, and no dtype the
    collectives' prices know."""
    return _is_key(self.dtype)


def _checked_shape(shape, name: str) -> tuple[int, ...]:
  try:
    dims = tuple(operator.index(d) for d in shape)
  except TypeError:
    dims = None
  if dims is None or any(d < 0 for d in dims):
    raise errors.PlacementError(
        f"plan: {name} has shape {tuple(shape)!r}; every dimension must be a non-negative int "
        "(give the concrete shape, e.g. jax.ShapeDtypeStruct((8, 4), jnp.float32), not -1 or "
        "None)")
  return dims


def _numeric(dtype) -> bool:
  """Numbers (bfloat16 and the float8 types included), bools and PRNG keys."""
  try:
    return bool(jax.dtypes.issubdtype(dtype, np.number) or
                jax.dtypes.issubdtype(dtype, np.bool_) or
                jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
  except TypeError:
    return False


def _is_key(dtype_name: str) -> bool:
  try:
    np.dtype(dtype_name)
  except TypeError:   # a PRNG key's name (key<fry>)
    return True
  return False


def is_float(dtype_name: str) -> bool:
  """A floating dtype by name (bfloat16 and the float8 types included; not a PRNG key's)."""
  return not _is_key(dtype_name) and bool(jax.dtypes.issubdtype(dtype_name, np.inexact))


def _dtype_name(dtype) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


@dataclasses.dataclass(frozen=True)
class StepGraph:
  leaves: tuple[Leaf, ...]
  weights: dict[int, WeightUse]
  pairs: tuple[Pair, ...]
  groups: tuple[tuple[int, ...], ...]      # tied state leaves, each group in leaf order
  flops: float                             # all products of one step, global
  activation_bytes: int                    # peak live batch-derived bytes, global
  gathered: frozenset[int]                 # state leaves read by gather (embedding tables)
  outputs: tuple[tuple[tuple[int, ...], str, int | None], ...]   # (shape, dtype, tied leaf)
  num_eqns: int
  out_tree: Any = None                     # the step's output treedef
  # (leaf, free dim) -> flops of activation products that split when that dim is sharded
  carried: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
  # (leaf, free dim) -> the share of activation_bytes sharded with that dim (its pair complete)
  act_share: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
  # gathered leaf -> (the dimensions the gather indexes, e.g. the vocabulary of an embedding
  # table; the bytes of the rows it reads per step, global; the bytes of each gather's rows)
  lookups: dict[int, tuple[tuple[int, ...], int, tuple[int, ...]]] = dataclasses.field(
      default_factory=dict)
  # looked-up leaf -> the dtype of its lookups' rows (a float32 table cast to bfloat16 first:
  # bfloat16), in which its lookup's gradient is made (pricing.gradient_dtype)
  lookup_dtypes: dict[int, str] = dataclasses.field(default_factory=dict)
  # (leaf, free dim)s whose product's output is only reduced over that dim (pairs.reduced_outputs):
  # column-parallel, complete on its own on XLA:CPU (its output stays sharded, its cone in
  # act_share)
  reduced: frozenset[tuple[int, int]] = frozenset()
  # (leaf, free dim)s of a product of a loop's carry in no pair (pairs.loop_split_outputs):
  # column-parallel on XLA:CPU, the loop's stacked residuals stay split over 'tensor' as the
  # carry does (their timeline values name the key among their owners)
  loop_split: frozenset[tuple[int, int]] = frozenset()
  # a top-level loop's equation -> the weights its body reads and makes no gradient of, each
  # with its gathered copies live at the loop (_loop_gathers)
  loop_gathers: dict[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
  # a state leaf a top-level loop's body reads only through lax.stop_gradient taken before the
  # loop (jaxpr_reader.stopped_loop_reads) -> the loops that read it so: each gathers it once
  # more, before the loop (pricing.price_layout; its copies are in loop_gathers)
  stopped_loops: dict[int, int] = dataclasses.field(default_factory=dict)
  # a stacked state leaf a top-level lax.scan slices through lax.stop_gradient and reads in
  # products -> the scans that do: each gathers its layers once more, one an iteration
  # (jaxpr_reader.stopped_scan_slices; pricing.price_layout)
  stopped_scans: dict[int, int] = dataclasses.field(default_factory=dict)
  # of those, a mixture of experts' routers (:func:`_routed_gathers`): (leaf, free dim) -> the
  # global bytes of the routed values XLA:CPU all-gathers over 'tensor' where the router is
  # column-parallel, and of them the bfloat16 values' (moved in float32)
  routed_gathers: dict[tuple[int, int], tuple[float, float]] = dataclasses.field(
      default_factory=dict)
  # the scanned stacks of layers: scan length -> (state leaf -> the leaf dimension the scan
  # slices, the bytes of the forward scan's carry, global); a pipeline's stages split one of them
  stacks: dict[int, tuple[dict[int, int], int]] = dataclasses.field(default_factory=dict)
  # the state leaves one scan slices, a set a scan (stacks.together): the stacks its body reads
  stacked_together: tuple[frozenset[int], ...] = ()

  # products (dot_general, convolutions) run per step, loop trips counted
  products: int = 0
  # bytes the work beside the products moves per step, global (jaxpr_reader.Reader.token_bytes),
  # and (leaf, free dim) -> the share of them in that pair's cone (split with it when complete)
  token_bytes: float = 0.0
  token_share: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)
  # the values the step materialises, in the jaxpr's order (activations, residuals kept for the
  # backward, loop bodies' peaks, gradients): the memory the layout's sizes are simulated over
  timeline: tuple[Live, ...] = ()
  # the batch's sequence dimension and the forward's attentions (planning/sequence.py's Facts;
  # None: no self-attention over a batch dimension)
  sequence: Any = None
  # where the devices meet between the products: the reductions over the batch that later work
  # on the batch reads (batch norm's statistics), all-reduced over the batch axes wherever they
  # split the batch (jaxpr_reader.Meeting), in walk order; and weight leaf -> the flops of the
  # products between the last of them before its first product and that product (global, per
  # step; absent where none comes before it): the compute its FSDP gather waits for
  meetings: tuple[Meeting, ...] = ()
  # the optimizer's update reduces values it computes from the gradients (a global norm):
  # XLA:CPU then reduces the gradients one at a time (liveness.update_reduces)
  update_reduces: bool = False
  # a state leaf's shape -> its gradient's products where more than one (a weight read twice):
  # reduced in one all-reduce where the update reduces the gradients one at a time
  # (liveness.gradient_parts)
  gradient_parts: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
  # state leaf -> the top-level equations that read it, each with whether it is a product
  # (liveness.weight_reads): a gathered copy only the forward's product reads is freed there
  weight_reads: dict[int, tuple[tuple[int, bool], ...]] = dataclasses.field(default_factory=dict)
  # (weight leaf, its dimension split over the batch axes) -> how plan.jit computes its
  # gradient on that shard from activations moved over the batch, where it does: one
  # gather.ShardGradient per product that makes a part of it (gather.shard_gradients)
  shard_gradients: dict[tuple[int, int], tuple[Any, ...]] = dataclasses.field(
      default_factory=dict)
  since_meeting: dict[int, float] = dataclasses.field(default_factory=dict)
  # the index reductions over the batch no later work on the batch reads (an argmax over the
  # batch the step returns): all-gathered over the batch axes, no meeting
  # (jaxpr_reader.Reader.index_gathers)
  index_gathers: tuple[Meeting, ...] = ()
  # the grouped convolutions' inputs that hold the batch: all-gathered whole over the batch axes
  # (jaxpr_reader.Reader.grouped_gathers)
  grouped_gathers: tuple[Meeting, ...] = ()
  # (leaf, free dim) of a tensor pair -> the vectors (biases) applied to its cone's values
  # (pairs.column_vectors): column-parallel, XLA all-gathers their new values over 'tensor'
  column_vectors: dict[tuple[int, int], tuple[int, ...]] = dataclasses.field(
      default_factory=dict)
  # the results a jax.shard_map's out_specs shard over the user's mesh: (bytes of the whole value,
  # the weight whose price holds moving it, the bytes XLA:CPU adds moving it: its bfloat16's, the
  # devices its dimension 0 is split over, the devices it is split over in all, the block of
  # dimension 0 each device holds) (jaxpr_reader.Reader.manual_outputs)
  manual_outputs: tuple[tuple[int, int | None, int, int, int, tuple[int, ...]], ...] = ()
  # a jax.shard_map's operands that hold the batch's dimension 0: (bytes, payer, bfloat16 bytes,
  # the devices its in_specs split dimension 0 over, the blocks)
  # (jaxpr_reader.Reader.manual_operands)
  manual_operands: tuple[tuple[int, int | None, int, int, tuple[int, ...]], ...] = ()
  # the concrete meshes the step's jax.shard_maps run over: (their devices' ids in the mesh's
  # order, the mesh's (axis, size) pairs) (jaxpr_reader.shard_map_meshes)
  manual_meshes: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...] = ()
  # (leaf, free dim) of a tensor pair -> the bytes of the step's outputs in its cone that are no
  # state's new value (a metric per hidden unit): column-parallel, XLA all-gathers them over
  # 'tensor' into the replicated outputs
  cone_outputs: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
  # of those bytes, the bfloat16 outputs' (XLA:CPU gathers them in float32: jaxpr_reader.wide_bytes)
  cone_wide: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
  # the step's shard_maps whose operands a tensor pair's cone holds (FeatureShardMap), and
  # for each entry of manual_outputs and of manual_operands, the index among them of the
  # shard_map whose value the cone holds (None: another value, priced as the batch's)
  manual_features: tuple[FeatureShardMap, ...] = ()
  manual_output_features: tuple[int | None, ...] = ()
  manual_operand_features: tuple[int | None, ...] = ()
  # the state leaves a product reads through lax.stop_gradient -> the bytes of the product's other
  # operand, global (jaxpr_reader.stopped_reads)
  stopped: dict[int, int] = dataclasses.field(default_factory=dict)
  # the positions of the step's outputs computed from the batch (jaxpr_reader.batch_outputs)
  batch_outputs: frozenset[int] = frozenset()
  # the leaves no equation the step's results need reads, nor a result is: jax.jit leaves them
  # out of the program it compiles (keep_unused=False), so they are no argument of it
  unread: frozenset[int] = frozenset()
  # the state leaves no equation reads beside a value computed from the batch
  # (jaxpr_reader.batch_free): a parameter the loss never reads, whose gradient is a constant
  # zero, is neither reduced over the batch axes nor gathered
  batch_free: frozenset[int] = frozenset()
  # the state leaves whose gradient is a constant zero (jaxpr_reader.gradient_free): those of
  # batch_free and a parameter the loss reads only under lax.stop_gradient
  gradient_free: frozenset[int] = frozenset()
  # the weights read in products only in a lax.cond branch other than the one the step is priced
  # on (jaxpr_reader.Reader.aside_only): that branch neither gathers nor reduces them
  aside: frozenset[int] = frozenset()
  # an integer leaf a dequantization reads -> its scales' leaves (None: a scale the step
  # computes; jaxpr_reader.dequantized_leaves)
  dequantized: dict[int, frozenset] = dataclasses.field(default_factory=dict)
  # the integer leaves whose dequantized float value has no gradient: no scale's gradient reads
  # their conversion (jaxpr_reader.untrained_dequantizations)
  untrained: frozenset[int] = frozenset()
  # the group counts of the step's grouped convolutions (jaxpr_reader.convolution_groups): over
  # a 'tensor' size that does not divide one, no weight is split row-parallel (roles/tensor.py's
  # ungrouped), which XLA's partitioner aborts on
  conv_groups: tuple[int, ...] = ()

  def stack(self) -> tuple[int, dict[int, int], int] | None:
    """``(layers, {leaf: sliced dimension}, carry bytes)`` of the scanned stack whose weights do
    the most product flops (the one a pipeline splits into stages), or None without one."""
    return stacks.main(self.stacks, self.weights)

  @functools.cached_property
  def returned(self) -> frozenset[int]:
    """The state leaves the step returns new values of (each an output of the step): the leaves
    of a group that outputs are tied to, matched one output to one leaf of its shape and dtype
    (a leaf the step only reads, tied to the group by the work that reads it -- an EMA compared
    with the parameters -- is no output; where an output tied to the group matches none of its
    leaves, the whole group), or of a group no output is tied to, the whole group where an
    untied output of its first leaf's shape and dtype may be its new value (a dropout key split,
    a recomputed hyperparameter), matched one output to one group. A frozen argument the step
    only reads (LoRA's base weights) is not returned: its bytes are no output of the step."""
    tied: dict[int, list[tuple[tuple[int, ...], str]]] = {}
    untied: dict[tuple[tuple[int, ...], str], int] = {}
    for shape, dtype, rep in self.outputs:
      if rep is None:
        untied[(shape, dtype)] = untied.get((shape, dtype), 0) + 1
      else:
        tied.setdefault(rep, []).append((shape, dtype))
    out: set[int] = set()
    for g in self.groups:
      mine = [o for i in g for o in tied.get(i, ())]
      if mine:
        free = list(g)
        for shape, dtype in mine:
          leaf = next((i for i in free if (self.leaves[i].shape, self.leaves[i].dtype) ==
                       (shape, dtype)), None)
          if leaf is None:
            out.update(g)
            break
          free.remove(leaf)
          out.add(leaf)
        continue
      key = (self.leaves[g[0]].shape, self.leaves[g[0]].dtype)
      if untied.get(key):
        untied[key] -= 1
        out.update(g)
    return frozenset(out)

  def zero_gradient(self, group: Sequence[int]) -> bool:
    """Whether a tied group's gradient is a constant zero XLA never synchronises: a float
    parameter that, with its moments, meets no value computed from the batch (``batch_free``:
    a leaf of the parameters the loss never reads), or a weight only a ``lax.cond``'s branch
    other than the priced one reads (``aside``: that branch returns a zero for it), or an
    integer array no product reads as a float (:meth:`integer_gradient_free`). A step counter
    (an integer scalar) keeps the price of its few bytes the recorded plans hold
    (pricing.price_layout)."""
    return self._constant_zero(group, self.batch_free)

  def no_gradient(self, group: Sequence[int]) -> bool:
    """Whether a tied group has no gradient value the memory holds: its gradient is a constant
    zero XLA fuses into the update (:meth:`zero_gradient`, or a float parameter the loss reads
    only under ``lax.stop_gradient``, which XLA still gathers for the forward, or a weight only
    another ``lax.cond`` branch reads: ``aside``), or an integer array JAX gives none
    (:meth:`integer_gradient_free`)."""
    return self._constant_zero(group, self.gradient_free)

  def _constant_zero(self, group: Sequence[int], free: frozenset[int]) -> bool:
    """:meth:`zero_gradient` and :meth:`no_gradient`, over their sets of free leaves."""
    return (((all(i in free for i in group) or any(i in self.aside for i in group))
             and is_float(self.leaves[group[0]].dtype)) or self.integer_gradient_free(group))

  def read_dequantized(self, index: int) -> bool:
    """Whether leaf ``index`` is stored in fewer bits than the float a product reads it as, and
    priced as its dequantized float (its copy, gather and gradient; integer_gradient_free): an
    integer array, or a float8 / float4 one a dequantization converts and scales
    (jaxpr_reader.is_quantized_dtype; ``wq.astype(f32) * scale`` of a float8_e4m3fn weight:
    XLA:CPU's temp holds the f32 copy, f32[512,256] on `data` 8, as for int8). A float8 weight
    only cast (``w.astype(bf16)``, trained) is a float weight read narrower or wider: gathered
    in its own dtype (tests/test_costmodel_wire.py)."""
    lf = self.leaves[index]
    return not lf.is_key and (not is_float(lf.dtype) or index in self.dequantized)

  def integer_gradient_free(self, group: Sequence[int]) -> bool:
    """Whether a tied group is of integer arrays XLA reduces nothing of: JAX's gradient of an
    integer is float0, nothing XLA computes, so what it all-reduces over the batch axes is
    either a product's float gradient, where one reads the array dequantized
    (``wq.astype(f32) * scale``: jaxpr_reader.dequantization_scales, priced as the float
    gradient it is, ``WeightUse.read_dtype``), or the array's new value where the step computes
    it from the batch (a histogram of the tokens: the scatter's int32 ``[4096]`` all-reduced,
    compiled on 8 CPU devices, `data` 8; priced at its bytes as before). Neither: nothing (an
    int32 ``[4096]`` the step adds one to: no collective compiled). A scalar, a step counter,
    is left as the recorded plans price it (its 4 bytes' share of the combined all-reduce:
    dropping it moves the GPU clusters' pinned costs by 1e-10); a group no output is tied to
    is not judged. A dequantized array whose every scale is a leaf of a frozen group (a frozen
    quantized weight and its scale, returned unchanged) has no float gradient either: JAX makes
    the product's gradient only for a trained scale's (review19b: f32[512,256] priced
    all-reduced on `data` 8 where XLA compiled none); nor has one whose conversion no scale's
    gradient reads (:attr:`untrained`: the scale passed in and not returned). An integer array
    the step returns no new value of (:attr:`returned`) has nothing reduced: an int8 embedding
    table passed in, looked up and dequantized per row (`data` 8: its 1 MiB priced all-reduced,
    none compiled)."""
    lf = self.leaves[group[0]]
    if lf.is_key or not lf.shape or not all(self.read_dequantized(i) for i in group):
      return False
    if is_float(lf.dtype) and not self.frozen(group):
      return False       # a float8 weight the step trains: its own gradient, as a float's
    if any(is_float(self.weights[i].read_dtype) for i in group
           if i in self.weights and self.weights[i].read_dtype):
      if all(i in self.untrained for i in group):
        return True
      scales = [k for i in group for k in self.dequantized.get(i, (None,))]
      if any(k is None or not self.frozen(self.group_of(k)) for k in scales):
        return False
    if not any(i in self.returned for i in group):
      return True        # no new value (an int8 embedding table the step only looks up)
    outs = [k for k, (_, _, rep) in enumerate(self.outputs) if rep == group[0]]
    return bool(outs) and not any(k in self.batch_outputs for k in outs)

  def frozen(self, group: Sequence[int]) -> bool:
    """Whether the step returns new values of a float group and computes none of them from the
    batch (a parameter optax.set_to_zero freezes: its new value is the old one plus zeros): XLA
    reduces no gradient of it over the batch axes, though it still gathers it where a product
    reads it. A group no output is tied to is not judged (its new value may be made where the
    ties are not followed), unless the step returns none of its leaves (:attr:`returned`, which
    matches untied outputs by shape and dtype): a frozen backbone passed as an argument the step
    only reads (QLoRA's float base beside its int8 weights: JAX differentiates only the adapter,
    and XLA reduced nothing of the base's f32[256,128] on `data` 8 where it was priced
    all-reduced, +537 %)."""
    if not is_float(self.leaves[group[0]].dtype):
      return False
    if not any(i in self.returned for i in group):
      return True
    outs = [k for k, (_, _, rep) in enumerate(self.outputs) if rep == group[0]]
    return bool(outs) and not any(k in self.batch_outputs for k in outs)

  def group_of(self, leaf: int) -> tuple[int, ...]:
    for g in self.groups:
      if leaf in g:
        return g
    return (leaf,)


def scalar_struct(leaf):
  """A Python scalar leaf as the weakly typed 0-d array ``jax.jit`` traces it as (flax's
  ``TrainState.create`` sets ``step=0``, an int); any other leaf as it is."""
  if isinstance(leaf, (bool, int, float, complex)):
    return jax.ShapeDtypeStruct((), jnp.asarray(leaf).dtype, weak_type=True)
  return leaf


def abstract(args: Sequence[Any]) -> list[Any]:
  """The step's arguments as ``jax.ShapeDtypeStruct`` pytrees, as ``jax.jit`` traces them."""
  def one(a):
    s = scalar_struct(a)
    return s if s is not a else jax.ShapeDtypeStruct(a.shape, a.dtype)
  return [jax.tree.map(one, arg) for arg in args]


def read_step(fn, args: Sequence[Any], batch_argnums: Sequence[int]) -> StepGraph:
  """Traces ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``s) and reads its jaxpr. The
  branches of its conds the reader chooses hold for this read only
  (:func:`jaxpr_reader.chosen_branches`): pairs, liveness and the graph below read them."""
  with jaxpr_reader.chosen_branches():
    return _read_step(fn, args, batch_argnums)


def _read_step(fn, args: Sequence[Any], batch_argnums: Sequence[int]) -> StepGraph:
  batch_argnums = tuple(batch_argnums)
  flat = []
  for argnum, arg in enumerate(args):
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      flat.append((argnum, path, scalar_struct(leaf)))
  leaves = []
  for i, (argnum, path, leaf) in enumerate(flat):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise errors.PlacementError(
          f"plan: argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'} is "
          f"{type(leaf).__name__}, not an array; pass arrays or jax.ShapeDtypeStruct leaves "
          "(static values belong in functools.partial)")
    name = f"argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'}"
    shape = _checked_shape(leaf.shape, name)
    if not _numeric(leaf.dtype):
      raise errors.PlacementError(
          f"plan: {name} has dtype {leaf.dtype}, which is not an array type JAX computes with; "
          "pass numeric, bool or PRNG key arrays (or jax.ShapeDtypeStruct leaves); strings and "
          "Python objects belong in functools.partial, outside the step's arguments")
    leaves.append(Leaf(i, argnum, f"[{argnum}]{jax.tree_util.keystr(path)}",
                       shape, _dtype_name(leaf.dtype),
                       argnum in batch_argnums, jaxpr_reader.itemsize(leaf.dtype)))
  try:
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract(args))
  except errors.DtenjaxError:
    raise
  except Exception as e:  # the user's step failed to trace
    raise errors.PlacementError(
        f"plan: the step could not be traced with the example arguments' shapes: "
        f"{type(e).__name__}: {e}") from e
  # optax's jit(inline=True) helpers are calls in jax 0.11's jaxpr, inlined in jax 0.10's and in
  # the HLO of both: read the jaxpr XLA compiles (a call's results were materialised values).
  # The sequence's facts are read from the jaxpr as traced: from the inlined one, under jax 0.11,
  # they counted 4x the attention calls of tests/test_step_planner_sequence.py (not analysed).
  # a fully unrolled scan (fori_loop(..., unroll=True)) is read as the loop XLA writes out
  jaxpr = jaxpr_reader.unroll_loops(jaxapi.inline_calls(closed)).jaxpr
  if len(jaxpr.invars) != len(leaves):
    raise errors.PlacementError(
        f"plan: the step's jaxpr has {len(jaxpr.invars)} inputs for {len(leaves)} argument "
        "leaves; pass every argument positionally")
  reader = jaxpr_reader.Reader(leaves)
  origin, tie = {}, {}
  for leaf, var in zip(leaves, jaxpr.invars):
    if not leaf.is_batch:
      origin[var] = (leaf.index, tuple(range(len(leaf.shape))))
      tie[var] = leaf.index
  for leaf, var in zip(leaves, jaxpr.invars):
    if leaf.is_batch and leaf.shape:
      reader.batch[var] = frozenset((0,))
  reader.walk(jaxpr, origin, tie, 1)
  meetings = reader.meetings()
  pairs, carried, cones = pairs_mod.find_pairs(reader)
  reduced = pairs_mod.reduced_outputs(reader, pairs)
  shard_maps = jaxpr_reader.call_shard_maps(jaxpr)
  features = _feature_shard_maps([e for e, _ in shard_maps], leaves, cones)
  feature_of = {}                 # (shard_map, value) ids -> its FeatureShardMap's index
  for k, f in enumerate(features):
    eqn = shard_maps[f.order][0]
    for v in [eqn.invars[i] for i in f.ins] + [eqn.outvars[i] for i in f.outs]:
      feature_of[(id(eqn), id(v))] = k
  weights = {}
  readers: dict[Any, int] = {}
  for v in reader.partner.values():
    readers[v] = readers.get(v, 0) + 1
  products = _top_products(jaxpr)
  loop_product_sizes = _loop_product_sizes(jaxpr, False)
  bodies: dict[int, dict[Any, list[tuple[Any, bool]]]] = {}   # a loop body's _top_products
  for leaf, use in reader.weights.items():
    shape = leaves[leaf].shape
    # a gradient's product has the weight's shape (or its transpose): it splits like the reads
    has_grad = (shape in reader.shape_flops or tuple(reversed(shape)) in reader.shape_flops)
    reads = reader.leaf_flops.get(leaf, 0.0)
    parts = _grad_parts(use, reader.leaf_reads.get(leaf, 1), leaf in reader.remat_read,
                        reader.free_reads.get(leaf, 0))
    if leaf not in reader.remat_read:
      parts = max(1, parts - _dropped_parts(reader, leaf, products))
    loop_uses, loop_parts = _loop_parts(use, reader.loop_reads.get(leaf, (0, 0)),
                                        leaf in reader.remat_read)
    if loop_uses and math.prod(shape) not in loop_product_sizes:
      # no loop's body makes a product of the weight's size: its loops read it in the forward
      # alone (a perturbation's loop outside the step's gradient), and none makes a part of
      # its gradient
      loop_uses = loop_parts = 0
    if leaf not in reader.remat_read and loop_uses:
      dropped, trips = _dropped_loop_parts(reader, leaf, bodies)
      if dropped:
        parts = max(1, parts - dropped)
        loop_uses, loop_parts = max(0, loop_uses - dropped), max(0, loop_parts - trips)
        loop_parts *= bool(loop_uses)
    # the partner made from state leaves needs an input gradient only where one of them is
    # differentiated: a weight read by one product outside jax.checkpoint (no input gradient's
    # product reads it) has none (an int8 table's rows dequantized by a frozen per-row scale:
    # JAX makes no gradient of them, and a column-parallel weight's all-reduce of it over
    # 'tensor', 0.25 MiB on `fsdp` 4 x `tensor` 2, was priced where XLA runs none)
    # (not in a lax.cond's branch: the backward's conditional is read on its priced branch only;
    # not a convolution's kernel: JAX's input gradient reads it reversed, ``rev(w)``, which the
    # reader does not count as a read of the leaf, so a second conv layer looked read once)
    once = (reader.leaf_reads.get(leaf, 1) == 1 and leaf not in reader.remat_read and
            not use.branched and use.primitive == "dot_general")
    weights[leaf] = dataclasses.replace(use, flops=reads * (1.5 if has_grad else 1.0),
                                        input_grad=use.input_grad and not once,
                                        remat=leaf in reader.remat_read,
                                        recomputed_loop=leaf in reader.remat_loop_read,
                                        forward_reads=pairs_mod.forward_reads(reader, leaf),
                                        siblings=readers.get(reader.partner.get(leaf), 1),
                                        grad_parts=parts, loop_uses=loop_uses,
                                        loop_parts=loop_parts)
  weights = _loop_shares(weights, reader.loop_of, leaves)
  stopped_loops = jaxpr_reader.stopped_loop_reads(jaxpr, leaves)
  loop_gathers = _loop_gathers(jaxpr, reader, weights, stopped_loops)
  groups: dict[int, list[int]] = {}
  for leaf in leaves:
    if not leaf.is_batch:
      groups.setdefault(reader.ties.find(leaf.index), []).append(leaf.index)
  batch_carried = frozenset(v for v, dims in reader.batch.items() if dims)
  loop_split = pairs_mod.loop_split_outputs(reader, pairs, reduced)
  act, act_share, timeline = liveness.activations(jaxpr, leaves, {**cones, **reduced},
                                                  batch_carried, loop_split)
  read = jaxpr_reader.needed_vars(jaxpr)
  outputs = []
  for v in jaxpr.outvars:
    aval = v.aval
    # the walk's ties of the top level: which state leaf group each output updates
    rep = reader.ties.find(tie[v]) if jaxpr_reader.is_var(v) and v in tie else None
    outputs.append((tuple(int(s) for s in aval.shape), _dtype_name(aval.dtype), rep))
  parts = liveness.gradient_parts(jaxpr, leaves)
  return StepGraph(leaves=tuple(leaves), weights=weights, pairs=pairs,
                   groups=tuple(tuple(g) for g in groups.values()), flops=reader.flops,
                   activation_bytes=act, gathered=frozenset(reader.gathered),
                   outputs=tuple(outputs), num_eqns=reader.eqn_count,
                   out_tree=jax.tree.structure(out_shape), carried=carried,
                   act_share=act_share, lookups=dict(reader.lookups),
                   lookup_dtypes=dict(reader.lookup_dtypes),
                   reduced=frozenset(reduced), loop_split=frozenset(loop_split),
                   loop_gathers=loop_gathers,
                   stopped_loops=_count_loops(stopped_loops),
                   stopped_scans=jaxpr_reader.stopped_scan_slices(jaxpr, leaves),
                   routed_gathers=_routed_gathers(reader, reduced, leaves),
                   stacks=stacks.read(reader.scans), stacked_together=stacks.together(reader.scans),
                   timeline=timeline,
                   products=reader.products, token_bytes=reader.token_bytes,
                   token_share=_token_share(reader, {**cones, **reduced}),
                   sequence=sequence_lib.read(closed.jaxpr, leaves),
                   update_reduces=liveness.update_reduces(jaxpr, leaves, batch_carried),
                   gradient_parts=parts,
                   weight_reads=liveness.weight_reads(jaxpr, leaves),
                   shard_gradients=_shard_gradients(closed.jaxpr, leaves, groups, weights, parts),
                   meetings=tuple(meetings), since_meeting=reader.since_meeting(meetings),
                   index_gathers=tuple(reader.index_gathers({**cones, **reduced})),
                   grouped_gathers=tuple(reader.grouped_gathers()),
                   column_vectors=pairs_mod.column_vectors(reader, jaxpr.invars, cones),
                   unread=frozenset(leaf.index for leaf, v in zip(leaves, jaxpr.invars)
                                    if v not in read),
                   batch_free=jaxpr_reader.batch_free(jaxpr, leaves),
                   gradient_free=jaxpr_reader.gradient_free(jaxpr, leaves),
                   dequantized=jaxpr_reader.dequantized_leaves(jaxpr),
                   untrained=jaxpr_reader.untrained_dequantizations(jaxpr),
                   conv_groups=jaxpr_reader.convolution_groups(jaxpr),
                   aside=reader.aside_only(),
                   batch_outputs=jaxpr_reader.batch_outputs(jaxpr, leaves),
                   manual_outputs=tuple(reader.manual_outputs()),
                   manual_operands=tuple(reader.manual_operands()),
                   manual_meshes=tuple(jaxpr_reader.shard_map_meshes(jaxpr).items()),
                   manual_features=features,
                   manual_output_features=tuple(feature_of.get((id(e), id(v)))
                                                for e, v in reader.manual_eqns),
                   manual_operand_features=tuple(feature_of.get((id(e), id(v)))
                                                 for e, v in reader.manual_in_eqns),
                   stopped=jaxpr_reader.stopped_reads(jaxpr, leaves),
                   cone_outputs=_cone_outputs(jaxpr, tie, cones),
                   cone_wide=_cone_outputs(jaxpr, tie, cones, jaxpr_reader.wide_bytes))


def _shard_gradients(jaxpr, leaves, groups: dict, weights: dict,
                     parts: dict[tuple[int, ...], int]) -> dict[tuple[int, int], tuple]:
  """StepGraph.shard_gradients: gather.shard_gradients' weights whose gradient moves the
  activations (each part's ShardGradient), where every weight the step's products read has
  its gradient's products followed (each group that holds a weight), as many as its shape has
  parts (``parts``, liveness.gradient_parts: a weight read again through a transpose,
  ``h @ w.T``, has a second part gather.py does not follow, made whole). Where some weight's
  gradient is no followed product (a weight read in a loop, scaled on its way to its product,
  read again transposed), XLA:CPU's combined all-reduce of the whole gradients remains, and
  beside it the moved program held memory the model does not follow (a scaled first layer on
  `fsdp` 8: 0.50 MiB of temp compiled where 0.75 was priced; a weight in a lax.fori_loop: 0.32
  MiB compiled, 0.29 priced): none moves. Not so a stack a lax.scan slices
  (:func:`_scanned_stack`): its gradient is made a layer at a time in the backward's loop body
  and reduced there, never in the combined all-reduce, and XLA's partitioner moves the other
  weights beside it for the plain FSDP jit (an MLP then tanh(h @ w) scanned over a replicated
  [4, 128, 128] stack on `fsdp` 8 under sgd: w1's gradient made on its shard, each layer's
  all-reduced in the loop, its compiled HLO; plan.jit with every gradient whole compiled 1.33x
  its memory in float32, 1.15x in bfloat16, moved 1.04x / 0.97x, docs/benchmarks.md scan22).
  Nor a first layer's weight whose product lies in a
  jax.checkpoint call (:func:`_checkpointed_first`; not a later layer's): its whole gradient,
  made in the backward's call, is reduced and the followed weights move beside it, as XLA's
  partitioner moves them (remat_first on `fsdp` 8 at batch 64: 0.90 MiB, priced 0.93, against
  the plain jit's 1.14; docs/benchmarks.md fsdp20). A followed weight whose cotangents are the
  larger (moves_activations, part by part) keeps its reduction beside the others' moves, as
  XLA's partitioner does for the plain FSDP step (review19b: the MLP at batch 136 on `fsdp` 8,
  w2 moved and w1 reduced, 0.94 MiB as priced against the plain jit's 1.04; with neither moved
  1.41; a weight read by two products, two_views at batch 256: w2's two parts moved and w1's
  reduced, 1.42 MiB against the plain jit's 1.97)."""
  followed = gather.shard_gradients(jaxpr)
  # (not a product the step's results do not need: a gradient the step computes and drops,
  # which XLA removes, _dropped_parts)
  needed = jaxpr_reader.needed_equations(jaxpr)
  followed = {key: kept for key, found in followed.items()
              if (kept := tuple((n, how) for n, how in found
                                if not isinstance(n, int) or id(jaxpr.eqns[n]) in needed))}
  weighed = {k for k, _ in followed}
  for group in groups.values():
    if (any(k in weights and not leaves[k].is_batch and not _checkpointed_first(weights[k])
            and not _scanned_stack(weights[k]) for k in group)
        and not any(k in weighed for k in group)):
      return {}
  if any(len(found) < parts.get(leaves[k].shape, 1) for (k, _), found in followed.items()):
    return {}
  return {key: tuple(how for _, how in _one_branch(found)) for key, found in followed.items()
          if found[0][1].moves}


def _scanned_stack(use) -> bool:
  """Whether ``use`` is a stack a ``lax.scan`` slices (WeightUse.layers), not a weight a loop
  reads whole (WeightUse.loop_uses), whose gradient the loop accumulates whole."""
  return use.layers > 1 and not use.loop_uses


def _one_branch(found: tuple) -> tuple:
  """Of a weight's gradient parts (gather.shard_gradients: (path, how)), those one run of the
  step makes: a part in a ``lax.cond``'s branch beside one in another branch of the same
  conditional (a weight both branches read, gated_head's w2) is the other's alternative, and
  XLA runs one branch's all-to-all and gather, not both (plan.check counts the priced branch's
  collectives; priced twice, all-to-all +100 %)."""
  kept: list = []
  for where, how in found:
    steps = (where,) if isinstance(where, int) else where
    if not any(_apart(steps, (w,) if isinstance(w, int) else w) for w, _ in kept):
      kept.append((where, how))
  return tuple(kept)


def _apart(a: tuple, b: tuple) -> bool:
  """Whether two paths (gather._eqn_at's) part in two branches of one conditional."""
  for x, y in zip(a, b):
    if x == y:
      continue
    return (isinstance(x, tuple) and isinstance(y, tuple) and x[0] == y[0])
  return False


def _checkpointed_first(use) -> bool:
  """Whether ``use`` is a first layer's weight under jax.checkpoint (WeightUse.remat, and no
  input gradient reads it), beside which the followed weights move (:func:`_shard_gradients`).
  A later layer's weight under checkpoint is not: beside a checkpointed second layer
  (``h @ w2`` in the call) plan.jit's program reduced w1's whole gradient where w1 was priced
  moved, and XLA's partitioner made w2's on its shard in the call, holding w1's gathered copy
  at the reduction: on `fsdp` 8 at batch 64 priced 0.90 MiB, compiled 1.03 (-12.6 %, review20a).
  Such a weight's gradient product is followed into the call instead (gather.shard_gradients,
  fsdp21) and made on its shard there by plan.jit itself: 0.90 MiB, priced within 0.3 %."""
  return use.remat and not use.input_grad


def _feature_shard_maps(shard_maps, leaves, cones) -> tuple[FeatureShardMap, ...]:
  """Of ``shard_maps`` (jaxpr_reader.call_shard_maps' equations, in order), those whose
  operands a tensor pair's cone holds (FeatureShardMap), where the specs of those values and of
  its results the cone holds split only their rows, all into one number of blocks, and the
  values hold the pair's free dimension (their features) in another."""
  found = []
  for order, eqn in enumerate(shard_maps):
    sizes = dict(getattr(eqn.params.get("mesh"), "shape", {}) or {})
    sides = ((eqn.invars, eqn.params.get("in_specs", ())),
             (eqn.outvars, eqn.params.get("out_specs", ())))
    for key in sorted(cones):
      cone = cones[key]
      width = leaves[key[0]].shape[key[1]]
      held = [[i for i, v in enumerate(vs) if jaxpr_reader.is_var(v) and v in cone]
              for vs, _ in sides]
      if not held[0]:
        continue
      values = [(sides[s][0][i], tuple(sides[s][1][i])) for s in (0, 1) for i in held[s]]
      splits = {math.prod(sizes.get(a, 1) for a in jaxpr_reader.spec_axes(spec[0]))
                if spec else 1 for _, spec in values}
      dims = {max((d for d, n in enumerate(v.aval.shape) if d and n == width), default=None)
              for v, _ in values}
      if (len(splits) != 1 or len(dims) != 1 or None in dims or 1 in splits
          or any(e is not None for _, spec in values for e in spec[1:])):
        continue
      found.append(FeatureShardMap(
          order=order, cone=key, dim=dims.pop(), ins=tuple(held[0]), outs=tuple(held[1]),
          rows=splits.pop(), nbytes=sum(jaxpr_reader.nbytes(v.aval) for v, _ in values),
          wide=sum(jaxpr_reader.wide_bytes(v.aval) for v, _ in values),
          shape=tuple(int(n) for n in values[0][0].aval.shape),
          blocks=jaxpr_reader.manual_blocks(sizes, jaxpr_reader.spec_axes(values[0][1][0]))))
      break
  return tuple(found)


def _cone_outputs(jaxpr, tie: dict, cones: dict[tuple[int, int], set[Any]],
                  size=jaxpr_reader.nbytes) -> dict[tuple[int, int], int]:
  """(leaf, free dim) -> the bytes (``size``) of the step's results in that pair's cone that are
  tied to no state leaf (a state's new value is priced with its group: pricing's column
  vectors)."""
  out: dict[tuple[int, int], int] = {}
  for v in jaxpr.outvars:
    if not jaxpr_reader.is_var(v) or v in tie:
      continue
    key = next((k for k in sorted(cones) if v in cones[k]), None)
    if key is not None:
      out[key] = out.get(key, 0) + size(v.aval)
  return out


def _token_share(reader: jaxpr_reader.Reader, cones) -> dict[tuple[int, int], float]:
  """Each pair's share of the work beside the products (``Reader.token_bytes``): the bytes of
  the equations whose results lie in its cone (a result in several cones split among them)."""
  return liveness.cone_shares(cones, reader.token_of, reader.token_bytes)


def _grad_parts(use: WeightUse, reads: int, remat: bool, free: int = 0) -> int:
  """How many times a weight is used per step, hence how many gradient parts XLA reduces before
  adding them (weights shared across layers): each use reads it in the forward product, again in
  the input gradient's product (when that is needed) and once more where jax.checkpoint
  recomputes the forward. A scanned stack's layers are one use (accumulated in the loop).
  Without jax.checkpoint, the ``free`` reads (Reader.free_reads: the other operand no state
  leaf made) need no input gradient and the others one each, so a weight read first from the
  batch's input and again from its own outputs (``tanh(h @ w)`` three times) has one part per
  forward read (review19b: three on `data` 8, as XLA:CPU all-reduces them; five were priced
  from the first read's use)."""
  if use.layers > 1:
    return 1
  if not remat:
    return max(1, free + (reads - free) // 2)
  per_use = 1 + int(use.input_grad) + int(remat)
  return max(1, reads // per_use)


def _loop_product_sizes(jaxpr, in_loop: bool) -> set[int]:
  """The sizes (elements) of the products' results (dot_general, conv_general_dilated) inside
  loops' bodies anywhere in ``jaxpr`` (``in_loop``: ``jaxpr`` is one). A weight's gradient part
  made in a loop (a trained ``fori_loop``'s backward, a micro-batch accumulation's) is such a
  product of its size; a loop whose bodies make none of it makes no part of its gradient."""
  out: set[int] = set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if in_loop and name in ("dot_general", "conv_general_dilated"):
      out.add(math.prod(eqn.outvars[0].aval.shape))
    for sub, _ in jaxpr_reader.sub_jaxprs(eqn):
      out |= _loop_product_sizes(sub, in_loop or name in ("scan", "while"))
    if name == "cond":
      for b in eqn.params["branches"]:
        out |= _loop_product_sizes(b.jaxpr, in_loop)
  return out


def _top_products(jaxpr) -> dict[Any, list[tuple[Any, bool]]]:
  """Each variable of ``jaxpr``'s top level -> the dot_generals there that read it, each with
  whether the step's results need it (XLA removes the others)."""
  needed = jaxpr_reader.needed_equations(jaxpr)
  out: dict[Any, list[tuple[Any, bool]]] = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      for v in eqn.invars:
        if jaxpr_reader.is_var(v):
          out.setdefault(v, []).append((eqn, id(eqn) in needed))
  return out


def _dropped_parts(reader, leaf: int, products: dict[Any, list[tuple[Any, bool]]]) -> int:
  """The gradient parts of a weight that the step computes and drops (0 where none is seen).
  JAX's gradient of a forward product ``a @ w`` with respect to ``w`` is a product of ``a``
  itself (its residual) with the output's cotangent, of ``w``'s size (then transposed to its
  shape). A gradient the step drops (``jax.grad(loss, argnums=(0, 1))`` keeping only the input's
  gradient: adversarial training's perturbation) leaves the reads of the weight as they are
  (forward and input gradient), which :func:`_grad_parts` counts parts from, but XLA removes
  its product and reduces nothing for it. Counted where a forward read's residual is read by a
  product of the weight's size that the results do not need and by none they need; for
  dot_generals of the top level only (a body's residuals are other variables)."""
  reads = reader.reads.get(leaf, ())
  if not reads or any(frames for *_, frames in reads):
    return 0
  size = math.prod(reader.leaves[leaf].shape)
  contracted = set(reader.weights[leaf].contracted)
  n = 0
  for eqn, side, dims, _ in reads:
    (lc, rc), _ = eqn.params["dimension_numbers"]
    if {dims[d] for d in (lc if side == 0 else rc) if dims[d] is not None} != contracted:
      continue                   # an input gradient's product: it contracts the free dimensions
    grads = [needed for e, needed in products.get(eqn.invars[1 - side], ())
             if e is not eqn and math.prod(e.outvars[0].aval.shape) == size]
    n += bool(grads) and not any(grads)
  return n


def _dropped_loop_parts(reader, leaf: int, bodies: dict[int, dict[Any, list[tuple[Any, bool]]]]
                        ) -> tuple[int, int]:
  """:func:`_dropped_parts` of a weight's reads inside ``lax.scan`` bodies (a ``fori_loop`` of
  static bounds is one): (the uses whose gradient the body computes and drops, their trips).
  A gradient taken inside a loop's body and dropped there (FGSM's ``jax.grad(mse,
  argnums=(0, 1))`` in a ``fori_loop``, keeping the input's gradient) leaves the body's forward
  and input-gradient products, which :func:`_loop_parts` counts a use from, but XLA removes the
  weight-gradient product from the body (dead there) and all-reduces nothing in the loop
  (compiled on 8 CPU devices, a loop of 2 on `data` 8: 0.50 MiB of all-reduce, the step's own
  gradients, where 1.25 was priced, tensor22). ``bodies`` caches each body's products."""
  dropped = trips = 0
  size = math.prod(reader.leaves[leaf].shape)
  contracted = set(reader.weights[leaf].contracted)
  for eqn, side, dims, frames in reader.reads.get(leaf, ()):
    if not frames or any(e.primitive.name != "scan" for e, _ in frames):
      continue
    (lc, rc), _ = eqn.params["dimension_numbers"]
    if {dims[d] for d in (lc if side == 0 else rc) if dims[d] is not None} != contracted:
      continue                   # an input gradient's product: it contracts the free dimensions
    body = frames[-1][1]
    if id(body) not in bodies:
      bodies[id(body)] = _top_products(body)
    grads = [needed for e, needed in bodies[id(body)].get(eqn.invars[1 - side], ())
             if e is not eqn and math.prod(e.outvars[0].aval.shape) == size]
    if grads and not any(grads):
      dropped += 1
      trips += math.prod(int(e.params["length"]) for e, _ in frames)
  return dropped, trips


def _loop_gathers(jaxpr, reader, weights: dict[int, WeightUse],
                  stopped: dict[int, tuple[int, ...]]) -> dict[int, tuple[tuple[int, int], ...]]:
  """Each top-level loop whose body reads weights it makes no gradient of (a perturbation's
  ``fori_loop``, whose gradient with respect to the weights is dropped: no part there,
  :func:`_dropped_loop_parts`) -> (leaf, copies) of those weights. Gathered per use (a batch
  axis shards them), XLA:CPU gathers each once before the loop, a loop invariant the while
  takes as an operand and holds to its end; the step's own gathers of a weight read outside the
  loop too do not wait for the loop and are made before it as well, so such a weight has two
  gathered copies live at the loop (XLA:CPU's buffer assignments of iterated FGSM on `fsdp` 8,
  w1 [128, 512] and w2 [512, 128], a loop of 2 at batch 64 and 256 and of 3 with [128, 256]
  and [256, 128]: the four gathered weights at four offsets of the temp, live together;
  tensor22). So for a loop whose body reads weights only through ``lax.stop_gradient``
  (``stopped``, :func:`jaxpr_reader.stopped_loop_reads`: a forward-only perturbation before
  the step's gradient), which the walk does not count as its reads: two copies of each weight
  the step reads outside the loop too, one of a weight it does not (loop27)."""
  index = {id(e): i for i, e in enumerate(jaxpr.eqns)}
  out: dict[int, list[tuple[int, int]]] = {}
  for leaf, use in sorted(weights.items()):
    loop = reader.loop_of.get(leaf)
    if (loop is None or id(loop) not in index or use.layers != 1 or use.loop_parts or
        not reader.loop_reads.get(leaf, (0, 0))[0]):
      continue
    outside = any(not frames for *_, frames in reader.reads.get(leaf, ()))
    out.setdefault(index[id(loop)], []).append((leaf, 2 if outside else 1))
  for at, leaves in stopped.items():
    for leaf in leaves:
      if all(leaf != seen for seen, _ in out.get(at, ())):
        out.setdefault(at, []).append((leaf, 2 if leaf in reader.leaf_reads else 1))
  return {k: tuple(v) for k, v in sorted(out.items())}


def _count_loops(stopped: dict[int, tuple[int, ...]]) -> dict[int, int]:
  """A leaf -> the loops of ``stopped`` (:func:`jaxpr_reader.stopped_loop_reads`) that read it."""
  out: dict[int, int] = {}
  for leaves in stopped.values():
    for leaf in leaves:
      out[leaf] = out.get(leaf, 0) + 1
  return out


def _loop_parts(use: WeightUse, loop_reads: tuple[int, int], remat: bool) -> tuple[int, int]:
  """(uses, gradient parts per step) of a weight inside loops' bodies, from ``loop_reads``
  (its products there, and those times their trip counts): each use reads it as
  :func:`_grad_parts` counts, and runs once per iteration. Not the first read's trip count times
  every use: a weight read by a fori_loop of 3 and once outside it has 3 + 1 gradient parts
  (compiled on 8 CPU devices, `data` 8: 3 all-reduces of it in the backward's loop body, one in
  the combined all-reduce after it), whichever read comes first. A scanned stack's layers are
  one use (accumulated in the loop): none."""
  if use.layers > 1 or not loop_reads[0]:
    return 0, 0
  per_use = 1 + int(use.input_grad) + int(remat)
  return max(1, loop_reads[0] // per_use), max(1, loop_reads[1] // per_use)


def _loop_shares(weights: dict[int, WeightUse], loop_of: dict[int, Any],
                 leaves: Sequence[Leaf]) -> dict[int, WeightUse]:
  """``weights`` with each loop weight's ``loop_share``: its gradient's bytes (of the dtype its
  product reads it in) over those of every weight whose parts are reduced in the same loop's
  body (``loop_of``: the loop its first in-loop product runs in). XLA:CPU joins those weights'
  gradients in one all-reduce per iteration (two weights of f32[128,128] read in a fori_loop of
  3, `data` 8: three all-reduces of both, compiled on 8 CPU devices), so each iteration pays one
  collective's latency for the body, not one per weight (tests/test_costmodel_wire.py)."""
  def grad_bytes(leaf: int) -> float:
    lf, read = leaves[leaf], weights[leaf].read_dtype
    return math.prod(lf.shape) * jaxpr_reader.itemsize(read) if read else lf.nbytes
  body_of = {leaf: id(loop_of[leaf]) for leaf, use in weights.items()
             if use.loop_parts and use.layers == 1 and loop_of.get(leaf) is not None}
  joined: dict[int, float] = {}
  for leaf, body in body_of.items():
    joined[body] = joined.get(body, 0.0) + grad_bytes(leaf)
  out = dict(weights)
  for leaf, body in body_of.items():
    if joined[body] > 0:
      out[leaf] = dataclasses.replace(weights[leaf], loop_share=grad_bytes(leaf) / joined[body])
  return out


def _routed_gathers(reader, reduced, leaves: Sequence[Leaf]
                    ) -> dict[tuple[int, int], tuple[float, float]]:
  """A mixture of experts' routers among the ``reduced`` outputs (a product whose output every
  path reduces over a free dimension: the router's logits into the softmax and argmax over the
  experts) -> the global bytes of the routed values XLA:CPU all-gathers over 'tensor' where the
  router is column-parallel, and of them the bfloat16 values'. A router is a product whose free
  dimension has an expert weight's expert count (a weight its product batches over one
  dimension, not a scanned stack's layer); its experts are the expert weights whose first
  products follow its own, before the next router's. XLA keeps the experts' split of the gates
  and of the one-hot masks made beside them, and all-gathers over 'tensor' what the expert
  layout needs whole (compiled: bench/_families.py's moe on `expert` 4 x `tensor` 2, router
  P(None, 'tensor'), per layer and device): the tokens dispatched to the first expert weight
  (``[E, b, C, d]``, 512 KiB) and the mask that dispatched them (``[b, s, E, C]``, 128 KiB) in
  the forward, and the gradient of the last expert weight's output (``[E, b, C, d]``, 512 KiB)
  in the backward; the argmax's partials (2 x 2 KiB) are left out. Where the router is
  replicated none of them moves."""
  experts = {leaf: leaves[leaf].shape[use.stacked[0]] for leaf, use in reader.weights.items()
             if use.primitive == "dot_general" and use.layers == 1 and len(use.stacked) == 1}
  routers = sorted(((reader.first_order.get(leaf, 0), leaf, k) for leaf, k in reduced
                    if leaves[leaf].shape[k] in set(experts.values())))
  out = {}
  for n, (order, leaf, k) in enumerate(routers):
    end = routers[n + 1][0] if n + 1 < len(routers) else math.inf
    mine = sorted((reader.first_order[e], e) for e, count in experts.items()
                  if count == leaves[leaf].shape[k] and order < reader.first_order.get(e, -1) < end)
    if not mine:
      continue
    first, last = mine[0][1], mine[-1][1]
    avals = []
    # the dispatched tokens: the product that made the first expert weight's operand
    made = _product_made(reader, first)
    if made is not None:
      avals.append(made.outvars[0].aval)
      avals += [v.aval for v in made.invars if jaxpr_reader.is_var(v) and
                experts[first] in tuple(v.aval.shape)]
    avals.append(reader.first_out[last][0].outvars[0].aval)
    out[(leaf, k)] = (float(sum(jaxpr_reader.nbytes(a) for a in avals)),
                      float(sum(jaxpr_reader.wide_bytes(a) for a in avals)))
  return out


def _product_made(reader, leaf: int):
  """The product (a ``dot_general``) that made the operand ``leaf``'s first product reads beside
  it, followed out of the calls it is read in (jnp.einsum's) and back through casts, sharding
  constraints, transposes (an einsum's output order) and the calls that made it; None where
  another equation made it."""
  eqn, side, _, frames = reader.first_out[leaf]
  var = eqn.invars[1 - side]
  for call, body in reversed(frames):       # a call's operand, as its caller hands it in
    if call.primitive.name not in jaxpr_reader.CALLS or var not in body.invars:
      break
    var = call.invars[list(body.invars).index(var)]
  for _ in range(64):
    made = reader.producer.get(var) if jaxpr_reader.is_var(var) else None
    if made is None:
      return None
    name = made.primitive.name
    if name == "dot_general":
      return made
    if name in jaxpr_reader.ALIASES or name == "transpose":
      var = made.invars[0]
    elif name in jaxpr_reader.CALLS:
      body = jaxpr_reader.sub_jaxprs(made)[0][0]
      var = body.outvars[list(made.outvars).index(var)]
    else:
      return None
  return None
