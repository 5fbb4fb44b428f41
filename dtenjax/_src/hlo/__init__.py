"""One reader of compiled XLA HLO: structured records for ``explain`` and ``graph_report``.

The compiled executable's optimised module is read from XLA's own structured form where jax
exposes it: ``compiled.runtime_executable().hlo_modules()[i].as_serialized_hlo_module_proto()``
(jax 0.10.2 and 0.11.x) is an ``xla.HloModuleProto``, decoded by Google's ``protobuf`` runtime
with the part of XLA's schema dtenjax reads (:mod:`.proto`); where only text is
available, from the printed module (:mod:`.text`). Both return the records of :mod:`.records`;
:mod:`.groups` expands XLA's compact replica-group forms.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

from dtenjax._src import errors
from dtenjax._src.hlo.groups import iota_groups as iota_groups
from dtenjax._src.hlo.groups import mesh_axes_groups as mesh_axes_groups
from dtenjax._src.hlo.proto import parse_proto as parse_proto
from dtenjax._src.hlo.records import BITS as BITS
from dtenjax._src.hlo.records import COLLECTIVE_KINDS as COLLECTIVE_KINDS
from dtenjax._src.hlo.records import COLLECTIVE_OPCODES as COLLECTIVE_OPCODES
from dtenjax._src.hlo.records import COLLECTIVE_TARGETS as COLLECTIVE_TARGETS
from dtenjax._src.hlo.records import Collective as Collective
from dtenjax._src.hlo.records import Computation as Computation
from dtenjax._src.hlo.records import HloReadError as HloReadError
from dtenjax._src.hlo.records import Instruction as Instruction
from dtenjax._src.hlo.records import Module as Module
from dtenjax._src.hlo.records import NUMPY_NAMES as NUMPY_NAMES
from dtenjax._src.hlo.records import Shape as Shape
from dtenjax._src.hlo.records import collective_bytes as collective_bytes
from dtenjax._src.hlo.records import known_trip_count as known_trip_count
from dtenjax._src.hlo.records import numpy_name as numpy_name
from dtenjax._src.hlo.text import parse_text as parse_text
from dtenjax._src.hlo.text import tokenize as tokenize
from dtenjax._src.hlo.text import trip_counts_from_text as trip_counts_from_text


def serialized_modules(compiled: Any) -> list[bytes] | None:
  """The executable's HloModuleProtos, or None where this jax/backend does not expose them."""
  try:
    runtime = compiled.runtime_executable()
    modules = runtime.hlo_modules()
    return [m.as_serialized_hlo_module_proto() for m in modules]
  except Exception:  # absent API or backend: fall back to text
    return None


# Each executable's module is read once (its records are frozen): StepPlan.check reads it for
# explain's collectives and again for the loops' trip counts, and a caller may explain the same
# executable again (reading a step's module is 0.1-0.5 s of CPU).
_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_compiled(compiled: Any, prefer: str = "proto") -> Module:
  """The optimised module of a ``jax.stages.Compiled`` (its first module; jax makes one).

  ``prefer="proto"`` reads XLA's structured form and falls back to the printed text where jax
  does not expose it; ``prefer="text"`` reads the text (used to cross-check the two readers).
  """
  if prefer not in ("proto", "text"):
    raise errors.ConfigurationError(f"prefer={prefer!r}; use 'proto' or 'text'")
  try:
    read = _READ.setdefault(compiled, {})
  except TypeError:          # an object that cannot be weakly referenced: read it every time
    read = {}
  if prefer not in read:
    read[prefer] = _read(compiled, prefer)
  return read[prefer]


def _read(compiled: Any, prefer: str) -> Module:
  if prefer == "proto":
    protos = serialized_modules(compiled)
    if protos:
      return parse_proto(protos[0])
  text = compiled.as_text()
  if not text:
    raise HloReadError(f"{type(compiled).__name__} exposes neither its HLO module proto nor its "
                       "text; compile with jax.jit(f).lower(*args).compile() on a backend that "
                       "keeps them.")
  first = re.split(r"\n(?=HloModule\s)", text.strip())[0]
  return parse_text(first)
