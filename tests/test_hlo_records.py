"""hlo/records.py and hlo/text.py as the one home of HLO's vocabulary: element type names (and
their numpy names, which ``dtenjax explain --shape-args`` reads), collective opcodes, and the
loops' known trip counts, checked against what XLA compiles and what numpy / ml_dtypes say."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src import hlo
from dtenjax._src.cli import explain as explain_cli
from dtenjax._src.gpu import graph_policy as gp
from dtenjax._src.gpu import graph_prediction as pred


def _dtype(name):
  return np.dtype(getattr(ml_dtypes, name, name))


def test_every_array_type_has_its_numpy_name_and_width():
  arrays = [n for n, bits in hlo.BITS.items() if bits and n not in ("tuple", "opaque", "token")]
  assert set(hlo.NUMPY_NAMES) == set(arrays)
  for name, np_name in hlo.NUMPY_NAMES.items():
    d = _dtype(np_name)
    assert (d.itemsize * 8 == hlo.BITS[name]) or hlo.BITS[name] < 8, (name, np_name)
  assert hlo.numpy_name("f8e4m3fn") == "float8_e4m3fn" and hlo.numpy_name("tuple") is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint16, jnp.bool_,
                                   jnp.complex64, jnp.float8_e4m3fn])
def test_the_names_xla_prints_map_back_to_the_dtype(dtype):
  """The element type XLA compiles a value to is named by records, and its numpy name is the
  dtype the value had."""
  c = jax.jit(lambda v: v).lower(jax.ShapeDtypeStruct((3,), dtype)).compile()
  module = hlo.read_compiled(c)
  shape = module.computations[module.entry].instructions[-1].shape
  assert np.dtype(_dtype(hlo.NUMPY_NAMES[shape.dtype])) == np.dtype(dtype)


def test_explain_reads_every_hlo_name_and_the_i_aliases():
  specs = explain_cli.parse_shape_args("f8e5m2[2],i32[3],s32[3],pred[1],bf16[4]")
  assert [s.dtype for s in specs] == [jnp.float8_e5m2, jnp.int32, jnp.int32, jnp.bool_,
                                      jnp.bfloat16]


def _collective_opcodes(compiled) -> set[str]:
  module = hlo.read_compiled(compiled)
  ops = {i.opcode for c in module.computations.values() for i in c.instructions}
  return {o for o in ops if any(k in o for k in ("all-", "reduce-scatter", "collective"))}


def test_collective_opcodes_cover_what_xla_compiles():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

  def body(v):
    a = lax.psum(v, "x")
    b = lax.all_gather(v, "x", tiled=True)[:v.shape[0]]
    c = lax.psum_scatter(jnp.tile(v, 4), "x", tiled=True)
    d = lax.ppermute(v, "x", [(i, (i + 1) % 4) for i in range(4)])
    e = lax.all_to_all(v.reshape(4, -1), "x", 0, 0).reshape(v.shape)
    return a + b + c + d + e

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
  found = _collective_opcodes(f.lower(jnp.ones((32,), jnp.float32)).compile())
  assert len(found) >= 4, found
  assert found <= hlo.COLLECTIVE_OPCODES, found - hlo.COLLECTIVE_OPCODES
  module = hlo.read_compiled(f.lower(jnp.ones((32,), jnp.float32)).compile())
  for comp in module.computations.values():
    for ins in comp.instructions:
      if ins.opcode in found:
        assert pred.classify(ins, module, ()) == (
            "split", f"collective {ins.opcode} needs command type COLLECTIVES, which this "
            "policy leaves out")
        assert pred.classify(ins, module, ("COLLECTIVES",)) == ("command", "COLLECTIVES")


def test_async_halves_are_collectives_and_the_generic_wrapper_is_not():
  for op in hlo.COLLECTIVE_KINDS:
    assert {op, f"{op}-start", f"{op}-done"} <= hlo.COLLECTIVE_OPCODES
  assert "async-done" not in hlo.COLLECTIVE_OPCODES and "async-start" not in hlo.COLLECTIVE_OPCODES


@pytest.mark.parametrize("n", [3, 17])
def test_trip_counts_come_from_the_compiled_text(n):
  def f(x):
    return lax.fori_loop(0, n, lambda i, v: jnp.sin(v) * 1.5, x)

  c = jax.jit(f).lower(jnp.ones((8,), jnp.float32)).compile()
  trips = hlo.trip_counts_from_text(c.as_text())
  assert list(trips.values()) == [n]
  # both readers find it: the proto's backend_config field and the printed one
  assert hlo.read_compiled(c).trip_counts() == trips
  assert hlo.read_compiled(c, prefer="text").trip_counts() == trips
  (name,) = trips
  module = hlo.read_compiled(c)
  loops = [i for comp in module.computations.values() for i in comp.instructions
           if i.opcode == "while"]
  assert [i.name for i in loops] == [name]          # the name is the module's while op
  report = pred.report_from_hlo(c.as_text(), gp.CudaGraphPolicy.from_mode("xla"), "gpu")
  assert report.is_prediction


def test_nested_loops_have_their_own_counts_in_both_readers():
  def f(x):
    y = lax.fori_loop(0, 7, lambda i, v: jnp.sin(v), x)
    return lax.fori_loop(0, 3, lambda i, v: lax.fori_loop(0, 5, lambda j, w: w * 2.0, v), y)

  c = jax.jit(f).lower(jnp.ones((8,), jnp.float32)).compile()
  proto, text = hlo.read_compiled(c), hlo.read_compiled(c, prefer="text")
  assert sorted(proto.trip_counts().values()) == [3, 5, 7]
  assert proto.trip_counts() == text.trip_counts()
  inner = [i for i in proto.instructions() if i.trip_count == 5]
  assert [i.computation for i in inner] != [proto.entry]   # the inner loop sits in a loop body


def test_a_backend_config_that_is_not_json_gives_no_count():
  assert hlo.known_trip_count('{"known_trip_count":{"n":"4"}}') == 4
  assert hlo.known_trip_count(b'{"known_trip_count":{"n":"4"}}') == 4
  for bad in ("", "{not json", "[]", '{"known_trip_count":"x"}', '{"other":1}'):
    assert hlo.known_trip_count(bad) is None, bad


def test_a_loop_without_a_known_count_is_left_out():
  def f(x):
    return lax.while_loop(lambda v: v[0] < 100.0, lambda v: v * 2.0, x)

  c = jax.jit(f).lower(jnp.ones((8,), jnp.float32)).compile()
  assert hlo.trip_counts_from_text(c.as_text()) == {} == hlo.read_compiled(c).trip_counts()


def test_a_collective_over_groups_of_one_device_is_not_a_collective():
  # lax.psum over singleton groups moves nothing between devices (XLA:CPU keeps it; the
  # collective algorithms use one to read their offsets at run time): no record; the same psum
  # over pairs is one
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))

  def compiled(groups):
    f = jax.jit(jax.shard_map(lambda v: lax.psum(v, "x", axis_index_groups=groups), mesh=mesh,
                              in_specs=P("x"), out_specs=P("x"), check_vma=False))
    return hlo.read_compiled(f.lower(jnp.ones((32,), jnp.float32)).compile())

  assert [c.kind for c in compiled([[0], [1], [2], [3]]).collectives()] == []
  assert [c.kind for c in compiled([[0, 1], [2, 3]]).collectives()] == ["all_reduce"]


_COMBINED_PERMUTE = """\
HloModule combined, entry_computation_layout={(f32[1024,256]{1,0}, f32[128,2048]{1,0})->((f32[1024,256]{1,0}, f32[128,2048]{1,0}), (f32[1024,256]{1,0}, f32[128,2048]{1,0}), f32[128,2048]{1,0})}

%async_computation.14 (param_0.2970: f32[1024,256], param_1.3588: f32[128,2048]) -> (f32[1024,256], f32[128,2048]) {
  %param_0.2970 = f32[1024,256]{1,0} parameter(0)
  %param_1.3588 = f32[128,2048]{1,0} parameter(1)
  ROOT %collective-permute.4 = (f32[1024,256]{1,0}, f32[128,2048]{1,0}) collective-permute(%param_0.2970, %param_1.3588), channel_id=78, source_target_pairs={{0,0},{1,1},{4,2},{5,3},{2,4},{3,5},{6,6},{7,7}}
}

ENTRY %main (p0: f32[1024,256], p1: f32[128,2048]) -> ((f32[1024,256], f32[128,2048]), (f32[1024,256], f32[128,2048]), f32[128,2048]) {
  %p0 = f32[1024,256]{1,0} parameter(0)
  %p1 = f32[128,2048]{1,0} parameter(1)
  %collective-permute-start = ((f32[1024,256]{1,0}, f32[128,2048]{1,0}), (f32[1024,256]{1,0}, f32[128,2048]{1,0})) async-start(%p0, %p1), calls=%async_computation.14
  %collective-permute-done = (f32[1024,256]{1,0}, f32[128,2048]{1,0}) async-done(%collective-permute-start)
  %sync = (f32[1024,256]{1,0}, f32[128,2048]{1,0}) collective-permute(%p0, %p1), channel_id=79, source_target_pairs={{0,1},{1,0}}
  %single = f32[128,2048]{1,0} collective-permute(%p1), channel_id=80, source_target_pairs={{0,1},{1,0}}
  ROOT %t = ((f32[1024,256]{1,0}, f32[128,2048]{1,0}), (f32[1024,256]{1,0}, f32[128,2048]{1,0}), f32[128,2048]{1,0}) tuple(%collective-permute-done, %sync, %single)
}
"""


def test_a_combined_collective_permute_moves_every_operand():
  # XLA:GPU combines the permutes of one set of pairs into one variadic collective-permute, run
  # through an async-start (the text above is llama_loop's FSDP x TP step on a mocked 8-GPU host,
  # /work/gpu_dumps/llama_loop/module_44438: the table's gradient half, f32[1024,256], and the
  # unembedding's piece, f32[128,2048], 1 MiB each). Each device sends both: 2 MiB, where the
  # first operand alone (1 MiB) was counted. A permute of one operand counts that operand.
  module = hlo.parse_text(_COMBINED_PERMUTE)
  got = {c.name: (c.kind, c.nbytes) for c in module.collectives()}
  both = (1024 * 256 + 128 * 2048) * 4
  assert got == {"collective-permute-start": ("ppermute", both), "sync": ("ppermute", both),
                 "single": ("ppermute", 128 * 2048 * 4)}, got
