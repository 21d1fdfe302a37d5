#!/usr/bin/env bash
# Runs on a GPU machine (device tool, carry build-gpu): the GPU unit tests, then the NVLink
# all-reduce checked and timed beside NCCL (ARGS go to r2ccl-gpu-perf --bench). JUnit XML goes to
# $OUT when it is set.
# usage: bench/gpu/on-device.sh [ARGS...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi -L
rc=0
for t in "$root"/build-gpu/bin/gpu_*_test; do
  name=$(basename "$t")
  "$t" --gtest_output="xml:${OUT:-/tmp}/$name.xml" || rc=1
done
"$root/bench/gpu/allreduce.sh" -n 1 --check || rc=1
"$root/bench/gpu/allreduce.sh" --check || rc=1
"$root/bench/gpu/allreduce.sh" --bench "$@" || rc=1
python3 "$root/bench/gpu/torch_baseline.py" || rc=1
exit $rc
