"""Cross-process all-reduce inside jit (dtenjax/_src/net/hostcoll.py).

Multi-process tests launch workers (tests/mp_workers/allreduce_worker.py) with a local
jax.distributed coordinator on 127.0.0.1; every worker has a timeout. They call the internal
module and the PUBLIC ``dtenjax.all_reduce`` under ``jax.shard_map``, ``dtenjax.mesh_map`` and
``jax.set_mesh``. In-process tests cover the ring order against numpy (also with segments much
smaller than a chunk, i.e. pipelined) and the configuration checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dtenjax._src import errors
from dtenjax._src.net import credentials
from dtenjax._src.net import hostcoll
from tests import transport_ref
from tests.mp_workers import launch
from tests.net_helpers import close_all, native_ring, requires_native, run_ranks


pytestmark = requires_native


def _run_all(comms, xs, op="sum"):
  outs, errs, _ = run_ranks([lambda r=r: comms[r].all_reduce(xs[r], op, site=(7, "t"))
                             for r in range(len(comms))])
  assert errs == [None] * len(comms), errs
  return outs


@pytest.mark.parametrize("n,count,segment", [(2, 1, None), (3, 1001, None), (4, 3, None),
                                             (5, 70001, None), (3, 70001, 256), (4, 99999, 4096)])
def test_in_process_ring_matches_reference_order_bit_exactly(n, count, segment):
  creds = credentials.JobCredentials(99, b"k" * 32)
  comms, errs = native_ring(n, creds, segment_bytes=segment)
  assert not errs
  try:
    rng = np.random.RandomState(count)
    xs = [(rng.randn(count) * 10.0 ** rng.randint(-3, 4, count)).astype(np.float32)
          for _ in range(n)]
    outs = _run_all(comms, xs)
    ref = transport_ref.reference_ring_sum(xs)
    for o in outs:
      assert o.tobytes() == ref.tobytes()
    np.testing.assert_allclose(ref, np.sum(np.array(xs, np.float64), 0), rtol=1e-4, atol=1e-3)
    ints = [rng.randint(-1000, 1000, count).astype(np.int64) for _ in range(n)]
    for o in _run_all(comms, ints, "max"):
      np.testing.assert_array_equal(o, np.max(ints, 0))
    nan_in = [np.where(np.arange(count) % 7 == r, np.nan, 1.0).astype(np.float32)
              for r in range(n)]
    for o in _run_all(comms, nan_in, "max"):   # max propagates NaN whatever the order
      assert np.isnan(o[np.arange(count) % 7 < n]).all()
  finally:
    close_all(comms)


def test_single_process_configuration_checks(cpu_devices):
  mesh = Mesh(np.array(cpu_devices), ("x",))
  f = jax.shard_map(lambda x: hostcoll.all_reduce(x, "x"), mesh=mesh, in_specs=P("x"),
                    out_specs=P("x"))
  with pytest.raises(errors.CollectiveError, match="one mesh device per process"):
    jax.jit(f)(jnp.ones(8))
  g = jax.shard_map(lambda x: hostcoll.all_reduce(x, "x", algorithm="tree", op="avg"),
                    mesh=mesh, in_specs=P("x"), out_specs=P("x"))
  with pytest.raises(errors.CollectiveError) as e:
    jax.jit(g)(jnp.ones(8))
  assert "algorithm='tree'" in str(e.value) and "op='avg'" in str(e.value)


def _launch(tmp_path, nprocs, **kw):
  codes, res, logs = launch.launch("tests.mp_workers.allreduce_worker", nprocs, str(tmp_path),
                                   **kw)
  return codes, res, logs


def _check_correct(res, nprocs, bit_exact):
  for r in res:
    assert r is not None and "exception" not in r, r
    for how in ("shard_map", "mesh_map", "set_mesh"):   # the public dtenjax.all_reduce
      p = r["public"][how]
      assert "error" not in p, (how, p.get("error"))
      assert p["transport_collectives"] >= 1, (how, p)  # really went through the host ring
      assert p["max_abs_err"] < 1e-2, (how, p)
      if bit_exact:
        assert p["bit_equal_ring_reference"], (how, p)
    assert r["ops"]["max_exact"] and r["ops"]["mean_err"] < 1e-4, r["ops"]
    assert r["mixed_err"] < 1e-2, r["mixed_err"]
  keys = res[0]["correct"].keys()
  assert len(keys) == 5
  for k in keys:
    shas = {s for r in res for s in r["correct"][k]["sha"]}
    assert len(shas) == 1, f"{k}: ranks disagree on the bits"
    for r in res:
      c = r["correct"][k]
      assert c["repeat_equal"], k
      assert c["max_rel_err"] < 1e-5, (k, c["max_rel_err"])
      if bit_exact:
        assert c["bit_equal_ring_reference"], k


@pytest.mark.multiprocess
def test_ring_four_processes_correct_and_deterministic(tmp_path):
  codes, res, logs = _launch(tmp_path, 4, timeout_s=150)
  assert codes == [0] * 4, logs
  _check_correct(res, 4, bit_exact=True)


@pytest.mark.gpu
@pytest.mark.multiprocess
def test_ring_two_processes_one_gpu_each(tmp_path):
  """The CUDA handler (custom_calls/transport/host_all_reduce_cuda.cc): device -> pinned host staging ->
  authenticated ring -> device, through the public API too. Needs 2 GPUs (one per process)."""
  if len(jax.devices("gpu")) < 2:
    pytest.skip(f"needs 2 GPUs (one per process), found {len(jax.devices('gpu'))}")
  codes, res, logs = _launch(tmp_path, 2, timeout_s=300, env={"JAX_PLATFORMS": "cuda"},
                             per_rank_env={0: {"CUDA_VISIBLE_DEVICES": "0"},
                                           1: {"CUDA_VISIBLE_DEVICES": "1"}})
  assert codes == [0, 0], logs
  assert all(r["platform"] == "gpu" for r in res), res
  _check_correct(res, 2, bit_exact=True)


@pytest.mark.multiprocess
def test_hierarchical_two_processes_two_devices(tmp_path):
  codes, res, logs = _launch(tmp_path, 2, devices_per_proc=2, timeout_s=150)
  assert codes == [0] * 2, logs
  assert res[0]["local"] == 2
  _check_correct(res, 2, bit_exact=False)


@pytest.mark.multiprocess
def test_killed_peer_fails_every_survivor_fast(tmp_path):
  timeout = 5
  codes, res, logs = _launch(tmp_path, 4, timeout_s=120,
                             env={"DTENJAX_TEST_PHASES": "kill",
                                  "DTENJAX_COLLECTIVE_TIMEOUT": str(timeout)})
  assert codes[:3] == [0] * 3 and codes[3] == 3, logs
  for r in res[:3]:
    assert "exception" not in r, r
  # Killed peer: rank 3 exits 0.5 s into a throttled collective; every survivor raises in time.
  for r in res[:3]:
    assert r["kill"]["error"] and "dtenjax transport" in r["kill"]["error"], r
    assert r["kill"]["seconds"] < timeout + 2
  # Data of that collective was already moving when the peer died (mid-collective, not before).
  moved = [r["counters_after_kill"]["bytes_received"] - r["counters_before_kill"]["bytes_received"]
           for r in res[:3]]
  assert max(moved) >= 1 << 20, moved


@pytest.mark.multiprocess
def test_mismatched_collectives_fail_on_every_rank_naming_both_sides(tmp_path):
  """Rank 1 of 4 runs int32 where the others run float32, then max where they run sum, then skips
  the collective at one line and pairs its next one (another line) with the others' first."""
  codes, res, logs = _launch(tmp_path, 4, timeout_s=150,
                             env={"DTENJAX_TEST_PHASES": "mismatch",
                                  "DTENJAX_COLLECTIVE_TIMEOUT": "20"})
  assert codes == [0] * 4, logs
  expect = {"dtype": ("dtype=float32", "dtype=int32"), "op": ("op=sum", "op=max"),
            "skip": ("site_a (allreduce_worker.py", "site_b (allreduce_worker.py")}
  for r in res:
    assert "exception" not in r, r
    for case, (one, other) in expect.items():
      err = r["mismatch"][case]["error"]
      assert err, (r["rank"], case)
      assert "collective mismatch" in err, (r["rank"], case, err)
      assert one in err and other in err, (r["rank"], case, err)
      assert r["mismatch"][case]["seconds"] < 15, (r["rank"], case)   # not the 20 s timeout
  # at least one detector per case (the others may learn of it from an ABORT first)
  assert sum(r["counters_after_mismatch"]["rejected_mismatch"] for r in res) >= 3


@pytest.mark.multiprocess
def test_mesh_against_process_order_is_explained(tmp_path):
  """The ring needs the processes along the axis in process order; a reversed mesh is refused at
  run time on every rank, saying what to do (no silent wrong pairing)."""
  codes, res, logs = _launch(tmp_path, 2, timeout_s=120,
                             env={"DTENJAX_TEST_PHASES": "permuted",
                                  "DTENJAX_COLLECTIVE_TIMEOUT": "20"})
  assert codes == [0, 0], logs
  for r in res:
    assert "exception" not in r, r
    err = r["permuted"]["error"]
    assert err and "holds position" in err and "in process order" in err, (r["rank"], err)
    assert r["permuted"]["seconds"] < 15


@pytest.mark.multiprocess
def test_wrong_secret_is_refused(tmp_path):
  codes, res, logs = _launch(
      tmp_path, 3, timeout_s=60,
      env={"DTENJAX_COLLECTIVE_TIMEOUT": "2", "DTENJAX_JOB_SECRET": "the-right-secret-0123456789"},
      per_rank_env={1: {"DTENJAX_JOB_SECRET": "a-wrong-secret-0123456789abc"}})
  assert all(c == 0 for c in codes), logs
  text = " ".join(r["exception"] for r in res)
  assert "authentication" in text
  assert all("exception" in r for r in res)
  assert sum(r["counters"]["rejected_auth"] for r in res) >= 1
