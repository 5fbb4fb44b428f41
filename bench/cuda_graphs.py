"""CUDA graphs (XLA command buffers) on a launch-bound step: off vs XLA's defaults vs dtenjax.

Seed section 2.1 compares per-kernel launches with graph replay. This script builds steps made of
many small ops, compiles each under several CUDA-graph policies (dtenjax.jit(cuda_graphs=...)),
and times them side by side in one run:

* ``launch``: L layers of (small fusion -> dtenjax CUDA custom call dtenjax_graph_probe_scale_add),
  i.e. 2L tiny launches; the custom call is command-buffer compatible and must not split graphs.
* ``loop``: a lax.fori_loop of small fusions + custom calls (a WHILE op: replayed on the device
  only when the policy records WHILE).
* ``split``: runs of three small ops separated by a tiny convolution (cuDNN; XLA cannot record it),
  so the minimum graph size decides whether the short runs become graphs.

Timing: warm up, then T back-to-back steps synchronised once at the end, repeated R times; the
median per-step time is reported with its ratio to graphs off. Two more columns per row:

* ``predicted``: graph_report's graphs and launches per step, a PREDICTION from XLA's rules
  applied to the compiled schedule (jax 0.10.2/0.11 form command buffers after HLO, so the HLO
  cannot show them);
* ``observed`` (GPU only): what the GPU really launched per step, read from a jax.profiler trace
  (graphs.observe_launches): CUDA graph launches and kernels launched one by one.

On a machine without a GPU the script still runs (plain jnp in place of the CUDA custom call),
leaves the observed columns empty and says that command buffers do not apply.

  python bench/cuda_graphs.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import dtenjax._src.ffi as dffi
from dtenjax._src.gpu import graphs

POLICIES = ("off", "xla", "auto", "all")


def scale_add_fn(on_gpu: bool):
  """out = 0.5 * x + y through the dtenjax CUDA custom call (or jnp where there is none)."""
  if on_gpu and dffi.has_target("dtenjax_graph_probe_scale_add", "CUDA"):
    target = dffi.require("dtenjax_graph_probe_scale_add", "CUDA")

    def f(x, y):
      return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          x, y, scale=np.float32(0.5))
    return f, True
  return (lambda x, y: 0.5 * x + y), False


def make_cases(layers: int, n: int, on_gpu: bool):
  sa, native = scale_add_fn(on_gpu)

  def launch(x, y):
    for i in range(layers):
      x = jnp.sin(x) * (1.0 + 1e-3 * i)
      x = sa(x, y)
    return x

  def loop(x, y):
    def body(i, c):
      c = jnp.cos(c) + 1e-3 * i.astype(c.dtype)
      return sa(c, y)
    return jax.lax.fori_loop(0, layers, body, x)

  kern = jnp.ones((3, 1, 1), jnp.float32) / 3.0

  def split(x, y):
    for _ in range(max(layers // 4, 1)):
      x = jnp.tanh(x) + 1.0
      x = sa(x, y)
      x = jnp.sin(x) * 0.9
      x = jax.lax.conv_general_dilated(x.reshape(1, n, 1), kern, (1,), "SAME",
                                       dimension_numbers=("NWC", "WIO", "NWC")).reshape(n)
    return x

  return {"launch": launch, "loop": loop, "split": split}, native


def time_step(f, args, steps: int, repeats: int) -> float:
  jax.block_until_ready(f(*args))
  jax.block_until_ready(f(*args))
  per_step = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
      out = f(*args)
    jax.block_until_ready(out)
    per_step.append((time.perf_counter() - t0) / steps)
  return statistics.median(per_step)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--layers", type=int, default=100)
  ap.add_argument("--n", type=int, default=4096, help="elements per array")
  ap.add_argument("--steps", type=int, default=200)
  ap.add_argument("--repeats", type=int, default=7)
  ap.add_argument("--cases", default="launch,loop,split")
  ap.add_argument("--observe-steps", type=int, default=10,
                  help="steps traced with jax.profiler for the observed columns (GPU only)")
  ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
  ap.add_argument("--json", default=None, help="write the results here")
  ap.add_argument("--dump-hlo", default=None,
                  help="write the optimised HLO of every case and policy to this one file")
  args = ap.parse_args(argv)
  if args.quick:
    args.layers, args.steps, args.repeats = 8, 5, 2

  on_gpu = jax.default_backend() == "gpu"
  cases, native = make_cases(args.layers, args.n, on_gpu)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(args.n), jnp.float32)
  y = jnp.asarray(rng.standard_normal(args.n) * 0.1, jnp.float32)
  rows = []
  for case in args.cases.split(","):
    fn = cases[case]
    ref = None
    base = None
    for mode in POLICIES:
      f = graphs.jit(fn, mode)
      t = time_step(f, (x, y), args.steps, args.repeats)
      out = np.asarray(f(x, y))
      ref = out if ref is None else ref
      rep = graphs.graph_report(f, x, y)
      obs = graphs.observe_launches(f, x, y, steps=args.observe_steps) if on_gpu else None
      if args.dump_hlo:
        with open(args.dump_hlo, "a") as fh:
          fh.write(f"\n\n===== case {case} policy {mode} =====\n")
          fh.write(f.lower(x, y).compile().as_text())
      base = t if base is None else base
      rows.append({
          "case": case, "policy": mode, "us_per_step": t * 1e6, "speedup_vs_off": base / t,
          "graphs": rep.num_graphs, "ops_inside": rep.ops_inside, "ops_outside": rep.ops_outside,
          "report_source": rep.source, "launches_per_step": rep.launches(),
          "observed_graph_launches_per_step": (obs.per_step(obs.graph_launches + obs.graph_executions)
                                               if obs else None),
          "observed_kernels_outside_per_step": obs.per_step(obs.kernels_outside) if obs else None,
          "max_abs_diff_vs_off": float(np.max(np.abs(out - ref))),
          "splitters": sorted({w for _, w, _ in rep.splitters}),
      })
      seen = (f"; observed: {rows[-1]['observed_graph_launches_per_step']:.1f} graph launches, "
              f"{rows[-1]['observed_kernels_outside_per_step']:.1f} kernels outside per step"
              if obs else "")
      print(f"{case:7s} {mode:5s} {t * 1e6:9.1f} us/step  report ({rep.source}): "
            f"{rep.num_graphs} graphs, {rep.ops_inside} in / {rep.ops_outside} out{seen}",
            flush=True)

  meta = {"date": time.strftime("%Y-%m-%d"), "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "dtenjax_cuda_custom_call": native, "layers": args.layers, "n": args.n,
          "steps": args.steps, "repeats": args.repeats, "command": " ".join(sys.argv)}
  if not on_gpu:
    print(f"note: backend {jax.default_backend()!r}: command buffers do not apply; the policies "
          "compile the same program and the times differ only by noise.")
  if args.json:
    with open(args.json, "w") as fh:
      json.dump({"meta": meta, "rows": rows}, fh, indent=1)

  from rich.console import Console  # pylint: disable=g-import-not-at-top
  from rich.table import Table  # pylint: disable=g-import-not-at-top
  table = Table(title=f"CUDA graphs per policy on {meta['device']} (jax {meta['jax']}, "
                f"{args.layers} layers, {args.n} f32, dtenjax custom call: {native})")
  for col in ("case", "policy", "us/step", "x vs off", "graphs (pred.)", "ops in (pred.)",
              "ops out (pred.)", "launches (pred.)", "graph launches (obs.)",
              "kernels outside (obs.)", "split by (pred.)"):
    table.add_column(col)
  fmt = lambda v: "-" if v is None else f"{v:.1f}"
  for r in rows:
    table.add_row(r["case"], r["policy"], f"{r['us_per_step']:.1f}", f"{r['speedup_vs_off']:.2f}",
                  str(r["graphs"]), str(r["ops_inside"]), str(r["ops_outside"]),
                  str(r["launches_per_step"]), fmt(r["observed_graph_launches_per_step"]),
                  fmt(r["observed_kernels_outside_per_step"]), ",".join(r["splitters"])[:30])
  Console(width=180).print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
