#!/usr/bin/env bash
# Sets up a development environment from scratch on a fresh Debian machine with Python 3.11:
# a virtual environment in .venv with the pinned-by-resolution dependencies, Debian's
# libibverbs-dev when we can install it (so the RDMA verbs provider compiles), and the native
# extension built into the editable install. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# Headers for the verbs provider (libibverbs is dlopen'ed at run time, never required).
if [ ! -f /usr/include/infiniband/verbs.h ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs-dev) \
    >/dev/null 2>&1 || echo "setup: could not install libibverbs-dev; the verbs provider will not be built"
fi

$VPY -m pip install -q --upgrade pip >/dev/null
# Build requirements first, so the extension can be built without build isolation against the
# same jaxlib it will run with (the XLA FFI headers come from jaxlib).
$VPY -m pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" "jax>=0.10.2" "jaxlib>=0.10.2" cmake ninja
$VPY -m pip install -q --no-build-isolation -e ".[test]"
$VPY -c "import dtenjax, dtenjax._src.ffi as f; i = f.build_info(); print('dtenjax', dtenjax.__version__, '| native:', {k: i[k] for k in ('built', 'cuda', 'verbs')})"
