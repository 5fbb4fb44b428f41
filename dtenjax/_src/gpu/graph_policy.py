"""CUDA-graph (XLA command buffer) policies: which commands XLA may record, and the options for it.

XLA's GPU backend records runs of consecutive convertible thunks (kernel fusions, cuBLAS/cuDNN
calls, command-buffer compatible FFI custom calls, ...) into CUDA graphs and replays each run with
one launch. Two per-executable compiler options steer it:

* ``xla_gpu_enable_command_buffer``: the command types that may be recorded (an empty list turns
  graphs off). Through ``compiler_options`` only full lists are accepted (``+WHILE`` is rejected
  as "not a valid enum value", measured on jax 0.10.2).
* ``xla_gpu_graph_min_graph_size``: a run of fewer thunks than this is launched op by op.

A :class:`CudaGraphPolicy` is one setting of both. ``explicit=False`` means "pass nothing": the
executable is then exactly the one ``jax.jit`` builds, under whatever XLA_FLAGS the process has.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax

from dtenjax._src import config
from dtenjax._src import errors

# Command types XLA accepts in xla_gpu_enable_command_buffer (jax 0.10.2 and 0.11.2).
ALL_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL", "COLLECTIVES",
                "CONDITIONAL", "WHILE", "DYNAMIC_SLICE_FUSION")
# XLA's defaults on jax 0.11.2 (not WHILE, not COLLECTIVES; runs of >= 5 thunks).
XLA_DEFAULT_COMMANDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL",
                        "DYNAMIC_SLICE_FUSION", "CONDITIONAL")
XLA_DEFAULT_MIN_GRAPH_SIZE = 5
# "auto" and "measure" decide per program (graphs.jit); the others are fixed settings.
MODES = ("auto", "measure", "xla", "off", "all")

OPT_COMMANDS = "xla_gpu_enable_command_buffer"
OPT_MIN_SIZE = "xla_gpu_graph_min_graph_size"
# XLA runs command buffers op by op while a profiler session is active unless this is set
# (CommandBufferThunk, "Profiler (CUPTI) + CUDA graphs" work-around); observation sets it.
OPT_PROFILING = "xla_enable_command_buffers_during_profiling"
GRAPH_OPTIONS = (OPT_COMMANDS, OPT_MIN_SIZE)


@dataclasses.dataclass(frozen=True)
class CudaGraphPolicy:
  """Which XLA command types are recorded into CUDA graphs, and the shortest run worth a graph.

  Attributes:
    mode: the name the policy was made from ("auto", "measure", "off", "xla", "all", "custom").
    commands: enabled command types, a subset of :data:`ALL_COMMANDS`; empty means graphs off.
    min_graph_size: runs of fewer thunks than this are launched op by op.
    explicit: whether to pass the options to XLA; False leaves XLA's defaults untouched (the
      executable ``jax.jit`` builds).
  """
  mode: str = "custom"
  commands: tuple[str, ...] = XLA_DEFAULT_COMMANDS
  min_graph_size: int = XLA_DEFAULT_MIN_GRAPH_SIZE
  explicit: bool = True

  def __post_init__(self):
    problems = []
    unknown = [c for c in self.commands if c not in ALL_COMMANDS]
    if unknown:
      problems.append(f"commands {unknown} are not XLA command types; use a subset of "
                      f"{list(ALL_COMMANDS)}")
    if len(set(self.commands)) != len(self.commands):
      problems.append(f"commands {list(self.commands)} lists a type twice; list each once")
    if not isinstance(self.min_graph_size, int) or self.min_graph_size < 1:
      problems.append(f"min_graph_size={self.min_graph_size!r} must be an integer >= 1")
    if problems:
      raise errors.ConfigurationError(errors.join_problems("Invalid CudaGraphPolicy:", problems))

  @classmethod
  def from_mode(cls, mode: str | CudaGraphPolicy) -> CudaGraphPolicy:
    """The fixed policy of a mode name, or ``mode`` itself if a policy.

    "auto" and "measure" start from XLA's defaults (not explicit: the ``jax.jit`` executable);
    :func:`dtenjax.jit` replaces that per program (see ``graphs.py``).
    """
    if isinstance(mode, CudaGraphPolicy):
      return mode
    if mode == "off":
      return cls("off", (), XLA_DEFAULT_MIN_GRAPH_SIZE)
    if mode in ("xla", "auto", "measure"):
      return cls(mode, XLA_DEFAULT_COMMANDS, XLA_DEFAULT_MIN_GRAPH_SIZE, explicit=False)
    if mode == "all":
      return cls("all", ALL_COMMANDS, 1)
    raise errors.ConfigurationError(
        f"cuda_graphs={mode!r} is not a known mode; use one of {list(MODES)} or pass a "
        f"dtenjax.CudaGraphPolicy(commands=..., min_graph_size=...).")

  @classmethod
  def xla_default_plus(cls, mode: str, extra: tuple[str, ...] = (),
                       min_graph_size: int = XLA_DEFAULT_MIN_GRAPH_SIZE) -> CudaGraphPolicy:
    """XLA's default command types plus ``extra``, written out explicitly."""
    commands = XLA_DEFAULT_COMMANDS + tuple(c for c in extra if c not in XLA_DEFAULT_COMMANDS)
    return cls(mode, commands, min_graph_size, explicit=True)

  @property
  def enabled(self) -> bool:
    return bool(self.commands)

  @property
  def is_xla_default(self) -> bool:
    """Whether the executable is the one jax.jit builds (nothing passed to XLA)."""
    return not self.explicit

  def describe(self) -> str:
    if not self.explicit:
      return "XLA's defaults (no options passed: the jax.jit executable)"
    if not self.commands:
      return "graphs off"
    extra = [c for c in self.commands if c not in XLA_DEFAULT_COMMANDS]
    missing = [c for c in XLA_DEFAULT_COMMANDS if c not in self.commands]
    parts = [f"+{c}" for c in extra] + [f"-{c}" for c in missing]
    if self.min_graph_size != XLA_DEFAULT_MIN_GRAPH_SIZE:
      parts.append(f"min_graph_size={self.min_graph_size}")
    return "XLA's defaults " + (", ".join(parts) if parts else "(written out)")

  def compiler_options(self) -> dict[str, Any]:
    """The per-executable XLA options for a GPU compile ({} when not explicit)."""
    if not self.explicit:
      return {}
    if not self.commands:
      return {OPT_COMMANDS: ""}
    return {OPT_COMMANDS: ",".join(self.commands), OPT_MIN_SIZE: self.min_graph_size}


def backend_platform(backend: str | None) -> str:
  platform = backend or jax.default_backend()
  return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


@functools.cache
def accepted_option_keys() -> frozenset[str]:
  """Which command-buffer option keys this jaxlib accepts (probed once on the default backend)."""
  accepted = set()
  probe_values = {OPT_COMMANDS: "FUSION", OPT_MIN_SIZE: 2, OPT_PROFILING: True}
  for key, value in probe_values.items():
    try:
      jax.jit(lambda x: x + 1, compiler_options={key: value}).lower(
          jax.ShapeDtypeStruct((2,), "float32")).compile()
      accepted.add(key)
    except Exception as e:
      config.log_once(f"graphs:option:{key}",
                      f"dtenjax.jit: this jaxlib rejects compiler option {key!r} ({e}); "
                      f"CUDA-graph policies compile without it.")
  return frozenset(accepted)


def options_for(policy: CudaGraphPolicy) -> dict[str, Any]:
  """``policy.compiler_options()`` restricted to the keys this jaxlib accepts."""
  opts = policy.compiler_options()
  if not opts:
    return {}
  accepted = accepted_option_keys()
  return {k: v for k, v in opts.items() if k in accepted}


def xla_flags_graph_settings(xla_flags: str | None = None) -> list[str]:
  """The command-buffer flags the process's XLA_FLAGS set (the user's own choice of default)."""
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  return re.findall(r"--(?:xla_gpu_enable_command_buffer|xla_gpu_graph_min_graph_size)=\S*",
                    flags)
