"""CUDA graphs (XLA command buffers): dtenjax.jit's policies against jax.jit's default, side by side.

One process measures every case; in each, the candidates are compiled first, then timed in
interleaved blocks (the order rotates every repeat), the median per step reported with the ratio
to ``jax.jit`` (XLA's default settings, what JAX users run) and that ratio's range over repeats.

Cases (``--cases``, default all but ``gpt2_scan``; cheap ones first, each skipped when
``--budget-s`` would be exceeded, said in the output):

* ``launch``: L x (small fusion -> dtenjax CUDA custom call), all launch-bound;
* ``loop``: a ``lax.fori_loop`` of small fusions + custom calls (a while loop);
* ``split``: runs of three small ops between tiny convolutions;
* ``decode``: GPT-2 small one-token decode step with a KV cache (launch-bound; examples/gpt2_train.py);
* ``decode_loop``: 16 decode steps in one ``fori_loop``;
* ``resnet50_b16``, ``resnet50_b64``: the ResNet-50 train step of examples/resnet50_train.py;
* ``gpt2``: GPT-2 small train step (124 M parameters, seq 1024, batch 8, AdamW);
* ``gpt2_scan``: the same with ``lax.scan`` over the layers.

Candidates: ``jax.jit`` (the baseline), ``auto`` (dtenjax's default), ``auto_v1`` (dtenjax's
previous auto: XLA's defaults + WHILE, min_graph_size 2, kept to show why it lost; on the cheap
cases and ResNet-50 batch 16, ``--with-v1`` for all), and on the cheap cases ``measure`` (the
opt-in measured choice, with its cost) and ``off``. Per candidate:
the decision, compile seconds, how many new XLA executables it built (0 = it reused the jax.jit
executable), whether its optimised HLO equals jax.jit's, graph_report's PREDICTED graph launches
and ops launched one by one per step, and on a GPU the profiler's OBSERVED graph launches and
kernels inside / outside graphs per step. Every candidate, jax.jit included, is compiled with
``xla_enable_command_buffers_during_profiling`` (XLA runs graphs op by op under a profiler
otherwise; the option is read only while a profiler session is active).

  python bench/cuda_graphs.py --out DIR [--quick] [--cases a,b] [--budget-s S]
  python bench/cuda_graphs.py --tiny    # a CPU smoke test: tiny models, GPU rules applied
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import _harness

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

# the probe kernel lives in the test extension (dtenjax/testing/native.py)
from dtenjax.testing import native as native_testing
import dtenjax
from dtenjax import testing
from dtenjax.testing import xla

CASES = ("launch", "loop", "split", "decode", "decode_loop", "resnet50_b16", "gpt2",
         "resnet50_b64", "gpt2_scan")
DEFAULT_CASES = CASES[:-1]         # gpt2_scan on request
CHEAP = ("launch", "loop", "split", "decode", "decode_loop")
# Rough H200 seconds per case (compiles dominate), to keep the run inside --budget-s.
ESTIMATE_S = {"launch": 8, "loop": 8, "split": 8, "decode": 45, "decode_loop": 45,
              "resnet50_b16": 110, "gpt2": 120, "resnet50_b64": 110, "gpt2_scan": 90}
AUTO_V1 = dtenjax.CudaGraphPolicy.xla_default_plus("auto_v1", ("WHILE",), 2)


def _candidates(case: str, args) -> list[str]:
  names = ["jax.jit", "auto"]
  if case in CHEAP or case == "resnet50_b16" or args.with_v1:   # where auto_v1 lost: ResNet b16
    names += ["auto_v1"]
  if case in CHEAP:
    names += ["measure", "off"]
  elif args.with_off:
    names += ["off"]
  return names


# ---- the steps ------------------------------------------------------------------------------

def _scale_add(on_gpu: bool):
  """out = 0.5 * x + y through the dtenjax CUDA custom call (or jnp where there is none)."""
  if on_gpu and native_testing.has_target("dtenjax_graph_probe_scale_add", "CUDA"):
    target = native_testing.require("dtenjax_graph_probe_scale_add", "CUDA")

    def f(x, y):
      return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          x, y, scale=np.float32(0.5))
    return f, True
  return (lambda x, y: 0.5 * x + y), False


def build(case: str, tiny: bool, on_gpu: bool) -> dict:
  """{fn, args, donate, advance(args, out) -> args, config} of one case."""
  if case in ("launch", "loop", "split"):
    layers, n = (8, 256) if tiny else (100, 4096)
    sa, native = _scale_add(on_gpu)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    y = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)
    kern = jnp.ones((3, 1, 1), jnp.float32) / 3.0

    def launch(x, y):
      for i in range(layers):
        x = sa(jnp.sin(x) * (1.0 + 1e-3 * i), y)
      return x

    def loop(x, y):
      def body(i, c):
        return sa(jnp.cos(c) + 1e-3 * i.astype(c.dtype), y)
      return jax.lax.fori_loop(0, layers, body, x)

    def split(x, y):
      for _ in range(max(layers // 4, 1)):
        x = jnp.sin(sa(jnp.tanh(x) + 1.0, y)) * 0.9
        x = jax.lax.conv_general_dilated(x.reshape(1, n, 1), kern, (1,), "SAME",
                                         dimension_numbers=("NWC", "WIO", "NWC")).reshape(n)
      return x
    fn = {"launch": launch, "loop": loop, "split": split}[case]
    return {"fn": fn, "args": (x, y), "donate": (), "advance": lambda a, out: a,
            "config": {"layers": layers, "n": n, "dtenjax_custom_call": native}, "unit": None}
  if case.startswith("resnet50"):
    import resnet50_train as rn
    batch = 2 if tiny else int(case.split("_b")[1])
    stages, width, classes, image = ((1, 1), 4, 10, 32) if tiny else ((3, 4, 6, 3), 64, 1000, 224)
    params = rn.init_resnet(0, stages, width, classes)
    images, labels = rn.synthetic_batch(1, batch, image, classes)
    fn = rn.make_train_step(rn.block_strides(stages))
    return {"fn": fn, "args": (params, jax.tree.map(jnp.zeros_like, params), images, labels),
            "donate": (0, 1), "advance": lambda a, out: (out[0], out[1]) + tuple(a[2:]),
            "config": {"batch": batch, "image": image, "stages": stages, "width": width},
            "unit": ("images/s", batch)}
  import gpt2_train as g2
  cfg = g2.CONFIGS["tiny" if tiny else "small"]
  batch = 2 if tiny else 8
  if case in ("gpt2", "gpt2_scan"):
    params = g2.init_params(0, cfg, scan=case == "gpt2_scan")
    tokens = g2.synthetic_tokens(1, batch, cfg)
    return {"fn": g2.make_train_step(cfg), "args": (params, g2.init_opt_state(params), tokens),
            "donate": (0, 1), "advance": lambda a, out: (out[0], out[1], a[2]),
            "config": {**cfg, "batch": batch, "scan": case == "gpt2_scan"},
            "unit": ("tokens/s", batch * cfg["ctx"])}
  pb = jax.tree.map(lambda v: v.astype(g2.DT), g2.init_params(0, cfg))
  tok = jnp.zeros((batch,), jnp.int32)
  n_tok = 4 if tiny else 16
  if case == "decode":
    fn = g2.make_decode_step(cfg)
    adv = lambda a, out: (a[0], out[1], out[0], out[2])      # the position stays on the device
    unit = ("tokens/s", batch)
  else:
    fn = g2.make_generate(cfg, n_tok)
    adv = lambda a, out: (a[0], out[1], out[0][-1], out[2])
    unit = ("tokens/s", batch * n_tok)
  return {"fn": fn, "args": (pb, g2.init_cache(cfg, batch), tok, jnp.int32(0)),
          "donate": (1,), "advance": adv, "unit": unit,
          "config": {**cfg, "batch": batch, "tokens_per_call": 1 if case == "decode" else n_tok}}


# ---- measuring ------------------------------------------------------------------------------

class _CompileCounter:
  """Counts XLA backend compiles (jax.monitoring events) to show which candidates reused one."""

  def __init__(self):
    self.n = 0
    jax.monitoring.register_event_duration_secs_listener(self._on)

  def _on(self, event: str, duration: float, **_):
    del duration
    if "backend_compile" in event:
      self.n += 1


def _make(name: str, fn, donate, prof_opts: dict, measure_kw: dict, backend: str | None):
  opts = dict(prof_opts)
  if name == "jax.jit":
    return jax.jit(fn, donate_argnums=donate, compiler_options=opts or None)
  mode = AUTO_V1 if name == "auto_v1" else name
  extra = {"measure": measure_kw} if name == "measure" else {}
  return dtenjax.jit(fn, mode, donate_argnums=donate, compiler_options=opts or None,
                    backend=backend, **extra)


def _copy(tree):
  return jax.tree.map(lambda v: jnp.array(v, copy=True) if isinstance(v, jax.Array) else v, tree)


def run_case(case: str, args, counter: _CompileCounter, on_gpu: bool) -> dict:
  spec = build(case, args.tiny, on_gpu)
  fn, advance = spec["fn"], spec["advance"]
  prof = ({xla.OPT_PROFILING: True}
          if on_gpu and xla.OPT_PROFILING in xla.accepted_option_keys() else {})
  measure_kw = {"steps": 3, "repeats": 3} if args.tiny else {"steps": 10, "repeats": 5}
  rows, state, fns = [], {}, {}
  baseline_hlo = None
  for name in _candidates(case, args):
    a = _copy(spec["args"])
    # --tiny applies the GPU rules on any backend (the options compile and are ignored on CPU)
    jitted = _make(name, fn, spec["donate"], prof, measure_kw, "gpu" if args.tiny else None)
    before, t0 = counter.n, time.perf_counter()
    compiled = jitted.lower(*a).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    baseline_hlo = digest if name == "jax.jit" else baseline_hlo
    rep = dtenjax.graph_report(jitted if name != "jax.jit" else compiled, *a)
    decision = getattr(jitted, "decision", None)
    measured = decision.measured if decision else None
    rows.append({
        "candidate": name, "compile_s": compile_s, "new_executables": counter.n - before,
        "hlo_sha256": digest, "same_hlo_as_jax_jit": digest == baseline_hlo,
        "policy": decision.policy.describe() if decision else "XLA's defaults (jax.jit)",
        "compiler_options": (jitted.compiler_options if decision else prof),
        "reason": decision.reason if decision else "",
        "measure": measured.to_dict() if measured else None,
        "predicted": {"source": rep.source, "graphs": rep.num_graphs,
                      "ops_inside": rep.ops_inside, "ops_outside": rep.ops_outside,
                      "graph_launches_per_step": rep.graph_launches_per_step(),
                      "ops_outside_per_step": rep.ops_outside_per_step(),
                      "splitters": sorted({s.what for s in rep.splitters})[:12]},
    })
    fns[name] = jitted
    state[name] = a
  # warm up (records the command buffers), then interleaved timing
  for name, f in fns.items():
    for _ in range(2):
      state[name] = advance(state[name], jax.block_until_ready(f(*state[name])))
  steps, repeats = args.steps, args.repeats
  per = {n: [] for n in fns}
  names = list(fns)
  outs = {}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      f, s = fns[name], state[name]
      t0 = time.perf_counter()
      out = None
      for _ in range(steps):
        out = f(*s)
        s = advance(s, out)
      jax.block_until_ready(out)
      per[name].append((time.perf_counter() - t0) / steps)
      state[name], outs[name] = s, out
  base = per["jax.jit"]
  ref = np.asarray(jax.tree.leaves(outs["jax.jit"])[0], np.float64)
  for row in rows:
    name = row["candidate"]
    ratios = [b / c for b, c in zip(base, per[name])]
    med = statistics.median(per[name])
    row.update(ms_per_step=1e3 * med, x_vs_jax_jit=statistics.median(base) / med,
               x_min=min(ratios), x_max=max(ratios), per_repeat_ms=[1e3 * v for v in per[name]],
               first_output_max_abs_diff=float(np.max(np.abs(
                   np.asarray(jax.tree.leaves(outs[name])[0], np.float64) - ref)))
               if ref.size else 0.0)
    if spec["unit"]:
      row["throughput"] = f"{spec['unit'][1] / med:.1f} {spec['unit'][0]}"
  if not args.no_observe:
    for row in rows:
      name = row["candidate"]
      f = fns[name]
      holder = {"s": state[name]}

      def one(f=f, holder=holder):
        out = f(*holder["s"])
        holder["s"] = advance(holder["s"], out)
        return out
      obs = testing.observe_launches(one, steps=3, warmup=1)
      row["observed"] = {**testing.per_step_summary(obs), "executions": obs.executions,
                         "applies": obs.applies, "graphs_kept_under_profiler": bool(prof)}
  return {"status": "ok", "config": spec["config"], "candidates": rows}


# ---- output ---------------------------------------------------------------------------------

def _fmt(v, nd=1):
  return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


# (header, key) of a case's table; text cells left-aligned, numbers right (_harness.table)
CASE_COLUMNS = (("candidate", "candidate", "s"), ("policy", "policy", "s"),
                ("compile s", "compile", ">"), ("new exe", "new", ">"),
                ("HLO = jax.jit", "same", "s"), ("pred. graphs", "graphs", ">"),
                ("pred. graph launches/step", "launches", ">"),
                ("pred. ops 1-by-1/step", "outside", ">"),
                ("obs. graph launches/step", "obs_launches", ">"),
                ("obs. kernels in/out per step", "obs_in_out", ">"), ("ms/step", "ms", ">"),
                ("x vs jax.jit (min..max)", "x", ">"))


def print_case(case: str, res: dict) -> None:
  if res["status"] != "ok":
    print(f"[{case}] {res['status']}: {res.get('why', '')}")
    return
  rows = []
  for r in res["candidates"]:
    p, o = r["predicted"], r.get("observed") or {}
    obs_in_out = (f"{_fmt(o.get('kernels_in_graphs_per_step'))} / "
                  f"{_fmt(o.get('kernels_outside_per_step'))}" if o else "-")
    rows.append({"candidate": r["candidate"], "policy": r["policy"][:48],
                 "compile": f"{r['compile_s']:.1f}", "new": str(r["new_executables"]),
                 "same": "yes" if r["same_hlo_as_jax_jit"] else "no",
                 "graphs": str(p["graphs"]), "launches": _fmt(p["graph_launches_per_step"]),
                 "outside": _fmt(p["ops_outside_per_step"]),
                 "obs_launches": _fmt(o.get("graph_launches_per_step")),
                 "obs_in_out": obs_in_out, "ms": f"{r['ms_per_step']:.3f}",
                 "x": f"{r['x_vs_jax_jit']:.3f} ({r['x_min']:.2f}..{r['x_max']:.2f})"})
  print(_harness.table(rows, CASE_COLUMNS, title=f"{case} {res['config']}"))
  for r in res["candidates"]:
    if r["reason"]:
      print(f"  {r['candidate']}: {r['reason']}")
    if r["measure"]:
      m = r["measure"]
      print(f"  measure: cost {m['cost_s']:.1f} s, candidates {m['candidates']}, "
            f"medians (ms) {({k: round(v * 1e3, 3) for k, v in m['seconds'].items()})}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--cases", default=",".join(DEFAULT_CASES),
                  help=f"comma list of {', '.join(CASES)} (default: all but gpt2_scan)")
  ap.add_argument("--steps", type=int, default=None, help="steps per timed block")
  ap.add_argument("--repeats", type=int, default=None, help="timed blocks per candidate")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="skip a case when the run would pass this many seconds (estimated from "
                       "the cases done so far); default 330, 230 with --quick")
  ap.add_argument("--quick", action="store_true", help="fewer steps and repeats")
  ap.add_argument("--tiny", action="store_true", help="tiny models and sizes (CPU smoke test)")
  ap.add_argument("--with-off", action="store_true", help="also time graphs off on the models")
  ap.add_argument("--with-v1", action="store_true",
                  help="also time auto_v1 on every model (default: cheap cases and ResNet b16)")
  ap.add_argument("--no-observe", action="store_true", help="skip the profiler observation")
  ap.add_argument("--out", default=None, help="directory for cuda_graphs.json")
  ap.add_argument("--json", default=None, help="write the JSON to this file instead")
  args = ap.parse_args(argv)
  cases = [c for c in args.cases.split(",") if c]
  bad = [c for c in cases if c not in CASES]
  if bad:
    ap.error(f"unknown case(s) {bad}; choose from {list(CASES)}")
  args.budget_s = args.budget_s or (230.0 if args.quick else 330.0)
  args.steps = args.steps or (3 if args.tiny else 10 if args.quick else 20)
  args.repeats = args.repeats or (2 if args.tiny else 3 if args.quick else 5)
  if args.steps < 1 or args.repeats < 1:
    ap.error("--steps and --repeats must be >= 1")
  path = args.json or (os.path.join(args.out, "cuda_graphs.json") if args.out else None)
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  on_gpu = jax.default_backend() == "gpu"
  meta = {"date": time.strftime("%Y-%m-%d %H:%M"), "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "command": " ".join([sys.executable, *sys.argv]), "steps": args.steps,
          "repeats": args.repeats, "tiny": args.tiny,
          "profiling_option_accepted": xla.OPT_PROFILING in xla.accepted_option_keys()}
  results: dict = {}
  counter = _CompileCounter()
  t_start = time.perf_counter()
  failed = False
  ratios = []          # measured / estimated seconds of the cases done so far
  for case in _harness.progress(cases, "cuda_graphs"):
    elapsed = time.perf_counter() - t_start
    scale = min(max(statistics.median(ratios), 0.5), 3.0) if ratios else 1.0
    need = ESTIMATE_S[case] * (0.6 if args.quick else 1) * scale
    if not args.tiny and elapsed + need > args.budget_s:
      results[case] = {"status": "skipped",
                       "why": f"budget: {elapsed:.0f} s used, ~{need:.0f} s needed, "
                              f"--budget-s {args.budget_s:.0f}"}
    else:
      t0 = time.perf_counter()
      try:
        results[case] = run_case(case, args, counter, on_gpu)
      except Exception as e:  # (keep measuring the other cases)
        failed = True
        results[case] = {"status": "error", "why": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()[-4000:]}
      results[case]["seconds"] = time.perf_counter() - t0
      if results[case]["status"] == "ok" and ESTIMATE_S[case] >= 40:    # compile-bound cases
        ratios.append(results[case]["seconds"] / (ESTIMATE_S[case] * (0.6 if args.quick else 1)))
    print_case(case, results[case])
    if path:
      rows = [{"case": c, **r} for c, res in results.items() if res["status"] == "ok"
              for r in res["candidates"]]
      with open(path, "w") as fh:
        json.dump({"meta": meta, "cases": results, "rows": rows}, fh, indent=1, default=str)
  summary = []
  for case, res in results.items():
    if res["status"] != "ok":          # not measured: its status and why, no numbers
      summary.append({"case": case, "jit": res["status"], "policy": res.get("why", "")[:60]})
      continue
    by = {r["candidate"]: r for r in res["candidates"]}
    x = lambda n: (f"{by[n]['x_vs_jax_jit']:.3f} ({by[n]['x_min']:.2f}..{by[n]['x_max']:.2f})"
                   if n in by else None)
    summary.append({"case": case, "jit": f"{by['jax.jit']['ms_per_step']:.3f}", "auto": x("auto"),
                    "auto_v1": x("auto_v1"), "measure": x("measure"), "off": x("off"),
                    "policy": by["auto"]["policy"][:60]})
  print(_harness.table(summary, (
      ("case", "case", "s"), ("jax.jit ms/step", "jit", ">"), ("auto x", "auto", ">"),
      ("auto_v1 x", "auto_v1", ">"), ("measure x", "measure", ">"), ("off x", "off", ">"),
      ("auto policy", "policy", "s")),
      title=f"auto vs jax.jit's default on {meta['device']} (jax {meta['jax']}), median of "
            f"{args.repeats} interleaved blocks of {args.steps} steps"))
  if not on_gpu:
    print(f"note: backend {jax.default_backend()!r}: command buffers do not apply; the "
          "candidates compile the same program and their times differ only by noise.")
  print(f"total {time.perf_counter() - t_start:.0f} s" + (f"; JSON: {path}" if path else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
