"""Convergence of top-k error-feedback compression on a real model and dataset, no network needed.

A small MLP on scikit-learn's digits (1797 8x8 images, shipped inside the package), data parallel
over 8 simulated CPU devices with jax.shard_map (its default check_vma=True; gradients are taken
with respect to ``compression.pvary(params)``, so each device has its own). Candidates, side by
side in one run: dense all-reduce (lax.pmean), top-k EF at 1% and 0.1% with plain SGD, DGC at 1%
and 0.1% (momentum correction, factor masking, warm-up, local clipping) against dense momentum
SGD, and the ablations without error feedback. Reports final test accuracy, the gap to dense in
percentage points, and the bytes each device puts on the wire per step and in total, read from
the compiled HLO of one training step (every all-reduce / all-gather / reduce-scatter /
all-to-all / collective-permute, priced per device as a ring moves it: all-reduce
2 (P-1)/P x bytes, all-gather and all-to-all (P-1)/P x the result, reduce-scatter (P-1) x the
result), next to ``compression_plan``'s prediction.

    python bench/compression_convergence.py [--steps 3000] [--seeds 1] [--json PATH]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import _harness
from dtenjax import compression
from dtenjax.testing import demo

AXIS = "data"


def load_digits(num_devices: int, seed: int = 0):
  """(x_train [D, m, 64], y_train [D, m], x_test, y_test): a fixed split, sharded per device."""
  from sklearn.datasets import load_digits as _load
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
  lr: float = 0.4
  clip_norm: float | None = None


# --- bytes on the wire, from the compiled HLO -----------------------------------------------

_COLLECTIVE = re.compile(
    r"=\s+(?P<shape>\([^()]*\)|\S+)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(")
_ARRAY = re.compile(r"\b(?P<dtype>pred|[subf]\d+|bf16|f8e\w+)\[(?P<dims>[\d,]*)\]")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_ITEMSIZE = {"pred": 1, "bf16": 2}


def _nbytes(dtype: str, dims: str) -> int:
  n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
  item = _ITEMSIZE.get(dtype) or (1 if dtype.startswith("f8") else int(dtype[1:]) // 8)
  return n * item


def collectives_in_hlo(hlo_text: str, num_devices: int) -> list[dict]:
  """Every collective of a compiled (CPU, synchronous) HLO module: op, result arrays, group size
  and the bytes one device puts on the wire for it under a ring schedule. Collectives in every
  computation are counted once (measure a program without lax.cond/switch around them)."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLLECTIVE.search(line)
    if not m:
      continue
    arrays = [(a["dtype"], a["dims"]) for a in _ARRAY.finditer(m["shape"])]
    nbytes = sum(_nbytes(d, s) for d, s in arrays)
    g = _GROUPS_IOTA.search(line)
    if g:
      p = int(g.group(2))
    else:
      g = _GROUPS_LIST.search(line)
      p = len(g.group(1).split(",")) if g and g.group(1) else num_devices
    op = m["op"]
    factor = {"all-reduce": 2 * (p - 1) / p, "all-gather": (p - 1) / p,
              "all-to-all": (p - 1) / p, "reduce-scatter": float(p - 1),
              "collective-permute": 1.0}[op]
    out.append(dict(op=op, arrays=[f"{d}[{s}]" for d, s in arrays], group=p,
                    result_bytes=nbytes, wire_bytes=factor * nbytes))
  return out


def _make_tx(cand: Candidate, ratio: float | None = None, warmup_steps: int | None = None):
  if cand.ratio is None:
    return optax.sgd(cand.lr, momentum=cand.momentum or None)
  return optax.chain(
      compression.topk_ef(cand.ratio if ratio is None else ratio, axis_name=AXIS,
                          momentum=cand.momentum, error_feedback=cand.error_feedback,
                          warmup_steps=cand.warmup_steps if warmup_steps is None
                          else warmup_steps, clip_norm=cand.clip_norm),
      optax.sgd(cand.lr))


def _local_step(cand: Candidate, tx):
  def step(p, s, xb, yb):
    # Per-device gradients: differentiate with respect to params typed as varying over AXIS
    # (under check_vma=True a replicated P() param would get an all-reduced gradient).
    g = jax.grad(loss_fn)(compression.pvary(p, AXIS), xb, yb)
    if cand.ratio is None:
      g = jax.lax.pmean(g, AXIS)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return step


def step_hlo(cand: Candidate, params, mesh, batch: int, ratio: float | None = None) -> str:
  """Compiled HLO text of one training step of ``cand`` (at density ``ratio``, no warm-up)."""
  tx = _make_tx(cand, ratio, warmup_steps=0)
  specs = compression.state_specs(jax.eval_shape(tx.init, params), AXIS)
  init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)
  step = jax.jit(jax.shard_map(_local_step(cand, tx), mesh=mesh,
                               in_specs=(P(), specs, P(AXIS), P(AXIS)), out_specs=(P(), specs)))
  ndev = mesh.devices.size
  xb = jax.ShapeDtypeStruct((ndev * batch, 64), jnp.float32)
  yb = jax.ShapeDtypeStruct((ndev * batch,), jnp.int32)
  return step.lower(params, jax.eval_shape(init, params), xb, yb).compile().as_text()


def wire_bytes(cand: Candidate, params, mesh, batch: int, steps: int) -> tuple[float, float]:
  """(bytes per device per step at the final density, total over ``steps`` with the warm-up's
  densities), both from compiled HLO: one step compiled per density the run uses."""
  ndev = mesh.devices.size
  if cand.ratio is None:
    per = sum(c["wire_bytes"] for c in collectives_in_hlo(step_hlo(cand, params, mesh, batch),
                                                          ndev))
    return per, per * steps
  cfg = compression.TopKConfig(ratio=cand.ratio, warmup_steps=cand.warmup_steps)
  ratios = cfg.stage_ratios()
  counts = np.bincount([int(cfg.stage(s)) for s in range(steps)], minlength=len(ratios))
  per_stage = [sum(c["wire_bytes"] for c in collectives_in_hlo(
      step_hlo(cand, params, mesh, batch, ratio=r), ndev))
               if counts[i] or i == len(ratios) - 1 else 0.0 for i, r in enumerate(ratios)]
  return per_stage[-1], float(np.dot(counts, per_stage))


def train(cand: Candidate, data, *, steps: int, batch: int = 16, seed: int = 0,
          wire: bool = True):
  """Trains one candidate; returns (test accuracy, wire bytes per device per step at the final
  density (compiled HLO), total wire bytes per device (compiled HLO), seconds, bytes per step
  that compression_plan predicts). ``wire=False`` leaves the two HLO counts None: each is a
  step compiled only to be read (about 3 s of CPU)."""
  xtr, ytr, xte, yte = data
  ndev, m = ytr.shape
  mesh = Mesh(np.array(jax.devices()[:ndev]), (AXIS,))
  params = init_mlp(jax.random.key(seed))
  tx = _make_tx(cand)
  one_step = _local_step(cand, tx)

  def run(params, xs, ys):
    state = tx.init(params)
    xs, ys = xs[0], ys[0]

    def step(i, carry):
      p, s = carry
      sel = (i * batch + jnp.arange(batch)) % m
      return one_step(p, s, xs[sel], ys[sel])

    return jax.lax.fori_loop(0, steps, step, (params, state))[0]

  fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P()))
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(params, jnp.asarray(xtr), jnp.asarray(ytr)))
  secs = time.perf_counter() - t0
  per_step, total = wire_bytes(cand, params, mesh, batch, steps) if wire else (None, None)
  if cand.ratio is None:
    predicted = compression.compression_plan(params, ndev, ratio=1.0).dense_bytes
  else:
    predicted = compression.compression_plan(params, ndev, ratio=cand.ratio).bytes_sent
  return accuracy(out, jnp.asarray(xte), jnp.asarray(yte)), per_step, total, secs, predicted


CANDIDATES = (
    # Plain SGD: error feedback alone.
    Candidate("dense SGD", None),
    Candidate("top-k EF 1%", 0.01),
    Candidate("top-k EF 0.1%", 0.001),
    Candidate("top-k no-EF 1%", 0.01, error_feedback=False),
    Candidate("top-k no-EF 0.1%", 0.001, error_feedback=False),
    # Momentum 0.9: DGC (momentum correction + factor masking, warm-up, local clipping).
    Candidate("dense momentum", None, momentum=0.9, lr=0.04),
    Candidate("DGC 1%", 0.01, momentum=0.9, lr=0.04, warmup_steps=200, clip_norm=20.0),
    Candidate("DGC 0.1%", 0.001, momentum=0.9, lr=0.04, warmup_steps=200, clip_norm=20.0),
    Candidate("DGC no-EF 0.1%", 0.001, momentum=0.9, lr=0.04, warmup_steps=200,
              clip_norm=20.0, error_feedback=False),
)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/compression_convergence.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=_harness.positive_int, default=3000)
  ap.add_argument("--seeds", type=_harness.positive_int, default=1)
  ap.add_argument("--json", default=None, metavar="PATH")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  if len(jax.devices()) != 8:
    _harness.refuse("bench/compression_convergence.py",
                    f"it trains over 8 devices and jax sees {len(jax.devices())}; leave XLA_FLAGS "
                    "without a device count (the bench sets 8 simulated CPU devices).")
  data = load_digits(8)
  rows = []
  with _harness.steps("compression_convergence", len(CANDIDATES) * args.seeds) as step:
    for cand in CANDIDATES:
      accs = []
      for seed in range(args.seeds):
        step(f"{cand.name}, seed {seed}")
        acc, per_step, total, secs, predicted = train(cand, data, steps=args.steps, seed=seed)
        accs.append(acc)
      rows.append(dict(name=cand.name, ratio=cand.ratio, error_feedback=cand.error_feedback,
                       momentum=cand.momentum, lr=cand.lr,
                       accuracy=float(np.mean(accs)), accuracies=accs, bytes_per_step=per_step,
                       predicted_bytes_per_step=predicted, total_bytes=total, seconds=secs))
  for r in rows:
    dense = [d for d in rows if d["ratio"] is None and d["momentum"] == r["momentum"]][0]
    r["gap_pp"] = 100 * (r["accuracy"] - dense["accuracy"])
    r["bytes_ratio"] = dense["total_bytes"] / r["total_bytes"]
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "compression_convergence", __file__, argv, {"steps": args.steps, "seeds": args.seeds},
        rows, kind="other", devices=jax.devices()))
  print(f"digits MLP 64-128-10, 8 simulated CPU devices, {args.steps} steps, batch 16/device, "
        f"{args.seeds} seed(s); SGD lr 0.4, momentum rows lr 0.04 (gap vs the dense row "
        "with the same momentum)")
  print("bytes: per device on the wire, from the compiled HLO of one step (plan: what "
        "compression_plan predicts)")
  shown = [dict(r, accuracy_pct=100 * r["accuracy"]) for r in rows]
  print(_harness.table(shown, (("candidate", "name", "s"), ("test acc %", "accuracy_pct", ".2f"),
                               ("vs dense pp", "gap_pp", "+.2f"),
                               ("B/dev/step", "bytes_per_step", ".0f"),
                               ("plan B/step", "predicted_bytes_per_step", ".0f"),
                               ("total B/dev", "total_bytes", ".3g"),
                               ("less bytes", "bytes_ratio", "ratio"))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
