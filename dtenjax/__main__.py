"""``python -m dtenjax {demo,topo,explain,bench,info}``.

Without an accelerator, dtenjax's command line runs on 8 simulated CPU devices (set before JAX
starts); with GPUs it uses them.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys

USAGE = """usage: python -m dtenjax COMMAND [ARGS]

commands:
  demo                 train an auto-placed MLP on digits, print plan + explain, check determinism
  topo [--fixture N]   print the link matrix of this machine (or a fixture) with bandwidths used
  explain              compile the demo's training step and list its collectives and memory
  bench NAME [ARGS]    run bench/NAME.py (allreduce, transport, planner, ...) from a source checkout
  info                 build information of the native extension
"""


def _simulated_devices() -> None:
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help"):
    print(USAGE)
    return 0
  _simulated_devices()
  cmd, rest = argv[0], argv[1:]
  if cmd == "demo":
    from dtenjax._src.cli import demo  # pylint: disable=g-import-not-at-top
    return demo.main(rest)
  if cmd == "topo":
    from dtenjax._src.topology import report as topology_report  # pylint: disable=g-import-not-at-top
    return topology_report.main(rest) or 0
  if cmd == "explain":
    from dtenjax._src.cli import demo  # pylint: disable=g-import-not-at-top
    return demo.main(["--steps", "1", "--no-progress"] + rest)
  if cmd == "info":
    from dtenjax._src import ffi  # pylint: disable=g-import-not-at-top
    import json  # pylint: disable=g-import-not-at-top
    print(json.dumps(ffi.build_info(), indent=1, default=str))
    return 0
  if cmd == "bench":
    if not rest:
      print("usage: python -m dtenjax bench NAME [ARGS]", file=sys.stderr)
      return 2
    bench_dir = pathlib.Path(__file__).resolve().parent.parent / "bench"
    script = bench_dir / f"{rest[0]}.py"
    if not script.exists():
      names = sorted(p.stem for p in bench_dir.glob("*.py")) if bench_dir.exists() else []
      print(f"no benchmark {rest[0]!r} in {bench_dir} (available: {names}); benchmarks run "
            "from a source checkout of dtenjax.", file=sys.stderr)
      return 2
    sys.argv = [str(script)] + rest[1:]
    runpy.run_path(str(script), run_name="__main__")
    return 0
  print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
