"""Compile time of an all-reduce of a gradient tree: dtenjax against ``lax.psum``, side by side.

A training step reduces one gradient per parameter; a model of 60 arrays (the default: 10 blocks
of 4 weights and 2 biases, as a small transformer's) asks for an all-reduce of 60 leaves. The
program dtenjax lowers for it must not make the step compile much slower than ``lax.psum`` of the
same tree does (target: at most 2x for the bucketed and the reproducible sums). Per candidate,
one fresh ``jax.jit(jax.shard_map(...))`` over every device, no persistent compilation cache:
the trace-and-lower time, XLA's compile time, their sum (``total``), the size of the program
(StableHLO operations of the lowering, HLO instructions after XLA's optimisation, the distinct
kernels XLA compiles -- XLA:CPU builds an LLVM module for each) and the collectives in it;
``x psum`` = total / lax.psum's total (lower is better). Each candidate is compiled
``--repeats`` times, interleaved, median reported, after ``--warmup`` rounds of every candidate
that are not counted: a process's first compile of a program also pays one-time costs (JAX's
own first lowering of shard_map and of the jnp functions it calls, dtenjax's modules imported on
first use) that a training step's compile shares with everything compiled before it; the first
round's total is reported apart (``first(ms)``, in the order the candidates run, so only
indicative). ``run(us)``: the median of ``--run-iters`` calls of each compiled program, the
candidates in turn, in reverse every other round (``run x psum``: against lax.psum's), so that a
change that compiles faster is seen not to run slower; ``run cpu(us)``: the CPU time of those
calls (every thread of the process). A `` (jnp)`` candidate is the same all-reduce with
dtenjax's XLA:CPU custom calls off (``DTENJAX_CPU_FFI=0``), ``ring (jnp steps)`` ring with only
its steps as jnp (``butterfly (jnp steps)`` the same for butterfly) (the bucket's copies still custom calls): the forms each custom call replaced,
in the same run.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/compile_time.py \
      --json compile_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

import _harness

# (label, all_reduce keyword arguments); None = lax.psum itself.
CANDIDATES = (
    ("lax.psum", None),
    ("auto", {}),
    ("auto per leaf", {"bucket_bytes": 0}),
    ("two_shot", {"algorithm": "two_shot"}),
    ("ring", {"algorithm": "ring"}),
    ("reproducible", {"reproducible": True}),
    ("reproducible two_shot", {"reproducible": True, "algorithm": "two_shot"}),
    ("reproducible per leaf", {"reproducible": True, "bucket_bytes": 0}),
    ("one_shot", {"algorithm": "one_shot"}),
    ("butterfly", {"algorithm": "butterfly"}),
    ("reproducible one_shot", {"reproducible": True, "algorithm": "one_shot"}),
    ("reproducible ring", {"reproducible": True, "algorithm": "ring"}),
    ("reproducible xla", {"reproducible": True, "algorithm": "xla"}),
    ("reproducible butterfly", {"reproducible": True, "algorithm": "butterfly"}),
    # two mesh axes (--outer): over (outer, inner)
    ("hierarchical", {"algorithm": "hierarchical"}),
    ("reproducible hierarchical", {"reproducible": True, "algorithm": "hierarchical"}),
)


# The same, with the per-element work as jnp (XLA:CPU compiles kernels for it) instead of
# dtenjax's custom calls (cpu_ffi.py): DTENJAX_CPU_FFI=0 while the candidate is traced.
JNP = " (jnp)"
CANDIDATES += tuple((label + JNP, kwargs) for label, kwargs in CANDIDATES
                    if kwargs and ("algorithm" in kwargs or kwargs.get("reproducible")))

# Ring's and butterfly's steps as jnp (XLA:CPU compiles their kernels) with the bucket's copies
# still custom calls: cpu_ffi.folds answers False while the candidate is traced (their form
# before their steps were custom calls).
JNP_STEPS = " (jnp steps)"
CANDIDATES += (("ring" + JNP_STEPS, {"algorithm": "ring"}),
               ("butterfly" + JNP_STEPS, {"algorithm": "butterfly"}))

# "reproducible per leaf" compiles for a minute on a 2-core VM (60 encodes and decodes), the
# other algorithms a user can name (and their jnp forms) on request
DEFAULT = ("lax.psum", "auto", "auto per leaf", "two_shot", "ring", "reproducible",
           "reproducible two_shot", "two_shot (jnp)", "ring (jnp)", "ring (jnp steps)",
           "reproducible (jnp)")


@contextlib.contextmanager
def _formulation(label: str):
  """DTENJAX_CPU_FFI=0 while a " (jnp)" candidate is traced and lowered; the custom-call steps
  off (``dtenjax.testing.xla.jnp_steps``) while a " (jnp steps)" one is."""
  if label.endswith(JNP_STEPS):
    from dtenjax.testing import xla
    with xla.jnp_steps():
      yield
    return
  if not label.endswith(JNP):
    yield
    return
  old = os.environ.get("DTENJAX_CPU_FFI")
  os.environ["DTENJAX_CPU_FFI"] = "0"
  try:
    yield
  finally:
    if old is None:
      del os.environ["DTENJAX_CPU_FFI"]
    else:
      os.environ["DTENJAX_CPU_FFI"] = old


def gradient_tree(blocks: int, d: int, world: int):
  """{name: [world, ...]}: one gradient per parameter of ``blocks`` blocks (4 ``d x d``
  weights, 2 biases each) on every device."""
  import jax.numpy as jnp
  shapes = {}
  for i in range(blocks):
    for w in ("q", "k", "v", "o"):
      shapes[f"{i}.{w}"] = (d, d)
    shapes[f"{i}.b1"], shapes[f"{i}.b2"] = (d,), (4 * d,)
  return {name: jnp.full((world, *s), 1.0 + (j % 8) / 4, jnp.float32)   # sums exact in f32
          for j, (name, s) in enumerate(shapes.items())}


def _count_ops(text: str) -> int:
  """Operations of a StableHLO or HLO module's text: lines that define a value."""
  return sum(1 for line in text.splitlines() if re.match(r"\s*(%|ROOT )", line))


def _kernels(hlo: str) -> int:
  """Kernels XLA compiles for an optimized HLO module: its distinct fused computations (XLA
  reuses one kernel for fusions whose computations are the same up to names) and standalone
  concatenates. XLA:CPU compiles each as an LLVM module of its own."""
  bodies, name, cur = {}, None, None
  for line in hlo.splitlines():
    m = re.match(r"^%?([\w.\-]+) \(.*\{$", line)
    if m and cur is None:
      name, cur = m.group(1), []
    elif cur is not None and line.startswith("}"):
      bodies[name], cur = cur, None
    elif cur is not None:
      cur.append(line)

  def canon(text: str) -> str:
    return re.sub(r"%[\w.\-]+", "%", re.sub(r", metadata=\{[^}]*\}", "", text)).strip()
  seen = set()
  for line in hlo.splitlines():
    m = re.search(r" fusion\(.*calls=%?([\w.\-]+)", line)
    if m:
      seen.add("\n".join(canon(b) for b in bodies.get(m.group(1), [m.group(1)])))
    elif " concatenate(" in line:
      seen.add(canon(line.split("=", 1)[1]))
  return len(seen)


def _collectives(hlo: str) -> int:
  """Collectives that move data: not the all-reduces over groups of one device each (dtenjax's
  run-time offsets, ``algorithms/base.py``'s ``opaque``)."""
  return sum(len(re.findall(r" (all-reduce|all-gather|all-to-all|reduce-scatter|"
                            r"collective-permute)(-start)?\(", line))
             for line in hlo.splitlines()
             if not re.search(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}", line))


# XLA's trace events (jax.profiler) of one compile: every XLA pass and the CPU backend, which
# emits and compiles the kernels (an LLVM module each). The whole compile's event is named
# PjRtCpuClient::Compile by jaxlib 0.10 and CompileCpuExecutable by 0.11 (read on both).
_XLA_NAMES, _BACKEND = ("PjRtCpuClient::Compile", "CompileCpuExecutable"), "CpuCompiler::RunBackend"


def phases(lowered) -> dict[str, float] | None:
  """Milliseconds of ``lowered.compile()`` (a fresh lowering: JAX keeps the executable of one it
  has compiled) by phase, from XLA's own trace events
  (``jax.profiler``): ``backend_ms`` (XLA:CPU's backend: the kernels, from their emission to
  the LLVM object code), ``passes_ms`` (XLA's HLO passes: sharding, simplification, fusion,
  layout...) and ``other_ms`` (the rest of the compile call: StableHLO to HLO, JAX's side).
  None where the trace has no such events (another backend, another XLA)."""
  import shutil
  import tempfile

  import jax
  path = tempfile.mkdtemp(prefix="compile_time_trace_")
  try:
    jax.profiler.start_trace(path)
    t0 = time.perf_counter()
    lowered.compile()
    wall = time.perf_counter() - t0
    jax.profiler.stop_trace()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                   if f.endswith(".xplane.pb"))
    if not files:
      return None
    spans = dict.fromkeys((*_XLA_NAMES, _BACKEND), 0.0)
    for plane in jax.profiler.ProfileData.from_file(files[-1]).planes:
      for line in plane.lines:
        for ev in line.events:
          if ev.name in spans:
            spans[ev.name] += ev.duration_ns / 1e6
  except Exception:  # a profiler missing here: no breakdown
    return None
  finally:
    shutil.rmtree(path, ignore_errors=True)
  xla = next((spans[n] for n in _XLA_NAMES if spans[n]), 0.0)
  if not xla:
    return None
  return dict(backend_ms=spans[_BACKEND], passes_ms=xla - spans[_BACKEND],
              other_ms=wall * 1e3 - xla)


def _run_times(programs: dict, tree, iters: int) -> dict[str, list[tuple[float, float]]]:
  """(wall, CPU) seconds per call of each compiled program, ``iters`` rounds after one untimed
  call each. CPU: ``time.process_time``, every thread of the process (the devices' threads
  included), which the other jobs of a shared machine disturb less than the wall time. The order
  is reversed every other round: a program always timed after the same other one inherits its
  threads' wake-ups."""
  import jax
  for f in programs.values():
    jax.block_until_ready(f(tree))
  samples = {label: [] for label in programs}
  order = list(programs)
  for i in range(iters):
    for label in (order if i % 2 == 0 else order[::-1]):
      c0, t0 = time.process_time(), time.perf_counter()
      jax.block_until_ready(programs[label](tree))
      samples[label].append((time.perf_counter() - t0, time.process_time() - c0))
  return samples


def measure(candidates, blocks: int, d: int, repeats: int, step: bool = False,
            run_iters: int = 5, warmup: int = 1, with_phases: bool = False, outer: int = 1):
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  import dtenjax

  jax.config.update("jax_enable_compilation_cache", False)
  world = jax.device_count()
  # one axis, or (outer, data) for the algorithms over two (hierarchical): every candidate and
  # psum reduce over all of them
  axes = "data" if outer == 1 else ("outer", "data")
  mesh = (jax.make_mesh((world,), (axes,)) if outer == 1
          else jax.make_mesh((outer, world // outer), axes))
  tree = jax.device_put(gradient_tree(blocks, d, world), NamedSharding(mesh, P(axes)))
  leaves = len(jax.tree.leaves(tree))
  nbytes = sum(v.nbytes for v in jax.tree.leaves(tree)) // world

  all_reduce = dtenjax.all_reduce      # imported here (dtenjax loads it on first use), not timed

  def build(kwargs):
    if kwargs is None:
      reduce = lambda t: jax.lax.psum(t, axes)
    else:
      reduce = lambda t: all_reduce(t, axes, **kwargs)
    if step:     # the reduced gradients consumed by an SGD update, as in a training step
      body = lambda t: jax.tree.map(lambda g, p: p[0] - 1e-3 * g, reduce(t), t)
    else:
      body = lambda t: reduce(t)
    # a fresh function each time: nothing of an earlier trace or compile is reused
    return jax.jit(jax.shard_map(lambda t: body(t), mesh=mesh, in_specs=(P(axes),),
                                 out_specs=P(), check_vma=not step))

  samples = {label: [] for label, _ in candidates}
  first = {}
  sizes, outs, programs = {}, {}, {}
  for r in range(warmup + repeats):
    what = (f"compile_time, warm-up {r + 1} of {warmup}" if r < warmup
            else f"compile_time, repeat {r - warmup + 1} of {repeats}")
    for label, kwargs in _harness.progress(candidates, what, lambda c: c[0]):
      f = build(kwargs)
      t0 = time.perf_counter()
      with _formulation(label):
        lowered = f.lower(tree)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      first.setdefault(label, t2 - t0)
      if r >= warmup:
        samples[label].append((t1 - t0, t2 - t1))
      if label not in sizes:
        hlo = compiled.as_text()
        sizes[label] = (_count_ops(lowered.as_text()), _count_ops(hlo), _kernels(hlo),
                        _collectives(hlo))
        outs[label] = jax.tree.leaves(compiled(tree))
        programs[label] = compiled
  # where one more compile of each goes, by XLA's trace events (not counted above)
  def lower(label, kwargs):
    with _formulation(label):
      return build(kwargs).lower(tree)
  split = ({label: phases(lower(label, kwargs)) for label, kwargs in candidates}
           if with_phases else {})
  # run time of each compiled program, interleaved: the compile-time changes must not cost it
  runs = _run_times(programs, tree, run_iters) if run_iters else {}
  rows = []
  for label, _ in candidates:
    lower = _harness.median(s[0] for s in samples[label])
    comp = _harness.median(s[1] for s in samples[label])
    stablehlo, hlo, kernels, colls = sizes[label]
    run = _harness.median(w for w, _ in runs[label]) * 1e6 if runs else None
    cpu = _harness.median(c for _, c in runs[label]) * 1e6 if runs else None
    rows.append(dict(candidate=label, leaves=leaves, bytes=nbytes, world=world,
                     lower_ms=lower * 1e3, compile_ms=comp * 1e3,
                     time_us=(lower + comp) * 1e6, total_ms=(lower + comp) * 1e3,
                     first_ms=first[label] * 1e3,
                     stablehlo_ops=stablehlo, hlo_ops=hlo, kernels=kernels, collectives=colls,
                     run_us=run, run_cpu_us=cpu, **(split.get(label) or {})))
  _harness.add_ratios(rows, "lax.psum", candidate="candidate", group=("leaves",),
                      ratio_key="speedup")
  base = next(row for row in rows if row["candidate"] == "lax.psum")
  for row in rows:
    row["x_psum"] = 1 / row["speedup"] if row["speedup"] else None
    row["run_x_psum"] = row["run_us"] / base["run_us"] if row["run_us"] else None
    row["run_cpu_x_psum"] = (row["run_cpu_us"] / base["run_cpu_us"] if row["run_cpu_us"]
                             else None)
  return rows, outs


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python bench/compile_time.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--blocks", type=_harness.positive_int, default=10,
                  help="blocks of 6 parameters (default 10: a 60-leaf tree)")
  ap.add_argument("--d", type=_harness.positive_int, default=64, help="model width")
  ap.add_argument("--repeats", type=_harness.positive_int, default=3)
  ap.add_argument("--warmup", type=int, default=1,
                  help="untimed rounds of every candidate before the timed ones (default 1; "
                       "the first round's totals are printed as first(ms) either way)")
  ap.add_argument("--step", action="store_true",
                  help="follow the all-reduce with an SGD update of each leaf (a training step's "
                       "use of the gradients) instead of returning the reduced leaves")
  ap.add_argument("--run-iters", type=int, default=5,
                  help="calls of each compiled program timed (interleaved, median) for the run "
                       "column; 0 skips it")
  ap.add_argument("--candidates", default=",".join(DEFAULT),
                  help="comma-separated labels of " + ", ".join(l for l, _ in CANDIDATES))
  ap.add_argument("--phases", action="store_true",
                  help="compile each candidate once more under jax.profiler and split that "
                       "compile by XLA's trace events: its HLO passes, its CPU backend (the "
                       "kernels) and the rest")
  ap.add_argument("--outer", type=_harness.positive_int, default=1,
                  help="a mesh of (outer, devices / outer) instead of one axis, every candidate "
                       "reducing over both (hierarchical needs two)")
  ap.add_argument("--json", default=None, help="write the rows to this path")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  known = dict(CANDIDATES)
  labels = [c.strip() for c in args.candidates.split(",") if c.strip()]
  if not labels or set(labels) - set(known):
    ap.error(f"--candidates={args.candidates!r}: pick from {list(known)}")
  if "lax.psum" not in labels:
    labels.insert(0, "lax.psum")                 # the anchor every ratio is taken against
  import jax
  import numpy as np
  world = jax.device_count()
  _harness.require_world("bench/compile_time.py", world, 2,
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
  if world % args.outer or (args.outer == 1 and any("hierarchical" in l for l in labels)):
    ap.error(f"--outer={args.outer}: it must divide the {world} devices, and be > 1 for "
             "hierarchical (two mesh axes), e.g. --outer 2")
  load_before = os.getloadavg()
  rows, outs = measure([(l, known[l]) for l in labels], args.blocks, args.d, args.repeats,
                       args.step, max(0, args.run_iters), max(0, args.warmup), args.phases,
                       args.outer)
  want = outs["lax.psum"]
  for row in rows:   # every candidate computes the same sums (the data is exact in float32)
    row["agrees"] = all(np.array_equal(np.asarray(a), np.asarray(b))
                        for a, b in zip(outs[row["candidate"]], want))
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "compile_time", __file__, argv, {k: v for k, v in vars(args).items() if k != "json"},
        rows, devices=jax.devices(), kind="other"))
  what = "all-reduce + SGD update" if args.step else "all-reduce"
  print(f"jit(shard_map({what})) of {rows[0]['leaves']} leaves ({rows[0]['bytes']} B per "
        f"device) over {world} {jax.default_backend()} devices, median of {args.repeats} fresh "
        f"compiles after {max(0, args.warmup)} untimed round(s); x psum = (lower + compile) / "
        "lax.psum's (lower is better; target <= 2); load average "
        f"{load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after (the times are the "
        "machine's: compare the ratios)")
  print(_harness.table(rows, (("candidate", "candidate", "s"), ("lower(ms)", "lower_ms", ".1f"),
                              ("compile(ms)", "compile_ms", ".1f"),
                              ("total(ms)", "total_ms", ".1f"), ("first(ms)", "first_ms", ".1f"),
                              ("stablehlo ops", "stablehlo_ops", "d"), ("hlo ops", "hlo_ops", "d"),
                              ("kernels", "kernels", "d"), ("collectives", "collectives", "d"),
                              ("run(us)", "run_us", ".0f"), ("run cpu(us)", "run_cpu_us", ".0f"),
                              ("agrees", "agrees", "")),
                       ) + "\n" + _harness.table(rows, (("candidate", "candidate", "s"),
                                                        ("x psum", "x_psum", ".2f"),
                                                        ("run x psum", "run_x_psum", ".2f"),
                                                        ("run cpu x psum", "run_cpu_x_psum",
                                                         ".2f"))))
  if all("backend_ms" in row for row in rows):
    print("one more compile of each, split by XLA's trace events (jax.profiler): the HLO passes, "
          "the CPU backend (emitting and compiling the kernels) and the rest (StableHLO to HLO)")
    print(_harness.table(rows, (("candidate", "candidate", "s"),
                                ("hlo passes(ms)", "passes_ms", ".1f"),
                                ("backend(ms)", "backend_ms", ".1f"),
                                ("other(ms)", "other_ms", ".1f"), ("kernels", "kernels", "d"))))
  elif args.phases:
    print("--phases: this jax/XLA gave no PjRtCpuClient::Compile trace events; no breakdown")
  return 0


if __name__ == "__main__":
  sys.exit(main())
