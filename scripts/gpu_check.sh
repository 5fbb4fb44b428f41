#!/usr/bin/env bash
# The whole GPU check in one go, on whatever GPUs are present, for a GPU machine with jax (CUDA)
# already installed and no package registry: build the extension, run every gpu-marked test
# (the p2p kernels with simulated ranks, the public all_reduce on every GPU in one process and
# with one process per GPU over CUDA IPC, CUDA graphs, reproducible steps, compression kernels),
# the all-reduce benchmark in both deployments and both dtypes and the cost-model check against
# it (only with >= 2 GPUs: a collective over one rank measures nothing), the demo and the
# topology probe, and print a summary table last, skipped steps with the reason. Logs and JSON go
# to $LOGS (default /tmp/dtenjax-gpu); when $OUT is set (the device tool's return folder) they
# are also packed into $OUT/gpu_check.tgz after every step.
#   bash scripts/gpu_check.sh [PART ...]   parts: build tests bench topo graphs repro
#     (default: build tests bench topo; graphs = bench/cuda_graphs.py, repro =
#     bench/reproducible_step.py --device; GPU_CHECK_QUICK=1 passes --quick to both;
#     GPU_CHECK_EXTRA=1 adds the older feature benchmarks)
set -uo pipefail
cd "$(dirname "$0")/.."
RET="${OUT:-}"
OUT="${LOGS:-/tmp/dtenjax-gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 DTENJAX_TEST_PLATFORM=gpu
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
SIZES="${GPU_CHECK_SIZES:-8,512,8K,64K,256K,1M,4M,16M,64M,256M}"
QUICK=""; [ "${GPU_CHECK_QUICK:-0}" = 1 ] && QUICK="--quick"
declare -a NAMES RCS SECS SKIPPED

pack() { if [ -n "$RET" ]; then tar czf "$RET/gpu_check.tgz" -C "$OUT" . ; fi; }

step() {  # step NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.log"
  NAMES+=("$name"); RCS+=("$rc"); SECS+=($(( $(date +%s) - t0 )))
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" >>"$OUT/summary.txt"
  pack   # keep what has been measured even if a later step runs past the caller's time limit
}

skip() {  # skip NAME REASON
  echo "== $1: skipped ($2)"
  SKIPPED+=("$1: $2")
  echo "$1 skipped: $2" >>"$OUT/summary.txt"
}

bench() {  # bench NAME ARGS...: the all-reduce benchmark, JSON next to the log
  local name=$1; shift
  step "$name" 300 $PY bench/allreduce.py --sizes "$SIZES" --chain 32 --iters 10 \
    --json "$OUT/$name.json" "$@"
}

PARTS=" ${*:-build tests bench topo} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
ONE_RANK="$NGPU GPU(s): a collective needs >= 2 ranks"

if want build; then
  # An editable install also builds the test-only extension dtenjax._ffi_testing (pyproject.toml).
  step build 420 $PY -m pip install -q --no-build-isolation --no-deps -e .
  { nvidia-smi topo -m; $PY -c "import dtenjax, jax; print(jax.__version__, jax.devices()); print(dtenjax.build_info()); import dtenjax._ffi_testing as t; print('test extension (editable builds):', t.registrations())"; } \
    2>&1 | tee "$OUT/info.log"
fi
want tests && step tests 480 $PY -m pytest -q -m gpu -p no:cacheprovider -rfEs tests
if want bench; then
  if [ "$NGPU" -ge 2 ]; then
    bench allreduce_1proc_f32
    bench allreduce_1proc_bf16 --dtype bfloat16 --algorithms psum,psum_oneshot,one_shot,two_shot,auto,reproducible
    bench allreduce_procs_f32 --procs "$NGPU" --algorithms psum,one_shot,two_shot,auto,reproducible
    bench allreduce_procs_bf16 --procs "$NGPU" --dtype bfloat16 --algorithms psum,one_shot,two_shot,auto,reproducible
  else
    skip allreduce_benchmarks "$ONE_RANK"
  fi
fi
if want topo; then
  step topo 180 $PY -m dtenjax topo --probe --save "$OUT/topology.json"
  if [ "$NGPU" -ge 2 ]; then
    for j in "$OUT"/allreduce_*.json; do
      [ -f "$j" ] && step "costmodel_$(basename "$j" .json)" 60 \
        $PY bench/costmodel_check.py "$j" --topology "$OUT/topology.json"
    done
  else
    skip costmodel_check "$ONE_RANK (it compares predictions with the all-reduce benchmark)"
  fi
  step demo 240 $PY -m dtenjax demo --no-progress
fi
# JSON straight into the return folder: it survives a caller's time limit mid-step
want graphs && step graphs 560 $PY bench/cuda_graphs.py --out "${RET:-$OUT}" $QUICK
want repro && step repro 560 $PY bench/reproducible_step.py --device --out "${RET:-$OUT}" $QUICK
if [ "${GPU_CHECK_EXTRA:-0}" = 1 ]; then
  step compression_bench 240 $PY bench/compression_select.py --json "$OUT/compression_select.json"
  step resnet 300 $PY examples/resnet50_train.py --json "$OUT/resnet.json"
fi

echo
echo "== gpu_check summary ($NGPU GPUs)"
printf '%-24s %-4s %s\n' step rc seconds
for i in "${!NAMES[@]}"; do
  printf '%-24s %-4s %s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"
done
for s in "${SKIPPED[@]+"${SKIPPED[@]}"}"; do echo "skipped  $s"; done
pack
for rc in "${RCS[@]+"${RCS[@]}"}"; do [ "$rc" = 0 ] || exit 1; done
