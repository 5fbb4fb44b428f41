"""Test set-up: 8 simulated CPU devices unless a GPU run asks otherwise.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
test session. On the GPU machine set DTENJAX_TEST_PLATFORM=gpu to keep the GPU as default backend.
"""

import os

if os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402  (must follow the environment set-up)
import pytest  # noqa: E402
from procs import PROCS  # noqa: E402  (tests/procs.py: why such tests share a group)


def _has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


HAS_GPU = _has_gpu()



@pytest.hookimpl(tryfirst=True)      # before pytest-xdist reads the groups (its hook tags node ids)
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


@pytest.fixture(scope="session")
def cpu_devices():
  devs = jax.devices("cpu")
  assert len(devs) >= 8, f"tests need 8 simulated CPU devices, found {len(devs)}"
  return devs[:8]
