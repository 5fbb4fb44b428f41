"""Test set-up: 8 simulated CPU devices unless a GPU run asks otherwise, XLA:CPU's quicker-to-compile
LLVM IR emitters (the same bits in what it checks; see below), compiled programs shared within a
run, and a time budget per test.

XLA_FLAGS must be set before JAX initialises its backends, so this runs at import time of the
test session. On the GPU machine set DTENJAX_TEST_PLATFORM=gpu to keep the GPU as default backend.

Shared compiled programs (CPU runs): the suite's processes (both pytest-xdist workers) use one
JAX persistent compilation cache in a temporary directory made for this run (removed at its
end), so a test that compiles a program another test already compiled -- the same HLO, the same
options, e.g. one collective under ``mesh_map`` and under ``jax.shard_map`` -- loads it instead
of compiling it again. It is set through ``jax.config`` in this process only: processes that
tests start (fresh-process reproducibility checks, the CLI, multi-process rings) compile for
themselves. ``DTENJAX_TEST_COMPILE_CACHE=0`` turns it off.

Time budget: a test that takes more than ``DTENJAX_TEST_TIME_LIMIT`` seconds (default 60; 0 turns
the check off) on both clocks -- wall time, and the CPU time of the test's process and the
processes under it (``_cpu_s``; one worker has about one core of the 2-core machine, so on a quiet
machine the two agree; on a busy one the wall clock alone would blame the test for others'
load) -- fails, unless it is marked ``slow`` and listed with its reason in docs/testing.md.
"""

import atexit
import gc
import json
import os
import pathlib
import re
import resource
import shutil
import tempfile
import time

if os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") == "cpu":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite runs as the docs tell GPU users to run: NVLink SHARP off (dtenjax.pin_nccl()), which
# importing dtenjax no longer does by itself. The planner prices deterministic all-reduces with
# XLA's collective only then (collectives/algorithms/xla.py), so plans on the GPU fixtures depend
# on it. Tests of the unpinned behaviour remove it from their own environment.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
# XLA:CPU's LLVM IR emitters for fused kernels instead of its MLIR fusion emitters (the default):
# the same bits in every program whose bits the pytest processes check (the stored reference bits;
# the sample in tests/test_conftest.py) for 20-30 % less CPU in the files that compile most. Not
# in every program: the 4 x 2 pipelined step of tests/pipeline_bits.py gets other bits with it
# (docs/testing.md, tenth round), so the processes the tests start keep XLA's default emitters. The optimised HLO
# differs (other fusion boundaries, scatters expanded into loops, other temp bytes), so a check of
# a compiled program's structure that must be the users' program compiles with the default
# emitters (helpers.DEFAULT_CPU_EMITTERS; docs/testing.md, ninth round). Naming the flag in
# XLA_FLAGS (=true) gives XLA's default back to the whole run. Not on GPU runs, and only with a
# jaxlib whose XLA has the flag: jax 0.11.2's aborts on it at start ("Unknown flag in XLA_FLAGS",
# seen on the GPU machine 2026-12-06), so there the suite compiles with XLA's defaults.
FUSION_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _xla_has_the_emitters_flag() -> bool:
  """jaxlib 0.10.x has it (CI's); 0.11.2 does not. Read without importing jax (the flag must be
  in XLA_FLAGS before jax starts)."""
  from importlib import metadata
  try:
    major, minor = (int(p) for p in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return False
  return (major, minor) < (0, 11)


if (os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") == "cpu"
    and "xla_cpu_use_fusion_emitters" not in flags and _xla_has_the_emitters_flag()):
  flags += " " + FUSION_EMITTERS_FLAG
# XLA:CPU's code generation in one LLVM module instead of XLA's default 32 parts compiled on its
# thread pool (xla_cpu_parallel_codegen_split_count): each fused kernel is the same function with
# the same passes, split or not, so the machine code and the bits are the same, and the HLO and
# the buffer assignment (memory_analysis) come before it. On a 2-core machine whose two workers
# keep both cores busy the parts save no wall time, and each part repeats LLVM's per-module set-up:
# with the suite's LLVM IR emitters (jaxlib 0.10) an AdamW step of a 6-layer MLP took 3.4 s of
# CPU to compile instead of 4.0 (0.8 instead of 1.1 with LLVM unoptimised, compile_only.LLVM_O0);
# with 0.11.2's default emitters 2.1 instead of 2.2 (docs/testing.md, the twenty-sixth round).
# tests/test_conftest.py compares the bits of a sample of programs with XLA's defaults. Naming
# the flag in XLA_FLAGS keeps the caller's value; not on GPU runs.
SPLIT_CODEGEN_FLAG = "--xla_cpu_parallel_codegen_split_count=1"
if (os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") == "cpu"
    and "xla_cpu_parallel_codegen_split_count" not in flags):
  flags += " " + SPLIT_CODEGEN_FLAG
os.environ["XLA_FLAGS"] = flags.strip()

import pytest  # noqa: E402
from procs import PROCS  # noqa: E402  (tests/procs.py: why such tests share a group)

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE_DIR_VAR = "DTENJAX_TEST_COMPILE_CACHE_DIR"


_CREATED: list[str] = []     # the cache directory this process made (and removes at the end)


def _compiled_programs_dir() -> str | None:
  """This run's directory of compiled programs (see the docstring), made by its first process."""
  if os.environ.get("DTENJAX_TEST_COMPILE_CACHE", "1") == "0" or (
      os.environ.get("DTENJAX_TEST_PLATFORM", "cpu") != "cpu"):
    return None
  path = os.environ.get(CACHE_DIR_VAR)
  if not path:          # the first process of the run (pytest-xdist's workers inherit it)
    path = tempfile.mkdtemp(prefix="dtenjax-test-compiled-")
    os.environ[CACHE_DIR_VAR] = path
    _CREATED.append(path)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  return path


COMPILE_CACHE_DIR = _compiled_programs_dir()


def _hands_out_tests_only(config) -> bool:
  """pytest-xdist's controller (``-n N``, as scripts/test.sh runs): it collects and runs no test,
  its workers do (the condition is xdist's own for starting them)."""
  return (not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"
          and bool(config.getoption("tx", None)) and not config.getoption("collectonly"))


def pytest_configure(config):
  """Points JAX's persistent compilation cache at this run's directory, in the processes that run
  tests. Not in xdist's controller, which never imports jax: importing it there (and starting its
  backend, to ask for a GPU) took 1.5 s of CPU before the controller started the workers
  (docs/testing.md, fourteenth round)."""
  if COMPILE_CACHE_DIR is None or _hands_out_tests_only(config):
    return
  import jax
  jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE_DIR)
  # Every program, however quick to compile: the 0.2 s this had is wall time, so on a quiet
  # machine it kept most of the suite's programs out (one process over six test files: 18 of 671
  # compiles loaded, 160 compiled a second time), while a loaded one cached them (202 of 888).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  """The run's cache directory goes with the run (atexit repeats it for other exits)."""
  del config
  for path in _CREATED:
    shutil.rmtree(path, ignore_errors=True)

@pytest.fixture(scope="session", autouse=True)
def _one_pair_of_fork_servers():
  """Every launch of the session that can fork (tests/mp_workers/launch.py: the `procs` group's
  jobs, the elastic launcher's workers, their fresh-process runs) forks from one pair of servers
  that imported jax, started at the first such launch (a worker that runs none starts none)."""
  from tests.mp_workers import launch
  with launch.shared_forks():
    yield


# --- the time budget per test -------------------------------------------------------------------

TIME_LIMIT_S = float(os.environ.get("DTENJAX_TEST_TIME_LIMIT", "60"))
TESTING_DOC = ROOT / "docs" / "testing.md"
# a row of the table in docs/testing.md: | `tests/test_x.py::test_y` | reason |
_ALLOWED_ROW = re.compile(r"^\|[ \t]*`(tests/[^`\n]+::[^`\n]+)`[ \t]*\|[ \t]*([^|\n]*[^|\s])[ \t]*\|[ \t]*$",
                          re.M)


def allowed_long_tests(doc: pathlib.Path = TESTING_DOC) -> dict[str, str]:
  """{node id (without parameters): reason} of the tests docs/testing.md allows over the limit."""
  try:
    text = doc.read_text(encoding="utf-8")
  except OSError:
    return {}
  return dict(_ALLOWED_ROW.findall(text))


ALLOWED_LONG = allowed_long_tests()


# The CPU clock of a test is that of the process tree under this process: this process, the children
# it reaped (RUSAGE_CHILDREN) and its live descendants, each with what it reaped (/proc's stat). A
# child's CPU is read while it works, so a test is booked what ran while it ran, whoever reaps the
# process that did it: the runs a fork server forks and reaps itself (tests/procs.py's
# ``ForkServer.run``: test_bench_scripts's benches, test_doc_code's blocks) and the server's own
# import of jax, which RUSAGE_CHILDREN alone booked on the test whose teardown ended the server,
# 27-61 s at once (docs/testing.md, suite19 and suite20). A child reaped between two readings
# moves from the live part to RUSAGE_CHILDREN: the clock does not jump. The live children are
# those of each process's main thread (where the fixtures start servers and where a process
# adopts orphans, ``procs.adopting``): two files a process, where every thread's list cost 0.2 ms
# a reading in a worker's 29 threads; a child another thread forked is read when it is reaped,
# as before.
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _read(path: str) -> bytes:
  fd = os.open(path, os.O_RDONLY)
  try:
    return os.read(fd, 65536)
  finally:
    os.close(fd)


def _live_cpu_s(pid: int) -> float:
  """The CPU of a process's live children (its main thread's), each with the children it reaped
  and its own live descendants; 0 where /proc does not list them (another system, a kernel
  without the children file) or the process was reaped since it was listed (its CPU is in
  RUSAGE_CHILDREN then)."""
  total = 0.0
  try:
    kids = _read(f"/proc/{pid}/task/{pid}/children").split()
  except OSError:
    return total
  for kid in kids:
    try:
      stat = _read(f"/proc/{int(kid)}/stat")
    except OSError:
      continue
    fields = stat[stat.rindex(b")") + 2:].split()     # after the command's name, which may hold ")"
    total += sum(int(v) for v in fields[11:15]) * _TICK_S + _live_cpu_s(int(kid))   # fields 14-17
  return total


def _has_live_children() -> bool:
  """Whether this process has a child not reaped yet (one system call: most tests start none)."""
  try:
    os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)     # reaps nothing
  except ChildProcessError:
    return False
  return True


def _cpu_s() -> float:
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  live = _live_cpu_s(os.getpid()) if _has_live_children() else 0.0
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + live


def _timed(item, key):
  wall0, cpu0 = time.perf_counter(), _cpu_s()
  yield
  item.user_properties.append((key, (time.perf_counter() - wall0, _cpu_s() - cpu0)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
  yield from _timed(item, "setup_s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  yield from _timed(item, "time_s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
  yield from _timed(item, "teardown_s")


# --- both clocks of every test, reported at the end ---------------------------------------------
# The controller (or the only process) collects each test's (wall, CPU) seconds from its teardown
# report (pytest-xdist sends user_properties along), fixtures' set-up included: a module fixture
# that starts processes is paid by the first test that uses it. The summary lists the slowest by
# CPU beside --durations' wall-clock list (CPU time is what a shared machine does not inflate);
# DTENJAX_TEST_TIMES=PATH also writes every test's times as JSON.
_TIMES: dict[str, tuple[float, float]] = {}


def pytest_runtest_logreport(report):
  if report.when != "teardown":
    return
  props = dict(report.user_properties)
  phases = [props[k] for k in ("setup_s", "time_s", "teardown_s") if k in props]
  if phases:
    _TIMES[report.nodeid] = (sum(w for w, _ in phases), sum(c for _, c in phases))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  del exitstatus
  # an xdist worker has workerinput (its environment variable would also reach the pytest runs
  # that tests start, tests/test_conftest.py's among them)
  if not _TIMES or hasattr(config, "workerinput"):
    return
  path = os.environ.get("DTENJAX_TEST_TIMES")
  if path:
    with open(path, "w", encoding="utf-8") as f:
      json.dump({k: {"wall_s": round(w, 3), "cpu_s": round(c, 3)} for k, (w, c) in _TIMES.items()},
                f, indent=1, sort_keys=True)
  n = config.getoption("durations", None)
  if n is None or n < 0:
    return
  n = n or len(_TIMES)                  # --durations=0: all of them, as pytest's own list
  wall, cpu = (sum(t[i] for t in _TIMES.values()) for i in (0, 1))
  terminalreporter.write_sep("=", f"slowest {n} by CPU time (set-up + call + teardown; "
                                  f"all {len(_TIMES)} tests: {cpu:.0f} s CPU, {wall:.0f} s wall)")
  for node, (w, c) in sorted(_TIMES.items(), key=lambda kv: -kv[1][1])[:n]:
    terminalreporter.write_line(f"{c:7.2f}s cpu {w:7.2f}s wall  {node}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if call.when != "call" or not report.passed or TIME_LIMIT_S <= 0:
    return
  wall, cpu = dict(item.user_properties).get("time_s", (0.0, 0.0))
  if min(wall, cpu) <= TIME_LIMIT_S:
    return
  base = item.nodeid.split("[")[0].split("@")[0]
  if base in ALLOWED_LONG and item.get_closest_marker("slow") is not None:
    return
  report.outcome = "failed"
  report.longrepr = (
      f"{item.nodeid} took {wall:.0f} s (wall) and {cpu:.0f} s (CPU, with the processes under "
      f"it), over the {TIME_LIMIT_S:g} s budget of one test (tests/conftest.py). Move "
      "its checks to a cheaper program, or mark it slow and list it with its reason in "
      "docs/testing.md.")


def _has_gpu() -> bool:
  """Whether jax sees a GPU: asked where tests are collected (it starts jax's backends)."""
  import jax
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


def pytest_collection_finish(session):
  """Python's cyclic garbage collector, set for a process that runs tests: what the imports and
  the collection made (jax's, numpy's, the test modules') is frozen out of its walks, and it runs
  every 10,000 allocations of container objects instead of every 700. No program or result
  changes, only how soon cyclic garbage is freed. Measured with gc.callbacks in one pytest
  process (docs/testing.md, fourteenth round): the collector took 4-7 % of its CPU (2.0 of 29.9 s
  over test_step_planner.py and test_vma.py), and 0.66 s with these settings."""
  del session
  gc.collect()
  gc.freeze()
  gc.set_threshold(10_000, 10, 10)


@pytest.hookimpl(tryfirst=True)      # before pytest-xdist reads the groups (its hook tags node ids)
def pytest_collection_modifyitems(config, items):
  del config
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible to jax here "
                              "(run on the GPU machine with scripts/gpu_check.sh)")
  # not keywords: a checkout in a directory named gpu would match. jax is asked only where a gpu
  # test was collected (a run of other tests, e.g. tests/test_conftest.py's inner run, never
  # imports it here: about 1.5 s of CPU a process).
  gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
  if gpu_tests and not _has_gpu():
    for item in gpu_tests:
      item.add_marker(skip_gpu)
  for item in items:
    if item.get_closest_marker("multiprocess") is not None:
      item.add_marker(PROCS)
  if os.environ.get("PYTEST_XDIST_WORKER"):
    # Longest first: xdist hands out tests in collection order, so a slow test collected last
    # (tests/test_wheel.py) would leave the other worker idle at the end. Stable: otherwise as
    # collected.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def cpu_devices():
  import jax
  devs = jax.devices("cpu")
  assert len(devs) >= 8, f"tests need 8 simulated CPU devices, found {len(devs)}"
  return devs[:8]
