"""Tests of dtenjax._src.gpu.graphs: CUDA-graph policies, per-executable options, the graph report.

What XLA put in a command buffer can only be observed on a GPU: on jax 0.10.2/0.11 XLA forms
command buffers after HLO (from thunks), so the compiled HLO shows none, and a CPU has none. The
CPU tests here check that graph_report reads the real compiled module and labels its rows as a
PREDICTION; they do not test the rule table against itself. The gpu-marked tests OBSERVE what
the GPU launched (jax.profiler: graph launches, kernels with and without a CUDA graph id) and
compare policies with each other and with the prediction.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src import hlo
from dtenjax._src.gpu import graphs

def test_modes_and_options():
  assert graphs.CudaGraphPolicy.from_mode("off").compiler_options() == {
      "xla_gpu_enable_command_buffer": ""}
  assert graphs.CudaGraphPolicy.from_mode("xla").compiler_options() == {}
  auto = graphs.CudaGraphPolicy.from_mode("auto")
  opts = auto.compiler_options()
  assert set(opts["xla_gpu_enable_command_buffer"].split(",")) == set(
      graphs.XLA_DEFAULT_COMMANDS) | {"WHILE"}
  assert opts["xla_gpu_graph_min_graph_size"] == 2
  assert "COLLECTIVES" in graphs.CudaGraphPolicy.from_mode("all").commands


def test_bad_policies_are_rejected_with_all_problems():
  with pytest.raises(errors.ConfigurationError, match="sometimes"):
    graphs.CudaGraphPolicy.from_mode("sometimes")
  with pytest.raises(errors.ConfigurationError) as e:
    graphs.CudaGraphPolicy(commands=("FUSION", "MEMCPY"), min_graph_size=0)
  assert "MEMCPY" in str(e.value) and "min_graph_size=0" in str(e.value)
  with pytest.raises(errors.ConfigurationError, match="xla_gpu_enable_command_buffer"):
    graphs.jit(lambda x: x, compiler_options={"xla_gpu_enable_command_buffer": ""})


@pytest.mark.parametrize("mode", graphs.MODES)
def test_policy_options_compile_with_this_jaxlib(mode):
  # The keys and values must be accepted by this jaxlib; on CPU XLA ignores them.
  opts = graphs.CudaGraphPolicy.from_mode(mode).compiler_options()
  f = jax.jit(lambda x: jnp.sin(x) * 2, compiler_options=opts or None)
  np.testing.assert_allclose(f(jnp.arange(4.0)), np.sin(np.arange(4.0)) * 2, rtol=1e-6)


def test_jit_on_cpu_is_plain_jit_and_keeps_jit_kwargs():
  def f(x, n):
    return x * n
  g = graphs.jit(f, "all", static_argnums=1, backend="cpu")
  assert g.platform == "cpu" and g.compiler_options == {}
  assert g.policy.mode == "all"
  np.testing.assert_array_equal(g(jnp.arange(3), 4), np.arange(3) * 4)
  assert "dtenjax.jit" in repr(g)


def _callback_step(x):
  y = jnp.tanh(x) * 3.0
  y = jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), y)
  return jnp.exp(y).sum()


def test_graph_report_on_cpu_is_labelled_a_prediction_over_the_real_schedule():
  x = jnp.ones((16,), jnp.float32)
  r = graphs.graph_report(graphs.jit(_callback_step, "all"), x)
  assert not r.applies and r.platform == "cpu"
  assert r.source == "predicted" and r.is_prediction
  text = r.render()
  assert "PREDICTED (not observed)" in text and "do not apply on cpu" in text
  assert r.to_dict()["source_meaning"].startswith("PREDICTED")
  # Every op the report places is an instruction of the compiled entry computation, once.
  module = hlo.read_compiled(jax.jit(_callback_step).lower(x).compile())
  entry = {i.name: i for i in module.computations[module.entry].instructions}
  placed = [n for s in r.segments for n in s.ops] + [n for n, _, _ in r.splitters]
  assert placed and len(placed) == len(set(placed)) and set(placed) <= set(entry)
  assert any(entry[n].custom_call_target for n, _, _ in r.splitters)   # the host callback
  compiled = jax.jit(_callback_step).lower(x).compile()
  assert graphs.graph_report(compiled).source == "predicted"


def test_graph_report_rejects_non_functions():
  with pytest.raises(errors.ConfigurationError, match="int"):
    graphs.graph_report(3)


def test_observe_launches_on_cpu_sees_no_cuda_graphs():
  x = jnp.ones((16,), jnp.float32)
  obs = graphs.observe_launches(graphs.jit(lambda a: jnp.sin(a) * 2, "auto"), x, steps=3)
  assert obs.platform == "cpu" and not obs.applies
  assert not obs.graphs_used and obs.graph_launches == 0 and obs.steps == 3
  with pytest.raises(errors.ConfigurationError, match="steps=0"):
    graphs.observe_launches(jnp.sin, x, steps=0)


# ---- on a GPU: observe what was launched ------------------------------------------------------

def _probe_chain(layers: int):
  target = ffi.require("dtenjax_graph_probe_scale_add", "CUDA")

  def step(x, y):
    for i in range(layers):
      x = jnp.sin(x) * (1.0 + 1e-3 * i)            # one fusion ...
      x = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          x, y, scale=np.float32(0.5))              # ... then the dtenjax kernel
    return x
  return step


def _probe_loop(iterations: int):
  target = ffi.require("dtenjax_graph_probe_scale_add", "CUDA")

  def step(x, y):
    def body(i, c):
      c = jnp.cos(c) + 1e-3 * i.astype(c.dtype)
      return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(c.shape, c.dtype))(
          c, y, scale=np.float32(0.5))
    return jax.lax.fori_loop(0, iterations, body, x)
  return step


def _xy():
  x = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
  return x, jnp.ones_like(x)


def _scale_add_outside(obs) -> float:
  return obs.per_step(sum(n for k, n in obs.kernel_names_outside.items() if "ScaleAdd" in k))


@pytest.mark.gpu
def test_gpu_graphs_off_launches_every_kernel_and_auto_replays_one_graph():
  layers = 8
  step = _probe_chain(layers)
  x, y = _xy()
  off = graphs.observe_launches(graphs.jit(step, "off"), x, y, steps=10)
  auto = graphs.observe_launches(graphs.jit(step, "auto"), x, y, steps=10)
  print("off:", off.to_dict(), "\nauto:", auto.to_dict())
  assert off.applies and not off.graphs_used, off.to_dict()
  # With graphs off every dtenjax kernel is its own launch: layers per step, named ScaleAdd.
  assert _scale_add_outside(off) == layers, off.kernel_names_outside
  assert off.per_step(off.kernels_outside) >= 2 * layers
  # auto: a graph is replayed, and the dtenjax custom call runs inside it (never outside).
  assert auto.graphs_used, auto.to_dict()
  assert _scale_add_outside(auto) == 0, auto.kernel_names_outside
  assert auto.per_step(auto.kernels_outside) < off.per_step(off.kernels_outside) / 2


@pytest.mark.gpu
def test_gpu_while_loop_replays_on_device_only_when_the_policy_records_while():
  iterations = 100        # as in bench/cuda_graphs.py's loop case (docs/scheduler.md)
  step = _probe_loop(iterations)
  x, y = _xy()
  xla = graphs.observe_launches(graphs.jit(step, "xla"), x, y, steps=3)
  auto = graphs.observe_launches(graphs.jit(step, "auto"), x, y, steps=3)
  print("xla:", xla.to_dict(), "\nauto:", auto.to_dict())
  # XLA's defaults leave WHILE out: the body's kernels are launched from the host each iteration.
  assert _scale_add_outside(xla) == iterations, xla.kernel_names_outside
  # auto records WHILE: the loop runs as graph nodes. Observed on an H200 (jax 0.11.2): one of the
  # 100 iterations' kernels per step still launches on its own, the other 99 inside the graph.
  assert auto.graphs_used and _scale_add_outside(auto) <= 1, auto.to_dict()


@pytest.mark.gpu
def test_gpu_prediction_agrees_with_observation_on_whether_graphs_run():
  step = _probe_chain(8)
  x, y = _xy()
  for mode in ("off", "auto"):
    f = graphs.jit(step, mode)
    predicted = graphs.graph_report(f, x, y)
    observed = graphs.observe_launches(f, x, y, steps=5)
    print(mode, predicted.source, predicted.num_graphs, predicted.launches(), observed.to_dict())
    assert predicted.applies
    assert (predicted.num_graphs > 0) == observed.graphs_used, (mode, observed.to_dict())
