"""The model of the host-transport pipeline's tests: a small MLP stack scanned over its layers,
its data, and the unpipelined reference in plain JAX (a gradient-accumulation loop: ``lax.scan``
over the micro-batches, ``jax.value_and_grad`` of each through ``lax.scan`` over every layer,
gradients summed in micro-batch order from zeros and divided by their number). Small on
purpose: every test process compiles it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

LAYERS, D, OUT, BATCH, MICRO = 6, 16, 4, 12, 4


def body(h, w):
  """One layer, as lax.scan takes it."""
  return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None


def loss_fn(head, h, targets):
  return jnp.mean((jnp.tanh(h) @ head["u"] - targets) ** 2)


def init(layers: int = LAYERS, seed: int = 0):
  """(stacked layers, head, x, targets), the same in every process."""
  rng = np.random.default_rng(seed)
  w = lambda *s: jnp.asarray(rng.normal(0, 0.4, s), jnp.float32)
  stacked = {"w1": w(layers, D, D), "w2": w(layers, D, D)}
  head = {"u": w(D, OUT)}
  return stacked, head, w(BATCH, D), w(BATCH, OUT)


def reference(stacked, head, x, targets, microbatches: int = MICRO):
  """(loss, layer gradients, head gradients, x gradient) of the unpipelined step."""
  def micro(layers, hd, xm, tm):
    return loss_fn(hd, lax.scan(body, xm, layers)[0], tm)

  @jax.jit
  def run(stacked, head, x, targets):
    split = lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:])

    def accumulate(acc, mb):
      value, g = jax.value_and_grad(micro, argnums=(0, 1, 2))(stacked, head, *mb)
      return (acc[0] + value, jax.tree.map(jnp.add, acc[1], g[0]),
              jax.tree.map(jnp.add, acc[2], g[1])), g[2]

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, stacked),
             jax.tree.map(jnp.zeros_like, head))
    (loss, gl, gh), dxs = lax.scan(accumulate, zeros, (split(x), split(targets)))
    mean = lambda t: jax.tree.map(lambda a: a / microbatches, t)
    return mean(loss), mean(gl), mean(gh), mean(dxs).reshape(x.shape)
  return run(stacked, head, x, targets)


# A stack that carries an integer per layer (its index, scaling the layer) and a head with an
# integer table: their gradients are float0, which a pipeline's accumulation must not add.
def int_body(h, w):
  return jnp.tanh(h @ w["w"]) * (1 + w["idx"].astype(h.dtype) / 8), None


def int_loss_fn(head, h, t):
  return ((h[:, head["cols"]] - t) ** 2).mean()


def int_init():
  """(layers of 4, head, x, targets) for `int_body` and `int_loss_fn`, batch 8 of width 8."""
  rng = np.random.default_rng(0)
  layers = {"w": jnp.asarray(rng.normal(0, 0.3, (4, 8, 8)), jnp.float32),
            "idx": jnp.arange(4, dtype=jnp.int32)}
  head = {"cols": jnp.asarray([1, 3, 5], jnp.int32)}
  return (layers, head, jnp.asarray(rng.normal(size=(8, 8)), jnp.float32),
          jnp.asarray(rng.normal(size=(8, 3)), jnp.float32))


def int_reference(layers, head, x, t, microbatches: int = 2):
  """(loss, (layer gradients, head gradients)) of the unpipelined loop over micro-batches,
  `jax.value_and_grad(..., allow_int=True)` as a user writes it."""
  def plain(w, hd):
    xs = x.reshape(microbatches, -1, x.shape[-1])
    ts = t.reshape(microbatches, -1, t.shape[-1])
    return sum(int_loss_fn(hd, lax.scan(int_body, xs[m], w)[0], ts[m])
               for m in range(microbatches)) / microbatches
  return jax.value_and_grad(plain, argnums=(0, 1), allow_int=True)(layers, head)
