"""Topology-aware device meshes, the context mesh, ``mesh_map`` and a ``jax.pmap`` equivalent.

:func:`make_mesh` orders devices so that the innermost mesh axis varies over devices that share
the fastest links (NVLink island before PCIe before the host boundary). The ordering is a pure
function of the topology, so the same machine always gets the same mesh.

Axis types. ``jax.make_mesh`` makes Explicit axes by default; :func:`make_mesh` makes Auto axes
unless given ``axis_types`` (one ``jax.sharding.AxisType`` for all axes, or one per axis), because
under Explicit axes shard_map's ``in_specs`` are only assertions and every input must be resharded
first. Every dtenjax function takes a mesh of any axis types, including one made by
``jax.make_mesh``: :func:`dtenjax.shard` uses ``jax.sharding.reshard`` on Explicit axes and a
sharding constraint on Auto ones, as flax does.

The context mesh (:func:`current_mesh`) is the mesh of the innermost :func:`use_mesh` block or
:func:`mesh_map` trace, else the one ``jax.set_mesh`` installed, else None. Placements without a
mesh and bare ``PartitionSpec``\\ s use it.
"""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src import jaxapi
from dtenjax._src.topology.model import Topology

_current_mesh: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "dtenjax_current_mesh", default=None)

DEFAULT_AXIS_NAMES = ("x", "y", "z", "w")


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


def _axis_types(axis_types, ndim: int) -> tuple[AxisType, ...]:
  """``axis_types`` as one AxisType per axis (None: all Auto)."""
  if axis_types is None:
    return (AxisType.Auto,) * ndim
  if isinstance(axis_types, AxisType):
    return (axis_types,) * ndim
  types = tuple(axis_types)
  bad = [t for t in types if not isinstance(t, AxisType)]
  if bad or len(types) != ndim:
    raise errors.MeshError(
        f"axis_types={axis_types!r} must be one jax.sharding.AxisType (Auto, Explicit or "
        f"Manual) or a tuple of {ndim} of them, one per mesh axis"
        + (f"; {bad!r} are not AxisTypes" if bad else ""))
  return types


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


def make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], axis_types=None, *,
              devices: Sequence[Any] | None = None, topology: Topology | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` of ``axis_shapes`` whose inner axes stay on the fastest links.

  The signature of ``jax.make_mesh`` plus ``topology``.

  Args:
    axis_shapes: mesh axis sizes, outermost first; their product must equal the device count.
    axis_names: one name per axis.
    axis_types: ``jax.sharding.AxisType`` for every axis (``AxisType.Explicit``, say) or a tuple
      of one per axis; default all ``Auto`` (``jax.make_mesh``'s default is Explicit).
    devices: devices to use; default ``jax.devices()``.
    topology: the topology to order by; default ``Topology.current()``.
  """
  if isinstance(axis_shapes, (int, np.integer, str)) or not hasattr(axis_shapes, "__iter__"):
    raise errors.MeshError(
        f"axis_shapes={axis_shapes!r} must be a sequence of axis sizes, e.g. ({axis_shapes!r},) "
        "for one axis")
  if isinstance(axis_names, str) or not hasattr(axis_names, "__iter__"):
    raise errors.MeshError(
        f"axis_names={axis_names!r} must be a sequence of names, one per axis, e.g. "
        f"({axis_names!r},) for one axis")
  shape = tuple(axis_shapes)
  axis_names = tuple(axis_names)
  _check_axes(shape, axis_names)
  types = _axis_types(axis_types, len(shape))
  devices = list(jax.devices() if devices is None else devices)
  if math.prod(shape) != len(devices):
    hint = ""
    if len(shape) >= 1 and len(devices) % math.prod(shape[1:] or (1,)) == 0:
      fixed = (len(devices) // math.prod(shape[1:] or (1,)),) + shape[1:]
      hint = f" For example shape={fixed}."
    platform = devices[0].platform if devices else "none"
    simulate = ""
    if platform == "cpu" and math.prod(shape) > len(devices):
      simulate = (f" On CPU, JAX simulates {math.prod(shape)} devices when the process starts "
                  "with XLA_FLAGS=--xla_force_host_platform_device_count="
                  f"{math.prod(shape)} (set it in the environment, or in os.environ before "
                  "the first import of jax).")
    raise errors.MeshError(
        f"mesh shape {shape} holds {math.prod(shape)} devices but {len(devices)} are available "
        f"({platform}).{simulate} Otherwise choose a shape whose product is {len(devices)}, or "
        f"pass devices=[...] with {math.prod(shape)} devices.{hint}")
  if topology is None:
    topology = Topology.current()
  return _make_mesh_cached(shape, axis_names, topology, tuple(devices), types)


def topology_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], axis_types=None, *,
                  devices: Sequence[Any] | None = None,
                  topology: Topology | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` whose inner axes stay on the fastest links, with Auto axes unless
  ``axis_types`` says otherwise (``jax.make_mesh`` makes Explicit ones; hence its own name).

  Args:
    axis_shapes: mesh axis sizes, outermost first; their product must equal the device count.
    axis_names: one name per axis.
    axis_types: ``jax.sharding.AxisType`` for every axis (``AxisType.Explicit``, say) or a tuple
      of one per axis; default all ``Auto``.
    devices: devices to use; default ``jax.devices()``.
    topology: the topology to order by; default ``Topology.current()``.
  """
  return make_mesh(axis_shapes, axis_names, axis_types, devices=devices, topology=topology)


def deprecated_make_mesh(axis_shapes: Sequence[int], axis_names: Sequence[str], axis_types=None,
                         *, devices: Sequence[Any] | None = None,
                         topology: Topology | None = None) -> Mesh:
  """``dtenjax.make_mesh``: deprecated, the same as :func:`topology_mesh` (which see)."""
  warnings.warn(
      "dtenjax.make_mesh is deprecated: it makes Auto axes where jax.make_mesh makes Explicit "
      "ones, so it is now dtenjax.topology_mesh (same arguments); for JAX's behaviour use "
      "jax.make_mesh.", DeprecationWarning, stacklevel=2)
  return make_mesh(axis_shapes, axis_names, axis_types, devices=devices, topology=topology)


@functools.lru_cache(maxsize=256)
def _make_mesh_cached(shape: tuple[int, ...], axis_names: tuple[str, ...], topology: Topology,
                      devices: tuple[Any, ...], axis_types: tuple[AxisType, ...]) -> Mesh:
  # make_mesh is a pure function of its arguments; placements resolve their mesh once per leaf,
  # so caching it keeps planning a large pytree cheap (bench/planner.py).
  ordered = order_devices(devices, topology)
  return Mesh(np.asarray(ordered, dtype=object).reshape(shape), axis_names,
              axis_types=axis_types)


# --- the context mesh -------------------------------------------------------------------------

def jax_context_mesh() -> Mesh | None:
  """The concrete mesh ``jax.set_mesh`` installed, also while tracing under jit; else None."""
  try:
    mesh = jax.sharding.get_mesh()
  except ValueError:
    # Inside jit, jax.sharding.get_mesh refuses; the concrete mesh is still in jax's context.
    mesh = jaxapi.concrete_mesh()
  if mesh is None or not isinstance(mesh, Mesh) or mesh.empty:
    return None
  return mesh


def current_mesh() -> Mesh | None:
  """The context mesh: the innermost :func:`use_mesh` block or :func:`mesh_map` trace, else the
  mesh of ``jax.set_mesh``, else None."""
  mesh = _current_mesh.get()
  return mesh if mesh is not None else jax_context_mesh()


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Makes ``mesh`` the default for dtenjax calls (placements, bare PartitionSpecs, collectives'
  cost model). It does not enter ``jax.set_mesh``: jit programs keep their own context."""
  if not isinstance(mesh, Mesh):
    raise errors.MeshError(f"use_mesh takes a jax.sharding.Mesh, got {type(mesh).__name__}: "
                           f"{mesh!r}; build one with dtenjax.topology_mesh or jax.make_mesh.")
  token = _current_mesh.set(mesh)
  try:
    yield mesh
  finally:
    _current_mesh.reset(token)


def as_mesh(mesh: Mesh | Sequence[int] | None, axis_names: Sequence[str] | None = None,
            topology: Topology | None = None) -> Mesh:
  """A Mesh from a Mesh, a shape such as ``(2, 4)``, or None.

  None is the context mesh (:func:`current_mesh`), else a 1D mesh over all devices named "x".
  A shape takes the context mesh when that mesh has this shape (and ``axis_names``, when given),
  so arrays placed with ``Placement(mesh=(2, 4))`` meet the user's own ``jax.set_mesh`` mesh in
  one jit. Under ``jax.set_mesh`` a shape that does not fit the context mesh is an error (the two
  meshes could not meet in one jit); without a context mesh a topology-ordered mesh is made, its
  axes named ``axis_names`` or "x", "y", "z", "w".
  """
  if isinstance(mesh, Mesh):
    return mesh
  if mesh is None:
    cur = current_mesh()
    if cur is not None:
      return cur
    return make_mesh((len(jax.devices()),), ("x",), topology=topology)
  if isinstance(mesh, str) or not hasattr(mesh, "__iter__") or not all(
      isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in mesh):
    raise errors.MeshError(
        f"mesh={mesh!r} is not a mesh: pass a jax.sharding.Mesh, a shape of axis sizes such as "
        "(2, 4), or None for the context mesh (jax.set_mesh, dtenjax.use_mesh)")
  shape = tuple(int(s) for s in mesh)
  names = None if axis_names is None else tuple(axis_names)
  return _mesh_for_shape(shape, names, topology, _current_mesh.get(), jax_context_mesh())


@functools.lru_cache(maxsize=256)
def _mesh_for_shape(shape: tuple[int, ...], names: tuple[str, ...] | None,
                    topology: Topology | None, cur: Mesh | None, ctx: Mesh | None) -> Mesh:
  # Cached: placements resolve their mesh once per leaf (bench/planner.py).
  for candidate in (cur, ctx):
    if candidate is not None and tuple(candidate.devices.shape) == shape and (
        names is None or tuple(candidate.axis_names) == names):
      return candidate
  if ctx is not None and cur is None:
    want = f"mesh={shape}" + ("" if names is None else f", axis_names={names}")
    raise errors.MeshError(
        f"{want} does not fit the mesh jax.set_mesh put in context, {dict(ctx.shape)} "
        f"(axis types {tuple(t.name for t in ctx.axis_types)}); arrays on two different meshes "
        "cannot meet in one jit. Leave mesh=None to use the context mesh, pass that Mesh "
        "itself, or give the shape and axis names of the context mesh.")
  if names is None:
    names = (DEFAULT_AXIS_NAMES[:len(shape)] if len(shape) <= len(DEFAULT_AXIS_NAMES)
             else tuple(f"a{i}" for i in range(len(shape))))
  return make_mesh(shape, names, topology=topology)


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


def _bind(f: Callable, mesh: Mesh) -> Callable:
  @functools.wraps(f)
  def body(*args, **kwargs):
    token = _current_mesh.set(mesh)
    try:
      return f(*args, **kwargs)
    finally:
      _current_mesh.reset(token)
  return body


class _InferSpecs:
  """``in_specs`` left out: ``jax.shard_map``'s own default (inferred from Explicit axes)."""

  def __repr__(self) -> str:
    return "Infer"


_INFER = _InferSpecs()


def mesh_map(f: Callable | None = None, mesh: Mesh | Sequence[int] | None = None, *,
             out_specs: Any, in_specs: Any = _INFER, axis_names=frozenset(),
             check_vma: bool = True) -> Callable:
  """Runs ``f`` once per device on its shard, like ``pmap`` but over a (multi-axis) mesh.

  A thin, validated layer over ``jax.shard_map`` with its keyword arguments, defaults and
  meaning (``out_specs`` is required, as there; ``in_specs`` may be left out where jax infers it,
  on Explicit axes; ``axis_names`` makes only
  those axes manual; without ``f`` it returns a decorator). ``mesh`` may also be a shape such as
  ``(2, 4)`` or None (the context mesh). ``check_vma`` defaults to True as in ``jax.shard_map``:
  values from ``in_specs=P()`` are invariant across devices, ``jax.grad`` with respect to them
  already sums the per-device gradients, and dtenjax's collectives are typed as lax's (an
  ``all_reduce`` result is invariant over its axes, so ``out_specs=P()`` accepts it). Pass
  ``check_vma=False`` for pmap's meaning (per-device gradients, no checks).

  Composes with ``jit``, ``grad`` and ``vmap``; inside ``f``, mesh axis names are bound for
  collectives (``dtenjax.all_reduce(x, "x")``), and :func:`current_mesh` returns the concrete mesh
  so the cost model knows which devices take part.
  """
  if f is None:
    return functools.partial(mesh_map, mesh=mesh, out_specs=out_specs, in_specs=in_specs,
                             axis_names=axis_names, check_vma=check_vma)
  mesh = as_mesh(mesh)
  if in_specs is not _INFER:
    _check_specs(mesh, in_specs, "in_specs")
  _check_specs(mesh, out_specs, "out_specs")
  unknown = sorted(set(axis_names) - set(mesh.axis_names), key=str)
  if unknown:
    raise errors.MeshError(f"axis_names={set(axis_names)!r} names {unknown}, which mesh "
                           f"{dict(mesh.shape)} does not have; use its axis names "
                           f"{tuple(mesh.axis_names)}.")
  kwargs = dict(mesh=mesh, out_specs=out_specs, axis_names=frozenset(axis_names),
                check_vma=check_vma)
  if in_specs is not _INFER:
    kwargs["in_specs"] = in_specs
  mapped = jax.shard_map(_bind(f, mesh), **kwargs)
  if in_specs is _INFER or AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
    return mapped

  @functools.wraps(f)
  def laid_out(*args):
    # On Explicit axes (jax.make_mesh's default) jax.shard_map's in_specs only assert how the
    # inputs are sharded; mesh_map's lay the inputs out first (jax.sharding.reshard, under jit or
    # not), as jax.shard_map does on Auto axes: the same call works on either mesh.
    specs = in_specs if isinstance(in_specs, tuple) else (in_specs,) * len(args)
    if len(specs) != len(args):
      return mapped(*args)       # jax.shard_map's own error names the mismatch
    return mapped(*(_reshard(arg, spec, mesh) for arg, spec in zip(args, specs)))
  return laid_out


def _reshard(arg, spec, mesh: Mesh):
  """``arg`` (a pytree) laid out as ``spec`` (a prefix of it) says on ``mesh``."""
  is_spec = lambda x: x is None or isinstance(x, P)
  leaves, tree = jax.tree_util.tree_flatten(arg)
  specs = jax.tree_util.tree_leaves(jax.tree.broadcast(spec, arg, is_leaf=is_spec),
                                    is_leaf=is_spec)
  return jax.tree_util.tree_unflatten(tree, [
      x if sp is None or not hasattr(x, "shape") else
      jax.sharding.reshard(x, NamedSharding(mesh, sp)) for x, sp in zip(leaves, specs)])


# --- pmap -------------------------------------------------------------------------------------

def _argnums(value, what: str) -> tuple[int, ...]:
  if isinstance(value, (int, np.integer)):
    return (int(value),)
  try:
    out = tuple(int(v) for v in value)
  except TypeError:
    raise errors.ConfigurationError(
        f"{what}={value!r} must be an int or a sequence of ints (argument positions)") from None
  return out


def _leaf_axes(axes, tree, what: str) -> list:
  """One axis (int or None) per leaf of ``tree``, from ``axes``, a pytree prefix of ``tree``."""
  out = []

  def one(ax, sub):
    if ax is not None and not isinstance(ax, (int, np.integer)):
      raise errors.ConfigurationError(f"{what} entries must be ints or None, got {ax!r}")
    out.extend([None if ax is None else int(ax)] * len(jax.tree.leaves(sub)))

  try:
    jax.tree.map(one, axes, tree, is_leaf=lambda x: x is None)
  except ValueError as e:
    raise errors.ConfigurationError(
        f"{what}={axes!r} is not a pytree prefix of the arguments "
        f"({jax.tree.structure(tree)}): give one int/None per argument, or a tree that "
        f"matches the argument's outer structure ({e})") from None
  return out


_PMAP_AXIS = "_dtenjax_pmap"     # the mesh axis of pmap(axis_name=None): not nameable by f


def pmap(f: Callable, axis_name: str | None = None, *, in_axes: Any = 0, out_axes: Any = 0,
         static_broadcasted_argnums: int | Sequence[int] = (),
         devices: Sequence[Any] | None = None, backend: str | None = None,
         axis_size: int | None = None,
         donate_argnums: int | Sequence[int] = ()) -> Callable:
  """``jax.pmap`` over a dtenjax mesh: maps ``f`` over one axis of its arguments.

  The same arguments as ``jax.pmap`` and the same meaning:

  * ``axis_name``: the name collectives inside ``f`` use for the mapped axis (None: no name).
  * ``in_axes``: an int, None, or a tuple with one entry per positional argument (entries of
    static arguments are ignored), each a pytree prefix of its argument. An int is the mapped axis
    (negative counts from the end); None broadcasts the argument to every device unchanged
    (scalars, unreplicated params). Keyword arguments are mapped over axis 0, as in ``jax.pmap``.
  * the mapped size: the length of the mapped axes (all equal), or ``axis_size`` when nothing is
    mapped; it takes that many of ``devices`` (default ``jax.devices(backend)``), which must
    hold enough.
  * ``out_axes``: where the device axis goes in each output (an int, None or a pytree prefix of
    the outputs); None returns a value every device holds (device 0's, unchecked, as in pmap).
  * ``static_broadcasted_argnums``: positions of hashable Python arguments passed to ``f`` as
    they are; a new value compiles again.
  * ``donate_argnums``: positions whose buffers the step may reuse for its outputs.

  The result also has ``.lower(*args, **kwargs)``, as a jitted function does. Inside ``f``,
  ``axis_name`` is bound for collectives and :func:`current_mesh` is the mesh. Like ``jax.pmap``
  there is no varying-type check (``check_vma=False``): the gradient with respect to an unmapped
  (``in_axes=None``) argument is this device's own, not a sum over devices. Built on ``jax.jit``
  and ``jax.shard_map`` over :func:`make_mesh`'s topology-ordered 1D mesh of the first devices.
  """
  if axis_name is not None and not isinstance(axis_name, str):
    raise errors.ConfigurationError(f"pmap: axis_name={axis_name!r} must be a string or None")
  if axis_size is not None and (not isinstance(axis_size, (int, np.integer))
                                or isinstance(axis_size, bool) or axis_size < 1):
    raise errors.ConfigurationError(f"pmap: axis_size={axis_size!r} must be a positive int")
  devices = list(jax.devices(backend) if devices is None else devices)
  name = _PMAP_AXIS if axis_name is None else axis_name
  static = _argnums(static_broadcasted_argnums, "static_broadcasted_argnums")
  donate = _argnums(donate_argnums, "donate_argnums")
  clash = sorted(set(static) & set(donate))
  if clash:
    raise errors.ConfigurationError(
        f"argument positions {clash} are both static_broadcasted_argnums and donate_argnums; a "
        "static (Python) argument has no buffer to donate: drop them from one of the two.")

  def split(args):
    nargs = len(args)
    stat = {(i + nargs if i < 0 else i) for i in static}
    bad = [i for i in stat if not 0 <= i < nargs]
    if bad:
      raise errors.ConfigurationError(
          f"static_broadcasted_argnums {static} name positions {sorted(bad)} but f got {nargs} "
          "positional arguments")
    dyn_idx = [i for i in range(nargs) if i not in stat]
    if isinstance(in_axes, (tuple, list)):
      if len(in_axes) == nargs:
        axes = tuple(in_axes[i] for i in dyn_idx)
      elif len(in_axes) == len(dyn_idx):
        axes = tuple(in_axes)
      else:
        raise errors.ConfigurationError(
            f"in_axes has {len(in_axes)} entries but f got {nargs} positional arguments "
            f"({len(dyn_idx)} not static): give one entry per argument")
    else:
      axes = (in_axes,) * len(dyn_idx)
    return stat, dyn_idx, axes

  def mapped_size(args, kwargs) -> int:
    """The size of the mapped axis (checked on every mapped leaf)."""
    _, dyn_idx, axes = split(args)
    dyn = tuple(args[i] for i in dyn_idx)
    leaves = jax.tree.leaves((dyn, kwargs))
    leaf_axes = _leaf_axes(axes, dyn, "in_axes") + [0] * len(jax.tree.leaves(kwargs))
    problems, sizes = [], []
    for i, (leaf, ax) in enumerate(zip(leaves, leaf_axes)):
      if ax is None:
        continue
      shape = np.shape(leaf)
      if not -len(shape) <= ax < len(shape):
        problems.append(f"argument leaf {i} has shape {shape}; in_axes {ax} is not one of its "
                        f"axes (use in_axes=None to give every device the whole value)")
      else:
        sizes.append((i, shape, shape[ax]))
    n = axis_size if axis_size is not None else (sizes[0][2] if sizes else None)
    if n is None and not problems:
      problems.append("no argument is mapped (every in_axes is None); pass axis_size= to say "
                      "over how many devices to run")
    for i, shape, size in sizes:
      if n is not None and size != n:
        problems.append(f"argument leaf {i} has shape {shape}; its mapped axis has size {size} "
                        f"but the mapped size is {n}" + (" (axis_size)" if axis_size else "")
                        + ": every mapped axis must have the same size")
    if n is not None and n > len(devices):
      problems.append(f"the mapped size {n} exceeds the {len(devices)} devices available "
                      f"({devices[0].platform if devices else 'none'}); map over at most "
                      f"{len(devices)} slices or pass devices=[...]")
    if problems:
      raise errors.MeshError(errors.join_problems("dtenjax.pmap:", problems))
    return int(n)

  @functools.lru_cache(maxsize=None)
  def compiled(n: int):
    mesh = make_mesh((n,), (name,), devices=devices[:n])

    def run(*args, **kwargs):
      _, dyn_idx, axes = split(args)
      dyn = tuple(args[i] for i in dyn_idx)
      leaves, treedef = jax.tree.flatten((dyn, kwargs))
      leaf_axes = _leaf_axes(axes, dyn, "in_axes") + [0] * len(jax.tree.leaves(kwargs))
      moved = [x if ax is None else jnp.moveaxis(x, ax, 0) for x, ax in zip(leaves, leaf_axes)]
      in_specs = tuple(P() if ax is None else P(name) for ax in leaf_axes)
      traced = []      # (output treedef, per-leaf out axis), recorded while f is traced

      def per_device(*local):
        local = [x if ax is None else x[0] for x, ax in zip(local, leaf_axes)]
        d, kw = jax.tree.unflatten(treedef, local)
        full = list(args)
        for i, v in zip(dyn_idx, d):
          full[i] = v
        out = f(*full, **kw)
        o_leaves, o_tree = jax.tree.flatten(out)
        o_axes = _leaf_axes(out_axes, out, "out_axes")
        traced.append((o_tree, o_axes))
        mapped = [jnp.asarray(o)[None] for o, ax in zip(o_leaves, o_axes) if ax is not None]
        unmapped = [o for o, ax in zip(o_leaves, o_axes) if ax is None]
        return mapped, unmapped

      # Mapped outputs come back stacked along a new axis 0, unmapped ones as device 0 has them.
      # Traced inside the user's jit under jax.set_mesh: the context (which jax.shard_map
      # requires to be the mesh it runs on) is set aside; jax lets it only for the same size.
      ctx = jax.sharding.get_abstract_mesh()
      aside = not getattr(ctx, "empty", True)
      if aside and getattr(ctx, "size", None) != mesh.size:
        raise errors.ConfigurationError(
            f"dtenjax.pmap over {mesh.size} devices traced inside jit under jax.set_mesh of "
            f"{getattr(ctx, 'size', None)} devices ({dict(ctx.shape)}): jax runs a traced "
            "program on the context's devices only. Call the pmap outside the jit (it sets the "
            f"context aside there), map over {getattr(ctx, 'size', None)} slices, or trace it "
            "outside the jax.set_mesh block.")
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if aside else contextlib.nullcontext():
        mapped, unmapped = jax.shard_map(
            _bind(per_device, mesh), mesh=mesh, in_specs=in_specs, out_specs=(P(name), P()),
            check_vma=False)(*moved)
      o_tree, o_axes = traced[-1]
      mapped, unmapped = iter(mapped), iter(unmapped)
      outs = []
      for ax in o_axes:
        if ax is None:
          outs.append(next(unmapped))
        else:
          o = next(mapped)
          outs.append(jnp.moveaxis(o, 0, ax if ax >= 0 else ax + o.ndim))
      return jax.tree.unflatten(o_tree, outs)

    return jax.jit(run, static_argnums=static, donate_argnums=donate)

  def call(method: str, args, kwargs):
    outer = jaxapi.manual_axes()
    if outer:
      raise errors.ConfigurationError(
          f"dtenjax.pmap inside a pmap or shard_map body (manual axes {sorted(outer)}): nested "
          "pmap is not supported (jax.pmap fails there too); map over a mesh of both axes "
          "instead, e.g. dtenjax.mesh_map(f, jax.make_mesh((2, 4), ('i', 'j')), in_specs=..., "
          "out_specs=...)")
    n = mapped_size(args, kwargs)
    fn = compiled(n)
    # pmap's mesh is its own, as jax.pmap knew no meshes: a jax.set_mesh context around the call
    # (jax.shard_map requires it to be the mesh it runs on) is set aside, and arrays committed
    # elsewhere (another mesh's shards, one device) move onto it first. Under a context of
    # Explicit axes the results move onto the context's mesh (to_context).
    ctx = jaxapi.concrete_mesh()
    if (method != "__call__" or ctx is None
        or AxisType.Explicit not in tuple(getattr(ctx, "axis_types", ()))):
      ctx = None
    mesh = make_mesh((n,), (name,), devices=devices[:n])
    _, dyn_idx, axes = split(args)
    dyn = tuple(args[i] for i in dyn_idx)
    leaves, treedef = jax.tree.flatten((dyn, kwargs))
    leaf_axes = _leaf_axes(axes, dyn, "in_axes") + [0] * len(jax.tree.leaves(kwargs))
    traced = any(isinstance(x, jax.core.Tracer) for x in leaves)
    split_ctx = None if ctx is None else (
        tuple(ctx.axis_names) if len(ctx.axis_names) > 1 else ctx.axis_names[0])
    # a leaf's layout on the context: its mapped axis split over all the context's axes where
    # it has their size (one slice a device, as pmap lays it out), else whole on each device
    there = lambda x, ax: _split_at(None if n != ctx.size else ax, np.ndim(x), split_ctx)
    if traced and ctx is None:
      return getattr(fn, method)(*args, **kwargs)
    if traced:
      # Traced values cross from the context's Explicit axes onto pmap's mesh, and their
      # gradients back (else jax.grad's cotangent would come back typed on pmap's mesh). They
      # are laid out on the context's axes first (jax.sharding.reshard, whose transpose types
      # the gradient as jax's own operations do).
      moved = [_carry(jax.sharding.reshard(x, there(x, ax)),
                      NamedSharding(mesh, _split_at(ax, np.ndim(x), name)),
                      NamedSharding(ctx, there(x, ax)))
               if isinstance(x, jax.core.Tracer) else x
               for x, ax in zip(leaves, leaf_axes)]
    else:
      moved = [_onto(x, mesh, ax, name) for x, ax in zip(leaves, leaf_axes)]
    dyn, kwargs = jax.tree.unflatten(treedef, moved)
    args = list(args)
    for i, v in zip(dyn_idx, dyn):
      args[i] = v
    if traced:
      out = getattr(fn, method)(*args, **kwargs)
    else:
      with jax.set_mesh(mesh):
        out = getattr(fn, method)(*args, **kwargs)
    return out if ctx is None else to_context(out, ctx, mesh, there)

  def to_context(out, ctx: Mesh, mesh: Mesh, there):
    """``out`` on the caller's ``jax.set_mesh`` mesh of Explicit axes: an array left on pmap's
    own mesh is refused by every later operation there ("context mesh ... should match the aval
    mesh"). The mapped axis is split over all the context's axes where it has their size (one
    slice a device, as pmap laid it out), else each device holds it whole."""
    leaves, tree = jax.tree.flatten(out)
    axes = _leaf_axes(out_axes, out, "out_axes")
    return jax.tree.unflatten(tree, [
        _carry(x, NamedSharding(ctx, there(x, ax)),
               NamedSharding(mesh, _split_at(ax, np.ndim(x), name)))
        for x, ax in zip(leaves, axes)])

  @functools.wraps(f)
  def wrapper(*args, **kwargs):
    return call("__call__", args, kwargs)

  wrapper.lower = lambda *args, **kwargs: call("lower", args, kwargs)
  return wrapper


def _split_at(ax: int | None, ndim: int, axes) -> P:
  """The spec splitting axis ``ax`` (None: none) of an array of ``ndim`` dims over ``axes``."""
  return P() if ax is None else P(*([None] * (ax % ndim)), axes)


def _carry(x, to, back):
  """``x`` put on sharding ``to``, its cotangent put back on ``back``: jax's own transpose of a
  device_put in a trace keeps the cotangent on ``to``, where the other mesh's program refuses
  it ("Expected cotangent type float32[8] but got float32[8@d]"). A value with no gradient
  (integers, bools) is only put."""
  if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
    return jax.device_put(x, to)

  @jax.custom_vjp
  def put(v):
    return jax.device_put(v, to)
  put.defvjp(lambda v: (jax.device_put(v, to), None), lambda _, ct: (jax.device_put(ct, back),))
  return put(x)


def _onto(x, mesh: Mesh, ax: int | None, name: str):
  """A committed jax.Array laid out on another mesh or device, moved onto pmap's ``mesh``
  (split along its mapped axis ``ax``, replicated where unmapped); anything else as it is."""
  if not isinstance(x, jax.Array) or not getattr(x, "committed", False):
    return x
  sharding = x.sharding
  if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
    return x
  spec = P() if ax is None else P(*([None] * (ax % x.ndim)), name)
  return jax.device_put(x, NamedSharding(mesh, spec))
