"""Planner benchmark: plans a 1000-leaf, transformer-like pytree with Placement("auto").

For each topology (the 8 x A100 NVLink fixture and the detected CPU topology) it times resolving
every leaf to a NamedSharding (mesh, planner, divisibility check), first with every dtenjax cache
cleared and a fresh Topology object (cold), then again (warm, median of --repeats), in wall time
and in this process's CPU time (the latter barely moves when other work shares the machine). Leaves are
``jax.ShapeDtypeStruct``s, so only planning is timed, not data movement. The issue's target is
< 50 ms for 1000 leaves.

Run:  .venv/bin/python bench/planner.py [--leaves 1000] [--repeats 5] [--json PATH]
      .venv/bin/python bench/planner.py --explain   # the fixtures' candidate tables
      .venv/bin/python bench/planner.py --update-docs   # rewrite them into docs/planner.md

docs/planner.md quotes the ``--explain`` output between two marker lines;
tests/test_bench_planner.py fails when the quote and the command's output differ.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp

import _harness
import dtenjax
from dtenjax import Placement, Topology
from dtenjax.testing import planning


def transformer_params(n_leaves: int, d: int = 1024, vocab: int = 32768) -> dict:
  """A pytree shaped like a decoder's parameters: embedding, per-layer attention / MLP kernels,
  biases and layer-norm vectors, in bf16/f32, trimmed to exactly ``n_leaves`` leaves."""
  sds = jax.ShapeDtypeStruct
  tree = {"embed": sds((vocab, d), jnp.bfloat16), "final_ln": sds((d,), jnp.float32)}
  layer = 0
  while sum(len(v) if isinstance(v, dict) else 1 for v in tree.values()) < n_leaves:
    tree[f"layer_{layer:03d}"] = {
        "q": sds((d, d), jnp.bfloat16), "k": sds((d, d // 4), jnp.bfloat16),
        "v": sds((d, d // 4), jnp.bfloat16), "o": sds((d, d), jnp.bfloat16),
        "q_bias": sds((d,), jnp.float32), "o_bias": sds((d,), jnp.float32),
        "up": sds((d, 4 * d), jnp.bfloat16), "gate": sds((d, 4 * d), jnp.bfloat16),
        "down": sds((4 * d, d), jnp.bfloat16), "ln1": sds((d,), jnp.float32),
        "ln2": sds((d,), jnp.float32), "rope": sds((64, d // 16), jnp.float32),
    }
    layer += 1
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(jax.tree.structure(leaves[:n_leaves]), leaves[:n_leaves]) \
      if len(leaves) > n_leaves else jax.tree.unflatten(treedef, leaves)


def plan_tree(tree, placement):
  return jax.tree.map(lambda leaf: placement.sharding(leaf.shape, leaf.dtype), tree)


def run(name: str, make_topology, tree, repeats: int) -> dict:
  n = len(jax.tree.leaves(tree))
  planning.clear_planner_caches()
  topo = make_topology()
  p = Placement("auto", mesh=(2, 4), topology=topo)
  t0, c0 = time.perf_counter(), time.process_time()
  shardings = plan_tree(tree, p)
  cold, cold_cpu = time.perf_counter() - t0, time.process_time() - c0
  warm, warm_cpu = [], []
  for _ in range(repeats):
    t0, c0 = time.perf_counter(), time.process_time()
    plan_tree(tree, p)
    warm.append(time.perf_counter() - t0)
    warm_cpu.append(time.process_time() - c0)
  counts: dict[str, int] = {}
  for s in jax.tree.leaves(shardings, is_leaf=lambda x: hasattr(x, "spec")):
    counts[str(s.spec)] = counts.get(str(s.spec), 0) + 1
  return {"topology": name, "leaves": n, "cold_ms": cold * 1e3,
          "warm_ms": statistics.median(warm) * 1e3, "cold_cpu_ms": cold_cpu * 1e3,
          "warm_cpu_ms": statistics.median(warm_cpu) * 1e3, "specs": counts,
          "distinct_plans": planning.distinct_plans()}


FIXTURE_MESHES = (("dgx_a100_8", (2, 4), ("x", "y")), ("roce_a100_4x8", (4, 8), ("host", "gpu")),
                  ("h200_8", (2, 4), ("x", "y")), ("pcie_8", (2, 4), ("x", "y")))


def explain_fixtures(shape=(4096, 4096), dtype="bfloat16", markdown: bool = True) -> str:
  """The planner's candidate table for ``shape`` on every topology fixture (default Workload),
  the fixture's devices laid out as make_mesh orders them: Markdown for docs/planner.md, or
  plain text (``markdown=False``, what ``--explain`` prints on a terminal)."""
  import numpy as np
  out = []
  for name, mesh_shape, names in FIXTURE_MESHES:
    topo = Topology.fixture(name)
    ids = np.array(sorted(topo.device_ids, key=topo.hierarchy_key)).reshape(mesh_shape)
    plan = planning.plan_tensor(shape, dtype, mesh_shape, names, ids, topo)
    title = f"{name}, mesh {dict(zip(names, mesh_shape))}"
    out.append(f"### {title}\n\n```text\n{plan.table()}\n```" if markdown else
               f"{title}\n{'-' * len(title)}\n{plan.table()}")
  return "\n\n".join(out)


DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "planner.md"
BEGIN = "<!-- begin: output of python bench/planner.py --explain (do not edit by hand) -->"
END = "<!-- end: output of python bench/planner.py --explain -->"


def docs_quote(text: str) -> str:
  """The part of docs/planner.md between the BEGIN and END marker lines."""
  try:
    head, rest = text.split(BEGIN + "\n", 1)
    quote, _ = rest.split("\n" + END, 1)
  except ValueError:
    raise SystemExit(f"{DOCS} lacks the marker lines {BEGIN!r} and {END!r}") from None
  del head
  return quote


def update_docs(path: pathlib.Path = DOCS) -> bool:
  """Rewrites the quote in ``path`` from explain_fixtures(); returns whether it changed."""
  text = path.read_text(encoding="utf-8")
  old = docs_quote(text)
  new = explain_fixtures()
  if old == new:
    return False
  path.write_text(text.replace(BEGIN + "\n" + old + "\n" + END, BEGIN + "\n" + new + "\n" + END),
                  encoding="utf-8")
  return True


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="bench/planner.py", description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--leaves", type=_harness.positive_int, default=1000)
  ap.add_argument("--repeats", type=_harness.positive_int, default=5)
  ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
  mode = ap.add_mutually_exclusive_group()
  mode.add_argument("--explain", action="store_true",
                    help="print the candidate table of a 4096 x 4096 bf16 weight on each fixture "
                    "(as plain text; --markdown: as docs/planner.md quotes it)")
  ap.add_argument("--markdown", action="store_true",
                  help="with --explain: Markdown headings and fences")
  mode.add_argument("--update-docs", action="store_true",
                    help="rewrite the --explain tables quoted in docs/planner.md")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = ap.parse_args(argv)
  # The tables are those of a GPU user who followed the docs (dtenjax.pin_nccl(): NVLink SHARP
  # off); without it deterministic all-reduces cannot use XLA's collective and are priced higher.
  dtenjax.pin_nccl()
  if args.explain:
    print(explain_fixtures(markdown=args.markdown))
    return 0
  if args.update_docs:
    print(f"{DOCS}: " + ("updated" if update_docs() else "already up to date"))
    return 0
  tree = transformer_params(args.leaves)
  cases = [("dgx_a100_8 (fixture)", lambda: Topology.fixture("dgx_a100_8")),
           ("detected CPU x8", lambda: Topology.detect(jax.devices()))]
  rows = [run(name, make, tree, args.repeats)
          for name, make in _harness.progress(cases, "planner", lambda case: case[0])]
  if args.json:
    _harness.write_json(args.json, _harness.document(
        "planner", __file__, argv, {"leaves": args.leaves, "repeats": args.repeats,
                                    "target_ms": 50}, rows, kind="other",
        devices=jax.devices()))
  for r in rows:
    print(f"  {r['topology']}: {r['specs']}")
  print(_harness.table(rows, (("topology", "topology", "s"), ("leaves", "leaves", "d"),
                              ("plans", "distinct_plans", "d"), ("cold ms", "cold_ms", ".2f"),
                              ("cold cpu ms", "cold_cpu_ms", ".2f"), ("warm ms", "warm_ms", ".2f"),
                              ("warm cpu ms", "warm_cpu_ms", ".2f"))))
  return 0


if __name__ == "__main__":
  sys.exit(main())
