"""RDMA NIC discovery: pyverbs (the control-plane view; optional dependency), else the verbs
library the provider itself loads.

:func:`discover_nics` lists every port of every RDMA device with its state, link layer
(``"InfiniBand"`` or ``"Ethernet"``, i.e. RoCE, whatever spelling or code pyverbs reports), rate,
MTU and the GID index the verbs provider would use (a RoCE v2 IPv4-mapped GID when there is one).
Units are explicit: ``rate_gbit_s`` is the port's data rate in gigaBITS per second (what ``ibstat``
prints, e.g. 200 for HDR 4x) and ``bandwidth_gbps`` the same in gigaBYTES per second (25 for HDR
4x), the unit of :class:`dtenjax._src.topology.parts.NicInfo` and every ``LinkSpec``. The topology
module turns this into link bandwidths. The data plane (QPs, MRs, CQs) is C++ in
csrc/transport/verbs_*.cc.

Sources, in order: pyverbs (``pip install dtenjax[rdma]`` or Debian's python3-pyverbs; with no
device it raises PyverbsRDMAError rather than returning an empty list: that means "no RDMA"),
then the library the verbs provider dlopens (``DTENJAX_IBVERBS_LIBRARY``, default
``libibverbs.so.1``). With neither, the answer is an empty list and :func:`unavailable_reason`
says why. A library that identifies itself as dtenjax's emulated test device
(tests/fakeverbs/) never yields NICs: its ports are listed by :func:`emulated_nics` and reported
as EMULATED (topology notes, transport selection), so a test device is never taken for hardware.
"""

from __future__ import annotations

import functools
from typing import Any

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi

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

  Same rule as the C++ provider's SelectGidIndex (csrc/transport/verbs_rules.cc)."""
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
    import pyverbs.device as dev
    from pyverbs.pyverbs_error import PyverbsRDMAError
  except ImportError as e:
    return None, None, f"pyverbs is not installed ({e}); pip install dtenjax[rdma] or " \
                       "apt-get install python3-pyverbs"
  return dev, PyverbsRDMAError, None


# --- the provider's own library -------------------------------------------------------------------

def _native_verbs():
  """``dtenjax._ffi.transport.verbs``, or None when this build has no verbs provider."""
  if not ffi.is_built():
    return None
  return getattr(getattr(ffi.module(), "transport", None), "verbs", None)


def load_library() -> dict[str, Any]:
  """Loads the library the verbs provider uses (``DTENJAX_IBVERBS_LIBRARY``); returns
  :func:`library_info`. ExtensionUnavailableError (saying why) when it cannot be loaded or the
  build has no verbs provider; ConfigurationError when another library is still in use."""
  v = _native_verbs()
  if v is None:
    raise errors.ExtensionUnavailableError(
        "this build has no verbs provider (libibverbs-dev headers were missing when it was "
        f"built); {ffi.BUILD_HINT}")
  v.load(config.get_str("DTENJAX_IBVERBS_LIBRARY"))
  return library_info()


def library_info() -> dict[str, Any]:
  """What the verbs provider loaded: built, loaded, path, emulated, error (never raises)."""
  v = _native_verbs()
  if v is None:
    return {"built": False, "loaded": False, "path": "", "emulated": False,
            "error": "the verbs provider is not in this build"}
  try:
    v.load(config.get_str("DTENJAX_IBVERBS_LIBRARY"))
  except errors.DtenjaxError as e:
    return {"built": True, **dict(v.library()), "loaded": False, "error": str(e)}
  return {"built": True, **dict(v.library())}


def _native_ports() -> tuple[list[dict[str, Any]], str | None, dict[str, Any]]:
  """(NIC dicts, why none, library info) from the provider's library."""
  info = library_info()
  if not info["loaded"]:
    return [], info["error"], info
  try:
    ports = list(_native_verbs().ports())
  except errors.DtenjaxError as e:
    return [], str(e), info
  nics = []
  for p in ports:
    link = link_layer_name(p["link_layer"])
    gids = []
    for i, (raw, gtype) in enumerate(zip(p["gids"], p["gid_types"])):
      text = ":".join(raw[k:k + 2].hex() for k in range(0, 16, 2))
      if gtype < 0:   # the library cannot tell (no ibv_query_gid_ex): the provider's guess
        gtype = 2 if text.startswith("0000:0000:0000:0000:0000:ffff:") else 1
      gids.append({"index": i, "gid": text, "type": ROCE_V2 if gtype == 2 else "IB/RoCE v1"})
    nics.append({
        "name": p["device"], "port": p["port"],
        "state": PORT_STATES.get(p["state"], str(p["state"])), "link_layer": link,
        "active_speed": p["active_speed"], "active_width": p["active_width"],
        "rate_gbit_s": rate_gbit_s(p["active_speed"], p["active_width"]),
        "bandwidth_gbps": bandwidth_gbytes_s(p["active_speed"], p["active_width"]),
        "active_mtu": MTU_BYTES.get(p["active_mtu"], 0), "lid": p["lid"],
        "gid_index": select_gid_index(gids, link), "gids": gids,
        "source": info["path"], "emulated": bool(info["emulated"])})
  if not nics:
    return [], f"{info['path']} lists no RDMA device", info
  return nics, None, info


@functools.cache
def emulated_nics() -> tuple[dict[str, Any], ...]:
  """Ports of an EMULATED device (dtenjax's test library loaded through
  ``DTENJAX_IBVERBS_LIBRARY``): usable by the verbs provider when forced, never a NIC."""
  nics, _, info = _native_ports()
  return tuple(n for n in nics if n["emulated"]) if info.get("emulated") else ()


@functools.cache
def discover_nics() -> tuple[dict[str, Any], ...] | list[dict[str, Any]]:
  """Every RDMA port of real hardware: name, port, state, link_layer, rate_gbit_s (Gb/s),
  bandwidth_gbps (GB/s), active_mtu, gid_index, source, ...

  Cached per process. Empty (and :func:`unavailable_reason` set) when there is no RDMA."""
  global _reason
  dev, rdma_error, why = _pyverbs()
  if dev is None:
    nics, native_why, info = _native_ports()
    if info.get("emulated"):
      _reason = (f"{why}; the verbs library {info['path']} (DTENJAX_IBVERBS_LIBRARY) is dtenjax's "
                 "EMULATED test device, not a NIC")
      return []
    if nics:
      _reason = None
      return nics
    _reason = f"{why}; {native_why}"
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
              "source": "pyverbs", "emulated": False,
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
  """Forget the discovery result (tests, hot-plug, another DTENJAX_IBVERBS_LIBRARY)."""
  global _reason
  discover_nics.cache_clear()
  emulated_nics.cache_clear()
  _pyverbs.cache_clear()
  _reason = None
