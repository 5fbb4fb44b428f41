"""roles/tensor.py's price: column-parallel weights that read the same input (attention's q, k and
v; an MLP's gate and up) share one all-reduce of that input's gradient. XLA:CPU compiles it as one
tuple all-reduce of the three partial gradients (one meeting of the devices, each operand's
bytes); XLA's GPU compiler reassociates all-reduce(a) + all-reduce(b) into all-reduce(a + b)."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src.planning import stepgraph
from tests import compile_only

D, H = 64, 128


def _step(params, batch):
  def loss(p):
    x = jnp.tanh(batch @ p["w0"])                     # depends on the state: its gradient flows
    q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]   # three column-parallel reads of x
    return jnp.sum(((jnp.tanh(q) * k + v) @ p["wo"]) ** 2)
  value, g = jax.value_and_grad(loss)(params)
  return jax.tree.map(lambda w, d: w - 1e-3 * d, params, g), value


def _args():
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  params = {"w0": s(D, D), "wq": s(D, H), "wk": s(D, H), "wv": s(D, H), "wo": s(H, D)}
  return params, s(64, D)


def test_weights_reading_one_input_are_siblings():
  graph = stepgraph.read_step(_step, _args(), (1,))
  names = {"w0": 1, "wq": 3, "wk": 3, "wv": 3, "wo": 1}
  by_leaf = {i: n for i, n in enumerate(sorted(names))}     # dict leaves flatten in key order
  assert {by_leaf[i]: u.siblings for i, u in graph.weights.items()} == names


def test_the_shared_input_gradient_is_priced_as_one_all_reduce_as_compiled(cpu_devices):
  """Megatron on tensor = 2: q, k, v column-parallel, wo row-parallel. XLA:CPU compiles one
  all-reduce instruction for x's gradient, a tuple of its three partial sums (jax 0.10.2), and
  one for wo's output; the plan's all-reduce bytes match the compiled ones within 2 % (pricing
  the three partial sums as one reduced sum had the tensor axis's bytes at half the compiled)."""
  del cpu_devices
  params, batch = _args()
  col, row = P(None, "tensor"), P("tensor", None)
  pins = [{"w0": P(), "wq": col, "wk": col, "wv": col, "wo": row}, None]
  plan = dtenjax.plan(_step, params, batch, mesh={"data": 4, "tensor": 2}, pinned=pins)
  check = plan.check(_step, params, batch, compiler_options=compile_only.LLVM_O0)   # read only
  assert check.compiled_bytes.get("all_reduce", 0) > 0
  assert check.kind_errors["all_reduce"] < 0.02, check.table()
