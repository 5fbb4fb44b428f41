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
# Without a GPU (CI) the CUDA kernels are built for sm_80 alone, SASS and PTX, with the device
# code unoptimised (a compile check of kernels this machine cannot run), unless the caller says
# otherwise: every .cu file still goes through nvcc's front end and ptxas, so a kernel that does
# not compile fails the set-up, for a fraction of the CPU of the set-up's default list
# (scripts/cuda_archs.cmake; docs/testing.md, "tenth round", "eleventh round"). A machine with a
# GPU builds for its GPUs, optimised.
export DTENJAX_CUDA_ARCHS_WITHOUT_GPU="${DTENJAX_CUDA_ARCHS_WITHOUT_GPU-80}"
bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=15 "$@"
