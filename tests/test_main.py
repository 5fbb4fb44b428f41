import json
import os

import pytest

import procs
from dtenjax import __main__ as cli
from dtenjax._src.cli import demo


def test_demo_trains_places_explains_and_is_bit_identical(capsys):
  assert demo.main(["--steps", "60", "--no-progress"]) == 0
  out = capsys.readouterr().out
  assert "losses sha256 " in out
  assert "== plan: Placement(strategy='auto')" in out
  for name in ("w0", "w1", "w2", "b0"):
    assert f"  {name} " in out
  assert "== explain(train_step) ==" in out and "total predicted communication" in out
  assert "losses bit-identical across runs: True" in out
  loss_line = next(l for l in out.splitlines() if l.startswith("loss "))
  first, last = (float(v) for v in loss_line.split(";")[0][5:].split(" -> "))
  assert last < 0.5 * first          # it actually trains


def test_cli_info_and_unknown(capsys):
  assert cli.main(["info", "--json"]) == 0
  info = json.loads(capsys.readouterr().out)
  assert {"built", "cuda", "verbs", "targets"} <= set(info["extension"])
  assert set(info["extras"]) == {"gpu", "demo", "plot", "rdma", "flax", "scheduler"}
  assert info["extras"]["demo"] == {"sklearn": True, "optax": True}     # the test extra has them
  assert cli.main(["info"]) == 0
  text = capsys.readouterr().out
  assert text.splitlines()[0].split() == ["extension", "value"]
  assert any(ln.split()[:4] == ["demo", "sklearn,", "optax", "yes"] for ln in text.splitlines())
  for argv in ([], ["no-such-command"]):
    with pytest.raises(SystemExit) as e:
      cli.main(argv)
    assert e.value.code == 2
  assert "required: COMMAND" in capsys.readouterr().err
  assert cli.main(["bench", "no-such-bench"]) == 2
  assert "no benchmark 'no-such-bench'" in capsys.readouterr().err


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


def _demos_in_subprocesses(counts, steps: int = 12) -> dict:
  """{devices: stdout} of ``python -m dtenjax demo`` in a fresh process per device count (None:
  no XLA_FLAGS, the CLI's own 8 simulated devices), all started at once."""
  runs = {}
  for devices in counts:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices is not None:
      env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    runs[devices] = (["-m", "dtenjax", "demo", "--steps", str(steps), "--no-progress"], env)
  outs = procs.run_at_once(runs, timeout=280)
  for stdout in outs.values():
    assert "bit-identical across runs: True" in stdout
  return outs


def _digest(out: str) -> str:
  return next(l for l in out.splitlines() if l.startswith("losses sha256 ")).split()[2]


# The demo once per device count for the two tests below (three processes).
@pytest.fixture(scope="module")
def demo_runs():
  return _demos_in_subprocesses((None, 2, 4))


@pytest.mark.slow
@procs.PROCS
def test_python_dash_m_runs_on_8_simulated_devices(demo_runs):
  assert "8 cpu device(s)" in demo_runs[None]


@pytest.mark.slow
@procs.PROCS
def test_demo_losses_are_bit_identical_across_device_counts(demo_runs):
  """The demo's step all-reduces its gradients with dtenjax (reproducible=True): the losses of
  the same run on 2, 4 and 8 simulated devices have the same bits."""
  outs = {2: demo_runs[2], 4: demo_runs[4], 8: demo_runs[None]}
  for n, out in outs.items():
    assert f"{n} cpu device(s)" in out
  digests = {n: _digest(out) for n, out in outs.items()}
  assert len(set(digests.values())) == 1, digests


def test_demo_without_its_extra_says_how_to_install_it(monkeypatch, capsys):
  from dtenjax._src.cli import info  # pylint: disable=g-import-not-at-top
  real = info._present  # pylint: disable=protected-access
  monkeypatch.setattr(info, "_present", lambda m: m != "optax" and real(m))
  assert cli.main(["demo", "--steps", "1"]) == 2
  err = capsys.readouterr().err
  assert err == ("python -m dtenjax demo: error: demo needs optax, which is "
                 "not installed: pip install 'dtenjax[demo]' (from a checkout: pip install "
                 "'.[demo]').\n")
