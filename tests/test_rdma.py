"""RDMA control plane (pyverbs discovery) and the verbs provider's device-free logic.

No machine here has an RDMA device; pyverbs is faked where a device is needed. The verbs data path
itself has never run on RDMA hardware (see docs/transport.md).
"""

import ctypes
import sys
import types

import pytest

from dtenjax._src.net import rdma
from dtenjax._src.net import transport

needs_verbs = pytest.mark.skipif(
    not transport.is_available() or not transport.lib().dtenjax_tp_verbs_built(),
    reason="the verbs provider is not in this build (libibverbs-dev headers missing)")


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
  assert "pyverbs is not installed" in rdma.unavailable_reason()


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
      ("mlx5_0", 1, "active", "ethernet"), ("mlx5_1", 1, "down", "infiniband")]
  assert nics[0]["bandwidth_gbps"] == 200.0 and nics[1]["bandwidth_gbps"] == 100.0
  assert nics[0]["active_mtu"] == 4096
  assert nics[0]["gid_index"] == 3          # RoCE v2 with an IPv4-mapped address
  assert nics[1]["gid_index"] == 0          # InfiniBand
  assert rdma.unavailable_reason() is None
  name, why = transport.select_provider(nics)
  assert (name == "verbs") == bool(transport.lib().dtenjax_tp_verbs_built())


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
  n = len(gids)
  raw = b"".join(_raw(g) for g, _ in gids)
  types_ = (ctypes.c_int * n)(*[t for _, t in gids])
  native = transport.lib().dtenjax_tp_verbs_select_gid(raw, types_, n, int(ethernet))
  py = rdma.select_gid_index([{"index": i, "gid": g, "type": rdma.ROCE_V2 if t else "IB/RoCE v1"}
                              for i, (g, t) in enumerate(gids)],
                             "ethernet" if ethernet else "infiniband")
  assert native == py == expected


@needs_verbs
def test_qp_state_machine_and_masks():
  L = transport.lib()
  err = ctypes.create_string_buffer(512)
  RESET, INIT, RTR, RTS, ERR = 0, 1, 2, 3, 6
  for a, b in ((RESET, INIT), (INIT, RTR), (RTR, RTS), (RTS, ERR), (ERR, RESET), (RTS, RESET)):
    assert L.dtenjax_tp_verbs_check_transition(a, b, err, 512) == 0
  for a, b in ((RESET, RTR), (RESET, RTS), (INIT, RTS), (RTS, RTR), (ERR, RTS)):
    assert L.dtenjax_tp_verbs_check_transition(a, b, err, 512) == 1
    assert b"RESET -> INIT -> RTR -> RTS" in err.value
  # ibv_qp_attr_mask bits (verbs.h): STATE 1, ACCESS_FLAGS 8, PKEY_INDEX 16, PORT 32, AV 128,
  # PATH_MTU 256, TIMEOUT 512, RETRY_CNT 1024, RNR_RETRY 2048, RQ_PSN 4096, MAX_QP_RD_ATOMIC 8192,
  # MIN_RNR_TIMER 32768, SQ_PSN 65536, MAX_DEST_RD_ATOMIC 131072, DEST_QPN 1048576.
  assert L.dtenjax_tp_verbs_transition_mask(INIT) == 1 | 8 | 16 | 32
  assert L.dtenjax_tp_verbs_transition_mask(RTR) == 1 | 128 | 256 | 4096 | 32768 | 131072 | 1048576
  assert L.dtenjax_tp_verbs_transition_mask(RTS) == 1 | 512 | 1024 | 2048 | 8192 | 65536


@needs_verbs
def test_qp_parameter_validation_lists_every_problem():
  L = transport.lib()
  err = ctypes.create_string_buffer(2048)
  good = [1, 3, 4, 1, 4096, 64, 64, 16384, 14, 7, 7, 12, 0x123456, 0x42, 0]
  arr = (ctypes.c_int64 * 15)(*good)
  assert L.dtenjax_tp_verbs_validate(arr, err, 2048) == 0, err.value
  bad = list(good)
  bad[1], bad[4], bad[5], bad[9], bad[12], bad[3] = 4, 1500, 0, 9, 1 << 24, 0
  arr = (ctypes.c_int64 * 15)(*bad)
  assert L.dtenjax_tp_verbs_validate(arr, err, 2048) == 1
  msg = err.value.decode()
  for frag in ("gid_index=4", "mtu_bytes=1500", "max_send_wr=0", "retry_cnt=9",
               "psn=16777216", "dlid=0 on InfiniBand"):
    assert frag in msg, (frag, msg)
  assert [L.dtenjax_tp_verbs_mtu_enum(b) for b in (256, 1024, 4096, 9000)] == [1, 3, 5, -1]
  L.dtenjax_tp_verbs_encode_imm.restype = ctypes.c_uint32
  assert L.dtenjax_tp_verbs_encode_imm(4 << 20, 1) == (4 << 20) | 0x80000000
  assert L.dtenjax_tp_verbs_encode_imm(12345, 0) == 12345


@needs_verbs
def test_verbs_library_loads_at_run_time_and_reports_no_device():
  err = ctypes.create_string_buffer(512)
  code = transport.lib().dtenjax_tp_verbs_probe(err, 512)
  if code == 0:
    pytest.skip("an RDMA device is present here")
  assert code == 2 and (b"no RDMA device" in err.value or b"dlopen" in err.value)
  with pytest.raises(Exception, match="no RDMA device|dlopen|cannot reach"):
    transport.create_local_comm(0, 2, transport.JobCredentials(3, b"v" * 32), provider="verbs",
                                timeout_s=1)
