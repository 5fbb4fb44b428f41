"""The reproducibility contract of a sum: one value, :class:`Contract`, parsed once.

The public ``reproducible=`` argument (``all_reduce``, ``reduce_scatter``, ``plan_all_reduce``,
``substitute_psum``, ``fuse_collectives``) takes the values docs/collectives.md lists: False
(no contract), True (contract v3), ``"v2"`` (contract v2) and ``"exact"`` (v2's deprecated
name, which warns). :func:`parse` turns them into a :class:`Contract` at that boundary;
everything below it (the algorithm records' ``Call``, the reproducible sums, the cost model,
the NVLink kernels' gate and attributes) takes the member.

A member's value is its name in the native vocabulary: the kernels' contracts are
``dtenjax._ffi.vocabulary["p2p.reproducible"]`` (``csrc/p2p/vocabulary.h``), a subset of these
(``tests/test_vocabulary.py``); a contract without kernels there runs on XLA's collectives, and
the NVLink gate (``gpu/p2p.py``) says so.
"""

from __future__ import annotations

import enum

from dtenjax._src import errors


class Contract(enum.Enum):
  """Which reproducible sum runs (docs/collectives.md).

  NONE: the algorithm's own sum (no fixed-point arithmetic). V3: contract v3, one int32 word
  per value (``collectives/fixed_point_v3.py``). V2: contract v2, two int32 words per value, a
  finer grid (``collectives/fixed_point.py``); v3 hands its sums to v2 past
  ``fixed_point_v3.MAX_CONTRIBUTIONS`` contributions.
  """
  NONE = "none"
  V3 = "v3"
  V2 = "v2"

  @property
  def reproducible(self) -> bool:
    """Whether a fixed-point sum runs at all."""
    return self is not Contract.NONE

  @property
  def word_bytes(self) -> int:
    """Bytes of integer words exchanged per value (0 for NONE)."""
    return _WORD_BYTES[self]

  @property
  def public(self) -> bool | str:
    """The public ``reproducible=`` value that asks for this contract (errors, docs)."""
    return _PUBLIC[self]


_WORD_BYTES = {Contract.NONE: 0, Contract.V3: 4, Contract.V2: 8}
_PUBLIC = {Contract.NONE: False, Contract.V3: True, Contract.V2: "v2"}
_NAMED = {c.value: c for c in Contract if c.reproducible}       # "v2", and "v3" as True
_DEPRECATED = {"exact": Contract.V2}


def parse(reproducible, what: str = "reproducible") -> Contract:
  """The :class:`Contract` a public ``reproducible=`` value asks for (a member passes through).

  False and None: NONE; True (or "v3"): V3; "v2": V2; "exact" (deprecated, warns once with a
  :class:`DtenjaxWarning`): V2. Anything else raises CollectiveError naming the value and the
  values accepted."""
  if isinstance(reproducible, Contract):
    return reproducible
  if reproducible is False or reproducible is None:
    return Contract.NONE
  if reproducible is True:
    return Contract.V3
  if isinstance(reproducible, str):
    if reproducible in _NAMED:
      return _NAMED[reproducible]
    if reproducible in _DEPRECATED:
      errors.warn_once(
          "reproducible-exact",
          "dtenjax: reproducible='exact' is deprecated: it is contract v2, a fixed-point sum "
          "with 40 bits below each element's largest exponent, not the correctly rounded sum "
          "(off by up to N * 2**(e - 41) + 2 ulp under cancellation, docs/collectives.md). "
          "Pass reproducible='v2' for the same bits, or reproducible=True (contract v3).")
      return _DEPRECATED[reproducible]
  raise errors.CollectiveError(
      f"{what}={reproducible!r} is not a reproducible mode; use False, True (contract v3: one "
      "integer word per value) or 'v2' (contract v2: two words per value, a finer fixed-point "
      "grid; 'exact' is its deprecated name).")
