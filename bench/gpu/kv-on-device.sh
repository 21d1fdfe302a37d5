#!/usr/bin/env bash
# Runs on a GPU machine (device tool), as root, from the repository root: KV-cache transfers
# between GPU pools on two "nodes" (network namespaces r2n0 and r2n1 joined by four veth NICs
# shaped to RATE each: bench/gpu/netns.sh), prefill rank 0 on GPU 0 in r2n0, decode rank 1 on
# GPU 1 in r2n1, every block checksummed through the GPU and verified on arrival
# (r2ccl-kvbench). First the engine's GPU unit test (kvxfer_device_memory_test), then in one
# call:
#   host    pools in host memory, four rails (the same workload, for comparison)
#   cuda    pools in GPU memory, four rails
#   down    pools in GPU memory, FAULT_NIC of r2n0 taken down at 40% of the cuda run's duration
# Carry build-gpu/bin/r2ccl-kvbench, build-gpu/bin/kvxfer_device_memory_test, build-gpu/carry-lib
# and bundle/net (bench/gpu/net-bundle.sh). Writes $OUT/summary.md, $OUT/*.json and each rank's
# output under $OUT/logs/; prints the table. Exit 0 when every run ended with every request DONE
# and every block verified.
#
# usage: bench/gpu/kv-on-device.sh [RATE (default 2gbit)]
#   env: MODEL (llama3-8b), REQUESTS (32), MIN_TOKENS (512), MAX_TOKENS (2048), CONCURRENCY (4),
#        FAULT_NIC (eth1), RANK_S (150: each rank's time limit)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
rate=${1:-2gbit}
out=${OUT:-/tmp/kv-out}
fault_nic=${FAULT_NIC:-eth1}
rank_s=${RANK_S:-150}
kvbench=$root/build-gpu/bin/r2ccl-kvbench
unit=$root/build-gpu/bin/kvxfer_device_memory_test
args=(--model "${MODEL:-llama3-8b}" --requests "${REQUESTS:-32}" --min-tokens "${MIN_TOKENS:-512}"
  --max-tokens "${MAX_TOKENS:-2048}" --concurrency "${CONCURRENCY:-4}" --pool-limit 24)
export R2_NET_BUNDLE=$root/bundle/net
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
netns=$root/bench/gpu/netns.sh
mkdir -p "$out/logs"
[[ -x $kvbench ]] || { echo "kv-on-device.sh: no $kvbench (bench/gpu/build.sh r2ccl-kvbench)"; exit 2; }
{
  date -u
  nvidia-smi -L
  nproc
} > "$out/testbed.txt" 2>&1
cat "$out/testbed.txt"

status=0
if [[ -x $unit ]]; then
  echo "== kvxfer_device_memory_test"
  timeout 120 "$unit" > "$out/logs/unit.txt" 2>&1 || status=1
  tail -n 4 "$out/logs/unit.txt"
fi

"$netns" up "$rate" > "$out/logs/netns.txt" 2>&1 || { cat "$out/logs/netns.txt"; exit 2; }
"$netns" check >> "$out/logs/netns.txt" 2>&1 || { echo "testbed check failed"; cat "$out/logs/netns.txt"; exit 2; }
trap '"$netns" teardown >/dev/null 2>&1' EXIT

token=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
# run TAG PORT [KVBENCH ARGS...]: rank 0 in r2n0 (JSON to $out/TAG.json), rank 1 in r2n1.
run() {
  local tag=$1 port=$2
  shift 2
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=198.19.0.1:$port" R2CCL_BOOTSTRAP_TIMEOUT=30s
    R2CCL_TIMEOUT=30s R2CCL_LOG=info R2CCL_NICS=eth0,eth1,eth2,eth3 "R2CCL_BOOTSTRAP_TOKEN=$token")
  "$netns" restore > /dev/null 2>&1
  timeout "$rank_s" "$netns" exec r2n1 env R2CCL_RANK=1 "${env[@]}" "$kvbench" "${args[@]}" "$@" \
    > "$out/logs/$tag.1.txt" 2>&1 &
  local p1=$!
  timeout "$rank_s" "$netns" exec r2n0 env R2CCL_RANK=0 "${env[@]}" "$kvbench" "${args[@]}" "$@" \
    --json "$out/$tag.json" > "$out/logs/$tag.0.txt" 2>&1
  local rc0=$? rc1=0
  wait "$p1" || rc1=$?
  echo "== $tag: rank 0 exit $rc0, rank 1 exit $rc1"
  grep -v '^r2ccl\[' "$out/logs/$tag.0.txt" | tail -n 6
  ((rc0 == 0 && rc1 == 0)) || status=1
}

field() {
  python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null
}

run host 29611 --memory host
run cuda 29612 --memory cuda
cuda_s=$(field "$out/cuda.json" 'j["seconds"]')
fault_at=$(python3 -c "print(round(0.4 * float('${cuda_s:-10}'), 1))")
run down 29613 --memory cuda --fault "$fault_at:$netns nic-down r2n0 $fault_nic"

# The rails' summed link rate, in GB/s, from RATE (e.g. 2gbit: 4 x 0.25).
link=$(python3 -c "
import re; m = re.fullmatch(r'([0-9.]+)([kmg]?)bit', '$rate')
print(4 * float(m.group(1)) * {'k': 1e3, 'm': 1e6, 'g': 1e9, '': 1}[m.group(2)] / 8e9)")
{
  echo "r2ccl-kvbench ${args[*]}: 2 nodes (network namespaces) x 4 veth NICs at $rate each" \
    "(summed link rate $link GB/s), rank 0 on GPU 0, rank 1 on GPU 1"
  echo
  echo "| case | pools | goodput GB/s | of the summed link rate | p50 / p99 ms | DONE / FAILED / preserved | verified / requests |"
  echo "|---|---|---:|---:|---:|---:|---:|"
  for t in host:"four rails" cuda:"four rails" down:"$fault_nic down at ${fault_at} s"; do
    tag=${t%%:*} f=$out/${t%%:*}.json
    if [[ ! -s $f ]]; then
      echo "| ${t#*:} | - | - | - | - | - | - |"
      continue
    fi
    python3 - "$f" "${t#*:}" "$link" <<'EOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"| {sys.argv[2]} | {j['memory']} | {j['goodput_gbps']:.3f} | "
      f"{100 * j['goodput_gbps'] / float(sys.argv[3]):.1f}% | "
      f"{j['latency_ms']['p50']:.0f} / {j['latency_ms']['p99']:.0f} | "
      f"{j['done']} / {j['failed']} / {j['preserved']} | {j['receiver_verified']} / {j['requests']} |")
EOF
  done
} | tee "$out/summary.md"
grep -h 'is down\|fenced' "$out/logs/down.0.txt" | head -n 3
exit "$status"
