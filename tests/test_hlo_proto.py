"""The HloModuleProto reader (dtenjax._src.hlo.proto) against modules XLA itself serialized.

The reader's schema table is ours; the bytes are XLA's. Every expected value comes from outside
the reader: XLA's own C++ module behind ``compiled.runtime_executable().hlo_modules()`` (names,
opcodes, operands, schedule order), the program the test builds (shapes, mesh device order,
groups), or an HLO text that XLA's parser turns into the proto (each replica-group encoding).
A wrong field number or type in the table reads as a missing or wrong value here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxlib import _hlo as xla_hlo

from dtenjax._src import hlo
from dtenjax._src.hlo import proto


def _xla_opcode(opcode: str) -> str:
  """The name of XLA's HloOpcode enum member for an opcode's text name."""
  return "k" + "".join(part.capitalize() for part in opcode.split("-"))


def _printed_form(text: str) -> str:
  """The replica-group encoding XLA's text of one instruction shows."""
  groups = text.split("replica_groups=", 1)[1]
  return "list" if groups.startswith("{") else "mesh" if groups.startswith("mesh[") else "iota"


def _step(cpu_devices):
  mesh = Mesh(np.array(cpu_devices[::-1]).reshape(2, 4), ("x", "y"))

  def body(a):
    b = jax.lax.psum(a, "y")
    c = jax.lax.psum(a, "x")
    d = jax.lax.ppermute(a, "y", [(0, 1), (1, 2), (2, 3), (3, 0)])
    return b + c + d, jax.lax.all_gather(a, "x", tiled=True)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x", "y"),
                            out_specs=(P("x", "y"), P(None, "y")), check_vma=False))
  return f.lower(jnp.arange(64.0).reshape(8, 8)).compile()


def test_compiled_step_reads_what_xla_holds(cpu_devices):
  compiled = _step(cpu_devices)
  xla_module = compiled.runtime_executable().hlo_modules()[0]
  m = hlo.parse_proto(xla_module.as_serialized_hlo_module_proto())
  assert m.source == "proto" and m.name == xla_module.name
  xla_comps = {c.name: c for c in xla_module.computations()}
  assert set(m.computations) == set(xla_comps)
  schedule = xla_module.schedule()
  for name, comp in m.computations.items():
    ours = comp.by_name()
    theirs = {i.name: i for i in xla_comps[name].instructions()}
    assert set(ours) == set(theirs), name
    for iname, ins in ours.items():
      assert _xla_opcode(ins.opcode) == theirs[iname].opcode.name, iname
      assert ins.operands == tuple(o.name for o in theirs[iname].operands()), iname
    if not comp.is_fusion:       # XLA schedules every non-fusion computation
      assert [i.name for i in comp.instructions] == [
          i.name for i in schedule.sequence(xla_comps[name])], name

  # Shapes, groups and pairs from the program: a (8, 8) array split 2 x 4 is f32[4,2] a device.
  entry = m.computations[m.entry]
  params = [i for i in entry.instructions if i.opcode == "parameter"]
  assert [p.shape for p in params] == [hlo.Shape("f32", (4, 2))]
  root = entry.instructions[-1]
  assert root.shape == hlo.Shape("tuple", (), (hlo.Shape("f32", (4, 2)), hlo.Shape("f32", (8, 2))))
  by_op = {}
  for i in entry.instructions:
    by_op.setdefault(i.opcode, []).append(i)
  rows, cols = ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))
  assert sorted(i.replica_groups for i in by_op["all-reduce"]) == sorted([rows, cols])
  # The encoding is XLA's choice (jax 0.10.2 writes lists, 0.11.2 mesh axes): ours must be the
  # one XLA prints for that instruction.
  xla_entry = {i.name: i for i in xla_comps[m.entry].instructions()}
  for i in by_op["all-reduce"] + by_op["all-gather"]:
    assert i.group_form == _printed_form(xla_entry[i.name].to_string()), i.name
    assert i.use_global_device_ids
  (ag,) = by_op["all-gather"]
  assert ag.replica_groups == cols and ag.dimensions == (0,) and ag.shape.dims == (8, 2)
  (cp,) = by_op["collective-permute"]
  assert set(cp.source_target_pairs) == {(r * 4 + s, r * 4 + (s + 1) % 4)
                                         for r in range(2) for s in range(4)}
  assert cp.op_name.endswith("ppermute")
  # The mesh's devices are reversed: partition p runs on device 7 - p.
  assert m.device_assignment == (tuple(d.id for d in cpu_devices[::-1]),)
  assert (m.num_replicas, m.num_partitions) == (1, 8)
  # The elementwise adds are one loop fusion whose body is a fusion computation.
  (fusion,) = by_op["fusion"]
  assert fusion.fusion_kind == "kLoop" and m.computations[fusion.called[0]].is_fusion
  assert not any(c.is_fusion for n, c in m.computations.items() if n != fusion.called[0])


_ENCODINGS = """HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p0: f32[4]) -> (f32[4], f32[4], f32[4], f32[4], f32[4], f32[4], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %list = f32[4]{0} all-reduce(%p0), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, use_global_device_ids=true, to_apply=%add
  %iota = f32[4]{0} all-reduce(%p0), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true, to_apply=%add
  %mesh = f32[4]{0} all-reduce(%p0), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'a'}, use_global_device_ids=true, to_apply=%add
  %mesh_ids = f32[4]{0} all-reduce(%p0), channel_id=4, replica_groups=mesh['a'=2,'b'=4], device_ids=(4,5,6,7,0,1,2,3) {'b'}, use_global_device_ids=true, to_apply=%add
  %mesh_iota = f32[4]{0} all-reduce(%p0), channel_id=5, replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}, use_global_device_ids=true, to_apply=%add
  %mesh_sub = f32[4]{0} all-reduce(%p0), channel_id=6, replica_groups=mesh['a'=2,'b'=4] {'b':(2)2}, use_global_device_ids=true, to_apply=%add
  %cp = f32[4]{0} collective-permute(%p0), channel_id=7, source_target_pairs={{0,1},{1,2},{7,0}}
  ROOT %t = (f32[4], f32[4], f32[4], f32[4], f32[4], f32[4], f32[4]) tuple(%list, %iota, %mesh, %mesh_ids, %mesh_iota, %mesh_sub, %cp)
}
"""


_PAIRS_BY_COL = ((0, 4), (1, 5), (2, 6), (3, 7))
_ENCODED_GROUPS = {
    "list": (((0, 2, 4, 6), (1, 3, 5, 7)), "list"),
    # [4,2]<=[2,4]T(1,0): iota(8) as 2 x 4, transposed, in rows of 2.
    "iota": (_PAIRS_BY_COL, "iota"),
    # devices that differ only along 'a' of a 2 x 4 mesh
    "mesh": (_PAIRS_BY_COL, "mesh"),
    # along 'b' of the mesh [[4,5,6,7],[0,1,2,3]]
    "mesh_ids": (((4, 5, 6, 7), (0, 1, 2, 3)), "mesh"),
    # devices iota(8) as 4 x 2, transposed: [0,2,4,6,1,3,5,7], so the 2 x 4 mesh's rows
    "mesh_iota": (((0, 2, 4, 6), (1, 3, 5, 7)), "mesh"),
    # 'b':(2)2 is b's minor half: groups of b in {0,1} or {2,3}
    "mesh_sub": (((0, 1), (2, 3), (4, 5), (6, 7)), "mesh"),
}


def _read_proto(module):
  # XLA serializes the module: each form lands in its own field.
  return hlo.parse_proto(module.as_serialized_hlo_module_proto())


def _read_text(module):
  # XLA prints the module: its own spelling of each form (e.g. the mesh's
  # device_ids=([4,2]T(1,0))), read by the text reader.
  return hlo.parse_text(module.to_string())


@pytest.mark.parametrize("read", [_read_proto, _read_text], ids=["proto", "text"])
def test_each_replica_group_encoding_xla_writes(read):
  ins = read(xla_hlo.hlo_module_from_text(_ENCODINGS)).computations["main"].by_name()
  want = _ENCODED_GROUPS
  assert {k: (ins[k].replica_groups, ins[k].group_form) for k in want} == want
  assert ins["cp"].source_target_pairs == ((0, 1), (1, 2), (7, 0))
  assert [ins[k].channel_id for k in ("list", "iota", "mesh", "cp")] == [1, 2, 3, 7]
  assert all(ins[k].use_global_device_ids for k in want) and not ins["cp"].use_global_device_ids
  assert ins["t"].shape == hlo.Shape("tuple", (), (hlo.Shape("f32", (4,)),) * 7)


def test_legacy_replica_groups_field_is_read():
  # XLA no longer writes the instruction's `replica_groups` (49), but still reads it: move the
  # explicit list of an XLA-written module there (our classes keep every field they do not
  # name), and XLA's reader and ours must both find the groups.
  data = xla_hlo.hlo_module_from_text(_ENCODINGS).as_serialized_hlo_module_proto()
  m = proto.message_class().FromString(data)
  (ins,) = [i for c in m.computations for i in c.instructions if i.name == "list"]
  assert ins.WhichOneof("replica_group_list") == "collective_device_list"
  ins.replica_groups.extend(ins.collective_device_list.replica_groups)
  ins.ClearField("collective_device_list")
  legacy = m.SerializeToString()
  xla_text = xla_hlo.HloModule.from_serialized_hlo_module_proto(legacy).to_string()
  assert "%list = f32[4]{0} all-reduce(%p0), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}" \
      in xla_text
  got = hlo.parse_proto(legacy).computations["main"].by_name()["list"]
  assert (got.replica_groups, got.group_form) == (((0, 2, 4, 6), (1, 3, 5, 7)), "list")


def test_fields_the_schema_does_not_name_are_skipped(cpu_devices):
  data = _step(cpu_devices).runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
  # Field 1000 of HloModuleProto, a varint and a length-delimited record: not in XLA's schema.
  extra = bytes([0xC0, 0x3E, 0x2A]) + bytes([0xC2, 0x3E, 0x03]) + b"abc"
  assert hlo.parse_proto(data + extra) == hlo.parse_proto(data)


@pytest.mark.parametrize("data, why", [
    (b"\x0f", "wire type 7"),
    (b"\x0a\xff\xff\xff\xff\x0f", "a length past the end"),
    (b"\x1a\x05\x0a\x03ab", "a computation cut short"),
])
def test_a_malformed_buffer_is_refused(data, why):
  with pytest.raises(hlo.HloReadError, match="not a serialized xla.HloModuleProto"):
    hlo.parse_proto(data)


def test_a_truncated_module_is_refused(cpu_devices):
  data = _step(cpu_devices).runtime_executable().hlo_modules()[0].as_serialized_hlo_module_proto()
  with pytest.raises(hlo.HloReadError, match=f"the {len(data) // 2} bytes given"):
    hlo.parse_proto(data[:len(data) // 2])


def test_element_types_read_as_xla_names_them():
  # XLA's parser turns each text name into its PrimitiveType number; the reader names it back.
  names = ["pred", "s1", "s2", "s4", "s8", "s16", "s32", "s64", "u1", "u2", "u4", "u8", "u16",
           "u32", "u64", "f16", "bf16", "f32", "f64", "c64", "c128", "f8e5m2", "f8e4m3",
           "f8e4m3fn", "f8e4m3b11fnuz", "f8e5m2fnuz", "f8e4m3fnuz", "f8e3m4", "f8e8m0fnu",
           "f4e2m1fn", "f6e3m2fn", "f6e2m3fn"]
  params = ", ".join(f"p{k}: {n}[3]" for k, n in enumerate(names))
  lines = "\n".join(f"  %p{k} = {n}[3] parameter({k})" for k, n in enumerate(names))
  text = (f"HloModule types\n\nENTRY %main ({params}) -> pred[3] {{\n{lines}\n"
          f"  ROOT %r = pred[3] copy(%p0)\n}}\n")
  data = xla_hlo.hlo_module_from_text(text).as_serialized_hlo_module_proto()
  ins = hlo.parse_proto(data).computations["main"].by_name()
  assert [ins[f"p{k}"].shape for k in range(len(names))] == [hlo.Shape(n, (3,)) for n in names]
  assert ins["r"].shape == hlo.Shape("pred", (3,))
