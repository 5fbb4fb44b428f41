"""The meetings over the batch (jaxpr_reader.Meeting: a reduction over the batch whose result later
work reads, which XLA all-reduces over the axes splitting the batch) in loops, under
jax.checkpoint and in a loop's condition: the reader's count and bytes against the all-reduces XLA
compiles for the data-parallel step on 8 CPU devices (loop trips counted), and derived by hand."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import check as check_lib
from dtenjax._src.planning import stepgraph

BATCH, IMAGE = 16, 8


def _norm(y):
  """Batch norm's statistics over the batch and the image (as the convnet family computes them):
  per channel, 3 floats in the forward's two all-reduces and 3 in the backward's two."""
  mean, var = jnp.mean(y, (0, 1, 2)), jnp.var(y, (0, 1, 2))
  return jax.nn.relu((y - mean) * jax.lax.rsqrt(var + 1e-5))


def _conv(x, k):
  return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _sgd(loss):
  def step(p, x):
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x))
  return step


def _images():
  return jax.ShapeDtypeStruct((BATCH, IMAGE, IMAGE, 3), jnp.float32)


def _scanned_stack(c: int, layers: int, per: int, remat: bool):
  """A stem convolution and norm, then ``layers`` scanned layers of ``per`` convolutions each
  followed by a norm (the body under jax.checkpoint if ``remat``): (step, abstract args)."""
  def loss(p, x):
    x = _norm(_conv(x, p["stem"]))

    def body(x, ks):
      for j in range(per):
        x = _norm(_conv(x, ks[j]))
      return x, None
    x, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, x, p["stack"])
    return jnp.mean(x ** 2)
  params = {"stem": jax.ShapeDtypeStruct((3, 3, 3, c), jnp.float32),
            "stack": jax.ShapeDtypeStruct((layers, per, 3, 3, c, c), jnp.float32)}
  return _sgd(loss), (params, _images())


def _checkpointed_blocks(channels):
  """Convolution and norm blocks, each under jax.checkpoint (not in a loop)."""
  def loss(p, x):
    for i in range(len(channels)):
      x = jax.checkpoint(lambda x, k: _norm(_conv(x, k)))(x, p[f"c{i}"])
    return jnp.mean(x ** 2)
  params, cin = {}, 3
  for i, c in enumerate(channels):
    params[f"c{i}"] = jax.ShapeDtypeStruct((3, 3, cin, c), jnp.float32)
    cin = c
  return _sgd(loss), (params, _images())


def _compiled_meetings(step, args):
  """(all-reduces per step, bytes per step) of the DP step's all-reduces of statistics (every
  operand a vector or a scalar: not a weight's gradient), each in a loop counted once per trip."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  compiled = jax.jit(step, in_shardings=(shard(P()),) + (shard(P("data")),) * (len(args) - 1),
                     out_shardings=shard(P())).lower(*args).compile()
  trips = check_lib.loop_repeats(compiled)
  count = nbytes = 0
  for c in dtenjax.explain(compiled).collectives:
    if c.kind == "all_reduce" and all(len(s.dims) <= 1 for o in c.operand_shapes
                                      for s in o.leaves()):
      count += trips(c.computation)
      nbytes += c.nbytes * trips(c.computation)
  return count, nbytes


@pytest.mark.parametrize("per,remat", [(1, False), (2, False), (1, True)],
                         ids=["one-norm-a-layer", "two-norms-a-layer", "checkpointed-layer"])
def test_a_scanned_stacks_meetings_are_counted_once_a_trip_as_xla_compiles_them(per, remat,
                                                                                cpu_devices):
  """A norm inside a lax.scan body meets the devices once a trip: its four all-reduces (6 C
  floats) in the forward's loop and the backward's, and under jax.checkpoint two more (the
  recomputed forward's 3 C floats, in the backward's loop: not the forward's computation, so
  nothing is shared). The stem's norm, outside the loops, four. By hand, XLA's count and the
  reader's agree, trips counted, and the DP plan's all-reduce bytes are the compile's."""
  del cpu_devices
  c, layers = 8, 3
  step, args = _scanned_stack(c, layers, per, remat)
  norms = layers * per
  count = 4 + norms * (4 + 2 * remat)
  nbytes = 4 * c * (6 + norms * (6 + 3 * remat))
  assert _compiled_meetings(step, args) == (count, nbytes)
  g = stepgraph.read_step(step, args, (1,))
  assert (sum(mt.count for mt in g.meetings), sum(mt.nbytes for mt in g.meetings)) == (
      count, nbytes), g.meetings
  # the loop's meetings are counted per trip, the stem's once
  assert sorted({mt.count for mt in g.meetings}) == [1, layers], g.meetings
  # the DP plan's all-reduce bytes per step are the compile's (plan.check counts a loop body's
  # collectives once a trip): the norms' and the gradients' (the stack's, a layer a trip)
  plan = dtenjax.plan(step, *args, mesh={"data": 8})
  check = plan.check(step, *args)
  grads = sum(math.prod(a.shape) * 4 for a in args[0].values())
  assert check.compiled_bytes["all_reduce"] == grads + nbytes, check.table()
  assert check.predicted_bytes["all_reduce"] == pytest.approx(grads + nbytes, rel=1e-9)


def test_a_checkpointed_blocks_recomputed_statistics_join_the_all_reduce_before_them(
    cpu_devices, monkeypatch):
  """Under jax.checkpoint outside a loop the backward recomputes each block's forward: 6 C
  floats of the norm's own four all-reduces and 3 C of the recomputed two, 6 meetings a block.
  The recomputation sits behind an optimization barrier over the block's operands (the
  cotangent among them), which XLA:GPU keeps through its combiner, and jaxlib 0.11's XLA:CPU
  keeps the recomputed convolutions (7 in its optimised HLO): 12 for the two blocks. jaxlib
  0.10's XLA:CPU expands the barrier first and computes the recomputed convolution once with
  the forward's (5 convolutions), so the recomputed norm's first statistics depend on no
  all-reduce since the forward's convolution and its combiner joins them to the all-reduce
  before them (read in the optimised HLO of two blocks of 8 and 16 channels: the second block's
  to its own forward's variance, the first block's to the second's last backward one): 10.
  The bytes are the same either way, and the DP plan predicts the compile's; where XLA:CPU
  joins them the two add no meeting to the price (each at least a wake-up less)."""
  del cpu_devices
  from dtenjax._src.planning import pricing
  channels = (8, 16)
  step, args = _checkpointed_blocks(channels)
  nbytes = 4 * 9 * sum(channels)
  joins = pricing.XLA_VERSION < (0, 11)
  count = (5 if joins else 6) * len(channels)
  assert _compiled_meetings(step, args) == (count, nbytes)
  g = stepgraph.read_step(step, args, (1,))
  assert len(g.meetings) == 6 * len(channels), g.meetings
  assert sum(mt.count for mt in g.meetings if not mt.joins_on_cpu) == 5 * len(channels)
  assert sum(mt.nbytes for mt in g.meetings) == nbytes
  plan = dtenjax.plan(step, *args, mesh={"data": 8}, topology=_sixteen_core_host())
  check = plan.check(step, *args)
  grads = sum(math.prod(a.shape) * 4 for a in args[0].values())
  assert check.compiled_bytes["all_reduce"] == grads + nbytes, check.table()
  assert check.predicted_bytes["all_reduce"] == pytest.approx(grads + nbytes, rel=1e-9)
  read = stepgraph.read_step
  monkeypatch.setattr(stepgraph, "read_step", lambda *a, **k: dataclasses.replace(
      g := read(*a, **k), meetings=tuple(dataclasses.replace(mt, joins_on_cpu=False)
                                         for mt in g.meetings)))
  apart = dtenjax.plan(step, *args, mesh={"data": 8}, topology=_sixteen_core_host())
  assert apart.cost.collective_bytes == plan.cost.collective_bytes
  extra = apart.cost.total_s - plan.cost.total_s
  if joins:
    assert 2 * pricing.MEETING_WAKE_S <= extra <= 2 * 3 * pricing.MEETING_WAKE_S, extra
  else:
    assert extra == 0.0


def _mlp_then(tail):
  """An SGD step of a tanh layer (32 x 32, a batch of 16) whose activations ``tail`` reads
  into the loss."""
  def loss(p, x):
    h = jnp.tanh(x @ p["w"])
    return tail(h)
  params = {"w": jax.ShapeDtypeStruct((32, 32), jnp.float32)}
  return _sgd(loss), (params, jax.ShapeDtypeStruct((16, 32), jnp.float32))


def _converge_on_the_mean(h):
  """A convergence test on a statistic of the batch (its mean), on values the loss then reads."""
  _, t = jax.lax.while_loop(lambda c: (c[0] < 5) & (jnp.mean(jnp.abs(c[1])) > 0.1),
                            lambda c: (c[0] + 1, c[1] * 0.5), (0, jax.lax.stop_gradient(h)))
  return jnp.mean((h - t) ** 2)


def _converge_on_the_columns(h):
  """The same on each column's sum over the batch (32 floats), then their largest."""
  _, t = jax.lax.while_loop(
      lambda c: (c[0] < 5) & (jnp.max(jnp.sum(jnp.abs(c[1]), 0)) > 0.1),
      lambda c: (c[0] + 1, c[1] * 0.5), (0, jax.lax.stop_gradient(h)))
  return jnp.mean((h - t) ** 2)


def _converge_on_the_error_the_body_leaves(h):
  """A convergence test on a statistic of the batch each trip computes and carries to the
  condition (the error it leaves), the initial carry a constant."""
  def trip(c):
    t = c[1] * 0.5
    return c[0] + 1, t, jnp.mean(jnp.abs(t))
  _, t, _ = jax.lax.while_loop(lambda c: (c[0] < 5) & (c[2] > 0.1), trip,
                               (0, jax.lax.stop_gradient(h), jnp.float32(1.0)))
  return jnp.mean((h - t) ** 2)


def _branch_on_the_mean(h):
  """A lax.cond whose predicate is the batch's mean."""
  h = jax.lax.cond(jnp.mean(h) > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
  return jnp.mean(h ** 2)


def _a_loop_nothing_reads(h):
  """A loop on the batch's mean whose result nothing reads: XLA removes it, and its meeting."""
  jax.lax.while_loop(lambda c: (c[0] < 5) & (jnp.mean(c[1]) > 0.1),
                     lambda c: (c[0] + 1, c[1] * 0.5), (0, jax.lax.stop_gradient(h)))
  return jnp.mean(h ** 2)


@pytest.mark.parametrize("tail,meets", [(_converge_on_the_mean, 4),
                                        (_converge_on_the_columns, 4 * 32),
                                        (_converge_on_the_error_the_body_leaves, 4),
                                        (_branch_on_the_mean, 4),
                                        (_a_loop_nothing_reads, 0)],
                         ids=["while-mean", "while-columns", "while-carried-error", "cond-mean",
                              "dead-loop"])
def test_a_predicate_read_from_the_batch_is_a_meeting(tail, meets, cpu_devices):
  """Every device must take the same way through a loop or a branch, so XLA all-reduces the
  statistics of the batch its predicate reads (inside the loop's condition, counted once: its
  trips are not known when it compiles; inside its body where a trip computes the statistic and
  carries it to the condition; before the branch). The reader walks the condition and
  finds them: the bytes by hand, which the compile all-reduces beside the gradient (32 x 32
  floats), and the plan is made."""
  del cpu_devices
  step, args = _mlp_then(tail)
  g = stepgraph.read_step(step, args, (1,))
  assert sum(mt.nbytes for mt in g.meetings) == meets, g.meetings
  assert _compiled_meetings(step, args) == (1 if meets else 0, meets)
  dtenjax.plan(step, *args, mesh={"data": 8})


@pytest.mark.parametrize("tail", [
    lambda h: jnp.mean((h - jnp.mean(h, 0) - jnp.max(jax.lax.stop_gradient(h), 0)) ** 2),
    lambda h: jnp.mean((h - jnp.max(jax.lax.stop_gradient(h), 0) -
                        jnp.min(jax.lax.stop_gradient(h), 0)) ** 2)], ids=["sum-max", "max-min"])
def test_independent_statistics_of_different_reductions_are_apart(tail, cpu_devices):
  """XLA's combiner joins only all-reduces of one reduction: a column's mean and its largest
  value (or its largest and smallest), independent and one after the other, are two all-reduces
  of 32 floats in the forward (the mean's cotangent a third), not one of 64: the reader's
  meetings are the compile's, in count and bytes."""
  del cpu_devices
  step, args = _mlp_then(tail)
  want = _compiled_meetings(step, args)
  assert want[1] == 4 * 32 * want[0]                    # each all-reduce one column statistic
  g = stepgraph.read_step(step, args, (1,))
  assert (sum(mt.count for mt in g.meetings), sum(mt.nbytes for mt in g.meetings)) == want, (
      g.meetings, want)


def test_a_statistic_a_trip_carries_to_the_next_is_a_meeting(cpu_devices):
  """A loop of 3 trips (lax.fori_loop, a scan) whose trip corrects the batch's values by the mean
  the trip before computed and carries (a running correction, 0 before the first): each trip's
  mean meets the next trip's values, and XLA all-reduces it in the body, 3 all-reduces of 4 bytes
  a step (the last trip's too: the loop's body is one computation), by hand and in the compile."""
  del cpu_devices

  def tail(h):
    def trip(_, c):
      t, e = c
      t = t - 0.1 * e
      return t, jnp.mean(t)
    t, _ = jax.lax.fori_loop(0, 3, trip, (jax.lax.stop_gradient(h), jnp.float32(0.0)))
    return jnp.mean((h - t) ** 2)
  step, args = _mlp_then(tail)
  assert _compiled_meetings(step, args) == (3, 12)
  g = stepgraph.read_step(step, args, (1,))
  assert (sum(mt.count for mt in g.meetings), sum(mt.nbytes for mt in g.meetings)) == (3, 12), (
      g.meetings)


def _centre_over_a_vmap_axis(h):
  """Per-example code mapped over the batch by jax.vmap, the statistics over its named axis (a
  pmap habit): the batch's mean, and its largest value (no derivative: of a stopped value)."""
  stop = jax.lax.stop_gradient
  t = jax.vmap(lambda r: r - jax.lax.pmean(r, "batch") - jax.lax.pmax(stop(r), "batch"),
               axis_name="batch")(h)
  return jnp.mean(t ** 2)


def test_a_collective_over_a_vmap_axis_of_the_batch_is_a_meeting(cpu_devices):
  """Under jax.vmap, lax.pmean and lax.pmax over its axis are a sum and a max over the batch's
  dimension (psum and pmax of positional axes in the jaxpr), which XLA all-reduces as it does
  the jnp.mean and jnp.max over the batch of the same step written without vmap: the reader's
  meetings are that compile's, in count and bytes."""
  del cpu_devices
  step, args = _mlp_then(_centre_over_a_vmap_axis)
  plain, plain_args = _mlp_then(lambda h: jnp.mean(
      (h - jnp.mean(h, 0) - jnp.max(jax.lax.stop_gradient(h), 0)) ** 2))
  want = _compiled_meetings(plain, plain_args)
  assert _compiled_meetings(step, args) == want
  g = stepgraph.read_step(step, args, (1,))
  assert (sum(mt.count for mt in g.meetings), sum(mt.nbytes for mt in g.meetings)) == want, (
      g.meetings, want)


def _sixteen_core_host():
  """8 CPU devices sharing 16 cores (the recorded wins runs' host): 5e10 FLOP/s each."""
  from dtenjax._src.topology.model import DeviceInfo, NumaNode, uniform
  devices = [DeviceInfo(id=i, platform="cpu", kind="cpu", memory_bytes=0, process_index=0,
                        host="h0") for i in range(8)]
  return uniform("cpu8", devices, intra="shared_memory",
                 numa_nodes=[NumaNode(host="h0", id=0, cpus="0-15")])


def _waits(step, args, pinned):
  """The exposed seconds the gathers' waits add to the price of ``pinned`` on 8 ``fsdp``
  devices of the 16-core host, priced with the CPU's ``gather_spread`` whatever the step's size
  (these steps are under ``gather_spread_bytes``, where the planner prices no wait)."""
  from dtenjax._src.pricing import costmodel
  from dtenjax.testing.planning import replaced_cost_terms
  price = lambda: dtenjax.plan(step, *args, mesh={"fsdp": 8}, topology=_sixteen_core_host(),
                               pinned=pinned, memory_budget=1 << 40).cost.exposed_s
  with replaced_cost_terms(gather_spread=0.0):
    unwaited = price()
  with replaced_cost_terms(gather_spread=costmodel.backend_costs("cpu").gather_spread):
    return price() - unwaited


def test_a_scanned_layers_gather_after_its_bodys_meeting_waits_for_the_products_since_it():
  """A scanned layer of two convolutions with a norm between them (``a``, norm, ``b``): each
  trip's gather of ``b`` follows the norm's all-reduces in the same trip, and of ``a`` the
  previous trip's norm and ``b``'s convolution (plan.jit's FSDP step, compiled: each layer's
  gather first in the loop's body, after the previous trip's last collective). So ``b``'s
  gathers wait for nothing, and ``a``'s, forward and backward, for ``b``'s convolution (2 x
  batch x image^2 x C x 9 C FLOP a trip, at 5e10 FLOP/s on each of 8 devices, arrivals spread
  gather_spread x 1.4236 of it); without the norm both wait for their own products, more."""
  from dtenjax._src.pricing import costmodel
  c, layers, batch, image = 32, 4, 32, 16

  def make(norm):
    def loss(p, x):
      x = jax.nn.relu(_conv(x, p["stem"]))

      def body(x, ks):
        y = _conv(x, ks[0])
        y = _norm(y) if norm else jax.nn.relu(y)
        return jax.nn.relu(_conv(y, ks[1])), None
      x, _ = jax.lax.scan(body, x, (p["a"], p["b"]))
      return jnp.mean(x ** 2)
    stack = jax.ShapeDtypeStruct((layers, 3, 3, c, c), jnp.float32)
    params = {"stem": jax.ShapeDtypeStruct((3, 3, 3, c), jnp.float32), "a": stack, "b": stack}
    return _sgd(loss), (params, jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32))

  def waits(norm, sharded):
    step, args = make(norm)
    spec = {n: P(None, None, None, None, "fsdp") if n == sharded else P() for n in args[0]}
    return _waits(step, args, [spec, None])

  g = stepgraph.read_step(*make(True), (1,))
  a, b = (next(lf.index for lf in g.leaves if lf.path == f"[0]['{n}']") for n in "ab")
  conv_b = 2 * batch * image * image * c * 9 * c
  assert g.since_meeting == {a: conv_b, b: 0.0}, g.since_meeting
  spread = costmodel.backend_costs("cpu").gather_spread * 1.4236
  assert waits(True, "b") == 0.0
  assert waits(True, "a") == pytest.approx(2 * layers * spread * conv_b / 8 / 5e10, rel=2e-3)
  assert waits(False, "b") > 0.0 and waits(False, "a") > waits(True, "a")


def test_a_residual_steps_independent_statistics_are_joined_as_xla_joins_them(cpu_devices):
  """Two residual blocks, each a main branch of two conv/norm pairs beside a normed projection
  shortcut, whose statistics are independent of the main branch's second pair: 28 reduction
  groups, 6 C floats a norm by hand (7 norms of 8 channels). XLA's combiner joins what follows
  one another and is independent; the compile has 23 all-reduces of statistics alone and 2
  more joined to gradients' all-reduces (not modelled: the gradients are priced apart). The
  reader counts 24, within that range (28 before it joined them)."""
  del cpu_devices
  c, blocks = 8, 2

  def loss(p, x):
    x = _norm(_conv(x, p["stem"]))
    for i in range(blocks):
      h = _norm(_conv(_norm(_conv(x, p[f"a{i}"])), p[f"b{i}"]))
      x = jax.nn.relu(h + _norm(_conv(x, p[f"s{i}"])))
    return jnp.mean(x ** 2)
  params = {"stem": jax.ShapeDtypeStruct((3, 3, 3, c), jnp.float32)}
  params.update({f"{n}{i}": jax.ShapeDtypeStruct((3, 3, c, c), jnp.float32)
                 for i in range(blocks) for n in "abs"})
  step, args = _sgd(loss), (params, _images())
  nbytes = 6 * 4 * c * (1 + 3 * blocks)
  alone, alone_bytes = _compiled_meetings(step, args)
  assert alone == 23 and alone_bytes < nbytes
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  shard = lambda spec: jax.sharding.NamedSharding(mesh, spec)
  compiled = jax.jit(step, in_shardings=(shard(P()), shard(P("data"))),
                     out_shardings=shard(P())).lower(*args).compile()
  ranks = lambda op: [len(s.dims) for o in op.operand_shapes for s in o.leaves()]
  joined = [op for op in dtenjax.explain(compiled).collectives
            if op.kind == "all_reduce" and min(ranks(op)) <= 1 < max(ranks(op))]
  # the blocks' kernels' gradients (the stem's alone after them) and the statistics joined
  kernels = 3 * blocks * 3 * 3 * c * c * 4
  assert len(joined) == 2, joined
  assert sum(op.nbytes for op in joined) == kernels + nbytes - alone_bytes, joined
  g = stepgraph.read_step(step, args, (1,))
  assert sum(mt.nbytes for mt in g.meetings) == nbytes
  assert alone <= len(g.meetings) <= alone + 2, g.meetings
