"""Point-to-point messages between two processes over the host transport: a ring of two.

A :class:`PairLink` is one side of a :class:`~dtenjax._src.net.transport.Communicator` of size 2
(authenticated connection, AES-GMAC on every frame, TCP or RDMA verbs from the provider table).
The native ring's one operation is an all-reduce; on two ranks it is exactly an exchange: each
side puts its messages in its own slots of one buffer and zeros in the peer's, the buffer travels
as 32-bit integers, and the sum (``x + 0``, exact for integers whatever the payload's dtype: a
float's sign of zero and NaN payloads survive) hands each side the other's slots. A ring
all-reduce of two ranks sends half of the buffer each way in each of its two steps, so a side
sends as many bytes as its messages plus the peer's would take, in two round trips of the
ring's latency (``bench/pipeline_host.py`` measures what that costs against XLA's own
collective-permute).

Both sides must issue the same exchanges in the same order, with the same slot layout and tag:
the tag and the layout travel in every frame's fingerprint, so a side that is one exchange ahead
or sends another layout gets an error on both sides naming both. Every wait ends: a peer that
does not answer within the communicator's timeout raises CollectiveTimeoutError, a peer that died
raises TransportError, and :meth:`PairLink.exchange` adds what was waited for (the caller's
``what``: which peer, which message).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np

from dtenjax._src import errors
from dtenjax._src.net import credentials
from dtenjax._src.net import kvstore
from dtenjax._src.net import providers
from dtenjax._src.net import transport


@dataclasses.dataclass(frozen=True)
class Slot:
  """One message of an exchange: which side sends it (0: the lower-numbered end, 1: the other),
  its shape and dtype (the same on both sides)."""
  sender: int
  shape: tuple
  dtype: np.dtype

  @property
  def words(self) -> int:          # 32-bit words the message takes in the buffer (padded)
    return -(-int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize // 4)


class PairLink:
  """This process's end of a link to one peer (see the module docstring). ``side`` is 0 on the
  end with the lower ``me`` number, 1 on the other; ``peer`` names the other end in errors."""

  def __init__(self, comm: transport.Communicator, side: int, me: int, peer: int, label: str,
               context: str = ""):
    self.comm, self.side, self.me, self.peer, self.label = comm, side, me, peer, label
    # The site text travels in every frame's fingerprint: two ends that disagree about what the
    # link carries (``context``: e.g. the schedule and its numbers) fail at their first exchange.
    self._site = (0, f"pair link {label}" + (f": {context}" if context else ""))

  def __repr__(self) -> str:
    return f"PairLink({self.label!r}, {self.me} <-> {self.peer}, provider={self.comm.provider!r})"

  @property
  def provider(self) -> str:
    return self.comm.provider

  def exchange(self, slots: Sequence[Slot], mine: Sequence[np.ndarray], *, tag: int,
               what: str = "") -> list[np.ndarray]:
    """Sends ``mine`` (this side's slots, in slot order) and returns the peer's (in slot
    order). ``tag`` (an int, the same on both sides: e.g. the tick) and ``what`` (for errors:
    what this exchange waits for) name the exchange."""
    own = [s for s in slots if s.sender == self.side]
    if len(own) != len(mine):
      raise errors.CollectiveError(
          f"{self!r}: {len(mine)} messages passed for the {len(own)} slots this side sends")
    offsets = np.cumsum([0] + [s.words for s in slots])
    buf = np.zeros(int(offsets[-1]), np.int32)
    bytes_view = buf.view(np.uint8)
    it = iter(mine)
    for s, lo in zip(slots, offsets):
      if s.sender != self.side:
        continue
      x = np.array(next(it), copy=None, order="C")
      if x.shape != tuple(s.shape) or x.dtype != np.dtype(s.dtype):
        raise errors.CollectiveError(
            f"{self!r}: a message of shape {x.shape} and dtype {x.dtype} for a slot of shape "
            f"{tuple(s.shape)} and dtype {np.dtype(s.dtype)}")
      bytes_view[lo * 4:lo * 4 + x.nbytes] = x.reshape(-1).view(np.uint8)
    if buf.size == 0:
      return []
    try:
      out = self.comm.all_reduce(buf, "sum", site=self._site, tag=int(tag))
    except errors.DtenjaxError as e:
      detail = f" ({what})" if what else ""
      raise type(e)(f"{self.label}: exchange with peer {self.peer} at tag {tag}{detail} failed: "
                    f"{e}") from None
    got = []
    out_bytes = out.view(np.uint8)
    for s, lo in zip(slots, offsets):
      if s.sender == self.side:
        continue
      n = int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize
      got.append(out_bytes[lo * 4:lo * 4 + n].view(s.dtype).reshape(s.shape).copy())
    return got

  def close(self) -> None:
    self.comm.close()


_uses_lock = threading.Lock()
_uses: dict[tuple, int] = {}


def connect(name: str, me: int, peer: int, *, store: kvstore.KVStore | None = None,
            timeout_s: float | None = None, provider: str | None = None,
            process_index: int | None = None, context: str = "") -> PairLink:
  """Connects this process (``me``, e.g. its pipeline stage) to ``peer`` over the host transport;
  both call it with the same ``name`` (blocking until both have). ``me`` and ``peer`` are numbers
  both ends agree on (the lower one is side 0); endpoints travel through ``store`` (default:
  jax.distributed's coordination store). ``context`` (the same text on both ends: what the link
  carries) is checked at every exchange."""
  if me == peer:
    raise errors.ConfigurationError(f"pair link {name!r}: me={me} and peer={peer} must differ")
  store = store or kvstore.default()
  provider = provider or providers.select_provider()[0]
  creds = credentials.job_credentials(store, process_index=process_index)
  lo, hi = sorted((me, peer))
  with _uses_lock:
    use = _uses.get((name, me, peer), 0)
    _uses[(name, me, peer)] = use + 1
  label = f"{name} {lo}-{hi}"
  side = 0 if me == lo else 1
  comm = transport.create_local_comm(side, 2, creds, provider=provider, timeout_s=timeout_s,
                                     name=label)
  try:
    namespace = f"pair-{name}-{lo}-{hi}-{use}"
    try:
      eps = store.exchange(namespace, side, 2, comm.endpoint, timeout_s=timeout_s)
    except errors.CollectiveTimeoutError as e:
      raise errors.CollectiveTimeoutError(
          f"pair link {label!r}: peer {peer} did not publish its endpoint within the timeout "
          f"({e}): it died, is slower than the timeout, or never created this link") from e
    transport.connect(comm, eps[1 - side])
  except BaseException:
    comm.close()
    raise
  return PairLink(comm, side, me, peer, label, context)
