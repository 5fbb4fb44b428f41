"""Top-k selection + packing on one device: exact lax.top_k against DGC's sampled threshold with
three packing formulations (jnp.nonzero, cumsum + scatter, the native kernel).

For n in {16 M, 134 M} float32 and density in {1%, 0.1%}, side by side in one run:

  top_k      exact lax.top_k(|x|, k) (a full sort on GPU), the reference
  thresh     the sampled threshold alone (top-k on a 1% stratified sample)
  +nonzero   threshold, then jnp.nonzero(|x| >= t, size=k) and a gather
  +cumsum    threshold, then cumsum stream compaction with a scatter into k slots
  +kernel    threshold, then the dtenjax_topk_pack FFI kernel (CUDA on GPU, C++ on CPU)
  select     dtenjax's select(): threshold + kernel (or cumsum) + the exact fallback cond
  copy       y = x + 1, one read and one write of x: the memory-bandwidth yardstick

Each candidate is jitted, warmed up, then timed as R repeats of N back-to-back calls with one
device synchronisation per repeat (so dispatch overlaps device work); the median per call is
reported with its ratio to top_k. Outputs of the kernel are checked against the cumsum
formulation (identical bits) before timing.

    python bench/compression_select.py [--sizes 16M,134M] [--ratios 0.01,0.001] [--json PATH]

(``--sizes`` counts float32 elements, K/M/G as powers of 1024.) ``--json`` writes
bench/_harness.py's one schema and says where.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import _harness
from dtenjax import compression
from dtenjax.testing import xla


def timeit(fn, x, *, calls: int, repeats: int) -> float:
  """Median seconds per call."""
  jax.block_until_ready(fn(x))
  jax.block_until_ready(fn(x))
  per = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(x)
    jax.block_until_ready(out)
    per.append((time.perf_counter() - t0) / calls)
  return statistics.median(per)


def candidates(k: int, sample_ratio: float, has_kernel: bool):
  def thresh(x):
    return compression.sample_threshold(x, k, sample_ratio=sample_ratio)

  def with_nonzero(x):
    t = thresh(x)
    (idx,) = jnp.nonzero(jnp.abs(x) >= t, size=k, fill_value=x.shape[0])
    return idx, x.at[idx].get(mode="fill", fill_value=0)

  c = {
      "top_k": lambda x: compression.exact_topk(x, k),
      "thresh": thresh,
      "+nonzero": with_nonzero,
      "+cumsum": lambda x: compression.pack(x, thresh(x), k, pack="cumsum"),
  }
  if has_kernel:
    c["+kernel"] = lambda x: compression.pack(x, thresh(x), k, pack="ffi")
  c["select"] = lambda x: compression.select(x, k, sample_ratio=sample_ratio)
  c["copy"] = lambda x: x + 1.0
  return {name: jax.jit(f) for name, f in c.items()}


def _ratios(text: str) -> list[float]:
  try:
    rs = [float(r) for r in text.split(",") if r.strip()]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of densities") from None
  if not rs or any(not 0 < r <= 1 for r in rs):
    raise argparse.ArgumentTypeError(f"densities {text!r} must lie in (0, 1]")
  return rs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/compression_select.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", default=_harness.sizes_arg("16M,134M"), type=_harness.sizes_arg,
                  help="float32 elements, comma list (K/M/G)")
  ap.add_argument("--ratios", default=[0.01, 0.001], type=_ratios)
  ap.add_argument("--sample-ratio", type=float, default=0.01)
  ap.add_argument("--calls", type=_harness.positive_int, default=10)
  ap.add_argument("--repeats", type=_harness.positive_int, default=5)
  ap.add_argument("--skip", default="", help="comma-separated candidates to leave out")
  ap.add_argument("--json", default=None, metavar="PATH")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  backend = jax.default_backend()
  platform = {"cpu": "cpu", "gpu": "CUDA", "cuda": "CUDA"}.get(backend, "")
  has_kernel = bool(platform) and xla.has_ffi_target(xla.TOPK_TARGET, platform)
  skip = {s for s in args.skip.split(",") if s}
  rows = []
  with _harness.steps("compression_select", len(args.sizes) * len(args.ratios)) as step:
    for n in args.sizes:
      # numpy's draw: an eager jax.random.normal compiles a program per size
      x = jnp.asarray(np.random.default_rng(0).standard_normal(n, np.float32))
      for ratio in args.ratios:
        step(f"n={n}, ratio={ratio}")
        k = compression.num_selected(n, ratio)
        fns = candidates(k, args.sample_ratio, has_kernel)
        check = {}
        if has_kernel:
          t = fns["thresh"](x)
          a = jax.jit(lambda x, t: compression.pack(x, t, k, pack="ffi"))(x, t)
          b = jax.jit(lambda x, t: compression.pack(x, t, k, pack="cumsum"))(x, t)
          check["kernel_equals_cumsum"] = all(bool(jnp.array_equal(u, v)) for u, v in zip(a, b))
          check["count"] = int(a[2])
        sel = fns["select"](x)
        ref = fns["top_k"](x)[0] if "top_k" not in skip else None
        if ref is not None:
          got = np.asarray(sel[0])
          check["select_overlap_with_exact"] = len(
              set(got[got < n].tolist()) & set(np.asarray(ref).tolist())) / k
        times = {}
        for name, fn in fns.items():
          if name in skip:
            continue
          times[name] = timeit(fn, x, calls=args.calls, repeats=args.repeats)
        rows.append(dict(n=n, ratio=ratio, k=k, backend=backend, times_s=times, check=check))
        print(f"n={n} ratio={ratio} k={k} check={check}", flush=True)
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "compression_select", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"},
        rows, kind="other", devices=jax.devices()[:1]))
  names = [c for c in ("top_k", "thresh", "+nonzero", "+cumsum", "+kernel", "select", "copy")
           if any(c in r["times_s"] for r in rows)]

  def cell(r, c):
    t, base = r["times_s"].get(c), r["times_s"].get("top_k")
    if t is None:
      return None
    return f"{1e3 * t:.3f} ({base / t:.1f}x)" if base else f"{1e3 * t:.3f}"
  shown = [dict(n=r["n"], ratio=r["ratio"], **{c: cell(r, c) for c in names}) for r in rows]
  print(_harness.table(shown, (("n", "n", "d"), ("ratio", "ratio", "g")) +
                       tuple((c, c, "s") for c in names),
                       title=f"\nselection + packing on {jax.devices()[0].device_kind} "
                             f"({backend}), median ms per call (x top_k / candidate)"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
