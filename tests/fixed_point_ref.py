"""Independent numpy references of the reproducible-sum contracts (docs/collectives.md).

Written from the contracts' text, not from dtenjax's code.

* Contract v3 (``reproducible=True``, :func:`v3_sum`): every quantity is an exact float64
  or int64 value: ``x / U`` is an exact float64 product, round-to-odd is ``trunc`` plus one where
  the truncation lost something and the truncated value is even, the ``q`` are summed as int64,
  ``Q * U`` is exact in float64 and rounded ONCE to the output dtype (numpy's float64 -> float32
  cast; for bfloat16 an explicit round-half-even at 8 significant bits, because ml_dtypes casts
  float64 through float32 and would round twice).
* Contract v2 (``reproducible="exact"``, :func:`exact_sum`): each contribution's fixed-point value
  ``q`` is formed from its integer mantissa by shifts with round-half-to-even done in integers,
  the ``q`` are summed as int64 (exact: |q| <= 2**40, at most 1024 contributions), and the final
  scaling is an exact float64 product rounded once to float32 by numpy (which keeps subnormals).
  bfloat16 goes through ml_dtypes (exact widening, RNE narrowing from float32).
"""

import math

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)


def widen(x) -> np.ndarray:
  """float32 values of float32 or bfloat16 contributions (exact)."""
  return np.asarray(x).astype(np.float32)


def codes(x32: np.ndarray) -> np.ndarray:
  b = x32.view(np.uint32).astype(np.int64)
  field = (b >> 23) & 0xFF
  nonzero = (b & 0x7FFFFFFF) != 0
  return np.where(field == 255, 255, np.where(nonzero, np.maximum(field, 1), 0))


def fixed(x32: np.ndarray, c: np.ndarray) -> np.ndarray:
  """int64 q = rint_half_even(x * 2**(166 - C)) for finite x, from the integer mantissa."""
  b = x32.view(np.uint32).astype(np.int64)
  field = (b >> 23) & 0xFF
  frac = b & 0x7FFFFF
  m = np.where(field == 0, frac, frac | 0x800000)      # |x| = m * 2**(max(field, 1) - 150)
  k = np.maximum(field, 1) - c + 16                    # q = m * 2**k
  up = m << np.clip(k, 0, 40)
  r = np.clip(-k, 1, 62)
  quot, rem = m >> r, m & ((1 << r) - 1)
  half = 1 << (r - 1)
  down = quot + ((rem > half) | ((rem == half) & (quot & 1 == 1)))
  q = np.where(k >= 0, up, down)
  return np.where(b >> 31 == 1, -q, q)


def exact_sum(x, axis: int = 0, mean: bool = False, out_dtype=None) -> np.ndarray:
  """Contract v2 over ``axis`` of float32/bfloat16 contributions; mean divides the float32
  decode by the contribution count (float32, RNE) before the final rounding."""
  x = np.asarray(x)
  out_dtype = np.dtype(out_dtype or x.dtype)
  x32 = np.moveaxis(widen(x), axis, 0)
  n = x32.shape[0]
  c = codes(x32).max(axis=0)
  finite = np.isfinite(x32)
  q = np.where(finite, fixed(np.where(finite, x32, 0).astype(np.float32), c[None]), 0)
  total = q.sum(axis=0)
  h, l = total >> 20, total & ((1 << 20) - 1)
  with np.errstate(over="ignore", invalid="ignore"):
    v = h.astype(np.float32) * np.float32(1 << 20) + l.astype(np.float32)
    r = (v.astype(np.float64) * np.exp2(c.astype(np.float64) - 166)).astype(np.float32)
  nan_or_ninf = (np.isnan(x32) | (x32 == -np.inf)).sum(axis=0)
  nan_or_pinf = (np.isnan(x32) | (x32 == np.inf)).sum(axis=0)
  special = np.where((nan_or_ninf > 0) & (nan_or_pinf > 0), np.float32(np.nan),
                     np.where(nan_or_pinf > 0, np.float32(np.inf), np.float32(-np.inf)))
  r = np.where(c == 255, special, np.where(c == 0, np.float32(0.0), r)).astype(np.float32)
  if mean:
    # The decode rounded with float32's precision but no upper exponent limit (v * 2**(c - 166)
    # is exact in float64 and already has 24 bits), divided once: a finite mean is never inf.
    with np.errstate(over="ignore", invalid="ignore"):
      r64 = v.astype(np.float64) * np.exp2(c.astype(np.float64) - 166)
      big = (np.abs(r64) >= 2.0 ** 128) & (c != 255)
      r = np.where(big, r64 / n, r.astype(np.float64) / n).astype(np.float32)
  return r.astype(out_dtype)


# --- contract v3 -------------------------------------------------------------------------------

V3_MAX_CONTRIBUTIONS = 32


def v3_precision(n: int) -> int:
  """Magnitude bits P of one word for n contributions: 31 - ceil(log2 n)."""
  return 31 - max(0, math.ceil(math.log2(n)))


def _special(x32: np.ndarray) -> np.ndarray:
  """The C == 255 result: NaN if a NaN or both infinities occur, else the infinity present."""
  nan_or_ninf = (np.isnan(x32) | (x32 == -np.inf)).any(axis=0)
  nan_or_pinf = (np.isnan(x32) | (x32 == np.inf)).any(axis=0)
  return np.where(nan_or_ninf & nan_or_pinf, np.float32(np.nan),
                  np.where(nan_or_pinf, np.float32(np.inf), np.float32(-np.inf)))


def round_once(v: np.ndarray, dtype) -> np.ndarray:
  """Exact float64 values rounded once (nearest, ties to even; subnormals kept, overflow to
  +-inf) to float32 or bfloat16."""
  v = np.asarray(v, np.float64)
  if np.dtype(dtype) == np.dtype(np.float32):
    with np.errstate(over="ignore"):
      return v.astype(np.float32)
  _, ex = np.frexp(v)                                  # |v| in [2**(ex-1), 2**ex)
  quantum = np.maximum(ex - 8, -133)                   # 8 significant bits; subnormal grid 2**-133
  r = np.ldexp(np.round(np.ldexp(v, -quantum)), quantum)   # np.round: half to even, exact here
  r = np.where(np.abs(r) >= 2.0 ** 128, np.copysign(np.inf, v), r)
  return r.astype(np.float32).astype(BF16)             # exact: r is a bfloat16 value


def round_24_unbounded(v: np.ndarray) -> np.ndarray:
  """Exact float64 values rounded once (nearest, ties to even) to 24 significant bits on the
  float32 subnormal grid below 2**-126, with no upper exponent limit (float64 holds the result)."""
  v = np.asarray(v, np.float64)
  _, ex = np.frexp(v)
  quantum = np.maximum(ex - 24, -149)
  return np.ldexp(np.round(np.ldexp(v, -quantum)), quantum)


def v3_words(x32: np.ndarray, c: np.ndarray, n: int) -> np.ndarray:
  """int64 q = round(x / U), U = 2**(C - 126 - P), of finite float32 x (0 elsewhere): to odd
  for n == 2, to nearest even otherwise."""
  finite = np.isfinite(x32)
  p = v3_precision(n)
  y = np.where(finite, x32, 0).astype(np.float64) * np.exp2((p - (c - 126)).astype(np.float64))
  if n == 2:
    t = np.trunc(np.abs(y))
    mag = t + ((t != np.abs(y)) & (np.fmod(t, 2) == 0))  # inexact: the odd neighbour toward y
    return np.where(y < 0, -mag, mag).astype(np.int64)
  return np.round(y).astype(np.int64)                  # half to even; exact float64 input


def v3_sum(x, axis: int = 0, mean: bool = False, out_dtype=None) -> np.ndarray:
  """Contract v3 (``reproducible=True``) over ``axis``: one word per contribution against the
  element's common exponent; more than 32 contributions use the exact contract v2."""
  x = np.asarray(x)
  out_dtype = np.dtype(out_dtype or x.dtype)
  x32 = np.moveaxis(widen(x), axis, 0)
  n = x32.shape[0]
  if n > V3_MAX_CONTRIBUTIONS:
    return exact_sum(x, axis=axis, mean=mean, out_dtype=out_dtype)
  c = codes(x32).max(axis=0)
  total = v3_words(x32, c[None], n).sum(axis=0)
  assert np.all(np.abs(total) < 2 ** 31), "v3 words must fit int32"
  exact = total.astype(np.float64) * np.exp2((c - 126 - v3_precision(n)).astype(np.float64))
  zero = np.zeros(c.shape, np.float64)
  if mean:
    # RNE of the sum at float32's 24 bits with no upper exponent limit, then one division
    # (float64 quotient rounded to float32: correctly rounded, 53 >= 2 * 24 + 2): a finite mean
    # is never inf.
    r = round_24_unbounded(np.where((c == 0) | (c == 255), zero, exact))
    with np.errstate(invalid="ignore", over="ignore"):
      r = (r / n).astype(np.float32)
    r = np.where(c == 255, _special(x32), r).astype(np.float32)
    return r.astype(out_dtype)
  r = round_once(np.where((c == 0) | (c == 255), zero, exact), out_dtype)
  return np.where(c == 255, _special(x32).astype(out_dtype), r).astype(out_dtype)


# What reproducible=True computes.
reproducible_sum = v3_sum


def fold_f32(x, axis: int = 0, out_dtype=None) -> np.ndarray:
  """The float32 rank-order left fold ``((x_0 + x_1) + x_2) + ...`` rounded to the dtype (what
  the deterministic one_shot algorithm computes), for error comparisons."""
  x = np.asarray(x)
  out_dtype = np.dtype(out_dtype or x.dtype)
  x32 = np.moveaxis(widen(x), axis, 0)
  acc = x32[0].copy()
  with np.errstate(over="ignore", invalid="ignore"):
    for i in range(1, x32.shape[0]):
      acc = (acc + x32[i]).astype(np.float32)
  return acc.astype(out_dtype)


def bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def special_columns(k: int, rng: np.random.Generator) -> np.ndarray:
  """``[k, m]`` float32 contributions covering the contract's corner cases, one case a column
  (each case's values first, zeros after; cut to ``k`` contributions)."""
  def col(*values):
    v = np.zeros(max(k, len(values)))
    v[:len(values)] = values
    return v[:k]
  cols = [
      np.full(k, np.nan), col(np.inf, 1, 1), col(np.inf, -np.inf, 1), col(-np.inf),
      col(np.nan, np.inf), col(1, np.nan), np.zeros(k), np.full(k, -0.0), col(-0.0),
      np.full(k, 3.0e38), col(3.4e38, 3.4e38), col(3.0e38, -3.0e38, 1.0), col(-3.4e38, -3.4e38),
      col(1e8, 1.0, -1e8), rng.standard_normal(k) * 1e-40, col(1.4e-45, 1.4e-45),
      col(1e-38, -9.9e-39), rng.standard_normal(k) * 2.0 ** -130,
      rng.standard_normal(k) * 2.0 ** 100, col(3.0e38, 2.0e37, -1.0e37),
  ]
  return np.stack(cols, axis=1).astype(np.float32)


def contributions(k: int, m: int, seed: int = 0) -> np.ndarray:
  """``[k, m]`` float32: the special columns, then random values over a wide dynamic range."""
  rng = np.random.default_rng(seed)
  special = special_columns(k, rng)
  rest = m - special.shape[1]
  rnd = rng.standard_normal((k, rest)) * np.exp2(rng.integers(-140, 120, (k, rest)))
  rnd[:, ::3] = rng.standard_normal((k, len(range(0, rest, 3)))) * 1e3   # similar magnitudes
  with np.errstate(over="ignore"):
    return np.concatenate([special, rnd.astype(np.float32)], axis=1)


def error_report(counts=(2, 3, 8, 24, 32), columns: int = 3000) -> str:
  """Errors against math.fsum on the adversarial suite (:func:`contributions`), per contract:
  the largest |result - S| / sum|x| over the finite columns, and on how many columns v3 is
  worse / better than the float32 fold. ``python tests/fixed_point_ref.py`` prints it."""
  lines = ["| N | dtype | v3 max err / sum abs | exact (v2) | float32 fold | v3 worse / better "
           "than the fold |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
  for n in counts:
    for dtype in (np.dtype(np.float32), BF16):
      x = contributions(n, columns, seed=5 + n).astype(dtype)
      x64 = widen(x).astype(np.float64)
      res = {"v3": v3_sum(x), "exact": exact_sum(x), "fold": fold_f32(x)}
      ok = np.all(np.isfinite(x64), axis=0) & (np.max(np.abs(x64), axis=0) > 0)
      for r in res.values():
        ok &= np.isfinite(widen(r))
      s = np.array([math.fsum(x64[:, j]) if ok[j] else 0.0 for j in range(x64.shape[1])])
      mass = np.sum(np.abs(x64), axis=0)
      err = {k: np.abs(widen(r).astype(np.float64) - s)[ok] for k, r in res.items()}
      rel = {k: np.max(e / mass[ok]) for k, e in err.items()}
      worse = int(np.sum(err["v3"] > err["fold"]))
      better = int(np.sum(err["v3"] < err["fold"]))
      name = "float32" if dtype == np.dtype(np.float32) else "bfloat16"
      lines.append(f"| {n} | {name} | {rel['v3']:.2e} | {rel['exact']:.2e} | {rel['fold']:.2e} "
                   f"| {worse} / {better} of {int(ok.sum())} |")
  return "\n".join(lines)


if __name__ == "__main__":
  print(error_report())
