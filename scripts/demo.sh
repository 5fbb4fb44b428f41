#!/usr/bin/env bash
# The main job, set-up included: builds the environment if needed (scripts/setup.sh demo), then runs
# `python -m dtenjax demo` (8 simulated CPU devices without an accelerator). Extra args go to demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo     # only what the demo needs: the demo extra, not the test extra
exec .venv/bin/python -m dtenjax demo "$@"
