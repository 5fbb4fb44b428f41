#!/usr/bin/env bash
# The whole GPU check in one go, for a GPU machine with jax (CUDA) already installed and no package
# registry: build the extension, run every gpu-marked test, then the GPU benchmarks, and print a
# summary table last. Logs and JSON go to $LOGS (default /tmp/dtenjax-gpu); when $OUT is set (the
# device tool's return folder) they are also packed into $OUT/gpu_check.tgz.
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
RET="${OUT:-}"
OUT="${LOGS:-/tmp/dtenjax-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 DTENJAX_TEST_PLATFORM=gpu
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
declare -a NAMES RCS SECS

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  NAMES+=("$name"); RCS+=("$rc"); SECS+=($(( $(date +%s) - t0 )))
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >>"$OUT/summary.txt"
  # keep what has been measured even if a later step runs past the caller's time limit
  if [ -n "$RET" ]; then tar czf "$RET/gpu_check.tgz" -C "$OUT" . ; fi
}

step build 420 $PY -m pip install -q --no-build-isolation --no-deps -e .
$PY -c "import dtenjax, jax; print(jax.__version__, jax.devices()); print(dtenjax.build_info())" \
  | tee "$OUT/info.log"
step tests 420 $PY -m pytest -q -m gpu -p no:cacheprovider tests --deselect tests/test_p2p.py
step p2p 300 bash scripts/gpu_p2p.sh "$OUT/p2p"
step compression_bench 240 $PY bench/compression_select.py --json "$OUT/compression_select.json"
step graphs_bench 240 $PY bench/cuda_graphs.py --json "$OUT/cuda_graphs.json"
step allreduce_bench 240 $PY bench/allreduce.py --json "$OUT/allreduce.json"
step resnet 300 $PY examples/resnet50_train.py --json "$OUT/resnet.json"
step demo 240 $PY -m dtenjax demo --no-progress
step topo 120 $PY -m dtenjax topo --probe

echo
echo "== gpu_check summary =="
printf '%-20s %-4s %s\n' step rc seconds
for i in "${!NAMES[@]}"; do
  printf '%-20s %-4s %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
done
if [ -n "$RET" ]; then tar czf "$RET/gpu_check.tgz" -C "$OUT" . ; fi
for rc in "${RCS[@]}"; do [ "$rc" = 0 ] || exit 1; done
