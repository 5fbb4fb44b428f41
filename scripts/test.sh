#!/usr/bin/env bash
# The whole test suite, set-up included: builds the environment if needed (scripts/setup.sh),
# then runs pytest on 8 simulated CPU devices. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
exec .venv/bin/python -m pytest "$@"
