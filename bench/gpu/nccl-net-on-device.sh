#!/usr/bin/env bash
# Runs on a GPU machine (device tool), as root, from the repository root: r2ccl's NCCL net plugin
# beside NCCL's own socket transport, between two network namespaces joined by four veth NICs
# shaped to RATE each (bench/gpu/netns.sh), one process per GPU (bench/gpu/nccl_net.py). Carry
# build-gpu/lib/libnccl-net-r2ccl.so, build-gpu/carry-lib (the plugin's shared libraries, put on
# LD_LIBRARY_PATH) and bundle/net (Debian's ip, tc, nft and their libraries, from
# bench/gpu/net-bundle.sh; netns.sh uses them, with their libraries for those tools only, when
# the machine has none).
#
# In order, each bounded (a case's own timeout, and a budget for all: a case that would not fit
# in what is left of BUDGET_S is skipped and said so):
#   plugin: correct (eager and CUDA graphs), bw (healthy, then FAULT_NIC down), loop with
#           FAULT_NIC down 5 s in, loop with FAULT_NIC black-holed 5 s in, loop with 5 flaps of it
#   r2ccl:  the same with r2ccl's own communicator on the CUDA tensors (device memory across
#           nodes over its rails; correct at R2_SIZES, graphs at R2_GRAPH_SIZES, every
#           collective in bf16, fp16 and fp32 unless R2_EVERY_DTYPE=0)
#   socket: bw (healthy, then FAULT_NIC down), the three loops
# The plugin: NCCL_NET_PLUGIN=<the .so>, R2CCL_NICS=eth0,eth1,eth2,eth3, NCCL's bootstrap on mgmt
# (NCCL_SOCKET_IFNAME==mgmt). NCCL's socket transport: NCCL_NET=Socket,
# NCCL_SOCKET_IFNAME==eth0,eth1,eth2,eth3 (its bootstrap then runs on eth0: FAULT_NIC defaults to
# eth1 so that the fault hits the data path only). Extra NCCL_* variables in the environment reach
# every rank (e.g. NCCL_NSOCKS_PERTHREAD, NCCL_SOCKET_NTHREADS for the socket transport).
# Writes $OUT/summary.md, $OUT/summary.json, $OUT/cases/*.json, $OUT/logs/ (each rank's output
# and NCCL log), $OUT/testbed.txt; prints a table at the end. Exit 0 when every case that ran for
# the plugin and r2ccl passed (the socket transport's stalls are the expected baseline,
# reported, not failed).
#
# usage: bench/gpu/nccl-net-on-device.sh [GPUS (2|4, default 2)] [RATE (default 2gbit)]
#   env: FAULT_NIC (eth1), LOOP_S (25), STALL_S (15), BUDGET_S (480), HARD_S (570),
#        ONLY (plugin|r2ccl|socket|all), PYTHON (python3), BW_COLLS (the bw cases:
#        collectives, comma-separated: all_reduce (default), all_gather, reduce_scatter),
#        BW_FAULT (down; none measures the bw cases healthy only), LOOPS (1; 0 leaves the
#        fault loops out), CORRECT (1; 0 leaves the correct cases out),
#        PLUGIN (build-gpu/lib/libnccl-net-r2ccl.so), PLUGIN_NET_NAME (NCCL_NET for the plugin;
#        default unset: NCCL takes the plugin's network first), EXTRA_ARGS (words added to
#        every nccl_net.py run), R2_TEST_TRANSPORT=gloo (every case on CPUs over gloo: tests
#        this script where there is no GPU)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 2
gpus=${1:-2}
rate=${2:-2gbit}
out=${OUT:-/tmp/nccl-net-out}
fault_nic=${FAULT_NIC:-eth1}
loop_s=${LOOP_S:-25}
stall_s=${STALL_S:-15}
budget_s=${BUDGET_S:-480}  # no case starts that would end past this, by its usual length
hard_s=${HARD_S:-570}      # and none runs past this (the device tool ends a call at 600 s)
only=${ONLY:-all}
plugin=${PLUGIN:-$root/build-gpu/lib/libnccl-net-r2ccl.so}
py=${PYTHON:-python3}
t0=$SECONDS
mkdir -p "$out"
export R2_NET_BUNDLE=$root/bundle/net R2_PYTHON=$py
export LD_LIBRARY_PATH=$root/build-gpu/carry-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# r2ccl's own communicator (transport r2ccl): the Python package over build-gpu's libr2ccl.
export R2CCL_LIBRARY=${R2CCL_LIBRARY:-$root/build-gpu/lib/libr2ccl.so.0.2.0}
export PYTHONPATH=$root/integrations/python${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
netns=$root/bench/gpu/netns.sh
drv=$root/bench/gpu/nccl_net.py

[[ $gpus == 2 || $gpus == 4 ]] || { echo "GPUS must be 2 or 4"; exit 2; }
have=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
{
  date -u
  nvidia-smi -L
  "$py" -c 'import torch; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version())'
  echo "plugin: $plugin"
  ls -la "$plugin" 2>&1
  ldd "$plugin" 2>&1
} > "$out/testbed.txt" 2>&1
cat "$out/testbed.txt"
test_transport=${R2_TEST_TRANSPORT:-}  # gloo: every case on CPUs (a test of this script only)
if [[ -z $test_transport ]] && ((have < gpus)); then
  echo "nccl-net-on-device.sh: $gpus GPUs asked, $have here"
  exit 2
fi
run_plugin=1 plugin_rc=0
if [[ ! -f $plugin && -z $test_transport ]]; then
  echo "nccl-net-on-device.sh: no plugin at $plugin: the plugin's cases are skipped"
  run_plugin=0
  plugin_rc=2
elif ldd "$plugin" | grep -q 'not found'; then
  echo "nccl-net-on-device.sh: the plugin lacks libraries:"
  ldd "$plugin" | grep 'not found'
fi

trap '"$netns" teardown >/dev/null 2>&1' EXIT
"$netns" up "$rate" || { echo "nccl-net-on-device.sh: the testbed failed"; exit 2; }
"$netns" check || { echo "nccl-net-on-device.sh: the testbed does not connect"; exit 2; }
"$netns" show >> "$out/testbed.txt" 2>&1

skipped=()
case_() {  # case_ TRANSPORT NAME EXPECTED_S LIMIT_S ARGS...
  local transport=$1 name=$2 expect=$3 limit=$4
  shift 4
  local used=$((SECONDS - t0))
  if ((used + expect > budget_s)); then
    echo "=== $name: skipped ($used s used, about $expect s more would pass the $budget_s s budget)"
    skipped+=("$name")
    return
  fi
  ((limit <= hard_s - used - 20)) || limit=$((hard_s - used - 20))
  echo "=== $name ($transport, $gpus GPUs, $rate; ${used} s so far)"
  local extra=()
  [[ $transport != plugin || -z ${PLUGIN_NET_NAME:-} ]] || extra=(--nccl-net "$PLUGIN_NET_NAME")
  # shellcheck disable=SC2086  # EXTRA_ARGS: words for every case
  timeout -k 5 $((limit + 15)) "$py" "$drv" run --transport "${test_transport:-$transport}" \
    --gpus "$gpus" ${EXTRA_ARGS:-} \
    --name "$name" --out "$out" --plugin "$plugin" --stall "$stall_s" --timeout "$limit" \
    --fault-nic "$fault_nic" --python "$py" "${extra[@]}" "$@"
  local s=$?
  [[ $transport == socket || $s -eq 0 ]] || plugin_rc=1
  # NCCL logs of a failing plugin may be long: keep 1 MB of each end.
  local f
  for f in "$out"/logs/"$name".rank*; do
    if [[ -f $f && $(stat -c %s "$f") -gt 2000000 ]]; then
      { head -c 1000000 "$f"; printf '\n[... cut ...]\n'; tail -c 1000000 "$f"; } > "$f.cut"
      mv "$f.cut" "$f"
    fi
  done
}

loop_limit=$((loop_s + stall_s + 45))
loop_expect=$((loop_s + 25))
for transport in plugin r2ccl socket; do
  [[ $only == all || $only == "$transport" ]] || continue
  [[ $transport != plugin || $run_plugin -eq 1 ]] || continue
  p=$transport
  if [[ ${CORRECT:-1} == 1 ]]; then
    [[ $transport != plugin ]] || case_ plugin plugin-correct 60 150 --mode correct
    every=()
    [[ ${R2_EVERY_DTYPE:-1} != 1 ]] || every=(--every-dtype)
    [[ $transport != r2ccl ]] || case_ r2ccl r2ccl-correct 120 240 --mode correct \
      --sizes "${R2_SIZES:-8K,1M,16M,256M}" --graph-sizes "${R2_GRAPH_SIZES:-8K,4M,64M}" \
      "${every[@]}"
  fi
  IFS=, read -ra colls <<< "${BW_COLLS:-all_reduce}"
  for coll in "${colls[@]}"; do
    suffix=
    [[ $coll == all_reduce ]] || suffix=-${coll//_/-}
    case_ "$transport" "$p-bw$suffix" 40 90 --mode bw --fault "${BW_FAULT:-down}" --coll "$coll"
  done
  [[ ${LOOPS:-1} == 1 ]] || continue
  case_ "$transport" "$p-loop-down" "$loop_expect" "$loop_limit" --mode loop \
    --duration "$loop_s" --fault down
  case_ "$transport" "$p-loop-blackhole" "$loop_expect" "$loop_limit" --mode loop \
    --duration "$loop_s" --fault blackhole
  case_ "$transport" "$p-loop-flap" "$loop_expect" "$loop_limit" --mode loop \
    --duration "$loop_s" --fault flap --flaps 5
done

echo "=== summary ($((SECONDS - t0)) s; $gpus GPUs, $rate per NIC, fault on r2n0 $fault_nic)"
"$py" "$drv" summary "$out"
if ((${#skipped[@]})); then
  echo "skipped (budget): ${skipped[*]}" | tee -a "$out/summary.md"
fi
exit $plugin_rc
