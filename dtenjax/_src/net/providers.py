"""The host transport's provider table, and which provider a communicator uses here and why.

The native side of a provider is one file in ``csrc/transport/`` that registers itself with
``DTENJAX_REGISTER_PROVIDER``; its Python side is one :class:`ProviderSpec` line in
:data:`PROVIDERS`, which says when ``DTENJAX_TRANSPORT=auto`` may pick it (docs/transport.md, "How
to add a provider"). :func:`select_provider` reads the table, what this build has
(:func:`built_providers`) and the RDMA ports :mod:`dtenjax._src.net.rdma` finds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.net import native
from dtenjax._src.net import rdma


@dataclasses.dataclass(frozen=True)
class ProviderSpec:
  """One transport provider: its native name and when ``auto`` may pick it.

  ``usable(nics)`` returns (usable, reason); providers are tried in table order and the first
  usable one wins. The native side of a provider is one file in csrc/transport/ that registers
  itself with ``DTENJAX_REGISTER_PROVIDER``."""
  name: str
  usable: Callable[[list[dict[str, Any]]], tuple[bool, str]]
  description: str


def _verbs_usable(nics: list[dict[str, Any]]) -> tuple[bool, str]:
  active = [n for n in nics if str(n.get("state", "")).lower() == "active"]
  if not active:
    if nics:
      return False, "no RDMA port is active (" + ", ".join(
          f"{n['name']}:{n['port']}={n.get('state')}" for n in nics) + ")"
    return False, "no RDMA device"
  return True, f"active RDMA port {active[0]['name']}:{active[0]['port']}"


PROVIDERS: tuple[ProviderSpec, ...] = (
    ProviderSpec("verbs", _verbs_usable, "RDMA verbs (RC QPs, RDMA WRITE WITH IMM)"),
    ProviderSpec("tcp", lambda nics: (True, "TCP is always available"), "TCP sockets"),
)


def built_providers() -> list[str]:
  """Providers compiled into this build of the extension."""
  return list(native.transport().providers())


def select_provider(nics: list[dict[str, Any]] | None = None) -> tuple[str, str]:
  """(provider, reason). ``DTENJAX_TRANSPORT`` forces one; ``auto`` takes the first provider of
  :data:`PROVIDERS` that is built and usable, and logs why once."""
  names = [p.name for p in PROVIDERS]
  forced = config.get_str("DTENJAX_TRANSPORT").strip().lower()
  if forced not in ("auto", *names):
    raise errors.ConfigurationError(
        f"DTENJAX_TRANSPORT={forced!r} is not one of {['auto', *names]}.")
  built = built_providers() if native.is_available() else []
  if forced != "auto":
    if forced not in built:
      raise errors.ExtensionUnavailableError(
          f"DTENJAX_TRANSPORT={forced} but this build has no {forced} provider (built: {built}); "
          + ("install libibverbs-dev and rebuild, " if forced == "verbs" else "")
          + "or unset DTENJAX_TRANSPORT.")
    reason = f"DTENJAX_TRANSPORT={forced}"
    if forced == "verbs" and rdma.emulated_nics():
      reason += " on an EMULATED device: " + _emulated_text()
      config.log_once(f"transport:emulated:{rdma.library_info()['path']}",
                      f"dtenjax host transport: verbs runs on an EMULATED RDMA device, not a NIC "
                      f"({_emulated_text()})")
    return forced, reason
  why_none = "no RDMA NIC was given"
  if nics is None:
    nics = list(rdma.discover_nics())
    why_none = rdma.unavailable_reason() or "no RDMA device"
    if rdma.emulated_nics():
      why_none += ("; auto never picks the EMULATED device (" + _emulated_text() +
                   "): set DTENJAX_TRANSPORT=verbs to run on it")
  passed_over = []
  for spec in PROVIDERS:
    if spec.name not in built:
      passed_over.append(f"{spec.name} is not in this build")
      continue
    ok, why = spec.usable(list(nics))
    if ok:
      if not passed_over:
        return spec.name, why
      reason = "; ".join(passed_over)
      config.log_once(f"transport:provider:{spec.name}:{reason}",
                      f"dtenjax host transport: using {spec.name} because {reason} (set "
                      f"DTENJAX_TRANSPORT={spec.name} to silence)", level=20)
      return spec.name, reason
    passed_over.append(f"{spec.name} is not usable: {why if nics else why_none}")
  raise errors.ExtensionUnavailableError(   # tcp is always built and usable, but say so if not
      "no transport provider is usable: " + "; ".join(passed_over))


def _emulated_text() -> str:
  ports = ", ".join(f"{n['name']}:{n['port']} {n['link_layer']}" for n in rdma.emulated_nics())
  return f"{ports} from {rdma.library_info()['path']}, dtenjax's test device"
