#!/usr/bin/env bash
# Sets up the development environment of the README's commands from scratch on a fresh Debian 12
# or Ubuntu 24.04 machine with Python 3.11+: the system packages a bare image lacks (python3-venv,
# python3-dev, g++; installed with apt-get when run as root, otherwise named with the command to
# install them), a virtual environment in .venv with the dependencies and one extra (default
# `test`; scripts/demo.sh asks for `demo`), Debian's libibverbs-dev when we can install it (so the
# RDMA verbs provider compiles), and the native extension built into an editable install (kept
# in build/ for fast rebuilds). Each step prints one line with the seconds so far.
#   bash scripts/setup.sh [EXTRA]        EXTRA: test (default), demo, or any extra of pyproject
#   bash scripts/setup.sh --check-system  only say which system packages are missing (exit 1 if any)
# CUDA kernels are built when nvcc is on the PATH, for the GPU this machine has (CMakeLists.txt:
# DTENJAX_CUDA_ARCHS or CMAKE_CUDA_ARCHITECTURES override it; without a GPU,
# DTENJAX_CUDA_ARCHS_WITHOUT_GPU, which scripts/test.sh sets, replaces the default list and
# compiles the device code unoptimised, a compile check).
#
# Run again, it does only what is missing, and nothing (no network, no build) when everything is
# in place: the venv exists, every requirement of pyproject.toml (dependencies, the test extra,
# the build requirements) is installed in a satisfying version, dtenjax is installed editable from
# this checkout with its extension, and no build input (pyproject.toml, CMakeLists.txt, csrc/,
# custom_calls/, this script, scripts/cuda_archs.cmake) changed since the last successful set-up, and the extension was not
# built for a DTENJAX_CUDA_ARCHS_WITHOUT_GPU this run does not ask for (the stamp records it: a
# plain set-up after scripts/test.sh's smaller build builds the default list). Changed C++/CUDA
# alone is rebuilt without asking the package index.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VPY=.venv/bin/python
STAMP=.venv/.dtenjax-setup-done
EXTRA=test
CHECK_ONLY=0
case "${1:-}" in
  --check-system) CHECK_ONLY=1 ;;
  "") ;;
  -*) echo "setup: unknown option $1 (usage: bash scripts/setup.sh [EXTRA | --check-system])" >&2
      exit 2 ;;
  *) EXTRA=$1 ;;
esac
T0=$SECONDS
step() { echo "setup [$((SECONDS - T0)) s]: $*"; }

# The Debian/Ubuntu packages a bare image lacks for this set-up: venv with pip (Debian splits
# ensurepip into python3-venv), Python's headers (the extension compiles against them) and a C++
# compiler. CMake and Ninja come from pip.
missing_system_packages() {
  local missing=()
  "$PY" -c "import venv, ensurepip" >/dev/null 2>&1 || missing+=(python3-venv)
  "$PY" -c "import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" \
    >/dev/null 2>&1 || missing+=(python3-dev)
  command -v "${CXX:-c++}" >/dev/null 2>&1 || missing+=(g++)
  echo "${missing[@]}"
}

ensure_system_packages() {
  if ! command -v "$PY" >/dev/null 2>&1; then
    echo "setup: no $PY on the PATH; install Python 3.11 or newer (apt-get install python3)" >&2
    exit 1
  fi
  local missing
  missing=$(missing_system_packages)
  [ -z "$missing" ] && return 0
  if [ "$CHECK_ONLY" = 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing the system packages this machine lacks: $missing (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
    missing=$(missing_system_packages)
    [ -z "$missing" ] && return 0
  fi
  echo "setup: missing system packages: $missing; install them first: sudo apt-get install -y" \
    "$missing (Debian/Ubuntu; other systems: Python's venv with ensurepip, Python's headers and a C++17 compiler)" >&2
  exit 1
}

if [ "$CHECK_ONLY" = 1 ]; then
  ensure_system_packages
  echo "setup: the system has what the set-up needs (python3-venv, python3-dev, a C++ compiler)"
  exit 0
fi
BUILD_REQS=("scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2,<0.12" "jaxlib>=0.10.2,<0.12" cmake ninja)

# Exit status 0: every requirement is installed and dtenjax is this checkout's editable install.
requirements_met() {
  SETUP_EXTRA=$EXTRA "$VPY" - "${BUILD_REQS[@]}" <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util, os, sys
from packaging.requirements import Requirement
reqs = [Requirement(r) for r in sys.argv[1:]]
reqs += [Requirement(r) for r in md.requires("dtenjax") or []]
for r in reqs:
    if r.marker is not None and not r.marker.evaluate({"extra": os.environ["SETUP_EXTRA"]}):
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

# Byte-compiles this checkout's own Python (and the paths appended), at low priority on every
# core: dtenjax is installed editable, so its sources are not in purelib, and every fresh process
# the tests start imports it (up to 0.3 s of CPU each from source where PYTHONDONTWRITEBYTECODE
# is set); bench/, examples/ and the tests' helpers and workers likewise. Not the test modules
# (tests/test_*.py), which pytest compiles itself, rewriting asserts, nor the packages' own test
# suites (*/tests/: scikit-learn's, scipy's, numpy's, ...), which nothing here imports: a sixth
# of purelib's files. compileall skips what is up to date. (A command, not a function, so that
# the build's failure can kill the background run by its pid.)
BYTE_COMPILE=(nice -n 10 "$VPY" -m compileall -q -j 0 -x '/tests/|^tests/test_'
              dtenjax bench examples tests)

newer_inputs() {   # build inputs changed since the last successful set-up
  find pyproject.toml CMakeLists.txt csrc custom_calls scripts/setup.sh scripts/cuda_archs.cmake \
    -newer "$STAMP" -print \
    2>/dev/null
}

# The one-line report of what was built; with --stamp also writes the stamp of a successful
# set-up, recording the DTENJAX_CUDA_ARCHS_WITHOUT_GPU a CUDA build was asked for (whether or not
# this machine's GPUs overrode it: tests/test_setup_script.py checks the build against it).
report() {
  "$VPY" - "$STAMP" "$@" <<'EOF'
import os, sys
import dtenjax, dtenjax._src.ffi as f
i = f.build_info()
if "--stamp" in sys.argv:
  asked = os.environ.get("DTENJAX_CUDA_ARCHS_WITHOUT_GPU", "")
  with open(sys.argv[1], "w") as stamp:
    if asked and i["cuda"]:
      stamp.write(f"cuda_archs_without_gpu={asked}\n")
print("dtenjax", dtenjax.__version__, "| native:",
      {k: i[k] for k in ("built", "cuda", "cuda_archs", "verbs")})
EOF
}

if [ -x "$VPY" ] && [ -f "$STAMP" ] && requirements_met; then
  changed=$(newer_inputs)
  built_for=$(sed -n 's/^cuda_archs_without_gpu=//p' "$STAMP")
  if [ -n "$built_for" ] && [ "$built_for" != "${DTENJAX_CUDA_ARCHS_WITHOUT_GPU:-}" ]; then
    changed="the CUDA architectures (built for DTENJAX_CUDA_ARCHS_WITHOUT_GPU=$built_for)"
  fi
  if [ -z "$changed" ]; then
    report                      # everything in place: nothing to do
    exit 0
  fi
  if [ ! pyproject.toml -nt "$STAMP" ]; then
    echo "setup: build inputs changed ($(echo "$changed" | head -3 | tr '\n' ' ')...); rebuilding" \
      "the extension without the package index"
    "$VPY" -m pip install -q --no-build-isolation --no-deps -e .
    "${BYTE_COMPILE[@]}" >/dev/null 2>&1 || true
    report --stamp
    exit 0
  fi
fi

ensure_system_packages
if [ ! -x "$VPY" ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  "$VPY" -m pip install -q --upgrade pip >/dev/null
fi

# Headers for the verbs provider (libibverbs is dlopen'ed at run time, never required).
if [ ! -f /usr/include/infiniband/verbs.h ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  step "installing libibverbs-dev (headers of the RDMA verbs provider)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev) \
    >/dev/null 2>&1 || echo "setup: could not install libibverbs-dev; the verbs provider will not be built"
fi

# Build requirements and dtenjax's dependencies (with the extra's) first, in one pip run, so the
# extension can be built without build isolation against the same jaxlib it will run with (the
# XLA FFI headers come from jaxlib). pip byte-compiles what it installs one file after another, so
# it is told not to: the packages are compiled with compileall on every core instead (as pip does
# it; like pip, a file of a package that does not compile, e.g. a template, is not an error of the
# set-up), at low priority WHILE the extension builds -- the build leaves a core idle in its CMake
# configure, its link steps and its longest nvcc file -- and the set-up waits for both. Without
# the .pyc files every process would import from source where PYTHONDONTWRITEBYTECODE is set.
deps=$("$VPY" - "$EXTRA" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project.get("optional-dependencies", {})
if sys.argv[1] not in extras:
    sys.exit(f"setup: pyproject.toml has no extra {sys.argv[1]!r} (extras: {', '.join(extras)})")
print("\n".join(project["dependencies"] + extras[sys.argv[1]]))
EOF
)
mapfile -t DEPS <<<"$deps"
step "installing the build requirements and dtenjax[$EXTRA]'s ${#DEPS[@]} dependencies"
"$VPY" -m pip install -q --no-compile "${BUILD_REQS[@]}" "${DEPS[@]}"
# The CUDA architectures the build will compile, and why (scripts/cuda_archs.cmake, which
# CMakeLists.txt includes; the report at the end prints the list built).
cuda_request() {
  if command -v nvcc >/dev/null 2>&1; then
    echo "C++ and CUDA for $(.venv/bin/cmake -P scripts/cuda_archs.cmake 2>&1)"
  else
    echo "C++ only, no nvcc"
  fi
}
step "building the native extension (the longest step: $(cuda_request))" \
  "and byte-compiling the installed packages and this checkout beside it; build log: build/setup.log"
"${BYTE_COMPILE[@]}" "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  >/dev/null 2>&1 &
compiling=$!
mkdir -p build
"$VPY" -m pip install -v --no-compile --no-deps --no-build-isolation -e . >build/setup.log 2>&1 || {
  kill "$compiling" 2>/dev/null || true
  tail -40 build/setup.log >&2
  echo "setup: building dtenjax's native extension failed; the whole log: build/setup.log" >&2
  exit 1
}
wait "$compiling" || true
step "done"
report --stamp
