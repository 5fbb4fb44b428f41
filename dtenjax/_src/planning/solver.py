"""The whole-step planner's solver: one mixed-integer program per mesh (scipy's ``milp``, HiGHS)
over the candidate layouts of every tied group, the column -> row pair savings, the exposed
communication and the memory budget; and the evaluation of one assignment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import sys
import typing
from collections.abc import Mapping
from collections.abc import Sequence

import numpy as np

from dtenjax._src.pricing import calls
from dtenjax._src.planning import heapslot
from dtenjax._src.planning import jaxpr_reader
from dtenjax._src.planning import roles
from dtenjax._src.planning import stepgraph
from dtenjax._src.planning.candidates import CandidateMesh
from dtenjax._src.planning.candidates import Layout
from dtenjax._src.planning.candidates import batch_div
from dtenjax._src.planning.candidates import layouts
from dtenjax._src.planning.candidates import splits_batch
from dtenjax._src.planning.pricing import Price
from dtenjax._src.planning.pricing import Pricer
from dtenjax._src.planning.pricing import StepCost
from dtenjax._src.planning.pricing import gradient_on_shard
from dtenjax._src.planning.pricing import gradient_bytes
from dtenjax._src.planning.pricing import gradient_dtype
from dtenjax._src.planning.pricing import lookup_gradient
from dtenjax._src.planning.pricing import price_layout
from dtenjax._src.planning.pricing import read_leaf
from dtenjax._src.planning.pricing import reduced_in_loop
from dtenjax._src.planning.pricing import scatter_zeros_from_the_start
from dtenjax._src.planning.pricing import XLA_VERSION
from dtenjax._src.planning.pricing import stacked_parts
from dtenjax._src.planning.pricing import start_wait
from dtenjax._src.planning.roles import BATCH_AXES
from dtenjax._src.planning.roles import ROUTED_AXES
from dtenjax._src.planning.roles import sequence
from dtenjax._src.planning.roles import stage


@dataclasses.dataclass
class Problem:
  m: CandidateMesh
  groups: list[tuple[int, ...]]
  cands: list[list[Layout]]
  prices: list[list[Price]]
  compute_s: float
  fixed_memory: dict[str, float]
  overlap: float
  grad_latency_s: float = 0.0
  # per mesh axis: blocking seconds no layout choice changes (a pipeline's sends, roles.stage)
  fixed_blocking: dict[str, float] = dataclasses.field(default_factory=dict)
  donate: bool = False
  # collective bytes per step no layout choice changes ("kind[axes]" -> bytes per participant:
  # the keys' and values' gathers of roles.sequence)
  fixed_bytes: dict[str, float] = dataclasses.field(default_factory=dict)
  # solve_bounded's programs, built at the first solve (by ``proposed``; None: none)
  programs: dict[bool, "_Program | None"] = dataclasses.field(default_factory=dict, repr=False,
                                                               compare=False)


def make_problem(graph, m: CandidateMesh, price, pins, overlap, donate) -> Problem | None:
  bdiv = batch_div(m)
  rdiv = sequence.row_div(m)         # bdiv but the axes that split the sequence
  batch_leaves = [lf for lf in graph.leaves if lf.is_batch]
  if rdiv > 1 and not any(splits_batch(lf, rdiv) for lf in batch_leaves):
    return None
  # the compute per device between two collectives is about one product's (the step's
  # products split over every device): what a collective's meeting can cost at most
  between = graph.flops / max(1, graph.products) / m.ids.size / m.peak_flops
  # the step's products over those that read a weight (FSDP's gathers wait for both)
  read = sum(u.flops for u in graph.weights.values())
  # the bytes of the gradients' combined all-reduce where every gradient is reduced whole (not
  # those reduced inside a loop's body, once per iteration)
  combined = sum(gradient_bytes(graph, graph.leaves[g[0]], graph.leaves[g[0]].nbytes)
                 for g in graph.groups
                 if not graph.leaves[g[0]].is_batch and stepgraph.is_float(graph.leaves[g[0]].dtype)
                 and not graph.zero_gradient(g) and not graph.frozen(g)
                 and not reduced_in_loop(graph.weights.get(g[0]), _backend(m)))
  pricer = Pricer(m, price, between, max(1.0, graph.flops / read) if read > 0 else 1.0,
                  [[graph.leaves[i] for i in g] for g in graph.groups], combined)
  groups = [g for g in graph.groups]
  cands, prices = [], []
  for g in groups:
    cs = layouts(graph, g, m, pins.get(g[0]))
    cands.append(cs)
    prices.append([price_layout(graph, g, c, m, pricer, bdiv, donate) for c in cs])
  # products without a weight (attention scores, ...) split over the batch axes only
  rest = graph.flops - sum(u.flops for u in graph.weights.values()) - sum(graph.carried.values())
  # and the work beside the products (norms, residuals, activations, softmax, the loss) that a
  # 'tensor' axis repeats: it splits the products of the weights it shards, not this work, which
  # every device of a 'tensor' group runs on the tokens of the group (each equation's bytes
  # streamed: the step's activations outlive the caches), but inside a complete column -> row
  # pair's cone (Price.token_saving). The share a device runs on its own tokens the products'
  # priors already hold (their FLOP/s priced the measured steps' products with it, the same
  # within 1 % on two families whose shares of it differ: docs/benchmarks.md, sixteenth round)
  repeated = graph.token_bytes / bdiv * (1 - 1 / m.size["tensor"])
  compute = max(0.0, rest) / bdiv / m.peak_flops + repeated * pricer.beside_s_per_byte
  if pricer.pure_products:
    # at a calibration's FLOP/s (Pricer.pure_products) the share of that work a device runs on
    # its own tokens is priced too, and the products twice counted are taken out: a column
    # weight's pair carries the products its cut splits (graph.carried), which on an unrolled
    # stack include the row weight's own (llama_loop: the weights' and the carried products are
    # 78.4 GFLOP where the step runs 61.2, read from its jaxpr and XLA's compile alike), split
    # with the pair over the batch and 'tensor'
    t = m.size["tensor"]
    compute += (min(0.0, rest) / bdiv / t / m.peak_flops +
                graph.token_bytes / bdiv / t * pricer.beside_s_per_byte)
  # a batch field the step never reads is no argument of the program jax.jit compiles
  fixed = {"activations": graph.activation_bytes / bdiv,
           "batch": sum(lf.nbytes / (rdiv if splits_batch(lf, rdiv) else 1) /
                        sequence.leaf_div(lf, m, graph) for lf in batch_leaves
                        if lf.index not in graph.unread)}

  # one latency for the combined gradient all-reduce(s) (see price_layout)
  batch = [a for a in BATCH_AXES if m.size[a] > 1]
  latency = 0.0
  if batch:
    latency = pricer("all_reduce", 1, batch, "float32")
    if "fsdp" in batch and "data" in batch:
      latency = max(latency, pricer("all_reduce", 1, ["data"], "float32"))
  prob = Problem(m, groups, cands, prices, compute, fixed, overlap, latency,
                 donate=bool(donate))
  sequence.adjust(prob, graph, pricer)
  return _with_stages(prob, graph)


def _with_stages(prob: Problem, graph) -> Problem | None:
  """A pipeline's terms (roles.stage.adjust) on a mesh with stages; None when some group has no
  layout left."""
  if prob.m.pipeline is None:
    return prob
  stage.adjust(prob, graph)
  return prob if all(prob.cands) else None


def evaluate(prob: Problem, choice: Sequence[int], graph: stepgraph.StepGraph,
              budget: float) -> StepCost:
  """The cost of one assignment (the program's objective, with the pair terms at their best)."""
  comm: dict[str, float] = {}
  blocking = overlappable = 0.0
  memory = {"params": 0.0, "grads": 0.0, "opt_state": 0.0, "gathered": 0.0, "outputs": 0.0,
            **prob.fixed_memory}
  nbytes: dict[str, float] = {}
  tp_of = {g[0]: prob.prices[gi][c].tp for gi, (g, c) in enumerate(zip(prob.groups, choice))}
  sources, dests = pair_maps(graph)
  sliced = sliced_leaves(prob, choice, sources, dests, tp_of)
  compute = prob.compute_s
  update, starts = 0.0, []
  kept: list[tuple[tuple[int, ...], float]] = []    # each group's gathered copy kept for the step
  # (first read, bytes live until the conversion, kept copy): Price.gathered_wide
  wide: list[tuple[int, float, float]] = []
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    pr = prob.prices[gi][c]
    if g[0] in sliced:
      pr = pr.sliced[sliced[g[0]]]
    if pr.memory.get("gathered"):
      kept.append((g, pr.memory["gathered"]))
    if pr.gathered_wide:
      first = min((r for k in g for r, _ in graph.weight_reads.get(k, ())), default=0)
      wide.append((first, pr.gathered_wide, pr.memory.get("gathered", 0.0)))
    compute += pr.compute
    update += pr.update
    if pr.start_gather is not None:
      starts.append(pr.start_gather)
    for k, v in pr.blocking.items():
      comm[k] = comm.get(k, 0.0) + v
      blocking += v
    for k, v in pr.overlappable.items():
      comm[k] = comm.get(k, 0.0) + v
      overlappable += v
    for k, v in pr.memory.items():
      memory[k] += v
    for k, v in pr.bytes.items():
      nbytes[k] = nbytes.get(k, 0.0) + v
  cpu = _backend(prob.m) == "cpu"
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    pr = prob.prices[gi][c]
    if pr.tp is None:
      continue
    kind, d = pr.tp
    ok = (complete_column(graph, sources, tp_of, g[0], d, cpu) if kind == "col" else
          complete_row(dests, tp_of, sliced, g[0], d))
    # an incomplete pair meets nowhere over 'tensor': its gather waits as plain FSDP's
    for k, v in pr.unmet_wait.items() if not ok else ():
      comm[k] = comm.get(k, 0.0) + v
      overlappable += v
    if kind == "col":
      if ok:
        memory["activations"] -= pr.act_saving
        compute -= pr.token_saving
      if not ok and pr.ag_fwd_bytes:
        comm["tensor"] = comm.get("tensor", 0.0) + pr.ag_fwd
        blocking += pr.ag_fwd
        nbytes["all_gather[tensor]"] = nbytes.get("all_gather[tensor]", 0.0) + pr.ag_fwd_bytes
    else:
      if not ok and pr.ag_bwd_bytes:
        comm["tensor"] = comm.get("tensor", 0.0) + pr.ag_bwd
        blocking += pr.ag_bwd
        nbytes["all_gather[tensor]"] = nbytes.get("all_gather[tensor]", 0.0) + pr.ag_bwd_bytes
  # a gather at the step's start waits for the update of this assignment (pricing.start_wait)
  for start in starts:
    extra = start_wait(start, update)
    comm[start[0]] = comm.get(start[0], 0.0) + extra
    overlappable += extra
  overlappable += prob.grad_latency_s
  for k, v in prob.fixed_bytes.items():
    nbytes[k] = nbytes.get(k, 0.0) + v
  for k, v in prob.fixed_blocking.items():
    comm[k] = comm.get(k, 0.0) + v
    blocking += v
  exposed = blocking + max(0.0, overlappable - prob.overlap * compute)
  peaks = [prob.prices[gi][c].gathered_peak for gi, c in enumerate(choice)]
  memory["gathered"] += max(peaks, default=0.0)
  top = max(range(len(peaks)), key=peaks.__getitem__, default=None)
  if top is not None and peaks[top] and _only_looked_up(graph, prob.groups[top]):
    # an integer table gathered whole for its lookups (pricing: its gathered peak) is read by
    # nothing after them: XLA:CPU frees the gathered copy there, and the forward's product
    # takes its place (an int8 [4096, 256] table on `fsdp` 8: s8[4096,256] at offset 0 of the
    # temp, then the product's f32[128,256], XLA:CPU's buffer assignment)
    kept.append((prob.groups[top], peaks[top]))
  start = _gathered_at_start(wide)
  if graph.timeline:
    memory.update(simulate_memory(prob, choice, graph, tp_of, memory["gathered"], kept, start))
  else:
    memory["gathered"] += start
  memory["total"] = sum(memory.values())
  fits = not budget or memory["total"] <= budget
  return StepCost(compute, comm, exposed, memory, nbytes, fits)


def _gathered_at_start(wide: Sequence[tuple[int, float, float]]) -> float:
  """Bytes beyond the kept gathered copies live at the step's start where XLA:CPU gathers
  weights through a conversion (``wide``: each one's (first read, the value live until its
  conversion, the kept copy), ``Price.gathered_wide``), one weight after the other in the
  order the step reads them: at the i-th conversion the kept copies of the weights before it
  and its own, and the values of it and of the weights after it not yet converted, are live.
  jax 0.11's XLA:CPU gathers a bfloat16 weight in float32 and converts each gathered copy to
  bfloat16 after, the float32 one dying at its conversion: at the first conversion every
  float32 copy and that bfloat16 copy are live (a bfloat16 MLP on `fsdp` 8 at batch 64:
  f32[128,512], f32[512,128] and bf16[128,512], XLA:CPU's buffer assignment, the peak of its
  temp), the later kept copies not yet made. A float16 weight is gathered in float16 and its
  kept copy is float32: at the last conversion every float32 copy and that float16 copy (a
  float16 MLP on `fsdp` 8: f32[128,512], f32[512,128] and f16[512,128], under jax 0.10 and
  0.11). jax 0.10's bfloat16 weight's shard is converted to float32 before its all-gather: at
  the last all-gather the float32 copies and that shard (a bfloat16 MLP on `data` 2 x `fsdp`
  4: f32[128,512], f32[512,128] and f32[128,128]). A value at the step's start alone, no copy
  kept (a float table only looked up, gathered there and dying at its lookup; a 16-bit weight
  no batch axis shards, converted to float32 for its products), is live beside all of them (a
  bfloat16 [1024, 128] table beside a bfloat16 MLP's two gathered weights on `fsdp` 8, jax
  0.10: f32[1024,128], f32[128,512] and f32[512,128] in XLA:CPU's temp, the peak where the
  weights' gradients are made on their shards)."""
  beside = sum(w for _, w, k in wide if not k)
  seq = sorted((first, w, k) for first, w, k in wide if k)
  if not seq:
    return beside
  kept = sum(k for _, _, k in seq)
  ks = [k for _, _, k in seq]
  ws = [w for _, w, _ in seq]
  peak = max(sum(ks[:i + 1]) + sum(ws[i:]) for i in range(len(seq)))
  return beside + max(0.0, peak - kept)


def simulate_memory(prob: Problem, choice: Sequence[int], graph: stepgraph.StepGraph,
                    tp_of: dict[int, tuple[str, int] | None], gathered: float = 0.0,
                    kept: Sequence[tuple[Sequence[int], float]] = (),
                    start: float = 0.0) -> dict[str, float]:
  """The activations and gradients per device that XLA keeps in its temporary buffer, by
  placing the step's values (``graph.timeline``, sized for this layout) as XLA's buffer
  assignment places them: largest first, each into the first output buffer, largest first, that
  is at least its size and holds no value live at the same time (an output is written by the
  optimizer's update at the end of the step; before that its buffer is free, and a gradient the
  size of an output buffer becomes that output in place); what finds no output buffer goes to
  the temporary buffer, whose size is the peak of its live values. With donation the outputs are
  the donated inputs' buffers, live all along: everything goes to the temporary buffer.

  Sizes per device: an activation is split over the batch axes (and over ``tensor`` where it
  lies between a column- and a row-parallel weight of a pair the layout completes); a gradient
  is whole (over ``tensor``'s shard) until it is reduced, except a ``lax.scan`` stack's under
  FSDP, which is reduce-scattered layer by layer inside the loop. ``start``: bytes live only at
  the step's start, beside the gathered copies (:func:`_gathered_at_start`)."""
  m = prob.m
  bdiv = batch_div(m)      # every axis that splits the batch (data, fsdp, sequence, expert)
  tensor = m.size["tensor"]
  sources, _ = pair_maps(graph)
  backend = _backend(m)
  cpu = backend == "cpu"
  complete = set()
  # a gradient value's per-device bytes by its shape: a leaf's own shape first, else a leaf's
  # reversed (a product's transposed result); an embedding table (vocab, d) and an unembedding
  # (d, vocab) are sized apart where their layouts differ (lookup_gradient)
  grad_sizes: dict[tuple[int, ...], list[float]] = {}
  turned: dict[tuple[int, ...], list[float]] = {}
  # the leaves' shards by shape (and reversed): the optimizer's update values (Live.update)
  shard_sizes: dict[tuple[int, ...], list[float]] = {}
  outputs: list[tuple[float, int]] = []   # (bytes per device, group) of each output buffer
  # whole gradients a batch axis reduces and a layout then shards, each with its products
  reduced: list[tuple[float, int]] = []
  # replicated gradients of one product a batch axis reduces: (bytes per device, group, whether
  # a loop reads the weight)
  single: list[tuple[float, int, bool]] = []
  # whole gradients of one product a batch axis reduces and a layout then shards (FSDP's)
  whole: list[tuple[float, int]] = []
  # whole gradients a batch axis reduces inside a lax.cond's branch: (bytes, the cond's step)
  in_branch: list[tuple[float, int]] = []
  # (bytes a device holds for the gradients a lax.cond's branch makes on their shard, its step)
  branch_moved: list[tuple[float, int]] = []
  gathered_per_use: set[int] = set()   # leaves sharded over a batch axis
  per_leaf_gathered: dict[int, float] = {}   # their gathered bytes per device (Price)
  sharded_shapes: set[tuple[int, ...]] = set()   # their shapes (and reversed)
  whole_tables: set[tuple[int, ...]] = set()   # XLA:GPU scatters their gradients into zeros
  # XLA:CPU makes the zeros their lookups' gradients are scattered into at the step's start
  zeros_first: set[tuple[int, ...]] = set()
  converted = 0.0     # the float conversions of integer weights a trained scale's gradient reads
  held_to_reduction: set[tuple[int, ...]] = set()   # their gradients' shapes (and reversed)
  # a scanned stack's shape -> what XLA:CPU holds while the backward loop over it runs that the
  # loop's values do not count (_scanned_stack_bytes)
  loop_held: dict[tuple[int, ...], list[tuple[float, list[float]]]] = {}
  sliced = {k: d for leaves, _ in graph.stacks.values() for k, d in leaves.items()}
  # the batch axes that split the batch: a replicated gradient's all-reduce spans them all
  spanned = frozenset(a for a in BATCH_AXES if m.size[a] > 1)
  # reduced's entries first reduced over some of them only -> those axes (_combined_reduction)
  regrouped: dict[int, frozenset[str]] = {}
  whole_axes: dict[int, frozenset[str]] = {}   # the same for whole's groups
  stacked: list[_Stack] = []
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    used = prob.cands[gi][c].used()
    shards = math.prod(m.size[a] for a in used)
    tp = tp_of.get(g[0])
    if tp is not None and tp[0] == "col" and (
        complete_column(graph, sources, tp_of, g[0], tp[1], cpu) or
        cpu and (g[0], tp[1]) in graph.loop_split):
      # (a loop's residuals of a column-parallel product of its carry: split as the carry,
      # which XLA:CPU gathers for each product; pairs.loop_split_outputs)
      complete.add((g[0], tp[1]))
    primary = graph.leaves[g[0]]
    use = graph.weights.get(g[0])
    zero = any(a in used and m.size[a] > 1 for a in BATCH_AXES)
    if zero:
      gathered_per_use.update(g)
      sharded_shapes.update((primary.shape, tuple(reversed(primary.shape))))
      # (a weight gathered once and kept for the backward has no peak of its own: its kept
      # copy, Price.memory's, is what a loop's hoisted gather of it copies)
      pr = prob.prices[gi][c]
      per_leaf_gathered[g[0]] = pr.gathered_peak or pr.memory.get("gathered", 0.0)
    t_shard = tensor if "tensor" in used else 1
    # a routed axis's shards (expert) hold complete gradients where they lie
    t_shard *= math.prod(m.size[a] for a in ROUTED_AXES if a in used)
    # a table only looked up whose gradient XLA scatters into its shard (lookup_gradient)
    scatter = (lookup_gradient(graph, read_leaf(graph, primary), used, m, backend)
               if use is None else None)
    in_shard = scatter is not None and not scatter.whole
    if not cpu and scatter is not None and scatter.whole_lookups:
      whole_tables.add(primary.shape)
    if use is None and scatter_zeros_from_the_start(graph, primary, used, m, backend, bdiv):
      zeros_first.add(primary.shape)
    parts_on_shard = gradient_on_shard(graph, g, used, m) if zero else None
    on_shard = parts_on_shard is not None
    # the step of the lax.cond whose branch makes the gradient, if one does
    made = _branch_step(graph, primary.shape) if use is not None and use.branched else None
    if on_shard:
      if made is not None and cpu:
        # the cotangent gathered whole and the residual's rows moved into features, per part
        branch_moved.append((sum(p.gathered + p.moved / bdiv for p in parts_on_shard), made))
    per_device = (primary.nbytes / shards if zero and (in_shard or on_shard or use is not None
                                                       and use.layers > 1)
                  else primary.nbytes / t_shard)
    dequantized = graph.read_dequantized(primary.index) and use is not None
    # a dequantized weight's gradient in bfloat16 or float16 (a trained scale's): XLA:CPU makes
    # it by a float32 product and all-reduces it in float32, and converts the integer weight
    # again for the scale's gradient after that reduction rather than keep the forward's
    # conversion (an int8 [512, 256] with a bfloat16 scale on `data` 8: the f32[256,512]
    # gradient and its reduction beside w2's, XLA:CPU's buffer assignment; the f32[512,256]
    # conversion made after, where the gradient was)
    narrow = (cpu and dequantized and bdiv > 1 and
              gradient_dtype(graph, primary) in ("bfloat16", "float16"))
    if dequantized:
      # an integer weight read dequantized: its gradient is the product's, of the float it reads
      per_device = gradient_bytes(graph, primary, per_device)
      if narrow:
        per_device *= 4 / jaxpr_reader.itemsize(gradient_dtype(graph, primary))
    # a 16-bit float weight whose gradient a batch axis reduces: XLA:CPU makes the gradient by a
    # float32 product and all-reduces it whole in float32 (calls.wire_bytes' widening) before
    # the slice and the cast back, so the reduction is a new buffer, never the bfloat16 output
    # written in place (bfloat16 params' MLP on `fsdp` 8 at batch 64: w1's and w2's gradients
    # and their reductions four f32 buffers of 256 KiB in the temporary buffer, XLA:CPU's
    # buffer assignment; sized at bfloat16 the price was -41.6 %, on `data` 8 -39.6 %, review20a).
    # Not a weight read in a loop (a scanned stack's layer, a fori_loop's weight): its parts are
    # added into the loop's carried gradient of its own dtype (a bfloat16 [4, 256, 256] stack
    # scanned on `data` 8 was priced +21.5 % so, -26.1 % without)
    # A float16 gradient is not: XLA:CPU converts the float32 product's result to float16 and
    # all-reduces it in float16 (its collectives stay float16, calls.wire_bytes), a gradient
    # of its own bytes reduced as a float32 one is (a float16 MLP on `fsdp` 8: f16[128,512]
    # and f16[512,128] and their reductions, 512 KiB of XLA:CPU's temp after the backward;
    # sized as float32 the price was +45.3 %, docs/benchmarks.md bf16_27). Nor is one made on
    # the weight's shard (gather.shard_gradients): no batch axis of the weight's reduces it,
    # the float32 products' parts are summed into the bfloat16 shard (two_views, a bfloat16 MLP
    # applied twice on `fsdp` 8: f32[512,16] parts, no all-reduce; priced as a whole gradient
    # reduced into a new buffer, 128 KiB beside the gathered copies, +12.6 %)
    looped = use is not None and (use.layers > 1 or bool(use.loop_uses))
    wide = (cpu and bdiv > 1 and not dequantized and use is not None and use.layers <= 1
            and not use.loop_uses and primary.dtype in ("bfloat16", "float16")
            and calls.wire_bytes(primary.dtype, backend) > 1
            and not (on_shard and spanned <= set(used)))
    if wide:
      per_device *= 4 / primary.itemsize
    # (not a stack under jax.checkpoint in the loop's body, whose backward body recomputes the
    # forward's: a scan of 8 checkpointed residual MLP layers on `fsdp` 8,
    # tests/test_step_planner_memory.py, went from within 10 % of the user's per-layer FSDP
    # program to +11.3 % with it; not read. A checkpoint around the loop, WeightUse.
    # recomputed_loop, leaves the backward's loop as it is without one: the backward's call runs
    # the forward's loop again first, its own loop)
    if (cpu and use is not None and use.layers > 1 and (not use.remat or use.recomputed_loop)
        and g[0] in sliced):
      # (a stack split over 'tensor' too holds its layer's part, none of the whole layer:
      # _scanned_stack_bytes' ``split``)
      stacked.append(_Stack(g[0], primary, use, shards, zero and t_shard == 1,
                            t_shard if zero and t_shard > 1 else 1))
    # a parameter the loss never reads has no gradient value: its constant zero is fused into
    # the update, neither sized beside the gradients of its shape nor reduced (unused_parameter
    # in tests/test_plan_user_steps.py: a head of w1's shape, replicated over 'tensor' where w1
    # is split, put w1's gradients at the mean of the two sizes and its whole zero into the
    # combined reduction, +24 % over XLA). So has one the loss reads only under stop_gradient
    # (gathered for the forward all the same: +15.7 % over XLA on fsdp 8 before)
    if not graph.no_gradient(g):
      grad_sizes.setdefault(primary.shape, []).append(per_device)
      turned.setdefault(tuple(reversed(primary.shape)), []).append(per_device)
      for shape in (primary.shape, tuple(reversed(primary.shape))):
        shard_sizes.setdefault(shape, []).append(primary.nbytes / shards)
      # a gradient of several products (a weight read twice) is reduced part by part; the
      # count is per shape, so a leaf of that shape read once (v beside w in ``tanh(h @ w)``
      # three times, then ``h @ v``) takes its own reads' count
      parts = max(graph.gradient_parts.get(s, 1) for s in (primary.shape,
                                                           tuple(reversed(primary.shape))))
      if use is not None:
        parts = min(parts, max(1, use.grad_parts))
      if zero and per_device > primary.nbytes / shards:
        axes = None if spanned <= set(used) else spanned & frozenset(used)
        if made is not None and cpu:
          in_branch.append((per_device * parts, made))
        elif parts == 1 and not wide and not looped:
          whole.append((per_device, gi))     # an output buffer may take its reduction
          if axes is not None:
            whole_axes[gi] = axes
        else:
          if axes is not None:
            regrouped[len(reduced)] = axes
          reduced.append((per_device, parts))
      elif dequantized and bdiv > 1:
        # the dequantized weight's gradient, which only its trained scale's gradient reads
        # (``sum(g * wq)``): no output takes its reduction, a new buffer beside the unreduced
        # one, and the float conversion that product reads again is kept from the forward
        # (XLA:CPU's buffer assignment of an int8 [512, 256] with a trained per-channel scale on
        # `data` 8: the conversion, the gradient and its reduction, f32[512,256] each)
        reduced.append((per_device, parts))
        converted += 0.0 if narrow else per_device
        held_to_reduction.update((primary.shape, tuple(reversed(primary.shape))))
      elif bdiv > 1 and parts == 1 and not on_shard:
        if wide:
          reduced.append((per_device, parts))
        elif not graph.frozen(g):
          # (a frozen argument the step only reads has no gradient to reduce: LoRA's backbone,
          # test_a_frozen_argument_is_no_output_of_the_step, priced +78 % with its two weights
          # reduced apart once no output buffer of theirs took them)
          single.append((per_device, gi, looped))
      elif parts > 1 and bdiv > 1 and not on_shard:
        # a replicated weight's (DP's): each part all-reduced into a new buffer too, live into
        # the update's fusions that sum them, which write the step's outputs while the parts
        # are read, so no output buffer takes them (XLA:CPU's buffer assignment of two_views
        # on `data` 8: the four reduced parts of two weights in the temporary buffer, the four
        # unreduced in outputs')
        reduced.append((per_device, parts))
    if not prob.donate:
      # only the leaves the step returns have an output buffer (StepGraph.returned): an int8
      # embedding table passed in and only looked up has none, and the lookup's dequantized
      # rows, f32[16,16,256] a device on `fsdp` 4 x `tensor` 2, are XLA:CPU's temp (its buffer
      # assignment), where an output buffer of the table's 0.5 MiB shard had taken them
      outputs.extend((graph.leaves[i].nbytes / shards, gi) for i in g if i in graph.returned)
  joined = any(n > 1 for _, n in reduced) or bool(held_to_reduction)
  if cpu and not graph.update_reduces and joined:
    # XLA:CPU's combined all-reduce that holds the parts makes a new buffer of every gradient
    # it joins: a replicated gradient of one product is not reduced into its output in place
    # beside them (tanh(h @ w) three times, then h @ v, on `data` 8: w's three parts and v's
    # gradient reduced into four temporary buffers, the buffer assignment of
    # test_plan_user_steps.py's thrice_read_chain)
    # (so where it holds a dequantized weight's gradient, which no output takes: w2's reduced
    # f32[256,128] in XLA:CPU's temp beside an int8 weight's with a trained scale, `data` 8)
    reduced.extend((nb, 1) for nb, _, _ in single)
  if not cpu or graph.update_reduces or joined:
    for nb, gi in whole:                          # joined with the parts, or one at a time
      if gi in whole_axes:
        regrouped[len(reduced)] = whole_axes[gi]
      reduced.append((nb, 1))
    whole, single = [], []
  loop_held.update(_loop_held(graph, stacked, backend, bdiv > 1))
  hoisted = _zeros_before_the_loop(graph, whole_tables) | _zeros_at_the_start(graph, zeros_first)
  values = []
  bodies: dict[int, tuple[float, stepgraph.Live]] = {}
  slots: list[tuple[float, stepgraph.Live]] = []
  sized: dict[int, float] = {}           # id of a timeline value -> its bytes per device
  for v in graph.timeline:
    # XLA:CPU's transposed operand copies (a GPU's kernels need none), the results of ops
    # only XLA:CPU counts expensive (XLA:GPU recomputes them in each user's fusion) and a call's
    # result counted again in its body (one buffer on XLA:GPU); on the CPU a product's result
    # that only a transpose reads is that transpose's buffer, and a reducing fusion's broadcast
    # operand is made only where its layout keeps it (Live.made_on_cpu)
    if ((v.copy or v.cheap_on_gpu or v.call_result) and not cpu or v.folded and cpu
        or not v.made_on_cpu(bdiv, gathered_per_use)):
      continue
    if id(v) in hoisted:                  # the zeros of a table's scatter, made before
      v = dataclasses.replace(v, start=hoisted[id(v)])
    if v.gpu_end is not None and not cpu:   # read by a fusion that recomputes a dropped value
      v = dataclasses.replace(v, end=v.gpu_end)
    if v.gpu_start is not None and not cpu:  # made at its own equation on XLA:GPU
      v = dataclasses.replace(v, start=v.gpu_start)
    if v.grad is not None:
      sizes = (shard_sizes.get(v.grad) if v.update else
               grad_sizes.get(v.grad) or turned.get(v.grad))
      nb = sum(sizes) / len(sizes) if sizes else v.nbytes / bdiv
      if not v.body and not v.update and loop_held.get(v.grad):
        # the backward loop that makes a scanned stack's gradient holds its layer's whole
        # gradient and the gathered layer's copy in its body under FSDP, a 16-bit stack's
        # float32 conversion beside it (_scanned_stack_bytes): one stack's at each gradient
        # of its shape (the stacks of one shape a body reads are made at one step, two scans'
        # at two)
        held = dataclasses.replace(v, grad=None, update=False, end=v.start)
        hoist, rest = loop_held[v.grad].pop(0)
        values.extend((nb, held) for nb in rest if nb > 0)
        if hoist:
          # the hoisted conversion reads only the stack's parameter: XLA:CPU's schedule makes
          # it at the step's start, beside the weights' gathered copies (a bfloat16 [4, 128,
          # 128] stack after a bfloat16 MLP on `fsdp` 8 under sgd: f32[4,128,128], f32[128,512]
          # and f32[512,128] at the first all-gathers, the peak of its temp; docs/benchmarks.md
          # scan22)
          values.append((hoist, dataclasses.replace(held, start=0)))
      if v.body:
        # a gradient part made in a loop's body (liveness._peak's loop_parts), live beside the
        # carried gradient while the loop runs, in an output buffer where one is free, and
        # all-reduced over the batch axes in the body into a buffer of its own (XLA:CPU's
        # buffer assignment of a weight read in a fori_loop or scan on `data` 8). Where a
        # batch axis shards the weight (FSDP) XLA:CPU's buffers differ (fori_inner_loop in
        # tests/test_plan_user_steps.py on `fsdp` 8 is within 10 % without the parts, +20 %
        # with them): not counted there
        if v.grad not in sharded_shapes:
          values.extend((nb, v) for _ in range(2 if bdiv > 1 else 1) if nb > 0)
        continue
    elif v.turned_gradient is not None:    # a kernel's gradient copied (XLA:CPU only)
      sizes = grad_sizes.get(v.turned_gradient) or turned.get(v.turned_gradient)
      nb = sum(sizes) / len(sizes) if sizes else v.nbytes
    elif v.whole:          # a grouped convolution's whole-batch buffers (Live.whole)
      nb = v.nbytes
    else:
      nb = v.nbytes / bdiv
      if tensor > 1 and any(k in complete for k in v.owners):
        nb /= tensor
    if v.gemm is not None and not cpu:     # XLA:GPU's product split over its contraction
      split = _split_bytes(v, nb, bdiv)
      summed = v.start if v.grad is not None else v.gemm_sum_at
      if split and summed < v.end:         # summed before the result's last use
        values.append((split, dataclasses.replace(v, end=summed, grad=None, gpu_end=None)))
      elif split:                          # the parts are the result until its last use
        nb = max(nb, split)
    sized[id(v)] = nb
    if v.slot is not None:   # the vocabulary chain's fourth heap slot, decided once placed
      if cpu:
        slots.append((nb, v))
    elif v.body:         # a loop body's values at its peak, each sized, placed as one block
      total, first = bodies.get(v.start, (0.0, v))
      bodies[v.start] = (total + nb, first)
    elif nb > 0:
      values.append((nb, v))
  values.extend((nb, v) for nb, v in bodies.values() if nb > 0)
  # XLA's buffer assignment: live-out buffers first, then the rest largest first, each into the
  # first existing buffer it fits that holds nothing live at the same time
  outputs.sort(key=lambda o: -o[0])
  owner = [gi for _, gi in outputs]         # the group whose update writes each output buffer
  outputs = [nb for nb, _ in outputs]
  held: list[list[tuple[int, float]]] = [[] for _ in outputs]   # (start, end) per output buffer
  kept_to_the_end: list[float] = []     # the gradients placed in outputs' buffers (to the update)
  temp: list[tuple[float, stepgraph.Live]] = []
  # the step's combined reduction of the gradients (_combined_reduction's)
  grads_made = [v.start for v in graph.timeline if v.grad is not None and not v.update]
  reduction = max(grads_made, default=0) + 1
  # a float32 scanned stack's gradient is the backward loop's carried value (the while loop's
  # colocated buffers: its zeros, the body's parameter and root, its result), which XLA:CPU
  # puts in the stack's output buffer where that is free (shard_map_in_layer_scan on `data` 8),
  # but the weights' gathered copies, which the model holds apart (``gathered``, in the
  # temporary buffer all step), go first into a free output buffer they fit: a [4, 128, 128]
  # stack after an MLP on `fsdp` 8 under sgd has w1's gathered f32[128,512] in the stack's
  # output buffer before the loop and the f32[4,128,128] carry in temp beside w2's gathered
  # copy and the layer's all-reduce (plan.check -11.6 % with the carry in the output, -6.1 %
  # so). So a carry no larger than the gathered copies is priced in temp. A bfloat16 stack's
  # carry, bfloat16, is its output's buffer, updated in place (the same step in bfloat16:
  # bf16[4,128,128] in the live-out allocation; in temp its rows on `data` 2 x `fsdp` 4 and
  # `fsdp` 4 x `tensor` 2 went from -0.1 / -1.0 % to +7.0 / +6.0 %). docs/benchmarks.md scan22
  carried = {st.leaf.shape for st in stacked if st.leaf.itemsize >= 4}
  for nb, v in sorted(values, key=lambda x: -x[0]):
    end = (math.inf if v.grad is not None and not v.body else
           reduction if v.turned_gradient is not None else _end(v, cpu))
    placed = False
    loop_carry = v.grad in carried and not v.body and not v.update and gathered >= nb
    for k, size in enumerate(() if loop_carry else outputs):
      if size < nb:
        break
      if all(v.start > e or end < s for s, e in held[k]):
        held[k].append((v.start, end))
        if end == math.inf:
          kept_to_the_end.append(nb)
        placed = True
        break
    if not placed:
      temp.append((nb, v))
  # XLA:CPU's combined all-reduce of whole gradients. Not of a weight read in a loop (a
  # scanned stack, a fori_loop's weight): XLA reduces each iteration's gradient in the loop's
  # body into an output buffer and updates the carried gradient in place (its buffer
  # assignment of shard_map_in_layer_scan's [4, 128, 128] stack on `data` 8: the [128, 128]
  # all-reduce in the backward loop, no whole reduction after it; priced here, +10.8 %)
  apart = [(nb, gi) for nb, gi, looped in single if not looped] + whole
  if apart:
    reduced.extend(_reduced_apart(apart, outputs, owner, kept_to_the_end))
  temp.extend(slot for slot in slots if _fourth_slot(slot, graph, temp, sized, bdiv,
                                                     gathered_per_use))
  events: dict[int, list[tuple[float, float]]] = {}
  branch_steps = {t for _, t in in_branch}
  for nb, v in temp:
    is_grad = v.grad is not None
    end = _end(v, cpu)
    # a dequantized weight's gradient is an operand of XLA:CPU's combined all-reduce after the
    # backward, live until it though the scale's gradient read it long before (two int8 weights
    # sharing a trained scale, read in a chain, `data` 8: the first-made f32[256,256] gradient
    # held to the all-reduce beside the second's, XLA:CPU's buffer assignment)
    if cpu and is_grad and v.grad in held_to_reduction and not v.body:
      end = max(end, reduction)
    if v.turned_gradient is not None:     # read by the combined all-reduce
      end = max(end, reduction)
    events.setdefault(v.start, []).append((nb * (not is_grad), nb * is_grad))
    # a branch's own values are dead by its last op, the reduction (_branch_reductions)
    end = v.start + 0.5 if v.body and v.start in branch_steps else end + 1
    events.setdefault(end, []).append((-nb * (not is_grad), -nb * is_grad))
  events.setdefault(-1, []).append((0.0, 0.0, gathered))    # the weights gathered for the step
  if start:                   # and jax 0.11's float32 copies of bfloat16 ones (_gathered_at_start)
    events[-1].append((0.0, 0.0, start))
    events.setdefault(-0.5, []).append((0.0, 0.0, -start))
  if cpu:
    # a loop's weights it makes no gradient of, gathered before it and held through it, with
    # the step's own gathers of them (StepGraph.loop_gathers), beyond the one priced
    for at, leaves in graph.loop_gathers.items():
      held_copies = sum(copies * per_leaf_gathered.get(leaf, 0.0) for leaf, copies in leaves)
      if held_copies > gathered:
        events.setdefault(at, []).append((0.0, 0.0, held_copies - gathered))
        events.setdefault(at + 1, []).append((0.0, 0.0, gathered - held_copies))
  if converted:               # dequantized weights' float conversions, kept to the step's end
    events[-1].append((0.0, 0.0, converted))
  if cpu:
    # the dequantized gradients' all-reduce spans every batch axis, and XLA's all-reduce
    # combiner joins only all-reduces of the same replica groups: not those of a whole gradient
    # first reduced over its weight's own batch axes (`data` 2 x `fsdp` 4, w2 P('fsdp'): XLA:CPU
    # reduces two int8 weights' float gradients in one all-reduce over all 8 devices, w2's over
    # `fsdp` and then its shard over `data`, three all-reduces, its buffer assignment), so each
    # group's reductions are new buffers at their own all-reduce, one group at a time
    _combined_reduction(graph, events, reduced, gathered, kept,
                        regrouped if held_to_reduction else None)
    _branch_reductions(events, in_branch, branch_moved)
  act = grads = held_gathered = 0.0
  peak = (0.0, 0.0, 0.0)
  for t in sorted(events):
    for da, dg, *dw in events[t]:
      act += da
      grads += dg
      held_gathered += sum(dw)
    if act + grads + held_gathered > sum(peak):
      peak = (act, grads, held_gathered)
  return {"activations": peak[0], "grads": peak[1], "gathered": peak[2]}


class _Stack(typing.NamedTuple):
  """A scanned stack simulate_memory holds the backward loop's buffers of (_loop_held)."""
  index: int                   # the leaf's index
  leaf: stepgraph.Leaf
  use: stepgraph.WeightUse
  shards: int                  # the devices its layout splits it over
  zero: bool                   # a batch axis alone splits it (FSDP)
  split: int                   # 'tensor''s size where a batch axis and 'tensor' split it, else 1


def _loop_held(graph: stepgraph.StepGraph, stacked: Sequence[_Stack], backend: str,
               reduced: bool = False) -> dict[tuple[int, ...], list[tuple[float, list[float]]]]:
  """:func:`_scanned_stack_bytes` of each scanned stack of ``stacked``, a list a stack, by the
  stack's shape (two stacks of one shape are two sets of buffers, each held where its gradient
  is made).
  Where one scan's body gathers several stacks' layers under FSDP (``StepGraph.
  stacked_together``), XLA:CPU's backward body holds each layer's gradient and its reduction at
  the iteration's combined all-reduce, the gathered layers and their copies dead by then, of
  which the plan prices one gathered layer (the largest, ``Price.gathered_peak``): XLA:CPU's
  buffer assignment of ``h + tanh(h @ w1) @ w2`` scanned over [2, 128, 256] and [2, 256, 128]
  on `fsdp` 8 holds four f32 layer buffers in the body, and each stack more read in the body
  adds two (three [2, 256, 256] stacks: +540,704 bytes of temp over two). Each stack's is
  (its hoisted 16-bit conversion's bytes, 0 where none, and the rest)."""
  zero = {st.index: st.leaf.nbytes / st.use.layers for st in stacked if st.zero}
  held: dict[tuple[int, ...], list[tuple[float, list[float]]]] = {}
  for k, leaf, use, shards, z, split in stacked:
    group = {j for s in graph.stacked_together if k in s for j in s if j in zero} | {k}
    found = _scanned_stack_bytes(
        leaf, use.layers, shards, z, stacked_parts(use, backend),
        _body_layers(use) if z else use.unroll,
        alone=len(group) <= 1, priced=max(group, key=lambda j: (zero.get(j, 0.0), j)) == k,
        split=split, reduced=reduced)
    hoisted = bool(found) and _hoisted_conversion(leaf)
    held.setdefault(leaf.shape, []).append(
        (found[0], found[1:]) if hoisted else (0.0, found))
  return held


def _body_layers(use: stepgraph.WeightUse) -> int:
  """The layers of a scanned stack whose gradients XLA:CPU makes before it reduces them: the
  scan's ``unroll``, the layers one trip of its backward's while loop makes and reduces
  together. A loop of one trip (L layers, ``unroll`` u < L, L // u == 1: JAX's while loop of
  the u written-out iterations and the L % u after it, ``loops._scan_impl``) XLA's while-loop
  simplifier removes, and its backward is written out: every layer's whole gradient is made
  before one all-reduce of them all (XLA:CPU's buffer assignment of ``tanh(h @ w)`` over
  [L, 128, 128] on `fsdp` 8 under adamw: all-reduce.9 of five f32[128,128] at L 5, u 3, its
  operands and results the ten 64 KiB buffers of the 0.625 MiB temp; 8, 6 and 10 such buffers
  at L 4 / u 3, L 3 / u 2, L 5 / u 4; a loop of two trips, L 7 / u 3, holds u's). Read where
  the batch axes alone shard the stack (FSDP); a stack `tensor` splits or none does keeps the
  trip's (``P(None, None, 'tensor')`` on `fsdp` 4 x `tensor` 2 at L 5 / u 3: +11.6 % as it
  was, +33.0 % with the L layers whole)."""
  if 1 < use.unroll < use.layers and use.layers // use.unroll == 1:
    return use.layers
  return use.unroll


def _hoisted_conversion(leaf) -> bool:
  """Whether jax 0.10's XLA:CPU converts a 16-bit float stack to float32 once before the
  loops (:func:`_scanned_stack_bytes`' first buffer)."""
  return leaf.itemsize < 4 and stepgraph.is_float(leaf.dtype) and XLA_VERSION < (0, 11)


def _scanned_stack_bytes(leaf, layers: int, shards: int, zero: bool, parts: int = 0,
                         unroll: int = 1, alone: bool = True, priced: bool = True,
                         split: int = 1, reduced: bool = False) -> list[float]:
  """What XLA:CPU holds while the backward loop of a ``lax.scan`` over a stacked weight runs,
  beyond the loop's values the timeline counts and the gathered layer the plan prices
  (``Price.gathered_peak``), in bytes per device. Where a batch axis shards the stack (FSDP,
  ``zero``): the layer's whole gradient, a float32 product's result (its all-reduce is then
  written into the gathered layer's buffer, dead by then), and a copy of the gathered layer in
  the product's layout (the all-gather over the layer's first dimension leaves the gathered
  dimension major, ``{2,0,1}``, and a ``copy_bitcast_fusion`` writes it as ``{1,0}`` for the
  dot, in the forward's body and the backward's). A 16-bit stack is converted to float32
  before its products (XLA:CPU's products of bfloat16 are float32 ones) and the conversion of
  the device's part of the whole stack is hoisted out of the loops, live from the forward's to
  the backward's end; under FSDP the gathered layer and its copy are float32 too (the
  all-gather's wire widening, calls.wire_bytes). XLA:CPU's buffer assignment (jax 0.10.2) of
  ``tanh(h @ w)`` scanned over a [4, 256, 256] stack at batch 64 under adamw
  (tests/test_plan_user_steps.py's ``test_a_scanned_stack_is_priced_as_compiled``): on `fsdp`
  8, float32, the gathered layer, its copy and the gradient, f32[256,256] each, beside the two
  stacked residuals, 860,608 bytes of temp where the model had the gathered layer and the
  residuals (-31.5 %); bfloat16, the same three in float32 and the f32[4,32,256] shard's
  conversion, 958,912 bytes (-57.8 %); on `data` 8, bfloat16, the whole stack's conversion f32[4,256,256] (1 MiB of
  1,167,736 bytes; the layer's gradient and its all-reduce are in the outputs' buffers),
  -26.1 %. A layer several products of the body read (``parts``, pricing.stacked_parts) has
  each product's whole gradient under FSDP (``tanh(tanh(h @ w) @ w)`` over [4, 256, 256] on
  `fsdp` 8: one f32[256,256] more, -13.2 % with one counted)."""
  elems = leaf.nbytes / leaf.itemsize
  wide = 4.0 if leaf.itemsize < 4 and stepgraph.is_float(leaf.dtype) else float(leaf.itemsize)
  layer = elems / layers
  # (jaxlib 0.11's XLA:CPU converts no 16-bit stack before the loops: its products read the
  # layer converted back to 16-bit in the product's layout, the copy, whose buffer the gradient's
  # float32 reduction then takes; review21b, [4, 256, 256] bfloat16 on `fsdp` 8: the gathered
  # f32[1,256,256] and the bf16[256,256] copy, then the f32 gradient and its all-reduce in their
  # two buffers, 561,592 bytes of temp, where 0.10's rule priced +38.7 %; replicated at 128
  # none, +30.2 %)
  converted = wide > leaf.itemsize and XLA_VERSION < (0, 11)
  held = [elems / shards * wide] if converted else []   # the hoisted conversion
  if zero:
    if unroll > 1 or not alone:
      # a body that gathers several layers (a partly unrolled one's, or other stacks' beside
      # this one's, ``alone`` False): each one's gradient and its reduction, a new buffer of
      # the combined all-reduce of the iteration's gradients
      n = 2 * unroll * max(1, parts)
    else:
      # the gathered layer, its copy (16-bit on jaxlib 0.11, the reduction in its place), the
      # gradient(s)
      n = 2 + max(1, parts) - (wide > leaf.itemsize and not converted)
    if priced:                # the gathered layer the plan prices, float32 where priced 16-bit
      held.append(layer * (wide - leaf.itemsize))
      n -= 1
    held += [layer * wide] * n
  elif split > 1:
    # a stack a batch axis and 'tensor' split (``split``, the tensor shards): the body gathers
    # the layer's part over the batch axis, f32[1, d, d / split] with the gathered dimension
    # major, and copies it into the product's layout; the gradient's part (transposed) then
    # takes the gathered buffer and its all-reduce the copy's, so two parts are live at a time,
    # one the plan prices (XLA:CPU's buffer assignment, jax 0.10.2, of ``tanh(h @ w)`` over a
    # stack laid out P(None, 'fsdp', 'tensor') on `fsdp` 4 x `tensor` 2: [2, 256, 256], the
    # all-gather f32[1,256,128] and copy_bitcast_fusion f32[256,128] at offsets 0 and 131072 of
    # the temp, dot and all-reduce after them there, -14.0 % with one priced; [3, 512, 512]
    # the same at 512 KiB, -16.5 %; [4, 256, 256] the gathered part and the gradient in the
    # outputs' buffers, f32[4,64,128], the copy in temp; a bfloat16 stack gathers and copies
    # (converts) in float32, -27.5 %)
    part = layer / split
    if priced:
      held.append(part * (wide - leaf.itemsize))
    held.append(part * wide)
  elif reduced and split == 1:
    # a stack no axis splits, its gradient reduced over the batch axes (DP's): the backward's
    # body slices the layer out of the stack, then makes the layer's gradient in its place (a
    # float32 product's, of a 16-bit stack too) and all-reduces it into a new buffer, two layer
    # buffers per product part and layer of the body, beside the carried gradient (XLA:CPU's
    # buffer assignment, jax 0.10.2, [4, 128, 128] on `data` 8 under sgd: the slice and then
    # dot.10 at offset 0, all-reduce.5 f32[128,128] at 65536 of the temp, -15.5 % without them;
    # two bfloat16 stacks the plan replicates on `fsdp` 8: four f32[128,128], the two gradients
    # and the combined all-reduce's two results, -24.2 %). Under adamw they take free
    # moments' buffers, as the placement gives them (tensor22)
    held += [layer * wide] * (2 * unroll * max(1, parts))
  return held


def _reduced_apart(whole: Sequence[tuple[float, int]], outputs: Sequence[float],
                   owner: Sequence[int], kept: Sequence[float]) -> list[tuple[float, int]]:
  """The all-reduce results of whole gradients of one product a batch axis reduces (``whole``:
  bytes per device and group; a replicated weight's, DP's, or an FSDP weight's before the
  slice) that XLA:CPU puts in the temporary buffer, as (bytes, 1) for the combined reduction
  (:func:`_combined_reduction`). An all-reduce writes a new
  buffer, never its operand's, so a reduced gradient is a value of its own, live from the
  reduction after the backward's last gradient to its update's fusions, beside the unreduced
  gradient it is made from. From the reduction on, the output buffers (``outputs``, written by
  the update of group ``owner``) hold the unreduced gradients (``kept``, the values the
  placement gave an output to the update), each in the smallest free one of at least its size,
  as XLA's buffer assignment reuses the smallest allocation that fits; each reduced gradient,
  largest first, then takes the smallest free one of another group's update: its own group's
  outputs are written by fusions that read it, and those fusions transpose the gradient jax
  makes as ``dot_general(dy, x)`` (the weight's dimensions reversed), so none writes over it
  in place. One that finds none is a new temporary buffer.

  XLA:CPU's buffer assignments of ``tanh(x @ w) @ v`` on `data` 8 (w f32[128,128], v
  f32[128,64]; tests/test_plan_user_steps.py's dp_chain): under plain sgd the outputs are the
  parameters, which hold the unreduced gradients up to the all-reduce, and both reductions are
  in the temporary buffer (96 KiB; priced 0 before, memory -30.6 %); under momentum and under
  adamw v's reduction is in one of w's state outputs, written after v's update reads it, and
  w's (64 KiB) in the temporary buffer, v's outputs too small for it (before: -14.1 %,
  -9.9 %). A DP MLP under adamw (w1 f32[128,512], w2 f32[512,128]) reduces w1's gradient into
  w2's second-moment output and w2's into w1's parameter output: temp 0, as priced before and
  after. The batch-512 MLP on `fsdp` 8 with w1 sharded and w2 replicated: under adamw w1's
  whole result is in w2's second-moment output and w2's in temp; under momentum both in temp
  (w2's two outputs hold the two unreduced gradients; before, w2's was priced in place:
  -14.7 %)."""
  free = list(range(len(outputs)))
  def take(nb: float, group: int | None) -> bool:
    fits = [k for k in free if outputs[k] >= nb and owner[k] != group]
    if not fits:
      return False
    free.remove(min(fits, key=lambda k: (outputs[k], k)))
    return True
  for nb in sorted(kept, reverse=True):
    take(nb, None)
  return [(nb, 1) for nb, gi in sorted(whole, key=lambda x: -x[0]) if not take(nb, gi)]


def _zeros_before_the_loop(graph: stepgraph.StepGraph, tables: set[tuple[int, ...]]
                           ) -> dict[int, int]:
  """Where XLA:GPU allocates the whole-table gradient of a lookup it partitions by "index
  passthrough" (each device scatters its tokens into zeros of the whole table, reduce-scattered
  after: ``tables``, the shapes of the tables :func:`lookup_gradient` prices so under FSDP): the
  zeros are scheduled with the backward loop's accumulators, before the loop, and live through
  it to the scatter after it. The table's gradient value (the last of its shape: the lookup is
  the forward's first read, so its gradient is the backward's last) then starts where the
  backward's loop over the scanned layers does (the first of their stacked gradients;
  ``StepGraph.stacks``): id of the timeline value -> that equation. Read from XLA:GPU's buffer
  assignment of Llama 1B's FSDP step (jax 0.11.2, mocked 32 GPUs, a lax.scan over 22 layers:
  tests/data/xla_gpu_llama1b_fsdp.json): the zeros f32[32000,2048] (250 MiB) are a broadcast
  scheduled before the backward while loop, at one offset with the scatter after it, and live at
  the temp's peak in the loop's attention; the 8-GPU step scatters into its shard instead (the
  rows and ids gathered), whose zeros are the table's output buffer, not the temp. A step
  without scanned layers (the unrolled families) is unchanged."""
  stacked = {graph.leaves[k].shape for leaves, _ in graph.stacks.values() for k in leaves}
  loop = min((v.start for v in graph.timeline if v.grad in stacked and not v.body), default=None)
  hoisted: dict[int, int] = {}
  for shape in sorted(tables):
    grads = [v for v in graph.timeline if v.grad == shape and not v.body]
    if loop is None or not grads:
      continue
    last = max(grads, key=lambda v: v.start)
    if loop < last.start:
      hoisted[id(last)] = loop
  return hoisted


def _zeros_at_the_start(graph: stepgraph.StepGraph, tables: set[tuple[int, ...]]
                        ) -> dict[int, int]:
  """The gradient values of ``tables`` (their shapes) whose scatter's zeros XLA:CPU makes at the
  step's start (:func:`pricing.scatter_zeros_from_the_start`): id of the timeline value (the last
  of its shape, the lookup's gradient) -> 0, its start."""
  hoisted: dict[int, int] = {}
  for shape in sorted(tables):
    grads = [v for v in graph.timeline if v.grad == shape and not v.body]
    if grads:
      hoisted[id(max(grads, key=lambda v: v.start))] = 0
  return hoisted


def split_k(batch: int, rows: int, cols: int, contraction: int) -> int:
  """How many parts XLA:GPU splits a product's contraction into (1: none), per device: it
  computes each part's product into one buffer of ``parts`` times the result's elements, in
  f32, and sums them (a reduce XLA fuses into the result's readers, or a fusion of its own
  where a product reads the result). At ``--xla_gpu_autotune_level=0`` XLA's dot cost model
  picks the tiling among its default configurations; this is the rule its choices in the
  round-2 XLA:GPU dumps of convnet, moe and llama-1b follow (tests/data/xla_gpu_mock8.json:
  65 of 67 product shapes, 494 of 508 products, 160 of them split; no product with a
  contraction under 256 is split; the two shapes it misses, the routers', would split a
  256-long contraction of an 8-column product, 16-32 KiB results):
  the most parts, a power of two, with ``2 * parts**2 * tiles <= contraction``, at least 64
  of the contraction per part and at most 128 parts x tiles, where ``tiles`` are the result's
  128 x 128 tiles; fewer than 4 parts are not split. A product with few result tiles and a
  long contraction, such as an MoE expert's output projection or a vocabulary's input
  gradient, is split into 4-32 parts."""
  tiles = batch * -(-rows // 128) * -(-cols // 128)
  parts = 1
  while (2 * (2 * parts) ** 2 * tiles <= contraction and 64 * 2 * parts <= contraction and
         2 * parts * tiles <= 128):
    parts *= 2
  return parts if parts >= 4 else 1


def _split_bytes(v: stepgraph.Live, nb: float, bdiv: int) -> float:
  """The buffer of XLA:GPU's split product (:func:`split_k`) that makes ``v`` (``nb`` bytes
  per device), in bytes per device; 0 where it is not split. The product's per-device
  dimensions are its global ones with the result's share split off its batch, rows, then
  columns; a weight's gradient contracts the tokens, split over the batch axes (``bdiv``)."""
  batch, rows, cols, contraction = v.gemm
  elems = batch * rows * cols
  if not elems or not v.nbytes or not nb:
    return 0.0
  factor = max(1, round(v.nbytes / nb))
  dims = []
  for d in (batch, rows, cols):
    g = math.gcd(d, factor)
    dims.append(d // g)
    factor //= g
  if v.grad is not None:
    contraction //= bdiv
  parts = split_k(*dims, contraction)
  return parts * elems * (nb / v.nbytes) * max(4.0, v.nbytes / elems) if parts > 1 else 0.0


def _only_looked_up(graph: stepgraph.StepGraph, group: Sequence[int]) -> bool:
  """Whether ``group`` is a table no product reads, only looked up (``StepGraph.lookups``)."""
  return (group[0] in graph.lookups and group[0] not in graph.weights and
          all(not product for k in group for _, product in graph.weight_reads.get(k, ())))


def _combined_reduction(graph: stepgraph.StepGraph, events: dict,
                        reduced: Sequence[tuple[float, int]], gathered: float,
                        kept: Sequence[tuple[Sequence[int], float]] = (),
                        apart: Mapping[int, frozenset[str]] | None = None) -> None:
  """XLA:CPU's gradient reductions after the backward: one combined all-reduce whose results
  are new buffers, live beside the unreduced gradients (``reduced``: the whole gradients an
  FSDP layout then slices, one per group), when the backward's last gradient has been made. A
  gathered weight (``kept``: each group's gathered copy) that only one product reads, the
  forward's (the first layer's, whose input no gradient is computed for), is freed after it, as
  XLA:CPU frees it; what else is
  gathered for the step (``gathered``) lives until the reduction. (XLA frees a copy the
  backward's input gradient reads after that product, too; the model holds it: the hoisted
  zeros of an untied table's scatter gradient, which XLA:CPU keeps from the step's start and the
  model does not price but for a vocab-parallel table beside other batch axes
  (pricing.scatter_zeros_from_the_start), are as large as the unembedding's copy on bench's
  small Llama under FSDP, 2 MiB of 18.3, and freeing the copy there put that row at -7.6 %.)

  Where the update sums values it computes from the gradients (``StepGraph.update_reduces``: a
  global norm's partial sums), XLA's combiner cannot join the gradients' all-reduces into one:
  each gradient is reduced joined with the sum of the one before, one new buffer at a time
  beside the unreduced gradients, the largest the peak's (XLA:CPU's compiles of
  clip_by_global_norm and adafactor steps of a two-layer MLP on ``fsdp`` 8, two widths: 3
  gradient-sized temporaries, where the combined reduction holds 4). A gradient of several
  products (``reduced``'s count: a weight read twice, ``StepGraph.gradient_parts``) is reduced
  part by part, each part a new buffer, the parts summed in the update (XLA:CPU's compile of a
  tied MLP's clip_by_global_norm step on ``fsdp`` 8: f32[512,128] and f32[128,512] in one
  all-reduce; of an MLP applied to two views under adamw: the four parts of the two weights in
  the combined one, four new buffers, where the model had two). Where a trained scale's step
  reduces gradients over other replica groups (``apart``: ``reduced``'s index -> the batch axes
  an FSDP weight's whole gradient is first reduced over; the rest, a dequantized weight's among
  them, over every batch axis), each group's combined all-reduce is one part. Adds the events to
  ``events`` (time -> (activations, gradients, gathered) deltas)."""
  ends = [v.start for v in graph.timeline if v.grad is not None and not v.update]
  if not ends:
    return
  after = max(ends) + 1          # the reduction runs once the last gradient has been made
  for group, nb in kept:         # a copy only the forward's product reads: freed there
    reads = sorted(r for k in group for r in graph.weight_reads.get(k, ()) if r[0] < after)
    # a copy a lax.cond's branch gathers dies in it (gather.py gathers again in the backward's)
    use = graph.weights.get(group[0])
    branched = bool(reads) and use is not None and use.branched
    if reads and _only_looked_up(graph, group):
      # a table only looked up: XLA fuses the lookup into the fusion that makes its rows (the
      # gather, the conversion and the scale: XLA:CPU's multiply fusion of f32[128,256] on
      # `fsdp` 8), which reads the gathered table; freed once the rows are made: the first
      # value after the lookup of at least the rows' bytes (a conversion widens them, a scale
      # keeps them; the per-row scale's own lookup, f32[64,16,1], is not the rows)
      rows = graph.lookups[group[0]][1]
      made = min((v.start for v in graph.timeline if v.start > reads[-1][0] and
                  v.nbytes >= rows), default=reads[-1][0])
      events.setdefault(made + 1, []).append((0.0, 0.0, -nb))
      gathered -= nb
    elif branched or (sum(product for _, product in reads) == 1 and reads[-1][1]):
      events.setdefault(reads[-1][0] + 1, []).append((0.0, 0.0, -nb))
      gathered -= nb
    elif (use is not None and not use.input_grad and not use.remat and reads and
          all(product for _, product in reads)):
      # a first layer's weight read by several forward products (an MLP applied to two views
      # of the batch): none of its gradient's products reads it, freed after the last (XLA:CPU's
      # buffer assignment of two_views on `data` 2 x `fsdp` 4: the cotangents' gathers and
      # the gradient parts take the gathered copies' offsets after the forward)
      events.setdefault(reads[-1][0] + 1, []).append((0.0, 0.0, -nb))
      gathered -= nb
    elif (use is not None and use.remat and not use.input_grad and reads
          and all(product for _, product in reads)):
      # a first layer under jax.checkpoint: read by the forward's product and by the backward's
      # checkpoint call, which rematerializes that product and then makes the gradient; XLA
      # inlines the call and frees the copy after the rematerialized product, before the
      # gradient the call returns is made (remat_first on `fsdp` 8, docs/benchmarks.md fsdp20)
      events.setdefault(reads[-1][0], []).append((0.0, 0.0, -nb))
      gathered -= nb
  events.setdefault(after, []).append((0.0, 0.0, -gathered))
  if graph.update_reduces:
    parts = sorted((nb * n for nb, n in reduced), reverse=True)
  else:
    joined: dict[frozenset[str] | None, float] = {}
    for k, (nb, n) in enumerate(reduced):
      key = (apart or {}).get(k)
      joined[key] = joined.get(key, 0.0) + nb * n
    parts = sorted(joined.values(), reverse=True) or [0.0]   # as one empty reduction before
  for k, nb in enumerate(parts):
    events.setdefault(after + k / len(parts), []).append((0.0, nb, 0.0))
    events.setdefault(after + (k + 1) / len(parts), []).append((0.0, -nb, 0.0))


def _branch_step(graph: stepgraph.StepGraph, shape: tuple[int, ...]) -> int | None:
  """The step of the top level whose equation makes the last gradient of ``shape`` (or its
  reverse), where that is a lax.cond (the backward's conditional: its branch's values at the
  same step, ``Live.body``); None where it is not."""
  shapes = (shape, tuple(reversed(shape)))
  made = [v.start for v in graph.timeline if v.grad in shapes and not v.update and not v.body]
  if not made:
    return None
  last = max(made)
  return last if any(v.body and v.start == last for v in graph.timeline) else None


def _branch_reductions(events: dict, in_branch: Sequence[tuple[float, int]],
                       branch_moved: Sequence[tuple[float, int]] = ()) -> None:
  """XLA:CPU's reductions of whole gradients made in a lax.cond's branch (an FSDP weight read
  only in a branch): the partitioner reduces them inside the branch, its last op (one combined
  all-reduce of the branch's gradients, cond19), into new buffers. The branch's own values are
  dead by then; the conditional's operands, the forward's residuals, live until it returns, and
  the unreduced gradients beside them (XLA:CPU's buffer assignment of nested_conds on `fsdp` 8
  at batch 256: w1's and w2's gradients and their reductions, four f32 buffers of 512 KiB, at
  offsets apart from the six f32[32,1024] residuals the backward's conditional reads; priced
  after the backward, where the residuals are dead, the model was 0.77 MiB of temp under).
  A gradient the same branch makes on its weight's shard beside that reduction
  (``branch_moved``: gather.shard_gradients in a branch, cond21b) holds its operands there too,
  the cotangent gathered whole and the residual moved into features: XLA:CPU's buffer
  assignment of nested_conds on `fsdp` 8 at batch 512 (w2 moved, w1 reduced) gives both
  f32[512,128] operands offsets of their own beside w1's gradient, its reduction and the
  residuals (0.50 MiB of temp the model was under, -13.7 %). A branch that reduces nothing
  peaks elsewhere, and its moved operands are left to the branch's values.
  Adds the events to ``events`` (time -> (activations, gradients, gathered) deltas)."""
  at: dict[int, float] = {}
  for nb, t in in_branch:
    at[t] = at.get(t, 0.0) + nb
  for t, nb in at.items():
    events.setdefault(t + 0.5, []).append((0.0, nb, 0.0))
    events.setdefault(t + 1, []).append((0.0, -nb, 0.0))
  for nb, t in branch_moved:
    if t in at:
      events.setdefault(t + 0.5, []).append((nb, 0.0, 0.0))
      events.setdefault(t + 1, []).append((-nb, 0.0, 0.0))


def _fourth_slot(slot: tuple[float, stepgraph.Live], graph: stepgraph.StepGraph,
                 temp: list[tuple[float, stepgraph.Live]], sized: dict[int, float], bdiv: int,
                 gathered_per_use: set[int]) -> bool:
  """Whether XLA:CPU's heap gives a sliced loss's vocabulary chain a fourth slot on this
  layout (heapslot.holds_a_fourth), read from the values placed in the temporary buffer
  (``temp``; a value placed in an output's buffer is not the heap's): the chain's pad is a heap
  buffer; no larger heap value starts or ends while the pad is live (kSpatial places the larger
  first, and one live before and after only moves the chain's base); whether the input
  gradient's result and the weight's gradient are the heap's; whether the weight is gathered
  per use (its gathered copy freed by the input gradient's product) and the weight gradient's
  product reads its operand last (heapslot.Chain.frees_operand). A whole gradient a batch axis
  reduces (DP's) is the all-reduce's operand, a heap buffer, wherever the placement put it."""
  _, v = slot
  s = v.slot
  pad = graph.timeline[s.pad]
  on_heap = {id(w) for _, w in temp}
  if id(pad) not in on_heap:
    return False
  size = sized[id(pad)]
  for nb, w in temp:         # kSpatial places the chain first: its buffers the largest there,
    if (nb > size * (1 + 1e-9) and w.start <= pad.end and w.end >= pad.start and
        (w.start >= pad.start or w.end <= pad.end)):
      return False           # but for larger values live all along (they only move its base)
  def allocated(k: int | None) -> bool:
    return k is not None and id(graph.timeline[k]) in on_heap
  gathered = s.weight_leaf in gathered_per_use
  whole_reduced = bdiv > 1 and s.weight_grad is not None and not gathered
  return heapslot.holds_a_fourth(allocated(s.input_grad), gathered,
                                 allocated(s.weight_grad) or whole_reduced, s.frees_operand)


def _end(v: stepgraph.Live, cpu: bool) -> int:
  """A value's last use on the plan's backend (XLA:GPU's fusion ends some elsewhere)."""
  return v.end if cpu or v.gpu_end is None else v.gpu_end


def _backend(m) -> str:
  """The platform of the devices the plan is for ("cpu", "gpu", ...): the backend it prices."""
  return m.topology.device(int(m.ids.ravel()[0])).platform


def complete_column(graph: stepgraph.StepGraph, sources, tp_of: dict, leaf: int, d: int,
                    cpu: bool) -> bool:
  """A column-parallel weight's output stays sharded: every pair it starts has its row-parallel
  partner, or (XLA:CPU) every reader of its output reduces over the sharded dimension
  (``StepGraph.reduced``)."""
  if cpu and (leaf, d) in graph.reduced:
    return True
  return bool(sources.get((leaf, d))) and all(
      tp_of.get(dst) == ("row", q) for dst, q in sources[(leaf, d)])


def _reduced_column(graph: stepgraph.StepGraph, leaf: int, pr: Price, cpu: bool) -> bool:
  """A column-parallel candidate whose output XLA:CPU keeps sharded with no partner: every reader
  reduces over the sharded dimension (:func:`complete_column`'s first case)."""
  return cpu and pr.tp is not None and pr.tp[0] == "col" and (leaf, pr.tp[1]) in graph.reduced


def complete_row(dests, tp_of: dict, sliced: dict[int, int], leaf: int, d: int) -> bool:
  """A row-parallel weight's input stays sharded: every pair that ends in it starts at a
  column-parallel weight, or at one XLA:CPU slices to the pair's shards (``sliced``: 'tensor'
  replicates it; at least one partner column-parallel)."""
  srcs = dests.get((leaf, d), [])
  cols = [tp_of.get(src) == ("col", k) for src, k in srcs]
  return any(cols) and all(c or sliced.get(src) == k for c, (src, k) in zip(cols, srcs))


def sliced_leaves(prob: Problem, choice: Sequence[int], sources, dests,
                  tp_of: dict) -> dict[int, int]:
  """The weights of ``choice`` priced at :attr:`pricing.Price.sliced` (leaf -> the dimension
  sliced): 'tensor' replicates them and a pair they start ends in a row-parallel weight beside a
  column-parallel source."""
  out = {}
  for gi, (g, c) in enumerate(zip(prob.groups, choice)):
    for k in sorted(prob.prices[gi][c].sliced):
      if any(tp_of.get(leaf) == ("row", q) and any(
          tp_of.get(s) == ("col", j) for s, j in dests[(leaf, q)])
             for leaf, q in sources.get((g[0], k), [])):
        out.setdefault(g[0], k)
  return out


def pair_maps(graph: stepgraph.StepGraph):
  sources: dict[tuple[int, int], list[tuple[int, int]]] = {}
  dests: dict[tuple[int, int], list[tuple[int, int]]] = {}
  for p in graph.pairs:
    sources.setdefault((p.src, p.src_dim), []).append((p.dst, p.dst_dim))
    dests.setdefault((p.dst, p.dst_dim), []).append((p.src, p.src_dim))
  return sources, dests


@contextlib.contextmanager
def _quiet_stdout():
  """HiGHS (inside scipy 1.16-1.18) prints debugging lines such as
  "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" to the process's
  standard output even with disp=False; they are not for the user."""
  try:
    fd = sys.stdout.fileno()
  except (AttributeError, OSError, ValueError):     # a replaced sys.stdout (pytest's capture)
    fd = 1
  sys.stdout.flush()
  saved = os.dup(fd)
  try:
    with open(os.devnull, "w", encoding="utf-8") as null:
      os.dup2(null.fileno(), fd)
      yield
  finally:
    os.dup2(saved, fd)
    os.close(saved)


# On a mesh the planner proposes, an axis over which the batch is replicated ('tensor') must split
# at least this share of the weights' product flops; otherwise most of the step would be computed
# once per device of the axis: duplicated work, which data parallelism turns into a split batch.
SPLIT_SHARE = 0.75


def replicated_axes(m: CandidateMesh) -> list[str]:
  """The mesh's axes of more than one device over which the batch is not split (the roles that
  do not split it: ``tensor``)."""
  return [r.name for r in roles.REGISTRY if not r.splits_batch and m.size[r.name] > 1]


def split_flops(prob: Problem, graph: stepgraph.StepGraph,
                axis: str) -> dict[int, dict[int, float]]:
  """group -> candidate -> the product flops it splits over ``axis`` (those that shard it)."""
  out: dict[int, dict[int, float]] = {}
  for gi, g in enumerate(prob.groups):
    use = graph.weights.get(g[0])
    if use is None:
      continue
    for ci, lay in enumerate(prob.cands[gi]):
      if axis in lay.used() and use.flops > 0:
        out.setdefault(gi, {})[ci] = use.flops
  return out


def lower_bound(prob: Problem) -> float:
  """A step time no assignment of ``prob`` goes below (seconds): the fixed compute and blocking
  terms plus, per group, its cheapest layout's compute and blocking communication, less the
  repeated work its pair would split if complete (Price.token_saving). The terms it leaves out
  (unpaired gathers, the exposed overlappable time) are never negative, so a mesh whose bound
  exceeds a plan already found cannot win and need not be solved."""
  return prob.compute_s + sum(prob.fixed_blocking.values()) + sum(
      min((pr.compute - pr.token_saving + sum(pr.blocking.values()) for pr in prs), default=0.0)
      for prs in prob.prices)


def uses_its_axes(prob: Problem, choice: Sequence[int], graph: stepgraph.StepGraph) -> bool:
  """Whether every axis that does not split the batch splits enough of the work (see solve)."""
  total = sum(u.flops for u in graph.weights.values())
  for axis in replicated_axes(prob.m):
    split = split_flops(prob, graph, axis)
    done = sum(split.get(gi, {}).get(c, 0.0) for gi, c in enumerate(choice))
    if not (total > 0 and done >= SPLIT_SHARE * total):
      return False
  return True


# Bisections of the program's memory cap in CapSearch: the cap's interval shrinks 256-fold.
CAP_STEPS = 8


def row_memory(prob: Problem, choice: Sequence[int]) -> float:
  """The program's memory row of ``choice`` without the pair savings (bytes per device): every
  layout's memory, the largest gathered peak and the fixed memory. An assignment fits a cap at
  least this large; ``evaluate``'s memory (XLA's buffer placement) is below it."""
  prices = [prob.prices[gi][c] for gi, c in enumerate(choice)]
  return (sum(sum(pr.memory.values()) for pr in prices) + sum(prob.fixed_memory.values()) +
          max((pr.gathered_peak for pr in prices), default=0.0))


# The plan a step gets is the one of least memory among those priced within this share of the
# fastest without the budget (and never above a recipe or pipeline plan that fits; step._leanest):
# two layouts priced closer than the model can tell apart are as fast, and the smaller leaves the user memory (for a larger batch,
# or headroom against fragmentation). Over the layouts timed on the 16-core host and the 2-core
# VM, pairs priced within 5 % were measured in either order (measure.RUNNER_UP_MARGIN's note);
# the benchmark's "as fast" is the same 5 % (bench/step_planner.py, the wins clause).
LEAN_MARGIN = 0.05
# solve_lean's relative optimality gap: its memory row over-counts activations by far more than
# this, and proving the last percent costs HiGHS most of its time on the clusters' 8B step
LEAN_GAP = 0.01

# Relative margin below the least memory row's dual bound under which a cap is known to have no
# solution (HiGHS's feasibility tolerance, 1e-7 of the scaled row, is far inside it).
ROW_MARGIN = 1e-5

# Relative margin by which a mesh's bound must exceed a plan found before the mesh is dropped:
# far above the solver's tolerances (HiGHS's 1e-6 feasibility) and the 2.3e-9 measured between a
# program's objective and evaluate's step time of its solution (bench/step_planner.py's fixtures).
PRUNE_MARGIN = 1e-4


class CapSearch:
  """The search of one mesh's assignment that fits a budget, one program at a time.

  The program's memory row is linear: it adds every gradient and activation as if all were live
  at once, up to 2.6x the memory :func:`evaluate` places (the moe family's ``tensor 8``: 107 MiB
  against 42), so a budget put on the row refused layouts that fit (moe under 1.10x its user
  FSDP x TP's compiled memory, "-0.0125 GiB short"). The row's cap is searched instead: the
  fastest assignment when it fits; else the cap is bisected (:data:`CAP_STEPS`) between the
  rows of the least-memory assignment and of the fastest, each solution checked by
  :func:`evaluate`, and the fastest that fits is kept (the least-memory assignment if it fits
  and nothing faster does).

  ``bound`` is a step time (seconds) that the search's answer cannot go below: the least of the
  fitting solutions found and of a floor of the programs still to solve, which every cap below
  a cap whose solution did not fit keeps (each later program's solutions are that program's
  too); the floor is :func:`lower_bound`, raised off the CPU to HiGHS's dual bound of the
  program plus the constant terms (there evaluate's step time of a solution is the program's
  objective; on XLA:CPU it is too since the program prices the CPU's terms, start waits, sliced
  weights and reduced columns, but pruning does not rely on that there yet). ``step.plan``
  advances the meshes' searches best-first and stops those whose bound exceeds a plan found:
  they cannot be chosen, and every other search ends where it would alone."""

  def __init__(self, prob: Problem, graph: stepgraph.StepGraph, budget: float,
               proposed: bool = True):
    self.prob, self.graph, self.budget, self.proposed = prob, graph, budget, proposed
    self.done = False
    self.choice: list[int] | None = None
    self.fastest: list[int] | None = None     # without the budget (solved first)
    self._cost: StepCost | None = None
    self._fastest_cost: StepCost | None = None
    self._floor = lower_bound(prob)
    self._fit = math.inf
    self._exact = _backend(prob.m) != "cpu"
    self._steps = self._search()

  @property
  def bound(self) -> float:
    return min(self._fit, self._floor)

  @functools.cached_property
  def _least(self) -> tuple[list[int] | None, float]:
    return solve_bounded(self.prob, self.graph, 0.0, objective="memory", proposed=self.proposed)

  @property
  def least(self) -> list[int] | None:
    """The least-memory assignment (solved once, for the search or the planner's shortfall)."""
    return self._least[0]

  def cost(self) -> StepCost | None:
    """:func:`evaluate`'s cost of ``choice`` under the budget (None without one): the search's
    own where it priced it, so the planner does not price the same assignment again."""
    if self.choice is not None and self._cost is None:
      self._cost = evaluate(self.prob, self.choice, self.graph, self.budget)
    return self._cost

  def fastest_cost(self) -> StepCost | None:
    """:func:`evaluate`'s cost of the mesh's fastest assignment without the budget (None before
    the search's first program): its time and memory do not depend on the budget."""
    if self.fastest is None:
      return None
    if self.fastest is self.choice:
      return self.cost()
    if self._fastest_cost is None:
      self._fastest_cost = evaluate(self.prob, self.fastest, self.graph, self.budget)
    return self._fastest_cost

  def advance(self) -> None:
    """Solve the next program (or end the search)."""
    try:
      next(self._steps)
    except StopIteration:
      self.done = True

  def run(self, stop: float = math.inf) -> bool:
    """Search to the end (True), or until the bound exceeds ``stop`` seconds (False: the answer
    would be slower than that, by more than :data:`PRUNE_MARGIN`)."""
    while not self.done:
      if self.beyond(stop):
        return False
      self.advance()
    return True

  def beyond(self, stop: float) -> bool:
    """Whether the answer cannot come within :data:`PRUNE_MARGIN` of ``stop`` seconds."""
    return self.bound > stop * (1 + PRUNE_MARGIN) + 1e-9

  def _above(self, floor: float) -> None:
    """A program's floor that every program left to solve keeps."""
    if self._exact:
      self._floor = max(self._floor, floor)

  def _search(self):
    prob, graph, budget = self.prob, self.graph, self.budget
    fastest, floor = solve_bounded(prob, graph, 0.0, proposed=self.proposed)
    self.fastest = fastest
    if fastest is None or not budget:
      self.choice = fastest
      return
    cost = self._fastest_cost = evaluate(prob, fastest, graph, budget)
    if cost.fits:
      self.choice, self._cost = fastest, cost
      return
    self._above(floor)
    yield
    least = self.least
    if least is None:
      return
    found = [(evaluate(prob, least, graph, budget), least)]
    if found[0][0].fits:
      self._fit = found[0][0].total_s
    yield
    # no assignment's row is below the fixed memory; the fastest's is at most row_memory (the
    # program's row also subtracts the activations a complete pair shards)
    lo, hi = sum(prob.fixed_memory.values()), row_memory(prob, fastest)
    # no assignment's row goes below the least-memory program's dual bound: a cap under it (by
    # far more than HiGHS's tolerances) has no solution, known without solving
    below = lo + self._least[1] - ROW_MARGIN * abs(self._least[1])
    for _ in range(CAP_STEPS):
      cap = (lo + hi) / 2
      choice, floor = (None, -math.inf) if cap < below else solve_bounded(
          prob, graph, cap, proposed=self.proposed)
      if choice is None:                 # nothing fits the cap: a larger one
        lo = cap
      else:
        cost = evaluate(prob, choice, graph, budget)
        found.append((cost, choice))
        if cost.fits:
          lo = cap
          self._fit = min(self._fit, cost.total_s)
        else:
          hi = cap
          self._above(floor)
      yield
    fits = [(c.total_s, k, choice, c) for k, (c, choice) in enumerate(found) if c.fits]
    if fits:
      self.choice, self._cost = min(fits)[2:]


def solve(prob: Problem, graph: stepgraph.StepGraph, budget: float,
          objective: str = "time", proposed: bool = True) -> list[int] | None:
  """The cheapest assignment that fits (scipy.optimize.milp), or None when none fits; with
  ``objective="memory"`` the assignment of least memory per device (no budget).

  On a mesh the planner proposes (``proposed``), a ``tensor`` axis must shard at least one
  weight over it: otherwise the devices along that axis would compute the same step on the same
  data (duplicated work). A mesh the user gave is planned as given."""
  return solve_bounded(prob, graph, budget, objective, proposed)[0]


@dataclasses.dataclass
class _Program:
  """One mesh's program, built once for its solves: each objective's costs and the constraint
  matrix and row bounds without the memory cap (``rows``) and with it as the last row
  (``capped``, its upper bound set per solve)."""
  index: dict[tuple[int, int], int]
  costs: dict[str, np.ndarray]
  rows: tuple
  capped: tuple
  integrality: np.ndarray
  bounds: object


def _program(prob: Problem, graph: stepgraph.StepGraph, proposed: bool) -> _Program | None:
  """The program of :func:`solve_bounded` (None where an axis that does not split the batch
  cannot split enough of the work, see :func:`solve`)."""
  from scipy import optimize, sparse
  index = {}
  costs: list[float] = []
  mem: list[float] = []
  over: list[float] = []
  update: list[float] = []
  cpu = _backend(prob.m) == "cpu"
  for gi, (g, cands) in enumerate(zip(prob.groups, prob.cands)):
    for ci in range(len(cands)):
      pr = prob.prices[gi][ci]
      index[(gi, ci)] = len(costs)
      cost, act = sum(pr.blocking.values()) + pr.ag_fwd + pr.ag_bwd + pr.compute, 0.0
      # a tensor pair's gather waits as plain FSDP's unless the pair is complete (the pair
      # variables below take it off)
      unmet, compute = sum(pr.unmet_wait.values()), pr.compute
      if _reduced_column(graph, g[0], pr, cpu):   # complete alone (evaluate's complete_column)
        cost -= pr.ag_fwd + pr.token_saving
        act, unmet, compute = pr.act_saving, 0.0, compute - pr.token_saving
      costs.append(cost)
      mem.append(sum(pr.memory.values()) - act)
      # e >= overlappable - overlap * compute: both sides depend on the layout
      over.append(sum(pr.overlappable.values()) + unmet - prob.overlap * compute)
      update.append(pr.update)
  nx = len(costs)
  group_of_leaf = {g[0]: gi for gi, g in enumerate(prob.groups)}
  sources, dests = pair_maps(graph)

  def tp_vars(leaf, want, sliceable=True):
    gi = group_of_leaf.get(leaf)
    if gi is None:
      return []
    # a row-parallel weight's partner may also be one XLA:CPU slices to its shards (priced
    # there by the sliced variables below)
    return [index[(gi, ci)] for ci, pr in enumerate(prob.prices[gi])
            if pr.tp == want or (sliceable and want[0] == "col" and want[1] in pr.sliced)]

  # pair variables: u = the candidate's gather is saved; u <= its own tp vars, u <= each partner's
  # (a row-parallel weight's also <= its partners' column-parallel ones: at least one of them is,
  # evaluate's complete_row); a complete pair's FSDP gather also waits less (Price.unmet_wait,
  # taken off the exposed row)
  # (saving seconds, activation bytes, own vars, [partner vars...], its exposed-row coefficient)
  saves = []
  for gi, g in enumerate(prob.groups):
    for ci, pr in enumerate(prob.prices[gi]):
      if pr.tp is None:
        continue
      kind, d = pr.tp
      partners = (sources if kind == "col" else dests).get((g[0], d))
      saving = pr.ag_fwd + pr.token_saving if kind == "col" else pr.ag_bwd
      act = pr.act_saving if kind == "col" else 0.0
      unmet = sum(pr.unmet_wait.values())
      if (not partners or (saving <= 0 and act <= 0 and unmet <= 0)
          or _reduced_column(graph, g[0], pr, cpu)):
        continue
      want = "row" if kind == "col" else "col"
      plist = [tp_vars(leaf, (want, q)) for leaf, q in partners]
      cols = [v for leaf, q in partners for v in tp_vars(leaf, ("col", q), False)]
      if kind == "row" and set(cols) != {v for vs in plist for v in vs}:
        plist.append(cols)
      if all(plist):
        # complete, the pair's gather waits less (unmet), and a column's compute, less by the
        # repeated work it saves, hides less
        hidden = prob.overlap * pr.token_saving if kind == "col" else 0.0
        saves.append((saving, act, [index[(gi, ci)]], plist, hidden - unmet))
  nu = len(saves)
  # a weight 'tensor' replicates, priced at Price.sliced where XLA:CPU slices its output to a
  # pair's shards (sliced_leaves: a pair it starts ends in a row-parallel weight beside a
  # column-parallel source): s >= x + row + col - 2 for each such row-parallel layout of a
  # partner and column-parallel layout of that partner's other sources, at the least extra
  # time of its sliced dimensions (one in every step measured). s is otherwise free in [0, 1]:
  # where the sliced price were cheaper, the program would take it (a bound below evaluate's)
  slices = []                              # (candidate's variable, time, overlappable, combos)
  for gi, g in enumerate(prob.groups):
    for ci, pr in enumerate(prob.prices[gi]):
      if not pr.sliced:
        continue
      combos = []
      for k in pr.sliced:
        for leaf, q in sources.get((g[0], k), []):
          rows_of = tp_vars(leaf, ("row", q))
          for src, j in dests.get((leaf, q), []) if rows_of else ():
            cols_of = tp_vars(src, ("col", j), False) if src != g[0] else []
            if cols_of:
              combos.append(rows_of + cols_of)
      if combos:
        extra = [(sum(sl.blocking.values()) - sum(pr.blocking.values()) + sl.compute - pr.compute,
                  sum(sl.overlappable.values()) - sum(pr.overlappable.values()) -
                  prob.overlap * (sl.compute - pr.compute)) for sl in pr.sliced.values()]
        slices.append((index[(gi, ci)], *min(extra, key=sum), combos))
  ns = len(slices)
  # a gather at the step's start waits for the assignment's update (pricing.start_wait): per
  # candidate that has one, w >= offset + share x update - priced where it is chosen (update
  # linear in the layouts; at most ``most`` seconds, so ``big`` lifts the row where it is not)
  most = sum(max(pr.update for pr in prs) for prs in prob.prices)
  waits = []                               # (candidate's variable, share, offset - priced, big)
  for gi, prs in enumerate(prob.prices):
    for ci, pr in enumerate(prs):
      if pr.start_gather is not None:
        _, share, offset, priced = pr.start_gather
        big = offset - priced + share * most
        if big > 0:
          waits.append((index[(gi, ci)], share, offset - priced, big))
  nw = len(waits)
  peaks = [[prob.prices[gi][ci].gathered_peak for ci in range(len(cands))]
           for gi, cands in enumerate(prob.cands)]
  iw = nx + nu + ns                        # the waits' variables
  ip = iw + nw                             # the gathered-peak variable p
  n = ip + 2                               # + p and the exposed-time variable e
  c_memory, c_time = np.zeros(n), np.zeros(n)
  c_memory[:nx] = mem
  for j, (_, act, _, _, _) in enumerate(saves):
    c_memory[nx + j] = -act
  c_memory[ip] = 1.0
  c_time[:nx] = costs
  for j, (saving, _, _, _, _) in enumerate(saves):
    c_time[nx + j] = -saving
  for j, (_, extra, _, _) in enumerate(slices):
    c_time[nx + nu + j] = extra
  c_time[-1] = 1.0
  rows, cols, vals, lo, hi = [], [], [], [], []
  r = 0
  for gi, ps in enumerate(peaks):                         # p >= each group's gathered peak
    if not any(ps):
      continue
    for ci, pk in enumerate(ps):
      if pk:
        rows.append(r)
        cols.append(index[(gi, ci)])
        vals.append(pk)
    rows.append(r)
    cols.append(ip)
    vals.append(-1.0)
    lo.append(-np.inf)
    hi.append(0.0)
    r += 1
  for axis in replicated_axes(prob.m) if proposed else ():  # no duplicated work over it
    split = split_flops(prob, graph, axis)
    total = sum(u.flops for u in graph.weights.values())
    if not split or sum(max(fs.values()) for fs in split.values()) < SPLIT_SHARE * total:
      return None
    for gi, fs in split.items():
      for ci, fl in fs.items():
        rows.append(r)
        cols.append(index[(gi, ci)])
        vals.append(fl / total)      # shares: HiGHS refuses coefficients above 1e15 (8B: flops)
    lo.append(SPLIT_SHARE)
    hi.append(np.inf)
    r += 1
  for gi, cands in enumerate(prob.cands):                 # one layout per group
    for ci in range(len(cands)):
      rows.append(r)
      cols.append(index[(gi, ci)])
      vals.append(1.0)
    lo.append(1.0)
    hi.append(1.0)
    r += 1
  for j, (_, _, own, plist, _) in enumerate(saves):       # u <= own, u <= each partner
    for vs in [own] + plist:
      rows.append(r)
      cols.append(nx + j)
      vals.append(1.0)
      for v in vs:
        rows.append(r)
        cols.append(v)
        vals.append(-1.0)
      lo.append(-np.inf)
      hi.append(0.0)
      r += 1
  for j, (x, _, _, combos) in enumerate(slices):      # s >= x + row + col - 2
    for vs in combos:
      for v in [x] + vs:
        rows.append(r)
        cols.append(v)
        vals.append(1.0)
      rows.append(r)
      cols.append(nx + nu + j)
      vals.append(-1.0)
      lo.append(-np.inf)
      hi.append(2.0)
      r += 1
  for j, (x, share, lift, big) in enumerate(waits):   # w >= share x update + lift - big (1 - x)
    for k in range(nx):
      if update[k] or k == x:
        rows.append(r)
        cols.append(k)
        vals.append(share * update[k] + (big if k == x else 0.0))
    rows.append(r)
    cols.append(iw + j)
    vals.append(-1.0)
    lo.append(-np.inf)
    hi.append(big - lift)
    r += 1
  # e >= overlappable - overlap x compute (both per candidate, see over[]) + the start waits -
  # the fixed terms
  for k in range(nx):
    rows.append(r)
    cols.append(k)
    vals.append(over[k])
  for j, (_, _, _, _, exposed) in enumerate(saves):
    if exposed:
      rows.append(r)
      cols.append(nx + j)
      vals.append(exposed)
  for j, (_, _, over_extra, _) in enumerate(slices):
    rows.append(r)
    cols.append(nx + nu + j)
    vals.append(over_extra)
  for j in range(nw):
    rows.append(r)
    cols.append(iw + j)
    vals.append(1.0)
  rows.append(r)
  cols.append(n - 1)
  vals.append(-1.0)
  lo.append(-np.inf)
  hi.append(prob.overlap * prob.compute_s - prob.grad_latency_s)
  r += 1
  uncapped = (sparse.csc_array(sparse.csr_array((vals, (rows, cols)), shape=(r, n))),
              np.array(lo, dtype=float), np.array(hi, dtype=float))
  for k in range(nx):                                     # memory per device, capped per solve
    rows.append(r)
    cols.append(k)
    vals.append(mem[k])
  for j, (_, act, _, _, _) in enumerate(saves):
    if act:
      rows.append(r)
      cols.append(nx + j)
      vals.append(-act)
  rows.append(r)
  cols.append(ip)
  vals.append(1.0)
  capped = (sparse.csc_array(sparse.csr_array((vals, (rows, cols)), shape=(r + 1, n))),
            np.array(lo + [-np.inf], dtype=float), np.array(hi + [np.inf], dtype=float))
  integrality = np.zeros(n)
  integrality[:nx] = 1
  bounds = optimize.Bounds(np.zeros(n), np.r_[np.ones(nx + nu + ns), np.full(nw + 2, np.inf)])
  return _Program(index, {"time": c_time, "memory": c_memory}, uncapped, capped, integrality,
                  bounds)


def solve_bounded(prob: Problem, graph: stepgraph.StepGraph, budget: float,
                  objective: str = "time", proposed: bool = True
                  ) -> tuple[list[int] | None, float]:
  """:func:`solve`'s assignment and a value no solution of this program goes below (``-inf``
  where there is none): for the time objective a step time (seconds), HiGHS's dual bound plus
  the terms no layout changes; for the memory objective HiGHS's dual bound of the memory row
  (bytes per device, without the fixed memory)."""
  program = _program_of(prob, graph, proposed)
  if program is None:
    return None, -math.inf
  if objective == "memory":
    budget = 0.0
  a, lo, hi = program.capped if budget else program.rows
  if budget:
    hi = hi.copy()
    hi[-1] = budget - sum(prob.fixed_memory.values())
  res = _milp(program, program.costs[objective], a, lo, hi)
  choice = _choice(prob, program, res)
  if choice is None:
    return None, -math.inf
  dual = getattr(res, "mip_dual_bound", None)
  if dual is None or not math.isfinite(dual):
    return choice, -math.inf
  if objective == "memory":
    return choice, dual
  return choice, dual + prob.compute_s + sum(prob.fixed_blocking.values())


def _program_of(prob: Problem, graph: stepgraph.StepGraph, proposed: bool) -> _Program | None:
  """The mesh's program (:func:`_program`), built on its first solve and kept on ``prob``."""
  if proposed not in prob.programs:
    prob.programs[proposed] = _program(prob, graph, proposed)
  return prob.programs[proposed]


# HiGHS stops at this many branch-and-bound nodes with its best assignment. A limit on nodes,
# not on time: the answer must not depend on the machine or its load (a plan depends only on its
# inputs). encdec's lean solve on 64 devices has many assignments of the same memory and time
# (weights' specs that are mirror images): HiGHS finds one within 300 nodes and cannot prove it
# in 100,000 (58 s); under the 10 s time limit this replaced, the spec set it returned changed
# with the load (three sets in nine processes).
NODE_LIMIT = 1000


def _milp(program: _Program, c: np.ndarray, a, lo: np.ndarray, hi: np.ndarray, gap=None):
  from scipy import optimize
  # the time limit is a guard against a pathological program only: NODE_LIMIT ends a solve
  # in about a second on a 2-core VM
  options = {"disp": False, "node_limit": NODE_LIMIT, "time_limit": 60.0}
  if gap is not None:
    options["mip_rel_gap"] = gap
  with _quiet_stdout():
    return optimize.milp(c, constraints=optimize.LinearConstraint(a, lo, hi),
                         integrality=program.integrality, bounds=program.bounds,
                         options=options)


def _choice(prob: Problem, program: _Program, res) -> list[int] | None:
  """The candidate each group takes in a solution (None: no solution)."""
  if res.x is None:
    return None
  return [int(np.argmax([res.x[program.index[(gi, ci)]] for ci in range(len(cands))]))
          for gi, cands in enumerate(prob.cands)]


def solve_lean(prob: Problem, graph: stepgraph.StepGraph, ceiling: float,
               proposed: bool = True) -> list[int] | None:
  """The assignment of least memory (the program's memory row) whose step the program prices
  at most ``ceiling`` seconds, the faster of equals; None when there is none. One program: the
  memory objective under a row on the time objective (the time objective's terms plus the
  constants of :func:`solve_bounded`'s bound), which is :func:`evaluate`'s step time (on
  XLA:CPU too: a table's start wait, sliced weights, reduced columns and the gather waits of
  incomplete tensor pairs are its variables and rows; a sliced price cheaper than the weight's own, never seen, would be a bound below it, so
  that no assignment within the ceiling is refused). No budget is put on the memory row, which
  over-counts activations (see :class:`CapSearch`) and would refuse layouts that fit: the
  caller checks the answer's memory and time with :func:`evaluate`."""
  from scipy import sparse
  program = _program_of(prob, graph, proposed)
  if program is None:
    return None
  a, lo, hi = program.rows
  time_row = program.costs["time"]
  spare = ceiling - prob.compute_s - sum(prob.fixed_blocking.values())
  a = sparse.csc_array(sparse.vstack([a, sparse.csr_array(time_row[None, :])]))
  # memory first: the whole ceiling's time weighs a thousandth of the largest memory
  # coefficient, so time only decides between assignments of (nearly) equal memory
  memory = program.costs["memory"]
  c = memory + time_row * (1e-3 * max(1.0, float(np.abs(memory).max())) / max(ceiling, 1e-12))
  return _choice(prob, program, _milp(program, c, a, np.r_[lo, -np.inf], np.r_[hi, spare],
                                      gap=LEAN_GAP))
