"""Where a host collective was issued: the user call stack as (tag, text), and how tags travel.

Every host collective carries its call site in its frames, so processes that issue different
collectives get an error that names both sides' stacks (:mod:`dtenjax._src.net.transport`). This
module only walks the Python stack and checks tags; it holds no state and needs no native code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import sysconfig

import numpy as np

from dtenjax._src import errors
from dtenjax._src.net import checks


def _module_dir(module) -> str:
  return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


@functools.cache
def _library_dirs() -> tuple[str, ...]:
  import jax
  dirs = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep,
          _module_dir(jax)]
  try:
    import jaxlib
    dirs.append(_module_dir(jaxlib))
  except ImportError:  # pragma: no cover
    pass
  return tuple(dirs)


@functools.cache
def _stdlib_dir() -> str:
  return os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


@functools.cache
def _trace_entry_files() -> tuple[str, ...]:
  """jax's files where tracing starts (jit, lower, make_jaxpr; shard_map, grad inside them)."""
  import jax
  src = os.path.join(_module_dir(jax), "_src")
  return (os.path.join(src, "pjit.py"), os.path.join(src, "interpreters", "partial_eval.py"))


def _is_library(filename: str) -> bool:
  if filename.startswith("<"):
    return True
  path = os.path.abspath(filename)
  if path.startswith(_library_dirs()):
    return True
  return path.startswith(_stdlib_dir()) and not any(
      d in path for d in (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep))


MAX_SITE_FRAMES = 16

# The longest texts a fingerprint record carries, in UTF-8 bytes (csrc/transport/frame.h's
# kMaxSiteText, fingerprint.h's kMaxSignatureText and kMaxThreadText): native code keeps only the
# first this many bytes of a longer text, so every text is made to fit here (:func:`wire_text`).
SITE_TEXT_BYTES = 2048
SIGNATURE_TEXT_BYTES = 512
STREAM_TEXT_BYTES = 256


@functools.lru_cache(maxsize=4096)   # a loop registers the same call again and again
def wire_text(text: str, limit: int) -> str:
  """``text`` in at most ``limit`` UTF-8 bytes that still stand for all of it: the text itself
  when it fits, else its beginning and the BLAKE2b-256 digest of the whole, as
  ``"<beginning> ... [5000 bytes, blake2b 3f2a...]"``. The fingerprint's keyed digest covers the
  text as it travels, so two texts that differ anywhere, however far in (a long call stack, a
  long str tag), have different fingerprints: the native layer's cut at ``limit`` bytes never
  makes two collectives look alike."""
  raw = text.encode("utf-8", "backslashreplace")
  if len(raw) <= limit:
    return text
  digest = hashlib.blake2b(raw, digest_size=32).hexdigest()
  suffix = f" ... [{len(raw)} bytes, blake2b {digest}]"
  head = raw[:max(0, limit - len(suffix))].decode("utf-8", "ignore")   # whole characters only
  return head + suffix


def call_site(depth_limit: int = 256) -> tuple[int, str]:
  """(tag, text) of the user code that issued the current collective: its user call stack.

  The text lists the frames outside dtenjax, jax, jaxlib and the standard library, innermost
  first, as ``"helper (a.py:3) < body (train.py:10) < step (train.py:20)"`` (at most
  MAX_SITE_FRAMES), and stops where jax began tracing: frames above the outermost ``jax.jit`` /
  trace are where the function was first *called* (which may differ between processes that run
  the same program, e.g. one lowered it for a log line), not part of the collective. The id is
  :func:`site_id` of the text. So one helper called from two lines gets two sites, and ranks that issue
  them in different orders are told apart; only iterations of one loop (same stack) look the
  same: give those a ``tag`` (see :func:`tag_value`)."""
  frames = []
  frame = sys._getframe(1)
  while frame is not None and len(frames) < depth_limit:
    frames.append(frame)
    frame = frame.f_back
  entry = _trace_entry_files()
  outer = [i for i, f in enumerate(frames) if os.path.abspath(f.f_code.co_filename) in entry]
  if outer:
    frames = frames[:outer[-1]]
  parts = [f"{f.f_code.co_name} ({os.path.basename(f.f_code.co_filename)}:{f.f_lineno})"
           for f in frames if not _is_library(f.f_code.co_filename)]
  if not parts:
    return site_id("unknown"), "unknown"
  text = " < ".join(parts[:MAX_SITE_FRAMES]) + (" < ..." if len(parts) > MAX_SITE_FRAMES else "")
  return site_id(text), text


@functools.lru_cache(maxsize=4096)   # a loop asks for the same call's id again and again
def site_id(text: str, signature: str = "", base: int = 0) -> int:
  """The id under which a call (its call-stack ``text`` and ``signature``) is registered with the
  native layer: 63 bits of BLAKE2b over both (and a caller's own ``base`` id), so it fits the FFI
  call's int64 attribute. Only this process uses it; what travels is the keyed 64-bit digest of
  the texts themselves (csrc/transport/fingerprint.h), so ids never need to agree across
  processes, and a collision of two ids in one process is refused when registered."""
  h = hashlib.blake2b(f"{base}\0{text}\0{signature}".encode("utf-8", "backslashreplace"),
                      digest_size=8)
  return int.from_bytes(h.digest(), "little") & (2**63 - 1)


def tag_value(tag) -> tuple[int | None, str]:
  """How a collective's ``tag`` travels: (value for the header's tag field, suffix of the site).

  * ``None``: no tag, (0, "").
  * a Python int in [0, 2**32): (the int, ""); every frame carries it and the ring compares it.
  * an integer scalar array, e.g. the traced step number inside ``lax.fori_loop``: (None, ""):
    the caller passes the array itself, which reaches the native layer as an operand.
  * a str naming the collective: (0, " [tag 'name']"): it joins the call site's text (so
    messages show it) and hash; a str of any length counts whole (:func:`wire_text`).
  Anything else raises CollectiveError naming the value."""
  if tag is None:
    return 0, ""
  if isinstance(tag, str):
    checks.name("tag", tag)
    return 0, f" [tag {tag!r}]"
  if isinstance(tag, (int, np.integer)) and not isinstance(tag, bool):
    return checks.integer("tag", int(tag), 0, checks.U32_MAX,
                          hint="an int tag travels as 32 bits; pass e.g. the step number"), ""
  shape, dtype = getattr(tag, "shape", None), getattr(tag, "dtype", None)
  if shape == () and dtype is not None and np.issubdtype(np.dtype(dtype), np.integer):
    return None, ""
  raise errors.CollectiveError(
      f"tag={tag!r} must be None, an int in 0..2**32-1, a str, or an integer scalar array (e.g. "
      f"the step number inside jit); got {type(tag).__name__}"
      + (f" of shape {shape} and dtype {dtype}" if shape is not None else "") + ".")
