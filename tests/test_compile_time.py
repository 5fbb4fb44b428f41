"""What the all-reduce of a gradient tree asks XLA to compile, against ``lax.psum``'s program for
the same tree (issue 43 item 3; bench/compile_time.py times it).

XLA:CPU compiles every distinct fused computation (and every standalone concatenate) as an LLVM
module of its own, tens of milliseconds each, whatever its size: the kernels were where the
compile time of a bucketed or reproducible all-reduce went, and on XLA:CPU that work is now
custom calls (``collectives/cpu_ffi.py``), which compile none. The anchor is XLA's own count for per-leaf
work after ``lax.psum`` (one kernel per leaf shape: XLA reuses a kernel for fusions that are the
same computation), not a number of ours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import dtenjax
from dtenjax._src import ffi
from tests.helpers import DEFAULT_CPU_EMITTERS
from tests.helpers import block_tree
from tests.test_collectives import _kernels

AX = "d"


@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices), (AX,))


def _compiled(mesh, body, tree, out_specs=P()):
  # the kernels of the program users get: XLA:CPU's default emitters (the suite's differ)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX),), out_specs=out_specs))
  return f.lower(tree).compile(DEFAULT_CPU_EMITTERS)


@pytest.mark.skipif(not ffi.is_built(),
                    reason="the native extension is not built (bash scripts/setup.sh builds it)")
@pytest.mark.parametrize("reproducible", (False, True))
def test_hierarchical_compiles_the_kernels_lax_psum_s_tree_compiles(cpu_devices, reproducible):
  """hierarchical over (outer, inner): the inner chunks and both rank-order folds (or, for
  reproducible=True's int32 words, both sums) are custom calls on XLA:CPU, so its program
  compiles what psum's over both axes compiles (none)."""
  mesh2 = Mesh(np.array(cpu_devices).reshape(2, 4), ("o", "i"))
  tree = block_tree()

  def compiled(reduce):
    f = jax.jit(jax.shard_map(reduce, mesh=mesh2, in_specs=(P(("o", "i")),), out_specs=P()))
    return f.lower(tree).compile(DEFAULT_CPU_EMITTERS)
  anchor = _kernels(compiled(lambda t: jax.lax.psum(t, ("o", "i"))).as_text())
  ours = compiled(lambda t: dtenjax.all_reduce(t, ("o", "i"), algorithm="hierarchical",
                                               reproducible=reproducible))
  assert ("dtenjax_cpu_ring_step" if reproducible else "dtenjax_cpu_fold") in ours.as_text()
  assert _kernels(ours.as_text()) <= anchor, anchor
  out = ours(tree)
  for k, v in tree.items():
    np.testing.assert_array_equal(out[k][0], np.asarray(v).sum(0))   # exact: small integers


_KINDS = ({"algorithm": "two_shot"}, {"algorithm": "ring"}, {"reproducible": True},
          {"reproducible": True, "algorithm": "two_shot"},
          {"reproducible": True, "algorithm": "one_shot"}, {"algorithm": "one_shot"},
          {"algorithm": "butterfly"}, {"reproducible": True, "algorithm": "xla"},
          {"reproducible": True, "algorithm": "ring"},
          {"reproducible": True, "algorithm": "butterfly"})
_IDS = ("two_shot", "ring", "reproducible", "reproducible_two_shot", "reproducible_one_shot",
        "one_shot", "butterfly", "reproducible_xla", "reproducible_ring", "reproducible_butterfly")


@pytest.mark.skipif(not ffi.is_built(),
                    reason="the native extension is not built (bash scripts/setup.sh builds it)")
@pytest.mark.parametrize("kwargs", _KINDS, ids=_IDS)
def test_with_the_custom_calls_a_bucket_compiles_the_kernels_lax_psum_s_tree_compiles(mesh,
                                                                                   kwargs):
  """On XLA:CPU the bucket's packing, the chunks an all-to-all sends, the fold, ring's steps or
  the exact sum and the copies out of the bucket are custom calls (cpu_ffi.py): thunks, no
  compiled kernel. The program then compiles what lax.psum's program for the same tree compiles
  (none), and ring and butterfly what lax.axis_index costs besides (the rank picks the chunk each
  step reads, or the half it keeps); with the update a step makes of the gradients, what psum's
  step compiles (a kernel per leaf shape), the rank besides. The sums are exact in float32: any order gives them."""
  tree = block_tree()
  shapes = len({v.shape for v in tree.values()})
  psum = lambda t: jax.lax.psum(t, AX)
  rank = 0
  if kwargs.get("algorithm") in ("ring", "butterfly"):
    rank = _kernels(_compiled(mesh, lambda t: (psum(t), jax.lax.axis_index(AX)[None]), tree,
                              (P(), P(AX))).as_text()) - _kernels(_compiled(mesh, psum, tree)
                                                                   .as_text())
  step = lambda reduce: lambda t: jax.tree.map(lambda g: g * 2, reduce(t))
  anchor = _kernels(_compiled(mesh, psum, tree).as_text())
  step_anchor = _kernels(_compiled(mesh, step(psum), tree).as_text())
  assert step_anchor == shapes, step_anchor         # XLA: one kernel per leaf shape
  ours = lambda t: dtenjax.all_reduce(t, AX, **kwargs)
  compiled = _compiled(mesh, ours, tree)
  assert "dtenjax_cpu_" in compiled.as_text()
  assert _kernels(compiled.as_text()) <= anchor + rank, (anchor, rank)
  out = compiled(tree)
  for k, v in tree.items():
    np.testing.assert_array_equal(out[k][0], np.asarray(v).sum(0))
  assert _kernels(_compiled(mesh, step(ours), tree).as_text()) <= step_anchor + rank, step_anchor


@pytest.mark.parametrize("kwargs", _KINDS[:4], ids=_IDS[:4])
def test_a_bucket_compiles_three_kernels_more_than_psum_with_per_leaf_work(mesh, kwargs,
                                                                           monkeypatch):
  """Without the custom calls (no extension, or DTENJAX_CPU_FFI=0: the jnp formulation), a
  bucket costs the kernels of its leaves' shapes (the copies out of it, as XLA's per-leaf
  work after lax.psum costs) plus three: the bucket's concatenate, the copy of the chunks an
  all-to-all takes (ring: the first chunk sent) and the fold (ring: a step's add; reproducible:
  the exact sum). Ring stacked its chunks into one more buffer and the reproducible owner sum
  stacked what the all-to-all received, a kernel each (7 where 6 now, bench/compile_time.py)."""
  monkeypatch.setenv("DTENJAX_CPU_FFI", "0")
  tree = block_tree()
  shapes = len({v.shape for v in tree.values()})
  anchor = _kernels(_compiled(
      mesh, lambda t: jax.tree.map(lambda g: g * 2, jax.lax.psum(t, AX)), tree).as_text())
  assert anchor == shapes, anchor                   # XLA: one kernel per leaf shape
  compiled = _compiled(mesh, lambda t: dtenjax.all_reduce(t, AX, **kwargs), tree)
  assert "dtenjax_cpu_" not in compiled.as_text()
  assert _kernels(compiled.as_text()) <= anchor + 3
  out = compiled(tree)
  for k, v in tree.items():                         # exact in float32: any order gives these
    np.testing.assert_array_equal(out[k][0], np.asarray(v).sum(0))


@pytest.mark.parametrize("kwargs", ({"algorithm": "ring"},
                                    {"reproducible": True, "algorithm": "two_shot"}),
                         ids=("ring", "reproducible_two_shot"))
def test_the_leaner_buckets_differentiate_as_lax_psum(mesh, kwargs):
  """Ring's chunks read in place and the owner sum reading what the all-to-all received: the
  gradient through the bucket under plain jax.shard_map (check_vma=True) is lax.psum's."""
  tree = {k: v * (1 + 0.25 * i) for i, (k, v) in enumerate(block_tree(1).items())}

  def grad(reduce):
    step = jax.shard_map(lambda t: reduce(t), mesh=mesh, in_specs=(P(AX),), out_specs=P())
    return jax.jit(jax.grad(lambda t: sum(jnp.sum(jnp.sin(y)) for y in
                                          jax.tree.leaves(step(t)))))(tree)
  ours = grad(lambda t: dtenjax.all_reduce(t, AX, **kwargs))
  theirs = grad(lambda t: jax.lax.psum(t, AX))
  for k in tree:
    np.testing.assert_allclose(ours[k], theirs[k], rtol=1e-6, atol=1e-6)
