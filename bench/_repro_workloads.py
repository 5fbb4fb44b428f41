"""Training steps for bench/reproducible_step.py --device, and the ways to compile them.

Workloads (``build``): the demo's data-parallel MLP step (``dtenjax demo``: shard_map, exact
gradient all-reduce, optax.adam), GPT-2 (examples/gpt2_train.py: 124 M parameters, seq 1024,
batch 8, AdamW; ``gpt2_mid``: 4 layers, width 512, seq 256, the same 50257-token vocabulary, so
the embedding gradient is a scatter-add with repeated indices) and ResNet-50 batch 16
(examples/resnet50_train.py with ``pool="slices"``: XLA has no deterministic select-and-scatter;
``resnet_mid``: stages (1, 1, 1, 1), width 16, 64 x 64 images, batch 8). ``tiny=True`` shrinks
every one to a seconds-long CPU size.

Pins (``jit_with``): ``jax.jit``; ``ops`` (``xla_gpu_exclude_nondeterministic_ops`` only);
``autotune`` (``xla_gpu_autotune_level=0`` only); ``reproducible_step`` (both, what
``dtenjax.reproducible_step`` pins); ``cache`` (reproducible_step with ``autotune="cache"``).

``python bench/_repro_workloads.py WORKLOAD PINS STEPS [--tiny] [--cache-dir D]`` runs one in
this process and prints one JSON line: the digest of the final parameters and losses.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

WORKLOADS = ("demo", "gpt2_mid", "resnet_mid", "gpt2", "resnet50_b16")
PINS = ("jax.jit", "ops", "autotune", "reproducible_step", "cache")


def build(name: str, tiny: bool = False) -> dict:
  """{fn, args, donate, advance(args, out) -> args, loss(out)} of one workload."""
  import jax
  import jax.numpy as jnp
  if name == "demo":
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    import dtenjax
    from dtenjax.testing import demo
    from dtenjax import Placement
    from dtenjax import shard
    devices = jax.devices()
    n = max(d for d in (1, 2, 4, 8) if d <= len(devices))
    mesh = dtenjax.topology_mesh(demo.mesh_shape_for(n), ("data", "model"))
    placement = Placement(strategy="auto", mesh=mesh)
    (xtr, ytr), _ = demo.load_digits(0)
    batch = 128
    micro = batch // demo.MICRO_BATCHES
    sh = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    x = jax.device_put(xtr[:batch].reshape(demo.MICRO_BATCHES, micro, -1), sh)
    y = jax.device_put(ytr[:batch].reshape(demo.MICRO_BATCHES, micro), sh)
    opt, step = demo.make_step(3e-3, mesh)
    params = shard(demo.init_params(jax.random.key(0)), placement)
    return {"fn": step, "args": (params, shard(opt.init(params), placement), x, y),
            "donate": (0, 1), "advance": lambda a, out: (out[0], out[1], a[2], a[3]),
            "loss": lambda out: out[2], "config": {"devices": n, "batch": batch}}
  if name.startswith("gpt2"):
    import gpt2_train as g2
    cfg = dict(g2.CONFIGS["tiny" if tiny else "small"])
    if name == "gpt2_mid" and not tiny:
      cfg.update(ctx=256, layers=4, heads=8, width=512)
    batch = 2 if tiny else 8
    params = g2.init_params(0, cfg)
    tokens = g2.synthetic_tokens(1, batch, cfg)
    return {"fn": g2.make_train_step(cfg), "args": (params, g2.init_opt_state(params), tokens),
            "donate": (0, 1), "advance": lambda a, out: (out[0], out[1], a[2]),
            "loss": lambda out: out[2], "config": {**cfg, "batch": batch}}
  if name in ("resnet_mid", "resnet50_b16"):
    import resnet50_train as rn
    if tiny:
      stages, width, classes, image, batch = (1, 1), 4, 10, 32, 2
    elif name == "resnet_mid":
      stages, width, classes, image, batch = (1, 1, 1, 1), 16, 100, 64, 8
    else:
      stages, width, classes, image, batch = (3, 4, 6, 3), 64, 1000, 224, 16
    params = rn.init_resnet(0, stages, width, classes)
    images, labels = rn.synthetic_batch(1, batch, image, classes)
    fn = rn.make_train_step(rn.block_strides(stages), pool="slices")
    return {"fn": fn, "args": (params, jax.tree.map(jnp.zeros_like, params), images, labels),
            "donate": (0, 1), "advance": lambda a, out: (out[0], out[1], a[2], a[3]),
            "loss": lambda out: out[2],
            "config": {"stages": stages, "width": width, "image": image, "batch": batch,
                       "pool": "slices"}}
  raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def jit_with(pins: str, fn, donate, cache_dir: str | None = None):
  """``fn`` compiled as ``pins`` says (see the module docstring)."""
  import jax
  import dtenjax
  from dtenjax.testing import xla
  if pins == "jax.jit":
    return jax.jit(fn, donate_argnums=donate)
  if pins in ("ops", "autotune"):
    return jax.jit(fn, donate_argnums=donate, compiler_options=xla.GPU_PINS[pins][0])
  # On CPU the process-to-process promise needs no process flag (that one is for fusion).
  check = jax.default_backend() == "gpu"
  if pins == "reproducible_step":
    return dtenjax.reproducible_step(fn, donate_argnums=donate, check_flags=check)
  if pins == "cache":
    return dtenjax.reproducible_step(fn, donate_argnums=donate, check_flags=check,
                                     autotune="cache", autotune_cache_dir=cache_dir)
  raise ValueError(f"unknown pins {pins!r}; choose from {PINS}")


def digest(tree, losses) -> str:
  import jax
  import numpy as np
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  h.update(np.asarray(losses, np.float32).tobytes())
  return h.hexdigest()[:16]


def run(name: str, pins: str, steps: int, tiny: bool = False,
        cache_dir: str | None = None) -> dict:
  """``steps`` steps of a workload from its fixed start; the digest of where they end."""
  import jax
  spec = build(name, tiny)
  f = jit_with(pins, spec["fn"], spec["donate"], cache_dir)
  args = spec["args"]
  t0 = time.perf_counter()
  f.lower(*args).compile()
  compile_s = time.perf_counter() - t0
  losses = []
  t0 = time.perf_counter()
  for _ in range(steps):
    out = f(*args)
    losses.append(float(spec["loss"](out)))
    args = spec["advance"](args, out)
  jax.block_until_ready(args)
  return {"workload": name, "pins": pins, "steps": steps, "digest": digest(args[:2], losses),
          "losses": losses[:3] + losses[-1:], "compile_s": compile_s,
          "run_s": time.perf_counter() - t0, "device": jax.devices()[0].device_kind,
          "jax": jax.__version__}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="one reproducibility workload in this process")
  ap.add_argument("workload", choices=WORKLOADS)
  ap.add_argument("pins", choices=PINS)
  ap.add_argument("steps", type=int)
  ap.add_argument("--tiny", action="store_true")
  ap.add_argument("--cache-dir", default=None)
  a = ap.parse_args(argv)
  if a.steps < 1:
    ap.error("steps must be >= 1")
  print(json.dumps(run(a.workload, a.pins, a.steps, a.tiny, a.cache_dir)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
