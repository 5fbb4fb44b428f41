"""The main job, ``python -m dtenjax demo``: auto-placed MLP training on scikit-learn's digits.

On 8 simulated CPU devices (or the GPUs present) it builds a small MLP, lets the planner place
every parameter over a mesh (``Placement(strategy="auto")``), prints the plan, trains a few
hundred data-parallel steps with a progress bar, prints ``explain()`` of the step, and trains again
from the same seed to show that the two runs' losses are bit-identical.

The step is data parallel over every device: parameters and optimizer state stay where the
planner put them, the step gathers the parameters, each device takes the gradient of each of its
micro-batches (a fixed split of the global batch into :data:`MICRO_BATCHES`, whatever the device
count), and ``dtenjax.all_reduce(..., reproducible=True, local_axis=0)`` sums them in fixed
point: the sum's bits do not depend on how the micro-batches are spread over devices. Whether the
losses are then the same on 1, 2, 4 or 8 devices depends on one more thing, which the demo checks
on the machine it runs on (:func:`microbatch_invariance`): that each micro-batch's gradient has the
same bits whether a device computes 8, 4, 2 or 1 of them. On a GPU the step is compiled with
``dtenjax.reproducible_step``'s pins (deterministic ops, no autotuning), without which two fresh
processes can compile different kernels and print different digests. The printed
``losses sha256`` lets you compare runs, processes and ``XLA_FLAGS``.

The losses themselves are bit-identical on 1, 2, 4 and 8 CPU devices: the step is compiled with
``reproducible_step``'s pins, and the demo starts XLA:CPU without fused multiply-adds
(``--xla_cpu_max_isa=AVX``, added to ``XLA_FLAGS`` when JAX has not started yet and the flag is
not set), without which the optimizer's update contracts ``a * b + c`` differently in each device
count's program (docs/reproducibility.md). The first line says which promise holds in the
process at hand.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from dtenjax._src import errors
from dtenjax._src.cli import common

if TYPE_CHECKING:
  from dtenjax._src.planning.placement import Placement

# jax and the layers below the command line are imported inside the functions that use them, so
# that building the command line's parser (``dtenjax --help``, ``--version``) imports no jax.


def load_digits(seed: int = 0):
  try:
    from sklearn.datasets import load_digits as _load
  except ImportError:
    raise errors.ConfigurationError(
        "the demo trains on scikit-learn's digits dataset, and scikit-learn is not installed: "
        "pip install 'dtenjax[demo]' (or run bash scripts/demo.sh, which sets everything up)."
    ) from None
  x, y = _load(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(x))
  x, y = x[order], y[order].astype(np.int32)
  split = int(0.8 * len(x))
  return (x[:split], y[:split]), (x[split:], y[split:])


def mesh_shape_for(n: int) -> tuple[int, int]:
  """(outer, inner) with inner as large as possible but at most 4 (2 x 4 on 8 devices)."""
  inner = max(d for d in (1, 2, 4) if n % d == 0)
  return n // inner, inner


def init_params(key, sizes=(64, 256, 256, 10)):
  """He-initialised weights (``jax.random.normal`` of each split of ``key``) and zero biases."""
  import jax
  import jax.numpy as jnp
  params = {}
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    # Drawn flat, then shaped: the values of jax.random.normal(sub, (a, b)), bit for bit (it
    # counts the elements in row-major order), and XLA:CPU compiled the (256, 10) draw in 2.2 s
    # of CPU, the flat one in 0.3 s (a minor dimension of 8 or 16 compiled as quickly as flat).
    w = jax.random.normal(sub, (a * b,), jnp.float32).reshape(a, b)
    params[f"w{i}"] = w * np.float32(np.sqrt(2.0 / a))
    params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
  return params


def forward(params, x):
  import jax
  n = len(params) // 2
  for i in range(n):
    x = x @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      x = jax.nn.relu(x)
  return x


def loss_fn(params, x, y):
  import jax
  import jax.numpy as jnp
  logits = forward(params, x)
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


MICRO_BATCHES = 8


def make_grads(mesh):
  """``grads_of(params, x, y) -> (loss, grads)``: the step's mean loss and reproducibly
  all-reduced gradients over every axis of ``mesh`` (see the module docstring)."""
  import jax
  from jax.sharding import PartitionSpec as P

  from dtenjax._src.collectives import all_reduce as collectives
  from dtenjax._src.compression.error_feedback import pvary

  axes = tuple(mesh.axis_names)

  def local_grads(params, xb, yb):
    # params come in replicated (P()); typed as varying, each device's gradient is its own (under
    # shard_map's default check_vma=True, jax.grad would otherwise sum it over the devices)
    params = pvary(params, axes)
    # xb: [k, m, features], this device's k micro-batches; one gradient per micro-batch
    losses, grads = jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(params, *b), (xb, yb))
    grads = collectives.all_reduce(grads, axes, op="mean", reproducible=True, local_axis=0)
    loss = collectives.all_reduce(losses, axes, op="mean", reproducible=True, local_axis=0)
    return loss, grads

  return jax.shard_map(local_grads, mesh=mesh, in_specs=(P(), P(axes), P(axes)),
                       out_specs=(P(), P()))


def make_step(lr: float, mesh):
  """The jitted data-parallel step over every axis of ``mesh`` (see the module docstring)."""
  import optax
  opt = optax.adam(lr)
  grads_of = make_grads(mesh)

  def step(params, opt_state, x, y):
    loss, grads = grads_of(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return opt, step


def step_jit(step, backend: str | None = None):
  """How the demo compiles its step: with ``reproducible_step``'s pins (GPU: run-to-run bits;
  CPU: no fast math, and with the FMA-free ISA the same bits on every device count). The
  process check is reproducible_step's on GPU (NCCL_NVLS_ENABLE with several GPUs), the demo's
  own on CPU (:func:`same_bits_across_device_counts` says what holds)."""
  import jax

  from dtenjax._src.planning import reproducible

  on_gpu = (backend or jax.default_backend()) == "gpu"
  return reproducible.reproducible_step(step, donate_argnums=(0, 1), check_flags=on_gpu)


def start_without_fma() -> None:
  """Adds ``--xla_cpu_max_isa=AVX`` to ``XLA_FLAGS`` when JAX has not started its backends yet
  and no ISA is chosen: XLA:CPU then emits no fused multiply-adds, so each device count's program
  rounds the optimizer's update alike. Only XLA:CPU reads the flag."""
  from dtenjax._src import jaxapi
  from dtenjax._src.planning import reproducible

  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_max_isa" not in flags and not jaxapi.backends_started():
    os.environ["XLA_FLAGS"] = (flags + " " + reproducible.PROCESS_FLAGS["cpu"][0]).strip()


def same_bits_across_device_counts(platform: str) -> tuple[bool, str]:
  """(whether the demo's losses are bit-identical on 1, 2, 4 and 8 devices here, why)."""
  from dtenjax._src.planning import reproducible

  if platform != "cpu":
    return False, ("losses compared bit for bit across runs; across device counts the "
                   "all-reduced gradients are reproducible, the losses are checked on CPU only")
  missing = reproducible.missing_process_flags("cpu")
  if missing:
    return False, (f"losses compared bit for bit across runs; across device counts to float32 "
                   f"rounding only: this process has XLA:CPU's FMAs (XLA_FLAGS lacks "
                   f"{' '.join(missing)})")
  return True, ("losses bit-identical on 1, 2, 4 and 8 devices (reproducible all-reduce, "
                "reproducible_step's pins, XLA:CPU without FMA)")


def microbatch_invariance(params, xb, yb, counts=(8, 4, 2, 1)) -> dict[int, str]:
  """{micro-batches per device: digest of the per-micro-batch losses and gradients}, computed on
  one device as a device of an ``8 // k``-device mesh computes its share (``lax.map`` over ``k``
  micro-batches, the step's own loop and function), for each ``k`` in ``counts``. Equal digests
  mean that what the reproducible all-reduce sums does not depend on the device count here."""
  import jax

  from dtenjax._src.planning import reproducible

  def grads(p, x, y):
    return jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(p, *b), (x, y))

  pinned = reproducible.gpu_options() if jax.default_backend() == "gpu" else None
  out = {}
  for k in counts:
    f = jax.jit(grads, compiler_options=pinned)
    parts = [f(params, xb[i:i + k], yb[i:i + k]) for i in range(0, xb.shape[0], k)]
    h = hashlib.sha256()
    for leaves in zip(*(jax.tree.leaves(part) for part in parts)):   # leaf by leaf, in order
      h.update(np.ascontiguousarray(np.concatenate([np.asarray(v) for v in leaves])).tobytes())
    out[k] = h.hexdigest()[:16]
  return out


def train(steps: int, batch: int, placement: Placement, data, seed: int = 0,
          progress: bool = True, lr: float = 3e-3, jit=None):
  import jax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from dtenjax._src.planning.placement import shard

  (xtr, ytr), _ = data
  mesh = placement.resolved_mesh()
  axes = tuple(mesh.axis_names)
  if MICRO_BATCHES % mesh.size or batch % MICRO_BATCHES:
    raise errors.ConfigurationError(
        f"the demo splits --batch {batch} into {MICRO_BATCHES} micro-batches over "
        f"{mesh.size} devices; use a batch divisible by {MICRO_BATCHES} and 1, 2, 4 or 8 devices")
  batch_sharding = NamedSharding(mesh, P(axes))     # micro-batches over every device
  opt, step = make_step(lr, mesh)
  params = shard(init_params(jax.random.key(seed)), placement)
  opt_state = shard(opt.init(params), placement)
  jstep = (jit or step_jit)(step)
  rng = np.random.default_rng(seed)
  losses = np.zeros(steps, np.float32)
  bar = None
  if progress and sys.stderr.isatty():   # on the terminal's stderr; nothing in a log or a pipe
    from rich.console import Console
    from rich.progress import Progress
    bar = Progress(console=Console(stderr=True), transient=False,
                   redirect_stdout=sys.stdout.isatty())
    task = bar.add_task(f"training seed={seed}", total=steps)
    bar.start()
  micro = batch // MICRO_BATCHES
  try:
    for i in range(steps):
      idx = rng.integers(0, len(xtr), batch)
      x = jax.device_put(xtr[idx].reshape(MICRO_BATCHES, micro, -1), batch_sharding)
      y = jax.device_put(ytr[idx].reshape(MICRO_BATCHES, micro), batch_sharding)
      params, opt_state, loss = jstep(params, opt_state, x, y)
      losses[i] = loss
      if bar is not None:
        bar.update(task, advance=1, description=f"training seed={seed} loss={float(loss):.4f}")
  finally:
    if bar is not None:
      bar.stop()
  return params, losses, jstep, (params, opt_state, x, y)


def losses_digest(losses: np.ndarray) -> str:
  """sha256 of the losses' bits (compare runs with different device counts)."""
  return hashlib.sha256(np.ascontiguousarray(losses, np.float32).tobytes()).hexdigest()[:16]


def accuracy(params, data) -> float:
  import jax.numpy as jnp

  _, (xte, yte) = data
  pred = np.asarray(jnp.argmax(forward(params, jnp.asarray(xte)), axis=-1))
  return float(np.mean(pred == yte))


HELP = "train an auto-placed MLP on digits, print plan + explain, check determinism"
DESCRIPTION = __doc__
EXTRA = "demo"      # scikit-learn's digits and optax: checked before run() (cli/main.py)


def _batch(text: str) -> int:
  v = common.whole_number(1)(text)
  if v % MICRO_BATCHES:
    raise argparse.ArgumentTypeError(
        f"{v} does not split into {MICRO_BATCHES} equal micro-batches; use a multiple of "
        f"{MICRO_BATCHES} such as {max(MICRO_BATCHES, v - v % MICRO_BATCHES)}")
  return v


def add_arguments(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--steps", type=common.whole_number(1), default=300,
                  help="training steps (>= 1)")
  ap.add_argument("--batch", type=_batch, default=128,
                  help=f"global batch, a multiple of {MICRO_BATCHES} (the micro-batch split)")
  ap.add_argument("--seed", type=common.whole_number(0), default=0)
  ap.add_argument("--no-progress", action="store_true",
                  help="no progress bar (there is none when stderr is not a terminal)")


def main(argv=None) -> int:
  """``demo`` on its own (the command line goes through dtenjax._src.cli.main)."""
  ap = argparse.ArgumentParser(prog="dtenjax demo", description=__doc__)
  add_arguments(ap)
  return run(ap.parse_args(argv))


def run(args: argparse.Namespace) -> int:
  import jax
  import jax.numpy as jnp

  from dtenjax._src import tables
  from dtenjax._src.planning import explain as explain_lib
  from dtenjax._src.planning import mesh as mesh_lib
  from dtenjax._src.planning import reproducible
  from dtenjax._src.planning.placement import Placement
  from dtenjax._src.topology.model import Topology

  common.line_buffered_stdout()   # a log shows each section when it is done (training: seconds)
  t0 = time.perf_counter()
  start_without_fma()
  devices = jax.devices()
  topology = Topology.current()
  shape = mesh_shape_for(len(devices))
  mesh = mesh_lib.make_mesh(shape, ("data", "model"), topology=topology)
  placement = Placement(strategy="auto", mesh=mesh)
  _, compared = same_bits_across_device_counts(devices[0].platform)
  print(f"dtenjax demo: {len(devices)} {devices[0].platform} device(s), mesh "
        f"{dict(mesh.shape)}, topology {topology.name}; {compared}")
  print("\n== plan: Placement(strategy='auto') for every parameter ==")
  rows = []
  for name, p in sorted(init_params(jax.random.key(0)).items()):
    plan = placement.plan(p.shape, p.dtype)
    best = next(c for c in plan.candidates if c.strategy == plan.strategy)
    rows.append((name, str(p.shape), plan.strategy, str(plan.spec),
                 f"{best.time_s * 1e6:.1f}", plan.reason))
  print(tables.render(["param", "shape", "strategy", "spec", "est. (us)", "why"], rows,
                      align=["left"] * 4 + ["right", "left"]))
  w = init_params(jax.random.key(0))["w1"]
  print("\n" + placement.explain(w.shape, w.dtype))

  data = load_digits(args.seed)
  print(f"\n== training: {args.steps} steps, global batch {args.batch}, digits "
        f"({len(data[0][0])} train / {len(data[1][0])} test) ==")
  params, losses1, jstep, example = train(args.steps, args.batch, placement, data, args.seed,
                                          progress=not args.no_progress)
  print(f"loss {losses1[0]:.4f} -> {losses1[-1]:.4f}; test accuracy {accuracy(params, data):.3f}")
  platform = devices[0].platform
  pins = ("pinned: " + ", ".join(f"{k}={v}" for k, v in reproducible.gpu_options().items())
          if platform == "gpu" else "pinned: " + ", ".join(
              [f"{k}={v}" for k, v in reproducible.COMPILER_OPTIONS["cpu"].items()]
              + ([] if reproducible.missing_process_flags("cpu") else ["--xla_cpu_max_isa=AVX"])))
  print(f"losses sha256 {losses_digest(losses1)} ({len(devices)} {platform} device(s); {pins}; "
        "compare it across fresh processes)")
  (xtr, ytr), _ = data
  micro = args.batch // MICRO_BATCHES
  xb = jnp.asarray(xtr[:args.batch].reshape(MICRO_BATCHES, micro, -1))
  yb = jnp.asarray(ytr[:args.batch].reshape(MICRO_BATCHES, micro))
  inv = microbatch_invariance(init_params(jax.random.key(args.seed)), xb, yb)
  if len(set(inv.values())) == 1:
    print("device counts: each micro-batch's gradient has the same bits whether a device "
          "computes 8, 4, 2 or 1 of them (checked here), and the all-reduce is reproducible, so "
          f"the gradients are the same on 1, 2, 4 and 8 {platform} devices of this kind")
  else:
    print(f"device counts: micro-batch gradients differ with the micro-batches per device "
          f"(checked here: {inv}); on this machine the losses depend on the device count")

  print("\n== explain(train_step) ==")
  print(explain_lib.explain(jstep, *example, topology=topology).table())

  print("\n== determinism: a second run from the same seed ==")
  _, losses2, _, _ = train(args.steps, args.batch, placement, data, args.seed,
                           progress=not args.no_progress)
  same = np.array_equal(losses1.view(np.uint32), losses2.view(np.uint32))
  print(f"losses bit-identical across runs: {same} ({args.steps} steps compared, in this "
        "process)")
  print(f"demo finished in {time.perf_counter() - t0:.1f} s")
  return 0 if same else 1
