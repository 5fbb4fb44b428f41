"""``dtenjax.jit``: ``jax.jit`` with a CUDA-graph (XLA command buffer) policy per executable.

XLA already runs most of a GPU step as CUDA graphs by default, so the question a policy answers
is where to differ from XLA's defaults, and the answer must never be slower than ``jax.jit``:

=========== =================================================================================
``auto``    (default) XLA's defaults, nothing passed: the very executable ``jax.jit`` builds,
            unless the compiled step holds a loop whose body XLA can record and enabling WHILE
            changes nothing else (:func:`graph_prediction.decide_auto`). Then the loop runs on
            the device as CUDA conditional nodes instead of one host launch (and, without a
            known trip count, one host round trip) per iteration. Decided once, from the first
            call's arguments (``.lower(*args)`` decides for those), at the cost of one compile of
            XLA's defaults (reused when they are chosen) plus a second compile when WHILE is.
``measure`` opt-in: compile the policies whose predicted launches differ from XLA's defaults
            (at most three), time a few steps of each interleaved with XLA's defaults, keep the
            fastest only if it beats the defaults by the margin (:mod:`graph_measure`); cached by
            executable fingerprint. Costs a compile per candidate and some steps.
``xla``     XLA's defaults, never changed.
``off``     no command buffers: every kernel is launched from the host.
``all``     every command type XLA knows, collectives included, and runs of any length.
=========== =================================================================================

A :class:`CudaGraphPolicy` can be passed instead of a mode name. On a CPU backend :func:`jit` is a
plain ``jax.jit``: command buffers do not exist there. Where XLA_FLAGS already sets
``xla_gpu_enable_command_buffer`` or ``xla_gpu_graph_min_graph_size``, ``auto`` keeps that choice.

The pieces: :mod:`graph_policy` (policies and options), :mod:`graph_prediction` (the report and
``auto``'s rule), :mod:`graph_observation` (what the profiler saw), :mod:`graph_measure` (the
measured choice). :func:`graph_report` reads the compiled module through :mod:`dtenjax._src.hlo`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import hlo
from dtenjax._src.gpu import graph_measure
from dtenjax._src.gpu import graph_policy as gp
from dtenjax._src.gpu import graph_prediction as pred
from dtenjax._src.gpu.graph_observation import LaunchObservation
from dtenjax._src.gpu.graph_observation import observe_launches
from dtenjax._src.gpu.graph_observation import per_step_summary
from dtenjax._src.gpu.graph_observation import read_launches
from dtenjax._src.gpu.graph_policy import ALL_COMMANDS
from dtenjax._src.gpu.graph_policy import CudaGraphPolicy
from dtenjax._src.gpu.graph_policy import MODES
from dtenjax._src.gpu.graph_policy import XLA_DEFAULT_COMMANDS
from dtenjax._src.gpu.graph_policy import XLA_DEFAULT_MIN_GRAPH_SIZE
from dtenjax._src.gpu.graph_prediction import GraphReport
from dtenjax._src.gpu.graph_prediction import GraphSegment
from dtenjax._src.gpu.graph_prediction import classify
from dtenjax._src.gpu.graph_prediction import report_from_hlo
from dtenjax._src.gpu.graph_prediction import report_from_module

__all__ = ["ALL_COMMANDS", "XLA_DEFAULT_COMMANDS", "XLA_DEFAULT_MIN_GRAPH_SIZE", "MODES",
           "CudaGraphPolicy", "GraphDecision", "GraphJitted", "GraphReport", "GraphSegment",
           "LaunchObservation", "classify", "graph_report", "jit", "observe_launches",
           "per_step_summary", "read_launches", "report_from_hlo", "report_from_module"]


@dataclasses.dataclass(frozen=True)
class GraphDecision:
  """What a :func:`jit` result compiles with, and why.

  Attributes:
    policy: the policy the executable uses (``policy.is_xla_default``: nothing was passed).
    reason: why (auto's rule, the measurement, or the fixed mode).
    decide_s: seconds the decision took (compiles and timing; 0 for fixed modes).
    measured: the measurement, for ``cuda_graphs="measure"``.
  """
  policy: CudaGraphPolicy
  reason: str
  decide_s: float = 0.0
  measured: graph_measure.MeasuredChoice | None = None


def _adaptive(policy: CudaGraphPolicy) -> bool:
  return policy.mode in ("auto", "measure") and not policy.explicit


class GraphJitted:
  """What :func:`jit` returns: a ``jax.jit`` function that remembers its CUDA-graph decision."""

  def __init__(self, fn: Callable[..., Any], policy: CudaGraphPolicy, platform: str,
               user_options: dict[str, Any], jit_kwargs: dict[str, Any],
               measure_kwargs: dict[str, Any] | None = None):
    self.fn = fn
    self.policy = policy                 # what was asked for
    self.platform = platform
    self._user_options = dict(user_options)
    self._jit_kwargs = dict(jit_kwargs)
    self._measure_kwargs = dict(measure_kwargs or {})
    self._default = jax.jit(fn, compiler_options=self._user_options or None, **jit_kwargs)
    self.decision: GraphDecision | None = None
    self.jitted: Any = None
    if platform != "gpu":
      self._settle(GraphDecision(gp.CudaGraphPolicy.from_mode("xla") if _adaptive(policy)
                                 else policy, f"command buffers do not apply on {platform}: "
                                 "a plain jax.jit"), use_default=True)
    elif not _adaptive(policy):
      self._settle(GraphDecision(policy, f"fixed: cuda_graphs={policy.mode!r}"))
    else:
      self._call = self._first_call
    functools.update_wrapper(self, fn)

  def _settle(self, decision: GraphDecision, use_default: bool = False) -> None:
    self.decision = decision
    opts = {} if use_default else gp.options_for(decision.policy)
    if not opts:
      self.jitted = self._default
    else:
      self.jitted = jax.jit(self.fn, compiler_options={**self._user_options, **opts},
                            **self._jit_kwargs)
    self._call = self.jitted

  @property
  def compiler_options(self) -> dict[str, Any] | None:
    """The options the executable is compiled with (None until an adaptive mode decided)."""
    if self.decision is None:
      return None
    if self.jitted is self._default:
      return dict(self._user_options)
    return {**self._user_options, **gp.options_for(self.decision.policy)}

  def decide(self, *args, **kwargs) -> GraphDecision:
    """Makes (once) and returns the decision for these arguments."""
    if self.decision is not None:
      return self.decision
    t0 = time.perf_counter()
    compiled = self._default.lower(*args, **kwargs).compile()
    user = gp.xla_flags_graph_settings()
    measured = None
    if user:
      policy = gp.CudaGraphPolicy.from_mode(self.policy.mode)
      reason = f"XLA_FLAGS sets {' '.join(user)}: the process's own choice is kept"
    elif self.policy.mode == "auto":
      text = compiled.as_text()
      if " while(" not in text:           # no loop at all: skip reading the module
        policy, reason = pred.decide_auto_without_loops()
      else:
        module = hlo.read_compiled(compiled)
        policy, reason = pred.decide_auto(module, module.trip_counts())
    else:
      measured = graph_measure.measure(
          self.fn, args, kwargs, jit_kwargs=self._jit_kwargs, user_options=self._user_options,
          default_compiled=compiled, **self._measure_kwargs)
      policy, reason = measured.policy, measured.reason
    decision = GraphDecision(policy, reason, time.perf_counter() - t0, measured)
    self._settle(decision)
    config.log_once(f"graphs:decision:{id(self)}",
                    f"dtenjax.jit({getattr(self.fn, '__name__', self.fn)!r}, cuda_graphs="
                    f"{self.policy.mode!r}): {policy.describe()} ({reason}; decided in "
                    f"{decision.decide_s:.1f} s)", level=20)
    return decision

  def _first_call(self, *args, **kwargs):
    self.decide(*args, **kwargs)
    return self._call(*args, **kwargs)

  def __call__(self, *args, **kwargs):
    return self._call(*args, **kwargs)

  def lower(self, *args, **kwargs):
    if self.decision is None:
      self.decide(*args, **kwargs)
    return self.jitted.lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._default.trace(*args, **kwargs)

  def profiling_twin(self) -> tuple[Any, bool]:
    """(the same executable compiled to keep its graphs under the profiler, whether it could).

    XLA runs command buffers op by op during a profiler session unless
    ``xla_enable_command_buffers_during_profiling`` is set (see graph_observation).
    """
    if self.decision is None:
      raise errors.ConfigurationError(
          "profiling_twin() before the first call: call the step (or .lower it) first so "
          "cuda_graphs decides what to compile.")
    if self.platform != "gpu" or gp.OPT_PROFILING not in gp.accepted_option_keys():
      return self.jitted, False
    opts = {**(self.compiler_options or {}), gp.OPT_PROFILING: True}
    return jax.jit(self.fn, compiler_options=opts, **self._jit_kwargs), True

  def __repr__(self):
    chosen = self.decision.policy.describe() if self.decision else "not decided yet"
    return (f"dtenjax.jit({getattr(self.fn, '__name__', self.fn)!r}, cuda_graphs="
            f"{self.policy.mode!r}, platform={self.platform!r}, compiles with: {chosen})")


def jit(fn: Callable[..., Any], cuda_graphs: str | CudaGraphPolicy = "auto", *,
        backend: str | None = None, measure: dict[str, Any] | None = None,
        **jit_kwargs) -> GraphJitted:
  """``jax.jit`` with a CUDA-graph policy set on this executable only.

  Args:
    fn: the function to compile.
    cuda_graphs: "auto" (default), "measure", "xla" (XLA's defaults), "off", "all", or a
      CudaGraphPolicy (see the module docstring for what each does and costs).
    backend: the platform the step is meant for; default ``jax.default_backend()``. Only for
      "gpu" are options set; otherwise the result is a plain ``jax.jit``. (Where it runs is
      decided by its inputs, as for ``jax.jit``.)
    measure: for "measure", keyword arguments of ``graph_measure.measure`` (steps, repeats,
      warmup, margin, cache_path).
    **jit_kwargs: passed to ``jax.jit`` (static_argnums, donate_argnums, ...). A
      ``compiler_options`` dict is merged; setting the command-buffer keys there too is an error.

  Returns:
    A :class:`GraphJitted` (callable like the ``jax.jit`` result; ``.lower``, ``.decision``).
  """
  policy = CudaGraphPolicy.from_mode(cuda_graphs)
  platform = gp.backend_platform(backend)
  user_opts = dict(jit_kwargs.pop("compiler_options", None) or {})
  clash = sorted(set(user_opts) & set(gp.GRAPH_OPTIONS))
  if clash:
    raise errors.ConfigurationError(
        f"compiler_options sets {clash}, which cuda_graphs={policy.mode!r} controls; pass a "
        f"dtenjax.CudaGraphPolicy as cuda_graphs instead of setting them by hand.")
  if measure and policy.mode != "measure":
    raise errors.ConfigurationError(
        f"measure={measure!r} is only read with cuda_graphs='measure' (got {policy.mode!r}).")
  return GraphJitted(fn, policy, platform, user_opts, jit_kwargs, measure)


# --------------------------------------------------------------------------------------------
# graph_report
# --------------------------------------------------------------------------------------------

def _compiled_platform(compiled: Any) -> str:
  for sharding in jax.tree.leaves(compiled.input_shardings):
    for device in getattr(sharding, "device_set", ()):
      return gp.backend_platform(device.platform)
  return gp.backend_platform(None)


def graph_report(fn_or_compiled: Any, *args, cuda_graphs: str | CudaGraphPolicy | None = None,
                 **kwargs) -> GraphReport:
  """Reports how much of a step runs inside CUDA graphs, and which ops split them and why.

  The compiled module is read once (:mod:`dtenjax._src.hlo`, the reader ``explain`` uses).
  Unless XLA outlined its command buffers into the HLO (``source == "observed"``), the rows are
  a prediction from XLA's rules (``source == "predicted"``, said in the table's title); on jax
  0.10.2/0.11 XLA builds command buffers after HLO, so GPU reports are predictions too. The
  report predicts graph launches and ops launched one by one per step (loops counted every
  iteration); :func:`observe_launches` observes what a GPU really launched.

  Args:
    fn_or_compiled: a :func:`jit` result, a ``jax.jit`` function, a plain function, or an
      already compiled ``jax.stages.Compiled``.
    *args: example arguments (arrays or ShapeDtypeStructs) to lower with; not used for a
      Compiled.
    **kwargs: example keyword arguments, likewise.
    cuda_graphs: the policy to report. For a :func:`jit` result or a plain function it is the
      policy compiled with (default: the :func:`jit` result's own, else "xla"); for a ``jax.jit``
      function or a Compiled the executable is read as it is, under this policy's rules ("auto"
      applies auto's rule to it; "measure" needs a :func:`jit` result).

  Returns:
    A :class:`GraphReport`; ``print(report)`` shows the table, ``report.to_dict()`` the data.
  """
  if isinstance(fn_or_compiled, GraphJitted):
    g = fn_or_compiled
    if cuda_graphs is not None and CudaGraphPolicy.from_mode(cuda_graphs) != g.policy:
      g = jit(g.fn, cuda_graphs, backend=g.platform, compiler_options=g._user_options or None,
              **g._jit_kwargs)
    compiled = g.lower(*args, **kwargs).compile()
    policy, reason = g.decision.policy, g.decision.reason
    module = hlo.read_compiled(compiled)
    platform = _compiled_platform(compiled)
    trips = module.trip_counts()
    if g.platform != "gpu" and _adaptive(g.policy) and g.policy.mode == "auto":
      policy, why = pred.decide_auto(module, trips)
      reason = f"{reason}; on a GPU auto would choose {policy.describe()}: {why}"
    return pred.report_from_module(module, policy, platform, trips, reason)
  if isinstance(fn_or_compiled, jax.stages.Compiled):
    compiled = fn_or_compiled
  elif hasattr(fn_or_compiled, "lower"):
    compiled = fn_or_compiled.lower(*args, **kwargs).compile()
  elif callable(fn_or_compiled):
    return graph_report(jit(fn_or_compiled, cuda_graphs or "xla"), *args, **kwargs)
  else:
    raise errors.ConfigurationError(
        f"graph_report got {type(fn_or_compiled).__name__}; pass a function, a jitted function "
        f"or a jax.stages.Compiled (from jax.jit(f).lower(*args).compile()).")
  module = hlo.read_compiled(compiled)
  trips = module.trip_counts()
  mode = cuda_graphs or "xla"
  if mode == "measure" or getattr(mode, "mode", None) == "measure":
    raise errors.ConfigurationError(
        "graph_report(..., cuda_graphs='measure') needs a dtenjax.jit(step, cuda_graphs="
        "'measure') result: measuring runs the step.")
  policy = CudaGraphPolicy.from_mode(mode)
  reason = ""
  if _adaptive(policy):
    policy, reason = pred.decide_auto(module, trips)
  return pred.report_from_module(module, policy, _compiled_platform(compiled), trips, reason)
