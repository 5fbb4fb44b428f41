"""``dtenjax launch --nprocs N [--min-nprocs M] SCRIPT ARGS...``: an elastic JAX job on this
host."""

from __future__ import annotations

import argparse
import os
import re

from dtenjax._src.cli import common

HELP = "run a script as an elastic job of N processes that continues on fewer when one is lost"
DESCRIPTION = """Starts N processes of SCRIPT under jax.distributed (a coordinator on 127.0.0.1,
a free port), watches them (exits, and heartbeats through the coordination store), and when
processes are lost restarts the survivors as a smaller job (at least --min-nprocs) that continues
from the newest complete step: the in-memory tier (peers' replicas) when it holds one, else the
persistent checkpoint. The script uses dtenjax.elastic.init(), ctx.restore(state) and
ctx.step_done(step, state) (docs/elastic.md). At start it says what it can check about whether
the run keeps the same bits after a failure."""
EPILOG = """example: dtenjax launch --nprocs 4 --min-nprocs 2 --cpu-devices-per-proc 2
--reproducible train.py --steps 100"""


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--nprocs", type=common.whole_number(1), required=True, metavar="N",
                  help="processes to start")
  ap.add_argument("--min-nprocs", type=common.whole_number(1), metavar="M",
                  help="the smallest job to continue with (default N: no shrinking)")
  ap.add_argument("--max-restarts", type=common.whole_number(0), default=3, metavar="R",
                  help="restarts allowed in all (default 3)")
  ap.add_argument("--snapshot-every", type=common.whole_number(0), default=1, metavar="STEPS",
                  help="steps between in-memory snapshots (default 1; 0: none)")
  ap.add_argument("--checkpoint-dir", metavar="DIR",
                  help="the persistent tier: a CheckpointManager directory (default: none)")
  ap.add_argument("--checkpoint-every", type=common.whole_number(1), default=100, metavar="STEPS",
                  help="steps between persistent checkpoints (default 100)")
  # more than 0.2 s: the launcher's own floor (launcher.launch), checked here so that it is a
  # usage error like every other bad value
  ap.add_argument("--heartbeat-timeout", type=common.number_above(0.2), default=10.0,
                  metavar="S", help="seconds a silent process is waited for before it is lost "
                  "(default 10; more than 0.2)")
  ap.add_argument("--timeout", type=common.number_above(0), default=24 * 3600.0, metavar="S",
                  help="bound on the whole run (default one day)")
  ap.add_argument("--grow", action="store_true",
                  help="after a shrink, grow back to N processes at the next complete in-memory "
                  "snapshot (this host's slots are free again once the lost process is gone)")
  ap.add_argument("--run-dir", metavar="DIR",
                  help="where the logs (g<generation>.r<rank>.log) and events go (default: a "
                  "new temporary directory)")
  ap.add_argument("--cpu-devices-per-proc", type=common.whole_number(1), metavar="D",
                  help="simulated CPU devices per process (XLA_FLAGS; default: as XLA_FLAGS says)")
  ap.add_argument("--reproducible", action="store_true",
                  help="add the process settings reproducible steps need on CPU "
                  "(--xla_cpu_max_isa=AVX in XLA_FLAGS)")
  ap.add_argument("script", metavar="SCRIPT", help="the Python script every process runs")
  ap.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                  help="the script's arguments")


def run(args: argparse.Namespace) -> int:
  if not os.path.isfile(args.script):
    raise common.UsageError(f"SCRIPT {args.script!r} is not a file")
  flags = os.environ.get("XLA_FLAGS", "")
  if args.min_nprocs is not None and args.min_nprocs > args.nprocs:
    raise common.UsageError(f"--min-nprocs {args.min_nprocs}: more than --nprocs "
                            f"{args.nprocs}; give at most {args.nprocs}")
  # after the usage checks: the launcher imports jax (its in-memory tier), 1.3 s of CPU that a
  # mistyped command line need not wait for
  from dtenjax._src.elastic import launcher
  if args.cpu_devices_per_proc is not None:
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    flags += f" --xla_force_host_platform_device_count={args.cpu_devices_per_proc}"
  if args.reproducible and "--xla_cpu_max_isa=" not in flags:
    flags += " --xla_cpu_max_isa=AVX"
  env = {"XLA_FLAGS": flags.strip()}
  argv = [args.script, *args.script_args]
  for ok, finding in launcher.qualification(argv, env):
    print(f"dtenjax launch: {'ok ' if ok else 'NO '} {finding}")
  print("dtenjax launch: the batch of a step must depend only on the step number and the step "
        "must not depend on the device count otherwise (docs/elastic.md): not checked")
  result = launcher.launch(
      argv, args.nprocs, min_nprocs=args.min_nprocs, max_restarts=args.max_restarts,
      env=env, run_dir=args.run_dir, snapshot_every=args.snapshot_every,
      checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
      heartbeat_timeout_s=args.heartbeat_timeout, timeout_s=args.timeout,
      capacity=(lambda: args.nprocs) if args.grow else None)
  print(result.summary())
  print(f"logs and events: {result.run_dir}")
  return result.code
