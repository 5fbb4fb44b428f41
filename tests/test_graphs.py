"""Tests of dtenjax._src.gpu.graphs: CUDA-graph policies, per-executable options, the graph report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.gpu import graphs

# A scheduled GPU entry computation, written the way XLA prints it: a cuDNN convolution splits,
# a dtenjax FFI call stays inside, a short run falls under min_graph_size.
GPU_HLO = """HloModule jit_step, is_scheduled=true

%fused_a (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%p)
}

%body (c: (s32[], f32[8])) -> (s32[], f32[8]) {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %v = f32[8]{0} get-tuple-element(%c), index=1
  %f = f32[8]{0} fusion(%v), kind=kLoop, calls=%fused_a
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %f)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%c), kind=kLoop, calls=%fused_a
}

ENTRY %main (x: f32[8], y: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %y = f32[8]{0} parameter(1)
  %f1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %cc = f32[8]{0} custom-call(%f1, %y), custom_call_target="dtenjax_graph_probe_scale_add"
  %f2 = f32[8]{0} fusion(%cc), kind=kLoop, calls=%fused_a
  %conv = (f32[8]{0}, u8[0]{0}) custom-call(%f2, %y), custom_call_target="__cudnn$convForward"
  %g = f32[8]{0} get-tuple-element(%conv), index=0
  %f3 = f32[8]{0} fusion(%g), kind=kLoop, calls=%fused_a
  %init = (s32[], f32[8]{0}) tuple(%x, %f3)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %r = f32[8]{0} get-tuple-element(%w), index=1
  ROOT %f4 = f32[8]{0} fusion(%r), kind=kLoop, calls=%fused_a
}
"""

OUTLINED_HLO = """HloModule jit_step, is_scheduled=true

%command_buffer (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  %a = f32[8]{0} fusion(%p0), kind=kLoop, calls=%fused_a
  ROOT %b = f32[8]{0} custom-call(%a), custom_call_target="dtenjax_graph_probe_scale_add"
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %cb = f32[8]{0} call(%x), to_apply=%command_buffer
  ROOT %h = f32[8]{0} custom-call(%cb), custom_call_target="xla_ffi_python_gpu_callback"
}
"""


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


def test_report_predicts_runs_and_splits_from_gpu_hlo():
  r = graphs.report_from_hlo(GPU_HLO, graphs.CudaGraphPolicy.from_mode("auto"), "gpu")
  assert r.source == "predicted" and r.applies
  runs = [(s.ops, s.captured) for s in r.segments]
  # f1, the dtenjax call and f2 form one graph; the conv splits; f3, while, f4 form another.
  assert runs == [(("f1", "cc", "f2"), True), (("f3", "w", "f4"), True)]
  assert [(n, w) for n, w, _ in r.splitters] == [("conv", "__cudnn$convForward")]
  assert "convolution" in r.splitters[0][2]
  # XLA's defaults: no WHILE, and runs need 5 commands.
  d = graphs.report_from_hlo(GPU_HLO, graphs.CudaGraphPolicy.from_mode("xla"), "gpu")
  assert d.num_graphs == 0
  assert any(n == "w" and "WHILE" in why for n, _, why in d.splitters)
  off = graphs.report_from_hlo(GPU_HLO, graphs.CudaGraphPolicy.from_mode("off"), "gpu")
  assert off.ops_inside == 0 and off.launches() > r.launches()


def test_report_reads_outlined_command_buffers():
  r = graphs.report_from_hlo(OUTLINED_HLO, graphs.CudaGraphPolicy.from_mode("xla"), "gpu")
  assert r.source == "observed"
  assert r.num_graphs == 1 and r.segments[0].ops == ("a", "b")
  assert r.splitters[0][0] == "h" and "host callback" in r.splitters[0][2]
  assert r.to_dict()["launches"] == 2


def test_graph_report_on_cpu_lists_what_would_be_captured():
  def step(x):
    y = jnp.tanh(x) * 3.0
    y = jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), y)
    return jnp.exp(y).sum()
  x = jnp.ones((16,), jnp.float32)
  r = graphs.graph_report(graphs.jit(step, "all"), x)
  assert not r.applies and r.platform == "cpu"
  assert r.ops_inside > 0
  assert any("callback" in why for _, _, why in r.splitters), r.splitters
  text = r.render()
  assert "do not apply on cpu" in text and "graph" in text
  compiled = jax.jit(step).lower(x).compile()
  assert graphs.graph_report(compiled).to_dict()["splitters"]


def test_graph_report_rejects_non_functions():
  with pytest.raises(errors.ConfigurationError, match="int"):
    graphs.graph_report(3)


@pytest.mark.gpu
def test_dtenjax_custom_call_stays_inside_graphs_on_gpu():
  target = ffi.require("dtenjax_graph_probe_scale_add", "CUDA")

  def step(x, y):
    for _ in range(8):
      x = jnp.sin(x) + 1.0
      x = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(
          x, y, scale=np.float32(0.5))
    return x
  x = jnp.linspace(0, 1, 4096, dtype=jnp.float32)
  y = jnp.ones_like(x)
  ref = x
  for _ in range(8):
    ref = (jnp.sin(ref) + 1.0) * 0.5 + y
  f = graphs.jit(step, "auto")
  np.testing.assert_allclose(f(x, y), ref, rtol=1e-5)
  r = graphs.graph_report(f, x, y)
  assert not [s for s in r.splitters if s[1].startswith("dtenjax_")], r.splitters
  assert r.ops_inside >= 16
