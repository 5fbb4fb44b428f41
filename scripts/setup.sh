#!/usr/bin/env bash
# Sets up the development environment of the README's test command from scratch on a fresh
# Debian machine with Python 3.11: a virtual environment in .venv with the dependencies (the test
# extra), Debian's libibverbs-dev when we can install it (so the RDMA verbs provider compiles),
# and the native extension built into an editable install (kept in build/ for fast rebuilds).
#
# Run again, it does only what is missing, and nothing (no network, no build) when everything is
# in place: the venv exists, every requirement of pyproject.toml (dependencies, the test extra,
# the build requirements) is installed in a satisfying version, dtenjax is installed editable from
# this checkout with its extension, and no build input (pyproject.toml, CMakeLists.txt, csrc/,
# custom_calls/, this script) changed since the last successful set-up. Changed C++/CUDA alone is
# rebuilt without asking the package index.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VPY=.venv/bin/python
STAMP=.venv/.dtenjax-setup-done
BUILD_REQS=("scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2,<0.12" "jaxlib>=0.10.2,<0.12" cmake ninja)

# Exit status 0: every requirement is installed and dtenjax is this checkout's editable install.
requirements_met() {
  "$VPY" - "${BUILD_REQS[@]}" <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util, os, sys
from packaging.requirements import Requirement
reqs = [Requirement(r) for r in sys.argv[1:]]
reqs += [Requirement(r) for r in md.requires("dtenjax") or []]
for r in reqs:
    if r.marker is not None and not r.marker.evaluate({"extra": "test"}):
        continue
    try:
        have = md.version(r.name)
    except md.PackageNotFoundError:
        sys.exit(f"missing {r}")
    if have not in r.specifier:
        sys.exit(f"{r.name} {have} does not satisfy {r}")
spec = importlib.util.find_spec("dtenjax")
if spec is None or not os.path.realpath(spec.origin).startswith(os.path.realpath(".") + os.sep):
    sys.exit("dtenjax is not installed from this checkout")
if importlib.util.find_spec("dtenjax._ffi") is None:
    sys.exit("the native extension is not built")
EOF
}

newer_inputs() {   # build inputs changed since the last successful set-up
  find pyproject.toml CMakeLists.txt csrc custom_calls scripts/setup.sh -newer "$STAMP" -print \
    2>/dev/null
}

report() {
  "$VPY" -c "import dtenjax, dtenjax._src.ffi as f; i = f.build_info(); print('dtenjax', dtenjax.__version__, '| native:', {k: i[k] for k in ('built', 'cuda', 'verbs')})"
}

if [ -x "$VPY" ] && [ -f "$STAMP" ] && requirements_met; then
  changed=$(newer_inputs)
  if [ -z "$changed" ]; then
    report                      # everything in place: nothing to do
    exit 0
  fi
  if [ ! pyproject.toml -nt "$STAMP" ]; then
    echo "setup: build inputs changed ($(echo "$changed" | head -3 | tr '\n' ' ')...); rebuilding" \
      "the extension without the package index"
    "$VPY" -m pip install -q --no-build-isolation --no-deps -e .
    touch "$STAMP"
    report
    exit 0
  fi
fi

if [ ! -x "$VPY" ]; then
  "$PY" -m venv .venv
  "$VPY" -m pip install -q --upgrade pip >/dev/null
fi

# Headers for the verbs provider (libibverbs is dlopen'ed at run time, never required).
if [ ! -f /usr/include/infiniband/verbs.h ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev) \
    >/dev/null 2>&1 || echo "setup: could not install libibverbs-dev; the verbs provider will not be built"
fi

# Build requirements first, so the extension can be built without build isolation against the
# same jaxlib it will run with (the XLA FFI headers come from jaxlib).
# pip byte-compiles what it installs one file after another (about 10 s here); without it every
# process would import from source where PYTHONDONTWRITEBYTECODE is set, so the packages are
# compiled afterwards on every core (compileall, as pip does it; like pip, a file of a package
# that does not compile, e.g. a template, is not an error of the set-up).
"$VPY" -m pip install -q --no-compile "${BUILD_REQS[@]}"
"$VPY" -m pip install -q --no-compile --no-build-isolation -e ".[test]"
"$VPY" -m compileall -q -j 0 "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >/dev/null || true
touch "$STAMP"
report
