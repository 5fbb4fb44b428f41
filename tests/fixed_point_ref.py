"""An independent numpy reference of the reproducible-sum contract v2 (/docs/collectives.md).

Written from the contract's text, not from dtenjax's code: float bits are read with numpy views,
each contribution's fixed-point value ``q`` is formed from its integer mantissa by shifts with
round-half-to-even done in integers, the ``q`` are summed as int64 (exact: |q| <= 2**40, at most
1024 contributions), and the final scaling is an exact float64 product rounded once to float32 by
numpy (which keeps subnormals). bfloat16 goes through ml_dtypes (exact widening, RNE narrowing).
"""

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


def reproducible_sum(x, axis: int = 0, mean: bool = False, out_dtype=None) -> np.ndarray:
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
    r = (r / np.float32(n)).astype(np.float32)
  return r.astype(out_dtype)


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
