"""XLA:CPU's fourth heap slot of a sliced loss's vocabulary chain.

A next-token loss slices its logits (``logits[:, :-1]``); the backward pads the softmax's
gradient back (``P``, ``[b, s, V]``) and two products read the pad: the input gradient's (through
a bitcast copy of the pad, ``B``) and the weight gradient's (through its transposed copy, ``C``).
With the logits (``L``) these are the chain's four ``[b·s, V]`` buffers, beside three
``[b, s-1, V]`` ones (the slice, ``exp(s - max)`` ``E``, the softmax's gradient ``G`` with the
labels' scatter written in place). At most three are live at once, yet XLA:CPU's heap can give
them four slots.

The mechanism is XLA:CPU's heap. Its buffer assignment runs two best-fit heaps
(``GlobalDecreasingSizeBestFitHeap``) over the same intervals and keeps the smaller
(``ChooseBestHeapAlgorithm``): kSpatial places the largest buffer first, then the longest
interval on the heap's own clock, then the lowest value id; kTemporal places the longest interval
first (reaching over the values a buffer is colocated with), then the largest. The clock
advances one tick per allocation and per free, at each instruction the allocations first. The
fourth slot is in XLA's temp only where both heaps leave it: read from XLA's own logs
(``TF_CPP_VMODULE=heap_simulator=2``) on the bench's 165 compiles, the temp is the smaller heap
on all, and it exceeds the largest live sum by one slot on the 26 where both heaps leave four
(three FSDP rows whose chain is not the largest around it aside), by at most a fifth of one
elsewhere (docs/benchmarks.md, rows13). Where the chain's buffers are the largest around it,
they are placed among themselves first.

kSpatial. XLA schedules ``P``, ``B``, ``C``, the input gradient's product, the weight
gradient's product one instruction apart; on the clock ``P`` spans 4 ticks, ``B``
4 + ``a_in`` + ``f_in`` and ``C`` 3 + ``a_in`` + ``f_in`` + ``a_w`` + ``f_w``, where ``a_in`` /
``a_w`` count the products' results the heap allocates (a result written into an output's
buffer is not the heap's) and ``f_in`` / ``f_w`` the heap buffers they free (a weight gathered
for the input gradient's product; the activation the weight gradient's product reads last).
When ``B`` is placed first (``B`` >= ``C``, ties to ``B``, the lower id) and ``C`` before ``P``
(``C`` > ``P``, ties to ``P``), ``B`` shares ``L``'s slot, ``C`` the next, ``P`` the third. Of
the three smaller buffers, ``E`` (live with ``L`` only) and ``G`` (live with ``E``, then with
``B`` and ``P``) are placed by their own intervals: where ``E`` goes first it takes ``C``'s slot
and ``G`` finds no free slot of the three: a fourth. Where ``G`` goes first it takes ``C``'s slot
(``C`` starts after it ends), ``E`` then ``P``'s, and the chain fits in three. Both span 3
ticks, plus one for each small value XLA makes around them that is a heap buffer allocated or
freed inside the interval (ties go to ``E``, the lower id): in ``E``'s, the labels' gather
indices, the rows' maximum and sum, and the loss's partial sum where XLA:CPU makes it one YNN
reduction before ``G`` (a reduce-window tree runs after the scatter); in ``G``'s, the scatter's
indices and its updates (a constant XLA broadcasts early in the forward). ``E`` spans 3 to 6
ticks and ``G`` 3 to 8 on the bench's compiles.

kTemporal. ``G``'s interval reaches over the labels' scatter written into it in place, 3 ticks (4
on 14 of the bench's 100 compiles with the chain) past its own: 6 ticks where nothing small ticks
inside. Where that is more than ``B``'s (and so ``C``'s, where kSpatial leaves four), ``G`` is
placed before the chain's larger buffers, takes the first slot and ``B``, ``C`` and ``P`` take
three more: four. Otherwise ``B`` and ``C`` go first, ``G`` shares ``C``'s slot and the chain fits
in three. So where ``B`` spans 6 (the input gradient's product allocates its result and frees a
gathered weight: FSDP x TP), the fourth slot needs a small heap value inside ``G`` for kTemporal
and as many inside ``E`` for kSpatial; under TP (``B`` 5) neither.

Whether such a small value is a heap buffer is XLA's buffer assignment: it first tries the outputs'
allocations of at least its size that hold nothing live over its range, and those are filled by
values the jaxpr does not have: FSDP's all-gathered weights, a scanned stack's gradient carries and
loop copies (on every scanned stack compiled, no output of the updates' size is free over their
range), and SPMD's ``partition-id``, which takes the loss output's 4-byte allocation (leaving the
partial sum on the heap) where its last reader is scheduled before the loss's division. Between
Llama 1B and Llama 8B under FSDP x TP (both scanned, both with the sum and the updates on the
heap) only the scatter's indices differ: the one output left free takes them on the 1B, none
fits them on the 8B (docs/benchmarks.md, heap19). The model sees none of that: it takes ``E`` and
``G`` at 3 ticks, no small value inside either, and :func:`holds_a_fourth` decides both heaps from
the ``B`` / ``C`` / ``P`` ticks (given XLA's own ticks, it gives XLA's slots on every compile read
where the chain is the largest around it). On the model's ``a_in`` ... ``f_w`` it agrees with XLA's
temp on 155 of the bench's 165 rows. Two of the ten others are outside 10 %: Llama 1B under FSDP x
TP on 16 and 32 devices, whose ``E`` and ``G`` each hold one small heap value (the loss's partial
sum, the scatter's updates), so XLA leaves a fourth slot; the model does not (it also sizes that
layout's weight gradient on the heap, where XLA writes it, in halves, into the table's output
allocation). Where the model cannot tell ``a_w`` (an output may hold the gradient, or a piece of
it), the slot priced wherever either value leaves it puts 19 of the bench's 165 rows more than 10 %
over on kSpatial's half alone, and 1 with kTemporal's (Llama 1B FSDP x TP on 8, where XLA's ``f_w``
is 0); pricing any ``a_in`` too puts 21 over either way (docs/benchmarks.md, rows13).

:func:`find` marks the chain in a step's top-level jaxpr; :func:`holds_a_fourth` decides the
slot per layout from the solver's placement of the two products' results.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dtenjax._src.planning.jaxpr_reader import is_var


@dataclasses.dataclass(frozen=True)
class Chain:
  """A sliced loss's vocabulary chain in a step's top-level jaxpr: the pad of the slice's
  backward (its result ``padded``), its operand (``sliced``, the ``[b, s-1, V]`` value), the two
  products that read the pad (their results ``input_grad`` and ``weight_grad``), the step input
  the input gradient's product reads as its weight (``weight_leaf``, None where it is computed)
  and whether the weight gradient's product is the last reader of its activation operand once
  XLA runs the input gradient's product first (``frees_operand``)."""
  sliced: Any
  padded: Any
  input_grad: Any
  weight_grad: Any
  weight_leaf: int | None
  frees_operand: bool


@dataclasses.dataclass(frozen=True)
class Slot:
  """What the solver reads per layout to decide the chain's fourth slot (``Live.slot``): the
  timeline's indices of the pad's buffer, the input gradient's result and the weight's
  gradient (None where the timeline has no such value), the weight's leaf, and ``Chain``'s
  ``frees_operand``."""
  pad: int
  input_grad: int | None
  weight_grad: int | None
  weight_leaf: int | None
  frees_operand: bool


def find(jaxpr, state_shapes: set) -> list[Chain]:
  """The chains of ``jaxpr``'s top level: a ``pad`` that adds one element at the high end of one
  non-minor dimension (the backward of ``x[:, :-1]``), read by two products, one of a state
  leaf's shape (the weight's gradient), one not (the input's)."""
  readers: dict[Any, list[int]] = {}
  last: dict[Any, int] = {}
  for i, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if is_var(v):
        readers.setdefault(v, []).append(i)
        last[v] = i
  producer = {o: eqn for eqn in jaxpr.eqns for o in eqn.outvars}
  leaf_of = {v: k for k, v in enumerate(jaxpr.invars)}
  chains = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name != "pad" or not _undoes_a_slice(eqn):
      continue
    padded = eqn.outvars[0]
    dots = [jaxpr.eqns[j] for j in readers.get(padded, ())
            if jaxpr.eqns[j].primitive.name == "dot_general"]
    weight = [d for d in dots if _state_shaped(d.outvars[0], state_shapes)]
    inputs = [d for d in dots if not _state_shaped(d.outvars[0], state_shapes)]
    if len(weight) != 1 or len(inputs) != 1:
      continue
    w, g = weight[0], inputs[0]
    act = next((v for v in w.invars[:2] if v is not padded), None)
    other = next((v for v in g.invars[:2] if v is not padded), None)
    while other in producer and producer[other].primitive.name in ("transpose",
                                                                  "convert_element_type"):
      other = producer[other].invars[0]
    g_at = jaxpr.eqns.index(g)
    chains.append(Chain(
        sliced=eqn.invars[0], padded=padded, input_grad=g.outvars[0],
        weight_grad=_gradient_buffer(jaxpr, w.outvars[0], readers, state_shapes),
        weight_leaf=leaf_of.get(other),
        frees_operand=is_var(act) and last.get(act, -1) <= g_at))
  return chains


def holds_a_fourth(a_in: bool, f_in: bool, a_w: bool, f_w: bool, e: int = 3, g: int = 3,
                   g_scatter: int = 6) -> bool:
  """Whether both of XLA:CPU's heaps place the chain in four slots, from the clock's ticks of
  ``B`` (4 + a_in + f_in), ``C`` (3 + a_in + f_in + a_w + f_w), ``P`` (4), ``E`` (``e``), ``G``
  (``g``) and ``G`` with the scatter written into it (``g_scatter``). kSpatial: ``B`` before
  ``C``, ``C`` before ``P`` and ``E`` before ``G``; kTemporal: ``G`` with its scatter before
  ``B``. ``e``, ``g`` and ``g_scatter`` are what they are without a small heap value inside
  (see the module's docstring)."""
  b, c = 4 + a_in + f_in, 3 + a_in + f_in + a_w + f_w
  return b >= c and c > 4 and e >= g and g_scatter > b


def _undoes_a_slice(eqn) -> bool:
  config = eqn.params["padding_config"]
  shape = eqn.invars[0].aval.shape
  padded = [d for d, (lo, hi, inner) in enumerate(config) if (lo, hi, inner) != (0, 0, 0)]
  return (len(shape) >= 3 and len(padded) == 1 and padded[0] != len(shape) - 1 and
          tuple(config[padded[0]]) == (0, 1, 0))


def _state_shaped(v, state_shapes: set) -> bool:
  shape = tuple(v.aval.shape)
  return shape in state_shapes or tuple(reversed(shape)) in state_shapes


def _gradient_buffer(jaxpr, v, readers: dict, state_shapes: set):
  """The value XLA writes the weight gradient's product into: the product's result, or what
  it becomes through the transposes XLA folds into the product (liveness._folded_transposes:
  a tied table's, transposed for ``table.T``'s cotangent and back)."""
  while True:
    users = [jaxpr.eqns[j] for j in readers.get(v, ())]
    if (len(users) == 1 and users[0].primitive.name == "transpose" and
        _state_shaped(users[0].outvars[0], state_shapes)):
      v = users[0].outvars[0]
      continue
    return v
