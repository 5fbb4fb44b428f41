"""What a training step does with its arrays, read from its jaxpr: the facts the step planner
(:mod:`dtenjax._src.planning.step`) prices.

:func:`read_step` traces ``fn(*args)`` with abstract values (nothing runs, nothing is allocated)
and walks the jaxpr, into ``jit``, ``scan``, ``remat`` and custom-derivative bodies:

* **weights** -- the first ``dot_general`` (or convolution) that reads a state leaf gives its
  dimensions a role: *contracted* (summed over, the input features of ``Y = X @ W``), *free*
  (kept in the product, the output features or heads) or *stacked* (a ``scan`` over stacked layers,
  or a batch dimension of the product). This is what tells ``(features, heads, head_dim)`` from
  ``(heads, head_dim, features)`` without guessing. The partner's free dimensions are the tokens.
* **pairs** -- a free dimension of one weight's product followed through elementwise ops,
  reshapes, transposes and the batch and free dimensions of later products, until a product with
  another weight contracts it: the column-parallel / row-parallel pairs of Megatron-style tensor
  parallelism (the MLP's two kernels, the attention's q/k/v and output kernels), whose activation
  between them stays sharded.
* **ties** -- state leaves that meet in elementwise ops of one shape (a parameter, its gradient's
  moments in the optimizer state, its update) form one group and are laid out alike: the optimizer
  state is read from the step, not assumed.
* **flops** of every product, and **activation bytes**: the peak, over the step's equations in
  order, of the live values computed from the batch (values a ``jax.checkpoint`` recomputes are not
  live in between, so rematerialisation lowers it).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.planning import sequence as sequence_lib

# Primitives whose output dimension i is the input's dimension i (operands broadcast as scalars
# or of the same shape): the sharded dimension of a pair survives them.
_ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type
copy copy_p cos cosh div erf erf_inv erfc exp exp2 expm1 floor imag integer_pow is_finite log
log1p logistic max min mul ne eq ge gt le lt neg nextafter not or pow real reduce_precision rem
round rsqrt select_n sign sin sinh sqrt square sub tan tanh xor pvary stop_gradient
optimization_barrier sharding_constraint
""".split())
# Values XLA computes inside the fusion of their consumer (recomputed there, never materialised)
# when every consumer is such an op: elementwise ops and cheap data movement; reductions take
# fused producers as their input (XLA's input fusions) but are fusion roots themselves.
_FUSIBLE = _ELEMENTWISE | frozenset(
    "broadcast_in_dim slice pad reshape squeeze expand_dims concatenate iota rev select_n "
    "convert_element_type".split())
_FUSED_INTO_CONSUMERS = _FUSIBLE | frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split())
# Elementwise primitives XLA counts as expensive (HloInstruction::IsExpensive): it does not
# duplicate them into several consumers' fusions.
_EXPENSIVE = frozenset("""
acos acosh asin asinh atan atan2 atanh cbrt cos cosh div erf erf_inv erfc exp exp2 expm1 log log1p
logistic pow rsqrt sin sinh sqrt tan tanh
""".split())
# Primitives that only rename a value of the same shape (a state leaf keeps its identity).
_ALIASES = frozenset(("convert_element_type", "copy", "copy_p", "pvary", "sharding_constraint",
                      "reduce_precision"))
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# jax.checkpoint's primitive (its name differs between JAX versions)
_REMAT = frozenset(("checkpoint", "remat", "remat2"))


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
    return math.prod(self.shape) * self.itemsize


def _itemsize(dtype) -> int:
  """Bytes per element; a PRNG key array's (key<fry>) is that of its key data."""
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    return int(getattr(dtype, "itemsize", 0) or 0)


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


def _dtype_name(dtype) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:
    return str(dtype)


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
  # weights whose first products read the same activation as this one (itself included): their
  # input gradients are added before any reduction (XLA reassociates all-reduce(a) +
  # all-reduce(b) into all-reduce(a + b)), so column-parallel siblings share one all-reduce
  siblings: int = 1


@dataclasses.dataclass(frozen=True)
class Pair:
  """``src``'s free dimension ``src_dim`` flows, unreduced, into a product with ``dst`` that
  contracts ``dst``'s dimension ``dst_dim``."""
  src: int
  src_dim: int
  dst: int
  dst_dim: int


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
  # table; the bytes of the rows it reads per step, global)
  lookups: dict[int, tuple[tuple[int, ...], int]] = dataclasses.field(default_factory=dict)
  # the scanned stacks of layers: scan length -> (state leaf -> the leaf dimension the scan
  # slices, the bytes of the forward scan's carry, global); a pipeline's stages split one of them
  stacks: dict[int, tuple[dict[int, int], int]] = dataclasses.field(default_factory=dict)
  # the batch's sequence dimension and the forward's attentions (planning/sequence.py's Facts;
  # None: no self-attention over a batch dimension)
  sequence: Any = None

  def stack(self) -> tuple[int, dict[int, int], int] | None:
    """``(layers, {leaf: sliced dimension}, carry bytes)`` of the scanned stack whose weights do
    the most product flops (the one a pipeline splits into stages), or None without one."""
    def flops(item):
      length, (leaves, _) = item
      return (sum(self.weights[i].flops for i in leaves if i in self.weights), length)
    best = max((kv for kv in self.stacks.items() if kv[0] > 1), key=flops, default=None)
    if best is None or flops(best)[0] <= 0:
      return None
    return best[0], best[1][0], best[1][1]
  # the values the step materialises, in the jaxpr's order (activations, residuals kept for the
  # backward, loop bodies' peaks, gradients): the memory the layout's sizes are simulated over
  timeline: tuple[Live, ...] = ()

  def group_of(self, leaf: int) -> tuple[int, ...]:
    for g in self.groups:
      if leaf in g:
        return g
    return (leaf,)


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


def _is_var(v) -> bool:
  return not isinstance(v, jax.extend.core.Literal)


def _nbytes(aval) -> int:
  shape = getattr(aval, "shape", ())
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return 0
  return math.prod(shape) * _itemsize(dtype)


def _sub_jaxprs(eqn):
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
    out.extend((b.jaxpr, 1) for b in eqn.params["branches"][:1])
  return out


class _Reader:
  """One walk of the jaxpr: origins of values (which leaf, which of its dimensions), the first
  product of each leaf, the ties, flops and, at the top level, liveness."""

  def __init__(self, leaves: Sequence[Leaf]):
    self.leaves = leaves
    self.weights: dict[int, WeightUse] = {}
    self.partner: dict[int, Any] = {}     # weight leaf -> the activation its first product reads
    self.first_out: dict[int, tuple[Any, int, tuple[int | None, ...], tuple]] = {}
    self.leaf_flops: dict[int, float] = {}
    self.shape_flops: dict[tuple[int, ...], float] = {}   # products whose result has this shape
    self.leaf_reads: dict[int, int] = {}      # leaf -> products that read it (in the jaxpr)
    self.ties = _UnionFind()
    self.flops = 0.0
    self.gathered: set[int] = set()
    # leaf -> (its dimensions a gather indexes, bytes the gathers read out of it per step)
    self.lookups: dict[int, tuple[tuple[int, ...], int]] = {}
    self.eqn_count = 0
    # value -> list of (equation, position) that read it, over every jaxpr walked
    self.uses: dict[Any, list[tuple[Any, int]]] = {}
    # a body's outvar -> (the outer value it becomes, the dimension shift of a scan's stack)
    self.outer_of_outvar: dict[Any, tuple[Any, int]] = {}
    self.origin_all: dict[Any, tuple[int, tuple[int | None, ...]]] = {}
    self.state_derived: set[Any] = set()     # values computed from any state leaf
    self.eqn_flops: dict[int, float] = {}     # id(product equation) -> flops per step
    self.remat_depth = 0                      # > 0 inside a jax.checkpoint body
    self.remat_read: set[int] = set()         # leaves a product reads inside a checkpoint body
    self.stacks: dict[int, tuple[dict[int, int], int]] = {}   # see StepGraph.stacks
    # the calls the walk is inside, outermost first: (equation, body). JAX shares one body
    # between calls of the same jitted function (jnp.einsum's), so a body's values stand for a
    # different call's values at each call site: the frames say which.
    self.frames: tuple[tuple[Any, Any], ...] = ()

  # origin: var -> (leaf index, dims) where dims[k] is the leaf dimension of the var's dim k
  def walk(self, jaxpr, origin: dict, tie: dict, repeats: int) -> None:
    for eqn in jaxpr.eqns:
      self.eqn_count += 1
      for pos, v in enumerate(eqn.invars):
        if _is_var(v):
          self.uses.setdefault(v, []).append((eqn, pos))
      name = eqn.primitive.name
      ins = [origin.get(v) if _is_var(v) else None for v in eqn.invars]
      for v, org in zip(eqn.invars, ins):
        if org is not None:
          self.origin_all[v] = org
      if any(_is_var(v) and (v in self.state_derived or v in origin) for v in eqn.invars):
        self.state_derived.update(eqn.outvars)
      if name in ("dot_general", "conv_general_dilated"):
        self._product(eqn, ins, repeats)
      elif name == "gather" and ins and ins[0] is not None:
        self.gathered.add(ins[0][0])
        leaf, dims = ins[0]
        indexed = tuple(sorted(dims[d] for d in eqn.params["dimension_numbers"].start_index_map
                               if d < len(dims) and dims[d] is not None))
        seen = self.lookups.get(leaf, ((), 0))
        self.lookups[leaf] = (indexed or seen[0],
                              seen[1] + _nbytes(eqn.outvars[0].aval) * repeats)
      if name in _ALIASES and ins[0] is not None:
        origin[eqn.outvars[0]] = ins[0]
      elif name == "transpose" and ins[0] is not None:
        perm = eqn.params["permutation"]
        origin[eqn.outvars[0]] = (ins[0][0], tuple(ins[0][1][p] for p in perm))
      self._tie(eqn, tie)
      remat = name in _REMAT
      self.remat_depth += remat
      for sub, length in _sub_jaxprs(eqn):
        self._enter(eqn, sub, origin, tie, repeats * length)
      self.remat_depth -= remat

  def _enter(self, eqn, sub, origin, tie, repeats):
    name = eqn.primitive.name
    outer = list(eqn.invars)
    if name == "cond":
      outer = outer[1:]
    inner_origin, inner_tie = {}, {}
    n_consts, n_carry = jaxapi.scan_counts(eqn) if name == "scan" else (0, 0)
    if name == "scan" and any(_is_var(o) and (o in self.state_derived or o in origin)
                              for o in outer):
      # the carry of the second iteration on was computed from the state the body reads
      self.state_derived.update(sub.invars[n_consts:n_consts + n_carry])
    if name == "scan":
      self._stack(eqn, sub, origin, n_consts, n_carry)
    for k, (o, i) in enumerate(zip(outer, sub.invars)):
      if not _is_var(o):
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
    saved = self.frames
    self.frames = saved + ((eqn, sub),)
    self.walk(sub, inner_origin, inner_tie, repeats)
    self.frames = saved
    for k, (i, o) in enumerate(zip(sub.outvars, eqn.outvars)):
      if _is_var(i):
        # a scan's stacked outputs (after the carry) gain the leading length dimension
        self.outer_of_outvar[i] = (o, 1 if name == "scan" and k >= n_carry else 0)
        # a tie made inside a call carries on after it: an optimizer update split over nested
        # jits (jax 0.11's optax update has two more than 0.10's) ties the parameter to its moments
        if name != "scan" and i in inner_tie and _is_var(o):
          tie[o] = inner_tie[i]

  def _stack(self, eqn, sub, origin, n_consts: int, n_carry: int) -> None:
    """Records the state leaves a scan slices (and the leaf dimension it slices) under the
    scan's length; the first such scan (the forward) gives the carry's bytes."""
    found = {}
    for o in eqn.invars[n_consts + n_carry:]:
      org = origin.get(o) if _is_var(o) else None
      if org is not None and org[1] and org[1][0] is not None:
        found[org[0]] = org[1][0]
    if not found:
      return
    length = int(eqn.params.get("length", 1))
    leaves, carry = self.stacks.get(length, ({}, None))
    if carry is None:
      carry = sum(_nbytes(v.aval) for v in sub.invars[n_consts:n_consts + n_carry])
    self.stacks[length] = ({**found, **leaves}, carry)

  def _tie(self, eqn, tie) -> None:
    """Elementwise ops over operands of one shape tie the state leaves they carry."""
    if eqn.primitive.name not in _ELEMENTWISE or not eqn.outvars:
      return
    shape = tuple(eqn.outvars[0].aval.shape)
    reps = [tie[v] for v in eqn.invars if _is_var(v) and v in tie
            and tuple(v.aval.shape) == shape]
    if not reps:
      return
    for r in reps[1:]:
      self.ties.union(reps[0], r)
    for o in eqn.outvars:
      tie[o] = reps[0]

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
    else:   # conv_general_dilated: rhs is the kernel
      dn = eqn.params["dimension_numbers"]
      rspec = dn.rhs_spec            # (out feature, in feature, spatial...)
      out = eqn.outvars[0].aval
      kernel = math.prod(rhs.shape) // rhs.shape[rspec[0]]
      flops = 2.0 * repeats * math.prod(out.shape) * kernel
      lspec = dn.lhs_spec
      sides = ((1, tuple(rspec[1:]), (), (rspec[0],), lhs, (lspec[0], *lspec[2:])),)
    self.flops += flops
    self.eqn_flops[id(eqn)] = flops
    out_shape = tuple(eqn.outvars[0].aval.shape)
    self.shape_flops[out_shape] = self.shape_flops.get(out_shape, 0.0) + flops
    for side, contracted, batched, free, partner, pfree in sides:
      org = ins[side]
      if org is None:
        continue
      leaf, dims = org
      self.leaf_flops[leaf] = self.leaf_flops.get(leaf, 0.0) + flops
      self.leaf_reads[leaf] = self.leaf_reads.get(leaf, 0) + 1
      if self.remat_depth:
        self.remat_read.add(leaf)
      if leaf in self.weights or self.leaves[leaf].is_batch:
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
          act_itemsize=_itemsize(partner.dtype),
          repeats=repeats, primitive=name,
          layers=math.prod(s for k, s in enumerate(self.leaves[leaf].shape) if k not in dims),
          input_grad=_is_var(eqn.invars[1 - side]) and eqn.invars[1 - side] in self.state_derived)
      self.first_out[leaf] = (eqn, side, dims, self.frames)
      if _is_var(eqn.invars[1 - side]):
        self.partner[leaf] = eqn.invars[1 - side]


def _out_dim_of(eqn, side: int, leaf_dims, leaf_dim: int) -> int | None:
  """The output dimension of a dot_general that holds ``leaf_dim`` of operand ``side``."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  layout = [("b", k) for k in range(len(lb))] + [("l", d) for d in lfree] + [("r", d) for d in rfree]
  for k, d in enumerate(leaf_dims):
    if d == leaf_dim:
      want = ("l", k) if side == 0 else ("r", k)
      return layout.index(want) if want in layout else None
  return None


def _follow(reader: _Reader, src: int, src_dim: int, start, dim: int, frames: tuple = (),
            budget: int = 4000) -> tuple[list[Pair], set[int], set[Any]]:
  """Pairs reached from ``start``'s dimension ``dim`` (see the module docstring), the products
  between activations that the dimension passes through unreduced (attention's score and value
  products under head sharding), which split with it, and the values that carry it. ``frames``
  are the calls ``start`` is inside (:attr:`_Reader.frames`): a body shared by several calls
  leaves through the call it was entered from."""
  pairs, todo, seen = [], [(start, dim, tuple(frames))], set()
  carried: set[int] = set()
  dirty = False
  while todo and budget > 0 and not dirty:
    var, d, ctx = todo.pop()
    key = (var, d, tuple(id(e) for e, _ in ctx))
    if key in seen:
      continue
    seen.add(key)
    budget -= 1
    nxt = []
    if ctx:
      call, body = ctx[-1]
      n_carry = jaxapi.scan_counts(call)[1] if call.primitive.name == "scan" else 0
      for k, o in enumerate(body.outvars):
        if o is var and k < len(call.outvars):
          # a scan's stacked outputs (after the carry) gain the leading length dimension
          shift = 1 if call.primitive.name == "scan" and k >= n_carry else 0
          todo.append((call.outvars[k], d + shift, ctx[:-1]))
    elif var in reader.outer_of_outvar:
      outer, shift = reader.outer_of_outvar[var]
      nxt.append((outer, d + shift))
    for eqn, pos in reader.uses.get(var, ()):
      name = eqn.primitive.name
      out = eqn.outvars[0] if eqn.outvars else None
      shape = tuple(var.aval.shape)
      if d >= len(shape):     # a use that does not see the followed dimension (jax 0.11's jaxprs)
        continue
      if name in _ELEMENTWISE:
        if out is not None and tuple(out.aval.shape) == shape:
          nxt.extend((o, d) for o in eqn.outvars)
      elif name == "transpose":
        nxt.append((out, list(eqn.params["permutation"]).index(d)))
      elif name == "reshape":
        new = tuple(out.aval.shape)
        m = _reshape_dim(shape, new, d)
        if m is not None:
          nxt.append((out, m))
      elif name == "broadcast_in_dim":
        nxt.append((out, eqn.params["broadcast_dimensions"][d]))
      elif name in ("reduce_max", "reduce_sum", "reduce_min", "argmax", "reduce_and", "reduce_or"):
        axes = tuple(eqn.params.get("axes", ()))
        if d in axes:
          dirty = True
        else:
          nxt.append((out, d - sum(1 for a in axes if a < d)))
      elif name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        mine_c, mine_b = (lc, lb) if pos == 0 else (rc, rb)
        other_c = rc if pos == 0 else lc
        other = eqn.invars[1 - pos]
        if d in mine_c:
          org = _origin_in(reader, other, ctx)
          if org is None:
            dirty = True          # a partial sum of activations: needs the gathered value
          elif org[0] != src and org[0] in reader.weights:
            leaf_dim = org[1][other_c[list(mine_c).index(d)]]
            if leaf_dim is not None and leaf_dim in reader.weights[org[0]].contracted:
              pairs.append(Pair(src, src_dim, org[0], leaf_dim))
        else:
          nl = len(eqn.invars[0].aval.shape)
          nr = len(eqn.invars[1].aval.shape)
          lfree = [k for k in range(nl) if k not in lc and k not in lb]
          rfree = [k for k in range(nr) if k not in rc and k not in rb]
          if _origin_in(reader, other, ctx) is None:
            carried.add(id(eqn))
          if d in mine_b:
            nxt.append((out, list(mine_b).index(d)))
          else:
            base = len(lb) + (0 if pos == 0 else len(lfree))
            free = lfree if pos == 0 else rfree
            nxt.append((out, base + free.index(d)))
      elif eqn.params.get("jaxpr") is not None or name in ("scan", "while", "cond"):
        for sub, _ in _sub_jaxprs(eqn):
          k = pos - (1 if name == "cond" else 0)
          inner_ctx = ctx + ((eqn, sub),)
          if 0 <= k < len(sub.invars):
            inner = sub.invars[k]
            if name == "scan" and k >= sum(jaxapi.scan_counts(eqn)):
              if d == 0:
                continue
              todo.append((inner, d - 1, inner_ctx))
            else:
              todo.append((inner, d, inner_ctx))
    todo.extend((v, dd, ctx) for v, dd in nxt if v is not None and _is_var(v))
  if dirty or todo:
    return [], set(), set()
  return pairs, carried, {v for v, _, _ in seen}


def _origin_of(reader: _Reader, var):
  """The (leaf, dims) a product operand stands for, or None for an activation."""
  return reader.origin_all.get(var)


def _origin_in(reader: _Reader, var, ctx: tuple):
  """:func:`_origin_of` at one call site: a body's input stands for the call's operand there."""
  while ctx:
    call, body = ctx[-1]
    k = next((k for k, v in enumerate(body.invars) if v is var), None)
    if k is None:
      break
    outer = list(call.invars)[k + (1 if call.primitive.name == "cond" else 0)]
    if not _is_var(outer):
      return None
    org = _origin_in(reader, outer, ctx[:-1])
    if org is not None and call.primitive.name == "scan" and k >= sum(jaxapi.scan_counts(call)):
      org = (org[0], org[1][1:])                      # one layer of a stacked leaf
    return org
  return reader.origin_all.get(var)


def _reshape_dim(old: tuple[int, ...], new: tuple[int, ...], d: int) -> int | None:
  """Where dimension ``d`` of ``old`` goes in ``new`` when it keeps its size or splits with it
  leading (features -> heads x head_dim), or merges as the leading part; None otherwise."""
  before = math.prod(old[:d])
  acc = 1
  for k, s in enumerate(new):
    if acc == before:
      if s == old[d] or (s > 1 and old[d] % s == 0) or (s % old[d] == 0 and
                                                         math.prod(old[d + 1:]) % (s // old[d]) == 0):
        return k
      return None
    acc *= s
    if acc > before:
      return None
  return None


def _liveness(jaxpr, batch_vars: set, excluded_shapes: set,
              counted: dict[Any, int] | None = None,
              timeline: list[tuple[Any, int, int, int, tuple[int, ...] | None]] | None = None
              ) -> int:
  """Peak bytes of live batch-derived values over ``jaxpr``'s equations in order (bodies of
  calls add their own peak while they run); ``counted`` collects the values it counts and
  ``timeline`` (value or None, start, end, bytes, state shape or None) every materialised
  batch-derived value, the gradients (values of a state leaf's shape) included, and each body's
  peak as a value of one equation; the step's own outputs are not in it."""
  tainted = set(batch_vars)
  last_use: dict[Any, int] = {}
  feeds_fusion_boundary: set[Any] = set()
  users: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    boundary = eqn.primitive.name not in _FUSED_INTO_CONSUMERS or _keeps_minor(eqn)
    for v in eqn.invars:
      if _is_var(v):
        last_use[v] = i
        users[v] = users.get(v, 0) + 1
        if boundary:
          feeds_fusion_boundary.add(v)
  # values an elementwise chain carries into a reduction over leading dimensions (which XLA:CPU
  # does not fuse its producers into): a producer there that also has other users is computed
  # once and kept, not duplicated into each user's fusion
  into_major: set[Any] = set()
  for eqn in reversed(jaxpr.eqns):
    if _keeps_minor(eqn) or (eqn.primitive.name in _FUSIBLE and
                             any(o in into_major for o in eqn.outvars)):
      into_major.update(v for v in eqn.invars if _is_var(v))
  feeds_fusion_boundary.update(v for v in into_major if users.get(v, 0) >= 2)
  # XLA duplicates a producer into each of its users' fusions only when it is cheap: the result
  # of an expensive elementwise op (tanh, exp, a division, ...) read by several is computed once
  # and kept -- unless a reduction over the minor dimension reads it (softmax's exponentials),
  # whose fusion XLA makes produce both
  into_minor = {v for eqn in jaxpr.eqns
                if eqn.primitive.name in _FUSED_INTO_CONSUMERS and
                eqn.primitive.name not in _FUSIBLE and not _keeps_minor(eqn)
                for v in eqn.invars if _is_var(v)}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _EXPENSIVE:
      feeds_fusion_boundary.update(o for o in eqn.outvars
                                   if users.get(o, 0) >= 2 and o not in into_minor)
  outvars = {v for v in jaxpr.outvars if _is_var(v)}
  for v in outvars:
    last_use[v] = len(jaxpr.eqns)
  live = 0
  peak = 0
  ends: dict[int, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if any(_is_var(v) and v in tainted for v in eqn.invars):
      inner = 0
      for sub, _ in _sub_jaxprs(eqn):
        n_outer = len(eqn.invars) - (1 if eqn.primitive.name == "cond" else 0)
        sub_batch = {sv for sv, ov in zip(sub.invars, list(eqn.invars)[-n_outer:])
                     if _is_var(ov) and ov in tainted}
        inner = max(inner, _liveness(sub, sub_batch, excluded_shapes))
      if eqn.primitive.name == "conv_general_dilated":
        inner += _conv_copies(eqn, tainted)
      if timeline is not None and inner:
        timeline.append((None, i, i, inner, None))
      for o in eqn.outvars:
        tainted.add(o)
        shape = tuple(o.aval.shape)
        nb = _nbytes(o.aval)
        end = last_use.get(o)
        if end is None or nb == 0:
          continue
        # XLA fuses chains of elementwise ops into their consumers (recomputing them in the
        # backward's fusions): such a value is materialised only when a non-elementwise op
        # reads it
        if eqn.primitive.name in _FUSIBLE and o not in feeds_fusion_boundary:
          continue
        state = shape in excluded_shapes or tuple(reversed(shape)) in excluded_shapes
        if timeline is not None and o not in outvars:
          timeline.append((o, i, end, nb, shape if state else None))
        if state:
          continue
        live += nb
        ends[end] = ends.get(end, 0) + nb
        if counted is not None:
          counted[o] = nb
      peak = max(peak, live + inner)
    live -= ends.pop(i, 0)
  return peak


def _keeps_minor(eqn) -> bool:
  """A reduction over leading dimensions only (batch norm's statistics, a bias's gradient):
  XLA:CPU fuses elementwise producers into reductions over the minor (last) dimension, not
  into these, so their input is materialised."""
  axes = eqn.params.get("axes")
  if not eqn.primitive.name.startswith("reduce_") or axes is None or not eqn.invars:
    return False
  ndim = len(getattr(eqn.invars[0].aval, "shape", ()))
  return ndim > 1 and (ndim - 1) not in tuple(axes)


def _conv_copies(eqn, tainted: set) -> int:
  """Bytes of the batch-derived operands and result of a convolution whose dimensions are not in
  the order the backend's convolution kernels take (batch, spatial..., feature; a kernel's
  spatial..., input, output): XLA transposes them into a copy while the convolution runs. The
  gradients' convolutions are of this kind (the kernel gradient contracts the batch)."""
  dn = eqn.params["dimension_numbers"]
  n = len(eqn.outvars[0].aval.shape)
  spatial = tuple(range(1, n - 1))
  extra = 0
  lhs, rhs = eqn.invars[0], eqn.invars[1]
  if _is_var(lhs) and lhs in tainted and tuple(dn.lhs_spec) != (0, n - 1, *spatial):
    extra += _nbytes(lhs.aval)
  if _is_var(rhs) and rhs in tainted and tuple(dn.rhs_spec) != (n - 1, n - 2, *range(n - 2)):
    extra += _nbytes(rhs.aval)
  if tuple(dn.out_spec) != (0, n - 1, *spatial):
    extra += _nbytes(eqn.outvars[0].aval)
  return extra


def read_step(fn, args: Sequence[Any], batch_argnums: Sequence[int]) -> StepGraph:
  """Traces ``fn(*args)`` (arrays or ``jax.ShapeDtypeStruct``s) and reads its jaxpr."""
  batch_argnums = tuple(batch_argnums)
  flat = []
  for argnum, arg in enumerate(args):
    for path, leaf in jax.tree_util.tree_flatten_with_path(arg)[0]:
      flat.append((argnum, path, leaf))
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
                       argnum in batch_argnums, _itemsize(leaf.dtype)))
  abstract = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), arg) for arg in args]
  try:
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
  except errors.DtenjaxError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (the user's step failed to trace)
    raise errors.PlacementError(
        f"plan: the step could not be traced with the example arguments' shapes: "
        f"{type(e).__name__}: {e}") from e
  jaxpr = closed.jaxpr
  if len(jaxpr.invars) != len(leaves):
    raise errors.PlacementError(
        f"plan: the step's jaxpr has {len(jaxpr.invars)} inputs for {len(leaves)} argument "
        "leaves; pass every argument positionally")
  reader = _Reader(leaves)
  origin, tie = {}, {}
  for leaf, var in zip(leaves, jaxpr.invars):
    if not leaf.is_batch:
      origin[var] = (leaf.index, tuple(range(len(leaf.shape))))
      tie[var] = leaf.index
  reader.walk(jaxpr, origin, tie, 1)
  pairs = []
  reached: dict[int, list[tuple[int, int]]] = {}     # product -> the sources that split it
  cones: dict[tuple[int, int], set[Any]] = {}        # (source, dim) -> values sharded with it
  for leaf, use in sorted(reader.weights.items()):
    eqn, side, dims, frames = reader.first_out[leaf]
    if eqn.primitive.name != "dot_general":
      continue
    for k in use.free:
      j = _out_dim_of(eqn, side, dims, k)
      if j is not None:
        found, through, cone = _follow(reader, leaf, k, eqn.outvars[0], j, frames)
        pairs.extend(found)
        if found:
          cones[(leaf, k)] = cone
        for e in through:
          reached.setdefault(e, []).append((leaf, k))
  carried: dict[tuple[int, int], float] = {}
  for e, srcs in reached.items():
    for key in srcs:
      carried[key] = carried.get(key, 0.0) + reader.eqn_flops.get(e, 0.0) / len(srcs)
  pairs = tuple(sorted(set(pairs), key=lambda p: (p.src, p.src_dim, p.dst, p.dst_dim)))
  weights = {}
  readers: dict[Any, int] = {}
  for v in reader.partner.values():
    readers[v] = readers.get(v, 0) + 1
  for leaf, use in reader.weights.items():
    shape = leaves[leaf].shape
    # a gradient's product has the weight's shape (or its transpose): it splits like the reads
    has_grad = (shape in reader.shape_flops or tuple(reversed(shape)) in reader.shape_flops)
    reads = reader.leaf_flops.get(leaf, 0.0)
    weights[leaf] = dataclasses.replace(use, flops=reads * (1.5 if has_grad else 1.0),
                                        remat=leaf in reader.remat_read,
                                        siblings=readers.get(reader.partner.get(leaf), 1),
                                        grad_parts=_grad_parts(use, reader.leaf_reads.get(leaf, 1),
                                                               leaf in reader.remat_read))
  groups: dict[int, list[int]] = {}
  for leaf in leaves:
    if not leaf.is_batch:
      groups.setdefault(reader.ties.find(leaf.index), []).append(leaf.index)
  state_shapes = {lf.shape for lf in leaves if not lf.is_batch and len(lf.shape) >= 2}
  batch_vars = {v for lf, v in zip(leaves, jaxpr.invars) if lf.is_batch}
  counted: dict[Any, int] = {}
  lives: list[tuple[Any, int, int, int, tuple[int, ...] | None]] = []
  act = _liveness(jaxpr, batch_vars, state_shapes, counted, lives)
  # the share of the counted activation bytes each column-parallel source shards (a value in
  # several sources' cones is split among them)
  owners: dict[Any, int] = {}
  for cone in cones.values():
    for v in cone:
      if v in counted:
        owners[v] = owners.get(v, 0) + 1
  total = sum(counted.values()) or 1
  act_share = {key: sum(counted[v] / owners[v] for v in cone if v in counted) / total
               for key, cone in cones.items()}
  cone_keys: dict[Any, list[tuple[int, int]]] = {}
  for key, cone in sorted(cones.items()):
    for v in cone:
      cone_keys.setdefault(v, []).append(key)
  timeline = tuple(Live(start, end, nb, grad, tuple(cone_keys.get(v, ())) if v is not None
                        else ())
                   for v, start, end, nb, grad in lives)
  outputs = []
  for v in jaxpr.outvars:
    aval = v.aval
    # the walk's ties of the top level: which state leaf group each output updates
    rep = reader.ties.find(tie[v]) if _is_var(v) and v in tie else None
    outputs.append((tuple(int(s) for s in aval.shape), _dtype_name(aval.dtype), rep))
  return StepGraph(leaves=tuple(leaves), weights=weights, pairs=pairs,
                   groups=tuple(tuple(g) for g in groups.values()), flops=reader.flops,
                   activation_bytes=int(act), gathered=frozenset(reader.gathered),
                   outputs=tuple(outputs), num_eqns=reader.eqn_count,
                   out_tree=jax.tree.structure(out_shape), carried=carried,
                   act_share=act_share, lookups=dict(reader.lookups),
                   stacks=dict(reader.stacks), timeline=timeline,
                   sequence=sequence_lib.read(jaxpr, leaves))


def _grad_parts(use: WeightUse, reads: int, remat: bool) -> int:
  """How many times a weight is used per step, hence how many gradient parts XLA reduces before
  adding them (weights shared across layers): each use reads it in the forward product, again in
  the input gradient's product (when that is needed) and once more where jax.checkpoint
  recomputes the forward. A scanned stack's layers are one use (accumulated in the loop)."""
  if use.layers > 1:
    return 1
  per_use = 1 + int(use.input_grad) + int(remat)
  return max(1, reads // per_use)
