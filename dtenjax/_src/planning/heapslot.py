"""XLA:CPU's fourth heap slot of a sliced loss's vocabulary chain.

A next-token loss slices its logits (``logits[:, :-1]``); the backward pads the softmax's
gradient back (``P``, ``[b, s, V]``) and two products read the pad: the input gradient's (through
a bitcast copy of the pad, ``B``) and the weight gradient's (through its transposed copy, ``C``).
With the logits (``L``) these are the chain's four ``[b·s, V]`` buffers, beside three
``[b, s-1, V]`` ones (the slice, ``exp(s - max)`` ``E``, the softmax's gradient ``G`` with the
labels' scatter written in place). At most three are live at once, yet XLA:CPU's heap can give
them four slots.

The mechanism is XLA's best-fit heap (``GlobalDecreasingSizeBestFitHeap``, kSpatial: the largest
buffer first, then the longest interval on the heap's own clock, then the lowest value id; the
clock advances one tick per allocation and per free, at each instruction the allocations first).
Where the chain's buffers are the largest around it, they are placed among themselves first. XLA
schedules ``P``, ``B``, ``C``, the input gradient's product, the weight gradient's product one
instruction apart; on the clock ``P`` spans 4 ticks, ``B`` 4 + ``a_in`` + ``f_in`` and ``C``
3 + ``a_in`` + ``f_in`` + ``a_w`` + ``f_w``, where ``a_in`` / ``a_w`` count the products' results
the heap allocates (a result written into an output's buffer is not the heap's) and ``f_in`` /
``f_w`` the heap buffers they free (a weight gathered for the input gradient's product; the
activation the weight gradient's product reads last). When ``B`` is placed first (``B`` >= ``C``,
ties to ``B``, the lower id) and ``C`` before ``P`` (``C`` > ``P``, ties to ``P``), ``B`` shares
``L``'s slot, ``C`` the next, ``P`` the third. Of the three smaller buffers, ``E`` (live with
``L`` only) and ``G`` (live with ``E``, then with ``B`` and ``P``) are placed by their own
intervals: where ``E`` goes first it takes ``C``'s slot and ``G`` finds no free slot of the
three: a fourth. Where ``G`` goes first it takes ``C``'s slot (``C`` starts after it ends), ``E``
then ``P``'s, and the chain fits in three. Both span 3 ticks, plus one for each small value XLA
makes around them that is a heap buffer allocated or freed inside the interval (ties go to
``E``, the lower id): in ``E``'s, the labels' gather indices, the rows' maximum and sum, and the
loss's partial sum where XLA:CPU makes it one YNN reduction before ``G`` (a reduce-window tree
runs after the scatter); in ``G``'s, the scatter's indices and its updates (a constant XLA
broadcasts early in the forward). ``E`` spans 3 to 7 ticks and ``G`` 3 to 6 on the compiles read.
Whether such a value is a heap buffer is XLA's buffer assignment: it first tries the outputs'
allocations of at least its size that hold nothing live over its range, and those are filled by
values the jaxpr does not have: FSDP's all-gathered weights, and SPMD's ``partition-id``, which
takes the loss output's 4-byte allocation (leaving the partial sum on the heap) where its last
reader is scheduled before the loss's division. The model sees none of that; it assumes ``E``
first, as on every TP compile read, so :func:`holds_a_fourth` is the ``B`` / ``C`` / ``P`` half,
a necessary condition. Read from XLA's own intervals and placement order
(``TF_CPP_VMODULE=heap_simulator=2``; docs/benchmarks.md, lossheap7 and rows10): a fourth slot
on GPT-2 and Llama 1B under TP (8-32 devices), Llama 1B under FSDP x TP on 16 and 32 devices and
the small GPT-2 under TP; three on GPT-2 under FSDP x TP (the bench's on 8 and a small one:
``B``, ``C``, ``P`` as above, but ``G`` 4 ticks to ``E``'s 3), on GPT-2 under DP and with a
tensor-sharded table (its whole gradient a heap buffer), and on Llama-shaped steps whose input
gradient is written into an output's buffer. Priced as an upper bound instead, wherever XLA
may place it (any ``a_in`` and ``a_w``, or ``a_w`` 0 wherever the FSDP x TP gradient's piece fits
an output), the slot puts 24 (or 16) of the bench's 165 rows more than 10 % over, where XLA
places three slots for the buffer-assignment reasons above (docs/benchmarks.md, fifteenth round).

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


def holds_a_fourth(a_in: bool, f_in: bool, a_w: bool, f_w: bool) -> bool:
  """Whether kSpatial places the chain in four slots, from the clock's ticks of ``B``
  (4 + a_in + f_in), ``C`` (3 + a_in + f_in + a_w + f_w) and ``P`` (4): ``B`` before ``C`` and
  ``C`` before ``P``; ``E`` before ``G`` is assumed (see the module's docstring)."""
  b, c = 4 + a_in + f_in, 3 + a_in + f_in + a_w + f_w
  return b >= c and c > 4


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
