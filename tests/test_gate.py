"""The NVLink gate (``dtenjax/_src/gpu/p2p.py``, ``gate``): the one place that decides whether a
call may run on the NVLink kernels, and says why not.

Two halves. Each condition: a call that violates it alone is refused with that condition and a
reason naming the offending value (remove a check from the gate and its case here fails). The
one place: no other module under dtenjax/ names the kernels' limits or vocabulary entries, and
inside gpu/p2p.py only ``gate`` reads them. The expected limits are the documented ones
(docs/p2p.md: at most 8 ranks, at most 128 blocks, 16-byte vectors), not values read from the
code under test.
"""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src import ffi
from dtenjax._src.collectives import common
from dtenjax._src.collectives.algorithms import base
from dtenjax._src.collectives.algorithms import nvlink
from dtenjax._src.collectives.plan_all_reduce import plan_all_reduce
from dtenjax._src.contract import Contract
from dtenjax._src.gpu import p2p
from tests.helpers import parsed

SRC = pathlib.Path(__file__).resolve().parents[1] / "dtenjax"
P2P = SRC / "_src" / "gpu" / "p2p.py"

needs_extension = pytest.mark.skipif(not ffi.is_built(), reason="the native extension is not "
                                     "built (the gate then refuses every call at deployment)")

# A call the kernels take, once deployment is assumed (no GPU here): each case changes one thing.
BASE = dict(world=2, dtype=jnp.float32, op="sum", contract=Contract.NONE, algorithm="one_shot",
            backend="gpu", kind="all_reduce", axes=("x",))


@pytest.fixture
def deployed(monkeypatch):
  """The gate told that the CUDA build and a GPU are there (this machine has none)."""
  monkeypatch.setattr(p2p, "unavailable_reason", lambda: None)


def _kernels_without_v2(monkeypatch):
  """A build whose kernels lack contract v2 (as a new Python contract would be)."""
  real = p2p.vocabulary()
  fewer = {k: v for k, v in real.reproducible.items() if k != Contract.V2.value}
  monkeypatch.setattr(p2p, "vocabulary", lambda: dataclasses.replace(real, reproducible=fewer))


# (condition, what to change, set-up, a text the reason must hold: the offending value)
CASES = [
    ("deployment", dict(backend="cpu"), None, "backend 'cpu'"),
    ("kind", dict(kind="reduce_scatter"), None, "'reduce_scatter'"),
    ("axes", dict(axes=("a", "b")), None, "('a', 'b')"),
    ("algorithm", dict(algorithm="three_shot"), None, "'three_shot'"),
    ("world", dict(world=9), None, "world size 9"),
    ("world", dict(world=0), None, "world size 0"),
    ("world", dict(world=True), None, "world size True"),
    ("dtype", dict(dtype=jnp.int32), None, "int32"),
    ("dtype", dict(dtype=jnp.float64), None, "float64"),
    ("op", dict(op="prod"), None, "'prod'"),
    ("contract", dict(contract=Contract.V3, dtype=jnp.float16), None, "float16"),
    ("contract", dict(contract=Contract.V2, op="min"), None, "'min'"),
    ("contract", dict(contract=Contract.V3, contributions=2), None, "got 2 stacked"),
    ("contract", dict(contract="v3"), None, "'v3'"),
    ("contract", dict(contract=Contract.V2), _kernels_without_v2, "'v2'"),
    ("memory", dict(), {"DTENJAX_P2P_BUFFER_BYTES": "1000"}, "DTENJAX_P2P_BUFFER_BYTES=1000"),
    ("memory", dict(), {"DTENJAX_P2P_BUFFER_BYTES": "0"}, "DTENJAX_P2P_BUFFER_BYTES=0"),
    ("memory", dict(), {"DTENJAX_P2P_MAX_BLOCKS": "129"}, "DTENJAX_P2P_MAX_BLOCKS=129"),
    ("memory", dict(), {"DTENJAX_P2P_MAX_BLOCKS": "0"}, "DTENJAX_P2P_MAX_BLOCKS=0"),
    ("graph", dict(vmap_axes=("v",)), None, "vmap axis 'v'"),
    ("graph", dict(platforms=("cpu",)), None, "['cpu']"),
    ("graph", dict(platforms=("cuda", "rocm")), None, "['cuda', 'rocm']"),
    ("graph", dict(axis_context="ShardingContext"), None, "ShardingContext"),
]


@needs_extension
def test_the_base_call_and_the_documented_limits_pass(deployed, monkeypatch):
  assert p2p.gate(**BASE) == p2p.Verdict(True)
  for kw in (dict(world=1), dict(world=8), dict(dtype=jnp.bfloat16), dict(dtype=jnp.float16),
             dict(op="mean"), dict(algorithm="two_shot"),
             dict(contract=Contract.V3), dict(contract=Contract.V2, op="mean"),
             dict(contract=Contract.V3, dtype=jnp.bfloat16), dict(platforms=("cuda",)),
             dict(world=np.int64(4))):
    v = p2p.gate(**{**BASE, **kw})
    assert v.ok, (kw, v.reason)
  for knob, value in (("DTENJAX_P2P_MAX_BLOCKS", "1"), ("DTENJAX_P2P_MAX_BLOCKS", "128"),
                      ("DTENJAX_P2P_BUFFER_BYTES", "16")):
    monkeypatch.setenv(knob, value)
    assert p2p.gate(**BASE).ok, (knob, value)
    monkeypatch.delenv(knob)


@needs_extension
@pytest.mark.parametrize("condition,change,setup,named", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_call_violating_one_condition_is_refused_naming_it(deployed, monkeypatch, condition,
                                                             change, setup, named):
  if isinstance(setup, dict):
    for k, v in setup.items():
      monkeypatch.setenv(k, v)
  elif setup is not None:
    setup(monkeypatch)
  v = p2p.gate(**{**BASE, **change})
  assert not v.ok
  assert v.failed == (condition,), v
  assert named in v.reason, v.reason
  assert str(v) == v.reason


def test_every_condition_has_a_case():
  assert {c[0] for c in CASES} == set(p2p.CONDITIONS)


def test_deployment_is_asked_of_the_process(monkeypatch):
  monkeypatch.setattr(p2p, "unavailable_reason", lambda: "no CUDA GPU is visible (test)")
  v = p2p.gate(**BASE)
  assert not v.ok and v.failed == ("deployment",) and "no CUDA GPU is visible (test)" in v.reason
  if ffi.is_built():      # the simulated-rank harness brings its own devices
    assert p2p.gate(**BASE, deployment=False).ok
    assert p2p.gate(**{**BASE, "world": 9}, deployment=False).failed == ("world",)


@needs_extension
def test_every_problem_is_listed_at_once(deployed, monkeypatch):
  monkeypatch.setenv("DTENJAX_P2P_MAX_BLOCKS", "500")
  v = p2p.gate(**{**BASE, "world": 9, "dtype": jnp.int32, "op": "prod", "axes": ("a", "b"),
                  "vmap_axes": ("a",)})
  assert v.failed == ("axes", "world", "dtype", "op", "memory", "graph")
  for part in ("('a', 'b')", "world size 9", "int32", "'prod'", "DTENJAX_P2P_MAX_BLOCKS=500",
               "vmap axis 'a'"):
    assert part in v.reason, (part, v.reason)


# --- every site asks the gate, and prints its reason -------------------------------------------

def _call(**kw):
  base_kw = dict(kind="all_reduce", op="sum", dtype=jnp.float32, axes=("x",), axis_sizes=(2,),
                 nbytes=1 << 10, backend="gpu")
  base_kw.update(kw)
  return base.Call(**base_kw)


@needs_extension
def test_the_records_supports_is_the_gates_reason(deployed):
  for kw in (dict(), dict(axis_sizes=(16,)), dict(dtype=jnp.int32),
             dict(contract=Contract.V3, contributions=3), dict(kind="reduce_scatter"),
             dict(axes=("a", "b"), axis_sizes=(2, 2)), dict(mesh_axes=False)):
    call = _call(**kw)
    want = p2p.gate(world=call.world, dtype=call.dtype, op=call.op, contract=call.contract,
                    backend=call.backend, kind=call.kind, axes=call.axes,
                    vmap_axes=() if call.mesh_axes else call.axes,
                    contributions=call.contributions)
    assert nvlink.ONE_SHOT.supports(call) == (None if want.ok else want.reason), kw


@needs_extension
def test_plan_all_reduce_prints_the_gates_reason(deployed):
  topo = dtenjax.Topology.fixture("dgx_a100_8")
  choice = plan_all_reduce(4 << 10, list(range(8)), topo, dtype=jnp.int32, backend="gpu")
  want = p2p.gate(world=8, dtype=jnp.int32).reason
  assert not choice.algorithm.startswith("nvlink_")
  assert f"nvlink_one_shot: {want}" in choice.reason and "int32" in want


def test_explain_prints_the_gates_reasons(cpu_devices, monkeypatch):
  # a GPU step as the collectives see it (backend "gpu"), on this machine's CPU devices: the
  # gate refuses the NVLink records (no GPU here) and explain's table says why
  real_context = common.context
  monkeypatch.setattr(common, "context", lambda axes: real_context(axes)._replace(backend="gpu"))
  monkeypatch.setattr(dtenjax.Topology, "current",
                      classmethod(lambda cls: dtenjax.Topology.fixture("dgx_a100_8")))
  mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("x",))
  f = jax.jit(jax.shard_map(lambda v: dtenjax.all_reduce(v, "x", algorithm="one_shot"),
                            mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"),
                            check_vma=False))
  e = dtenjax.explain(f, jnp.ones((4 * 16,), jnp.int32))
  want = p2p.gate(world=4, dtype=jnp.int32).reason
  assert ("NVLink kernels not used", want) in e.extra
  assert f"NVLink kernels not used: {want}" in e.table()


def test_refusals_are_collected_only_inside_the_block():
  with p2p.refusals() as seen:
    p2p.gate(**BASE)
  outside = p2p.gate(**BASE)
  if outside.ok:
    pytest.skip("the kernels can run here: nothing refused")
  assert seen == [outside.reason]
  with p2p.refusals() as cpu_only:
    p2p.gate(**{**BASE, "backend": "cpu"})    # not a GPU call: nothing to explain
  assert cpu_only == []


# --- the one place -------------------------------------------------------------------------------

# Names of the kernels' limits and vocabulary tables: only gpu/p2p.py may spell them.
LIMIT_NAMES = {"MAX_WORLD", "DESCRIPTOR_BYTES", "max_world", "vector_bytes", "descriptor_bytes",
               "reproducible_dtypes", "p2p.limits", "p2p.dtype", "p2p.dtype_reproducible",
               "p2p.op", "p2p.algorithm", "p2p.reproducible"}
# Inside gpu/p2p.py, what reads a condition: only ``gate`` may.
CONDITION_ATTRS = {"max_world", "max_blocks", "vector_bytes", "dtypes", "reproducible_dtypes"}
MEMBERSHIP_OF = {"ops", "algorithms", "reproducible", "dtypes", "reproducible_dtypes"}
# What the rest of dtenjax may use of gpu/p2p.py; the test extension's harness
# (dtenjax/testing/native.py) also passes on the attributes the lowering rule encodes.
P2P_API = {"gate", "all_reduce", "refusals", "Verdict", "kernel_timeouts", "CONDITIONS"}
HARNESS = SRC / "testing" / "native.py"
HARNESS_API = P2P_API | {"_attributes", "capacity_bytes", "max_blocks", "_timeout_ms"}


def _docstrings(tree):
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        out.add(id(body[0].value))
  return out


def _spelled(tree) -> set[str]:
  """Identifiers, attributes, keywords and string constants (not docstrings) of a module."""
  docs, out = _docstrings(tree), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name):
      out.add(node.id)
    elif isinstance(node, ast.Attribute):
      out.add(node.attr)
    elif isinstance(node, ast.keyword) and node.arg:
      out.add(node.arg)
    elif isinstance(node, ast.alias):
      out.add(node.name.rpartition(".")[2])
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docs):
      out.add(node.value)
  return out


def test_no_other_module_names_the_limits_or_the_vocabulary():
  offenders = {}
  for path in sorted(SRC.rglob("*.py")):
    if path == P2P:
      continue
    names = _spelled(parsed(path)) & LIMIT_NAMES
    if names:
      offenders[str(path.relative_to(SRC.parent))] = sorted(names)
  assert not offenders, offenders


def test_the_rest_of_dtenjax_asks_only_the_gate():
  used, bad = {}, {}
  for path in sorted(SRC.rglob("*.py")):
    if path == P2P:
      continue
    allowed = HARNESS_API if path == HARNESS else P2P_API
    tree = parsed(path)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id == "p2p"):
        used.setdefault(node.attr, set()).add(path.name)
        if node.attr not in allowed:
          bad.setdefault(str(path.relative_to(SRC.parent)), set()).add(node.attr)
  assert not bad, bad
  # the NVLink records' supports (pricing/algorithms.py, below collectives) ask the gate
  assert "gate" in used and "algorithms.py" in used["gate"]


def _enclosing_functions(tree):
  """(node, name of the outermost function it sits in, or None at module/class level)."""
  def visit(node, fn):
    for child in ast.iter_child_nodes(node):
      inner = fn
      if fn is None and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        inner = child.name
      yield child, inner
      yield from visit(child, inner)
  yield from visit(tree, None)


def test_inside_p2p_only_the_gate_reads_the_conditions():
  readers = {}
  for node, fn in _enclosing_functions(ast.parse(P2P.read_text())):
    what = None
    if isinstance(node, ast.Attribute) and node.attr in CONDITION_ATTRS:
      what = f".{node.attr}"
    elif isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn))
                                               for o in node.ops):
      for c in node.comparators:
        if isinstance(c, ast.Attribute) and c.attr in MEMBERSHIP_OF:
          what = f"in .{c.attr}"
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("unavailable_reason", "capacity_bytes")):
      what = f"{node.func.id}()"
    if what is not None and fn != "gate":
      readers.setdefault(fn, set()).add(what)
  # _lower and native set-up read the values they pass on (max_blocks(), the descriptor size),
  # never a condition: what is left may only be the gate's
  allowed = {"prepare": {"capacity_bytes()"}}
  assert {k: v for k, v in readers.items() if allowed.get(k) != v} == {}, readers
