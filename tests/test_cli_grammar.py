"""One grammar for every command: the same mistake gives the same exit status and the same
one-line message whichever command it is made in (a table of commands x mistakes), ``--json``
where the docs promise it, and help texts that name only options that exist."""

import json
import re
import textwrap

import pytest

from dtenjax._src.cli import main as cli

STEP = textwrap.dedent("""
    import jax, jax.numpy as jnp

    def step(p, x):
      return jnp.sum(jnp.tanh(x @ p["w"]))

    def example():
      return ({"w": jax.ShapeDtypeStruct((32, 32), jnp.float32)},
              jax.ShapeDtypeStruct((16, 32), jnp.float32))
""")

# The commands' own arguments before the mistake (a valid step where the command needs one),
# and after it (launch's SCRIPT comes last).
BASE = {
    "demo": ["demo"],
    "topo": ["topo"],
    "explain": ["explain", "gstep:step", "--args", "gstep:example"],
    "plan": ["plan", "gstep:step", "--args", "gstep:example"],
    "bench": ["bench"],
    "info": ["info"],
    "launch": ["launch", "--nprocs", "2"],
}
TAIL = {"launch": ["train.py"]}
NOWHERE = "/nonexistent-dir/out.json"
FLAG = "FLAG"      # a mistake made with each command's own flag reads the same but for its name

# mistake -> (the arguments that make it, per command, exit status, what the one error line says
# after "PROG COMMAND: error: "; identical in every command, with FLAG standing for the flag)
MISTAKES = {
    "unknown option": ({c: ["--no-such-option"] for c in BASE}, 2,
                       "unrecognized arguments: --no-such-option"),
    "unknown fixture": ({c: ["--fixture", "nosuch"] for c in ("topo", "explain", "plan")}, 2,
                        "--fixture 'nosuch': no shipped topology has that name; choose one of "
                        "dgx_a100_8, "),
    "mesh larger than the devices": ({c: ["--mesh", "data=16"] for c in ("topo", "explain", "plan")},
                                     2,
                                     "--mesh 'data=16': the mesh needs 16 devices; this machine "
                                     "has 8"),
    "mesh not NAME=SIZE": ({c: ["--mesh", "data=x"] for c in ("topo", "explain", "plan")}, 2,
                           "--mesh 'data=x': write it as NAME=SIZE,... (e.g. data=2,model=4): "
                           "'data=x' is not NAME=SIZE"),
    "--draw to a format it cannot write": ({c: ["--draw", "mesh.jpg"] for c in ("topo", "plan")},
                                           2, "--draw 'mesh.jpg': name a .png, .svg, .pdf file"),
    "unwritable --json": ({c: ["--json", NOWHERE] for c in ("topo", "explain", "plan", "info")}, 1,
                          f"--json '{NOWHERE}': cannot write it (No such file or directory); "
                          "give a path in a directory you can write to."),
    "--args not MODULE:FUNCTION": ({c: ["--args", "gstep"] for c in ("explain", "plan")}, 2,
                                   "--args 'gstep' is not MODULE:FUNCTION"),
    "--args naming nothing": ({c: ["--args", "gstep:nosuch"] for c in ("explain", "plan")}, 2,
                              "--args 'gstep:nosuch': module 'gstep' has no attribute 'nosuch'"),
    "a count that is not a whole number": (
        {"demo": ["--steps", "x"], "launch": ["--nprocs", "x"]}, 2,
        f"argument {FLAG}: 'x' is not a whole number"),
    "a count below its minimum": (
        {"demo": ["--steps", "0"], "launch": ["--cpu-devices-per-proc", "0"]}, 2,
        f"argument {FLAG}: 0 is less than 1"),
    "an amount that is not a number": (
        {"plan": ["--budget-gib", "x"], "launch": ["--timeout", "x"]}, 2,
        f"argument {FLAG}: 'x' is not a number"),
    "an amount at or below its floor": (
        {"plan": ["--budget-gib", "0"], "launch": ["--timeout", "0"]}, 2,
        f"argument {FLAG}: 0 is not more than 0"),
}


@pytest.fixture()
def step_dir(tmp_path, monkeypatch):
  (tmp_path / "gstep.py").write_text(STEP)
  (tmp_path / "train.py").write_text("raise SystemExit('launched: a mistake went unnoticed')\n")
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  return tmp_path


def _run(argv, capsys):
  try:
    rc = cli.main(argv, prog="dtenjax")
  except SystemExit as e:            # argparse's usage errors
    rc = e.code
  out, err = capsys.readouterr()
  assert "Traceback" not in err, err
  return rc, out, err


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_the_same_mistake_reads_the_same_in_every_command(mistake, step_dir, capsys):
  made, code, message = MISTAKES[mistake]
  seen = {}
  for command, extra in made.items():
    rc, _, err = _run(BASE[command] + extra + TAIL.get(command, []), capsys)
    lines = err.strip().splitlines()
    prefix = f"dtenjax {command}: error: "
    assert rc == code, (command, rc, err)
    assert lines and lines[-1].startswith(prefix), (command, err)
    # one line of message (argparse's own errors put its usage, a line or a few, above it)
    assert len(lines) == 1 or lines[0].startswith("usage: "), (command, err)
    seen[command] = lines[-1].removeprefix(prefix)
    if FLAG in message:
      seen[command] = seen[command].replace(f"argument {extra[0]}:", f"argument {FLAG}:", 1)
    assert seen[command].startswith(message), (command, seen[command])
  assert len(set(seen.values())) == 1, seen


def test_every_command_is_in_the_table():
  assert set(BASE) == set(cli.COMMANDS)
  assert {c for made, _, _ in MISTAKES.values() for c in made} == set(BASE)


def test_json_is_json_in_every_command_that_offers_it(step_dir, capsys):
  for command, key in (("topo", "devices"), ("info", None), ("plan", "leaves"),
                       ("explain", None)):
    rc, out, err = _run(BASE[command] + ["--json"], capsys)
    assert rc == 0, (command, err)
    data = json.loads(out)                      # nothing but JSON on stdout
    assert isinstance(data, dict) and data, command
    if key:
      assert key in data, (command, sorted(data))
    rc, out, _ = _run(BASE[command] + ["--json", str(step_dir / f"{command}.json")], capsys)
    assert rc == 0 and json.loads((step_dir / f"{command}.json").read_text()) == data, command
  plan = json.loads((step_dir / "plan.json").read_text())
  assert plan["mesh"] and all(leaf["spec"] for leaf in plan["leaves"])


def test_help_texts_name_only_options_and_commands_that_exist(capsys):
  parser = cli.build_parser("dtenjax")
  subparsers = next(a for a in parser._actions if a.choices and "topo" in a.choices)
  options = {name: {o for a in p._actions for o in a.option_strings}
             for name, p in subparsers.choices.items()}
  texts = [parser.format_help()] + [p.format_help() for p in subparsers.choices.values()]
  named = [(c, f) for t in texts for c, f in re.findall(r"dtenjax ([a-z]+) (--[\w-]+)",
                                                        " ".join(t.split()))]
  assert ("topo", "--list-fixtures") in named                # plan's and explain's --fixture
  for command, flag in named:
    assert command in options and flag in options[command], (command, flag)
  rc, out, _ = _run(["topo", "--list-fixtures"], capsys)
  assert rc == 0 and "dgx_a100_8" in out.split() and "h100_16" in out.split()


# `dtenjax CMD ... --flag` (or `python -m dtenjax CMD ...`) inside one code span or table cell
DOC_COMMAND = re.compile(r"(?:dtenjax|python -m dtenjax) (demo|topo|explain|plan|info|launch)"
                         r"((?: [^`|;,)]*?)?)(?=`|\||;|\)|$)")


def _doc_commands(text: str) -> list[tuple[str, str]]:
  """(command, flag) for every option the text writes after a dtenjax command."""
  text = " ".join(text.split())
  return [(m.group(1), flag) for m in DOC_COMMAND.finditer(text)
          for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2))]


def test_the_docs_name_only_options_that_exist():
  """What README, CONTRIBUTING and docs/ tell a user to type: every `dtenjax CMD --flag` they
  write is an option of that command (bench's ARGS are the bench's own, not checked here)."""
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[1]
  parser = cli.build_parser("dtenjax")
  subparsers = next(a for a in parser._actions if a.choices and "topo" in a.choices)
  options = {name: {o for a in p._actions for o in a.option_strings}
             for name, p in subparsers.choices.items()}
  assert _doc_commands("run `dtenjax topo --fixture x --no-such-flag` | `python -m dtenjax plan "
                       "m:s --json`") == [("topo", "--fixture"), ("topo", "--no-such-flag"),
                                          ("plan", "--json")]
  pages = [root / "README.md", root / "CONTRIBUTING.md"] + sorted((root / "docs").glob("*.md"))
  found = [(p.name, c, f) for p in pages for c, f in _doc_commands(p.read_text())]
  assert len(found) > 20                                     # the pages do name options
  wrong = [x for x in found if x[2] not in options[x[1]] | {"--help"}]
  assert not wrong, wrong


def test_topo_and_plan_draw_the_mesh_over_the_topology(step_dir, capsys):
  pytest.importorskip("matplotlib", reason="the plot extra (in the test extra)")
  rc, out, err = _run(["topo", "--fixture", "roce_a100_4x8", "--draw", "topo.svg"], capsys)
  assert rc == 0, err
  svg = (step_dir / "topo.svg").read_text()
  assert "roce_a100_4x8: 32 devices, 4 host(s)" in svg
  for label in ("nvlink: 300 GB/s", "roce: 12.5 GB/s"):        # the fixture's link classes
    assert label in svg, label
  rc, out, err = _run(BASE["plan"] + ["--fixture", "h100_16", "--draw", "plan.svg"], capsys)
  assert rc == 0, err
  svg = (step_dir / "plan.svg").read_text()
  plan = json.loads(_run(BASE["plan"] + ["--fixture", "h100_16", "--json"], capsys)[1])
  # Each axis of the mesh with the link it runs over: the slowest link class between devices
  # of one of its groups, worked out from the fixture's own link matrix.
  import numpy as np
  from dtenjax._src.topology.model import Topology
  topo = Topology.fixture("h100_16")
  ids = np.asarray(plan["device_ids"]).reshape(tuple(plan["mesh"].values()))
  links = {a["name"]: a["link"] for a in plan["axes"]}
  assert set(links) == {axis for axis, size in plan["mesh"].items() if size > 1}, plan["axes"]
  spans_hosts = False
  for k, (axis, size) in enumerate(plan["mesh"].items()):
    if size == 1:
      continue
    group = [int(d) for d in np.moveaxis(ids, k, -1).reshape(-1, size)[0]]
    classes = {topo.link_class(a, b) for a in group for b in group if a != b}
    slowest = min(classes, key=lambda c: topo.spec(c).bandwidth_gbps)
    assert links[axis] == slowest, (axis, links[axis], classes)
    assert f"{axis} ({size}): {slowest} " in svg, axis
    spans_hosts |= len({h for h, members in enumerate(topo.hosts()) for d in group
                        if d in members}) > 1
  assert spans_hosts                    # one axis crosses the two hosts' links
  # the labels name the axes that shape the grid, not the planner's axes of size 1
  for axis, size in plan["mesh"].items():
    assert (f"{axis} ({size})" in svg) if size > 1 else (axis not in svg), (axis, size)
  assert "host 1" in svg                                       # 16 devices over two hosts


def test_topo_shows_and_draws_which_links_each_mesh_axis_runs_over(step_dir, capsys):
  """roce_a100_4x8 is 4 hosts of 8 A100s: NVLink (300 GB/s) inside a host, RoCE (12.5 GB/s)
  between hosts. topology_mesh's order keeps the inner axis inside a host, so the axis of 8
  runs over NVLink and the one of 4 over RoCE; with the sizes swapped the inner axis of 4 is
  still inside a host and the outer one of 8 crosses hosts."""
  pytest.importorskip("matplotlib", reason="the plot extra (in the test extra)")
  for mesh, want in (("data=4,model=8", {"data": "roce", "model": "nvlink"}),
                     ("model=8,data=4", {"model": "roce", "data": "nvlink"})):
    rc, out, err = _run(["topo", "--fixture", "roce_a100_4x8", "--mesh", mesh, "--draw",
                         "mesh.svg"], capsys)
    assert rc == 0, err
    rows = {line.split()[0]: line.split() for line in out.splitlines()[-2:]}
    assert {a: r[2] for a, r in rows.items()} == want, out
    svg = (step_dir / "mesh.svg").read_text()
    for axis, link in want.items():
      size = mesh.split(axis + "=")[1].split(",")[0]
      gbps = {"nvlink": "300", "roce": "12.5"}[link]
      assert rows[axis][1] == size and rows[axis][3] == gbps, out
      assert f"{axis} ({size}): {link}, {gbps} GB/s" in svg, axis
    assert "host 3" in svg
  rc, _, err = _run(["topo", "--fixture", "roce_a100_4x8", "--mesh", "data=4"], capsys)
  assert rc == 2 and "a mesh spans every device; the fixture 'roce_a100_4x8' has 32" in err


def test_long_steps_show_a_spinner_on_a_terminal_and_nothing_in_a_log(step_dir, capsys,
                                                                      monkeypatch):
  """plan and explain trace and compile the user's step (seconds): on a terminal a spinner on
  stderr says what runs; in a log or a pipe (as in every other test here) nothing; stdout, the
  table or the JSON, is the same either way."""
  import io
  import sys

  class Terminal(io.StringIO):
    def isatty(self):
      return True
  rc, quiet_out, quiet_err = _run(BASE["plan"] + ["--json"], capsys)
  assert rc == 0 and quiet_err == ""
  for command, says in (("plan", "planning gstep:step"), ("explain", "compiling gstep:step")):
    term = Terminal()
    with monkeypatch.context() as m:
      m.setattr(sys, "stderr", term)
      rc, out, _ = _run(BASE[command] + ["--json"], capsys)
    assert rc == 0, command
    if command == "plan":
      assert json.loads(out)["leaves"] == json.loads(quiet_out)["leaves"]
    assert json.loads(out), command                     # stdout: only the JSON
    assert says in term.getvalue() and "\x1b[" in term.getvalue(), (command, term.getvalue())
