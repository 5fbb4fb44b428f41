"""The layering of dtenjax/_src (docs/architecture.md): imports flow downward, never in a circle;
no import cycle in the whole package or in bench/, and no bench imports from tests/.

Reads every module's imports (module level and inside functions) with ``ast``, so a lazy import
that climbs a layer or closes a cycle fails here as surely as a top-level one.
"""

import ast
import pathlib
import re

import pytest

from tests.helpers import parsed

SRC = pathlib.Path(__file__).resolve().parents[1] / "dtenjax" / "_src"

# Package (or base module) -> layer; a module may import its own package and lower layers only.
LAYERS = {
    "net": 1, "gpu": 1,
    "topology": 2, "pipeline": 2,
    "pricing": 3,
    "planning": 4,
    "collectives": 5, "checkpoint": 5,
    "compression": 6, "serving": 6, "elastic": 6,
    "cli": 7,
}


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in SRC.rglob("*.py"):
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(["dtenjax", "_src"] + parts)] = path
  return out


def _imports(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
  """dtenjax._src modules imported by the module at ``path`` (anywhere in it)."""
  tree = parsed(path)
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      base = node.module
      if node.level:   # relative imports: resolve against the package
        pkg = name.split(".")[:-node.level + (1 if path.name == "__init__.py" else 0) or None]
        base = ".".join(pkg + [node.module])
      targets = [f"{base}.{a.name}" for a in node.names] + [base]
    else:
      continue
    for t in targets:
      while t and t not in known:
        t = t.rpartition(".")[0]
      if t and t != name and t.startswith("dtenjax._src."):
        found.add(t)
  return found


BASE = ("errors", "config", "ffi", "hlo", "jaxapi", "tables", "contract")  # base modules: one group


def _layer_of(module: str) -> tuple[str, int]:
  top = module.split(".")[2]
  if top in BASE:
    return "base", 0
  if top not in LAYERS:
    raise AssertionError(f"{module}: package {top!r} has no layer in tests/test_architecture.py; "
                         "add it (and to docs/architecture.md)")
  return top, LAYERS[top]


def _graph():
  mods = _modules()
  known = set(mods)
  return {m: _imports(p, m, known) for m, p in mods.items()}


def test_every_package_has_a_layer():
  for module in _modules():
    if module != "dtenjax._src":
      _layer_of(module)


def test_imports_flow_downward():
  problems = []
  for module, deps in sorted(_graph().items()):
    if module == "dtenjax._src":
      continue
    top, layer = _layer_of(module)
    for dep in sorted(deps):
      dtop, dlayer = _layer_of(dep)
      if dtop != top and dlayer >= layer:
        problems.append(f"{module} (layer {layer}) imports {dep} (layer {dlayer})")
  assert not problems, "imports that climb or cross a layer:\n" + "\n".join(problems)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Every cycle a depth-first walk of ``graph`` closes, each as ``[a, b, ..., a]``."""
  state: dict[str, int] = {}
  cycles = []

  def visit(node, stack):
    state[node] = 1
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == 1:
        cycles.append(stack[stack.index(dep):] + [dep])
      elif dep not in state:
        visit(dep, stack)
    stack.pop()
    state[node] = 2

  for node in sorted(graph):
    if node not in state:
      visit(node, [])
  return cycles


def _no_cycles(graph: dict[str, set[str]], what: str) -> None:
  cycles = _cycles(graph)
  assert not cycles, f"import cycles in {what}:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycles():
  _no_cycles(_graph(), "dtenjax/_src")


# --- the whole package and bench/ ---------------------------------------------------------------

ROOT = SRC.parents[1]
BENCH = ROOT / "bench"


def _package_graph() -> dict[str, set[str]]:
  """Every module of dtenjax (the public modules, dtenjax.testing, _src) -> the dtenjax modules
  it imports. A package's ``__init__`` importing its own submodules is how packages are built,
  and a submodule's import of a name from its parent package runs that ``__init__`` first, so
  edges from a module up to a package that contains it are left out."""
  out = {}
  pkg = ROOT / "dtenjax"
  for path in pkg.rglob("*.py"):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  known = set(out)
  graph = {}
  for m, p in out.items():
    deps = set()
    tree = parsed(p)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        targets = [f"{node.module}.{a.name}" for a in node.names]
      else:
        continue
      for t in targets:
        while t and t not in known:
          t = t.rpartition(".")[0]
        if t and t != m and not m.startswith(t + "."):
          deps.add(t)
    graph[m] = deps
  return graph


def _bench_graph(bench: pathlib.Path = BENCH) -> dict[str, set[str]]:
  """bench/'s scripts and helpers -> the bench modules each imports (``import _harness``: the
  directory of the script Python runs is on the path)."""
  scripts = {p.stem: p for p in bench.glob("*.py")}
  graph = {}
  for name, path in scripts.items():
    deps = set()
    for node in ast.walk(parsed(path)):
      if isinstance(node, ast.Import):
        deps |= {a.name.split(".")[0] for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
        deps.add(node.module.split(".")[0])
    graph[name] = {d for d in deps if d in scripts and d != name}
  return graph


def test_no_import_cycles_in_the_package():
  graph = _package_graph()
  assert "dtenjax.testing.native" in graph and "dtenjax._src.hlo.text" in graph
  _no_cycles(graph, "dtenjax")


def test_no_import_cycles_in_bench():
  graph = _bench_graph()
  assert "_harness" in graph["allreduce"]     # the reader sees bench's own imports
  _no_cycles(graph, "bench/")


def test_the_cycle_finder_names_the_cycle(tmp_path):
  (tmp_path / "a.py").write_text("import b\n")
  (tmp_path / "b.py").write_text("def f():\n  from c import x\n  return x\n")
  (tmp_path / "c.py").write_text("import os\nimport a\n")
  (tmp_path / "d.py").write_text("import a\n")
  graph = _bench_graph(tmp_path)
  assert _cycles(graph) == [["a", "b", "c", "a"]]
  with pytest.raises(AssertionError, match="a -> b -> c -> a"):
    _no_cycles(graph, "tmp")


def test_benches_import_nothing_from_tests():
  """What benches and tests share lives in dtenjax (dtenjax.testing) or bench/_harness.py."""
  bench_modules = {p.stem for p in BENCH.glob("*.py")}
  test_modules = ({p.stem for p in (ROOT / "tests").glob("*.py")}
                  | {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()} | {"tests"})
  test_modules -= bench_modules
  problems = []
  for path in sorted(BENCH.glob("*.py")):
    text = path.read_text()
    for node in ast.walk(parsed(path)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
      problems += [f"bench/{path.name}:{node.lineno} imports {n}" for n in names
                   if n.split(".")[0] in test_modules]
    if re.search(r"sys\.path\.insert\([^\n]*tests", text):
      problems.append(f"bench/{path.name} puts tests/ on sys.path")
  assert not problems, "\n".join(problems)


def test_the_checker_sees_lazy_imports(tmp_path):
  """A function-level import is an import: the checker must not be blind to it."""
  pkg = tmp_path / "dtenjax" / "_src" / "net"
  pkg.mkdir(parents=True)
  mod = pkg / "x.py"
  mod.write_text("def f():\n  from dtenjax._src.planning import planner\n  return planner\n")
  deps = _imports(mod, "dtenjax._src.net.x", {"dtenjax._src.planning.planner",
                                               "dtenjax._src.net.x"})
  assert deps == {"dtenjax._src.planning.planner"}


def test_package_docstrings_state_their_layer():
  """Each package's docstring opens with "Layer N:", N its layer here (and in
  docs/architecture.md's table, which test_docs_state_the_layers checks)."""
  problems = []
  for pkg, layer in sorted(LAYERS.items()):
    doc = ast.get_docstring(ast.parse((SRC / pkg / "__init__.py").read_text())) or ""
    if not doc.startswith(f"Layer {layer}:"):
      problems.append(f"dtenjax/_src/{pkg}/__init__.py: {doc[:30]!r} (want 'Layer {layer}:')")
  assert not problems, "\n".join(problems)


def test_docs_state_the_layers():
  """docs/architecture.md's layer table gives each package the layer this file checks."""
  text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
  table = {pkg: int(n) for n, pkg in re.findall(r"^(\d)\s+(\w+)/\s", text, flags=re.M)}
  assert table == LAYERS
  assert re.search(r"^0\s+" + r"\s+".join(BASE[:3]), text, flags=re.M)


# --- private JAX: one module reads it (dtenjax/_src/jaxapi.py) ------------------------------------

PRIVATE_JAX_OWNER = SRC / "jaxapi.py"


def _private_jax_uses(path: pathlib.Path) -> list[str]:
  """Where the module at ``path`` imports ``jax._src`` or reads ``jax._src`` as an attribute
  (``import jax._src.x``, ``from jax._src import x``, ``from jax import _src``, ``jax._src.x``)."""
  tree = parsed(path)
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found += [f"line {node.lineno}: import {a.name}" for a in node.names
                if a.name == "jax._src" or a.name.startswith("jax._src.")]
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      mod = node.module
      if mod == "jax._src" or mod.startswith("jax._src.") or (
          mod in ("jax", "jaxlib") and any(a.name == "_src" for a in node.names)):
        found.append(f"line {node.lineno}: from {mod} import ...")
    elif (isinstance(node, ast.Attribute) and node.attr == "_src"
          and isinstance(node.value, ast.Name) and node.value.id in ("jax", "jaxlib")):
      found.append(f"line {node.lineno}: {node.value.id}._src")
  return found


def test_only_jaxapi_touches_private_jax():
  problems = []
  for path in sorted((SRC.parent).rglob("*.py")):
    if path != PRIVATE_JAX_OWNER:
      problems += [f"{path.relative_to(SRC.parent.parent)} {u}" for u in _private_jax_uses(path)]
  assert not problems, ("private JAX outside dtenjax/_src/jaxapi.py (add a helper there):\n"
                        + "\n".join(problems))
  assert _private_jax_uses(PRIVATE_JAX_OWNER)   # the owner is where they are


# Equation parameters jax 0.10 has and jax 0.11 does not (a scan's counts are ``ft_in`` there):
# read through jaxapi.scan_counts, which knows both; CI runs jax 0.10 only, so a direct read
# fails only on the GPU machine's jax 0.11 (110 tests did, once).
VERSIONED_PARAMS = ("num_consts", "num_carry")


def test_scan_parameters_that_moved_between_jax_versions_are_read_in_jaxapi_only():
  problems = []
  for path in sorted((SRC.parent).rglob("*.py")):
    if path == PRIVATE_JAX_OWNER:
      continue
    for node in ast.walk(parsed(path)):
      if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
          and node.slice.value in VERSIONED_PARAMS):
        problems.append(f"{path.relative_to(SRC.parent.parent)} line {node.lineno}: "
                        f"[{node.slice.value!r}]")
  assert not problems, ("read through jaxapi.scan_counts (jax 0.11 has no such parameter):\n"
                        + "\n".join(problems))


@pytest.mark.parametrize("source", [
    "from jax._src import core\n", "import jax._src.mesh\n", "from jax import _src\n",
    "import jax\ndef f():\n  return jax._src.core.typeof\n",
    "def f():\n  from jax._src.lib import _jax\n  return _jax\n"])
def test_the_private_jax_check_sees_every_form(tmp_path, source):
  mod = tmp_path / "x.py"
  mod.write_text(source)
  assert _private_jax_uses(mod)
  mod.write_text("import jax\nfrom jax import lax\nx = jax.sharding.Mesh\n")
  assert not _private_jax_uses(mod)


if __name__ == "__main__":
  pytest.main([__file__])


def _is_type_narrowing(test: ast.expr) -> bool:
  """``isinstance(...)`` / ``x is None`` / ``x is not None`` (and ``and`` of them): what a type
  checker narrows on. Anything else is a check that ``python -O`` drops and users see as a bare
  AssertionError."""
  if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
    return all(_is_type_narrowing(v) for v in test.values)
  if isinstance(test, ast.Call) and isinstance(test.func, ast.Name):
    return test.func.id in ("isinstance", "issubclass")
  return (isinstance(test, ast.Compare) and len(test.ops) == 1 and
          isinstance(test.ops[0], (ast.Is, ast.IsNot)) and
          isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None)


def _bare_asserts(root: pathlib.Path) -> list[str]:
  found = []
  for path in sorted(root.rglob("*.py")):
    for node in ast.walk(parsed(path)):
      if isinstance(node, ast.Assert) and not _is_type_narrowing(node.test):
        found.append(f"{path}:{node.lineno}: assert {ast.unparse(node.test)}")
  return found


def test_no_bare_asserts_in_the_library():
  """Bad input gets a DtenjaxError naming the value; an invariant that fails gets an error that
  says what broke. A bare assert gives neither (and vanishes under python -O)."""
  assert _bare_asserts(SRC.parent) == []


def test_the_assert_check_sees_a_bare_assert(tmp_path):
  (tmp_path / "m.py").write_text("def f(x, y):\n  assert isinstance(x, int)\n  assert y is not None"
                                 "\n  assert x > 0\n")
  assert _bare_asserts(tmp_path) == [f"{tmp_path / 'm.py'}:4: assert x > 0"]


# --- nothing installs itself into a lower layer at import ----------------------------------------

def _module_level_calls(tree: ast.Module):
  """Call nodes of statements that run at import (module level, outside functions and classes)."""
  for stmt in tree.body:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    yield from (n for n in ast.walk(stmt) if isinstance(n, ast.Call))


def test_no_module_installs_into_another_package_at_import():
  """Pricing sits below planning and the collectives, which both import it; before, importing
  collectives/api.py installed the planner's all-reduce price with a setter
  (``planner.set_all_reduce_time``), a dependency that ran upward at import time. No module may
  call a ``set_*``/``install*``/``register*`` function of another dtenjax package's module at
  import, and the planning layer defines no such setter."""
  mods = _modules()
  problems = []
  for name, path in sorted(mods.items()):
    tree = parsed(path)
    imported = {}     # local alias -> dtenjax module it names
    for node in tree.body:
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dtenjax."):
        for a in node.names:
          full = f"{node.module}.{a.name}"
          if full in mods:
            imported[a.asname or a.name] = full
    top = (name.split(".") + [""])[2]
    for call in _module_level_calls(tree):
      f = call.func
      if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and
          f.value.id in imported and f.attr.startswith(("set_", "install", "register")) and
          (imported[f.value.id].split(".") + [""])[2] != top):
        problems.append(f"{name} calls {imported[f.value.id]}.{f.attr} at import")
  for name, path in mods.items():
    if name.startswith("dtenjax._src.planning"):
      tree = parsed(path)
      problems += [f"{name} defines {n.name}" for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name.startswith(("set_all_reduce",
                                                                            "install"))]
  assert not problems, "\n".join(problems)
