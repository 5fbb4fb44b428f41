"""The collectives' per-element work as XLA:CPU custom calls (``collectives/cpu_ffi.py``,
``custom_calls/cpu/``): each handler gives the bits of the jnp formulation it replaces and of the
numpy references (tests/fixed_point_ref.py, written from the contracts), on the contracts'
corner cases; bad buffers are FFI errors; the collectives that use them keep their bits, their
gradients and vmap. What they are for -- no compiled kernel -- is tests/test_compile_time.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import dtenjax
from dtenjax._src import ffi
from dtenjax._src.collectives import cpu_ffi
from dtenjax._src.collectives import fixed_point_v3 as v3
from dtenjax._src.collectives.algorithms import base
from tests import fixed_point_ref as fpref

# Skipped only without the extension; a built one without the CPU targets fails (a build that
# dropped them must not pass as a skip).
pytestmark = pytest.mark.skipif(
    not ffi.is_built(),
    reason="the native extension is not built (bash scripts/setup.sh builds it)")

AX = "d"
BF16 = jnp.dtype(jnp.bfloat16)
DTYPES = (np.dtype(np.float32), BF16)


def _bits(a):
  return fpref.bits(np.asarray(a))


def _same_bits(got, want, what=""):
  got, want = _bits(got), _bits(want)
  bad = np.nonzero(got != want)
  assert bad[0].size == 0, (what, bad[0][:5], got[bad][:5], want[bad][:5])


def _contributions(w: int, dtype, m: int = 400, seed: int = 0):
  """``[w, m]``: the contracts' corner cases (NaN, +-inf, -0.0, subnormals, float32's largest
  values) first, then values over a wide range of magnitudes."""
  with np.errstate(invalid="ignore", over="ignore"):
    return fpref.contributions(w, m, seed=seed + w).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repro_sum_is_contract_v3_of_the_numpy_reference(dtype):
  """Sum and mean of W = 2..8, 17 and 32 contributions: the reference's bits, whatever way the
  contributions are grouped into the call's operands (an all-to-all leaves one per source)."""
  for w in (*range(2, 9), 17, 32):
    x = _contributions(w, dtype)
    for op in ("sum", "mean"):
      want = fpref.v3_sum(x, mean=op == "mean")
      _same_bits(cpu_ffi.repro_sum([jnp.asarray(x)], op, dtype), want, (w, op))
      groups = [jnp.asarray(x[:1]), jnp.asarray(x[1:])]
      _same_bits(cpu_ffi.repro_sum(groups, op, dtype), want, (w, op, "groups"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repro_sum_gives_the_jnp_path_s_bits(dtype):
  xs = [_contributions(w, dtype, m=200) for w in (2, 3, 8)]
  ops = ("sum", "mean")
  jnp_path = jax.jit(lambda xs: [v3.local_sum(x, op) for x in xs for op in ops])(xs)
  ours = [cpu_ffi.repro_sum([jnp.asarray(x)], op, dtype) for x in xs for op in ops]
  for a, b in zip(ours, jnp_path):
    _same_bits(a, b)


def _nan_payloads(w: int, dtype):
  """Columns of NaNs of both signs and other payloads, among finite values."""
  nans = np.array([0x7FC00000, 0xFFC00000, 0x7FC00001, 0x7F800001, 0xFFF00000], np.uint32)
  cols = np.ones((w, 2 * len(nans)), np.float32)
  for j, b in enumerate(nans):
    cols[j % w, j] = nans.view(np.float32)[j]
    cols[:, len(nans) + j] = nans.view(np.float32)[j]
  with np.errstate(invalid="ignore"):
    return cols.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_gives_ordered_reduce_s_bits_with_xla_cpu_s_flushing(dtype):
  """The rank-order fold in float32 of W = 2, 3, 5, 8 parts, rounded to float32 and to bfloat16: the
  bits XLA:CPU's kernel of ``base.ordered_reduce`` gives, subnormals flushed as that kernel
  flushes them (the numpy fold, which keeps them, differs there)."""
  xs = [np.concatenate([_contributions(w, dtype), _nan_payloads(w, dtype)], axis=1)
        for w in (2, 3, 5, 8)]
  jnp_path = jax.jit(lambda xs: [base.ordered_reduce(x, "sum", jnp.float32).astype(out)
                                 for x in xs for out in DTYPES])(xs)
  ours = [cpu_ffi.fold([jnp.asarray(p) for p in x], out) for x in xs for out in DTYPES]
  for i, (a, b) in enumerate(zip(ours, jnp_path)):
    _same_bits(a, b, (i // 2, DTYPES[i % 2]))
  # the contributions as rows of [m, c] operands (one_shot's gathered buffer), in operand order
  for i, x in enumerate(xs):
    for parts in ([jnp.asarray(x)], [jnp.asarray(x[:1]), jnp.asarray(x[1])] + (
        [jnp.asarray(x[2:])] if len(x) > 2 else [])):
      _same_bits(cpu_ffi.fold(parts, jnp.float32, x.shape[1:]), jnp_path[2 * i], (i, "rows"))
  normal = np.float32([[1.0, 3e38, -2.5], [2.0, 3e38, 2.5], [4.0, 1.0, 1e-30]]).astype(dtype)
  _same_bits(cpu_ffi.fold([jnp.asarray(p) for p in normal], jnp.float32),
             fpref.fold_f32(normal, out_dtype=np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ring_step_reads_the_chunk_at_the_rank_and_adds_the_partial(dtype):
  """A ring step's bits: the chunk of the flat buffer at ``(rank + shift) mod n`` (the last one
  padded with zeros) copied as it is, or added to the received partial as XLA:CPU's jnp add
  does it (subnormals flushed), on the corner cases; chunks long enough for the vectorized loop
  and its tails (38 values: 16 + 16 + 4 + 2)."""
  n, size = 4, 150
  c = -(-size // n)
  flat = _contributions(1, dtype, m=size)[0]
  padded = np.pad(flat.astype(np.float32), (0, n * c - size))
  recv = _contributions(1, np.float32, m=c + 20, seed=5)[0, 20:]
  add = jax.jit(lambda a, b: a + b)                        # XLA:CPU's add: flushed
  for rank in range(n):
    for shift in (-1, -2, 5):
      idx = (rank + shift) % n
      chunk = padded[idx * c:(idx + 1) * c]
      got = cpu_ffi.ring_step(jnp.asarray(flat), jnp.int32(rank), None, n, shift, c)
      _same_bits(got, chunk, (rank, shift))
      got = cpu_ffi.ring_step(jnp.asarray(flat), jnp.int32(rank), jnp.asarray(recv), n, shift, c)
      _same_bits(got, add(recv, chunk), (rank, shift, "recv"))


def test_ring_step_writes_over_the_partial_it_received(mesh):
  """A step's result aliases the received partial (input_output_aliases): in ring's program
  every step writes where ppermute left the partial, and XLA adds no copy for it; where the
  partial is read again XLA copies it first, so it keeps its value."""
  x = np.arange(4 * 50, dtype=np.float32).reshape(4, 50)
  hlo = _program(mesh, {"algorithm": "ring"}).lower(x).compile().as_text()
  steps = [l for l in hlo.splitlines() if "dtenjax_cpu_ring_step" in l]
  assert len(steps) == 4 and sum("output_to_operand_aliasing" in l for l in steps) == 3, steps
  assert "copy(" not in hlo, hlo
  flat, recv = jnp.arange(8, dtype=jnp.float32), jnp.ones(4, jnp.float32)
  out, again = jax.jit(lambda f, r: (cpu_ffi.ring_step(f, jnp.int32(1), r, 2, 0, 4), r + 0))(
      flat, recv)
  _same_bits(out, np.float32([5, 6, 7, 8]))
  _same_bits(again, np.ones(4, np.float32))


@pytest.mark.parametrize("dtype", (np.int32, BF16, np.float32), ids=str)
def test_pack_and_unpack_are_concatenate_and_slices_and_each_other_s_transpose(dtype):
  rng = np.random.default_rng(1)
  parts = [rng.integers(-9, 9, (3, s)).astype(dtype) for s in (5, 1, 0, 7)]
  total = 16
  packed = cpu_ffi.pack([jnp.asarray(p) for p in parts], total)
  want = np.pad(np.concatenate(parts, axis=1), ((0, 0), (0, total - 13)))
  _same_bits(packed, want)
  sizes = (5, 1, 0, 7, 6)                       # the last piece runs past the end: zeros
  got = cpu_ffi.unpack(packed[:, :15], sizes)
  cut = np.pad(want[:, :15], ((0, 0), (0, 24 - 15)))
  for g, a, s in zip(got, np.cumsum((0,) + sizes[:-1]), sizes):
    _same_bits(g, cut[:, a:a + s])
  if dtype == np.int32:
    return
  # derivatives: each is the other's transpose, as concatenate's and slicing's
  w = [jnp.asarray(rng.standard_normal(p.shape), dtype) for p in parts]
  ours = jax.grad(lambda ps: jnp.sum(cpu_ffi.pack(ps, total)[:, :13] * jnp.concatenate(w, 1)))
  theirs = jax.grad(lambda ps: jnp.sum(jnp.concatenate(ps, 1) * jnp.concatenate(w, 1)))
  loss = lambda pieces: sum(jnp.sum(p * p) for p in pieces)
  out = jax.jit(lambda xs, f: (
      ours(xs), theirs(xs), jax.grad(lambda f: loss(cpu_ffi.unpack(f, (5, 8))))(f),
      jax.grad(lambda f: loss([f[:, :5], f[:, 5:13]]))(f)))([jnp.asarray(p) for p in parts],
                                                            jnp.asarray(want))
  for a, b in zip(out[0], out[1]):
    _same_bits(a, b)
  _same_bits(out[2], out[3])


def test_the_calls_batch_under_vmap():
  """Under jax.vmap every operand gets the batch dimension in front (broadcast_all), which each
  handler reads as leading dimensions: the results of calling it per batch element."""
  rng = np.random.default_rng(2)
  a, b = rng.standard_normal((4, 3, 5), np.float32), rng.standard_normal((3, 2), np.float32)
  got = jax.vmap(lambda u: cpu_ffi.pack([u, jnp.asarray(b)], 8))(a)
  for i in range(4):
    _same_bits(got[i], cpu_ffi.pack([a[i], b], 8))
  x = _contributions(8, np.float32, m=60)
  with np.errstate(over="ignore"):
    stack = np.stack([x, x[::-1] * 3, x * 0.5])
  got = jax.vmap(lambda s: cpu_ffi.repro_sum([s[:3], s[3:]], "sum", jnp.float32))(stack)
  for i in range(3):
    _same_bits(got[i], fpref.v3_sum(stack[i]))
  got = jax.vmap(lambda f: cpu_ffi.ring_step(f, jnp.int32(1), None, 4, -1, 3))(stack[:, 0, :10])
  for i in range(3):
    _same_bits(got[i], stack[i, 0, :3])
  recv = stack[:, 1, :3]
  got = jax.vmap(lambda f, r: cpu_ffi.ring_step(f, jnp.int32(2), r, 4, 0, 3))(stack[:, 0, :10],
                                                                              recv)
  for i in range(3):
    _same_bits(got[i], cpu_ffi.ring_step(stack[i, 0, :10], jnp.int32(2), recv[i], 4, 0, 3))


def _call(target, outs, *operands, **attrs):
  return jax.ffi.ffi_call(target, outs)(*operands, **{k: np.int64(v) for k, v in attrs.items()})


def test_bad_buffers_are_ffi_errors_naming_the_mismatch():
  cpu_ffi.built()                                   # registers the targets
  f32, i32 = jnp.float32, jnp.int32
  s = jax.ShapeDtypeStruct
  x, y = jnp.ones((2, 3), f32), jnp.ones((2, 4), f32)
  cases = [
      (lambda: _call(cpu_ffi.PACK, s((2, 10), f32), x, y.astype(i32)), "another dtype"),
      (lambda: _call(cpu_ffi.PACK, s((2, 5), f32), x, y), "more than the result's 5"),
      (lambda: _call(cpu_ffi.PACK, s((3, 10), f32), x, y), "leading dimensions"),
      (lambda: _call(cpu_ffi.UNPACK, [s((2, 2), f32), s((1, 2), f32)], x), "leading dim"),
      (lambda: _call(cpu_ffi.FOLD, s((2, 3), f32), x, y), "has not the result's 6 values"),
      (lambda: _call(cpu_ffi.FOLD, s((2, 3), i32), x.astype(i32)), "f32 or bf16"),
      (lambda: _call(cpu_ffi.RING_STEP, s((2,), f32), x[0], jnp.float32(0), n=2, shift=0),
       "rank must be int32"),
      (lambda: _call(cpu_ffi.RING_STEP, s((1,), f32), x[0], jnp.int32(0), n=2, shift=0),
       "do not cover"),
      (lambda: _call(cpu_ffi.RING_STEP, s((2,), f32), x[0], jnp.int32(0), n=0, shift=0),
       "must be positive"),
      (lambda: _call(cpu_ffi.RING_STEP, s((2,), f32), x[0], jnp.int32(0), x[0, :2].astype(
          jnp.bfloat16), n=2, shift=0), "received partial must be f32"),
      (lambda: _call(cpu_ffi.BUTTERFLY, [s((1, 3), f32)] * 2, x[0], jnp.int32(0), n=3, step=-1,
                     scale_log2=2), "power of two"),
      (lambda: _call(cpu_ffi.BUTTERFLY, [s((1, 3), f32)] * 2, x[0], jnp.int32(0), x[0], n=2,
                     step=-1, scale_log2=1), "takes no received buffer"),
      (lambda: _call(cpu_ffi.BUTTERFLY, [s((1, 3), f32)] * 2, x[0], jnp.float32(0), n=2,
                     step=-1, scale_log2=1), "rank must be int32"),
      (lambda: _call(cpu_ffi.BUTTERFLY, [s((1, 1), f32)] * 2, x[0], jnp.int32(0), n=2,
                     step=-1, scale_log2=1), "2 chunks of 1 values do not cover 3"),
      (lambda: _call(cpu_ffi.BUTTERFLY, [s((2, 3), f32)] * 2, x[0], jnp.int32(0), n=2,
                     step=-1, scale_log2=1), "does not fit the results"),
      (lambda: _call(cpu_ffi.BUTTERFLY, s((3,), f32), x[:1], jnp.int32(0),
                     y[:1, :3].astype(jnp.bfloat16), n=2, step=0, scale_log2=1),
       "received buffer must be of the source's type"),
      (lambda: _call(cpu_ffi.REPRO_SUM, s((3,), f32), jnp.ones((33, 3), f32), mean=0),
       "33 contributions"),
      (lambda: _call(cpu_ffi.REPRO_SUM, s((3,), f32), jnp.ones((1, 3), f32), mean=0),
       "1 contributions"),
      (lambda: _call(cpu_ffi.REPRO_SUM, s((4,), f32), x, mean=0), r"\[\.\.\., contributions"),
      (lambda: _call(cpu_ffi.REPRO_SUM, s((3,), f32), x, mean=2), "mean must be 0 or 1"),
  ]
  for fn, match in cases:
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
      jax.block_until_ready(fn())


# --- the collectives through them ------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(cpu_devices):
  return Mesh(np.array(cpu_devices[:4]), (AX,))


def _tree():
  """Leaves of several shapes and both float dtypes, with the corner cases in them."""
  x = _contributions(4, np.float32, m=90, seed=3)
  return {"a": x[:, :40].reshape(4, 5, 8), "b": x[:, 40:47], "c": x[:, 47:].astype(ml_dtypes.bfloat16),
          "d": x[:, 50:52] * 0 + 1}


def _program(mesh, kwargs):
  body = lambda t: dtenjax.all_reduce(t, AX, **kwargs)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(AX),), out_specs=P()))


@pytest.mark.parametrize("kwargs", (
    {"algorithm": "two_shot"}, {"algorithm": "ring"}, {"algorithm": "butterfly"},
    {"algorithm": "butterfly", "op": "mean"}, {"algorithm": "two_shot", "op": "mean"},
    {"algorithm": "one_shot", "op": "mean"}, {"reproducible": True},
    {"reproducible": True, "algorithm": "one_shot", "op": "mean"},
    {"reproducible": True, "algorithm": "xla"}, {"reproducible": True, "algorithm": "xla", "op": "mean"},
    {"reproducible": True, "algorithm": "ring"}, {"reproducible": True, "algorithm": "butterfly"}),
    ids=("two_shot", "ring", "butterfly", "butterfly_mean", "two_shot_mean", "one_shot_mean", "reproducible",
         "reproducible_one_shot_mean", "reproducible_xla", "reproducible_xla_mean",
         "reproducible_ring", "reproducible_butterfly"))
def test_a_bucket_through_the_calls_has_the_jnp_formulation_s_bits(mesh, kwargs, monkeypatch):
  """The same tree (bucketed: one dtype group per bucket) with the custom calls and with
  DTENJAX_CPU_FFI=0: the same bits; only the first program calls dtenjax's targets."""
  tree = _tree()
  ours = _program(mesh, kwargs).lower(tree).compile()
  monkeypatch.setenv("DTENJAX_CPU_FFI", "0")
  theirs = _program(mesh, kwargs).lower(tree).compile()
  assert "dtenjax_cpu_" in ours.as_text() and "dtenjax_cpu_" not in theirs.as_text()
  a, b = ours(tree), theirs(tree)
  for k in tree:
    _same_bits(a[k], b[k], k)
  if kwargs.get("reproducible"):
    for k in tree:
      _same_bits(a[k][0], fpref.v3_sum(tree[k], mean=kwargs.get("op") == "mean"), k)


@pytest.mark.parametrize("n", (2, 8))
@pytest.mark.parametrize("op", ("sum", "mean"))
def test_butterfly_s_steps_give_its_jnp_tree_s_bits(cpu_devices, n, op, monkeypatch):
  """Butterfly over 2 and 8 devices (one step and three): its steps are custom calls
  (log2(n) + 1 of them) and the result has the jnp tree's bits, NaN payloads, infinities,
  -0.0, subnormals and sizes that leave the last chunks padded (and the vectorized add's tails)
  included."""
  mesh = Mesh(np.array(cpu_devices[:n]), (AX,))
  x = _contributions(n, np.float32, m=203, seed=n)
  with np.errstate(invalid="ignore", over="ignore"):
    x = np.concatenate([x, x[::-1] * np.float32(3e37)], axis=1)
  f = lambda: jax.jit(jax.shard_map(lambda t: dtenjax.all_reduce(t, AX, algorithm="butterfly",
                                                                  op=op),
                                    mesh=mesh, in_specs=(P(AX),), out_specs=P()))
  ours = f().lower(x).compile()
  calls = [l for l in ours.as_text().splitlines() if "dtenjax_cpu_butterfly" in l and "=" in l]
  assert len(calls) == n.bit_length(), calls
  monkeypatch.setenv("DTENJAX_CPU_FFI", "0")
  theirs = f().lower(x).compile()
  assert "dtenjax_cpu_butterfly" not in theirs.as_text()
  _same_bits(ours(x), theirs(x))


@pytest.mark.parametrize("n", (2, 8))
@pytest.mark.parametrize("algorithm", ("ring", "butterfly"))
def test_ring_and_butterfly_sum_int32_through_their_steps(cpu_devices, n, algorithm):
  """int32 sums (the reproducible word exchange's words) through ring's and butterfly's step
  handlers: numpy's wrapping sum on every rank."""
  mesh = Mesh(np.array(cpu_devices[:n]), (AX,))
  ints = np.random.default_rng(n).integers(-2**31, 2**31, size=(n, 203), dtype=np.int32)
  f = jax.jit(jax.shard_map(lambda t: dtenjax.all_reduce(t, AX, algorithm=algorithm), mesh=mesh,
                            in_specs=(P(AX),), out_specs=P()))
  ours = f.lower(ints).compile()
  assert f"dtenjax_cpu_{'ring_step' if algorithm == 'ring' else 'butterfly'}" in ours.as_text()
  with np.errstate(over="ignore"):
    np.testing.assert_array_equal(np.asarray(ours(ints)), ints.sum(0, dtype=np.int32)[None])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_word_calls_are_stack_codes_encode_and_decode(dtype):
  """The word exchange's codes, encode (k = 1, 3 local contributions of 2, 3, 8 and 32 in all)
  and decode (sum and mean) as custom calls: fixed_point_v3's jnp functions' bits, on the
  corner cases, and the numpy reference's sum of the same words."""
  for count in (2, 3, 8, 32):
    x = _contributions(count, dtype)
    for k in sorted({1, min(3, count)}):
      stack = jnp.asarray(x[:k])
      want = v3.stack_codes(stack)
      codes = cpu_ffi.repro_codes(stack)
      assert codes.dtype == jnp.uint8
      _same_bits(codes.astype(jnp.int32), want, (count, k, "codes"))
      _same_bits(cpu_ffi.repro_encode(stack, codes, count), v3.encode(stack, want, count),
                 (count, k, "encode"))
    codes = v3.stack_codes(jnp.asarray(x))
    words = v3.encode(jnp.asarray(x), codes, count)     # every contribution on one device
    for op in ("sum", "mean"):
      got = cpu_ffi.repro_decode(words, codes.astype(jnp.uint8), count, op, dtype)
      _same_bits(got, v3.decode(words, codes, count, op, dtype), (count, op, "decode"))
      _same_bits(got, fpref.v3_sum(x, mean=op == "mean"), (count, op, "reference"))


@pytest.mark.parametrize("n", (2, 8))
@pytest.mark.parametrize("algorithm", ("xla", "ring", "butterfly"))
def test_the_word_exchange_through_the_calls_has_the_reference_s_bits(cpu_devices, n, algorithm,
                                                                        monkeypatch):
  """reproducible=True with the algorithms that only all-reduce, over 2 devices (round to odd)
  and 8: the codes, encode and decode are custom calls, and the sum and the mean of float32
  and bfloat16 leaves are the numpy reference's and the jnp path's bits."""
  mesh = Mesh(np.array(cpu_devices[:n]), (AX,))
  x = _contributions(n, np.float32, m=150, seed=7)
  tree = {"f": x, "b": x.astype(ml_dtypes.bfloat16)}
  for op in ("sum", "mean"):
    f = lambda: jax.jit(jax.shard_map(
        lambda t: dtenjax.all_reduce(t, AX, reproducible=True, algorithm=algorithm, op=op),
        mesh=mesh, in_specs=(P(AX),), out_specs=P()))
    monkeypatch.delenv("DTENJAX_CPU_FFI", raising=False)
    ours = f().lower(tree).compile()
    for t in (cpu_ffi.REPRO_CODES, cpu_ffi.REPRO_ENCODE, cpu_ffi.REPRO_DECODE):
      assert t in ours.as_text(), t
    monkeypatch.setenv("DTENJAX_CPU_FFI", "0")
    theirs = f().lower(tree).compile()
    assert cpu_ffi.REPRO_ENCODE not in theirs.as_text()
    a, b = ours(tree), theirs(tree)
    for k in tree:
      _same_bits(a[k], b[k], (op, k))
      _same_bits(a[k][0], fpref.v3_sum(tree[k], mean=op == "mean"), (op, k))


@pytest.mark.parametrize("kwargs", ({"algorithm": "two_shot"}, {"algorithm": "one_shot"},
                                    {"algorithm": "ring"}, {"algorithm": "butterfly"},
                                    {"reproducible": True}),
                         ids=("two_shot", "one_shot", "ring", "butterfly", "reproducible"))
def test_a_bucket_through_the_calls_under_vmap(mesh, kwargs):
  """jax.vmap over a batch dimension of each device's leaves: every batch element reduced as
  on its own."""
  tree = {k: v for k, v in _tree().items() if k != "c"}
  with np.errstate(over="ignore"):
    batch = {k: np.stack([v, v * 2, -v]) for k, v in tree.items()}
  f = jax.jit(jax.shard_map(jax.vmap(lambda t: dtenjax.all_reduce(t, AX, **kwargs)), mesh=mesh,
                            in_specs=(P(None, AX),), out_specs=P()))
  one = _program(mesh, kwargs)
  got = f(batch)
  for i in range(3):
    want = one({k: v[i] for k, v in batch.items()})
    for k in tree:
      _same_bits(got[k][i], want[k], (i, k))
