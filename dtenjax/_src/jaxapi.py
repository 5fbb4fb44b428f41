"""The one module that reaches into JAX's private modules, and the JAX-context helpers built on them.

JAX's public API does not (yet) expose everything a library of collectives needs: the
varying-manual-axes (vma) type of a traced value, whether ``shard_map``'s type check is on, the
concrete mesh while tracing under ``jax.set_mesh``. Each is
read here, so a JAX release that moves one touches this file only (checked on jax 0.10.2 and
0.11.2).

Varying manual axes in one paragraph: under ``jax.shard_map(..., check_vma=True)`` (JAX's default)
every value carries the set of manual mesh axes along which it may differ between devices.
``lax.psum`` over ``a`` takes a value varying over ``a`` to one invariant over ``a``; when its
input is invariant over ``a`` JAX first casts it to varying (``lax.pcast(..., to="varying")``,
whose transpose is a psum), so ``psum`` of a replicated value is ``n`` times that value. The
transpose of a varying -> invariant collective is the invariant -> varying cast (no
communication). With ``check_vma=False`` (and in ``pmap`` and ``vmap``) there are no types and the
transpose of ``psum`` is ``psum``. dtenjax's collectives follow exactly these rules.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax import lax
import numpy as np
from jax._src import config as _jax_config
from jax._src import core as _jax_core
from jax._src import distributed as _jax_distributed
from jax._src import mesh as _jax_mesh


def vma_checked() -> bool:
  """Whether values carry vma types here (inside ``shard_map(check_vma=True)``)."""
  return bool(_jax_config._check_vma.value)  # pylint: disable=protected-access


def vma(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (empty outside ``shard_map`` or without the check)."""
  aval = _jax_core.typeof(x)
  mat = getattr(aval, "mat", None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def manual_axes() -> frozenset:
  """The manual axes of the current abstract mesh (the axes of the enclosing ``shard_map``s)."""
  am = jax.sharding.get_abstract_mesh()
  return frozenset(getattr(am, "manual_axes", ()) or ())


def to_varying(x, axes: Sequence[str]):
  """``x`` cast to varying over those of ``axes`` it is invariant over (psum's implicit cast).

  Only manual mesh axes carry types: vmap axes and an unchecked ``shard_map`` return ``x``.
  """
  if not vma_checked():
    return x
  missing = tuple(a for a in axes if a in manual_axes() and a not in vma(x))
  return lax.pcast(x, missing, to="varying") if missing else x


def all_gather_invariant(x, axes: Sequence[str], *, axis: int = 0, tiled: bool = False):
  """JAX's varying -> invariant all-gather (``lax.all_gather(..., to="invarying")``): every device
  gets the same gathered value, typed so.

  The same HLO all-gather as ``lax.all_gather``; only the result type differs (``lax.all_gather``
  is varying -> varying, because its transpose is a reduce-scatter). Over vmap axes alone there
  are no types, and this is ``lax.all_gather``.
  """
  axes = tuple(axes)
  if not manual_axes() & frozenset(axes):
    return lax.all_gather(x, axes, axis=axis, tiled=tiled)
  return lax.all_gather(x, axes, axis=axis, tiled=tiled, to="invarying")


def reduced_type(aval, axes: Sequence[str]):
  """``aval`` with ``axes`` removed from its varying axes: the type rule of ``lax.psum``."""
  mat = getattr(aval, "mat", None)
  if mat is None:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=mat.varying - frozenset(axes)))


def reduced_struct(x, axes: Sequence[str]) -> jax.ShapeDtypeStruct:
  """A ``ShapeDtypeStruct`` like ``x`` typed as ``lax.psum(x, axes)`` would be: the result type
  of a custom call that all-reduces ``x`` over ``axes``."""
  aval = _jax_core.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is None or not mat.varying:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  # A manual-axis type is only meaningful with the (abstract) mesh of its sharding.
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=aval.sharding, manual_axis_type=mat.update(
      varying=mat.varying - frozenset(axes)))


def concrete_mesh():
  """The concrete mesh of ``jax.set_mesh`` (also while tracing under jit), else None.

  Outside such a block JAX returns an *empty* mesh (no axes): that is not a mesh."""
  try:
    mesh = _jax_mesh.get_concrete_mesh()
  except AttributeError:  # pragma: no cover - a jax that moved it
    return None
  if mesh is None or getattr(mesh, "empty", True) or not tuple(getattr(mesh, "axis_names", ())):
    return None
  return mesh


def distributed_state():
  """jax.distributed's global state (its ``client`` is the coordination service's key-value
  store; ``num_processes`` what it was initialised for), or None."""
  return getattr(_jax_distributed, "global_state", None)


def bound_axis_sizes() -> dict[str, int]:
  """Named axes bound here (shard_map and vmap axes) and their sizes, for error messages."""
  try:
    return dict(_jax_core.get_axis_env().axis_sizes)
  except AttributeError:  # pragma: no cover - a jax that moved it
    return {}


def coordination_client():
  """jax.distributed's coordination-service client (its key-value store), or None before
  ``jax.distributed.initialize()``."""
  return getattr(distributed_state(), "client", None)


# --- shared JAX-context helpers (public API only) ------------------------------------------------

def axis_tuple(axis_name) -> tuple:
  """``axis_name`` (one name, or a tuple/list of names) as a tuple of names."""
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def device_groups(devices, axis_names: Sequence[str], axes: Sequence[str]):
  """The devices of every group along ``axes`` of a mesh's device array: an array of shape
  (groups, group size), each row in rank order (``lax.axis_index(axes)``, the first name major),
  rows in the C order of the remaining axes. Every name of ``axes`` must be in ``axis_names``."""
  devs = np.asarray(devices)
  names = list(axis_names)
  rest = [names.index(n) for n in names if n not in axes]
  devs = np.transpose(devs, rest + [names.index(a) for a in axes])
  return devs.reshape(-1, math.prod(devs.shape[len(rest):]))
