"""The host transport's wire protocol, authentication and rejection paths (in-process).

A Python client speaking the documented protocol (struct + Python's hmac) talks to the native TCP
provider, so the framing and the HMAC-SHA256 implementation are checked against an independent
implementation, and every malformed input is rejected, counted, and survived.
"""

import ctypes
import hashlib
import hmac
import os
import socket
import struct
import threading

import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.net import transport

pytestmark = pytest.mark.skipif(not transport.is_available(), reason="native extension not built")

HDR = struct.Struct("<IHHQQQQII")
MAGIC, VERSION = 0x584A5444, 1
HELLO, CHALLENGE, RESPONSE, ACCEPT, DATA = 1, 2, 3, 4, 5
JOB = 0x1234_5678_9ABC
SECRET = b"correct horse battery staple 123"


def header(ftype, payload=b"", *, job=JOB, seq=0, rank=1, size=None, magic=MAGIC,
           payload_sum=None):
  size = len(payload) if size is None else size
  psum = (transport.checksum64(payload) if payload else 0) if payload_sum is None else payload_sum
  body = struct.pack("<IHHQQQQI", magic, VERSION, ftype, job, seq, size, psum, rank)
  return body + struct.pack("<I", transport.checksum64(body) & 0xFFFFFFFF)


def recv_exact(s, n):
  buf = b""
  while len(buf) < n:
    chunk = s.recv(n - len(buf))
    if not chunk:
      raise ConnectionError("closed")
    buf += chunk
  return buf


def proof(key, label, client, server, n1, n2):
  msg = label + struct.pack("<QII", JOB, client, server) + n1 + n2
  return hmac.new(key, msg, hashlib.sha256).digest()


def py_client_handshake(endpoint, key, *, rank=1, server_rank=0):
  host, port = endpoint[len("tcp://"):].rsplit(":", 1)
  s = socket.create_connection((host, int(port)), timeout=10)
  nonce_c = os.urandom(32)
  s.sendall(header(HELLO, nonce_c, rank=rank) + nonce_c)
  h = HDR.unpack(recv_exact(s, 48))
  assert h[0] == MAGIC and h[2] == CHALLENGE and h[5] == 64
  ch = recv_exact(s, 64)
  server_ok = hmac.compare_digest(
      ch[32:], proof(key, b"dtenjax-server", rank, server_rank, nonce_c, ch[:32]))
  resp = proof(key, b"dtenjax-client", rank, server_rank, ch[:32], nonce_c)
  s.sendall(header(RESPONSE, resp, rank=rank) + resp)
  return s, server_ok


class Acceptor(threading.Thread):
  """Runs the native accept (GIL released by ctypes) while the test plays the client."""

  def __init__(self, lid, timeout=10.0):
    super().__init__(daemon=True)
    self.lid, self.timeout = lid, timeout
    self.conn, self.code, self.err = None, None, None

  def run(self):
    cid = ctypes.c_int64(-1)
    buf = ctypes.create_string_buffer(2048)
    self.code = transport.lib().dtenjax_tp_accept(self.lid, JOB, 0, 1, SECRET, len(SECRET),
                                                  self.timeout, ctypes.byref(cid), buf, 2048)
    self.conn, self.err = cid.value, buf.value.decode()


def listen():
  lid = ctypes.c_int64(-1)
  ep = ctypes.create_string_buffer(256)
  err = ctypes.create_string_buffer(2048)
  assert transport.lib().dtenjax_tp_listen(b"127.0.0.1", ctypes.byref(lid), ep, 256, err, 2048) == 0
  return lid.value, ep.value.decode()


def delta(before, after):
  return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.mark.parametrize("klen,mlen", [(0, 0), (3, 3), (32, 1000), (64, 55), (65, 64), (200, 7)])
def test_hmac_and_sha256_match_python(klen, mlen):
  rng = np.random.RandomState(klen * 1000 + mlen)
  key, msg = rng.bytes(klen), rng.bytes(mlen)
  assert transport.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
  assert transport.sha256(msg) == hashlib.sha256(msg).digest()


def test_checksum_detects_single_bit_flips():
  data = bytearray(np.random.RandomState(0).bytes(4099))
  base = transport.checksum64(bytes(data))
  for pos in (0, 1, 2048, 4098):
    for bit in (0, 7):
      data[pos] ^= 1 << bit
      assert transport.checksum64(bytes(data)) != base
      data[pos] ^= 1 << bit


def test_server_rejects_bad_peers_and_accepts_authenticated_one():
  lid, ep = listen()
  acc = Acceptor(lid)
  before = transport.counters()
  acc.start()
  host, port = ep[len("tcp://"):].rsplit(":", 1)

  def attempt(data):
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(data)
    s.settimeout(10)
    try:
      got = s.recv(1)   # the server closes the connection without answering
    except ConnectionResetError:
      got = b""
    s.close()
    return got

  assert attempt(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40) == b""        # bad magic
  n = os.urandom(32)
  assert attempt(header(HELLO, n, job=JOB + 1) + n) == b""                         # other job
  assert attempt(header(HELLO, n, rank=5) + n) == b""                              # unknown rank
  assert attempt(header(HELLO, n, size=1 << 31)) == b""                            # oversized
  bad = bytearray(header(HELLO, n))
  bad[20] ^= 0xFF
  assert attempt(bytes(bad) + n) == b""                                            # header crc
  s, server_ok = py_client_handshake(ep, b"wrong key, same length as right1")      # wrong secret
  assert not server_ok   # the client also catches the server's proof not matching its key
  with pytest.raises(ConnectionError):
    recv_exact(s, 48)
  s.close()
  s, server_ok = py_client_handshake(ep, SECRET)
  assert server_ok
  h = HDR.unpack(recv_exact(s, 48))
  assert h[2] == ACCEPT
  acc.join(15)
  assert acc.code == 0, acc.err
  d = delta(before, transport.counters())
  assert d["rejected_bad_header"] >= 1 and d["rejected_unknown_peer"] >= 2
  assert d["rejected_oversized"] == 1 and d["rejected_auth"] == 1
  assert d["rejected_bad_checksum"] == 1 and d["connections_accepted"] == 1

  # A data frame whose payload was corrupted in flight is rejected by checksum.
  payload = np.arange(256, dtype=np.float32).tobytes()
  bad_payload = bytearray(payload)
  bad_payload[100] ^= 1
  s.sendall(header(DATA, payload, seq=1) + bytes(bad_payload))
  out = np.zeros(256, np.float32)
  err = ctypes.create_string_buffer(2048)
  code = transport.lib().dtenjax_tp_exchange(
      -1, None, 0, acc.conn, out.ctypes.data_as(ctypes.c_void_p), out.nbytes, 1, JOB, 0, 5.0,
      err, 2048)
  assert code == 6 and b"checksum mismatch" in err.value
  # And a good one arrives intact (fresh connection: the first is dead after the rejection).
  s.close()
  transport.lib().dtenjax_tp_close(acc.conn)
  acc2 = Acceptor(lid)
  acc2.start()
  s, ok = py_client_handshake(ep, SECRET)
  recv_exact(s, 48)
  acc2.join(15)
  s.sendall(header(DATA, payload, seq=7) + payload)
  code = transport.lib().dtenjax_tp_exchange(
      -1, None, 0, acc2.conn, out.ctypes.data_as(ctypes.c_void_p), out.nbytes, 7, JOB, 0, 5.0,
      err, 2048)
  assert code == 0, err.value
  np.testing.assert_array_equal(out, np.arange(256, dtype=np.float32))
  s.close()
  transport.lib().dtenjax_tp_close(acc2.conn)
  transport.lib().dtenjax_tp_close(lid)


def test_native_ring_with_mismatched_secret_fails_fast():
  good = transport.JobCredentials(5, b"a" * 32)
  bad = transport.JobCredentials(5, b"b" * 32)
  c0 = transport.create_local_comm(0, 2, good, timeout_s=3)
  c1 = transport.create_local_comm(1, 2, bad, timeout_s=3)
  errs = {}
  def go(c, nxt):
    try:
      transport.connect(c, nxt)
    except errors.DtenjaxError as e:
      errs[c.rank] = e
  ts = [threading.Thread(target=go, args=(c0, c1.endpoint)),
        threading.Thread(target=go, args=(c1, c0.endpoint))]
  [t.start() for t in ts]
  [t.join(20) for t in ts]
  assert set(errs) == {0, 1}
  assert all(isinstance(e, errors.TransportError) for e in errs.values())
  assert any("authentication" in str(e) for e in errs.values())
  c0.close()
  c1.close()


def test_stalled_peer_times_out_with_clear_error():
  creds = transport.JobCredentials(6, b"c" * 32)
  comms = [transport.create_local_comm(r, 2, creds, timeout_s=1.0) for r in range(2)]
  ts = [threading.Thread(target=transport.connect, args=(comms[r], comms[1 - r].endpoint))
        for r in range(2)]
  [t.start() for t in ts]
  [t.join(10) for t in ts]
  with pytest.raises(errors.CollectiveTimeoutError, match="timed out"):
    comms[0].all_reduce(np.ones(10, np.float32))    # rank 1 never joins
  with pytest.raises(errors.TransportError, match="unusable after an earlier failure"):
    comms[0].all_reduce(np.ones(10, np.float32))
  for c in comms:
    c.close()


def test_credentials_and_provider_choice(monkeypatch):
  with pytest.raises(errors.ConfigurationError, match="at least 16"):
    transport.JobCredentials(1, b"short")
  monkeypatch.setenv("DTENJAX_TRANSPORT", "carrier-pigeon")
  with pytest.raises(errors.ConfigurationError, match="carrier-pigeon"):
    transport.select_provider([])
  monkeypatch.setenv("DTENJAX_TRANSPORT", "auto")
  name, why = transport.select_provider([{"name": "mlx5_0", "port": 1, "state": "down"}])
  assert name == "tcp" and "mlx5_0:1=down" in why
  name, why = transport.select_provider([])
  assert name == "tcp"
