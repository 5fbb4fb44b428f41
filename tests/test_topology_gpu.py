"""Topology.detect() on a real GPU machine, checked against nvidia-smi and sysfs (independent of
dtenjax's own reading): every jax GPU gets the PCI bus id nvidia-smi reports for it, its NUMA node
from sysfs, and, with several GPUs, the NVLink class nvidia-smi's matrix shows.

Run on the GPU machine:  DTENJAX_TEST_PLATFORM=gpu python -m pytest -q -m gpu tests/test_topology_gpu.py
"""

import importlib.util
import os
import re
import shutil
import subprocess

import jax
import pytest

from dtenjax._src.topology import detect
from dtenjax._src.topology.model import Topology

pytestmark = pytest.mark.gpu

HAS_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None
HAS_NVML = importlib.util.find_spec("pynvml") is not None


def _smi(*args):
  if shutil.which("nvidia-smi") is None:
    pytest.skip("nvidia-smi is not on PATH; the check compares with it")
  return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True,
                        timeout=60).stdout


def _visible_bus_ids():
  """nvidia-smi's bus ids of the GPUs CUDA numbers 0, 1, ... (CUDA_VISIBLE_DEVICES applied; CUDA's
  default order is fastest first, which is PCI order on machines of one GPU model)."""
  rows = [ln.split(",") for ln in _smi("--query-gpu=index,pci.bus_id", "--format=csv,noheader")
          .strip().splitlines()]
  by_index = {int(i): detect.normalize_bus_id(b.strip()) for i, b in rows}
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  order = ([int(v) for v in visible.split(",") if v.strip().isdigit()] if visible else
           sorted(by_index))
  return [by_index[i] for i in order]


@pytest.mark.skipif(not HAS_CUDA_PYTHON, reason="needs cuda-python (pip install 'dtenjax[gpu]')")
def test_bus_ids_and_numa_nodes_match_nvidia_smi_and_sysfs():
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  t = Topology.detect()
  expected = _visible_bus_ids()
  got = {d.id: d for d in t.devices}
  for g in gpus:
    info = got[g.id]
    assert info.pci_bus_id == expected[g.local_hardware_id], (g, info)
    with open(f"/sys/bus/pci/devices/{info.pci_bus_id}/numa_node", encoding="utf-8") as f:
      node = int(f.read())
    assert info.numa_node == max(node, 0)
  assert not any("cuda-python" in n for n in t.notes), t.notes


@pytest.mark.skipif(not (HAS_CUDA_PYTHON and HAS_NVML),
                    reason="needs dtenjax[gpu] (cuda-python and nvidia-ml-py)")
def test_link_classes_match_nvidia_smi_topo():
  gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
  if len(gpus) < 2:
    pytest.skip(f"{len(gpus)} GPU: no pair to compare with nvidia-smi topo -m")
  t = Topology.detect()
  lines = [ln for ln in _smi("topo", "-m").splitlines() if re.match(r"^\s*GPU\d+\s", ln)]
  cells = {int(ln.split()[0][3:]): ln.split()[1:] for ln in lines}
  bus = _visible_bus_ids()
  smi_index = {b: i for i, b in enumerate(detect.normalize_bus_id(x.split(",")[1].strip())
                                          for x in _smi("--query-gpu=index,pci.bus_id",
                                                        "--format=csv,noheader").splitlines())}
  for a in gpus:
    for b in gpus:
      if a.id == b.id:
        continue
      code = cells[smi_index[bus[a.local_hardware_id]]][smi_index[bus[b.local_hardware_id]]]
      ours = t.link_class(a.id, b.id)
      if code.startswith("NV"):
        assert ours in ("nvlink", "nvswitch"), (a, b, code, ours)
      else:
        assert ours in ("pcie", "numa_cross"), (a, b, code, ours)


def test_links_not_seen_are_unknown_never_pcie():
  t = Topology.detect()
  assert all(d.platform == "gpu" for d in t.devices)
  pairs = {t.link_class(a, b) for a in t.device_ids for b in t.device_ids if a != b}
  if not (HAS_CUDA_PYTHON and HAS_NVML) and pairs:
    assert pairs == {"unknown"} and any("dtenjax[gpu]" in n for n in t.notes), t.notes
