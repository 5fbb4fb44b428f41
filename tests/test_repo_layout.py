"""The repository root holds what the layout lists and nothing else: a stray file (``=0.10``
from an unquoted ``pip install jax>=0.10``, a scratch script, a build output that .gitignore
misses) fails here before it is committed."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Every name allowed at the top of the repository, and why it is there. A new root file is a
# deliberate change: add it here (and to CONTRIBUTING.md's layout) in the same commit.
LAYOUT = {
    ".ci": "the CI entry point (runs scripts/test.sh)",
    ".gitignore": "build outputs, virtual environments, dist/",
    "CHANGELOG.md": "what changed, per release",
    "CMakeLists.txt": "the native extension's build",
    "CONTRIBUTING.md": "how to set up, test and add to dtenjax",
    "LICENSE": "Apache-2.0",
    "README.md": "the first page",
    "SECURITY.md": "the transport's threat model and how to report a vulnerability",
    "bench": "benchmark scripts",
    "csrc": "native code without XLA headers",
    "custom_calls": "XLA FFI handlers and Python bindings",
    "docs": "user documentation",
    "dtenjax": "the package",
    "examples": "short runnable scripts",
    "pyproject.toml": "the package's metadata, extras and tool configuration",
    "scripts": "set-up, test, demo and GPU-check scripts",
    "tests": "the test suite",
}


def _root_entries() -> set[str]:
  """Top-level names git tracks or would track (tracked plus untracked files .gitignore does not
  ignore): what a `git add -A` would commit."""
  out = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
      capture_output=True, text=True, timeout=60, check=True).stdout
  return {p.split("/", 1)[0] for p in out.split("\0") if p}


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout (an unpacked sdist has no root to police)")
def test_the_root_holds_only_what_the_layout_lists():
  deleted = set(subprocess.run(["git", "ls-files", "--deleted", "-z"], cwd=ROOT, capture_output=True,
                               text=True, timeout=60, check=True).stdout.split("\0")) - {""}
  present = {name for name in _root_entries() if name not in deleted and (ROOT / name).exists()}
  unlisted = sorted(present - set(LAYOUT))
  assert not unlisted, (
      f"files at the repository root that the layout does not list: {unlisted}; move them "
      "into a directory, delete them, ignore them in .gitignore (build outputs), or add them to "
      "LAYOUT in tests/test_repo_layout.py with the reason they belong at the root")


def test_build_outputs_are_ignored():
  """README's wheel command writes dist/; setup writes .venv/ and build/: none may show up as
  files to commit."""
  ignored = subprocess.run(["git", "check-ignore", "--no-index", "dist/x.whl", ".venv/x",
                            "build/x", "dtenjax/_ffi.so"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
  assert ignored.stdout.split() == ["dist/x.whl", ".venv/x", "build/x", "dtenjax/_ffi.so"], \
      ignored.stdout
