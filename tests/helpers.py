"""What several test files share: jitted ``shard_map`` over one mesh, data whose sums depend on
the order they are taken in (with the left fold that states one such order), and waiting for a
condition instead of sleeping for a time, XLA:CPU's fusion emitters (the option that gives a
program the default ones back, the flag that gives a process the suite's), the mark that keeps
a module's tests in one xdist worker, a jax that cannot be imported, and the package's modules
parsed once for the checks that read their source."""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import pathlib
import time
from collections.abc import Callable

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import FUSION_EMITTERS_FLAG, SPLIT_CODEGEN_FLAG


# tests/conftest.py compiles the suite with XLA:CPU's LLVM IR emitters (the same bits, less
# compile time, but another optimised HLO): this flag where it does, empty where the run kept
# XLA's emitters (GPU runs, a jaxlib without the flag, a run that named it in XLA_FLAGS).
SUITE_CPU_EMITTERS = (FUSION_EMITTERS_FLAG
                      if FUSION_EMITTERS_FLAG in os.environ.get("XLA_FLAGS", "").split() else "")
# A program's own compiler option that gives it XLA:CPU's default (MLIR) fusion emitters back: a
# check of a compiled program's structure that must be the program users get (its loops, its
# fusions) compiles with this.
DEFAULT_CPU_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if SUITE_CPU_EMITTERS else {}
# The same for conftest's code generation in one LLVM module (the same machine code, less CPU).
SUITE_CPU_SPLIT = (SPLIT_CODEGEN_FLAG
                   if SPLIT_CODEGEN_FLAG in os.environ.get("XLA_FLAGS", "").split() else "")


def one_worker(module: str) -> pytest.MarkDecorator:
  """The mark (a module's ``pytestmark = helpers.one_worker(__name__)``) that keeps a module's
  tests in one xdist worker (scripts/test.sh's ``--dist loadgroup``), for a module whose
  module-scoped fixture each worker that runs one of its tests would make again: a fork server
  that imports jax and dtenjax (about 1.3 s of CPU), a planned FSDP step (1.4 s with the run's
  compile cache warm), a fresh interpreter's report. Not for a module whose fixture is a mesh."""
  return pytest.mark.xdist_group(module.rpartition(".")[2])


def xla_flags(*flags: str) -> str:
  """``XLA_FLAGS`` for a process a test starts with flags of its own (a device count, the AVX
  flag): ``flags`` and the suite's emitters and code-splitting flags where the run has them, for
  a process whose check is about values or bits, which the flags keep (a stored digest is the
  guard), not about a compiled program's structure."""
  return " ".join(f for f in (*flags, SUITE_CPU_EMITTERS, SUITE_CPU_SPLIT) if f)


def smap(mesh, f, axes=("o", "i"), *, out_specs=None, check_vma=False, jit=True):
  """``jax.shard_map(f)`` with every input and (by default) output sharded over ``axes``,
  jitted unless ``jit=False``."""
  g = jax.shard_map(f, mesh=mesh, in_specs=P(axes),
                    out_specs=P(axes) if out_specs is None else out_specs, check_vma=check_vma)
  return jax.jit(g) if jit else g


def wide(shape, seed):
  """Random data over a wide exponent range: different summation orders give different bits."""
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) * np.exp(rng.uniform(-15, 15, shape))).astype(np.float32)


def fold(rows, start=None, dtype=np.float32):
  """Left fold in the given order: from ``start`` (e.g. +0.0) or from the first row."""
  acc = rows[0].astype(dtype) if start is None else np.full(rows[0].shape, start, dtype)
  for r in (rows[1:] if start is None else rows):
    acc = (acc + r.astype(dtype)).astype(dtype)
  return acc


def block_tree(blocks: int = 2) -> dict:
  """A gradient tree of ``blocks`` blocks of 4 weights and 2 biases (3 leaf shapes, 168 values
  per device of 8: a multiple of 8, so no bucket is padded), each block's weights filled with its
  own value."""
  import jax.numpy as jnp
  out = {}
  for b in range(blocks):
    for w in "qkvo":
      out[f"{b}{w}"] = jnp.full((8, 4, 4), 1.0 + b, jnp.float32)
    out[f"{b}b1"], out[f"{b}b2"] = jnp.full((8, 4), 0.5, jnp.float32), jnp.ones((8, 16))
  return out


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
  """Returns as soon as ``condition()`` holds (checked every millisecond, for state such as the
  native counters that has no event to wait on); fails the test naming ``what`` after
  ``timeout_s``. Timing tests order their events with this, never with a fixed sleep."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      pytest.fail(f"waited {timeout_s:g} s for {what}; it never happened", pytrace=False)
    time.sleep(0.001)


def _trace_context():
  """jax's settings that change a trace (x64, the mesh in context, ...): the key of jax.jit's
  own trace cache, where this jax has it (jax 0.10 and later keep it in ``jax._src.config``)."""
  from jax._src import config
  context = getattr(config, "trace_context", None)
  return context() if context is not None else None


@contextlib.contextmanager
def shared_step_reads(reads: dict | None = None):
  """Within it, ``dtenjax.plan`` reads each step once per argument shapes: a test that plans the
  same step function on several meshes, pins or topologies (the step read, ``stepgraph.read_step``:
  a trace and a walk of its jaxpr, depends on the step, the arguments' tree, shapes and dtypes and
  the batch's positions alone, not on the mesh or the prices) reuses the first read. The planner
  never changes the graph it was given (it makes new ones with ``dataclasses.replace``), and a
  read of the same step gives the same graph (tests/test_step_planner.py
  ``test_same_inputs_same_plan``), so each plan is the one planned alone. A read is 0.1-0.2 s of
  CPU of a small family's step; the calibrated band test plans each of six families' steps under
  four layouts (docs/benchmarks.md, suite21). The step function is kept while the block runs
  (it is in the key). ``reads``: a dict of earlier blocks' reads to go on with (a module's steps
  made once, by a ``functools.cache``, and planned by several tests)."""
  from dtenjax._src.planning import stepgraph
  read = stepgraph.read_step
  reads = {} if reads is None else reads

  def shared(fn, args, batch_argnums):
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (fn, tree, tuple(batch_argnums), _trace_context(),
           tuple((type(leaf), getattr(leaf, "shape", leaf), str(getattr(leaf, "dtype", None)),
                  getattr(leaf, "weak_type", None)) for leaf in leaves))
    try:
      hash(key)
    except TypeError:                  # a leaf that is no array: the read names it
      return read(fn, args, batch_argnums)
    if key not in reads:
      reads[key] = read(fn, args, batch_argnums)
    return reads[key]

  stepgraph.read_step = shared
  try:
    yield reads
  finally:
    stepgraph.read_step = read


def without_jax(path) -> str:
  """A directory with ``jax`` and ``jaxlib`` packages that raise when imported, made under
  ``path`` (a ``pathlib.Path``): first on a process's PYTHONPATH, it shows that what the process
  runs never imports jax."""
  for name in ("jax", "jaxlib"):
    (path / name).mkdir(parents=True)
    (path / name / "__init__.py").write_text(
        'raise ImportError("jax must not be imported here (tests/helpers.py without_jax)")\n')
  return str(path)


@functools.cache
def _parsed(path: str, text: str) -> ast.Module:
  return ast.parse(text, filename=path)


def parsed(path: pathlib.Path) -> ast.Module:
  """The module at ``path``, parsed once per text in this process: the checks of
  tests/test_architecture.py and tests/test_gate.py read the whole package (151 modules, 0.5 s of
  CPU a parse), six of them. Keyed by the text, so a file a test rewrites is parsed again; the
  trees are shared, so a check must not change them."""
  return _parsed(str(path), path.read_text())
