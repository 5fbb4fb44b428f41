"""``python -m dtenjax explain`` and ``bench`` through a subprocess, as a user runs them (the
``explain`` runs in processes forked from one that has imported jax: tests/procs.py's ForkServer,
``python -m dtenjax`` without paying jax's import each time; ``demo`` and the console script in
processes of their own).

The explain tests load a step the test writes (a Megatron-style MLP on a 2 x 4 mesh) and check
its rows against what the construction implies: the forward partial sums are reduced over
"model" (the mesh's rows, {0,1,2,3},{4,5,6,7}) and the gradients over "data" (its columns).
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests import compile_only, helpers
from tests.mp_workers import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]

USER_STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def grad_step(w0, b0, w1, x):
      def loss(p, x):
        h = jax.nn.relu(x @ p[0] + p[1])
        return jnp.mean((h @ p[2]) ** 2)
      return jax.grad(loss)((w0, b0, w1), x)

    def make_args():
      mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
      put = lambda shape, spec: jax.device_put(jnp.ones(shape), NamedSharding(mesh, spec))
      return (put((16, 64), P(None, "model")), put((64,), P("model")),
              put((64, 8), P("model", None)), put((32, 16), P("data")))
""")
SHAPE_ARGS = "f32[16,64]{-,model},f32[64]{model},f32[64,8]{model,-},f32[32,16]{data,-}"
ROWS = [[0, 1, 2, 3], [4, 5, 6, 7]]          # mesh rows: reduction over "model"
COLS = [[0, 4], [1, 5], [2, 6], [3, 7]]      # mesh columns: reduction over "data"


def _env():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)                 # the CLI sets 8 simulated devices itself
  env["PYTHONPATH"] = launch.pythonpath()
  return env


def _run(args, cwd, timeout=300):
  return subprocess.run([sys.executable, "-m", "dtenjax", *args], cwd=cwd, env=_env(),
                        capture_output=True, text=True, timeout=timeout, check=False)


pytestmark = helpers.one_worker(__name__)    # the session's fork servers: one worker starts them


@pytest.fixture(scope="module")
def forks(tmp_path_factory):
  with launch.one_server(_env(), tmp_path_factory.mktemp("cli_runs")) as server:
    yield server


@pytest.fixture
def run(forks):
  """``python -m dtenjax ARGS`` in a process forked from the server (``xla_flags``: its
  XLA_FLAGS, to which the command line adds its 8 devices)."""
  def run(args, cwd, timeout=300, xla_flags=None):
    env = None if xla_flags is None else dict(_env(), XLA_FLAGS=xla_flags)
    return forks.run(["-m", "dtenjax", *args], cwd=cwd, timeout=timeout, env=env)
  return run


@pytest.fixture()
def user_dir(tmp_path, monkeypatch):
  (tmp_path / "mystep.py").write_text(USER_STEP)
  # Tests that run the command line in this process import the user's modules: leave no trace.
  monkeypatch.setattr(sys, "path", list(sys.path))
  for name in ("mystep", "axes"):
    monkeypatch.delitem(sys.modules, name, raising=False)
  yield tmp_path
  for name in ("mystep", "axes"):
    sys.modules.pop(name, None)


def _check_user_rows(data):
  rows = {json.dumps(c["groups"]): c for c in data["collectives"]}
  assert set(rows) == {json.dumps(ROWS), json.dumps(COLS)}, data["collectives"]
  model, dp = rows[json.dumps(ROWS)], rows[json.dumps(COLS)]
  assert model["kind"] == dp["kind"] == "all_reduce"
  assert model["nbytes"] == (32 // 2) * 8 * 4                 # h @ w1 of the local batch
  assert dp["nbytes"] == (16 * 16 + 16 + 16 * 8) * 4          # the three local gradient shards
  assert len(dp["operand_shapes"]) == 3


def test_explain_help_is_its_own(run):
  r = run(["explain", "--help"], ROOT)
  assert r.returncode == 0, r.stderr
  assert "usage: python -m dtenjax explain" in r.stdout
  assert "--shape-args" in r.stdout and "MODULE:FUNCTION" in r.stdout
  assert "--steps" not in r.stdout          # not the demo's help


def test_explain_a_user_step_from_shape_args(user_dir, run):
  out = user_dir / "rows.json"
  r = run(["explain", "mystep:grad_step", "--mesh", "data=2,model=4", "--shape-args",
            SHAPE_ARGS, "--json", str(out)], user_dir)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "explain(mystep:grad_step) on 8 cpu device(s)" in r.stdout
  assert "{0,1,2,3},{4,5,6,7}" in r.stdout and "{0,4},{1,5},{2,6},{3,7}" in r.stdout
  assert "2 collectives" in r.stdout
  _check_user_rows(json.loads(out.read_text()))


def test_explain_a_user_step_from_a_file_and_an_args_factory(user_dir, tmp_path_factory, run):
  elsewhere = tmp_path_factory.mktemp("cwd")
  out = elsewhere / "rows.json"
  r = run(["explain", str(user_dir / "mystep.py") + ":grad_step", "--args", "mystep:make_args",
            "--json", str(out)], elsewhere)
  assert r.returncode == 0, r.stderr[-3000:]
  _check_user_rows(json.loads(out.read_text()))


def test_explain_errors_name_the_bad_value_and_exit_2(user_dir, capsys, monkeypatch):
  """In this process (the command line's own parsing and loading; the subprocess tests above
  run it as users start it)."""
  rc, err = _main(["explain", "nosuchmodule:f"], capsys, user_dir, monkeypatch)
  assert rc == 2 and "no module 'nosuchmodule'" in err
  rc, err = _main(["explain", "mystep:nosuchfn"], capsys)
  assert rc == 2 and "'nosuchfn'" in err and "grad_step" in err
  rc, err = _main(["explain", "mystep:grad_step", "--shape-args", "f33[2],f32[3]{model}"], capsys)
  assert rc == 2
  assert "'f33' is unknown" in err and "no --mesh" in err
  rc, err = _main(["explain", "mystep:grad_step", "--mesh", "data=3,model=4"], capsys)
  assert rc == 2 and "needs 12 devices" in err


@pytest.mark.slow
def test_explain_without_a_target_lists_every_collective_of_the_demo_step(tmp_path, run):
  hlo_file, out = tmp_path / "step.hlo", tmp_path / "rows.json"
  # LLVM unoptimised (tests/compile_only.py): the claims read the optimised HLO, which XLA makes
  # before LLVM (the same text without metadata both ways), and the demo's first step runs only
  # to hand explain its arguments; the command took 5.1-5.4 s of CPU at XLA's default level,
  # 4.6-5.0 s so
  r = run(["explain", "--dump-hlo", str(hlo_file), "--json", str(out)], tmp_path,
          xla_flags=compile_only.LLVM_O0_FLAGS)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "explain(the demo's training step)" in r.stdout
  # Independent count: collective instructions in the dumped HLO text (async forms once), but
  # not those whose every replica group is one device (they move nothing between devices: the
  # all-reduce that hands a collective algorithm its run-time offsets on CPU)
  text = hlo_file.read_text()
  op = re.compile(r"\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                  r"(-start)?\(")
  alone = re.compile(r"replica_groups=\{\{\d+\}(,\{\d+\})*\}")
  n = sum(1 for line in text.splitlines()
          if " = " in line and op.search(line) and not alone.search(line))
  rows = json.loads(out.read_text())["collectives"]
  assert len([c for c in rows if not c["kind"].startswith("custom:")]) == n > 0
  assert all(c["groups"] for c in rows if not c["kind"].startswith("custom:"))


def test_bench_passes_arguments_and_exit_status_through(tmp_path, capfd):
  """``bench NAME ARGS`` from this process (the benchmark is a child process either way)."""
  from dtenjax._src.cli.main import main
  out = tmp_path / "b.json"
  assert main(["bench", "cuda_graphs", "--quick", "--cases", "loop", "--json", str(out)]) == 0
  assert {row["case"] for row in json.loads(out.read_text())["rows"]} == {"loop"}
  capfd.readouterr()
  # The refusals from bench/pipeline.py, which reads its command line before importing jax
  # (cuda_graphs imports it first: 1.2 s of CPU a refusal, for the same exit status).
  assert main(["bench", "pipeline", "--no-such-flag"]) == 2           # argparse's status
  assert "--no-such-flag" in capfd.readouterr().err
  assert main(["bench", "pipeline", "--schedules", "nosuchschedule"]) == 2
  assert "nosuchschedule" in capfd.readouterr().err                  # the bench's own check
  assert main(["bench", "no_such_bench"]) == 2
  assert "available" in capfd.readouterr().err


# --- the command line itself: help everywhere, prog, one-line errors -------------------------


COMMANDS = ("demo", "topo", "explain", "plan", "bench", "info", "launch")


def test_the_command_list_is_the_cli_s():
  from dtenjax._src.cli.main import COMMANDS as cli_commands
  assert tuple(cli_commands) == COMMANDS      # a new command gets the per-command tests below


def test_prog_names_the_way_it_was_started():
  from dtenjax._src.cli.main import prog_name
  assert prog_name("/venv/bin/dtenjax") == "dtenjax"
  assert prog_name("/src/dtenjax/__main__.py") == "python -m dtenjax"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_its_own_help(command, capsys):
  from dtenjax._src.cli.main import main
  with pytest.raises(SystemExit) as e:
    main([command, "--help"], prog="dtenjax")
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: dtenjax {command} [-h]")
  assert "{" not in out.splitlines()[0]                 # not the top-level usage
  if command == "info":
    assert "--json" in out and not out.lstrip().startswith("{")   # help, not JSON


def test_console_script_and_module_name_themselves():
  script = pathlib.Path(sys.executable).parent / "dtenjax"
  assert script.is_file(), f"{script} missing: the console script of pyproject's [project.scripts]"
  r = subprocess.run([str(script), "explain", "--help"], capture_output=True, text=True,
                     timeout=120, check=False)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: dtenjax explain ")
  r = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=120,
                     check=False)
  assert r.stdout.strip() == "dtenjax 0.1.0"
  r = _run(["demo", "--steps", "0"], ROOT)
  assert r.returncode == 2
  assert r.stderr.splitlines()[-1] == ("python -m dtenjax demo: error: argument --steps: 0 is "
                                       "less than 1")


def test_explain_absent_axis_and_indivisible_shape_are_one_line_errors(user_dir, capsys,
                                                                      monkeypatch):
  (user_dir / "axes.py").write_text(textwrap.dedent("""
      import jax
      from jax.sharding import PartitionSpec as P
      def f(x):
        return jax.lax.with_sharding_constraint(x, P("nosuch"))
  """))
  cases = [
      (["axes:f", "--mesh", "data=2,model=4", "--shape-args", "f32[8,128]"],
       "Resource axis: nosuch of P('nosuch',) is not found in mesh"),
      (["mystep:grad_step", "--mesh", "data=2,model=4", "--shape-args", "f32[7,64]{model,-}"],
       "dimension 0 of size 7 does not divide into 4 shards over model"),
      (["mystep:grad_step", "--mesh", "data=2,model=4", "--shape-args", "f32[8,64]{tensor,-}"],
       "axis ['tensor'] is not in the mesh ['data', 'model']"),
  ]
  monkeypatch.chdir(user_dir)
  for argv, message in cases:
    rc, err = _main(["explain", *argv], capsys)
    assert rc == 2, err[-2000:]
    assert message in err, err
    assert err.startswith("dtenjax explain: error: ") and err.count("\n") == 1


def test_bench_without_a_name_lists_them(capsys):
  from dtenjax._src.cli.main import main
  with pytest.raises(SystemExit) as e:
    main(["bench"], prog="dtenjax")
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "dtenjax bench: error: which benchmark? give NAME: allreduce," in err
  assert "_harness" not in err


# --- error paths of every command: one line, no traceback, 2 for usage and 1 for failures -----


def _main(argv, capsys, cwd=None, monkeypatch=None):
  """(exit status, stderr) of the command line run in this process."""
  from dtenjax._src.cli.main import main
  if cwd is not None:
    monkeypatch.chdir(cwd)
  try:
    rc = main(argv, prog="dtenjax")
  except SystemExit as e:          # argparse's usage errors
    rc = e.code
  err = capsys.readouterr().err
  assert "Traceback" not in err, err
  return rc, err


def _one_error_line(err, command):
  lines = err.splitlines()
  assert lines and lines[-1].startswith(f"dtenjax {command}: error: "), err
  return lines[-1]


FAILING_USER_CODE = textwrap.dedent("""
    import jax.numpy as jnp

    def make_args():
      return helper()

    def helper():
      raise RuntimeError("no data here")

    def step(x):
      return jnp.sum(x) / undefined_name      # NameError while traced
""")


@pytest.fixture()
def failing_dir(tmp_path):
  (tmp_path / "failing_user.py").write_text(FAILING_USER_CODE)
  (tmp_path / "broken_import.py").write_text("import json\nvalue = json.loads('{')\n")
  (tmp_path / "bad_syntax.py").write_text("def f(:\n  pass\n")
  (tmp_path / "okstep.py").write_text("import jax.numpy as jnp\ndef f(x):\n  return x * 2\n")
  return tmp_path


def test_explain_user_code_that_fails_shows_the_users_frame_and_exits_1(failing_dir, capsys,
                                                                        monkeypatch):
  path = failing_dir / "failing_user.py"
  rc, err = _main(["explain", f"{path}:step", "--args", f"{path}:make_args"], capsys,
                  failing_dir, monkeypatch)
  line = _one_error_line(err, "explain")
  assert rc == 1, err
  assert "the --args factory" in line and "RuntimeError: no data here" in line
  assert f"{path}:8 in helper" in line             # the user's innermost frame, not ours
  rc, err = _main(["explain", f"{path}:step", "--shape-args", "f32[4]"], capsys)
  line = _one_error_line(err, "explain")
  assert rc == 1 and "NameError" in line and "undefined_name" in line, err
  assert f"{path}:11 in step" in line
  broken = failing_dir / "broken_import.py"
  rc, err = _main(["explain", f"{broken}:value"], capsys)
  line = _one_error_line(err, "explain")
  assert rc == 1 and "importing" in line and "JSONDecodeError" in line
  assert f"{broken}:2 in <module>" in line
  rc, err = _main(["explain", "bad_syntax:f"], capsys, failing_dir, monkeypatch)
  line = _one_error_line(err, "explain")
  assert rc == 1 and "SyntaxError" in line and "bad_syntax.py:1" in line, err


def test_explain_unwritable_outputs_exit_1_in_one_line(failing_dir, capsys, monkeypatch):
  nowhere = failing_dir / "no-such-dir" / "out"
  for flag in ("--json", "--dump-hlo"):
    rc, err = _main(["explain", "okstep:f", "--shape-args", "f32[8]", flag, str(nowhere)],
                    capsys, failing_dir, monkeypatch)
    line = _one_error_line(err, "explain")
    assert rc == 1 and line.startswith(f"dtenjax explain: error: {flag} ") and "cannot write" in line
    assert err.count("\n") == 1


def test_explain_usage_errors_exit_2(failing_dir, capsys, monkeypatch):
  for argv, message in [
      (["explain", "okstep"], "is not MODULE:FUNCTION"),
      (["explain", "no_such_module:f"], "no module 'no_such_module'"),
      (["explain", "okstep:nope"], "has no attribute 'nope'"),
      (["explain", "okstep:f", "--shape-args", "f33[2]"], "'f33' is unknown"),
      (["explain", "okstep:f", "--mesh", "data=64"], "needs 64 devices"),
      (["explain", "--mesh", "data=2"], "name it first"),
      (["explain", "okstep:f", "--no-such-flag"], "unrecognized arguments: --no-such-flag")]:
    rc, err = _main(argv, capsys, failing_dir, monkeypatch)
    assert rc == 2 and message in _one_error_line(err, "explain"), (argv, err)


def test_explain_json_alone_prints_json_instead_of_the_table(failing_dir, capsys, monkeypatch):
  from dtenjax._src.cli.main import main
  monkeypatch.chdir(failing_dir)
  assert main(["explain", "okstep:f", "--shape-args", "f32[8]", "--json"], prog="dtenjax") == 0
  data = json.loads(capsys.readouterr().out)
  assert data["target"] == "okstep:f" and data["collectives"] == []


def test_bench_failures_pass_through_and_usage_is_2(tmp_path, capsys, monkeypatch):
  from dtenjax._src.cli import bench
  (tmp_path / "exits3.py").write_text("import sys\nprint('cannot measure here', file=sys.stderr)\n"
                                      "sys.exit(3)\n")
  monkeypatch.setattr(bench, "BENCH_DIR", tmp_path)
  from dtenjax._src.cli.main import main
  assert main(["bench", "exits3"], prog="dtenjax") == 3     # the benchmark's own status
  rc, err = _main(["bench", "nosuch"], capsys)
  assert rc == 2 and "no benchmark 'nosuch'" in _one_error_line(err, "bench")


def test_help_texts_are_plain_text(capsys):
  from dtenjax._src.cli.main import COMMANDS, main
  for command in (*COMMANDS, None):
    with pytest.raises(SystemExit):
      main([command, "--help"] if command else ["--help"], prog="dtenjax")
    out = capsys.readouterr().out
    assert not re.search(r":[a-z]+:`|``", out), (command, out)


def test_json_means_the_same_in_every_command():
  """--json [FILE]: the result as JSON to FILE, or to stdout without FILE (cli/common.py)."""
  from dtenjax._src.cli.main import build_parser
  parser = build_parser("dtenjax")
  sub = next(a for a in parser._actions if a.dest == "command")
  seen = {}
  for name, p in sub.choices.items():
    for action in p._actions:
      if "--json" in action.option_strings:
        seen[name] = (action.nargs, action.const, action.metavar)
  assert set(seen) == {"topo", "explain", "plan", "info"}, seen
  assert set(seen.values()) == {("?", "-", "FILE")}, seen


# --- --version and --help without jax -------------------------------------------------------

def test_version_and_every_help_answer_without_importing_jax(tmp_path):
  """``import dtenjax`` loads its public names on first use, and the command modules import jax
  inside the functions that run a command: ``--version`` and every ``--help`` answer with jax
  made unimportable (a ``jax`` package on PYTHONPATH that raises), as a user starts them."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([helpers.without_jax(tmp_path), str(ROOT)]))
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-m", "dtenjax", "--version"], env=env, cwd=tmp_path,
                     capture_output=True, text=True, timeout=60, check=False)
  assert (r.returncode, r.stdout, r.stderr) == (0, "dtenjax 0.1.0\n", ""), r.stderr
  script = textwrap.dedent("""
      import contextlib, io, sys
      import dtenjax
      from dtenjax.__main__ import main           # what the console script runs
      from dtenjax._src.cli.main import COMMANDS
      sys.argv[0] = "dtenjax"
      assert dtenjax.__version__ == "0.1.0" and "shard" in dir(dtenjax)
      for argv in (["--version"], ["--help"], *([c, "--help"] for c in COMMANDS)):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
          try:
            main(argv)
          except SystemExit as e:
            assert e.code == 0, (argv, e.code)
        assert out.getvalue().startswith("dtenjax 0.1.0" if argv == ["--version"]
                                         else "usage: dtenjax"), (argv, out.getvalue()[:200])
      assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib")]
      try:
        dtenjax.shard                              # the first use of a name needs jax
      except ImportError as e:
        assert "must not be imported" in str(e)
      else:
        raise AssertionError("dtenjax.shard loaded without jax")
      print("ok", len(COMMANDS))
  """)
  r = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                     capture_output=True, text=True, timeout=60, check=False)
  assert r.returncode == 0 and r.stdout.startswith("ok "), r.stdout + r.stderr[-3000:]


def test_a_long_command_prints_each_line_into_a_pipe_as_it_goes(monkeypatch):
  """The demo trains for seconds between its sections: into a pipe or a log (`bash
  scripts/demo.sh | tee log`) each line arrives when printed, not all at the end."""
  import io
  import sys
  from dtenjax._src.cli import common
  raw = io.BytesIO()
  monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="utf-8"))
  print("before")
  assert raw.getvalue() == b""                    # Python's block buffering into a non-terminal
  common.line_buffered_stdout()
  print("after")
  assert raw.getvalue() == b"before\nafter\n"
