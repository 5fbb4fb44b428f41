"""A small Llama-shaped decoder with its layers stacked for ``lax.scan``, and two training steps
over it: pipelined over a ``stage`` mesh axis (:func:`dtenjax.pipeline`) and the same step
unpipelined, a gradient-accumulation loop over the same micro-batches (the reference a user
would otherwise write). Both reduce gradients over the ``data`` axis with dtenjax's
reproducible sum and update with optax's adamw.

Shared by ``tests/test_pipeline*.py`` and ``bench/pipeline.py``. The reference uses nothing of
the pipeline: plain ``lax.scan`` over every layer, ``jax.value_and_grad`` per micro-batch,
gradients summed in micro-batch order and divided by their number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import dtenjax

CONFIG = dict(vocab=64, d=32, heads=4, kv_heads=2, ffn=64, layers=16, seq=8)


def init(seed: int = 0, **overrides) -> dict:
  """Parameters: ``embed``, ``layers`` (every leaf stacked ``[layers, ...]``), ``head``."""
  c = {**CONFIG, **overrides}
  d, h, kv, f, n, vocab = c["d"], c["heads"], c["kv_heads"], c["ffn"], c["layers"], c["vocab"]
  hd = d // h
  rng = np.random.default_rng(seed)
  w = lambda *shape: jnp.asarray(rng.normal(0, 0.5 / np.sqrt(shape[-2] if len(shape) > 2 else d),
                                            shape), jnp.float32)
  return {
      "embed": w(vocab, d),
      "layers": {
          "attn_norm": jnp.ones((n, d)), "mlp_norm": jnp.ones((n, d)),
          "wq": w(n, d, h, hd), "wk": w(n, d, kv, hd), "wv": w(n, d, kv, hd),
          "wo": w(n, h, hd, d), "w_gate": w(n, d, f), "w_up": w(n, d, f), "w_down": w(n, f, d),
      },
      "head": {"norm": jnp.ones((d,)), "unembed": w(d, vocab)},
  }


def tokens(batch: int, seed: int = 1, **overrides) -> jax.Array:
  c = {**CONFIG, **overrides}
  return jnp.asarray(np.random.default_rng(seed).integers(0, c["vocab"], (batch, c["seq"] + 1)),
                     jnp.int32)


def _rms(x, w):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w


def body(x, p):
  """One decoder layer, as ``lax.scan`` takes it: ``(h, layer) -> (h, None)``."""
  h, kv = p["wq"].shape[1], p["wk"].shape[1]
  y = _rms(x, p["attn_norm"])
  q = jnp.einsum("bsd,dhk->bshk", y, p["wq"])
  k = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wk"]), h // kv, axis=2)
  v = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wv"]), h // kv, axis=2)
  scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1]).astype(np.float32)
  mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
  probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
  x = x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", probs, v), p["wo"])
  y = _rms(x, p["mlp_norm"])
  x = x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"]), p["w_down"])
  return x, None


def loss_fn(head, x, targets):
  """Final norm, unembedding and next-token cross-entropy of one micro-batch."""
  logits = _rms(x, head["norm"]) @ head["unembed"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def embed(table, toks):
  return jnp.take(table, toks, axis=0)


def _data_mean(tree, data_axis, data_size, reproducible):
  if reproducible and isinstance(tree, dict) and "layers" in tree:
    # One call per vma type: leaves bucketed together come back with the union of their types.
    return {k: _data_mean(v, data_axis, data_size, reproducible) for k, v in tree.items()}
  if reproducible:
    tree = dtenjax.all_reduce(tree, data_axis, reproducible=True)
  else:
    tree = jax.tree.map(lambda a: lax.psum(a, data_axis), tree)
  return jax.tree.map(lambda a: a / data_size, tree)


def pipelined_step(pipe, tx, *, data_axis: str = "data", data_size: int = 1,
                   reproducible: bool = True):
  """``step(params, opt_state, tokens) -> (params, opt_state, loss)`` to run inside
  ``jax.shard_map`` over ``(pipe.axis, data_axis)``; ``params["layers"]`` is this device's share
  of ``pipe.to_stages(layers)``."""
  def step(params, opt_state, toks):
    params_d = dtenjax.compression.pvary(params, data_axis)     # per-device gradients

    def loss(p):
      return pipe(p["layers"], p["head"], embed(p["embed"], toks[:, :-1]), toks[:, 1:])

    value, grads = jax.value_and_grad(loss)(params_d)
    grads = _data_mean(grads, data_axis, data_size, reproducible)
    value = _data_mean(value, data_axis, data_size, reproducible)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def reference_step(microbatches, tx, *, data_axis: str = "data", data_size: int = 1,
                   reproducible: bool = True, layer=body):
  """The same step unpipelined (every layer on every device; inside ``jax.shard_map`` over
  ``data_axis``): embedding over the whole batch, then a gradient-accumulation loop over
  ``microbatches`` micro-batches through all layers (``layer``: the body, e.g. under
  ``jax.checkpoint`` as the pipelined step's)."""
  def step(params, opt_state, toks):
    p = dtenjax.compression.pvary(params, data_axis)
    x, embed_vjp = jax.vjp(lambda e: embed(e, toks[:, :-1]), p["embed"])
    split = lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:])
    xs, ts = split(x), split(toks[:, 1:])

    def micro(layers, head, xm, tm):
      return loss_fn(head, lax.scan(layer, xm, layers)[0], tm)

    def accumulate(acc, mb):
      xm, tm = mb
      value, g = jax.value_and_grad(micro, argnums=(0, 1, 2))(p["layers"], p["head"], xm, tm)
      loss_acc, gl, gh = acc
      return (loss_acc + value, jax.tree.map(jnp.add, gl, g[0]),
              jax.tree.map(jnp.add, gh, g[1])), g[2]

    zeros = jax.tree.map(jnp.zeros_like, (p["layers"], p["head"]))
    init = (dtenjax.compression.pvary(jnp.zeros((), jnp.float32), data_axis), *zeros)
    (loss_sum, gl, gh), dxs = lax.scan(accumulate, init, (xs, ts))
    mean = lambda t: jax.tree.map(lambda a: a / microbatches, t)
    (ge,) = embed_vjp(mean(dxs).reshape(x.shape))
    grads = {"embed": ge, "layers": mean(gl), "head": mean(gh)}
    grads = _data_mean(grads, data_axis, data_size, reproducible)
    value = _data_mean(mean(loss_sum), data_axis, data_size, reproducible)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def param_specs(params, stage_axis: str | None):
  """PartitionSpecs: the stacked layers split over ``stage_axis`` (None: replicated)."""
  return {"embed": P(), "head": jax.tree.map(lambda _: P(), params["head"]),
          "layers": jax.tree.map(lambda _: P(stage_axis), params["layers"])}


def opt_specs(opt_state, params, specs):
  """The optimizer state's PartitionSpecs: every subtree shaped like ``params`` (adam's moments)
  gets ``specs``, everything else (counts) is replicated."""
  shape = jax.tree.structure(params)

  def walk(node):
    if jax.tree.structure(node) == shape:
      return specs
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(*[walk(c) for c in node])
    if isinstance(node, (tuple, list)):
      return type(node)(walk(c) for c in node)
    return jax.tree.map(lambda _: P(), node)
  return walk(opt_state)
