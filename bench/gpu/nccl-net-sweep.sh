#!/usr/bin/env bash
# Runs on a GPU machine: the plugin's 64 MiB all-reduce bus bandwidth (bench/gpu/nccl_net.py bw,
# no fault) under each setting given as an argument (space-separated K=V words, "-" for none),
# on the testbed of netns.sh at RATE per NIC. Prints one line per setting.
# usage: bench/gpu/nccl-net-sweep.sh RATE SETTING...
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
rate=$1
shift
out=${OUT:-/tmp/nccl-net-sweep}
mkdir -p "$out"
export R2_NET_BUNDLE=$root/bundle/net
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
trap '"$root/bench/gpu/netns.sh" teardown >/dev/null 2>&1' EXIT
"$root/bench/gpu/netns.sh" up "$rate" >/dev/null || exit 2
i=0
for setting in "$@"; do
  i=$((i + 1))
  envs=()
  if [[ $setting != - ]]; then
    for kv in $setting; do envs+=(--env "$kv"); done
  fi
  transport=plugin
  [[ $setting != *SOCKET* ]] || transport=socket
  timeout -k 5 120 python3 bench/gpu/nccl_net.py run --transport "$transport" --gpus 2 \
    --name "sweep$i" --out "$out" --timeout 100 --mode bw --fault none "${envs[@]}" \
    > "$out/sweep$i.txt" 2>&1
  echo "[$setting] $(grep -h 'BW healthy' "$out/sweep$i.txt" | head -n 1) rc=$?"
done
