#!/usr/bin/env bash
# Builds, tests and benchmarks the NVLink p2p all-reduce on whatever GPUs are present, in stages:
#   bash scripts/gpu_p2p.sh [STAGE ...]      stages: build tests bench bench-procs (default: all)
# Logs, JSON and a summary go to $LOGS (default /tmp/dtenjax-gpu-p2p); when $OUT is set (the
# device tool's return folder) they are packed into $OUT/gpu_p2p.tgz after every stage.
set -uo pipefail
cd "$(dirname "$0")/.."
RET="${OUT:-}"
LOGDIR="${LOGS:-/tmp/dtenjax-gpu-p2p}"
mkdir -p "$LOGDIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 DTENJAX_TEST_PLATFORM=gpu
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(build tests bench bench-procs)
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
SIZES="${P2P_SIZES:-8,512,8K,64K,256K,1M,4M,16M,64M,256M}"
ALGOS="${P2P_ALGOS:-psum,psum_oneshot,psum_nccl,one_shot,two_shot,auto,reproducible}"
rc_all=0

stage() {  # stage NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo "== $name: $*"
  timeout "$limit" "$@" >"$LOGDIR/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$LOGDIR/$name.log"
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$LOGDIR/summary.txt"
  [ "$rc" = 0 ] || rc_all=1
  if [ -n "$RET" ]; then tar czf "$RET/gpu_p2p.tgz" -C "$LOGDIR" . ; fi
}

for s in "${STAGES[@]}"; do
  case "$s" in
    build)
      stage build 420 $PY -m pip install -q --no-build-isolation --no-deps -e .
      { nvidia-smi topo -m; $PY -c "import jax, dtenjax; print(jax.__version__, jax.devices()); print(dtenjax.build_info())"; } \
        >"$LOGDIR/info.log" 2>&1; cat "$LOGDIR/info.log";;
    tests)
      DTENJAX_COLLECTIVE_TIMEOUT=20 stage tests 420 $PY -m pytest -q -m gpu -p no:cacheprovider \
        tests/test_p2p.py -x -rfEs ${P2P_PYTEST_ARGS:-};;
    bench)
      stage bench 300 $PY bench/allreduce.py --sizes "$SIZES" --algorithms "$ALGOS" --chain 16 \
        --iters 10 --progress --json "$LOGDIR/allreduce_1proc_f32.json";;
    bench-bf16)
      stage bench-bf16 300 $PY bench/allreduce.py --sizes "$SIZES" --algorithms "$ALGOS" --chain 16 \
        --iters 10 --dtype bfloat16 --json "$LOGDIR/allreduce_1proc_bf16.json";;
    bench-procs)
      stage bench-procs 300 $PY bench/allreduce.py --procs "$NGPU" --sizes "$SIZES" \
        --algorithms "$ALGOS" --chain 16 --iters 10 --json "$LOGDIR/allreduce_${NGPU}procs_f32.json";;
    *) echo "unknown stage $s"; exit 2;;
  esac
done
echo; echo "== gpu_p2p summary"; cat "$LOGDIR/summary.txt"
exit $rc_all
