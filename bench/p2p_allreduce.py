"""Benchmark of the p2p all-reduce kernels with N simulated ranks on one GPU.

Every rank's kernel runs on the same GPU (the simulated-rank harness of the test extension,
dtenjax._ffi_testing, through dtenjax/testing/native.py, as in tests/test_p2p.py), so the number
that means something is the fraction of the GPU's memory bandwidth the kernel reaches, against a
device-to-device copy measured in the same run. Per rank and message of n bytes, the fewest
bytes through HBM are: one-shot 4n (read input, write stage, read stage, write output; the other
ranks' reads of a stage hit L2 at best), two-shot 5n (+ the in-place write of the reduced
segment and the gather). `hbm_GB/s` uses those counts; `ratio` = hbm_GB/s / copy GB/s (goal
>= 0.85 for one-shot). `algbw` is n / time (nccl-tests style, per rank). `repro_us` times the
fused reproducible kernel (contract v3, reproducible=True) on the same data, `exact_us` the exact
contract v2 (reproducible="exact"); `plain/repro` and `plain/exact` = plain time / their time
(1.0: the fixed-point conversion is free; it shows what the conversion costs on a GPU's cores,
which simulated ranks share, so it is a pessimistic bound for real peers).

Timing: jit calls that launch the kernel K1 and K2 times; (t(K2) - t(K1)) / (K2 - K1), medians
of several calls, so dispatch overhead cancels (K2 is larger for small messages, so the difference
stays well above the host clock's noise; a difference that is not positive is reported as nan,
never as a time). Rows also carry nccl-tests' columns (size per
rank, count, type, time, algbw, busbw = algbw x 2(W-1)/W for W simulated ranks). It needs a CUDA
GPU, the extension built with CUDA and the test extension (an editable install:
pip install --no-build-isolation -e .), and refuses (exit status 3, one line) without them.

  python bench/p2p_allreduce.py [--json PATH] [--quick] [--reps 7]
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
import dtenjax

from dtenjax.testing import native as native_testing

K1 = 2


def launches_for(nbytes: int) -> int:
  """K2: about a millisecond of kernel time between the two calls at every size."""
  return 12 if nbytes >= 1 << 20 else 102


def _time(fn, x, reps: int) -> float:
  fn(x).block_until_ready()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn(x).block_until_ready()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts)


def per_launch(x, *, algorithm: str, mode: int, reps: int,
               reproducible: bool | str = False) -> float | None:
  """Seconds per launch: K2 launches against K1 in one call; None (said on stderr) when the
  difference is within the noise, so that no row shows an unmeasured time."""
  k2 = launches_for(x.nbytes // x.shape[0])
  selftest = native_testing.p2p_selftest
  f1 = jax.jit(lambda v: selftest(v, algorithm=algorithm, iters=K1, mode=mode,
                                  reproducible=reproducible))
  f2 = jax.jit(lambda v: selftest(v, algorithm=algorithm, iters=k2, mode=mode,
                                  reproducible=reproducible))
  return _harness.per_op_seconds(
      _time(f2, x, reps), _time(f1, x, reps), k2 - K1,
      what=f"{algorithm} mode {mode} reproducible={reproducible} at {x.nbytes // x.shape[0]} B "
           f"x {x.shape[0]} ranks")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/p2p_allreduce.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--json", default=None, metavar="PATH")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--reps", type=_harness.positive_int, default=7)
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  _harness.require_gpu("bench/p2p_allreduce.py", "the NVLink p2p kernels")
  if not dtenjax.build_info().get("cuda"):
    _harness.refuse("bench/p2p_allreduce.py",
                    "the native extension was built without CUDA (python -m dtenjax info); "
                    "rebuild it where nvcc is found: pip install --no-build-isolation -e .")
  try:
    native_testing.require(native_testing.P2P_SELFTEST, "CUDA")
  except dtenjax.ExtensionUnavailableError as e:
    _harness.refuse("bench/p2p_allreduce.py", f"the simulated-rank harness is missing: {e}")
  worlds = (2, 8) if args.quick else (2, 4, 8)
  sizes = ((8 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20) if not args.quick
           else (8 << 10, 256 << 10, 16 << 20))
  dtypes = (jnp.bfloat16, jnp.float32)
  rows = []
  with _harness.steps("p2p_allreduce", len(worlds) * len(dtypes) * len(sizes)) as step:
    for world in worlds:
      for dtype in dtypes:
        for nbytes in sizes:
          step(f"W={world}, {jnp.dtype(dtype).name}, {_harness.format_size(nbytes)}")
          itemsize = jnp.dtype(dtype).itemsize
          n = nbytes // itemsize
          x = jax.device_put(jnp.asarray(
              np.random.default_rng(0).standard_normal((world, n)).astype(np.float32), dtype))
          # The arena of W ranks is created by the first (validation) call.
          jax.jit(lambda v: native_testing.p2p_selftest(v, iters=1))(x).block_until_ready()
          t_copy = per_launch(x, algorithm="one_shot", mode=2, reps=args.reps)
          copy_bw = 2 * world * nbytes / t_copy / 1e9 if t_copy else None
          for alg, hbm_bytes in (("one_shot", 4), ("two_shot", 5)):
            t = per_launch(x, algorithm=alg, mode=1, reps=args.reps)
            if t is None:                  # within the noise: no row (said on stderr)
              continue
            hbm = hbm_bytes * world * nbytes / t / 1e9
            t_rep = per_launch(x, algorithm=alg, mode=1, reps=args.reps, reproducible=True)
            t_exact = per_launch(x, algorithm=alg, mode=1, reps=args.reps, reproducible="exact")
            rows.append(dict(_harness.nccl_columns(nbytes, jnp.dtype(dtype).name, t, world),
                             world=world, algorithm=alg, hbm_GBps=hbm, copy_GBps=copy_bw,
                             ratio=hbm / copy_bw if copy_bw else None,
                             reproducible_us=t_rep * 1e6 if t_rep else None,
                             reproducible_vs_plain=t / t_rep if t_rep else None,
                             exact_us=t_exact * 1e6 if t_exact else None,
                             exact_vs_plain=t / t_exact if t_exact else None))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "p2p_allreduce", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"},
        rows, devices=jax.devices()[:1],
        notes=[f"{r} simulated ranks on one GPU" for r in worlds]))
  print(_harness.table(rows, (("W", "world", "d"),) + _harness.NCCL_TABLE +
                       (("algorithm", "algorithm", "s"),) + _harness.NCCL_TAIL +
                       (("hbm_GB/s", "hbm_GBps", ".1f"), ("copy_GB/s", "copy_GBps", ".1f"),
                        ("hbm/copy", "ratio", ".2f"), ("repro_us", "reproducible_us", ".1f"),
                        ("plain/repro", "reproducible_vs_plain", ".2f"),
                        ("exact_us", "exact_us", ".1f"), ("plain/exact", "exact_vs_plain", ".2f"))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
