"""GPT-2 small in plain JAX: an AdamW training step, and one-token decoding with a KV cache.

124 M parameters (12 layers, 12 heads, width 768, vocabulary 50257, context 1024): pre-LayerNorm
blocks, causal softmax attention written with jnp (no fused kernel), GELU MLP, tied embeddings,
bf16 compute with float32 master weights, AdamW (weight decay on matrices) written out, synthetic
tokens. ``--decode`` times the one-token step instead (bf16 weights, a per-layer KV cache updated
in place, greedy next token): the launch-bound case. ``--scan`` stacks the layers and runs them
with ``lax.scan`` (a while loop in the compiled step) instead of unrolling them.

It compares ``jax.jit``'s default (XLA's own CUDA-graph settings) with ``dtenjax.jit`` modes in one
process, the default first; on a CPU graphs do not apply and ``--tiny`` is a seconds-long check.

  python examples/gpt2_train.py --batch 8 --steps 10
  python examples/gpt2_train.py --decode --batch 8 --steps 200
  python examples/gpt2_train.py --tiny
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dtenjax

DT = jnp.bfloat16
CONFIGS = {
    "small": {"vocab": 50257, "ctx": 1024, "layers": 12, "heads": 12, "width": 768},
    "tiny": {"vocab": 256, "ctx": 32, "layers": 2, "heads": 2, "width": 32},
}


def init_params(seed: int, cfg, scan: bool = False):
  """GPT-2 parameters (float32, drawn with numpy: no RNG kernels to compile). ``scan``: the
  blocks stacked along a leading layer axis."""
  d, n_layers = cfg["width"], cfg["layers"]
  rng = np.random.default_rng(seed)
  std, proj_std = 0.02, 0.02 / math.sqrt(2 * n_layers)

  def normal(shape, s):
    return jnp.asarray(rng.standard_normal(shape, np.float32) * s)

  def ln():
    return {"g": jnp.ones(d), "b": jnp.zeros(d)}

  blocks = [{"ln1": ln(), "ln2": ln(),
             "qkv": {"w": normal((d, 3 * d), std), "b": jnp.zeros(3 * d)},
             "out": {"w": normal((d, d), proj_std), "b": jnp.zeros(d)},
             "fc": {"w": normal((d, 4 * d), std), "b": jnp.zeros(4 * d)},
             "proj": {"w": normal((4 * d, d), proj_std), "b": jnp.zeros(d)}}
            for _ in range(n_layers)]
  if scan:
    blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
  return {"wte": normal((cfg["vocab"], d), std), "wpe": normal((cfg["ctx"], d), 0.01),
          "blocks": blocks, "ln_f": ln()}


def _ln(x, p, eps=1e-5):
  xf = x.astype(jnp.float32)
  mean = xf.mean(-1, keepdims=True)
  var = ((xf - mean) ** 2).mean(-1, keepdims=True)
  return ((xf - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]).astype(DT)


def _dense(x, p):
  return jnp.dot(x, p["w"].astype(DT), preferred_element_type=jnp.float32).astype(DT) + \
      p["b"].astype(DT)


def _block(x, blk, heads):
  b, t, d = x.shape
  hd = d // heads
  qkv = _dense(_ln(x, blk["ln1"]), blk["qkv"]).reshape(b, t, 3, heads, hd)
  q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))      # [b, h, t, hd]
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
  causal = jnp.tril(jnp.ones((t, t), bool))
  p = jax.nn.softmax(jnp.where(causal, s, -1e30), axis=-1).astype(DT)
  a = jnp.einsum("bhqk,bhkd->bhqd", p, v).transpose(0, 2, 1, 3).reshape(b, t, d)
  x = x + _dense(a, blk["out"])
  h = jax.nn.gelu(_dense(_ln(x, blk["ln2"]), blk["fc"]))
  return x + _dense(h, blk["proj"])


def forward(params, tokens, cfg):
  """Logits (float32) of ``tokens`` [batch, time]."""
  t = tokens.shape[1]
  x = (params["wte"][tokens] + params["wpe"][:t]).astype(DT)
  if isinstance(params["blocks"], dict):                       # stacked: lax.scan over layers
    x, _ = jax.lax.scan(lambda h, blk: (_block(h, blk, cfg["heads"]), None), x,
                        params["blocks"])
  else:
    for blk in params["blocks"]:
      x = _block(x, blk, cfg["heads"])
  x = _ln(x, params["ln_f"])
  return jnp.dot(x, params["wte"].astype(DT).T, preferred_element_type=jnp.float32)


def make_train_step(cfg, lr=3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1):
  """step(params, opt_state, tokens) -> (params, opt_state, loss): next-token cross entropy,
  AdamW. ``opt_state`` is ``init_opt_state(params)``."""

  def loss_fn(params, tokens):
    logits = forward(params, tokens[:, :-1], cfg)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

  def step(params, opt_state, tokens):
    m, v, count = opt_state
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    count = count + 1
    m = jax.tree.map(lambda m_, g: b1 * m_ + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v_, g: b2 * v_ + (1 - b2) * g * g, v, grads)
    c1, c2 = 1 - b1 ** count, 1 - b2 ** count

    def update(p, m_, v_):
      decay = weight_decay * p if p.ndim >= 2 else 0.0
      return p - lr * ((m_ / c1) / (jnp.sqrt(v_ / c2) + eps) + decay)
    params = jax.tree.map(update, params, m, v)
    return params, (m, v, count), loss
  return step


def init_opt_state(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return zeros, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32)


def init_cache(cfg, batch: int):
  """Per-layer (keys, values), each [batch, ctx, heads, head_dim] bf16."""
  hd = cfg["width"] // cfg["heads"]
  shape = (batch, cfg["ctx"], cfg["heads"], hd)
  return [(jnp.zeros(shape, DT), jnp.zeros(shape, DT)) for _ in range(cfg["layers"])]


def make_decode_step(cfg):
  """decode(params, cache, tokens [batch], pos) -> (next tokens, cache, next pos): one token per
  sequence, attending to the cache up to ``pos`` (an int32 scalar, kept on the device: the next
  position wraps at the context length); ``params`` unrolled (a list of blocks), bf16 or f32."""
  heads = cfg["heads"]

  def decode(params, cache, tokens, pos):
    b, d = tokens.shape[0], cfg["width"]
    hd = d // heads
    x = (params["wte"][tokens] + params["wpe"][pos]).astype(DT)          # [b, d]
    new_cache = []
    for blk, (kc, vc) in zip(params["blocks"], cache):
      qkv = _dense(_ln(x, blk["ln1"]), blk["qkv"]).reshape(b, 3, heads, hd)
      kc = jax.lax.dynamic_update_slice(kc, qkv[:, None, 1], (0, pos, 0, 0))
      vc = jax.lax.dynamic_update_slice(vc, qkv[:, None, 2], (0, pos, 0, 0))
      s = jnp.einsum("bhd,bthd->bht", qkv[:, 0], kc,
                     preferred_element_type=jnp.float32) / math.sqrt(hd)
      s = jnp.where(jnp.arange(cfg["ctx"]) <= pos, s, -1e30)
      p = jax.nn.softmax(s, axis=-1).astype(DT)
      a = jnp.einsum("bht,bthd->bhd", p, vc).reshape(b, d)
      x = x + _dense(a, blk["out"])
      x = x + _dense(jax.nn.gelu(_dense(_ln(x, blk["ln2"]), blk["fc"])), blk["proj"])
      new_cache.append((kc, vc))
    x = _ln(x, params["ln_f"])
    logits = jnp.dot(x, params["wte"].astype(DT).T, preferred_element_type=jnp.float32)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), new_cache, (pos + 1) % cfg["ctx"]
  return decode


def make_generate(cfg, n_tokens: int):
  """generate(params, cache, tokens, pos) -> (tokens [n, batch], cache, next pos): ``n_tokens``
  decode steps in one ``lax.fori_loop`` (a while loop on the device when CUDA graphs record
  WHILE)."""
  decode = make_decode_step(cfg)

  def generate(params, cache, tokens, pos):
    def body(i, carry):
      cache, tok, pos, out = carry
      tok, cache, pos = decode(params, cache, tok, pos)
      return cache, tok, pos, out.at[i].set(tok)
    out = jnp.zeros((n_tokens, tokens.shape[0]), jnp.int32)
    cache, _, pos, out = jax.lax.fori_loop(0, n_tokens, body, (cache, tokens, pos, out))
    return out, cache, pos
  return generate


def synthetic_tokens(seed: int, batch: int, cfg):
  """[batch, ctx + 1] random token ids (int32)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, cfg["vocab"], (batch, cfg["ctx"] + 1)), jnp.int32)


def n_params(params) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def _time(fn, state, steps, repeats=3):
  """Median seconds per step over ``repeats`` blocks; ``fn(state) -> state`` threads the state."""
  state = fn(state)
  jax.block_until_ready(state)
  per = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      state = fn(state)
    jax.block_until_ready(state)
    per.append((time.perf_counter() - t0) / steps)
  return float(np.median(per)), state


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="GPT-2 small: jax.jit's default vs dtenjax.jit modes")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("--decode", action="store_true", help="time the one-token decode step")
  ap.add_argument("--scan", action="store_true", help="layers with lax.scan (training only)")
  ap.add_argument("--modes", default="auto,off",
                  help="dtenjax.jit modes after jax.jit's default (comma list)")
  ap.add_argument("--tiny", action="store_true", help="a seconds-long CPU configuration")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  cfg = CONFIGS["tiny" if args.tiny else "small"]
  if args.tiny:
    args.batch, args.steps = 2, 3
  modes = [m for m in args.modes.split(",") if m]
  for m in modes:
    dtenjax.CudaGraphPolicy.from_mode(m)          # a clear error for a bad mode, before compiling
  params = init_params(0, cfg, scan=args.scan and not args.decode)
  tokens = synthetic_tokens(1, args.batch, cfg)
  print(f"GPT-2 {'tiny' if args.tiny else 'small'}: {n_params(params) / 1e6:.1f} M parameters, "
        f"batch {args.batch}, {'decode (1 token, KV cache)' if args.decode else 'training'}, "
        f"on {jax.devices()[0].device_kind}", flush=True)
  results = []
  # one function object for every mode: a mode that passes XLA nothing reuses jax.jit's executable
  fn = make_decode_step(cfg) if args.decode else make_train_step(cfg)
  pb = jax.tree.map(lambda x: x.astype(DT), params)
  for name in ["jax.jit"] + modes:
    if args.decode:
      jitted = (jax.jit(fn, donate_argnums=1) if name == "jax.jit"
                else dtenjax.jit(fn, name, donate_argnums=1))
      tok0 = tokens[:, 0].astype(jnp.int32)

      def one(state, jitted=jitted, pb=pb):
        cache, tok, pos = state
        tok, cache, pos = jitted(pb, cache, tok, pos)
        return cache, tok, pos
      secs, _ = _time(one, (init_cache(cfg, args.batch), tok0, jnp.int32(0)), args.steps)
      unit = f"{args.batch / secs:.1f} tokens/s"
    else:
      jitted = (jax.jit(fn, donate_argnums=(0, 1)) if name == "jax.jit"
                else dtenjax.jit(fn, name, donate_argnums=(0, 1)))

      def one(state, jitted=jitted):
        p, o, _ = state
        return jitted(p, o, tokens)
      p0 = jax.tree.map(jnp.array, params)
      secs, state = _time(one, (p0, init_opt_state(p0), jnp.zeros(())), args.steps)
      unit = f"{args.batch * cfg['ctx'] / secs:.0f} tokens/s, loss {float(state[2]):.4f}"
    decision = getattr(jitted, "decision", None)
    policy = ("jax.jit's default" if decision is None else decision.policy.describe()
              if jax.default_backend() == "gpu" else "a plain jax.jit on this backend")
    results.append({"mode": name, "ms_per_step": 1e3 * secs, "policy": policy})
    print(f"{name}: {1e3 * secs:.3f} ms/step, {unit} ({results[-1]['policy']})", flush=True)
  base = results[0]["ms_per_step"]
  for r in results[1:]:
    print(f"{r['mode']} vs jax.jit's default: {base / r['ms_per_step']:.3f}x")
  if jax.default_backend() != "gpu":
    print(f"note: backend {jax.default_backend()!r}: CUDA graphs do not apply.")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"config": {**cfg, "batch": args.batch, "decode": args.decode,
                            "scan": args.scan}, "results": results}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
