#!/usr/bin/env bash
# Starts one r2ccl-gpu-perf rank per GPU of this machine (or -n RANKS), bootstrapped over
# loopback, and waits for all of them; exits 77 (skipped) where fewer GPUs are visible.
# With --share, more ranks than GPUs share them (r2ccl-gpu-perf --share-gpu: for --check), under a
# CUDA MPS daemon of its own so that their kernels run at once (without MPS they take turns, and a
# kernel spinning for a peer's data holds the GPU through its time slice).
# usage: bench/gpu/allreduce.sh [-n RANKS] [--bin DIR] [--share] r2ccl-gpu-perf ARGS...
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$root/build-gpu/bin
n=""
share=()
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    --share) share=(--share-gpu); shift ;;
    *) break ;;
  esac
done
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
n=${n:-$gpus}
if [[ ${gpus:-0} -lt 1 || ${n:-0} -lt 1 || ($n -gt $gpus && ${#share[@]} -eq 0) ]]; then
  echo "bench/gpu/allreduce.sh: needs ${n:-1} GPUs, this machine has ${gpus:-0}; skipped" >&2
  exit 77
fi
[[ -d $root/build-gpu/carry-lib ]] &&
  export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [[ ${#share[@]} -gt 0 && $n -gt $gpus ]] && command -v nvidia-cuda-mps-control >/dev/null; then
  CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) && CUDA_MPS_LOG_DIRECTORY=$(mktemp -d) || exit 1
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d || exit 1
  trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"' EXIT
fi
port=$(( 20000 + RANDOM % 20000 ))
pids=()
for ((r = 0; r < n; r++)); do
  R2CCL_RANK=$r R2CCL_NRANKS=$n R2CCL_BOOTSTRAP=127.0.0.1:$port \
    R2CCL_NICS=127.0.$((20 + r)).1 "$bin/r2ccl-gpu-perf" "${share[@]}" "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [[ $rc -ne 0 ]] || rc=$s; }
done
exit $rc
