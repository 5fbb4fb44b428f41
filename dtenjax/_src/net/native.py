"""The native host transport as Python sees it: the extension module, its codes, counters, crypto.

The data plane lives in C++ (``csrc/transport/``: a TCP provider and an RDMA verbs provider behind
one table of functions), bound to Python with nanobind as ``dtenjax._ffi.transport``
(``custom_calls/transport/bindings.cc``); a native failure raises the dtenjax error of its status
code. :func:`transport` is the one way to that module; every other net module reaches the native
layer through it, so a build without transport bindings fails in one place, saying why.

Connections are authenticated by HMAC-SHA256 and frames by AES-256-GMAC (docs/transport.md), both
from OpenSSL's libcrypto, which the native layer loads at run time (``DTENJAX_LIBCRYPTO`` to choose
the file): :func:`ensure_crypto` loads it, and without it no connection is made (fail closed).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import callsite
from dtenjax._src.net import checks


def transport():
  """``dtenjax._ffi.transport``; ExtensionUnavailableError (saying why) when it is not built."""
  mod = ffi.module()
  sub = getattr(mod, "transport", None)
  if sub is None:
    raise errors.ExtensionUnavailableError(
        f"this build of dtenjax._ffi has no transport bindings (build info: "
        f"{dict(mod.build_info())}). Rebuild the extension: {ffi.BUILD_HINT}")
  return sub


def is_available() -> bool:
  """Whether the native transport is in this build."""
  try:
    transport()
    return True
  except errors.ExtensionUnavailableError:
    return False


@functools.cache
def codes() -> tuple[dict[np.dtype, int], dict[str, int]]:
  """({dtype: code}, {op: code}) of the frames, as the extension exports them (frame.h)."""
  import ml_dtypes
  dtypes = ffi.vocabulary("transport.dtype")
  return ({np.dtype(getattr(ml_dtypes, n, n)): c for n, c in dtypes.items()},
          ffi.vocabulary("transport.op"))


def counters() -> dict[str, int]:
  """Process-wide transport counters: frames/bytes moved, connections, rejections by reason
  (rejected_mac: modified frames, rejected_replay: replayed frames, rejected_mismatch: frames of
  another collective, ...), aborts sent/received, pending handshakes, peer_failures (collectives
  and ring set-ups a peer's failure ended: it closed or died, or a completion to it failed; one
  each, and none for a peer that closed having taken all it was owed)."""
  return dict(transport().counters())


_registered: dict[int, tuple[str, str]] = {}   # what this process told the native table


def register_site(site_id: int, text: str, signature: str = "") -> None:
  """Tells the native layer what call ``site_id`` is: its call stack ``text`` and its
  ``signature`` (dtype, shape, algorithm, contract). Both are part of the fingerprint every rank
  checks (:func:`dtenjax._src.net.callsite.site_id` makes the id); an id registered again with
  other texts raises ConfigurationError. Texts longer than a fingerprint record holds travel as
  their beginning and the digest of the whole (:func:`dtenjax._src.net.callsite.wire_text`)."""
  value = (callsite.wire_text(str(text), callsite.SITE_TEXT_BYTES),
           callsite.wire_text(str(signature), callsite.SIGNATURE_TEXT_BYTES))
  if _registered.get(site_id) == value:
    return                      # already there (the native table keeps every call)
  transport().register_site(checks.integer("site id", site_id, 0, checks.I64_MAX), *value)
  if len(_registered) < 1 << 16:
    _registered[site_id] = value


# --- libcrypto ------------------------------------------------------------------------------------

@functools.cache
def _crypto_loaded(path: str) -> None:
  transport().crypto_load(path)


def ensure_crypto() -> str:
  """Loads libcrypto (``DTENJAX_LIBCRYPTO`` or the default names); returns the file loaded.

  Raises ExtensionUnavailableError saying what was tried and how to install it."""
  path = config.get_str("DTENJAX_LIBCRYPTO")
  _crypto_loaded(path)
  return transport().crypto_status()[2]


def crypto_status() -> dict[str, Any]:
  ok, why, lib = transport().crypto_status()
  return {"loaded": bool(ok), "library": lib, "error": None if ok else why}


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
  """libcrypto's HMAC-SHA256 (what authenticates connections); equals Python's hmac module."""
  ensure_crypto()
  return transport().hmac_sha256(bytes(key), bytes(msg))
