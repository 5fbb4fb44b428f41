import json
import os

import jax
import pytest

from dtenjax import __main__ as cli
from dtenjax._src.cli import demo
from procs import run_at_once
from tests.mp_workers import launch


def test_demo_trains_places_explains_and_is_bit_identical(capsys):
  # this process's backend starts before the demo could leave out FMAs: the first line says so
  # (started here: a pytest process starts jax only where a test needs it, so in a narrow run of
  # this file nothing before this test had)
  jax.devices()
  assert demo.main(["--steps", "60", "--no-progress"]) == 0
  out = capsys.readouterr().out
  first = out.splitlines()[0]
  assert first.startswith("dtenjax demo: 8 cpu device(s)"), first
  assert "across device counts to float32 rounding only" in first and "--xla_cpu_max_isa" in first
  assert "losses sha256 " in out
  assert "== plan: Placement(strategy='auto')" in out
  rows = {line.split()[0] for line in out.splitlines() if line.split()}
  assert {"w0", "w1", "w2", "b0"} <= rows             # the plan's table: one row per parameter
  assert "== explain(train_step) ==" in out and "total predicted communication" in out
  assert "losses bit-identical across runs: True" in out
  loss_line = next(l for l in out.splitlines() if l.startswith("loss "))
  first, last = (float(v) for v in loss_line.split(";")[0][5:].split(" -> "))
  assert last < 0.5 * first          # it actually trains


def test_cli_info_and_unknown(capsys):
  import jaxlib
  import platform
  import dtenjax
  assert cli.main(["info", "--json"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert {"built", "cuda", "verbs", "targets"} <= set(info["extension"])
  assert set(info["extras"]) == {"gpu", "demo", "plot", "rdma", "flax", "scheduler", "checkpoint",
                                 "gds", "test"}
  assert info["extras"]["demo"] == {"sklearn": True, "optax": True}     # the test extra has them
  v = info["versions"]
  assert (v["dtenjax"], v["jax"], v["jaxlib"], v["python"]) == (
      dtenjax.__version__, jax.__version__, jaxlib.__version__, platform.python_version())
  assert info["devices"]["count"] == len(jax.devices())
  assert cli.main(["info"]) == 0
  text = capsys.readouterr().out
  lines = text.splitlines()
  assert lines[0].split() == ["version", "value"]
  assert lines[1].split()[:2] == ["dtenjax", dtenjax.__version__]
  assert ["jax", jax.__version__] in [ln.split() for ln in lines]
  assert any(ln.split()[:2] == ["python", platform.python_version()] for ln in lines)
  assert any(ln.split()[:3] == ["devices", str(len(jax.devices())), jax.default_backend()]
             for ln in lines)
  assert any(ln.split()[:4] == ["demo", "sklearn,", "optax", "yes"] for ln in lines)
  assert "(" + "'" not in text                        # no Python tuple reprs
  for argv in ([], ["no-such-command"]):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == 2
  assert "required: COMMAND" in capsys.readouterr().err
  assert cli.main(["bench", "no-such-bench"]) == 2
  assert "no benchmark 'no-such-bench'" in capsys.readouterr().err


def test_info_json_to_a_file_and_an_unwritable_one(tmp_path, capsys):
  out = tmp_path / "info.json"
  assert cli.main(["info", "--json", str(out)]) == 0
  assert capsys.readouterr().out.splitlines()[0].split() == ["version", "value"]   # table too
  assert json.loads(out.read_text())["versions"]["dtenjax"]
  assert cli.main(["info", "--json", str(tmp_path / "no-such-dir" / "info.json")]) == 1
  err = capsys.readouterr().err
  assert err.startswith("python -m dtenjax info: error: --json ") and "cannot write it" in err
  assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--steps", "0"], "argument --steps: 0 is less than 1"),
    (["--steps", "many"], "argument --steps: 'many' is not a whole number"),
    (["--batch", "3"], "argument --batch: 3 does not split into 8 equal micro-batches"),
    (["--batch", "0"], "argument --batch: 0 is less than 1"),
    (["--seed", "-1"], "argument --seed: -1 is less than 0"),
])
def test_demo_bad_arguments_are_one_line_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["demo", *argv])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert err.splitlines()[-1].startswith(f"python -m dtenjax demo: error: {message}")
  assert "Traceback" not in err


def _forked(argv: list[str], xla_flags: str | None, timeout: float) -> str:
  """``python ARGV`` with ``XLA_FLAGS`` (None: unset) -> its stdout (asserting exit status 0),
  forked from the session's fork servers (tests/conftest.py: jax and dtenjax imported, no
  backend started, so the process still starts XLA with its own flags), which saves each run
  the 1.3 s of CPU of importing jax; a process of its own where they cannot fork it."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", PYTHONPATH=launch.pythonpath())
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  return run_at_once({"run": (argv, env)}, timeout, launch.fork_servers([env]))["run"]


def test_python_dash_m_runs_on_8_simulated_devices():
  """Without XLA_FLAGS the command line gives itself 8 simulated CPU devices (cli/main.py),
  shown by the cheapest command that reports them; tests/test_wheel.py runs the demo itself
  that way from an installed wheel."""
  devices = json.loads(_forked(["-m", "dtenjax", "info", "--json"], None, 240))["devices"]
  assert (devices["backend"], devices["count"]) == ("cpu", 8), devices
  assert "--xla_force_host_platform_device_count=8" in devices["xla_flags"]


_DEVICE_COUNTS_SCRIPT = """
import sys
from dtenjax._src.cli import demo
demo.start_without_fma()                  # what `dtenjax demo` does before JAX starts
import jax
from dtenjax._src.planning import mesh as mesh_lib
from dtenjax._src.planning.placement import Placement
same, line = demo.same_bits_across_device_counts(jax.default_backend())
print("promise", same, line)
data = demo.load_digits(0)
for n in (1, 2, 4, 8):
  mesh = mesh_lib.make_mesh(demo.mesh_shape_for(n), ("data", "model"), devices=jax.devices()[:n])
  _, losses, _, _ = demo.train(int(sys.argv[1]), 128, Placement(strategy="auto", mesh=mesh), data,
                               0, progress=False)
  print("losses", n, mesh.size, demo.losses_digest(losses), float(losses[0]), float(losses[-1]))
"""


def test_demo_losses_are_bit_identical_on_1_2_4_and_8_devices():
  """The demo's headline, as `dtenjax demo` runs it: a process of its own whose XLA starts fresh
  (``_forked``; XLA_FLAGS naming only the device count) in which the demo starts XLA:CPU without
  FMA and compiles its step with reproducible_step's pins trains the same batches on meshes of 1, 2, 4 and 8 of its devices
  (shaped as the demo shapes them, parameters auto-placed on each) and gets the same losses, bit
  for bit; its first line promises exactly that."""
  lines = _forked(["-c", _DEVICE_COUNTS_SCRIPT, "5"], "--xla_force_host_platform_device_count=8",
                  400).splitlines()
  assert lines[0].startswith("promise True losses bit-identical on 1, 2, 4 and 8 devices"), lines
  runs = [ln.split() for ln in lines if ln.startswith("losses ")]
  assert [(int(n), int(size)) for _, n, size, *_ in runs] == [(1, 1), (2, 2), (4, 4), (8, 8)]
  assert len({digest for _, _, _, digest, _, _ in runs}) == 1, runs
  assert all(float(last) < float(first) for *_, first, last in runs), runs    # it trains


def test_demo_without_its_extra_says_how_to_install_it(monkeypatch, capsys):
  from dtenjax._src.cli import info
  real = info._present
  monkeypatch.setattr(info, "_present", lambda m: m != "optax" and real(m))
  assert cli.main(["demo", "--steps", "1"]) == 1       # not a usage error: a missing package
  err = capsys.readouterr().err
  assert err == ("python -m dtenjax demo: error: demo needs optax, which is "
                 "not installed: pip install 'dtenjax[demo]' (from a checkout: pip install "
                 "'.[demo]').\n")


def test_demo_init_gives_jax_randoms_values_for_the_shapes_bit_for_bit():
  """``demo.init_params`` draws each weight flat and reshapes it (XLA:CPU compiles the demo's
  (256, 10) draw 7x slower than the flat one); the weights must stay what
  ``jax.random.normal(sub, (a, b))`` gives, times the He scale: the demo's digests start there.
  Small sizes with the same odd minor dimensions (10, 3) as the demo's last layer."""
  import jax.numpy as jnp
  import numpy as np
  sizes, key = (6, 10, 3), jax.random.key(1)
  got = demo.init_params(key, sizes)
  assert sorted(got) == ["b0", "b1", "w0", "w1"]
  for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
    key, sub = jax.random.split(key)
    want = jax.random.normal(sub, (a, b), jnp.float32) * np.float32(np.sqrt(2.0 / a))
    assert np.asarray(got[f"w{i}"]).tobytes() == np.asarray(want).tobytes(), i
    assert got[f"b{i}"].shape == (b,) and not np.asarray(got[f"b{i}"]).any()
