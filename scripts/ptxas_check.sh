#!/usr/bin/env bash
# The second half of the test command's CUDA compile check: ptxas over the PTX that a
# compile-check build kept (CMakeLists.txt, scripts/cuda_archs.cmake case 3). scripts/test.sh
# builds the kernels as PTX only ("80-virtual": nvcc's front end and NVVM at -O0) and runs this
# beside the tests, at low priority, so that the set-up does not wait for ptxas: every kernel
# still goes through ptxas for the PTX's own target (sm_80), at -O0 as the build did before (and
# --Ofast-compile max where ptxas has it, below), and a kernel ptxas refuses fails the test
# command with this script's output.
#   bash scripts/ptxas_check.sh DIR     DIR: a copy of the build's ptx/ (its manifest and *.ptx)
# The manifest's lines: `ptxas=PATH` (the ptxas beside the build's nvcc) and `unit=NAME` per .cu
# file, whose PTX is DIR/NAME.ptx. Exit status 0 only when every unit's PTX is there and compiles.
set -euo pipefail
dir=${1:?usage: bash scripts/ptxas_check.sh DIR}
manifest="$dir/manifest"
[ -f "$manifest" ] || { echo "ptxas check: no manifest in $dir" >&2; exit 1; }
ptxas=$(sed -n 's/^ptxas=//p' "$manifest")
mapfile -t units < <(sed -n 's/^unit=//p' "$manifest")
[ -n "$ptxas" ] && [ "${#units[@]}" -gt 0 ] || {
  echo "ptxas check: $manifest names no ptxas or no unit" >&2; exit 1; }
# ptxas 12.8 and later also take --Ofast-compile max (-Ofc), which leaves out optimisations that
# -O0 still runs: every kernel is still compiled to sm_80, for about a quarter less CPU (the whole
# check 10.4 -> 7.7 s; docs/testing.md, fifteenth round). An older ptxas does without.
fast=()
case "$("$ptxas" --help 2>/dev/null || true)" in
  *--Ofast-compile*) fast=(-Ofc max) ;;
esac
# Every unit at once (each a single-threaded ptxas): at nice 19 beside the tests they take the
# cores the tests leave idle, both of them when both are.
failed=0
pids=()
for unit in "${units[@]}"; do
  ptx="$dir/$unit.ptx"
  if [ ! -f "$ptx" ]; then
    echo "ptxas check: $unit.ptx is missing (touch its .cu file and run the set-up again)" >&2
    failed=1
    continue
  fi
  target=$(sed -n 's/^\.target[[:space:]]\{1,\}\(sm_[0-9a-z]*\).*/\1/p;T;q' "$ptx")
  [ -n "$target" ] || { echo "ptxas check: $unit.ptx names no .target" >&2; failed=1; continue; }
  (
    T0=$SECONDS
    if "$ptxas" -arch="$target" -m64 -O0 "$ptx" -o "$dir/$unit.cubin" "${fast[@]}" \
        2>"$dir/$unit.log"; then
      echo "ptxas check: $unit ($target) compiled in $((SECONDS - T0)) s"
    else
      cat "$dir/$unit.log" >&2
      echo "ptxas check: $unit ($target) does not compile (ptxas above)" >&2
      exit 1
    fi
  ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
exit "$failed"
