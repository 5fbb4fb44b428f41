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
