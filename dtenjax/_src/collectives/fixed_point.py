"""Exact fixed-point encoding: the arithmetic behind ``all_reduce(..., reproducible=True)``.

A float sum whose bits do not depend on the order of addition, the algorithm or the device count
is computed as an integer sum (integer addition is associative). Per element, over all
contributions:

1. :func:`analyze` gives ``meta = [e, pinf, ninf]``: the exponent with ``|x| < 2**e`` and flags for
   +inf/-inf (a NaN sets both). Reduced across contributions with MAX.
2. :func:`encode` turns each contribution into two int32 words, ``hi * 2**20 + lo ==
   rint(x * 2**(40 - e_max))``. Reduced with SUM, which is exact for up to
   :data:`MAX_CONTRIBUTIONS` contributions.
3. :func:`decode` turns the summed words back into a float and applies IEEE rules: any NaN, or
   +inf with -inf, gives NaN; infinities of one sign propagate.

Error bound of the result ``r`` against the exact sum ``s`` of ``N`` contributions whose largest
magnitude is below ``2**e_max``: ``|r - s| <= N * 2**(e_max - 41) + 2 ulp(r)`` (quantisation
of each contribution plus the two f32 roundings in :func:`decode`); bf16 adds one bf16 rounding.
Zero results are +0.0.

Two implementations produce identical bits: a jnp formulation (every backend) and the CPU FFI
handlers ``dtenjax_fp_{analyze,encode,decode}`` (one pass each, used on CPU when the extension is
built). ``tests/test_fixed_point.py`` pins their equality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dtenjax._src import errors
from dtenjax._src import ffi

FRAC_BITS = 40
LO_BITS = 20
EXP_ZERO = -200
MAX_CONTRIBUTIONS = 1 << (31 - LO_BITS)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_dtype(dtype, what: str = "reproducible all_reduce") -> None:
  if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
    raise errors.CollectiveError(
        f"{what} supports float32 and bfloat16, got {jnp.dtype(dtype).name}. Cast the input "
        "(e.g. x.astype(jnp.float32)) or use reproducible=False (integer sums are already "
        "order-independent).")


def _pow2(k):
  """2.0**k as float32 for int32 k in [-126, 127], built from the exponent bits (exact)."""
  return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def _use_ffi(x) -> bool:
  del x
  return jax.default_backend() == "cpu" and ffi.is_built()


# --- jnp formulation --------------------------------------------------------------------------

def _analyze_jnp(x):
  x = x.astype(jnp.float32)
  finite = jnp.isfinite(x)
  _, ex = jnp.frexp(jnp.where(finite, x, 0.0))
  e = jnp.where(finite & (x != 0), ex.astype(jnp.int32), EXP_ZERO)
  nan = jnp.isnan(x)
  pinf = ((x == jnp.inf) | nan).astype(jnp.int32)
  ninf = ((x == -jnp.inf) | nan).astype(jnp.int32)
  return jnp.stack([e, pinf, ninf])


def _encode_jnp(x, e_max):
  x = x.astype(jnp.float32)
  s = FRAC_BITS - e_max
  big = s > 127
  y = x * _pow2(jnp.where(big, 127, s))
  y = y * _pow2(jnp.where(big, s - 127, 0))
  q = jnp.round(y)                             # round half to even, like nearbyint
  h = jnp.floor(q * np.float32(2.0 ** -LO_BITS))
  lo = q - h * np.float32(2.0 ** LO_BITS)
  keep = jnp.isfinite(x) & (e_max != EXP_ZERO)
  hi = jnp.where(keep, h, 0).astype(jnp.int32)
  lo = jnp.where(keep, lo, 0).astype(jnp.int32)
  return jnp.stack([hi, lo])


def _decode_jnp(words, meta, dtype):
  hi, lo = words[0], words[1]
  e_max, pinf, ninf = meta[0], meta[1], meta[2]
  h = hi + (lo >> LO_BITS)
  l = lo & ((1 << LO_BITS) - 1)
  v = h.astype(jnp.float32) * np.float32(2.0 ** LO_BITS) + l.astype(jnp.float32)
  t = jnp.maximum(e_max - FRAC_BITS, -226)     # only EXP_ZERO is clamped (v == 0 there)
  t1 = jnp.maximum(t, -100)
  r = (v * _pow2(t1)) * _pow2(t - t1)
  r = jnp.where(pinf > 0, jnp.inf, r)
  r = jnp.where(ninf > 0, -jnp.inf, r)
  r = jnp.where((pinf > 0) & (ninf > 0), jnp.nan, r)
  return r.astype(dtype)


# --- public entry points: FFI on CPU when built, jnp otherwise -------------------------------

def analyze(x, *, use_ffi: bool | None = None):
  """int32[3, *x.shape]: exponent, +inf flag, -inf flag of each element (MAX-reducible)."""
  check_dtype(x.dtype)
  if use_ffi if use_ffi is not None else _use_ffi(x):
    target = ffi.require("dtenjax_fp_analyze")
    out = jax.ShapeDtypeStruct((3,) + x.shape, jnp.int32)
    return jax.ffi.ffi_call(target, out, vmap_method="broadcast_all")(x)
  return _analyze_jnp(x)


def encode(x, e_max, *, use_ffi: bool | None = None):
  """int32[2, *x.shape]: the (hi, lo) fixed-point words of x against the reduced exponents."""
  check_dtype(x.dtype)
  if use_ffi if use_ffi is not None else _use_ffi(x):
    target = ffi.require("dtenjax_fp_encode")
    out = jax.ShapeDtypeStruct((2,) + x.shape, jnp.int32)
    return jax.ffi.ffi_call(target, out, vmap_method="broadcast_all")(x, e_max.astype(jnp.int32))
  return _encode_jnp(x, e_max)


def decode(words, meta, dtype, *, use_ffi: bool | None = None):
  """The float (dtype) value of summed words, with IEEE special values from reduced meta."""
  check_dtype(dtype)
  if use_ffi if use_ffi is not None else _use_ffi(words):
    target = ffi.require("dtenjax_fp_decode")
    out = jax.ShapeDtypeStruct(words.shape[1:], jnp.dtype(dtype))
    return jax.ffi.ffi_call(target, out, vmap_method="broadcast_all")(words, meta)
  return _decode_jnp(words, meta, dtype)


def exact_sum(x, axis: int = 0, *, use_ffi: bool | None = None):
  """Reproducible sum of ``x`` over ``axis`` on one device (the local half of the collective)."""
  check_dtype(x.dtype)
  if x.shape[axis] > MAX_CONTRIBUTIONS:
    raise errors.CollectiveError(
        f"reproducible sum over {x.shape[axis]} contributions exceeds the exact-integer limit "
        f"of {MAX_CONTRIBUTIONS}; split the reduction or use reproducible=False.")
  x = jnp.moveaxis(x, axis, 0)
  meta = jnp.max(analyze(x, use_ffi=use_ffi), axis=1)
  words = encode(x, jnp.broadcast_to(meta[0], x.shape), use_ffi=use_ffi)
  return decode(jnp.sum(words, axis=1), meta, x.dtype, use_ffi=use_ffi)
