"""Data-parallel training with DGC top-k error-feedback compression on 8 simulated CPU devices.

A small MLP on scikit-learn's digits; gradients cross devices as 0.1% (index, value) pairs.

    python examples/compressed_training.py [--steps 1500]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from sklearn.datasets import load_digits

from dtenjax import compression

AXIS = "data"


def main(steps: int = 1500) -> float:
  """Trains for ``steps`` steps; returns the final test accuracy."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  perm = np.random.default_rng(0).permutation(len(x))
  x, y = x[perm], y[perm]
  x_train, y_train, x_test, y_test = x[:1432], y[:1432], x[1432:], y[1432:]
  mesh = Mesh(np.array(jax.devices()[:8]), (AXIS,))

  key1, key2 = jax.random.split(jax.random.key(0))
  params = {"w0": jax.random.normal(key1, (64, 128)) * 0.18, "b0": jnp.zeros(128),
            "w1": jax.random.normal(key2, (128, 10)) * 0.13, "b1": jnp.zeros(10)}
  # Replicated on the mesh from the start, as the step returns them: the step compiles once (with
  # the eager arrays' single-device placement, the second step would compile it again).
  params = jax.device_put(params, NamedSharding(mesh, P()))

  def predict(p, x):
    return jax.nn.relu(x @ p["w0"] + p["b0"]) @ p["w1"] + p["b1"]

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(p, x), y).mean()

  # DGC: momentum correction inside the compressor, plain SGD after it.
  tx = optax.chain(
      compression.topk_ef(0.001, axis_name=AXIS, momentum=0.9, warmup_steps=200,
                          clip_norm=20.0),
      optax.sgd(0.005))
  print(compression.compression_plan(params, 8, ratio=0.001).table())

  specs = compression.state_specs(jax.eval_shape(tx.init, params), AXIS)
  state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)

  def local_step(p, s, xb, yb):
    # This device's own gradient: differentiate with respect to params typed as varying over
    # AXIS. (jax.grad(loss)(p, ...) of the replicated p would already be summed over AXIS by a
    # dense all-reduce; topk_ef refuses such gradients.)
    g = jax.grad(loss)(compression.pvary(p, AXIS), xb, yb)
    u, s = tx.update(g, s, p)                # compressed all-reduce (mean over AXIS)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(local_step, mesh=mesh,
                               in_specs=(P(), specs, P(AXIS), P(AXIS)),
                               out_specs=(P(), specs)))
  rng = np.random.default_rng(0)
  for i in range(steps):
    sel = rng.integers(0, len(x_train), 8 * 16)
    params, state = step(params, state, x_train[sel], y_train[sel])
    # On simulated CPU devices, wait for each step: XLA's CPU runtime can deadlock when many
    # steps holding collectives and the top-k sort's runtime call are queued asynchronously.
    jax.block_until_ready(params)
    if i % 500 == 499 or i == steps - 1:
      acc = jnp.mean(jnp.argmax(predict(params, x_test), -1) == y_test)
      print(f"step {i + 1}: test accuracy {100 * float(acc):.2f}%")
  return float(acc)


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=1500)
  main(ap.parse_args().steps)
