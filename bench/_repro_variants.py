"""The flax MLP step of bench/reproducible_step.py around each gradient reduction (substitute_psum
one_shot / two_shot, fuse_collectives at 4 KiB, 64 KiB, 1 MiB), run for some steps from one start:
which parameters' bits differ from the substitute_psum(one_shot) variant. Used by the CPU question
(bench/reproducible_step.py) and the device part "fusion" (bench/_repro_device.py), which imports
it instead of the script, so bench/ has no import cycle.
"""

from __future__ import annotations

import time

VARIANTS = ("subst one_shot", "subst two_shot", "fuse 4KiB", "fuse 64KiB", "fuse 1MiB")
CHECK_STEPS = (1, 5, 10)


def run_variants(jit, steps: int, variants=VARIANTS, devices=None) -> dict:
  """Each variant's step, jitted with ``jit``, run ``steps`` steps from the same start; returns
  differing-parameter counts at CHECK_STEPS (vs "subst one_shot", which must be among
  ``variants``) and median seconds per step."""
  import jax
  import numpy as np
  import optax
  import flax.linen as nn
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import dtenjax

  ax = "d"
  devices = jax.devices()[:8] if devices is None else devices
  mesh = Mesh(np.array(devices), (ax,))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.gelu(nn.LayerNorm()(nn.Dense(128)(x)))
      x = nn.relu(nn.Dense(128)(x))
      return nn.Dense(10)(x)

  model = Net()
  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[1], (128, 64))
  y = jax.random.randint(k[2], (128,), 0, 10)
  # jitted: the same bits as flax's eager init here (checked under both CPU ISA flags), one
  # compile where eager init compiled a program per initializer and shape (1.4 s of CPU per process)
  params = jax.jit(model.init)(k[0], x[:1])
  tx = optax.adamw(1e-3, weight_decay=1e-2)

  def body(p, s, x, y):
    g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(
        model.apply(p, x), y).mean())(p)
    g = jax.lax.pmean(g, ax)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  bodies = {
      "subst one_shot": dtenjax.substitute_psum(body, algorithm="one_shot"),
      "subst two_shot": dtenjax.substitute_psum(body, algorithm="two_shot"),
      "fuse 4KiB": dtenjax.fuse_collectives(body, bucket_bytes=1 << 12, algorithm="one_shot"),
      "fuse 64KiB": dtenjax.fuse_collectives(body, bucket_bytes=1 << 16, algorithm="one_shot"),
      "fuse 1MiB": dtenjax.fuse_collectives(body, bucket_bytes=1 << 20, algorithm="one_shot"),
  }
  hist, secs = {}, {}
  for name in variants:
    b = bodies[name]
    step = jit(jax.shard_map(b, mesh=mesh, in_specs=(P(), P(), P(ax), P(ax)),
                             out_specs=(P(), P()), check_vma=False))
    p, s = params, tx.init(params)
    # on the mesh as the step returns them, so that every step finds the same input shardings
    # and one program is compiled (from single-device arrays the first step compiled another)
    p, s = jax.device_put((p, s), NamedSharding(mesh, P()))
    xs, ys = jax.device_put((x, y), NamedSharding(mesh, P(ax)))
    hist[name], times = [], []
    for _ in range(steps):
      t0 = time.perf_counter()
      p, s = jax.block_until_ready(step(p, s, xs, ys))
      times.append(time.perf_counter() - t0)
      hist[name].append([np.asarray(a) for a in jax.tree.leaves(p)])
    secs[name] = float(np.median(times[1:] or times))
  ref = hist["subst one_shot"]
  diffs = {name: {str(i): int(sum(np.sum(a.view(np.uint32) != b.view(np.uint32))
                                  for a, b in zip(h[i - 1], ref[i - 1])))
                  for i in CHECK_STEPS if i <= steps} for name, h in hist.items()}
  total = int(sum(a.size for a in jax.tree.leaves(params)))
  return dict(diffs=diffs, seconds=secs, params=total, jax=jax.__version__,
              devices=len(devices), backend=jax.default_backend())
