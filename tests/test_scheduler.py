"""Tests of dtenjax._src.serving.scheduler on CPU, with real jitted steps and synthetic load.

Timing-dependent tests scale everything to the step time measured at run time and assert counts
and orderings (misses with vs without preemption), never absolute wall-clock numbers.
"""

import gc
import re
import threading
import time
import urllib.request
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtenjax._src import errors
from dtenjax._src.serving import scheduler as S

# Small: the scheduling tests count steps (the flood's clock is virtual), so a step's cost is
# only the test's time; at 384 the flood's 600 steps took 6.7 s of CPU, at 128 0.4 s, with the
# same deadline misses with and without preemption (35 and 0 of 40), two busy processes beside.
N = 128
W = jnp.asarray(np.random.default_rng(0).standard_normal((N, N)) / np.sqrt(N), jnp.float32)
SPEC = jax.ShapeDtypeStruct((N, N), jnp.float32)


def step(batch):
  x = batch
  for _ in range(8):
    x = jnp.tanh(x @ W)
  return x.sum(axis=1)


def reference(batch):
  x = np.asarray(batch, np.float64)
  w = np.asarray(W, np.float64)
  for _ in range(8):
    x = np.tanh(x @ w)
  return x.sum(axis=1)


def batch_of(seed):
  return np.random.default_rng(seed).standard_normal((N, N)).astype(np.float32)


# ---- pure decision functions ----------------------------------------------------------------

def test_preemption_decision_seed_defaults():
  p = S.PreemptionPolicy()
  assert S.preemption_decision(p, 0, None) == 0.0
  assert S.preemption_decision(p, 2, 0.100) == 0.0
  assert S.preemption_decision(p, 3, None) == 0.25
  assert S.preemption_decision(p, 0, 0.111) == 0.40
  assert S.preemption_decision(p, 10, 0.5) == 0.40          # the larger release applies
  assert S.preemption_decision(p, 2, 0.110) == 0.0          # strictly above 110 ms
  off = S.PreemptionPolicy(enabled=False)
  assert S.preemption_decision(off, 100, 9.0) == 0.0
  custom = S.PreemptionPolicy(backlog_batches=1, backlog_release=0.5, p95_seconds=0.01,
                              p95_release=0.1)
  assert S.preemption_decision(custom, 1, 0.02) == 0.5


def test_preemption_policy_validation_lists_every_problem():
  with pytest.raises(errors.ConfigurationError) as e:
    S.PreemptionPolicy(backlog_batches=0, backlog_release=1.5, p95_seconds=-1)
  msg = str(e.value)
  assert "backlog_batches=0" in msg and "backlog_release=1.5" in msg and "p95_seconds=-1" in msg


def _slots(share, n=800):
  credit, low = 0.0, 0
  for _ in range(n):
    q, credit = S.pick_queue(credit, share, True, True)
    low += q == S.LOW_LATENCY
  return low


def test_pick_queue_shares_slots_by_weight_and_yields_idle_slots():
  assert _slots(0.125) == 100
  released = S.low_latency_slot_share(0.125, 0.40)
  assert released == pytest.approx(0.475)
  assert _slots(released) == pytest.approx(380, abs=1)
  assert S.pick_queue(0.0, 0.125, True, False)[0] == S.LOW_LATENCY
  assert S.pick_queue(5.0, 0.125, False, True)[0] == S.MAIN
  assert S.pick_queue(0.0, 0.125, False, False)[0] is None


def test_percentiles():
  p = S.percentiles(list(range(101)))
  assert p == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
  assert S.percentiles([]) == {"p50": None, "p95": None, "p99": None}


# ---- the scheduler with a real jitted step ---------------------------------------------------

def test_futures_carry_the_step_results():
  with S.GraphScheduler(step, batch_spec=SPEC) as sch:
    futs = [(s, sch.submit(batch_of(s))) for s in range(3)]
    futs += [(s, sch.inject_micro_batch(batch_of(s))) for s in range(3, 6)]
    for s, f in futs:
      np.testing.assert_allclose(f.result(timeout=30), reference(batch_of(s)), rtol=2e-4,
                                 atol=2e-4)
  m = sch.metrics()
  assert m[S.MAIN].completed == 3 and m[S.LOW_LATENCY].completed == 3
  assert m[S.LOW_LATENCY].p50 is not None and m[S.LOW_LATENCY].p50 > 0


def test_batches_that_do_not_fit_are_rejected_at_injection():
  spec = {"x": SPEC, "mask": jax.ShapeDtypeStruct((N,), jnp.bool_)}
  with S.GraphScheduler(lambda b: step(b["x"]) * b["mask"], batch_spec=spec) as sch:
    with pytest.raises(errors.ConfigurationError) as e:
      sch.inject_micro_batch({"x": np.ones((N, N + 1), np.float32),
                              "mask": np.ones((N,), np.int32)})
    msg = str(e.value)
    assert "['x']" in msg and f"float32[{N}, {N + 1}]" in msg
    assert "['mask']" in msg and "int32" in msg and "bool" in msg
    with pytest.raises(errors.ConfigurationError, match="structure"):
      sch.submit(np.ones((N, N), np.float32))
    ok = sch.submit({"x": batch_of(1), "mask": np.ones((N,), bool)})
    np.testing.assert_allclose(ok.result(timeout=30), reference(batch_of(1)), rtol=2e-4,
                               atol=2e-4)
  assert sch.metrics()[S.MAIN].completed == 1


def test_a_failing_step_fails_its_future_and_the_dispatcher_goes_on():
  def check(x):
    if x[0, 0] < 0:
      raise ValueError("negative sentinel")
    return x
  def failing_step(b):
    return jax.pure_callback(check, jax.ShapeDtypeStruct(b.shape, b.dtype), b).sum()
  with S.GraphScheduler(failing_step, batch_spec=SPEC) as sch:
    bad = np.ones((N, N), np.float32)
    bad[0, 0] = -1
    f_bad = sch.inject_micro_batch(bad)
    f_ok = sch.submit(np.ones((N, N), np.float32))
    with pytest.raises(Exception, match="negative sentinel"):
      f_bad.result(timeout=30)
    assert float(f_ok.result(timeout=30)) == N * N
  m = sch.metrics()
  assert m[S.LOW_LATENCY].failed == 1 and m[S.MAIN].completed == 1


def test_constructor_validation():
  with pytest.raises(errors.ConfigurationError) as e:
    S.GraphScheduler(step, batch_spec=SPEC, latency_sla=0, low_latency_share=1.5, max_queue=0)
  msg = str(e.value)
  assert "latency_sla=0" in msg and "low_latency_share=1.5" in msg and "max_queue=0" in msg


def test_shutdown_runs_every_accepted_batch_then_refuses_work():
  sch = S.GraphScheduler(step, batch_spec=SPEC)
  b = batch_of(0)
  futs = [sch.submit(b) for _ in range(60)] + [sch.inject_micro_batch(b) for _ in range(15)]
  sch.shutdown(timeout=120)
  assert all(f.done() and f.exception() is None for f in futs)
  m = sch.metrics()
  assert m[S.MAIN].completed == 60 and m[S.LOW_LATENCY].completed == 15
  assert m[S.MAIN].depth == 0 and m[S.LOW_LATENCY].depth == 0
  with pytest.raises(S.SchedulerClosedError):
    sch.submit(b)


def test_full_queue_raises_after_its_timeout():
  with S.GraphScheduler(step, batch_spec=SPEC, max_queue=1) as sch:
    b = batch_of(0)
    with pytest.raises(S.QueueFullError, match="max_queue=1"):
      for _ in range(200):
        sch.submit(b, timeout=0.0)


def _wait_for_steps(sch, k, timeout=120.0):
  end = time.monotonic() + timeout
  while sch.steps_run < k:
    if time.monotonic() > end:
      raise TimeoutError(f"the dispatcher ran {sch.steps_run} steps in {timeout} s; wanted {k}")
    time.sleep(0.0005)


def _flood(preempt: bool, n_low: int = 40, gap: int = 5, sla_steps: int = 20):
  """Main queue flooded; a low-latency batch every `gap` steps. Returns (metrics, episodes).

  Time is virtual: the scheduler's clock counts finished steps (1 ms each), so the outcome does
  not depend on how fast or loaded the machine is, while every step is a real jitted run.
  """
  dt = 1e-3
  holder = {}
  clock = lambda: holder["s"].steps_run * dt if "s" in holder else 0.0
  policy = S.PreemptionPolicy(enabled=preempt, p95_seconds=0.9 * sla_steps * dt)
  sch = S.GraphScheduler(step, batch_spec=SPEC, latency_sla=sla_steps * dt, preemption=policy,
                         cuda_graphs="off", clock=clock)
  holder["s"] = sch
  b = batch_of(0)
  mains = [sch.submit(b) for _ in range(n_low * gap + 60)]
  lows = []
  for i in range(n_low):
    _wait_for_steps(sch, i * gap)
    lows.append(sch.inject_micro_batch(b))
  sch.shutdown(timeout=120)
  assert all(f.exception() is None for f in mains + lows)
  return sch.metrics(), sch.preemption_episodes


def test_low_latency_queue_meets_deadlines_with_preemption_and_misses_without():
  n = 40
  without, episodes_off = _flood(False, n)
  with_p, episodes_on = _flood(True, n)
  low_off, low_on = without[S.LOW_LATENCY], with_p[S.LOW_LATENCY]
  assert low_off.completed == low_on.completed == n
  # Without preemption the low-latency queue has only its 1/8 base share of a flooded device
  # while batches arrive at 1/5 of its rate: its backlog grows and deadlines are missed.
  assert episodes_off == 0 and low_off.preemptions == 0
  assert low_off.deadline_misses >= n // 2, low_off
  # With it, main-queue capacity is released and (nearly) every deadline is met.
  assert episodes_on >= 1 and low_on.preemptions > 0 and with_p[S.MAIN].preemptions > 0
  assert low_on.deadline_misses <= n // 10, low_on
  assert low_on.p95 < low_off.p95


def test_prometheus_endpoint_exports_per_queue_metrics_from_a_private_registry():
  a = S.GraphScheduler(step, batch_spec=SPEC, metrics_port=0, latency_sla=1e-6)
  b = S.GraphScheduler(step, batch_spec=SPEC, metrics_port=0)   # own registry: no clash
  try:
    for _ in range(3):
      a.inject_micro_batch(batch_of(0)).result(timeout=30)   # a 1 us SLA: every one misses
    a.submit(batch_of(0)).result(timeout=30)
    host, port = a.metrics_address
    assert host == "127.0.0.1"
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    misses = re.search(r'dtenjax_sched_deadline_misses_total\{queue="low_latency"\} (\S+)', body)
    assert misses and float(misses.group(1)) == a.metrics()[S.LOW_LATENCY].deadline_misses == 3
    assert re.search(r'dtenjax_sched_latency_seconds\{quantile="0.95",queue="low_latency"\}',
                     body)
    assert 'dtenjax_sched_batches_total{queue="main",status="ok"} 1.0' in body
    assert b.metrics_address[1] != port
  finally:
    a.shutdown()
    b.shutdown()


# ---- reliability: every future resolves, no thread outlives its scheduler ---------------------

def _gated_step(gate: threading.Event):
  """A step whose first run waits (at most 30 s) until the test has queued its batches."""
  def wait(x):
    if not gate.wait(30):
      raise TimeoutError("the test never opened the gate (waited 30 s)")
    return x
  return lambda b: jax.pure_callback(wait, jax.ShapeDtypeStruct(b.shape, b.dtype), b).sum()


def test_dispatcher_failure_after_a_step_resolves_that_batch_and_fails_the_queued_ones():
  gate = threading.Event()

  class ClockBroke(RuntimeError):
    pass

  def clock():
    if threading.current_thread().name == "dtenjax-graph-scheduler":
      raise ClockBroke("the clock failed on the dispatcher thread")
    return time.monotonic()
  sch = S.GraphScheduler(_gated_step(gate), batch_spec=SPEC, clock=clock)
  b = np.ones((N, N), np.float32)
  first = sch.submit(b)
  queued = [sch.submit(b) for _ in range(3)] + [sch.inject_micro_batch(b)]
  gate.set()
  # The first batch ran: it gets its result although the bookkeeping after it failed.
  assert float(first.result(timeout=60)) == N * N
  for f in queued:
    err = f.exception(timeout=60)
    assert isinstance(err, S.SchedulerClosedError) and "ClockBroke" in str(err)
    assert isinstance(err.__cause__, ClockBroke)
  assert isinstance(sch.failure, ClockBroke)
  with pytest.raises(S.SchedulerClosedError, match="dispatcher thread failed"):
    sch.submit(b)
  with pytest.raises(S.SchedulerClosedError, match="ClockBroke"):
    sch.shutdown(timeout=30)
  assert not sch._d.thread.is_alive()


def test_interrupt_while_a_batch_runs_fails_it_and_every_queued_batch(monkeypatch):
  gate = threading.Event()

  class Interrupted(BaseException):   # not an Exception: escapes the per-step handler
    pass

  def run_step(compiled, batch):
    del compiled, batch
    if not gate.wait(30):
      raise TimeoutError("the test never opened the gate (waited 30 s)")
    raise Interrupted("interrupted while the step ran")
  monkeypatch.setattr(S, "_run_step", run_step)
  sch = S.GraphScheduler(step, batch_spec=SPEC)
  b = batch_of(0)
  futs = [sch.submit(b) for _ in range(3)] + [sch.inject_micro_batch(b) for _ in range(2)]
  gate.set()
  for f in futs:
    err = f.exception(timeout=60)
    assert isinstance(err, S.SchedulerClosedError), err
    assert isinstance(err.__cause__, Interrupted) and "Interrupted" in str(err)
  sch._d.thread.join(30)
  assert not sch._d.thread.is_alive()
  with pytest.raises(S.SchedulerClosedError):
    sch.shutdown(timeout=30)


def test_a_scheduler_dropped_without_shutdown_runs_its_work_and_its_thread_exits():
  sch = S.GraphScheduler(step, batch_spec=SPEC, metrics_port=0)
  futs = [(s, sch.submit(batch_of(s))) for s in range(3)]
  thread = sch._d.thread
  host, port = sch.metrics_address
  ref = weakref.ref(sch)
  del sch
  gc.collect()
  assert ref() is None, "something still holds the GraphScheduler"
  thread.join(60)
  assert not thread.is_alive(), "the dispatcher thread outlived its scheduler"
  for s, f in futs:
    np.testing.assert_allclose(f.result(timeout=1), reference(batch_of(s)), rtol=2e-4, atol=2e-4)
  with pytest.raises(OSError):        # the metrics endpoint was closed with it
    urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5)


def test_an_idle_dropped_scheduler_thread_exits():
  sch = S.GraphScheduler(step, batch_spec=SPEC)
  thread = sch._d.thread
  del sch
  gc.collect()
  thread.join(30)
  assert not thread.is_alive()


# ---- inputs that used to slip through (issue 23 item 4) -------------------------------------

@pytest.mark.parametrize("kwargs,fragment", [
    (dict(max_queue=True), "max_queue=True must be an integer"),
    (dict(latency_window=2.5), "latency_window=2.5 must be an integer"),
    (dict(latency_sla="0.1"), "latency_sla='0.1' must be a finite number of seconds (got str)"),
    (dict(latency_sla=float("nan")), "latency_sla=nan must be a finite number"),
    (dict(latency_sla=float("inf")), "latency_sla=inf must be a finite number"),
    (dict(poll_interval=-1), "poll_interval=-1 must be a finite number of seconds > 0"),
    (dict(low_latency_share=1.0), "low_latency_share=1.0 must be < 1"),
    (dict(low_latency_share="half"), "low_latency_share='half' must be a finite number"),
    (dict(metrics_port=True), "metrics_port=True must be None or an integer port"),
    (dict(metrics_port=70000), "metrics_port=70000 must be None or an integer port"),
    (dict(preemption="aggressive"), "preemption='aggressive' must be a PreemptionPolicy"),
    (dict(clock=lambda: "12"), "clock returned '12' (str)"),
    (dict(clock=lambda: float("nan")), "clock returned nan (float)"),
    (dict(clock=3.0), "clock=3.0 must be callable"),
])
def test_constructor_refuses_values_of_the_wrong_kind(kwargs, fragment):
  with pytest.raises(errors.ConfigurationError, match=re.escape(fragment)):
    S.GraphScheduler(step, batch_spec=SPEC, **kwargs)


@pytest.mark.parametrize("batch_spec,fragments", [
    (None, ["batch_spec=None holds no array", "jax.ShapeDtypeStruct((32, 128), jnp.float32)"]),
    ({"x": None, "y": []}, ["holds no array"]),
    (np.array(["a", "b"]), ["batch_spec: dtype <U1 is not numeric or bool"]),
    ({"tokens": np.array([object()])}, ["['tokens']: dtype object is not numeric or bool"]),
    ((SPEC, jax.ShapeDtypeStruct((-1, 4), jnp.float32)),
     ["[1]: shape (-1, 4) must be non-negative integer sizes"]),
])
def test_batch_specs_a_step_cannot_take_are_named_before_compiling(batch_spec, fragments):
  """GraphScheduler(batch_spec=None) used to reach the user's step as None (a raw TypeError from
  inside it); str/object arrays and negative sizes reached XLA (TypeError, MLIRError)."""
  with pytest.raises(errors.ConfigurationError) as e:
    S.GraphScheduler(step, batch_spec=batch_spec)
  assert all(f in str(e.value) for f in fragments), str(e.value)


@pytest.mark.parametrize("step_fn,fragment", [
    (lambda: 1, "TypeError: <lambda>() takes 0 positional arguments but 1 was given"),
    (lambda b: b @ jnp.ones((3, 3)), "TypeError: dot_general requires contracting dimensions"),
])
def test_a_step_that_cannot_take_the_batch_spec_is_a_configuration_error(step_fn, fragment):
  with pytest.raises(errors.ConfigurationError) as e:
    S.GraphScheduler(step_fn, batch_spec=jax.ShapeDtypeStruct((2,), jnp.float32))
  msg = str(e.value)
  assert "step_fn could not be compiled for one batch of batch_spec float32[2]" in msg, msg
  assert fragment in msg and "fix batch_spec or step_fn" in msg, msg
  assert isinstance(e.value.__cause__, TypeError)     # the step's own error is kept


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(backlog_batches=True), "backlog_batches=True must be an integer"),
    (dict(backlog_release="0.5"), "backlog_release='0.5' must be a finite number (got str)"),
    (dict(p95_release=float("nan")), "p95_release=nan must be a finite number"),
    (dict(p95_seconds=float("inf")), "p95_seconds=inf must be a finite number"),
    (dict(enabled="no"), "enabled='no' must be True or False"),
])
def test_preemption_policy_refuses_values_of_the_wrong_kind(kwargs, fragment):
  with pytest.raises(errors.ConfigurationError, match=re.escape(fragment)):
    S.PreemptionPolicy(**kwargs)


def test_timeouts_deadlines_and_batches_of_the_wrong_kind_are_refused_at_once():
  gate = threading.Event()
  sch = S.GraphScheduler(_gated_step(gate), batch_spec=SPEC, max_queue=1)
  b = np.ones((N, N), np.float32)
  try:
    sch.submit(b)              # runs (blocked on the gate) once the dispatcher takes it
    sch.submit(b, timeout=30)  # fills the main queue
    for bad in (float("nan"), float("inf"), 1e300, -1.0, "1", True, None):
      t0, c0 = time.monotonic(), time.process_time()
      with pytest.raises(errors.ConfigurationError, match=r"timeout=.* must be a finite number "
                                                          r"of seconds"):
        sch.submit(b, timeout=bad)
      # refused before any wait: no 0.3 CPU-s/s busy loop on NaN, no overflow on huge values
      assert time.monotonic() - t0 < 0.5 and time.process_time() - c0 < 0.5, bad
    with pytest.raises(errors.ConfigurationError, match=r"timeout=nan"):
      sch.inject_micro_batch(b, timeout=float("nan"))
    with pytest.raises(errors.ConfigurationError, match=r"another clock \(time.time\(\)\?\)"):
      sch.inject_micro_batch(b, deadline=time.time())
    for bad in (float("nan"), float("inf"), "soon"):
      with pytest.raises(errors.ConfigurationError, match="deadline="):
        sch.inject_micro_batch(b, deadline=bad)
    for bad, kind in (((x for x in [b]), "generator"), (b"\0" * 16, "bytes"), ("batch", "str")):
      with pytest.raises(errors.ConfigurationError, match=f"batch: {kind}"):
        sch.submit(bad)
    with pytest.raises(errors.ConfigurationError, match="batch_spec: generator"):
      S.GraphScheduler(step, batch_spec=(x for x in [SPEC]))
    for bad in (float("nan"), float("inf"), "60"):
      with pytest.raises(errors.ConfigurationError, match="timeout="):
        sch.shutdown(timeout=bad)
  finally:
    gate.set()
  sch.shutdown(timeout=60)   # the refused calls left it working
  assert sch.metrics()[S.MAIN].completed == 2


def test_a_clock_that_turns_bad_is_named_where_it_is_read():
  """A clock returning a str after construction: the caller's injection raises naming the value;
  on the dispatcher thread it stops the dispatcher, and every pending future and later call say
  why (the ConfigurationError is the cause), never a raw TypeError or a silent death."""
  gate = threading.Event()
  state = {"bad": False}

  def clock():
    return "12:00" if state["bad"] else time.monotonic()
  sch = S.GraphScheduler(_gated_step(gate), batch_spec=SPEC, clock=clock)
  b = np.ones((N, N), np.float32)
  first = sch.submit(b)
  queued = sch.submit(b)
  state["bad"] = True
  with pytest.raises(errors.ConfigurationError, match=r"clock returned '12:00' \(str\)"):
    sch.submit(b)
  gate.set()
  assert float(first.result(timeout=60)) == N * N   # it ran; its bookkeeping then failed
  err = queued.exception(timeout=60)
  assert isinstance(err, S.SchedulerClosedError) and "clock returned '12:00'" in str(err)
  assert isinstance(err.__cause__, errors.ConfigurationError)
  with pytest.raises(S.SchedulerClosedError, match="clock returned '12:00'"):
    sch.shutdown(timeout=30)


# ---- re-entrancy: the scheduler called from its own done-callbacks (issue 35 item 6) -------------

def _held_scheduler(**kw):
  """A scheduler whose step waits (a host callback inside it) until ``hold`` is set, so a
  done-callback can be attached to a batch that is certainly not done yet (it then runs on the
  dispatcher thread); ``sch.entered`` is set once a batch is running (it left its queue)."""
  hold, entered = threading.Event(), threading.Event()

  def gate(x):
    entered.set()
    assert hold.wait(60)
    return np.zeros((), np.float32)

  def held_step(batch):
    return step(batch) + jax.pure_callback(gate, jax.ShapeDtypeStruct((), jnp.float32),
                                           batch[0, 0])
  sch = S.GraphScheduler(held_step, batch_spec=SPEC, **kw)
  sch.entered = entered
  return sch, hold


def test_shutdown_from_a_done_callback_works_and_runs_the_accepted_batches():
  sch, hold = _held_scheduler()
  b = batch_of(0)
  seen = []
  first = sch.submit(b)
  rest = [sch.submit(b) for _ in range(3)]

  def on_done(f):
    seen.append(threading.current_thread().name)
    try:
      sch.shutdown(timeout=5)      # on the dispatcher thread: must neither raise nor wait
      seen.append(None)
    except BaseException as e:
      seen.append(e)
  first.add_done_callback(on_done)
  hold.set()
  for f in [first, *rest]:
    assert f.result(timeout=60).shape == (N,)
  assert seen == ["dtenjax-graph-scheduler", None], seen
  sch._d.thread.join(30)           # the dispatcher drained what was accepted and exited
  assert not sch._d.thread.is_alive()
  with pytest.raises(S.SchedulerClosedError, match="shut down"):
    sch.submit(b)
  sch.shutdown(timeout=5)          # a later shutdown from outside returns at once


def test_submit_from_a_done_callback_into_a_full_queue_raises_at_once():
  sch, hold = _held_scheduler(max_queue=1)
  b = batch_of(0)
  box = {}

  def on_done(f):
    box["thread"] = threading.current_thread().name
    t0 = time.monotonic()
    try:
      sch.submit(b, timeout=20)    # the main queue is full: only this thread could make room
    except BaseException as e:
      box["error"] = e
    box["seconds"] = time.monotonic() - t0
  first = sch.submit(b)
  first.add_done_callback(on_done)
  assert sch.entered.wait(60)
  queued = sch.submit(b)           # fills the queue behind the held batch
  with pytest.raises(S.QueueFullError):
    sch.submit(b)
  hold.set()
  assert queued.result(timeout=60).shape == (N,)
  assert box["thread"] == "dtenjax-graph-scheduler", box
  assert box["seconds"] < 1.0, box          # not the 20 s timeout
  assert isinstance(box["error"], S.QueueFullError), box
  assert "dispatcher thread" in str(box["error"]) and "max_queue=1" in str(box["error"])
  sch.shutdown(timeout=60)
