"""A scanned stack of convolution and batch-norm layers, data-parallel beside FSDP, on 8 CPU
devices: does FSDP's per-layer gather wait for the layer's products, or has the norm's meeting of
the devices (its statistics' all-reduces, inside the loop's body) already lined them up?

Times, round-robin in one process (``_harness.interleaved``), plain ``jax.jit`` with
``NamedSharding``s as a user writes them (DP: the weights replicated; FSDP: the stack sharded over
its output channels and each layer gathered in the loop's body by a sharding constraint, as
bench/_families.py's FSDP recipe does) and ``plan.jit`` of the FSDP layout pinned, for the stack
with its norms and without them (a ReLU in their place: no meeting), and prints the planner's
price of both layouts beside the measured ratio::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/scan_norm_waits.py \\
        --iters 10 --json bench/results/DATE_scan_norm_waits_BRANCH.json
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _harness

BENCH = "scan_norm_waits"


def _norm(y):
  mean, var = jnp.mean(y, (0, 1, 2)), jnp.var(y, (0, 1, 2))
  return jax.nn.relu((y - mean) * jax.lax.rsqrt(var + 1e-5))


def _conv(x, k):
  return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                      dimension_numbers=("NHWC", "HWIO", "NHWC"))


def make(channels: int, layers: int, batch: int, image: int, norm: bool, gather=None):
  """(step, abstract args): a stem convolution, then ``layers`` scanned convolutions each
  followed by batch norm's statistics (``norm``) or a ReLU; ``gather(k)`` is what the body does
  to a layer's kernel before its convolution (the FSDP recipe's sharding constraint)."""
  def loss(p, x):
    x = jax.nn.relu(_conv(x, p["stem"]))

    def body(x, k):
      y = _conv(x, gather(k) if gather else k)
      return (_norm(y) if norm else jax.nn.relu(y)), None
    x, _ = jax.lax.scan(body, x, p["stack"])
    return jnp.mean(x ** 2)

  def step(p, x):
    return jax.tree.map(lambda a, g: a - 0.01 * g, p, jax.grad(loss)(p, x))
  params = {"stem": jax.ShapeDtypeStruct((3, 3, 3, channels), jnp.float32),
            "stack": jax.ShapeDtypeStruct((layers, 3, 3, channels, channels), jnp.float32)}
  return step, (params, jax.ShapeDtypeStruct((batch, image, image, 3), jnp.float32))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--channels", type=_harness.positive_int, default=32)
  ap.add_argument("--layers", type=_harness.positive_int, default=4)
  ap.add_argument("--batch", type=_harness.positive_int, default=32)
  ap.add_argument("--image", type=_harness.positive_int, default=16)
  ap.add_argument("--iters", type=_harness.positive_int, default=10)
  ap.add_argument("--warmup", type=_harness.positive_int, default=2)
  ap.add_argument("--json", default=None, help="write the rows here")
  args = ap.parse_args(argv)
  devices = _harness.require_devices(BENCH, 8)
  import dtenjax
  mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
  shard = lambda spec: NamedSharding(mesh, spec)
  fsdp_spec = {"stem": P(), "stack": P(None, None, None, None, "fsdp")}
  dp_spec = {"stem": P(), "stack": P()}
  sizes = (args.channels, args.layers, args.batch, args.image)
  rows = []
  for norm in _harness.progress((True, False), BENCH, lambda n: f"norms={n}"):
    step, abstract = make(*sizes, norm)
    fsdp_step, _ = make(*sizes, norm, gather=lambda k: jax.lax.with_sharding_constraint(
        k, shard(P())))
    rng = np.random.default_rng(0)
    concrete = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.1, a.dtype),
                            abstract)
    fns, placed = {}, {}
    for name, fn, spec in (("DP", step, dp_spec), ("FSDP", fsdp_step, fsdp_spec)):
      shardings = (jax.tree.map(shard, spec), shard(P("fsdp")))
      fns[name] = jax.jit(fn, in_shardings=shardings, out_shardings=shardings[0])
      placed[name] = jax.device_put(concrete, shardings)
    priced = {}
    for name, spec in (("DP", dp_spec), ("FSDP", fsdp_spec)):
      plan = dtenjax.plan(step, *abstract, mesh={"fsdp": 8}, pinned=[spec, None],
                          memory_budget=1 << 40)
      priced[name] = plan.cost.total_s
      if name == "FSDP":
        fns["plan FSDP"] = plan.jit(step)
        placed["plan FSDP"] = jax.device_put(
            concrete, (jax.tree.map(shard, fsdp_spec), shard(P("fsdp"))))
    samples = {k: [] for k in fns}
    for k, f in fns.items():       # each candidate its own arguments, one call a round
      for _ in range(args.warmup):
        _harness.block(f(*placed[k]))
    for _ in range(args.iters):
      for k, f in fns.items():
        t0 = time.perf_counter()
        _harness.block(f(*placed[k]))
        samples[k].append(time.perf_counter() - t0)
    for k in fns:
      ratio = _harness.median([a / b for a, b in zip(samples[k], samples["DP"])])
      row = {"norms": norm, "layout": k, "ms": 1e3 * _harness.median(samples[k]),
             "vs_dp": ratio,
             "priced_ms": 1e3 * priced.get(k.removeprefix("plan "), float("nan")),
             "priced_vs_dp": priced.get(k.removeprefix("plan "), float("nan")) / priced["DP"]}
      rows.append(row)
  shown = [{**r, "norms": str(r["norms"])} for r in rows]
  print(_harness.table(shown, (("norms", "norms", "s"), ("layout", "layout", "s"),
                               ("ms", "ms", ".1f"), ("/ DP", "vs_dp", "ratio"),
                               ("priced ms", "priced_ms", ".1f"),
                               ("priced / DP", "priced_vs_dp", "ratio"))), flush=True)
  if args.json:
    params = dict(vars(args))
    doc = _harness.document(BENCH, __file__, sys.argv[1:] if argv is None else argv, params,
                            rows, devices=devices, kind="other")
    _harness.write_json(args.json, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
