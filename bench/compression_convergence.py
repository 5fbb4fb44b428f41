"""Convergence of top-k error-feedback compression on a real model and dataset, no network needed.

A small MLP on scikit-learn's digits (1797 8x8 images, shipped inside the package), data parallel
over 8 simulated CPU devices with jax.shard_map. Candidates, side by side in one run:
dense all-reduce (lax.pmean), top-k EF at 1% and 0.1% with plain SGD, DGC at 1% and 0.1% (momentum
correction, factor masking, warm-up, local clipping) against dense momentum SGD, and the
ablations without error feedback. Reports final test accuracy, the gap to dense
in percentage points, and the bytes each device sends per step and in total.

    python bench/compression_convergence.py [--steps 1500] [--json PATH]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from dtenjax._src.compression import error_feedback as compression  # noqa: E402
from dtenjax._src.cli import demo  # noqa: E402

AXIS = "data"


def load_digits(num_devices: int, seed: int = 0):
  """(x_train [D, m, 64], y_train [D, m], x_test, y_test): a fixed split, sharded per device."""
  from sklearn.datasets import load_digits as _load  # pylint: disable=g-import-not-at-top
  d = _load()
  x = (d.data / 16.0).astype(np.float32)
  y = d.target.astype(np.int32)
  perm = np.random.default_rng(seed).permutation(len(x))
  x, y = x[perm], y[perm]
  n_test = 360
  xt, yt, xs, ys = x[n_test:], y[n_test:], x[:n_test], y[:n_test]
  m = len(xt) // num_devices
  return (xt[:m * num_devices].reshape(num_devices, m, 64),
          yt[:m * num_devices].reshape(num_devices, m), xs, ys)


def init_mlp(key, sizes=(64, 128, 10)):
  return demo.init_params(key, sizes)


mlp = demo.forward      # the demo's MLP: dense layers with ReLU between them


def loss_fn(params, x, y):
  return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), y).mean()


def accuracy(params, x, y) -> float:
  return float(jnp.mean(jnp.argmax(mlp(params, x), -1) == y))


@dataclasses.dataclass(frozen=True)
class Candidate:
  name: str
  ratio: float | None          # None: dense all-reduce
  error_feedback: bool = True
  momentum: float = 0.0
  warmup_steps: int = 0
  lr: float = 0.05
  clip_norm: float | None = None


def train(cand: Candidate, data, *, steps: int, batch: int = 16, seed: int = 0):
  """Trains one candidate; returns (test accuracy, bytes sent per device per step (final stage),
  total bytes sent per device, seconds)."""
  xtr, ytr, xte, yte = data
  ndev, m = ytr.shape
  mesh = Mesh(np.array(jax.devices()[:ndev]), (AXIS,))
  params = init_mlp(jax.random.key(seed))
  if cand.ratio is None:
    tx = optax.sgd(cand.lr, momentum=cand.momentum or None)
  else:
    tx = optax.chain(
        compression.topk_ef(cand.ratio, axis_name=AXIS, momentum=cand.momentum,
                            error_feedback=cand.error_feedback, warmup_steps=cand.warmup_steps,
                            clip_norm=cand.clip_norm),
        optax.sgd(cand.lr))
  abstract = jax.eval_shape(tx.init, params)
  specs = compression.state_specs(abstract, AXIS)

  def run(params, xs, ys):
    state = tx.init(params)
    xs, ys = xs[0], ys[0]

    def step(i, carry):
      p, s = carry
      sel = (i * batch + jnp.arange(batch)) % m
      g = jax.grad(loss_fn)(p, xs[sel], ys[sel])
      if cand.ratio is None:
        g = jax.lax.pmean(g, AXIS)
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    return jax.lax.fori_loop(0, steps, step, (params, state))[0]

  fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P()))
  del specs
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(params, jnp.asarray(xtr), jnp.asarray(ytr)))
  secs = time.perf_counter() - t0
  if cand.ratio is None:
    plan = compression.compression_plan(params, ndev, ratio=1.0)
    per_step = plan.dense_bytes
    total = per_step * steps
  else:
    cfg = compression.TopKConfig(ratio=cand.ratio, warmup_steps=cand.warmup_steps)
    per_step = compression.compression_plan(params, ndev, config=cfg).bytes_sent
    total = sum(compression.compression_plan(params, ndev, config=cfg, step=s).bytes_sent
                for s in range(steps))
  return accuracy(out, jnp.asarray(xte), jnp.asarray(yte)), per_step, total, secs


CANDIDATES = (
    # Plain SGD: error feedback alone.
    Candidate("dense SGD", None),
    Candidate("top-k EF 1%", 0.01),
    Candidate("top-k EF 0.1%", 0.001),
    Candidate("top-k no-EF 1%", 0.01, error_feedback=False),
    Candidate("top-k no-EF 0.1%", 0.001, error_feedback=False),
    # Momentum 0.9: DGC (momentum correction + factor masking, warm-up, local clipping).
    Candidate("dense momentum", None, momentum=0.9, lr=0.005),
    Candidate("DGC 1%", 0.01, momentum=0.9, lr=0.005, warmup_steps=200, clip_norm=20.0),
    Candidate("DGC 0.1%", 0.001, momentum=0.9, lr=0.005, warmup_steps=200, clip_norm=20.0),
    Candidate("DGC no-EF 0.1%", 0.001, momentum=0.9, lr=0.005, warmup_steps=200,
              clip_norm=20.0, error_feedback=False),
)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=3000)
  ap.add_argument("--seeds", type=int, default=1)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  data = load_digits(8)
  rows = []
  for cand in CANDIDATES:
    accs = []
    for seed in range(args.seeds):
      acc, per_step, total, secs = train(cand, data, steps=args.steps, seed=seed)
      accs.append(acc)
    rows.append(dict(name=cand.name, ratio=cand.ratio, error_feedback=cand.error_feedback,
                     momentum=cand.momentum, lr=cand.lr,
                     accuracy=float(np.mean(accs)), accuracies=accs, bytes_per_step=per_step,
                     total_bytes=total, seconds=secs))
  for r in rows:
    dense = [d for d in rows if d["ratio"] is None and d["momentum"] == r["momentum"]][0]
    r["gap_pp"] = 100 * (r["accuracy"] - dense["accuracy"])
    r["bytes_ratio"] = dense["total_bytes"] / r["total_bytes"]
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(steps=args.steps, seeds=args.seeds, devices=8, rows=rows), f,
                indent=1)
  print(f"digits MLP 64-128-10, 8 simulated CPU devices, {args.steps} steps, batch 16/device, "
        f"{args.seeds} seed(s); SGD lr 0.05, momentum rows lr 0.005 (gap vs the dense row "
        "with the same momentum)")
  print(f"{'candidate':<20} {'test acc %':>10} {'vs dense pp':>11} {'B/dev/step':>11} "
        f"{'total B/dev':>12} {'less bytes':>10}")
  for r in rows:
    print(f"{r['name']:<20} {100 * r['accuracy']:>10.2f} {r['gap_pp']:>+11.2f} "
          f"{r['bytes_per_step']:>11.0f} {r['total_bytes']:>12.3g} {r['bytes_ratio']:>9.1f}x")


if __name__ == "__main__":
  main()
