#!/usr/bin/env bash
# Starts one r2ccl-gpu-perf rank per GPU of this machine (or -n RANKS), bootstrapped over
# loopback, and waits for all of them; exits 77 (skipped) where fewer GPUs are visible.
# usage: bench/gpu/allreduce.sh [-n RANKS] [--bin DIR] r2ccl-gpu-perf ARGS...
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$root/build-gpu/bin
n=""
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    --bin) bin=$2; shift 2 ;;
    *) break ;;
  esac
done
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
n=${n:-$gpus}
if [[ ${gpus:-0} -lt 1 || ${n:-0} -lt 1 || $n -gt $gpus ]]; then
  echo "bench/gpu/allreduce.sh: needs ${n:-1} GPUs, this machine has ${gpus:-0}; skipped" >&2
  exit 77
fi
[[ -d $root/build-gpu/carry-lib ]] &&
  export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
port=$(( 20000 + RANDOM % 20000 ))
pids=()
for ((r = 0; r < n; r++)); do
  R2CCL_RANK=$r R2CCL_NRANKS=$n R2CCL_BOOTSTRAP=127.0.0.1:$port \
    R2CCL_NICS=127.0.$((20 + r)).1 "$bin/r2ccl-gpu-perf" "$@" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [[ $rc -ne 0 ]] || rc=$s; }
done
exit $rc
