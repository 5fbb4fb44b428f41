"""GPU topology detection (dtenjax/_src/topology/detect.py) against recorded NVML, CUDA and sysfs
answers, through fakes that enforce the real call contracts:

* NVML (docs.nvidia.com/deploy/nvml-api, the names pynvml gives them): every call before
  ``nvmlInit`` (or after the matching ``nvmlShutdown``) fails with NVML_ERROR_UNINITIALIZED (1);
  ``nvmlInit`` without a driver fails with NVML_ERROR_DRIVER_NOT_LOADED (9); init/shutdown are
  reference counted; handles come from a PCI bus id in the formats NVML accepts
  (``domain:bus:device.function``, ``domain:bus:device``, ``bus:device.function``, hexadecimal),
  NVML_ERROR_INVALID_ARGUMENT (2) for a malformed id and NVML_ERROR_NOT_FOUND (6) for an absent
  GPU; per link, NVML_ERROR_INVALID_ARGUMENT for a link the GPU does not have and
  NVML_ERROR_NOT_SUPPORTED (3) on a GPU without NVLink; ``nvmlDeviceGetNvLinkState`` returns
  NVML_FEATURE_ENABLED (1) / DISABLED (0); remote PCI info spells busId ``%08X:%02X:%02X.0``
  (bytes, as pynvml's ctypes struct returns it); remote device types are GPU 0, IBMNPU 1, SWITCH 2;
  a driver without ``nvmlDeviceGetNvLinkRemoteDeviceType`` answers NVML_ERROR_FUNCTION_NOT_FOUND
  (13).
* CUDA runtime (cuda-python): ``cudaDeviceGetPCIBusId(len, device)`` returns ``(cudaError_t,
  bytes)``: cudaErrorInvalidValue (1) when ``len`` cannot hold the 13 characters of
  ``[domain]:[bus]:[device].[function]``, cudaErrorInvalidDevice (101) for an ordinal the process
  does not have (CUDA numbers only the GPUs CUDA_VISIBLE_DEVICES leaves, in its own order).
* sysfs: ``/sys/bus/pci/devices/<dddd:bb:dd.f>/numa_node`` holds the node or -1.

The machines are modelled on `nvidia-smi topo -m` of real systems: an 8 x H200 HGX board (18
NVLinks per GPU, all to NVSwitches, GPUs 0-3 on NUMA 0 and 4-7 on NUMA 1), a 4-GPU PCIe box with
two NVLink bridges (GPU0-GPU1, GPU2-GPU3) and an 8 x L40S PCIe box (no NVLink).
"""

import enum
import logging
import threading
import types

import pytest

from dtenjax._src import config
from dtenjax._src.net import kvstore
from dtenjax._src.topology import detect
from dtenjax._src.topology.model import Topology

H200_BUSES = ["0000:19:00.0", "0000:3B:00.0", "0000:4C:00.0", "0000:5D:00.0",
              "0000:9B:00.0", "0000:BB:00.0", "0000:CB:00.0", "0000:DB:00.0"]
SWITCH_BUSES = ["0000:05:00.0", "0000:06:00.0", "0000:07:00.0", "0000:08:00.0"]


# --- fakes ---------------------------------------------------------------------------------------


class NVMLError(Exception):
  def __init__(self, value):
    super().__init__(f"NVML error {value}")
    self.value = value


def _parse_nvml_bus(text):
  """NVML's accepted spellings -> (domain, bus, device), or None when malformed."""
  import re
  for pat in (r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$",
              r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)$",
              r"^()([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-9a-fA-F]+)$"):
    m = re.match(pat, text)
    if m:
      g = m.groups()
      return int(g[0] or "0", 16), int(g[1], 16), int(g[2], 16)
  return None


class FakeNvml:
  """pynvml with NVML's documented contract (module docstring). ``gpus`` maps a bus id to None (no
  NVLink) or a list of links ``(active, remote_type, remote_bus)``."""
  NVMLError = NVMLError
  NVML_ERROR_UNINITIALIZED = 1
  NVML_ERROR_INVALID_ARGUMENT = 2
  NVML_ERROR_NOT_SUPPORTED = 3
  NVML_ERROR_NOT_FOUND = 6
  NVML_ERROR_DRIVER_NOT_LOADED = 9
  NVML_ERROR_FUNCTION_NOT_FOUND = 13
  NVML_FEATURE_DISABLED = 0
  NVML_FEATURE_ENABLED = 1
  NVML_NVLINK_MAX_LINKS = 18
  NVML_NVLINK_DEVICE_TYPE_GPU = 0
  NVML_NVLINK_DEVICE_TYPE_IBMNPU = 1
  NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

  def __init__(self, gpus, *, driver=True, remote_type=True):
    self._gpus = {_parse_nvml_bus(b): links for b, links in gpus.items()}
    self._driver, self._remote_type = driver, remote_type
    self.refs = 0
    self.handles_asked = []

  def _ready(self):
    if self.refs == 0:
      raise NVMLError(self.NVML_ERROR_UNINITIALIZED)

  def nvmlInit(self):
    if not self._driver:
      raise NVMLError(self.NVML_ERROR_DRIVER_NOT_LOADED)
    self.refs += 1

  def nvmlShutdown(self):
    self._ready()
    self.refs -= 1

  def nvmlDeviceGetHandleByPciBusId(self, bus_id):
    self._ready()
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    key = _parse_nvml_bus(text)
    if key is None:
      raise NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
    if key not in self._gpus:
      raise NVMLError(self.NVML_ERROR_NOT_FOUND)
    self.handles_asked.append(text)
    return ("handle", key)

  def _link(self, handle, link):
    self._ready()
    if not (isinstance(handle, tuple) and handle[0] == "handle" and handle[1] in self._gpus):
      raise NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
    links = self._gpus[handle[1]]
    if links is None:
      raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
    if not 0 <= link < len(links):
      raise NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
    return links[link]

  def nvmlDeviceGetNvLinkState(self, handle, link):
    active, _, _ = self._link(handle, link)
    return self.NVML_FEATURE_ENABLED if active else self.NVML_FEATURE_DISABLED

  def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
    _, _, remote = self._link(handle, link)
    d, b, dev = _parse_nvml_bus(remote)
    return types.SimpleNamespace(busId=b"%08X:%02X:%02X.0" % (d, b, dev),
                                 busIdLegacy=b"%04X:%02X:%02X.0" % (d, b, dev),
                                 domain=d, bus=b, device=dev)

  def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
    if not self._remote_type:
      raise NVMLError(self.NVML_ERROR_FUNCTION_NOT_FOUND)
    _, kind, _ = self._link(handle, link)
    return kind


class CudaError(enum.IntEnum):
  cudaSuccess = 0
  cudaErrorInvalidValue = 1
  cudaErrorInvalidDevice = 101


class FakeCudart:
  """cuda-python's runtime: ``visible`` lists the bus ids of CUDA ordinals 0, 1, ..."""

  def __init__(self, visible):
    self._visible = list(visible)

  def cudaDeviceGetPCIBusId(self, length, device):
    if not 0 <= device < len(self._visible):
      return CudaError.cudaErrorInvalidDevice, b""
    if length < 13:
      return CudaError.cudaErrorInvalidValue, b""
    return CudaError.cudaSuccess, self._visible[device].encode().ljust(length, b"\0")


def _sysfs(tmp_path, numa):
  for bus, node in numa.items():
    d = tmp_path / "bus" / "pci" / "devices" / bus.lower()
    d.mkdir(parents=True)
    (d / "numa_node").write_text(f"{node}\n")
  for node in sorted({n for n in numa.values() if n >= 0}) or [0]:
    d = tmp_path / "devices" / "system" / "node" / f"node{node}"
    d.mkdir(parents=True)
    (d / "cpulist").write_text(f"{node * 56}-{node * 56 + 55}\n")
  return str(tmp_path)


def _gpu(dev_id, ordinal, process=0):
  return types.SimpleNamespace(id=dev_id, platform="gpu", device_kind="NVIDIA H200",
                               process_index=process, local_hardware_id=ordinal,
                               memory_stats=lambda: {"bytes_limit": 140 << 30})


def _hgx_h200():
  """18 active NVLinks per GPU, each to one of four NVSwitches."""
  return {b: [(True, 2, SWITCH_BUSES[k % 4]) for k in range(18)] for b in H200_BUSES}


H200_NUMA = {b: (0 if i < 4 else 1) for i, b in enumerate(H200_BUSES)}


@pytest.fixture(autouse=True)
def _fresh_log_once():
  config._said.discard("topology-links-unknown")
  yield


# --- the fakes keep the contract ---------------------------------------------------------------


def test_fakes_enforce_the_documented_contract():
  nvml = FakeNvml(_hgx_h200())
  with pytest.raises(NVMLError) as e:
    nvml.nvmlDeviceGetHandleByPciBusId(H200_BUSES[0])
  assert e.value.value == 1                                  # UNINITIALIZED before nvmlInit
  nvml.nvmlInit()
  for spelling in ("00000000:19:00.0", "0000:19:00", "19:00.0"):
    assert nvml.nvmlDeviceGetHandleByPciBusId(spelling) == ("handle", (0, 0x19, 0))
  with pytest.raises(NVMLError) as e:
    nvml.nvmlDeviceGetHandleByPciBusId("0000:77:00.0")
  assert e.value.value == 6                                  # NOT_FOUND
  with pytest.raises(NVMLError) as e:
    nvml.nvmlDeviceGetNvLinkState(nvml.nvmlDeviceGetHandleByPciBusId("19:00.0"), 18)
  assert e.value.value == 2                                  # a link the GPU does not have
  nvml.nvmlShutdown()
  with pytest.raises(NVMLError):
    nvml.nvmlShutdown()
  assert FakeCudart(["0000:19:00.0"]).cudaDeviceGetPCIBusId(32, 1)[0] == 101
  assert FakeCudart(["0000:19:00.0"]).cudaDeviceGetPCIBusId(8, 0)[0] == 1


# --- bus ids and NUMA ----------------------------------------------------------------------------


@pytest.mark.parametrize("raw,expected", [
    ("0000:1B:00.0", "0000:1b:00.0"),            # CUDA
    (b"00000000:1B:00.0\0\0\0", "0000:1b:00.0"),  # NVML busId, NUL padded bytes
    ("1b:00.0", "0000:1b:00.0"),                 # bus:device.function
    ("0001:C1:00.1", "0001:c1:00.1"),
])
def test_normalize_bus_id(raw, expected):
  assert detect.normalize_bus_id(raw) == expected


def test_normalize_bus_id_rejects_other_text():
  with pytest.raises(ValueError, match="is not a PCI bus id"):
    detect.normalize_bus_id("GPU-6f2a")


def test_numa_node_from_sysfs(tmp_path):
  root = _sysfs(tmp_path, {"0000:19:00.0": 1, "0000:3b:00.0": -1})
  assert detect.numa_node_of("0000:19:00.0", root) == 1
  assert detect.numa_node_of("0000:3b:00.0", root) is None    # -1: no affinity reported
  assert detect.numa_node_of("0000:77:00.0", root) is None    # no such device


# --- one process -------------------------------------------------------------------------------------


def test_devices_match_nvml_by_bus_id_not_index(tmp_path):
  """CUDA_VISIBLE_DEVICES=5,2: CUDA ordinal 0 is the sixth GPU of the board, ordinal 1 the third;
  NVML (which ignores CUDA_VISIBLE_DEVICES) is asked for exactly those two by bus id."""
  nvml = FakeNvml(_hgx_h200())
  t = Topology(**detect.describe(
      [_gpu(0, 0), _gpu(1, 1)], cudart=FakeCudart([H200_BUSES[5], H200_BUSES[2]]), nvml=nvml,
      sysfs=_sysfs(tmp_path, H200_NUMA), process=(0, 1), host="node0"))
  assert [d.pci_bus_id for d in t.devices] == ["0000:bb:00.0", "0000:4c:00.0"]
  assert [d.numa_node for d in t.devices] == [1, 0]
  assert t.link_class(0, 1) == "nvswitch"
  assert sorted(nvml.handles_asked) == ["0000:4c:00.0", "0000:bb:00.0"]
  assert nvml.refs == 0                                        # every nvmlInit shut down
  assert not any("unknown" in n for n in t.notes)


def test_nvlink_bridges_pcie_and_numa_on_a_pcie_box(tmp_path):
  """Two NVLink bridges (GPU0-GPU1, GPU2-GPU3; four links each, one unused), GPUs 0-1 on NUMA 0 and
  2-3 on NUMA 1, a driver without the remote-device-type call."""
  buses = ["0000:17:00.0", "0000:31:00.0", "0000:B1:00.0", "0000:CA:00.0"]
  bridge = lambda peer: [(True, 0, peer)] * 3 + [(False, 0, peer)]
  nvml = FakeNvml({buses[0]: bridge(buses[1]), buses[1]: bridge(buses[0]),
                   buses[2]: bridge(buses[3]), buses[3]: bridge(buses[2])}, remote_type=False)
  t = Topology(**detect.describe(
      [_gpu(i, i) for i in range(4)], cudart=FakeCudart(buses), nvml=nvml,
      sysfs=_sysfs(tmp_path, dict(zip(buses, (0, 0, 1, 1)))), process=(0, 1), host="box"))
  assert t.link_class(0, 1) == "nvlink" and t.link_class(2, 3) == "nvlink"
  assert t.link_class(0, 2) == "numa_cross" and t.link_class(1, 3) == "numa_cross"
  assert t.fast_islands() == ((0, 1), (2, 3))
  assert nvml.refs == 0


def test_pcie_only_gpus_have_no_nvlink(tmp_path):
  buses = [f"0000:{b:02X}:00.0" for b in (0x1a, 0x1b, 0x3d, 0x3e, 0x9c, 0x9d, 0xbb, 0xbc)]
  t = Topology(**detect.describe(
      [_gpu(i, i) for i in range(8)], cudart=FakeCudart(buses),
      nvml=FakeNvml({b: None for b in buses}),
      sysfs=_sysfs(tmp_path, {b: i // 4 for i, b in enumerate(buses)}), process=(0, 1),
      host="l40s"))
  assert t.link_class(0, 3) == "pcie" and t.link_class(3, 4) == "numa_cross"
  assert t.fast_islands() == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_without_the_gpu_extra_links_are_unknown_and_logged_once(tmp_path, monkeypatch,
                                                                 caplog):
  def missing():
    raise ImportError("No module named 'cuda'")
  monkeypatch.setattr(detect, "load_cudart", missing)
  gpus = [_gpu(0, 0), _gpu(1, 1)]
  with caplog.at_level(logging.WARNING, logger="dtenjax"):
    t = Topology(**detect.describe(gpus, sysfs=_sysfs(tmp_path, H200_NUMA), process=(0, 1),
                                   host="h"))
    Topology(**detect.describe(gpus, sysfs=str(tmp_path), process=(0, 1), host="h"))
  assert t.link_class(0, 1) == "unknown"
  assert [d.pci_bus_id for d in t.devices] == ["", ""]
  logged = [r.getMessage() for r in caplog.records if "'unknown'" in r.getMessage()]
  assert len(logged) == 1                                      # once per process
  assert "cuda-python is not installed" in logged[0]
  assert "pip install 'dtenjax[gpu]'" in logged[0] and "topo --probe" in logged[0]
  assert any("cuda-python is not installed" in n for n in t.notes)


def test_without_nvml_bus_ids_and_numa_are_still_read(tmp_path, monkeypatch):
  def missing():
    raise ImportError("No module named 'pynvml'")
  monkeypatch.setattr(detect, "load_nvml", missing)
  t = Topology(**detect.describe(
      [_gpu(0, 0), _gpu(1, 1)], cudart=FakeCudart(H200_BUSES[3:5]),
      sysfs=_sysfs(tmp_path, H200_NUMA), process=(0, 1), host="h"))
  assert [d.numa_node for d in t.devices] == [0, 1]
  assert t.link_class(0, 1) == "unknown"
  assert any("nvidia-ml-py (pynvml) is not installed" in n for n in t.notes)


def test_nvml_without_a_driver_says_so(tmp_path):
  nvml = FakeNvml(_hgx_h200(), driver=False)
  t = Topology(**detect.describe(
      [_gpu(0, 0), _gpu(1, 1)], cudart=FakeCudart(H200_BUSES[:2]), nvml=nvml,
      sysfs=_sysfs(tmp_path, H200_NUMA), process=(0, 1), host="h"))
  assert t.link_class(0, 1) == "unknown"
  assert any("NVML could not report NVLink (NVMLError: NVML error 9)" in n for n in t.notes)
  assert nvml.refs == 0


def test_a_cuda_ordinal_the_process_lacks_is_a_note(tmp_path):
  t = Topology(**detect.describe(
      [_gpu(0, 0), _gpu(1, 7)], cudart=FakeCudart(H200_BUSES[:2]),
      nvml=FakeNvml(_hgx_h200()), sysfs=_sysfs(tmp_path, H200_NUMA), process=(0, 1),
      host="h"))
  assert t.devices[1].pci_bus_id == "" and t.link_class(0, 1) == "unknown"
  assert any("cudaDeviceGetPCIBusId(7) failed with <CudaError.cudaErrorInvalidDevice" in n
             for n in t.notes)


# --- several processes ------------------------------------------------------------------------------


def _run_processes(per_process, hosts, nvmls, tmp_path):
  """describe() in one thread per process, all sharing one coordination store."""
  store = kvstore.KVStore(kvstore.InMemoryClient(), timeout_s=20.0)
  devices = [_gpu(4 * p + k, k, p) for p in range(len(per_process)) for k in range(4)]
  sysfs = _sysfs(tmp_path, H200_NUMA)
  out, errs = {}, []

  def one(p):
    try:
      out[p] = Topology(**detect.describe(
          devices, cudart=FakeCudart(per_process[p]), nvml=nvmls[p], sysfs=sysfs, store=store,
          process=(p, len(per_process)), host=hosts[p]))
    except Exception as e:
      errs.append(e)
  threads = [threading.Thread(target=one, args=(p,)) for p in range(len(per_process))]
  for th in threads:
    th.start()
  for th in threads:
    th.join(60)
  assert not errs, errs
  return out


def test_gpus_of_other_processes_on_the_host_get_their_real_links(tmp_path):
  """Two processes of four GPUs each on one 8 x H200 board: the pairs across processes are
  NVSwitch (they used to be 'pcie'), NUMA nodes come from each GPU's own sysfs node, only the
  host's first process asks NVML, and both processes build the same topology."""
  never = FakeNvml({})          # process 1 must not need NVML: process 0 reads the host
  never.nvmlInit = lambda: pytest.fail("the second process of a host read NVML itself")
  topos = _run_processes([H200_BUSES[:4], H200_BUSES[4:]], ["node0", "node0"],
                         [FakeNvml(_hgx_h200()), never], tmp_path)
  t0, t1 = topos[0], topos[1]
  assert t0.link_matrix == t1.link_matrix and t0.devices == t1.devices
  assert {t0.link_class(a, b) for a in range(8) for b in range(8) if a != b} == {"nvswitch"}
  assert [d.numa_node for d in t0.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
  assert t0.devices[5].pci_bus_id == "0000:bb:00.0" and t0.devices[5].process_index == 1
  assert t0.devices[5].memory_bytes == 140 << 30          # exchanged, not 0 for "not mine"


def test_two_hosts_each_read_their_own_links(tmp_path):
  topos = _run_processes([H200_BUSES[:4], H200_BUSES[:4]], ["node0", "node1"],
                         [FakeNvml(_hgx_h200()), FakeNvml(_hgx_h200())], tmp_path)
  t = topos[1]
  assert topos[0].link_matrix == t.link_matrix
  assert t.hosts() == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert t.link_class(4, 7) == "nvswitch" and t.link_class(0, 4) == "tcp"
