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
   subnormal quotients kept), then rounded to the dtype.

Error bound (sum, finite contributions, ``2**e > max |x_c|`` with ``e = C - 126``):
``|result - S| <= N * U / 2 + ulp_dtype(result) / 2`` with ``U = 2**(e - P)``; for ``N == 2`` the
result is the correctly rounded sum (round to odd keeps the information that decides the final
rounding), i.e. the float32 fold's bits; for ``N == 1`` it is the contribution itself.
docs/collectives.md derives it and compares it with a float32 rank-order fold.

More than :data:`MAX_CONTRIBUTIONS` contributions need more than one word: ``reproducible=True``
uses the exact contract v2 (``fixed_point.py``) for them.

Only integer operations act on the values (the words come from the float bits by shifts, the
result's bits are assembled by shifts), so nothing here depends on XLA:CPU's flushing of
subnormals, and the CUDA kernels (``csrc/cuda/p2p_allreduce.cuh``) compute the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src.collectives import fixed_point

MAX_CONTRIBUTIONS = 32      # one int32 word: 31 - ceil(log2 N) >= 26 magnitude bits
_I32 = jnp.int32
_INF = 0x7F800000
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


def quantize_exact(b, c, n: int):
  """int32 word ``q`` of finite ``x`` (bits ``b``) against the common code ``c`` (step 3).

  ``|x| = m * 2**(max(f, 1) - 150)`` (mantissa ``m`` with its implicit bit, field ``f``), so
  ``x / U = m * 2**d`` with ``d = max(f, 1) - c + P - 24 <= P - 24``: a left shift when
  ``d >= 0``, else a right shift by ``k = -d`` rounded on the cut bits. Meaningless where
  ``c == 255`` (the caller overrides those).
  """
  p = precision(n)
  f = jnp.right_shift(b, 23) & 0xFF
  m = (b & 0x7FFFFF) | jnp.where(f != 0, _I32(1 << 23), _I32(0))
  d = jnp.maximum(f, 1) - c + (p - 24)
  k = jnp.clip(-d, 0, 31)
  t = jnp.right_shift(m, k)
  cut = m - jnp.left_shift(t, k)                    # the bits shifted out, < 2**k
  if n == 2:                                        # round to odd: any cut bit sets the lowest
    t = t | (cut != 0).astype(_I32)
  else:                                             # nearest, ties to even
    half = jax.lax.shift_right_logical(jnp.left_shift(_I32(1), k), _I32(1))
    t = t + ((cut > half) | ((cut == half) & (k > 0) & ((t & 1) == 1))).astype(_I32)
  q = jnp.left_shift(t, jnp.maximum(d, 0))
  return jnp.where(b < 0, -q, q)


def _pow2(k):
  """2.0**k as float32 for int32 k in [-126, 127] (built from the exponent bits)."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(jnp.clip(k, -126, 127) + 127, 23), jnp.float32)


def quantize_fast(x32, b, c, n: int):
  """:func:`quantize_exact` with float operations, valid where ``FAST_MIN_CODE <= c < 255``:
  there ``x * 2**(P + 126 - c)`` is one exact product (a product below 2**-126, flushed to zero
  or not, has |x / U| < 1/2), a subnormal ``x`` has ``|x / U| < 1/2`` (the flushing of subnormal
  inputs cannot matter; round to odd reads its cut bits from ``b``), and the product is rounded
  to an integer and converted exactly."""
  y = x32 * _pow2(precision(n) + 126 - c)
  if n != 2:
    return jnp.round(y).astype(_I32)                # half to even
  a = jnp.abs(y)
  t = a.astype(_I32)                                # truncation; exact below 2**31
  cut = (t.astype(jnp.float32) != a) | ((a == 0) & ((b & 0x7FFFFFFF) != 0))
  t = t | cut.astype(_I32)
  return jnp.where(b < 0, -t, t)


# From this code up to 254 the float forms meet no subnormal that matters (a contribution, a
# result, a mean's quotient) and no special value; an array whose every element's code is 0 or
# in that range takes them (XLA:CPU runs them about five times faster).
FAST_MIN_CODE = 40


def fast(c):
  """Whether every element's code allows the float forms (a scalar predicate for lax.cond;
  an integer minimum: XLA:CPU reduces booleans slowly)."""
  ok = (c == 0) | ((c >= FAST_MIN_CODE) & (c < 255))
  return jnp.min(ok.astype(_I32)) == 1


def _special_word(b):
  """The word of a contribution when ``C == 255``: ``(NaN or -inf) + 2**16 (NaN or +inf)``."""
  mag = b & 0x7FFFFFFF
  nan = mag > _INF
  return ((nan | (b == _I32(_INF | _SIGN))).astype(_I32) +
          jnp.left_shift((nan | (b == _INF)).astype(_I32), 16))


def _words(stack, c, n: int, use_fast: bool):
  """int32 sum of the words of ``stack``'s contributions (axis 0)."""
  total = None
  for i in range(stack.shape[0]):
    b = bits(stack[i])
    if use_fast:
      w = quantize_fast(stack[i].astype(jnp.float32), b, c, n)
    else:
      w = jnp.where(c == 255, _special_word(b), quantize_exact(b, c, n))
    total = w if total is None else total + w
  return total


def encode(stack, c, n: int):
  """int32 sum of the words of ``stack``'s contributions (axis 0) against the reduced codes
  ``c``, for ``n`` contributions in all (what the collectives add up)."""
  return jax.lax.cond(fast(c), lambda s, c: _words(s, c, n, True),
                      lambda s, c: _words(s, c, n, False), stack, c)


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


def _finish(q, c, n: int, op: str, dtype, use_fast: bool):
  """The ``dtype`` result from the summed words ``q`` and the codes ``c`` (step 4). The float
  form (every code 0 or in the fast range): the result and a mean's quotient are normal, so it
  is one int -> float32 conversion (the one rounding) times an exact power of two."""
  t = c - (126 + precision(n))
  f32 = op == "mean" or jnp.dtype(dtype) == jnp.dtype(jnp.float32)
  if use_fast and f32:
    r = jnp.where(c == 0, jnp.float32(0), q.astype(jnp.float32) * _pow2(t))
    return (fixed_point.ieee_divide(r, n) if op == "mean" else r).astype(dtype)
  neg = (q & 0xFFFF) > 0
  pos = jnp.right_shift(q, 16) > 0
  special = jnp.where(neg & pos, _I32(0x7FC00000), jnp.where(pos, _I32(_INF), _I32(_INF | _SIGN)))
  if f32:
    r = round_scaled(q, t, 24)
    r = jnp.where(c == 255, special, jnp.where(c == 0, 0, r))
    r = jax.lax.bitcast_convert_type(r, jnp.float32)
    if op == "mean":
      r = fixed_point.divide(r, n)
    return r.astype(dtype)
  r = round_scaled(q, t, 8)                           # bfloat16 sum: one rounding
  r = jnp.where(c == 255, jnp.right_shift(special, 16), jnp.where(c == 0, 0, r))
  return jax.lax.bitcast_convert_type(r.astype(jnp.uint16), jnp.bfloat16)


def decode(q, c, n: int, op: str, dtype):
  """The ``dtype`` result of summed words ``q`` (:func:`encode`, summed over devices) against
  the codes ``c`` for ``n`` contributions (step 4; ``op`` "sum" or "mean")."""
  return jax.lax.cond(fast(c), lambda q, c: _finish(q, c, n, op, dtype, True),
                      lambda q, c: _finish(q, c, n, op, dtype, False), q, c)


def stack_codes(stack):
  """int32 codes of the largest magnitude over axis 0 (``code`` is monotone in the magnitude
  bits, and NaN > inf > finite there): one integer maximum per contribution."""
  mag = None
  for i in range(stack.shape[0]):
    m = bits(stack[i]) & 0x7FFFFFFF
    mag = m if mag is None else jnp.maximum(mag, m)
  return codes(mag)


def local_sum(stack, op: str = "sum", dtype=None):
  """Contract-v3 sum (or mean) over axis 0 of ``stack`` on one device: ``decode(encode(...))``
  of the same contributions, so the same bits as the collective word exchange. ``dtype``
  defaults to ``stack``'s. Elementwise folds over the contributions (XLA:CPU reduces over a
  leading axis slowly)."""
  n = stack.shape[0]
  dtype = stack.dtype if dtype is None else dtype
  c = stack_codes(stack)

  def run(use_fast):
    return lambda s, c: _finish(_words(s, c, n, use_fast), c, n, op, dtype, use_fast)
  return jax.lax.cond(fast(c), run(True), run(False), stack, c)
