"""Install truth: what pyproject.toml declares is what dtenjax needs, the README lists it, the
jax bound admits the versions the suite passed on, and the version is written once."""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import dtenjax
from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPENDENCIES = {Requirement(r).name: Requirement(r) for r in PYPROJECT["project"]["dependencies"]}
# The jax releases the whole suite has passed on: CPU CI (Python 3.11) and the GPU machine
# (Python 3.12). Add one here when the suite passes on it, then raise the bound in pyproject.toml.
PASSED_ON = ("0.10.2", "0.11.2")


# One fresh process for two claims (starting jax is most of its time): it plans through the
# _src modules alone, before anything loaded the collectives layer, then loads every public name.
FRESH = """
import json, sys
import jax
before = set(sys.modules)
import numpy as np
from dtenjax._src.planning import planner
from dtenjax._src.topology.model import Topology
public = ("common", "all_reduce", "reduce_scatter", "all_gather", "plan_all_reduce")
untouched = not {"dtenjax._src.collectives." + m for m in public} & set(sys.modules)
t = Topology.fixture("dgx_a100_8")
p = planner.plan_tensor((4096, 4096), "bfloat16", (2, 4), ("x", "y"),
                        np.array(sorted(t.device_ids)).reshape(2, 4), t)
import dtenjax
[getattr(dtenjax, n) for n in dtenjax.__all__]
print(json.dumps({"modules": sorted({m.split(".")[0] for m in set(sys.modules) - before}),
                  "untouched": untouched, "strategy": p.strategy,
                  "comm_s": min(c.comm_s for c in p.candidates if c.feasible)}))
"""


pytestmark = helpers.one_worker(__name__)    # its fresh interpreter's report, made once


@pytest.fixture(scope="module")
def fresh():
  r = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=120,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.splitlines()[-1])


def test_planning_through_the_src_modules_alone_finds_the_default_pricing(fresh):
  """The planner prices all-reduces with the collectives layer's chooser, which that layer
  installs when imported; with the public names loaded on first use, a caller of the _src
  modules (the command line, a bench) may plan before anything loaded it."""
  assert fresh["untouched"]                   # nothing had loaded the collectives layer
  assert fresh["strategy"] == "2d" and fresh["comm_s"] > 0, fresh


def test_every_import_time_dependency_is_declared(fresh):
  """The third-party distributions whose modules ``import dtenjax`` loads with every public name
  (they load on first use; beyond what importing jax loads, which jax declares) are dependencies
  in pyproject.toml."""
  top = [m for m in fresh["modules"]
         if m not in sys.stdlib_module_names and not m.startswith("_") and m != "dtenjax"]
  owners = importlib.metadata.packages_distributions()
  dists = {Requirement(d).name.lower() for m in top for d in owners.get(m, [m])}
  assert "protobuf" in dists, dists                          # hlo/proto.py, at import
  missing = dists - {n.lower() for n in DEPENDENCIES}
  assert not missing, f"imported by `import dtenjax` but not declared: {missing}"


def test_the_readme_install_line_lists_every_dependency():
  line = next(ln for ln in (ROOT / "README.md").read_text().splitlines()
              if ln.startswith("pip install .  "))
  for name in DEPENDENCIES:
    assert name in line, (name, line)


def test_the_jax_bound_admits_the_versions_passed_on_and_no_untested_minor():
  newest = max(map(Version, PASSED_ON))
  next_minor = Version(f"{newest.major}.{newest.minor + 1}")
  for name in ("jax", "jaxlib"):
    spec = DEPENDENCIES[name].specifier
    for v in PASSED_ON:
      assert spec.contains(v), (name, v, spec)
    assert not spec.contains(str(next_minor)), (name, spec, "no upper bound past", newest)
    assert {s.operator for s in spec} == {">=", "<"} and any(
        s.operator == "<" and Version(s.version) == next_minor for s in spec), spec
    assert spec.contains(importlib.metadata.version(name)), "the installed one is outside"


def test_the_build_requirements_and_setup_script_use_the_same_jax_bound():
  build = {Requirement(r).name: Requirement(r) for r in PYPROJECT["build-system"]["requires"]}
  setup = (ROOT / "scripts" / "setup.sh").read_text()
  reqs = re.search(r"^BUILD_REQS=\((.*)\)$", setup, re.M).group(1)
  setup_reqs = {Requirement(r).name: Requirement(r) for r in re.findall(r'"([^"]+)"', reqs)}
  for name in ("jax", "jaxlib"):
    assert build[name].specifier == DEPENDENCIES[name].specifier, name
    assert setup_reqs[name].specifier == DEPENDENCIES[name].specifier, name


def test_the_version_is_written_once():
  assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
  config = PYPROJECT["tool"]["scikit-build"]["metadata"]["version"]
  assert config["input"] == "dtenjax/__init__.py"
  assert importlib.metadata.version("dtenjax") == dtenjax.__version__
  versions = re.findall(r"^__version__ = \"([^\"]+)\"$",
                        (ROOT / "dtenjax" / "__init__.py").read_text(), re.M)
  assert versions == [dtenjax.__version__]


def test_shared_dependencies_are_bounded_no_lower_than_jax_bounds_them():
  """numpy and scipy (the step planner's MILP) are dtenjax's own dependencies too: a floor below
  the installed jax's floor promises an install that pip cannot make."""
  jax_reqs = {r.name: r for r in map(Requirement, importlib.metadata.requires("jax") or [])
              if r.marker is None}
  assert "scipy" in DEPENDENCIES, "step.py imports scipy.optimize: declare it"
  for name in ("numpy", "scipy"):
    ours = [Version(s.version) for s in DEPENDENCIES[name].specifier if s.operator == ">="]
    theirs = [Version(s.version) for s in jax_reqs[name].specifier if s.operator == ">="]
    assert ours and theirs, (name, DEPENDENCIES[name], jax_reqs.get(name))
    assert ours[0] >= theirs[0], f"{name}: ours {ours[0]} is below jax's floor {theirs[0]}"


def test_dtenjax_info_reports_every_extra_with_its_packages():
  """``dtenjax info`` lists each extra of pyproject.toml and checks a module of each of its
  distributions."""
  from dtenjax._src.cli import info
  extras = PYPROJECT["project"]["optional-dependencies"]
  assert set(info.EXTRAS) == set(extras)
  for extra, requirements in extras.items():
    declared = {Requirement(r).name.lower().replace("_", "-") for r in requirements}
    shown = {info.PACKAGES[m].lower().replace("_", "-") for m in info.EXTRAS[extra]}
    assert shown == declared, (extra, shown, declared)
