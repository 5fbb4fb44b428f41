"""The tensor-parallel pairs of a step: a free dimension of one weight's product followed
through elementwise ops, reshapes, transposes and the batch and free dimensions of later products,
until a product with another weight contracts it. These are the column-parallel / row-parallel
pairs of Megatron-style tensor parallelism (the MLP's two kernels, the attention's q/k/v and
output kernels), whose activation between them stays sharded. The walk also records the products
between activations the dimension passes through unreduced (attention's score and value products
under head sharding, which split with it) and the values that carry it (its *cone*, the
activation bytes sharded with it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Collection

from dtenjax._src import jaxapi
from dtenjax._src.planning.jaxpr_reader import CALLS
from dtenjax._src.planning.jaxpr_reader import CUSTOM_DERIVATIVE_CALLS
from dtenjax._src.planning.jaxpr_reader import ELEMENTWISE
from dtenjax._src.planning.jaxpr_reader import Reader
from dtenjax._src.planning.jaxpr_reader import is_var
from dtenjax._src.planning.jaxpr_reader import sub_jaxprs


# What a bias passes through on its way to the product's output it is added to
_TO_OUTPUT = frozenset(("broadcast_in_dim", "reshape", "convert_element_type", "reduce_precision"))


@dataclasses.dataclass(frozen=True)
class Pair:
  """``src``'s free dimension ``src_dim`` flows, unreduced, into a product with ``dst`` that
  contracts ``dst``'s dimension ``dst_dim``."""
  src: int
  src_dim: int
  dst: int
  dst_dim: int


def find_pairs(reader: Reader) -> tuple[tuple[Pair, ...], dict[tuple[int, int], float],
                                         dict[tuple[int, int], set[Any]]]:
  """The pairs the walked step holds (sorted), the flops of the activation products each
  ``(leaf, free dim)`` splits when sharded (a product reached from several is split among them),
  and each paired ``(leaf, free dim)``'s cone: the values sharded with it."""
  pairs = []
  reached: dict[int, list[tuple[int, int]]] = {}     # product -> the sources that split it
  cones: dict[tuple[int, int], set[Any]] = {}        # (source, dim) -> values sharded with it
  for leaf, k, eqn, j, frames in _free_outputs(reader):
    found, through, cone = _follow(reader, leaf, k, eqn.outvars[0], j, frames)
    pairs.extend(found)
    if found:
      cones[(leaf, k)] = cone
    for e in through:
      reached.setdefault(e, []).append((leaf, k))
    if not found:
      continue
    # the weight's other reads (the forward jax.checkpoint recomputes in the backward, the
    # other depths of a weight shared across layers) carry the same dimension: the values
    # it reaches unreduced are sharded with it too (the backward's recomputed activation
    # may meet no row-parallel product: only its gradient does)
    for other, o_side, o_dims, o_frames in reader.reads.get(leaf, ())[1:]:
      o_j = _out_dim_of(other, o_side, o_dims, k)
      if o_j is not None:
        cone.update(_follow(reader, leaf, k, other.outvars[0], o_j, o_frames)[2])
    # the row-parallel partner's products that keep its sharded (contracted) dimension
    # free -- the backward's input gradient ``dy @ W2^T`` -- produce values sharded with
    # the pair too, up to the column-parallel weight's transposed product that contracts it
    for p in found:
      for other, o_side, o_dims, o_frames in reader.reads.get(p.dst, ()):
        o_j = _out_dim_of(other, o_side, o_dims, p.dst_dim)
        if o_j is not None:
          cone.update(_follow(reader, p.dst, p.dst_dim, other.outvars[0], o_j, o_frames)[2])
  ordered = tuple(sorted(set(pairs), key=lambda p: (p.src, p.src_dim, p.dst, p.dst_dim)))
  return ordered, carried_flops(reached, reader.eqn_flops), cones


def carried_flops(reached: dict[Any, list[tuple[int, int]]], flops: dict[Any, float]
                  ) -> dict[tuple[int, int], float]:
  """Each ``(leaf, free dim)``'s flops of the products it reaches, a product reached from
  several split among them. Exactly rounded sums (math.fsum): the products come from sets of ids,
  which iterate in the order of their addresses, another in every process, and a plain sum's
  last bit followed that order (llama_loop's carried flops differed by an ulp from one process to
  the next)."""
  parts: dict[tuple[int, int], list[float]] = {}
  for e, srcs in reached.items():
    for key in srcs:
      parts.setdefault(key, []).append(flops.get(e, 0.0) / len(srcs))
  return {key: math.fsum(v) for key, v in sorted(parts.items())}


def column_vectors(reader: Reader, invars, cones: dict[tuple[int, int], set[Any]]
                   ) -> dict[tuple[int, int], tuple[int, ...]]:
  """Each paired ``(leaf, free dim)`` -> the vector state leaves (a bias) an elementwise
  equation applies to a value of its cone, along that dimension (``x @ w1 + b1``): XLA computes
  such a vector's gradient in the product's column layout, runs its update there and all-gathers
  the new vector (and its moments) over 'tensor' into the replicated outputs. Followed from the
  leaf (``invars``: the step's, one per leaf) through its broadcast along the tokens, reshapes,
  casts and elementwise work, and into the bodies of loops and calls that read it (a bias added
  inside a lax.scan over micro-batches; a scanned stack of biases, one layer a trip)."""
  out: dict[tuple[int, int], list[int]] = {}
  # a 2-D leaf a scan slices (a stack of vectors, one a layer), beside the 1-D ones
  stacked = {org[0] for _, _, orgs in reader.scans for org in orgs if org is not None}
  for leaf, var in zip(reader.leaves, invars):
    if leaf.is_batch or not (len(leaf.shape) == 1 or
                             (len(leaf.shape) == 2 and leaf.index in stacked)):
      continue
    todo, seen, found = [var], 0, None
    while todo and found is None and seen < 32:
      v = todo.pop()
      seen += 1
      for eqn, pos in reader.uses.get(v, ()):
        name = eqn.primitive.name
        if name in _TO_OUTPUT:
          todo.append(eqn.outvars[0])
          continue
        if name == "scan" or name in CALLS or name in CUSTOM_DERIVATIVE_CALLS:
          # the body's operand is the leaf (a scan's const), or one layer of it (a scan's xs)
          todo.extend(sub.invars[pos] for sub, _ in sub_jaxprs(eqn) if pos < len(sub.invars))
          continue
        if name not in ELEMENTWISE:
          continue
        others = [x for k, x in enumerate(eqn.invars) if k != pos and is_var(x)]
        found = next((key for key in sorted(cones)
                      if reader.leaves[key[0]].shape[key[1]] == leaf.shape[-1] and
                      any(x in cones[key] for x in others)), None)
        if found is not None:
          break
        todo.append(eqn.outvars[0])
    if found is not None:
      out.setdefault(found, []).append(leaf.index)
  return {k: tuple(v) for k, v in out.items()}


def reduced_outputs(reader: Reader, pairs: tuple[Pair, ...]
                    ) -> dict[tuple[int, int], set[Any]]:
  """The ``(leaf, free dim)``s of products in no pair whose output every path reduces over that
  dimension (the unembedding's logits, read by the loss's log-softmax and its label's pick),
  with their cones: column-parallel, XLA's partitioner reduces each shard in place and
  all-reduces the reduced values (one per token), never gathering the output, which stays
  sharded (compiled: llama_scan's `fsdp` 8 x `tensor` 2 plan on 16 CPU devices, no all-gather of
  its 4 MiB of logits). The cone holds the output's gradient as well, which stays sharded too
  (:func:`_keeps_whole`, :func:`_made_beside`)."""
  paired = {(p.src, p.src_dim) for p in pairs}
  out = {}
  for leaf, k, eqn, j, frames in _free_outputs(reader):
    if (leaf, k) in paired:
      continue
    ends: list[Any] = []
    found, _, cone = _follow(reader, leaf, k, eqn.outvars[0], j, frames, ends=ends)
    if ends and cone and not found:
      out[(leaf, k)] = cone
  return out


def loop_split_outputs(reader: Reader, pairs: tuple[Pair, ...], reduced: Collection[Any]
                       ) -> dict[tuple[int, int], set[Any]]:
  """The ``(leaf, free dim)``s of a product in a top-level ``lax.scan``'s body (a
  ``fori_loop`` of static bounds is one) in no pair and not reduced in place, whose output's
  dimension the loop's carry holds into the next iteration's product (:func:`_follow`'s
  unpaired carry), with the loop's stacked outputs that carry it: the residuals the forward
  loop hands the backward's. Column-parallel, XLA's partitioner keeps the carry split over
  'tensor' (it gathers it before each iteration's product, roles/tensor.py's
  ``carried_input``) and stacks each iteration's values split, as they are made (compiled on 8
  CPU devices: tests/test_plan_user_steps.py's column_parallel_loop, a ``fori_loop`` of 3 of
  ``tanh(h @ w)`` with w [128, 128] pinned P(None, 'tensor') on `fsdp` 4 x `tensor` 2 at
  batch 64, three f32[3,16,64] residual stacks in XLA:CPU's buffer assignment)."""
  skip = {(p.src, p.src_dim) for p in pairs} | set(reduced)
  out: dict[tuple[int, int], set[Any]] = {}
  for leaf, k, eqn, j, frames in _free_outputs(reader):
    if (leaf, k) in skip or len(frames) != 1 or frames[0][0].primitive.name != "scan":
      continue
    loop, body = frames[0]
    n_consts, n_carry = jaxapi.scan_counts(loop)
    found, _, cone = _follow(reader, leaf, k, eqn.outvars[0], j, frames)
    carries = [body.invars[n_consts + c] for c, o in enumerate(body.outvars[:n_carry])
               if is_var(o) and o in cone and o.aval.shape == eqn.outvars[0].aval.shape]
    if found or not carries:
      continue
    # the carry's next iteration is split as this one's output: the stacked inputs of the
    # iterations (the weight's gradient reads them) too
    for carry in carries:
      cone = cone | _follow(reader, leaf, k, carry, j, frames)[2]
    stacked = {v for v in loop.outvars[n_carry:] if v in cone}
    if stacked:
      out[(leaf, k)] = stacked
  return out


def forward_reads(reader: Reader, leaf: int) -> int:
  """How many of a weight's products contract the dimensions its first product contracts (the
  forward's, not the input gradient's, which contracts its free ones), loop trips not counted.
  Row-parallel, each one's output is a partial sum all-reduced over 'tensor'. jax.checkpoint's
  backward recomputes a product only where the backward reads its output: a layer's attention
  output projection is recomputed (the MLP's norm reads the residual it adds to), its last
  product is not (compiled: Llama 1B's scan of remat layers under `tensor` 8 on 8 CPU devices,
  two all-reduces of the output projection's [8, 2048, 2048] per layer, the forward's and the
  recomputed one, and one of the MLP's down projection). 0 for a convolution's kernel (its reads
  are not recorded)."""
  contracted = set(reader.weights[leaf].contracted)
  n = 0
  for eqn, side, dims, _ in reader.reads.get(leaf, ()):
    (lc, rc), _ = eqn.params["dimension_numbers"]
    mine = {dims[d] for d in (lc if side == 0 else rc) if dims[d] is not None}
    n += mine == contracted
  return n


def _free_outputs(reader: Reader):
  """Each weight's first product (a dot_general) and each free dimension ``k`` of the weight
  its output keeps: ``(leaf, k, the product, the output's dimension, its frames)``."""
  for leaf, use in sorted(reader.weights.items()):
    eqn, side, dims, frames = reader.first_out[leaf]
    if eqn.primitive.name != "dot_general":
      continue
    for k in use.free:
      j = _out_dim_of(eqn, side, dims, k)
      if j is not None:
        yield leaf, k, eqn, j, frames


def _out_dim_of(eqn, side: int, leaf_dims, leaf_dim: int) -> int | None:
  """The output dimension of a dot_general that holds ``leaf_dim`` of operand ``side``."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  nl, nr = len(eqn.invars[0].aval.shape), len(eqn.invars[1].aval.shape)
  lfree = [d for d in range(nl) if d not in lc and d not in lb]
  rfree = [d for d in range(nr) if d not in rc and d not in rb]
  layout = [("b", k) for k in range(len(lb))] + [("l", d) for d in lfree] + [("r", d) for d in rfree]
  for k, d in enumerate(leaf_dims):
    if d == leaf_dim:
      want = ("l", k) if side == 0 else ("r", k)
      return layout.index(want) if want in layout else None
  return None


def _follow(reader: Reader, src: int, src_dim: int, start, dim: int, frames: tuple = (),
            budget: int = 4000, ends: list | None = None) -> tuple[list[Pair], set[int], set[Any]]:
  """Pairs reached from ``start``'s dimension ``dim`` (see the module docstring), the products
  between activations that the dimension passes through unreduced (attention's score and value
  products under head sharding), which split with it, and the values that carry it. ``frames``
  are the calls ``start`` is inside (:attr:`Reader.frames`): a body shared by several calls
  leaves through the call it was entered from. A reduction over the dimension spoils the walk
  (all empty), or, where ``ends`` is a list, ends that path (the reduction appended to it)."""
  pairs, todo, seen = [], [(start, dim, tuple(frames))], set()
  carried: set[int] = set()
  beside: set[Any] = set()
  # the pair's weights' gradients (products that contract the batch) and what the optimizer's
  # update computes from them: sharded as the weights, whose layouts price them; a reduction
  # over the dimension there (adafactor's factored moments, clip_by_global_norm's norm) is the
  # update's, not an activation's that needs the value whole
  updating: set[Any] = set()
  dirty = unpaired = False
  while todo and budget > 0 and not dirty:
    var, d, ctx = todo.pop()
    key = (var, d, tuple(id(e) for e, _ in ctx))
    if key in seen:
      continue
    seen.add(key)
    budget -= 1
    nxt = []
    grads = len(todo)          # what this value reaches is the update's too, where it is
    if ctx:
      call, body = ctx[-1]
      n_consts, n_carry = (jaxapi.scan_counts(call) if call.primitive.name == "scan" else
                           (0, 0))
      for k, o in enumerate(body.outvars):
        if o is var and k < len(call.outvars):
          # a scan's stacked outputs (after the carry) gain the leading length dimension
          shift = 1 if call.primitive.name == "scan" and k >= n_carry else 0
          todo.append((call.outvars[k], d + shift, ctx[:-1]))
        if (o is var and k < n_carry and n_consts + k < len(body.invars) and
            _contracts_itself(reader, src, body.invars[n_consts + k], d, ctx)):
          # a carry is also the next iteration's input: there the weight's own product contracts
          # it as it contracts its input (h + tanh(h @ w) in a lax.fori_loop), and needs the
          # value whole, gathered in every iteration (compiled on 8 CPU devices). No pair
          unpaired = True
    elif var in reader.outer_of_outvar:
      outer, shift = reader.outer_of_outvar[var]
      nxt.append((outer, d + shift))
    for eqn, pos in reader.uses.get(var, ()):
      name = eqn.primitive.name
      out = eqn.outvars[0] if eqn.outvars else None
      shape = tuple(var.aval.shape)
      if d >= len(shape):     # a use that does not see the followed dimension (jax 0.11's jaxprs)
        continue
      if name in ELEMENTWISE:
        if out is not None and tuple(out.aval.shape) == shape:
          nxt.extend((o, d) for o in eqn.outvars)
          if ends is not None:
            beside.update(_made_beside(reader, eqn, pos))
      elif name == "transpose":
        nxt.append((out, list(eqn.params["permutation"]).index(d)))
      elif name == "reshape":
        new = tuple(out.aval.shape)
        m = _reshape_dim(shape, new, d)
        if m is not None:
          nxt.append((out, m))
      elif name == "broadcast_in_dim":
        nxt.append((out, eqn.params["broadcast_dimensions"][d]))
      elif ends is not None and _keeps_whole(eqn, pos, d):
        nxt.append((out, d))        # the loss's shifted tokens, forward (slice) and backward (pad)
      elif name in ("reduce_max", "reduce_sum", "reduce_min", "argmax", "reduce_and", "reduce_or"):
        axes = tuple(eqn.params.get("axes", ()))
        if d in axes and ends is not None:
          ends.append(eqn)
        elif d in axes and var not in updating:
          dirty = True
        elif d in axes:
          continue
        else:
          nxt.append((out, d - sum(1 for a in axes if a < d)))
      elif name == "dot_general":
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        mine_c, mine_b = (lc, lb) if pos == 0 else (rc, rb)
        other_c = rc if pos == 0 else lc
        other = eqn.invars[1 - pos]
        if d in mine_c:
          org = _origin_in(reader, other, ctx)
          if org is None:
            dirty = True          # a partial sum of activations: needs the gathered value
          elif org[0] != src and org[0] in reader.weights:
            leaf_dim = org[1][other_c[list(mine_c).index(d)]]
            if leaf_dim is not None and leaf_dim in reader.weights[org[0]].contracted:
              pairs.append(Pair(src, src_dim, org[0], leaf_dim))
        else:
          nl = len(eqn.invars[0].aval.shape)
          nr = len(eqn.invars[1].aval.shape)
          lfree = [k for k in range(nl) if k not in lc and k not in lb]
          rfree = [k for k in range(nr) if k not in rc and k not in rb]
          if _origin_in(reader, other, ctx) is None:
            carried.add(id(eqn))
          if d in mine_b:
            nxt.append((out, list(mine_b).index(d)))
          else:
            base = len(lb) + (0 if pos == 0 else len(lfree))
            free = lfree if pos == 0 else rfree
            nxt.append((out, base + free.index(d)))
            if set(reader.batch.get(var, ())) & set(mine_c) and not reader.batch.get(out):
              updating.add(out)     # a weight's gradient: its product contracts the batch
      elif (eqn.params.get("jaxpr") is not None or name in ("scan", "while", "cond")
            or name in CUSTOM_DERIVATIVE_CALLS):
        # into a body: a call, a loop, a branch, or the primal of a function with a custom
        # derivative (jax.nn.relu's custom_jvp_call: flax's nn.relu MLPs)
        for sub, _ in sub_jaxprs(eqn):
          k = pos - (1 if name == "cond" else 0)
          inner_ctx = ctx + ((eqn, sub),)
          if 0 <= k < len(sub.invars):
            inner = sub.invars[k]
            if name == "scan" and k >= sum(jaxapi.scan_counts(eqn)):
              if d == 0:
                continue
              todo.append((inner, d - 1, inner_ctx))
            else:
              todo.append((inner, d, inner_ctx))
    todo.extend((v, dd, ctx) for v, dd in nxt if v is not None and is_var(v))
    if var in updating:
      updating.update(v for v, _, _ in todo[grads:])
  if dirty or todo:
    return [], set(), set()
  return [] if unpaired else pairs, carried, {v for v, _, _ in seen} | beside


def _contracts_itself(reader: Reader, src: int, var, d: int, ctx: tuple,
                      budget: int = 200) -> bool:
  """Whether ``var``'s dimension ``d`` (a loop body's carry, holding the dimension the walk
  follows from ``src``'s product) reaches, through elementwise ops, a product with ``src`` that
  contracts it as ``src``'s first product contracts its input: the next iteration's product of
  the same weight."""
  todo, seen = [(var, d)], set()
  while todo and budget > 0:
    v, dd = todo.pop()
    if (v, dd) in seen:
      continue
    seen.add((v, dd))
    budget -= 1
    if dd >= len(v.aval.shape):
      continue
    for eqn, pos in reader.uses.get(v, ()):
      name = eqn.primitive.name
      if name in ELEMENTWISE and tuple(eqn.outvars[0].aval.shape) == tuple(v.aval.shape):
        todo.extend((o, dd) for o in eqn.outvars)
      elif name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        mine_c, other_c = (lc, rc) if pos == 0 else (rc, lc)
        if dd in mine_c:
          org = _origin_in(reader, eqn.invars[1 - pos], ctx)
          if org is not None and org[0] == src:
            dim = org[1][other_c[list(mine_c).index(dd)]]
            if dim is not None and dim in reader.weights[src].contracted:
              return True
  return False


def _keeps_whole(eqn, pos: int, d: int) -> bool:
  """Whether ``eqn`` is a slice or a pad of its operand (``pos`` 0) along other dimensions than
  ``d``, which it leaves whole: XLA's partitioner keeps a value sharded on ``d`` through it (the
  logits' gradient, padded back from the loss's shifted tokens, stays sharded over 'tensor' on
  the vocabulary: compiled, moe's `expert` 8 x `tensor` 4 plan on 32 CPU devices)."""
  name = eqn.primitive.name
  if pos != 0 or name not in ("slice", "pad"):
    return False
  if name == "pad" and tuple(eqn.params["padding_config"][d]) != (0, 0, 0):
    return False
  return eqn.outvars[0].aval.shape[d] == eqn.invars[0].aval.shape[d]


def _made_beside(reader: Reader, eqn, pos: int) -> list[Any]:
  """The operands of the elementwise ``eqn`` other than ``pos`` (the value the walk follows) that
  have its output's shape and are made from smaller inputs only (a scatter into zeros, whose
  zeros are a broadcast): nothing keeps them whole, and XLA's sharding propagation gives them the
  sharding of the value they meet (the label pick's gradient, scattered into the logits' shape
  and added to the softmax's gradient, stays sharded over 'tensor' on the vocabulary: compiled,
  moe's `expert` 8 x `tensor` 4 plan on 32 CPU devices). A call's result comes with its body's,
  the value the body's peak holds."""
  shape = tuple(eqn.outvars[0].aval.shape)
  size = math.prod(shape)

  def small(v) -> bool:
    made = reader.producer.get(v)
    return (math.prod(getattr(v.aval, "shape", ())) < size
            or made is not None and made.primitive.name == "broadcast_in_dim")
  out = []
  for k, w in enumerate(eqn.invars):
    made = reader.producer.get(w) if k != pos and is_var(w) else None
    if made is None or tuple(w.aval.shape) != shape:
      continue
    if all(small(v) for v in made.invars if is_var(v)):
      out.append(w)
      out.extend(i for i, (o, _) in reader.outer_of_outvar.items() if o is w)
  return out


def _origin_in(reader: Reader, var, ctx: tuple):
  """The (leaf, dims) a product operand stands for at one call site (a body's input stands for
  the call's operand there), or None for an activation."""
  while ctx:
    call, body = ctx[-1]
    k = next((k for k, v in enumerate(body.invars) if v is var), None)
    if k is None:
      break
    outer = list(call.invars)[k + (1 if call.primitive.name == "cond" else 0)]
    if not is_var(outer):
      return None
    org = _origin_in(reader, outer, ctx[:-1])
    if org is not None and call.primitive.name == "scan" and k >= sum(jaxapi.scan_counts(call)):
      org = (org[0], org[1][1:])                      # one layer of a stacked leaf
    return org
  return reader.origin_all.get(var)


def _reshape_dim(old: tuple[int, ...], new: tuple[int, ...], d: int) -> int | None:
  """Where dimension ``d`` of ``old`` goes in ``new`` when it keeps its size or splits with it
  leading (features -> heads x head_dim), or merges as the leading part; None otherwise."""
  before = math.prod(old[:d])
  acc = 1
  for k, s in enumerate(new):
    if acc == before:
      if s == old[d] or (s > 1 and old[d] % s == 0) or (s % old[d] == 0 and
                                                         math.prod(old[d + 1:]) % (s // old[d]) == 0):
        return k
      return None
    acc *= s
    if acc > before:
      return None
  return None
