"""tests/conftest.py's xdist groups, as scripts/test.sh runs the suite: tests of one group (marked
``xdist_group``, or ``multiprocess``: they start several processes) run in one worker. It fails on pytest 9.2, where pytest-xdist's --dist loadgroup ignores
the groups (pytest-dev/pytest-xdist#1386; hence pyproject's pytest<9.2)."""

import json
import os
import re
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from tests import helpers

ROOT = pathlib.Path(__file__).resolve().parents[1]

TESTS = textwrap.dedent("""
    import json, os
    import pytest

    def _ran(name):
      with open(os.environ["RAN"], "a") as f:
        f.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

    # adjacent members: a plain round robin over the tests would split them
    @pytest.mark.xdist_group("procs")
    def test_g0(): _ran("g0")
    @pytest.mark.multiprocess
    def test_g1(): _ran("g1")
    def test_s0(): _ran("s0")
    def test_s1(): _ran("s1")
    def test_s2(): _ran("s2")
    @pytest.mark.xdist_group("procs")
    def test_g2(): _ran("g2")
    @pytest.mark.multiprocess
    def test_g3(): _ran("g3")
    @pytest.mark.parametrize("i", range(4))
    def test_s3(i): _ran(f"s3{i}")
""")


BUDGET_TESTS = textwrap.dedent("""
    import json, os, time
    import pytest

    @pytest.fixture(autouse=True)
    def _ran(request):         # where each ran: with the groups' tests, that both workers ran some
      with open(os.environ["RAN"], "a") as f:
        f.write(json.dumps([request.node.name, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")

    def _burn(seconds):
      end = time.process_time() + seconds
      while time.process_time() < end:
        pass

    def test_quick(): _burn(0.02)
    def test_busy(): _burn(0.3)
    @pytest.mark.slow
    def test_listed_and_slow(): _burn(0.3)
    def test_listed_not_slow(): _burn(0.3)
    @pytest.mark.slow
    @pytest.mark.parametrize("i", [0])
    def test_listed_parametrized(i): _burn(0.3)
    def test_waits(): time.sleep(0.4)      # wall time only: a busy machine, not the test
""")
TESTING_DOC = textwrap.dedent("""
    | test | reason |
    | --- | --- |
    | `tests/test_budget.py::test_listed_and_slow` | burns 0.3 s of CPU on purpose |
    | `tests/test_budget.py::test_listed_not_slow` | listed, but not marked slow |
    | `tests/test_budget.py::test_listed_parametrized` | every parameter of it |
""")


# One inner run for both checks below (a controller and two workers, each importing jax through
# the copied conftest: about 2 s of CPU a process): the groups' tests and the budget's, as
# scripts/test.sh runs the suite (-n 2 --dist loadgroup), with a 0.25 s budget. The module stays
# in one worker, so that the run is made once.
pytestmark = helpers.one_worker(__name__)


@pytest.fixture(scope="module")
def inner_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("inner_run")
  (root / "tests").mkdir()
  (root / "docs").mkdir()
  for name in ("conftest.py", "procs.py"):
    shutil.copy(ROOT / "tests" / name, root / "tests" / name)
  (root / "tests" / "test_groups.py").write_text(TESTS)
  (root / "tests" / "test_budget.py").write_text(BUDGET_TESTS)
  (root / "docs" / "testing.md").write_text(TESTING_DOC)
  ran, times = root / "ran.jsonl", root / "times.json"
  # PYTHONPATH: the copied conftest's fork servers are the repository's (tests.mp_workers); an
  # xdist worker puts the repository there itself, a -n 0 run does not
  env = dict(os.environ, RAN=str(ran), DTENJAX_TEST_TIME_LIMIT="0.25",
             DTENJAX_TEST_COMPILE_CACHE="0", DTENJAX_TEST_TIMES=str(times),
             PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                      "--dist", "loadgroup", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                      "-rfE", "--durations=2", "tests/test_groups.py", "tests/test_budget.py"],
                     cwd=root, env=env, capture_output=True, text=True, timeout=240, check=False)
  return r, ran, times


def test_a_group_runs_in_one_worker(inner_run):
  r, ran, _ = inner_run
  assert not re.findall(r"^(?:FAILED|ERROR) tests/test_groups.py", r.stdout, re.M), r.stdout[-3000:]
  workers = dict(json.loads(line) for line in ran.read_text().splitlines())
  assert len(workers) == 17, workers          # the groups' 11 and the budget's 6
  assert len({workers[g] for g in ("g0", "g1", "g2", "g3")}) == 1, workers
  # and the rest was spread: xdist gives each worker a first share of the tests, so this holds
  # whatever the tests take (the groups' tests no longer sleep to keep one worker busy)
  assert set(workers.values()) == {"gw0", "gw1"}, workers


def test_a_test_over_the_budget_fails_unless_marked_slow_and_listed(inner_run):
  r, _, times = inner_run
  out = r.stdout
  failed = set(re.findall(r"^FAILED tests/test_budget.py::(\w+)", out, re.M))
  assert failed == {"test_busy", "test_listed_not_slow"}, out[-3000:]
  assert "over the 0.25 s budget of one test" in out and "docs/testing.md" in out
  assert "2 failed, 15 passed" in out, out[-2000:]      # the budget's 4 and the groups' 11
  # both clocks of every test: the summary's slowest by CPU (the burners, not the sleepers) and
  # the JSON of all
  m = re.search(r"slowest 2 by CPU time .*\n(.*)\n(.*)\n", out)
  assert m and all("s cpu" in ln and "test_waits" not in ln for ln in m.groups()), out[-3000:]
  recorded = json.loads(times.read_text())
  assert len(recorded) == 17, recorded
  waits = recorded["tests/test_budget.py::test_waits"]
  assert waits["wall_s"] >= 0.4 and waits["cpu_s"] < 0.25, waits
  assert recorded["tests/test_budget.py::test_busy"]["cpu_s"] >= 0.3


def test_the_listed_long_tests_exist_are_marked_slow_and_say_why():
  import conftest
  allowed = conftest.allowed_long_tests()
  rows = [ln for ln in conftest.TESTING_DOC.read_text().splitlines() if ln.startswith("| `tests/")]
  assert allowed and len(allowed) == len(rows), (sorted(allowed), rows)   # every row is read
  for node, reason in allowed.items():
    path, name = node.split("::")
    source = (ROOT / path).read_text()
    m = re.search(rf"((?:^@.*\n)*)^def {name}\(", source, re.M)
    assert m, f"{node} (docs/testing.md) does not exist"
    assert "@pytest.mark.slow" in m.group(1), f"{node} is listed but not marked slow"
    assert len(reason.split()) >= 5, (node, reason)


def test_tests_share_compiled_programs_through_this_runs_cache():
  import jax
  import jax.numpy as jnp
  import conftest
  if conftest.COMPILE_CACHE_DIR is None:
    import pytest
    pytest.skip("the compile cache is off (DTENJAX_TEST_COMPILE_CACHE=0 or a GPU run)")
  assert jax.config.jax_compilation_cache_dir == conftest.COMPILE_CACHE_DIR
  assert os.environ[conftest.CACHE_DIR_VAR] == conftest.COMPILE_CACHE_DIR
  assert "JAX_COMPILATION_CACHE_DIR" not in os.environ      # not for the processes tests start
  hits = []

  def listener(event, **kwargs):
    del kwargs
    if event == "/jax/compilation_cache/cache_hits":
      hits.append(event)
  jax.monitoring.register_event_listener(listener)
  try:
    def make():                  # a new function object each time: no in-memory cache hit
      def program(x):            # quick to compile: the run caches every program
        return jnp.sin(x @ x.T + 1) @ x
      return program
    x = jnp.ones((16, 16))
    jax.jit(make()).lower(x).compile()
    jax.jit(make()).lower(x).compile()                # another test's copy of the same program
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert hits, "the second compile of the same program did not load it from the cache"


def test_the_suites_xla_cpu_emitters_give_the_default_emitters_bits():
  """tests/conftest.py compiles the suite with XLA:CPU's LLVM IR emitters for fused kernels
  (``--xla_cpu_use_fusion_emitters=false``: about 40 % less compile CPU) and its code generated
  in one LLVM module (``--xla_cpu_parallel_codegen_split_count=1``, XLA's default 32). What makes
  that sound is that no result changes a bit: the stored reference bits of the collectives check
  it on their programs; this checks a sample of the other kinds of program the suite runs, each
  compiled in this process both ways (``compiler_options`` per program: XLA's defaults for what
  the suite's flags set): an expression LLVM may contract to an FMA, the transcendental
  functions, reductions in float32 and bfloat16, dots, a scatter-add with a gather, top-k and a
  sort, and an AdamW step of a small MLP with layer norm and GELU."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import pytest
  import conftest
  from tests.helpers import DEFAULT_CPU_EMITTERS
  suite_flags = os.environ["XLA_FLAGS"].split()
  emitters = conftest.FUSION_EMITTERS_FLAG in suite_flags
  xla_defaults = {**(DEFAULT_CPU_EMITTERS if emitters else {}),
                  **({"xla_cpu_parallel_codegen_split_count": 32}
                     if conftest.SPLIT_CODEGEN_FLAG in suite_flags else {})}
  if not xla_defaults:
    pytest.skip("this run chose its own emitters and code splitting in XLA_FLAGS (or is a GPU run)")
  rng = np.random.default_rng(0)
  x, y, z = (rng.standard_normal(4096, np.float32) * 3 for _ in range(3))
  m = rng.standard_normal((333, 1027), np.float32)
  w = rng.standard_normal((1027, 40), np.float32)
  idx = rng.integers(0, 1027, 500).astype(np.int32)

  def elementwise(a, b, c):
    return (a * b + c, jnp.exp(a), jnp.log(jnp.abs(a) + 1e-3), jnp.tanh(a), jnp.sin(a),
            jax.lax.erf(a), jax.nn.sigmoid(a), jax.nn.gelu(a), jnp.power(jnp.abs(a), 1.7),
            jax.lax.rsqrt(jnp.abs(a) + 1), jnp.expm1(a), jnp.log1p(jnp.abs(a)),
            jnp.exp(a.astype(jnp.bfloat16)), a.astype(jnp.bfloat16) * b.astype(jnp.bfloat16) + 1)

  def reductions(a, b, i):
    h = a.astype(jnp.bfloat16)
    return (a.sum(), a.sum(0), a.mean(1), a.var(0), jnp.cumsum(a, 1)[:, ::97], h.sum(1),
            jax.nn.softmax(a, -1)[::50], jax.nn.logsumexp(a, 0), jnp.linalg.norm(a, axis=1),
            a @ b, (h @ b.astype(jnp.bfloat16)).astype(jnp.float32),
            a.at[:, i].add(1.5)[::50], a[:, i] * 2.0 - 1.0, jax.lax.top_k(a[0], 17),
            jnp.argsort(a[1]))

  def adamw_step(params, xb, yb):
    def loss(p):
      h = xb
      for k, (wk, bk) in enumerate(p):
        h = h @ wk + bk
        if k < len(p) - 1:
          mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
          h = jax.nn.gelu((h - mu) * jax.lax.rsqrt(var + 1e-5))
      return optax.softmax_cross_entropy_with_integer_labels(h, yb).mean()
    tx = optax.adamw(1e-2)
    state = tx.init(params)
    for _ in range(2):
      grads = jax.grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
    return params

  sizes = (64, 96, 10)
  params = [(rng.standard_normal((a, b), np.float32) / np.sqrt(a), np.zeros(b, np.float32))
            for a, b in zip(sizes[:-1], sizes[1:])]
  xb = rng.standard_normal((32, 64), np.float32)
  yb = rng.integers(0, 10, 32).astype(np.int32)
  cases = {"elementwise": (elementwise, (x, y, z)), "reductions": (reductions, (m, w, idx)),
           "adamw": (adamw_step, (params, xb, yb))}
  differing_hlo = []
  for name, (fn, args) in cases.items():
    suites = jax.jit(fn).lower(*args).compile()
    default = jax.jit(fn, compiler_options=xla_defaults).lower(*args).compile()
    for got, want in zip(jax.tree.leaves(suites(*args)), jax.tree.leaves(default(*args))):
      got, want = np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want))
      np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)
    if suites.as_text() != default.as_text():
      differing_hlo.append(name)
  # The emitters flag is in effect: the suite's programs are not the default emitters' programs
  # (code splitting changes no HLO: the bits above are its check).
  assert differing_hlo or not emitters, "the suite's XLA_FLAGS did not change how XLA:CPU compiles"


_BURN = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end:\n  pass\n"


def test_a_fork_servers_runs_are_booked_on_the_test_that_ran_them(tmp_path):
  """The per-test CPU clock (conftest's ``_cpu_s``) reads the live processes under the test's:
  a run that a fork server forks and reaps itself (``ForkServer.run``) is on the clock once it has
  ended, while the server still runs, and ending the server (a later test's teardown, for a
  module's or the session's) adds nothing. RUSAGE_CHILDREN alone reads the run only when the
  server is reaped: 0 s after the run, 0.3 s at the server's end."""
  import conftest
  from tests import procs
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT),
                                                                    os.environ.get("PYTHONPATH")))))
  with procs.ForkServer(env, tmp_path, tmp_path, preload=()) as server:
    before = conftest._cpu_s()
    assert server.run(["-c", _BURN], timeout=60).returncode == 0
    ran = conftest._cpu_s()
  ended = conftest._cpu_s()
  # the run's 0.3 s, less what /proc's rounding to ticks (10 ms) loses (0.29 s read on this VM)
  assert ran - before >= 0.25, (before, ran, ended)
  # the server's exit and reaping: milliseconds, not the run a second time
  assert ended - ran < 0.1, (before, ran, ended)
