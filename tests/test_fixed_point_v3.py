"""Contract v3 of the reproducible sum (dtenjax/_src/collectives/fixed_point_v3.py) against the
independent numpy reference in tests/fixed_point_ref.py, its error bound against math.fsum, the
comparison with a float32 rank-order fold, and the stored reference bits the GPU suite uses."""

import math
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dtenjax
from dtenjax._src import contract as contract_lib
from dtenjax._src.collectives import fixed_point_v3 as v3
from dtenjax._src.collectives import reproducible as repro
from dtenjax._src.contract import Contract
import fixed_point_ref as ref

REF_FILE = pathlib.Path(__file__).parent / "data" / "reproducible_v3_ref.npz"
COUNTS = (1, 2, 3, 5, 8, 16, 32)


def _dtype(name):
  return ref.BF16 if name == "bfloat16" else np.dtype(np.float32)


def _normal_range(k, m, seed):
  """Contributions every code of which takes the float forms: zeros, exact cancellations, ties
  at the word's last place, values near the float32 maximum, a wide exponent range."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((k, m)) * np.exp2(rng.integers(-60, 120, (k, m)))
  x[:, ::7] = 0
  x[0, 1::5] = 3.3e38
  x[min(1, k - 1), 1::5] = -3.3e38
  x[:, 2::11] = rng.integers(-1000, 1000, (k, len(range(2, m, 11)))) * 2.0 ** -20
  x[:, 3::13] = (2.0 ** 30 + 2.0 * rng.integers(0, 64, (k, len(range(3, m, 13))))) * (
      1.0 + 2.0 ** -23)
  return x.astype(np.float32)


def _assert_bits(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
  bad = np.nonzero(ref.bits(got) != ref.bits(want))[0]
  assert bad.size == 0, (what, bad[:8], got[bad[:8]], want[bad[:8]])


def test_precision_leaves_ceil_log2_n_bits_of_headroom():
  assert [v3.precision(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == \
      [31, 30, 29, 29, 28, 28, 27, 27, 26, 26]
  assert [v3.precision(n) for n in range(1, 33)] == [ref.v3_precision(n) for n in range(1, 33)]
  assert v3.supports(32) and not v3.supports(33)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", COUNTS)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_local_sum_bits_equal_the_reference(dtype, k, op):
  """The adversarial suite (NaN, +-inf, +-0, subnormals, overflow, cancellation) and data in
  the normal range with ties at the word's last place."""
  f = jax.jit(lambda v: v3.local_sum(v, op))
  for x in (ref.contributions(k, 3000, seed=k), _normal_range(k, 3000, k)):
    x = x.astype(_dtype(dtype))
    _assert_bits(f(jnp.asarray(x)), ref.v3_sum(x, mean=op == "mean"), (dtype, k, op))


def test_words_equal_the_references_words():
  """Each contribution's word (also subnormal ones, and those far below the common exponent)."""
  for k in (2, 3, 8):
    x = ref.contributions(k, 3000, seed=20 + k)
    c = ref.codes(x).max(axis=0)
    finite = (c < 255)[None] & np.isfinite(x)
    want = ref.v3_words(x, c[None], k)
    got = np.stack([np.asarray(v3.quantize(v3.bits(jnp.asarray(x[i])), jnp.asarray(c), k))
                    for i in range(k)])
    np.testing.assert_array_equal(np.where(finite, got, 0), np.where(finite, want, 0))


def test_the_test_data_exercises_every_branch():
  x = ref.contributions(8, 3000, seed=8)
  r = ref.v3_sum(x)
  c = ref.codes(x).max(axis=0)
  assert {0, 255} <= set(c.tolist()) and (c == 1).any()
  far = (ref.codes(x) > 0) & (ref.codes(x) + 60 < c[None]) & (c[None] < 255)
  assert far.any(), "contributions 2**60 below the common exponent"
  assert np.isnan(r).any() and np.isposinf(r).any() and np.isneginf(r).any()
  assert ((r != 0) & (np.abs(r) < np.finfo(np.float32).tiny)).any(), "subnormal sums"
  assert (np.abs(r[np.isfinite(r)]) > 3e38).any()
  words = ref.v3_words(x, c[None], 8)
  assert (np.abs(words.sum(0)) > 2 ** 30).any(), "the headroom is used"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_word_exchange_split_over_devices_gives_the_local_bits(dtype):
  """What the collectives do: every device encodes its share against the common codes, the
  int32 words are added (in any grouping), the total is decoded once."""
  for x in (ref.contributions(8, 2000, seed=3), _normal_range(8, 2000, 3)):
    x = jnp.asarray(x.astype(_dtype(dtype)))
    c = v3.stack_codes(x)
    local = v3.local_sum(x, "sum")
    for split in ((8,), (4, 4), (2, 2, 2, 2), (1, 3, 4), (1,) * 8):
      parts, i = [], 0
      for s in split:
        parts.append(v3.encode(x[i:i + s], c, 8))
        i += s
      total = parts[0]
      for p in parts[1:]:
        total = total + p
      _assert_bits(v3.decode(total, c, 8, "sum", x.dtype), local, split)


def test_special_words_count_the_flags():
  x = jnp.asarray(np.array([[np.nan, np.inf, -np.inf, 1.0, np.inf],
                            [1.0, np.inf, 2.0, 2.0, -np.inf]], np.float32))
  c = v3.stack_codes(x)
  w = np.asarray(v3.encode(x, c, 2))
  assert list(w[:3]) == [1 + (1 << 16), 2 << 16, 1] and w[4] == 1 + (1 << 16)
  r = np.asarray(v3.decode(jnp.asarray(w), c, 2, "sum", jnp.float32))
  assert np.isnan(r[0]) and r[1] == np.inf and r[2] == -np.inf and np.isnan(r[4])


def test_order_independence():
  rng = np.random.default_rng(1)
  for x in (ref.contributions(16, 1000, seed=2), _normal_range(16, 1000, 2)):
    base = np.asarray(v3.local_sum(jnp.asarray(x)))
    for _ in range(4):
      perm = rng.permutation(16)
      _assert_bits(v3.local_sum(jnp.asarray(x[perm])), base, perm)


def test_two_contributions_give_the_correctly_rounded_sum():
  """Round to odd keeps the cut bits' information: for N = 2 the result is RNE(x0 + x1), which
  is what a float32 addition computes (except that -0 + -0 gives +0)."""
  for seed in range(3):
    for x in (ref.contributions(2, 20000, seed=seed), _normal_range(2, 20000, seed)):
      x[1, ::3] = x[0, ::3] * np.float32(-1 + 2.0 ** -20)         # near-cancellations
      got = np.asarray(v3.local_sum(jnp.asarray(x)))
      with np.errstate(invalid="ignore", over="ignore"):
        fold = (x[0] + x[1]).astype(np.float32)
      keep = ~(np.isnan(fold) | ((x[0] == 0) & (x[1] == 0)))
      _assert_bits(got[keep], fold[keep], seed)
      xb = x.astype(ref.BF16)
      gotb = np.asarray(v3.local_sum(jnp.asarray(xb)))
      with np.errstate(invalid="ignore"):
        wantb = ref.round_once(xb[0].astype(np.float64) + xb[1].astype(np.float64), ref.BF16)
      keep = ~(np.isnan(gotb.astype(np.float32)) | ((xb[0] == 0) & (xb[1] == 0)))
      _assert_bits(gotb[keep], wantb[keep], ("bf16", seed))      # exact in float64


def _errors(x, r, fold):
  """Per finite, nonzero column: |v3 - S|, half an ulp of v3's result, v3's quantization bound
  N U / 2 (N U for N = 2), |fold - S|, sum |x| and the exact S (math.fsum)."""
  n = x.shape[0]
  x64 = ref.widen(x).astype(np.float64)
  rows = []
  for j in range(x64.shape[1]):
    col = x64[:, j]
    amax = np.max(np.abs(col))
    if not (np.all(np.isfinite(col)) and np.isfinite(r[j]) and np.isfinite(fold[j])) or amax == 0:
      continue
    exact = math.fsum(col)
    e = math.frexp(amax)[1]                               # 2**e > max |x| >= 2**(e - 1)
    # Every contribution is a multiple of 2**-149 >= U when C = 1 (all subnormal): exact words.
    unit = 2.0 ** (e - v3.precision(n)) if e > -125 else 0.0
    half_ulp = 0.5 * float(np.spacing(np.asarray(abs(r[j]), r.dtype)).astype(np.float64))
    rows.append((abs(float(r[j]) - exact), half_ulp, n * unit / (1 if n == 2 else 2),
                 abs(float(fold[j]) - exact), float(np.sum(np.abs(col))), abs(exact)))
  return np.array(rows)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n", [2, 3, 8, 24, 32])
def test_error_bound_against_fsum_and_never_worse_than_a_float32_fold(dtype, n):
  """On every finite column of the adversarial suite: |v3 - S| <= N U / 2 + ulp(result) / 2
  (N = 2: at most half an ulp, the correctly rounded sum); the part of that bound before the
  final rounding, N U / 2 (1 + u) + u |S|, never exceeds the float32 fold's worst-case bound
  gamma_{N-1} sum|x| (u = 2**-24; docs/collectives.md derives it for 3 <= N <= 32); and the
  largest error relative to sum|x| over the suite is no larger than the fold's."""
  x = np.concatenate([ref.contributions(n, 3000, seed=5 + n), _normal_range(n, 1000, n)], axis=1)
  x = x.astype(_dtype(dtype))
  r = np.asarray(v3.local_sum(jnp.asarray(x)))
  fold = ref.fold_f32(x)
  err, half_ulp, quant, ferr, mass, s = _errors(x, r, fold).T
  assert len(err) > 3000
  if n == 2:
    assert np.all(err <= half_ulp), np.nonzero(err > half_ulp)
  else:
    assert np.all(err <= quant + half_ulp), np.nonzero(err > quant + half_ulp)
    u = 2.0 ** -24
    gamma = (n - 1) * u / (1 - (n - 1) * u)
    normal = quant > 0                                    # C >= 2: sum |x| >= 2**(e - 1)
    assert np.all(quant * (1 + u) + u * s <= gamma * mass, where=normal)
    assert normal.sum() > 2500
  assert np.max(err / mass) <= np.max(ferr / mass), (np.max(err / mass), np.max(ferr / mass))


def test_more_than_32_contributions_run_the_exact_contract():
  x = jnp.asarray(ref.contributions(40, 500, seed=9))
  for n in (33, 40):
    got = repro.local_sum(x[:n], "sum", Contract.V3)
    _assert_bits(got, ref.exact_sum(np.asarray(x[:n])), n)
    _assert_bits(got, ref.v3_sum(np.asarray(x[:n])), n)     # the reference says the same
  _assert_bits(repro.local_sum(x[:32], "sum", Contract.V3), ref.v3_sum(np.asarray(x[:32])), 32)


def test_reference_file_holds_the_contract_bits():
  """tests/data/reproducible_v3_ref.npz: the bits the GPU suite compares its kernels with."""
  data = np.load(REF_FILE)
  for dtype in ("float32", "bfloat16"):
    x = data[f"x_{dtype}"].view(_dtype(dtype)) if dtype == "bfloat16" else data[f"x_{dtype}"]
    for w in range(1, 9):
      for op in ("sum", "mean"):
        want = data[f"{op}_{dtype}_{w}"]
        np.testing.assert_array_equal(ref.bits(ref.v3_sum(x[:w], mean=op == "mean")), want,
                                      err_msg=f"reference drifted: {op} {dtype} {w}")
        got = repro.local_sum(jnp.asarray(x[:w]), op, Contract.V3)
        np.testing.assert_array_equal(ref.bits(np.asarray(got)), want,
                                      err_msg=f"{op} {dtype} {w}")
  wide = data["wide_float32"]
  for w in (16, 32, 33, 40):
    for op in ("sum", "mean"):
      got = repro.local_sum(jnp.asarray(wide[:w]), op, Contract.V3)
      np.testing.assert_array_equal(ref.bits(np.asarray(got)), data[f"{op}_wide_{w}"],
                                    err_msg=f"wide {op} {w}")


def test_reproducible_modes_are_named_clearly():
  """Contract v2 is public as "v2"; "exact" (its old name, which promised a correctly rounded
  sum it does not give) is a deprecated alias that warns once with the new name."""
  from dtenjax._src import errors as errors_lib
  assert contract_lib.parse(True) is Contract.V3 and contract_lib.parse("v2") is Contract.V2
  assert contract_lib.parse(False) is Contract.NONE and contract_lib.parse(None) is Contract.NONE
  assert contract_lib.parse("v3") is Contract.V3 and contract_lib.parse(Contract.V2) is Contract.V2
  errors_lib._warned.discard("reproducible-exact")
  with pytest.warns(dtenjax.DtenjaxWarning, match=r"'exact' is deprecated.*reproducible='v2'"):
    assert contract_lib.parse("exact") is Contract.V2
  for bad in ("fast", "none", 1, 0.0):
    with pytest.raises(dtenjax.CollectiveError, match=r"reproducible=.*True.*'v2'"):
      contract_lib.parse(bad)
  with pytest.raises(dtenjax.CollectiveError, match=r"reproducible='fast'"):
    dtenjax.all_reduce(jnp.ones(2), "d", reproducible="fast")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
  x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 5)) * 1e5, jnp.float32)
  run = lambda mode: np.asarray(jax.jit(jax.shard_map(
      lambda v: dtenjax.all_reduce(v, "d", reproducible=mode), mesh=mesh, in_specs=P("d"),
      out_specs=P()))(x))
  np.testing.assert_array_equal(run("v2").view(np.uint32), run("exact").view(np.uint32))
  assert repro.contract_for(Contract.V3, 32) is Contract.V3
  assert repro.contract_for(Contract.V3, 33) is Contract.V2
  assert repro.contract_for(Contract.V2, 2) is Contract.V2


def test_no_retrace_on_repeated_calls():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(x):
    return v3.local_sum(x)
  x = jnp.ones((4, 16), jnp.float32)
  f(x)
  f(x + 1)


@pytest.mark.parametrize("algorithm", ["xla", "two_shot", "one_shot", "auto"])
def test_collective_with_more_than_32_contributions_gives_the_exact_contracts_bits(
    cpu_devices, algorithm):
  """8 devices x 5 local contributions: past one word per value, reproducible=True is the exact
  contract (the word exchange, the owner form and the gather alike)."""
  mesh = jax.sharding.Mesh(np.array(cpu_devices), ("d",))
  x = ref.contributions(40, 64, seed=41)
  f = jax.jit(jax.shard_map(
      lambda v: dtenjax.all_reduce(v, "d", algorithm=algorithm, reproducible=True,
                                   local_axis=0)[None],
      mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"), check_vma=False))
  got = np.asarray(f(jnp.asarray(x)))
  want = ref.bits(ref.exact_sum(x))
  for r in range(8):
    np.testing.assert_array_equal(ref.bits(got[r]), want, err_msg=f"{algorithm} rank {r}")
