#!/usr/bin/env bash
# Runs on a GPU machine (device tool; carry build-gpu/bin, build-gpu/lib/libr2ccl.so.0.2.0 and
# build-gpu/carry-lib) on its first RANKS GPUs (default: all): the GPU unit tests; r2ccl-gpu-perf --check on 1 GPU and on
# RANKS; the Python package's check on CUDA tensors under torch.cuda.graph; the fault cases
# (tests/gpu/faults.py); the GPU memory a communicator takes (bench/gpu/footprint.py, 2 or more
# GPUs); then the all-reduce
# timed beside NCCL (r2ccl-gpu-perf --bench, ARGS passed on), through the Python package beside
# the C++ figures of the same run, and PyTorch's NCCL and symmetric-memory baselines. Every
# output, and the GPU tests' JUnit XML, goes to $OUT when it is set.
# usage: bench/gpu/on-device.sh [-n RANKS] [--no-check] [--no-bench] [ARGS...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp}
n=$(nvidia-smi -L | grep -c '^GPU ')
do_check=1 do_bench=1
while [[ $# -gt 0 ]]; do
  case $1 in
    -n) n=$2; shift 2 ;;
    --no-check) do_check=0; shift ;;
    --no-bench) do_bench=0; shift ;;
    *) break ;;
  esac
done
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export R2CCL_LIBRARY=$root/build-gpu/lib/libr2ccl.so.0.2.0
export PYTHONPATH=$root/integrations/python:$root/bench/gpu${PYTHONPATH:+:$PYTHONPATH}
# The Python scripts see the first n GPUs; r2ccl-gpu-perf ranks take GPU (rank mod count).
export CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1)))
nvidia-smi -L
rc=0
step() {  # step NAME COMMAND...: runs it, its output also into $out/NAME.txt
  echo "=== $1"
  local name=$1
  shift
  "$@" 2>&1 | tee "$out/$name.txt"
  local s=${PIPESTATUS[0]}
  [[ $s -eq 0 ]] || { echo "=== $name: exit $s"; rc=1; }
}
if [[ $do_check -eq 1 ]]; then
  for t in "$root"/build-gpu/bin/gpu_*_test; do
    step "$(basename "$t")" "$t" --gtest_output="xml:$out/$(basename "$t").xml"
  done
  step check-1 "$root/bench/gpu/allreduce.sh" -n 1 --check
  step "check-$n" "$root/bench/gpu/allreduce.sh" -n "$n" --check
  step "python-check-$n" python3 "$root/bench/gpu/torch_r2ccl.py" -n "$n" --check
  step "faults-$n" python3 "$root/tests/gpu/faults.py" -n "$n"
  [[ $n -lt 2 ]] || step "footprint-$n" python3 "$root/bench/gpu/footprint.py" -n "$n"
fi
if [[ $do_bench -eq 1 ]]; then
  step "bench-$n" "$root/bench/gpu/allreduce.sh" -n "$n" --bench "$@"
  step "python-bench-$n" python3 "$root/bench/gpu/torch_r2ccl.py" -n "$n" --bench \
    --cxx "$out/bench-$n.txt"
  step "baseline-$n" python3 "$root/bench/gpu/torch_baseline.py"
fi
exit $rc
