"""One walk of a training step's jaxpr (:class:`Reader`), into ``jit``, ``scan``, ``remat`` and
custom-derivative bodies: where each value comes from (which state leaf, which of its dimensions),
the first product that reads each weight (:class:`WeightUse`), the ties between state leaves, the
flops of every product and the table lookups. :func:`dtenjax._src.planning.stepgraph.read_step`
runs it and hands its findings to the pairs (:mod:`~dtenjax._src.planning.pairs`), the stacks
(:mod:`~dtenjax._src.planning.stacks`) and the values' liveness
(:mod:`~dtenjax._src.planning.liveness`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.extend.core as jcore
import numpy as np

from dtenjax._src import jaxapi

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
_ALIASES = frozenset(("convert_element_type", "copy", "copy_p", "pvary", "sharding_constraint",
                      "reduce_precision"))
_SUBJAXPR_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# jax.checkpoint's primitive (its name differs between JAX versions)
_REMAT = frozenset(("checkpoint", "remat", "remat2"))


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
  # products per step, loop trips not counted, that contract the dimensions the first one does:
  # the forward's, each use's of a weight shared across layers, and jax.checkpoint's recomputed
  # ones the backward reads (pairs.forward_reads); 0: not counted (a convolution)
  forward_reads: int = 0
  # weights whose first products read the same activation as this one (itself included): their
  # input gradients are added before any reduction (XLA reassociates all-reduce(a) +
  # all-reduce(b) into all-reduce(a + b)), so column-parallel siblings share one all-reduce
  siblings: int = 1


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


def nbytes(aval) -> int:
  shape = getattr(aval, "shape", ())
  dtype = getattr(aval, "dtype", None)
  if dtype is None:
    return 0
  return math.prod(shape) * itemsize(dtype)


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
    out.extend((b.jaxpr, 1) for b in eqn.params["branches"][:1])
  return out


class Reader:
  """One walk of the jaxpr: origins of values (which leaf, which of its dimensions), the first
  product of each leaf, the ties, flops and, at the top level, liveness."""

  def __init__(self, leaves: Sequence[Any]):   # stepgraph.Leaf records
    self.leaves = leaves
    self.weights: dict[int, WeightUse] = {}
    self.partner: dict[int, Any] = {}     # weight leaf -> the activation its first product reads
    self.first_out: dict[int, tuple[Any, int, tuple[int | None, ...], tuple]] = {}
    # weight leaf -> every dot_general that reads it, as first_out (the forward recomputed in
    # the backward under jax.checkpoint, the other depths of a weight shared across layers)
    self.reads: dict[int, list[tuple[Any, int, tuple[int | None, ...], tuple]]] = {}
    self.leaf_flops: dict[int, float] = {}
    self.shape_flops: dict[tuple[int, ...], float] = {}   # products whose result has this shape
    self.leaf_reads: dict[int, int] = {}      # leaf -> products that read it (in the jaxpr)
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
    # the scans walked, in order: (equation, body, the origin of each scanned operand)
    self.scans: list[tuple[Any, Any, tuple]] = []
    # the calls the walk is inside, outermost first: (equation, body). JAX shares one body
    # between calls of the same jitted function (jnp.einsum's), so a body's values stand for a
    # different call's values at each call site: the frames say which.
    self.frames: tuple[tuple[Any, Any], ...] = ()

  # origin: var -> (leaf index, dims) where dims[k] is the leaf dimension of the var's dim k
  def walk(self, jaxpr, origin: dict, tie: dict, repeats: int) -> None:
    for eqn in jaxpr.eqns:
      self.eqn_count += 1
      for pos, v in enumerate(eqn.invars):
        if is_var(v):
          self.uses.setdefault(v, []).append((eqn, pos))
      self.producer.update((o, eqn) for o in eqn.outvars)
      name = eqn.primitive.name
      ins = [origin.get(v) if is_var(v) else None for v in eqn.invars]
      for v, org in zip(eqn.invars, ins):
        if org is not None:
          self.origin_all[v] = org
      if any(is_var(v) and (v in self.state_derived or v in origin) for v in eqn.invars):
        self.state_derived.update(eqn.outvars)
      if name in ("dot_general", "conv_general_dilated"):
        self._product(eqn, ins, repeats)
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
      if name in _ALIASES and ins[0] is not None:
        origin[eqn.outvars[0]] = ins[0]
      elif name == "transpose" and ins[0] is not None:
        perm = eqn.params["permutation"]
        origin[eqn.outvars[0]] = (ins[0][0], tuple(ins[0][1][p] for p in perm))
      self._tie(eqn, tie)
      remat = name in _REMAT
      self.remat_depth += remat
      for sub, length in sub_jaxprs(eqn):
        self._enter(eqn, sub, origin, tie, repeats * length)
      self.remat_depth -= remat

  def _enter(self, eqn, sub, origin, tie, repeats):
    name = eqn.primitive.name
    outer = list(eqn.invars)
    if name == "cond":
      outer = outer[1:]
    inner_origin, inner_tie = {}, {}
    n_consts, n_carry = jaxapi.scan_counts(eqn) if name == "scan" else (0, 0)
    if name == "scan" and any(is_var(o) and (o in self.state_derived or o in origin)
                              for o in outer):
      # the carry of the second iteration on was computed from the state the body reads
      self.state_derived.update(sub.invars[n_consts:n_consts + n_carry])
    if name == "scan":
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
    saved = self.frames
    self.frames = saved + ((eqn, sub),)
    self.walk(sub, inner_origin, inner_tie, repeats)
    self.frames = saved
    for k, (i, o) in enumerate(zip(sub.outvars, eqn.outvars)):
      if is_var(i):
        # a scan's stacked outputs (after the carry) gain the leading length dimension
        self.outer_of_outvar[i] = (o, 1 if name == "scan" and k >= n_carry else 0)
        # a tie made inside a call carries on after it: an optimizer update split over nested
        # jits (jax 0.11's optax update has two more than 0.10's) ties the parameter to its moments
        if name != "scan" and i in inner_tie and is_var(o):
          tie[o] = inner_tie[i]

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
    self.products += repeats
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
          act_itemsize=itemsize(partner.dtype),
          repeats=repeats, primitive=name,
          layers=math.prod(s for k, s in enumerate(self.leaves[leaf].shape) if k not in dims),
          input_grad=is_var(eqn.invars[1 - side]) and eqn.invars[1 - side] in self.state_derived)
      self.first_out[leaf] = (eqn, side, dims, self.frames)
      if is_var(eqn.invars[1 - side]):
        self.partner[leaf] = eqn.invars[1 - side]
