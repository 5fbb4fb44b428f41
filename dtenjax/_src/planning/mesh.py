"""Topology-aware device meshes and the pmap-like ``mesh_map``.

:func:`make_mesh` orders devices so that the innermost mesh axis varies over devices that share
the fastest links (NVLink island before PCIe before the host boundary). The ordering is a pure
function of the topology, so the same machine always gets the same mesh.

Meshes are ``jax.sharding.Mesh`` with Auto axes, chosen deliberately: ``jax.make_mesh`` defaults
to Explicit axes, under which shard_map's ``in_specs`` are only assertions and every input must be
resharded first. Auto axes let :func:`dtenjax.shard` constraints and :func:`mesh_map` accept any
input layout, on jax 0.10 and 0.11 alike.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.topology.model import Topology

_current_mesh: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "dtenjax_current_mesh", default=None)


def _check_axes(shape: Sequence[int], axis_names: Sequence[str]) -> None:
  problems = []
  if len(shape) != len(axis_names):
    problems.append(f"shape {tuple(shape)} has {len(shape)} axes but axis_names "
                    f"{tuple(axis_names)} has {len(axis_names)}; give one name per axis")
  if any((not isinstance(s, (int, np.integer))) or s < 1 for s in shape):
    problems.append(f"every axis size must be a positive integer, got {tuple(shape)}")
  if len(set(axis_names)) != len(axis_names):
    problems.append(f"axis names must be distinct, got {tuple(axis_names)}")
  if any(not isinstance(a, str) or not a for a in axis_names):
    problems.append(f"axis names must be non-empty strings, got {tuple(axis_names)}")
  if problems:
    raise errors.MeshError(errors.join_problems("invalid mesh:", problems))


def order_devices(devices: Sequence[Any], topology: Topology | None = None) -> list[Any]:
  """Devices sorted so that neighbours share the fastest links (deterministic)."""
  devices = list(devices)
  if topology is None:
    return sorted(devices, key=lambda d: (d.process_index, d.id))
  present = set(topology.device_ids)
  missing = [d.id for d in devices if d.id not in present]
  if missing:
    raise errors.TopologyError(
        f"devices {missing} are not described by topology {topology.name!r}; pass the "
        "topology of these devices (Topology.detect()) or topology=None.")
  return sorted(devices, key=lambda d: topology.hierarchy_key(d.id))


def make_mesh(shape: Sequence[int], axis_names: Sequence[str], topology: Topology | None = None,
              devices: Sequence[Any] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` of ``shape`` whose inner axes stay on the fastest links.

  Args:
    shape: mesh axis sizes, outermost first; their product must equal the device count.
    axis_names: one name per axis.
    topology: the topology to order by; default ``Topology.current()``.
    devices: devices to use; default ``jax.devices()``.
  """
  shape = tuple(shape)
  axis_names = tuple(axis_names)
  _check_axes(shape, axis_names)
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(devices):
    hint = ""
    if len(shape) >= 1 and len(devices) % math.prod(shape[1:] or (1,)) == 0:
      fixed = (len(devices) // math.prod(shape[1:] or (1,)),) + shape[1:]
      hint = f" For example shape={fixed}."
    raise errors.MeshError(
        f"mesh shape {shape} holds {math.prod(shape)} devices but {len(devices)} are available "
        f"({devices[0].platform if devices else 'none'}). Choose a shape whose product is "
        f"{len(devices)}, or pass devices=[...] with {math.prod(shape)} devices.{hint}")
  if topology is None:
    topology = Topology.current()
  return _make_mesh_cached(shape, axis_names, topology, tuple(devices))


@functools.lru_cache(maxsize=256)
def _make_mesh_cached(shape: tuple[int, ...], axis_names: tuple[str, ...], topology: Topology,
                      devices: tuple[Any, ...]) -> Mesh:
  # make_mesh is a pure function of its arguments; placements resolve their mesh once per leaf,
  # so caching it keeps planning a large pytree cheap (bench/planner.py).
  ordered = order_devices(devices, topology)
  return Mesh(np.asarray(ordered, dtype=object).reshape(shape), axis_names)


def as_mesh(mesh: Mesh | Sequence[int] | None, axis_names: Sequence[str] | None = None) -> Mesh:
  """A Mesh from a Mesh, a shape like ``(2, 4)`` (axes named ``"x", "y"`` or ``axis_names``), or
  None (the enclosing :func:`use_mesh`, else a 1D mesh over all devices named ``"x"``)."""
  if isinstance(mesh, Mesh):
    return mesh
  if mesh is None:
    cur = current_mesh()
    if cur is not None:
      return cur
    return make_mesh((len(jax.devices()),), ("x",))
  shape = tuple(mesh)
  if axis_names is None:
    axis_names = ("x", "y", "z", "w")[:len(shape)] if len(shape) <= 4 else tuple(
        f"a{i}" for i in range(len(shape)))
  return make_mesh(shape, axis_names)


def current_mesh() -> Mesh | None:
  """The mesh of the enclosing :func:`use_mesh` block or :func:`mesh_map` trace, if any."""
  return _current_mesh.get()


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Makes ``mesh`` the default for dtenjax calls (placements, collectives' cost model)."""
  token = _current_mesh.set(mesh)
  try:
    yield mesh
  finally:
    _current_mesh.reset(token)


def _spec_axes(spec) -> set[str]:
  out = set()
  if spec is None:
    return out
  for entry in spec:
    if entry is None:
      continue
    out.update(entry if isinstance(entry, tuple) else (entry,))
  return out


def suggest_axis(name: Any, axis_names: Sequence[str]) -> str:
  """' (did you mean 'x'?)' when ``name`` looks like a misspelling of one of ``axis_names``."""
  close = difflib.get_close_matches(str(name), [str(a) for a in axis_names], n=1, cutoff=0.5)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _check_specs(mesh: Mesh, specs, what: str) -> None:
  bad = set()
  for leaf in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P) or s is None):
    if isinstance(leaf, P):
      bad |= _spec_axes(leaf) - set(mesh.axis_names)
  if bad:
    problems = [f"{a!r} is not an axis of the mesh{suggest_axis(a, mesh.axis_names)}"
                for a in sorted(bad, key=str)]
    raise errors.MeshError(errors.join_problems(
        f"{what} name mesh axes that mesh {dict(mesh.shape)} does not have; use its axis names "
        f"{tuple(mesh.axis_names)}:", problems))


def mesh_map(f: Callable, mesh: Mesh | Sequence[int] | None = None, in_specs: Any = P(),
             out_specs: Any = P(), check_vma: bool = False) -> Callable:
  """Runs ``f`` once per device on its shard, like ``pmap`` but over a (multi-axis) mesh.

  A thin, validated layer over ``jax.shard_map``: composes with ``jit``, ``grad`` and ``vmap``;
  inside ``f``, mesh axis names are bound for collectives (``dtenjax.all_reduce(x, "x")``), and
  :func:`current_mesh` returns the concrete mesh so the cost model knows which devices take part.
  """
  mesh = as_mesh(mesh)
  _check_specs(mesh, in_specs, "in_specs")
  _check_specs(mesh, out_specs, "out_specs")

  @functools.wraps(f)
  def body(*args):
    token = _current_mesh.set(mesh)
    try:
      return f(*args)
    finally:
      _current_mesh.reset(token)

  return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def pmap(f: Callable, axis_name: str = "i", devices: Sequence[Any] | None = None) -> Callable:
  """``jax.pmap``-style convenience: maps ``f`` over the leading axis of every argument.

  The leading axis must equal the device count; inside ``f`` each device sees its slice without
  that axis, and ``axis_name`` is bound for collectives. Returns stacked results. Built on
  :func:`mesh_map`, so it composes with ``jit``.
  """
  devices = list(jax.devices() if devices is None else devices)
  mesh = make_mesh((len(devices),), (axis_name,), devices=devices)

  def per_device(*args):
    out = f(*jax.tree.map(lambda a: a[0], args))
    return jax.tree.map(lambda o: o[None], out)

  mapped = mesh_map(per_device, mesh, in_specs=P(axis_name), out_specs=P(axis_name))

  @functools.wraps(f)
  def wrapper(*args):
    problems = []
    for i, leaf in enumerate(jax.tree.leaves(args)):
      lead = np.shape(leaf)[0] if np.ndim(leaf) else None
      if lead != len(devices):
        problems.append(f"argument leaf {i} has shape {np.shape(leaf)}; its leading axis must "
                        f"be {len(devices)} (one slice per device)")
    if problems:
      raise errors.MeshError(errors.join_problems("dtenjax.pmap:", problems))
    return mapped(*args)

  return wrapper
