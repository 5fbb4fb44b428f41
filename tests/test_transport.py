"""The host transport's wire protocol, cryptography, authentication and set-up (in-process).

A pure-Python peer (tests/transport_ref.py: AES, GMAC, CRC32C and the frame layout written from
the specification, Python's hmac for HMAC-SHA256) takes part in real rings with the native
transport, so framing, key derivation and tags are checked against an independent
implementation; every malformed handshake is rejected, counted and survived.
"""

import hashlib
import hmac
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src import ffi
from dtenjax._src.net import credentials
from dtenjax._src.net import native
from dtenjax._src.net import providers
from dtenjax._src.net import transport
from dtenjax.testing import native as native_testing
from tests import transport_ref as ref
from tests.net_helpers import close_all, delta, listener, native_ring, requires_native, run_ranks

pytestmark = requires_native

JOB = 0x1234_5678_9ABC
SECRET = b"correct horse battery staple 123"

BINDINGS = ("Comm", "BufferPool", "counters", "providers", "crypto_load", "crypto_status",
            "hmac_sha256", "gmac", "register_site", "set_quota", "usage",
            "set_owner_context", "check_device_memory", "take", "_seams")
VERBS_BINDINGS = ("check_transition", "transition_mask", "select_gid", "validate_qp",
                  "encode_imm", "mtu_enum", "probe", "set_device")
TESTING_HOOKS = ("set_pointer_owners", "reset_pointer_owners", "fail_registrations",
                 "fail_thread_starts")


def test_every_binding_is_in_the_build():
  """A renamed or dropped binding fails here (it is never a silent skip)."""
  info = ffi.build_info()
  assert "transport" in info["bindings"], info
  t = native.transport()
  assert [b for b in BINDINGS if not hasattr(t, b)] == []
  assert not hasattr(t, "testing")        # fault injection lives in the test extension only
  assert [b for b in TESTING_HOOKS if not hasattr(native_testing.transport(), b)] == []
  assert "tcp" in providers.built_providers()
  if info["verbs"]:
    assert [b for b in VERBS_BINDINGS if not hasattr(t.verbs, b)] == []
    assert "verbs" in providers.built_providers()
  else:
    assert not hasattr(t, "verbs")


@pytest.mark.parametrize("klen,mlen", [(0, 0), (3, 3), (32, 1000), (64, 55), (65, 64), (200, 7)])
def test_hmac_sha256_from_libcrypto_matches_python(klen, mlen):
  rng = np.random.RandomState(klen * 1000 + mlen)
  key, msg = rng.bytes(klen), rng.bytes(mlen)
  assert native.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
  assert native.crypto_status()["loaded"]


def test_gmac_matches_the_specification():
  # The reference implementation against published vectors: FIPS-197 C.3, GCM test case 13.
  k = bytes(range(32))
  assert ref.aes256_encrypt_block(k, bytes.fromhex("00112233445566778899aabbccddeeff")).hex() == \
      "8ea2b7ca516745bfeafc49904b496089"
  assert ref.gmac(bytes(32), bytes(12), b"").hex() == "530f8afbc74536b9a963b4f1c4cb738b"
  # The native primitive against the reference.
  native.ensure_crypto()
  t = native.transport()
  assert t.gmac(bytes(32), 0, 0, b"").hex() == "530f8afbc74536b9a963b4f1c4cb738b"
  for n in (1, 15, 16, 17, 64, 1000):
    key, data = os.urandom(32), os.urandom(n)
    assert t.gmac(key, 9, 2, data) == ref.gmac(key, ref.nonce(9, 2), data), n


def _python_rank1(ep0: str, lsock: socket.socket, x1: np.ndarray, site: str, out: dict):
  """Rank 1 of a 2-rank ring, in Python: accepts rank 0, connects to rank 0, runs the ring."""
  conn, _ = lsock.accept()
  conn.settimeout(10)
  from_prev = ref.server_handshake(conn, SECRET, JOB, me=1, client=0)   # rank 0 -> rank 1
  to_next = ref.client_handshake(ep0, SECRET, JOB, me=1, server=0)      # rank 1 -> rank 0
  ref.setup_check(to_next, from_prev, me=1, n=2)                        # collective #0
  n, count = 2, x1.size
  half = count // 2 + count % 2
  chunks = [(0, half), (half, count)]
  acc = x1.copy()
  # The fingerprint, computed from the specification: the same call as rank 0's
  key = ref.fingerprint_key(SECRET, JOB)
  # (the stream is the creating thread's default one: an empty text, never a thread's name)
  record = dict(op=0, dtype=0, count=count, tag=0, signature=f"float32[{count}]", site=site,
                thread="")
  digest = ref.fingerprint_digest(key, **record)
  desc = dict(site=digest & 0xFFFFFFFF, tag=digest >> 32, coll_seq=1, count=count, op=0, dtype=0)
  to_next.send(ref.FINGERPRINT, ref.fingerprint_payload(digest, **record), **desc)
  # reduce-scatter: send chunk 1, receive chunk 0 and add
  lo, hi = chunks[1]
  to_next.send(ref.DATA, acc[lo:hi].tobytes(), step=0, **desc)
  h, payload = from_prev.recv()
  out["header0"] = h
  lo, hi = chunks[0]
  acc[lo:hi] = acc[lo:hi] + np.frombuffer(payload, np.float32)
  # all-gather: send chunk 0, receive chunk 1
  to_next.send(ref.DATA, acc[lo:hi].tobytes(), step=1, **desc)
  h, payload = from_prev.recv()
  lo, hi = chunks[1]
  acc[lo:hi] = np.frombuffer(payload, np.float32)
  out["result"] = acc
  out["fingerprints"] = list(from_prev.fingerprints)
  out["digest"] = digest
  del n


def test_python_peer_speaks_the_protocol():
  creds = credentials.JobCredentials(JOB, SECRET)
  comm0 = transport.create_local_comm(0, 2, creds, timeout_s=10)
  lsock, ep1 = listener()
  rng = np.random.RandomState(0)
  x0, x1 = rng.randn(1001).astype(np.float32), rng.randn(1001).astype(np.float32)
  site = (0xABCD1234, "peer-test (here:1)")
  peer: dict = {}
  t = threading.Thread(target=_python_rank1, args=(comm0.endpoint, lsock, x1, site[1], peer),
                       daemon=True)
  t.start()
  transport.connect(comm0, ep1)
  y0 = comm0.all_reduce(x0, "sum", site=site)
  t.join(30)
  assert not t.is_alive()
  expected = ref.reference_ring_sum([x0, x1])
  assert y0.tobytes() == expected.tobytes()
  assert peer["result"].tobytes() == expected.tobytes()
  h = peer["header0"]   # what the native side put on the wire
  assert (h["type"], h["src"], h["site"], h["tag"], h["coll_seq"], h["count"], h["op"],
          h["dtype"], h["step"]) == (ref.DATA, 0, peer["digest"] & 0xFFFFFFFF, peer["digest"] >> 32,
                                     1, 1001, 0, 0, 0)
  # rank 0's fingerprint came once, in full, before its data, and its digest is the one the
  # specification gives for the same call (the keyed hash of op, dtype, count, tag and texts)
  assert peer["fingerprints"] == [dict(digest=peer["digest"], full=True, op=0, dtype=0, tag=0,
                                       count=1001, signature="float32[1001]", site=site[1],
                                       thread="")]
  comm0.close()
  lsock.close()


def test_server_rejects_bad_peers_and_accepts_the_authenticated_one():
  """Every malformed handshake is refused with a REJECT frame naming the field that differs (bytes
  that are not dtenjax at all are just closed), counted, and survived; the real peer gets in."""
  creds = credentials.JobCredentials(JOB, SECRET)
  comm0 = transport.create_local_comm(0, 2, creds, timeout_s=15)
  lsock, ep1 = listener()
  before = native.counters()
  errs = {}
  t = threading.Thread(target=lambda: errs.setdefault("connect", transport.connect(comm0, ep1)),
                       daemon=True)
  t.start()
  conn, _ = lsock.accept()   # rank 0 connects to "rank 1" (us) while it waits for its prev
  conn.settimeout(10)
  from_prev = ref.server_handshake(conn, SECRET, JOB, me=1, client=0)

  def attempt(data: bytes):
    """What the listener answers to ``data``: a REJECT (class, code, text), or None (closed)."""
    s = socket.create_connection(ref.host_port(comm0.endpoint), timeout=10)
    s.sendall(data)
    try:
      head = ref.recv_exact(s, 64)
    except (ConnectionError, OSError):
      s.close()
      return None
    h = ref.parse_header(head)
    assert h["type"] == ref.REJECT and h["version"] == ref.VERSION, h
    r = ref.read_reject(s, h)
    assert s.recv(1) == b""    # and then it closes
    s.close()
    return r.cls, r.code, r.text

  n = os.urandom(32)
  hello = dict(job=JOB, src=1, payload_bytes=32)
  assert attempt(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40) is None           # bad magic
  cls, code, text = attempt(ref.header(ref.HELLO, **{**hello, "job": JOB + 1}) + n)   # other job
  assert (cls, code) == (ref.FATAL, 5) and f"job id {JOB + 1} is not this job's ({JOB})" in text
  cls, code, text = attempt(ref.header(ref.HELLO, **{**hello, "src": 5}) + n)         # wrong rank
  assert cls == ref.FATAL and "sender rank 5, expected 1" in text, text
  cls, _, text = attempt(ref.header(ref.HELLO, **{**hello, "payload_bytes": 1 << 31}))  # oversized
  assert cls == ref.FATAL and "exceeds the 1073741824-byte frame limit" in text, text
  # An old-protocol peer is named as one, before any other field is looked at (here also a job
  # id that differs: the version is what it hears about).
  cls, code, text = attempt(ref.header(ref.HELLO, **{**hello, "version": 2, "job": 7}) + n)
  assert (cls, code) == (ref.FATAL, 1), (cls, code, text)
  assert "speaks transport protocol version 2, this process version 4" in text, text
  wrong = b"wrong key, same length as right1"
  with pytest.raises(PermissionError):     # we see the server's proof does not match our key ...
    ref.client_handshake(comm0.endpoint, wrong, JOB, me=1, server=0)
  with pytest.raises(ref.Rejected) as r:   # ... and the server refuses our proof, saying so
    ref.client_handshake(comm0.endpoint, wrong, JOB, me=1, server=0, check_server=False)
  assert r.value.cls == ref.FATAL and "DTENJAX_JOB_SECRET" in r.value.text, r.value
  to_next = ref.client_handshake(comm0.endpoint, SECRET, JOB, me=1, server=0)
  ref.setup_check(to_next, from_prev, me=1, n=2)
  t.join(20)
  assert not t.is_alive() and errs == {"connect": None}
  d = delta(before, native.counters())
  assert d["rejected_bad_header"] >= 1 and d["rejected_unknown_peer"] >= 2, d
  assert d["rejected_oversized"] == 1 and d["rejected_auth"] == 1, d
  assert d["rejected_bad_version"] == 1 and d["connections_accepted"] == 1, d
  comm0.close()
  lsock.close()


def test_old_protocol_listener_is_named_by_the_client():
  """A native client meeting a listener of another protocol version says so at once, both when
  the listener answers with its own-version frames and when it closes without a word."""
  creds = credentials.JobCredentials(JOB, SECRET)
  lsock, ep = listener()

  def old_server(answer):
    for _ in range(3):
      conn, _ = lsock.accept()
      ref.recv_exact(conn, 96)    # the HELLO
      if answer:
        conn.sendall(ref.reject(ref.FATAL, 1, "v2 says no", job=JOB, src=1, version=2))
        conn.close()
        return
      conn.close()               # what a version-2 listener does with a frame it cannot read

  for answer, fragment in ((True, "speaks transport protocol version 2, this process version 4"),
                           (False, "closed the connection 3 times in a row without saying why")):
    th = threading.Thread(target=old_server, args=(answer,), daemon=True)
    th.start()
    c0 = transport.create_local_comm(0, 2, creds, timeout_s=10)
    t0 = time.monotonic()
    with pytest.raises(errors.DtenjaxError, match=fragment):
      transport.connect(c0, ep)
    assert time.monotonic() - t0 < 3   # not the 10 s timeout
    th.join(5)
    c0.close()
  lsock.close()


def test_native_ring_with_mismatched_secret_fails_fast():
  good = credentials.JobCredentials(5, b"a" * 32)
  bad = credentials.JobCredentials(5, b"b" * 32)
  c0 = transport.create_local_comm(0, 2, good, timeout_s=3)
  c1 = transport.create_local_comm(1, 2, bad, timeout_s=3)
  _, errs, seconds = run_ranks([lambda: transport.connect(c0, c1.endpoint),
                                lambda: transport.connect(c1, c0.endpoint)])
  assert all(isinstance(e, errors.TransportError) for e in errs), errs
  assert any("authentication" in str(e) for e in errs), errs
  assert seconds < 6
  close_all([c0, c1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_host_ring_keeps_the_sign_of_a_sum_of_negative_zeros(dtype):
  """IEEE: -0 + -0 = -0. The ring folds each chunk from its first rank's value (not from +0, as
  XLA's reduction does), so a sum of only -0.0 stays -0.0, and a +0.0 anywhere makes it +0.0."""
  comms, errs = native_ring(3, credentials.JobCredentials(0x44, SECRET))
  assert not errs
  for values in ([-0.0, -0.0, -0.0], [-0.0, 0.0, -0.0]):
    xs = [np.full(7, v, dtype) for v in values]    # 7 elements: chunks of 3, 2, 2
    outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(xs[r], site=(0x44, "zeros"))
                               for r in range(3)])
    assert errs == [None] * 3, errs
    want = -1.0 if all(np.signbit(values)) else 1.0    # IEEE, not the code under test
    for y in outs:
      assert np.all(y == 0) and np.all(np.copysign(1.0, y) == want), (values, y)
      assert y.tobytes() == ref.reference_ring_sum(xs).tobytes()
  close_all(comms)


def test_stalled_peer_times_out_with_clear_error():
  comms, errs = native_ring(2, credentials.JobCredentials(6, b"c" * 32), timeout_s=1.0)
  assert not errs
  with pytest.raises(errors.CollectiveTimeoutError, match="timed out after 1 s without progress receiving"):
    comms[0].all_reduce(np.ones(10, np.float32))    # rank 1 never joins
  with pytest.raises(errors.CollectiveTimeoutError, match="unusable after an earlier failure"):
    comms[0].all_reduce(np.ones(10, np.float32))
  close_all(comms)


def test_a_provider_not_in_the_build_is_named_with_those_that_are():
  creds = credentials.JobCredentials(8, b"p" * 32)
  with pytest.raises(errors.ExtensionUnavailableError,
                     match=r"provider 'carrier-pigeon' is not in this build: pass provider= one "
                           r"of \['tcp'"):
    transport.create_local_comm(0, 1, creds, provider="carrier-pigeon")


def test_an_array_tag_outside_jit_is_refused_naming_it():
  comm = transport.create_local_comm(0, 1, credentials.JobCredentials(7, b"t" * 32))
  try:
    with pytest.raises(errors.CollectiveError, match=r"got tag=array\(3.*hostcoll.all_reduce"):
      comm.all_reduce(np.ones(3, np.float32), tag=np.array(3))
  finally:
    comm.close()


def test_credentials_and_provider_table(monkeypatch):
  with pytest.raises(errors.ConfigurationError, match="at least 16"):
    credentials.JobCredentials(1, b"short")
  with pytest.raises(errors.ConfigurationError, match=r"job_id=18446744073709551616 .*2\*\*64-1"):
    credentials.JobCredentials(2**64, b"x" * 16)
  assert [p.name for p in providers.PROVIDERS] == ["verbs", "tcp"]
  monkeypatch.setenv("DTENJAX_TRANSPORT", "carrier-pigeon")
  with pytest.raises(errors.ConfigurationError, match="carrier-pigeon"):
    providers.select_provider([])
  monkeypatch.setenv("DTENJAX_TRANSPORT", "auto")
  name, why = providers.select_provider([{"name": "mlx5_0", "port": 1, "state": "down"}])
  assert name == "tcp" and "mlx5_0:1=down" in why
  name, why = providers.select_provider([{"name": "mlx5_0", "port": 1, "state": "ACTIVE"}])
  assert name == ("verbs" if "verbs" in providers.built_providers() else "tcp")


def test_no_usable_provider_names_every_one_passed_over(monkeypatch):
  """The end of ``auto``'s search: every provider unbuilt or unusable is an error naming each."""
  monkeypatch.setenv("DTENJAX_TRANSPORT", "auto")
  monkeypatch.setattr(providers, "PROVIDERS", (
      providers.ProviderSpec("verbs", lambda nics: (False, "no port is ACTIVE"), "RDMA"),
      providers.ProviderSpec("tcp", lambda nics: (False, "sockets are forbidden here"), "TCP"),
      providers.ProviderSpec("smoke", lambda nics: (True, "always"), "not a real provider")))
  monkeypatch.setattr(providers, "built_providers", lambda: ["verbs", "tcp"])
  monkeypatch.setattr(native, "is_available", lambda: True)
  with pytest.raises(errors.ExtensionUnavailableError,
                     match=r"no transport provider is usable: verbs is not usable: no port is "
                           r"ACTIVE; tcp is not usable: sockets are forbidden here; smoke is "
                           r"not in this build"):
    providers.select_provider([{"name": "mlx5_0", "port": 1, "state": "down"}])


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(rank=2, size=2), "rank=2 is out of range"),
    (dict(rank=0, size=2**40), "size=1099511627776 is out of range"),
    (dict(rank=0, size=2, timeout_s=float("nan")), "timeout_s=nan"),
    (dict(rank=0, size=2, timeout_s=-1.0), "timeout_s=-1.0"),
    (dict(rank=0, size=2, segment_bytes=2**64), "segment_bytes=18446744073709551616"),
    (dict(rank=0, size=2, max_pending_handshakes=0), "max_pending_handshakes=0"),
    (dict(rank=True, size=2), "rank=True must be an integer"),
])
def test_communicator_arguments_are_validated(kwargs, fragment):
  with pytest.raises(errors.ConfigurationError, match=fragment.replace("(", r"\(")):
    transport.create_local_comm(creds=credentials.JobCredentials(3, b"v" * 32), **kwargs)


def test_missing_libcrypto_fails_closed(tmp_path):
  """No libcrypto: no connection at all, and the error says what to install (subprocess, since
  the library is loaded once per process)."""
  code = (
      "from dtenjax._src import errors\n"
      "from dtenjax._src.net import credentials\n"
      "from dtenjax._src.net import transport\n"
      "c = credentials.JobCredentials(3, b'v' * 32)\n"
      "try:\n"
      "  transport.create_local_comm(0, 2, c)\n"
      "except errors.ExtensionUnavailableError as e:\n"
      "  print('REFUSED', e)\n"
      "else:\n"
      "  print('CREATED')\n"
      "one = transport.create_local_comm(0, 1, c)\n"   # a world of one needs no connection
      "print('SINGLE', one.all_reduce(__import__('numpy').ones(3, 'float32')).tolist())\n")
  env = dict(os.environ, DTENJAX_LIBCRYPTO=str(tmp_path / "libcrypto-missing.so.3"))
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
  assert "REFUSED" in out.stdout, out.stdout + out.stderr
  assert "libcrypto-missing.so.3" in out.stdout and "fail closed" in out.stdout
  assert "apt-get install libssl3" in out.stdout
  assert "SINGLE [1.0, 1.0, 1.0]" in out.stdout
