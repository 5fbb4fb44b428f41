"""Public collectives: ``all_reduce``, ``reduce_scatter``, ``all_gather`` and algorithm choice.

They run wherever JAX has named axes: inside ``jax.shard_map`` / ``mesh_map`` (under jit or
not) and over ``jax.vmap(..., axis_name=...)`` axes. ``axis_name`` may be a tuple of axes (treated
as one combined axis in mesh order). Arguments may be pytrees; an all-reduce of a pytree packs
its leaves into flat buckets of ``bucket_bytes`` (default ``DTENJAX_BUCKET_BYTES``) so a tree of
many small gradients costs few collectives (see ``buckets.py``).

Semantics and guarantees
------------------------
- Results are per-device (``varying``) values, as with ``pmap``-era collectives: the transpose of
  ``all_reduce(sum)`` is ``all_reduce(sum)`` of the cotangents, ``reduce_scatter`` and
  ``all_gather`` transpose into each other. Inside ``jax.shard_map(..., check_vma=True)`` return
  them with an ``out_specs`` that names the axis, or use ``check_vma=False``.
- ``deterministic=True`` (default): identical bits on every rank and every run for a given
  algorithm, world size and input shape; the order of each algorithm is documented in
  ``algorithms.py``. XLA's ``psum`` has an unspecified float reduction order, so
  ``algorithm="xla"`` with ``deterministic=True`` keeps XLA's collectives for data movement only:
  a float sum or mean becomes XLA all-gather + dtenjax's fixed rank-order reduction (the same bits
  as ``one_shot``), while max, min and integer sums (exact in any order) stay on ``psum``/``pmax``.
  ``deterministic=False`` with ``algorithm="xla"`` is plain ``lax.psum``.
- ``reproducible=True``: an exact fixed-point sum (``fixed_point.py``): the bits do not depend on
  the algorithm or on how the same contributions are split over devices. With ``local_axis`` the
  input holds several contributions stacked on that axis; each is encoded on its own, so the
  result equals that of the same contributions spread over more devices. float32 / bfloat16 only.
- ``vmap``: mapping over an ordinary (unnamed) batch dimension reduces every batch element
  independently across devices; ``jax.vmap(f, axis_name="v")`` makes "v" a valid ``axis_name``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dtenjax._src.collectives import algorithms as alg
from dtenjax._src.collectives import buckets
from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.collectives import fixed_point

AxisName = alg.AxisName
_ALGOS = alg.ALGORITHMS + ("auto",)


# --- validation at the Python boundary ----------------------------------------------------------

def _bound_axes() -> dict[str, int]:
  try:
    from jax._src import core   # private; only used to list axes in an error message
    return dict(core.get_axis_env().axis_sizes)
  except Exception:  # noqa: BLE001 - message quality only
    return {}


def check_axes(axis_name: AxisName, what: str) -> tuple[str, ...]:
  """The axis names as a tuple; raises CollectiveError naming unbound axes and the bound ones."""
  axes = alg.axis_tuple(axis_name)
  if not axes:
    raise errors.CollectiveError(f"{what}: axis_name={axis_name!r} is empty; pass a mesh axis "
                                 "name or a tuple of them.")
  bad = []
  for a in axes:
    try:
      lax.axis_size(a)
    except NameError:
      bad.append(a)
  if bad:
    bound = _bound_axes()
    raise errors.CollectiveError(
        f"{what}: axis name(s) {bad} are not bound here (axes in scope: "
        f"{sorted(bound) or 'none'}). Call it inside jax.shard_map / dtenjax.mesh_map over a mesh "
        "with that axis (or jax.vmap(..., axis_name=...)), and spell the name as the mesh does.")
  if len(set(axes)) != len(axes):
    raise errors.CollectiveError(f"{what}: axis_name={axis_name!r} repeats an axis; name each "
                                 "mesh axis once.")
  return axes


def _check_common(what: str, op: str, algorithm: str, ops: Sequence[str] = alg.OPS):
  problems = []
  if op not in ops:
    problems.append(f"op={op!r} is not supported; use one of {list(ops)}")
  if algorithm not in _ALGOS:
    problems.append(f"algorithm={algorithm!r} is unknown; use one of {list(_ALGOS)}")
  if problems:
    raise errors.CollectiveError(errors.join_problems(f"{what}: bad arguments", problems))


def _check_leaf(what: str, x, op: str, reproducible: bool):
  dtype = jnp.result_type(x)
  if reproducible:
    if op not in ("sum", "mean", "max", "min"):
      raise errors.CollectiveError(f"{what}: op={op!r} has no reproducible form")
    if op in ("sum", "mean"):
      fixed_point.check_dtype(dtype, f"{what}(reproducible=True)")
  if jnp.dtype(dtype) == jnp.dtype(bool) and op in ("sum", "mean"):
    raise errors.CollectiveError(f"{what}: op={op!r} on a bool array; cast it first "
                                 "(x.astype(jnp.int32)).")
  if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
    raise errors.CollectiveError(f"{what}: op='mean' on {jnp.dtype(dtype).name} would truncate; "
                                 "cast to a float dtype or use op='sum'.")


def _optional(name: str):
  """A sibling module that other engineers own and may not have landed yet (ImportError then)."""
  return importlib.import_module(name)


# --- algorithm choice -----------------------------------------------------------------------------

class AlgorithmChoice(NamedTuple):
  """What ``auto`` chose and why: data for ``explain``."""
  algorithm: str
  times: dict[str, float]
  reason: str


# Fallback alpha-beta constants, used only when the lead's cost model cannot be imported.
FALLBACK_ALPHA_S = 10e-6          # per collective step latency
FALLBACK_BW = 20e9                # bytes/s inside an island
FALLBACK_CROSS_BW = 2e9           # bytes/s between islands (processes/hosts)


def fallback_time(algorithm: str, nbytes: int, n: int, islands: int = 1) -> float:
  """Alpha-beta estimate of one all-reduce (seconds); islands > 1 slows cross-island bytes."""
  a, b = FALLBACK_ALPHA_S, nbytes / (FALLBACK_CROSS_BW if islands > 1 else FALLBACK_BW)
  if n <= 1:
    return 0.0
  if algorithm == "one_shot":
    return a + (n - 1) * b
  if algorithm in ("two_shot", "xla"):
    return 2 * a + 2 * (n - 1) / n * b
  if algorithm == "ring":
    return 2 * (n - 1) * a + 2 * (n - 1) / n * b
  if algorithm == "hierarchical":
    m = max(n // max(islands, 1), 1)
    inner = nbytes / FALLBACK_BW
    inside = 2 * a + 2 * (m - 1) / m * inner if m > 1 else 0.0
    k = max(islands, 1)
    return inside + a + (k - 1) * (nbytes / m) / FALLBACK_CROSS_BW
  raise KeyError(algorithm)


def plan_all_reduce(nbytes: int, group: Sequence[int], topology: Any, *,
                    candidates: Sequence[str] = ("one_shot", "two_shot", "ring"),
                    kind: str = "all_reduce", costmodel: Any = None,
                    islands: int = 1) -> AlgorithmChoice:
  """Pure choice of an algorithm for one collective of ``nbytes`` per rank over ``group``.

  Uses ``costmodel.rank_algorithms`` (the lead's alpha-beta model fed by topology probes); when
  that module is unavailable, the documented fallback model :func:`fallback_time` with
  ``islands`` islands. Ties go to the name that sorts first.
  """
  cands = sorted(set(candidates))
  if costmodel is None:
    try:
      costmodel = _optional("dtenjax._src.planning.costmodel")
    except ImportError:
      costmodel = None
  ranked = None
  if costmodel is not None and topology is not None:
    try:
      ranked = list(costmodel.rank_algorithms(kind, int(nbytes), list(group), topology, cands))
      source = "cost model"
    except errors.DtenjaxError as e:   # e.g. a group the topology does not describe
      config.log_once(f"auto-model-error:{e}", f"dtenjax: cost model refused ({e}); algorithm="
                      "'auto' uses the built-in alpha-beta fallback for this call.")
  if ranked is None:
    config.log_once("auto-fallback", "dtenjax: no cost model/topology available; algorithm="
                    "'auto' uses the built-in alpha-beta fallback (collectives.fallback_time).")
    ranked = sorted(((c, fallback_time(c, nbytes, len(group), islands)) for c in cands),
                    key=lambda t: (t[1], t[0]))
    source = "fallback alpha-beta model"
  times = {name: float(t) for name, t in ranked}
  best = ranked[0][0]
  reason = (f"{source}: {best} is fastest for {nbytes} B over {len(group)} ranks "
            + ", ".join(f"{k}={v * 1e6:.1f}us" for k, v in ranked))
  return AlgorithmChoice(best, times, reason)


def _group_and_topology(axes: tuple[str, ...]):
  """Global device ids of one group along ``axes`` and the topology, when they can be known."""
  n = alg.axis_size(axes)
  topo = None
  try:
    topo = _optional("dtenjax._src.topology.model").Topology.current()
  except Exception:  # noqa: BLE001 - ImportError until it lands; any failure means "unknown"
    topo = None
  mesh = None
  try:
    mesh = _optional("dtenjax._src.planning.mesh").current_mesh()
  except Exception:  # noqa: BLE001
    mesh = None
  if mesh is not None and all(a in mesh.axis_names for a in axes):
    import numpy as np  # noqa: PLC0415
    devs = np.asarray(mesh.devices)
    names = list(mesh.axis_names)
    idx = tuple(slice(None) if nm in axes else 0 for nm in names)
    sub = devs[idx]
    kept = [nm for nm in names if nm in axes]
    sub = np.transpose(sub, [kept.index(a) for a in axes]).reshape(-1)
    devices = list(sub)
  else:
    devices = jax.devices()[:n] if len(jax.devices()) >= n else jax.devices()
  group = [d.id for d in devices]
  islands = len({getattr(d, "process_index", 0) for d in devices})
  return group, topo, islands


def choose(axes: tuple[str, ...], nbytes: int, op: str, dtype, deterministic: bool,
           kind: str = "all_reduce") -> AlgorithmChoice:
  group, topo, islands = _group_and_topology(axes)
  cands = alg.candidates(axes, op, dtype, deterministic, kind)
  if kind != "all_reduce":
    cands = [c for c in cands if c != "hierarchical"]
  return plan_all_reduce(nbytes, group, topo, candidates=cands, kind=kind, islands=islands)


# --- plug-ins: GPU NVLink kernels and cross-process transports (other modules, optional) ---------

def _p2p_module():
  try:
    return _optional("dtenjax._src.gpu.p2p")
  except ImportError:
    return None


def _hostcoll_module():
  try:
    return _optional("dtenjax._src.net.hostcoll")
  except ImportError:
    return None


def _plugin(x, axes, algorithm: str, op: str):
  """A custom implementation of ``algorithm`` for this call, or None (use XLA-native)."""
  name = axes[0] if len(axes) == 1 else axes     # plug-ins take a plain name for one axis
  if algorithm in ("ring", "hierarchical"):
    hc = _hostcoll_module()
    if hc is not None and hc.spans_processes(name):
      return functools.partial(hc.all_reduce, axis_name=name, algorithm=algorithm, op=op)
  if algorithm in ("one_shot", "two_shot") and jax.default_backend() == "gpu":
    p2p = _p2p_module()
    if p2p is None:
      config.log_fallback("p2p-missing", f"dtenjax: {algorithm} on GPU uses the XLA-native form "
                          "(dtenjax._src.gpu.p2p is not available)")
      return None
    ok, why = p2p.supported(alg.axis_size(axes), x.size * x.dtype.itemsize, x.dtype, op=op)
    if ok:
      # The kernels learn which GPU is which rank from the concrete mesh when lowered; if their
      # set-up fails there, the bit-identical XLA-native form is lowered instead.
      def fallback(v, algorithm=algorithm):
        count = alg.axis_size(axes)
        finish = lambda y: (y / jnp.asarray(count, y.dtype) if op == "mean" else y).astype(v.dtype)
        return alg.ALL_REDUCE[algorithm](v, axes, op, finish)
      return functools.partial(p2p.all_reduce, axis_name=axes, algorithm=algorithm, op=op,
                               fallback=fallback)
    config.log_fallback(f"p2p:{why}", f"dtenjax: {algorithm} NVLink kernel not used ({why}); "
                        "using the XLA-native form")
  return None


# --- single-array all-reduce with its JVP -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Spec:
  axes: tuple[str, ...]
  op: str
  algorithm: str
  deterministic: bool
  reproducible: bool
  local_axis: int | None = None
  use_plugins: bool = True


def _resolve(spec: _Spec, x) -> str:
  if spec.algorithm != "auto":
    return spec.algorithm
  return choose(spec.axes, x.size * jnp.dtype(x.dtype).itemsize, spec.op, x.dtype,
                spec.deterministic).algorithm


def _float_all_reduce(x, spec: _Spec, algorithm: str, count: int):
  """The non-reproducible path: XLA-native algorithm (or plug-in) with finish = mean + cast."""
  op, out_dtype = spec.op, x.dtype
  if spec.use_plugins:
    plug = _plugin(x, spec.axes, algorithm, op)
    if plug is not None:
      return plug(x)

  def finish(y):
    if op == "mean":
      y = y / jnp.asarray(count, y.dtype)
    return y.astype(out_dtype)

  exact = op in ("max", "min") or not jnp.issubdtype(x.dtype, jnp.floating)
  if algorithm == "xla" and spec.deterministic and not exact:
    algorithm = "one_shot"
  return alg.ALL_REDUCE[algorithm](x, spec.axes, op, finish)


def _reproducible_all_reduce(x, spec: _Spec, algorithm: str):
  """analyze -> pmax, encode -> exact integer sum with ``algorithm``, decode."""
  if spec.local_axis is not None:
    stack = jnp.moveaxis(x, spec.local_axis, 0)
  else:
    stack = x[None]
  k = stack.shape[0]
  n = alg.axis_size(spec.axes)
  if k * n > fixed_point.MAX_CONTRIBUTIONS:
    raise errors.CollectiveError(
        f"reproducible all_reduce of {k * n} contributions exceeds the exact-integer limit of "
        f"{fixed_point.MAX_CONTRIBUTIONS}; reduce in stages or use reproducible=False.")
  meta = jnp.max(fixed_point.analyze(stack), axis=1)            # [3, ...] local max
  meta = lax.pmax(meta, spec.axes)                              # exact, order-free
  e_max = jnp.broadcast_to(meta[0], stack.shape)
  words = fixed_point.encode(stack, e_max)                      # [2, k, ...]
  local = words[:, 0]
  for i in range(1, k):                                         # integer adds: exact
    local = local + words[:, i]
  isum = dataclasses.replace(spec, op="sum", reproducible=False, use_plugins=False)
  total = _float_all_reduce(local, isum, "xla" if algorithm == "xla" else algorithm, n)
  if spec.op == "mean":
    r = fixed_point.decode(total, meta, jnp.float32)
    return (r / jnp.float32(k * n)).astype(x.dtype)
  return fixed_point.decode(total, meta, x.dtype)


def _impl(x, spec: _Spec):
  algorithm = _resolve(spec, x)
  n = alg.axis_size(spec.axes)
  if spec.reproducible and spec.op in ("sum", "mean"):
    return _reproducible_all_reduce(x, spec, algorithm)
  if spec.local_axis is not None:   # max / min over local contributions: exact in any order
    x = alg.ordered_reduce(jnp.moveaxis(x, spec.local_axis, 0), spec.op, x.dtype)
  return _float_all_reduce(x, spec, algorithm, n)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _all_reduce_array(x, spec: _Spec):
  return _impl(x, spec)


@_all_reduce_array.defjvp
def _all_reduce_jvp(spec: _Spec, primals, tangents):
  (x,), (t,) = primals, tangents
  y = _all_reduce_array(x, spec)
  algorithm = _resolve(spec, x)
  lin = dataclasses.replace(spec, op="sum", reproducible=False, local_axis=None,
                            algorithm="one_shot" if algorithm == "xla" else algorithm,
                            use_plugins=False)
  n = alg.axis_size(spec.axes)
  if spec.op in ("sum", "mean"):
    if spec.local_axis is not None:
      t = jnp.sum(t, axis=spec.local_axis)
    k = x.shape[spec.local_axis] if spec.local_axis is not None else 1
    dt = _impl(t, lin)
    return y, dt / (n * k) if spec.op == "mean" else dt
  # max / min: the tangent of the selected element(s), ties share equally (like jnp.max)
  yb = jnp.expand_dims(y, spec.local_axis) if spec.local_axis is not None else y
  mask = (x == yb).astype(t.dtype)
  mt, mc = mask * t, mask
  if spec.local_axis is not None:
    mt, mc = jnp.sum(mt, axis=spec.local_axis), jnp.sum(mc, axis=spec.local_axis)
  return y, _impl(mt, lin) / _impl(mc, lin)


def all_reduce(x, axis_name: AxisName, *, op: str = "sum", algorithm: str = "auto",
               deterministic: bool = True, reproducible: bool = False,
               local_axis: int | None = None, bucket_bytes: int | None = None):
  """All-reduce of ``x`` (array or pytree) over the named axis/axes ``axis_name``.

  Args:
    op: "sum", "mean", "max" or "min".
    algorithm: "auto" (cost model), "xla", "ring", "hierarchical" (needs >= 2 axes: the last
      is the fast island axis), "one_shot" or "two_shot".
    deterministic: fixed reduction order (see the module docstring for what "xla" means here).
    reproducible: exact fixed-point sum; the same bits for every algorithm and device split.
    local_axis: with reproducible=True or op max/min, the axis of ``x`` holding several local
      contributions (summed exactly with the other devices'; the axis is removed).
    bucket_bytes: pytree leaves are packed into flat buffers of at most this many bytes
      (default DTENJAX_BUCKET_BYTES; 0 = one collective per leaf).
  """
  _check_common("all_reduce", op, algorithm)
  axes = check_axes(axis_name, "all_reduce")
  if algorithm == "hierarchical" and len(axes) < 2:
    raise errors.CollectiveError(
        f"all_reduce: algorithm='hierarchical' needs two mesh axes (islands, devices per "
        f"island), got axis_name={axis_name!r}; pass e.g. axis_name=('host', 'local') or use "
        "algorithm='two_shot'/'ring'.")
  if local_axis is not None and not reproducible and op in ("sum", "mean"):
    raise errors.CollectiveError(
        f"all_reduce: local_axis={local_axis} with op={op!r} needs reproducible=True (it is the "
        "exact sum of stacked local contributions); sum the axis yourself otherwise.")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  leaves = [jnp.asarray(leaf) for leaf in leaves]
  for leaf in leaves:
    _check_leaf("all_reduce", leaf, op, reproducible)
    if local_axis is not None and not -leaf.ndim <= local_axis < leaf.ndim:
      raise errors.CollectiveError(f"all_reduce: local_axis={local_axis} is out of range for "
                                   f"shape {leaf.shape}; pass an axis of x.")
  spec = _Spec(axes, op, algorithm, bool(deterministic), bool(reproducible),
               None if local_axis is None else int(local_axis))
  if bucket_bytes is None:
    bucket_bytes = config.get_int("DTENJAX_BUCKET_BYTES")
  if len(leaves) > 1 and bucket_bytes > 0 and local_axis is None:
    out = buckets.bucketed_apply(leaves, lambda flat: _all_reduce_array(flat, spec), bucket_bytes)
  else:
    out = [_all_reduce_array(leaf, spec) for leaf in leaves]
  return jax.tree_util.tree_unflatten(treedef, out)


# --- reduce_scatter / all_gather: transposes of each other ----------------------------------------

@dataclasses.dataclass(frozen=True)
class _RSSpec:
  axes: tuple[str, ...]
  op: str
  algorithm: str
  deterministic: bool
  dim: int
  tiled: bool = True


def _rs_impl(x, s: _RSSpec):
  n = alg.axis_size(s.axes)
  algorithm = s.algorithm
  if algorithm == "auto":
    algorithm = choose(s.axes, x.size * x.dtype.itemsize, s.op, x.dtype, s.deterministic,
                       "reduce_scatter").algorithm
  blocks = jnp.moveaxis(x, s.dim, 0)
  blocks = blocks.reshape((n, blocks.shape[0] // n) + blocks.shape[1:])
  y = alg.reduce_scatter_blocks(blocks, s.axes, s.op, algorithm, s.deterministic)
  if s.op == "mean":
    y = y / jnp.asarray(n, y.dtype)
  y = jnp.moveaxis(y.astype(x.dtype), 0, s.dim)
  return y


def _ag_impl(x, s: _RSSpec):
  algorithm = "xla" if s.algorithm in ("auto", "one_shot", "two_shot", "hierarchical") \
      else s.algorithm
  g = alg.all_gather_blocks(x, s.axes, algorithm)       # [n, *x.shape]
  if not s.tiled:
    return jnp.moveaxis(g, 0, s.dim)
  g = jnp.moveaxis(g, 0, s.dim)
  shape = x.shape[:s.dim] + (g.shape[s.dim] * g.shape[s.dim + 1],) + x.shape[s.dim + 1:]
  return g.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reduce_scatter_array(x, s: _RSSpec):
  return _rs_impl(x, s)


def _rs_fwd(x, s):
  return _rs_impl(x, s), None


def _rs_bwd(s, _, ct):
  ag = dataclasses.replace(s, algorithm="xla", tiled=True)
  out = _ag_impl(ct, ag)
  if s.op == "mean":
    out = out / jnp.asarray(alg.axis_size(s.axes), out.dtype)
  return (out,)


_reduce_scatter_array.defvjp(_rs_fwd, _rs_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_gather_array(x, s: _RSSpec):
  return _ag_impl(x, s)


def _ag_fwd(x, s):
  return _ag_impl(x, s), None


def _ag_bwd(s, _, ct):
  rs = dataclasses.replace(s, op="sum", algorithm="two_shot" if s.deterministic else "xla")
  if s.tiled:
    return (_rs_impl(ct, rs),)
  ct = jnp.moveaxis(ct, s.dim, 0)                      # [n, *x.shape]
  out = _rs_impl(ct, dataclasses.replace(rs, dim=0))   # [1, *x.shape]
  return (out[0],)


_all_gather_array.defvjp(_ag_fwd, _ag_bwd)


def reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int, op: str = "sum",
                   algorithm: str = "auto", deterministic: bool = True):
  """Reduces over ``axis_name`` and leaves rank r with block r of ``scatter_dimension``.

  Like ``lax.psum_scatter(..., tiled=True)``; the transpose is :func:`all_gather`.
  Algorithms: "ring" (ppermute ring), "one_shot" (all_gather + ordered reduction of the owned
  block), "two_shot" (all_to_all + ordered reduction), "xla" (psum_scatter when
  deterministic=False, else as two_shot), "auto".
  """
  _check_common("reduce_scatter", op, algorithm)
  axes = check_axes(axis_name, "reduce_scatter")
  if algorithm == "hierarchical":
    raise errors.CollectiveError("reduce_scatter: algorithm='hierarchical' is not available; "
                                 "use 'two_shot', 'ring' or 'auto'.")
  n = alg.axis_size(axes)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  problems, out = [], []
  for i, leaf in enumerate(leaves):
    leaf = jnp.asarray(leaf)
    _check_leaf("reduce_scatter", leaf, op, False)
    if not -leaf.ndim <= scatter_dimension < leaf.ndim:
      problems.append(f"leaf {i} shape {leaf.shape}: scatter_dimension={scatter_dimension} is "
                      "out of range")
      continue
    dim = scatter_dimension % leaf.ndim
    if leaf.shape[dim] % n:
      problems.append(f"leaf {i} shape {leaf.shape}: dimension {dim} of size {leaf.shape[dim]} "
                      f"is not divisible by the size {n} of axis {axis_name!r}; pad it to a "
                      f"multiple of {n} or pick another scatter_dimension")
      continue
    out.append(_reduce_scatter_array(leaf, _RSSpec(axes, op, algorithm, bool(deterministic),
                                                   dim)))
  if problems:
    raise errors.CollectiveError(errors.join_problems("reduce_scatter: bad inputs", problems))
  return jax.tree_util.tree_unflatten(treedef, out)


def all_gather(x, axis_name: AxisName, *, axis: int = 0, tiled: bool = False,
               algorithm: str = "auto", deterministic: bool = True):
  """Gathers ``x`` from every rank along ``axis`` (stacked, or concatenated when ``tiled``).

  Pure data movement, so the bits never depend on the algorithm: "ring" is a ppermute ring,
  every other name uses XLA's all-gather. The transpose is :func:`reduce_scatter` (deterministic
  two_shot order when ``deterministic``).
  """
  _check_common("all_gather", "sum", algorithm)
  axes = check_axes(axis_name, "all_gather")
  leaves, treedef = jax.tree_util.tree_flatten(x)
  out, problems = [], []
  for i, leaf in enumerate(leaves):
    leaf = jnp.asarray(leaf)
    nd = leaf.ndim if tiled else leaf.ndim + 1
    if not -nd <= axis < nd or (tiled and leaf.ndim == 0):
      problems.append(f"leaf {i} shape {leaf.shape}: axis={axis} is out of range "
                      f"(tiled={tiled})")
      continue
    out.append(_all_gather_array(leaf, _RSSpec(axes, "sum", algorithm, bool(deterministic),
                                               axis % nd, bool(tiled))))
  if problems:
    raise errors.CollectiveError(errors.join_problems("all_gather: bad inputs", problems))
  return jax.tree_util.tree_unflatten(treedef, out)


def nbytes_of(x) -> int:
  return int(sum(math.prod(jnp.shape(l)) * jnp.result_type(l).itemsize
                 for l in jax.tree_util.tree_leaves(x)))
