"""What every benchmark in bench/ shares: sizes, timing, the nccl-tests columns, ratios, one JSON
schema and clear refusals. Each bench imports it as ``import _harness`` (bench/ is the directory
of the script Python runs, and ``python -m dtenjax bench NAME`` runs the same script).

* sizes: ``--sizes 8,64K,1M`` (:func:`parse_size`, :func:`sizes_arg` for argparse);
* timing: :func:`interleaved` times every candidate round-robin, one call of each per round, so
  drift of the machine hits them alike;
* columns: :func:`nccl_columns` gives nccl-tests' size, count, type, time (us), algbw and busbw
  (busbw = algbw x :func:`bus_factor`, e.g. 2(n-1)/n for all-reduce);
* ratios: :func:`add_ratios` puts ``baseline time / candidate time`` next to every row of a group
  (> 1: the candidate is faster), so candidates measured in one run are compared side by side;
* tables: :func:`table` (laid out by rich as the CLI's, through ``dtenjax.testing.report``);
* JSON: :func:`document` builds the one schema every bench writes (:data:`SCHEMA`: bench,
  command, date, machine, versions, params, rows, notes), :func:`write_json` validates and writes
  it and says where, :func:`validate` lists every problem of a document;
* candidates: :func:`algorithm_families`, the algorithms to compare, from the registry;
* refusals: :func:`refuse` (exit status :data:`EXIT_CANNOT_MEASURE`, one line saying why),
  :func:`require_gpu`, :func:`require_world`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from importlib import metadata
from typing import Any

SCHEMA = "dtenjax.bench/1"
EXIT_CANNOT_MEASURE = 3      # the bench cannot measure on this machine (the message says why)
NCCL_COLUMNS = ("size", "count", "type", "time_us", "algbw", "busbw")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}


# --- sizes ---------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
  """``"8"``, ``"64K"``, ``"1M"``, ``"1.5G"`` -> bytes (K/M/G are powers of 1024)."""
  s = str(text).strip().upper().removesuffix("B")
  try:
    value = float(s[:-1]) * _UNITS[s[-1]] if s and s[-1] in _UNITS else float(s)
  except ValueError:
    raise ValueError(f"size {text!r} is not a number of bytes such as 8, 64K, 1M or 1.5G") from None
  if value < 1 or value != int(value):
    raise ValueError(f"size {text!r} must be a whole number of bytes >= 1")
  return int(value)


def format_size(nbytes: int) -> str:
  """8 -> "8 B", 65536 -> "64 KiB", 1.5 * 2**20 -> "1.5 MiB" (the inverse of parse_size)."""
  for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if nbytes >= factor:
      return f"{nbytes / factor:g} {unit}"
  return f"{nbytes} B"


def sizes_arg(text: str) -> list[int]:
  """argparse ``type=`` for a comma list of sizes (a bad one is argparse's one-line error)."""
  try:
    sizes = [parse_size(s) for s in text.split(",") if s.strip()]
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not sizes:
    raise argparse.ArgumentTypeError(f"{text!r} names no size; give e.g. 8,64K,1M")
  return sizes


def positive_int(text: str) -> int:
  """argparse ``type=`` for counts that must be >= 1 (chain lengths, iterations): the command
  line's own, so that ``dtenjax bench NAME --reps 0`` reads as ``dtenjax demo --steps 0``."""
  from dtenjax.testing import report
  return report.whole_number(1)(text)


# --- timing ----------------------------------------------------------------------------------------

def block(value: Any) -> Any:
  """Waits for every jax value in ``value`` (any pytree: a dict of gradients too) to be
  computed."""
  import jax
  for leaf in jax.tree.leaves(value):
    if hasattr(leaf, "block_until_ready"):
      leaf.block_until_ready()
  return value


def interleaved(fns: Mapping[Any, Callable[..., Any]], args: Sequence[Any] = (), *,
                warmup: int, iters: int) -> dict[Any, list[float]]:
  """Wall seconds of ``fn(*args)`` (until ready) per call, ``iters`` calls of each candidate
  timed round-robin after ``warmup`` untimed calls of each."""
  for f in fns.values():
    for _ in range(warmup):
      block(f(*args))
  samples: dict[Any, list[float]] = {k: [] for k in fns}
  for _ in range(iters):
    for k, f in fns.items():
      t0 = time.perf_counter()
      block(f(*args))
      samples[k].append(time.perf_counter() - t0)
  return samples


def median(xs: Iterable[float]) -> float:
  return statistics.median(list(xs))


# --- nccl-tests columns and ratios -----------------------------------------------------------------

def bus_factor(op: str, world: int) -> float:
  """nccl-tests' busbw / algbw for ``op`` over ``world`` ranks (1 for a single rank)."""
  if op not in _BUS_FACTOR:
    raise ValueError(f"unknown collective {op!r}; known: {sorted(_BUS_FACTOR)}")
  return _BUS_FACTOR[op](world) if world > 1 else 1.0


# A chain is "measured" only when it took clearly longer than the same chain without the ops:
# within this fraction of the empty chain's time the difference is timer and scheduling noise.
NOISE_FRACTION = 0.02


def per_op_seconds(chain_s: float, base_s: float, ops: int, *, what: str = "") -> float | None:
  """Seconds per op of a chain of ``ops`` ops timed at ``chain_s`` against the same chain
  without them at ``base_s``; None (and a note on stderr) when the difference is within the
  noise, so that no table prints an unmeasured row as a time and a ratio."""
  diff = chain_s - base_s
  if diff <= NOISE_FRACTION * base_s:
    print(f"# {what or 'a candidate'}: its chain of {ops} took {chain_s * 1e6:.1f} us against "
          f"{base_s * 1e6:.1f} us without the ops, within the noise: not reported (raise "
          "--chain or the size)", file=sys.stderr, flush=True)
    return None
  return diff / ops


def progress(items: Sequence[Any], what: str, label: Callable[[Any], str] = str):
  """``items``, reporting each step on stderr (:func:`steps`)."""
  items = list(items)
  with steps(what, len(items)) as step:
    for item in items:
      step(label(item))
      yield item


@contextlib.contextmanager
def steps(what: str, total: int):
  """Progress of ``total`` steps on stderr, for loops :func:`progress` does not fit (nested
  ones): ``with steps("checkpoint", n) as step:`` and ``step("1 GiB, dtenjax")`` as each step
  starts. On a terminal a rich progress bar (gone when the bench ends), in a log one line per
  step with the time so far, so that a long bench never looks hung; stdout keeps the tables."""
  t0, done = time.perf_counter(), [0]
  if sys.stderr.isatty():
    from rich.console import Console
    from rich.progress import Progress
    # the bar on stderr; prints to stdout go above it when stdout is the terminal too, and
    # straight to stdout (a pipe, a file) otherwise
    with Progress(console=Console(stderr=True), transient=True,
                  redirect_stdout=sys.stdout.isatty()) as bar:
      task = bar.add_task(what, total=total)

      def step(label: str) -> None:
        bar.update(task, completed=done[0], description=f"{what}: {label}")
        done[0] += 1
      yield step
    return

  def step(label: str) -> None:
    done[0] += 1
    print(f"# {what}: {label} ({done[0]} of {total}, {time.perf_counter() - t0:.0f} s so far)",
          file=sys.stderr, flush=True)
  yield step


def nccl_columns(nbytes: int, dtype: str, seconds: float, world: int,
                 op: str = "all_reduce") -> dict[str, Any]:
  """size (bytes per rank), count (elements), type, time_us, algbw and busbw (GB/s, 1e9 B/s)."""
  import jax.numpy as jnp
  itemsize = jnp.dtype(dtype).itemsize
  algbw = nbytes / seconds / 1e9
  return {"size": int(nbytes), "count": int(nbytes // itemsize), "type": str(dtype),
          "time_us": seconds * 1e6, "algbw": algbw, "busbw": algbw * bus_factor(op, world)}


def add_ratios(rows: list[dict], baseline: str, *, candidate: str = "algorithm",
               group: Sequence[str] = ("size",), time_key: str = "time_us",
               ratio_key: str = "ratio") -> list[dict]:
  """Sets ``row[ratio_key] = baseline's time / row's time`` within each group of rows (same
  values of ``group``); None where the group has no baseline row. Returns ``rows``."""
  base = {tuple(r[g] for g in group): r[time_key] for r in rows if r[candidate] == baseline}
  for r in rows:
    b = base.get(tuple(r[g] for g in group))
    r[ratio_key] = (b / r[time_key]) if b and r[time_key] else None
  return rows


def fmt_ratio(r: float | None) -> str:
  return "-" if r is None else f"{r:.2f}x"


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]],
          title: str | None = None) -> str:
  """Rows as text: ``columns`` are (header, key, format) with format a ``format()`` spec, or
  ``"ratio"`` for ``1.23x``. Text columns (format ``"s"``) are left-aligned, numbers right."""
  from dtenjax.testing import report

  def cell(v, f):
    if v is None:
      return "-"
    return fmt_ratio(v) if f == "ratio" else format(v, f)
  body = [[cell(r.get(key), f) for _, key, f in columns] for r in rows]
  return report.render_table([h for h, _, _ in columns], body, title=title,
                       align=["left" if f == "s" else "right" for _, _, f in columns])


NCCL_TABLE = (("size", "size", "d"), ("count", "count", "d"), ("type", "type", "s"))
NCCL_TAIL = (("time(us)", "time_us", ".1f"), ("algbw(GB/s)", "algbw", ".3f"),
             ("busbw(GB/s)", "busbw", ".3f"))


# --- refusals ------------------------------------------------------------------------------------

def wait_workers(procs: Sequence[Any], timeout_s: float, bench: str) -> None:
  """Waits for the worker processes a bench started, together at most ``timeout_s`` seconds, and
  kills the ones still running then; exits naming every worker's code when one failed."""
  deadline = time.monotonic() + timeout_s
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
      p.kill()
      codes.append(None)
  if any(c != 0 for c in codes):
    raise SystemExit(f"bench/{bench}.py: worker exit codes {codes} (None: killed after "
                     f"--timeout {timeout_s} s)")


def refuse(bench: str, why: str) -> None:
  """Ends the bench with one line on stderr saying why it cannot measure here."""
  print(f"{bench}: cannot measure here: {why}", file=sys.stderr)
  raise SystemExit(EXIT_CANNOT_MEASURE)


def require_gpu(bench: str, what: str) -> None:
  """Refuses unless jax's default backend is a GPU."""
  import jax
  backend = jax.default_backend()
  if backend != "gpu":
    refuse(bench, f"it needs a CUDA GPU ({what}), and jax's backend is {backend!r} "
           f"({len(jax.devices())} {backend} device(s)); run it on a GPU machine.")


def require_devices(bench: str, n: int) -> list:
  """jax's first ``n`` devices; refuses where fewer are present, naming the flag that simulates
  them on CPU."""
  import jax
  devices = jax.devices()
  if len(devices) < n:
    refuse(bench, f"needs {n} devices, found {len(devices)}; set "
           f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
  return devices[:n]


def require_world(bench: str, world: int, minimum: int = 2, how: str = "") -> None:
  """Refuses when fewer than ``minimum`` ranks take part (a collective of one rank moves
  nothing, so its times and ratios would describe no communication)."""
  if world < minimum:
    refuse(bench, f"a collective over {world} rank(s) moves no data; it needs at least "
           f"{minimum}. {how}".rstrip())


# --- what is compared ------------------------------------------------------------------------------

def algorithm_families() -> tuple[str, ...]:
  """The values of ``algorithm=`` besides "auto": the registry's families
  (``collectives/algorithms/registry.py``), read from it so a bench's list of candidates never
  falls behind the algorithms dtenjax has. Imports dtenjax (jax reads XLA_FLAGS later, when a
  backend starts)."""
  from dtenjax.testing import costmodel
  return costmodel.ALGORITHM_FAMILIES


# --- the JSON document -----------------------------------------------------------------------------

def _version(dist: str) -> str | None:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def versions() -> dict[str, str | None]:
  return {"python": platform.python_version(), "dtenjax": _version("dtenjax"),
          "jax": _version("jax"), "jaxlib": _version("jaxlib"), "numpy": _version("numpy"),
          "jax_cuda_plugin": _version("jax-cuda12-plugin") or _version("jax-cuda13-plugin"),
          "cuda_python": _version("cuda-python"), "nvidia_ml_py": _version("nvidia-ml-py")}


def machine(devices: Sequence[Any] | None = None) -> dict[str, Any]:
  """Host, OS, cores, load and (given jax devices) a summary of the devices."""
  m: dict[str, Any] = {"host": socket.gethostname(), "platform": platform.platform(),
                       "cpus": os.cpu_count(), "load_average": list(os.getloadavg())}
  if devices is not None:
    devices = list(devices)
    kinds: dict[str, int] = {}
    for d in devices:
      k = getattr(d, "device_kind", d.platform)
      kinds[k] = kinds.get(k, 0) + 1
    m["devices"] = {"backend": devices[0].platform if devices else None,
                    "count": len(devices), "kinds": kinds,
                    "processes": len({d.process_index for d in devices})}
  return m


def command(script: str, argv: Sequence[str]) -> str:
  """The command line that reruns this bench from the repository root."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rel = os.path.relpath(os.path.abspath(script), root)
  return shlex.join(["python", rel, *argv])


def document(bench: str, script: str, argv: Sequence[str], params: Mapping[str, Any],
             rows: Sequence[Mapping[str, Any]], *, devices: Sequence[Any] | None = None,
             kind: str = "collective", notes: Sequence[str] = (),
             machine_extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """The one JSON shape of bench/ (see :func:`validate`)."""
  return {
      "schema": SCHEMA, "bench": bench, "kind": kind,
      "command": command(script, argv), "argv": list(argv),
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "machine": {**machine(devices), **(machine_extra or {})}, "versions": versions(),
      "params": dict(params), "rows": [dict(r) for r in rows], "notes": list(notes),
  }


_TOP = {"schema": str, "bench": str, "kind": str, "command": str, "argv": list, "date": str,
        "machine": dict, "versions": dict, "params": dict, "rows": list, "notes": list}


def validate(doc: Any) -> list[str]:
  """Every way ``doc`` differs from :data:`SCHEMA` (an empty list when it conforms)."""
  if not isinstance(doc, dict):
    return [f"the document must be a JSON object, got {type(doc).__name__}"]
  problems = []
  if doc.get("schema") != SCHEMA:
    problems.append(f"schema is {doc.get('schema')!r}, expected {SCHEMA!r}")
  for k, t in _TOP.items():
    if k not in doc:
      problems.append(f"missing key {k!r}")
    elif not isinstance(doc[k], t):
      problems.append(f"{k!r} must be a {t.__name__}, got {type(doc[k]).__name__}")
  problems += [f"unknown key {k!r}" for k in sorted(set(doc) - set(_TOP))]
  if isinstance(doc.get("date"), str):
    try:
      datetime.datetime.strptime(doc["date"], "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
      problems.append(f"date {doc['date']!r} is not UTC ISO 8601 (YYYY-MM-DDTHH:MM:SSZ)")
  for k in ("host", "platform", "cpus"):
    if isinstance(doc.get("machine"), dict) and k not in doc["machine"]:
      problems.append(f"machine has no {k!r}")
  for k in ("python", "jax", "jaxlib", "dtenjax"):
    if isinstance(doc.get("versions"), dict) and k not in doc["versions"]:
      problems.append(f"versions has no {k!r}")
  rows = doc.get("rows") if isinstance(doc.get("rows"), list) else []
  for i, r in enumerate(rows):
    if not isinstance(r, dict):
      problems.append(f"rows[{i}] must be an object")
    elif doc.get("kind") == "collective":
      missing = [c for c in NCCL_COLUMNS if c not in r]
      if missing:
        problems.append(f"rows[{i}] lacks the nccl-tests columns {missing}")
    if len(problems) > 20:
      break
  if doc.get("kind") not in ("collective", "other"):
    problems.append(f"kind {doc.get('kind')!r} must be 'collective' or 'other'")
  return problems


def write_json(path: str, doc: Mapping[str, Any]) -> str:
  """Validates ``doc``, writes it to ``path`` and says where on stderr; returns the path."""
  problems = validate(doc)
  if problems:
    raise ValueError("bench result does not match " + SCHEMA + ": " + "; ".join(problems))
  path = os.path.abspath(path)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
  print(f"wrote {path}", file=sys.stderr)
  chart_next_to(path, doc)
  return path


def _series(rows: Sequence[Mapping[str, Any]]):
  """(x key, y key, y label, series key) of a result's chart, or None when it has none: busbw
  over the message size for collectives (nccl-tests' plot), GB/s over the size for checkpoints."""
  keys = set().union(*(r.keys() for r in rows)) if rows else set()
  name = next((k for k in ("algorithm", "candidate") if k in keys), None)
  if name and {"size", "busbw"} <= keys:
    return "size", "busbw", "busbw (GB/s)", lambda r: str(r[name])
  if name and {"size", "gbps", "op"} <= keys:
    return "size", "gbps", "GB/s", lambda r: f"{r[name]} {r['op']}"
  return None


RATIO_BAR = 1.05    # the planner's wins bar: the plan at most 1.05x the fastest recipe


def _ratio_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
  """The rows of a result that compare layouts per model family by their time over the fastest
  hand-written recipe's (bench/step_planner.py's wins part), else none."""
  return [r for r in rows if {"family", "layout"} <= r.keys()
          and isinstance(r.get("vs_best_recipe"), (int, float))]


def _draw_ratios(ax, rows: Sequence[Mapping[str, Any]]) -> None:
  """Grouped bars: one group per family, one bar per layout, the 1.05x bar as a dashed line."""
  families = list(dict.fromkeys(r["family"] for r in rows))
  layouts = list(dict.fromkeys(r["layout"] for r in rows))
  width = 0.8 / len(layouts)
  for i, layout in enumerate(layouts):
    ratio = {r["family"]: r["vs_best_recipe"] for r in rows if r["layout"] == layout}
    xs = [f + (i - (len(layouts) - 1) / 2) * width for f in range(len(families))]
    ax.bar(xs, [ratio.get(f, 0.0) for f in families], width, label=layout)
  ax.axhline(RATIO_BAR, color="black", linestyle="--", linewidth=0.8)
  ax.set_xticks(range(len(families)), families)
  ax.set_ylabel("step time / fastest hand-written recipe's")


def chart(doc: Mapping[str, Any], path: str) -> str | None:
  """A PNG chart of a bench result (matplotlib, the `plot` extra) at ``path``, titled with the
  machine: one line per candidate over the message size, or grouped bars of each layout's time
  over the fastest recipe's per model family; None when the result has neither."""
  rows = [r for r in doc.get("rows", []) if isinstance(r, Mapping)]
  series, ratios = _series(rows), _ratio_rows(rows)
  if series is None and not ratios:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4), dpi=80)
  if series is None:
    _draw_ratios(ax, ratios)
  else:
    xk, yk, ylabel, key = series
    for label in sorted({key(r) for r in rows}):
      pts = sorted((r[xk], r[yk]) for r in rows if key(r) == label and r.get(yk) is not None)
      ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes per rank" if yk == "busbw" else "bytes")
    ax.set_ylabel(ylabel)
  devices = (doc.get("machine") or {}).get("devices") or {}
  kinds = ", ".join(f"{n} x {k}" for k, n in (devices.get("kinds") or {}).items())
  ax.set_title(f"bench/{doc.get('bench')}.py, {str(doc.get('date', ''))[:10]}, "
               f"{kinds or devices.get('backend', '?')}, {devices.get('processes', '?')} "
               "process(es)", fontsize=9)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return os.path.abspath(path)


def chart_next_to(json_path: str, doc: Mapping[str, Any]) -> str | None:
  """The chart of ``doc`` as ``<json_path without .json>.png``, when matplotlib is installed."""
  try:
    import matplotlib  # noqa: F401  (is the plot extra installed?)
  except ImportError:
    print("# no chart: matplotlib is not installed (pip install 'dtenjax[plot]')",
          file=sys.stderr)
    return None
  out = chart(doc, os.path.splitext(json_path)[0] + ".png")
  if out:
    print(f"wrote {out}", file=sys.stderr)
  return out


def load(path: str) -> dict[str, Any]:
  """Reads a bench result and checks it against :data:`SCHEMA` (ValueError listing problems)."""
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  problems = validate(doc)
  if problems:
    raise ValueError(f"{path} is not a {SCHEMA} document: " + "; ".join(problems))
  return doc


if __name__ == "__main__":    # python bench/_harness.py chart RESULT.json OUT.png
  if len(sys.argv) != 4 or sys.argv[1] != "chart":
    sys.exit("usage: python bench/_harness.py chart RESULT.json OUT.png")
  written = chart(load(sys.argv[2]), sys.argv[3])
  sys.exit(0 if written else f"{sys.argv[2]}: its rows have no chart (no sizes)")
