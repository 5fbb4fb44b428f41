#!/usr/bin/env bash
# Builds, tests and benchmarks the NVLink p2p all-reduce on a GPU machine in one run.
#   bash scripts/gpu_p2p.sh [OUT_DIR]     (OUT_DIR gets pytest's log, the bench JSON and table)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/dtenjax-gpu-p2p}}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

t0=$(date +%s)
$PY -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1
build_rc=$?
t1=$(date +%s)
$PY -c "from dtenjax._src import p2p, ffi; print('build', ffi.build_info()); print('p2p unavailable:', p2p.unavailable_reason())" 2>&1 | tee "$OUT/info.log"

DTENJAX_TEST_PLATFORM=gpu $PY -m pytest -q -m gpu tests/test_p2p.py -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest.log"
test_rc=${PIPESTATUS[0]}
t2=$(date +%s)
$PY bench/p2p_allreduce.py --json "$OUT/p2p_bench.json" ${P2P_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
t3=$(date +%s)

echo
echo "== gpu_p2p summary =="
printf '%-8s %-6s %s\n' step rc seconds
printf '%-8s %-6s %s\n' build "$build_rc" $((t1 - t0))
printf '%-8s %-6s %s   (%s)\n' tests "$test_rc" $((t2 - t1)) "$(tail -n1 "$OUT/pytest.log")"
printf '%-8s %-6s %s\n' bench "$bench_rc" $((t3 - t2))
[ "$build_rc" = 0 ] || tail -n 30 "$OUT/build.log"
exit $(( build_rc || test_rc || bench_rc ))
