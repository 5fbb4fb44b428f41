"""``all_gather``: every rank's array along a new or an existing axis (``lax.all_gather``'s
arguments and result types). The array-level collective and its transpose, a reduce-scatter, are
in ``scatter_gather.py``; where it runs and its semantics: ``common.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.collectives import common
from dtenjax._src.collectives import scatter_gather
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.contract import Contract

AxisName = base.AxisName

ALL_GATHER_TO = ("varying", "invarying")


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               to: str = "varying", algorithm: str = "auto", deterministic: bool = True,
               reproducible: bool | str = False):
  """Gathers ``x`` from every rank along ``axis`` (stacked, or concatenated when ``tiled``).

  Pure data movement, so the bits never depend on the algorithm: "ring" is a ppermute ring,
  every other name uses XLA's all-gather. The transpose is :func:`reduce_scatter` (chosen by
  ``auto`` with the same ``deterministic`` and ``reproducible``: True or "v2" make the gradient
  of a gathered weight the reproducible sum of its cotangents, the same bits on any device
  split; floating leaves must then be float32 or bfloat16, as for the sum).

  ``to`` is ``lax.all_gather``'s (jax 0.10.2 and 0.11.2): the result's type over typed manual
  axes (``shard_map(check_vma=True)``). "varying" (default): it varies over ``axis_name`` (the
  transpose is a reduce-scatter). "invarying": every device holds the same gathered value, typed
  invariant (it can leave through ``out_specs=P()``); XLA's all-gather for any ``algorithm``,
  and the transpose takes rank r's block of the (invariant) cotangent, with no communication.
  Over vmap axes or without the type check there are no types and both are the same. lax's
  third value, "reduced", belongs to its unreduced/reduced types and is refused here (use
  ``jax.lax.all_gather(..., to="reduced")``).
  """
  common.check_common("all_gather", "sum", algorithm)
  if to not in ALL_GATHER_TO:
    raise errors.CollectiveError(
        f"all_gather: to={to!r} is not one of {ALL_GATHER_TO} (lax.all_gather's varying and "
        "invarying result types); for to='reduced' call jax.lax.all_gather directly.")
  contract = common.contract_of("sum", reproducible)
  axes = common.check_axes(axis_name, "all_gather")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  args = (axes, axis, bool(tiled), algorithm, bool(deterministic), to, contract)
  with common.vmap_errors("all_gather", axes):
    out = common.eager_or_traced("all_gather", _all_gather_leaves, leaves, args)
  return jax.tree_util.tree_unflatten(treedef, out)


def _all_gather_leaves(leaves, axes, axis, tiled, algorithm, deterministic, to="varying",
                       contract=Contract.NONE):
  def kept(i, entries):            # the gathered dimension: grown (tiled) or new
    nd = len(entries) if tiled else len(entries) + 1
    if not -nd <= axis < nd:
      return entries
    d = axis % nd
    return entries[:d] + (None,) + entries[d + (1 if tiled else 0):]
  return common.free_explicit_axes(
      leaves, lambda ls: _all_gather_typed(ls, axes, axis, tiled, algorithm, deterministic, to,
                                           contract), kept)


def _all_gather_typed(leaves, axes, axis, tiled, algorithm, deterministic, to, contract):
  out, problems = [], []
  typed = common.typed_axes(axes)
  invariant = to == "invarying" and bool(axes) and set(typed) == set(axes)
  for i, leaf in enumerate(leaves):
    leaf = jaxapi.to_varying(jnp.asarray(leaf), typed)     # as lax.all_gather
    if jnp.issubdtype(leaf.dtype, jnp.inexact):            # the transpose's sum takes these
      common.check_leaf("all_gather", leaf, "sum", contract)
    nd = leaf.ndim if tiled else leaf.ndim + 1
    if not -nd <= axis < nd or (tiled and leaf.ndim == 0):
      problems.append(f"leaf {i} shape {leaf.shape}: axis={axis} is out of range "
                      f"(tiled={tiled})")
      continue
    spec = scatter_gather.Spec(axes, "sum", algorithm, deterministic, axis % nd, tiled,
                               contract=contract, invariant=invariant)
    out.append(scatter_gather.all_gather_array(leaf, spec))
  if problems:
    raise errors.CollectiveError(errors.join_problems("all_gather: bad inputs", problems))
  return out


