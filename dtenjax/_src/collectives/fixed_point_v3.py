"""Contract v3 of ``all_reduce(..., reproducible=True)``: one int32 word per value.

A float sum whose bits depend neither on the order of addition, nor on the algorithm, nor on how
the contributions are split over devices, computed as an integer sum. Per element, over all
``N`` contributions ``x_c`` (float32, or bfloat16 widened exactly), ``N <= 32``:

1. ``code(x)``: 255 for NaN/Inf, 0 for +-0, otherwise the biased exponent field of ``x`` with
   subnormals mapped to 1, so ``|x| < 2**(code - 126)``; ``C`` = the largest code.
2. ``C == 255``: NaN if some contribution is NaN or both infinities occur, else the infinity
   present. ``C == 0``: +0.0.
3. Otherwise, with ``P = 31 - ceil(log2 N)`` and the unit ``U = 2**(C - 126 - P)``, each
   contribution is one word ``q = round(x / U)``: to odd for ``N == 2`` (truncate toward zero,
   then set the lowest bit if anything was cut), to nearest even otherwise. ``|q| < 2**P``, so
   ``Q = sum q`` fits int32 (``ceil(log2 N)`` bits of headroom) and is exact in any order.
4. ``sum``: ``RNE_dtype(Q * U)``, rounded ONCE to the output dtype (subnormals kept, overflow to
   +-inf, ``Q == 0`` gives +0.0). ``mean``: ``RNE_f32(Q * U)`` divided by ``N`` (IEEE float32,
   subnormal quotients kept), then rounded to the dtype; where ``Q * U`` could pass float32's
   range the division happens at ``Q * U / 2**m`` (``2**m >= N``) and is scaled back, so a finite
   mean is never inf (``fixed_point.mean_of``: the same bits wherever ``RNE_f32(Q * U)`` is
   finite).

Error bound (sum, finite contributions, ``2**e > max |x_c|`` with ``e = C - 126``):
``|result - S| <= N * U / 2 + ulp_dtype(result) / 2`` with ``U = 2**(e - P)``; for ``N == 2`` the
result is the correctly rounded sum (round to odd keeps the information that decides the final
rounding), i.e. the float32 fold's bits; for ``N == 1`` it is the contribution itself.
docs/collectives.md derives it and compares it with a float32 rank-order fold.

More than :data:`MAX_CONTRIBUTIONS` contributions need more than one word: ``reproducible=True``
uses the exact contract v2 (``fixed_point.py``) for them.

Nothing here depends on XLA:CPU's flushing of subnormals (denormals-are-zero, flush-to-zero):
a word is an exact float product (or one far below 1/2, see :func:`quantize`), and the result's
bits are assembled by integer shifts (:func:`round_scaled`); the CUDA kernels
(``csrc/p2p/repro_v3.h``) compute the same bits with IEEE operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src.collectives import fixed_point

MAX_CONTRIBUTIONS = 32      # one int32 word: 31 - ceil(log2 N) >= 26 magnitude bits
_I32 = jnp.int32
_INF = 0x7F800000
_NAN = 0x7FC00000
_SIGN = np.int32(-0x80000000)


def supports(n: int) -> bool:
  """Whether ``n`` contributions fit one word per value (else the exact contract applies)."""
  return 1 <= n <= MAX_CONTRIBUTIONS


def precision(n: int) -> int:
  """Magnitude bits ``P = 31 - ceil(log2 n)`` of one word for ``n`` contributions."""
  return 31 - (int(n) - 1).bit_length()


def bits(x):
  """int32 float32 bit pattern of float32 or bfloat16 ``x`` (bfloat16 widened by a shift)."""
  if jnp.dtype(x.dtype) == jnp.dtype(jnp.bfloat16):
    return jnp.left_shift(jax.lax.bitcast_convert_type(x, jnp.uint16).astype(_I32), 16)
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), _I32)


def codes(b):
  """int32 ``code`` of float32 bit patterns ``b`` (step 1; monotone in ``b & 0x7FFFFFFF``)."""
  mag = b & 0x7FFFFFFF
  return jnp.maximum(jnp.right_shift(mag, 23), (mag != 0).astype(_I32))


def _pow2(k):
  """2.0**k as float32 for int32 k, clipped to [-126, 127] (built from the exponent bits)."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(jnp.clip(k, -126, 127) + 127, 23),
                                      jnp.float32)


def scales(c, n: int):
  """The three powers of two :func:`quantize` multiplies by, which depend on the codes ``c`` only:
  computed once for all the contributions of a sum (tracing them per contribution was most of
  the lowering time of a reproducible all-reduce)."""
  s = precision(n) + 126 - c
  s1 = jnp.minimum(s, 127)
  return _pow2(s1), _pow2(s - s1), _pow2(s - 149)


def quantize(b, c, n: int, scale=None):
  """int32 word ``q`` of finite ``x`` (float32 bits ``b``) against the common code ``c``:
  ``x / U = x * 2**s`` with ``s = P + 126 - c``, rounded to an integer. Meaningless where
  ``c == 255`` (the caller overrides those).

  Every product is exact or far below 1/2, so XLA:CPU's flushing of subnormals cannot change a
  word: a normal ``x`` is scaled by ``2**min(s, 127)`` and then by the rest (``x < 2**(c - 126)``
  keeps the first product below 2**31; a product below 2**-126, flushed to zero or not, is far
  below 1/2); a subnormal ``x = +-m * 2**-149`` is the exact integer ``+-m`` times
  ``2**(s - 149)``, a normal power of two whenever the word can be nonzero. Round to odd reads
  whether anything was cut from the product, and a nonzero ``x`` whose product vanished from the
  bits. ``scale``: :func:`scales` of ``c``, if the caller has them.
  """
  p1, p2, p3 = scales(c, n) if scale is None else scale
  x = jax.lax.bitcast_convert_type(b, jnp.float32)
  normal = (x * p1) * p2
  m = b & 0x7FFFFF
  sub = jax.lax.select(b < 0, -m, m).astype(jnp.float32) * p3
  y = jax.lax.select((b & 0x7F800000) == 0, sub, normal)
  if n != 2:                                        # nearest, ties to even
    return jax.lax.round(y, jax.lax.RoundingMethod.TO_NEAREST_EVEN).astype(_I32)
  a = jnp.abs(y)                                    # round to odd: truncate, then set the
  t = a.astype(_I32)                                # lowest bit if anything was cut
  cut = (t.astype(jnp.float32) != a) | ((a == 0) & ((b & 0x7FFFFFFF) != 0))
  t = t | cut.astype(_I32)
  return jnp.where(b < 0, -t, t)


def _special_word(b):
  """The word of a contribution when ``C == 255``: ``(NaN or -inf) + 2**16 (NaN or +inf)``."""
  nan = (b & 0x7FFFFFFF) > _INF
  return ((nan | (b == _I32(_INF | _SIGN))).astype(_I32) +
          jnp.left_shift((nan | (b == _INF)).astype(_I32), 16))


def encode(stack, c, n: int):
  """int32 sum of the words of ``stack``'s contributions (axis 0) against the reduced codes
  ``c``, for ``n`` contributions in all (what the collectives add up)."""
  total, scale = None, scales(c, n)
  for i in range(stack.shape[0]):
    b = bits(stack[i])
    w = jnp.where(c == 255, _special_word(b), quantize(b, c, n, scale))
    total = w if total is None else total + w
  return total


def round_scaled(q, t, p: int):
  """Bits of ``RNE(q * 2**t)`` in a binary format of ``p`` significant bits and float32's
  exponent range (``p = 24``: float32 bits; ``p = 8``: bfloat16 bits), for int32 ``q`` with
  ``|q| < 2**31``: one rounding, subnormals kept, overflow to +-inf, +0 for ``q == 0``.

  The result's last place is ``2**u`` with ``u = max(L - p + t, -125 - p)`` (``L`` = bit length
  of ``|q|``; the second term is the subnormal grid), ``|q|`` is shifted to it with
  round-half-even, and the bits are ``(u + 125 + p) << (p - 1)`` plus that integer (the implicit
  bit carries into the exponent field, which also covers subnormals and a rounding carry).
  """
  a = jnp.abs(q)
  length = 32 - jax.lax.clz(a)
  u = jnp.maximum(length - p + t, -125 - p)
  r = u - t
  rs = jnp.clip(r, 0, 31)
  m0 = jnp.right_shift(a, rs)
  cut = a - jnp.left_shift(m0, rs)
  half = jax.lax.shift_right_logical(jnp.left_shift(_I32(1), rs), _I32(1))
  up = (rs > 0) & ((cut > half) | ((cut == half) & ((m0 & 1) == 1)))
  m = jnp.where(r > 0, m0 + up.astype(_I32), jnp.left_shift(a, jnp.clip(-r, 0, 31)))
  g = u + 125 + p                                   # the exponent field minus one (normal)
  inf = 255 << (p - 1)
  out = jnp.where(g >= 254, inf, jnp.minimum(jnp.left_shift(jnp.minimum(g, 253), p - 1) + m, inf))
  out = jnp.where(a == 0, 0, out)
  sign = _SIGN if p == 24 else _I32(1 << (p + 7))
  return out | jnp.where(q < 0, sign, _I32(0))


def _finish(q, c, special, n: int, op: str, dtype):
  """The ``dtype`` result from the summed words ``q``, the codes ``c`` and the float32 bits of
  the special results (used where ``c == 255``)."""
  t = c - (126 + precision(n))
  if op == "mean" or jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    def at(k):                                        # RNE_f32(Q * U / 2**k)
      return jax.lax.bitcast_convert_type(round_scaled(q, t - k, 24), jnp.float32)
    r = fixed_point.mean_of(at, c, n) if op == "mean" else at(0)
    r = jnp.where(c == 255, jax.lax.bitcast_convert_type(special, jnp.float32),
                  jnp.where(c == 0, jnp.float32(0.0), r))
    return r.astype(dtype)
  r = round_scaled(q, t, 8)                           # bfloat16 sum: one rounding
  r = jnp.where(c == 255, jnp.right_shift(special, 16), jnp.where(c == 0, 0, r))
  return jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)


def decode(q, c, n: int, op: str, dtype):
  """The ``dtype`` result of summed words ``q`` (:func:`encode`, summed over devices) against
  the codes ``c`` for ``n`` contributions (step 4; ``op`` "sum" or "mean")."""
  neg = (q & 0xFFFF) > 0
  pos = jnp.right_shift(q, 16) > 0
  special = jnp.where(neg & pos, _I32(_NAN), jnp.where(pos, _I32(_INF), _I32(_INF | _SIGN)))
  return _finish(q, c, special, n, op, dtype)


def stack_codes(stack):
  """int32 codes of the largest magnitude over axis 0 (``code`` is monotone in the magnitude
  bits, and NaN > inf > finite there): one integer maximum per contribution."""
  mag = None
  for i in range(stack.shape[0]):
    m = bits(stack[i]) & 0x7FFFFFFF
    mag = m if mag is None else jnp.maximum(mag, m)
  return codes(mag)


def local_sum(stack, op: str = "sum", dtype=None):
  """Contract-v3 sum (or mean) over axis 0 of ``stack`` (an array, or a list of the
  contributions) on one device: the same bits as the collective word exchange of the same
  contributions. ``dtype`` defaults to ``stack``'s.

  Elementwise folds over the contributions (XLA:CPU reduces over a leading axis slowly): two
  integer maxima per contribution, ``hi = max(bits)`` and ``lo = max(bits ^ sign)``, see the
  positive and the negative contributions' magnitudes, so they give the largest magnitude
  (hence ``C``) and, for the special values, whether +inf (or a NaN) and -inf occur.
  """
  if isinstance(stack, (list, tuple)):   # the contributions one by one (reproducible.local_sum)
    rows = list(stack)
  else:
    rows = [stack[i] for i in range(stack.shape[0])]
  n = len(rows)
  dtype = rows[0].dtype if dtype is None else dtype
  b = [bits(r) for r in rows]
  hi, lo = b[0], b[0] ^ _SIGN
  for v in b[1:]:
    hi, lo = jnp.maximum(hi, v), jnp.maximum(lo, v ^ _SIGN)
  mag = jnp.maximum(hi, lo)
  c = codes(mag)
  q, scale = None, scales(c, n)
  for v in b:
    w = quantize(v, c, n, scale)
    q = w if q is None else q + w
  nan = (mag > _INF) | ((hi == _INF) & (lo == _INF))
  special = jnp.where(nan, _I32(_NAN), jnp.where(hi == _INF, _I32(_INF), _I32(_INF | _SIGN)))
  return _finish(q, c, special, n, op, dtype)
