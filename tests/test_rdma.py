"""RDMA control plane (pyverbs discovery, the provider's own library) and the verbs provider's
device-free logic.

No machine here has an RDMA device; pyverbs is faked where a device is needed. The verbs data path
runs on the emulated device in tests/test_verbs.py; it has never run on RDMA hardware (see
docs/transport.md).
"""

import pathlib
import sys
import types

import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import providers
from dtenjax._src.net import rdma
from dtenjax._src.net import transport

# Skip only when the build has no verbs provider (its headers were missing), saying so; when the
# build says it has one, a missing binding fails.
needs_verbs = pytest.mark.skipif(
    not ffi.build_info().get("verbs", False),
    reason="the verbs provider is not in this build (libibverbs-dev headers were missing at build "
           f"time; build info: {ffi.build_info().get('error') or 'built without verbs'})")


def verbs():
  return native.transport().verbs


def test_verbs_provider_is_built_where_its_headers_are():
  """The verbs tests skip only in a build without the provider; that must mean the headers were
  missing, never a broken CMake check on a machine that has them."""
  header = pathlib.Path("/usr/include/infiniband/verbs.h")
  assert ffi.build_info().get("verbs", False) or not header.exists(), (
      f"{header} is installed but this build has no verbs provider: {ffi.build_info()}")


class FakeRDMAError(Exception):
  pass


def install_fake_pyverbs(monkeypatch, devices, raise_on_list=False):
  pkg = types.ModuleType("pyverbs")
  dev = types.ModuleType("pyverbs.device")
  err = types.ModuleType("pyverbs.pyverbs_error")
  err.PyverbsRDMAError = FakeRDMAError

  def get_device_list():
    if raise_on_list:
      raise FakeRDMAError("Failed to get devices list. Errno: 19, No such device")
    return [types.SimpleNamespace(name=d["name"].encode()) for d in devices]

  class Context:
    def __init__(self, name):
      self.d = next(d for d in devices if d["name"] == name)
    def __enter__(self):
      return self
    def __exit__(self, *a):
      return False
    def query_device(self):
      return types.SimpleNamespace(phys_port_cnt=len(self.d["ports"]))
    def query_port(self, port):
      return types.SimpleNamespace(**self.d["ports"][port - 1]["attr"])
    def query_gid(self, port, i):
      return self.d["ports"][port - 1]["gids"][i][0]
    def query_gid_type(self, port, i):
      return self.d["ports"][port - 1]["gids"][i][1]

  dev.get_device_list = get_device_list
  dev.Context = Context
  pkg.device, pkg.pyverbs_error = dev, err
  for name, mod in (("pyverbs", pkg), ("pyverbs.device", dev), ("pyverbs.pyverbs_error", err)):
    monkeypatch.setitem(sys.modules, name, mod)
  rdma.reset_cache()


@pytest.fixture(autouse=True)
def _fresh():
  rdma.reset_cache()
  yield
  rdma.reset_cache()


def test_no_pyverbs_means_no_rdma(monkeypatch):
  monkeypatch.setitem(sys.modules, "pyverbs", None)
  monkeypatch.setitem(sys.modules, "pyverbs.device", None)
  rdma.reset_cache()
  assert rdma.discover_nics() == []
  why = rdma.unavailable_reason()
  assert "pyverbs is not installed" in why
  # ... and the provider's own library was asked too, and says why it found nothing.
  info = rdma.library_info()
  if info["loaded"]:
    assert f"{info['path']} lists no RDMA device" in why, why
    assert not info["emulated"] and rdma.emulated_nics() == ()
  else:
    assert info["error"] and info["error"] in why, (info, why)


def test_pyverbs_error_means_no_rdma(monkeypatch):
  install_fake_pyverbs(monkeypatch, [], raise_on_list=True)
  assert rdma.discover_nics() == []
  assert "no RDMA device" in rdma.unavailable_reason()


def test_discovery_reports_ports_bandwidth_and_gid(monkeypatch):
  z = "0000:0000:0000:0000:0000:0000:0000:0000"
  link_local = "fe80:0000:0000:0000:0202:c9ff:fe00:0001"
  mapped = "0000:0000:0000:0000:0000:ffff:0a00:0001"
  roce = {"name": "mlx5_0", "ports": [{
      "attr": dict(state=4, link_layer=2, active_speed=64, active_width=2, active_mtu=5, lid=0,
                   gid_tbl_len=4),
      "gids": [(link_local, 0), (link_local, 1), (mapped, 0), (mapped, 1)]}]}
  ib = {"name": "mlx5_1", "ports": [{
      "attr": dict(state=1, link_layer=1, active_speed=32, active_width=2, active_mtu=5, lid=7,
                   gid_tbl_len=1),
      "gids": [(z, 0)]}]}
  install_fake_pyverbs(monkeypatch, [roce, ib])
  nics = rdma.discover_nics()
  assert [(n["name"], n["port"], n["state"], n["link_layer"]) for n in nics] == [
      ("mlx5_0", 1, "active", "Ethernet"), ("mlx5_1", 1, "down", "InfiniBand")]
  # HDR (50 Gb/s per lane) x 4 lanes = 200 Gb/s = 25 GB/s; EDR x 4 = 100 Gb/s = 12.5 GB/s.
  assert nics[0]["rate_gbit_s"] == 200.0 and nics[1]["rate_gbit_s"] == 100.0
  assert nics[0]["bandwidth_gbps"] == 25.0 and nics[1]["bandwidth_gbps"] == 12.5
  assert nics[0]["active_mtu"] == 4096
  assert nics[0]["gid_index"] == 3          # RoCE v2 with an IPv4-mapped address
  assert nics[1]["gid_index"] == 0          # InfiniBand
  assert rdma.unavailable_reason() is None
  name, why = providers.select_provider(nics)
  assert (name == "verbs") == ("verbs" in providers.built_providers())


@pytest.mark.parametrize("reported", [1, "InfiniBand", "infiniband", "INFINIBAND", "IB"])
def test_a_200_gbit_infiniband_port_is_25_gbytes_infiniband_in_the_topology(monkeypatch, reported):
  """However pyverbs spells the link layer, a 200 Gb/s IB port is 25 GB/s InfiniBand all the way
  into the detected topology (not 1600 Gb/s RoCE)."""
  ib = {"name": "mlx5_0", "ports": [{
      "attr": dict(state=4, link_layer=reported, active_speed=64, active_width=2, active_mtu=5,
                   lid=3, gid_tbl_len=1),
      "gids": [("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0)]}]}
  install_fake_pyverbs(monkeypatch, [ib])
  nic = rdma.discover_nics()[0]
  assert (nic["link_layer"], nic["rate_gbit_s"], nic["bandwidth_gbps"]) == ("InfiniBand", 200.0,
                                                                           25.0)
  assert nic["gid_index"] == 0
  from dtenjax._src.topology import detect
  from dtenjax._src.topology import report
  from dtenjax._src.topology.model import Topology
  desc = detect.describe()
  (info,) = desc["nics"]
  assert (info.link_layer, info.bandwidth_gbps) == ("InfiniBand", 25.0)
  text = report.link_matrix_table(Topology(**desc))
  assert "NIC mlx5_0" in text and "InfiniBand, active, 200 Gb/s" in text, text
  assert "1600" not in text


def test_link_layer_names_are_compared_case_insensitively():
  assert [rdma.link_layer_name(v) for v in (1, 2, 0, "ETHERNET", "RoCE", "infiniband")] == [
      "InfiniBand", "Ethernet", "Unspecified", "Ethernet", "Ethernet", "InfiniBand"]
  gids = [{"index": 0, "gid": "fe80:0000:0000:0000:0202:c9ff:fe00:0001", "type": rdma.ROCE_V2}]
  assert rdma.select_gid_index(gids, "INFINIBAND") == 0 == rdma.select_gid_index(gids, "ib")


def _raw(gid: str) -> bytes:
  return bytes.fromhex(gid.replace(":", ""))


@needs_verbs
@pytest.mark.parametrize("gids,ethernet,expected", [
    ([("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0),
      ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 1),
      ("0000:0000:0000:0000:0000:ffff:0a00:0001", 0),
      ("0000:0000:0000:0000:0000:ffff:0a00:0001", 1)], True, 3),
    ([("0000:0000:0000:0000:0000:0000:0000:0000", 1),
      ("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0),
      ("fe80:0000:0000:0000:0202:c9ff:fe00:0002", 1)], True, 2),
    ([("0000:0000:0000:0000:0000:0000:0000:0000", 0)], True, -1),
    ([("fe80:0000:0000:0000:0202:c9ff:fe00:0001", 0)], False, 0),
])
def test_gid_selection_native_matches_python(gids, ethernet, expected):
  raw = b"".join(_raw(g) for g, _ in gids)
  native_index = verbs().select_gid(raw, [t for _, t in gids], ethernet)
  py = rdma.select_gid_index([{"index": i, "gid": g, "type": rdma.ROCE_V2 if t else "IB/RoCE v1"}
                              for i, (g, t) in enumerate(gids)],
                             "ethernet" if ethernet else "infiniband")
  assert native_index == py == expected


@needs_verbs
def test_qp_state_machine_and_masks():
  v = verbs()
  RESET, INIT, RTR, RTS, ERR = 0, 1, 2, 3, 6
  for a, b in ((RESET, INIT), (INIT, RTR), (RTR, RTS), (RTS, ERR), (ERR, RESET), (RTS, RESET)):
    v.check_transition(a, b)
  for a, b in ((RESET, RTR), (RESET, RTS), (INIT, RTS), (RTS, RTR), (ERR, RTS)):
    with pytest.raises(errors.ConfigurationError, match="RESET -> INIT -> RTR -> RTS"):
      v.check_transition(a, b)
  # ibv_qp_attr_mask bits (verbs.h): STATE 1, ACCESS_FLAGS 8, PKEY_INDEX 16, PORT 32, AV 128,
  # PATH_MTU 256, TIMEOUT 512, RETRY_CNT 1024, RNR_RETRY 2048, RQ_PSN 4096, MAX_QP_RD_ATOMIC 8192,
  # MIN_RNR_TIMER 32768, SQ_PSN 65536, MAX_DEST_RD_ATOMIC 131072, DEST_QPN 1048576.
  assert v.transition_mask(INIT) == 1 | 8 | 16 | 32
  assert v.transition_mask(RTR) == 1 | 128 | 256 | 4096 | 32768 | 131072 | 1048576
  assert v.transition_mask(RTS) == 1 | 512 | 1024 | 2048 | 8192 | 65536


@needs_verbs
def test_qp_parameter_validation_lists_every_problem():
  v = verbs()
  good = dict(port=1, gid_index=3, gid_table_len=4, ethernet=True, mtu_bytes=4096,
              max_send_wr=64, max_recv_wr=64, device_max_wr=16384, timeout=14, retry_cnt=7,
              rnr_retry=7, min_rnr_timer=12, psn=0x123456, dest_qpn=0x42, dlid=0)
  v.validate_qp(**good)
  bad = dict(good, gid_index=4, mtu_bytes=1500, max_send_wr=0, retry_cnt=9, psn=1 << 24,
             ethernet=False)
  with pytest.raises(errors.ConfigurationError) as e:
    v.validate_qp(**bad)
  msg = str(e.value)
  for frag in ("gid_index=4", "mtu_bytes=1500", "max_send_wr=0", "retry_cnt=9",
               "psn=16777216", "dlid=0 on InfiniBand"):
    assert frag in msg, (frag, msg)
  assert [v.mtu_enum(b) for b in (256, 1024, 4096, 9000)] == [1, 3, 5, -1]
  assert v.encode_imm(4 << 20, True) == (4 << 20) | 0x80000000
  assert v.encode_imm(12345, False) == 12345


@needs_verbs
def test_verbs_library_loads_at_run_time_and_reports_no_device():
  try:
    n = verbs().probe()
  except errors.ExtensionUnavailableError as e:
    assert "no RDMA device" in str(e) or "dlopen" in str(e)
  else:
    pytest.skip(f"{n} RDMA device(s) present here")
  with pytest.raises(errors.DtenjaxError, match="no RDMA device|dlopen|cannot reach"):
    transport.create_local_comm(0, 2, credentials.JobCredentials(3, b"v" * 32), provider="verbs",
                                timeout_s=1)
