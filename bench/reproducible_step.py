"""Whole-step bit reproducibility, two questions, one script.

Default (CPU, the fusion question): one adamw training step compiled around different gradient
reductions, dtenjax.substitute_psum (one_shot, two_shot) and dtenjax.fuse_collectives (one_shot,
bucket_bytes 4 KiB, 64 KiB, 1 MiB), under plain jax.jit, jax.jit with per-executable XLA options
that look relevant, and dtenjax.reproducible_step with its process flag, side by side in one run.
A flax linen MLP (Dense-LayerNorm-gelu-Dense-relu-Dense, 26,378 parameters) with optax.adamw,
data parallel over 8 simulated CPU devices with jax.shard_map. Every variant starts from the same
parameters and batch; the table counts the parameters whose bits differ from the
substitute_psum(one_shot) variant after 1, 5 and 10 steps, and the median time of one step
relative to that variant's own unpinned run. Each mode runs in its own process, because the
flag it needs (XLA_FLAGS=--xla_cpu_max_isa=AVX) is read when JAX starts its CPU backend.

    python bench/reproducible_step.py [--steps 10] [--json PATH]

``--json`` writes bench/_harness.py's one schema (one row per mode and variant) and says where.

``--device`` (for a GPU; ``--tiny`` runs every part at toy sizes on a CPU): the run-to-run
question, ``dtenjax.reproducible_step`` against ``jax.jit`` (bench/_repro_workloads.py has the
steps and the pins):

1. processes: each workload (the demo step, a reduced GPT-2 and ResNet, GPT-2 small pinned) run
   in several FRESH processes at once per pin set; the table counts distinct digests of the
   parameters and losses after the same steps (1 = the same bits in every process);
2. costs: the demo step, GPT-2 small and ResNet-50 (batch 16, sliced pooling) compiled with
   jax.jit, the autotune pin alone and reproducible_step (both pins; ``--all-pins`` adds the ops
   pin alone and autotune="cache"), timed interleaved in this process (ratios);
3. the demo itself (``python -m dtenjax demo``) in two fresh processes: its printed digests;
4. device counts: the demo's per-micro-batch gradients with 8, 4, 2, 1 micro-batches per device
   (``demo.microbatch_invariance``: what decides whether other device counts give the same bits);
5. select-and-scatter: the max-pooling gradient XLA cannot compile deterministically;
6. fused vs unfused: the flax MLP step above around substitute_psum and fuse_collectives(64 KiB),
   both under reproducible_step's pins on this device.

Parts run in that order, each skipped (and said so) when ``--budget-s`` would be exceeded. JSON
goes to DIR/reproducible_step.json after every part.

    python bench/reproducible_step.py --device --out DIR [--quick] [--budget-s S]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _harness
from _repro_variants import CHECK_STEPS, VARIANTS, run_variants

MODES = {
    # mode: (extra XLA_FLAGS for the process, how the step is jitted)
    "jax.jit": ("", None),
    # per-executable options that look like they should help (they do not: see the table)
    "jit, max_isa=AVX option": ("", {"xla_cpu_max_isa": "AVX"}),
    "jit, no fusion emitters": ("", {"xla_cpu_use_fusion_emitters": False}),
    "reproducible_step": ("--xla_cpu_max_isa=AVX", "reproducible_step"),
}
DEVICE_PARTS = ("processes", "costs", "demo", "device_counts", "select_and_scatter", "fusion")


def worker(mode: str, steps: int, variants=VARIANTS) -> dict:
  """Runs ``variants`` for ``steps`` steps in this process, the step jitted by jax.jit or
  dtenjax.reproducible_step as ``mode`` says."""
  import functools
  import jax
  import dtenjax
  how = MODES[mode][1]
  if how == "reproducible_step":
    jit = dtenjax.reproducible_step
  else:
    jit = functools.partial(jax.jit, compiler_options=how)
  return dict(run_variants(jit, steps, variants), mode=mode,
              xla_flags=os.environ.get("XLA_FLAGS", ""))


def run_mode(mode: str, steps: int, variants=VARIANTS, run=None) -> dict:
  """``worker(mode, steps, variants)`` in a fresh process with the mode's XLA_FLAGS. ``run(argv,
  env=, timeout=)`` starts ``python argv`` and returns its ``subprocess.CompletedProcess``
  (default: a new interpreter; the tests pass a fork server's, tests/procs.py)."""
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = " ".join(f for f in ("--xla_force_host_platform_device_count=8",
                                          MODES[mode][0]) if f)
  argv = [__file__, "--worker", mode, "--steps", str(steps), "--variants", ",".join(variants)]
  if run is None:
    out = subprocess.run([sys.executable, *argv], env=env, capture_output=True, text=True,
                         timeout=1800, check=False)
  else:
    out = run(argv, env=env, timeout=1800)
  if out.returncode:
    raise RuntimeError(f"worker {mode!r} failed ({out.returncode}):\n{out.stderr[-4000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/reproducible_step.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--steps", type=_harness.positive_int, default=10)
  ap.add_argument("--json", default=None, metavar="PATH")
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--variants", default=",".join(VARIANTS), help=argparse.SUPPRESS)
  ap.add_argument("--device", action="store_true",
                  help="the run-to-run measurements on the default device (a GPU)")
  ap.add_argument("--out", default=None, help="--device: directory for reproducible_step.json")
  ap.add_argument("--quick", action="store_true", help="--device: fewer processes and models")
  ap.add_argument("--tiny", action="store_true", help="--device: toy sizes (CPU smoke test)")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="--device: skip parts that would pass this many seconds (estimated from "
                       "the parts done so far); default 360, 200 with --quick")
  ap.add_argument("--parts", default=",".join(DEVICE_PARTS),
                  help=f"--device: comma list of {', '.join(DEVICE_PARTS)}")
  ap.add_argument("--workloads", default="demo,gpt2_mid,resnet_mid",
                  help="--device: the workloads the processes part starts fresh processes of")
  ap.add_argument("--models", default="demo,gpt2,resnet50_b16",
                  help="--device: the workloads the costs part times")
  ap.add_argument("--all-pins", action="store_true",
                  help="--device: also time the 'ops' pin alone and autotune='cache'")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  if args.device:
    import _repro_device
    return _repro_device.main(args, ap)
  if args.worker:
    print(json.dumps(worker(args.worker, args.steps, tuple(args.variants.split(",")))))
    return 0
  results = {m: run_mode(m, args.steps) for m in _harness.progress(list(MODES), "reproducible_step")}
  base = results["jax.jit"]["seconds"]
  rows = [dict(mode=m, variant=v, differing=r["diffs"][v], ms_per_step=1e3 * r["seconds"][v],
               vs_jit=r["seconds"][v] / base[v],
               differing_text="/".join(str(n) for n in r["diffs"][v].values()))
          for m, r in results.items() for v in VARIANTS]
  first = next(iter(results.values()))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "reproducible_step", __file__, argv, {"steps": args.steps}, rows, kind="other",
        machine_extra={"devices": {"backend": first["backend"], "count": first["devices"],
                                   "processes": 1}},
        notes=[f"{first['params']} parameters; jax {first['jax']} in the workers"]))
  print(f"adamw step, flax MLP ({first['params']} parameters), 8 simulated CPU devices, "
        f"jax {first['jax']}: parameters whose bits differ from 'subst one_shot' after "
        f"{', '.join(str(i) for i in CHECK_STEPS if i <= args.steps)} steps; time per step "
        "relative to the same variant under jax.jit")
  print(_harness.table(rows, (("mode", "mode", "s"), ("variant", "variant", "s"),
                              ("differing", "differing_text", "s"),
                              ("ms/step", "ms_per_step", ".2f"), ("vs jax.jit", "vs_jit", "ratio"))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
