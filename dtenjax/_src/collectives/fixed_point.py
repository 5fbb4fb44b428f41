"""Exact fixed-point arithmetic of ``all_reduce(..., reproducible=True)``: contract v2.

A float sum whose bits depend neither on the order of addition, nor on the algorithm, nor on how the
contributions are split over devices, computed as an integer sum (integer addition is
associative). Per element, over all contributions ``x_c`` (float32, or bfloat16 widened exactly):

1. :func:`codes`: a uint8 ``code(x)``: 255 for NaN/Inf, 0 for +-0, otherwise the biased exponent
   field of ``x`` with subnormals mapped to 1, so ``|x| < 2**(code - 126)``. Reduced with MAX
   (one byte per element on the wire).
2. :func:`encode`: against the reduced code ``C``, two int32 words ``(hi, lo)`` with
   ``hi * 2**20 + lo == q == rint_half_even(x * 2**(40 - e))``, ``e = C - 126``, ``lo`` in
   ``[0, 2**20)``. When ``C == 255`` the words are flags instead: ``hi = isnan(x) or x == -inf``,
   ``lo = isnan(x) or x == +inf``. Reduced with SUM: exact for up to :data:`MAX_CONTRIBUTIONS`.
3. :func:`decode`: ``h = HI + (LO >> 20)``, ``l = LO & (2**20 - 1)``,
   ``v = f32(h) * 2**20 + f32(l)`` (one rounding), ``result = RNE(v * 2**(e - 40))`` (one rounding,
   subnormals kept); bfloat16 rounds that float32 once more (RNE). ``C == 255``: NaN if both flag
   sums are positive, else the signed infinity; ``C == 0``: +0.0.

XLA:CPU runs with denormals-are-zero and flush-to-zero (``1e-40 * 2**100 == 0`` under jit), so no
float operation here may depend on a subnormal: a subnormal contribution is scaled on its bits, a
product that would underflow has ``q == 0`` whether flushed or not, subnormal results are assembled
on the bits, and the mean's subnormal quotients come from an integer division. So the results are
the exact values the contract defines on every backend and match GPU kernels that use IEEE
``__fmul_rn`` / ``__fdiv_rn`` without ``-ftz``.

Error bound against the exact sum ``S`` (``math.fsum``) of ``N`` finite contributions with
``2**e > max |x_c|``: ``|result - S| <= N * 2**(e - 41) + 2 ulp_f32(result)`` (plus half a bfloat16
ulp of the result for bfloat16): each ``q`` is off by at most half a unit ``2**(e - 40)``, and the
two roundings in decode cost at most one float32 ulp each. Zero results are +0.0.

The same jnp code runs on every backend; XLA fuses each pass into one elementwise loop (faster than
the former per-pass CPU FFI handlers, which were removed: see docs/collectives.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors

FRAC_BITS = 40
LO_BITS = 20
LO_MASK = (1 << LO_BITS) - 1
CODE_SPECIAL = 255          # some contribution is NaN or +-Inf
CODE_ZERO = 0               # every contribution is +-0
MAX_CONTRIBUTIONS = 1024    # hi sums stay within 2**30, lo sums below 2**30: no int32 overflow
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

_I32 = jnp.int32


def check_dtype(dtype, what: str = "reproducible all_reduce") -> None:
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise errors.CollectiveError(
        f"{what} supports float32 and bfloat16, got {jnp.dtype(dtype).name}. Cast the input "
        "(e.g. x.astype(jnp.float32)) or use reproducible=False (integer sums are already "
        "order-independent).")


def check_contributions(count: int, what: str = "reproducible all_reduce") -> None:
  if count > MAX_CONTRIBUTIONS:
    raise errors.CollectiveError(
        f"{what} of {count} contributions exceeds the exact-integer limit of "
        f"{MAX_CONTRIBUTIONS}; reduce in stages (e.g. per host, then across hosts) or use "
        "reproducible=False.")


def _bits(x):
  """int32 bit pattern of ``x`` widened to float32 (bfloat16 -> float32 is exact)."""
  return jax.lax.bitcast_convert_type(x.astype(jnp.float32), _I32)


def _pow2(k):
  """2.0**k as float32 for int32 k in [-126, 127], built from the exponent bits (exact)."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(k + 127, 23).astype(_I32), jnp.float32)


def codes(x):
  """uint8 ``code(x)`` per element (step 1; MAX-reduce it over contributions)."""
  b = _bits(x)
  field = jnp.right_shift(b, 23) & 0xFF
  nonzero = (b & 0x7FFFFFFF) != 0
  c = jnp.where(field == 0xFF, 0xFF, jnp.where(nonzero, jnp.maximum(field, 1), 0))
  return c.astype(jnp.uint8)


def _value_words(x, code_max):
  """(hi, lo) int32 of ``q = rint_half_even(x * 2**(166 - C))`` for finite ``x`` (step 3).

  Only exact float operations: a normal ``x`` is multiplied by two powers of two (a product
  below 2**-126, flushed to zero by XLA:CPU or not, has ``q == 0``); a subnormal ``x`` is scaled
  on its bits (as if its exponent field were 1, minus the implicit one); rint / floor / the split
  act on values whose every bit float32 holds. Meaningless where ``C == 255`` (the caller
  overrides those).
  """
  b = _bits(x)
  c = jnp.broadcast_to(code_max, x.shape).astype(_I32)
  s = (126 + FRAC_BITS) - c                     # x * 2**s, s = 40 - e
  s1 = jnp.minimum(s, 127)
  y = (x.astype(jnp.float32) * _pow2(jnp.clip(s1, -126, 127))) * _pow2(
      jnp.clip(s - s1, -126, 127))
  sub_shift = jnp.where(s >= 0, jnp.left_shift(s, 23) + (1 << 23), 0)
  implicit = jnp.where(s >= 0, jnp.left_shift(jnp.clip(s + 1, 1, 254), 23), 0)
  sub = (jax.lax.bitcast_convert_type(b + sub_shift, jnp.float32) -
         jax.lax.bitcast_convert_type(implicit | (b & _I32(-0x80000000)), jnp.float32))
  y = jnp.where((b & 0x7F800000) == 0, sub, y)
  q = jnp.round(y)                              # half to even
  h = jnp.floor(q * np.float32(2.0 ** -LO_BITS))
  lo = q - h * np.float32(1 << LO_BITS)
  return h.astype(_I32), lo.astype(_I32)


def _special_flags(x):
  """int32 (hi, lo) flags of the C == 255 case: (NaN or -inf, NaN or +inf)."""
  b = _bits(x)
  special = (jnp.right_shift(b, 23) & 0xFF) == 0xFF
  nan = special & ((b & 0x7FFFFF) != 0)
  inf = special & ~nan
  return (nan | (inf & (b < 0))).astype(_I32), (nan | (inf & (b >= 0))).astype(_I32)


def encode(x, code_max):
  """int32[2, *x.shape]: the (hi, lo) words of ``x`` against the reduced codes (step 3)."""
  c = jnp.broadcast_to(code_max, x.shape)
  hi, lo = _value_words(x, c)
  fhi, flo = _special_flags(x)
  special = c == CODE_SPECIAL
  return jnp.stack([jnp.where(special, fhi, hi), jnp.where(special, flo, lo)])


def _decode_values(hi, lo, c, shift: int = 0):
  """float32 ``RNE(v * 2**(e - 40 - shift))`` of summed value words (finite, nonzero C): the
  sum, or with ``shift`` the sum scaled down by ``2**shift`` (see :func:`mean_of`)."""
  h = hi + jnp.right_shift(lo, LO_BITS)
  l = lo & LO_MASK
  v = h.astype(jnp.float32) * np.float32(1 << LO_BITS) + l.astype(jnp.float32)
  t = c - (126 + FRAC_BITS + shift)
  vb = jax.lax.bitcast_convert_type(v, _I32)
  f = (jnp.right_shift(vb, 23) & 0xFF) + t      # exponent field of the exact result
  normal = jax.lax.bitcast_convert_type(vb + jnp.left_shift(t, 23), jnp.float32)
  # below 2**-126: the subnormal's bits are rint(|v| * 2**(t + 149)), an exact float product
  tiny = jnp.round(jnp.abs(v) * _pow2(jnp.clip(t + 149, -126, 127))).astype(_I32)
  tiny = jax.lax.bitcast_convert_type(tiny | (vb & _I32(-0x80000000)), jnp.float32)
  r = jnp.where(f >= 255, jnp.where(v < 0, -jnp.inf, jnp.inf), jnp.where(f >= 1, normal, tiny))
  return jnp.where(v == 0, jnp.float32(0.0), r)


def mean_of(decode_at, c, n: int):
  """The float32 mean of ``n`` contributions whose sum ``S`` has the codes ``c``:
  ``RNE(RNE(S) / n)``, where ``decode_at(k)`` is ``RNE(S / 2**k)`` (a decode with the exponent
  lowered by ``k``; meaningless where ``c`` is 0 or 255, which callers override).

  ``RNE(S)`` alone overflows where ``S`` does although the mean does not (8 x 3e38): where
  ``|S| < n * 2**(c - 126)`` can pass float32's range (``c + ceil(log2 n) > 254``) the sum is
  decoded scaled down by ``2**m >= n`` instead, divided, and scaled back. There ``S`` is a
  multiple of a unit far above the subnormal range, so both roundings are of normal numbers and
  commute with the power-of-two scaling: the bits are ``RNE(RNE(S) / n)`` wherever that is
  finite, and a finite mean is never inf. Error bound: the sum's own bound divided by ``n``, plus
  half an ulp of the result (docs/collectives.md)."""
  r = decode_at(0)
  if n == 1:
    return r
  m = (n - 1).bit_length()
  big = (c + m > 254) & (c < CODE_SPECIAL)
  q = divide(jnp.where(big, decode_at(m), r), n)
  return jnp.where(big, q * np.float32(2.0 ** m), q)


def decode_f32(words, code_max, mean_count: int | None = None):
  """float32 value of summed words (step 5), before any rounding to a narrower dtype; with
  ``mean_count`` the mean of that many contributions (:func:`mean_of`)."""
  hi, lo = words[0].astype(_I32), words[1].astype(_I32)
  c = jnp.broadcast_to(code_max, hi.shape).astype(_I32)
  if mean_count is None:
    r = _decode_values(hi, lo, c)
  else:
    r = mean_of(lambda k: _decode_values(hi, lo, c, k), c, mean_count)
  special = jnp.where((hi > 0) & (lo > 0), jnp.float32(jnp.nan),
                      jnp.where(lo > 0, jnp.float32(jnp.inf), jnp.float32(-jnp.inf)))
  r = jnp.where(c == CODE_SPECIAL, special, r)
  return jnp.where(c == CODE_ZERO, jnp.float32(0.0), r)


def decode(words, code_max, dtype):
  """The ``dtype`` result of summed words: float32 decode, then one RNE rounding to ``dtype``."""
  check_dtype(dtype)
  return decode_f32(words, code_max).astype(dtype)


def local_sum_f32(stack, mean: bool = False):
  """Contract-v2 sum (``mean``: mean, :func:`mean_of`) over axis 0 of ``stack`` on one device,
  as float32 (not yet rounded to a narrower dtype): the same bits as the collective word
  exchange of the same contributions.

  Written as elementwise folds over the contributions (XLA:CPU reduces over a leading axis
  slowly), with the per-element work hoisted out of the per-contribution loop:

  * ``C``: the code of the largest magnitude (``code`` is monotone in the magnitude bits, and
    NaN > inf > finite there), so one integer max per contribution;
  * special values: a NaN-propagating float max and min (NaN, or +inf with -inf, is NaN; else the
    infinity present), instead of per-contribution flags;
  * ``q``: a normal ``x`` times two exact powers of two (a product below 2**-126 is flushed or
    rounds to ``q = 0`` either way); a subnormal or zero ``x`` (exponent field 0,
    ``x = f * 2**-126``) is scaled on the bits as if its field were 1, which reads
    ``(1 + f) * 2**k``, and loses the implicit one by subtracting ``2**k`` (exact).
  """
  k = stack.shape[0]
  b = [_bits(stack[i]) for i in range(k)]
  xs = [stack[i].astype(jnp.float32) for i in range(k)]
  mag, hi_f, lo_f = b[0] & 0x7FFFFFFF, xs[0], xs[0]
  for i in range(1, k):
    mag = jnp.maximum(mag, b[i] & 0x7FFFFFFF)
    hi_f, lo_f = jnp.maximum(hi_f, xs[i]), jnp.minimum(lo_f, xs[i])
  c = codes(jax.lax.bitcast_convert_type(mag, jnp.float32)).astype(_I32)
  s = (126 + FRAC_BITS) - c
  s1 = jnp.minimum(s, 127)
  p1, p2 = _pow2(jnp.clip(s1, -126, 127)), _pow2(jnp.clip(s - s1, -126, 127))
  # field 0 (x = f * 2**-126): read with field 1 the bits are (1 + f) * 2**(s - 126); subtract
  # the implicit one. Only needed where s >= 0 (else |x * 2**s| < 2**-126 and q = 0).
  sub_shift = jnp.where(s >= 0, jnp.left_shift(s, 23) + (1 << 23), 0)
  implicit = jnp.where(s >= 0, jnp.left_shift(jnp.clip(s + 1, 1, 254), 23), 0)
  hi = lo = None
  for i in range(k):
    # normal x: two exact power-of-two products (an underflow is flushed or rounds to q = 0)
    y = (xs[i] * p1) * p2
    sub = (jax.lax.bitcast_convert_type(b[i] + sub_shift, jnp.float32) -
           jax.lax.bitcast_convert_type(implicit | (b[i] & _I32(-0x80000000)), jnp.float32))
    y = jnp.where((b[i] & 0x7F800000) == 0, sub, y)
    q = jnp.round(y)
    h = jnp.floor(q * np.float32(2.0 ** -LO_BITS))
    l = (q - h * np.float32(1 << LO_BITS)).astype(_I32)
    h = h.astype(_I32)
    hi, lo = (h, l) if hi is None else (hi + h, lo + l)
  if mean:
    r = mean_of(lambda m: _decode_values(hi, lo, c, m), c, k)
  else:
    r = _decode_values(hi, lo, c)
  special = jnp.where(jnp.isnan(hi_f) | ((hi_f == jnp.inf) & (lo_f == -jnp.inf)),
                      jnp.float32(jnp.nan), jnp.where(hi_f == jnp.inf, jnp.float32(jnp.inf),
                                                      jnp.float32(-jnp.inf)))
  r = jnp.where(c == CODE_SPECIAL, special, r)
  return jnp.where(c == CODE_ZERO, jnp.float32(0.0), r)


def ieee_divide(x, n: int):
  """``x / n`` rounded once (IEEE). XLA rewrites a division by a broadcast scalar into a
  multiplication by its rounded reciprocal (off by one ulp for a third of float32 inputs with
  n = 3), so the divisor is a materialised array XLA cannot see through."""
  d = jax.lax.optimization_barrier(jnp.full(x.shape, n, x.dtype))
  return x / d


def divide(r, n: int):
  """``r / n`` for float32 ``r`` and a positive integer ``n``: IEEE division, rounded once to
  nearest even, subnormal quotients included (the reproducible mean).

  Normal quotients are one float division. XLA:CPU would flush a subnormal quotient to zero
  (and treats a subnormal ``r`` as zero), so those (``|r| < n * 2**-126``) are divided in
  integers on the bits: ``N = |r| * 2**149 = m * 2**sh`` (mantissa ``m``, ``sh <= 15``) is split
  as ``Nh * 2**16 + Nl`` for an int32 long division; the rounded quotient is the subnormal's bit
  pattern (up to 2**-126 itself, whose bits continue the subnormal grid).
  """
  if n == 1:
    return r
  q = ieee_divide(r, n)
  b = jax.lax.bitcast_convert_type(r, _I32)
  field = jnp.right_shift(b, 23) & 0xFF
  m = jnp.where(field == 0, b & 0x7FFFFF, (b & 0x7FFFFF) | 0x800000)
  sh = jnp.clip(field - 1, 0, 15)
  nh = jnp.right_shift(m, 16 - sh)
  nl = jnp.left_shift(m & (jnp.left_shift(1, 16 - sh) - 1), sh)
  qh, rh = nh // n, nh % n
  rest = rh * (1 << 16) + nl
  ql, rem = rest // n, rest % n
  mq = qh * (1 << 16) + ql
  mq = mq + ((2 * rem > n) | ((2 * rem == n) & ((mq & 1) == 1))).astype(_I32)
  tiny = jax.lax.bitcast_convert_type(mq | (b & _I32(-0x80000000)), jnp.float32)
  # the quotient is below 2**-126 exactly when N < n * 2**23, i.e. Nh < n * 2**7
  return jnp.where((field <= 16) & (nh < n * 128), tiny, q)


def exact_sum(x, axis: int = 0):
  """Reproducible sum of ``x`` over ``axis`` on one device (the local half of the collective)."""
  check_dtype(x.dtype)
  check_contributions(x.shape[axis], "reproducible sum")
  return local_sum_f32(jnp.moveaxis(x, axis, 0)).astype(x.dtype)
