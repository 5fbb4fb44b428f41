"""``plan.jit``'s FSDP step against the plain ``jax.jit`` FSDP step a user writes, on 8 CPU
devices, for small MLPs at batches from below to above the input width (issue 39, item 2: the
planned step's compiled memory at most the plain step's plus 10 %).

For each case, one process: the adamw step of a two-layer MLP (``gelu(x @ w1 + b1) @ w2 + b2``,
mean squared error) planned on ``mesh={"fsdp": 8}`` and run by ``plan.jit``, beside the same step
under ``jax.jit`` with every leaf whose first dimension divides over the 8 devices laid out
``P("fsdp")`` and every other leaf replicated (the user's FSDP: no sharding constraints, XLA's
partitioner chooses the program). Each row has the compiled memory per device
(``memory_analysis()``: arguments, outputs not aliased, temporaries), the collective bytes per
kind read from the compiled HLO, and the step time (median of rounds timed round-robin, every
other round in the reverse order)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/fsdp_small_batch.py \\
        --iters 20 --json bench/results/DATE_fsdp_small_batch_BRANCH.json

``--models`` picks the MLP's variants (``MODELS``, comma-separated): ``mlp``, the two-layer MLP
above; ``two_views``, the same MLP applied to the batch and to its features reversed, the two
losses summed (every weight read by two products: tests/test_plan_user_steps.py's
``two_views``); ``remat_first``, the first layer (``gelu(x @ w1 + b1)``) inside
``jax.checkpoint``; ``remat_dots``, the same under ``policy=dots_saveable``; ``remat_second``,
the second layer (``h @ w2 + b2``) inside ``jax.checkpoint``; ``remat_both``, both layers each
inside its own (issue 39's checkpoint rows, docs/benchmarks.md review20a and fsdp21);
``gated_head``, the loss through one of two first layers a parameter gates, ``lax.cond(flag > 0,
MLP of w1, MLP of head)`` (tests/test_plan_user_steps.py's ``gated_head``: each branch's
gradients made in the backward's conditional, docs/benchmarks.md cond21b); ``remat_block``, the
whole MLP under one ``jax.checkpoint`` (flax ``nn.remat``'s form), applied twice (its output
is its input's width; docs/benchmarks.md remat22); ``remat_twice``, the MLP under
``nothing_saveable`` applied twice inside one ``dots_saveable`` checkpoint (one checkpointed
function called twice on the same weights, each under its own policy: docs/benchmarks.md
remat27).

``--dtype bfloat16`` makes the parameters bfloat16 (the batch cast to it for the products, the
loss in float32: docs/benchmarks.md bf16_22's rows).

``--layouts`` times, beside the two, the other layouts a user may write of the same step on the
same mesh -- DP (every leaf replicated, the batch over ``fsdp``) and each weight matrix alone
laid out ``P("fsdp")`` (with its bias) -- and ``plan.jit`` of ``dtenjax.plan(..., measure=True)``:
which layout is fastest when run, against the one the plan's priced model chose.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _harness

BENCH = "fsdp_small_batch"
# (input width, hidden width, batch): the suite's MLP (tests/test_plan_user_steps.py) at five
# batches (136: just above w1's threshold, where w2's gradient alone moves), and one twice as
# wide at two
CASES = ((128, 512, 16), (128, 512, 64), (128, 512, 136), (128, 512, 256), (128, 512, 512),
         (256, 1024, 64), (256, 1024, 1024))


# the MLP's variants (--models): the rows fsdp19 left (docs/benchmarks.md, fsdp19b)
MODELS = ("mlp", "two_views", "remat_first", "remat_dots", "remat_second", "remat_both",
          "gated_head", "remat_block", "remat_twice")


def _first(p, x):
  return jax.nn.gelu(x @ p["w1"] + p["b1"])


def _second(p, h):
  return h @ p["w2"] + p["b2"]


def make(d: int, hidden: int, batch: int, model: str = "mlp", dtype: str = "float32"):
  """The adamw step of the MLP (``model``, one of MODELS) and its concrete arguments; the
  parameters of ``dtype`` (``bfloat16``: the batch cast to it for the products, the loss taken
  in float32)."""
  tx = optax.adamw(1e-2)
  keys = iter(jax.random.split(jax.random.key(0), 4))
  normal = lambda *s: 0.1 * jax.random.normal(next(keys), s, jnp.float32)
  first = (jax.checkpoint(_first) if model in ("remat_first", "remat_both") else
           jax.checkpoint(_first, policy=jax.checkpoint_policies.dots_saveable)
           if model == "remat_dots" else _first)
  second = (jax.checkpoint(_second) if model in ("remat_second", "remat_both") else _second)

  def mse(p, x, y):
    if model == "remat_block":
      block = jax.checkpoint(lambda p, x: _second(p, _first(p, x)))
      return jnp.mean((block(p, block(p, x.astype(dtype))).astype(jnp.float32) - y) ** 2)
    if model == "remat_twice":
      once = jax.checkpoint(lambda p, x: _second(p, _first(p, x)),
                            policy=jax.checkpoint_policies.nothing_saveable)
      twice = jax.checkpoint(lambda p, x: once(p, once(p, x)),
                             policy=jax.checkpoint_policies.dots_saveable)
      return jnp.mean((twice(p, x.astype(dtype)).astype(jnp.float32) - y) ** 2)
    if dtype != "float32":
      return jnp.mean((second(p, first(p, x.astype(dtype))).astype(jnp.float32) - y) ** 2)
    return jnp.mean((second(p, first(p, x)) - y) ** 2)

  def loss(p, batch):
    if model == "gated_head":
      other = lambda q: mse({**q, "w1": q["head"]}, batch["x"], batch["y"])
      return jax.lax.cond(p["flag"] > 0, lambda q: mse(q, batch["x"], batch["y"]), other, p)
    value = mse(p, batch["x"], batch["y"])
    if model == "two_views":
      value = value + mse(p, batch["x"][:, ::-1], batch["y"])
    return value

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  params = {"w1": normal(d, hidden), "b1": jnp.zeros((hidden,)), "w2": normal(hidden, d),
            "b2": jnp.zeros((d,))}
  if model == "gated_head":
    params["head"] = 0.1 * jax.random.normal(jax.random.key(7), (d, hidden), jnp.float32)
    params["flag"] = jnp.asarray(1.0, jnp.float32)
  params = jax.tree.map(lambda a: a.astype(dtype) if a.ndim else a, params)
  return step, (params, tx.init(params), {"x": normal(batch, d), "y": normal(batch, d)})


def _cases(text: str) -> tuple[tuple[int, int, int], ...]:
  try:
    cases = tuple(tuple(int(v) for v in c.split(",")) for c in text.split(";") if c.strip())
  except ValueError:
    cases = ()
  if not cases or any(len(c) != 3 or min(c) <= 0 or c[2] % 8 for c in cases):
    raise argparse.ArgumentTypeError(
        f"--cases {text!r}: give D,HIDDEN,BATCH triples of positive ints separated by ';', "
        "the batch a multiple of the 8 devices (e.g. 128,512,64;128,512,256)")
  return cases


def _models(text: str) -> tuple[str, ...]:
  models = tuple(m.strip() for m in text.split(",") if m.strip())
  bad = [m for m in models if m not in MODELS]
  if not models or bad:
    raise argparse.ArgumentTypeError(
        f"--models {text!r}: {bad or 'none given'} not among {', '.join(MODELS)}; give a "
        "comma-separated list of them (e.g. mlp,remat_first)")
  return models


def _layout(mesh, concrete, sharded):
  """NamedShardings of the step's arguments: the batch over ``fsdp``; a parameter (and its
  optimizer state) whose name ``sharded(name)`` takes, and whose first dimension divides over the
  8 devices, ``P("fsdp")``; every other leaf replicated. The plain jit's FSDP is every name."""
  def spec(path, x):
    keys = [getattr(k, "key", None) for k in path]
    name = next((k for k in reversed(keys) if isinstance(k, str)), None)
    batch = path and getattr(path[0], "idx", None) == 2
    split = x.ndim and x.shape[0] % 8 == 0 and (batch or sharded(name))
    return NamedSharding(mesh, P("fsdp") if split else P())
  return jax.tree_util.tree_map_with_path(spec, concrete)


def compiled_stats(compiled) -> dict:
  """Memory per device (MiB) and collective bytes per kind (KiB) of a compiled step."""
  import dtenjax
  m = compiled.memory_analysis()
  kinds: dict[str, float] = {}
  for c in dtenjax.explain(compiled).collectives:
    kinds[c.kind] = kinds.get(c.kind, 0.0) + c.nbytes / 2**10
  return {"memory_mib": (m.argument_size_in_bytes + m.output_size_in_bytes
                         - m.alias_size_in_bytes + m.temp_size_in_bytes) / 2**20,
          "temp_mib": m.temp_size_in_bytes / 2**20,
          "collective_kib": {k: round(v, 1) for k, v in sorted(kinds.items())}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--iters", type=_harness.positive_int, default=20)
  ap.add_argument("--warmup", type=_harness.positive_int, default=2)
  ap.add_argument("--json", default=None, help="write the rows here")
  ap.add_argument("--cases", type=_cases, default=CASES,
                  help="D,HIDDEN,BATCH[;...] (default: the seven of CASES)")
  ap.add_argument("--models", type=_models, default=("mlp",),
                  help=f"the MLP's variants, comma-separated, of {','.join(MODELS)} (default mlp; "
                       "see the module's docstring)")
  ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                  help="the parameters' dtype (default float32; bfloat16: docs/benchmarks.md "
                       "bf16_22)")
  ap.add_argument("--layouts", action="store_true",
                  help="also time DP, each weight matrix alone over fsdp, and the plan made with "
                       "measure=True (see the module's docstring)")
  args = ap.parse_args(argv)
  devices = _harness.require_devices(BENCH, 8)
  import dtenjax
  mesh = jax.sharding.Mesh(np.array(devices[:8]), ("fsdp",))
  rows = []
  runs = [(m, *c) for m in args.models for c in args.cases]
  for model, d, hidden, batch in _harness.progress(runs, BENCH,
                                                   lambda c: f"{c[0]} d {c[1]} batch {c[3]}"):
    step, concrete = make(d, hidden, batch, model, args.dtype)
    fsdp = _layout(mesh, concrete, lambda name: True)
    plan = dtenjax.plan(step, *concrete, mesh={"fsdp": 8})
    fns = {"plain jit": jax.jit(step, in_shardings=fsdp).lower(*concrete).compile(),
           "plan.jit": plan.jit(step).lower(*concrete).compile()}
    placed = {"plain jit": jax.device_put(concrete, fsdp), "plan.jit": plan.shard(*concrete)}
    if args.layouts:
      hand = {"DP": lambda name: False}
      hand.update({f"{w} only": (lambda name, w=w: name in (w, "b" + w[1:]))
                   for w in sorted(concrete[0]) if concrete[0][w].ndim == 2})
      for k, sharded in hand.items():
        shardings = _layout(mesh, concrete, sharded)
        fns[k] = jax.jit(step, in_shardings=shardings).lower(*concrete).compile()
        placed[k] = jax.device_put(concrete, shardings)
      measured = dtenjax.plan(step, *concrete, mesh={"fsdp": 8}, measure=True)
      fns["plan.jit, measure=True"] = measured.jit(step).lower(*concrete).compile()
      placed["plan.jit, measure=True"] = measured.shard(*concrete)
    samples = {k: [] for k in fns}
    for k, f in fns.items():
      for _ in range(args.warmup):
        _harness.block(f(*placed[k]))
    order = list(fns)
    for i in range(args.iters):
      for k in (order if i % 2 == 0 else order[::-1]):
        t0 = time.perf_counter()
        _harness.block(fns[k](*placed[k]))
        samples[k].append(time.perf_counter() - t0)
    stats = {k: compiled_stats(f) for k, f in fns.items()}
    for k in fns:
      rows.append({"case": f"d {d} h {hidden} batch {batch}", "model": model,
                   "dtype": args.dtype,
                   "candidate": k, **stats[k],
                   "memory_vs_plain": stats[k]["memory_mib"] / stats["plain jit"]["memory_mib"],
                   "ms": 1e3 * _harness.median(samples[k]),
                   "time_vs_plain": _harness.median(
                       [a / b for a, b in zip(samples[k], samples["plain jit"])]),
                   "collectives": " ".join(f"{n} {v:.0f}"
                                           for n, v in stats[k]["collective_kib"].items())})
  print(_harness.table(rows, (("model", "model", "s"), ("case", "case", "s"),
                              ("candidate", "candidate", "s"),
                              ("memory MiB", "memory_mib", ".3f"), ("temp MiB", "temp_mib", ".3f"),
                              ("/ plain", "memory_vs_plain", ".3f"),
                              ("collectives KiB", "collectives", "s"),
                              ("ms", "ms", ".3f"), ("time / plain", "time_vs_plain", ".2f"))),
        flush=True)
  if args.json:
    doc = _harness.document(BENCH, __file__, sys.argv[1:] if argv is None else argv,
                            dict(vars(args)), rows, devices=devices, kind="other")
    _harness.write_json(args.json, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
