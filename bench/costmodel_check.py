"""The cost model's predicted all-reduce times next to measured ones (issue 11: within 2x).

  python bench/costmodel_check.py RESULTS.json [--topology FILE.json | --fixture NAME | --intra nvlink]

RESULTS.json is what ``bench/allreduce.py --json`` wrote (bench/_harness.py's schema, checked on
reading). Each row's candidate is mapped to the cost-model formula that ``algorithm="auto"``
would rank it with (psum -> xla; on GPU one_shot / two_shot -> nvlink_one_shot /
nvlink_two_shot), and the prediction for that size and world is
printed next to the measured per-op time, with predicted/measured. The topology is a saved
``python -m dtenjax topo --probe --save FILE`` (measured links), a fixture, or by default a
uniform one of the run's world size whose devices are joined by ``--intra`` (table link specs).
Prints the table last and exits 1 if any ratio falls outside [0.5, 2].
"""

from __future__ import annotations

import argparse
import sys

import _harness

FORMULA = {"psum": "xla", "psum_nccl": "xla", "xla": "xla", "ring": "ring",
           "hierarchical": "hierarchical"}
GPU_FORMULA = {"one_shot": "nvlink_one_shot", "two_shot": "nvlink_two_shot"}
CPU_FORMULA = {"one_shot": "one_shot", "two_shot": "two_shot"}


def _topology(args, world: int, platform: str):
  import dtenjax
  from dtenjax.testing import costmodel
  if args.topology:
    return dtenjax.Topology.from_json(args.topology)
  if args.fixture:
    return dtenjax.Topology.fixture(args.fixture)
  devices = [costmodel.DeviceInfo(id=i, platform=platform,
                                  kind="NVIDIA H200" if platform == "gpu" else "cpu",
                                  memory_bytes=0, process_index=0, host="h", local_index=i)
             for i in range(world)]
  return costmodel.uniform_topology(f"uniform-{args.intra}-{world}", devices, intra=args.intra)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="bench/costmodel_check.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("results")
  src = p.add_mutually_exclusive_group()
  src.add_argument("--topology", metavar="FILE.json")
  src.add_argument("--fixture", metavar="NAME")
  p.add_argument("--intra", default="nvlink", help="link class of the default uniform topology")
  args = p.parse_args(argv)
  from dtenjax.testing import costmodel
  try:
    data = _harness.load(args.results)
  except (OSError, ValueError) as e:
    p.error(str(e))
  if data["bench"] != "allreduce":
    p.error(f"{args.results} holds bench/{data['bench']}.py results; this check reads "
            "bench/allreduce.py --json output")
  rows = data["rows"]
  out, bad = [], 0
  for r in rows:
    platform = "gpu" if r["backend"] == "gpu" else "cpu"
    formula = FORMULA.get(r["algorithm"]) or (GPU_FORMULA if platform == "gpu"
                                               else CPU_FORMULA).get(r["algorithm"])
    if formula is None:
      continue
    topology = _topology(args, r["world"], platform)
    # hierarchical's two levels are the call's axes: bench/allreduce.py's 2-D mesh (2, world / 2)
    itemsize = 4 if r["type"] == "float32" else 2
    # a dtenjax algorithm sums 16-bit floats in float32 (each formula puts the float32 partial
    # sums where its program sends them); lax.psum is XLA's all-reduce of the input's dtype
    carried = 1 if r["algorithm"] in ("psum", "psum_nccl") else 4 / itemsize
    pred = costmodel.collective_time("all_reduce", r["size"], list(range(r["world"])), topology,
                                     costmodel.algorithm(formula).cost, itemsize=itemsize,
                                     inner=r["world"] // 2 if formula == "hierarchical" else None,
                                     carried=carried)
    ratio = pred / (r["time_us"] * 1e-6)
    bad += not 0.5 <= ratio <= 2.0
    out.append(dict(size=r["size"], candidate=r["algorithm"], formula=formula,
                    measured=r["time_us"], predicted=pred * 1e6, ratio=ratio))
  print(_harness.table(out, (("size", "size", "d"), ("candidate", "candidate", "s"),
                             ("formula", "formula", "s"), ("meas(us)", "measured", ".1f"),
                             ("pred(us)", "predicted", ".1f"), ("pred/meas", "ratio", ".2f"))))
  print(f"# {len(out) - bad} of {len(out)} predictions within 2x of the measurement")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
