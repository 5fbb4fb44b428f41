"""dtenjax.HostPipeline: stages as separate programs joined by the host transport (TCP here).

The claim that matters runs in two processes on 127.0.0.1 (one CPU device each, jax.distributed
for the coordination store only): the loss and every gradient of GPipe and 1F1B are bit-identical
to the unpipelined gradient-accumulation loop in plain JAX (tests/pipeline_host_model.py), and a
stage that dies mid-step gives its neighbour a TransportError naming the peer, the tick and the
micro-batches, within seconds. In this process, stages on threads (each its own links, programs
and tick loop) check 3 stages of the interleaved schedule (the wrap-around link from the last
stage to the first), the links over the emulated RDMA verbs device, a stalled peer's timeout, and
bad input.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtenjax
from dtenjax._src import ffi
from dtenjax._src.net import kvstore
from dtenjax._src.net import native
from dtenjax._src.net import pair
from dtenjax._src.pipeline import host
from dtenjax._src.pipeline import transport
from tests import pipeline_host_model as m
from tests.net_helpers import requires_native
from tests.net_helpers import run_ranks
from tests.test_verbs import fake  # noqa: F401  (the emulated RDMA device's fixture)

pytestmark = requires_native


def _on_threads(stages: int, fn, join_s: float = 120.0) -> tuple[list, list]:
  """fn(stage) on one thread per stage (net_helpers.run_ranks); (results, errors) by stage."""
  outs, errs, _ = run_ranks([functools.partial(fn, d) for d in range(stages)], join_s=join_s)
  return outs, errs


def _store():
  return kvstore.KVStore(kvstore.InMemoryClient())


@pytest.mark.multiprocess
def test_two_processes_give_the_unpipelined_bits_and_a_dying_peer_a_clear_error(tmp_path):
  from tests.mp_workers import launch
  timeout_s = 20.0
  codes, results, logs = launch.launch(
      "tests.mp_workers.pipeline_host_worker", 2, str(tmp_path), timeout_s=120,
      args=[str(timeout_s)],
      env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1 --xla_cpu_max_isa=AVX"})
  assert codes == [0, 17], [log[-3000:] for log in logs]   # 17: stage 1 died on purpose
  arrays = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
  ref = arrays[0]
  n = m.LAYERS // 2
  same = lambda a, b: a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
  for name in ("gpipe", "1f1b"):
    for r in range(2):
      assert same(arrays[r][f"{name}/loss"], ref["ref/loss"]), (name, r)
      assert same(arrays[r][f"{name}/forward_loss"], ref["ref/loss"]), (name, r)
      for k in ("w1", "w2"):
        assert same(arrays[r][f"{name}/layers/{k}"], ref[f"ref/layers/{k}"][r * n:(r + 1) * n])
    assert same(arrays[1][f"{name}/head/u"], ref["ref/head/u"]), name
    assert same(arrays[0][f"{name}/x"], ref["ref/x"]), name
    assert f"{name}/head/u" not in arrays[0] and f"{name}/x" not in arrays[1]
  for r in results:
    assert r["path"] == "host" and "tcp" in r["table"] and "xla" in r["table"], r
  fault = results[0]["fault"]
  assert fault is not None and fault["type"] in ("TransportError", "ProcessLostError"), fault
  assert fault["seconds"] < timeout_s, fault          # the lost connection, not the timeout
  assert "peer 1" in fault["message"] and "tick" in fault["message"], fault
  assert "micro-batch" in fault["message"], fault


def test_three_stages_interleaved_on_threads_match_the_reference():
  """3 stages x 2 virtual chunks (chunk 2 on stage 2 sends to chunk 3 on stage 0, over the link
  from the last stage to the first): the reference's values to float rounding (in one process
  without --xla_cpu_max_isa=AVX, a one-layer chunk may fuse with FMA where the loop does not),
  and every gradient where it belongs."""
  stacked, head, x, targets = m.init()
  micro = 3
  pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=3, microbatches=micro,
                          schedule=dtenjax.Interleaved(virtual=2))
  staged = pipe.to_stages(stacked)
  store = _store()

  def stage(d):
    mine = jax.tree.map(lambda a: a[2 * d:2 * d + 2], staged)
    xin = x if d == 0 else jax.ShapeDtypeStruct(x.shape, x.dtype)
    with dtenjax.HostPipeline(pipe, stage=d, store=store, timeout_s=60) as hp:
      assert sorted(hp.links) == [[(0, 1), (0, 2)], [(0, 1), (1, 2)], [(0, 2), (1, 2)]][d]
      return hp.value_and_grad(mine, head, xin, targets if d == 2 else None)

  outs, errs = _on_threads(3, stage)
  assert errs == [None] * 3, errs
  loss, gl, gh, dx = m.reference(stacked, head, x, targets, microbatches=micro)
  want = pipe.to_stages(gl)
  close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6,
                                                  atol=1e-7)
  for d, (value, (dlayers, dhead, dxx)) in enumerate(outs):
    close(value, loss)
    for k in ("w1", "w2"):
      close(dlayers[k], want[k][2 * d:2 * d + 2])
    assert (dhead is None) == (d != 2) and (dxx is None) == (d != 0)
  close(outs[2][1][1]["u"], gh["u"])
  close(outs[0][1][2], dx)


def test_a_stalled_peer_times_out_naming_what_was_waited_for():
  """Stage 1 connects and never steps: stage 0's first exchange (tick 0, micro-batch 0's
  activation) ends after the timeout with an error that says so; stage 1's links are closed."""
  stacked, head, x, targets = m.init()
  pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=2, microbatches=2, schedule=dtenjax.GPipe())
  store, ready = _store(), threading.Event()

  def stage(d):
    mine = jax.tree.map(lambda a: a[3 * d:3 * d + 3], stacked)
    hp = dtenjax.HostPipeline(pipe, stage=d, store=store, timeout_s=1.0)
    if d == 1:
      ready.wait(60)
      hp.close()
      return None
    try:
      return hp.value_and_grad(mine, head, x, None)
    finally:
      ready.set()

  _, errs = _on_threads(2, stage)
  assert errs[1] is None
  e = errs[0]
  assert isinstance(e, dtenjax.CollectiveTimeoutError), e
  for part in ("peer 1", "tick 0", "activation of micro-batch 0 from stage 0", "timed out"):
    assert part in str(e), (part, str(e))


def test_bad_input_names_the_value_and_the_fix():
  stacked, head, x, targets = m.init()
  pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=2, microbatches=4, schedule=dtenjax.GPipe())
  with pytest.raises(dtenjax.ConfigurationError, match=r"1 processes but the pipeline 2 stages"):
    dtenjax.HostPipeline(pipe)                        # one process, two stages, no stage=
  with pytest.raises(dtenjax.ConfigurationError, match=r"stage=2 must be an int in \[0, 2\)"):
    dtenjax.HostPipeline(pipe, stage=2)
  with pytest.raises(dtenjax.ConfigurationError, match="dtenjax.pipeline"):
    dtenjax.HostPipeline(lambda x: x, stage=0)
  one = dtenjax.pipeline(m.body, m.loss_fn, stages=1, microbatches=4)
  with pytest.raises(dtenjax.ConfigurationError, match="one stage"):
    dtenjax.HostPipeline(one, stage=0)
  store = _store()
  sds = jax.ShapeDtypeStruct(x.shape, x.dtype)

  def stage(d):
    # Each case is wrong on both stages (a stage whose input is fine would start the step and
    # wait for its neighbour): errors are raised before anything is sent.
    cases = [(x[:10], targets[:10], 3), (x, targets, 2),
             (sds if d == 0 else x, None if d == 1 else targets, 3)]
    found = []
    with dtenjax.HostPipeline(pipe, stage=d, store=store, timeout_s=30) as hp:
      for xin, tin, n in cases:
        mine = {"w1": stacked["w1"][3 * d:3 * d + 3], "w2": stacked["w2"][3 * d:3 * d + n]}
        with pytest.raises(dtenjax.ConfigurationError) as e:
          hp.value_and_grad(mine, head, xin, tin)
        found.append(str(e.value))
    return found

  outs, errs = _on_threads(2, stage)
  assert errs == [None, None], errs
  for d in range(2):
    assert f"stage {d}" in outs[d][0]
    assert "does not divide the batch of 10 rows: use one of [1, 2, 5, 10]" in outs[d][0]
    assert "sharing one leading dimension" in outs[d][1]
  assert "ShapeDtypeStruct on the first stage" in outs[0][2]
  assert "the last stage needs targets" in outs[1][2]


@pytest.mark.skipif(not (ffi.is_built() and ffi.build_info().get("verbs")),
                    reason="the verbs provider is not in this build")
def test_the_links_run_over_verbs_on_the_emulated_device(fake):  # noqa: F811 (the fixture)
  """The links are host-transport communicators: over the RDMA verbs provider (the emulated
  device of tests/fakeverbs/, no NIC here) a 1F1B step moves RDMA writes, breaks none of the
  device's rules, and gives the bits of the same step over TCP. Run again with the last frame
  (the loss handed down) late on either side, and the stages closing their links as they leave
  ``with HostPipeline``: late_cqe, its receive completion posted 0.3 s after its acknowledgement
  (the stage that sent it returns and closes at once, and the other still takes the frame; race14
  reported the closed peer as lost); late_ack, its acknowledgement taken 0.3 s late (the stage
  that took it closes while its sender's write is in flight: that sender counted a peer failure
  every 20 ms until the write completed, abort17). No run counts a peer failure."""
  stacked, head, x, targets = m.init()
  pipe = dtenjax.pipeline(m.body, m.loss_fn, stages=2, microbatches=m.MICRO,
                          schedule=dtenjax.OneFOneB())
  results, frames = {}, 0         # frames: the RDMA writes of the last run
  failures = native.counters()["peer_failures"]
  for run in ("tcp", "verbs", "verbs-late_cqe", "verbs-late_ack"):
    provider, _, fault = run.partition("-")
    store = _store()
    before = fake.counters()
    if fault:
      fake.arm(fault, frames - 1)      # the same links and frames as the run before

    def stage(d, provider=provider, store=store):
      mine = jax.tree.map(lambda a: a[3 * d:3 * d + 3], stacked)
      with dtenjax.HostPipeline(pipe, stage=d, store=store, timeout_s=60, provider=provider,
                                name=provider) as hp:
        assert all(link.provider == provider for link in hp.links.values())
        return hp.value_and_grad(mine, head, x, targets)

    outs, errs = _on_threads(2, stage)
    assert errs == [None, None], (run, errs)
    results[run] = [np.asarray(a) for a in jax.tree.leaves(outs)]
    moved = fake.counters()["messages_received"] - before["messages_received"]
    assert (moved > 0) == (provider == "verbs"), (run, moved)
    frames = fake.counters()["writes_received"] - before["writes_received"]
    fired = fake.counters()["faults_fired"] - before["faults_fired"]
    assert fired == bool(fault), f"{run}: {fault} did not fire"
  assert native.counters()["peer_failures"] == failures, native.counters()["peer_failures"] - failures
  assert fake.counters()["violations"] == fake.violations_before, fake.last_violation()
  for run in ("verbs", "verbs-late_cqe", "verbs-late_ack"):
    assert [a.tobytes() for a in results[run]] == [a.tobytes() for a in results["tcp"]], run


def test_pair_links_carry_exact_bytes_both_ways_and_refuse_mismatches():
  """The exchange under the pipeline: each side's messages arrive with their exact bytes (a
  float sum would turn -0.0 into +0.0 and may quiet a NaN's payload; odd byte counts are padded),
  in slot order; a side that sends another layout fails on both sides, naming the link."""
  import ml_dtypes
  special = np.array([-0.0, np.nan, np.inf, 1e-45, -3.5], np.float32)
  special.view(np.uint32)[1] = 0x7fa00001                       # a NaN with a payload
  odd = np.arange(3, dtype=ml_dtypes.bfloat16)                  # 6 bytes: padded to 8
  slots = [pair.Slot(0, (5,), np.float32), pair.Slot(1, (3,), odd.dtype),
           pair.Slot(0, (), np.int64)]
  store = _store()

  def side(s):
    link = pair.connect("unit", s, 1 - s, store=store, timeout_s=20, context="unit test")
    try:
      mine = [special, np.int64(-7)] if s == 0 else [odd]
      got = link.exchange(slots, mine, tag=5, what="the unit test's exchange")
      with pytest.raises(dtenjax.CollectiveError, match="messages passed for the"):
        link.exchange(slots, [], tag=6)                          # refused before sending
      wrong = [pair.Slot(0, (6,), np.float32)] if s == 0 else [pair.Slot(1, (2,), np.float32)]
      with pytest.raises(dtenjax.DtenjaxError) as e:
        link.exchange(wrong, [np.zeros(6 if s == 0 else 2, np.float32)], tag=7)
      return got, str(e.value)
    finally:
      link.close()

  outs, errs = _on_threads(2, side)
  assert errs == [None, None], errs
  (got0, err0), (got1, err1) = outs
  assert [a.tobytes() for a in got1] == [special.tobytes(), np.int64(-7).tobytes()]
  assert got1[0].dtype == np.float32 and got1[1].shape == ()
  assert [a.tobytes() for a in got0] == [odd.tobytes()] and got0[0].dtype == odd.dtype
  for text in (err0, err1):
    assert "unit 0-1" in text and "at tag 7" in text and "collective mismatch" in text, text


def test_the_choice_lists_both_paths_and_why():
  host = (True, "dtenjax's host transport over tcp (TCP is always available)")
  auto = transport.decide(2, "cpu", "none", "auto", host)
  assert auto.path == "host" and "reach no other process" in auto.reason and "tcp" in auto.reason
  assert [c[:2] for c in auto.candidates] == [("xla", False), ("host", True)]
  assert "* host" in auto.table() and "  xla" in auto.table()
  assert transport.decide(2, "cpu", "gloo", "auto", host).path == "xla"     # XLA wins if it can
  assert transport.decide(2, "gpu", None, "auto", host).path == "xla"
  asked = transport.decide(2, "cpu", "gloo", "host", host)
  assert asked.path == "host" and "asked for" in asked.reason
  assert transport.decide(2, "cpu", "none", "xla", host).path == "none"
  one = transport.decide(1, "cpu", "gloo", "host", host)
  assert one.path == "none" and "one process" in one.reason
  down = transport.decide(2, "cpu", "none", "host", (False, "no libcrypto"))
  assert down.path == "none" and "no libcrypto" in down.reason
  mesh = jax.make_mesh((2, 4), ("stage", "data"))
  assert dtenjax.pipeline_transport(mesh, transport="host").path == "none"   # one process
  with pytest.raises(dtenjax.ConfigurationError, match="transport='carrier'"):
    dtenjax.pipeline_transport(mesh, transport="carrier")


def test_a_stages_programs_name_a_loss_that_is_not_a_scalar_and_a_layer_that_changes_h():
  """user19: as the SPMD pipeline's, the host stage's programs name a ``loss_fn`` that returns
  no floating scalar and a ``body`` that changes the activation (they failed with lax.scan's
  carry error or jax.vjp's "Gradient only defined for scalar-output functions")."""
  w, h, t = jnp.ones((2, 4, 4)), jnp.ones((3, 4)), jnp.ones((3, 4))
  body = lambda c, layer: (c @ layer, None)
  progs = host._programs(body, lambda hd, c, tt: ((c - tt) ** 2).mean(-1))
  with pytest.raises(dtenjax.ConfigurationError, match=r"loss_fn.*returned float32\[3\]"):
    progs["backward_loss"](w, {}, h, t)
  progs = host._programs(lambda c, layer: ((c @ layer)[:, :2], None), m.loss_fn)
  with pytest.raises(dtenjax.ConfigurationError, match=r"body.*into float32\[3, 2\]"):
    progs["forward"](w, h)


def test_integer_leaves_in_the_layers_and_the_head_on_threads():
  """user19: a layer stack carrying an integer per layer and a head with an integer table: the
  stage programs' accumulation added their float0 cotangents ("Called add with a float0
  array"). The loss and the float gradients are those of jax.grad(allow_int=True) of the plain
  loop; the integer leaves get float0 zeros, as jax.grad gives them."""
  layers, head, x, t = m.int_init()
  pipe = dtenjax.pipeline(m.int_body, m.int_loss_fn, stages=2, microbatches=2)
  store = _store()

  def stage(d):
    mine = jax.tree.map(lambda a: a[2 * d:2 * d + 2], layers)
    with dtenjax.HostPipeline(pipe, stage=d, store=store, timeout_s=60) as hp:
      return hp.value_and_grad(mine, head, x, t if d == 1 else None)

  outs, errs = _on_threads(2, stage)
  assert not any(errs), errs

  ref, (rg, rgh) = m.int_reference(layers, head, x, t)
  for d, (value, (dlayers, dhead, _)) in enumerate(outs):
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    np.testing.assert_allclose(dlayers["w"], rg["w"][2 * d:2 * d + 2], rtol=1e-5, atol=1e-7)
    assert dlayers["idx"].dtype == jax.dtypes.float0 and dlayers["idx"].shape == (2,)
  assert outs[1][1][1]["cols"].dtype == jax.dtypes.float0
