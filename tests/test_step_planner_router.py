"""A mixture of experts' router laid out column-parallel over 'tensor' (issue 39, item 3): the
all-gathers XLA:CPU compiles for the routed tokens it splits, against the planner's price."""

import sys
from pathlib import Path

import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src import hlo
from tests import compile_only
from tests.test_costmodel_wire import _recorded

ROOT = Path(__file__).resolve().parents[1]


def _families():
  sys.path.insert(0, str(ROOT / "bench"))
  import _families
  return _families


def test_a_column_parallel_router_s_routed_gathers_are_priced_as_xla_cpu_compiles_them(
    cpu_devices):
  """bench/_families.py's mixture of experts (one layer, 8 experts, d 128, batch 16 x 32, float32)
  as a user writes expert parallelism on `expert` 4 x `tensor` 2 (the experts over `expert`, the
  dispatched tokens constrained onto them), with the router replicated and column-parallel
  over `tensor`: compiled, the column-parallel router adds all-gathers over `tensor` of the
  tokens dispatched to the experts and of their mask in the forward, and of the experts'
  output gradient in the backward (and the argmax's partials). The planner's price of the
  router's column-parallel layout records them at the bytes the compile adds, within the
  argmax's partials (before: none, the logits' reduction taken as the end of the split)."""
  fams = _families()
  fam = fams.moe(vocab=512, d=128, heads=4, ffn=256, experts=8, layers=1, batch=16, seq=32)
  ep = fams.expert_recipe(fam, cpu_devices)
  mesh = Mesh(np.asarray(cpu_devices).reshape(4, 2), ("expert", "tensor"))
  gathered = {}
  for router in (P(), P(None, "tensor")):
    specs = dict(ep.param_specs)
    specs["l0"] = {**specs["l0"], "router": router}
    r = fams.Recipe("EP", mesh, specs, ep.compute, ("expert",))
    fn, ins = fams.recipe_jit(fam, r)
    _, args = fam.make()
    exe = fn.lower(*args).compile(compile_only.LLVM_O0)
    gathered[router] = [c for c in hlo.read_compiled(exe).collectives() if c.kind == "all_gather"]
  assert gathered[P()] == []
  moved = sorted(c.nbytes for c in gathered[P(None, "tensor")])
  # per device: the argmax's value and index partials, the mask [b, s, E, C] (4 x 32 x 8 x 8 x 4
  # bytes), and the dispatched tokens and the output's gradient [E, b, C, d] (8 x 4 x 8 x 128 x 4)
  assert moved == [4 * 32 * 2 * 4] * 2 + [4 * 32 * 8 * 8 * 4] + [8 * 4 * 8 * 128 * 4] * 2

  step, args = fam.make()
  got = _recorded(step, args, (2,), {"expert": 4, "tensor": 2})
  priced = got[(True, "[0]['l0']['router']", (None, "tensor"), "all_gather[tensor]")]
  assert priced == sum(moved[2:])
  assert not [k for k in got if k[1] == "[0]['l0']['router']" and k[2] == (None, None) and
              k[3].startswith("all_gather")]
