"""Shared set-up of worker processes: jax.distributed on the local coordinator, result writing."""

from __future__ import annotations

import json
import os


def init():
  """jax.distributed on the test's coordinator. DTENJAX_TEST_HEARTBEAT sets its
  heartbeat_timeout_seconds (JAX's default is 100)."""
  import jax
  extra = {}
  if os.environ.get("DTENJAX_TEST_HEARTBEAT"):
    extra["heartbeat_timeout_seconds"] = int(os.environ["DTENJAX_TEST_HEARTBEAT"])
  jax.distributed.initialize(
      coordinator_address=os.environ["DTENJAX_TEST_COORDINATOR"],
      num_processes=int(os.environ["DTENJAX_TEST_NPROCS"]),
      process_id=int(os.environ["DTENJAX_TEST_RANK"]),
      initialization_timeout=60, **extra)
  return jax.process_index(), jax.process_count()


def write(result: dict) -> None:
  rank = int(os.environ["DTENJAX_TEST_RANK"])
  path = os.path.join(os.environ["DTENJAX_TEST_OUT"], f"rank{rank}.json")
  with open(path + ".tmp", "w") as f:
    json.dump(result, f)
  os.replace(path + ".tmp", path)


def done(store) -> None:
  """Counts this process done in the store, with its pid, so that process 0 (``finish``) can wait
  for it to have exited. A process that leaves on its own (os._exit) right after must call this."""
  store.set(f"dtenjax/test-pid/{os.environ['DTENJAX_TEST_RANK']}", str(os.getpid()),
            overwrite=True)
  store.increment("dtenjax/test-done", 1)


def _running(pid: int) -> bool:
  """Whether ``pid`` has not exited yet (a zombie, exited but not yet reaped, has)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def finish(result: dict, code: int = 0, *, expect_done: int | None = None,
           wait_s: float = 30) -> None:
  """Writes the result and exits at once (a jax.distributed shutdown barrier would wait for peers
  that a fault-injection test killed). Process 0 hosts the coordination service, whose exit
  terminates the others, so it leaves last: every process counts itself done in the store
  (``done``), and process 0 waits (up to ``wait_s``) until ``expect_done`` processes have and
  every one of them has exited (all the processes run on this host). It used to wait a fixed
  0.5 s instead: idle time in every launch, and no guarantee on a loaded machine."""
  import time
  write(result)
  from dtenjax._src.net import kvstore
  store = kvstore.default()
  rank = int(os.environ["DTENJAX_TEST_RANK"])
  n = int(os.environ["DTENJAX_TEST_NPROCS"]) if expect_done is None else expect_done
  try:
    done(store)
    if rank == 0:
      deadline = time.monotonic() + wait_s
      while time.monotonic() < deadline and store.increment("dtenjax/test-done", 0) < n:
        time.sleep(0.05)
      pids = {int(v) for v in store.dir("dtenjax/test-pid").values()} - {os.getpid()}
      while time.monotonic() < deadline and any(map(_running, pids)):
        time.sleep(0.01)
  except Exception:
    pass
  os._exit(code)


def barrier(name: str, timeout_s: float = 60) -> None:
  """All processes meet here (through the coordination store)."""
  from dtenjax._src.net import kvstore
  kvstore.default().barrier(f"test-{name}", timeout_s=timeout_s)


def gathered(tree):
  """The tree's arrays whole, as numpy arrays, in every process: one jitted program replicates
  every leaf (jax.experimental.multihost_utils.process_allgather compiles one program per leaf
  shape, a dozen small compiles in each process of a job)."""
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  if jax.process_count() > 1:
    tree = jax.jit(lambda t: t, out_shardings=jax.tree.map(
        lambda a: NamedSharding(a.sharding.mesh, P()), tree))(tree)
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)
  return jax.tree.map(np.asarray, tree)


def zero_state(init, tree):
  """``init(tree)`` for an optimizer whose initial state is zeros (adam's and adamw's: the
  moments and a zero count), made with numpy from its shapes: ``init``'s eager ``jnp.zeros``
  compile a one-device program per shape and dtype in every process that calls it."""
  import jax
  import numpy as np
  return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(init, tree))


def mlp(mesh, n_in: int):
  """The checkpoint and elastic workers' model: an MLP n_in -> 32 (tanh) -> 4, data parallel over
  ``mesh``'s axis "data". Returns ``params`` (drawn with numpy: jax.random's eager draws would
  compile a few one-device programs in every process, about a second of CPU each on the test
  machine), ``opt`` (adam), ``opt_state`` (its zero state), ``layout(x)`` (the sharding of a
  leaf: along "data" when its first dimension divides the device count, else replicated) and
  ``grads_of(params, x, y) -> (loss, grads)``: each device's micro-batches' losses and gradients
  averaged over the devices by dtenjax.all_reduce(op="mean", reproducible=True). It runs under
  shard_map's default check_vma=True, as a user's step would: the parameters come in replicated
  and dtenjax.compression.pvary types them as varying, so each device's gradient is its own."""
  import types
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  import dtenjax
  import dtenjax.compression

  n = mesh.shape["data"]
  rng = np.random.default_rng(0)
  params = {"w1": np.float32(0.3) * rng.standard_normal((n_in, 32), dtype=np.float32),
            "b1": np.zeros(32, np.float32),
            "w2": np.float32(0.3) * rng.standard_normal((32, 4), dtype=np.float32),
            "b2": np.zeros(4, np.float32)}
  opt = optax.adam(1e-2)

  def layout(x):
    return NamedSharding(mesh, P("data") if x.ndim and x.shape[0] % n == 0 else P())

  def loss_fn(p, x, y):
    h = jax.nn.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

  def local(p, x, y):
    p = dtenjax.compression.pvary(p, "data")
    losses, grads = jax.lax.map(lambda b: jax.value_and_grad(loss_fn)(p, *b), (x, y))
    grads = dtenjax.all_reduce(grads, "data", op="mean", reproducible=True, local_axis=0)
    loss = dtenjax.all_reduce(losses, "data", op="mean", reproducible=True, local_axis=0)
    return loss, grads

  grads_of = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                           out_specs=(P(), P()))
  return types.SimpleNamespace(params=params, opt=opt, opt_state=zero_state(opt.init, params),
                               layout=layout, grads_of=grads_of)
