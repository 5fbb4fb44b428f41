"""plan.jit gathers FSDP weights where products read them (dtenjax/_src/planning/gather.py): one
layer at a time inside lax.scan, never the whole stack, the optimizer's update left sharded, and
the same values as the step itself.

The yardstick is what a user writes without dtenjax: plain jax.jit with NamedShardings, FSDP over
all devices (bench/_families.py's hand-written recipes)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src import hlo
from dtenjax._src.planning import gather
from tests import compile_only
from tests import helpers

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
import _families as families


VOCAB = 512


def _scan_family():
  return families.llama(scan=True, vocab=VOCAB, d=128, heads=4, ffn=256, layers=3, batch=16,
                        seq=128)


pytestmark = helpers.one_worker(__name__)    # its planned and compiled FSDP step, made once


@pytest.fixture(scope="module")
def scanned():
  fam = _scan_family()
  step, args = fam.make()
  plan = dtenjax.plan(step, *args, recipe="FSDP")
  # Compiled for its structure (collectives, loops, bytes): the program users get, its machine
  # code unoptimised (tests/compile_only.py; 3.8 -> 2.0 s of CPU). The values test runs it (the
  # same HLO: the same values, 0.2 s more to run).
  compiled = plan.jit(step).lower(*args).compile(compile_only.USERS_PROGRAM)
  return fam, step, args, plan, compiled


@pytest.fixture(scope="module")
def bare(scanned):
  """Plain jax.jit with the FSDP recipe's shardings and no gathers at all: (jitted, compiled)."""
  fam, _, args, _, _ = scanned
  r = families.recipe(fam, "FSDP")
  fn, _ = families.recipe_jit(fam, families.Recipe("FSDP", r.mesh, r.param_specs, {},
                                                   r.batch_axes))
  return fn, fn.lower(*args).compile(compile_only.USERS_PROGRAM)     # read, never run


def _real_args(fam, seed: int = 0):
  """Concrete arguments as families.real_args makes them (small random parameters, adamw's
  state, a batch of tokens), on the host: the parameters and tokens drawn with numpy, the
  optimizer state from one jitted init. families.real_args draws each leaf with an eager
  jax.random.normal, a program compiled per leaf shape (7 s of CPU for this model; one jitted
  program of all the draws still 5 s), and its device arrays made the step's first call compile
  a reshard; the family's eager jax.random.randint of the tokens was a 0.8 s compile."""
  _, (params, _, batch) = fam.make()
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda l: (0.02 * rng.standard_normal(l.shape)).astype(l.dtype), params)
  opt = jax.tree.map(np.asarray, jax.jit(optax.adamw(1e-3).init)(params))
  return params, opt, rng.integers(0, VOCAB, batch.shape).astype(batch.dtype)


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def nbytes(compiled) -> int:
  """Collective bytes per step: a collective in a loop body counts once per iteration."""
  module = hlo.read_compiled(compiled)
  trips = {name: ins.trip_count or 1 for ins in module.instructions() if ins.opcode == "while"
           for name in ins.called}
  return sum(c.nbytes * trips.get(c.computation, 1) for c in module.collectives())


def _gathers(compiled):
  """(all-gathers inside while-loop bodies, all-gathers outside), with their result bytes."""
  module = hlo.read_compiled(compiled)
  bodies = {name for ins in module.instructions() if ins.opcode == "while"
            for name in ins.called}
  inside, outside = [], []
  for c in module.collectives():
    if c.kind == "all_gather":
      (inside if c.computation in bodies else outside).append(c)
  return inside, outside


def test_a_stacked_weight_is_gathered_one_layer_at_a_time_inside_the_loop(scanned):
  fam, step, args, plan, compiled = scanned
  del fam, step
  inside, outside = _gathers(compiled)
  layers = args[0]["layers"]
  # every stacked kernel sharded by the plan is gathered in the loop bodies, a layer's slice each
  slice_shapes = {tuple(x.shape[1:]) for k, x in layers.items() if x.ndim >= 3 or
                  k.startswith("w_")}
  # (XLA gathers the dynamic slice of one layer: a leading dimension of 1)
  gathered_in_loop = {tuple(c.result_shape.dims)[1:] if c.result_shape.dims[:1] == (1,) else
                      tuple(c.result_shape.dims) for c in inside}
  assert slice_shapes <= gathered_in_loop, (slice_shapes, gathered_in_loop)
  # and nothing outside the loops gathers a stacked weight (which would gather every layer)
  n = layers["wq"].shape[0]
  assert not [c for c in outside if len(c.result_shape.dims) >= 3 and c.result_shape.dims[0] == n]
  del plan


def test_memory_and_bytes_against_the_fsdp_a_user_writes(scanned, bare):
  fam, step, args, plan, compiled = scanned
  del step, plan
  r = families.recipe(fam, "FSDP")
  user, _ = families.recipe_jit(fam, r)
  user_c = user.lower(*args).compile(compile_only.USERS_PROGRAM)
  _, bare_c = bare            # plain jax.jit with the same FSDP shardings, no gathers at all
  assert _memory(compiled) <= 1.10 * _memory(user_c), (_memory(compiled), _memory(user_c))
  assert _memory(compiled) <= 1.10 * _memory(bare_c), (_memory(compiled), _memory(bare_c))

  # Bytes per step (a loop body's collectives once per iteration) are no more than plain FSDP's
  # under jax.jit, which moves activations instead of gathering.
  assert nbytes(compiled) <= nbytes(bare_c), (nbytes(compiled), nbytes(bare_c))


def test_the_gathered_step_computes_what_the_step_computes(scanned):
  # A sharding constraint changes no value; XLA may sum partial products in another order for
  # another layout, so values agree to float32 rounding, not bit for bit.
  # The gathered step is the fixture's executable (plan.jit's program, compiled once for its
  # structure and run here), so that it is not compiled a second time for its values.
  fam, step, _, plan, compiled = scanned
  real = _real_args(fam)
  want = jax.jit(step, compiler_options=compile_only.LLVM_O0)(*real)   # the same HLO
  got = compiled(*plan.shard(*real))
  assert float(got[2]) == pytest.approx(float(want[2]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_the_optimizer_update_reads_the_sharded_weight():
  # a weight read by a product and by elementwise optimizer arithmetic: only the product's read
  # is gathered, so the update stays sharded (no gather of the moments or the update)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))

  def step(w, x):
    y = x @ w.astype(jnp.bfloat16).astype(jnp.float32)
    g = jnp.sum(y)
    return w * 0.9 + g, y

  fn = gather.gather_for_compute(step, mesh, (P(None, None), None))
  jaxpr = jax.make_jaxpr(fn)(jnp.ones((64, 32)), jnp.ones((16, 64)))
  constraints = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "sharding_constraint"]
  assert len(constraints) == 1
  # the weight is followed through its casts and gathered where the product reads it; the
  # update reads the sharded weight itself
  (c,) = constraints
  users = [e.primitive.name for e in jaxpr.jaxpr.eqns if c.outvars[0] in e.invars]
  assert users == ["dot_general"]
  (mul,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "mul"]
  assert mul.invars[0] is jaxpr.jaxpr.invars[0]


def test_weights_followed_through_nested_jit_and_transpose():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))

  @jax.jit
  def inner(w, x):
    return x @ w.T

  def step(w, x):
    return inner(w, x).sum()

  fn = gather.gather_for_compute(step, mesh, (P("fsdp", None), None))
  text = str(jax.make_jaxpr(fn)(jnp.ones((64, 32)), jnp.ones((16, 32))))
  # the transposed weight (32, 64) is constrained with the transposed layout, inside the call
  assert "sharding_constraint" in text
  w = jax.device_put(jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32),
                     NamedSharding(mesh, P("fsdp", None)))
  x = jnp.ones((16, 32))
  np.testing.assert_array_equal(jax.jit(fn)(w, x), jax.jit(step)(w, x))


def test_nothing_planned_is_the_step_itself():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))

  def step(w):
    return w @ w

  fn = gather.gather_for_compute(step, mesh, (None,))
  assert "sharding_constraint" not in str(jax.make_jaxpr(fn)(jnp.ones((8, 8))))
