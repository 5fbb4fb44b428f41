"""The README's and docs' steps that lay arrays out on a mesh, run on ``jax.make_mesh`` meshes:
Explicit axes, JAX's default, as a user who builds their mesh with JAX gets it.

Each block is taken from its page (tests/test_doc_code.py's extraction), its mesh replaced by
``jax.make_mesh``'s of the same shape and names, and run in this process under ``jax.set_mesh``
(which JAX's sharding in types asks for: an eager ``jax.grad`` of a program on an Explicit mesh
fails without it, with plain ``jax.shard_map`` too). ``jax.shard_map`` calls are spelled
``dtenjax.mesh_map``: on Explicit axes ``jax.shard_map``'s ``in_specs`` only assert where the
inputs already are, and ``mesh_map`` lays them out (as ``jax.shard_map`` does on Auto axes), so
the steps' unplaced batches work unchanged. The pipeline step's mesh loses its Auto axis types.
The blocks run as written on their own meshes in tests/test_doc_code.py; docs/checkpoint.md's
manager and docs/elastic.md's job already build their meshes with ``jax.make_mesh`` there.
"""

import os
import pathlib

import jax
import pytest
from jax.sharding import AxisType

from tests.test_doc_code import blocks_of

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (page, a line of the block, [(text in the block, its replacement)])
STEPS = {
    "readme-quickstart": ("README.md", "dtenjax.topology_mesh((8,), (\"i\",))", [
        ("dtenjax.tensor((4096, 4096)", "dtenjax.tensor((256, 256)"),     # small: the test's time
        ('placement = dtenjax.Placement(strategy="auto", mesh=(2, 4), memory_policy="device")',
         'placement = dtenjax.Placement(strategy="auto", mesh=jax.make_mesh((2, 4), '
         '("data", "model")), memory_policy="device")'),
        ('mesh = dtenjax.topology_mesh((8,), ("i",))', 'mesh = jax.make_mesh((8,), ("i",))'),
        ("y = f(x)", "with jax.set_mesh(mesh):\n  y = f(x)"),
        ("g = jax.grad(", "  g = jax.grad("),
        ("print(dtenjax.explain(f, x))", "  print(dtenjax.explain(f, x))"),
    ]),
    "compression-step": ("docs/compression.md", "compression.topk_ef(0.01", [
        ('mesh = dtenjax.topology_mesh((8,), ("data",))', "mesh = MESH"),
        ("jax.shard_map(", "dtenjax.mesh_map("),
    ]),
    "reproducibility-step": ("docs/reproducibility.md", "MICRO, SIZE = 8, 4", [
        ('mesh = Mesh(np.array(jax.devices()[:n]), ("d",))',
         'mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])'),
        ("  bits.add(np.asarray(f(w, data)).tobytes())",
         "  with jax.set_mesh(mesh):\n    bits.add(np.asarray(f(w, data)).tobytes())"),
        ("jax.shard_map(", "dtenjax.mesh_map("),
    ]),
    "readme-checkpoint-step": ("README.md", "def train_step(state):", [
        ('mesh = dtenjax.topology_mesh((2, 4), ("a", "b"))',
         'mesh = jax.make_mesh((2, 4), ("a", "b"))'),
        ('mesh2 = dtenjax.topology_mesh((4, 2), ("a", "b"))',
         'mesh2 = jax.make_mesh((4, 2), ("a", "b"))'),
    ]),
    "pipeline-step": ("docs/pipeline.md", "LAYERS, D, VOCAB, SEQ", [
        ('mesh = jax.make_mesh((4, 2), ("stage", "data"), axis_types=(jax.sharding.AxisType.Auto,)'
         ' * 2)', 'mesh = jax.make_mesh((4, 2), ("stage", "data"))'),
        ("jax.shard_map(", "dtenjax.mesh_map("),
    ]),
}
# the mesh the whole block runs under (None: the block's edits enter jax.set_mesh themselves)
MESHES = {"compression-step": ((8,), ("data",))}
# the training steps that compile once for all their calls (a step whose first inputs are not
# placed as it returns them compiles again at its second call: docs/pipeline.md's did)
COMPILED_ONCE = {"compression-step": "jit(step)", "pipeline-step": "jit(step)"}


def _step(name):
  page, marker, edits = STEPS[name]
  matches = [code for _, code in blocks_of((ROOT / page).read_text()) if marker in code]
  assert len(matches) == 1, f"{page}: {len(matches)} blocks contain {marker!r}"
  code = matches[0]
  for old, new in edits:
    assert old in code, f"{page} no longer has {old!r}: update this test's edit"
    code = code.replace(old, new)
  return code


@pytest.mark.parametrize("name", sorted(STEPS))
def test_doc_step_runs_on_a_jax_make_mesh_mesh(name, cpu_devices, monkeypatch):
  code = _step(name)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # the blocks append to it
  namespace = {"__name__": f"doc_step_{name}"}
  compiled = []        # JAX's backend compile events (persistent cache hits too), by program

  def listener(event, _duration, fun_name="", **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiled.append(fun_name)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    shape = MESHES.get(name)
    if shape is None:
      exec(compile(code, name, "exec"), namespace)
    else:
      mesh = jax.make_mesh(*shape, devices=cpu_devices[:8])
      assert all(t == AxisType.Explicit for t in mesh.axis_types)
      namespace["MESH"] = mesh
      with jax.set_mesh(mesh):
        exec(compile(code, name, "exec"), namespace)
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  if name in COMPILED_ONCE:
    assert compiled.count(COMPILED_ONCE[name]) == 1, compiled
