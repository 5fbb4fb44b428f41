"""A grouped convolution's kernels and 'tensor' (dtenjax/_src/planning/roles/tensor.py's
``ungrouped``, step._ungrouped): XLA's SPMD partitioner aborts the whole process (a failed CHECK in
convolution_handler.cc, ``new_input_batch_size % new_output_batch_size == 0 (4 vs. 0)``) on a
grouped convolution whose features a 'tensor' split leaves holding part of a group, so the planner
offers no such split and a pinned one is refused before anything compiles. The layouts XLA aborts
on were found by compiling the plain jax.jit of this step with NamedShardings, one process per
layout (jax 0.10.2, 8 CPU devices): on `tensor` 8 the grouped kernel split on either feature
dimension, the next kernel split on its input features alone (row-parallel), and the three
Megatron splits main planned all abort; the first and last kernels column-parallel compile;
`tensor` 4 and 2 (dividing the 4 groups) compile. The asserts below read the
plan's specs before anything compiles, so on a planner that offers the split they fail instead of
killing pytest."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from tests import compile_only


def _conv(a, k, groups=1):
  return jax.lax.conv_general_dilated(a, k, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                      feature_group_count=groups)


def _loss(p, x):
  h = jnp.tanh(_conv(jnp.tanh(_conv(x, p["w0"])), p["w1"], groups=4))
  return jnp.mean(_conv(h, p["w2"]) ** 2)


def _step(p, x):
  g = jax.grad(_loss)(p, x)
  return {k: p[k] - 0.1 * g[k] for k in p}


# three 3 x 3 convolutions of 8 -> 32 -> 32 -> 8 features, the middle one of 4 groups (review22's
# g4_t), planned and compiled only
_S = jax.ShapeDtypeStruct
_P = {"w0": _S((3, 3, 8, 32), jnp.float32), "w1": _S((3, 3, 8, 32), jnp.float32),
      "w2": _S((3, 3, 32, 8), jnp.float32)}
_X = _S((16, 8, 8, 8), jnp.float32)


def test_no_kernel_of_a_step_with_4_groups_is_split_over_tensor_8_and_the_plan_compiles():
  plan = dtenjax.plan(_step, _P, _X, mesh={"tensor": 8}, batch_argnums=(1,))
  # main planned w0 and w1 column-parallel and w2 row-parallel: 32 features in 4 groups split
  # 8 ways, 4 features a shard where a group has 8; XLA's partitioner aborted compiling it. The
  # grouped kernel is split over no 'tensor', no kernel on its contracted window and input
  # features (row-parallel); a column split (the output features, dimension 3) compiles
  specs = plan.specs[0]
  assert "tensor" not in tuple(specs["w1"]), specs
  rows = {k: s for k, s in specs.items() if "tensor" in tuple(s)[:3]}
  assert not rows, specs
  check = plan.check(_step, _P, _X, compiler_options=compile_only.USERS_PROGRAM)
  assert check.compiled_memory["total"] > 0


@pytest.mark.parametrize("leaf,spec", [
    ("w1", P(None, None, None, "tensor")),   # the grouped kernel's output features: aborts
    ("w2", P(None, None, "tensor")),         # the next one's input features (row): aborts
])
def test_a_kernel_pinned_over_a_tensor_that_splits_the_groups_is_refused(leaf, spec):
  pins = {k: (spec if k == leaf else None) for k in _P}
  with pytest.raises(dtenjax.DtenjaxError,
                     match=rf"\['{leaf}'\].*'tensor' \(8 devices.*4 groups, which 8 does not "
                     r"divide.*without 'tensor'.*divides the groups \(1, 2, 4\)"):
    dtenjax.plan(_step, _P, _X, mesh={"tensor": 8}, batch_argnums=(1,), pinned=(pins, None))
  # on `data` 2 x `tensor` 4 (4 divides the groups) the same pin is planned as pinned: XLA
  # compiles it (a process of its own, 0.10.2)
  plan = dtenjax.plan(_step, _P, _X, mesh={"data": 2, "tensor": 4}, batch_argnums=(1,),
                      pinned=(pins, None))
  assert plan.specs[0][leaf] == spec
