"""Whole-step planner benchmark (dtenjax.plan): predictions against compilation, plans on the
reference clusters, planning time, and the measured ranking of plans on 8 CPU devices.

Parts (``--parts``, default all):

* ``predict`` -- for each model (an MLP, GPT-2, Llama-shaped 1B and 8B, and the six families of
  bench/_families.py with a global batch that grows with the devices) and device count
  (``--devices`` picks among them), the chosen plan and the four standard recipes
  (DP, FSDP, TP, FSDP x TP) are compiled for the CPU with simulated devices (a fresh process per
  device count, ``--xla_force_host_platform_device_count=N``; abstract arguments, nothing runs)
  and the prediction is compared with ``memory_analysis()`` (arguments + outputs + temp) and with
  the collective bytes ``dtenjax.explain`` reads from the compiled HLO. Every miss of the 10 % /
  10 % targets is listed.
* ``clusters`` -- the Llama-shaped 1B and 8B steps planned on every fixture (8 x H200, 32 x A100
  over RoCE, 16 to 1,024 H100): the chosen mesh and time against the best recipe that fits.
* ``time`` -- planning an 8B Llama-shaped step and a 70B-shaped one on 64, 256 and 1,024 devices
  (``h100_64``, ``h100_256``, ``h100_1024``; the target: under 2 s of one core each), cold
  (imports of scipy's solver and the tracing included) in fresh processes,
  then the same plan again in that process: wall and process CPU time, with the load average
  (the CPU time barely moves when other work shares the machine), and the first plan's CPU time
  in Python's cyclic garbage collector (its full passes walk every object the imports made).
  ``--time-against DIR`` plans with another revision's package too, in the same rounds (its
  first plans' medians over ours); copy the native extension into DIR/dtenjax for a like-for-like
  comparison (a note says when it is missing).
* ``wins`` -- six model families (bench/_families.py: a scanned and a looped Llama-shaped decoder,
  an encoder-decoder, a convnet with batch norm, a mixture-of-experts transformer, weights shared
  across layers) on this machine's devices: the plan's ``plan.jit`` step against the layouts a
  user writes by hand with plain ``jax.jit`` and ``NamedSharding`` (DP, FSDP gathering per layer
  inside the scan, FSDP x TP, HSDP), compiled (memory per device, collective bytes per kind with
  loop trip counts) and timed side by side (interleaved rounds, each in a fresh seeded order,
  each candidate's turn a warm call and two timed ones, medians); the plan's step time over the
  fastest recipe's. Where the plan is a leaner one than the model's fastest (docs/planner.md,
  "The choice"), the fastest priced is a row too ("plan, fastest priced"). Every row has the
  cost model's predicted time next to the measured one,
  twice: with the table priors ("predicted") and with this machine's ``Topology.calibrate()``
  ("calibrated"; the plan made with it is a row of its own, "plan calibrated"). A hand-written
  layout is predicted as the plan with its specs pinned. With ``--budgets [NAMES]`` the plan under
  ``memory_budget`` = 1.10x the compiled memory of each hand-written layout named (all without
  names) is a row too ("plan @ FSDP x TP budget", ...; a layout or program already in the table is not timed again, a refusal
  is a row with its shortfall), and each family's note gives the plan at the fastest layout's
  budget: its time and memory over that layout's. ``--no-measure`` leaves out the
  ``measure=True`` plan ("plan measured": ``--measure-rounds`` timed rounds, default 6; its own
  compiles and timings, whose count, CPU and wall seconds and every candidate's time and
  compiled memory are a note), ``--no-calibrate`` the calibrated one. Each plan row's "clause"
  says whether it meets the issue's clause against the fastest hand-written layout: time at most
  1.05x, compiled memory at most 1.10x; a plan made under a budget is compared with the fastest
  hand-written layout that compiles within that budget (named after the verdict when it is not
  the fastest overall).

* ``priced`` -- the wins part's plan and hand-written layouts priced by the cost model only
  (nothing compiled or run), beside a recorded wins run's measured times (``--measured-json``).

* ``terms`` -- every layout of recorded wins runs (``--measured-json A,B``: the hand-written
  layouts, the plan and the plans under the recorded budgets, planned by this tree) priced by the
  cost model in its terms: products, the work beside them, the optimizer's update, the exposed
  collectives (and the FSDP gathers' waits among them) and the number of meetings priced, beside
  the measured time; per family the pairs of layouts the
  prediction orders as measured, and the bytes XLA compiles optax's AdamW update to move per
  parameter byte; per family the range of predicted / measured. ``--cores`` prices the recorded
  machine's host, ``--calibration PATH`` with a ``Topology.calibrate()`` record of it (a JSON
  object whose ``calibration`` is written as ``Topology.to_json`` writes it: the records of the
  16-core host and of the 2-core VM are in bench/results/, ``*_calibration_*``);
  ``--update-scale S`` prices the update S times over and adds each family's default plan under
  that price.

* ``placement`` -- each family's DP and FSDP layouts (hand-written) and ``plan.jit``'s program
  of its plan on `fsdp` 8, compiled on this machine's devices (nothing run): per collective kind,
  how many the entry computation issues and after how many of its products the first and the
  last (``collective_placement``): where the FSDP gathers' waits are paid.

* ``calibrate`` -- ``Topology.calibrate()`` run ``--iters`` times on this machine: every run's
  summary a note, the median of each field a row (what ``--calibration`` reads back).

* ``rows`` -- the work of one product that does not grow with its rows (the cost model's
  ``product_fixed_rows``): the forward and backward of a float32 ``[M, 256] x [256, 1024]``
  product on every device at once, this process's CPU seconds against ``M`` (32 to 512 rows per
  device, interleaved rounds, medians), and the straight line's intercept in rows. CPU seconds,
  not wall time: other work on a shared machine stretches the wall time, not the work.

* ``gpu`` -- (GPU machine) the same comparison compiled by XLA's GPU compiler for a mocked host of
  8 GPUs (``jax_mock_gpu_topology``, set before the backend starts: ``--mock-gpus 8``), nothing
  run: the plan's predicted memory and collective bytes per kind against the compiled ones, next
  to the hand-written recipes' compiled memory and bytes.

The wins part prints each family's table as soon as it is measured and, with ``--json``, rewrites
the JSON after each family, so a run stopped by a time limit keeps the families it finished;
``--families`` picks a subset.

Run:  .venv/bin/python bench/step_planner.py [--parts predict,clusters,time,wins] [--json PATH]
      python3 bench/step_planner.py --parts gpu --mock-gpus 8   (one real GPU is enough)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

if "--mock-gpus" not in sys.argv:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp

if "--mock-gpus" in sys.argv:     # before the backend starts: XLA's mock NCCL, compile only.
  # No GEMM autotuning: with mocked devices it ran for minutes per program (a 1.5 s CPU compile
  # of the llama_scan family had not finished after 96 s on an H100); nothing here is run, and
  # without it XLA takes its default kernels, whose workspace (part of temp) may differ a little.
  os.environ["XLA_FLAGS"] += " --xla_gpu_autotune_level=0"
  # jax 0.11 wants the mocked host's device count to be the local one: N hosts of 1 GPU.
  jax.config.update("jax_mock_gpu_topology",
                    f"1x{sys.argv[sys.argv.index('--mock-gpus') + 1]}x1")

import _harness
import _step_models as models
import dtenjax
from dtenjax.testing import planning
from dtenjax.testing.xla import loop_repeats

HERE = os.path.dirname(os.path.abspath(__file__))
# (model, device counts) compiled in the predict part
PREDICT = {"mlp": (8, 16), "gpt2": (8, 16, 32), "llama-1b": (8, 16, 32), "llama-8b": (64,),
           **{f: (8, 16, 32, 64) for f in ("llama_scan", "llama_loop", "encdec", "convnet", "moe",
                                           "shared")}}
# global batch per device of the families (bench/_families.py; their default at 8 devices)
_FAMILY_BATCH = {"convnet": 4}


def make(model: str, devices: int):
  """The step and abstract arguments of ``model`` with a global batch for ``devices``."""
  if model == "mlp":
    return models.mlp_step(d=512, f=2048, layers=2, batch=4 * devices, seq=256)
  if model == "gpt2":          # GPT-2 small's width and vocabulary, 4 of its 12 layers
    return models.gpt2_step(batch=2 * devices, seq=512, layers=4)
  if "-" not in model:         # a family of bench/_families.py
    import _families as fams
    return fams.FAMILIES[model](batch=_FAMILY_BATCH.get(model, 2) * devices).make()
  size = model.split("-")[1]
  return models.llama_step(size, batch=devices, seq=2048, remat=True, dtype=jnp.float32)


def predict_rows(model: str, devices: int) -> list[dict]:
  step, args = make(model, devices)
  rows = []
  for recipe in (None,) + planning.RECIPES:
    plan = dtenjax.plan(step, *args, recipe=recipe, memory_budget=1 << 50)
    t0 = time.perf_counter()
    check = plan.check(step, *args)
    rows.append({
        "model": model, "devices": devices, "plan": recipe or "chosen",
        "mesh": "x".join(map(str, plan.mesh_shape)),
        "mem_pred_mib": check.predicted_memory["total"] / 2**20,
        "mem_xla_mib": check.compiled_memory["total"] / 2**20,
        "mem_err": check.memory_error,
        "bytes_pred_mib": sum(check.predicted_bytes.values()) / 2**20,
        "bytes_xla_mib": sum(check.compiled_bytes.values()) / 2**20,
        "bytes_err": check.bytes_error, "compile_s": time.perf_counter() - t0,
        "kind_errs": ",".join(f"{k}:{e:.0%}" for k, e in check.kind_errors.items()),
        "worst_kind": "{}:{:.0%}".format(*check.worst_kind()) if check.worst_kind() else "-",
        "misses": sorted(check.misses()),
        "kinds_pred_mib": {k: v / 2**20 for k, v in check.predicted_bytes.items() if v},
        "kinds_xla_mib": {k: v / 2**20 for k, v in check.compiled_bytes.items() if v},
        "xla_kinds": ",".join(sorted(k for k, v in check.compiled_bytes.items() if v)),
    })
  return rows


def _child(model: str, devices: int) -> list[dict]:
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  out = subprocess.run([sys.executable, __file__, "--child", f"{model}:{devices}"], env=env,
                       capture_output=True, text=True, timeout=3000, check=False)
  if out.returncode:
    raise RuntimeError(f"{model} on {devices} devices failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def cluster_rows() -> list[dict]:
  rows = []
  cases = [("llama-8b", "h200_8", 8), ("llama-8b", "roce_a100_4x8", 32),
           ("llama-1b", "h100_16", 16), ("llama-8b", "h100_64", 64),
           ("llama-8b", "h100_256", 256), ("llama-8b", "h100_1024", 1024)]
  for model, fixture, batch in cases:
    step, args = models.llama_step(model.split("-")[1], batch=batch, seq=2048, remat=True,
                                   dtype=jnp.float32)
    topo = dtenjax.Topology.fixture(fixture)
    plan = dtenjax.plan(step, *args, topology=topo)
    fits = [r for r in plan.recipes if r.cost is not None and r.cost.fits]
    best = min(fits, key=lambda r: r.cost.total_s) if fits else None
    rows.append({
        "model": model, "topology": fixture, "mesh": "x".join(map(str, plan.mesh_shape)),
        "step_ms": plan.cost.total_s * 1e3, "exposed_ms": plan.cost.exposed_s * 1e3,
        "mem_gib": plan.cost.memory["total"] / 2**30,
        "best_recipe": best.name if best else "none fits",
        "best_recipe_ms": best.cost.total_s * 1e3 if best else None,
        "ratio": (best.cost.total_s / plan.cost.total_s) if best else None,
        "plan_ms": plan.planning_s * 1e3,
        "crossing": ",".join(a.name for a in plan.axes if a.span == "across hosts") or "-",
    })
  return rows


_TIME_CHILD = """
import sys, time
t0 = time.perf_counter()
sys.path.insert(0, {here!r})
src = {src!r}
if src:   # another revision's package first; an editable install's finder would redirect to ours
  sys.meta_path = [f for f in sys.meta_path if "editable" not in type(f).__module__]
  sys.path.insert(0, src)
import jax.numpy as jnp, _step_models as m, dtenjax
assert not src or dtenjax.__file__.startswith(src), dtenjax.__file__
topology = dtenjax.Topology.fixture({fixture!r})
n = topology.num_devices
step, args = (m.llama_step("8b", batch=n, seq=2048, remat=True, dtype=jnp.bfloat16)
              if {model!r} == "8b" else m.decoder_70b(batch=n))
import gc
gc_s = [0.0, 0.0]              # CPU s in the cyclic garbage collector; the current pass's start


def timed_gc(phase, info):
  if phase == "start":
    gc_s[1] = time.process_time()
  else:
    gc_s[0] += time.process_time() - gc_s[1]


gc.callbacks.append(timed_gc)
t1, c1 = time.perf_counter(), time.process_time()
plan = dtenjax.plan(step, *args, topology=topology)
t2, c2 = time.perf_counter(), time.process_time()
collected = gc_s[0]
again = dtenjax.plan(step, *args, topology=topology)
c3 = time.process_time()
import hashlib
digest = hashlib.sha256(repr((plan.mesh_shape, plan.device_ids, plan.specs)).encode()).hexdigest()
print(t2 - t1, c2 - c1, c3 - c2, collected, "x".join(map(str, plan.mesh_shape)), digest[:16])
"""


def time_rows(repeats: int = 3, fixtures=("h100_64", "h100_256", "h100_1024"),
              models_=("8b", "70b"), against: str = "") -> list[dict]:
  """Planning an 8B step (one sequence of 2048 per device, bf16) and a 70B-shaped one
  (``_step_models.decoder_70b``) on each fixture in fresh processes: the first plan (imports of
  scipy's solver, the tracing and the topology's first look-ups included; of it, the cyclic
  garbage collector's passes) and the same plan again in that process (the planning alone). The
  target: under 2 s of one core each.
  ``against``: a directory holding another revision's ``dtenjax`` package, planned in the same
  rounds (each round a process of each, the first of the pair alternating; the rows' ``src``)."""
  srcs = ["", os.path.abspath(against)] if against else [""]
  rows = []
  for model in models_:
    for fixture in fixtures:
      for i in range(repeats):
        for src in srcs[::-1] if i % 2 else srcs:
          child = _TIME_CHILD.format(here=HERE, fixture=fixture, model=model, src=src)
          out = subprocess.run([sys.executable, "-c", child],
                               capture_output=True, text=True, timeout=600, check=True)
          wall, cpu, again, collected, mesh, digest = out.stdout.split()[-6:]
          load = os.getloadavg()[0]
          rows.append({"model": model, "topology": fixture, "run": i, "plan_s": float(wall),
                       "plan_cpu_s": float(cpu), "again_cpu_s": float(again),
                       "plan_gc_cpu_s": float(collected), "load": load,
                       "mesh": mesh, "specs_hash": digest, "src": src or "this checkout"})
  return rows


def _pairs(rows: list[dict]) -> dict:
  """(model, topology) -> (this checkout's first plans' CPU s, the other package's)."""
  out: dict = {}
  for r in rows:
    mine, theirs = out.setdefault((r["model"], r["topology"]), ([], []))
    (mine if r["src"] == "this checkout" else theirs).append(r["plan_cpu_s"])
  return out


def compiled_profile(compiled) -> dict:
  """Per-device memory (arguments + outputs not aliased + temp) and collective bytes per kind per
  step (a loop body's collectives once per iteration) of a compiled step."""
  stats = compiled.memory_analysis()
  mem = planning.compiled_bytes(compiled)     # as plan(measure=True) counts its candidates
  repeats = loop_repeats(compiled)
  kinds: dict[str, float] = {}
  counts: dict[str, int] = {}
  for c in dtenjax.explain(compiled).collectives:
    kinds[c.kind] = kinds.get(c.kind, 0.0) + c.nbytes * repeats(c.computation)
    counts[c.kind] = counts.get(c.kind, 0) + repeats(c.computation)
  return {"mem": float(mem), "temp": float(stats.temp_size_in_bytes), "bytes": kinds,
          "counts": counts}


def gpu_rows(names, size: str, fixture: str = "h200_8") -> tuple[list[dict], list[str]]:
  """Compile-only on the (mocked) GPUs: the plan's prediction against XLA's GPU compiler, and the
  hand-written recipes' compiled memory and bytes (bench/_families.py). ``llama-1b`` is a bfloat16
  Llama 1B at batch 8; ``predict:MODEL`` is the predict part's ``make(MODEL, N)`` for the N
  (mocked) GPUs present, planned for ``fixture`` (a topology of N GPUs)."""
  import _families as fams
  topo = dtenjax.Topology.fixture(fixture)
  rows, notes = [], []
  for name in names:
    if name == "llama-1b":
      step, args = models.llama_step("1b", batch=8, seq=2048, remat=True, dtype=jnp.bfloat16)
      fam = None
    elif name.startswith("predict:"):
      step, args = make(name.split(":", 1)[1], len(jax.devices()))
      fam = None
    else:
      fam = fams.FAMILIES[name]() if size == "small" else fams.FAMILIES[name](batch=64)
      step, args = fam.make()
    for recipe in (None, "DP", "FSDP", "FSDP x TP"):
      t0 = time.perf_counter()
      plan = dtenjax.plan(step, *args, topology=topo, recipe=recipe, memory_budget=1 << 50)
      check = plan.check(step, *args)
      rows.append({
          "family": name, "layout": f"plan({recipe})" if recipe else "plan",
          "mesh": "x".join(map(str, plan.mesh_shape)),
          "mem_pred_mib": check.predicted_memory["total"] / 2**20,
          "mem_xla_mib": check.compiled_memory["total"] / 2**20, "mem_err": check.memory_error,
          "pred_kinds": ",".join(f"{k}:{v / 2**20:.1f}" for k, v in
                                 sorted(check.predicted_bytes.items()) if v),
          "xla_kinds": ",".join(f"{k}:{v / 2**20:.1f}" for k, v in
                                sorted(check.compiled_bytes.items()) if v),
          # how many collectives of each kind the step runs (a latency each; Check's count)
          "xla_counts": _counts(check.compiled_counts),
          "bytes_err": check.bytes_error})
      _progress(rows[-1], t0)
    if fam is not None:
      for rn in fams.RECIPES:
        r = fams.recipe(fam, rn)
        if r is None:
          continue
        fn, _ = fams.recipe_jit(fam, r)
        t0 = time.perf_counter()
        prof = compiled_profile(fn.lower(*args).compile())
        rows.append({"family": name, "layout": f"user {rn}",
                     "mesh": "x".join(map(str, r.mesh.shape.values())),
                     "mem_xla_mib": prof["mem"] / 2**20,
                     "xla_kinds": ",".join(f"{k}:{v / 2**20:.1f}" for k, v in
                                           sorted(prof["bytes"].items()) if v),
                     "xla_counts": _counts(prof["counts"])})
        _progress(rows[-1], t0)
  return rows, notes


def _counts(counts: dict[str, int]) -> str:
  """"all_gather:68,all_reduce:5": collectives per kind a compiled step runs."""
  return ",".join(f"{k}:{n}" for k, n in sorted(counts.items()) if n)


def _progress(row: dict, t0: float) -> None:
  """One line per compiled row on stderr, so that a run cut short by a time limit keeps what it
  compiled (the GPU compiler takes tens of seconds per Llama-sized program)."""
  shown = {k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}
  print(f"[{time.perf_counter() - t0:.1f} s] {shown}", file=sys.stderr, flush=True)


def predicted_recipe(fam, r, step, args, topology) -> float | None:
  """The cost model's step time (s) of the hand-written layout ``r``: the plan of ``step`` on
  ``r``'s mesh with every parameter and optimizer-state leaf pinned to ``r``'s specs."""
  import _families as fams
  params, opt, _ = args
  try:
    p = dtenjax.plan(step, *args, mesh=dict(r.mesh.shape), topology=topology,
                     pinned=[r.param_specs, fams._like_params(opt, params, r.param_specs), None],
                     memory_budget=1 << 50)
  except dtenjax.PlacementError:
    return None
  return p.cost.total_s


def program_text(compiled) -> list[str]:
  """A compiled step's instructions without names and source metadata, sorted: two layouts with
  the same text run the same program. jax 0.11 prints the mesh in shardings and replica groups,
  where axes of size 1 name no partition (a plan's mesh lists all six roles): they are left out."""
  import re
  out = []
  for line in compiled.as_text().splitlines():
    if "=" not in line or "file_name_id" in line or "file_location_id" in line:
      continue
    line = re.sub(r", metadata=\{[^}]*\}", "", re.sub(r"%[\w.-]+", "%v", line))
    line = re.sub(r"'\w+'=1,", "", re.sub(r",'\w+'=1\b", "", line))
    out.append(line.strip())
  return sorted(out)


WINS_COLUMNS = (("family", "family", "s"), ("layout", "layout", "s"), ("mesh", "mesh", "s"),
                ("same program as", "same_as", "s"), ("measured ms", "measured_ms", ".2f"),
                ("predicted ms", "predicted_ms", ".2f"), ("calibrated ms", "calibrated_ms", ".2f"),
                ("/fastest recipe", "vs_best_recipe", ".2f"), ("spread", "ratio_spread", ".2f"),
                ("MiB/dev", "mem_mib", ".1f"), ("mem/fastest's", "mem_vs_best_recipe", ".2f"),
                ("clause", "clause", "s"), ("coll MiB", "coll_mib", ".1f"),
                ("per kind", "kinds", "s"))
# the clause ("wins when run"): a plan's time at most this over the fastest hand-written
# layout's, its compiled memory at most (1 + MEMORY_SLACK) x that layout's
TIME_SLACK, MEMORY_SLACK = planning.CLAUSE_TIME_SLACK, planning.CLAUSE_MEMORY_SLACK


def clause(vs_time: float, vs_memory: float) -> str:
  """"met", or the halves of the issue's clause a plan misses (its ratios to the fastest
  hand-written layout)."""
  missed = ([f"time {vs_time:.2f}x"] if vs_time > 1 + TIME_SLACK else []) + (
      [f"memory {vs_memory:.2f}x"] if vs_memory > 1 + MEMORY_SLACK else [])
  return "met" if not missed else "missed: " + ", ".join(missed)


def wins_rows(names, iters: int, calibrated=None, on_family=None, budgets=(),
              measure: int = 6) -> tuple[list[dict], list[str]]:
  """``calibrated``: a calibrated Topology (``Topology.calibrate()``): its plan is measured too,
  and every row gets its prediction beside the uncalibrated model's. ``on_family(rows, notes)``
  is called after each family (the rows and notes so far), so a run cut short keeps them.
  ``budgets``: hand-written layouts (names of ``_families.RECIPES``) under whose compiled memory
  x :data:`BUDGET_SLACK` the family is also planned ("plan @ DP budget", ...;
  :func:`budget_plans`), timed in the same rounds; ``measure``: timed rounds of the
  ``measure=`` plan, a row ("plan measured"; 0: none).

  "/fastest recipe" is the median over the rounds of the candidate's time over the fastest
  hand-written layout's time in the same round (paired: drift of the machine cancels), and
  "spread" the half-width of the middle half of those ratios; "same program as" names the
  hand-written layout whose compiled program is the plan's, instruction for instruction. A
  budget's plan whose layout or program is another candidate's is not timed again: its row
  takes that candidate's samples and names it."""
  import _families as fams
  rows, notes = [], []
  for name in names:
    fam = fams.FAMILIES[name]()
    step, args = fam.make()
    real = fams.real_args(fam)
    plans = {"plan": dtenjax.plan(step, *args)}
    with planning.fastest_priced():    # the model's fastest, where the plan is a leaner one
      fastest = dtenjax.plan(step, *args)
    if not planning.same_layout(fastest, plans["plan"]):
      plans["plan, fastest priced"] = fastest
    if measure:
      wall, cpu = time.perf_counter(), time.process_time()
      plans["plan measured"] = p = dtenjax.plan(step, *args, measure=measure)
      notes.append(f"{name}: plan measured (measure={measure}): {len(p.measured)} candidates "
                   f"compiled and timed in {time.perf_counter() - wall:.1f} s wall, "
                   f"{time.process_time() - cpu:.1f} s CPU (load average "
                   f"{os.getloadavg()[0]:.1f}): " + "; ".join(
                       f"{m.name} {m.seconds * 1e3:.2f} ms {m.memory_bytes / 2**20:.1f} MiB "
                       f"({m.note})" for m in p.measured))
      print(notes[-1], file=sys.stderr, flush=True)
    if calibrated is not None:
      plans["plan calibrated"] = dtenjax.plan(step, *args, topology=calibrated)
    cands = {k: (p.jit(step), p.shardings()) for k, p in plans.items()}
    predicted = {}
    for rn in fams.RECIPES:
      r = fams.recipe(fam, rn)
      if r is not None:
        cands[rn] = fams.recipe_jit(fam, r)
        predicted[rn] = (predicted_recipe(fam, r, step, args, None),
                         None if calibrated is None else
                         predicted_recipe(fam, r, step, args, calibrated))
    prof, placed, programs = {}, {}, {}

    def add(cname, fn, shardings):
      compiled = fn.lower(*args).compile()
      prof[cname] = compiled_profile(compiled)
      programs[cname] = program_text(compiled)
      placed[cname] = jax.device_put(real, shardings)
    for cname, (fn, shardings) in cands.items():
      add(cname, fn, shardings)
    alias, refused = {}, {}
    if budgets:
      under, refused = budget_plans(step, args, {rn: prof[rn]["mem"] for rn in budgets
                                                 if rn in prof})
      for k, p in under.items():        # the smallest budget first: a layout keeps its name
        same = next((q for q, other in plans.items() if planning.same_layout(p, other)), None)
        plans[k], fn = p, p.jit(step)
        if same is None:
          add(k, fn, p.shardings())
          same = next((q for q in cands if programs[q] == programs[k]), None)
          if same is not None:
            del placed[k]
        if same is not None:
          alias[k] = same
        else:
          cands[k] = (fn, p.shardings())
    # each layout priced by the table priors and by the calibration (the same layout pinned)
    predicted.update({k: (p.cost.total_s, None if calibrated is None else dtenjax.plan(
        step, *args, topology=calibrated, mesh=dict(zip(p.axis_names, p.mesh_shape)),
        pinned=list(p.specs), memory_budget=1 << 50).cost.total_s) for k, p in plans.items()})
    samples = planning.time_calls({k: (lambda k=k: cands[k][0](*placed[k])) for k in cands},
                                 warmup=2, rounds=iters)
    for k, same in alias.items():
      samples[k], prof[k], programs[k] = samples[same], prof[same], programs[same]
    times = {k: _harness.median(v) for k, v in samples.items()}
    recipes_only = {k: v for k, v in times.items() if k not in plans}
    best = min(recipes_only, key=recipes_only.get)
    ratios = {k: sorted(a / b for a, b in zip(samples[k], samples[best])) for k in samples}

    def clause_of(k: str) -> str:
      ref = reference_layout(recipes_only, {r: prof[r]["mem"] for r in recipes_only},
                             plans[k].budget_bytes if k.endswith(" budget") else None)
      vs = _harness.median([a / b for a, b in zip(samples[k], samples[ref])])
      return clause(vs, prof[k]["mem"] / prof[ref]["mem"]) + ("" if ref == best else f" ({ref})")
    first = len(rows)
    for cname in samples:
      p = plans.get(cname)
      rows.append({
          "family": name, "layout": cname,
          "mesh": ("x".join(f"{a}{n}" for a, n in zip(p.axis_names, p.mesh_shape) if n > 1)
                   if p is not None else "x".join(f"{a}{n}" for a, n in
                                                  fams.recipe(fam, cname).mesh.shape.items())),
          "measured_ms": times[cname] * 1e3,
          "predicted_ms": _ms(predicted[cname][0]),
          "calibrated_ms": _ms(predicted[cname][1]),
          "mem_mib": prof[cname]["mem"] / 2**20,
          "coll_mib": sum(prof[cname]["bytes"].values()) / 2**20,
          "kinds": ",".join(f"{k}:{v / 2**20:.1f}" for k, v in sorted(prof[cname]["bytes"].items())),
          "vs_best_recipe": _harness.median(ratios[cname]),
          "ratio_spread": planning.ratio_spread(ratios[cname]),
          "same_as": ",".join([alias[cname]] if cname in alias else [
              r for r in cands if r not in plans and r != cname
              and programs[r] == programs[cname]]) or "-",
          "mem_vs_best_recipe": prof[cname]["mem"] / prof[best]["mem"],
          **({"clause": clause_of(cname)} if p is not None else {}),
          **({"budget_mib": p.budget_bytes / 2**20} if cname.endswith(" budget") else {}),
      })
    rows += [{"family": name, "layout": k, "mesh": "refused", "budget_mib": b / 2**20,
              "refused": why} for k, (b, why) in refused.items()]
    for k, p in plans.items():
      same = [r for r in cands if r not in plans and programs[r] == programs[k]]
      notes.append(f"{name}: {k} {dict(zip(p.axis_names, p.mesh_shape))} "
                   f"{_harness.median(ratios[k]):.2f}x the fastest hand-written recipe ({best}), "
                   f"memory {prof[k]['mem'] / prof[best]['mem']:.2f}x" +
                   (f"; the same program as {', '.join(same)}" if same else ""))
      print(notes[-1], file=sys.stderr, flush=True)      # progress: one family at a time
    if budgets:
      notes.append(budget_note(name, best, rows[first:]))
    print(_harness.table(rows[first:], WINS_COLUMNS + (BUDGET_COLUMNS if budgets else ()),
                         title=f"{name}, measured"), flush=True)
    if on_family is not None:
      on_family(rows, notes)
  return rows, notes


# The budgets of the wins part's --budgets: this times each hand-written layout's compiled memory
# (issue 39: the plan's memory at most the fastest recipe's plus 10 % whenever it fits)
BUDGET_SLACK = 1.10
BUDGET_COLUMNS = (("budget MiB", "budget_mib", ".1f"), ("refused", "refused", "s"))


def budget_plans(step, args, compiled_mem: dict[str, float]) -> tuple[dict, dict]:
  """The default plan of ``step`` under ``memory_budget`` = :data:`BUDGET_SLACK` x each
  hand-written layout's compiled memory (``compiled_mem``: name -> bytes per device, from
  ``memory_analysis()`` of the user's plain ``jax.jit`` program), the smallest budget first:
  ``({"plan @ NAME budget": plan}, {"plan @ NAME budget": (budget, the refusal's message)})``."""
  plans, refused = {}, {}
  for rn, mem in sorted(compiled_mem.items(), key=lambda kv: kv[1]):
    k, budget = f"plan @ {rn} budget", BUDGET_SLACK * mem
    try:
      plans[k] = dtenjax.plan(step, *args, memory_budget=budget)
    except dtenjax.PlacementError as e:
      refused[k] = (budget, str(e).split(". ")[0])
  return plans, refused


def reference_layout(times: dict[str, float], memory: dict[str, float],
                     budget: float | None) -> str:
  """The hand-written layout a plan is judged against: the fastest (``times``) of those whose
  compiled ``memory`` fits ``budget`` (under a budget a layout does not fit, a user could not
  run it either); the fastest overall without a budget or when none fits."""
  fit = {k: t for k, t in times.items() if budget is None or memory[k] <= budget}
  return min(fit or times, key=(fit or times).get)


def budget_note(name: str, best: str, rows: list[dict]) -> str:
  """The family's line of the --budgets part: the plan under the fastest hand-written layout's
  budget, its time and memory over that layout's."""
  by = {r["layout"]: r for r in rows}
  row = by.get(f"plan @ {best} budget")
  if row is None:
    return f"{name}: not planned at {best}'s budget (--budgets)"
  head = f"{name}: at {best}'s budget ({row['budget_mib']:.1f} MiB): "
  if "refused" in row:
    return head + row["refused"]
  return (head + f"{row['mesh']}" + (f" (the program of {row['same_as']})"
                                     if row["same_as"] != "-" else "") +
          f", {row['vs_best_recipe']:.2f}x {best}'s time, memory "
          f"{row['mem_mib'] / by[best]['mem_mib']:.2f}x")


def product_rows(rows=(32, 64, 128, 256, 512), iters: int = 7, k: int = 256,
                 n: int = 1024) -> tuple[list[dict], list[str]]:
  """The ``rows`` part: CPU seconds per device of a product's forward and backward against its
  rows per device (every device at once, as in a step), and the line's intercept in rows."""
  import resource
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  devs = np.array(jax.devices())
  mesh = Mesh(devs, ("c",))
  reps = 8                                     # products per program, one dispatch

  def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

  def local(x, w):
    loss = lambda x, w: jnp.tanh(x @ w).sum()
    def body(_, acc):
      gx, gw = jax.grad(loss, argnums=(0, 1))(x + acc * 1e-9, w + acc * 1e-9)
      return acc + gx.sum() + gw.sum()
    return jax.lax.fori_loop(0, reps, body, jnp.float32(0))[None]

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("c"), P("c")), out_specs=P("c"),
                             check_vma=False))
  put = lambda shape: jax.device_put(np.full(shape, 0.01, np.float32), NamedSharding(mesh, P("c")))
  progs = {m: (put((devs.size * m, k)), put((devs.size * k, n))) for m in rows}
  for a in progs.values():
    _harness.block(fn(*a))
  samples: dict[int, list[float]] = {m: [] for m in rows}
  for _ in range(iters):
    for m, a in progs.items():
      c0 = cpu_s()
      _harness.block(fn(*a))
      samples[m].append((cpu_s() - c0) / (devs.size * reps))
  per = {m: _harness.median(v) for m, v in samples.items()}
  slope, intercept = np.polyfit(list(rows), [per[m] for m in rows], 1)
  out = [{"rows": m, "k": k, "n": n, "devices": int(devs.size), "cpu_us": per[m] * 1e6,
          "line_us": (slope * m + intercept) * 1e6} for m in rows]
  return out, [f"rows: {devs.size} devices, {os.cpu_count()} cores: {slope * 1e9:.0f} ns of CPU "
               f"per row + {intercept * 1e6:.0f} us per product = {intercept / slope:.1f} rows "
               f"of work that does not grow with the rows (load average "
               f"{os.getloadavg()[0]:.1f})"]


def described_host(cores: int):
  """This host's topology with its devices' host described as having ``cores`` CPU cores: the
  machine a recorded run was measured on (``--cores``)."""
  import dataclasses
  topo = dtenjax.Topology.current()
  hosts = sorted({d.host for d in topo.devices})
  return dataclasses.replace(topo, numa_nodes=tuple(planning.NumaNode(h, 0, f"0-{cores - 1}")
                                                    for h in hosts))


_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse_calibration(summary: str) -> dict:
  """A calibration as ``Topology.to_json`` writes it, read back from its one-line summary
  (``Calibration.summary``, which the wins part's notes record: the collectives' times to 10 us,
  the rates to the printed digit)."""
  import re
  hit = re.search(r"calibrated on (\d+) (\w+) devices sharing (\d+) cores: ([\d.]+) GFLOP/s and "
                  r"([\d.]+) GB/s per device, a collective between products (\d+) us"
                  r"(?:, the optimizer's update streaming ([\d.]+) GB/s per device)?(?:; (.*))?",
                  summary)
  if hit is None:
    raise ValueError(f"not a calibration summary: {summary[:80]!r}")
  devices, platform, cores, flops, gbps, latency, stream, rest = hit.groups()
  collectives = {}
  for part in (rest or "").split(", ") if rest else []:
    kind, times, sizes = re.match(r"(\w+) ([\d./]+) ms at (.*)", part).groups()
    nbytes = [int(float(x.split()[0]) * _UNITS[x.split()[1]]) for x in sizes.split("/")]
    collectives[kind] = [[b, float(t) * 1e-3] for b, t in zip(nbytes, times.split("/"))]
  return {"platform": platform, "devices": int(devices), "cores": int(cores),
          "matmul_flops": float(flops) * 1e9, "memory_gbps": float(gbps),
          "collectives": collectives, "latency_s": int(latency) * 1e-6,
          "stream_gbps": float(stream or 0.0)}


def recorded_calibration(paths: list[str]) -> dict:
  """One machine's calibration from the ``Topology.calibrate()`` runs recorded in bench JSONs
  (their notes' summaries): :func:`recorded_calibration_of`."""
  summaries = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
    summaries += [n[n.index("calibrated on"):] for n in doc.get("notes", [])
                  if isinstance(n, str) and "calibrated on" in n]
  if not summaries:
    raise ValueError(f"no calibration summary in the notes of {paths}")
  return recorded_calibration_of(summaries)


def recorded_calibration_of(summaries: list[str]) -> dict:
  """The calibration of several runs' summaries (:func:`parse_calibration`): each field's median
  over the runs (a collective's time at each size likewise, never less than at the size below),
  since one run on a shared host can read half or twice another's."""
  import statistics
  cals = [parse_calibration(s) for s in summaries]
  out = dict(cals[0])
  for k in ("matmul_flops", "memory_gbps", "latency_s", "stream_gbps"):
    out[k] = statistics.median(c[k] for c in cals)
  out["collectives"] = {}
  for kind, points in cals[0]["collectives"].items():
    times = []
    for i, (nbytes, _) in enumerate(points):
      t = statistics.median(c["collectives"][kind][i][1] for c in cals)
      times.append([nbytes, max([t] + [p[1] for p in times])])
    out["collectives"][kind] = times
  return out


def priced_host(cores: int, calibration: str):
  """The topology the priced and terms parts price with: this host's, described as having
  ``cores`` cores (:func:`described_host`), with a calibration of the recorded machine where
  ``calibration`` names one: a JSON file whose ``calibration`` is written as Topology.to_json
  writes it, or bench JSONs (comma-separated) whose notes record ``Topology.calibrate()`` runs
  (:func:`recorded_calibration`)."""
  topo = described_host(cores) if cores else None
  if not calibration:
    return topo
  paths = calibration.split(",")
  with open(paths[0], encoding="utf-8") as f:
    first = json.load(f)
  recorded = (first["calibration"] if len(paths) == 1 and "calibration" in first
              else recorded_calibration(paths))
  return dtenjax.Topology.from_dict({**(topo or dtenjax.Topology.current()).to_dict(),
                                     "calibration": recorded})


def priced_rows(names, measured_json: str | None, topology=None) -> list[dict]:
  """The ``priced`` part: the cost model's step time of the plan and of every hand-written
  layout of the wins part (planning only, nothing runs), beside the measured times of a recorded
  wins run (``measured_json``, this bench's JSON) where it has the same family and layout."""
  import _families as fams
  measured = {}
  if measured_json:
    with open(measured_json, encoding="utf-8") as f:
      measured = {(r["family"], r["layout"]): r["measured_ms"] for r in json.load(f)["rows"]
                  if r.get("part") == "wins"}
  rows = []
  for name in names:
    fam = fams.FAMILIES[name]()
    step, args = fam.make()
    plan = dtenjax.plan(step, *args, topology=topology)
    rows.append({"family": name, "layout": "plan",
                 "mesh": "x".join(f"{a}{n}" for a, n in zip(plan.axis_names, plan.mesh_shape)
                                  if n > 1),
                 "predicted_ms": plan.cost.total_s * 1e3})
    for rn in fams.RECIPES:
      r = fams.recipe(fam, rn)
      if r is not None:
        rows.append({"family": name, "layout": rn,
                     "mesh": "x".join(f"{a}{n}" for a, n in r.mesh.shape.items()),
                     "predicted_ms": _ms(predicted_recipe(fam, r, step, args, topology)),
                     "measured_ms": measured.get((name, rn))})
    for row in rows:
      if row.get("measured_ms") and row.get("predicted_ms"):
        row["predicted_vs_measured"] = row["predicted_ms"] / row["measured_ms"]
  return rows


def model_terms(step, args, mesh: dict, specs, topology=None, update_scale: float = 1.0) -> dict:
  """The cost model's step time (ms) of the layout ``specs`` on ``mesh`` (pinned) in its terms:
  the products, the work beside them (norms, activations, softmax, the loss: the step's
  ``token_bytes`` streamed), the optimizer's update (its price times ``update_scale``), the
  exposed collectives and the FSDP gathers' waits among them, and how many collectives the price
  counts a meeting for (the time one more millisecond per meeting adds, with the update and the
  gathers' waits left out, less the price without meetings)."""
  def price(**attrs):
    with planning.replaced_cost_terms(**attrs):
      return dtenjax.plan(step, *args, topology=topology, mesh=mesh, pinned=specs,
                          memory_budget=1 << 50).cost
  full = price(stream_s_per_byte=lambda s: s * update_scale)
  no_update = price(stream_s_per_byte=0.0)
  products = price(stream_s_per_byte=0.0, beside_s_per_byte=0.0)
  unwaited = price(stream_s_per_byte=lambda s: s * update_scale, gather_spread=0.0)
  unmet = price(stream_s_per_byte=0.0, step_latency=0.0, gather_spread=0.0)
  met = price(stream_s_per_byte=0.0, step_latency=1e-3, gather_spread=0.0)
  return {"predicted_ms": full.total_s * 1e3, "products_ms": products.compute_s * 1e3,
          "beside_ms": (no_update.compute_s - products.compute_s) * 1e3,
          "update_ms": (full.compute_s - no_update.compute_s) * 1e3,
          "collectives_ms": full.exposed_s * 1e3,
          "waits_ms": (full.exposed_s - unwaited.exposed_s) * 1e3,
          "meetings": (met.exposed_s - unmet.exposed_s) / 1e-3}


COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                  "collective-permute")


def collective_placement(text: str) -> tuple[int, list[tuple[str, int]]]:
  """Where a compiled CPU program's entry computation issues its collectives among its products:
  (the products it runs, [(collective kind, products issued before it)] in the program's order).
  A product is a ``dot`` or ``convolution`` of the entry computation or a fusion that holds one;
  the products of a loop's body (a ``while``) are not counted (llama_scan's gathers lie there,
  one burst a layer). This is the order XLA:CPU's sequential schedule gives them (its runtime
  may start an independent instruction out of it: not observed here); where a gather follows
  ``k`` products, its devices arrive spread by those ``k`` since they last met
  (pricing.Pricer.gather_wait's premise)."""
  import re
  heads = re.split(r"\n(?=\S)", text)
  holds = {m.group(1) for h in heads for m in [re.match(r"%?([\w.\-]+) ", h)]
           if m and (" dot(" in h or " convolution(" in h)}
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  products, out = 0, []
  kinds = "|".join(COLLECTIVE_OPS)
  for line in entry.splitlines()[1:]:
    hit = re.search(rf"= .*?\b({kinds})(?:-start)?\(", line)
    if hit:
      out.append((hit.group(1), products))
      continue
    called = re.search(r"calls=%?([\w.\-]+)", line)
    if " dot(" in line or " convolution(" in line or (called and called.group(1) in holds):
      products += 1
  return products, out


def placement_rows(names, layouts=("DP", "FSDP")) -> list[dict]:
  """Each family's hand-written layouts (``layouts``) and ``plan.jit``'s program of the plan on
  `fsdp` 8 compiled on this machine's devices: per collective kind, how many the entry issues and
  after how many of its products the first and the last."""
  import _families as fams
  rows = []
  for name in names:
    fam = fams.FAMILIES[name]()
    programs = []
    for rn in layouts:
      r = fams.recipe(fam, rn)
      if r is not None:
        fn, _ = fams.recipe_jit(fam, r)
        programs.append((rn, "x".join(f"{a}{n}" for a, n in r.mesh.shape.items()),
                         lambda fn=fn, r=r: fn.lower(*fam.make(r.use)[1]).compile()))
    step, args = fam.make()
    plan = dtenjax.plan(step, *args, mesh={"fsdp": len(jax.devices())})
    programs.append(("plan.jit", "fsdp" + str(len(jax.devices())),
                     lambda: plan.jit(step).lower(*args).compile()))
    for layout, mesh, compile_ in programs:
      products, colls = collective_placement(compile_().as_text())
      kinds = {}
      for kind, before in colls:
        kinds.setdefault(kind, []).append(before)
      rows.append({"family": name, "layout": layout, "mesh": mesh, "products": products,
                   "placement": "; ".join(
                       f"{k} {len(v)}: after {min(v)}-{max(v)}" for k, v in sorted(kinds.items())),
                   "kinds": {k: v for k, v in sorted(kinds.items())}})
  return rows


def fused_bytes_per_param_byte(compiled, param_bytes: int) -> float:
  """Bytes the array-sized fusions of a compiled program's entry computation read and write
  (operands and results; scalars left out), per ``param_bytes``: what its loops move."""
  import re
  text = compiled.as_text()
  entry = text[text.index("ENTRY"):]
  size = {name: 4 * math.prod(int(d) for d in dims.split(",") if d)
          for name, dims in re.findall(r"%(\S+) = (?:f32|s32)\[([0-9,]*)\]", entry)}
  moved = 0
  for line in entry.splitlines():
    hit = re.match(r"\s*%(\S+) = \S+ fusion\(([^)]*)\)", line)
    if hit and size.get(hit.group(1), 0) > 4:
      operands = [o.strip().lstrip("%") for o in hit.group(2).split(",")]
      moved += size[hit.group(1)] + sum(size[o] for o in operands if size.get(o, 0) > 4)
  return moved / param_bytes


def adamw_update_passes() -> float:
  """Bytes XLA compiles optax's AdamW update (``tx.update`` then ``apply_updates``) to move per
  parameter byte on this backend; the cost model counts one fused pass, 7."""
  import optax
  tx = optax.adamw(1e-3)
  params = {"w": jnp.zeros((512, 1024), jnp.float32)}

  def update(p, g, state):
    u, state = tx.update(g, state, p)
    return optax.apply_updates(p, u), state
  compiled = jax.jit(update).lower(params, params, tx.init(params)).compile()
  return fused_bytes_per_param_byte(compiled, 512 * 1024 * 4)


# bench/fsdp_small_batch.py --layouts's candidates: which weight matrices each lays out P("fsdp")
MLP_LAYOUTS = {"plain jit": ("w1", "w2"), "DP": (), "w1 only": ("w1",), "w2 only": ("w2",)}


def mlp_terms_rows(measured: list[dict], topology=None,
                   update_scale: float = 1.0) -> tuple[list[dict], list[str]]:
  """The ``terms`` part of bench/fsdp_small_batch.py --layouts's rows (``measured``): each MLP
  layout (the plain FSDP jit, DP, one weight matrix with its bias over `fsdp` 8) priced in its
  terms beside its measured time, as :func:`terms_rows` prices the families', and per case and
  model how many pairs measured more than 3 % apart the prediction orders as measured."""
  import itertools
  from jax.sharding import PartitionSpec as P
  import fsdp_small_batch as fsb
  rows, notes = [], []
  for case, model in dict.fromkeys((r["case"], r["model"]) for r in measured):
    d, hidden, batch = (int(v) for v in case.split()[1::2])
    step, args = fsb.make(d, hidden, batch, model)

    def specs(tree, sharded):
      # a leaf named after a weight or its bias (b1 goes with w1; the optimizer's moments with
      # their parameter), its first dimension split over the 8 devices, as the bench laid it out
      def spec(path, x):
        names = [k.key for k in path if isinstance(getattr(k, "key", None), str)]
        split = names and "w" + names[-1][1:] in sharded and x.ndim and x.shape[0] % 8 == 0
        return P("fsdp") if split else P()
      return jax.tree_util.tree_map_with_path(spec, tree)
    ours = []
    for r in measured:
      if (r["case"], r["model"]) == (case, model):
        sharded = MLP_LAYOUTS[r["candidate"]]
        row = {"family": f"{model} {case}", "layout": r["candidate"], "mesh": "fsdp8",
               "planned_mesh": "fsdp8", "measured_ms": r["ms"],
               **model_terms(step, args, {"fsdp": 8}, [specs(args[0], sharded),
                                                       specs(args[1], sharded), None],
                             topology, update_scale)}
        row["predicted_vs_measured"] = row["predicted_ms"] / row["measured_ms"]
        ours.append(row)
    rows += ours
    pairs = [(a, b) for a, b in itertools.combinations(ours, 2)
             if abs(a["measured_ms"] / b["measured_ms"] - 1) > 0.03]
    agree = sum((a["measured_ms"] < b["measured_ms"]) == (a["predicted_ms"] < b["predicted_ms"])
                for a, b in pairs)
    notes.append(f"terms: {model} {case}: {agree} of {len(pairs)} pairs of layouts measured more "
                 "than 3 % apart predicted in the measured order")
  return rows, notes


def terms_rows(measured_jsons: list[str], topology=None,
               update_scale: float = 1.0) -> tuple[list[dict], list[str]]:
  """The ``terms`` part: every layout of recorded wins runs (``measured_jsons``, this bench's
  JSON) priced by the cost model in its terms (:func:`model_terms`) beside its measured time:
  the hand-written layouts as their specs pinned, "plan" and "plan @ ... budget" as this tree
  plans them (at the recorded budget; a row whose mesh is not the recorded one is priced, not
  counted); and per family, how many pairs of layouts whose measured times differ by more than
  3 % the prediction orders as measured. With ``update_scale`` the
  update is priced that many times over, and each family's default plan under that price is a
  row of its own ("plan, update x S"), not measured."""
  import itertools
  import _families as fams
  measured: dict[tuple[str, str], dict] = {}
  layouts: list[dict] = []
  for path in measured_jsons:
    with open(path, encoding="utf-8") as f:
      doc = json.load(f)
    if doc.get("bench") == "fsdp_small_batch":
      layouts += [r for r in doc["rows"] if r["candidate"] in MLP_LAYOUTS]
      continue
    for r in doc["rows"]:
      if r.get("part") == "wins" and r.get("measured_ms"):
        measured.setdefault((r["family"], r["layout"]), r)
  rows, notes = mlp_terms_rows(layouts, topology, update_scale)
  for name in dict.fromkeys(f for f, _ in measured):
    fam = fams.FAMILIES[name]()
    step, args = fam.make()
    params, opt, _ = args
    seen, planned = {}, {}
    for (f, layout), rec in measured.items():
      if f != name or layout in ("plan measured", "plan calibrated"):
        continue
      if layout in fams.RECIPES:
        r = fams.recipe(fam, layout)
        mesh, specs = dict(r.mesh.shape), [r.param_specs,
                                           fams._like_params(opt, params, r.param_specs), None]
      else:
        budget = rec.get("budget_mib")
        p = planned[layout] = dtenjax.plan(step, *args, topology=topology, memory_budget=None
                                           if budget is None else budget * 2**20)
        mesh, specs = dict(zip(p.axis_names, p.mesh_shape)), list(p.specs)
      row = {"family": name, "layout": layout, "mesh": rec["mesh"],
             "measured_ms": rec["measured_ms"], "recorded_ms": rec.get("predicted_ms"),
             **model_terms(step, args, mesh, specs, topology, update_scale)}
      row["planned_mesh"] = "x".join(f"{a}{n}" for a, n in mesh.items() if n > 1)
      rows.append(row)
      if row["planned_mesh"] == rec["mesh"]:   # else this tree plans another layout than was timed
        seen.setdefault((row["planned_mesh"], round(row["predicted_ms"], 3)), row)
    if update_scale != 1.0:
      with planning.replaced_cost_terms(stream_s_per_byte=lambda s: s * update_scale):
        p = dtenjax.plan(step, *args, topology=topology)
      mesh = dict(zip(p.axis_names, p.mesh_shape))
      planned_mesh = "x".join(f"{a}{n}" for a, n in mesh.items() if n > 1)
      rows.append({"family": name, "layout": f"plan, update x {update_scale:g}",
                   "mesh": planned_mesh, "planned_mesh": planned_mesh,
                   "same_as": ",".join(k for k, q in planned.items()
                                       if planning.same_layout(p, q)) or "-",
                   **model_terms(step, args, mesh, list(p.specs), topology, update_scale)})
    counted = [r for r in rows if r["family"] == name and r["planned_mesh"] == r["mesh"]
               and r.get("measured_ms")]
    for r in rows:
      if r["family"] == name and r.get("measured_ms"):
        r["predicted_vs_measured"] = r["predicted_ms"] / r["measured_ms"]
    if counted:
      ratios = [r["predicted_vs_measured"] for r in counted]
      notes.append(f"terms: {name}: predicted / measured {min(ratios):.2f}-{max(ratios):.2f} over "
                   f"{len(counted)} rows priced on the mesh timed")
    distinct = list(seen.values())
    pairs = [(a, b) for a, b in itertools.combinations(distinct, 2)
             if abs(a["measured_ms"] / b["measured_ms"] - 1) > 0.03]
    agree = sum((a["measured_ms"] < b["measured_ms"]) == (a["predicted_ms"] < b["predicted_ms"])
                for a, b in pairs)
    notes.append(f"terms: {name}: {agree} of {len(pairs)} pairs of distinct layouts measured "
                 f"more than 3 % apart predicted in the measured order")
  notes.append(f"terms: XLA compiles optax.adamw's update to move {adamw_update_passes():.1f} "
               f"bytes per parameter byte ({jax.devices()[0].platform}); the cost model's count "
               "(pricing.update_bytes) is checked against it by tests/test_step_planner.py")
  return rows, notes


def _budget_names(flag: str) -> list[str]:
  """--budgets: the hand-written layouts named (comma-separated), "all" for every one."""
  import _families as fams
  names = list(fams.RECIPES) if flag == "all" else [b for b in flag.split(",") if b]
  bad = [b for b in names if b not in fams.RECIPES]
  if bad:
    raise SystemExit(f"--budgets: {bad} are not hand-written layouts; name among {fams.RECIPES}")
  return names


def _ms(seconds: float | None) -> float | None:
  return None if seconds is None else seconds * 1e3


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/step_planner.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--parts", default="predict,clusters,time,wins")
  ap.add_argument("--families", default="llama_scan,llama_loop,encdec,convnet,moe,shared",
                  help="model families of the wins part (bench/_families.py)")
  ap.add_argument("--models", default=",".join(PREDICT), help="models of the predict part")
  ap.add_argument("--devices", default="",
                  help="predict part: only these device counts (e.g. 8,16; default all listed)")
  ap.add_argument("--iters", type=_harness.positive_int, default=10)
  ap.add_argument("--mock-gpus", type=int, default=0,
                  help="gpu part: mock a host of this many GPUs on the one present")
  ap.add_argument("--gpu-families", default="llama-1b,llama_scan,llama_loop,encdec,moe,shared",
                  help="gpu part: families, llama-1b, or predict:MODEL (the predict part's MODEL "
                  "on the mocked GPUs)")
  ap.add_argument("--gpu-fixture", default="h200_8",
                  help="gpu part: the topology fixture planned for (its GPU count: --mock-gpus)")
  ap.add_argument("--measured-json", metavar="PATH",
                  help="priced part: a recorded wins run whose measured times go beside; terms "
                  "part: recorded wins runs (comma-separated) whose layouts are priced")
  ap.add_argument("--cores", type=_harness.positive_int, default=0,
                  help="priced and terms parts: price this host's devices as sharing this many "
                  "cores (the machine of --measured-json; default: this host's)")
  ap.add_argument("--calibration", metavar="PATH", default="",
                  help="priced and terms parts: price with this Topology.calibrate() record of the "
                  "machine of --measured-json (a JSON object whose 'calibration' is written as "
                  "Topology.to_json writes it) in place of the table priors")
  ap.add_argument("--update-scale", type=float, default=1.0,
                  help="terms part: price the optimizer's update this many times over, and plan "
                  "each family under that price")
  ap.add_argument("--no-calibrate", action="store_true",
                  help="wins part: skip Topology.calibrate() and the calibrated plan")
  ap.add_argument("--budgets", nargs="?", const="all", default="",
                  help="wins part: also plan under 1.10x these hand-written layouts' compiled "
                  "memory (comma-separated; alone: all of them) and time those plans in the same "
                  "rounds")
  ap.add_argument("--no-measure", action="store_true",
                  help="wins part: skip the measure= plan (it compiles and times every layout a "
                  "user writes and the model's runner-ups once more)")
  ap.add_argument("--measure-rounds", type=_harness.positive_int, default=6,
                  help="wins part: timed rounds of the measure= plan (at least 2)")
  ap.add_argument("--time-against", metavar="DIR", default="",
                  help="time part: also plan with the dtenjax package under DIR (another "
                  "revision: git archive REV dtenjax | tar -x -C DIR), side by side")
  ap.add_argument("--json", metavar="PATH")
  ap.add_argument("--child", help=argparse.SUPPRESS)
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  if args.child:
    model, devices = args.child.split(":")
    print(json.dumps(predict_rows(model, int(devices))))
    return 0
  parts = args.parts.split(",")
  doc_rows, notes = [], []
  if "predict" in parts:
    rows = []
    for model in args.models.split(","):
      for n in PREDICT[model]:
        if not args.devices or str(n) in args.devices.split(","):
          rows += _child(model, n)
    misses = [r for r in rows if r["misses"]]
    print(_harness.table(rows, (("model", "model", "s"), ("N", "devices", "d"),
                                ("plan", "plan", "s"), ("mesh", "mesh", "s"),
                                ("mem pred MiB", "mem_pred_mib", ".1f"),
                                ("mem XLA MiB", "mem_xla_mib", ".1f"), ("mem err", "mem_err", ".1%"),
                                ("coll pred MiB", "bytes_pred_mib", ".1f"),
                                ("coll XLA MiB", "bytes_xla_mib", ".1f"),
                                ("coll err", "bytes_err", ".1%"),
                                ("worst kind", "worst_kind", "s"),
                                ("per kind", "kind_errs", "s")),
                         title="predictions against compilation"))
    notes.append(f"predict: {len(misses)} of {len(rows)} rows miss (memory or a collective "
                 f"kind's bytes > 10 %, StepPlan.check's misses()): " + "; ".join(
                     f"{r['model']}/{r['devices']}/{r['plan']} ({','.join(r['misses'])})"
                     for r in misses))
    doc_rows += [{"part": "predict", **r} for r in rows]
  if "clusters" in parts:
    rows = cluster_rows()
    print(_harness.table(rows, (("model", "model", "s"), ("topology", "topology", "s"),
                                ("mesh d x f x t", "mesh", "s"), ("step ms", "step_ms", ".1f"),
                                ("exposed ms", "exposed_ms", ".1f"), ("GiB/dev", "mem_gib", ".1f"),
                                ("best recipe", "best_recipe", "s"),
                                ("its ms", "best_recipe_ms", ".1f"), ("recipe/plan", "ratio", "ratio"),
                                ("across hosts", "crossing", "s"), ("plan ms", "plan_ms", ".0f")),
                         title="plans on the reference clusters"))
    doc_rows += [{"part": "clusters", **r} for r in rows]
  if "time" in parts:
    rows = time_rows(against=args.time_against)
    print(_harness.table(rows, (("model", "model", "s"), ("topology", "topology", "s"),
                                ("run", "run", "d"), ("package", "src", "s"),
                                ("plan s (cold, wall)", "plan_s", ".2f"),
                                ("CPU s", "plan_cpu_s", ".2f"),
                                ("of which GC", "plan_gc_cpu_s", ".2f"),
                                ("again, CPU s", "again_cpu_s", ".2f"), ("load avg", "load", ".1f"),
                                ("mesh", "mesh", "s"), ("specs hash", "specs_hash", "s")),
                         title="planning an 8B and a 70B-shaped step (bf16, 2048 tokens per "
                               "device), fresh processes; target: under 2 s of CPU each"))
    same = all(len({r["specs_hash"] for r in rows if (r["model"], r["topology"]) == k}) == 1
               for k in {(r["model"], r["topology"]) for r in rows})
    cold = sum(r["plan_cpu_s"] < 2.0 for r in rows)
    again = sum(r["again_cpu_s"] < 2.0 for r in rows)
    notes.append(f"time: same plan in every process of a model and topology: {same}; under 2 s "
                 f"of CPU: {cold} of {len(rows)} first plans, {again} of {len(rows)} again")
    theirs = os.path.join(args.time_against, "dtenjax")
    if (args.time_against and dtenjax.build_info()["built"] and
        not any(f.startswith("_ffi") for f in os.listdir(theirs))):
      notes.append(f"time: {theirs} has no native extension (this checkout's is built): its NVLink "
                   "gate stops at 'not built' and skips the checks this tree's makes for every "
                   "priced all-reduce; copy the extension in to compare like with like")
    if args.time_against:
      notes.append("time: median first plan's CPU s over " + args.time_against + "'s: " + ", ".join(
          f"{m} {f} {_harness.median(mine) / _harness.median(theirs):.2f}x"
          for (m, f), (mine, theirs) in _pairs(rows).items()))
    doc_rows += [{"part": "time", **r} for r in rows]
  if "gpu" in parts:
    rows, gnotes = gpu_rows(args.gpu_families.split(","), "large", args.gpu_fixture)
    print(_harness.table(rows, (("family", "family", "s"), ("layout", "layout", "s"),
                                ("mesh", "mesh", "s"), ("mem pred MiB", "mem_pred_mib", ".1f"),
                                ("mem XLA MiB", "mem_xla_mib", ".1f"), ("mem err", "mem_err", ".1%"),
                                ("predicted per kind MiB", "pred_kinds", "s"),
                                ("compiled per kind MiB", "xla_kinds", "s"),
                                ("compiled per kind count", "xla_counts", "s"),
                                ("bytes err", "bytes_err", ".1%")),
                         title=f"XLA's GPU compiler, {len(jax.devices())} "
                         f"{jax.devices()[0].device_kind} (mocked), compile only"))
    notes += gnotes
    doc_rows += [{"part": "gpu", **r} for r in rows]
  if "calibrate" in parts:
    runs = [dtenjax.Topology.current().calibrate().calibration for _ in range(args.iters)]
    notes += [c.summary() for c in runs]
    med = recorded_calibration_of([c.summary() for c in runs])
    print(f"calibrate: {args.iters} runs; the median: {med}")
    doc_rows.append({"part": "calibrate", "calibration": med})
  if "rows" in parts:
    rows, rnotes = product_rows(iters=args.iters)
    print(_harness.table(rows, (("rows/device", "rows", "d"),
                                ("CPU us per product", "cpu_us", ".1f"),
                                ("line us", "line_us", ".1f")),
                         title="a product's forward and backward per device, CPU time"))
    notes += rnotes
    doc_rows += [{"part": "rows", **r} for r in rows]
  if "priced" in parts:
    rows = priced_rows(args.families.split(","), args.measured_json,
                       priced_host(args.cores, args.calibration))
    print(_harness.table(rows, (("family", "family", "s"), ("layout", "layout", "s"),
                                ("mesh", "mesh", "s"), ("predicted ms", "predicted_ms", ".1f"),
                                ("measured ms", "measured_ms", ".1f"),
                                ("predicted/measured", "predicted_vs_measured", ".2f")),
                         title="the cost model's step times (table priors of this host's "
                         "devices" + (f", described as {args.cores} cores" if args.cores else "")
                         + "), nothing run"))
    doc_rows += [{"part": "priced", **r} for r in rows]
  if "placement" in parts:
    rows = placement_rows(args.families.split(","))
    print(_harness.table(rows, (("family", "family", "s"), ("layout", "layout", "s"),
                                ("mesh", "mesh", "s"), ("products", "products", "d"),
                                ("collectives: count, after how many products", "placement",
                                 "s")),
                         title="where XLA issues each collective among the entry's products, "
                         "compiled, nothing run"))
    doc_rows += [{"part": "placement", **r} for r in rows]
  if "terms" in parts:
    rows, tnotes = terms_rows(args.measured_json.split(",") if args.measured_json else [],
                              priced_host(args.cores, args.calibration), args.update_scale)
    print(_harness.table(rows, (("family", "family", "s"), ("layout", "layout", "s"),
                                ("mesh", "mesh", "s"), ("priced mesh", "planned_mesh", "s"),
                                ("measured ms", "measured_ms", ".1f"),
                                ("predicted ms", "predicted_ms", ".1f"),
                                ("/measured", "predicted_vs_measured", ".2f"),
                                ("products", "products_ms", ".1f"), ("beside", "beside_ms", ".1f"),
                                ("update", "update_ms", ".2f"),
                                ("collectives", "collectives_ms", ".1f"), ("waits", "waits_ms", ".1f"),
                                ("meetings", "meetings", ".0f"), ("same as", "same_as", "s")),
                         title="the cost model's terms (ms) of recorded layouts, nothing run ("
                         + (f"calibrated: {args.calibration}" if args.calibration else
                            "table priors") + ")"))
    notes += tnotes
    doc_rows += [{"part": "terms", **r} for r in rows]
  if "wins" in parts:
    budgets = _budget_names(args.budgets)
    calibrated = None
    if not args.no_calibrate:
      calibrated = dtenjax.Topology.current().calibrate()
      notes.append(f"wins: {calibrated.calibration.summary()}")
      print(notes[-1], file=sys.stderr, flush=True)
    def keep(rows_so_far, notes_so_far):       # a run cut short keeps every finished family
      if args.json:
        _write(args, argv, parts, doc_rows + [{"part": "wins", **r} for r in rows_so_far],
               notes + notes_so_far)
    rows, win_notes = wins_rows(args.families.split(","), args.iters, calibrated, keep,
                                budgets=budgets,
                                measure=0 if args.no_measure else args.measure_rounds)
    print(_harness.table(rows, WINS_COLUMNS + (BUDGET_COLUMNS if args.budgets else ()),
                         title=f"the plan against hand-written layouts, {len(jax.devices())} "
                         f"{jax.devices()[0].platform.upper()} devices, measured"))
    notes += win_notes
    doc_rows += [{"part": "wins", **r} for r in rows]
  for n in notes:
    print(n)
  if args.json:
    _write(args, argv, parts, doc_rows, notes)
  return 0


def _write(args, argv, parts, doc_rows, notes) -> None:
  _harness.write_json(args.json, _harness.document(
      "step_planner", __file__, argv, {"parts": parts}, doc_rows, kind="other",
      devices=jax.devices(), notes=notes))


if __name__ == "__main__":
  sys.exit(main())
