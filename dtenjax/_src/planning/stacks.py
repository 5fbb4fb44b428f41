"""The scanned stacks of a step: the state leaves a ``lax.scan`` slices one layer at a time
(stacked weights and their optimizer state), grouped by the scan's length, and the bytes of the
forward scan's carry. A pipeline's stages split the stack whose weights do the most product flops
(:func:`main`); FSDP gathers a stacked weight one layer at a time inside the loop body.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Any

from dtenjax._src import jaxapi
from dtenjax._src.planning.jaxpr_reader import WeightUse
from dtenjax._src.planning.jaxpr_reader import nbytes

# scan length -> (state leaf -> the leaf dimension the scan slices, the forward carry's bytes)
Stacks = dict[int, tuple[dict[int, int], int]]


def read(scans: Iterable[tuple[Any, Any, tuple]]) -> Stacks:
  """The stacks of the scans the reader walked (:attr:`Reader.scans`, in the jaxpr's order): a
  scan's sliced state leaves (and the leaf dimension it slices) are recorded under its length;
  the first such scan (the forward) gives the carry's bytes."""
  stacks: Stacks = {}
  for eqn, sub, origins in scans:
    found = {}
    for org in origins:
      if org is not None and org[1] and org[1][0] is not None:
        found[org[0]] = org[1][0]
    if not found:
      continue
    n_consts, n_carry = jaxapi.scan_counts(eqn)
    length = int(eqn.params.get("length", 1))
    leaves, carry = stacks.get(length, ({}, None))
    if carry is None:
      carry = sum(nbytes(v.aval) for v in sub.invars[n_consts:n_consts + n_carry])
    stacks[length] = ({**found, **leaves}, carry)
  return stacks


def together(scans: Iterable[tuple[Any, Any, tuple]]) -> tuple[frozenset[int], ...]:
  """The state leaves each scan the reader walked slices (:attr:`Reader.scans`), one set a
  scan of more than one such leaf: the stacks one loop's body reads together (two scans of
  one length, an encoder's and a decoder's, are apart here and one in :func:`read`)."""
  out = []
  for _, _, origins in scans:
    found = frozenset(org[0] for org in origins
                      if org is not None and org[1] and org[1][0] is not None)
    if len(found) > 1 and found not in out:
      out.append(found)
  return tuple(out)


def main(stacks: Stacks, weights: Mapping[int, WeightUse]
         ) -> tuple[int, dict[int, int], int] | None:
  """``(layers, {leaf: sliced dimension}, carry bytes)`` of the stack of more than one layer
  whose weights do the most product flops (the one a pipeline splits into stages), or None
  without one."""
  def flops(item):
    length, (leaves, _) = item
    return (sum(weights[i].flops for i in leaves if i in weights), length)
  best = max((kv for kv in stacks.items() if kv[0] > 1), key=flops, default=None)
  if best is None or flops(best)[0] <= 0:
    return None
  return best[0], best[1][0], best[1][1]
