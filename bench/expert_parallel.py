"""The planner's expert role against expert parallelism written by hand, on the mixture-of-experts
family of bench/_families.py.

Candidates, each compiled for the same devices and timed side by side in one process
(interleaved rounds, medians):

* ``plan expert``  -- ``dtenjax.plan(step, *args, mesh={"expert": N})``, run by ``plan.jit``;
* ``plan``         -- the planner's own choice of mesh and layout;
* ``EP``           -- expert parallelism by hand: plain ``jax.jit`` with the expert weights
                      sharded over ``expert`` and the dispatched tokens constrained to their
                      experts and back (``_families.expert_recipe``);
* ``DP``, ``FSDP``, ``FSDP x TP``, ``HSDP`` -- the family's other hand-written recipes.

Columns: compiled memory per device (arguments + outputs not aliased + temp), collective bytes
per kind per step (a loop body's once per iteration), the median step time and its ratio to the
hand-written EP (> 1: slower than EP).

  python bench/expert_parallel.py [--iters 10] [--experts 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--iters", type=int, default=10, help="timed rounds (default 10)")
  parser.add_argument("--experts", type=int, default=8, help="experts per layer (default 8)")
  parser.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when no XLA_FLAGS says otherwise (default 8)")
  parser.add_argument("--json", help="write the rows to this file")
  args = parser.parse_args(argv)
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.devices}")
  import jax
  import _families as fams
  import _harness
  import dtenjax
  from dtenjax.testing.xla import loop_repeats

  n = len(jax.devices())
  fam = fams.moe(experts=args.experts)
  step, abstract = fam.make()
  real = fams.real_args(fam)
  plans = {"plan expert": dtenjax.plan(step, *abstract, mesh={"expert": n}),
           "plan": dtenjax.plan(step, *abstract)}
  cands = {k: (p.jit(step), p.shardings()) for k, p in plans.items()}
  cands["EP"] = fams.recipe_jit(fam, fams.expert_recipe(fam))
  for name in fams.RECIPES:
    r = fams.recipe(fam, name)
    if r is not None:
      cands[name] = fams.recipe_jit(fam, r)
  prof, placed = {}, {}
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
  samples = _harness.interleaved({k: (lambda k=k: cands[k][0](*placed[k])) for k in cands}, (),
                                 warmup=2, iters=args.iters)
  times = {k: _harness.median(v) for k, v in samples.items()}
  rows = []
  for name in cands:
    p = plans.get(name)
    mesh = (dict(zip(p.axis_names, p.mesh_shape)) if p is not None else
            dict(fams.recipe(fam, name).mesh.shape) if name in fams.RECIPES else {"expert": n})
    mem, kinds = prof[name]
    rows.append({
        "layout": name, "mesh": "x".join(f"{a}{s}" for a, s in mesh.items() if s > 1),
        "mem_mib": mem / 2**20,
        "a2a_mib": kinds.get("all_to_all", 0.0) / 2**20,
        "ag_mib": kinds.get("all_gather", 0.0) / 2**20,
        "ar_mib": kinds.get("all_reduce", 0.0) / 2**20,
        "other_mib": sum(v for k, v in kinds.items()
                         if k not in ("all_to_all", "all_gather", "all_reduce")) / 2**20,
        "predicted_a2a_mib": (p.cost.collective_bytes.get("all_to_all[expert]", 0.0) / 2**20
                              if p is not None else None),
        "step_ms": times[name] * 1e3, "vs_EP": times[name] / times["EP"],
    })
  print(_harness.table(rows, [
      ("layout", "layout", "s"), ("mesh", "mesh", "s"), ("mem (MiB)", "mem_mib", ".2f"),
      ("all-to-all", "a2a_mib", ".2f"), ("priced", "predicted_a2a_mib", ".2f"),
      ("all-gather", "ag_mib", ".2f"), ("all-reduce", "ar_mib", ".2f"),
      ("other", "other_mib", ".2f"), ("step (ms)", "step_ms", ".2f"), ("vs EP", "vs_EP", "ratio")],
      title="moe family, collective bytes per kind in MiB per step and device"))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "expert_parallel", __file__, sys.argv[1:] if argv is None else argv,
        {"iters": args.iters, "experts": args.experts, "devices": n}, rows,
        devices=jax.devices(), kind="other"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
