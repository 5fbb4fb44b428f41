"""Who belongs to a job: the job id in every frame header and the secret that authenticates it.

Every connection of the host transport is authenticated by an HMAC-SHA256 challenge-response keyed
by the job secret: ``DTENJAX_JOB_SECRET`` if set, else random bytes made by process 0 and shared
through jax.distributed's coordination store (:mod:`dtenjax._src.net.kvstore`), as is the job id.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading

from dtenjax._src import config
from dtenjax._src import errors
from dtenjax._src.net import checks
from dtenjax._src.net import kvstore


@dataclasses.dataclass(frozen=True)
class JobCredentials:
  """Who belongs to this job: a 64-bit job id in every frame header and the HMAC secret."""
  job_id: int
  secret: bytes = dataclasses.field(repr=False)

  def __post_init__(self):
    checks.integer("job_id", self.job_id, 1, checks.U64_MAX)
    if not isinstance(self.secret, (bytes, bytearray)):
      raise errors.ConfigurationError(
          f"the job secret must be bytes, got {type(self.secret).__name__}.")
    if len(self.secret) < 16:
      raise errors.ConfigurationError(
          f"the job secret has {len(self.secret)} bytes; use at least 16 (set "
          "DTENJAX_JOB_SECRET to a long random string, or leave it unset to have process 0 make "
          "one).")


_creds_lock = threading.Lock()
_creds: JobCredentials | None = None


def job_credentials(store: kvstore.KVStore | None = None, *, process_index: int | None = None
                    ) -> JobCredentials:
  """This job's credentials; the first call on each process is collective (reads the store)."""
  global _creds
  with _creds_lock:
    if _creds is not None:
      return _creds
    store = store or kvstore.default()
    if process_index is None:
      import jax
      process_index = jax.process_index()
    env = config.get_str("DTENJAX_JOB_SECRET")
    if process_index == 0:
      store.set(store.key("job", "id"), str(secrets.randbits(63) | 1), overwrite=True)
      if not env:
        store.set(store.key("job", "secret"), secrets.token_hex(32), overwrite=True)
    job_id = int(store.get(store.key("job", "id")))
    secret = env.encode() if env else bytes.fromhex(store.get(store.key("job", "secret")))
    _creds = JobCredentials(job_id, secret)
    return _creds
