#!/usr/bin/env bash
# The whole test suite, set-up included: builds the environment if needed (scripts/setup.sh),
# then runs pytest on 8 simulated CPU devices in two pytest-xdist workers (the CI machine has two
# cores; most tests are single-threaded XLA compiles). Tests in one xdist_group run one after
# another in one worker (tests/conftest.py puts every test that starts several processes in
# "procs"). Every run ends with the 15 slowest tests (--durations=15), by wall clock and by CPU
# time (tests/conftest.py; DTENJAX_TEST_TIMES=PATH writes every test's times as JSON), so the
# budget stays visible (docs/testing.md: under 8 minutes on 2 cores, 60 s per test). Extra arguments go to pytest,
# after ours: `-n 0` runs everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
# Without a GPU (CI) the CUDA kernels are built for sm_80 as PTX only ("80-virtual"), with the
# device code unoptimised (a compile check of kernels this machine cannot run), unless the caller
# says otherwise: every .cu file still goes through nvcc's front end and NVVM in the set-up, and
# ptxas compiles the PTX it kept to sm_80 beside the tests (scripts/ptxas_check.sh, at nice 19:
# the tests leave a core idle while they wait for processes and timeouts), so a kernel that does
# not compile fails the set-up or, after the tests, this command, printing ptxas's log
# (scripts/cuda_archs.cmake; docs/testing.md, "tenth round" to "twelfth round"). A machine with a
# GPU builds for its GPUs, optimised, and keeps no PTX to check.
export DTENJAX_CUDA_ARCHS_WITHOUT_GPU="${DTENJAX_CUDA_ARCHS_WITHOUT_GPU-80-virtual}"
bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
tests=(.venv/bin/python -m pytest -n 2 --dist loadgroup --durations=15 "$@")
ptx_dir=$(.venv/bin/python -c 'import sys; print("build/cp%d%d-" % sys.version_info[:2])')
ptx_dir=$(ls -d "$ptx_dir"*/ptx 2>/dev/null | head -1 || true)
[ -n "$ptx_dir" ] || exec "${tests[@]}"
# PTX that passed once is not checked again (ptx/checked: the digest of what passed), so that a
# narrow run (`bash scripts/test.sh -n 0 tests/test_api.py`) does not wait for ptxas each time.
digest=$(cat "$ptx_dir"/manifest "$ptx_dir"/*.ptx 2>/dev/null | sha256sum | cut -d' ' -f1)
if [ "$(cat "$ptx_dir/checked" 2>/dev/null || true)" = "$digest" ]; then
  echo "test: ptxas passed this build's PTX in an earlier run ($ptx_dir/checked)"
  exec "${tests[@]}"
fi
# A copy, which a test that reconfigures the build directory (tests/test_wheel.py) cannot change.
check=$(mktemp -d)
checking=
trap 'kill "$checking" 2>/dev/null || true; rm -rf "$check"' EXIT
cp "$ptx_dir"/manifest "$ptx_dir"/*.ptx "$check"/ 2>/dev/null || true
nice -n 19 bash scripts/ptxas_check.sh "$check" >"$check/log" 2>&1 &
checking=$!
status=0
"${tests[@]}" || status=$?
if wait "$checking"; then
  cat "$check/log"
  echo "$digest" >"$ptx_dir/checked"
else
  cat "$check/log" >&2
  echo "test: ptxas refused the kernels' PTX (above; $ptx_dir, kept by the set-up's build)" >&2
  [ "$status" != 0 ] || status=1
fi
checking=
exit "$status"
