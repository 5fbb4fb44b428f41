"""A small flax GPT trained data-parallel the way JAX users write it: ``jax.shard_map`` with its
defaults (``check_vma=True``), replicated parameters, the batch sharded over "data", per-device
gradients averaged with ``lax.pmean`` -- or with ``dtenjax.all_reduce(op="mean")`` in its place.

Used by ``tests/test_gpt_dp.py``; ``python tests/gpt_dp.py [N ...]`` trains the reproducible
variant on a mesh of the first N devices for each N (default: all devices, as many as
``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` gives) and prints one line per N with
the digest of its loss curve. One process trains every device count: a mesh of the first N of 8
devices compiles the same N-partition program as a process of N devices, and the model's
initialisation (eager flax, the slow part of a fresh start) is done once.
"""

from __future__ import annotations

import functools
import hashlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import dtenjax

VOCAB, SEQ, D, HEADS, LAYERS = 32, 8, 16, 2, 1
MICRO, PER_MICRO = 8, 2           # the global batch: 8 micro-batches of 2 sequences
STEPS = 6


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D, deterministic=True)(
        h, h, mask=mask)
    x = x + h
    h = nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(nn.LayerNorm()(x))))
    return x + h


class GPT(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    x = x + self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
    mask = nn.make_causal_mask(tokens)
    for _ in range(LAYERS):
      x = Block()(x, mask)
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


MODEL = GPT()


def data(seed: int = 0):
  """[STEPS, MICRO, PER_MICRO, SEQ + 1] token sequences that follow t -> 3 t + 1 (mod VOCAB)."""
  rng = np.random.default_rng(seed)
  start = rng.integers(0, VOCAB, (STEPS, MICRO, PER_MICRO, 1))
  seq = [start]
  for _ in range(SEQ):
    seq.append((3 * seq[-1] + 1) % VOCAB)
  return jnp.asarray(np.concatenate(seq, -1), jnp.int32)


@functools.cache
def init():
  """The initial parameters (computed once per process: eager flax init takes seconds; jax
  arrays are immutable and the step does not donate them, so sharing them is safe)."""
  return MODEL.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_step(mesh, reduce=None, *, reproducible=False, compiler_options=None):
  """One data-parallel adamw step. ``reduce(tree)`` averages per-device values over "data"
  (``lax.pmean`` by default); ``reproducible=True`` instead hands dtenjax every micro-batch's
  gradient (``local_axis=0``), so the mean does not depend on how they are split over devices.
  ``compiler_options`` go to ``jax.jit`` (the in-process curves, compared within a tolerance,
  compile with LLVM unoptimised: tests/compile_only.py)."""
  tx = optax.adamw(3e-3)
  reduce = reduce or (lambda t: lax.pmean(t, "data"))

  def local(params, opt_state, xb):                # xb: this device's micro-batches
    p = lax.pcast(params, "data", to="varying")    # per-device gradients (no implicit psum)
    losses, grads = lax.map(lambda b: jax.value_and_grad(loss_fn)(p, b), xb)
    if reproducible:
      grads = dtenjax.all_reduce(grads, "data", op="mean", reproducible=True, local_axis=0)
      loss = dtenjax.all_reduce(losses, "data", op="mean", reproducible=True, local_axis=0)
    else:
      grads = reduce(jax.tree.map(lambda g: g.mean(0), grads))
      loss = reduce(losses.mean())
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                               out_specs=(P(), P(), P())), compiler_options=compiler_options)
  return tx, step


def train(mesh, reduce=None, *, reproducible=False, compiler_options=None) -> np.ndarray:
  tx, step = make_step(mesh, reduce, reproducible=reproducible, compiler_options=compiler_options)
  # Placed on the mesh as the step returns them, so that every call finds the same input
  # shardings and the step compiles once (from single-device arrays, the first call would
  # compile a second program).
  replicated = jax.sharding.NamedSharding(mesh, P())
  params = jax.device_put(init(), replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  batches = jax.device_put(data(), jax.sharding.NamedSharding(mesh, P(None, "data")))
  losses = []
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(loss)
  return np.asarray(losses, np.float32)


def digest(losses: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(losses, np.float32).tobytes()).hexdigest()[:16]


def mesh_of(n: int):
  """A 1D Auto mesh named "data" over the first ``n`` devices."""
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n],
                       axis_types=(jax.sharding.AxisType.Auto,))


if __name__ == "__main__":
  for n in [int(a) for a in sys.argv[1:]] or [len(jax.devices())]:
    curve = train(mesh_of(n), reproducible=True)
    print(f"devices={n} losses={curve.tolist()} digest={digest(curve)}", flush=True)
  sys.exit(0)
