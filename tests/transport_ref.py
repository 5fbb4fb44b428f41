"""An independent pure-Python implementation of the host transport's wire protocol (version 4),
written from docs/transport.md, for tests: AES-256 (FIPS 197), GMAC (NIST SP 800-38D with the
data as additional authenticated data only), frame layout, handshake (with REJECT frames), key
derivation, the ring set-up check and the collectives' fingerprints (FINGERPRINT frames).

Slow (pure Python): meant for small frames. Nothing here imports dtenjax, so tests that compare
the native transport with it check the implementation against the specification, not itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

import numpy as np

# --- AES-256 (FIPS 197), encryption of single blocks ----------------------------------------------


def _xtime(a: int) -> int:
  a <<= 1
  return (a ^ 0x11B) & 0xFF if a & 0x100 else a


def _gmul(a: int, b: int) -> int:
  r = 0
  while b:
    if b & 1:
      r ^= a
    a = _xtime(a)
    b >>= 1
  return r


def _make_sbox() -> list[int]:
  inv = [0] * 256
  for x in range(1, 256):
    for y in range(1, 256):
      if _gmul(x, y) == 1:
        inv[x] = y
        break
  box = []
  for x in range(256):
    b = inv[x]
    s = b
    for k in range(1, 5):
      s ^= ((b << k) | (b >> (8 - k))) & 0xFF
    box.append(s ^ 0x63)
  return box


SBOX = _make_sbox()


def _expand_key(key: bytes) -> list[list[int]]:
  assert len(key) == 32
  nk, nr = 8, 14
  words = [list(key[4 * i:4 * i + 4]) for i in range(nk)]
  rcon = 1
  for i in range(nk, 4 * (nr + 1)):
    t = list(words[i - 1])
    if i % nk == 0:
      t = t[1:] + t[:1]
      t = [SBOX[b] for b in t]
      t[0] ^= rcon
      rcon = _xtime(rcon)
    elif i % nk == 4:
      t = [SBOX[b] for b in t]
    words.append([a ^ b for a, b in zip(words[i - nk], t)])
  return [sum(words[4 * r:4 * r + 4], []) for r in range(nr + 1)]


def aes256_encrypt_block(key: bytes, block: bytes) -> bytes:
  rk = _expand_key(key)
  s = [b ^ k for b, k in zip(block, rk[0])]
  for rnd in range(1, 15):
    s = [SBOX[b] for b in s]
    # ShiftRows: state is column-major, s[r + 4c]
    s = [s[(r + 4 * ((c + r) % 4))] for c in range(4) for r in range(4)]
    s = [s[4 * c + r] for c in range(4) for r in range(4)]  # back to column-major order
    if rnd != 14:
      out = []
      for c in range(4):
        a = s[4 * c:4 * c + 4]
        out += [_gmul(a[0], 2) ^ _gmul(a[1], 3) ^ a[2] ^ a[3],
                a[0] ^ _gmul(a[1], 2) ^ _gmul(a[2], 3) ^ a[3],
                a[0] ^ a[1] ^ _gmul(a[2], 2) ^ _gmul(a[3], 3),
                _gmul(a[0], 3) ^ a[1] ^ a[2] ^ _gmul(a[3], 2)]
      s = out
    s = [b ^ k for b, k in zip(s, rk[rnd])]
  return bytes(s)


# --- GMAC ------------------------------------------------------------------------------------------

_R = 0xE1 << 120


def _gf128_mul(x: int, y: int) -> int:
  z, v = 0, y
  for i in range(128):
    if (x >> (127 - i)) & 1:
      z ^= v
    v = (v >> 1) ^ _R if v & 1 else v >> 1
  return z


def gmac(key: bytes, nonce: bytes, aad: bytes) -> bytes:
  """AES-256-GCM tag of an empty plaintext with ``aad`` (96-bit nonce)."""
  assert len(nonce) == 12
  h = int.from_bytes(aes256_encrypt_block(key, bytes(16)), "big")
  y = 0
  padded = aad + bytes((-len(aad)) % 16)
  for i in range(0, len(padded), 16):
    y = _gf128_mul(y ^ int.from_bytes(padded[i:i + 16], "big"), h)
  y = _gf128_mul(y ^ ((len(aad) * 8) << 64), h)
  ek = aes256_encrypt_block(key, nonce + b"\x00\x00\x00\x01")
  return (int.from_bytes(ek, "big") ^ y).to_bytes(16, "big")


# --- frames ----------------------------------------------------------------------------------------

MAGIC, VERSION = 0x584A5444, 4
HELLO, CHALLENGE, RESPONSE, ACCEPT, DATA, ABORT, CONTROL, FINGERPRINT, REJECT = range(1, 10)
RETRY, FATAL = 1, 2   # REJECT classes
HEADER = struct.Struct("<IHHQQQIIQQBBHI")
assert HEADER.size == 64
TAG = 16
OPS = {"sum": 0, "max": 1, "min": 2, "prod": 3}
DTYPES = {"float32": 0, "float64": 1, "int32": 2, "int64": 3, "bfloat16": 4}


def header(ftype: int, *, job: int, src: int, payload_bytes: int, seq: int = 0, site: int = 0,
           coll_seq: int = 0, count: int = 0, op: int = 0, dtype: int = 0, step: int = 0,
           tag: int = 0, magic: int = MAGIC, version: int = VERSION) -> bytes:
  return HEADER.pack(magic, version, ftype, job, seq, payload_bytes, src, site, coll_seq, count,
                     op, dtype, step, tag)


def parse_header(b: bytes) -> dict:
  names = ("magic", "version", "type", "job", "seq", "payload_bytes", "src", "site", "coll_seq",
           "count", "op", "dtype", "step", "tag")
  return dict(zip(names, HEADER.unpack(b)))


def reject(cls: int, code: int, text: str, *, job: int, src: int, version: int = VERSION) -> bytes:
  """A REJECT frame: header, class byte, status code byte, text."""
  body = bytes([cls, code]) + text.encode()
  return header(REJECT, job=job, src=src, payload_bytes=len(body), version=version) + body


class Rejected(ConnectionError):
  """The other side of a handshake sent a REJECT frame."""

  def __init__(self, cls: int, code: int, text: str):
    super().__init__(f"REJECT class {cls} code {code}: {text}")
    self.cls, self.code, self.text = cls, code, text


def read_reject(s: socket.socket, h: dict) -> Rejected:
  body = recv_exact(s, h["payload_bytes"])
  return Rejected(body[0], body[1], body[2:].decode(errors="replace"))


def nonce(seq: int, label: int) -> bytes:
  return struct.pack("<QI", seq, label)


def seal(key: bytes, ftype: int, payload: bytes, **fields) -> bytes:
  """head (64) + header tag + payload + payload tag, under ``key`` with counter fields['seq']."""
  h = header(ftype, payload_bytes=len(payload), **fields)
  seq = fields.get("seq", 0)
  return h + gmac(key, nonce(seq, 1), h) + payload + gmac(key, nonce(seq, 2), h + payload)


def proof(secret: bytes, label: bytes, job: int, client: int, server: int, n1: bytes,
          n2: bytes) -> bytes:
  return hmac.new(secret, label + struct.pack("<QII", job, client, server) + n1 + n2,
                  hashlib.sha256).digest()


def session_keys(secret: bytes, job: int, client: int, server: int, nonce_c: bytes,
                 nonce_s: bytes) -> tuple[bytes, bytes]:
  """(client->server key, server->client key)."""
  master = hmac.new(secret, b"dtenjax-v3-session-keys" + struct.pack("<QII", job, client, server)
                    + nonce_c + nonce_s, hashlib.sha256).digest()
  return (hmac.new(master, b"client->server", hashlib.sha256).digest(),
          hmac.new(master, b"server->client", hashlib.sha256).digest())


def recv_exact(s: socket.socket, n: int) -> bytes:
  buf = b""
  while len(buf) < n:
    chunk = s.recv(n - len(buf))
    if not chunk:
      raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
    buf += chunk
  return buf


def host_port(endpoint: str) -> tuple[str, int]:
  host, port = endpoint[len("tcp://"):].rsplit(":", 1)
  return host, int(port)


class Channel:
  """One authenticated connection of the Python peer: socket, keys and counters."""

  def __init__(self, sock: socket.socket, job: int, me: int, peer: int, send_key: bytes,
               recv_key: bytes, send_seq: int = 0, recv_seq: int = 0):
    self.sock, self.job, self.me, self.peer = sock, job, me, peer
    self.send_key, self.recv_key = send_key, recv_key
    self.send_seq, self.recv_seq = send_seq, recv_seq
    self.fingerprints: list[dict] = []   # the full records received, in order
    self.pushback = b""   # a header already read from the socket

  def send(self, ftype: int, payload: bytes = b"", **desc) -> bytes:
    frame = seal(self.send_key, ftype, payload, job=self.job, src=self.me, seq=self.send_seq,
                 **desc)
    self.send_seq += 1
    self.sock.sendall(frame)
    return frame

  def recv(self, skip_fingerprints: bool = True) -> tuple[dict, bytes]:
    """The next frame; FINGERPRINT frames are decoded into self.fingerprints and skipped."""
    while True:
      h, payload = self._recv_one()
      if skip_fingerprints and h["type"] == FINGERPRINT:
        record = parse_fingerprint(payload)
        self.fingerprints.append(record if record["full"] else
                                 dict(self.fingerprints[-1], full=False))
        assert record["digest"] == self.fingerprints[-1]["digest"], record
        continue
      return h, payload

  def _recv_one(self) -> tuple[dict, bytes]:
    head, self.pushback = self.pushback or recv_exact(self.sock, 64), b""
    htag = recv_exact(self.sock, TAG)
    h = parse_header(head)
    assert h["magic"] == MAGIC and h["version"] == VERSION, h
    assert hmac.compare_digest(htag, gmac(self.recv_key, nonce(h["seq"], 1), head)), "bad htag"
    assert h["seq"] == self.recv_seq, (h["seq"], self.recv_seq)
    payload = recv_exact(self.sock, h["payload_bytes"])
    ptag = recv_exact(self.sock, TAG)
    assert hmac.compare_digest(ptag, gmac(self.recv_key, nonce(h["seq"], 2), head + payload))
    self.recv_seq += 1
    return h, payload


def client_handshake(endpoint: str, secret: bytes, job: int, me: int, server: int,
                     timeout: float = 10, check_server: bool = True) -> Channel:
  s = socket.create_connection(host_port(endpoint), timeout=timeout)
  nonce_c = os.urandom(32)
  s.sendall(header(HELLO, job=job, src=me, payload_bytes=32) + nonce_c)
  h = parse_header(recv_exact(s, 64))
  if h["type"] == REJECT:
    raise read_reject(s, h)
  assert h["type"] == CHALLENGE and h["payload_bytes"] == 64, h
  ch = recv_exact(s, 64)
  nonce_s = ch[:32]
  if check_server and not hmac.compare_digest(
      ch[32:], proof(secret, b"dtenjax-server", job, me, server, nonce_c, nonce_s)):
    raise PermissionError("the server's proof does not match our secret")
  resp = proof(secret, b"dtenjax-client", job, me, server, nonce_s, nonce_c)
  s.sendall(header(RESPONSE, job=job, src=me, payload_bytes=32) + resp)
  c2s, s2c = session_keys(secret, job, me, server, nonce_c, nonce_s)
  ch = Channel(s, job, me, server, send_key=c2s, recv_key=s2c)
  head = recv_exact(s, 64)
  h = parse_header(head)
  if h["type"] == REJECT:
    raise read_reject(s, h)
  ch.pushback = head
  h, _ = ch.recv()
  assert h["type"] == ACCEPT, h
  return ch


def server_handshake(sock: socket.socket, secret: bytes, job: int, me: int, client: int
                     ) -> Channel:
  h = parse_header(recv_exact(sock, 64))
  assert h["type"] == HELLO and h["src"] == client, h
  nonce_c = recv_exact(sock, 32)
  nonce_s = os.urandom(32)
  sock.sendall(header(CHALLENGE, job=job, src=me, payload_bytes=64) + nonce_s +
               proof(secret, b"dtenjax-server", job, client, me, nonce_c, nonce_s))
  h = parse_header(recv_exact(sock, 64))
  assert h["type"] == RESPONSE, h
  resp = recv_exact(sock, 32)
  assert hmac.compare_digest(resp, proof(secret, b"dtenjax-client", job, client, me, nonce_s,
                                         nonce_c)), "client proof"
  c2s, s2c = session_keys(secret, job, client, me, nonce_c, nonce_s)
  ch = Channel(sock, job, me, client, send_key=s2c, recv_key=c2s)
  ch.send(ACCEPT)
  return ch


# --- fingerprints (csrc/transport/fingerprint.h) -------------------------------------------------

def fingerprint_key(secret: bytes, job: int) -> bytes:
  return hmac.new(secret, b"dtenjax-fingerprint-key" + struct.pack("<Q", job),
                  hashlib.sha256).digest()


def _texts(*texts: str, width: int) -> bytes:
  out = b""
  for t in texts:
    b = t.encode()
    out += len(b).to_bytes(width, "little") + b
  return out


def fingerprint_digest(key: bytes, *, op: int, dtype: int, count: int, tag: int = 0,
                       signature: str = "", site: str = "", thread: str = "") -> int:
  """The keyed 64-bit digest: HMAC-SHA256 of the fields and the three texts, first 8 bytes."""
  msg = (b"dtenjax-fingerprint-v1" + bytes([op, dtype]) + struct.pack("<QI", count, tag) +
         _texts(signature, site, thread, width=4))
  return int.from_bytes(hmac.new(key, msg, hashlib.sha256).digest()[:8], "little")


def fingerprint_payload(digest: int, *, full: bool = True, op: int = 0, dtype: int = 0,
                        count: int = 0, tag: int = 0, signature: str = "", site: str = "",
                        thread: str = "") -> bytes:
  out = struct.pack("<QB", digest, int(full))
  if full:
    out += struct.pack("<BBIQ", op, dtype, tag, count) + _texts(signature, site, thread, width=2)
  return out


def parse_fingerprint(p: bytes) -> dict:
  digest, full = struct.unpack_from("<QB", p)
  if not full:
    assert len(p) == 9, len(p)
    return dict(digest=digest, full=False)
  op, dtype, tag, count = struct.unpack_from("<BBIQ", p, 9)
  at, texts = 9 + 14, []
  for _ in range(3):
    n = int.from_bytes(p[at:at + 2], "little")
    texts.append(p[at + 2:at + 2 + n].decode())
    at += 2 + n
  assert at == len(p)
  return dict(digest=digest, full=True, op=op, dtype=dtype, tag=tag, count=count,
              signature=texts[0], site=texts[1], thread=texts[2])


SETUP = dict(coll_seq=0, count=1, op=OPS["max"], dtype=DTYPES["int32"], site=0, tag=0)


def setup_check(to_next: Channel, from_prev: Channel, me: int, n: int) -> None:
  """This rank's part of the ring set-up check: the ring all-reduce (max) of one int32 zero,
  collective number 0. Of the n chunks only chunk 0 holds an element; the others travel as empty
  segments. Reduce-scatter steps t < n-1 send chunk (me - t) mod n, all-gather steps send chunk
  (me + 1 - (t - (n-1))) mod n; one segment per step."""
  for t in range(2 * (n - 1)):
    chunk = (me - t) % n if t < n - 1 else (me + 1 - (t - (n - 1))) % n
    to_next.send(DATA, bytes(4) if chunk == 0 else b"", step=t, **SETUP)
    h, payload = from_prev.recv()
    want = {k: h[k] for k in SETUP}
    assert h["type"] == DATA and h["step"] == t and want == SETUP, h
    assert payload in (b"", bytes(4)), payload


# --- the ring all-reduce's order (dtenjax/_src/net/hostcoll.py) -------------------------------

def reference_ring_sum(xs) -> np.ndarray:
  """numpy reproduction of the ring's reduction order (bit-exact for float32/float64/int)."""
  n = len(xs)
  flat = [np.asarray(a).reshape(-1) for a in xs]
  count = flat[0].size
  out = np.empty_like(flat[0])
  base, rem = divmod(count, n)
  for c in range(n):
    lo = base * c + min(c, rem)
    hi = lo + base + (1 if c < rem else 0)
    acc = flat[c][lo:hi].copy()
    for i in range(1, n):
      acc = acc + flat[(c + i) % n][lo:hi]
    out[lo:hi] = acc
  return out.reshape(np.shape(xs[0]))
