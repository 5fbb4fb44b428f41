"""What the cost model charges for the bytes a collective puts on the wire, read from the programs
the algorithms lower to: a bfloat16 sum accumulates in float32, and the records whose schedules
send partial sums (xla's psum of the widened input, ring's and butterfly's steps, hierarchical's
cross-island stage, the host transport) send float32 there; the formulas must charge those bytes,
not the input's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from dtenjax._src import hlo
from dtenjax._src.contract import Contract
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import registry
from dtenjax._src.collectives.all_reduce import all_reduce
from dtenjax._src.collectives.reduce_scatter import reduce_scatter
from dtenjax._src.pricing import algorithms as prices
from dtenjax._src.pricing import costmodel as cm
from dtenjax._src.pricing import registry as pricing_registry
from dtenjax._src.topology.model import LinkSpec
from tests import test_costmodel as cmt

AX = cmt.AX
E = cmt.E                   # elements per device
CPU_RECORDS = ("xla", "ring", "one_shot", "two_shot", "hierarchical", "butterfly")


def _lowered_collectives(mesh, name, kind, dtype):
  """The collectives of the program ``algorithm=name`` lowers to for ``E`` elements of ``dtype``
  per device, as jax emits them (before XLA:CPU's own passes, which run 16-bit collectives in
  float32 on the host: the operand types here are the ones a GPU's NCCL receives)."""
  if kind == "all_reduce":
    f = lambda v: all_reduce(v, AX, algorithm=name)
  else:
    f = lambda v: reduce_scatter(v, AX, algorithm=name, tiled=True)
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec(AX),
                               out_specs=PartitionSpec(AX)))
  text = step.lower(jax.ShapeDtypeStruct((8 * E,), dtype)).as_text(dialect="hlo")
  return hlo.parse_text(text).collectives()


def _link_bytes(record, call):
  """The bytes ``record``'s formula sends over links for ``call`` over devices 0-7: its
  derivative in beta, with one link spec inside and across pcie_8's islands (as
  test_costmodel's ``_coefficients``), priced through the record as ``auto`` prices it (the
  fixture's devices are GPUs; the call's backend says whose compiler runs it)."""
  def at(bw):
    spec = LinkSpec(bw, 5.0)
    topo = cmt.PCIE.with_links({"pcie": spec, "numa_cross": spec})
    return record.time(call, list(range(8)), topo, cmt.GPU)
  return (at(10.0) - at(20.0)) / (1 / 10e9 - 1 / 20e9)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter"])
def test_a_bfloat16_sum_is_priced_at_the_bytes_its_lowered_program_sends(cpu_devices, kind):
  """For every XLA-native record, the link bytes its formula charges for a bfloat16 sum are the
  bytes its lowered program's collectives carry, each at its operand's type (float32 partial
  sums, bfloat16 inputs and results). Before the formulas carried ``Terms.w``, ring, butterfly,
  hierarchical and xla were charged the bfloat16 bytes of steps that send float32."""
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  call = base.Call(kind, "sum", jnp.bfloat16, AX, (2, 4), 2 * E, backend="gpu", nvls=False)
  records = {a.name: a for a in registry.REGISTRY if a.why_not(call) is None}
  assert set(CPU_RECORDS) <= set(records)
  widened = set()
  for name in CPU_RECORDS:
    ops = _lowered_collectives(mesh, name, kind, jnp.bfloat16)
    types = {c.dtype for c in ops}
    assert types <= {"bf16", "f32"}, (name, types)
    if "f32" in types:
      widened.add(name)
    sent = sum(cmt._received(c) for c in ops)
    assert _link_bytes(records[name], call) == pytest.approx(sent), (name, ops)
  # the programs read: which records send partial sums in float32 (docs/collectives.md's table)
  assert widened == {"xla", "ring", "hierarchical", "butterfly"}


def test_on_cpu_a_bfloat16_sum_is_priced_as_the_float32_collectives_xla_cpu_compiles(
    cpu_devices):
  """XLA:CPU compiles every 16-bit collective in float32 (converting around it): one_shot's
  all-gather and two_shot's all-to-all and all-gather of a bfloat16 input are float32 in the
  compiled HLO, twice the lowered program's bytes. On CPU devices a bfloat16 sum is priced at
  those bytes, for every record: auto's ranking there is the float32 one (xla, as before),
  where the lowered program's bytes would price xla's widened psum above two_shot's."""
  _assert_priced_as_compiled_in_float32(cpu_devices, reproducible=False)


def _assert_priced_as_compiled_in_float32(cpu_devices, **kwargs):
  """one_shot's and two_shot's bfloat16 sum on 8 CPU devices (2 x 4): every collective XLA:CPU
  compiles is float32, and the record's link bytes are the bytes those collectives move."""
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)
  contract = {"contract": Contract.V3} if kwargs.get("reproducible") else {}
  call = base.Call("all_reduce", "sum", jnp.bfloat16, AX, (2, 4), 2 * E, backend="cpu",
                   **contract)
  for name in ("one_shot", "two_shot"):
    step = jax.jit(jax.shard_map(lambda v: all_reduce(v, AX, algorithm=name, **kwargs),
                                 mesh=mesh, in_specs=PartitionSpec(AX),
                                 out_specs=PartitionSpec(AX)))
    ops = hlo.read_compiled(step.lower(jax.ShapeDtypeStruct((8 * E,), jnp.bfloat16))
                            .compile(cmt.LLVM_O0)).collectives()
    assert {c.dtype for c in ops} == {"f32"}, (name, ops)
    sent = sum(cmt._received(c) for c in ops)
    assert _link_bytes(registry.get(name), call) == pytest.approx(sent), (name, ops)


def test_partial_sum_widths_by_op_and_dtype():
  """``carried``: float32 partials for sums and means of 16-bit floats, the input's width for
  float32 and for max/min (order keys of the input's width); the host transport widens 16-bit
  keys to int32 (collectives/algorithms/host.py)."""
  def call(op, dtype):
    return base.Call("all_reduce", op, dtype, ("x",), (8,), 1024, backend="cpu")
  for op, dtype, want, host in (("sum", jnp.bfloat16, 2, 2), ("mean", jnp.float16, 2, 2),
                                ("sum", jnp.float32, 1, 1), ("max", jnp.bfloat16, 1, 2),
                                ("min", jnp.float32, 1, 1), ("sum", jnp.int32, 1, 1)):
    assert prices.RING.carried(call(op, dtype)) == want, (op, dtype)
    assert prices.HOST_RING.carried(call(op, dtype)) == host, (op, dtype)


def test_auto_prices_xla_s_bfloat16_psum_at_float32_bytes_and_picks_two_shot():
  """dgx_a100_8, 64 MiB of bfloat16 per device over 8 GPUs: xla's psum of the float32 input
  sends 2 x 7/8 x 128 MiB, where two_shot's all-to-all and all-gather send bfloat16 (2 x 7/8 x
  64 MiB); by hand, with the GPU costs (one latency per collective, NVLink's alpha and beta, the
  local passes at the local link's bandwidth):
  xla = L + 2 (a + 7/8 2N b) + 2 N m, two_shot = 2 L + 2 a + 2 (7/8) N b + P + 3 N m.
  Priced at the input's bytes xla was 482 us against two_shot's 537 and won; now two_shot
  wins."""
  N = 64 << 20
  L, P = cmt.GPU.xla_collective_us * 1e-6, cmt.GPU.local_pass_us * 1e-6
  a, b, m = cmt.NV_A, 1 / cmt.NV_BW, 1 / cmt.LOCAL_BW
  want_xla = L + 2 * (a + 7 / 8 * 2 * N * b) + 2 * N * m
  want_two = 2 * L + 2 * a + 2 * 7 / 8 * N * b + P + 3 * N * m
  call = base.Call("all_reduce", "sum", jnp.bfloat16, ("x",), (8,), N, backend="gpu",
                   nvls=False)
  ch = registry.choose(call, list(range(8)), cmt.DGX)
  assert ch.times["xla"] == pytest.approx(want_xla, rel=1e-12)
  assert ch.times["two_shot"] == pytest.approx(want_two, rel=1e-12)
  assert ch.algorithm == "two_shot"
  # float32 of the same bytes: nothing is widened, xla keeps the call
  f32 = dataclasses.replace(call, dtype=jnp.dtype(jnp.float32))
  assert registry.choose(f32, list(range(8)), cmt.DGX).algorithm == "xla"


def test_the_whole_step_planner_s_all_reduce_is_xla_s_of_the_gradient_s_dtype():
  """``registry.xla_all_reduce_time`` prices the all-reduce XLA inserts in a planned step, of
  the gradient's own dtype (nothing widens it): a bfloat16 gradient of N bytes costs what XLA's
  all-reduce of N bytes costs, half the xla record's float32 psum of the same input."""
  N = 1 << 20
  group = list(range(8))
  plain = cm.collective_time("all_reduce", N, group, cmt.DGX)
  assert pricing_registry.xla_all_reduce_time(N, group, (8,), cmt.DGX, "bfloat16") == plain
  # the xla record's float32 psum of the same input: N more bytes through both ring passes
  widened = cm.collective_time("all_reduce", N, group, cmt.DGX, carried=2)
  assert widened - plain == pytest.approx(2 * 7 / 8 * N / cmt.NV_BW, rel=1e-9)



def test_an_all_to_all_over_a_stage_spanning_hosts_pays_the_slow_link_for_the_peers_off_host(
    cpu_devices):
  """hierarchical's reduce-scatter over axes (4, 2) on two hosts of four (roce_a100_4x8's
  devices 0-3 and 8-11): its second stage is an all-to-all over 4 ranks, two on each host, so
  each rank sends one chunk to its host-mate and two across. The formula's bytes on each link
  class are the lowered program's, each all-to-all's chunks counted by where their peer is;
  its RoCE latencies are the two peers across (before, the stage was priced on its slowest
  link: all three chunks and three latencies on RoCE)."""
  mesh = Mesh(np.array(cpu_devices).reshape(4, 2), AX)
  step = jax.jit(jax.shard_map(
      lambda v: reduce_scatter(v, AX, algorithm="hierarchical", tiled=True), mesh=mesh,
      in_specs=PartitionSpec(AX), out_specs=PartitionSpec(AX)))
  text = step.lower(jax.ShapeDtypeStruct((8 * E,), jnp.float32)).as_text(dialect="hlo")
  ops = hlo.parse_text(text).collectives()
  assert {c.kind for c in ops} == {"all_to_all"}, ops
  host = lambda d: d // 4                       # logical ids 0-3 on one host, 4-7 on the other
  inside = across = 0.0
  for c in ops:
    group = next(g for g in c.replica_groups if 0 in g)
    chunk = c.nbytes / len(group)               # what rank 0 sends each peer
    inside += chunk * sum(host(d) == host(0) for d in group if d != 0)
    across += chunk * sum(host(d) != host(0) for d in group if d != 0)
  n_bytes = 4 * E
  assert (inside, across) == (pytest.approx(n_bytes / 2 + n_bytes / 2 / 4),
                              pytest.approx(2 * n_bytes / 2 / 4))
  cost = registry.get("hierarchical").cost
  hosts2 = cmt.HOSTS2
  for link, got in (("roce", across), ("nvlink", inside)):
    assert cmt._d("reduce_scatter", cost, hosts2, cmt.ROCE, link, "bytes", n_bytes,
                  inner=2) == pytest.approx(got), link
  assert cmt._d("reduce_scatter", cost, hosts2, cmt.ROCE, "roce", "latency", n_bytes,
                inner=2) == pytest.approx(2)


def test_a_share_of_a_combined_all_reduce_is_priced_at_the_combined_point_on_a_measured_curve():
  """``Pricer.share`` with ``of`` (the combined collective's bytes) on a calibration whose
  all-reduce curve is 3 ms at 1 MiB and 43 ms at 9 MiB (tests/test_calibration.py's CAL): three
  sibling weights' 2 MiB input gradients in one tuple all-reduce of 6 MiB cost 3 + 5 x 5 = 28 ms
  by the curve; their three shares and one latency (the curve below its first size, 3 ms) add up
  to it. Each at its own point (no ``of``) they were 3 x (8 - 3) + 3 = 18 ms. Where the
  calibration does not cover the group (another topology's devices), the price is alpha-beta's
  and ``of`` changes nothing."""
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.pricing import Pricer
  from dtenjax._src.planning.roles import AXES
  from tests import test_calibration as tcal
  MiB = 1 << 20
  shape = tuple(8 if a == "tensor" else 1 for a in AXES)
  topo = dataclasses.replace(tcal._cpu_host(8, "0-1"), calibration=tcal.CAL)
  pricer = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), topo),
                  pricing_registry.xla_all_reduce_time)
  latency = pricer("all_reduce", 1, ("tensor",), "float32")
  assert latency - pricer.step_latency == pytest.approx(3e-3)
  combined = 3 * pricer.share("all_reduce", 2 * MiB, ("tensor",), "float32", of=6 * MiB)
  assert combined + latency - pricer.step_latency == pytest.approx(28e-3)
  parts = 3 * pricer.share("all_reduce", 2 * MiB, ("tensor",), "float32")
  assert parts + latency - pricer.step_latency == pytest.approx(18e-3)
  plain = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1")),
                 pricing_registry.xla_all_reduce_time)
  assert plain.share("all_reduce", 2 * MiB, ("tensor",), "float32", of=6 * MiB) == \
      plain.share("all_reduce", 2 * MiB, ("tensor",), "float32")


def test_the_step_planner_prices_a_bfloat16_collective_on_cpu_at_the_float32_bytes_xla_moves(
    cpu_devices):
  """XLA:CPU all-reduces a bfloat16 gradient, and all-gathers a bfloat16 weight, in float32
  (the compiled HLO of a data-parallel and a gathered step, 8 CPU devices: f32[256,256] each,
  twice the weight's 128 KiB); the whole-step planner's Pricer on CPU devices prices them at
  those bytes, and a GPU's (whose NCCL moves bfloat16) at the weight's."""
  from jax.sharding import NamedSharding
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.pricing import Pricer
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.topology.model import Topology
  from tests import test_calibration as tcal
  mesh = Mesh(np.array(cpu_devices), ("data",))
  whole, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))

  def step(w, x):
    w = jax.lax.with_sharding_constraint(w, whole)
    g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w).astype(jnp.float32)))(w)
    return w - 0.1 * g
  x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=split)
  w = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=split)
  ops = hlo.read_compiled(jax.jit(step, out_shardings=split).lower(w, x)
                          .compile(cmt.LLVM_O0)).collectives()
  assert sorted((c.kind, c.nbytes, c.dtype) for c in ops) == [
      ("all_gather", 2 * 256 * 256 * 2, "f32"), ("all_reduce", 2 * 256 * 256 * 2, "f32")]
  nb = 256 * 256 * 2
  shape = tuple(8 if a == "data" else 1 for a in AXES)
  cpu = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1")),
               pricing_registry.xla_all_reduce_time)
  for kind in ("all_reduce", "all_gather"):
    assert cpu(kind, nb, ("data",), "bfloat16") == cpu(kind, 2 * nb, ("data",), "float32"), kind
  # widened once whatever the all-reduce's price: auto's (registry.all_reduce_time, whose
  # records widen a bfloat16 sum on CPU themselves) is handed the float32 bytes, not widened
  # again (before: four times the weight's bytes)
  auto = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1")),
                pricing_registry.AllReducePrices())
  assert auto("all_reduce", nb, ("data",), "bfloat16") == \
      auto("all_reduce", 2 * nb, ("data",), "float32")
  gpu = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), Topology.fixture("h200_8")),
               pricing_registry.xla_all_reduce_time)
  for kind in ("all_reduce", "all_gather"):
    assert gpu(kind, nb, ("data",), "bfloat16") == gpu(kind, nb, ("data",), "float32"), kind


def test_on_cpu_a_float16_collective_stays_float16_and_is_priced_so(cpu_devices):
  """XLA:CPU widens bfloat16 collectives to float32, not float16 ones: two_shot's all-to-all and
  all-gather and XLA's own psum and all-gather of a float16 input are float16 in the compiled
  HLO (jaxlib 0.10). So on CPU devices a float16 sum is priced at the bytes its program sends
  (two_shot: the input's, as on a GPU), and the whole-step planner's Pricer prices a float16
  collective at its own bytes. Before, both doubled every 16-bit float: two_shot's float16 sum at
  twice the bytes it moves, a float16 gradient's all-reduce and a weight's all-gather too."""
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.pricing import Pricer
  from dtenjax._src.planning.roles import AXES
  from tests import test_calibration as tcal
  mesh = Mesh(np.array(cpu_devices).reshape(2, 4), AX)

  def f(v):
    return (all_reduce(v, AX, algorithm="two_shot"), jax.lax.psum(v, AX),
            jax.lax.all_gather(v, AX, tiled=True))
  step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=PartitionSpec(AX),
                               out_specs=(PartitionSpec(AX), PartitionSpec(), PartitionSpec(AX))))
  ops = hlo.read_compiled(step.lower(jax.ShapeDtypeStruct((8 * E,), jnp.float16))
                          .compile(cmt.LLVM_O0)).collectives()
  assert {c.dtype for c in ops} == {"f16"}, ops
  assert sorted(c.kind for c in ops) == ["all_gather", "all_gather", "all_reduce", "all_to_all"]
  # two_shot's collectives: the all-to-all and the all-gather of its result (E / 8 values each)
  sent = sum(cmt._received(c) for c in ops if c.kind == "all_to_all" or
             (c.kind == "all_gather" and c.nbytes == 2 * E))
  call = base.Call("all_reduce", "sum", jnp.float16, AX, (2, 4), 2 * E, backend="cpu")
  assert _link_bytes(registry.get("two_shot"), call) == pytest.approx(sent), ops
  shape = tuple(8 if a == "data" else 1 for a in AXES)
  cpu = Pricer(CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1")),
               pricing_registry.xla_all_reduce_time)
  for kind in ("all_reduce", "all_gather"):
    assert cpu(kind, 2 * E, ("data",), "float16") == cpu(kind, 2 * E, ("data",), "float32"), kind


def test_a_bfloat16_step_on_cpu_is_priced_as_the_float32_step_whose_collectives_it_compiles(
    cpu_devices):
  """An MLP with a bias and an argmax over the batch per hidden unit (a metric the step
  returns), on `data` 4 x `tensor` 2 (8 CPU devices), w1 column- and w2 row-parallel: XLA:CPU
  compiles it with bfloat16 weights and activations, and with float32 weights cast to bfloat16
  for the products (mixed precision), with exactly the float32 step's collectives (the compiled
  HLO below: every bfloat16 all-reduce and all-gather in float32, the argmax's int32 indices as
  they are); with float16 it keeps them float16, half the float32 bytes. So every layout's
  collectives are priced as the float32 step's in the first two: a row-parallel output's
  all-reduce and a column-parallel input gradient's (roles/tensor.py counts them at 4 bytes an
  element), the activations' gathers, the bias's all-gather, the argmax's gathers (its int32
  indices over 'tensor', its partials over 'data'), the gradients' shares; and the float16 step's
  activation all-reduce at half the float32 bytes. Before, the Pricer widened the first by the
  weight's bfloat16 again (twice the bytes that move), the int32 indices too, the bfloat16
  partials not at all, the mixed step's bfloat16 activation gathers not at all; a gradient's
  share subtracted a latency of 2 bytes; float16 activations were counted at 4 bytes."""
  from jax.sharding import NamedSharding
  from dtenjax._src.planning import stepgraph
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.planning.solver import make_problem
  from tests import test_calibration as tcal

  def step(p, x):
    c = lambda v: v.astype(x.dtype)
    def loss(p):
      h = jnp.tanh(x @ c(p["w1"]) + c(p["b1"]))
      return jnp.mean((h @ c(p["w2"])).astype(jnp.float32) ** 2)
    new = jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
    return new, jnp.argmax(jnp.tanh(x @ c(p["w1"]) + c(p["b1"])), axis=0)

  def args(weights, acts):
    return ({"w1": jax.ShapeDtypeStruct((64, 128), weights),
             "b1": jax.ShapeDtypeStruct((128,), weights),
             "w2": jax.ShapeDtypeStruct((128, 64), weights)},
            jax.ShapeDtypeStruct((256, 64), acts))
  mesh = Mesh(np.array(cpu_devices).reshape(4, 2), ("data", "tensor"))
  s = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
  layout = {"w1": s(None, "tensor"), "b1": s(), "w2": s("tensor", None)}

  def compiled(*dtypes):
    c = jax.jit(step, in_shardings=(layout, s("data")), out_shardings=(layout, s()))
    ops = hlo.read_compiled(c.lower(*args(*dtypes)).compile(cmt.LLVM_O0)).collectives()
    return sorted((c.kind, c.nbytes, c.dtype) for c in ops)

  def priced(*dtypes):
    graph = stepgraph.read_step(step, args(*dtypes), (1,))
    shape = tuple({"data": 4, "tensor": 2}.get(a, 1) for a in AXES)
    m = CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1"))
    prob = make_problem(graph, m, pricing_registry.AllReducePrices(
        pricing_registry.xla_all_reduce_time), {}, 0.0, False)
    return {(graph.leaves[g[0]].path, lay.spec): pr
            for g, lays, prs in zip(prob.groups, prob.cands, prob.prices)
            for lay, pr in zip(lays, prs)}
  f32 = priced(jnp.float32, jnp.float32)
  assert len(f32) == 7 and sum(pr.tp is not None for pr in f32.values()) == 4
  whole = compiled(jnp.float32, jnp.float32)
  for dtypes in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)):
    assert compiled(*dtypes) == whole, dtypes
    got = priced(*dtypes)
    assert set(got) == set(f32), dtypes
    for key, pr in f32.items():
      assert (got[key].blocking, got[key].overlappable, got[key].ag_fwd, got[key].ag_bwd) == (
          pytest.approx(pr.blocking, rel=1e-12), pytest.approx(pr.overlappable, rel=1e-12),
          pytest.approx(pr.ag_fwd, rel=1e-12), pytest.approx(pr.ag_bwd, rel=1e-12)), (dtypes, key)
  # float16: the row-parallel output's all-reduce moves half the float32 step's bytes
  half = [(nb, t) for k, nb, t in compiled(jnp.float16, jnp.float16) if k == "all_reduce"]
  assert [(2 * nb, t) for nb, t in half] == [(nb, "f16") for k, nb, _ in whole
                                             if k == "all_reduce"]
  row = ("[0]['w2']", ("tensor", None))
  f16 = priced(jnp.float16, jnp.float16)
  assert f16[row].bytes["all_reduce[tensor]"] == f32[row].bytes["all_reduce[tensor]"] / 2
  assert f16[row].blocking["tensor"] < f32[row].blocking["tensor"]

def test_a_meeting_on_cpu_is_priced_at_its_own_values_bytes_not_the_weight_s_dtype(cpu_devices):
  """A centring over the batch in a bfloat16 MLP, `data` 8 on CPU devices: the forward's mean
  sums in float32 (jnp.mean: an f32[128] statistic) and the backward's sum of its cotangent is
  bfloat16 (bf16[128]); XLA:CPU all-reduces both as f32[128] (the compiled HLO: 512 B each, beside
  the gradients' combined all-reduce), as the same MLP in float32 does. So each weight's meeting
  is priced as the float32 MLP's. Before, a meeting was widened by the weight's dtype: the
  float32 statistic priced at twice the bytes that move (and a bfloat16 one under a float32
  weight at half)."""
  from jax.sharding import NamedSharding
  from dtenjax._src.planning import stepgraph
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.planning.solver import make_problem
  from tests import test_calibration as tcal

  def step(p, x):
    def loss(p):
      h = x @ p["w1"]
      h = h - jnp.mean(h, axis=0)
      return jnp.mean((jnp.tanh(h) @ p["w2"]).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))

  def args(dt):
    return ({"w1": jax.ShapeDtypeStruct((64, 128), dt),
             "w2": jax.ShapeDtypeStruct((128, 64), dt)}, jax.ShapeDtypeStruct((256, 64), dt))
  mesh = Mesh(np.array(cpu_devices), ("data",))
  rep, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
  ops = hlo.read_compiled(jax.jit(step, in_shardings=({"w1": rep, "w2": rep}, split),
                                  out_shardings={"w1": rep, "w2": rep})
                          .lower(*args(jnp.bfloat16)).compile(cmt.LLVM_O0)).collectives()
  assert sorted((c.kind, c.nbytes, c.dtype) for c in ops) == [
      ("all_reduce", 512, "f32"), ("all_reduce", 512, "f32"),
      ("all_reduce", 2 * 2 * 64 * 128 * 2, "f32")], ops

  def meetings(dt):
    graph = stepgraph.read_step(step, args(dt), (1,))
    assert len(graph.meetings) == 2
    shape = tuple(8 if a == "data" else 1 for a in AXES)
    m = CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1"))
    prob = make_problem(graph, m, pricing_registry.AllReducePrices(
        pricing_registry.xla_all_reduce_time), {}, 0.0, False)
    return {graph.leaves[g[0]].path: prs[0].blocking["data"]
            for g, prs in zip(prob.groups, prob.prices)}
  f32, bf16 = meetings(jnp.float32), meetings(jnp.bfloat16)
  assert len(f32) == 2 and bf16 == pytest.approx(f32, rel=1e-12)


def test_on_cpu_a_reproducible_bfloat16_sum_s_raw_floats_are_priced_at_float32_bytes(
    cpu_devices):
  """one_shot's and two_shot's reproducible sums move the raw floats (an all-gather; an
  all-to-all and the rounded chunk's all-gather), in the input's dtype as jax emits them; XLA:CPU
  compiles those bfloat16 collectives in float32 (the compiled HLO below), twice the lowered
  bytes, so on CPU devices their formulas are priced at those bytes. The word exchange's int32
  words are not widened (test_partial_sum_widths_by_op_and_dtype's records). Before, these two
  were priced at the bfloat16 bytes, half what moves, against the others' int32 words priced at
  what they move."""
  _assert_priced_as_compiled_in_float32(cpu_devices, reproducible=True)


def test_a_bfloat16_attention_s_sequence_gathers_on_cpu_are_priced_at_float32_bytes():
  """test_step_planner_sequence's decoder on `data` 2 x `sequence` 4 (8 CPU devices), its
  parameters and optimizer state in bfloat16: the keys and values are bfloat16, half the float32
  decoder's bytes, and XLA:CPU all-gathers (and all-reduces) a bfloat16 value in float32 (the
  compiled HLO of the tests above), so the sequence role's collectives move what the float32
  decoder's move and are priced and recorded alike (the recorded bytes are what ``plan.check``
  sets beside the compiled float32 collectives). Before, they were priced as float32 of the
  bfloat16 bytes, half what moves, and then recorded at the bfloat16 bytes."""
  from dtenjax._src.planning import stepgraph
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.planning.solver import make_problem
  from tests import test_calibration as tcal
  from tests import test_step_planner_sequence as tsq
  step, args = tsq._model(2, 64)

  def fixed(dt):
    cast = lambda tree: jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, dt if s.dtype == jnp.float32 else s.dtype), tree)
    graph = stepgraph.read_step(step, (cast(args[0]), cast(args[1]), args[2]), (2,))
    assert {a.dtype for a in graph.sequence.attention} == {jnp.dtype(dt).name}
    shape = tuple({"data": 2, "sequence": 4}.get(a, 1) for a in AXES)
    m = CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1"))
    prob = make_problem(graph, m, pricing_registry.AllReducePrices(
        pricing_registry.xla_all_reduce_time), {}, 0.0, False)
    return prob.fixed_blocking["sequence"], prob.fixed_bytes["all_gather[sequence]"]
  (f32, f32_bytes), (bf16, bf16_bytes) = fixed(jnp.float32), fixed(jnp.bfloat16)
  assert bf16_bytes == f32_bytes and f32 > 0
  assert bf16 == pytest.approx(f32, rel=1e-12)


def _recorded(step, args, batch_argnums, mesh_sizes):
  """Every layout's recorded collective bytes on a mesh of ``mesh_sizes`` (8 CPU devices):
  (whether the leaf is a float, leaf, spec, "kind[axes]" or the unpaired gathers' fields, with
  "sliced" where the layout is priced for an output a pair slices) -> bytes per device."""
  from dtenjax._src.planning import stepgraph
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.planning.solver import make_problem
  from tests import test_calibration as tcal
  graph = stepgraph.read_step(step, args, batch_argnums)
  shape = tuple(mesh_sizes.get(a, 1) for a in AXES)
  m = CandidateMesh(shape, np.arange(8).reshape(shape), tcal._cpu_host(8, "0-1"))
  prob = make_problem(graph, m, pricing_registry.AllReducePrices(
      pricing_registry.xla_all_reduce_time), {}, 0.0, False)
  out = {}
  for g, lays, prs in zip(prob.groups, prob.cands, prob.prices):
    for lay, pr in zip(lays, prs):
      leaf = graph.leaves[g[0]]
      key = (stepgraph.is_float(leaf.dtype), leaf.path, lay.spec)
      out.update({key + (k,): v for k, v in pr.bytes.items()})
      out.update({key + (k,): getattr(pr, k) for k in ("ag_fwd_bytes", "ag_bwd_bytes")
                  if getattr(pr, k)})
      for dim, sliced in pr.sliced.items():      # its price where a pair slices its output
        out.update({key + (dim, f"sliced {k}"): v for k, v in sliced.bytes.items()})
  out.update({(True, "fixed", k): v for k, v in prob.fixed_bytes.items()})
  return out


def _to(dt, tree):
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
      s.shape, dt if s.dtype == jnp.float32 else s.dtype), tree)


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_every_role_s_bytes_move_as_the_one_wire_rule_says(monkeypatch, factor):
  """``calls.wire_bytes`` is the one place that says what a collective of a dtype moves on a
  backend; the roles (tensor's activation all-reduces and unpaired gathers, a column-parallel
  bias's gathers, a replicated weight's collectives where a pair slices its output, expert's
  all-to-alls, sequence's gathers and reductions) and the gradients' reductions and FSDP gathers
  all ask it, through the Pricer. So where it says a bfloat16 byte
  moves as ``factor`` bytes on CPU devices (XLA:CPU's is 2: tests above), every recorded byte of
  a bfloat16 step is ``factor`` times the bfloat16 bytes: ``factor / 2`` times the float32
  step's, on every layout of an MLP with a bias (`data` 4 x `tensor` 2, `fsdp` 4 x `tensor` 2),
  test_step_planner_roles' mixture of experts (`data` 2 x `expert` 4) and
  test_step_planner_sequence's decoder (`data` 2 x `sequence` 4; `fsdp` 2 x `tensor` 4, more
  devices than its 2 heads: the sliced outputs). A role that widened a
  bfloat16 activation by itself (roles/tensor.py multiplied its bytes by 2 on CPU devices, beside
  the Pricer's widening elsewhere) records the float32 bytes whatever the rule, and fails here."""
  from dtenjax._src.pricing import calls
  from tests import test_step_planner_roles as roles_t
  from tests import test_step_planner_sequence as tsq
  rule = calls.wire_bytes
  monkeypatch.setattr(calls, "wire_bytes", lambda dtype, backend: factor * rule(dtype, backend)
                      / 2 if rule(dtype, backend) > 1 else 1.0)

  def mlp(p, x):
    def loss(p):
      h = jnp.tanh(x @ p["w1"] + p["b1"])
      return jnp.mean((h @ p["w2"]).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  mlp_args = ({"w1": jax.ShapeDtypeStruct((64, 128), jnp.float32),
               "b1": jax.ShapeDtypeStruct((128,), jnp.float32),
               "w2": jax.ShapeDtypeStruct((128, 64), jnp.float32)},
              jax.ShapeDtypeStruct((256, 64), jnp.float32))
  moe_step, moe_args = roles_t.moe()
  seq_step, seq_args = tsq._model(2, 64)
  cases = [(mlp, mlp_args, (1,), {"data": 4, "tensor": 2}),
           (mlp, mlp_args, (1,), {"fsdp": 4, "tensor": 2}),
           (moe_step, moe_args, (2,), {"data": 2, "expert": 4}),
           (seq_step, seq_args, (2,), {"data": 2, "sequence": 4}),
           (seq_step, seq_args, (2,), {"fsdp": 2, "tensor": 4})]
  kinds = set()
  for step, args, batch, sizes in cases:
    f32 = _recorded(step, args, batch, sizes)
    bf16 = _recorded(step, _to(jnp.bfloat16, args), batch, sizes)
    assert set(bf16) == set(f32) and f32, sizes
    for key, nb in f32.items():     # an integer leaf (adam's count) moves as it is
      assert bf16[key] == pytest.approx(factor / 2 * nb if key[0] else nb, rel=1e-12), (
          sizes, key)
    kinds |= {key[-1] for key in f32}
  # the roles' collectives were all there
  for kind in ("all_reduce[tensor]", "all_gather[tensor]", "ag_fwd_bytes", "all_to_all[expert]",
               "all_gather[sequence]", "all_reduce[data]", "all_gather[fsdp]",
               "sliced all_reduce[tensor]"):
    assert kind in kinds, (kind, sorted(kinds))


def test_xla_s_all_to_all_over_two_hosts_sends_only_the_chunks_to_off_host_peers_over_the_network():
  """XLA's own all-to-all (the expert role's dispatch and combine) over 8 ranks on two hosts of
  four (roce_a100_4x8's devices 0-3 and 8-11): each rank sends every peer 1/8 of its N bytes
  directly, so by hand 3/8 N go to its host-mates over NVLink (one latency: the host's peers are
  reached at once) and 4/8 N over RoCE to the 4 ranks on the other host (a latency each).
  Before, all 7/8 N and 7 latencies were priced on RoCE. On one host (devices 0-7) all 7/8 N
  stay on NVLink with one latency, and with one rank a host (0, 8, 16, 24) every peer is behind
  RoCE, as before."""
  for link, what, want in (("roce", "bytes", 4 / 8 * cmt.N), ("nvlink", "bytes", 3 / 8 * cmt.N),
                           ("roce", "latency", 4), ("nvlink", "latency", 1)):
    assert cmt._d("all_to_all", cm.XLA, cmt.HOSTS2, cmt.ROCE, link, what) == pytest.approx(
        want, rel=1e-6), (link, what)
  assert cmt._d("all_to_all", cm.XLA, range(8), cmt.ROCE, "nvlink", "bytes") == pytest.approx(
      7 / 8 * cmt.N, rel=1e-6)
  assert cmt._d("all_to_all", cm.XLA, range(8), cmt.ROCE, "roce", "bytes") == 0
  spread = [0, 8, 16, 24]
  assert cmt._d("all_to_all", cm.XLA, spread, cmt.ROCE, "roce", "bytes") == pytest.approx(
      3 / 4 * cmt.N, rel=1e-6)
  assert cmt._d("all_to_all", cm.XLA, spread, cmt.ROCE, "roce", "latency") == pytest.approx(3)


def test_a_bfloat16_table_s_lookup_gradient_moves_its_int32_token_ids_as_they_are():
  """A bfloat16 table of 16384 x 64 looked up by 16 x 32 int32 tokens, `fsdp` 8 on its rows:
  XLA:CPU all-gathers the table for the lookup (f32[2048,64] per device: 16384 x 64 x 4 B
  gathered), and for the lookup's gradient the cotangent rows (f32[2,32,64]: 512 x 64 x 4 B)
  and the token ids (s32[2,32,1]: 512 x 4 B) into the shard (plan.check of this step compiled:
  4327424 B of all-gather). The ids are int32 and move as they are; before, they were widened
  with the table's bfloat16 (4329472 B recorded, 2 KiB over)."""
  def step(p, tokens):
    def loss(p):
      x = jnp.take(p["embed"], tokens, axis=0)
      return jnp.mean(jnp.tanh(x @ p["w"]).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  f = jax.ShapeDtypeStruct
  got = _recorded(step, ({"embed": f((16384, 64), jnp.bfloat16), "w": f((64, 64), jnp.bfloat16)},
                         f((16, 32), jnp.int32)), (1,), {"fsdp": 8})
  assert got[(True, "[0]['embed']", ("fsdp", None), "all_gather[fsdp]")] == (
      16384 * 64 * 4 + 512 * 64 * 4 + 512 * 4)


def _data_parallel_collectives(step, p, x, devices) -> list[tuple[int, int]]:
  """(bytes, runs a step) of each collective XLA:CPU compiles for ``step(p, x)`` with the
  parameters replicated and ``x`` split over `data` 8, sorted."""
  from jax.sharding import NamedSharding
  from dtenjax._src.planning.check import loop_repeats
  mesh = Mesh(np.array(devices), ("data",))
  rep, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
  compiled = jax.jit(step, in_shardings=({k: rep for k in p}, split),
                     out_shardings={k: rep for k in p}).lower(p, x).compile(cmt.LLVM_O0)
  repeats = loop_repeats(compiled)
  return sorted((c.nbytes, repeats(c.computation)) for c in hlo.read_compiled(compiled).collectives())


def _calibrated_data8_prices(step, args, calibration):
  """The planner's problem of ``step(*args)`` (batch argument 1) on a `data` 8 mesh of a CPU host
  priced on ``calibration``'s curve, and each group's overlappable all-reduce time over `data`
  by its first leaf's path."""
  from dtenjax._src.planning import stepgraph
  from dtenjax._src.planning.candidates import CandidateMesh
  from dtenjax._src.planning.roles import AXES
  from dtenjax._src.planning.solver import make_problem
  from tests import test_calibration as tcal
  shape = tuple(8 if a == "data" else 1 for a in AXES)
  topo = dataclasses.replace(tcal._cpu_host(8, "0-1"), calibration=calibration)
  graph = stepgraph.read_step(step, args, (1,))
  prob = make_problem(graph, CandidateMesh(shape, np.arange(8).reshape(shape), topo),
                      pricing_registry.AllReducePrices(pricing_registry.xla_all_reduce_time),
                      {}, 0.0, False)
  return prob, {graph.leaves[g[0]].path: prs[0].overlappable.get("data", 0.0)
                for g, prs in zip(prob.groups, prob.prices)}


def test_a_loop_weight_s_per_iteration_all_reduce_is_a_collective_of_its_own_on_a_measured_curve(
    cpu_devices):
  """A weight a lax.fori_loop of 3 reads whole in every iteration, `data` 8 on CPU devices:
  XLA:CPU all-reduces its gradient inside the backward's loop, once per iteration, and the other
  gradients in one combined all-reduce after it (the compiled HLO below: f32[512,512] in the
  loop body, run 3 times; w_in's and out's together outside). Nothing joins the loop's
  all-reduces to the combined one, so each is a collective of its own, its latency and meeting
  included. On test_calibration's curve (CAL: 3 ms at 1 MiB, 43 ms at 9 MiB, flat below) with
  no meeting (its latency_s 0, by hand) the 1 MiB weight is 3 x 3 = 9 ms, a 4 MiB one
  3 x 18 = 54 ms; with CAL's meeting M each iteration pays it too, 3 x M more (M: the problem's
  one latency for the combined all-reduce, CAL's 3 ms at one byte + M). Before (wire18), each
  lacked the latency: 3 x (3 - 3) = 0 ms and 3 x (18 - 3) = 45 ms, though three collectives
  run. The combined one holds w_in's and out's gradients only: 0.5 MiB (1 MiB), flat on the
  curve, so their shares are 0."""
  from tests import test_calibration as tcal

  def step(p, x):
    def loss(p):
      h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["w"]), x @ p["w_in"])
      return jnp.mean((h @ p["out"]) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))

  def args(n):
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {"w_in": f(128, n), "w": f(n, n), "out": f(n, 128)}, f(64, 128)
  assert _data_parallel_collectives(step, *args(512), cpu_devices) == [
      (2 * 128 * 512 * 4, 1), (512 * 512 * 4, 3)]

  quiet = dataclasses.replace(tcal.CAL, latency_s=0.0)
  for cal, n, curve in ((quiet, 512, 3e-3), (quiet, 1024, 18e-3), (tcal.CAL, 512, 3e-3),
                        (tcal.CAL, 1024, 18e-3)):
    prob, got = _calibrated_data8_prices(step, args(n), cal)
    meeting = prob.grad_latency_s - 3e-3
    if cal is quiet:
      assert meeting == pytest.approx(0.0, abs=1e-12)
    else:
      assert 0 < meeting < 3e-3
    assert got == pytest.approx({"[0]['w']": 3 * (curve + meeting), "[0]['w_in']": 0.0,
                                 "[0]['out']": 0.0}, abs=1e-9), (n, cal.latency_s)



def test_two_weights_of_one_loop_body_pay_one_latency_per_iteration(cpu_devices):
  """Two weights a lax.fori_loop of 3 reads in every iteration, `data` 8 on CPU devices: XLA:CPU
  joins their gradients in one all-reduce per iteration of the backward's loop body (the compiled
  HLO below: 2 x f32[128,128] run 3 times), so the body pays one collective's latency per
  iteration, not one per weight. On test_calibration's CAL (flat 3 ms below 1 MiB) without its
  meeting (latency_s 0) two 0.25 MiB weights join 0.5 MiB: 3 x 3 = 9 ms a step for the pair,
  half each by their bytes (4.5 ms); priced one collective a weight, 9 ms each."""
  from tests import test_calibration as tcal

  def step(p, x):
    def loss(p):
      body = lambda i, h: jnp.tanh(jnp.tanh(h @ p["w"]) @ p["v"])
      h = jax.lax.fori_loop(0, 3, body, x @ p["w_in"])
      return jnp.mean((h @ p["out"]) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))

  def args(n):
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {"w_in": f(64, n), "w": f(n, n), "v": f(n, n), "out": f(n, 64)}, f(64, 64)
  assert _data_parallel_collectives(step, *args(128), cpu_devices) == [
      (2 * 64 * 128 * 4, 1), (2 * 128 * 128 * 4, 3)]

  _, got = _calibrated_data8_prices(step, args(256),
                                    dataclasses.replace(tcal.CAL, latency_s=0.0))
  assert got["[0]['w']"] == pytest.approx(3 * 3e-3 / 2, rel=1e-9)
  assert got["[0]['v']"] == pytest.approx(3 * 3e-3 / 2, rel=1e-9)


@pytest.mark.parametrize("after", [False, True])
def test_a_weight_read_in_a_loop_and_outside_it_reduces_one_part_per_iteration_and_one_after(
    cpu_devices, after):
  """A weight a lax.fori_loop of 3 reads in every iteration and one product reads once more
  outside the loop (after it, or before it: the order must not matter), `data` 8 on CPU
  devices: XLA:CPU all-reduces its gradient 3 times in the backward's loop body and once more
  in the combined all-reduce after the backward, with w_in's and out's (the compiled HLO below:
  f32[128,128] run 3 times; f32[128,128] + 2 x f32[64,128] once): 4 parts. Before, the parts
  were the first read's trip count times the reads (3 x 2 = 6 with the loop first, 1 x 2 = 2
  with it second: plan.check 40 % off either way), and on a calibration's curve either every
  part was priced at its own point, the one that joins the combined all-reduce too, or none was
  (test_calibration's CAL: 3 ms at 1 MiB, 43 ms at 9 MiB, linear between, flat below; a 4 MiB
  weight beside two of 0.25 MiB, CAL's meeting left out (latency_s 0): 3 x 18 = 54 ms in the
  loop, each iteration's all-reduce a collective of its own, and 4 / 4.5 of the combined 4.5
  MiB's 20.5 - 3 ms after it, 69.6 ms; before, 6 x 15 = 90 ms with the loop first, 2 x 4 /
  4.5 x 17.5 = 31.1 ms with it second)."""
  from tests import test_calibration as tcal

  def step(p, x):
    def loss(p):
      h = x @ p["w_in"]
      if not after:
        h = jnp.tanh(h @ p["w"])
      h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ p["w"]), h)
      if after:
        h = jnp.tanh(h @ p["w"])
      return jnp.mean((h @ p["out"]) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))

  def args(n):
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {"w_in": f(64, n), "w": f(n, n), "out": f(n, 64)}, f(64, 64)
  compiled = _data_parallel_collectives(step, *args(128), cpu_devices)
  assert compiled == [(128 * 128 * 4, 3), ((128 * 128 + 2 * 64 * 128) * 4, 1)]
  got = _recorded(step, args(128), (1,), {"data": 8})
  whole = [v for k, v in got.items() if k[-1] == "all_reduce[data]" and set(k[2]) == {None}]
  assert sum(whole) == sum(nbytes * runs for nbytes, runs in compiled)

  _, got = _calibrated_data8_prices(step, args(1024),
                                    dataclasses.replace(tcal.CAL, latency_s=0.0))
  assert got["[0]['w']"] == pytest.approx(3 * 18e-3 + 4 / 4.5 * 17.5e-3, rel=1e-9)


def test_plan_check_sets_the_recorded_bytes_of_a_bfloat16_step_beside_xla_cpu_s_float32_ones():
  """``plan.check`` compares a plan's recorded collective bytes with the compiled program's
  collectives, whose operands on CPU devices are XLA:CPU's float32 for a bfloat16 value: the
  bytes that move. A bfloat16 MLP of two 256 x 256 weights under FSDP on `fsdp` 8 at a batch of
  64: plan.jit gathers both weights, f32[256,256] each, and makes each gradient on its weight's
  shard (gather.shard_gradients, bf16_22: the 64 x 256 cotangent is smaller than the weight),
  the cotangent gathered, f32[64,256], and the residual's rows moved into features by an
  all-to-all of f32[8,256] a device; no all-reduce. The plan records those bytes. Before, it
  priced them so but recorded the bfloat16 bytes, half (plan.check: 50 % off for both kinds)."""
  import dtenjax
  f = jax.ShapeDtypeStruct

  def step(p, x):
    def loss(p):
      return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  args = ({"w1": f((256, 256), jnp.bfloat16), "w2": f((256, 256), jnp.bfloat16)},
          f((64, 256), jnp.bfloat16))
  plan = dtenjax.plan(step, *args, mesh={"fsdp": 8}, recipe="FSDP")
  check = plan.check(step, *args)
  want = {"all_gather": 2 * 256 * 256 * 4.0 + 2 * 64 * 256 * 4.0,
          "all_to_all": 2 * 64 * 256 * 4.0 / 8}
  assert check.compiled_bytes == want and check.predicted_bytes == want, check.table()


def test_a_float32_weight_read_in_float16_has_its_gradient_reduced_in_float16():
  """Mixed precision: float32 weights a step casts to float16 before its products (the master
  weights' usual pattern, bfloat16 on a GPU). XLA's SPMD partitioner all-reduces a weight's
  gradient where its product makes it, in the dtype the product reads the weight in, and converts
  it to float32 after (the partitioned HLO before XLA:CPU's all-reduce promotion:
  bf16[512,256] for a float32 weight read as bfloat16; XLA:CPU then widens a bfloat16 one to
  float32, which hides it there, but keeps float16, and a GPU keeps both). Two 256 x 512 weights,
  `data` 8 (DP) and `fsdp` 8 (FSDP): plan.check's compile has 2 x 256 x 512 x 2 B of
  all-reduce, and the FSDP gathers in float32 (the leaf's, before the cast: 2 x 256 x 512 x 4 B).
  Before, the gradients were priced and recorded at the leaf's float32, twice what moves."""
  import dtenjax
  f = jax.ShapeDtypeStruct

  def step(p, x):
    def loss(p):
      h = jnp.tanh(x.astype(jnp.float16) @ p["w1"].astype(jnp.float16))
      return jnp.mean((h @ p["w2"].astype(jnp.float16)).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  args = ({"w1": f((256, 512), jnp.float32), "w2": f((512, 256), jnp.float32)},
          f((64, 256), jnp.float32))
  for mesh, recipe, want in (
      ({"data": 8}, "DP", {"all_reduce": 2 * 256 * 512 * 2.0}),
      ({"fsdp": 8}, "FSDP", {"all_reduce": 2 * 256 * 512 * 2.0,
                             "all_gather": 2 * 256 * 512 * 4.0})):
    check = dtenjax.plan(step, *args, mesh=mesh, recipe=recipe).check(step, *args)
    assert check.compiled_bytes == want and check.predicted_bytes == want, check.table()


@pytest.mark.parametrize("dtype,mesh", [("bfloat16", {"fsdp": 8}), ("float16", {"data": 4, "tensor": 2}),
                                        ("float16", {"data": 2, "fsdp": 4})])
def test_a_float32_table_cast_before_its_lookup_moves_its_rows_and_gradient_in_the_cast_dtype(
    dtype, mesh):
  """A float32 table of 4096 x 64 cast to ``dtype`` before its lookup by 16 x 32 int32 tokens
  (mixed precision's copy): the lookup's rows, their cotangents and the scatter of them into the
  table's gradient are of ``dtype``, and so is what XLA moves: on `fsdp` 8 the cotangent rows
  all-gathered in float32 (XLA:CPU's bfloat16 widened: 512 x 64 x 4 B) beside their 512 int32
  ids; on `data` 4 x `tensor` 2 (vocab-parallel) and `data` 2 x `fsdp` 4 the table's gradient
  all-reduced in float16. plan.check's compile is the yardstick, kind by kind. Before, the rows
  were priced at the table's float32 with their bfloat16 bytes (half what moves) and half the
  ids counted (the rows' bytes over a float32 row's), and the gradient of a float16 read at
  float32 (fsdp 8: 1105 KiB of all-gather against 1170 compiled; the float16 meshes' all-reduce
  1080 against 564 KiB and 1300 against 650, and there 512 B of ids short)."""
  import dtenjax
  f = jax.ShapeDtypeStruct
  dt = jnp.dtype(dtype)

  def step(p, tokens):
    def loss(p):
      x = jnp.take(p["embed"].astype(dt), tokens, axis=0)
      h = jnp.tanh(x @ p["w"].astype(dt))
      return jnp.mean((h @ p["out"].astype(dt)).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  args = ({"embed": f((4096, 64), jnp.float32), "w": f((64, 64), jnp.float32),
           "out": f((64, 4096), jnp.float32)}, f((16, 32), jnp.int32))
  check = dtenjax.plan(step, *args, mesh=mesh).check(step, *args)
  assert check.predicted_bytes == check.compiled_bytes, check.table()


def test_a_bfloat16_table_s_permuted_token_ids_move_as_int32():
  """A bfloat16 table of 4096 x 64 under FSDP x TP (`fsdp` 4 x `tensor` 2): XLA:CPU reduces its
  lookup's gradient in pieces and permutes each device's cotangent rows and token ids to the
  piece's owner (pricing._moved_per_lookup; plan.check's compile: f32[...] rows, XLA:CPU's
  float32 of the bfloat16 cotangents, and s32 ids: 128 tokens x 64 x 4 B + 128 x 4 B). The ids
  move as they are; before, they were widened with the rows (33792 B recorded, 512 over)."""
  import dtenjax
  f = jax.ShapeDtypeStruct

  def step(p, tokens):
    def loss(p):
      x = jnp.take(p["embed"], tokens, axis=0)
      return jnp.mean(jnp.tanh(x @ p["w"]).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))
  args = ({"embed": f((4096, 64), jnp.bfloat16), "w": f((64, 64), jnp.bfloat16)},
          f((16, 32), jnp.int32))
  check = dtenjax.plan(step, *args, mesh={"fsdp": 4, "tensor": 2}, recipe="FSDP x TP").check(
      step, *args)
  want = 128 * 64 * 4 + 128 * 4
  assert check.compiled_bytes["ppermute"] == want and check.predicted_bytes["ppermute"] == want


def test_a_float8_weight_s_gathers_move_in_float16_on_cpu():
  """XLA:CPU compiles a collective of a float8 type in float16 (an all-gather, psum and
  all-to-all of float8_e4m3fn or float8_e5m2 under shard_map: f16 operands), as it does a
  bfloat16 one in float32: twice the value's bytes. Two float8_e4m3fn weights of 256 x 512 read
  as bfloat16, FSDP on `fsdp` 8: plan.check's compile gathers the float8 shards, 2 x 256 x 512 x
  2 B, and reduces the bfloat16 gradients in float32 (2 x 256 x 512 x 4 B). Before,
  ``calls.wire_bytes`` moved every dtype but bfloat16 as it is: the gathers at half."""
  import dtenjax
  f = jax.ShapeDtypeStruct

  def step(p, x):
    def loss(p):
      h = jnp.tanh(x @ p["w1"].astype(jnp.bfloat16))
      return jnp.mean((h @ p["w2"].astype(jnp.bfloat16)).astype(jnp.float32) ** 2)
    return jax.tree.map(lambda a, b: (a.astype(jnp.float32) - 0.1 * b.astype(jnp.float32)).astype(
        a.dtype), p, jax.grad(loss)(p))
  f8 = jnp.float8_e4m3fn
  args = ({"w1": f((256, 512), f8), "w2": f((512, 256), f8)}, f((64, 256), jnp.bfloat16))
  check = dtenjax.plan(step, *args, mesh={"fsdp": 8}, recipe="FSDP").check(step, *args)
  want = {"all_gather": 2 * 256 * 512 * 2.0, "all_reduce": 2 * 256 * 512 * 4.0}
  assert check.compiled_bytes == want and check.predicted_bytes == want, check.table()


def test_an_integer_leaf_is_reduced_only_as_its_dequantized_product_s_float_gradient(cpu_devices):
  """An int8 weight a product reads dequantized (``wq.astype(f32) * scale``), an int32 histogram
  of the batch's tokens, an int32 array the step adds one to, and a step counter, on 8 CPU
  devices. JAX gives an integer no gradient (float0): XLA all-reduces the product's float
  gradient of the dequantized weight (f32[256,512], 512 KiB, on `data` 8; gathered as float32
  too, f32[64,256] a device on `fsdp` 8) and the histogram's scatter from the batch (s32[4096]),
  and nothing of the int32 array (the compiled HLO below). Before, the planner priced the int8
  weight as an all-reduce of its own 128 KiB, the product's gradient not at all, the FSDP
  gather at int8 bytes, and the int32 array as a 16 KiB all-reduce; and plan.jit's FSDP program
  must keep gathering the scale vector (following the weight through its scale there gathered
  the scale's f32[512,256] broadcast, 0.5 MiB more)."""
  from jax.sharding import NamedSharding

  def step(p, x):
    def loss(fp):
      h = jnp.tanh(x @ (p["wq"].astype(jnp.float32) * fp["scale"]))
      return jnp.mean((h @ fp["w2"]) ** 2)
    fp = {k: p[k] for k in ("scale", "w2")}
    g = jax.grad(loss)(fp)
    hist = p["hist"] + jnp.zeros_like(p["hist"]).at[jnp.argmax(x, 1) % 4096].add(1)
    return {**p, **{k: fp[k] - 0.1 * g[k] for k in fp}, "hist": hist, "seen": p["seen"] + 1,
            "count": p["count"] + 1}

  s = jax.ShapeDtypeStruct
  p = {"wq": s((512, 256), jnp.int8), "scale": s((256,), jnp.float32),
       "w2": s((256, 128), jnp.float32), "hist": s((4096,), jnp.int32),
       "seen": s((4096,), jnp.int32), "count": s((), jnp.int32)}
  x = s((64, 512), jnp.float32)
  compiled = {}
  for axis in ("data", "fsdp"):
    mesh = Mesh(np.array(cpu_devices), (axis,))
    ins = {k: NamedSharding(mesh, PartitionSpec(axis) if k == "wq" and axis == "fsdp" else
                            PartitionSpec()) for k in p}
    exe = jax.jit(step, in_shardings=(ins, NamedSharding(mesh, PartitionSpec(axis))),
                  out_shardings=ins).lower(p, x).compile(cmt.LLVM_O0)
    compiled[axis] = sorted((c.kind, s.dtype, s.dims)
                            for c in hlo.read_compiled(exe).collectives()
                            for s in c.operand_shapes)
  assert compiled["data"] == [("all_reduce", "f32", (128, 256)), ("all_reduce", "f32", (256, 512)),
                              ("all_reduce", "s32", (4096,))]
  assert ("all_gather", "f32", (64, 256)) in compiled["fsdp"]
  assert ("all_reduce", "f32", (256, 512)) in compiled["fsdp"]
  assert not [c for c in compiled["fsdp"] if c[1] == "s8"]

  got = _recorded(step, (p, x), (1,), {"data": 8})
  assert got[(False, "[0]['wq']", (None, None), "all_reduce[data]")] == 256 * 512 * 4
  assert got[(False, "[0]['hist']", (None,), "all_reduce[data]")] == 4096 * 4
  assert not [k for k in got if k[1] == "[0]['seen']"]
  got = _recorded(step, (p, x), (1,), {"fsdp": 8})
  assert got[(False, "[0]['wq']", ("fsdp", None), "all_gather[fsdp]")] == 64 * 256 * 4 * 8
  assert got[(False, "[0]['wq']", ("fsdp", None), "all_reduce[fsdp]")] == 256 * 512 * 4
  # plan.jit's own FSDP program gathers the scale vector, not its broadcast beside the weight:
  # its collectives as the plan records them (the memory's temp, the dequantized weight and its
  # gradient, is not modelled)
  import dtenjax
  check = dtenjax.plan(step, p, x, mesh={"fsdp": 8}, batch_argnums=(1,), recipe="FSDP").check(
      step, p, x)
  assert set(check.misses()) <= {"memory"}, check.table()
  assert check.compiled_bytes["all_gather"] < 0.7 * 2**20


def _sgd_check_on_data_8(loss):
  """plan.check of the sgd step of ``loss(p, x)`` over two f32[128,128] weights ``w`` and ``v``
  and a batch of 64 rows, planned on `data` 8, against XLA:CPU's compile."""
  import dtenjax

  def step(p, x):
    g = jax.grad(loss)(p, x)
    return {k: p[k] - 0.1 * g[k] for k in p}

  s = jax.ShapeDtypeStruct
  args = ({"w": s((128, 128), jnp.float32), "v": s((128, 128), jnp.float32)},
          s((64, 128), jnp.float32))
  return dtenjax.plan(step, *args, mesh={"data": 8}, batch_argnums=(1,)).check(
      step, *args, compiler_options=cmt.LLVM_O0)


def test_a_weight_read_thrice_in_a_chain_has_a_gradient_part_per_read(cpu_devices):
  """review19b: ``tanh(h @ w)`` three times, the first ``h`` the batch's input, then ``h @ v``
  (sgd, `data` 8): w's gradient is three products, one per read, which XLA:CPU all-reduces on
  their own (4 buffers of f32[128,128] with v's, and the loss's scalar: the compile below). The
  reads the planner counts are five (the input gradients' two products read w too); the parts
  were counted as reads per use of the first read, which needs no input gradient: five parts,
  the all-reduce 0.38 MiB priced against 0.25 compiled (+50 %)."""
  def loss(p, x):
    h = x
    for _ in range(3):
      h = jnp.tanh(h @ p["w"])
    return jnp.mean((h @ p["v"]) ** 2)

  check = _sgd_check_on_data_8(loss)
  assert check.compiled_bytes["all_reduce"] >= 4 * 128 * 128 * 4, check.table()
  assert "all_reduce" not in check.misses(), check.table()


def test_a_weight_read_in_two_loops_has_its_gradient_parts_beside_the_carry(cpu_devices):
  """mem19b: ``tanh(h @ w)`` in a ``lax.scan`` of 3, then ``sin(h @ w)`` in a
  ``lax.fori_loop`` of 2, then ``h @ v`` (sgd, `data` 8). Each backward loop's body makes w's
  gradient part (f32[128,128]) and all-reduces it into a buffer of its own while the gradient
  it is added into is carried through the loop, and v's reduced gradient waits for its update
  after the loops: four buffers of w's size live together, two of them the outputs', two in the
  temporary buffer (XLA:CPU's buffer assignment of the compile below). The body's gradient
  parts were not counted (a value of a weight's shape in a body was dropped from the body's
  peak): memory 25 % under the compile, 26 % with one scan of 3 alone."""
  def loss(p, x):
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(h @ p["w"]), None), x, None, length=3)
    h = jax.lax.fori_loop(0, 2, lambda i, h: jnp.sin(h @ p["w"]), h)
    return jnp.mean((h @ p["v"]) ** 2)

  check = _sgd_check_on_data_8(loss)
  assert check.compiled_memory["temp"] >= 2 * 128 * 128 * 4, check.table()
  assert check.misses(0.05) == {}, check.table()


@pytest.mark.parametrize("returned", [True, False])
def test_a_frozen_int8_weight_and_its_frozen_scale_have_no_gradient(cpu_devices, returned):
  """review19b: an int8 weight dequantized by a per-channel scale that the step does not train
  either (both passed in, and returned unchanged or not returned: a quantized frozen backbone):
  JAX differentiates neither, so no float gradient of the dequantized weight is made or reduced.
  XLA all-reduces w2's gradient alone on `data` 8 (f32[256,128] and the loss's scalar: the
  compile below). Before, the dequantized weight's f32[512,256] gradient was priced too
  (all-reduce 0.63 MiB priced, 0.13 compiled, +400 %; +168 % on `fsdp` 4 x `tensor` 2)."""
  import dtenjax

  def step(p, q, x):
    def loss(p):
      h = jnp.tanh(x @ (q["wq"].astype(jnp.float32) * q["scale"]))
      return jnp.mean((h @ p["w2"]) ** 2)
    g = jax.grad(loss)(p)
    new = {k: p[k] - 0.1 * g[k] for k in p}
    return (new, q) if returned else new

  s = jax.ShapeDtypeStruct
  args = ({"w2": s((256, 128), jnp.float32)},
          {"wq": s((512, 256), jnp.int8), "scale": s((1, 256), jnp.float32)},
          s((64, 512), jnp.float32))
  check = dtenjax.plan(step, *args, mesh={"data": 8}, batch_argnums=(2,)).check(
      step, *args, compiler_options=cmt.LLVM_O0)
  assert check.compiled_bytes["all_reduce"] < 256 * 512 * 4, check.table()
  assert "all_reduce" not in check.misses(), check.table()
