"""Sequence (context) parallelism's reading of a step: which dimension of the batch is the sequence,
and which values of the forward pass are an attention's keys and values.

Context parallelism (MaxText's ``context`` axis, PyTorch's ``context_parallel``) shards the
activations of a long sequence over a mesh axis along their sequence dimension; every per-token op
(projections, MLP, norms, the loss) then splits over it as over the batch, and only attention
mixes positions: each device's queries need every key and value. As in MaxText's all-gather
context parallelism, the keys and values are all-gathered over the axis before the scores (their
cotangents reduced back in the backward); ring attention, which overlaps the gather with the
blocks of the scores, is not built.

:func:`read` follows the dimensions of the batch through the step's jaxpr (elementwise ops,
casts, reshapes that keep a dimension, transposes, broadcasts, reductions, the gather of an
embedding lookup, the batch and free dimensions of products, ``jit``, ``scan``, ``remat`` and
custom-derivative bodies) with one label per batch dimension, and finds the attentions of the
forward pass (its equations are those outside JAX's ``transpose(...)`` name scope): a product of
two values that carry the same sequence label on a free dimension each (the scores ``q k^T``),
whose output, through the softmax, is contracted along the key's position with a third value
that carries it once (``probs v``). That dimension of the batch is the sequence; the scores' key
operand and the value operand are what is gathered. A step without such an attention has no
sequence dimension: sharding its tokens is data parallelism by another name, and no ``sequence``
axis is offered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.extend.core as jcore
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.planning.jaxpr_reader import CALLS
from dtenjax._src.planning.jaxpr_reader import CUSTOM_DERIVATIVE_CALLS
from dtenjax._src.planning.jaxpr_reader import ELEMENTWISE

# the step reader's elementwise primitives (jax 0.11's one_minus_square among them); an
# optimization barrier is not followed
_SAME = ELEMENTWISE - {"optimization_barrier"}
_REDUCE = frozenset("reduce_sum reduce_max reduce_min reduce_prod argmax argmin".split())
_CALLS = CALLS | CUSTOM_DERIVATIVE_CALLS | {"checkpoint", "remat", "remat2"}
ROW = 0                          # the label of the batch's dimension 0 (every batch leaf's)


@dataclasses.dataclass(frozen=True)
class Attention:
  """One self-attention of the forward pass: its keys and values (global bytes of one call) and
  the calls per step (the trips of the loops around it); ``recomputed``: the backward's
  recomputation of a forward attention inside ``jax.checkpoint`` (its keys and values are
  gathered again there, and the forward's are not kept)."""
  k_bytes: int
  v_bytes: int
  repeats: int
  recomputed: bool = False
  # the keys' dtype: the Pricer widens a bfloat16 one's collectives as XLA:CPU runs them (float32)
  dtype: str = "float32"


@dataclasses.dataclass(frozen=True)
class Facts:
  """The sequence dimension of a step: its ``length``, the batch leaves that have it
  (leaf index -> dimension), the forward pass's attentions, and the batch's sequences per step
  (those leaves' dimension 0)."""
  length: int
  dims: dict[int, int]
  attention: tuple[Attention, ...]
  rows: int = 1


class _Reader:
  """Labels the dimensions of the values of a jaxpr (see the module docstring)."""

  def __init__(self):
    self.parent: dict[int, int] = {}
    self.lab: dict[Any, tuple] = {}          # var -> per dimension: (class, origin) or None
    self.kv: dict = {}                       # var -> (role, row dim, sequence dim)
    self.attention: list[tuple[Any, Any, int, bool]] = []   # (k, v, repeats, recomputed)
    self.recorded: set = set()
    self.enter: set = set()                  # ids of equations whose bodies hold kv values
    self.classes: dict[int, tuple[int, int]] = {}           # class -> (leaf, dim)
    self.scores: dict[int, Any] = {}         # id -> a scores product (q k^T) of the forward
    # var -> the value it repeats or reshapes (broadcast_in_dim, reshape): grouped-query
    # attention's keys and values are gathered before their heads are repeated
    self.source: dict = {}

  def find(self, c: int) -> int:
    while self.parent.get(c, c) != c:
      c = self.parent[c]
    return c

  def union(self, a: int, b: int) -> None:
    a, b = self.find(a), self.find(b)
    if a != b and ROW not in (a, b):
      self.parent[max(a, b)] = min(a, b)

  def get(self, v) -> tuple:
    if isinstance(v, jcore.Literal):
      return ()
    return self.lab.get(v, ())

  def walk(self, jaxpr, labels: list, repeats: int, backward: bool,
           recomputed: bool = False) -> list:
    """Labels ``jaxpr``'s values given its inputs' labels; returns its outputs' labels. An
    equation is the backward's when JAX's name stack puts it under ``transpose(...)`` (inside a
    loop or call: when the equation calling it is), except the forward that ``jax.checkpoint``
    recomputes there (``rematted_computation``)."""
    for v, lab in zip(jaxpr.invars, labels):
      if lab:
        self.lab[v] = lab
    for eqn in jaxpr.eqns:
      names = str(getattr(eqn.source_info, "name_stack", ""))
      if "rematted_computation" in names:
        self.eqn(eqn, repeats, False, True)
      else:
        self.eqn(eqn, repeats, backward or "transpose(" in names, recomputed)
    return [self.get(v) for v in jaxpr.outvars]

  def eqn(self, eqn, repeats: int, backward: bool, recomputed: bool = False) -> None:
    name = eqn.primitive.name
    ins = [self.get(v) for v in eqn.invars]
    outs: list[tuple] = [()] * len(eqn.outvars)
    if name == "dot_general":
      outs[0] = self.product(eqn, ins, repeats, backward, recomputed)
    elif name in _SAME:
      shape = tuple(eqn.outvars[0].aval.shape)
      merged: list = [None] * len(shape)
      for v, lab in zip(eqn.invars, ins):
        if not lab or tuple(v.aval.shape) != shape:
          continue
        for d, x in enumerate(lab):
          if x is None:
            continue
          if merged[d] is None:
            merged[d] = x
          else:
            self.union(merged[d][0], x[0])
      outs = [tuple(merged) if any(m is not None for m in merged) else ()] * len(eqn.outvars)
    elif not any(ins) and name not in ("scan", *_CALLS):
      return
    elif name == "transpose":
      perm = eqn.params["permutation"]
      outs[0] = tuple(ins[0][p] for p in perm) if ins[0] else ()
    elif name == "broadcast_in_dim":
      out = [None] * len(eqn.params["shape"])
      for d, x in zip(eqn.params["broadcast_dimensions"], ins[0] or ()):
        out[d] = x
      outs[0] = tuple(out)
      self.source[eqn.outvars[0]] = self.source.get(eqn.invars[0], eqn.invars[0])
    elif name in _REDUCE:
      axes = set(eqn.params.get("axes", ()))
      outs[0] = tuple(x for d, x in enumerate(ins[0]) if d not in axes) if ins[0] else ()
    elif name in ("reshape", "squeeze", "expand_dims"):
      outs[0] = _reshaped(ins[0], tuple(eqn.invars[0].aval.shape),
                          tuple(eqn.outvars[0].aval.shape))
      self.source[eqn.outvars[0]] = self.source.get(eqn.invars[0], eqn.invars[0])
    elif name == "slice":
      outs[0] = ins[0]
    elif name == "gather":
      outs[0] = _gathered(eqn, ins)
    elif name == "scan":
      outs = self.scan(eqn, ins, repeats, backward, recomputed)
    elif name in _CALLS:
      outs = self.call(eqn, ins, repeats, backward, recomputed)
    for v, lab in zip(eqn.outvars, outs):
      if lab and any(x is not None for x in lab) and not isinstance(v, jcore.DropVar):
        self.lab[v] = lab

  def seq_dims(self, lab: tuple, skip=()) -> list[int]:
    return [d for d, x in enumerate(lab) if x is not None and x[0] != ROW and d not in skip]

  def product(self, eqn, ins, repeats: int, backward: bool, recomputed: bool) -> tuple:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
    lab_l = lhs or (None,) * nl
    lab_r = rhs or (None,) * nr
    lf = [d for d in range(nl) if d not in lc and d not in lb]
    rf = [d for d in range(nr) if d not in rc and d not in rb]
    out = [lab_l[d] if lab_l[d] is not None else lab_r[e] for d, e in zip(lb, rb)]
    seq_l, seq_r = self.seq_dims(lab_l, lb), self.seq_dims(lab_r, rb)
    if not backward and len(seq_l) == 1 and len(seq_r) == 1 and seq_l[0] in lf and (
        seq_r[0] in rf) and self.find(lab_l[seq_l[0]][0]) == self.find(lab_r[seq_r[0]][0]):
      # scores: q k^T, each position of either side free; the output remembers which side
      # each position came from
      tag = id(eqn)
      self.scores[tag] = eqn
      out += [(lab_l[d][0], (tag, 0)) if d == seq_l[0] else lab_l[d] for d in lf]
      out += [(lab_r[d][0], (tag, 1)) if d == seq_r[0] else lab_r[d] for d in rf]
      return tuple(out)
    if not backward:
      for probs, other, pc, oc, side in ((lab_l, lab_r, lc, rc, 1), (lab_r, lab_l, rc, lc, 0)):
        ps, os_ = self.seq_dims(probs), self.seq_dims(other)
        if len(ps) < 2 or len(os_) != 1:
          continue
        for a, b in zip(pc, oc):
          x = probs[a]
          if x is None or x[1] is None or b != os_[0] or self.find(x[0]) != self.find(
              other[b][0]):
            continue
          s_eqn = self.scores[x[1][0]]
          k, q = s_eqn.invars[x[1][1]], s_eqn.invars[1 - x[1][1]]
          v = eqn.invars[side]
          k, v = self._unrepeated(k), self._unrepeated(v)
          if (k, v) in self.recorded:
            continue
          self.recorded.add((k, v))
          for var, role in ((k, "k"), (v, "v"), (q, "q")):
            if isinstance(var, jcore.Literal):
              continue
            lab = self.get(var)
            rows = [d for d, y in enumerate(lab) if y is not None and y[0] == ROW]
            seqs = self.seq_dims(lab)
            if len(seqs) == 1:
              self.kv[var] = (role, rows[0] if rows else None, seqs[0], self.find(lab[seqs[0]][0]))
          self.attention.append((k, v, repeats, recomputed))
    out += [lab_l[d] for d in lf]
    out += [lab_r[d] for d in rf]
    return tuple(out)

  def _unrepeated(self, v):
    """``v``, or the value it repeats or reshapes where that keeps the sequence dimension."""
    if isinstance(v, jcore.Literal):
      return v
    src = self.source.get(v)
    if src is None or isinstance(src, jcore.Literal) or len(self.seq_dims(self.get(src))) != 1:
      return v
    return src

  def scan(self, eqn, ins, repeats: int, backward: bool, recomputed: bool) -> list:
    nc, nk = jaxapi.scan_counts(eqn)
    body = eqn.params["jaxpr"]
    inner = []
    for k, lab in enumerate(ins):
      if k >= nc + nk:
        inner.append(lab[1:] if lab else ())
      else:
        inner.append(lab)
    before = len(self.kv)
    outs = self.walk(body.jaxpr, inner, repeats * int(eqn.params["length"]), backward,
                     recomputed)
    if len(self.kv) > before:
      self.enter.add(id(eqn))
    res = [lab if k < nk else ((None,) + lab if lab else ()) for k, lab in enumerate(outs)]
    return res[:len(eqn.outvars)]

  def call(self, eqn, ins, repeats: int, backward: bool, recomputed: bool) -> list:
    sub = None
    for p in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
      if p in eqn.params:
        sub = eqn.params[p]
        break
    if sub is None:
      return [()] * len(eqn.outvars)
    jaxpr = getattr(sub, "jaxpr", sub)
    if len(jaxpr.invars) != len(eqn.invars):
      return [()] * len(eqn.outvars)
    before = len(self.kv)
    outs = self.walk(jaxpr, ins, repeats, backward, recomputed)
    if len(self.kv) > before:
      self.enter.add(id(eqn))
    return outs[:len(eqn.outvars)] + [()] * (len(eqn.outvars) - len(outs))


def _nbytes(v) -> int:
  aval = v.aval
  return int(math.prod(aval.shape)) * aval.dtype.itemsize


def _reshaped(lab: tuple, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple:
  """Labels through a reshape: a dimension keeps its label where the sizes before it and its own
  size are the same on both sides."""
  if not lab:
    return ()
  out: list = [None] * len(dst)
  for d, x in enumerate(lab):
    if x is None:
      continue
    before = math.prod(src[:d])
    for e in range(len(dst)):
      if math.prod(dst[:e]) == before and dst[e] == src[d] and src[d] > 1:
        out[e] = x
        break
  return tuple(out)


def _gathered(eqn, ins) -> tuple:
  """An embedding lookup's output: the indices' dimensions (less the index vector's) in the
  output's batch positions, in order."""
  dn = eqn.params["dimension_numbers"]
  idx_lab = ins[1] if len(ins) > 1 else ()
  if not idx_lab:
    return ()
  rank = len(eqn.outvars[0].aval.shape)
  offset = set(getattr(dn, "offset_dims", ()))
  ivd = len(eqn.invars[1].aval.shape) - 1
  batch_in = [d for d in range(len(eqn.invars[1].aval.shape)) if d != ivd]
  batch_out = [d for d in range(rank) if d not in offset]
  out: list = [None] * rank
  for i, o in zip(batch_in, batch_out):
    out[o] = idx_lab[i] if i < len(idx_lab) else None
  return tuple(out)


def _leaf_labels(reader: _Reader, leaves) -> list:
  labels = []
  next_class = 1
  for lf in leaves:
    if not lf.is_batch or len(lf.shape) < 2 or lf.dtype.find("key") >= 0:
      labels.append(())
      continue
    lab = [(ROW, None)]
    for d in range(1, len(lf.shape)):
      if lf.shape[d] > 1:
        reader.classes[next_class] = (lf.index, d)
        lab.append((next_class, None))
        next_class += 1
      else:
        lab.append(None)
    labels.append(tuple(lab))
  return labels


def analyse(jaxpr, leaves) -> tuple[_Reader, list]:
  """Reads ``jaxpr`` (the step's, one input per leaf of ``leaves``: stepgraph.Leaf records)."""
  reader = _Reader()
  reader.walk(jaxpr, _leaf_labels(reader, leaves), 1, False)
  return reader


def read(jaxpr, leaves) -> Facts | None:
  """The step's sequence dimension and attentions (see the module docstring), or None."""
  reader = analyse(jaxpr, leaves)
  if not reader.attention:
    return None
  seq_classes = {c for role, _, _, c in reader.kv.values() if role == "k"}
  dims = {}
  for cls, (leaf, d) in reader.classes.items():
    if reader.find(cls) in seq_classes:
      dims.setdefault(leaf, d)
  if not dims:
    return None
  lengths = {leaves[leaf].shape[d] for leaf, d in dims.items()}
  attention = tuple(Attention(_nbytes(k), _nbytes(v), r, rec, k.aval.dtype.name)
                    for k, v, r, rec in reader.attention)
  rows = math.gcd(*(leaves[leaf].shape[0] for leaf in dims))
  return Facts(min(lengths), dims, attention, rows)


# --- pricing ----------------------------------------------------------------------------------

def check_mesh(facts: Facts | None, size: int) -> None:
  """Raises PlacementError when a ``sequence`` axis of ``size`` devices cannot shard the step."""
  if size <= 1:
    return
  if facts is None:
    raise errors.PlacementError(
        f"plan: the mesh has a 'sequence' axis of {size} devices, but the step has no "
        "self-attention over a dimension of its batch (a product q k^T whose output the softmax "
        "hands to a product with v), so there is no sequence dimension to shard; give a mesh "
        "without 'sequence' (or sequence 1), or let the planner choose (mesh=None)")
  if facts.length % size:
    g = math.gcd(facts.length, size)
    divisors = [k for k in range(1, g + 1) if g % k == 0]
    raise errors.PlacementError(
        f"plan: the mesh's 'sequence' axis of {size} devices does not divide the sequence length "
        f"{facts.length}; give a 'sequence' size that divides it (of those dividing {size}: "
        f"{divisors}, the other devices on other axes), or pad the sequence to a multiple of "
        f"{size}")


def sizes(facts: Facts | None, rest: int) -> list[int]:
  """1, and where the step has a sequence dimension and its batch cannot be split over the
  ``rest`` of the devices, every size dividing both the sequence length and ``rest``. (Where the
  batch fills the devices, the axis would only divide the activations' memory; that mesh is not
  proposed, to keep the number of meshes small: a mesh given to the planner may have one.)"""
  if facts is None or facts.rows % rest == 0:
    return [1]
  g = math.gcd(rest, facts.length)
  return [k for k in range(1, g + 1) if g % k == 0]


def spec(role: str, rank: int, row: int | None, seq: int, row_axes, axis: str) -> P:
  """The layout ``plan.jit`` constrains an attention operand to: keys and values gathered over
  ``axis`` along their sequence dimension (queries sharded over it), the batch dimension over
  the ``row_axes``, every other dimension left to XLA."""
  entries: list = [P.UNCONSTRAINED] * rank
  if row is not None:
    entries[row] = (row_axes[0] if len(row_axes) == 1 else tuple(row_axes)) if row_axes else None
  entries[seq] = axis if role == "q" else None
  return P(*entries)


# --- application (plan.jit) -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _In:
  index: int
  shape: tuple[int, ...]
  dtype: str
  is_batch: bool


@dataclasses.dataclass(frozen=True)
class Application:
  """How ``plan.jit`` applies a ``sequence`` axis: the axis, the axes that split the batch's
  dimension 0, and the step's batch arguments."""
  axis: str
  row_axes: tuple[str, ...]
  batch_argnums: tuple[int, ...]

  def constraints(self, jaxpr, args) -> tuple[dict, frozenset]:
    """For the step's jaxpr ``jaxpr`` (traced from ``args``): each attention operand of the
    forward -> the layout to constrain it to (:func:`spec`), and the ids of the equations
    (loops, calls) whose bodies hold one."""
    import jax
    leaves = []
    for argnum, arg in enumerate(args):
      for x in jax.tree.leaves(arg):
        leaves.append(_In(len(leaves), tuple(x.shape), str(x.dtype),
                          argnum in self.batch_argnums))
    reader = analyse(jaxpr, leaves)
    out = {v: spec(role, len(v.aval.shape), row, seq, self.row_axes, self.axis)
           for v, (role, row, seq, _) in reader.kv.items()}
    return out, frozenset(reader.enter)


def application(size: dict[str, int], sequence_axes, batch_axes,
                batch_argnums) -> Application | None:
  """A plan's :class:`Application` on a mesh of axis ``size``s (None: no sequence axis of more
  than one device)."""
  axes = [a for a in sequence_axes if size.get(a, 1) > 1]
  if not axes:
    return None
  rows = tuple(a for a in batch_axes if a not in sequence_axes and size.get(a, 1) > 1)
  return Application(axes[0], rows, tuple(batch_argnums))
