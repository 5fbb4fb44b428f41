"""What a candidate layout costs per step and per device: collective times and bytes by kind
and mesh axes, compute, and memory (:class:`Price` per layout, :class:`StepCost` per plan).

Collectives are priced as XLA's own ops (the all-reduces through an
:data:`~dtenjax._src.planning.planner.AllReduceTime`, ``pricing.registry.xla_all_reduce_time``
for the whole-step planner: a planned step's collectives are those XLA inserts, not a
``dtenjax.all_reduce``'s ``algorithm="auto"`` choice), for the backend the plan is for: XLA:CPU
lowers a reduce-scatter as an all-reduce of the whole gradient, the GPU compiler keeps it. The
backend is the platform of the plan's devices and the XLA of the jaxlib this process runs
(:data:`XLA_VERSION`, read once here: the compiler that will compile the plan): XLA:CPU 0.11
partitions a looked-up table's gradient beside 'tensor' its own way (:func:`_scattered_in_pieces`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jaxlib

from dtenjax._src.pricing import calls
from dtenjax._src.pricing import costmodel
from dtenjax._src.topology import calibrate as calibrate_lib
from dtenjax._src.planning import jaxpr_reader
from dtenjax._src.planning import planner
from dtenjax._src.planning import roles
from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.candidates import CandidateMesh
from dtenjax._src.planning.candidates import Layout
from dtenjax._src.planning.roles import AXES
from dtenjax._src.planning.roles import BATCH_AXES
from dtenjax._src.planning.roles import ROUTED_AXES
from dtenjax._src.planning.roles import SEQUENCE_AXES
from dtenjax._src.planning.roles import sequence
from dtenjax._src.planning.roles.base import WIRE


@dataclasses.dataclass
class Price:
  """A candidate's per-step collectives and memory, by mesh axes."""
  blocking: dict[str, float] = dataclasses.field(default_factory=dict)
  overlappable: dict[str, float] = dataclasses.field(default_factory=dict)
  bytes: dict[str, float] = dataclasses.field(default_factory=dict)      # collective -> bytes
  memory: dict[str, float] = dataclasses.field(default_factory=dict)
  ag_fwd: float = 0.0          # an unpaired column-parallel output's all-gather (s), and bytes
  ag_fwd_bytes: float = 0.0
  ag_bwd: float = 0.0          # an unpaired row-parallel input gradient's all-gather
  ag_bwd_bytes: float = 0.0
  tp: tuple[str, int] | None = None
  compute: float = 0.0         # seconds of the products it takes part in, per device
  act_saving: float = 0.0      # activation bytes per device a complete column->row pair shards
  # seconds per device of the work beside the products (StepGraph.token_bytes) in that pair's
  # cone, which 'tensor' splits when the pair is complete (else every device of it runs all)
  token_saving: float = 0.0
  # bytes of this weight gathered at once when its gathered copy is not kept between the forward
  # and the backward (a rematerialised read: one layer of a scanned stack); the step's peak is the
  # largest of these, not their sum
  gathered_peak: float = 0.0
  # bytes of the float32 copy jax 0.11's XLA:CPU gathers a bfloat16 weight in and converts into
  # the kept bfloat16 copy (``memory["gathered"]``) at the step's start, or of a float table's
  # gathered copy, live from the step's start to its lookup (price_layout,
  # solver._gathered_at_start)
  gathered_wide: float = 0.0
  # what its FSDP gather waits beyond :attr:`overlappable`'s where the tensor pair its layout is
  # in is not completed by the assignment: a complete pair's meetings over 'tensor' leave its
  # gather the forward's products to wait for (price_layout), an incomplete one has none.
  # ``solver.evaluate`` adds it where the pair is incomplete, the program through the pair's
  # variable (by mesh axes, as overlappable)
  unmet_wait: dict[str, float] = dataclasses.field(default_factory=dict)
  # a role's factor on the time of the products it takes part in (a pipeline's bubble and
  # recomputed forward, set by roles.stage)
  compute_scale: float = 1.0
  # seconds per device of the optimizer's update of this group (in ``compute``)
  update: float = 0.0
  # a gather at the step's start (a lookup table's), which waits for the update the devices ran
  # since the previous step's last meeting: (the mesh axes' key, the seconds of wait per second
  # of that update, the wake-up less the meeting, the wait already priced here); ``evaluate``
  # prices the assignment's own update (:func:`start_wait`)
  start_gather: tuple[str, float, float, float] | None = None
  # this layout's price where 'tensor' replicates the weight and its output meets a pair sharded
  # over 'tensor', which XLA:CPU slices it to, by the free dimension that starts the pair
  # (roles.tensor.sliced; the solver picks it)
  sliced: dict[int, "Price"] = dataclasses.field(default_factory=dict)


# The meeting of devices at a collective between products (Pricer): the devices' wake-up and the
# share of a product's compute by which their arrivals spread (fitted to the two measurements
# quoted in Pricer; docs/benchmarks.md, "The CPU expert choice").
MEETING_WAKE_S = calibrate_lib.CPU_WAKE_S
MEETING_SPREAD = 1 / 6

# the XLA that compiles the plans of this process: the jaxlib's (major, minor) version
XLA_VERSION = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])


def acc(where: dict[str, float], key: str, value: float) -> None:
  where[key] = where.get(key, 0.0) + value


@functools.lru_cache(maxsize=None)
def last_arrival(n: int) -> float:
  """The expected largest of ``n`` independent standard normal draws (0.56 for 2, 1.03 for 4,
  1.42 for 8, 1.77 for 16): where the last of ``n`` devices arrives at a meeting, in standard
  deviations of their arrivals past the mean, which the group waits for. By the midpoint rule
  on [-9, 9] (the density and the distribution of ``math.erf``; 1e-9 of the tabulated values)."""
  if n < 2:
    return 0.0
  steps, lo, hi = 3600, -9.0, 9.0
  h = (hi - lo) / steps
  total = 0.0
  for i in range(steps):
    x = lo + (i + 0.5) * h
    cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
    total += x * n * math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi) * cdf ** (n - 1)
  return total * h


class Pricer:
  """Collective times on one mesh, cached by (kind, bytes, axes, dtype, wide): ``dtype`` is the
  collective's, whose bytes move as :meth:`wire` says; ``roles.base.WIRE`` for bytes counted as
  they move."""

  def __init__(self, m: CandidateMesh, price: planner.AllReduceTime,
               between: float | None = None, weightless: float = 1.0,
               state: Sequence[Sequence[stepgraph.Leaf]] = (), combined: float = 0.0):
    self.m, self.price = m, price
    self.cache: dict[tuple, float] = {}
    # the bytes per device of the gradients' combined all-reduce where every gradient is reduced
    # whole (DP): the point a measured curve prices each gradient's share of it at (share)
    self.combined = combined
    self._curved: dict[tuple[str, ...], bool] = {}
    first = int(m.ids.ravel()[0])
    self.backend = m.topology.device(first).platform
    costs = costmodel.backend_costs(self.backend)
    bw = costs.local_bandwidth_gbps
    # seconds per byte of a local elementwise pass (the optimizer's update), and what one
    # collective adds inside the step beyond its own time (the devices' rendezvous after their
    # share of compute): measured by the calibration, else the prior of the host's sharing. A
    # value the user sets in DTENJAX_COST_PARAMS wins over both.
    user = costmodel.user_overrides(self.backend)
    prior_s_per_byte = m.topology.spec("local").beta if bw is None else 1.0 / (bw * 1e9)
    self.local_s_per_byte = (prior_s_per_byte if user.get("local_bandwidth_gbps") is not None
                             else m.topology.local_s_per_byte(prior_s_per_byte))
    # seconds per byte of a pass over a buffer beyond the caches the elementwise pass above is
    # measured in: the optimizer's update (every device's whole state, once a step) and the work
    # beside the products (the step's activations); on CPU devices the calibration's measured
    # update (Calibration.stream_gbps: the rate moves with the host's memory, not its FLOP/s: 14
    # FLOP per byte of the products on the 16-core host, 27 on the 2-core VM), else the host's
    # streaming balance (calibrate.prior_cpu_stream_s_per_byte) at the device's FLOP/s, the
    # calibration's where measured (its elementwise pass is the caches'), unless the user sets
    # the bandwidth
    self.stream_s_per_byte = self.local_s_per_byte
    cal = m.topology.calibration
    if self.backend == "cpu" and user.get("local_bandwidth_gbps") is None:
      if cal is not None and cal.platform == "cpu" and cal.stream_gbps > 0:
        self.stream_s_per_byte = 1.0 / (cal.stream_gbps * 1e9)
      else:
        self.stream_s_per_byte = calibrate_lib.prior_cpu_stream_s_per_byte(
            m.topology.peak_flops())
    self.update_split = costs.update_split
    # the work beside the products streams alike (solver.make_problem; its own attribute so
    # that a diagnostic can price it apart: dtenjax.testing.planning.replaced_cost_terms).
    # Measured on CPU devices only: a GPU's is left unpriced, as before, until measured there
    # (the clusters' plans, tests/test_step_planner_clusters.py, rest on their collectives)
    self.beside_s_per_byte = self.stream_s_per_byte if self.backend == "cpu" else 0.0
    # whether the products' FLOP/s are a calibration's, measured on products alone: the priors'
    # CPU FLOP/s were set against whole steps' products, the work beside them on a device's own
    # tokens inside, a calibration's chain of products holds none of it. Where measured, that
    # work is priced on its own (solver.make_problem) at the rate above (CPU devices: a GPU's
    # work beside its products is not priced, as before)
    self.pure_products = (self.backend == "cpu" and cal is not None and cal.platform == "cpu")
    self.step_latency = (costs.step_collective_us * 1e-6 if "step_collective_us" in user
                         else m.topology.meeting_s(self.backend, costs.step_collective_us * 1e-6))
    self.product_fixed_rows = costs.product_fixed_rows
    # that meeting is the devices waiting for the slowest of them to finish its compute since
    # the previous collective: their wake-up plus the spread of their arrivals, a share of that
    # compute (``between``, a product's time per device). Measured on the 8-device CPU VM: 0.09
    # ms per psum between products of 0.09 ms, 0.9 ms between products of 5 ms, which
    # wake-up + between / 6 gives (75 us and 0.89 ms); capping at the whole product (as before)
    # priced the second at the 3.06 ms prior, the collectives of tensor-parallel layouts 3x over
    if between is not None:
      self.step_latency = min(self.step_latency, MEETING_WAKE_S + MEETING_SPREAD * between)
    # an FSDP weight's all-gather waits longer: for the last of its group's devices, whose
    # arrivals are spread by the compute each did since they last met (gather_wait). The step's
    # products over those that read a weight (``weightless`` >= 1): the products no weight
    # reads (attention's scores) lie between the gathers too, shared among them in proportion.
    self.gather_spread = costs.gather_spread
    # ... except in a step whose parameters, whole, are no more than ``gather_spread_bytes``
    # (BackendCosts): its FSDP steps were measured no slower than DP's where this wait priced
    # them the slower. ``state`` not given (a Pricer built for one collective's price): as before
    weights = sum(g[0].nbytes for g in state if not g[0].is_batch)
    if state and weights <= costs.gather_spread_bytes:
      self.gather_spread = 0.0
    self.weightless = weightless
    # the bytes the optimizer's update of the whole state (``state``: its tied groups) moves per
    # step, replicated: what the devices run between the step's last meeting and the next
    # step's first gather (a lookup table's)
    self.state_update_bytes = sum(update_bytes(g, self.update_split) for g in state)

  def gather_wait(self, between: float, group: int) -> float:
    """What one FSDP all-gather over ``group`` devices waits beyond the meeting every collective
    pays (``step_latency``), where ``between`` is the compute per device since those devices last
    met: their wake-up and the last arrival of ``group`` arrivals spread about their mean by
    ``BackendCosts.gather_spread`` of ``between`` (:func:`last_arrival`)."""
    if self.gather_spread <= 0 or group < 2 or between <= 0:
      return 0.0
    return max(0.0, MEETING_WAKE_S + self.gather_spread * last_arrival(group) * between -
               self.step_latency)

  def wire(self, nbytes: float, dtype: str, wide: float = 0.0) -> float:
    """The bytes a collective of ``nbytes`` of ``dtype`` moves on this mesh's backend
    (``calls.wire_bytes``, the one place that decides it): what every collective is priced at,
    and what it records (``Price.bytes``: ``plan.check`` sets them beside the compiled
    collectives' operands, XLA:CPU's float32 of a bfloat16 value). ``wide``: of ``nbytes``, the
    bytes of bfloat16 values among values of ``dtype`` (a meeting's statistics, an index
    reduction's partials)."""
    own = calls.wire_bytes(dtype, self.backend)
    return nbytes * own + wide * (calls.wire_bytes("bfloat16", self.backend) - own)

  def __call__(self, kind: str, nbytes: float, axes: Sequence[str], dtype: str,
               wide: float = 0.0) -> float:
    """One collective of ``kind`` of ``nbytes`` per participant over ``axes``, priced at the
    bytes it moves (:meth:`wire`), with the meeting every collective pays."""
    axes = tuple(a for a in AXES if a in axes and self.m.size[a] > 1)
    if not axes or nbytes <= 0:
      return 0.0
    key = (kind, int(nbytes), axes, dtype, wide)
    if key not in self.cache:
      group = self.m.group(axes)
      # XLA:CPU runs a bfloat16 collective in float32: priced as the float32 collective it is
      # (an all-reduce price that widens a bfloat16 sum itself, auto's, is not handed the
      # bfloat16 dtype again)
      wire = self.wire(nbytes, dtype, wide)
      if kind == "all_reduce":
        t = self.price(int(wire), group, self.m.axis_sizes(axes), self.m.topology,
                       dtype if wire == nbytes else WIRE)
      else:
        t = costmodel.collective_time(kind, int(wire), group, self.m.topology)
      self.cache[key] = t + self.step_latency
    return self.cache[key]

  def share(self, kind: str, nbytes: float, axes: Sequence[str], dtype: str,
            of: float = 0.0) -> float:
    """One leaf's share of a collective XLA combines with the other leaves' (the gradients'
    all-reduces after the backward): its time less one latency, which the problem adds once
    (solver.make_problem). On an alpha-beta price the shares and that latency add up to the
    combined collective's time whatever its size. On a calibration's measured all-reduce (a
    piecewise curve, flat below its first size) they do not: one combined collective of the
    summed bytes runs, one latency and one point on the curve. Given ``of``, the bytes of that
    combined collective (the gradients': :attr:`combined`, every gradient reduced whole), the
    share is its part of them times that collective's time less the latency: exact where the
    combined collective has those bytes, the curve's secant elsewhere."""
    # the combined collective's latency, as the problem adds it (solver.make_problem: one byte
    # of float32, whatever the leaves' dtypes)
    latency = self(kind, 1, axes, WIRE)
    if kind == "all_reduce" and of > 0 and self._measured(axes):
      return nbytes / of * (self(kind, of, axes, dtype) - latency)
    return self(kind, nbytes, axes, dtype) - latency

  def looped(self, part: float, kind: str, nbytes: float, axes: Sequence[str],
             dtype: str) -> float:
    """One weight's gradient part that XLA:CPU reduces inside a loop's body, in every iteration:
    ``part`` (``WeightUse.loop_share``) of one collective of the body's joined bytes, its
    latency and meeting included. Each iteration's all-reduce is a collective of its own, run
    where the body runs, never the gradients' combined one after the backward whose latency the
    problem adds once (solver.make_problem): under alpha-beta the body's weights' parts add up
    to one alpha and their summed bytes' beta per iteration, on a measured curve to the joined
    bytes' point."""
    if part >= 1.0:
      return self(kind, nbytes, axes, dtype)
    return part * self(kind, nbytes / part, axes, dtype)

  def gradient_share(self, kind: str, nbytes: float, axes: Sequence[str], dtype: str) -> float:
    """:meth:`share` of the gradients' combined all-reduce (:attr:`combined` bytes)."""
    return self.share(kind, nbytes, axes, dtype, of=self.combined)

  def _measured(self, axes: Sequence[str]) -> bool:
    """Whether the topology's calibration measured the all-reduce over ``axes``' group (the
    price ``costmodel.collective_time`` gives XLA's all-reduce there)."""
    axes = tuple(a for a in AXES if a in axes and self.m.size[a] > 1)
    if axes not in self._curved:
      self._curved[axes] = bool(axes) and costmodel.calibrated_time(
          "all_reduce", 1, self.m.group(axes), self.m.topology) is not None
    return self._curved[axes]


def loop_parts(use: stepgraph.WeightUse | None, backend: str) -> int:
  """The gradient parts per step of a weight (``use``: its WeightUse) that XLA reduces inside a
  loop's body, once per iteration: those of its uses a loop runs whole in every iteration (not
  a scanned stack's layer; ``WeightUse.loop_parts``) on XLA:CPU. Joined there with the other
  weights the body reads (two such weights: one all-reduce of f32[128,128] x 2 per iteration),
  never across iterations nor with the gradients' combined all-reduce after the backward, which
  XLA runs outside the loop and which holds the parts of the weight's uses outside any loop
  (compiled on 8 CPU devices: tests/test_costmodel_wire.py)."""
  if use is None or backend != "cpu" or use.layers != 1:
    return 0
  return use.loop_parts


def stacked_parts(use: stepgraph.WeightUse | None, backend: str) -> int:
  """The gradient parts per layer of a scanned stack's layer that several products of the
  loop's body read (``tanh(tanh(h @ w) @ w)``), each reduced on its own (0 otherwise): XLA:CPU
  all-reduces each product's part of the layer's gradient in the backward's body, one
  all-reduce per part per iteration (compiled on 8 CPU devices, a [4, 128, 128] stack read
  twice in the body on `data` 8 and on `fsdp` 8: 8 all-reduces of f32[128,128], 0.5 MiB, where
  one part per layer was priced, -50 %). Not under jax.checkpoint, whose recomputed products
  ``WeightUse.forward_reads`` counts too."""
  if use is None or backend != "cpu" or use.layers <= 1 or use.remat:
    return 0
  return use.forward_reads if use.forward_reads > 1 else 0


def reduced_in_loop(use: stepgraph.WeightUse | None, backend: str) -> bool:
  """Whether every gradient part of a weight is reduced inside a loop's body (:func:`loop_parts`):
  none of it joins the gradients' combined all-reduce (``Pricer.combined``)."""
  return loop_parts(use, backend) > 0 and use.loop_uses >= use.grad_parts


def gradient_dtype(graph: stepgraph.StepGraph, leaf: stepgraph.Leaf) -> str:
  """The dtype XLA reduces a weight's gradient in: that of the weight as its product reads it
  (``WeightUse.read_dtype``), which the gradient's product makes, not the leaf's; for a table
  only looked up, its lookups' rows' (``StepGraph.lookup_dtypes``: the scatter-add of their
  cotangents makes the table's gradient in it). XLA's SPMD partitioner all-reduces the
  product's result and converts it to the leaf's dtype after (a float32 weight read as
  bfloat16: bf16[512,256] all-reduced, compiled on 8 CPU devices before XLA:CPU's all-reduce
  promotion widens it; a float16 one stays float16 there, and a GPU keeps both:
  tests/test_costmodel_wire.py). A leaf no product nor lookup reads: its own."""
  use = graph.weights.get(leaf.index)
  if use is not None and use.read_dtype:
    return use.read_dtype
  return graph.lookup_dtypes.get(leaf.index, leaf.dtype)


def gradient_bytes(graph: stepgraph.StepGraph, leaf: stepgraph.Leaf, nbytes: float) -> float:
  """``nbytes`` of ``leaf``'s dtype as bytes of its gradient's (:func:`gradient_dtype`)."""
  read = gradient_dtype(graph, leaf)
  if read == leaf.dtype:
    return nbytes
  # a 4-bit leaf's bytes are half its elements (jaxpr_reader.packed_bytes)
  return nbytes * jaxpr_reader.itemsize(read) / (jaxpr_reader.packed_bytes(8, leaf.dtype) / 8)


def read_leaf(graph: stepgraph.StepGraph, leaf: stepgraph.Leaf) -> stepgraph.Leaf:
  """``leaf`` as its products or lookups read it (:func:`gradient_dtype`): the table a lookup's
  gradient is scattered into and reduced as, its rows' bytes per row (the token ids' count)."""
  read = gradient_dtype(graph, leaf)
  if read == leaf.dtype:
    return leaf
  return dataclasses.replace(leaf, dtype=read, itemsize=jaxpr_reader.itemsize(read))


def _parts_time(looped: int, rest: int, in_loop, combined, *call) -> float:
  """The time of a gradient's ``looped`` parts reduced inside a loop's body, each a collective of
  its own (``in_loop``: Pricer.looped of the weight's share of the body), and its ``rest`` in the
  combined all-reduce after the backward (``combined``: its share there)."""
  return ((looped * in_loop(*call) if looped else 0.0) +
          (rest * combined(*call) if rest else 0.0))


def axis_key(axes: Sequence[str]) -> str:
  return "+".join(a for a in AXES if a in axes)


@dataclasses.dataclass
class PriceContext:
  """One layout of one tied group being priced: what a role's ``price`` reads, and the
  :class:`Price` it adds to (through :meth:`add`)."""
  graph: stepgraph.StepGraph
  primary: stepgraph.Leaf
  use: stepgraph.WeightUse | None
  used: dict[str, int]               # mesh axis -> the dimension it shards
  m: CandidateMesh
  pricer: Pricer
  batch_div: int
  dtype: str
  grad: float                        # the gradient's bytes per device before any reduction
  vocab_axes: list[str]              # axes sharding the dimension a lookup indexes
  price: Price

  def add(self, kind: str, nbytes: float, axes: Sequence[str], *, blocking: bool,
          times: float = 1, dtype: str | None = None, wide: float = 0.0) -> None:
    """``times`` collectives of ``kind`` of ``nbytes`` per participant over ``axes`` (a
    fraction: this leaf's share of one collective several leaves share), of ``dtype`` (default
    the weight's; ``WIRE`` where ``nbytes`` already are the bytes that move), with ``wide``
    bytes of bfloat16 among them (values of their own dtypes: ``jaxpr_reader.wide_bytes``).
    Priced and recorded at the bytes that move (``Pricer.wire``)."""
    key = axis_key(axes)
    dtype = self.dtype if dtype is None else dtype
    acc(self.price.blocking if blocking else self.price.overlappable, key,
        times * self.pricer(kind, nbytes, axes, dtype, wide))
    acc(self.price.bytes, f"{kind}[{key}]", times * self.pricer.wire(nbytes, dtype, wide))


def _gathered_widening(backend: str, dtype) -> float:
  """Bytes of the gathered copy a product reads per byte of a weight of ``dtype`` gathered for
  it whole. XLA:CPU gathers a bfloat16 weight in float32 (the shard converted, then a float32
  all-gather: :func:`calls.wire_bytes`), and jax 0.10's XLA:CPU, which computes the bfloat16
  product in float32, keeps that float32 value for the forward's and the backward's products: a
  bfloat16 MLP on `fsdp` 8 at batch 64 whose gradients are made on the weights' shards holds
  f32[128,512] and f32[512,128] gathered at the step's start, the peak of its temp (XLA:CPU's
  buffer assignment; priced in bfloat16, the step's memory was -46.6 %). jax 0.11's computes the
  product in bfloat16 and converts the gathered copy back, a bfloat16 copy kept and the float32
  one transient (``Price.gathered_wide``). A float16 weight is gathered in float16 (its
  collectives stay float16) and the gathered copy converted to float32, the copy XLA:CPU's
  products read under jax 0.10 and 0.11 alike (a float16 MLP on `fsdp` 8: f32[128,512] and
  f32[512,128] kept, the float16 all-gather's result dying at its conversion; XLA:CPU's buffer
  assignment under both). Every other dtype, and a GPU's copy: its own."""
  return 2.0 if backend == "cpu" and str(dtype) in ("bfloat16", "float16") else 1.0


def _converted_for_products(backend: str, dtype) -> bool:
  """Whether XLA:CPU computes a product of a weight of ``dtype`` in float32, on a float32
  copy of the weight: float16 under jax 0.10 and 0.11, bfloat16 under 0.10 only (0.11's
  XLA:CPU computes bfloat16 products in bfloat16: no copy in its buffer assignment of a
  bfloat16 MLP on `data` 8, where 0.10's holds f32[128,512] and f32[512,128]). A GPU's
  products read the weight as it is."""
  return backend == "cpu" and (str(dtype) == "float16" or
                               str(dtype) == "bfloat16" and XLA_VERSION < (0, 11))


def gradient_on_shard(graph: stepgraph.StepGraph, group: Sequence[int], used: dict[str, int],
                      m: CandidateMesh):
  """How plan.jit computes the gradient of ``group``'s weight (the tied leaves of one layout:
  the parameter and its optimizer state) on its shard from activations moved over the batch
  (a gather.ShardGradient per product that makes a part of it) under a layout (``used``: mesh
  axis -> the dimension it shards) that splits one dimension of it over batch axes alone, as
  gather.py's evaluator applies it; None where the whole gradient is made and reduced."""
  if not used or any(a not in BATCH_AXES or a in SEQUENCE_AXES or m.size[a] == 1
                     for a in used):
    return None
  dims = set(used.values())
  if len(dims) != 1:
    return None
  d = dims.pop()
  return next((graph.shard_gradients[(k, d)] for k in group
               if (k, d) in graph.shard_gradients), None)


def _vocab_axes(lookup, used, m: CandidateMesh, zero: list[str]) -> list[str]:
  """The axes over which a table read only by lookups is looked up in place (vocab-parallel:
  sharded over the dimension the lookups index). Not the batch axes that plan.jit gathers the
  table over (its compute layout, as for any FSDP weight): XLA all-gathers the table and looks up
  locally, on both backends (llama_loop's FSDP plan: all-gather 20.0 MiB and no all-reduce on a
  mocked 8-GPU host, where the masked lookup priced 8 MiB of all-reduce; on 64 CPU devices the
  masked lookup would all-reduce the rows of every token of the global batch, 16 MiB, where XLA:CPU
  gathers 2 MiB of table)."""
  if lookup is None:
    return []
  return [a for a in used if m.size[a] > 1 and used[a] in lookup[0] and a not in zero]


def _reduced_in_tensor_pairs(graph: stepgraph.StepGraph, primary: stepgraph.Leaf, use,
                             used, m: CandidateMesh, zero: list[str]) -> bool:
  """Whether XLA:GPU reduces this FSDP weight's gradient as shards over groups of the FSDP
  size rather than reduce-scattering it: a product's (or convolution's) weight outside any
  loop, or a table read by
  lookups, sharded over the batch axes ``zero`` and replicated over a ``tensor`` axis at least
  as large, whose gradient every tensor device could compute whole. The GPU partitioner splits
  that product over a tensor sub-axis of the FSDP size instead, so each device computes one
  shard (llama-1b's FSDP x TP step, fsdp 2 x tensor 4, module_217552: the unembedding's
  gradient is a [1024, 32000] product per device, all-reduced over the fsdp pair and then
  moved to its owner by a collective-permute; the table's all-reduced likewise; every FSDP x TP
  row of the recorded runs reduce-scatters 4-4.5 MiB where 8-8.5 were priced, all-reduces 2
  MiB more and permutes 2 MiB, the table's piece and the unembedding's in one combined op)."""
  fsdp = math.prod(m.size[a] for a in zero)
  tensor = m.size["tensor"]
  if tensor < 2 or "tensor" in used or tensor % fsdp:
    return False
  if use is not None:
    return use.layers <= 1
  return primary.index in graph.lookups


def _price_pair_reduction(ctx: PriceContext, zero: list[str]) -> None:
  """The collectives of :func:`_reduced_in_tensor_pairs`: the gradient's shard all-reduced
  over the FSDP axes and sent to the device that holds it (a collective-permute), for a
  product's weight, a convolution's kernel and a looked-up table alike (the combined permutes
  of the mocked 8-GPU host's FSDP x TP steps: llama_loop's table half and unembedding piece, 1
  MiB each; convnet's eight kernel pieces, 0.567 MiB; moe's table, routers and unembedding).
  A table's lookups are partitioned one by one, each reducing and moving its own piece, or
  its tokens' cotangent rows and their int32 ids where those are smaller
  (:func:`_moved_table_rows`)."""
  shard = ctx.grad / math.prod(ctx.m.size[a] for a in zero)
  moved = _moved_table_rows(ctx, shard) if ctx.use is None else [shard]
  ctx.add("all_reduce", shard, zero, blocking=False, times=len(moved))
  for nbytes in moved:
    ctx.add("ppermute", nbytes, zero + ["tensor"], blocking=False)


def _moved_table_rows(ctx: PriceContext, shard: float) -> list[float]:
  """The bytes per device XLA:GPU permutes for each lookup of a table whose gradient is reduced
  in pairs (:func:`_price_pair_reduction`): the table's shard, or, where they are smaller, the
  cotangent rows of the tokens an FSDP group looks up with their int32 ids, which XLA:GPU moves
  so that each tensor pair holds every token of its table shard and scatters them there
  (llama-1b's FSDP x TP step, module_217552: bf16[4,2048,2048] rows and s32[4,2048,1] ids
  permuted, 32.03 MiB, against a 62.5 MiB half table; the half table's all-reduce is
  unchanged). The encoder-decoder's table, looked up for the source and the target tokens, is
  all-reduced as two halves (its FSDP x TP step: 45 MiB of all-reduce compiled, 44 with one)."""
  lookup = ctx.graph.lookups.get(ctx.primary.index)
  if lookup is None:
    return [shard]
  indexed, _, each = lookup
  row = ctx.primary.nbytes / max(1, math.prod(ctx.primary.shape[k] for k in indexed))
  return [min(shard, rows / ctx.batch_div * (1 + 4 / row)) for rows in each]


@dataclasses.dataclass(frozen=True)
class LookupGradient:
  """The collectives of a table's lookups' gradient part, and whether that part is the whole
  table on every device (then reduced like any FSDP gradient) or made in the device's shard."""
  all_gather: float = 0.0      # bytes per device, over the batch axes that shard the table
  all_to_all: float = 0.0
  ppermute: float = 0.0        # over those axes and 'tensor'
  # of all_gather (ppermute), the int32 token ids' bytes: they move as they are beside the
  # table's rows, which XLA:CPU moves in float32 where the table is bfloat16
  all_gather_ids: float = 0.0
  ppermute_ids: float = 0.0
  all_reduce: float = 0.0      # over 'tensor'
  reduced: float = 0.0         # all-reduced over the batch axes (:func:`_scattered_in_pieces`)
  whole: bool = True
  whole_lookups: int | None = None   # the lookups whose part is the whole table (None: all)


def lookup_gradient(graph: stepgraph.StepGraph, primary: stepgraph.Leaf, used: dict[str, int],
                    m: CandidateMesh, backend: str) -> LookupGradient:
  """How XLA's SPMD partitioner makes a lookup's gradient (a scatter-add of the tokens'
  cotangent rows into zeros of the table's shape) where axes that split the tokens shard the
  table (FSDP's): of its methods, the one of least estimated memory (gather_scatter_handler.cc,
  compiled on 8 and 16 CPU devices):

  * the table sharded on a dimension the lookups do not index (FSDP shards a tied table on its
    features, the dimension its product contracts): each device's cotangent rows go to the
    shard's layout (an all-to-all, "operand passthrough"), the token ids are all-gathered, and
    the rows are scattered into the shard;
  * sharded on the indexed one (the vocabulary): where a lookup's rows and its int32 token ids,
    all-gathered, are no more bytes than the table ("trivially sliced operand": the shard plus
    the gathered rows and ids, against the whole table plus the local ones), XLA gathers them
    and scatters into the shard; else each device scatters its tokens into a whole table, which
    is all-reduced ("index passthrough"). Each lookup is partitioned on its own.

  Priced on XLA:CPU (measured there: FSDP rows, and beside a ``tensor`` axis for a table it
  replicates, sharded on its features: :func:`_lookup_pieces_over_tensor`), and on XLA:GPU for
  the vocabulary-sharded table on meshes without a ``tensor`` axis (its partitioner is the same:
  llama-1b's `fsdp` 8 plans on a mocked 8-GPU host, module_171787 and module_202297, all-gather
  the lookup's cotangent rows, bf16[8,2048,2048], and its s32[8,2048] ids, 64.06 MiB, and
  reduce-scatter no table gradient, where the families' 4 MiB of rows against a 2 MiB table
  reduce-scatter it). XLA:CPU's other forms beside ``tensor`` are :func:`_table_scatter`'s (a
  vocab-parallel table) and :func:`_spread_reduction`'s (a table sharded on its vocabulary),
  XLA:GPU's :func:`_reduced_in_tensor_pairs`'; elsewhere the whole gradient is reduced."""
  lookup = graph.lookups.get(primary.index)
  zero = [a for a in BATCH_AXES if a in used and m.size[a] > 1 and a not in ROUTED_AXES]
  if lookup is None or not zero or (backend != "cpu" and m.size["tensor"] > 1):
    return LookupGradient()
  indexed, _, each = lookup
  vocabulary = any(used[a] in indexed for a in zero)
  if backend != "cpu" and not vocabulary:      # the feature-sharded table: seen on XLA:CPU only
    return LookupGradient()
  rest = math.prod(m.size[a] for a in BATCH_AXES if m.size[a] > 1 and a not in zero)
  local = rest * math.prod(m.size[a] for a in zero)
  row = primary.nbytes / max(1, math.prod(primary.shape[k] for k in indexed))
  ids = [rows / row * 4 for rows in each]            # int32 token ids of each lookup
  if m.size["tensor"] > 1:
    if vocabulary or "tensor" in used:
      return LookupGradient()
    # a tied table's lookup part (a product's gradient too), and any table where another batch
    # axis splits the tokens, keep 0.10's form on 0.11 (:func:`_scattered_in_pieces`)
    gathered = None if primary.index in graph.weights or rest > 1 else sum(each) / rest
    if gathered is not None and _scattered_in_pieces(primary, gathered, m, zero):
      shard = primary.nbytes / math.prod(m.size[a] for a in zero)
      return LookupGradient(reduced=_piece(primary, m, zero), ppermute=shard, whole=False)
    return _lookup_pieces_over_tensor(primary, m, zero, sum(each) / local, sum(ids) / local,
                                      gathered)
  if not vocabulary:
    return LookupGradient(all_gather=sum(ids) / rest, all_gather_ids=sum(ids) / rest,
                          all_to_all=sum(each) / local, whole=False)
  small = [(rows, i) for rows, i in zip(each, ids) if rows + i <= primary.nbytes]
  return LookupGradient(all_gather=sum(rows + i for rows, i in small) / rest,
                        all_gather_ids=sum(i for _, i in small) / rest,
                        whole=len(small) < len(each), whole_lookups=len(each) - len(small))


def _lookup_pieces_over_tensor(primary: stepgraph.Leaf, m: CandidateMesh, zero: list[str],
                               rows: float, ids: float, gathered: float | None
                               ) -> LookupGradient:
  """A lookup's gradient part on XLA:CPU where the batch axes ``zero`` shard the table on its
  features and 'tensor' replicates it: each device's cotangent rows (``rows`` bytes) go to the
  shard's layout by an all-to-all over ``zero``, as without 'tensor'; the 'tensor' devices of
  an FSDP group then scatter the gathered tokens in pieces (the token ids moved to them by a
  collective-permute, ``ids`` bytes) into the shard and all-reduce it over a 'tensor'
  sub-group. Nothing of this part is reduced over ``zero``; a tied table's product part is
  still :func:`_spread_reduction`'s (compiled: gpt2's FSDP x TP plans, `fsdp` 2 x `tensor` 4 to
  16 on 8 to 32 CPU devices: on 8 an all-to-all of 2 x f32[8,512,1,384] and the shard
  f32[50304,384] all-reduced over pairs of 'tensor' devices, beside the product's half
  all-reduced over 'fsdp' and permuted; a lookup-only table alike, `fsdp` 2 x `tensor` 4 and
  `fsdp` 4 x `tensor` 2). XLA:CPU 0.11 all-gathers a lookup-only table's rows over ``zero``
  instead (``gathered`` bytes, each device's rows times the group's size; None for a tied
  table, whose rows are still all-to-alled) and slices its features from them, the rest alike
  (compiled under jaxlib 0.11.2: llama_loop's tables of 1024 and 2048 rows, `fsdp` 4 x `tensor`
  2 and `fsdp` 2 x `tensor` 4: the 0.5 MiB of rows all-gathered where 0.10.2 all-to-alls 0.125
  (0.25) MiB; gpt2-like tied tables of 1024 to 8192 rows as on 0.10.2)."""
  shard = primary.nbytes / math.prod(m.size[a] for a in zero)
  if gathered is not None and XLA_VERSION >= (0, 11):
    return LookupGradient(all_gather=gathered, ppermute=ids, ppermute_ids=ids, all_reduce=shard,
                          whole=False)
  return LookupGradient(all_to_all=rows, ppermute=ids, ppermute_ids=ids, all_reduce=shard,
                        whole=False)


def _scattered_in_pieces(primary: stepgraph.Leaf, gathered: float, m: CandidateMesh,
                         zero: list[str]) -> bool:
  """Whether XLA:CPU 0.11's partitioner scatters a lookup's gradient into pieces of a table that
  the batch axes ``zero`` shard on its features, beside a 'tensor' axis that replicates it or
  splits its vocabulary: where the whole table is fewer bytes than the lookup's cotangent rows
  gathered over ``zero`` (``gathered``). Each device then scatters its own tokens into a piece of
  the table's features (one per 'tensor' sub-group, as many as the smaller of the two axes has
  devices: :func:`_piece`), all-reduces it over ``zero`` and sends each device its shard by a
  collective-permute; no rows and no token ids move. Otherwise, and on 0.10, the rows go to the
  shard's layout (:func:`_lookup_pieces_over_tensor`, :func:`_table_scatter`). Compiled under
  jaxlib 0.11.2 on 8 CPU devices: llama_loop's 512-row table (256 KiB) against 512 KiB and 1
  MiB of rows, `fsdp` 4 x `tensor` 2 and `fsdp` 2 x `tensor` 4, sharded on its features or also
  on its vocabulary over 'tensor': a 128 KiB piece all-reduced over 'fsdp' and the 64 (32) KiB
  shard permuted, where 0.10.2 all-to-alls the rows; with 1024 or 2048 rows, no pieces. A tied
  table (a product's gradient too) was not seen in pieces; nor is a table priced so where another
  batch axis also splits the tokens: there 0.11.2 partitions as 0.10.2 prices (`data` 2 x `fsdp`
  4 x `tensor` 2 on 16 devices: the rows all-to-alled), and on 8 devices (`data` 2 x `fsdp` 2 x
  `tensor` 2) both versions scatter in pieces, which neither is priced for. On 16 devices
  without `data` (`fsdp` 8 x `tensor` 2, `fsdp` 4 x `tensor` 4) 0.11.2 compiles these forms.
  Never on XLA's GPU compiler (its tables beside 'tensor': :func:`_reduced_in_tensor_pairs`)."""
  f, t = math.prod(m.size[a] for a in zero), m.size["tensor"]
  return (XLA_VERSION >= (0, 11) and t > 1 and not (t % f and f % t)
          and primary.nbytes < gathered)


def _piece(primary: stepgraph.Leaf, m: CandidateMesh, zero: list[str]) -> float:
  """The bytes of one piece of :func:`_scattered_in_pieces`: the table split over the smaller of
  the batch axes ``zero`` and 'tensor'."""
  return primary.nbytes / min(math.prod(m.size[a] for a in zero), m.size["tensor"])


def _spread_reduction(graph: stepgraph.StepGraph, primary: stepgraph.Leaf, use, used,
                      m: CandidateMesh, zero: list[str], backend: str, grad: float,
                      batch_div: int) -> tuple[int, float, float]:
  """Into how many pieces XLA:CPU's partitioner splits the reduction of a weight's gradient
  that the batch axes ``zero`` shard and 'tensor' replicates (1: not split), the bytes per
  device it then permutes, and of those the int32 token ids' (:func:`_moved_per_lookup`).

  Every 'tensor' device of an FSDP group would compute the same gradient, so XLA computes it in
  pieces, one per 'tensor' sub-group (as many as the smaller of the two axes has devices, where
  one divides the other), all-reduces each piece over the FSDP group, and moves each device's
  shard to it with a collective-permute of the shard (compiled: llama_loop's FSDP x TP plan on
  8, 16 and 32 CPU devices, `fsdp` 2: the embedding's and the unembedding's gradients, and the
  attention's where 'tensor' does not divide the heads, all-reduced and permuted as halves; the
  convnet's convolutions; llama_scan's `fsdp` 16 x `tensor` 4 plan on 64: the FSDP table's
  gradient all-reduced in quarters, 0.5 MiB, and 0.125 MiB permuted). For a lookup table it
  permutes the tokens' cotangents instead where they are smaller (the mixture of experts' 512
  tokens per device: 0.5 MiB, not 1). Only a gradient a product or a lookup's scatter writes is
  split, and a product's only where 'tensor' is at least as large as the FSDP group: with more
  FSDP devices its gradient is all-reduced whole over them and not permuted (compiled on 8 CPU
  devices, `fsdp` 4 x `tensor` 2: llama_loop's unembedding f32[512,128] whole, its lookup table
  still in halves and a quarter permuted; a tied table's product part whole). A norm's gradient
  (a reduce over the tokens) is all-reduced whole. XLA's GPU compiler reduces them another way
  (:func:`_reduced_in_tensor_pairs`): not priced there."""
  t = m.size["tensor"]
  if backend != "cpu" or t <= 1 or "tensor" in used or not zero:
    return 1, 0.0, 0.0
  lookup = graph.lookups.get(primary.index)
  if use is None and lookup is None:
    return 1, 0.0, 0.0
  f = math.prod(m.size[a] for a in zero)
  if (t % f and f % t) or (use is not None and f > t):
    return 1, 0.0, 0.0
  moved = grad / f
  if use is None:
    return (min(f, t),) + _moved_per_lookup(primary, lookup, moved, batch_div)
  return min(f, t), moved, 0.0


def _moved_per_lookup(primary: stepgraph.Leaf, lookup, piece: float,
                      batch_div: int) -> tuple[float, float]:
  """What XLA:CPU permutes per lookup of a table :func:`_spread_reduction` reduces in pieces,
  on average over its lookups: each lookup's gradient is partitioned, reduced and permuted on its
  own (:func:`_lookup_parts`), and permutes the ``piece`` of the table, or the lookup's local
  cotangent rows and int32 token ids where they are fewer bytes (compiled: the
  encoder-decoder's FSDP x TP plan, two lookups of a 2048 x 256 table: on 8 CPU devices two
  f32[8,64,256] and two s32[8,64,1], on 16 two f32[1024,256] pieces). With the bytes of the
  int32 ids among them (which move as they are, beside rows of the table's dtype)."""
  indexed, _, each = lookup
  row = primary.nbytes / max(1, math.prod(primary.shape[k] for k in indexed))
  moved = ids = 0.0
  for rows in each:
    if piece <= (rows + rows / row * 4) / batch_div:
      moved += piece
    else:
      moved += (rows + rows / row * 4) / batch_div
      ids += rows / row * 4 / batch_div
  return moved / len(each), ids / len(each)


def _lookup_parts(graph: stepgraph.StepGraph, primary: stepgraph.Leaf, scatter: LookupGradient,
                  backend: str) -> int:
  """The gradient parts XLA:CPU reduces apart for a table only looked up: one per lookup whose
  part is the whole table (each lookup's gradient is a scatter of its own, partitioned and
  all-reduced before they are added; compiled: the encoder-decoder's source and target lookups
  into one table, 24.0 MiB of all-reduce on its DP and FSDP rows where one reduction priced
  22.0, and under FSDP x TP two pieces all-reduced and two permutes where one was priced, on 8
  to 64 CPU devices), none where each is made in the table's shard (on both backends:
  :func:`lookup_gradient`). XLA's GPU compiler otherwise: one (not seen compiled with several
  lookups)."""
  lookup = graph.lookups.get(primary.index)
  if lookup is None:
    return 1
  if not scatter.whole:
    return 0
  if backend != "cpu":
    return 1
  return len(lookup[2]) if scatter.whole_lookups is None else scatter.whole_lookups


def _table_scatter(lookup, vocab_axes: list[str], zero: list[str], m: CandidateMesh,
                   primary: stepgraph.Leaf, backend: str, batch_div: int,
                   rest: Sequence[str] = ()) -> list[tuple]:
  """The collectives (kind, bytes per device, axes[, dtype]) of XLA:CPU's backward of a lookup
  into a table vocab-parallel over ``vocab_axes`` and sharded over the batch axes ``zero`` on its
  features (none otherwise): it all-to-alls the tokens' cotangents over ``zero`` (each device's
  rows, from split by token to split by feature), scatters them into every vocabulary row of
  its feature shard and all-reduces that over ``vocab_axes``; the table's gradient is never
  all-reduced over ``zero`` (compiled: llama_scan's `fsdp` 8 x `tensor` 2 plan on 16 CPU
  devices, 0.5 MiB of all-to-all and a 0.25 MiB all-reduce where the model priced 1 MiB of
  all-reduce; the mixture of experts' `fsdp` 16 x `tensor` 4 on 64). XLA:CPU 0.11, vocab-parallel
  over 'tensor' with no other batch axis, scatters in pieces where the table is the smaller
  (:func:`_scattered_in_pieces`), else all-gathers the rows (``gathered`` bytes) where 0.10
  all-to-alls them (:func:`_lookup_pieces_over_tensor`). Where other batch axes (``rest``, the
  mixture of experts' `expert`, a `data` axis) split the tokens too, XLA:CPU 0.10 makes one of
  :func:`_scatter_beside_batch`'s forms instead. Not seen compiled for the GPU."""
  if backend != "cpu" or not (vocab_axes and zero):
    return []
  f = math.prod(m.size[a] for a in zero)
  form = _scatter_beside_batch(lookup, vocab_axes, zero, m, primary, batch_div)
  if form is not None:
    t = math.prod(m.size[a] for a in vocab_axes)
    if form == "reduced":
      return [("all_reduce", primary.nbytes / t, zero + list(rest)),
              ("ppermute", primary.nbytes / (f * t), zero + vocab_axes)]
    row = primary.nbytes / max(1, math.prod(primary.shape[k] for k in lookup[0]))
    ids = lookup[1] / row * 4 / batch_div        # each device's int32 token ids
    reduced = ([("all_reduce", primary.nbytes / f, list(rest) + vocab_axes)]
               if form == "gathered, whole vocabulary" else
               [("all_reduce", primary.nbytes / (f * t), list(rest))])
    return [("all_gather", lookup[1], zero + list(rest)),
            ("ppermute", ids, zero + vocab_axes, "int32")] + reduced
  gathered = lookup[1] / batch_div * f
  if vocab_axes == ["tensor"] and batch_div == f:     # no other batch axis
    if _scattered_in_pieces(primary, gathered, m, zero):
      return [("all_reduce", _piece(primary, m, zero), zero),
              ("ppermute", primary.nbytes / (f * m.size["tensor"]), zero + ["tensor"])]
    if XLA_VERSION >= (0, 11):
      return [("all_gather", gathered, zero), ("all_reduce", primary.nbytes / f, vocab_axes)]
  return [("all_to_all", lookup[1] / batch_div, zero),
          ("all_reduce", primary.nbytes / f, vocab_axes)]


def _scatter_beside_batch(lookup, vocab_axes: list[str], zero: list[str], m: CandidateMesh,
                          primary: stepgraph.Leaf, batch_div: int) -> str | None:
  """How XLA:CPU 0.10's partitioner makes the gradient of a lookup into a table vocab-parallel
  over ``vocab_axes`` and sharded on its features over the batch axes ``zero``, where other batch
  axes split the tokens too (``batch_div`` above the size of ``zero``); None elsewhere. It picks
  by the estimated memory of each method (gather_scatter_handler.cc), here by the bytes of every
  token's cotangent rows (``lookup[1]``, R) against the table's (W):

  * R > W, "reduced" (index passthrough): each device scatters its own tokens into every
    vocabulary row of the table's features split over ``vocab_axes`` (W / t), all-reduces that
    over all the batch axes (the combined gradient all-reduce), slices its shard and
    collective-permutes it onto the parameter's devices (W / (f t));
  * R <= W: the rows of every token all-gathered over all the batch axes (R bytes per device),
    the int32 ids collective-permuted, and the rows scattered into the device's features of
    the table: where R < W into its shard, all-reduced over the other batch axes, "gathered"
    (W / (f t)); where R = W, the two methods' estimates tie (the shard plus the rows on every
    vocab-parallel device, against every vocabulary row plus the rows split among them:
    W/(f t) + R/f against W/f + R/(f t)) and XLA took every vocabulary row, all-reduced over the
    other batch axes and ``vocab_axes``, "gathered, whole vocabulary" (W / f).

  Compiled under jaxlib 0.10.2 on 8 to 32 CPU devices, a 2048 x 256 table P('tensor', 'fsdp'),
  `fsdp` x `expert` x `tensor` and `fsdp` x `data` x `tensor` with the tokens split over both
  batch axes: R of 0.5 and 1 MiB ("gathered") on 2x2x2, 2x4x2, 4x2x2 (data too); R = 2 MiB,
  "gathered, whole vocabulary" on 2x2x2, 2x4x2, 4x2x2, 4x4x2 (the mixture of experts' 16-device
  row, 2 MiB of all-gather where 0.25 MiB of all-to-all was priced) and "gathered" on 2x2x4
  (the tie broken the other way; with 'tensor' 2 as priced); R of 3 and 4 MiB, "reduced", on
  2x4x2, 4x2x2 (data), 4x4x2, 2x8x2 and 8x2x2 (the 32- and 64-device rows' 0.25 MiB permute).
  XLA:CPU 0.11.2 all-to-alls the rows of a 256 KiB table on `data` 2 x `fsdp` 4 x `tensor` 2
  (:func:`_scattered_in_pieces`): not priced so there."""
  if (XLA_VERSION >= (0, 11) or lookup is None or not (vocab_axes and zero)
      or batch_div <= math.prod(m.size[a] for a in zero)):
    return None
  if lookup[1] > primary.nbytes:
    return "reduced"
  return "gathered, whole vocabulary" if lookup[1] == primary.nbytes else "gathered"


def scatter_zeros_from_the_start(graph: stepgraph.StepGraph, primary: stepgraph.Leaf, used,
                                 m: CandidateMesh, backend: str, batch_div: int) -> bool:
  """Whether XLA:CPU makes the zeros a table's lookup gradient is scattered into at the step's
  start: where :func:`_scatter_beside_batch` scatters into every vocabulary row ("reduced", and
  "gathered, whole vocabulary"), the broadcast of those zeros has no operand and XLA:CPU's
  schedule puts it before the forward (compiled under jaxlib 0.10.2: a 2048 x 256 table's
  lookup step on 16 and 32 CPU devices, `wrapped_broadcast` f32[2048,128] the 20th of 76
  instructions, before the forward's products; tests/test_step_planner_memory.py's 512 x 64 on
  8; the mixture of experts' 64-device row, XLA's heap log: from tick 0 to 434 of 438, live at
  the temp's peak at the loss, tick 181), at one offset with the scatter written into it in
  place. The table's gradient value then lives from the step's start
  (:func:`solver._zeros_at_the_start`). The zeros of the shard ("gathered", W / (f t)) are
  made at the start too; not priced so (the model sizes this table's gradient W / t)."""
  if backend != "cpu" or primary.index in graph.weights:
    return False
  lookup = graph.lookups.get(primary.index)
  routed = [a for a in ROUTED_AXES if a in used and m.size[a] > 1]
  zero = [a for a in BATCH_AXES if a in used and m.size[a] > 1 and a not in routed]
  read = read_leaf(graph, primary)
  form = _scatter_beside_batch(lookup, _vocab_axes(lookup, used, m, zero), zero, m, read,
                               batch_div)
  return form in ("reduced", "gathered, whole vocabulary")


def regathered(use) -> bool:
  """Whether an FSDP weight is gathered again for the backward: a layer of a scanned stack
  (gathered inside the loop body, in the forward's loop and again in the backward's), or a
  weight a loop reads whole (a lax.fori_loop applying one weight in every iteration: gathered
  once for the forward's loop and once for the backward's; compiled on 8 CPU devices). A
  checkpointed read outside any loop is gathered once: XLA merges the backward's gather of the
  same sharded weight with the forward's (compiled on 8 CPU devices: three checkpointed layers
  and an output kernel, 4 all-gathers for the 4 weights, with and without a checkpoint policy;
  tests/test_plan_user_steps.py). A weight whose input gradient a ``lax.cond``'s branch reads is
  gathered in the forward's conditional and again in the backward's (gated_head in
  tests/test_plan_user_steps.py: w2 twice, the first layer's weight once). So is one a branch
  reads under jax.checkpoint: the backward's rematerialized conditional is another
  conditional, whose branch gathers it again, and XLA merges no gather across conditionals (a
  cond of ``x + gelu(x @ w1) @ w2`` or ``tanh(x @ w3)`` in a checkpoint on `fsdp` 8: w1 and w3
  gathered in the forward's conditional and in the rematerialized one, w2 in the forward's and
  the backward's; 2176 KiB of all-gather, priced 1536 before)."""
  return use is not None and (use.layers > 1 or use.repeats > 1 or
                              (use.branched and (use.input_grad or use.remat)))


def dead_first_gather(use) -> bool:
  """Whether XLA gathers one layer of a scanned FSDP stack once rather than twice: a scan of
  ``unroll`` u > 1 over L layers, L not a multiple of u, whose product reads the carry and whose
  carry into the first layer no state leaf computes (the batch). JAX writes the L % u
  remainder iterations out after the while loop (``loops._scan_impl``, jax 0.10 and 0.11): the
  last ones of the forward's scan, the first layers in the backward's reverse scan, whose
  last-run iteration is the first layer's. Its input gradient is dead there (the batch has
  none) and, written out of the loop, XLA removes its product: the first layer's only
  backward read is its gradient's product, which reads no weight, so XLA gathers that layer
  for the forward alone (compiled on `fsdp` 8, ``tanh(h @ w)`` over [L, 128, 128]: 2L - 1
  all-gathers of f32[1,128,128] at L 4 and 5 with u 3, L 3 with u 2, L 7 with u 3 (a two-trip
  loop: 13), L 5 with u 4; 2L at u 1 and at L 4 with u 2, where the backward's loop body reads
  every layer for its input gradient)."""
  return (use is not None and use.layers > 1 and use.carried_input and use.carry_in_free
          and 1 < use.unroll < use.layers and use.layers % use.unroll != 0)


def gathers_a_pass(use) -> int:
  """How many times a step gathers an FSDP weight (a scanned stack's layer, once a trip): twice
  where :func:`regathered` (the forward's read and the backward's), else once; three times for a
  scanned stack's layer read in a loop that a jax.checkpoint call holds (the checkpoint around
  the ``lax.scan``, ``WeightUse.recomputed_loop``): JAX's backward call runs the forward's loop
  again before the backward's loop, and each of the three loops gathers every layer (a
  [3, 64, 64] stack split ``P(None, 'fsdp')``, ``tanh(h @ w + b)``, on `data` 2 x `fsdp` 4, sgd,
  batch 64: 144 KiB of all-gather on jax 0.10.2 and 0.11.2, three 16 KiB layers three times;
  96 KiB were priced)."""
  if use is not None and use.layers > 1 and use.recomputed_loop:
    return 3
  return 2 if regathered(use) else 1


def gathered_in_call(use) -> bool:
  """Whether a weight read in a jax.checkpoint call outside any loop is gathered a second time,
  in the backward's call behind its optimization barrier: under jaxlib 0.11, where plan.jit
  gathers it there as the plain FSDP jit does (gather.GATHER_BEFORE_BARRIER; jaxlib 0.10's
  plan.jit gathers it once, before the barrier). Its copy is priced held as before (XLA:CPU
  0.11's compiles of the checkpointed MLPs at batch 64 on `fsdp` 8 hold as much: 0.90 MiB), and
  the second gather only in the bytes plan.check compares: priced in the time the plans are
  chosen by it moved tests/test_plan_user_steps.py's remat_policy off FSDP, onto a plan XLA
  compiles with a third more all-gather than priced (not traced)."""
  return (use is not None and use.remat and XLA_VERSION >= (0, 11)
          and not regathered(use))


def price_layout(graph: stepgraph.StepGraph, group: tuple[int, ...], lay: Layout, m: CandidateMesh,
           pricer: Pricer, batch_div: int, donate: bool) -> Price:
  leaves = [graph.leaves[i] for i in group]
  primary = leaves[0]
  used = lay.used()
  shards = math.prod(m.size[a] for a in used)
  # a weight's shards over a routed axis (expert) stay put: the tokens come to them, and each
  # gradient shard is complete where it lies (no gather, no reduction over that axis)
  routed = [a for a in ROUTED_AXES if a in used and m.size[a] > 1]
  zero = [a for a in BATCH_AXES if a in used and m.size[a] > 1 and a not in routed]
  batch = [a for a in BATCH_AXES if m.size[a] > 1 and a not in routed]
  pr = Price()
  dtype = primary.dtype
  # the group's weight as the step reads it, though the group's first leaf be an optimizer
  # state's (a state dict whose "opt" sorts before its "params"): without it the gathered copy
  # was priced at nothing, which only a peak at the gradients' reduction hid
  use = next((graph.weights[i] for i in group if i in graph.weights), None)
  # the axes sharding it that do not split the batch ('tensor', a pipeline's 'stage'), and the
  # routed ones, divide the gradient each device computes; the other batch axes only split work
  grad = primary.nbytes / math.prod(m.size[a] for a in used
                                    if a not in BATCH_AXES or a in routed)
  # a leaf both looked up (gather) and multiplied (tied embeddings) has two gradient parts,
  # which XLA synchronises separately before adding them (seen on XLA:CPU)
  parts = 2 if (use is not None and primary.index in graph.gathered) else 1
  # a weight read at several depths (shared across layers) has one gradient part per read:
  # XLA:CPU reduces each part on its own before adding them; XLA's GPU compiler adds the parts
  # first and reduces their sum once (compiled for a mocked 8-GPU host: 8 MiB of all-reduce on
  # the shared family's DP step, where one reduction per use would be 28)
  uses = use.grad_parts if use is not None and pricer.backend == "cpu" else 1
  uses = max(uses, stacked_parts(use, pricer.backend))
  # a weight a loop reads whole in every iteration (not a scanned stack's layer): XLA:CPU
  # reduces each iteration's gradient part inside the backward's loop (compiled on 8 CPU
  # devices, data- and fully-sharded alike: a lax.fori_loop of 3, 3 all-reduces of the weight).
  # They run in the loop's body (loop_parts): each iteration's all-reduce a collective of its own,
  # latency included, joined with the body's other weights (Pricer.looped), not a share of the
  # combined all-reduce after the backward; a use outside any loop (the same weight read once
  # more after the loop) joins that combined one
  looped = loop_parts(use, pricer.backend)
  in_loop = functools.partial(pricer.looped, use.loop_share if looped else 1.0)
  if looped:
    uses += looped - min(use.loop_uses, uses)
  parts = max(parts, uses)
  lookup = graph.lookups.get(primary.index) if use is None else None
  vocab_axes = _vocab_axes(lookup, used, m, zero)
  ctx = PriceContext(graph, primary, use, used, m, pricer, batch_div, dtype, grad, vocab_axes, pr)
  # XLA:CPU's reductions of a gradient the batch axes shard: a vocab-parallel table's scatter
  # (_table_scatter), else a gradient 'tensor' replicates reduced in pieces (_spread_reduction),
  # else a looked-up table's rows gathered into its shard or its gradient made whole
  # (lookup_gradient)
  # of the dtype its products or lookups read it in (a float32 weight cast to bfloat16), not the
  # leaf's: its gradient, its lookups' cotangent rows and the table-shaped pieces they are
  # scattered into (gradient_dtype; priced on the leaf as read, read_leaf)
  rdtype, rgrad, read = (gradient_dtype(graph, primary), gradient_bytes(graph, primary, grad),
                         read_leaf(graph, primary))
  table_sync = _table_scatter(lookup, vocab_axes, zero, m, read, pricer.backend, batch_div,
                              [a for a in batch if a not in zero])
  spread, moved, moved_ids = _spread_reduction(graph, read, use, used, m, zero, pricer.backend,
                                               rgrad, batch_div)
  # the permuted pieces' bytes as they move: the table's rows of its dtype, the ids int32
  wmoved = pricer.wire(moved - moved_ids, rdtype) + pricer.wire(moved_ids, "int32")
  scatter = lookup_gradient(graph, read, used, m, pricer.backend)
  if use is None:
    uses = _lookup_parts(graph, read, scatter, pricer.backend)
    parts = max(parts, uses)
  # (an integer table has no gradient to scatter: StepGraph.integer_gradient_free)
  scattered = () if graph.integer_gradient_free(group) else (
      ("all_gather", "all_gather", zero), ("all_to_all", "all_to_all", zero),
      ("ppermute", "ppermute", zero + ["tensor"]), ("all_reduce", "all_reduce", ["tensor"]),
      ("reduced", "all_reduce", zero))
  for field, kind, axes in scattered:
    nb = getattr(scatter, field)
    if nb:
      # the table's rows of its dtype, the token ids int32 (integers move as they are)
      ids = getattr(scatter, f"{field}_ids", 0.0)
      ctx.add(kind, pricer.wire(nb - ids, rdtype) + pricer.wire(ids, "int32"), axes,
              blocking=False, dtype=WIRE)
  # gradient synchronisation
  for kind, nb, axes, *ids in table_sync:
    ctx.add(kind, nb, axes, blocking=False, dtype=ids[0] if ids else rdtype)
  # a PRNG key has no gradient, nor has an integer array (StepGraph.integer_gradient_free: one
  # read dequantized is reduced as its product's float gradient, rgrad; a step counter is priced
  # the share of its few bytes that the recorded plans' costs hold)
  # nor has a parameter the loss never reads: its gradient is a constant zero, never reduced;
  # nor is one the step freezes reduced (its gradient is computed where a product needs its
  # input's, and dropped)
  constant = graph.zero_gradient(group)
  if batch and not primary.is_key and not constant and not graph.frozen(group):
    if zero:
      k = axis_key(zero)
      # XLA:CPU lowers a reduce-scatter as an all-reduce of the whole gradient followed by a
      # slice; the GPU compiler keeps the reduce-scatter: price what the plan's backend runs
      rs = "all_reduce" if pricer.backend == "cpu" else "reduce_scatter"
      # a weight shared across layers: on CPU each use's gradient reduced on its own (not a
      # tied embedding's lookup part, which XLA scatters into the sharded table)
      # XLA:CPU combines these all-reduces with the others after the backward (5 in all for a
      # scanned decoder's FSDP step, as for DP)
      outside = pricer.gradient_share if rs == "all_reduce" else pricer
      on_shard = gradient_on_shard(graph, group, used, m)
      if on_shard is not None:
        # made on the weight's shard (gather.shard_gradients): the cotangent gathered whole over
        # the batch and the residual's rows moved into features, both waited for by the product
        # (over the weight's axes; each keeps its rows over the batch's other axes, ``rest``):
        # one of each per product that makes a part of it (a weight read by two products: XLA
        # moves each part's operands apart, two_views' plain FSDP compile)
        zdiv = math.prod(m.size[a] for a in zero)
        for part in on_shard:
          ctx.add("all_gather", part.gathered * zdiv / batch_div, zero, blocking=True,
                  dtype=part.dtype)
          ctx.add("all_to_all", part.moved / batch_div, zero, blocking=True, dtype=part.dtype)
      elif rs == "reduce_scatter" and _reduced_in_tensor_pairs(graph, primary, use, used, m,
                                                                zero):
        _price_pair_reduction(ctx, zero)
      else:
        if not table_sync:
          acc(pr.overlappable, k, _parts_time(looped, uses - looped, in_loop, outside,
                                              rs, rgrad / spread, zero, rdtype))
          acc(pr.bytes, f"{rs}[{k}]", uses * pricer.wire(rgrad / spread, rdtype))
        if moved:
          ctx.add("ppermute", wmoved, zero + ["tensor"], blocking=False, times=uses, dtype=WIRE)
      rest = [a for a in batch if a not in zero]
      # (a vocab-parallel table's scatter beside other batch axes reduces over them itself:
      # _scatter_beside_batch)
      if rest and not (table_sync and _scatter_beside_batch(lookup, vocab_axes, zero, m, read,
                                                             batch_div)):
        g2 = rgrad / math.prod(m.size[a] for a in zero)
        k2 = axis_key(rest)
        # a gradient made on its shard part by part has each part's shard reduced over the
        # batch's other axes (two_views on `data` 2 x `fsdp` 4: the four parts' 64 KiB shards
        # all-reduced over `data` in one all-reduce, 256 KiB compiled, where one shard per
        # weight was priced)
        g2 *= len(on_shard) if on_shard is not None else 1
        acc(pr.overlappable, k2, pricer.gradient_share("all_reduce", g2, rest, rdtype))
        acc(pr.bytes, f"all_reduce[{k2}]", pricer.wire(g2, rdtype))
    else:
      # XLA combines the gradients' all-reduces into few large ones (one per group of axes:
      # the sequence's is separate, roles.sequence)
      for axes in sequence.reduction_groups(batch):
        k = axis_key(axes)
        acc(pr.overlappable, k, _parts_time(looped, parts - looped, in_loop,
                                            pricer.gradient_share, "all_reduce", rgrad, axes,
                                            rdtype))
        acc(pr.bytes, f"all_reduce[{k}]", parts * pricer.wire(rgrad, rdtype))
  # the meetings this group's weight pays (the reductions over the batch that later work on the
  # batch reads, after its product: batch norm's statistics): XLA all-reduces them over every axis
  # that splits the batch, whatever the weights' layouts (the convnet family's DP and FSDP steps
  # on 8 CPU devices: 24 all-reduces of 10752 bytes in all, the forward's two a norm between its
  # convolution and the next, the backward's two likewise), and nothing moves on with the step
  # until every device has arrived: at each, the wake-up and the spread of the compute since the
  # previous one (a product's, or none between the two of one norm), at most what any collective
  # between products is priced to wait (Pricer.step_latency)
  meet = [a for a in BATCH_AXES if m.size[a] > 1]
  # An index reduction (argmax over the batch) meets as an all-gather of every device's partials
  # (the extreme values and their indices): the buffer gathered is the batch axes' devices times
  # its bytes (compiled on 8 CPU devices, `data` 8: f32[1,128] and s32[1,128] gathered, 4 KiB
  # each)
  # Their values' own dtypes, not the weight's: priced and recorded at the bytes that move
  # (WIRE), XLA:CPU's float32 of their bfloat16 values (Meeting.wide) counted
  gathers = math.prod(m.size[a] for a in meet)
  for mt in graph.meetings:
    kind, moved = ("all_gather", gathers * mt.nbytes) if mt.gathered else ("all_reduce", mt.nbytes)
    wire = pricer.wire(moved, WIRE, moved / mt.nbytes * mt.wide if mt.nbytes else 0.0)
    if (mt.payer in group and meet and mt.joins_on_cpu and pricer.backend == "cpu" and
        XLA_VERSION < (0, 11) and not mt.gathered):
      # its bytes move in the all-reduce before it, which pays the meeting (jaxlib 0.10's
      # XLA:CPU; 0.11's keeps the recomputation apart: Reader.meetings)
      acc(pr.blocking, axis_key(meet),
          mt.count * pricer.share("all_reduce", wire / mt.count, meet, WIRE))
      acc(pr.bytes, f"all_reduce[{axis_key(meet)}]", wire)
    elif mt.payer in group and meet:
      since = mt.since / mt.count / batch_div / m.peak_flops
      own = min(pricer.step_latency, MEETING_WAKE_S + MEETING_SPREAD * since)
      time = pricer(kind, wire / mt.count, meet, WIRE) - pricer.step_latency + own
      acc(pr.blocking, axis_key(meet), mt.count * time)
      acc(pr.bytes, f"{kind}[{axis_key(meet)}]", wire)
  # FSDP: the parameter gathered for the forward; XLA keeps the gathered copy for the backward
  # (one all-gather per step, the copy live in between)
  # a table only read by lookups, sharded over the dimension they index (vocab-parallel): each
  # device looks up the rows it holds (the others masked to zero) and the rows are all-reduced
  # over the axes sharding the table, for every token of the batch those axes do not split;
  # nothing is gathered and the gradient is a local scatter into the shard
  if vocab_axes:
    unsplit = math.prod(m.size[a] for a in batch if a not in vocab_axes)
    ctx.add("all_reduce", lookup[1] / unsplit, vocab_axes, blocking=True, dtype=rdtype)
  # (an integer weight a product reads dequantized has no gradient where its scale is frozen,
  # StepGraph.integer_gradient_free, but XLA still gathers its float value for the product:
  # a frozen int8 [512, 256] on `fsdp` 4 x `tensor` 2, f32[512,128] a device, compiled on 8 CPU
  # devices; an int8 table the step only looks up is gathered as it is, int8, for the lookup)
  read_int = (use is not None and graph.read_dequantized(primary.index) and
              stepgraph.is_float(use.read_dtype or dtype))
  looked_up_int = (use is None and not stepgraph.is_float(dtype) and
                   primary.index in graph.lookups)
  if zero and not vocab_axes and (not constant or read_int or looked_up_int):
    k = axis_key(zero)
    # gathered where its product reads it (StepPlan.jit; a parameter the loss never reads is
    # gathered nowhere: its update reads its own shard); a read inside jax.checkpoint, or a
    # layer of a lax.scan stack (gathered inside the loop body, once per layer, in the forward
    # and again in the backward's loop), is gathered twice per step and the gathered copy is not
    # kept in between: only the slice being used is live. Otherwise XLA keeps the gathered
    # weight for the backward.
    regather = regathered(use)
    times = gathers_a_pass(use)
    # a scanned stack is gathered one layer per loop iteration: one collective per layer
    per = use.layers if use is not None and use.layers > 1 else 1
    # an integer weight read dequantized (``wq.astype(f32) * scale``): XLA converts the shard
    # and gathers the float value its product reads (f32[512,256] for an int8 [512, 256] weight
    # on `fsdp` 8, compiled on 8 CPU devices), where a float weight read narrower is gathered
    # before its cast, in its own dtype
    gdtype, gbytes = ((rdtype, rgrad) if graph.read_dequantized(primary.index) and
                      stepgraph.is_float(rdtype) else (dtype, grad))
    # (a scanned stack's first layer gathered for the forward alone: dead_first_gather)
    own_gathers = times * per - int(regather and dead_first_gather(use))
    acc(pr.overlappable, k, own_gathers * pricer("all_gather", gbytes / per, zero, gdtype))
    # a loop that reads the weight only through lax.stop_gradient gathers it once more, before
    # the loop (a loop invariant XLA hoists out of the body: StepGraph.stopped_loops)
    looped = graph.stopped_loops.get(primary.index, 0) if per == 1 else 0
    if looped:
      acc(pr.overlappable, k, looped * pricer("all_gather", gbytes, zero, gdtype))
    # a scan that slices the stack through lax.stop_gradient gathers each of its layers once
    # more, in its body (StepGraph.stopped_scans)
    sliced = graph.stopped_scans.get(primary.index, 0) if per > 1 else 0
    if sliced:
      acc(pr.overlappable, k, sliced * per * pricer("all_gather", gbytes / per, zero, gdtype))
      looped += sliced
    # (the backward call's second gather under jaxlib 0.11 is counted in the bytes plan.check
    # compares, not in the time or the memory the plans are chosen by: gathered_in_call)
    acc(pr.bytes, f"all_gather[{k}]",
        (own_gathers / per + looped + int(gathered_in_call(use))) * pricer.wire(gbytes, gdtype))
    if use is None and primary.index in graph.lookups and primary.index in graph.stopped:
      # a table looked up and read by a product under lax.stop_gradient (the output projection
      # of a tied embedding the loss does not train through): the lookup's gathered copy dies
      # with it, and for the product XLA gathers the smaller of the table and the product's
      # other operand (the tokens' activations; the logits are then split on the vocabulary).
      # Compiled on 8 CPU devices, `fsdp` 8, 256 tokens of 64 features: a table of 128 or 256
      # rows gathered twice; of 512 rows once, and the activations, f32[2,16,64], gathered
      other = min(grad, graph.stopped[primary.index])
      acc(pr.overlappable, k, pricer("all_gather", other, zero, dtype))
      acc(pr.bytes, f"all_gather[{k}]", pricer.wire(other, dtype))
    if looked_up_int:
      # the int8 table gathered whole for its lookups, the step's largest value (`fsdp` 8: an
      # int8 [4096, 256] table, 1 MiB of XLA:CPU's 1.12 MiB temp); a float table's copy, which
      # dies with the forward's lookup, is left to the backward's peak as before
      pr.gathered_peak = grad
    if regather and not use.branched:
      pr.gathered_peak = grad / max(1, use.layers)
    elif use is not None:         # (a lax.cond's branch: freed after it, solver._combined_reduction)
      wide = _gathered_widening(pricer.backend, dtype)
      if wide > 1 and str(dtype) == "float16":
        # the float16 all-gather's result is live at the step's start until its conversion,
        # beside the float32 copies converted before it (solver._gathered_at_start)
        pr.memory["gathered"] = gbytes * wide
        pr.gathered_wide = gbytes
      elif wide > 1 and XLA_VERSION >= (0, 11):
        # jax 0.11's XLA:CPU computes the product in bfloat16: each float32 gathered copy is
        # converted back into a bfloat16 one, kept for the step, and dies there; the float32
        # copies all live at the step's start (XLA:CPU issues the all-gathers first), beside
        # the first conversion (solver.simulate_memory)
        pr.memory["gathered"] = gbytes
        pr.gathered_wide = gbytes * wide
      else:
        pr.memory["gathered"] = gbytes * wide
        if wide > 1:
          # jax 0.10's XLA:CPU converts a bfloat16 weight's shard to float32 and all-gathers
          # that: the last converted shard is live at the step's start beside the gathered
          # copies (a bfloat16 MLP on `data` 2 x `fsdp` 4: f32[128,128] beside f32[128,512] and
          # f32[512,128] at the second all-gather, the peak of XLA:CPU's temp;
          # solver._gathered_at_start)
          pr.gathered_wide = gbytes * wide / math.prod(m.size[a] for a in zero)
    # (a table only read by lookups is not kept: the lookup's backward scatters into zeros and
    # never reads it, so its gathered copy dies with the forward's lookup)
    if (use is None and primary.index in graph.lookups and stepgraph.is_float(dtype)
        and pricer.backend == "cpu"):
      # but XLA:CPU issues the step's all-gathers first: the float table's gathered copy (in
      # float32 for a bfloat16 table, _gathered_widening) is live at the step's start beside the
      # weights' gathered copies until the first lookup (solver._gathered_at_start). That is
      # the peak where the weights' gradients are made on their shards (review22: a bfloat16
      # [1024, 128] table and MLP on `fsdp` 8, sgd: 1.09 MiB of temp compiled, the table's
      # f32[1024,128] beside the weights' f32[128,512] and f32[512,128]; priced 0.56, -43.3 %)
      pr.gathered_wide = gbytes * _gathered_widening(pricer.backend, dtype)
    if use is None and primary.index in graph.lookups:
      # gathered for the step's first lookup, before any product: its devices last met at the
      # previous step's last collective and have run the optimizer's update since: this
      # table's share of it, and of the rest of the state at least its share sharded over every
      # device; the rest depends on the other groups' layouts, and solver.evaluate adds it
      # from the assignment's update (start_wait)
      group = math.prod(m.size[a] for a in zero)
      own = update_bytes(leaves, pricer.update_split)
      floor = own / shards + (pricer.state_update_bytes - own) / m.ids.size
      wait = pricer.gather_wait(floor * pricer.stream_s_per_byte, group)
      acc(pr.overlappable, k, wait)
      if pricer.gather_spread > 0:
        pr.start_gather = (k, pricer.gather_spread * last_arrival(group),
                           MEETING_WAKE_S - pricer.step_latency, wait)
  elif read_int and not vocab_axes:
    # an integer weight a product reads dequantized and no batch axis shards: XLA converts and
    # scales it into a float copy of its shard (f32[512,256] for an int8 [512, 256] on `data` 8,
    # f32[512,128] split over `tensor` 2: XLA:CPU's temp), kept as a gathered copy is (freed
    # after the forward's product where that is its only reader, solver._combined_reduction).
    # XLA:CPU runs a 16-bit float product in float32 and dequantizes straight into its widened
    # operand (a bfloat16 dequantization on `fsdp` 4 x `tensor` 2: one f32[512,128] convert
    # fusion, no bfloat16 copy); jaxlib 0.11's keeps the bfloat16 copy
    wide = (4 / jaxpr_reader.itemsize(rdtype) if pricer.backend == "cpu" and XLA_VERSION < (0, 11)
            else 1.0)
    pr.memory["gathered"] = rgrad * max(1.0, wide)
  elif (not zero and use is not None and _converted_for_products(pricer.backend, dtype) and
        use.read_dtype in ("", str(dtype)) and use.layers <= 1 and not use.loop_uses):
    # a 16-bit float weight no batch axis shards, read by products in its own dtype: XLA:CPU
    # converts it to float32 for them at the step's start (its schedule issues the conversions
    # first) and each copy dies at its last product, before the gradients are reduced (a
    # float16 MLP on `data` 8: f32[128,512] and f32[512,128], 512 KiB, the peak of XLA:CPU's
    # temp; a bfloat16 one's under jax 0.10, below its reduction's 1 MiB). A value at the
    # step's start only (solver._gathered_at_start), nothing kept
    pr.gathered_wide = grad * 4 / jaxpr_reader.itemsize(dtype)
  elif zero and vocab_axes and pricer.backend == "cpu":
    # a vocab-parallel table sharded over a batch axis on another dimension: the lookup reads
    # whole rows of the tokens that axis splits, so XLA:CPU gathers the table's 'tensor' shard
    # over it first (compiled: llama_scan's `fsdp` 8 x `tensor` 2 plan on 16 CPU devices, 1 MiB
    # of the 2 MiB table, not kept for the backward; not seen compiled for the GPU)
    ctx.add("all_gather", grad, zero, blocking=False)
  # the roles' own collectives (tensor parallelism's activation all-reduces and gathers, ...)
  for role in roles.REGISTRY:
    if role.price is not None and role.name in used:
      role.price(ctx)
  # a vector (a bias) applied to the column-parallel output of this weight's product, which the
  # plan replicates: XLA computes its gradient and runs its update in the product's column layout
  # and all-gathers each new value of its group the step computes from the batch (the vector and
  # its moments; none of a frozen one, whose new value is the old) over 'tensor' into the
  # replicated outputs (compiled on 8 CPU devices, `fsdp` 4 x `tensor` 2: an MLP's first bias and
  # adam's two moments, three f32[256] gathered into f32[512]). XLA:CPU gathers a bfloat16
  # one in f32, before converting it (bf16 parameters on `tensor` 8: three f32[64]): each of
  # its own dtype, not the weight's
  if pr.tp is not None and pr.tp[0] == "col" and m.size["tensor"] > 1:
    # (a norm's scale and bias, tied by the work that reads them, are one group: its outputs once)
    tied = {graph.group_of(b)[0] for b in graph.column_vectors.get((primary.index, pr.tp[1]), ())}
    for k, (shape, dtype, rep) in enumerate(graph.outputs):
      if rep in tied and k in graph.batch_outputs:
        ctx.add("all_gather", math.prod(shape) * jaxpr_reader.itemsize(dtype), ("tensor",),
                blocking=False, dtype=dtype)
    # a result of the step in the pair's cone that is no state's new value (an argmax over the
    # batch per hidden unit): split over 'tensor' where it is made, gathered into the replicated
    # output (compiled on 8 CPU devices, `data` 4 x `tensor` 2: s32[256] into s32[512])
    nb = graph.cone_outputs.get((primary.index, pr.tp[1]), 0)
    if nb:
      ctx.add("all_gather", nb, ("tensor",), blocking=False, dtype=WIRE,
              wide=graph.cone_wide.get((primary.index, pr.tp[1]), 0))
  # a jax.shard_map over the user's own mesh inside the step: XLA reshards the batch's values at
  # its boundary between the plan's layout and the in_specs / out_specs (plan.jit pins the
  # results to the plan's batch layout: gather.py). Where each device's block of rows in one
  # layout holds its block in the other or lies in it (the user's split axes lead their mesh,
  # as the plan's batch axes lead its): a result whose rows the plan splits into fewer blocks is
  # all-gathered, a block of the plan's, over the plan's other axes (compiled on 8 CPU devices
  # against a per-shard centring over a "data" 8 mesh, f32[64,128]: `tensor` 8 f32[8,128] into
  # the whole value; `data` 4 x `tensor` 2, `fsdp` 4 x `tensor` 2 f32[8,128] into f32[16,128]
  # over 'tensor'; `data` 2 x `tensor` 4 into f32[32,128]); where the plan splits them as finely
  # or finer, each device slices its rows and nothing moves (`data` 8, `fsdp` 8, `data` 2 x
  # `fsdp` 4). An operand whose in_specs split fewer blocks than the plan is all-gathered into
  # the user's block over the plan's batch axes (a 2 x 4 mesh's P("data") on `data` 8: f32[8,128]
  # into f32[32,128]). Where the blocks do not nest (the user's P("model") of a 2 x 4 mesh: its
  # blocks on devices {k, k + 4}), XLA first permutes each device's piece, the finer layout's
  # block, into place, at the operand and again at the result (f32[16,128] each way on `data`
  # 4 x `tensor` 2; f32[8,128] on `data` 8), then gathers as above. A result split on another
  # dimension is priced only where the plan splits no batch (the whole value gathered)
  rows_axes = [a for a in BATCH_AXES if a not in SEQUENCE_AXES and m.size[a] > 1]
  rows_div = math.prod(m.size[a] for a in rows_axes)
  others = [a for a in AXES if m.size[a] > 1 and a not in rows_axes]
  everyone = [a for a in AXES if m.size[a] > 1]
  plan_blocks = None
  # a shard_map on a tensor pair's activations: its boundary is the column-parallel leaf's to pay
  # (its layout decides it). Where the plan splits their features over 'tensor' and plan.jit pins
  # them so (stepgraph.FeatureShardMap.pinned), each operand and result the pair holds is one
  # all-to-all over 'tensor' of each device's block (compiled on 8 CPU devices, the centring of
  # f32[64,512] hidden activations over a "data" 8 mesh: `tensor` 8, four of f32[8,512], forward
  # and backward); elsewhere priced as the batch's values below
  features = graph.manual_features
  for f in features:
    if f.cone[0] == primary.index and f.pinned(m.size, pr.tp, rows_axes):
      ctx.add("all_to_all", f.nbytes / f.rows, ["tensor"], blocking=True, dtype=WIRE,
              wide=f.wide / f.rows)

  def boundary_paid(payer, k) -> bool:
    if k is None:
      return payer in group
    f = features[k]
    return f.cone[0] == primary.index and not f.pinned(m.size, pr.tp, rows_axes)

  out_features = graph.manual_output_features or (None,) * len(graph.manual_outputs)
  in_features = graph.manual_operand_features or (None,) * len(graph.manual_operands)
  for (nb, payer, wide, rows, whole, blocks), k in zip(graph.manual_outputs, out_features):
    if not boundary_paid(payer, k) or not everyone:
      continue
    if rows == whole:
      plan_blocks = plan_blocks or jaxpr_reader.manual_blocks(
          {a: m.size[a] for a in AXES}, rows_axes)
      if not jaxpr_reader.blocks_nest(blocks, rows, plan_blocks, rows_div):
        ctx.add("ppermute", nb / max(rows, rows_div), everyone, blocking=True, dtype=WIRE,
                wide=wide / max(rows, rows_div))
      if rows > rows_div and others:
        ctx.add("all_gather", nb / rows_div, others, blocking=True, dtype=WIRE,
                wide=wide / rows_div)
    elif rows_div == 1:
      ctx.add("all_gather", nb, everyone, blocking=True, dtype=WIRE, wide=wide)
  for (nb, payer, wide, rows, blocks), k in zip(graph.manual_operands, in_features):
    if not boundary_paid(payer, k) or not rows_axes:
      continue
    plan_blocks = plan_blocks or jaxpr_reader.manual_blocks(
        {a: m.size[a] for a in AXES}, rows_axes)
    if not jaxpr_reader.blocks_nest(blocks, rows, plan_blocks, rows_div):
      ctx.add("ppermute", nb / max(rows, rows_div), everyone, blocking=True, dtype=WIRE,
              wide=wide / max(rows, rows_div))
    if rows < rows_div:
      ctx.add("all_gather", nb / rows, rows_axes, blocking=True, dtype=WIRE, wide=wide / rows)
  # an index reduction no later work on the batch reads (a metric the step returns) is gathered
  # all the same, waited for by nothing but the step's end; of values a column-parallel product
  # splits over 'tensor' (its pair's cone), each device gathers the partials of its share
  for mt in graph.index_gathers:
    if mt.payer in group and meet:
      split = m.size["tensor"] if mt.cone is not None and pr.tp == ("col", mt.cone[1]) else 1
      ctx.add("all_gather", gathers * mt.nbytes / mt.count / split, meet, blocking=False,
              times=mt.count, dtype=WIRE, wide=gathers * mt.wide / mt.count / split)
  # a grouped convolution's input that the batch axes split is all-gathered whole over them
  # before it (XLA's partitioner runs a grouped convolution on the whole batch), and nothing
  # moves on until every device's rows have come (Reader.grouped_gathers)
  for mt in graph.grouped_gathers:
    if mt.payer in group and meet:
      ctx.add("all_gather", mt.nbytes / mt.count, meet, blocking=True, times=mt.count,
              dtype=WIRE, wide=mt.wide / mt.count)
  if use is not None:
    split = m.size["tensor"] if pr.tp is not None else 1
    flops = use.flops / split
    for (leaf, k), f in graph.carried.items():
      if leaf == primary.index:
        flops += f / (m.size["tensor"] if pr.tp == ("col", k) else 1)
    # each product that reads the weight also does work that grows with the weight a device
    # holds and not with the rows it multiplies (BackendCosts.product_fixed_rows: XLA:CPU packs
    # the weight for its kernel on every call), as if that many more rows were multiplied: the
    # products' FLOPs per row (every call, forward and backward, and every expert of a batched
    # product) times those rows, for the share of the weight a device holds ('tensor' and the
    # routed axes shard it; splitting the batch does not)
    batched = math.prod(primary.shape[k] for k in use.stacked) / max(1, use.layers)
    fixed = (pricer.product_fixed_rows * use.flops / max(1, use.tokens) * batched *
             grad / max(1, primary.nbytes))
    pr.compute = (flops / batch_div + fixed) / m.peak_flops * pr.compute_scale
    # a grouped convolution runs on the whole batch on every device (Reader.grouped_gathers):
    # the share of its flops the batch axes would have split is computed again on each
    for mt in graph.grouped_gathers:
      if mt.payer in group and batch_div > 1:
        pr.compute += mt.flops * (1 - 1 / batch_div) / m.peak_flops * pr.compute_scale
    if zero and not vocab_axes:
      # each of its gathers (one a pass, or one a layer and pass of a scanned stack) waits for
      # the compute since the devices' previous meeting: where every weight is gathered where
      # its products read it, the compute between two gathers is one weight's products (with
      # its share of the products no weight reads), a pass's or one layer's; of a weight read
      # at several depths (shared across layers), gathered once, its first depth's: the next
      # weight's gather follows it, and the later depths' products have no gather between them
      gathers = (gathers_a_pass(use) * max(1, use.layers) -
                 int(regathered(use) and dead_first_gather(use)))
      own = (use.flops / split / batch_div + fixed) / m.peak_flops * pr.compute_scale
      between = own * pricer.weightless / gathers / max(1, use.grad_parts)
      # a gather once a step, before its first product, that a meeting over the batch comes
      # before (batch norm's statistics between the convolutions): its devices last met there,
      # and waited for each other, so the compute it waits for is the products since then. A
      # layer of a scanned stack whose body meets (a conv/norm layer), likewise per trip: on
      # XLA:CPU each trip's gather, forward and backward, follows the previous trip's last
      # collective (the forward's norm, the backward's gradient reduction; read in the
      # compiled loops of plan.jit's FSDP step); the backward's are priced as the forward's
      since = graph.since_meeting.get(primary.index)
      if since is not None and (gathers == 1 or use.layers > 1):
        between = min(between, since / batch_div / m.peak_flops * pr.compute_scale)
      n = math.prod(m.size[a] for a in zero)
      wait = gathers * pricer.gather_wait(between, n)
      # a weight in a tensor pair (column- or row-parallel) gathered once a step: the pair meets
      # its devices over 'tensor' in the forward (the row-parallel output's all-reduce) and in the
      # backward (the column-parallel input gradient's), and its gather lies in the forward. The
      # spread of the backward's products, which a plain FSDP step's gathers wait for (the
      # twelfth round's split: 0.97 of the step's products), is paid at the backward's meetings
      # (their Pricer.step_latency), so the gather waits for the forward's share of its products
      # alone: one of the two (a first layer's weight, no input gradient) or three products
      # that read it. A meeting of the pair alone does not narrow its FSDP group's spread since
      # that group's last gather (the last of 8 arrivals past the last of 2, 0.86 standard
      # deviations, against 1.03 for 4): only the backward's products are taken out. Where the
      # assignment leaves the pair incomplete there is no meeting: ``unmet_wait`` is the rest
      if pr.tp is not None and gathers == 1 and m.size["tensor"] > 1:
        met = pricer.gather_wait(between / (3 if use.input_grad else 2), n)
        if wait > met:
          pr.unmet_wait[axis_key(zero)] = wait - met
        wait = met
      acc(pr.overlappable, axis_key(zero), wait)
  # the optimizer's update reads the parameter, its gradient and its moments and writes the
  # parameter and moments: each device updates its shard only (the work FSDP saves beside memory)
  pr.update = update_bytes(leaves, pricer.update_split) / shards * pricer.stream_s_per_byte
  pr.compute += pr.update
  # memory per device
  # an argument the step never reads is no argument of the program jax.jit compiles
  pr.memory["params"] = 0.0 if primary.index in graph.unread else primary.nbytes / shards
  # A gradient is a temporary: whole before its reduction where the weight is gathered for
  # compute, sharded as the parameter otherwise. A scanned stack's gradient is accumulated layer
  # by layer into one stacked buffer, which without donation is the new state's output buffer
  # (the optimizer's update is elementwise and in place): no memory of its own (measured on
  # XLA:CPU); with donation the outputs alias the inputs and it is a temporary again.
  gathered_weight = zero and not vocab_axes and (use is not None or (
      primary.index in graph.gathered and scatter.whole))
  scanned = use is not None and use.layers > 1
  if scanned:
    pr.memory["grads"] = primary.nbytes / shards if donate else 0.0
  else:
    pr.memory["grads"] = grad if gathered_weight else primary.nbytes / shards
    if (pricer.backend == "cpu" and batch and use is not None and use.layers <= 1 and
        not use.loop_uses and not graph.read_dequantized(primary.index) and
        stepgraph.is_float(dtype) and calls.wire_bytes(dtype, pricer.backend) > 1):
      # a bfloat16 gradient the batch axes reduce whole: XLA:CPU makes it by a float32 product
      # and all-reduces it in float32 into a new buffer, two float32 buffers of it, as
      # solver.simulate_memory places them (its ``wide``); one made on the weight's shard
      # (gather.shard_gradients) is the shard's. The program's memory row is this sum: sized
      # at bfloat16, a bfloat16 MLP replicated on `data` 2 x `fsdp` 4 (the reductions' four
      # f32 buffers of 256 KiB) looked leaner than its FSDP layout (two float32 gathered
      # copies), which simulate_memory prices 1.76 against 1.14 MiB, and the lean search never
      # found it (docs/benchmarks.md bf16_27)
      if zero and gradient_on_shard(graph, group, used, m) is not None:
        pr.memory["grads"] = primary.nbytes / shards
      else:
        pr.memory["grads"] *= 2 * calls.wire_bytes(dtype, pricer.backend)
  pr.memory["opt_state"] = sum(lf.nbytes for lf in leaves[1:]
                               if lf.index not in graph.unread) / shards
  # the new state's copy, of the leaves the step returns (not of an argument it only reads)
  pr.memory["outputs"] = (0.0 if donate else
                          sum(lf.nbytes for lf in leaves if lf.index in graph.returned) / shards)
  pr.sliced = roles.tensor.sliced(ctx, zero, wmoved, uses)
  return pr


def start_wait(start: tuple[str, float, float, float], update: float) -> float:
  """What a gather at the step's start (``Price.start_gather``) waits beyond the price its
  layout holds, where the devices ran ``update`` seconds of the optimizer's update since their
  previous meeting (the assignment's, which one layout's price cannot know: it holds the least,
  every group's update sharded as the table)."""
  _, share, offset, priced = start
  return max(0.0, max(0.0, offset + share * update) - priced)


def update_bytes(leaves: Sequence[stepgraph.Leaf], split: float) -> float:
  """Bytes an elementwise optimizer update of a tied group (the parameter first, then its
  moments) moves per step: one fused loop reads the parameter, its gradient and the moments and
  writes the parameter and moments (AdamW: 7 bytes per parameter byte); split into a loop per
  moment and one for the parameter (``BackendCosts.update_split``, XLA:CPU), each moment's loop
  reads the gradient and the moment and writes the moment, the parameter's reads the parameter
  and every moment and writes the parameter (AdamW: 10)."""
  param = leaves[0].nbytes
  moments = sum(lf.nbytes for lf in leaves[1:])
  if not split or not moments:
    return 2 * (param + moments) + param
  return len(leaves[1:]) * param + 3 * moments + 2 * param


@dataclasses.dataclass(frozen=True)
class StepCost:
  """Predicted per step and per device."""
  compute_s: float
  comm_s: dict[str, float]          # per mesh axis (or axes), blocking + overlappable
  exposed_s: float                  # the communication not hidden behind compute
  memory: dict[str, float]          # params, grads, opt_state, activations, batch, total
  collective_bytes: dict[str, float]   # "kind[axes]" -> bytes per participant (explain's count)
  fits: bool

  @property
  def total_s(self) -> float:
    return self.compute_s + self.exposed_s

  @property
  def comm_total_s(self) -> float:
    return sum(self.comm_s.values())
