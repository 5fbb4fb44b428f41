"""Test set-up: 8 simulated CPU devices unless a GPU run asks otherwise.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
test session. On the GPU machine set DTENJAX_TEST_PLATFORM=gpu to keep the GPU as default backend.
"""

import json
import os
import pathlib
import shutil
import tempfile

if os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must follow the environment set-up)
import pytest  # noqa: E402


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()


# Tests that start several processes of their own share an xdist group: scripts/test.sh runs two
# pytest-xdist workers on a 2-core machine, and two such tests at once would put 8 busy processes
# on 2 cores (their timeouts were chosen for one test at a time). The tests of a group run one
# after another in one worker while the other worker goes on with the rest.
PROCS = pytest.mark.xdist_group("procs")


def pytest_collection_modifyitems(config, items):
  del config
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to jax here "
                              "(run on the GPU machine with scripts/gpu_check.sh)")
  for item in items:
    if item.get_closest_marker("gpu") is not None and not HAS_GPU:   # not keywords: a checkout in a directory named gpu would match
      item.add_marker(skip_gpu)
    if item.get_closest_marker("multiprocess") is not None:
      item.add_marker(PROCS)
  if os.environ.get("PYTEST_XDIST_WORKER"):
    # Longest first: xdist hands out tests in collection order, so a slow test collected last
    # (tests/test_wheel.py) would leave the other worker idle at the end. Stable: otherwise as
    # collected.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


# --- xdist groups, carried by us ------------------------------------------------------------
# pytest-xdist's --dist loadgroup passes a test's group by appending "@group" to its node id, which
# pytest 9.2 no longer lets a plugin change: the marks are silently ignored (pytest-xdist issue
# 1386). So each worker writes {node id: group} to a file when it has collected, and the
# controller schedules xdist's load-by-scope over those groups (tests/test_conftest.py checks it).

def _groups_file(config) -> pathlib.Path | None:
  workerinput = getattr(config, "workerinput", None)        # set in xdist workers only
  return pathlib.Path(workerinput["dtenjax_groups"]) if workerinput else None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):              # controller: once per worker, before it starts
  if _GROUPS_DIR not in node.config.stash:
    node.config.stash[_GROUPS_DIR] = tempfile.mkdtemp(prefix="dtenjax-xdist-")
  d = node.config.stash[_GROUPS_DIR]
  node.workerinput["dtenjax_groups"] = os.path.join(d, node.gateway.id + ".json")


@pytest.hookimpl(tryfirst=True)      # before xdist's own hook sends the collection to the controller
def pytest_collection_finish(session):
  path = _groups_file(session.config)
  if path is not None:
    groups = {}
    for item in session.items:
      names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                      for m in item.iter_markers("xdist_group")})
      if names:
        groups[item.nodeid] = "_".join(names)
    path.write_text(json.dumps(groups))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  if config.getoption("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=g-import-not-at-top

  class Groups(LoadScopeScheduling):
    """Load by scope, a scope being a test's group (or the test itself)."""
    _groups = None

    def _split_scope(self, nodeid):
      if self._groups is None:     # every worker has collected (and written) by the first call
        d = config.stash[_GROUPS_DIR]
        self._groups = {}
        for name in sorted(os.listdir(d)):
          self._groups.update(json.loads(pathlib.Path(d, name).read_text()))
      return self._groups.get(nodeid, nodeid)

  return Groups(config, log)


def pytest_unconfigure(config):
  d = config.stash.get(_GROUPS_DIR, None)
  if d is not None:
    shutil.rmtree(d, ignore_errors=True)


_GROUPS_DIR = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def cpu_devices():
  devs = jax.devices("cpu")
  assert len(devs) >= 8, f"tests need 8 simulated CPU devices, found {len(devs)}"
  return devs[:8]
