"""Training steps the whole-step planner is checked and measured on (bench/step_planner.py,
tests/test_step_planner.py): a two-layer MLP, a GPT-2-shaped flax model, and a Llama-shaped
decoder written as a plain pytree with its layers stacked under ``lax.scan`` (as MaxText's
``scan_layers``), at any size; abstract arguments, so an 8B model costs nothing to describe.

Each ``*_step(...)`` returns ``(step, args)``: ``step(params, opt_state, batch) -> (params,
opt_state, loss)`` with AdamW, and ``args`` as ``jax.ShapeDtypeStruct`` pytrees.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _adamw_step(loss):
  tx = optax.adamw(1e-3)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, tx


def mlp_step(d: int = 256, f: int = 1024, layers: int = 2, batch: int = 32, seq: int = 128,
             dtype=jnp.float32):
  """A residual MLP: ``h + gelu(h @ w1) @ w2`` per layer, mean squared output."""
  def loss(p, x):
    h = x
    for i in range(layers):
      h = h + jax.nn.gelu(h @ p[f"l{i}"]["w1"]) @ p[f"l{i}"]["w2"]
    return jnp.mean(h.astype(jnp.float32) ** 2)

  params = {f"l{i}": {"w1": jax.ShapeDtypeStruct((d, f), dtype),
                      "w2": jax.ShapeDtypeStruct((f, d), dtype)} for i in range(layers)}
  step, tx = _adamw_step(loss)
  opt = jax.eval_shape(tx.init, params)
  return step, (params, opt, jax.ShapeDtypeStruct((batch, seq, d), dtype))


def _rms(x, w):
  """RMSNorm in float32, cast back (the Llama-shaped steps' norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 ** 2, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def llama_config(size: str) -> dict:
  """Llama-shaped sizes: "tiny" (tests), "1b" and "8b" (Llama 3's 8B shape)."""
  return {
      "tiny": dict(vocab=512, d=128, heads=4, kv_heads=2, ffn=384, layers=2),
      "small": dict(vocab=2048, d=256, heads=8, kv_heads=4, ffn=768, layers=4),
      "1b": dict(vocab=32000, d=2048, heads=32, kv_heads=8, ffn=5632, layers=22),
      "8b": dict(vocab=128256, d=4096, heads=32, kv_heads=8, ffn=14336, layers=32),
  }[size]


def llama_step(size: str = "tiny", batch: int = 8, seq: int = 128, dtype=jnp.bfloat16,
               remat: bool = False):
  """A Llama-shaped decoder (RMSNorm, grouped-query attention with kernels of shape
  (d, heads, head_dim), SwiGLU MLP, untied embedding and unembedding), layers stacked and run by
  ``lax.scan``; next-token cross-entropy."""
  c = llama_config(size)
  d, h, kv, ffn, vocab, n = c["d"], c["heads"], c["kv_heads"], c["ffn"], c["vocab"], c["layers"]
  hd = d // h
  s = jax.ShapeDtypeStruct
  params = {
      "embed": s((vocab, d), dtype),
      "layers": {
          "attn_norm": s((n, d), dtype), "mlp_norm": s((n, d), dtype),
          "wq": s((n, d, h, hd), dtype), "wk": s((n, d, kv, hd), dtype),
          "wv": s((n, d, kv, hd), dtype), "wo": s((n, h, hd, d), dtype),
          "w_gate": s((n, d, ffn), dtype), "w_up": s((n, d, ffn), dtype),
          "w_down": s((n, ffn, d), dtype),
      },
      "final_norm": s((d,), dtype),
      "unembed": s((d, vocab), dtype),
  }

  def layer(x, p):
    y = _rms(x, p["attn_norm"])
    q = jnp.einsum("bsd,dhk->bshk", y, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", y, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", y, p["wv"])
    k = jnp.repeat(k, h // kv, axis=2)
    v = jnp.repeat(v, h // kv, axis=2)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32) / jnp.sqrt(hd)
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1).astype(x.dtype)
    attn = jnp.einsum("bhqs,bshk->bqhk", probs, v)
    x = x + jnp.einsum("bqhk,hkd->bqd", attn, p["wo"])
    y = _rms(x, p["mlp_norm"])
    g = jnp.einsum("bsd,df->bsf", y, p["w_gate"])
    u = jnp.einsum("bsd,df->bsf", y, p["w_up"])
    x = x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(g) * u, p["w_down"])
    return x, None

  body = jax.checkpoint(layer) if remat else layer

  def loss(p, tokens):
    x = jnp.take(p["embed"], tokens, axis=0)
    x, _ = jax.lax.scan(body, x, p["layers"])
    logits = jnp.einsum("bsd,dv->bsv", _rms(x, p["final_norm"]), p["unembed"])
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  step, tx = _adamw_step(loss)
  opt = jax.eval_shape(tx.init, params)
  return step, (params, opt, jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def gpt2_step(batch: int = 8, seq: int = 128, layers: int = 12, d: int = 768, heads: int = 12,
              vocab: int = 50304):
  """GPT-2 small in flax linen (tied embeddings, MultiHeadDotProductAttention kernels of shape
  (features, heads, head_dim)); shrink it with fewer layers or a smaller width."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      y = nn.LayerNorm()(x)
      y = nn.MultiHeadDotProductAttention(num_heads=heads)(y, y, mask=nn.make_causal_mask(
          jnp.ones(x.shape[:2])))
      x = x + y
      y = nn.LayerNorm()(x)
      y = nn.Dense(4 * d)(y)
      return x + nn.Dense(d)(nn.gelu(y))

  class GPT(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      emb = nn.Embed(vocab, d)
      x = emb(tokens) + self.param("pos", nn.initializers.normal(0.02), (seq, d))
      for _ in range(layers):
        x = Block()(x)
      return emb.attend(nn.LayerNorm()(x))

  model = GPT()
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)

  def loss(p, tokens):
    logits = model.apply(p, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  step, tx = _adamw_step(loss)
  opt = jax.eval_shape(tx.init, params)
  return step, (params, opt, tokens)


def decoder_70b(batch: int, seq: int = 2048):
  """A 70B-shaped decoder (Llama 3 70B's widths: d 8192, 64 heads, 8 kv heads, ffn 28672, 80
  layers, vocabulary 128256), layers stacked for lax.scan under jax.checkpoint, bf16, AdamW;
  abstract arguments."""
  vocab, d, h, kv, ffn, n = 128256, 8192, 64, 8, 28672, 80
  hd = d // h
  s = jax.ShapeDtypeStruct
  bf = jnp.bfloat16
  params = {"embed": s((vocab, d), bf), "unembed": s((d, vocab), bf), "norm": s((d,), bf),
            "layers": {"wq": s((n, d, h, hd), bf), "wk": s((n, d, kv, hd), bf),
                       "wv": s((n, d, kv, hd), bf), "wo": s((n, h, hd, d), bf),
                       "w_gate": s((n, d, ffn), bf), "w_up": s((n, d, ffn), bf),
                       "w_down": s((n, ffn, d), bf), "ln1": s((n, d), bf), "ln2": s((n, d), bf)}}

  def layer(x, p):
    y = _rms(x, p["ln1"])
    q = jnp.einsum("bsd,dhk->bshk", y, p["wq"])
    k = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wk"]), h // kv, axis=2)
    v = jnp.repeat(jnp.einsum("bsd,dhk->bshk", y, p["wv"]), h // kv, axis=2)
    a = jax.nn.softmax(jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32), -1).astype(bf)
    x = x + jnp.einsum("bqhk,hkd->bqd", jnp.einsum("bhqs,bshk->bqhk", a, v), p["wo"])
    y = _rms(x, p["ln2"])
    g = jax.nn.silu(jnp.einsum("bsd,df->bsf", y, p["w_gate"]))
    return x + jnp.einsum("bsf,fd->bsd", g * jnp.einsum("bsd,df->bsf", y, p["w_up"]),
                          p["w_down"]), None

  def loss(p, tokens):
    x, _ = jax.lax.scan(jax.checkpoint(layer), jnp.take(p["embed"], tokens, axis=0), p["layers"])
    logits = jnp.einsum("bsd,dv->bsv", _rms(x, p["norm"]), p["unembed"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  tx = optax.adamw(1e-4)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, jax.eval_shape(tx.init, params), s((batch, seq), jnp.int32))
