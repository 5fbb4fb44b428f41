"""Tokens routed to sharded weights: the activation side of expert parallelism in ``plan.jit``.

A weight sharded over a routed axis (``expert``) along a dimension its product batches over
(``einsum("ebcd,edf->ebcf", dispatched, w)``) stays sharded for the product; the other operand,
the dispatched tokens, must be sharded alike along its matching dimension. :func:`product`
evaluates such a ``dot_general`` inside :mod:`~dtenjax._src.planning.gather`'s evaluator:

* an operand that is not yet routed is constrained twice: first unsharded along the expert
  dimension (the tokens as the batch axes hold them), then sharded over the weight's axis. Between
  the two layouts XLA's partitioner emits one all-to-all (a single constraint lets it recompute
  the dispatch from gathered inputs instead: all-gathers and all-reduces of the batch);
* the product's output, whose leading dimensions are the batch dimensions, is routed as well and
  stays with its experts through elementwise ops and the next expert product;
* a routed value read by a product that does not batch over its routed dimension (the combine
  einsum, which sums over the experts) is first constrained back, unsharded along it: the
  all-to-all home.

The step's jaxpr already holds the backward pass, so the gradients' products (the input
gradient read with the weight, the weight gradient read with a routed residual) are routed by
the same rules. ``routes`` maps a value to ``{dimension: mesh axes}`` (and ``("home", value)``
to the value sent home, which the backward reads again). A constraint never
changes a value: a wrong guess costs time, not correctness.
"""

from __future__ import annotations

import jax.extend.core as jcore
from jax.sharding import PartitionSpec as P


def _spec(rank: int, dims: dict[int, object]) -> P:
  """Sharded as ``dims`` says along those dimensions, left to XLA elsewhere."""
  return P(*(dims[d] if d in dims else P.UNCONSTRAINED for d in range(rank)))


def _var(v) -> bool:
  return not isinstance(v, jcore.Literal)


def product(eqn, vals: list, tracked, routes: dict, env: dict, constrain, bind) -> list:
  """Binds the ``dot_general`` ``eqn`` to ``vals`` with its operands and output routed (see the
  module docstring); ``tracked`` maps planned weights to their compute layouts, ``constrain(x,
  spec)`` puts a sharding constraint, ``bind(eqn, vals)`` binds the equation. An operand routed
  here is routed for its later readers too (``env``, the evaluator's values): the backward's
  weight-gradient product reads the same dispatched tokens."""
  (_, _), (lb, rb) = eqn.params["dimension_numbers"]
  batch = (tuple(lb), tuple(rb))
  want: dict[int, object] = {}                 # batch position -> mesh axes
  for side in (0, 1):
    v = eqn.invars[side]
    spec = tracked.get(v) if _var(v) else None
    if spec is not None:
      entries = tuple(spec)
      for k, d in enumerate(batch[side]):
        if d < len(entries) and entries[d] is not None:
          want[k] = entries[d]
  for side in (0, 1):
    v = eqn.invars[side]
    r = routes.get(v) if _var(v) else None
    if not r:
      continue
    for d, axes in r.items():
      if d in batch[side]:
        want.setdefault(batch[side].index(d), axes)
    back = {d: None for d in r if d not in batch[side]}
    if back:                                   # combine: the tokens go home first, once
      if ("home", v) not in routes:
        routes[("home", v)] = constrain(vals[side],
                                        _spec(len(eqn.invars[side].aval.shape), back))
      vals[side] = routes[("home", v)]
  if not want:
    return bind(eqn, vals)
  for side in (0, 1):
    v = eqn.invars[side]
    if _var(v) and tracked.get(v) is not None:
      continue                                 # the weight: in its compute layout already
    dims = {batch[side][k]: axes for k, axes in want.items()}
    r = routes.get(v, {}) if _var(v) else {}
    if all(r.get(d) == axes for d, axes in dims.items()):
      continue
    rank = len(eqn.invars[side].aval.shape)
    x = constrain(vals[side], _spec(rank, {d: None for d in dims}))
    vals[side] = constrain(x, _spec(rank, dims))       # dispatch: one all-to-all
    if _var(v):
      env[v] = vals[side]
      routes[v] = {**r, **dims}
  outs = bind(eqn, vals)
  dims = dict(want)                            # the output's batch dimensions lead
  outs[0] = constrain(outs[0], _spec(len(eqn.outvars[0].aval.shape), dims))
  routes[eqn.outvars[0]] = dims
  return outs


def follow(eqn, routes: dict) -> None:
  """Carries routes through an equation bound unchanged: to outputs of a routed operand's shape
  (elementwise ops, casts) and through transposes."""
  ins = [(v, routes[v]) for v in eqn.invars if _var(v) and v in routes]
  if not ins:
    return
  if eqn.primitive.name == "transpose":
    perm = list(eqn.params["permutation"])
    (_, r), = ins[:1]
    routes[eqn.outvars[0]] = {perm.index(d): a for d, a in r.items()}
    return
  for o in eqn.outvars:
    shape = tuple(getattr(o.aval, "shape", ()))
    same = [r for v, r in ins if tuple(v.aval.shape) == shape]
    if same and all(r == same[0] for r in same):
      routes[o] = same[0]
