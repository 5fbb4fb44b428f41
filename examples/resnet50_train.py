"""Train a ResNet-50 on synthetic ImageNet-shaped data in bf16, with dtenjax's CUDA-graph policy.

A functional ResNet-50 in plain JAX (bottleneck blocks [3, 4, 6, 3], NHWC, batch-statistics batch
norm), bf16 activations and weights in the forward pass with float32 master weights, SGD with
momentum, one jitted train step. It compiles the step with ``jax.jit`` (XLA's default CUDA-graph
settings, what JAX users run) first, then with each ``dtenjax.jit(step, cuda_graphs=mode)`` of
``--modes``, and prints images/s for each with the ratio to ``jax.jit``, what graph_report
PREDICTS per step (graph launches, ops launched one by one) and, on a GPU, what the profiler
OBSERVES. ``--tiny`` is a seconds-long configuration for CI (CPU).

``--pool slices`` writes the 3x3/2 max pooling as a maximum over nine strided slices instead of
``lax.reduce_window``: the same forward values, and a gradient made of elementwise selects
instead of XLA's select-and-scatter, which has no deterministic GPU implementation (so
``dtenjax.reproducible_step`` can compile the step).

  python examples/resnet50_train.py --batch 64 --steps 20
  python examples/resnet50_train.py --tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dtenjax
from dtenjax import testing

DT = jnp.bfloat16


def init_resnet(seed: int = 0, stages=(3, 4, 6, 3), width=64, num_classes=1000):
  """Parameters of a bottleneck ResNet (ResNet-50 with the defaults) as a nested dict (float32,
  He-normal convolutions drawn with numpy: no RNG kernels to compile)."""
  rng = np.random.default_rng(seed)

  def conv_w(kh, kw, cin, cout):
    std = np.sqrt(2.0 / (kh * kw * cin))
    return jnp.asarray(rng.standard_normal((kh, kw, cin, cout), np.float32) * std)

  def bn_p(c, gamma=1.0):
    return {"g": jnp.full((c,), gamma, jnp.float32), "b": jnp.zeros((c,), jnp.float32)}

  params = {"stem": {"w": conv_w(7, 7, 3, width), "bn": bn_p(width)}}
  cin = width
  blocks = []
  for s, n in enumerate(stages):
    mid = width * 2 ** s
    cout = mid * 4
    for b in range(n):
      blk = {"c1": conv_w(1, 1, cin, mid), "c2": conv_w(3, 3, mid, mid),
             "c3": conv_w(1, 1, mid, cout), "bn1": bn_p(mid), "bn2": bn_p(mid),
             "bn3": bn_p(cout, 0.0)}                    # zero-init last BN gamma
      if b == 0:
        blk["proj"] = conv_w(1, 1, cin, cout)
        blk["bnp"] = bn_p(cout)
      blocks.append(blk)
      cin = cout
  params["blocks"] = blocks
  params["fc"] = {"w": jnp.asarray(rng.standard_normal((cin, num_classes), np.float32) * 0.01),
                  "b": jnp.zeros((num_classes,), jnp.float32)}
  return params


def synthetic_batch(seed: int, batch: int, image: int, classes: int):
  """(images [batch, image, image, 3] bf16, labels [batch] int32), drawn with numpy."""
  rng = np.random.default_rng(seed)
  images = jnp.asarray(rng.standard_normal((batch, image, image, 3), np.float32)).astype(DT)
  return images, jnp.asarray(rng.integers(0, classes, (batch,)), jnp.int32)


def block_strides(stages):
  return [2 if (b == 0 and s > 0) else 1 for s, n in enumerate(stages) for b in range(n)]


def conv(x, w, stride=1):
  return jax.lax.conv_general_dilated(x, w.astype(DT), (stride, stride), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def bn(x, p, eps=1e-5):
  xf = x.astype(jnp.float32)
  mean = xf.mean(axis=(0, 1, 2))
  var = xf.var(axis=(0, 1, 2))
  return ((xf - mean) * jax.lax.rsqrt(var + eps) * p["g"] + p["b"]).astype(DT)


def max_pool_3x3_s2(x, pool: str = "reduce_window"):
  """3x3 max pooling, stride 2, SAME padding (NHWC)."""
  if pool == "reduce_window":
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
  if pool != "slices":
    raise ValueError(f"pool={pool!r}; use 'reduce_window' or 'slices'")
  _, h, w, _ = x.shape
  oh, ow = -(-h // 2), -(-w // 2)
  ph, pw = max((oh - 1) * 2 + 3 - h, 0), max((ow - 1) * 2 + 3 - w, 0)
  xp = jnp.pad(x, ((0, 0), (ph // 2, ph - ph // 2), (pw // 2, pw - pw // 2), (0, 0)),
               constant_values=-jnp.inf)
  out = None
  for i in range(3):
    for j in range(3):
      s = jax.lax.slice(xp, (0, i, j, 0), (xp.shape[0], i + 2 * (oh - 1) + 1,
                                           j + 2 * (ow - 1) + 1, xp.shape[3]), (1, 2, 2, 1))
      out = s if out is None else jnp.maximum(out, s)
  return out


def forward(params, images, strides, pool="reduce_window"):
  x = conv(images.astype(DT), params["stem"]["w"], 2)
  x = jax.nn.relu(bn(x, params["stem"]["bn"]))
  x = max_pool_3x3_s2(x, pool)
  for blk, stride in zip(params["blocks"], strides):
    y = jax.nn.relu(bn(conv(x, blk["c1"]), blk["bn1"]))
    y = jax.nn.relu(bn(conv(y, blk["c2"], stride), blk["bn2"]))
    y = bn(conv(y, blk["c3"]), blk["bn3"])
    sc = bn(conv(x, blk["proj"], stride), blk["bnp"]) if "proj" in blk else x
    x = jax.nn.relu(y + sc)
  x = x.astype(jnp.float32).mean(axis=(1, 2))
  return x @ params["fc"]["w"] + params["fc"]["b"]


def make_train_step(strides, lr=0.1, momentum=0.9, pool="reduce_window"):
  def loss_fn(params, images, labels):
    logits = forward(params, images, strides, pool)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean()

  def train_step(params, mom, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    mom = jax.tree.map(lambda m, g: momentum * m + g, mom, grads)
    params = jax.tree.map(lambda p, m: p - lr * m, params, mom)
    return params, mom, loss
  return train_step


def run(mode, fn, params, data, steps, warmup=2):
  step = (jax.jit(fn, donate_argnums=(0, 1)) if mode == "jax.jit"
          else dtenjax.jit(fn, mode, donate_argnums=(0, 1)))
  p = jax.tree.map(jnp.array, params)
  m = jax.tree.map(jnp.zeros_like, params)
  images, labels = data
  t0 = time.perf_counter()
  compiled = step.lower(p, m, images, labels).compile()   # one compile, used for both
  rep = dtenjax.graph_report(step if mode != "jax.jit" else compiled, p, m, images, labels)
  jitted, step = step, compiled
  p, m, loss = step(p, m, images, labels)
  jax.block_until_ready(loss)
  compile_s = time.perf_counter() - t0
  for _ in range(warmup - 1):
    p, m, loss = step(p, m, images, labels)
  jax.block_until_ready(loss)
  losses = []
  t0 = time.perf_counter()
  for _ in range(steps):
    p, m, loss = step(p, m, images, labels)
    losses.append(loss)
  jax.block_until_ready(losses[-1])
  dt = time.perf_counter() - t0
  observed = None
  if jax.default_backend() == "gpu":
    state = {"p": p, "m": m}

    def one_step():   # threads the donated state through, as training does
      state["p"], state["m"], step_loss = step(state["p"], state["m"], images, labels)
      return step_loss
    obs = testing.observe_launches(one_step, steps=3, warmup=1)
    observed = testing.per_step_summary(obs)
  decision = getattr(jitted, "decision", None)
  return {"mode": mode, "images_per_s": steps * images.shape[0] / dt,
          "ms_per_step": 1e3 * dt / steps, "compile_s": compile_s,
          "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
          "policy": decision.policy.describe() if decision else "jax.jit's default",
          "graphs": rep.num_graphs, "ops_inside": rep.ops_inside, "ops_outside": rep.ops_outside,
          "predicted_graph_launches_per_step": rep.graph_launches_per_step(),
          "predicted_ops_outside_per_step": rep.ops_outside_per_step(),
          "report_source": rep.source, "observed": observed}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="ResNet-50, synthetic data, bf16: jax.jit's default "
                               "vs dtenjax.jit CUDA-graph modes")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--image", type=int, default=224)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--modes", default="auto",
                  help="dtenjax.jit modes timed after jax.jit's default (comma list, e.g. auto,off)")
  ap.add_argument("--pool", default="reduce_window", choices=("reduce_window", "slices"))
  ap.add_argument("--tiny", action="store_true", help="a seconds-long CI configuration")
  ap.add_argument("--json", default=None)
  args = ap.parse_args(argv)
  if args.tiny:
    cfg = {"stages": (1, 1), "width": 4, "classes": 10}
    args.batch, args.image, args.steps = 4, 32, 3
  else:
    cfg = {"stages": (3, 4, 6, 3), "width": 64, "classes": 1000}
  on_gpu = jax.default_backend() == "gpu"
  modes = ["jax.jit"] + [m for m in args.modes.split(",") if m and m != "jax.jit"]
  for m in modes[1:]:
    dtenjax.CudaGraphPolicy.from_mode(m)          # a clear error for a bad mode, before compiling

  params = init_resnet(0, cfg["stages"], cfg["width"], cfg["classes"])
  n_params = sum(x.size for x in jax.tree.leaves(params))
  images, labels = synthetic_batch(1, args.batch, args.image, cfg["classes"])
  print(f"ResNet stages={cfg['stages']} width={cfg['width']} params={n_params / 1e6:.2f}M "
        f"batch={args.batch} image={args.image} bf16 on {jax.devices()[0].device_kind}", flush=True)

  results = []
  # one function object for every mode: a mode that passes XLA nothing reuses jax.jit's executable
  fn = make_train_step(block_strides(cfg["stages"]), pool=args.pool)
  for mode in modes:
    r = run(mode, fn, params, (images, labels), args.steps)
    results.append(r)
    print(f"{mode}: {r['images_per_s']:.1f} images/s, {r['ms_per_step']:.2f} "
          f"ms/step, compile {r['compile_s']:.1f} s  loss {r['first_loss']:.4f} -> "
          f"{r['last_loss']:.4f}  {r['policy']}; {r['report_source']} per step: "
          f"{r['predicted_graph_launches_per_step']} graph launches + "
          f"{r['predicted_ops_outside_per_step']} ops one by one", flush=True)
    if r["observed"]:
      o = r["observed"]
      print(f"  observed per step: {o['graph_launches_per_step']:.1f} graph launches, "
            f"{o['kernels_in_graphs_per_step']:.1f} kernels in graphs, "
            f"{o['kernels_outside_per_step']:.1f} kernels launched one by one", flush=True)
    if not np.isfinite(r["last_loss"]):
      print("error: the loss is not finite", file=sys.stderr)
      return 1
  base = results[0]["images_per_s"]
  for r in results[1:]:
    print(f"{r['mode']} vs jax.jit's default: {r['images_per_s'] / base:.3f}x images/s")
  if not on_gpu:
    print(f"note: backend {jax.default_backend()!r}: CUDA graphs do not apply; "
          "dtenjax.jit is a plain jax.jit here.")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"config": {**cfg, "batch": args.batch, "image": args.image, "steps": args.steps,
                            "pool": args.pool,
                            "device": jax.devices()[0].device_kind, "jax": jax.__version__},
                 "results": results}, fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
