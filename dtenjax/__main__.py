"""``python -m dtenjax {demo,topo,explain,bench,info}``.

Without an accelerator, dtenjax's command line runs on 8 simulated CPU devices (set before JAX
starts); with GPUs it uses them.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

USAGE = """usage: python -m dtenjax COMMAND [ARGS]

commands:
  demo                 train an auto-placed MLP on digits, print plan + explain, check determinism
  topo [--fixture N]   print the link matrix of this machine (or a fixture) with bandwidths used
  explain [MODULE:FUNCTION --shape-args SPEC | --args MODULE:FACTORY]
                       compile a step (default: the demo's training step) and list its
                       collectives, device groups, bytes and memory; explain --help for more
  bench NAME [ARGS]    run bench/NAME.py (allreduce, transport, planner, ...) from a source
                       checkout; its arguments and exit status pass through unchanged
  info                 build information of the native extension
"""


def _simulated_devices() -> None:
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


def _bench(rest: list[str]) -> int:
  """Runs bench/NAME.py in a child Python with the remaining arguments; returns its status."""
  if not rest or rest[0] in ("-h", "--help"):
    print("usage: python -m dtenjax bench NAME [ARGS]   (ARGS go to bench/NAME.py; "
          "python -m dtenjax bench NAME --help shows them)", file=sys.stdout if rest else sys.stderr)
    return 0 if rest else 2
  root = pathlib.Path(__file__).resolve().parent.parent
  bench_dir = root / "bench"
  script = bench_dir / f"{rest[0]}.py"
  if not script.is_file():
    names = sorted(p.stem for p in bench_dir.glob("*.py")) if bench_dir.exists() else []
    print(f"no benchmark {rest[0]!r} in {bench_dir} (available: {names}); benchmarks run "
          "from a source checkout of dtenjax.", file=sys.stderr)
    return 2
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
      [str(root)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  proc = subprocess.Popen([sys.executable, str(script), *rest[1:]], env=env)
  try:
    rc = proc.wait()
  except KeyboardInterrupt:      # the child got the same SIGINT; wait for it to finish
    rc = proc.wait()
  # A child killed by a signal reports -N; a shell reports 128 + N.
  return 128 - rc if rc < 0 else rc


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
    from dtenjax._src.cli import explain  # pylint: disable=g-import-not-at-top
    return explain.main(rest)
  if cmd == "info":
    from dtenjax._src import ffi  # pylint: disable=g-import-not-at-top
    import json  # pylint: disable=g-import-not-at-top
    print(json.dumps(ffi.build_info(), indent=1, default=str))
    return 0
  if cmd == "bench":
    return _bench(rest)
  print(f"unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
  return 2


if __name__ == "__main__":
  sys.exit(main())
