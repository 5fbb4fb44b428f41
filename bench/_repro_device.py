"""bench/reproducible_step.py --device: run-to-run reproducibility on the default device.

See bench/reproducible_step.py's docstring for the parts; bench/_repro_workloads.py holds the
steps and the pins. The main process never preallocates device memory
(``XLA_PYTHON_CLIENT_PREALLOCATE=false``, set before jax starts), so the fresh processes it starts
share the GPU with it.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _harness  # bench/_harness.py: the one table renderer of the benches
# Rough H200 seconds per part (compiles dominate), to keep the run inside --budget-s.
ESTIMATE_S = {"processes": 110, "costs": 155, "demo": 30, "device_counts": 10,
              "select_and_scatter": 10, "fusion": 20}


def _env(tiny: bool) -> dict[str, str]:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
  if tiny:
    env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def fresh_processes(jobs: list[list[str]], tiny: bool, timeout_s: float = 420) -> list[dict]:
  """Runs ``python <args>`` for every job at once, each in a fresh process; their JSON lines."""
  procs = [subprocess.Popen([sys.executable, *job], cwd=ROOT, env=_env(tiny), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for job in jobs]
  out = []
  deadline = time.monotonic() + timeout_s
  for job, p in zip(jobs, procs):
    try:
      stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      stdout, stderr = p.communicate()
      out.append({"error": f"timed out after {timeout_s:.0f} s: {' '.join(job)}",
                  "stderr": stderr[-2000:]})
      continue
    if p.returncode:
      out.append({"error": f"exit {p.returncode}: {' '.join(job)}", "stderr": stderr[-3000:]})
      continue
    out.append({"stdout": stdout})
  return out


def part_processes(args) -> dict:
  k = 2 if args.quick or args.tiny else 3
  steps = 3 if args.tiny else 5
  groups = [(w, 3 if args.tiny else 20 if w == "demo" else steps)
            for w in args.workloads.split(",") if w]
  res = {}
  cache_dir = tempfile.mkdtemp(prefix="dtenjax-autotune-")
  for workload, n in groups:
    jobs = [["bench/_repro_workloads.py", workload, pins, str(n)] + (["--tiny"] if args.tiny
                                                                    else [])
            for pins in ("jax.jit", "reproducible_step") for _ in range(k)]
    t0 = time.perf_counter()
    outs = fresh_processes(jobs, args.tiny)
    for pins in ("jax.jit", "reproducible_step"):
      rows = [o for j, o in zip(jobs, outs) if j[2] == pins]
      res[f"{workload} / {pins}"] = _digests(rows, k, time.perf_counter() - t0)
  if not args.quick and not args.tiny and "gpt2_mid" in args.workloads:
    jobs = [["bench/_repro_workloads.py", "gpt2", "reproducible_step", "3"] for _ in range(2)]
    t0 = time.perf_counter()
    res["gpt2 / reproducible_step"] = _digests(fresh_processes(jobs, args.tiny), 2,
                                               time.perf_counter() - t0)
  for workload, n in groups if args.all_pins else ():
    # the autotune cache: the first process fills it, the others read it
    job = ["bench/_repro_workloads.py", workload, "cache", str(n), "--cache-dir",
           os.path.join(cache_dir, workload)] + (["--tiny"] if args.tiny else [])
    t0 = time.perf_counter()
    first = fresh_processes([job], args.tiny)
    rest = fresh_processes([job] * (k - 1), args.tiny)
    res[f"{workload} / cache"] = _digests(first + rest, k, time.perf_counter() - t0)
  return res


def _digests(outs: list[dict], k: int, wall_s: float) -> dict:
  rows, errors = [], []
  for o in outs:
    if "error" in o:
      errors.append(o)
      continue
    rows.append(json.loads(o["stdout"].strip().splitlines()[-1]))
  digests = [r["digest"] for r in rows]
  return {"processes": k, "ok": len(rows), "distinct_digests": len(set(digests)),
          "digests": digests, "compile_s": [round(r["compile_s"], 1) for r in rows],
          "losses": [r["losses"] for r in rows], "wall_s": wall_s, "errors": errors}


def part_demo(args) -> dict:
  steps = "12" if args.tiny else "60"
  outs = fresh_processes([["-m", "dtenjax", "demo", "--no-progress", "--steps", steps]] * 2,
                         args.tiny)
  res = {"runs": []}
  for o in outs:
    if "error" in o:
      res["runs"].append(o)
      continue
    text = o["stdout"]
    line = lambda prefix: next((l for l in text.splitlines() if l.startswith(prefix)), "")
    res["runs"].append({"digest_line": line("losses sha256 "),
                        "device_counts_line": line("device counts:"),
                        "in_process_line": line("losses bit-identical")})
  digests = [r["digest_line"].split()[2] for r in res["runs"] if r.get("digest_line")]
  res["distinct_digests"] = len(set(digests)) if len(digests) == 2 else None
  return res


def part_device_counts(args) -> dict:
  del args
  import jax.numpy as jnp
  import jax
  from dtenjax.testing import demo
  (xtr, ytr), _ = demo.load_digits(0)
  micro = 128 // demo.MICRO_BATCHES
  xb = jnp.asarray(xtr[:128].reshape(demo.MICRO_BATCHES, micro, -1))
  yb = jnp.asarray(ytr[:128].reshape(demo.MICRO_BATCHES, micro))
  inv = demo.microbatch_invariance(demo.init_params(jax.random.key(0)), xb, yb)
  return {"digests_by_microbatches_per_device": inv, "identical": len(set(inv.values())) == 1}


def part_select_and_scatter(args) -> dict:
  del args
  import jax
  import jax.numpy as jnp
  import dtenjax

  def pooled_grad(x):
    pool = lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1),
                                           "SAME")
    return jax.grad(lambda v: pool(v).sum())(x)
  x = jax.random.normal(jax.random.key(0), (2, 16, 16, 4))
  jax.jit(pooled_grad)(x).block_until_ready()
  try:
    dtenjax.reproducible_step(pooled_grad, check_flags=jax.default_backend() == "gpu")(
        x).block_until_ready()
    return {"jax.jit": "compiles", "reproducible_step": "compiles"}
  except dtenjax.ConfigurationError as e:
    return {"jax.jit": "compiles", "reproducible_step": f"refused: {str(e)[:400]}"}


def part_fusion(args) -> dict:
  import functools
  import jax
  import dtenjax
  import _repro_variants
  loose = functools.partial(dtenjax.reproducible_step, check_flags=False)
  steps = 2 if args.tiny else 5
  out = _repro_variants.run_variants(loose, steps, ("subst one_shot", "fuse 64KiB"),
                           devices=jax.devices()[:8])
  return {"differing_parameters_vs_subst_one_shot": out["diffs"], "parameters": out["params"],
          "devices": out["devices"]}


def part_costs(args) -> dict:
  import jax
  import jax.numpy as jnp
  import _repro_workloads as rw
  models = [m for m in args.models.split(",") if m]
  pins = ["jax.jit", "autotune", "reproducible_step"] + (["ops", "cache"] if args.all_pins
                                                         else [])
  steps, repeats = (2, 2) if args.tiny else (10, 3)
  cache_dir = tempfile.mkdtemp(prefix="dtenjax-autotune-")
  res = {}
  for model in models:
    t_model = time.perf_counter()
    spec = rw.build(model, args.tiny)
    fns, state, rows = {}, {}, {}
    for p in pins:
      f = rw.jit_with(p, spec["fn"], spec["donate"], cache_dir)
      a = jax.tree.map(lambda v: jnp.array(v, copy=True) if isinstance(v, jax.Array) else v,
                       spec["args"])
      t0 = time.perf_counter()
      try:
        f.lower(*a).compile()
      except Exception as e:  # (record it, time the others)
        rows[p] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        continue
      rows[p] = {"compile_s": time.perf_counter() - t0}
      for _ in range(2):
        a = spec["advance"](a, jax.block_until_ready(f(*a)))
      fns[p], state[p] = f, a
    per = {p: [] for p in fns}
    names = list(fns)
    for r in range(repeats):
      for p in names[r % len(names):] + names[:r % len(names)]:
        f, a = fns[p], state[p]
        t0 = time.perf_counter()
        out = None
        for _ in range(steps):
          out = f(*a)
          a = spec["advance"](a, out)
        jax.block_until_ready(out)
        per[p].append((time.perf_counter() - t0) / steps)
        state[p] = a
    base = per.get("jax.jit")
    for p, times in per.items():
      med = statistics.median(times)
      rows[p].update(ms_per_step=1e3 * med, per_repeat_ms=[1e3 * t for t in times])
      if base:
        ratios = [b / t for b, t in zip(base, times)]
        rows[p].update(x_vs_jax_jit=statistics.median(base) / med, x_min=min(ratios),
                       x_max=max(ratios))
    res[model] = {"config": spec["config"], "pins": rows, "seconds": time.perf_counter() - t_model}
  return res


PARTS = {"processes": part_processes, "demo": part_demo, "device_counts": part_device_counts,
         "select_and_scatter": part_select_and_scatter, "fusion": part_fusion,
         "costs": part_costs}


def print_part(name: str, res: dict) -> None:
  print(f"\n== {name} ({res.get('seconds', 0):.0f} s) ==")
  if res.get("status") in ("skipped", "error"):
    print(f"{res['status']}: {res.get('why', '')}")
    return
  if name == "processes":
    rows = [{"what": k, "ok": f"{v['ok']} of {v['processes']}",
             "distinct": v["distinct_digests"],
             "digests": " ".join(v["digests"]) + (f"  errors: {v['errors']}" if v["errors"]
                                                   else "")}
            for k, v in res.items() if isinstance(v, dict) and "digests" in v]
    print(_harness.table(rows, (("workload / pins", "what", "s"), ("processes", "ok", ">"),
                                ("distinct digests", "distinct", "d"), ("digests", "digests", "s"))))
  elif name == "costs":
    rows = []
    for model, m in res.items():
      if not isinstance(m, dict) or "pins" not in m:
        continue
      for p, r in m["pins"].items():
        if "error" in r:      # said below the table, never as a row of numbers
          print(f"# {model} {p}: error: {r['error'][:120]}", file=sys.stderr)
          continue
        x = (f"{r['x_vs_jax_jit']:.3f} ({r['x_min']:.2f}..{r['x_max']:.2f})"
             if "x_vs_jax_jit" in r else None)
        rows.append({"model": model, "pins": p, "compile_s": r["compile_s"],
                     "ms": r["ms_per_step"], "x": x})
    print(_harness.table(rows, (("model", "model", "s"), ("pins", "pins", "s"),
                                ("compile s", "compile_s", ".1f"), ("ms/step", "ms", ".3f"),
                                ("x vs jax.jit", "x", ">"))))
  else:
    print(json.dumps({k: v for k, v in res.items() if k != "seconds"}, indent=1, default=str))


def main(args, ap) -> int:
  import _repro_workloads as rw
  args.budget_s = args.budget_s or (200.0 if args.quick else 360.0)
  parts = [p for p in args.parts.split(",") if p]
  bad = [p for p in parts if p not in PARTS]
  bad += [w for w in args.workloads.split(",") + args.models.split(",")
          if w and w not in rw.WORKLOADS]
  if bad:
    ap.error(f"unknown part(s) or workload(s) {bad}; parts: {list(PARTS)}, workloads: "
             f"{list(rw.WORKLOADS)}")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # before jax starts
  if args.tiny:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, str(HERE))
  import jax
  path = os.path.join(args.out, "reproducible_step.json") if args.out else args.json
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "jax": jax.__version__, "command": " ".join([sys.executable, *sys.argv]),
          "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
          "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
  results: dict = {}
  failed = False
  t_start = time.perf_counter()
  ratios = []          # measured / estimated seconds of the big parts done so far
  for name in _harness.progress(parts, "reproducible_step --device"):
    elapsed = time.perf_counter() - t_start
    scale = min(max(statistics.median(ratios), 0.5), 3.0) if ratios else 1.0
    est = ESTIMATE_S[name] * (0.6 if args.quick else 1.0) * scale
    if not args.tiny and elapsed + est > args.budget_s:
      results[name] = {"status": "skipped", "why": f"budget: {elapsed:.0f} s used, ~{est:.0f} s "
                                                   f"needed, --budget-s {args.budget_s:.0f}"}
    else:
      t0 = time.perf_counter()
      try:
        results[name] = PARTS[name](args)
      except Exception as e:  # (keep measuring the other parts)
        failed = True
        results[name] = {"status": "error", "why": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-4000:]}
      results[name]["seconds"] = time.perf_counter() - t0
      if results[name].get("status") != "error" and ESTIMATE_S[name] >= 30:
        ratios.append(results[name]["seconds"] / (ESTIMATE_S[name] * (0.6 if args.quick else 1)))
    print_part(name, results[name])
    if path:
      with open(path, "w") as f:
        json.dump({"meta": meta, "parts": results}, f, indent=1, default=str)
  print(f"\ntotal {time.perf_counter() - t_start:.0f} s on {meta['device']} (jax {meta['jax']})"
        + (f"; JSON: {path}" if path else ""))
  procs = results.get("processes", {})
  broken = [k for k, v in procs.items() if isinstance(v, dict) and k.endswith("reproducible_step")
            and v.get("distinct_digests", 1) > 1]
  if broken:
    print(f"NOT REPRODUCIBLE under reproducible_step: {broken}")
  return 1 if failed or broken else 0
