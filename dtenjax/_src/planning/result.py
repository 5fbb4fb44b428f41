"""The whole-step planner's answer (:class:`StepPlan`) and how it is applied: the mesh, one
NamedSharding per argument leaf, ``jit`` with them, and the report."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src import tables
from dtenjax._src.pipeline import run as run_lib
from dtenjax._src.planning import check as check_lib
from dtenjax._src.planning import gather
from dtenjax._src.planning import jaxpr_reader
from dtenjax._src.planning import sequence as sequence_lib
from dtenjax._src.planning.candidates import AxisLink
from dtenjax._src.planning.candidates import axis_links
from dtenjax._src.planning.candidates import spec_entry
from dtenjax._src.planning.candidates import splits_batch
from dtenjax._src.planning.pricing import StepCost
from dtenjax._src.planning.pricing import gradient_on_shard
from dtenjax._src.planning.roles import AXES
from dtenjax._src.planning.roles import BATCH_AXES
from dtenjax._src.planning.roles import ROUTED_AXES
from dtenjax._src.planning.roles import SEQUENCE_AXES
from dtenjax._src.planning.roles import sequence as sequence_role
from dtenjax._src.planning.solver import Problem


@dataclasses.dataclass(frozen=True)
class LeafPlan:
  path: str
  shape: tuple[int, ...]
  dtype: str
  spec: P
  reason: str


@dataclasses.dataclass(frozen=True)
class Alternative:
  """A standard recipe (or another mesh) priced by the same model."""
  name: str
  mesh_shape: dict[str, int]
  cost: StepCost | None
  note: str = ""


class Measured(NamedTuple):
  """One candidate of ``plan(..., measure=True)`` (``StepPlan.measured``), as run on the
  devices: its median seconds per step, its compiled memory per device (``memory_analysis()``:
  arguments, outputs not aliased, temporaries), the median over the rounds of its time over the
  fastest candidate that may be kept (``vs_fastest``) with that ratio's spread (half the
  interquartile range), and whether it was kept or why not."""
  name: str
  seconds: float
  memory_bytes: float
  vs_fastest: float
  spread: float
  note: str


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
  """The pipeline a :class:`StepPlan` chose (``plan.pipeline``; None when it has no stages): the
  values :func:`dtenjax.pipeline` takes, and what the planner predicted for them.

  ``stages`` is the size of the plan's ``stage`` mesh axis (``plan.mesh()`` has it), over which
  the ``layers`` of the step's scanned stack are split into contiguous stages of
  ``layers // stages``; ``microbatches`` splits the batch each pipeline sees (the global batch
  over the plan's data and fsdp axes); ``schedule`` is a :class:`dtenjax.Schedule`.
  ``pipe = plan.pipeline.make(body, loss_fn)`` builds the pipelined loss; the stacked leaves'
  specs in ``plan.specs`` put their layer dimension over ``stage`` (``P("stage", ...)``), as
  ``pipe.to_stages`` expects."""
  stages: int
  microbatches: int
  schedule: Any
  layers: int
  axis: str = "stage"
  bubble: float = 0.0             # dtenjax.pipeline_cost's lockstep bubble for these numbers
  ticks: int = 0
  inputs_held: int = 0            # micro-batch inputs one device holds at most
  message_bytes: float = 0.0      # one micro-batch's activation at a stage boundary, per device
  send_s: float = 0.0             # the sends of one step (activations and cotangents)
  link: str = ""                  # the link class between neighbouring stages

  def kwargs(self) -> dict[str, Any]:
    """``dict(stages=, microbatches=, schedule=, axis=)`` for ``dtenjax.pipeline``."""
    return dict(stages=self.stages, microbatches=self.microbatches, schedule=self.schedule,
                axis=self.axis)

  def make(self, body: Callable, loss_fn: Callable):
    """``dtenjax.pipeline(body, loss_fn, **self.kwargs())``."""
    return run_lib.pipeline(body, loss_fn, **self.kwargs())


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """The planner's answer for a whole step (see the module docstring).

  ``specs`` holds one PartitionSpec per argument leaf, in the arguments' tree structure;
  :meth:`shardings` turns them into NamedShardings on :meth:`mesh`, and :meth:`shard` places
  arguments with them. ``table()`` (or ``str(plan)``) is the report."""
  axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  device_ids: tuple[int, ...]
  axes: tuple[AxisLink, ...]
  leaves: tuple[LeafPlan, ...]
  specs: tuple[Any, ...]
  cost: StepCost
  recipes: tuple[Alternative, ...]
  budget_bytes: float
  topology: str
  planning_s: float
  meshes_tried: int
  notes: tuple[str, ...] = ()
  out_specs: Any = None          # PartitionSpecs of the step's outputs (state outputs like state)
  # per argument: None, or a tree holding, for each FSDP-sharded weight, its layout for compute
  # (the spec without the batch axes) and None for every other leaf
  compute_specs: tuple[Any, ...] = ()
  donate: bool = False           # planned for a step whose state arguments are donated
  # the arguments the step returns a new value of (StepGraph.returned): those plan.jit donates
  # for donate=True; None (unknown) donates every argument but the batch
  returned_argnums: tuple[int, ...] | None = None
  nvls: bool = False             # the topology's NVLink SHARP state the plan was priced with
  batch_argnums: tuple[int, ...] = ()
  # plan(..., measure=True): every candidate as run on the devices, fastest first
  measured: tuple[Measured, ...] = ()
  # the pipeline over the 'stage' axis (None: the plan has no stages)
  pipeline: PipelinePlan | None = None
  # what compute and collectives were priced with (Topology.pricing_summary: the calibration's
  # measurements or the table priors)
  priced_with: str = ""
  # the step runs a jax.shard_map over the user's own mesh on the batch whose results plan.jit
  # pins to the plan's batch layout: "" none, "coarser" those gather.pins_manual pins (the
  # user's blocks of rows coarser than the plan's or on other devices), "all" every result its
  # out_specs split on dimension 0 only (the pin measured against: bench/shard_map_boundary.py)
  manual: str = ""
  # the concrete meshes the planned step's jax.shard_maps run over: (their devices' ids in
  # order, the (axis, size) pairs); where there are some, plan.jit traces the step it is given
  # to name a shard_map mesh whose devices are not the plan's in its order
  manual_meshes: tuple[tuple[tuple[int, ...], tuple[tuple[str, int], ...]], ...] = ()
  # the step's jax.shard_maps on a tensor pair's activations whose operands and results the pair
  # holds plan.jit pins to the plan's split of their features (stepgraph.FeatureShardMap): (its
  # place in jaxpr_reader.call_shard_maps' order, the shape of the first operand pinned, those
  # operands, those results, the dimension split over 'tensor', the axes dimension 0 is over)
  manual_features: tuple[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], int,
                               tuple[str, ...]], ...] = ()
  # the leaves whose gradient plan.jit makes on their shard from activations moved over the
  # batch, as priced (pricing.gradient_on_shard, gather.shard_gradients)
  gradients_on_shard: tuple[int, ...] = ()

  # --- applying it -----------------------------------------------------------------------------

  def mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
    """The planned mesh over ``devices`` (default ``jax.devices()``, every process's), in the
    planned device order."""
    devices = list(jax.devices() if devices is None else devices)
    by_id = {d.id: d for d in devices}
    missing = [i for i in self.device_ids if i not in by_id]
    if missing:
      raise errors.MeshError(
          f"the plan was made for devices {list(self.device_ids)[:8]}... of topology "
          f"{self.topology!r}; devices {missing[:8]} are not among the {len(devices)} present. "
          "Plan with the topology of the devices you run on (topology=None), or run where the "
          "planned devices exist.")
    arr = np.asarray([by_id[i] for i in self.device_ids], dtype=object)
    return Mesh(arr.reshape(self.mesh_shape), self.axis_names)

  def shardings(self, devices: Sequence[Any] | None = None) -> tuple[Any, ...]:
    """One NamedSharding per argument leaf, in the arguments' structure."""
    mesh = self.mesh(devices)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.specs,
                        is_leaf=lambda s: isinstance(s, P))

  def out_shardings(self, devices: Sequence[Any] | None = None) -> Any:
    """NamedShardings for the step's outputs: new state laid out as the state, the rest
    replicated (pass as ``jax.jit(step, out_shardings=...)``)."""
    mesh = self.mesh(devices)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), self.out_specs,
                        is_leaf=lambda s: isinstance(s, P))

  def jit(self, step: Callable, **jit_kwargs):
    """``jax.jit(step)`` with this plan's input and output shardings, and its FSDP parameters
    gathered where the step's products read them.

    FSDP lays a parameter out sharded over ``fsdp``; the products need it whole. The returned
    function re-evaluates the step's jaxpr with each FSDP-sharded weight constrained to its
    gathered layout (:attr:`compute_specs`) at the products that read it, as FSDP's users write
    it: a weight stacked for ``lax.scan`` is gathered one layer at a time inside the loop body,
    for the forward and again for the backward pass (FSDP2's ``reshard_after_forward``), and the
    optimizer's update reads the sharded weight (dtenjax/_src/planning/gather.py). Without the
    gathers XLA's partitioner, seeing the batch and the weight sharded over the same axis, often
    moves the activations instead (all-to-alls, all-reduces of partial products: 10x the bytes
    on a GPT-2 step); gathering the whole stack before the step would hold every layer's
    gathered weights at once. Values are those of ``step`` up to XLA's summation order.

    ``jit_kwargs`` are ``jax.jit``'s: ``static_argnums`` / ``static_argnames`` name arguments the
    plan was made with (a Python flag) that are not traced, so they get no sharding;
    ``donate_argnums`` donates state as usual; a plan made with ``donate=True`` donates the
    arguments the step returns new values of when no ``donate_argnums`` / ``donate_argnames`` is
    given (the program its memory was priced for and :meth:`check` compiles): not the batch, nor
    a frozen argument it only reads (a reference model, LoRA's base), whose buffer jax.jit would
    hand to an output of its shape and delete. The result wraps ``jax.jit``'s function (its
    attributes are jax's): its call, ``lower``, ``trace`` and ``eval_shape`` also take, by name,
    an argument the plan has a place for; ``step`` may be another plan's ``jit`` (this plan lays
    out the step it wraps)."""
    if not callable(step):
      raise errors.PlacementError(
          f"StepPlan.jit: step is a {type(step).__name__}, not callable; pass the step function "
          "the plan was "
          "made for (plan.jit(step), then call the result with its arguments)")
    if isinstance(step, _PlannedStep):   # another plan's function: this plan lays out its step
      step = step._step
    if self.pipeline is not None:
      p = self.pipeline
      raise errors.PlacementError(
          f"StepPlan.jit: this plan runs the step's {p.layers} layers as a pipeline of "
          f"{p.stages} stages, which plan.jit cannot apply to an arbitrary step. Write the step "
          "with dtenjax.pipeline inside jax.shard_map over plan.mesh(): "
          f"dtenjax.pipeline(body, loss_fn, stages={p.stages}, microbatches={p.microbatches}, "
          f"schedule={p.schedule!r}) (plan.pipeline.make(body, loss_fn)), with plan.specs as "
          "the in_specs; or plan without stages (mesh= a dict without 'stage')")
    mesh = self.mesh()
    planned = gather.gather_for_compute(
        step, mesh, self.compute_specs,
        sequence=sequence_lib.application(dict(zip(self.axis_names, self.mesh_shape)),
                                          SEQUENCE_AXES, BATCH_AXES, self.batch_argnums),
        shard_specs=self.specs, rows=self._batch_rows(), pin_all=self.manual == "all",
        features=self.manual_features, batch_axes=self._batch_axes(),
        on_shard=frozenset(self.gradients_on_shard))

    def checked(*args):
      if self.manual_meshes:     # the planned step ran shard_maps: is this one's on our devices?
        self._check_manual_meshes(jaxpr_reader.shard_map_meshes(jax.make_jaxpr(step)(*args)))
      return planned(*args)

    manual_axes = {axes for _, axes in self.manual_meshes}

    @functools.wraps(planned)          # the step's name: jit_<step> in profiles and HLO
    def fn(*args):
      # under a user's jax.set_mesh of another mesh, traced under the plan's: the arguments lie
      # on it, and JAX refuses a product whose operands' mesh is not the context's. Without a
      # context mesh none is set, so that a jax.shard_map given its own mesh keeps working; nor
      # under the mesh of the step's own shard_map, which JAX refuses to trace under another
      context = jax.sharding.get_abstract_mesh()
      if context.empty or tuple(zip(context.axis_names, context.axis_sizes)) in manual_axes:
        return checked(*args)
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return checked(*args)
    static = _static_positions(step, jit_kwargs, len(self.specs))
    if self.donate and not {"donate_argnums", "donate_argnames"} & set(jit_kwargs):
      returned = (range(len(self.specs)) if self.returned_argnums is None
                  else self.returned_argnums)
      jit_kwargs = {**jit_kwargs, "donate_argnums": tuple(
          k for k in returned if k not in self.batch_argnums and k not in static)}
    # jax.jit takes in_shardings for the traced positional arguments only
    shardings = tuple(sh for k, sh in enumerate(self.shardings()) if k not in static)
    jitted = jax.jit(fn, in_shardings=shardings, out_shardings=self.out_shardings(),
                     **jit_kwargs)
    donates = bool({"donate_argnums", "donate_argnames"} & set(jit_kwargs))
    return _PlannedStep(jitted, step, self, static, donates)

  def _check_args(self, what: str, step: Callable, args) -> None:
    """``step`` callable and ``args`` one per planned argument, else the error naming them."""
    if not callable(step):
      raise errors.PlacementError(
          f"StepPlan.{what}: step is a {type(step).__name__}, not callable; pass the step "
          "function first, then "
          f"its arguments: plan.{what}(step, *args)")
    if len(args) != len(self.specs):
      raise errors.PlacementError(
          f"StepPlan.{what}: the plan has {len(self.specs)} arguments, got {len(args)}; pass "
          "the step's arguments in the order they were planned")

  def _check_manual_meshes(self, meshes) -> None:
    """jax.jit runs a step's arguments and every jax.shard_map inside it over one list of devices
    in one order, and refuses a shard_map over a mesh of other devices or of the plan's in
    another order with JAX's "incompatible devices" (a mesh built from jax.devices() reversed,
    or on a host whose topology orders the plan's devices otherwise than jax.make_mesh):
    ``meshes`` (jaxpr_reader.shard_map_meshes of the step traced) named with the fix instead."""
    for ids, axes in meshes.items():
      if ids == tuple(self.device_ids):
        continue
      names = tuple(a for a, _ in axes)
      shape = tuple(n for _, n in axes)
      order = ("the plan's devices in another order" if sorted(ids) == sorted(self.device_ids)
               else f"{len(ids)} devices where the plan has {len(self.device_ids)}")
      raise errors.MeshError(
          f"StepPlan.jit: the step's jax.shard_map runs over a mesh {dict(axes)} of devices "
          f"{list(ids)[:8]}{'...' if len(ids) > 8 else ''}, {order} "
          f"{list(self.device_ids)[:8]}{'...' if len(self.device_ids) > 8 else ''}; jax.jit "
          "runs a step's arguments and its shard_maps on one device order. Build the "
          "shard_map's mesh from the plan's devices: jax.sharding.Mesh(plan.mesh().devices"
          f".reshape({shape}), {names})")

  def _batch_rows(self) -> tuple[str, ...]:
    """The mesh axes this plan splits the batch's dimension 0 over (its batch layout's), where the
    step has a jax.shard_map's results to pin to it; else none."""
    return self._batch_axes() if self.manual else ()

  def _batch_axes(self) -> tuple[str, ...]:
    """The mesh axes this plan splits the batch's dimension 0 over."""
    return tuple(a for a, n in zip(self.axis_names, self.mesh_shape)
                 if n > 1 and a in BATCH_AXES and a not in SEQUENCE_AXES)

  def check(self, step: Callable, *args,
            compiler_options: dict | None = None) -> check_lib.Check:
    """Compiles ``step`` with this plan's shardings (abstract arguments are fine: nothing runs)
    and compares the prediction with what XLA compiled: per-device memory
    (``memory_analysis()``) and collective bytes (read from the compiled HLO as
    :func:`dtenjax.explain` reads them). ``compiler_options``: XLA's options, as the step's own
    ``jax.jit(..., compiler_options=...)`` passes them, so the check compiles what will run."""
    self._check_args("check", step, args)
    if compiler_options is not None and not isinstance(compiler_options, dict):
      raise errors.PlacementError(
          f"StepPlan.check: compiler_options={compiler_options!r} must be a dict of XLA's options "
          "as jax.jit(...).lower(...).compile(compiler_options) takes them, e.g. "
          "{'xla_cpu_enable_fast_math': False}, or None")
    return check_lib.compare(self, step, args, compiler_options)

  def shard(self, *args):
    """Places ``args`` (the step's arguments, as planned) with :meth:`shardings`."""
    if len(args) != len(self.specs):
      raise errors.PlacementError(
          f"StepPlan.shard: the plan has {len(self.specs)} arguments, got {len(args)}; pass the "
          "step's arguments in the order they were planned")
    for argnum, a in enumerate(args):
      for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
        if isinstance(leaf, jax.ShapeDtypeStruct):
          raise errors.PlacementError(
              f"StepPlan.shard: argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'} "
              f"is a jax.ShapeDtypeStruct {leaf.shape} {leaf.dtype}, which has no values to "
              "place; make the arrays on the plan's layout instead, e.g. "
              "jax.jit(init, out_shardings=plan.shardings()[0])(key), or pass arrays")
    out = tuple(jax.device_put(a, s) for a, s in zip(args, self.shardings()))
    return out if len(out) > 1 else out[0]

  # --- reading it ------------------------------------------------------------------------------

  def table(self) -> str:
    gib = 2**30
    lines = [f"mesh {dict(zip(self.axis_names, self.mesh_shape))} on {self.topology} "
             f"({len(self.device_ids)} devices, NVLink SHARP {'on' if self.nvls else 'off'}), "
             f"planned in {self.planning_s * 1e3:.0f} ms over {self.meshes_tried} meshes"]
    for a in self.axes:
      lines.append(f"  axis {a.name!r} x{a.size}: {a.link} {a.span}, alpha {a.alpha_us:.1f} us, "
                   f"{a.bandwidth_gbps:.1f} GB/s ({a.source})")
    if self.priced_with:
      lines.append(f"  priced with {self.priced_with}")
    c = self.cost
    lines.append(f"step time {c.total_s * 1e3:.3f} ms = compute {c.compute_s * 1e3:.3f} ms + "
                 f"exposed communication {c.exposed_s * 1e3:.3f} ms")
    for k, v in c.comm_s.items():
      lines.append(f"  communication over {k}: {v * 1e3:.3f} ms")
    mem = ", ".join(f"{k} {v / gib:.3f}" for k, v in c.memory.items())
    budget = f"{self.budget_bytes / gib:.1f} GiB" if self.budget_bytes else "unknown"
    lines.append(f"memory per device (GiB): {mem} (budget {budget})")
    lines.append("")
    lines.append(_recipe_table(
        [Alternative("chosen", dict(zip(self.axis_names, self.mesh_shape)), self.cost)]
        + list(self.recipes)))
    if self.measured:
      lines.append("")
      lines.append(_measured_table(self.measured))
    lines.append("")
    lines.append(tables.render(["leaf", "shape", "spec", "reason"],
                               [(lp.path, str(lp.shape), str(lp.spec), lp.reason)
                                for lp in self.leaves], align=["left"] * 4))
    lines.extend(self.notes)
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.table()


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _static_positions(step: Callable, jit_kwargs, n: int) -> frozenset[int]:
  """The positions among the plan's ``n`` arguments that ``jit_kwargs``' ``static_argnums`` and
  ``static_argnames`` (by ``step``'s signature) make static."""
  nums = jit_kwargs.get("static_argnums", ())
  nums = (nums,) if isinstance(nums, int) else tuple(nums)
  names = jit_kwargs.get("static_argnames", ())
  names = (names,) if isinstance(names, str) else tuple(names)
  out = {k % n if -n <= k < 0 else k for k in nums}
  if names:
    try:
      params = list(inspect.signature(step).parameters.values())
    except (TypeError, ValueError):
      params = []
    out |= {k for k, prm in enumerate(params[:n]) if prm.name in names and prm.kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
  bad = sorted(k for k in out if not 0 <= k < n)
  if bad:
    raise errors.PlacementError(
        f"StepPlan.jit: static_argnums {bad} are not positions of the plan's {n} arguments; "
        "name the planned arguments that are not traced (a Python flag the plan was made with)")
  return frozenset(out)


class _PlannedStep:
  """``StepPlan.jit``'s result: the ``jax.jit`` function (its other attributes are jax's), whose
  calls name what ``jax.jit`` with in_shardings refuses with a bare ValueError: an argument
  passed by name (bound to its position where the plan has one), and an argument already laid
  out on another mesh or layout (``plan.shard`` places it), and, where the program donates, an
  argument an earlier call deleted (on XLA:CPU jaxlib 0.10, jax.jit's compiled call on a deleted
  buffer crashes the process)."""

  def __init__(self, jitted, step: Callable, plan: StepPlan, static: frozenset[int],
               donates: bool = False):
    # the step's name and attributes first, then ours: a step that is another plan's function
    # carries its own _jitted / _plan in its __dict__, which update_wrapper copies
    functools.update_wrapper(self, step)
    self._jitted, self._step, self._plan, self._static = jitted, step, plan, static
    self._donates = donates
    try:
      self._signature = inspect.signature(step)
    except (TypeError, ValueError):     # a builtin or an object without one: no names to bind
      self._signature = None
    # the planned arguments' names where each may come positionally or by name: a call giving
    # the last ones by name is put in order without binding the signature (microseconds a call)
    n = len(plan.specs)
    params = [] if self._signature is None else list(self._signature.parameters.values())[:n]
    self._names = tuple(prm.name for prm in params) if len(params) == n and all(
        prm.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for prm in params) else None

  def __repr__(self):
    mesh = {a: n for a, n in zip(self._plan.axis_names, self._plan.mesh_shape) if n > 1}
    return f"<plan.jit of {self._step!r} on mesh {mesh}>"

  def __getattr__(self, name):
    if name == "_jitted":               # not set yet (a copy being made)
      raise AttributeError(name)
    return getattr(self._jitted, name)

  def __call__(self, *args, **kwargs):
    if kwargs:
      args = self._positional(args, kwargs)
    if self._donates and any(isinstance(leaf, jax.Array) and leaf.is_deleted()
                             for leaf in jax.tree.leaves(args)):
      self._name_deleted(args)
    try:
      return self._jitted(*args)
    except ValueError as e:
      self._count(args)
      if "does not match the sharding" in str(e):
        self._name_misplaced(args)
      elif "evenly divide" in str(e):
        self._name_undivided(args)
      raise

  # jax.jit's ahead-of-time methods take the arguments as the call does (by name too)
  def lower(self, *args, **kwargs):
    return self._jitted.lower(*self._arguments(args, kwargs))

  def trace(self, *args, **kwargs):
    return self._jitted.trace(*self._arguments(args, kwargs))

  def eval_shape(self, *args, **kwargs):
    return self._jitted.eval_shape(*self._arguments(args, kwargs))

  def _arguments(self, args, kwargs) -> tuple:
    args = self._positional(args, kwargs) if kwargs else args
    self._count(args)
    return args

  def _count(self, args) -> None:
    """Raises the error naming a call with another number of arguments than the plan's (JAX's
    is about the in_shardings' tree prefix)."""
    n = len(self._plan.specs)
    if len(args) != n:
      raise errors.PlacementError(
          f"StepPlan.jit: the plan has {n} arguments, got {len(args)}; pass the step's "
          "arguments as the plan was made with them (bind the others with functools.partial)")

  def _positional(self, args, kwargs) -> tuple:
    """``kwargs`` bound to their positions by the step's signature, when they are among the
    planned arguments (jax.jit takes in_shardings for positional arguments only)."""
    n = len(self._plan.specs)
    if self._names is not None and len(args) + len(kwargs) == n:
      try:
        return args + tuple(kwargs[k] for k in self._names[len(args):])
      except KeyError:
        pass
    try:
      bound = None if self._signature is None else self._signature.bind(*args, **kwargs)
    except TypeError as e:
      raise errors.PlacementError(f"StepPlan.jit: the step's arguments do not bind: {e}") from None
    extra = sorted(kwargs)
    if bound is not None:
      pos = tuple(bound.args)
      if len(pos) == n and not bound.kwargs:
        return pos
      # the keywords without a planned place: beyond the plan's arguments, or keyword-only
      names = list(self._signature.parameters)
      extra = sorted(k for k in kwargs if k in bound.kwargs or names.index(k) >= n)
      if not extra:
        self._count(pos)
    raise errors.PlacementError(
        f"StepPlan.jit: keyword arguments {extra} are not among the {n} arguments the "
        "plan was made for, and jax.jit with the plan's in_shardings takes positional arguments "
        "only; bind them first (plan.jit(functools.partial(step, "
        f"{', '.join(f'{k}=...' for k in extra)}))), or plan with them as positional "
        "arguments")

  def _name_deleted(self, args) -> None:
    """Raises the error naming the first argument leaf an earlier call donated (deleted)."""
    for argnum, a in enumerate(args):
      for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
          raise errors.PlacementError(
              f"StepPlan.jit: argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'} "
              "was deleted: an earlier call donated it (the plan was made with donate=True, or "
              "plan.jit was given donate_argnums). Pass the step's new state, its output, to the "
              "next call, or keep the arguments with plan.jit(step, donate_argnums=())")

  def _name_undivided(self, args) -> None:
    """Raises the error naming the first argument leaf whose dimensions the plan's layout does
    not divide (a last batch of fewer rows than the plan was made for)."""
    sizes = dict(zip(self._plan.axis_names, self._plan.mesh_shape))
    for argnum, (a, specs) in enumerate(zip(args, self._plan.specs)):
      if argnum in self._static:
        continue
      got = jax.tree_util.tree_flatten_with_path(a)[0]
      for (path, leaf), spec in zip(got, jax.tree.leaves(specs, is_leaf=_is_spec)):
        shape = np.shape(leaf)
        for dim, e in enumerate(spec):
          n = int(np.prod([sizes[x] for x in (e if isinstance(e, tuple) else (e,))])) if e else 1
          if dim < len(shape) and shape[dim] % n:
            planned = next((lp.shape for lp in self._plan.leaves
                            if lp.path == f"[{argnum}]{jax.tree_util.keystr(path)}"), None)
            raise errors.PlacementError(
                f"StepPlan.jit: argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'} "
                f"has shape {shape}, whose dimension {dim} ({shape[dim]}) the plan's {spec} "
                f"splits {n} ways"
                + (f" (the plan was made for {planned})" if planned else "")
                + f"; give a multiple of {n} (drop or pad a last partial batch), or plan "
                "for this shape")

  def _name_misplaced(self, args) -> None:
    """Raises the error naming the first argument leaf laid out otherwise than the plan's."""
    for argnum, (a, s) in enumerate(zip(args, self._plan.shardings())):
      if argnum in self._static:
        continue
      got = jax.tree_util.tree_flatten_with_path(a)[0]
      for (path, leaf), sh in zip(got, jax.tree.leaves(s)):
        have = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.Array) and have is not None and not have.is_equivalent_to(
            sh, leaf.ndim):
          raise errors.PlacementError(
              f"StepPlan.jit: argument {argnum} leaf {jax.tree_util.keystr(path) or '(root)'} "
              f"lies on {have}, not on the plan's {sh}; place the arguments on the plan's "
              "layout first: args = plan.shard(*args) (once: the step's outputs stay on it)")


def _recipe_table(alternatives) -> str:
  """The chosen layout beside each recipe: step time, exposed communication, memory (``-``:
  not priced)."""
  gib, rows = 2**30, []
  for r in alternatives:
    c = r.cost
    rows.append((r.name, str(r.mesh_shape)) + ((None, None, None, r.note) if c is None else (
        f"{c.total_s * 1e3:.3f}", f"{c.exposed_s * 1e3:.3f}", f"{c.memory['total'] / gib:.3f}",
        ("" if c.fits else "does not fit; ") + r.note)))
  return tables.render(["recipe", "mesh", "step (ms)", "exposed", "mem (GiB)", "note"], rows,
                       align=["left", "left", "right", "right", "right", "left"])


def _measured_table(measured: Sequence[Measured]) -> str:
  """``plan(measure=True)``'s candidates: time, compiled memory, and which was kept."""
  return tables.render(
      ["measured", "ms", "/fastest", "spread", "compiled MiB", "note"],
      [(m.name, f"{m.seconds * 1e3:.2f}", f"{m.vs_fastest:.2f}", f"{m.spread:.2f}",
        f"{m.memory_bytes / 2**20:.1f}", m.note) for m in measured],
      align=["left", "right", "right", "right", "right", "left"])


def report(graph, prob: Problem, choice, cost, recipes, budget, topology, seconds, tried,
            args, donate: bool) -> StepPlan:
  m = prob.m
  spec_of: dict[int, tuple[P, str]] = {}
  for g, lays, c in zip(prob.groups, prob.cands, choice):
    lay = lays[c]
    spec = P(*lay.spec)
    reason = lay.note
    use = graph.weights.get(g[0])
    if use is not None and not reason.startswith("pinned"):
      reason += (f"; product contracts dims {list(use.contracted)}, keeps {list(use.free)}")
    for k, leaf in enumerate(g):
      spec_of[leaf] = (spec, reason if k == 0 else f"tied to {graph.leaves[g[0]].path}")
  batch_axes = tuple(a for a in BATCH_AXES if m.size[a] > 1 and a not in SEQUENCE_AXES)
  bspec_entry = spec_entry(batch_axes)
  seq_axes = tuple(a for a in SEQUENCE_AXES if m.size[a] > 1)
  seq_dims = graph.sequence.dims if seq_axes and graph.sequence is not None else {}
  leaves = []
  specs_flat = []
  for lf in graph.leaves:
    if lf.is_batch:
      if bspec_entry is None:
        spec, reason = P(), "the batch: replicated (the mesh has no data or fsdp axis)"
      elif splits_batch(lf, sequence_role.row_div(m)):
        spec, reason = P(bspec_entry), "the batch: dimension 0 over the data-parallel axes"
      else:
        spec, reason = P(), "a batch argument whose dimension 0 does not split: replicated"
      if lf.index in seq_dims:
        entries = list(spec) + [None] * (len(lf.shape) - len(spec))
        entries[seq_dims[lf.index]] = spec_entry(seq_axes)
        spec = P(*entries)
        reason = (f"the batch: dimension {seq_dims[lf.index]} (the sequence) over "
                  f"{spec_entry(seq_axes)!r}" + (", dimension 0 over the data-parallel axes"
                                                 if entries[0] is not None else ""))
    else:
      spec, reason = spec_of.get(lf.index, (P(), "replicated"))
    spec = trim(spec)
    leaves.append(LeafPlan(lf.path, lf.shape, lf.dtype, spec, reason))
    specs_flat.append(spec)
  specs = per_arg(args, specs_flat)
  compute_flat = []
  for lf, spec in zip(graph.leaves, specs_flat):
    weight = lf.index in graph.weights or lf.index in graph.gathered
    # gathered over the batch axes for its products, except where the tokens are routed to the
    # weight's shards (an expert dimension): gather.py routes them there
    drop = set(BATCH_AXES) - set(ROUTED_AXES) if weight else set()
    entries = [spec_entry([a for a in (e if isinstance(e, tuple) else (e,)) if a not in drop])
               if e is not None else None for e in spec]
    gathered_spec = trim(P(*entries))
    routed = any(a in ROUTED_AXES for e in spec if e is not None
                 for a in (e if isinstance(e, tuple) else (e,)))
    compute_flat.append(gathered_spec if weight and (gathered_spec != spec or routed) else None)
  compute_specs = [None if all(c is None for c in jax.tree.leaves(t, is_leaf=_is_none)) else t
                   for t in per_arg(args, compute_flat)]
  out_specs_flat = []
  for shape, _, rep in graph.outputs:
    spec = spec_of.get(rep, (P(),))[0] if rep is not None else P()
    if rep is not None and graph.leaves[rep].shape != shape:
      spec = P()
    out_specs_flat.append(trim(spec))
  out_specs = jax.tree_util.tree_unflatten(graph.out_tree, out_specs_flat)
  notes = () if budget else (
      "memory: the devices' memory is unknown (as on CPU), so no budget was checked; pass "
      "memory_budget= to check one",)
  # no state leaf returned (StepGraph.returned: an output tied to it, or of its shape and dtype
  # where the tie is lost -- a lax.scan of optimizer steps, a reshape back)
  if graph.weights and not graph.returned:
    notes += ("state: the step returns no new value of its state arguments: a forward-only step, "
              "or one that updates them in place (nnx's optimizer.update(model, grads)), whose "
              "updates jax.jit and plan.jit drop; return the new state (nnx.state((model, "
              "optimizer)) of nnx.merge'd copies) to train with it",)
  pipe = m.pipeline
  pipeline = None if pipe is None else PipelinePlan(
      stages=pipe.stages, microbatches=pipe.microbatches, schedule=pipe.schedule,
      layers=pipe.layers, bubble=pipe.chosen.cost.bubble, ticks=pipe.chosen.cost.ticks,
      inputs_held=pipe.chosen.cost.live_inputs, message_bytes=pipe.send_bytes,
      send_s=pipe.chosen.send_s, link=pipe.link)
  return StepPlan(axis_names=AXES, mesh_shape=m.shape, out_specs=out_specs, pipeline=pipeline,
                  compute_specs=tuple(compute_specs), donate=donate, nvls=topology.nvls,
                  returned_argnums=tuple(sorted({graph.leaves[i].argnum
                                                 for i in graph.returned})),
                  batch_argnums=tuple(sorted({lf.argnum for lf in graph.leaves if lf.is_batch})),
                  device_ids=tuple(int(i) for i in m.ids.ravel()), axes=axis_links(m),
                  leaves=tuple(leaves), specs=tuple(specs), cost=cost, recipes=recipes,
                  budget_bytes=budget, topology=topology.name, planning_s=seconds,
                  meshes_tried=tried, notes=notes, priced_with=topology.pricing_summary(),
                  manual=_manual(graph, m), manual_meshes=graph.manual_meshes,
                  manual_features=_feature_pins(graph, prob, choice),
                  gradients_on_shard=_gradients_on_shard(graph, prob, choice))


def _manual(graph, m) -> str:
  """StepPlan.manual: "coarser" where gather.pins_manual pins one of the step's shard_map results
  on this plan's mesh (so that plan.jit traces the step to pin it), else ""."""
  sizes = {a: m.size[a] for a in AXES}
  rows = tuple(a for a in BATCH_AXES if a not in SEQUENCE_AXES and sizes[a] > 1)
  pinned = any(n_rows == whole and gather.pins_manual(blocks, n_rows, sizes, rows)
               for _, _, _, n_rows, whole, blocks in graph.manual_outputs)
  return "coarser" if pinned else ""


def _feature_pins(graph, prob: Problem, choice) -> tuple:
  """StepPlan.manual_features: the shard_maps on a tensor pair's activations this plan pins
  (stepgraph.FeatureShardMap.pinned, as pricing.price_layout priced them)."""
  m = prob.m
  lay_of = {g[0]: lays[c] for g, lays, c in zip(prob.groups, prob.cands, choice)}
  rows = tuple(a for a in BATCH_AXES if a not in SEQUENCE_AXES and m.size[a] > 1)
  pins = []
  for f in graph.manual_features:
    lay = lay_of.get(f.cone[0])
    tensor = lay.used().get("tensor") if lay is not None and m.size["tensor"] > 1 else None
    if f.pinned(m.size, None if tensor is None else ("col", tensor), rows):
      pins.append((f.order, f.shape, f.ins, f.outs, f.dim, rows))
  return tuple(pins)


def _gradients_on_shard(graph, prob: Problem, choice) -> tuple[int, ...]:
  """StepPlan.gradients_on_shard: the leaves of the groups whose chosen layout
  pricing.gradient_on_shard priced with their gradient made on their shard."""
  out = [k for g, lays, c in zip(prob.groups, prob.cands, choice)
         if gradient_on_shard(graph, g, lays[c].used(), prob.m) is not None for k in g]
  return tuple(sorted(out))


def _is_none(x) -> bool:
  return x is None


def per_arg(args, flat: list) -> list:
  """``flat`` (one entry per argument leaf, in order) in the trees of ``args``, one per argument."""
  out, k = [], 0
  for a in args:
    treedef = jax.tree_util.tree_structure(a)
    out.append(jax.tree_util.tree_unflatten(treedef, flat[k:k + treedef.num_leaves]))
    k += treedef.num_leaves
  return out


def trim(spec: P) -> P:
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)
