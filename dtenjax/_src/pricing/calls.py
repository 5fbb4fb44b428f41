"""The question every algorithm record answers: one collective :class:`Call`, as static values,
with the vocabulary it is written in (ops, sums, kinds, the accumulation dtype).

Both sides ask it: the price records (``pricing/algorithms.py``: can you run it, what would it
cost) and the collectives that run it (``collectives/algorithms/``, which re-export these names
from their ``base`` module).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from dtenjax._src.contract import Contract

OPS = ("sum", "mean", "max", "min")
# The ops whose result is a sum (mean: the sum divided by the count): they accumulate in float32
# for 16-bit floats, and the reproducible contracts apply to them only.
SUMS = frozenset(("sum", "mean"))
KINDS = ("all_reduce", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Call:
  """Everything an algorithm may depend on to accept or cost one collective (static values).

  Attributes:
    kind: "all_reduce" or "reduce_scatter".
    op: "sum", "mean", "max" or "min".
    dtype: element type of the data.
    axes: the named axes reduced over, in order (their product is the group).
    axis_sizes: size of each axis.
    nbytes: bytes per participant (reduce_scatter: the full, unscattered input).
    backend: platform of the devices ("cpu", "gpu", "tpu").
    deterministic: the caller needs a fixed reduction order.
    contract: the reproducible sum that runs (``collectives/reproducible.py``), a
      :class:`~dtenjax._src.contract.Contract` parsed from the public ``reproducible=``;
      NONE unless ``op`` is one of :data:`SUMS`.
    contributions: contributions stacked on each device (``local_axis``), 1 otherwise.
    mesh_axes: every axis is a manual mesh axis (shard_map / mesh_map), not a vmap axis.
    processes: processes the group spans (1: every participant is in this process).
    xla_reaches_processes: XLA's own collectives work across those processes here.
    requested: the ``algorithm=`` the caller passed ("auto", a family or a record name).
    nvls: NCCL may use NVLink SHARP (from ``Topology.nvls`` when planning; None reads
      NCCL_NVLS_ENABLE).
    tag: the caller's ``tag=`` (None, an int or a str): the host transport compares it on every
      rank (``net/callsite.tag_value``); no choice or cost depends on it.
  """
  kind: str
  op: str
  dtype: Any
  axes: tuple[str, ...]
  axis_sizes: tuple[int, ...]
  nbytes: int
  backend: str = "cpu"
  deterministic: bool = True
  contract: Contract = Contract.NONE
  contributions: int = 1
  mesh_axes: bool = True
  processes: int = 1
  xla_reaches_processes: bool = True
  requested: str = "auto"
  tag: int | str | None = dataclasses.field(default=None, compare=False)
  # NVLink SHARP in use (GPU): the Topology's ``nvls`` when the planner asks; None: the process
  # environment (NCCL_NVLS_ENABLE) at trace time
  nvls: bool | None = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
    if not isinstance(self.contract, Contract):
      raise TypeError(f"Call.contract must be a Contract (contract.parse), got {self.contract!r}")
    if self.contract.reproducible and self.op not in SUMS:
      raise ValueError(f"Call: contract {self.contract.value} with op={self.op!r}; the "
                       "reproducible contracts apply to sums only")

  @property
  def reproducible(self) -> bool:
    """Whether a reproducible fixed-point sum runs (``contract`` is not NONE)."""
    return self.contract.reproducible

  @property
  def world(self) -> int:
    return math.prod(self.axis_sizes)

  @property
  def itemsize(self) -> int:
    return self.dtype.itemsize

  @property
  def exact(self) -> bool:
    """Whether every order of reduction gives the same bits (integer sums, max and min)."""
    return self.op not in SUMS or not jnp.issubdtype(self.dtype, jnp.inexact)


def acc_dtype(dtype, op: str):
  """Accumulation dtype: float32 for sums of 16-bit floats, the input dtype otherwise."""
  dtype = jnp.dtype(dtype)
  if op in SUMS and dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return jnp.dtype(jnp.float32)
  return dtype


def doubled_on_cpu(dtype) -> bool:
  """Whether XLA:CPU compiles a collective of ``dtype`` at twice its bytes: bfloat16 in float32,
  the float8 types in float16 (the compiled HLO's operands on 8 CPU devices: a float8_e4m3fn or
  float8_e5m2 all-gather, psum and all-to-all are f16 ones; tests/test_costmodel_wire.py). Not
  float16, integers, bools nor a PRNG key's dtype (which numpy does not know)."""
  try:
    d = jnp.dtype(dtype)
  except TypeError:
    return False
  return d == jnp.dtype(jnp.bfloat16) or d.name.startswith("float8")


def wire_bytes(dtype, backend: str) -> float:
  """Bytes XLA's collective of a value of ``dtype`` moves per byte of the value on ``backend``:
  the one place this is decided (the whole-step planner's roles, its Pricer, the per-array
  planner and the algorithm records ask it). XLA:CPU compiles a collective of bfloat16 in
  float32 and one of a float8 type in float16, with conversions around it (a bfloat16
  gradient's all-reduce, a bfloat16 weight's all-gather, all-to-alls and ppermutes alike: the
  compiled HLO's operands, and the bytes ``plan.check`` reads back from it:
  tests/test_costmodel_wire.py), 2 (:func:`doubled_on_cpu`); every other dtype as it is, 1:
  float16 (its collectives stay float16 in the compiled HLO), integers, PRNG keys, and every
  dtype on a GPU (NCCL sends the input's bytes)."""
  return 2.0 if backend == "cpu" and doubled_on_cpu(dtype) else 1.0


def uses_keys(dtype) -> bool:
  """Whether max/min of ``dtype`` run on integer order keys (floats do)."""
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


def xla_reaches(call: Call) -> str | None:
  """None when XLA's own collectives connect the call's processes, else why not."""
  if call.processes > 1 and not call.xla_reaches_processes:
    return (f"the axes span {call.processes} processes and XLA's {call.backend} collectives do "
            "not reach across processes here (set jax_cpu_collectives_implementation='gloo' "
            "before jax.distributed.initialize, or use the host transport: "
            "algorithm='ring'/'hierarchical')")
  return None
