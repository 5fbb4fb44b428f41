"""The planner's ``sequence`` role (context parallelism, #39 item 4): the sequence dimension found
through the step, the role chosen where the batch cannot be split over the devices and not where
it can, ``plan.jit``'s values against plain ``jax.jit``, its compiled memory and collective bytes
against the prediction, and the errors for a ``sequence`` axis that cannot shard the step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import stepgraph
from tests import compile_only

VOCAB, D, HEADS, FFN, LAYERS = 128, 64, 2, 128, 2


def _model(batch: int, seq: int, *, scan: bool = True, attention: bool = True,
           remat: bool = False, kv_heads: int = HEADS):
  """A causal decoder step (AdamW), its layers a lax.scan over stacked weights or a loop, each
  layer inside jax.checkpoint with ``remat``; fewer ``kv_heads`` than heads: grouped-query
  attention (the keys' and values' heads repeated)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  hd = D // HEADS
  lead = (LAYERS,) if scan else ()
  layer = lambda: {"wq": s(*lead, D, HEADS, hd), "wk": s(*lead, D, kv_heads, hd),
                   "wv": s(*lead, D, kv_heads, hd), "wo": s(*lead, HEADS, hd, D),
                   "w1": s(*lead, D, FFN), "w2": s(*lead, FFN, D)}
  params = {"embed": s(VOCAB, D), "unembed": s(D, VOCAB),
            **({"layers": layer()} if scan else {f"l{i}": layer() for i in range(LAYERS)})}

  def block(x, p):
    if attention:
      q = jnp.einsum("bsd,dhk->bshk", x, p["wq"])
      k = jnp.repeat(jnp.einsum("bsd,dhk->bshk", x, p["wk"]), HEADS // kv_heads, axis=2)
      v = jnp.repeat(jnp.einsum("bsd,dhk->bshk", x, p["wv"]), HEADS // kv_heads, axis=2)
      scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(hd)
      scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
      attn = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, -1), v)
      x = x + jnp.einsum("bqhk,hkd->bqd", attn, p["wo"])
    return x + jnp.einsum("bsf,fd->bsd", jax.nn.gelu(jnp.einsum("bsd,df->bsf", x, p["w1"])),
                          p["w2"])

  if remat:
    block = jax.checkpoint(block)

  def loss(p, tokens):
    x = jnp.take(p["embed"], tokens, axis=0)
    if scan:
      x, _ = jax.lax.scan(lambda x, lp: (block(x, lp), None), x, p["layers"])
    else:
      for i in range(LAYERS):
        x = block(x, p[f"l{i}"])
    logits = jnp.einsum("bsd,dv->bsv", x, p["unembed"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1, 1)).mean()

  tx = optax.adamw(1e-3)

  def step(p, opt, tokens):
    value, grads = jax.value_and_grad(loss)(p, tokens)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, value
  return step, (params, jax.eval_shape(tx.init, params),
                jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def _facts(step, args):
  return stepgraph.read_step(step, args, (2,)).sequence


def test_the_sequence_dimension_is_found_through_the_step():
  # the tokens' dimension 1 reaches both operands of the scores and, through the softmax, the
  # product with the values: one attention per layer, counted per loop trip when scanned
  for scan in (True, False):
    step, args = _model(2, 64, scan=scan)
    facts = _facts(step, args)
    assert facts is not None
    assert facts.length == 64
    assert list(facts.dims.values()) == [1]
    kv = 2 * 64 * D * 4                       # one layer's keys (batch 2 x 64 x D, f32)
    assert sum(a.repeats for a in facts.attention) == LAYERS
    assert all(a.k_bytes == kv and a.v_bytes == kv for a in facts.attention)
  # inside jax.checkpoint the backward recomputes each layer's attention: its keys and values
  # are gathered again there
  step, args = _model(2, 64, remat=True)
  assert [a.recomputed for a in _facts(step, args).attention] == [False, True]
  # grouped-query attention: the keys and values are gathered before their heads are repeated
  step, args = _model(2, 64, kv_heads=1)
  assert [a.k_bytes for a in _facts(step, args).attention] == [2 * 64 * (D // HEADS) * 4]
  # no attention: sharding the tokens would be data parallelism by another name
  step, args = _model(2, 64, attention=False)
  assert _facts(step, args) is None


def _axes(p) -> dict[str, int]:
  return {a: s for a, s in zip(p.axis_names, p.mesh_shape) if s > 1}


def test_planner_chooses_sequence_only_where_the_batch_does_not_split():
  # 8 devices, a batch of 2 (or 1) long sequences: no mesh splits the batch over all devices,
  # and the rest of them would compute the same step; the sequence axis makes them useful
  for batch in (1, 2):
    step, args = _model(batch, 512)
    p = dtenjax.plan(step, *args)
    axes = _axes(p)
    assert axes.get("sequence", 1) * axes.get("data", 1) * axes.get("fsdp", 1) == 8, axes
    assert axes.get("sequence", 1) >= 8 // batch, axes
    tokens = p.leaves[-1]
    assert "sequence" in str(tokens.spec) and "sequence" in tokens.reason
    assert any(n.startswith(f"sequence: the batch's {batch} sequences of 512 tokens") and
               f"{LAYERS} attention calls per step" in n for n in p.notes), p.notes
  # a batch that splits over every device: the sequence axis is not worth its gathers
  step, args = _model(8, 512)
  p = dtenjax.plan(step, *args)
  assert "sequence" not in _axes(p), _axes(p)


def _real(args, seed=0):
  """Concrete arguments, made with numpy (no one-device programs to compile)."""
  params, opt, batch = args
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype), params)
  opt = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), opt)
  return params, opt, rng.integers(0, VOCAB, batch.shape).astype(np.int32)


def test_plan_jit_matches_plain_jit_and_its_prediction():
  step, args = _model(2, 256)
  p = dtenjax.plan(step, *args, mesh={"data": 2, "sequence": 4})
  real = _real(args)
  # machine code unoptimised (tests/compile_only.py): the same HLO, the same values
  want = jax.jit(step, compiler_options=compile_only.LLVM_O0)(*real)
  got = p.jit(step, compiler_options=compile_only.LLVM_O0)(*p.shard(*real))
  # float32: XLA sums the sharded products' partial results in another order
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-6)
  # what XLA compiled for plan.jit against the prediction: the keys' and values' all-gathers
  # and the reductions (their cotangents', the gradients' over 'sequence' and over 'data');
  # the run's compile cache has the program plan.jit ran
  check = p.check(step, *args, compiler_options=compile_only.LLVM_O0)
  assert check.compiled_bytes.get("all_gather", 0) > 0
  for kind in ("all_gather", "all_reduce"):
    assert check.kind_errors[kind] <= 0.10, check
  assert check.memory_error <= 0.10, check


def test_beside_fsdp_and_under_remat_the_prediction_holds():
  # weights sharded over 'fsdp' (pinned: the solver keeps this small model replicated), the
  # sequence over 'sequence', each layer rematerialised: the weights' per-layer gathers, the
  # keys' and values' gathers (forward and recomputation) and the reductions compile to the
  # priced bytes; memory within 10 % (compile only)
  def pin(path, w):
    first = 1 if "layers" in jax.tree_util.keystr(path) else 0
    d = max(range(first, w.ndim), key=lambda i: w.shape[i])
    return P(*[("fsdp" if i == d else None) for i in range(w.ndim)])
  step, args = _model(2, 256, remat=True)
  p = dtenjax.plan(step, *args, mesh={"fsdp": 2, "sequence": 4},
                   pinned=(jax.tree_util.tree_map_with_path(pin, args[0]), None, None))
  assert "fsdp" in str(p.leaves[0].spec)
  check = p.check(step, *args, compiler_options=compile_only.LLVM_O0)
  for kind in ("all_gather", "all_reduce"):
    assert check.kind_errors[kind] <= 0.10, check
  assert check.memory_error <= 0.10, check


def test_a_sequence_axis_that_cannot_shard_the_step_is_refused():
  step, args = _model(2, 100)
  with pytest.raises(dtenjax.PlacementError, match=r"'sequence' axis of 8 devices does not divide "
                     r"the sequence length 100; give a 'sequence' size that divides it \(of "
                     r"those dividing 8: \[1, 2, 4\]"):
    dtenjax.plan(step, *args, mesh={"sequence": 8})
  step, args = _model(2, 64, attention=False)
  with pytest.raises(dtenjax.PlacementError, match="no self-attention"):
    dtenjax.plan(step, *args, mesh={"data": 2, "sequence": 4})
