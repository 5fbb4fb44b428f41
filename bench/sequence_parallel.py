"""The planner's sequence role against what a user writes by hand for a long-sequence,
small-batch decoder step (a batch of a few sequences on more devices than sequences).

Candidates, each compiled for the same devices and timed side by side in one process
(interleaved rounds, medians):

* ``plan``         -- ``dtenjax.plan(step, *args)``, the planner's own choice, run by ``plan.jit``;
* ``plan CP``      -- ``dtenjax.plan(step, *args, mesh={"data": B, "sequence": N // B})``;
* ``CP``           -- context parallelism by hand (MaxText's all-gather recipe): plain
                      ``jax.jit``, tokens sharded over ``data`` x ``sequence``, each layer's
                      input constrained to its sequence shards and its keys and values to the
                      gathered layout;
* ``DP idle``      -- plain ``jax.jit`` data parallelism over the B devices the batch allows,
                      the others idle;
* ``DP dup``       -- DP over all N devices as a ``data`` x ``replica`` mesh: the batch split
                      over ``data``, the work duplicated over ``replica``;
* ``FSDP dup``     -- FSDP: weights, gradients and optimizer state sharded over all N devices
                      (gathered where used, one layer at a time inside the scan), the batch split
                      over the B devices it allows and duplicated over the rest.

Columns: compiled memory per device (arguments + outputs not aliased + temp), collective bytes
per kind per step (a loop body's once per iteration), the planner's predicted bytes and memory
for its rows, the median step time and its ratio to the hand-written CP (> 1: slower).

  python bench/sequence_parallel.py [--batch 2] [--seq 1024] [--d 128] [--layers 2] [--iters 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def model(batch: int, seq: int, *, vocab: int, d: int, heads: int, ffn: int, layers: int,
          use=None, act=None, kv=None):
  """A causal decoder step with AdamW (layers a lax.scan over stacked weights), its abstract
  arguments; ``use(name, w)``, ``act(x)`` and ``kv(t)`` are the hand-written recipes' hooks on
  the weights, on each layer's input and on the keys and values."""
  import jax
  import jax.numpy as jnp
  import optax
  use = use or (lambda name, w: w)
  act = act or (lambda x: x)
  kv = kv or (lambda t: t)
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  hd = d // heads
  params = {"embed": s(vocab, d), "unembed": s(d, vocab),
            "layers": {"norm1": s(layers, d), "norm2": s(layers, d),
                       "wq": s(layers, d, heads, hd), "wk": s(layers, d, heads, hd),
                       "wv": s(layers, d, heads, hd), "wo": s(layers, heads, hd, d),
                       "w_gate": s(layers, d, ffn), "w_up": s(layers, d, ffn),
                       "w_down": s(layers, ffn, d)}}

  def rms(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

  def block(x, p):
    x = act(x)
    y = rms(x, p["norm1"])
    q = jnp.einsum("bsd,dhk->bshk", y, use("wq", p["wq"]))
    k = kv(jnp.einsum("bsd,dhk->bshk", y, use("wk", p["wk"])))
    v = kv(jnp.einsum("bsd,dhk->bshk", y, use("wv", p["wv"])))
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(hd)
    scores = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), scores, -1e9)
    attn = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, -1), v)
    x = x + jnp.einsum("bqhk,hkd->bqd", attn, use("wo", p["wo"]))
    y = rms(x, p["norm2"])
    g = jnp.einsum("bsd,df->bsf", y, use("w_gate", p["w_gate"]))
    u = jnp.einsum("bsd,df->bsf", y, use("w_up", p["w_up"]))
    return x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(g) * u, use("w_down", p["w_down"]))

  def loss(p, tokens):
    x = jnp.take(use("embed", p["embed"]), tokens, axis=0)
    x, _ = jax.lax.scan(lambda x, lp: (block(x, lp), None), x, p["layers"])
    logits = jnp.einsum("bsd,dv->bsv", x, use("unembed", p["unembed"]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(tokens, -1, 1)).mean()

  tx = optax.adamw(1e-3)

  def step(p, opt, tokens):
    value, grads = jax.value_and_grad(loss)(p, tokens)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, value
  return step, (params, jax.eval_shape(tx.init, params),
                jax.ShapeDtypeStruct((batch, seq), jnp.int32))


def hand_written(name: str, n: int, batch: int, sizes: dict):
  """``(jitted step, shardings of (params, opt, tokens), mesh)`` of a recipe written by hand."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  devices = np.asarray(jax.devices()[:n])
  hooks = {}
  if name == "CP":
    mesh = Mesh(devices.reshape(batch, n // batch), ("data", "sequence"))
    ns = lambda *spec: NamedSharding(mesh, P(*spec))
    hooks["act"] = lambda x: jax.lax.with_sharding_constraint(x, ns("data", "sequence"))
    hooks["kv"] = lambda t: jax.lax.with_sharding_constraint(t, ns("data", None))
    tokens = P("data", "sequence")
  elif name == "DP idle":
    mesh = Mesh(devices[:batch], ("data",))
    tokens = P("data")
  else:
    mesh = Mesh(devices.reshape(batch, n // batch), ("data", "replica"))
    tokens = P("data")
  step, args = model(batch, use=None, **sizes, **hooks)
  params, opt, _ = args
  pspecs = jax.tree.map(lambda _: P(), params)
  if name == "FSDP dup":
    def spec(path, w):
      # the largest dimension that divides, never the layer dimension of a stacked weight
      first = 1 if path[0].key == "layers" else 0
      dims = [i for i in range(first, w.ndim) if w.shape[i] % n == 0]
      if w.ndim - first < 2 or not dims:
        return P()
      best = max(dims, key=lambda i: w.shape[i])
      return P(*[("data", "replica") if i == best else None for i in range(w.ndim)])
    pspecs = jax.tree_util.tree_map_with_path(spec, params)

    def use(path, w):       # gathered where used: one layer at a time inside the scan's body
      del path
      return jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
    step, args = model(batch, use=use, **sizes)
  opt_specs = jax.tree.map(lambda _: P(), opt)
  if name == "FSDP dup":
    flat_p = jax.tree.leaves(pspecs, is_leaf=lambda s: isinstance(s, P))
    by_shape = {}
    for leaf, s in zip(jax.tree.leaves(params), flat_p):
      by_shape.setdefault(tuple(leaf.shape), s)
    opt_specs = jax.tree.map(lambda x: by_shape.get(tuple(x.shape), P()), opt)
  named = lambda t: jax.tree.map(lambda s: NamedSharding(mesh, s), t,
                                 is_leaf=lambda s: isinstance(s, P))
  ins = (named(pspecs), named(opt_specs), NamedSharding(mesh, tokens))
  fn = jax.jit(step, in_shardings=ins, out_shardings=(ins[0], ins[1], NamedSharding(mesh, P())))
  return fn, ins, mesh


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
  parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
  parser.add_argument("--d", type=int, default=128, help="model width (default 128)")
  parser.add_argument("--layers", type=int, default=2, help="layers (default 2)")
  parser.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
  parser.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when no XLA_FLAGS says otherwise (default 8)")
  parser.add_argument("--json", help="write the rows to this file")
  args = parser.parse_args(argv)
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import numpy as np
  import _harness
  import dtenjax
  from dtenjax.testing.xla import loop_repeats

  n = len(jax.devices())
  if args.batch < 1 or n % args.batch or args.seq % (n // args.batch):
    parser.error(f"--batch {args.batch} must divide the {n} devices, and --seq {args.seq} the "
                 f"{n // args.batch} devices per sequence")
  sizes = dict(seq=args.seq, vocab=1024, d=args.d, heads=max(1, args.d // 64), ffn=4 * args.d,
               layers=args.layers)
  step, abstract = model(args.batch, **sizes)
  plans = {"plan": dtenjax.plan(step, *abstract),
           "plan CP": dtenjax.plan(step, *abstract,
                                   mesh={"data": args.batch, "sequence": n // args.batch})}
  cands = {k: (p.jit(step), p.shardings()) for k, p in plans.items()}
  meshes = {k: {a: s for a, s in zip(p.axis_names, p.mesh_shape)} for k, p in plans.items()}
  for name in ("CP", "DP idle", "DP dup", "FSDP dup"):
    fn, shardings, mesh = hand_written(name, n, args.batch, sizes)
    cands[name] = (fn, shardings)
    meshes[name] = dict(mesh.shape)
  rng = np.random.default_rng(0)
  real = (jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(x.dtype),
                       abstract[0]),
          jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), abstract[1]),
          rng.integers(0, sizes["vocab"], abstract[2].shape).astype(np.int32))
  prof, placed, losses = {}, {}, {}
  for name, (fn, shardings) in _harness.progress(list(cands.items()), "compiling",
                                                 lambda kv: kv[0]):
    compiled = fn.lower(*abstract).compile()
    m = compiled.memory_analysis()
    repeats = loop_repeats(compiled)
    kinds: dict[str, float] = {}
    for c in dtenjax.explain(compiled).collectives:
      kinds[c.kind] = kinds.get(c.kind, 0.0) + c.nbytes * repeats(c.computation)
    prof[name] = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                  + m.temp_size_in_bytes, kinds)
    placed[name] = jax.device_put(real, shardings)
    losses[name] = float(fn(*placed[name])[2])
  samples = _harness.interleaved({k: (lambda k=k: cands[k][0](*placed[k])) for k in cands}, (),
                                 warmup=1, iters=args.iters)
  times = {k: _harness.median(v) for k, v in samples.items()}
  rows = []
  for name in cands:
    p = plans.get(name)
    mesh = meshes[name]
    mem, kinds = prof[name]
    predicted = (lambda kind: sum(v for k, v in p.cost.collective_bytes.items()
                                  if k.startswith(kind + "[")) / 2**20) if p else None
    rows.append({
        "layout": name, "mesh": "x".join(f"{a}{s}" for a, s in mesh.items() if s > 1),
        "mem_mib": mem / 2**20,
        "predicted_mem_mib": p.cost.memory["total"] / 2**20 if p is not None else None,
        "ag_mib": kinds.get("all_gather", 0.0) / 2**20,
        "predicted_ag_mib": predicted("all_gather") if p else None,
        "ar_mib": kinds.get("all_reduce", 0.0) / 2**20,
        "predicted_ar_mib": predicted("all_reduce") if p else None,
        "other_mib": sum(v for k, v in kinds.items()
                         if k not in ("all_gather", "all_reduce")) / 2**20,
        "loss": losses[name],
        "step_ms": times[name] * 1e3, "vs_CP": times[name] / times["CP"],
    })
  print(_harness.table(rows, [
      ("layout", "layout", "s"), ("mesh", "mesh", "s"), ("mem (MiB)", "mem_mib", ".2f"),
      ("priced", "predicted_mem_mib", ".2f"), ("all-gather", "ag_mib", ".2f"),
      ("priced", "predicted_ag_mib", ".2f"), ("all-reduce", "ar_mib", ".2f"),
      ("priced", "predicted_ar_mib", ".2f"), ("other", "other_mib", ".2f"),
      ("loss", "loss", ".5f"), ("step (ms)", "step_ms", ".2f"), ("vs CP", "vs_CP", "ratio")],
      title=f"decoder, batch {args.batch} x {args.seq} tokens, d {args.d}, {args.layers} layers "
      f"on {n} devices; collective bytes per kind in MiB per step and device"))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "sequence_parallel", __file__, sys.argv[1:] if argv is None else argv,
        {"iters": args.iters, "batch": args.batch, "seq": args.seq, "d": args.d,
         "layers": args.layers, "devices": n}, rows, devices=jax.devices(), kind="other"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
