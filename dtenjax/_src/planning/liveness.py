"""The values a step materialises and how long each lives: a walk of the step's top-level
jaxpr in order (a loop body's peak counted while the loop runs) that leaves out the values XLA
fuses into their consumers, keeps the ones it does not duplicate (expensive ops read by several,
inputs of reductions over leading dimensions, convolutions' transposed copies), and records the
gradients. The solver simulates XLA's buffer assignment over this timeline with each layout's
sizes (:func:`dtenjax._src.planning.solver.simulate_memory`); its peak of batch-derived values is
the step's activation bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

from dtenjax._src.planning.jaxpr_reader import ELEMENTWISE
from dtenjax._src.planning.jaxpr_reader import is_var
from dtenjax._src.planning.jaxpr_reader import nbytes
from dtenjax._src.planning.jaxpr_reader import sub_jaxprs

# Values XLA computes inside the fusion of their consumer (recomputed there, never materialised)
# when every consumer is such an op: elementwise ops and cheap data movement; reductions take
# fused producers as their input (XLA's input fusions) but are fusion roots themselves.
_FUSIBLE = ELEMENTWISE | frozenset(
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


def activations(jaxpr, leaves: Sequence[Any], cones: Mapping[tuple[int, int], set[Any]]
                ) -> tuple[int, dict[tuple[int, int], float], tuple[Live, ...]]:
  """The peak bytes of live batch-derived values (global), the share of them each paired
  ``(leaf, free dim)`` shards (its cone, :func:`dtenjax._src.planning.pairs.find_pairs`; a value
  in several cones is split among them) and the step's timeline of materialised values.
  ``leaves`` are the step's stepgraph.Leaf records, in the order of ``jaxpr``'s inputs."""
  state_shapes = {lf.shape for lf in leaves if not lf.is_batch and len(lf.shape) >= 2}
  batch_vars = {v for lf, v in zip(leaves, jaxpr.invars) if lf.is_batch}
  counted: dict[Any, int] = {}
  lives: list[tuple[Any, int, int, int, tuple[int, ...] | None]] = []
  act = _peak(jaxpr, batch_vars, state_shapes, counted, lives)
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
  return int(act), act_share, timeline


def _peak(jaxpr, batch_vars: set, excluded_shapes: set,
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
      if is_var(v):
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
      into_major.update(v for v in eqn.invars if is_var(v))
  feeds_fusion_boundary.update(v for v in into_major if users.get(v, 0) >= 2)
  # XLA duplicates a producer into each of its users' fusions only when it is cheap: the result
  # of an expensive elementwise op (tanh, exp, a division, ...) read by several is computed once
  # and kept -- unless a reduction over the minor dimension reads it (softmax's exponentials),
  # whose fusion XLA makes produce both
  into_minor = {v for eqn in jaxpr.eqns
                if eqn.primitive.name in _FUSED_INTO_CONSUMERS and
                eqn.primitive.name not in _FUSIBLE and not _keeps_minor(eqn)
                for v in eqn.invars if is_var(v)}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in _EXPENSIVE:
      feeds_fusion_boundary.update(o for o in eqn.outvars
                                   if users.get(o, 0) >= 2 and o not in into_minor)
  outvars = {v for v in jaxpr.outvars if is_var(v)}
  for v in outvars:
    last_use[v] = len(jaxpr.eqns)
  live = 0
  peak = 0
  ends: dict[int, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    if any(is_var(v) and v in tainted for v in eqn.invars):
      inner = 0
      for sub, _ in sub_jaxprs(eqn):
        n_outer = len(eqn.invars) - (1 if eqn.primitive.name == "cond" else 0)
        sub_batch = {sv for sv, ov in zip(sub.invars, list(eqn.invars)[-n_outer:])
                     if is_var(ov) and ov in tainted}
        inner = max(inner, _peak(sub, sub_batch, excluded_shapes))
      if eqn.primitive.name == "conv_general_dilated":
        inner += _conv_copies(eqn, tainted)
      if timeline is not None and inner:
        timeline.append((None, i, i, inner, None))
      for o in eqn.outvars:
        tainted.add(o)
        shape = tuple(o.aval.shape)
        nb = nbytes(o.aval)
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
  if is_var(lhs) and lhs in tainted and tuple(dn.lhs_spec) != (0, n - 1, *spatial):
    extra += nbytes(lhs.aval)
  if is_var(rhs) and rhs in tainted and tuple(dn.rhs_spec) != (n - 1, n - 2, *range(n - 2)):
    extra += nbytes(rhs.aval)
  if tuple(dn.out_spec) != (0, n - 1, *spatial):
    extra += nbytes(eqn.outvars[0].aval)
  return extra
