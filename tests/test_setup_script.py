"""scripts/setup.sh, run again with everything in place (as scripts/test.sh does before every
run), does nothing: no pip, no apt, no build, so it needs no network."""

import os
import pathlib
import subprocess
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_setup_does_nothing_when_everything_is_in_place(tmp_path):
  stamp = ROOT / ".venv" / ".dtenjax-setup-done"
  assert stamp.exists(), "scripts/setup.sh did not finish here (no stamp)"
  before = stamp.stat().st_mtime_ns
  # Any pip or apt-get call fails: they are shadowed by failing commands, and pip's index is an
  # address nothing listens on.
  fake = tmp_path / "bin"
  fake.mkdir()
  for tool in ("apt-get", "pip", "pip3"):
    (fake / tool).write_text("#!/bin/sh\necho \"$0 called\" >&2\nexit 97\n")
    (fake / tool).chmod(0o755)
  pip_log = tmp_path / "pip.log"           # written by any `python -m pip` run (PIP_LOG)
  env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}", PIP_LOG=str(pip_log),
             PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="",
             PIP_FIND_LINKS="", PIP_NO_INDEX="1")
  t0 = time.monotonic()
  r = subprocess.run(["bash", "scripts/setup.sh"], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300, check=False)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.splitlines() == [r.stdout.strip()] and r.stdout.startswith("dtenjax 0.1.0 |")
  assert "called" not in r.stderr and "rebuilding" not in r.stdout
  assert not pip_log.exists(), pip_log.read_text()[-2000:]
  assert stamp.stat().st_mtime_ns == before
  assert time.monotonic() - t0 < 120


def _fake_python(tmp_path, *, ensurepip: bool, headers: bool) -> pathlib.Path:
  """A python3 that behaves like Debian's without python3-venv (no ensurepip) and without
  python3-dev (no Python.h): the two set-up needs a bare image lacks."""
  real = subprocess.run(["python3", "-c", "import sys; print(sys.executable)"], capture_output=True,
                        text=True, check=True).stdout.strip()
  include = tmp_path / "include"
  include.mkdir(exist_ok=True)
  if headers:
    (include / "Python.h").write_text("")
  code = ("import sys, sysconfig; paths = sysconfig.get_paths; "
          f"sysconfig.get_paths = lambda *a, **k: {{**paths(*a, **k), 'include': {str(include)!r}}}; "
          + ("" if ensurepip else "sys.modules['ensurepip'] = None; "))
  fake = tmp_path / "python3"
  fake.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then shift; exec {real} -c \"{code}$1\" \"$@\"; fi\n"
                  f"exec {real} \"$@\"\n")
  fake.chmod(0o755)
  return fake


def test_setup_names_the_system_packages_a_bare_debian_lacks(tmp_path):
  """--check-system reports python3-venv, python3-dev and g++ when they are missing, with the
  command that installs them, and passes when they are there (it never installs anything)."""
  base = dict(os.environ, PATH=os.environ["PATH"])
  bare = dict(base, PYTHON=str(_fake_python(tmp_path, ensurepip=False, headers=False)),
              CXX="no-such-compiler")
  r = subprocess.run(["bash", "scripts/setup.sh", "--check-system"], cwd=ROOT, env=bare,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 1, r.stdout + r.stderr
  assert "missing system packages: python3-venv python3-dev g++;" in r.stderr
  assert "apt-get install -y python3-venv python3-dev g++" in r.stderr
  ready = dict(base, PYTHON=str(_fake_python(tmp_path, ensurepip=True, headers=True)))
  r = subprocess.run(["bash", "scripts/setup.sh", "--check-system"], cwd=ROOT, env=ready,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0 and "has what the set-up needs" in r.stdout, r.stdout + r.stderr
  r = subprocess.run(["bash", "scripts/setup.sh", "--bogus"], cwd=ROOT, capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def test_the_demo_command_sets_up_only_the_demo_extra():
  demo = (ROOT / "scripts" / "demo.sh").read_text()
  assert "bash scripts/setup.sh demo" in demo
  assert "[test]" not in demo
