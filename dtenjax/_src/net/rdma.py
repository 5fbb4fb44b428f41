"""RDMA NIC discovery through pyverbs (the control-plane view; optional dependency).

:func:`discover_nics` lists every port of every RDMA device with its state, link layer
(``"InfiniBand"`` or ``"Ethernet"``, i.e. RoCE, whatever spelling or code pyverbs reports), rate,
MTU and the GID index the verbs provider would use (a RoCE v2 IPv4-mapped GID when there is one).
Units are explicit: ``rate_gbit_s`` is the port's data rate in gigaBITS per second (what ``ibstat``
prints, e.g. 200 for HDR 4x) and ``bandwidth_gbps`` the same in gigaBYTES per second (25 for HDR
4x), the unit of :class:`dtenjax._src.topology.parts.NicInfo` and every ``LinkSpec``. The topology
module turns this into link bandwidths. The data plane (QPs, MRs, CQs) is C++ in
csrc/transport/verbs.cc.

pyverbs is optional (``pip install dtenjax[rdma]`` or Debian's python3-pyverbs). With no pyverbs,
or no device (pyverbs raises PyverbsRDMAError rather than returning an empty list), the answer is
an empty list and :func:`unavailable_reason` says why.
"""

from __future__ import annotations

import functools
from typing import Any

# ibv_port_state / ibv_mtu / link layer / active_width / active_speed encodings (verbs.h).
PORT_STATES = {0: "nop", 1: "down", 2: "init", 3: "armed", 4: "active", 5: "active_defer"}
LINK_LAYERS = {0: "Unspecified", 1: "InfiniBand", 2: "Ethernet"}
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
WIDTH_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
# Per-lane data rate in Gb/s after encoding overhead (SDR..NDR; 8b/10b before FDR, 64b/66b after).
SPEED_GBPS = {1: 2.0, 2: 4.0, 4: 8.0, 8: 10.0, 16: 13.64, 32: 25.0, 64: 50.0, 128: 100.0}
# ibv_gid_type_sysfs-style names pyverbs reports; RoCE v2 is routable (UDP/IP).
ROCE_V2 = "RoCE v2"

_reason: str | None = None


def rate_gbit_s(active_speed: int, active_width: int) -> float:
  """Port data rate in gigaBITS per second from ibv_port_attr.active_speed and active_width."""
  return SPEED_GBPS.get(int(active_speed), 0.0) * WIDTH_LANES.get(int(active_width), 0)


def bandwidth_gbytes_s(active_speed: int, active_width: int) -> float:
  """The same rate in gigaBYTES per second (the unit of NicInfo.bandwidth_gbps / LinkSpec)."""
  return rate_gbit_s(active_speed, active_width) / 8.0


def link_layer_name(value: Any) -> str:
  """``"InfiniBand"``, ``"Ethernet"`` or ``"Unspecified"`` from an ibv_port_attr code or any
  spelling of the name (compared case-insensitively; "RoCE" means Ethernet)."""
  if isinstance(value, (int,)) and not isinstance(value, bool):
    return LINK_LAYERS.get(int(value), f"unknown({value})")
  text = str(value).strip().lower()
  if text in ("infiniband", "ib"):
    return "InfiniBand"
  if text in ("ethernet", "eth", "roce"):
    return "Ethernet"
  if text in ("unspecified", ""):
    return "Unspecified"
  return str(value)


def select_gid_index(gids: list[dict[str, Any]], link_layer: str) -> int:
  """The GID index to use: InfiniBand -> 0; RoCE -> the first RoCE v2 GID holding an IPv4-mapped
  address (::ffff:a.b.c.d), else the first RoCE v2 GID, else the first non-zero one; -1 if none.

  Same rule as the C++ provider's SelectGidIndex (csrc/transport/verbs.cc)."""
  if link_layer_name(link_layer) == "InfiniBand":
    return 0 if gids else -1
  valid = [g for g in gids if g.get("gid") and set(g["gid"].replace(":", "")) != {"0"}]
  v2 = [g for g in valid if g.get("type") == ROCE_V2]
  mapped = [g for g in v2 if g["gid"].lower().startswith("0000:0000:0000:0000:0000:ffff:")]
  for group in (mapped, v2, valid):
    if group:
      return int(group[0]["index"])
  return -1


def unavailable_reason() -> str | None:
  """Why :func:`discover_nics` found nothing (None when it found NICs or was not called)."""
  discover_nics()
  return _reason


@functools.cache
def _pyverbs():
  try:
    import pyverbs.device as dev  # pylint: disable=g-import-not-at-top
    from pyverbs.pyverbs_error import PyverbsRDMAError  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    return None, None, f"pyverbs is not installed ({e}); pip install dtenjax[rdma] or " \
                       "apt-get install python3-pyverbs"
  return dev, PyverbsRDMAError, None


@functools.cache
def discover_nics() -> tuple[dict[str, Any], ...] | list[dict[str, Any]]:
  """Every RDMA port: name, port, state, link_layer, rate_gbit_s (Gb/s), bandwidth_gbps (GB/s),
  active_mtu, gid_index, ...

  Cached per process. Empty (and :func:`unavailable_reason` set) when there is no RDMA."""
  global _reason
  dev, rdma_error, why = _pyverbs()
  if dev is None:
    _reason = why
    return []
  try:
    devices = dev.get_device_list()
  except rdma_error as e:
    _reason = f"no RDMA device (pyverbs: {e})"
    return []
  if not devices:
    _reason = "no RDMA device (pyverbs listed none)"
    return []
  nics: list[dict[str, Any]] = []
  for d in devices:
    name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
    try:
      with dev.Context(name=name) as ctx:
        attr = ctx.query_device()
        for port in range(1, attr.phys_port_cnt + 1):
          pa = ctx.query_port(port)
          link = link_layer_name(pa.link_layer)
          gids = []
          for i in range(min(pa.gid_tbl_len, 32)):
            try:
              g = ctx.query_gid(port, i)
              gtype = ctx.query_gid_type(port, i) if hasattr(ctx, "query_gid_type") else None
            except rdma_error:
              continue
            gids.append({"index": i, "gid": str(g), "type": _gid_type_name(gtype)})
          nics.append({
              "name": name, "port": port, "state": PORT_STATES.get(pa.state, str(pa.state)),
              "link_layer": link, "active_speed": pa.active_speed, "active_width": pa.active_width,
              "rate_gbit_s": rate_gbit_s(pa.active_speed, pa.active_width),
              "bandwidth_gbps": bandwidth_gbytes_s(pa.active_speed, pa.active_width),
              "active_mtu": MTU_BYTES.get(pa.active_mtu, 0), "lid": pa.lid,
              "gid_index": select_gid_index(gids, link), "gids": gids,
          })
    except rdma_error as e:
      _reason = f"RDMA device {name} could not be queried ({e})"
  if not nics and _reason is None:
    _reason = "RDMA devices exist but report no ports"
  if nics:
    _reason = None
  return nics


def _gid_type_name(t) -> str | None:
  if t is None:
    return None
  return {0: "IB/RoCE v1", 1: ROCE_V2}.get(int(t), str(t)) if isinstance(t, int) else str(t)


def reset_cache() -> None:
  """Forget the discovery result (tests, hot-plug)."""
  global _reason
  discover_nics.cache_clear()
  _pyverbs.cache_clear()
  _reason = None
